"""Reproduce the paper's Figure 9: the strategies TAPAS finds, drawn per unique subgraph.

    python scripts/figure9_strategies.py [--models=t5-large,resnet50-100k,moe-1.3b]
        [--devices=8] [--json_out=out/figure9_strategies.json] [--png_dir=out/figure9]

For each model, searched (gp) on one node of ``--devices`` V100s (``Cluster.v100_ethernet``):
the pattern of every GraphNode of one instance of each template (the unique subgraph; every
instance gets the same plan), and of the GraphNodes with weights that no template covers,
with each weight's split and the GraphNodes where the plan differs from the Megatron
reference (transformers) or from data parallelism. The plan is the cost model's choice (no
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
    table = s._table
    family = {v: {i.name: str(getattr(i, "family", "") or "") for i in table.infos[v]}
              for v in range(len(graph.nodes))}

    def node_row(v: int) -> dict:
        node = graph.nodes[v]
        pattern = s.patterns[v]
        return {"id": v, "kind": node.kind.value, "name": node.name, "pattern": pattern,
                "family": family[v].get(pattern, ""),
                "weights": {w.path.split("/")[-2] + "/" + w.path.split("/")[-1]
                            if "/" in w.path else w.path: s.weight_placements.get(w.path, "R")
                            for w in node.weights}}

    templates = []
    covered = set()
    for tid, tname, instances in s.templates:
        first = sorted(instances[0])
        covered.update(v for inst in instances for v in inst)
        templates.append({"id": tid, "name": tname, "instances": len(instances),
                          "nodes": [node_row(v) for v in first]})
    loose = [node_row(v) for v in range(len(graph.nodes))
             if v not in covered and graph.nodes[v].weights]
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
            w = ", ".join(f"{k}:{v}" for k, v in n["weights"].items())
            print(f"    {n['kind']:<18} {n['pattern']:<14} {w}")
    if r["uncovered"]:
        print("  outside the templates (with weights):")
        for n in r["uncovered"]:
            w = ", ".join(f"{k}:{v}" for k, v in n["weights"].items())
            print(f"    {n['kind']:<18} {n['pattern']:<14} {w}")


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
