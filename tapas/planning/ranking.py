"""Ranking metrics of the cost model against measured step times (the paper's ranking table).

In:  for one model, the measured step times of its candidate plans (median and spread of
     repeated timings) and the cost model's predicted times of the same plans.
Out: the rank the model gives the measured-best plan (:func:`best_rank`) and, over models,
     Acc@1, Acc@k and MRR (:func:`table_metrics`); how much slower than the measured best
     the plan the model picks runs (:func:`pick_regret`); how well the whole predicted
     order agrees with the measured one (:func:`kendall_tau`).

How ties are scored (``docs/paper.md`` summarizes this):

- Measured ties count *for* the model: every plan whose measured median is within the
  noise of the fastest one (:func:`measured_best`: within ``max(rel_tol * fastest, spread
  of the two plans)``) is a measured-best plan, and the model is credited with the best
  predicted rank among them.
- Predicted ties with a slower plan count *against* the model: plans whose predicted
  times are equal (to a relative 1e-9) are ordered worst-first for the measured-best plan,
  i.e. its predicted rank is 1 + the number of plans *outside the measured-best set*
  predicted no slower than it. A tie among measured-best plans costs nothing: whichever
  of them the model's pick is, it runs as fast as the best within the noise (two plans
  that differ only in whether an integer input is fed split or whole are priced the same,
  and rightly so). ``strict_ties=True``: every other plan predicted no slower counts,
  measured-best or not (a model adding arbitrary differences between equal plans scores
  better under it).

This module imports no TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["measured_best", "predicted_rank", "best_rank", "table_metrics", "pick_regret",
           "kendall_tau"]

_PREDICTED_TIE = 1e-9


def _check(name: str, values: Sequence[float]) -> None:
    if not values:
        raise ValueError(f"{name} is empty: give one value per candidate plan")
    for i, v in enumerate(values):
        if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise ValueError(f"{name}[{i}]={v!r}: must be a number >= 0 (a time in seconds "
                             "or cost units)")


def measured_best(medians: Sequence[float], spreads: Sequence[float] | None = None,
                  rel_tol: float = 0.05) -> list[int]:
    """Indices of the plans tied with the fastest within the measured noise.

    ``medians[i]``: plan i's median step time; ``spreads[i]``: its spread (e.g. the
    interquartile range, same units; default 0). Plan i ties with the fastest f when
    ``medians[i] - medians[f] <= max(rel_tol * medians[f], spreads[i], spreads[f])``.
    """
    _check("medians", medians)
    spreads = [0.0] * len(medians) if spreads is None else list(spreads)
    if len(spreads) != len(medians):
        raise ValueError(f"spreads has {len(spreads)} values but medians has {len(medians)}: "
                         "give one spread per plan")
    _check("spreads", spreads)
    if not 0 <= rel_tol < 1:
        raise ValueError(f"rel_tol={rel_tol!r}: must be in [0, 1)")
    f = min(range(len(medians)), key=lambda i: medians[i])
    return [i for i, m in enumerate(medians)
            if m - medians[f] <= max(rel_tol * medians[f], spreads[i], spreads[f])]


def predicted_rank(predicted: Sequence[float], i: int) -> int:
    """Plan i's 1-based rank under ``predicted``, ties against it: 1 + the number of other
    plans predicted no slower (to a relative 1e-9)."""
    _check("predicted", predicted)
    if not 0 <= i < len(predicted):
        raise ValueError(f"plan index {i} is out of range for {len(predicted)} plans")
    p = predicted[i]
    return 1 + sum(1 for j, q in enumerate(predicted)
                   if j != i and q <= p * (1 + _PREDICTED_TIE))


def best_rank(medians: Sequence[float], predicted: Sequence[float],
              spreads: Sequence[float] | None = None, rel_tol: float = 0.05,
              strict_ties: bool = False) -> int:
    """The best predicted rank among the measured-best plans (see the module docstring:
    a predicted tie counts against the model only with a plan outside the measured-best
    set, or with any plan under ``strict_ties``)."""
    if len(predicted) != len(medians):
        raise ValueError(f"predicted has {len(predicted)} values but medians has "
                         f"{len(medians)}: give one prediction per measured plan")
    best = measured_best(medians, spreads, rel_tol)
    if strict_ties:
        return min(predicted_rank(predicted, i) for i in best)
    _check("predicted", predicted)
    members = set(best)
    others = [q for j, q in enumerate(predicted) if j not in members]
    return min(1 + sum(1 for q in others if q <= predicted[i] * (1 + _PREDICTED_TIE))
               for i in best)


def table_metrics(ranks: Mapping[str, int], k: int = 5) -> dict[str, float]:
    """Acc@1, Acc@k and MRR over models, from each model's :func:`best_rank`.

    Returns ``{"acc@1", f"acc@{k}", "mrr", "models"}``."""
    if not ranks:
        raise ValueError("ranks is empty: give the best_rank of at least one model")
    for m, r in ranks.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"ranks[{m!r}]={r!r}: must be an int >= 1 (a 1-based rank)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be an int >= 1")
    n = len(ranks)
    return {"acc@1": sum(r == 1 for r in ranks.values()) / n,
            f"acc@{k}": sum(r <= k for r in ranks.values()) / n,
            "mrr": sum(1.0 / r for r in ranks.values()) / n, "models": n}


def pick_regret(medians: Sequence[float], predicted: Sequence[float]) -> float:
    """How much slower the plan the cost model picks runs than the fastest measured plan:
    ``medians[p] / min(medians) - 1`` for ``p`` the plan predicted cheapest (the worst
    measured of several predicted equally cheap). 0 when the pick is the fastest; 0.10 is a
    pick within 10 % of the best measured plan (the bar docs/paper.md's ranking counts)."""
    if len(predicted) != len(medians):
        raise ValueError(f"predicted has {len(predicted)} values but medians has "
                         f"{len(medians)}: give one prediction per measured plan")
    _check("medians", medians)
    _check("predicted", predicted)
    low = min(predicted)
    picks = [i for i, q in enumerate(predicted) if q <= low * (1 + _PREDICTED_TIE)]
    best = min(medians)
    if best <= 0:
        raise ValueError(f"the fastest measured plan has median {best}: times must be > 0")
    return max(medians[i] for i in picks) / best - 1.0


def kendall_tau(medians: Sequence[float], predicted: Sequence[float]) -> float | None:
    """Kendall's rank correlation of the predicted and the measured order of all plans:
    (concordant - discordant) / (concordant + discordant) over the pairs of plans, a pair
    whose measured or predicted times are equal (to a relative 1e-9) counting as neither.
    1: the model orders every pair as measured; 0: no better than chance; -1: reversed.
    None when no pair is ordered both ways (fewer than two plans, or all tied). Unlike
    Acc@k and MRR, which look only at where the measured-best plan lands, this scores the
    whole ranking (a cluster where one plan wins by far makes Acc@1 easy)."""
    if len(predicted) != len(medians):
        raise ValueError(f"predicted has {len(predicted)} values but medians has "
                         f"{len(medians)}: give one prediction per measured plan")
    _check("medians", medians)
    _check("predicted", predicted)

    def order(a: float, b: float) -> int:
        if abs(a - b) <= _PREDICTED_TIE * max(abs(a), abs(b)):
            return 0
        return 1 if a > b else -1

    agree = disagree = 0
    for i in range(len(medians)):
        for j in range(i + 1, len(medians)):
            s = order(medians[i], medians[j]) * order(predicted[i], predicted[j])
            agree += s > 0
            disagree += s < 0
    return None if agree + disagree == 0 else (agree - disagree) / (agree + disagree)
