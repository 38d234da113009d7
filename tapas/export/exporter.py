"""Export a TAPAS Strategy as a Keras 3 distribution layout, and cost a layout edited by hand.

In:  a ``Strategy`` (``tapas.search``'s, or ``Strategy.load``'s) and the ``tapas.ir.Graph``
     it was searched on; optionally the mesh (``None``: ``1 x N``, the strategy's N devices
     on the model axis; ``"RxC"`` or a ``tapas.planning.mesh.Mesh`` whose COLS are the
     strategy's devices: a row's strategy from ``tapas search --mesh``, data parallel over
     the ROWS on the batch axis) and the ``CostOptions`` the strategy was searched with.
Out: :func:`export_layout` -> :class:`tapas.export.layouts.LayoutExport`; :func:`layout_map`
     -> the ``keras.distribution.LayoutMap``; :func:`cost_layout` -> :class:`LayoutCost`,
     the cheapest plan with a (possibly hand-edited) layout's weight placements, its cost
     and what differs from the strategy.
Raises: ``ValueError`` when the strategy is not the graph's, the mesh's columns are not the
     strategy's devices, or a layout does not fit the graph's weights
     (``tapas.export.layouts``).

A weight's layout is its placement in the first GraphNode that reads it (where the program
stores it; a tied weight read in another placement is resharded there, by TAPAS and by
GSPMD alike). A LayoutMap pins weights only: everything else is left to GSPMD's
propagation. What it cannot pin is found with the cost model: the cheapest plan whose
weights are placed as exported (``tapas.planning.search.plan_with_weights``) is compared
with the strategy GraphNode by GraphNode; where they differ the export lists the
GraphNodes, the pattern TAPAS chose, the one the weight layouts imply, and the cost of the
difference (seconds per step). The activations the map leaves open (GraphNodes whose
pattern the weight layouts, the pinned layer outputs and the model inputs do not determine,
with what GSPMD's propagation may take instead and its cost) are found by
:func:`tapas.export.open_nodes.open_patterns` and listed beside them
(``Unexpressed.kind == "activations"``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tapas.ir import Graph
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions, comm_cost
from tapas.planning.devicemesh import MODEL
from tapas.planning.mesh import Mesh, gradient_all_reduce
from tapas.planning.precision import resolve
from tapas.planning.search import plan_with_weights
from tapas.planning.strategy import Strategy
from tapas.planning.table import EdgeCoster, pattern_table
from tapas.sharding.placements import Placement, Replica, parse_placement
from tapas.export.layouts import LayoutExport, Unexpressed, axes_for, placements_from_layouts
from tapas.export.open_nodes import open_patterns
from tapas.export.outputs import layer_paths, output_layouts, pinned_outputs

__all__ = ["export_layout", "layout_map", "cost_layout", "LayoutCost", "stored_placements"]


def _mesh(mesh: Any, strategy: Strategy) -> Mesh:
    n = strategy.num_devices
    if mesh is None:
        return Mesh(1, n)
    if isinstance(mesh, str):
        mesh = Mesh.parse(mesh)
    elif isinstance(mesh, (tuple, list)):
        mesh = Mesh(*mesh)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r}: give None, 'ROWSxCOLS', (rows, cols) or a "
                         "tapas.planning.mesh.Mesh")
    if mesh.experts:
        raise ValueError(f"mesh {mesh}: experts split over the rows have no LayoutMap form in "
                         "this export: export the row's strategy on the plain mesh "
                         f"{mesh.rows}x{mesh.cols}")
    if mesh.cols != n:
        raise ValueError(f"mesh {mesh.rows}x{mesh.cols}: its {mesh.cols} columns must be the "
                         f"strategy's {n} devices (a row's strategy, from `tapas search "
                         f"--mesh={mesh.rows}x{n}`); or pass mesh=None for 1x{n}")
    return mesh


def stored_placements(strategy: Strategy, graph: Graph) -> dict[str, Placement]:
    """Weight path -> the placement the program stores it in (its first reader's), for
    every weight of ``graph`` (replicated for one no GraphNode reads)."""
    out: dict[str, Placement] = {}
    for node in graph.nodes:
        pattern = strategy.pattern(node.id)
        for w in node.weights:
            if graph.reads(node.id, w.path) and w.path not in out:
                out[w.path] = pattern.weights[w.path]
    return {w.path: out.get(w.path, Replica()) for w in graph.weights}


def _options(strategy: Strategy, graph: Graph, options: CostOptions | None) -> CostOptions:
    options = CostOptions.for_cluster(strategy.cluster) if options is None else options
    if strategy.precision and options.precision is None:
        options = dataclasses.replace(options, precision=strategy.precision)
    return resolve(options, graph)[0]


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """The cheapest plan with a layout's weight placements (``placements``: path ->
    placement, every weight): its cost (seconds per step, ``total``/``communication``/
    ``compute``), its pattern per GraphNode, the weights no pattern could place as given
    (``unmapped``: path -> why), and against the ``strategy`` compared with: the weights
    placed otherwise (``changed``: path -> (strategy's, layout's)), the GraphNodes whose
    pattern differs (id -> (strategy's, layout's)) and the cost difference."""

    placements: Mapping[str, str]
    total: float
    communication: float
    compute: float
    patterns: tuple[str, ...]
    unmapped: Mapping[str, str]
    changed: Mapping[str, tuple[str, str]]
    node_changes: Mapping[int, tuple[str, str]]
    strategy_total: float
    strategy_communication: float = 0.0
    strategy_compute: float = 0.0

    @property
    def difference(self) -> float:
        return self.total - self.strategy_total

    def explain(self, graph: Graph, max_rows: int = 12) -> str:
        share = (f" ({self.difference / self.strategy_total:+.1%})"
                 if self.strategy_total else "")
        lines = [f"the layout's plan: {self.total * 1e3:.4f} ms per step (communication "
                 f"{self.communication * 1e3:.4f}, compute {self.compute * 1e3:.4f}); the "
                 f"strategy: {self.strategy_total * 1e3:.4f} ms; difference "
                 f"{self.difference * 1e3:+.4f} ms{share}: communication "
                 f"{(self.communication - self.strategy_communication) * 1e3:+.4f} ms, "
                 f"compute {(self.compute - self.strategy_compute) * 1e3:+.4f} ms"]
        for path, (old, new) in list(self.changed.items())[:max_rows]:
            lines.append(f"  weight {path}: {old} in the strategy, {new} in the layout")
        for v, (old, new) in list(self.node_changes.items())[:max_rows]:
            lines.append(f"  GraphNode {v} '{graph.nodes[v].name}': {old} -> {new}")
        if len(self.node_changes) > max_rows:
            lines.append(f"  ... {len(self.node_changes) - max_rows} more GraphNodes")
        for path, why in self.unmapped.items():
            lines.append(f"  not placed as given: {path}: {why}")
        return "\n".join(lines)


def cost_layout(strategy: Strategy, graph: Graph, placements: Mapping[str, str] | LayoutExport,
                options: CostOptions | None = None, mode: str = "gp") -> LayoutCost:
    """Cost the plan of ``placements`` (path -> placement, or a LayoutExport, e.g. a
    layout edited by hand and read with ``load_layout``) against ``strategy``."""
    strategy = strategy.bind(graph)
    if isinstance(placements, LayoutExport):
        cols = placements.mesh_shape[1]
        if cols != strategy.num_devices:
            raise ValueError(f"the layout's mesh {placements.mesh_shape[0]}x{cols} splits "
                             f"weights over {cols} devices, the strategy over "
                             f"{strategy.num_devices}: edit a layout exported for this "
                             "strategy, or export one for the other mesh")
        placements = placements_from_layouts(placements,
                                             {w.path: len(w.shape) for w in graph.weights})
    placements = {w.path: str(parse_placement(placements.get(w.path, "R")))
                  for w in graph.weights}
    opts = _options(strategy, graph, options)
    given = plan_with_weights(graph, placements, cluster=strategy.cluster, options=opts,
                              mode=mode)
    stored = {path: str(p) for path, p in stored_placements(strategy, graph).items()}
    changed = {p: (stored[p], placements[p]) for p in placements if stored[p] != placements[p]}
    node_changes = {v: (strategy.patterns[v], name) for v, name in enumerate(given.patterns)
                    if name != strategy.patterns[v]}
    c = given.cost
    # the same patterns are the same plan: the strategy's recorded cost is its cost
    same = not node_changes
    return LayoutCost(placements, c.total, c.communication, c.compute, given.patterns,
                      dict(given.unmapped), changed, node_changes,
                      c.total if same else strategy.total_cost,
                      c.communication if same else float(strategy.cost["communication"]),
                      c.compute if same else float(strategy.cost["compute"]))


def _unexpressed(graph: Graph, strategy: Strategy, stored: Mapping[str, Placement],
                 cost: LayoutCost) -> tuple[Unexpressed, ...]:
    """The GraphNodes whose pattern the weight layouts do not pin, grouped by (chosen,
    emitted) pattern and reason: a weight read here in another placement than it is
    stored (a tied embedding: a LayoutMap gives a weight one layout), or patterns that
    differ in activations only (a LayoutMap places no activation)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for v, (chosen, emitted) in cost.node_changes.items():
        pattern = strategy.pattern(v)
        tied = [f"{w.path} ({pattern.weights[w.path]}, stored {stored[w.path]})"
                for w in graph.nodes[v].weights if graph.reads(v, w.path)
                and pattern.weights[w.path] != stored[w.path]]
        why = (f"it reads {', '.join(tied)} in another layout than its first reader stores "
               "it, and a LayoutMap gives a weight one layout" if tied else
               "the two patterns place its weights alike and differ in activations, which "
               "a LayoutMap does not place")
        groups.setdefault((chosen, emitted, why), []).append(v)
    return tuple(Unexpressed(
        tuple((v, graph.nodes[v].name) for v in nodes), chosen, emitted,
        f"{why}; GSPMD's propagation decides these GraphNodes. The cheapest plan with the "
        f"exported layouts takes {emitted!r} here: {cost.difference * 1e3:+.4f} ms per "
        "step for the whole plan under the cost model")
        for (chosen, emitted, why), nodes in sorted(groups.items()))


