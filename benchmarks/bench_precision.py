"""Benchmark: the plan and cost the search picks in float32 and in mixed precision.

    python benchmarks/bench_precision.py [--model=t5-large] [--nodes=2] [--devices=8]
        [--cluster=v100] [--policies=float32,mixed_float16,mixed_bfloat16]
        [--override=mixed_float16] [--graph_cache=out/graphs]
        [--json_out=out/bench_precision.json]

The zoo model ``--model`` is built structure-only (``build(fast_init=True)``: zero
weights) and captured once under each Keras dtype policy of ``--policies``
(``keras.mixed_precision.set_dtype_policy``), then searched (gp) on ``--nodes`` x
``--devices`` GPUs of the ``--cluster`` preset. The search reads each capture's precision
from its dtypes (``tapas.planning.precision.graph_precision``); ``--override`` also
searches the float32 capture with ``tapas.search(..., precision=...)``, priced as if it
ran under that policy. For every run it prints the plan (how many GraphNodes of each
pattern family, how many weights are split) and its cost per training step (total,
compute, communication, memory per device), the reference plans' costs, and then where
each plan places weights differently from the float32 capture's. Every number goes to
``--json_out``.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from absl import app, flags  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py, beside this script)

flags.DEFINE_string("model", "t5-large", "Zoo preset to capture and search.")
flags.DEFINE_integer("nodes", 2, "Nodes of the cluster.")
flags.DEFINE_integer("devices", 8, "Devices per node.")
flags.DEFINE_string("cluster", "v100", "Cluster preset (tapas.planning.cluster.CLUSTER_PRESETS).")
flags.DEFINE_list("policies", ["float32", "mixed_float16", "mixed_bfloat16"],
                  "Keras dtype policies to capture the model under.")
flags.DEFINE_string("override", "mixed_float16", "Also search the float32 capture priced "
                    "as this policy (tapas.search precision=); empty to skip.")
flags.DEFINE_string("graph_cache", None, "Directory for the captured graphs (JSON), one "
                    "file per model and policy.")
flags.DEFINE_string("json_out", "out/bench_precision.json", "Where to write the results.")
FLAGS = flags.FLAGS

_MS = 1e3


def capture(name: str, policy: str) -> tuple[object, float]:
    """The graph of zoo preset ``name`` built and captured under ``policy`` (cached in
    ``--graph_cache``), and the seconds that took (0.0 from the cache)."""
    import keras

    import tapas
    from tapas import models
    from tapas.ir import Graph
    path = (os.path.join(FLAGS.graph_cache, f"{name}-{policy}.json")
            if FLAGS.graph_cache else None)
    if path and os.path.exists(path):
        with open(path) as f:
            return Graph.loads(f.read()), 0.0
    entry = models.get(name)
    start = time.perf_counter()
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = entry.build(fast_init=True)
        graph = tapas.capture(model, list(entry.input_spec()), name=f"{name}-{policy}")
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    seconds = time.perf_counter() - start
    del model
    keras.backend.clear_session()
    gc.collect()
    if path:
        os.makedirs(FLAGS.graph_cache, exist_ok=True)
        with open(path, "w") as f:
            f.write(graph.dumps())
    return graph, seconds


def searched(graph, cluster, precision: str | None) -> dict:
    """One gp search's plan and cost as a row."""
    import tapas
    start = time.perf_counter()
    s = tapas.search(graph, cluster=cluster, precision=precision)
    seconds = time.perf_counter() - start
    infos = [s._table.infos[v][s._table.index(v, name)] for v, name in enumerate(s.patterns)]
    families = collections.Counter(i.family.value if i.family else "none" for i in infos)
    c = s.cost
    return {"precision": s.precision, "search_s": round(seconds, 2),
            "total_ms": c["total"] * _MS, "compute_ms": c["compute"] * _MS,
            "communication_ms": c["communication"] * _MS,
            "forward_ms": c["forward"] * _MS, "backward_ms": c["backward"] * _MS,
            "by_kind_ms": {k: v * _MS for k, v in c["by_kind"].items()},
            "memory_gib": s.memory.total / 2**30,
            "families": dict(sorted(families.items())),
            "weights_split": len(s.weight_placements), "weights": len(graph.weights),
            "weight_placements": dict(s.weight_placements),
            "references": {r.name: {"total_ms": r.cost * _MS, "compute_ms": r.compute * _MS,
                                    "communication_ms": r.communication * _MS}
                           for r in s.references},
            "notes": list(s.notes)}


