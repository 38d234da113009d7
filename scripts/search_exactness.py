"""Is the search exact on every model? The corpus and the zoo on 2, 4 and 8 devices.

    python scripts/search_exactness.py [--devices=2,4,8] [--models=name,...]
        [--zoo=all|none|name,...] [--corpus=all|none] [--library=keras-hub|...]
        [--time_limit=120] [--graph_cache=out/graphs] [--json_out=out/search_exactness.json]

Every model of ``tapas.models.corpus`` (models written by other libraries) and every preset
of the zoo (``tapas.models.registry``) is captured once (the graph kept in ``--graph_cache``
when given) and searched in ``gp`` mode on one V100 node of each device count, reference
plans left out. Per model and device count it lists whether the plan is exact (the
enumeration kept every frontier, or the beam cut only prefixes dearer than the plan) or
beam-limited, with ``Strategy.bound`` (how far above the optimum the plan may be; none when
a folded branch's own beam cut), the seconds, the plan's cost and the prefixes the beam cut.
The printed table marks ``exact*`` a search whose beam cut only dearer prefixes. A search
past ``--time_limit`` seconds (wall clock) is listed as ``timeout``; a model that raises
as ``error`` with its exception. The JSON is rewritten after every model, and models already
in it are skipped (``--resume``), so a long run can be stopped and continued. Order: the
zoo's tiny presets, the corpus (slow entries last), then the larger zoo presets.
``tests/test_search_exactness.py`` runs a slice of it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _define_flags() -> None:
    """The script's flags, defined when it runs (importing it, as its test does, next to
    tapas.cli, whose flags share names, defines none)."""
    flags.DEFINE_list("devices", ["2", "4", "8"], "Device counts (one V100 node each).")
    flags.DEFINE_list("models", None, "Only these models (corpus entry or zoo preset names).")
    flags.DEFINE_list("zoo", ["all"], "Zoo presets: all, none or a list of names.")
    flags.DEFINE_enum("corpus", "all", ["all", "none"], "Search the corpus entries or not.")
    flags.DEFINE_string("library", None, "Only corpus entries of this library.")
    flags.DEFINE_float("time_limit", 120.0, "Seconds per search before it is listed as timeout.")
    flags.DEFINE_string("graph_cache", None, "Directory for captured graphs (JSON).")
    flags.DEFINE_string("json_out", "out/search_exactness.json", "Where to write the results.")
    flags.DEFINE_bool("resume", True, "Skip the models already in --json_out.")


FLAGS = flags.FLAGS


def search_row(graph: Any, devices: int, time_limit: float | None,
               explore_options: Any = None) -> dict[str, Any]:
    """One gp search of ``graph`` on one V100 node of ``devices``: ``status`` (``exact``,
    ``beam-limited`` or ``timeout``), ``bound``, ``seconds``, ``cost_s``, ``beam`` (prefixes
    the beam cut) and the notes that mention the beam; ``cpu_s``, the CPU seconds of the
    search (this process), and ``load``, the machine's 1-minute load average as it began
    (wall-clock seconds on a shared machine are several times the CPU time)."""
    import dataclasses

    import tapas
    from tapas.planning.explore import ExploreOptions, SearchTimeout
    opts = explore_options or ExploreOptions()
    if time_limit is not None:
        opts = dataclasses.replace(opts, time_limit=time_limit)
    start, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    try:
        s = tapas.search(graph, cluster=tapas.Cluster.v100_ethernet(1, devices), mode="gp",
                         references=(), explore_options=opts)
    except SearchTimeout as e:
        return {"devices": devices, "status": "timeout", "bound": None,
                "seconds": time.perf_counter() - start,
                "cpu_s": time.process_time() - cpu, "load": load, "error": str(e)}
    return {"devices": devices, "status": "exact" if s.exact else "beam-limited",
            "bound": s.bound, "seconds": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu, "load": load, "cost_s": s.total_cost,
            "beam": s.counts.get("beam", 0),
            "notes": [n for n in s.notes if "beam" in n or "bound" in n]}


def _models() -> list[tuple[str, str, Any]]:
    """(name, library, capture function) in the order of the run."""
    from tapas.models import corpus, registry
    tiny = [n for n in registry.names() if "tiny" in n]
    zoo = {"all": registry.names(), "none": []}.get(",".join(FLAGS.zoo), FLAGS.zoo)
    out: list[tuple[str, str, Any]] = [(n, "zoo", _zoo(n)) for n in zoo if n in tiny]
    if FLAGS.corpus == "all":
        entries = sorted(corpus.entries(FLAGS.library), key=lambda e: e.slow)
        out += [(e.name, e.library, _corpus(e)) for e in entries]
    out += [(n, "zoo", _zoo(n)) for n in zoo if n not in tiny]
    return [m for m in out if FLAGS.models is None or m[0] in FLAGS.models]


def _zoo(name: str) -> Any:
    def capture() -> Any:
        from tapas.models import registry
        return registry.capture_preset(name, FLAGS.graph_cache)[0]
    return capture


def _corpus(entry: Any) -> Any:
    def capture() -> Any:
        import tapas
        from tapas.ir import Graph
        path = (os.path.join(FLAGS.graph_cache, f"corpus-{entry.name}.json")
                if FLAGS.graph_cache else None)
        if path and os.path.exists(path):
            with open(path) as f:
                return Graph.loads(f.read())
        model, specs = entry.build()
        graph = tapas.capture(model, specs, name=entry.name)
        if path:
            os.makedirs(FLAGS.graph_cache, exist_ok=True)
            with open(path, "w") as f:
                f.write(graph.dumps())
        return graph
    return capture


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']:34s} error: {row['error'][:120]}"
    cells = []
    for r in row["searches"]:
        tag = {"exact": "exact", "beam-limited": "BEAM", "timeout": "TIMEOUT"}[r["status"]]
        if r["status"] == "exact" and r.get("beam"):
            tag += "*"        # the beam cut, but nothing cheaper than the plan
        if r["status"] == "beam-limited":
            tag += f" {r['bound']:.1%}" if r["bound"] is not None else " (no bound)"
        cpu = f" (cpu {r['cpu_s']:.1f}s, load {r['load']:.0f})" if "cpu_s" in r else ""
        cells.append(f"{r['devices']}: {tag} {r['seconds']:.1f}s{cpu}")
    return f"{row['model']:34s} {row['graph_nodes']:5d}  " + " | ".join(cells)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of searches per status and the beam-limited / timed-out / failed models."""
    counts: dict[str, int] = {}
    exceptions = []
    for row in rows:
        if "error" in row:
            exceptions.append({"model": row["model"], "status": "error"})
            continue
        for r in row["searches"]:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
            if r["status"] != "exact":
                exceptions.append({"model": row["model"], "devices": r["devices"],
                                   "status": r["status"], "bound": r["bound"],
                                   "seconds": round(r["seconds"], 2),
                                   **({"cpu_s": round(r["cpu_s"], 2), "load": r["load"]}
                                      if "cpu_s" in r else {})})
    return {"models": len(rows), "searches": counts, "exceptions": exceptions}