def predicted_collectives(strategy: Strategy, graph: Graph, mesh: Mesh,
                          options: CostOptions, cluster: Cluster | None = None
                          ) -> list[dict[str, Any]]:
    """The collectives a training step of ``strategy`` runs (the TAPAS audit's prediction,
    ``tapas.execution.checking.audit.predicted_comm_list``), grouped by (kind, phase, tensor,
    bytes) with their count and seconds each under the cost model; on a mesh with rows,
    the data-parallel gradient all-reduce of every trainable weight's local shard over the
    column, priced on ``cluster`` (the whole mesh's; default: the mesh's own, made by
    ``cluster.mesh(rows, cols)``, else :func:`_whole_cluster`)."""
    from tapas.execution.checking.audit import predicted_comm_list
    n = strategy.num_devices
    weights = {w.placeholder + ":0" for w in graph.weights}
    rows: Counter = Counter()
    seconds: dict[tuple, float] = {}
    row_axis = strategy.cluster.axis(n, name=MODEL)   # the row's mesh axis, as searched
    for c in predicted_comm_list(strategy, graph):
        key = (c.kind.value, c.phase, c.tensor, int(c.bytes), n)
        rows[key] += 1
        seconds[key] = comm_cost(c, row_axis, options, weights=weights).total
    split = stored_placements(strategy, graph)
    whole = cluster or mesh.cluster or _whole_cluster(strategy, mesh)
    for term in gradient_all_reduce(graph, split, mesh.on(whole), options).terms:
        key = ("AR", "bwd", term.label.removeprefix("dp "), int(term.nbytes), mesh.rows)
        rows[key] += 1
        seconds[key] = term.total
    return [{"kind": k[0], "phase": k[1], "tensor": k[2], "bytes": k[3], "group": k[4],
             "count": cnt, "seconds": seconds[k]} for k, cnt in rows.items()]


