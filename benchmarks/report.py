"""What every benchmark writes besides its table: the machine it ran on, and the JSON file;
the one timed search that the search benchmark and the Figure 6 script share; and the one
timed training step that the Table 2 and Figure 7 scripts share.

In:  a benchmark's results (a JSON-able dict) and the path given by its ``--json_out``; or
     a captured graph, a search mode and a time limit; or a model, a plan (one pattern name
     per GraphNode) and a ``tf.distribute`` strategy.
Out: :func:`machine` (python, platform, CPU count), :func:`write_json` (the file, its
     directory created, a line saying where it went), :func:`timed_search` (a row) and
     :func:`plan_program` (a plan built and warmed) and :func:`timed_plan` (median and
     spread of the plan's training step, optionally paired with an anchor plan's, and
     optionally of the same plan built :func:`without_communication`: how much of the
     step its collectives take; the instrument is
     ``tapas.execution.calibration.communication_scale.without_communication``, which the cost model's
     communication calibration times with too); :func:`timed_round_robin` (several built
     plans timed in turn, round after round, each step against the same round's steps of
     the others: what the Table 2 script ranks plans by) and its arithmetic
     :func:`round_robin_summary`.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tapas.execution.calibration.communication_scale import without_communication
from tapas.execution.calibration.compute_scale import median_standard_error

__all__ = ["machine", "write_json", "timed_search", "plan_program", "timed_plan",
           "timed_round_robin", "round_robin_summary", "without_communication"]


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on: Python version, platform and CPU count."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count()}


def write_json(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` (indented JSON), creating its directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nwrote {path}")


def timed_search(graph: Any, mode: str, limit: float | None, devices: int,
                 memory_budget: float | None = None) -> dict[str, Any]:
    """``tapas.search`` of ``graph`` in ``mode`` ("gp" or "es") on one node of ``devices``
    V100s, timed from a cold pattern cache (reference plans not included), stopped after
    ``limit`` seconds (None: no limit), under ``memory_budget`` bytes per device (None: the
    device's memory). A row: ``finished`` and ``seconds`` always (``cpu_seconds``, the
    process's CPU time, when it finished: less disturbed by other work on the machine); the cost, exactness (and
    the bound when not exact), counts and timings when it finished, the error when it was
    stopped."""
    from tapas.planning import explore, search
    from tapas.planning.cluster import Cluster
    from tapas.sharding.patterns import clear_cache
    clear_cache()          # every run generates its patterns (no warm cache)
    gc.collect()
    cluster = Cluster.v100_ethernet(1, devices)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        s = search.search(graph, cluster=cluster, mode=mode, references=(),
                          explore_options=explore.ExploreOptions(time_limit=limit),
                          memory_budget=memory_budget)
    except explore.SearchTimeout as e:
        return {"mode": mode, "finished": False, "seconds": round(time.perf_counter() - t0, 3),
                "error": str(e)}
    return {"mode": mode, "finished": True, "seconds": round(time.perf_counter() - t0, 3),
            "cpu_seconds": round(time.process_time() - c0, 3),
            "cost_s": s.total_cost, "communication_s": s.cost["communication"],
            "memory_gib": round(s.memory.total / 2**30, 4), "exact": s.exact,
            "bound": s.bound, "folded_nodes": s.counts.get("folded_nodes", 0),
            "beam": s.counts["beam"], "penalty_rounds": s.counts["penalty_rounds"],
            "generated": s.counts["generated"], "valid": s.counts["valid"],
            "units": s.counts["units"], "templates": s.counts["templates"],
            "timings": dict(s.timings),
            "split_weights": len(s.weight_placements)}


def _structure(x: Any) -> Any:
    """A zoo entry's tuple of inputs or specs as the list parallelize takes; a dict (or one
    array) as it is."""
    return list(x) if isinstance(x, tuple) else x


def plan_program(model: Any, entry: Any, graph: Any, patterns: Any, strategy: Any,
                 batch_size: int) -> tuple[Any, Any, Any]:
    """``(ParallelModel, inputs, targets)``: ``model`` (zoo ``entry``, or anything with its
    ``input_spec``, ``synthetic_batch`` and ``keras_loss``; inference graph ``graph``)
    reconstructed with ``patterns`` (one pattern name per GraphNode) under ``strategy``,
    after one untimed ``train_step`` (tracing and the graph's first run)."""
    from tapas.execution.api import parallel
    from tapas.execution.program.plan import Plan
    from tapas.planning.strategy import graph_digest
    from tapas.sharding.patterns import pattern_by_name
    n = int(strategy.num_replicas_in_sync)
    chosen = {node.id: pattern_by_name(node, graph, n, patterns[node.id])
              for node in graph.nodes}
    xs, y = entry.synthetic_batch(batch_size)
    xs = _structure(xs)
    pm = parallel.parallelize(model, _structure(entry.input_spec(batch_size)),
                              Plan(n, chosen, graph_digest=graph_digest(graph)),
                              distribute_strategy=strategy, loss=entry.keras_loss(),
                              training=False)
    pm.train_step(xs, y)
    return pm, xs, y


def _step_seconds(program: tuple[Any, Any, Any]) -> float:
    pm, xs, y = program
    start = time.perf_counter()
    pm.train_step(xs, y)
    return time.perf_counter() - start


def timed_plan(model: Any, entry: Any, graph: Any, patterns: Any, strategy: Any,
               batch_size: int, steps: int, repeats: int,
               anchor: tuple[Any, Any, Any] | None = None,
               decompose: bool = False) -> dict[str, Any]:
    """Median, interquartile range and every step time of ``train_step`` of the plan
    (:func:`plan_program`): one untimed step, then ``repeats`` rounds of ``steps`` timed
    steps.

    ``anchor`` (another :func:`plan_program`, e.g. the replicated plan): each timed step
    of the plan is paired with one of the anchor right before it, and the result also has
    ``ratio`` (the median of plan / anchor over the pairs), its interquartile range
    ``ratio_iqr`` and the anchor's step times: a ratio is unmoved by the machine's load
    drifting between plans measured minutes apart, which the plain medians are not.

    ``decompose``: the plan is also built :func:`without_communication` and each of its
    timed steps is followed by one of that copy: the result also has ``local_median_s``,
    ``local_times_s`` and (with ``anchor``) ``local_ratio``, the median of local copy /
    anchor over the same pairs."""
    program = plan_program(model, entry, graph, patterns, strategy, batch_size)
    local = None
    if decompose:
        with without_communication():
            local = plan_program(model, entry, graph, patterns, strategy, batch_size)
    times, anchored, local_times = [], [], []
    for _ in range(repeats):
        for _ in range(steps):
            if anchor is not None:
                anchored.append(_step_seconds(anchor))
            times.append(_step_seconds(program))
            if local is not None:
                local_times.append(_step_seconds(local))
    out = {"median_s": statistics.median(times), "iqr_s": _iqr(times), "times_s": times}
    if anchor is not None:
        ratios = [t / a for t, a in zip(times, anchored)]
        out.update(ratio=statistics.median(ratios), ratio_iqr=_iqr(ratios),
                   anchor_times_s=anchored)
    if local is not None:
        out.update(local_median_s=statistics.median(local_times), local_times_s=local_times)
        if anchor is not None:
            out["local_ratio"] = statistics.median(t / a for t, a in zip(local_times,
                                                                           anchored))
    return out


def timed_round_robin(programs: list[Any], rounds: int, drop_after: int = 5,
                      drop_ratio: float = 1.5, local_programs: list[Any] | None = None,
                      seed: int = 0, step: Any = None, refine_after: int = 0,
                      refine_ratio: float = 0.0, keep: Sequence[int] = ()
                      ) -> list[dict[str, Any]]:
    """Time several built plans (:func:`plan_program`) in turn: ``rounds`` rounds, each
    stepping every plan still timed once, in an order shuffled per round (``seed``: the
    same order in every process, as worker processes need). A plan's step is compared with
    the other plans' steps of the same round (:func:`round_robin_summary`), so the
    machine's speed drifting over the minutes of a model's run moves every plan alike.

    After ``drop_after`` rounds, a plan whose median step is over ``drop_ratio`` times the
    fastest plan's stops being timed (its steps so far are kept): the rounds go to the
    plans whose order is in question. ``refine_after`` (0: never) and ``refine_ratio``: a
    second, finer cut of the same kind after that many rounds, so the plans within
    ``refine_ratio`` of the fastest (the ones whose order the noise still decides) get the
    remaining rounds to themselves. Both cuts compare each plan's median step relative to
    its rounds (the geometric mean of the steps of the plans still timed, as
    :func:`round_robin_summary` ranks them), so a drift of the machine's speed during the
    rounds does not decide them; the plans in ``keep`` (indices) are never cut (a plan and
    its second build, timed to see how far two builds measure apart, need the same
    rounds). ``drop_ratio=0`` and ``refine_ratio=0``: none is dropped
    (worker processes must, as each would decide on its own timings and their collectives
    would no longer meet). ``local_programs[i]`` (or None): a copy of plan i built
    :func:`without_communication`, stepped right after it (``local_*`` in the result).
    ``step``: the timer (default: one ``train_step``'s wall time); a step that raises
    leaves its plan out of the later rounds, with ``error`` in its result.

    Returns one dict per plan: :func:`round_robin_summary`'s, plus ``error`` where a step
    failed.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: must be an int >= 1")
    for name, ratio in (("drop_ratio", drop_ratio), ("refine_ratio", refine_ratio)):
        if ratio and ratio < 1:
            raise ValueError(f"{name}={ratio!r}: must be 0 (keep every plan) or >= 1 (a "
                             "plan that many times slower than the fastest stops)")
    if isinstance(refine_after, bool) or not isinstance(refine_after, int) or refine_after < 0:
        raise ValueError(f"refine_after={refine_after!r}: must be an int >= 0 (0: no second "
                         "cut)")
    step = step or _step_seconds
    n = len(programs)
    local_programs = local_programs or [None] * n
    if len(local_programs) != n:
        raise ValueError(f"local_programs has {len(local_programs)} entries for {n} "
                         "programs: give one (or None) per program")
    times: list[list[float | None]] = [[None] * rounds for _ in range(n)]
    local: list[list[float | None]] = [[None] * rounds for _ in range(n)]
    errors: dict[int, str] = {}
    active = list(range(n))
    order_rng = random.Random(seed)
    for r in range(rounds):
        order = list(active)
        order_rng.shuffle(order)
        for i in order:
            try:
                times[i][r] = step(programs[i])
                if local_programs[i] is not None:
                    local[i][r] = step(local_programs[i])
            except Exception as e:  # noqa: BLE001  (reported with the plan; the rest go on)
                errors[i] = f"{type(e).__name__}: {str(e)[:400]}"
                times[i][r] = local[i][r] = None
                active.remove(i)
        for after, ratio in ((drop_after, drop_ratio), (refine_after, refine_ratio)):
            if ratio and after and r + 1 == after and len(active) > 1:
                medians = _relative_medians(times, active, r + 1)
                fastest = min(medians.values())
                active = [i for i in active if medians[i] <= ratio * fastest or i in keep]
        if not active:
            break
    ok = [i for i in range(n) if i not in errors and any(t is not None for t in times[i])]
    summary = round_robin_summary([times[i] for i in ok], [local[i] for i in ok])
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for i, s in zip(ok, summary):
        out[i] = s
    for i, e in errors.items():
        out[i] = {"error": e}
    return out


def _relative_medians(times: list[list[float | None]], active: list[int],
                      upto: int) -> dict[int, float]:
    """Each active plan's median step over rounds ``0..upto-1`` relative to its round (the
    geometric mean of the active plans' steps that round; active plans were timed in every
    round so far)."""
    g = [math.exp(statistics.fmean(math.log(times[i][r]) for i in active)) for r in range(upto)]
    return {i: statistics.median(times[i][r] / g[r] for r in range(upto)) for i in active}


def round_robin_summary(times: list[list[float | None]],
                        local_times: list[list[float | None]] | None = None
                        ) -> list[dict[str, Any]]:
    """Each plan's step time from :func:`timed_round_robin`'s rounds.

    ``times[i][r]``: plan i's step in round r, None where it was not timed (dropped). The
    plans timed in every round are the round's yardstick: ``g[r]``, the geometric mean of
    their steps in round r. Plan i's steps relative to their rounds, ``times[i][r] / g[r]``,
    give ``ratio`` (their median), ``ratio_iqr`` and ``paired_s = ratio * median(g)`` (the
    time the plan is ranked by), ``paired_iqr_s`` and ``paired_se_s`` (the standard error
    of that median, ``tapas.execution.calibration.compute_scale.median_standard_error``, in seconds), besides the
    plain ``median_s``, ``iqr_s`` and every step ``times_s`` and ``rounds`` (how many).
    ``local_times`` (same layout, or None rows): the same for each plan's copy without its
    collectives (``local_median_s``, ``local_times_s``, ``local_ratio``)."""
    if not times:
        return []
    rounds = len(times[0])
    if any(len(ts) != rounds for ts in times):
        raise ValueError("every plan needs one entry (a time or None) per round")
    full = [ts for ts in times if all(t is not None for t in ts)]
    if not full:
        raise ValueError("no plan was timed in every round: nothing to compare the rounds by")
    g = [math.exp(statistics.fmean(math.log(ts[r]) for ts in full)) for r in range(rounds)]
    base = statistics.median(g)
    out = []
    for i, ts in enumerate(times):
        mine = [(t, g[r]) for r, t in enumerate(ts) if t is not None]
        raw = [t for t, _ in mine]
        rel = [t / gr for t, gr in mine]
        ratio, ratio_iqr = statistics.median(rel), _iqr(rel)
        run = {"median_s": statistics.median(raw), "iqr_s": _iqr(raw), "times_s": raw,
               "rounds": len(raw), "ratio": ratio, "ratio_iqr": ratio_iqr,
               "round_s": base, "paired_s": ratio * base, "paired_iqr_s": ratio_iqr * base,
               "paired_se_s": median_standard_error(ratio_iqr, len(rel)) * base}
        lts = local_times[i] if local_times else None
        if lts is not None and any(t is not None for t in lts):
            pairs = [(t, g[r]) for r, t in enumerate(lts) if t is not None]
            run.update(local_median_s=statistics.median(t for t, _ in pairs),
                       local_times_s=[t for t, _ in pairs],
                       local_ratio=statistics.median(t / gr for t, gr in pairs))
        out.append(run)
    return out


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]
