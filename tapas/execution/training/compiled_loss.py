"""The compiled loss of a model with one or several outputs, as Keras's ``CompileLoss``
takes it: one loss per output and its ``loss_weights``; targets and sample weights per
output.

In:  a Keras model (its ``output_names`` and compile configuration) or the ``loss`` given
     to ``tapas.parallelize``: one loss for every output, a list in output order, or a
     dict keyed by output name; ``loss_weights`` likewise (or one float for a one-output
     model); targets ``y`` and ``sample_weight`` in the forms Keras's ``fit`` takes.
Out: :func:`output_losses`: (a ``keras.losses.Loss`` per output, its weight or None, the
     output names); :func:`output_targets` / :func:`output_weights`: one array per
     output, in output order; in the runtime, :func:`outputs_loss` (a replica's share of
     the weighted sum of the outputs' losses) and :func:`prepare_outputs` (each output's
     loss plan and its targets and weights placed for it).

Keras's total loss is ``sum_k weight_k * loss_k(y_k, y_pred_k, sample_weight_k)``, each
``loss_k`` reduced by its own reduction; with several outputs Keras also logs each
output's unweighted loss as ``<output name>_loss`` (``loss_names``). An output without a
loss (``None`` in the list or dict, which Keras skips) is refused: the runtime trains
every output it computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["output_losses", "output_targets", "output_weights", "loss_names", "outputs_loss",
           "prepare_outputs"]


def _per_output(value: Any, names: Sequence[str], what: str, fix: str) -> list[Any]:
    """``value`` (one for all, a list in output order, a dict by output name) as a list."""
    n = len(names)
    if isinstance(value, Mapping):
        missing = [k for k in names if k not in value]
        extra = [k for k in value if k not in names]
        if missing or extra:
            raise ValueError(f"{what} is a dict with keys {sorted(value)}, the model's "
                             f"outputs are {list(names)}: {fix}")
        return [value[k] for k in names]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries, the model has {n} outputs "
                             f"{list(names)}: {fix}")
        return list(value)
    return [value] * n


def output_losses(model: Any, loss: Any = None, loss_weights: Any = None,
                  to_object: Callable[[Any], Any] = lambda x: x
                  ) -> tuple[list[Any], list[float | None], list[str]]:
    """(a Loss per output, its weight or None, the output names): ``loss`` (default: the
    loss the model was compiled with) and ``loss_weights`` (default: the compiled ones),
    each loss made a ``keras.losses.Loss`` by ``to_object``."""
    names = [str(n) for n in (getattr(model, "output_names", None) or ["output"])]
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss_weights is None:
            loss_weights = config.get("loss_weights")
    fix = "give one loss per output (a list in output order or a dict keyed by name)"
    losses = _per_output(loss, names, "loss", fix)
    if len(names) > 1 and any(l is None for l in losses):
        none = [n for n, l in zip(names, losses) if l is None]
        raise ValueError(f"outputs {none} have no loss: the runtime trains every output "
                         f"of the model, so {fix} (or build a model without those outputs)")
    if isinstance(loss_weights, (int, float)) and len(names) > 1:
        raise ValueError(f"loss_weights={loss_weights}: one float is for a model with one "
                         f"output; this one has {len(names)} {names}: give a list or dict")
    weights = _per_output(loss_weights, names, "loss_weights",
                          "give one weight per output (a list in output order or a dict "
                          "keyed by output name)")
    weights = [None if w is None else float(w) for w in weights]
    return [to_object(l) for l in losses], weights, names


def loss_names(names: Sequence[str]) -> list[str]:
    """The names Keras logs each output's unweighted loss under (several outputs only)."""
    return [f"{n}_loss" for n in names] if len(names) > 1 else []