def _whole_cluster(strategy: Strategy, mesh: Mesh) -> Cluster:
    """The cluster of the whole mesh when only the row's is known: one row's cluster per
    row, each on its own nodes."""
    if mesh.rows == 1:
        return strategy.cluster
    row = strategy.cluster
    return dataclasses.replace(row, name=f"{row.name} x {mesh.rows} rows",
                               num_nodes=row.num_nodes * mesh.rows)


def export_layout(strategy: Strategy, graph: Graph, mesh: Any = None,
                  options: CostOptions | None = None, mode: str = "gp",
                  cluster: Cluster | None = None, layers: Any = None,
                  outputs: str = "all") -> LayoutExport:
    """The LayoutExport of ``strategy`` on ``graph`` (see the module docstring); ``cluster``
    is the whole mesh's (it prices the data-parallel all-reduces over the rows; default:
    the cluster of a mesh made by ``cluster.mesh(rows, cols)``, else each row on its own
    nodes). ``layers``: the Keras model (or its layer paths) whose
    layer outputs to pin (:mod:`tapas.export.outputs`; ``outputs``: ``"all"`` split and
    replicated, ``"split"`` the split ones only, ``"none"``); None pins no output. On a mesh with
    rows no output is pinned (an activation's rows split is Keras's batch axis)."""
    strategy = strategy.bind(graph)
    mesh = _mesh(mesh, strategy)
    stored = stored_placements(strategy, graph)
    layouts, weights, replicated = {}, {}, []
    for w in graph.weights:
        axes = axes_for(stored[w.path], len(w.shape))
        if axes is None:
            replicated.append(w.path)
            continue
        layouts[re.escape(w.path)] = axes
        weights[w.path] = str(stored[w.path])
    opts = _options(strategy, graph, options)
    cost = cost_layout(strategy, graph, stored, opts, mode)
    pinned: dict[str, Any] = {}
    tensors: dict[str, Placement] = {}
    if layers is not None and outputs != "none" and mesh.rows == 1:
        paths = layer_paths(layers)
        pinned = output_layouts(strategy, graph, paths, outputs)[0]
        tensors = pinned_outputs(strategy, graph, paths, outputs)
    table = pattern_table(graph, strategy.num_devices, strategy.cluster, opts)
    edges = EdgeCoster(strategy.num_devices, strategy.cluster, opts,
                       gradients=table.gradients)
    gaps = _unexpressed(graph, strategy, stored, cost) + open_patterns(
        strategy, graph, table, edges, stored, tensors, frozenset(cost.node_changes))
    return LayoutExport(
        strategy.graph_name, strategy.graph_digest, strategy.cluster.name,
        (mesh.rows, mesh.cols), layouts, weights, tuple(replicated), gaps,
        {"strategy": cost.strategy_total, "layout_map": cost.total,
         "difference": cost.difference},
        tuple(predicted_collectives(strategy, graph, mesh, opts, cluster)),
        outputs=pinned)


def layout_map(strategy: Strategy, graph: Graph, mesh: Any = None,
               devices: Any = None, layers: Any = None) -> Any:
    """The ``keras.distribution.LayoutMap`` of ``strategy`` (``export_layout(...)
    .to_keras(devices)``; ``layers``: the model, to pin its layer outputs)."""
    return export_layout(strategy, graph, mesh, layers=layers).to_keras(devices)
