"""``tapas export``: a model's strategy as a Keras 3 distribution LayoutMap (JAX backend),
and the cost of a layout edited by hand.

In:  the model flags, the cluster (``--cluster``, ``--nodes``, ``--devices_per_node``),
     ``--strategy`` (a Strategy JSON; default: search it here, as ``tapas search`` does),
     ``--mesh=ROWSxCOLS`` (data parallel over the rows: the row's strategy on COLS devices),
     ``--format``, ``--out`` (``.json`` or ``.py``), ``--pin_from`` (a layout to cost).
Out: the layout written to ``--out`` and summarised (keys, replicated weights, what the
     layouts cannot pin and its cost, the predicted collectives); with ``--pin_from`` the
     cheapest plan with that layout's weight placements, its cost and its difference from
     the strategy. The report is returned as a dict (``--json_out``).
Raises: ``absl.app.UsageError`` naming the flag, the value and the fix.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from absl import app, flags

from tapas.cli.common import FLAGS, capture_flags_model

flags.DEFINE_enum("format", "keras-layoutmap", ["keras-layoutmap"], "export: the plan's form: "
                  "a Keras 3 keras.distribution LayoutMap (JSON for --out=*.json, a Python "
                  "module building it with Keras alone for --out=*.py).")
flags.DEFINE_string("pin_from", None, "export: a layout file (JSON or .py from `tapas "
                    "export`, possibly edited by hand): cost the cheapest plan with its "
                    "weight placements and explain how it differs from the strategy.")

SUMMARY = 'export a strategy as a Keras 3 distribution LayoutMap (JAX backend), or cost one'
USAGE = ('tapas export --model=NAME|path.keras --nodes=M --devices_per_node=N '
         '[--strategy=s.json] [--mesh=ROWSxCOLS] --format=keras-layoutmap '
         '--out=layout.json|layout.py [--pin_from=edited.json]')
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('model', 'batch_size', 'training', 'nodes', 'devices_per_node', 'cluster',
              'mode', 'strategy', 'mesh', 'format', 'out', 'pin_from', 'json_out')


def _check_flags() -> Any:
    """The mesh of ``--mesh`` (or None), after checking the paths the command reads and
    writes before anything is captured."""
    if not FLAGS.out and not FLAGS.pin_from:
        raise app.UsageError("--out is required: give the layout's path, --out=layout.json "
                             "(JSON) or --out=layout.py (a Python module); or --pin_from="
                             "layout.json to cost a layout")
    if FLAGS.out and os.path.splitext(FLAGS.out)[1] not in (".json", ".py"):
        raise app.UsageError(f"--out={FLAGS.out}: the layout is written as JSON (.json) or "
                             "as a Python module (.py): end the path with one of them")
    if FLAGS.out and os.path.dirname(FLAGS.out) and not os.path.isdir(
            os.path.dirname(FLAGS.out)):
        raise app.UsageError(f"--out={FLAGS.out}: directory {os.path.dirname(FLAGS.out)} "
                             "does not exist: create it or write elsewhere")
    for name in ("strategy", "pin_from"):
        path = FLAGS[name].value
        if path and not os.path.isfile(path):
            raise app.UsageError(f"--{name}={path}: no such file; give the path of a "
                                 + ("Strategy JSON (`tapas search --out=s.json`)"
                                    if name == "strategy" else
                                    "layout written by `tapas export --out=layout.json`"))
    if not FLAGS.mesh:
        return None
    from tapas.planning.mesh import Mesh
    try:
        mesh = Mesh.parse(FLAGS.mesh)
    except ValueError as e:
        raise app.UsageError(f"--mesh={FLAGS.mesh}: {e}") from None
    if mesh.experts:
        raise app.UsageError(f"--mesh={FLAGS.mesh}: ':experts' has no LayoutMap form in this "
                             f"export; use --mesh={mesh.rows}x{mesh.cols}")
    return mesh


def _row_graph(graph: Any, trace: Any, loaded: Any, rows: int) -> Any:
    """The graph of one mesh row: the model captured at the batch over ``rows``."""
    if rows == 1:
        return graph
    import tensorflow as tf

    from tapas import capturing
    from tapas.execution.runtime.inputs import InputSignature
    batch = int(tf.nest.flatten(trace.input_specs)[0].shape[0])
    if batch % rows:
        raise app.UsageError(f"--mesh={FLAGS.mesh}: the batch {batch} does not split into "
                             f"{rows} rows: give --batch_size as a multiple of {rows}")
    specs = InputSignature.of(loaded.model, loaded.specs).per_row(rows).spec_structure()
    return capturing.capture(loaded.model, specs, training=bool(FLAGS.training),
                             name=f"{loaded.name}/batch{batch // rows}")


def _strategy(graph: Any, cluster: Any, mesh: Any, loss: Any) -> Any:
    """``--strategy`` read against ``graph``, or the strategy searched here (on the row's
    cluster with ``--mesh``)."""
    from tapas.planning.search import search
    from tapas.planning.strategy import Strategy
    cols = cluster.num_devices if mesh is None else mesh.cols
    if FLAGS.strategy:
        try:
            return Strategy.load(FLAGS.strategy, graph, cols)
        except ValueError as e:
            raise app.UsageError(f"--strategy={FLAGS.strategy}: {e}") from None
    sub = cluster
    if mesh is not None:
        try:
            sub = mesh.on(cluster).row_cluster
        except ValueError as e:
            raise app.UsageError(f"--mesh={FLAGS.mesh}: {e}") from None
    print(f"searching ({FLAGS.mode}) '{graph.name}' on {sub.name} ({sub.num_devices} "
          "devices)", flush=True)
    try:
        return search(graph, cluster=sub, mode=FLAGS.mode, loss=loss)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def cmd_export() -> dict[str, Any]:
    from tapas.cli.search_cmd import _flags_cluster
    from tapas.export import cost_layout, export_layout, load_layout
    from tapas.planning.cost import CostOptions
    mesh = _check_flags()
    cluster = _flags_cluster()
    if mesh is not None and mesh.num_devices != cluster.num_devices:
        raise app.UsageError(f"--mesh={FLAGS.mesh} has {mesh.num_devices} devices, the "
                             f"cluster {cluster.num_devices} (--nodes x --devices_per_node)")
    graph, trace, _, loaded = capture_flags_model()
    graph = _row_graph(graph, trace, loaded, 1 if mesh is None else mesh.rows)
    strategy = _strategy(graph, cluster, mesh, loaded.loss)
    options = CostOptions.for_cluster(strategy.cluster, loss=_loss_spec(loaded.loss))
    try:
        layout = export_layout(strategy, graph, mesh, options, mode=FLAGS.mode,
                               cluster=cluster, layers=loaded.model)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    report: dict[str, Any] = {"model": graph.name, "layout": layout.to_json()}
    _say(layout)
    if FLAGS.out:
        layout.save(FLAGS.out)
        print(f"\nlayout written to {FLAGS.out}")
    if FLAGS.pin_from:
        try:
            cost = cost_layout(strategy, graph, load_layout(FLAGS.pin_from), options,
                               mode=FLAGS.mode)
        except ValueError as e:
            raise app.UsageError(f"--pin_from={FLAGS.pin_from}: {e}") from None
        print(f"\n--pin_from={FLAGS.pin_from}:")
        print(cost.explain(graph))
        report["pinned"] = {"total": cost.total, "communication": cost.communication,
                            "compute": cost.compute, "strategy": cost.strategy_total,
                            "difference": cost.difference,
                            "changed": {k: list(v) for k, v in cost.changed.items()},
                            "node_changes": {str(k): list(v) for k, v in
                                             cost.node_changes.items()},
                            "unmapped": dict(cost.unmapped)}
    return report


def _loss_spec(loss: Any) -> Any:
    if loss is None:
        return None
    from tapas.sharding.losses import LossSpec
    return LossSpec.of(loss)


def _say(layout: Any) -> None:
    rows, cols = layout.mesh_shape
    print(f"'{layout.model}' on a {rows}x{cols} DeviceMesh {tuple(layout.axis_names)}: "
          f"{len(layout.layouts)} weight(s) split over '{layout.axis_names[1]}', "
          f"{len(layout.replicated)} replicated (no entry), {len(layout.outputs)} layer "
          "output(s) pinned")
    for key, axes in list(layout.layouts.items())[:8]:
        print(f"  {key}: {tuple(axes)}")
    if len(layout.layouts) > 8:
        print(f"  ... {len(layout.layouts) - 8} more")
    c = layout.cost
    print(f"cost model: strategy {c['strategy'] * 1e3:.4f} ms per step, the layouts' plan "
          f"{c['layout_map'] * 1e3:.4f} ms ({c['difference'] * 1e3:+.4f} ms)")
    for u in layout.unexpressed:
        names = ", ".join(f"{i} '{n}'" for i, n in u.nodes[:4])
        more = f" and {len(u.nodes) - 4} more" if len(u.nodes) > 4 else ""
        if u.kind == "activations":
            alts = ", ".join(f"{a!r} ({c * 1e3:+.4f} ms)" for a, c in u.alternatives[:3])
            print(f"  activations open: GraphNode(s) {names}{more}: TAPAS chose "
                  f"{u.chosen!r}, GSPMD's propagation may take {alts}")
            continue
        print(f"  not pinned: GraphNode(s) {names}{more}: TAPAS chose {u.chosen!r}, the "
              f"layouts give {u.emitted!r}")
    kinds: Counter = Counter()
    for p in layout.predicted:
        kinds[(p["kind"], p["phase"])] += p["count"]
    text = ", ".join(f"{n} {k} {ph}" for (k, ph), n in sorted(kinds.items()))
    print(f"predicted collectives per training step: {text or 'none'}")
