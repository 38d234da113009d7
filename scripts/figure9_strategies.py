"""Reproduce the paper's Figure 9: the strategies TAPAS finds, drawn per unique subgraph.

    python scripts/figure9_strategies.py [--models=t5-large,resnet50-100k,moe-1.3b]
        [--devices=8] [--json_out=out/figure9_strategies.json] [--png_dir=out/figure9]

For each model, searched (gp) on one node of ``--devices`` V100s (``Cluster.v100_ethernet``):
the pattern of every GraphNode of one instance of each template (the unique subgraph; every
instance gets the same plan), and of the GraphNodes with weights or collectives that no
template covers, with the weights each splits, its collectives and how many GraphNodes
differ in the Megatron reference (transformers) and in data parallelism
(``tapas.planning.draw.strategy_rows``). The plan is the cost model's choice (no
GPUs here), so the figure shows *what* is chosen, as the paper's does. Prints one block per
model, writes JSON and a PNG per model (``tapas.planning.draw``, as ``tapas search --draw``):
the strategy beside the reference plans of its kind (T5: Megatron, FFN-only, MHA-only; MoE:
expert, data parallel; CNNs: data parallel), a row per GraphNode of each template with its
pattern, weight splits and collectives, coloured by the pattern's family, each panel
titled with its predicted cost.
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

flags.DEFINE_list("models", ["t5-large", "resnet50-100k", "moe-1.3b"], "Zoo presets.")
flags.DEFINE_integer("devices", 8, "V100s in the node.")
flags.DEFINE_string("json_out", "out/figure9_strategies.json", "Where to write the JSON.")
flags.DEFINE_string("png_dir", "out/figure9", "Where to write one PNG per model "
                    "(<model>.png: the strategy beside its reference plans).")
FLAGS = flags.FLAGS


def strategy_of(name: str) -> dict:
    """The searched plan of ``name``, per template instance and uncovered weighted node."""
    import tapas
    from tapas import models
    from tapas.planning.cluster import Cluster
    from tapas.planning.search import search
    entry = models.get(name)
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec()), name=name)
    s = search(graph, cluster=Cluster.v100_ethernet(1, FLAGS.devices))
    if FLAGS.png_dir:
        from tapas.planning.draw import draw_strategy
        wanted = (("megatron", "ffn-only", "mha-only") if name.startswith(("t5", "bert"))
                  else ("expert", "data-parallel") if name.startswith("moe")
                  else ("data-parallel",))
        refs = [r for r in wanted if any(a.name == r for a in s.references)]
        png = draw_strategy(s, graph, os.path.join(FLAGS.png_dir, f"{name}.png"),
                            references=refs)
        print(f"  {name}: drawn to {png}", flush=True)
    from tapas.planning.draw import strategy_rows
    templates: list[dict] = []   # the drawing's rows, grouped: each template, then the rest
    loose: list[dict] = []
    for row in strategy_rows(s, graph):
        if "template" in row:
            if row["template"] is not None:
                templates.append({"id": row["template"], "instances": row["instances"],
                                  "nodes": []})
            current = templates[-1]["nodes"] if row["template"] is not None else loose
        else:
            current.append(row)
    compare = {}
    for alt in s.references:
        if alt.name in ("megatron", "data-parallel") and not alt.error:
            compare[alt.name] = {"cost": alt.cost, "differs": len(alt.changes)}
    return {"model": name, "cost": s.total_cost, "templates": templates, "uncovered": loose,
            "references": compare, "graph_nodes": len(graph.nodes)}


def say(r: dict) -> None:
    print(f"\n{r['model']}: {r['cost'] * 1e3:.2f} ms per step on {FLAGS.devices} V100s; "
          + ", ".join(f"{k} {v['cost'] * 1e3:.2f} ms ({v['differs']} GraphNodes differ)"
                      for k, v in r["references"].items()))
    for t in r["templates"]:
        print(f"  T{t['id']} x{t['instances']}:")
        for n in t["nodes"]:
            print(f"    {n['kind']:<18} {n['pattern']:<14} "
                  + "; ".join(n["weights"] + n["collectives"]))
    if r["uncovered"]:
        print("  outside the templates (with weights or collectives):")
        for n in r["uncovered"]:
            print(f"    {n['kind']:<18} {n['pattern']:<14} "
                  + "; ".join(n["weights"] + n["collectives"]))


def main(argv: list[str]) -> None:
    del argv
    print(f"Figure 9: the strategies found on one node of {FLAGS.devices} V100s (gp; the "
          "cost model's choice)")
    rows = [strategy_of(name) for name in FLAGS.models]
    for r in rows:
        say(r)
    out = {"figure": "TAPAS Figure 9", "predicted": True, "devices": FLAGS.devices,
           "machine": report.machine(), "rows": rows}
    if FLAGS.json_out:
        report.write_json(FLAGS.json_out, out)


if __name__ == "__main__":
    app.run(main)
