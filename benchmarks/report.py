"""What every benchmark writes besides its table: the machine it ran on, and the JSON file;
and the one timed search that the search benchmark and the Figure 6 script share.

In:  a benchmark's results (a JSON-able dict) and the path given by its ``--json_out``; or
     a captured graph, a search mode and a time limit.
Out: :func:`machine` (python, platform, CPU count), :func:`write_json` (the file, its
     directory created, a line saying where it went) and :func:`timed_search` (a row).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from typing import Any

__all__ = ["machine", "write_json", "timed_search"]


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