def output_targets(y: Any, names: Sequence[str]) -> list[np.ndarray]:
    """The targets of each output, in output order: ``y`` a list or tuple in output order
    or a dict keyed by output name (one array for a one-output model)."""
    if len(names) == 1 and not isinstance(y, (list, tuple, Mapping)):
        return [np.asarray(y)]
    return [np.asarray(v) for v in _per_output(
        y, names, "y", "give the targets of every output: a list in output order or a dict "
        "keyed by output name")]


def output_weights(sample_weight: Any, names: Sequence[str]) -> list[np.ndarray] | None:
    """Sample weights per output (Keras: one array weighs every output's loss alike, a
    list or dict gives each output its own), or None."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, (list, tuple, Mapping)):
        return [np.asarray(w, dtype=np.float32) for w in _per_output(
            sample_weight, names, "sample_weight", "give one array for every output, or "
            "one per output (a list in output order or a dict keyed by output name)")]
    return [np.asarray(sample_weight, dtype=np.float32)] * len(names)


# ---- in the runtime (a tapas.execution.runtime.Runtime ``rt``) --------------------------------

def outputs_loss(rt: Any, r: Any, outs: list, y: Any) -> tuple[Any, bool]:
    """In a replica body (``r``): (this replica's share of Keras's compiled loss, whether
    the replicas' shares are summed): each output's loss (``rt._local_loss``) times its
    loss weight, summed. Where one output's shares are summed (split on the batch) and
    another's is the full loss on every replica, the full ones count 1/N in value with
    their gradient kept (``regularizers.value_scale``). With ``rt.keep_step_values``,
    each output's unweighted global loss goes to ``r.notes["output_losses"]``."""
    from tapas.execution.training.regularizers import value_scale
    k = len(rt.output_losses or [None])
    weights_of = rt.loss_weights or [None] * k
    if k == 1:
        share, partial = rt._local_loss(r, outs[0], y)
        return (share if weights_of[0] is None else share * weights_of[0]), partial
    ws = list(y[k:]) or [None] * k
    parts = [rt._local_loss(r, outs[i], y[i] if ws[i] is None else (y[i], ws[i]), i)
             for i in range(k)]
    summed = any(partial for _, partial in parts)
    total = None
    for (share, partial), w in zip(parts, weights_of):
        if rt.keep_step_values:
            r.notes.setdefault("output_losses", []).append(
                rt._dp_loss(r, r.values.sum_value(share) if partial else share))
        if summed and not partial:
            share = value_scale(share, 1.0 / rt.num_devices)
        share = share if w is None else share * w
        total = share if total is None else total + share
    return total, summed


def prepare_outputs(rt: Any, xs: list, y: Any, worker_share: bool,
                    sample_weight: Any) -> tuple[Any, Any]:
    """``Runtime._prepare`` of a model with several outputs: each output's loss plan
    (``rt.loss_plans``), its targets (and sample weights) placed for its loss and
    distributed as one tuple: the targets in output order, then the weights."""
    from tapas.sharding.placements import Replica, Split
    if worker_share and not rt._all_local():
        raise ValueError("a model with several outputs trains with every worker reading "
                         "whole global batches: pass the global batch (worker_share=False), "
                         "not a worker's share")
    names = rt.output_names or [f"output_{k}" for k in range(len(rt.output_losses))]
    ys = output_targets(y, names)
    rt.loss_plans = [rt._loss_plan(v, k) for k, v in enumerate(ys)]
    rt.loss_plan = rt.loss_plans[0]
    places = [Replica() if p.target_axis is None else Split(p.target_axis)
              for p in rt.loss_plans]
    dist_x = rt._distribute(xs, rt.input_placements)
    ws = output_weights(sample_weight, names)
    if ws is None:
        return dist_x, rt._distribute(ys, places)
    ws = [rt._check_weights(w, v) for w, v in zip(ws, ys)]
    rt.weight_placements = [p if isinstance(p, Split) and p.axis < w.ndim else Replica()
                            for p, w in zip(places, ws)]
    return dist_x, rt._distribute(ys + ws, places + rt.weight_placements)