def _write(rows: list[dict[str, Any]], devices: tuple[int, ...]) -> None:
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump({"devices": list(devices), "time_limit_s": FLAGS.time_limit,
                   "summary": summary(rows), "models": rows}, f, indent=1, default=str)


def main(argv: list[str]) -> None:
    del argv
    import keras
    devices = tuple(int(d) for d in FLAGS.devices)
    rows: list[dict[str, Any]] = []
    if FLAGS.resume and os.path.exists(FLAGS.json_out):
        with open(FLAGS.json_out) as f:
            rows = json.load(f)["models"]
    done = {r["model"] for r in rows}
    for name, library, capture in _models():
        if name in done:
            continue
        row: dict[str, Any] = {"model": name, "library": library}
        try:
            start = time.perf_counter()
            graph = capture()
            row.update(capture_s=time.perf_counter() - start, graph_nodes=len(graph.nodes),
                       searches=[search_row(graph, n, FLAGS.time_limit) for n in devices])
        except Exception as e:  # reported, and the run goes on
            row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        finally:
            keras.backend.clear_session()
            gc.collect()
        rows.append(row)
        print(_line(row), flush=True)
        _write(rows, devices)
    s = summary(rows)
    print(f"\n{s['models']} models, searches: {s['searches']}")
    for e in s["exceptions"]:
        print(f"  {e}")
    _write(rows, devices)
    print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
