"""Reproduce the paper's Table 1 (appendix A) on our presets: how far each stage shrinks
what the search has to look at.

    python scripts/table1_complexity.py [--models=t5-large,resnet50-1k,moe-1.3b]
        [--devices=8] [--es_limit=60] [--graph_cache=out/graphs]
        [--json_out=out/table1_complexity.json] [--png_out=out/table1_complexity.png]

Per model, counted (nothing here is predicted):

* the **op graph**: V = the TensorFlow ops the capture keeps (``Graph.num_ops``), E = the
  data edges between them (an op input produced by another kept op);
* the **GraphNode graph**: V = GraphNodes, E = their edges; ``C`` = ops per GraphNode,
  the paper's first reduction factor;
* the **folded graph**: what the gp search enumerates: the unique subgraphs (templates,
  once each) plus the GraphNodes no template covers, V and E among them; ``L`` = the
  instances of the largest template (the layers);
* the **candidates** each search mode generates (prefix extensions) on one node of
  ``--devices`` V100s: gp, and es stopped after ``--es_limit`` seconds (then reported as
  not finished, with no count: the count at the stop is not kept).

Beside them the paper's formula for TAPAS's search space, N((V+E) / (2CL)) with the
op-graph V and E and our C and L, and the ratios of each level to the op graph. Prints the
table, writes JSON and a PNG (log scale, one group of bars per model).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks"))

from absl import app, flags  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)

flags.DEFINE_list("models", ["t5-large", "resnet50-1k", "moe-1.3b"], "Zoo presets.")
flags.DEFINE_integer("devices", 8, "Devices of the one-node V100 cluster searched on.")
flags.DEFINE_float("es_limit", 60.0, "Seconds before an es search is stopped.")
flags.DEFINE_string("graph_cache", None, "Directory for captured IR graphs (JSON): reused "
                    "when present, written otherwise.")
flags.DEFINE_string("json_out", "out/table1_complexity.json", "Where to write the JSON.")
flags.DEFINE_string("png_out", "out/table1_complexity.png", "Where to write the plot.")
FLAGS = flags.FLAGS


def op_graph(graph) -> tuple[int, int]:
    """(V, E) of the ops the IR keeps: an edge per op input made by another kept op."""
    ops = [op for node in graph.nodes for op in node.ops]
    names = {op.name for op in ops}
    edges = sum(1 for op in ops for i in op.inputs if i.rsplit(":", 1)[0] in names)
    return len(ops), edges


def folded_graph(graph, folded) -> tuple[int, int, int]:
    """(V, E, L) of what gp enumerates: each template's first instance and every GraphNode
    no template covers; E the edges among those; L the instances of the largest template."""
    keep = {v for t in folded.templates for v in t.instances[0]}
    covered = {v for t in folded.templates for inst in t.instances for v in inst}
    keep |= {n.id for n in graph.nodes if n.id not in covered}
    edges = sum(1 for e in graph.edges if e.src in keep and e.dst in keep)
    largest = max(folded.templates, key=lambda t: t.size * t.num_instances, default=None)
    return len(keep), edges, (largest.num_instances if largest else 1)


def count(name: str) -> dict:
    from tapas import mining, models
    graph = models.capture_preset(name, FLAGS.graph_cache)[0]
    v_op, e_op = op_graph(graph)
    folded = mining.mine(graph)
    v_f, e_f, layers = folded_graph(graph, folded)
    c = v_op / max(len(graph.nodes), 1)
    gp = report.timed_search(graph, "gp", None, FLAGS.devices)
    es = report.timed_search(graph, "es", FLAGS.es_limit, FLAGS.devices)
    row = {"model": name, "ops": {"V": v_op, "E": e_op},
           "graph_nodes": {"V": len(graph.nodes), "E": len(graph.edges)},
           "folded": {"V": v_f, "E": e_f, "templates": folded.num_templates},
           "C": round(c, 2), "L": layers,
           "paper_formula": round((v_op + e_op) / (2 * c * layers), 1),
           "gp": {"generated": gp["generated"], "seconds": gp["seconds"]},
           "es": ({"generated": es["generated"], "seconds": es["seconds"]} if es["finished"]
                  else {"finished": False, "seconds": es["seconds"]})}
    print(f"  {name}: ops {v_op:,}/{e_op:,}, GraphNodes {len(graph.nodes):,}/"
          f"{len(graph.edges):,}, folded {v_f}/{e_f}, gp {gp['generated']:,} candidates, es "
          + (f"{es['generated']:,}" if es["finished"] else
             f"stopped after {es['seconds']:.0f} s"), flush=True)
    return row


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    levels = [("op graph V+E", lambda r: r["ops"]["V"] + r["ops"]["E"]),
              ("GraphNode graph V+E", lambda r: r["graph_nodes"]["V"] + r["graph_nodes"]["E"]),
              ("folded graph V+E (searched)", lambda r: r["folded"]["V"] + r["folded"]["E"]),
              ("paper: (V+E)/(2CL)", lambda r: r["paper_formula"])]
    width = 0.8 / len(levels)
    for k, (label, value) in enumerate(levels):
        xs = [i + k * width for i in range(len(rows))]
        ax.bar(xs, [max(value(r), 1) for r in rows], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([r["model"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("vertices + edges (log scale)")
    ax.set_title("What each stage leaves to search (counted on our presets)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main(argv: list[str]) -> None:
    del argv
    print(f"Table 1: search-space sizes on one node of {FLAGS.devices} V100 "
          f"(es stopped after {FLAGS.es_limit:.0f} s)")
    rows = [count(name) for name in FLAGS.models]
    print(f"\n{'model':<15}{'ops V':>9}{'ops E':>9}{'GN V':>7}{'GN E':>7}{'C':>6}{'L':>4}"
          f"{'fold V':>8}{'fold E':>8}{'paper':>8}{'gp cand':>11}{'es cand':>13}")
    for r in rows:
        es = f"{r['es']['generated']:,}" if "generated" in r["es"] else \
            f">{r['es']['seconds']:.0f}s"
        print(f"{r['model']:<15}{r['ops']['V']:>9,}{r['ops']['E']:>9,}"
              f"{r['graph_nodes']['V']:>7,}{r['graph_nodes']['E']:>7,}{r['C']:>6.1f}"
              f"{r['L']:>4}{r['folded']['V']:>8,}{r['folded']['E']:>8,}"
              f"{r['paper_formula']:>8.0f}{r['gp']['generated']:>11,}{es:>13}")
    print("\nC: ops per GraphNode; L: instances of the largest template; paper: TAPAS's "
          "search space (V+E)/(2CL) from the op graph (appendix A); fold: what gp "
          "enumerates (each template once + uncovered GraphNodes)")
    out = {"table": "1", "devices": FLAGS.devices, "es_limit_s": FLAGS.es_limit,
           "machine": report.machine(), "rows": rows}
    if FLAGS.json_out:
        report.write_json(FLAGS.json_out, out)
    if FLAGS.png_out:
        plot(rows, FLAGS.png_out)
        print(f"plot written to {FLAGS.png_out}")


if __name__ == "__main__":
    app.run(main)