def print_table(rows: dict[str, dict]) -> None:
    head = (f"{'run':<28} {'priced':<15} {'total ms':>9} {'compute':>9} {'comm':>9} "
            f"{'fwd':>8} {'bwd':>8} {'GiB':>6} {'split':>7}  families")
    print(head)
    print("-" * len(head))
    for run, r in rows.items():
        fam = ", ".join(f"{k} {v}" for k, v in r["families"].items())
        print(f"{run:<28} {r['precision']:<15} {r['total_ms']:>9.2f} {r['compute_ms']:>9.2f} "
              f"{r['communication_ms']:>9.2f} {r['forward_ms']:>8.2f} {r['backward_ms']:>8.2f} "
              f"{r['memory_gib']:>6.2f} {r['weights_split']:>3}/{r['weights']:<3}  {fam}")
    names = sorted({n for r in rows.values() for n in r["references"]})
    print("\nreference plans, total ms (compute + communication):")
    for run, r in rows.items():
        cells = []
        for n in names:
            ref = r["references"].get(n)
            if ref and ref["total_ms"] != float("inf"):
                cells.append(f"{n} {ref['total_ms']:.2f} ({ref['compute_ms']:.2f} + "
                             f"{ref['communication_ms']:.2f})")
        print(f"  {run}: " + "; ".join(cells))


def differences(rows: dict[str, dict], base: str) -> dict[str, dict[str, list[str]]]:
    """Per run, the weights it places unlike ``base``'s plan, grouped by the change."""
    want = rows[base]["weight_placements"]
    out: dict[str, dict[str, list[str]]] = {}
    for run, r in rows.items():
        if run == base:
            continue
        got = r["weight_placements"]
        changes: dict[str, list[str]] = collections.defaultdict(list)
        for path in sorted(set(want) | set(got)):
            a, b = want.get(path, "R"), got.get(path, "R")
            if a != b:
                changes[f"{a} -> {b}"].append(path)
        out[run] = dict(changes)
    return out


def main(argv: list[str]) -> None:
    del argv
    from tapas.planning.cluster import Cluster
    cluster = Cluster.preset(FLAGS.cluster, FLAGS.nodes, FLAGS.devices)
    print(f"{FLAGS.model} on {cluster.name}: float32 peak "
          f"{cluster.device_peak_flops / 1e12:.1f} TFLOP/s, "
          + ", ".join(f"{d} {r / 1e12:.0f}"
                      for d, r in (cluster.device_peak_flops_by_dtype or {}).items()))
    rows: dict[str, dict] = {}
    graphs = {}
    captures = {}
    for policy in FLAGS.policies:
        graphs[policy], captures[policy] = capture(FLAGS.model, policy)
        print(f"  captured under {policy}: {len(graphs[policy].nodes)} GraphNodes "
              f"({captures[policy]:.1f} s)")
        rows[f"captured {policy}"] = searched(graphs[policy], cluster, None)
    if FLAGS.override and "float32" in graphs:
        rows[f"float32 as {FLAGS.override}"] = searched(graphs["float32"], cluster,
                                                         FLAGS.override)
    print()
    print_table(rows)
    diffs = differences(rows, "captured float32") if "captured float32" in rows else {}
    for run, changes in diffs.items():
        print(f"\nweights placed unlike the float32 plan in '{run}': "
              + ("none" if not changes else ""))
        for change, paths in changes.items():
            print(f"  {change}: {len(paths)} weights, e.g. {', '.join(paths[:3])}")
    report.write_json(FLAGS.json_out, {
        "model": FLAGS.model, "cluster": cluster.to_json(), "machine": report.machine(),
        "capture_s": captures, "runs": rows, "weights_placed_unlike_float32": diffs})


if __name__ == "__main__":
    app.run(main)
