"""Reproduce the paper's Figure 8: weak scaling from 8 to 64 GPUs, TAPAS-ES against TAPAS-GP.

    python scripts/figure8_weak_scaling.py [--models=moe-1.3b]
        [--nodes=1,2,4,8] [--devices_per_node=8] [--per_device_batch=2] [--es_limit=60]
        [--json_out=out/figure8_weak_scaling.json] [--png_out=out/figure8_weak_scaling.png]

For each model and cluster S(m, 8) of V100 nodes on 100 Gb/s Ethernet
(``Cluster.v100_ethernet``), the model is captured with a global batch of
``--per_device_batch`` x devices (weak scaling: the work per device stays the same), then
searched in gp and in es (stopped after ``--es_limit`` seconds: reported as not finished).
Everything here is **predicted by the cost model** (no GPUs on this machine): the best
plan's step-time cost of each mode, their gap (the paper: GP within 1.5 % of ES), the
search times (measured here), and which plan wins at each size (the patterns the searched
plan uses most, and its weights split), since the paper sees the plan change with the
cluster. Prints the table, writes JSON and a PNG (cost per mode and search time against
the device count).
"""

from __future__ import annotations

import collections
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks"))

from absl import app, flags  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)

flags.DEFINE_list("models", ["moe-1.3b"], "Zoo presets (the paper scales MoE-1.3B).")
flags.DEFINE_list("nodes", ["1", "2", "4", "8"], "Cluster sizes m of S(m, n).")
flags.DEFINE_integer("devices_per_node", 8, "n of S(m, n).")
flags.DEFINE_integer("per_device_batch", 2, "Examples per device (the global batch grows "
                     "with the cluster).")
flags.DEFINE_float("es_limit", 60.0, "Seconds before an es search is stopped.")
flags.DEFINE_string("json_out", "out/figure8_weak_scaling.json", "Where to write the JSON.")
flags.DEFINE_string("png_out", "out/figure8_weak_scaling.png", "Where to write the plot.")
FLAGS = flags.FLAGS


def _search(graph, cluster, mode: str, limit: float | None) -> dict:
    from tapas.planning import explore, search
    t0 = time.perf_counter()
    try:
        s = search.search(graph, cluster=cluster, mode=mode, references=(),
                          explore_options=explore.ExploreOptions(time_limit=limit))
    except explore.SearchTimeout:
        return {"finished": False, "seconds": round(time.perf_counter() - t0, 2)}
    used = collections.Counter(p for p, n in zip(s.patterns, graph.nodes) if n.weights)
    return {"finished": True, "seconds": round(time.perf_counter() - t0, 2),
            "cost_s": s.total_cost, "exact": s.exact,
            "patterns": dict(used.most_common(3)), "split_weights": len(s.weight_placements),
            "generated": s.counts["generated"]}


def point(name: str, nodes: int) -> dict:
    import tapas
    from tapas import models
    from tapas.planning.cluster import Cluster
    entry = models.get(name)
    n = nodes * FLAGS.devices_per_node
    batch = FLAGS.per_device_batch * n
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec(batch)))
    cluster = Cluster.v100_ethernet(nodes, FLAGS.devices_per_node)
    gp = _search(graph, cluster, "gp", None)
    es = _search(graph, cluster, "es", FLAGS.es_limit)
    row = {"model": name, "nodes": nodes, "devices": n, "batch": batch,
           "graph_nodes": len(graph.nodes), "gp": gp, "es": es}
    if es["finished"] and gp["finished"]:
        row["gap"] = gp["cost_s"] / es["cost_s"] - 1 if es["cost_s"] > 0 else 0.0
    print(f"  {name} on {n} devices (batch {batch}): gp {gp['cost_s'] * 1e3:.2f} ms in "
          f"{gp['seconds']:.1f} s; es " + (f"{es['cost_s'] * 1e3:.2f} ms in {es['seconds']:.1f} s"
                                           if es["finished"] else
                                           f"did not finish in {es['seconds']:.0f} s"),
          flush=True)
    return row


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=120)
    FigureCanvasAgg(fig)
    cost_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        xs = [r["devices"] for r in mine]
        cost_ax.plot(xs, [r["gp"]["cost_s"] * 1e3 for r in mine], "o-", label=f"{name} GP")
        es = [(r["devices"], r["es"]["cost_s"] * 1e3) for r in mine if r["es"]["finished"]]
        if es:
            cost_ax.plot(*zip(*es), "s--", label=f"{name} ES")
        time_ax.plot(xs, [r["gp"]["seconds"] for r in mine], "o-", label=f"{name} GP")
        time_ax.plot(xs, [r["es"]["seconds"] for r in mine], "s--",
                     label=f"{name} ES (at the limit: did not finish)")
    for ax, ylabel, title in ((cost_ax, "predicted step cost (ms)", "Best plan's cost"),
                              (time_ax, "search time (s)", "Search time (measured here)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    time_ax.axhline(FLAGS.es_limit, color="grey", lw=0.8, ls=":")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main(argv: list[str]) -> None:
    del argv
    print(f"Figure 8: weak scaling, {FLAGS.per_device_batch} examples per device, V100 "
          f"nodes of {FLAGS.devices_per_node} on 100 Gb/s Ethernet (costs predicted by the "
          f"cost model; es stopped after {FLAGS.es_limit:.0f} s)")
    rows = [point(name, int(m)) for name in FLAGS.models for m in FLAGS.nodes]
    print(f"\n{'model':<10}{'GPUs':>5}{'batch':>6}{'gp ms':>10}{'es ms':>10}{'gap':>8}"
          f"{'gp s':>7}{'es s':>7}  gp plan (patterns of weighted GraphNodes)")
    for r in rows:
        gp, es = r["gp"], r["es"]
        gap = f"{100 * r['gap']:.2f}%" if "gap" in r else "-"
        print(f"{r['model']:<10}{r['devices']:>5}{r['batch']:>6}{gp['cost_s'] * 1e3:>10.2f}"
              f"{es['cost_s'] * 1e3 if es['finished'] else float('nan'):>10.2f}{gap:>8}"
              f"{gp['seconds']:>7.1f}{es['seconds']:>7.1f}{'' if es['finished'] else '*'}  "
              f"{gp['patterns']}")
    print("* es stopped at the limit. Paper: GP within 1.5 % of ES; ES runs out of time as "
          "the cluster grows; the plan changes with the cluster size.")
    out = {"figure": "TAPAS Figure 8", "predicted": True,
           "per_device_batch": FLAGS.per_device_batch, "es_limit_s": FLAGS.es_limit,
           "machine": report.machine(), "rows": rows}
    if FLAGS.json_out:
        report.write_json(FLAGS.json_out, out)
    if FLAGS.png_out:
        plot(rows, FLAGS.png_out)
        print(f"plot written to {FLAGS.png_out}")


if __name__ == "__main__":
    app.run(main)
