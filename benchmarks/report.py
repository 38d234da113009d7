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
     ``tapas.execution.communication_scale.without_communication``, which the cost model's
     communication calibration times with too).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from typing import Any

from tapas.execution.communication_scale import without_communication

__all__ = ["machine", "write_json", "timed_search", "plan_program", "timed_plan",
           "without_communication"]


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


def timed_search(graph: Any, mode: str, limit: float | None, devices: int) -> dict[str, Any]:
    """``tapas.search`` of ``graph`` in ``mode`` ("gp" or "es") on one node of ``devices``
    V100s, timed from a cold pattern cache (reference plans not included), stopped after
    ``limit`` seconds (None: no limit). A row: ``finished`` and ``seconds`` always; the
    cost, counts and timings when it finished, the error when it was stopped."""
    from tapas.planning import explore, search
    from tapas.planning.cluster import Cluster
    from tapas.sharding.patterns import clear_cache
    clear_cache()          # every run generates its patterns (no warm cache)
    gc.collect()
    cluster = Cluster.v100_ethernet(1, devices)
    t0 = time.perf_counter()
    try:
        s = search.search(graph, cluster=cluster, mode=mode, references=(),
                          explore_options=explore.ExploreOptions(time_limit=limit))
    except explore.SearchTimeout as e:
        return {"mode": mode, "finished": False, "seconds": round(time.perf_counter() - t0, 3),
                "error": str(e)}
    return {"mode": mode, "finished": True, "seconds": round(time.perf_counter() - t0, 3),
            "cost_s": s.total_cost, "communication_s": s.cost["communication"],
            "memory_gib": round(s.memory.total / 2**30, 4), "exact": s.exact,
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
    from tapas.execution import parallel
    from tapas.execution.plan import Plan
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


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]
