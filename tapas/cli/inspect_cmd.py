"""``tapas inspect``: capture ``--model`` and print what the IR holds.

In:  ``--model``, ``--batch_size``, ``--training``, ``--top``, ``--graph_out``, ``--json_out``.
Out: the report (printed, and returned as a dict): TF ops, GraphNodes by kind, parameters,
     capture time, the largest GraphNodes; ``--graph_out`` the IR as JSON.
Raises: ``absl.app.UsageError`` for an unknown model.
"""

from __future__ import annotations

from typing import Any

from absl import flags

from tapas import ir
from tapas.cli.common import FLAGS, capture_flags_model, write

flags.DEFINE_string("graph_out", None, "inspect: write the captured IR as JSON to this path.")
flags.DEFINE_integer("top", 10, "inspect: how many of the largest GraphNodes to list.")

SUMMARY = ('capture a model and print its IR: ops, GraphNodes by kind, parameters, the largest'
           ' nodes')
USAGE = 'tapas inspect --model=NAME [--batch_size=N] [--graph_out=ir.json] [--top=10]'
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('model', 'batch_size', 'training', 'top', 'graph_out', 'json_out')


def inspect_report(graph: ir.Graph, trace_s: float, ir_s: float, tf_ops: int,
                   top: int = 10) -> dict[str, Any]:
    """The numbers `tapas inspect` prints, as a dict."""
    biggest = sorted(graph.nodes, key=lambda n: -n.num_params)[:top]
    return {
        "model": graph.name,
        "tf_ops": tf_ops,
        "ir_ops": graph.num_ops,
        "dead_ops": len(graph.dead_ops),
        "graph_nodes": len(graph.nodes),
        "edges": len(graph.edges),
        "kinds": graph.kind_counts(),
        "unique_signatures": len({n.signature for n in graph.nodes}),
        "params": graph.num_params,
        "weights": len(graph.weights),
        "unused_weights": [w.path for w in graph.unused_weights],
        "trace_seconds": round(trace_s, 4),
        "ir_seconds": round(ir_s, 4),
        "top_nodes": [{"id": n.id, "name": n.name, "kind": n.kind.value, "params": n.num_params,
                       "weights": [f"{w.path} {list(w.shape)}" for w in n.weights]}
                      for n in biggest if n.num_params > 0],
    }


def format_inspect(r: dict[str, Any]) -> str:
    lines = [f"model            {r['model']}",
             f"TF ops           {r['tf_ops']:,}  ({r['dead_ops']} dead, in no GraphNode)",
             f"GraphNodes       {r['graph_nodes']:,}  ({r['unique_signatures']} distinct "
             f"signatures, {r['edges']:,} edges)",
             f"parameters       {r['params']:,}  in {r['weights']} weights",
             f"capture time     {r['trace_seconds'] + r['ir_seconds']:.3f} s  (trace "
             f"{r['trace_seconds']:.3f} s, IR conversion {r['ir_seconds']:.3f} s)",
             "", "GraphNodes by kind:"]
    for kind, count in r["kinds"].items():
        lines.append(f"  {kind:<18} {count:>6}")
    if r["unused_weights"]:
        lines.append(f"\nweights the traced graph never reads: {', '.join(r['unused_weights'])}")
    lines += ["", f"largest GraphNodes by weight size (top {len(r['top_nodes'])}):",
              f"  {'id':>5}  {'kind':<16} {'params':>14}  name"]
    for n in r["top_nodes"]:
        lines.append(f"  {n['id']:>5}  {n['kind']:<16} {n['params']:>14,}  {n['name']}")
    return "\n".join(lines)


def cmd_inspect() -> dict[str, Any]:
    graph, trace, ir_s, _ = capture_flags_model()
    report = inspect_report(graph, trace.seconds, ir_s, len(trace.graph.get_operations()),
                            FLAGS.top)
    print(format_inspect(report))
    if FLAGS.graph_out:
        write(FLAGS.graph_out, graph.dumps())
        print(f"\nIR written to {FLAGS.graph_out}")
    return report
