"""What every benchmark writes besides its table: the machine it ran on, and the JSON file;
the one timed search that the search benchmark and the Figure 6 script share; and the one
timed training step that the Table 2 and Figure 7 scripts share.

In:  a benchmark's results (a JSON-able dict) and the path given by its ``--json_out``; or
     a captured graph, a search mode and a time limit; or a model, a plan (one pattern name
     per GraphNode) and a ``tf.distribute`` strategy.
Out: :func:`machine` (python, platform, CPU count), :func:`write_json` (the file, its
     directory created, a line saying where it went), :func:`timed_search` (a row) and
     :func:`timed_plan` (median and spread of the plan's training step).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from typing import Any

__all__ = ["machine", "write_json", "timed_search", "timed_plan"]


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


def timed_plan(model: Any, entry: Any, graph: Any, patterns: Any, strategy: Any,
               batch_size: int, steps: int, repeats: int) -> dict[str, Any]:
    """Median, interquartile range and every step time of ``train_step`` of ``model`` (zoo
    ``entry``, inference graph ``graph``) reconstructed with ``patterns`` (one pattern name
    per GraphNode) under ``strategy``: one untimed step (tracing), then ``repeats`` rounds
    of ``steps`` timed steps."""
    from tapas.execution import parallel
    from tapas.execution.plan import Plan
    from tapas.planning.strategy import graph_digest
    from tapas.sharding.patterns import pattern_by_name
    n = int(strategy.num_replicas_in_sync)
    chosen = {node.id: pattern_by_name(node, graph, n, patterns[node.id])
              for node in graph.nodes}
    xs, y = entry.synthetic_batch(batch_size)
    specs = list(entry.input_spec(batch_size))
    pm = parallel.parallelize(model, specs, Plan(n, chosen, graph_digest=graph_digest(graph)),
                              distribute_strategy=strategy, loss=entry.keras_loss(),
                              training=False)
    pm.train_step(list(xs), y)                     # tracing and the graph's first run
    times = []
    for _ in range(repeats):
        for _ in range(steps):
            start = time.perf_counter()
            pm.train_step(list(xs), y)
            times.append(time.perf_counter() - start)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "iqr_s": q[2] - q[0], "times_s": times}
