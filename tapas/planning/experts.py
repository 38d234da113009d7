"""Nested expert + tensor parallelism on a 2-D mesh (the paper's Figure 8 plan).

On a ``rows x cols`` mesh the model runs data parallel over the rows and a tensor-parallel
strategy inside each row (``tapas.planning.mesh``). Nested expert + tensor parallelism also
splits the *experts* of every MoE expert einsum over the rows: the devices of one mesh
column (one device per row) exchange the dispatched tokens with an all-to-all, so that row
``i`` runs experts ``i * E/rows ..`` on the tokens of *every* row, each expert's
feed-forward split over the row's devices by the row's strategy (column / row, as Megatron
splits a dense MLP); a second all-to-all sends the expert outputs back. Expert weights are
then held once per column (no data-parallel gradient all-reduce for them), every other
weight once per row as in DP x TP.

In:  a captured ``Graph`` of one mesh row (the model at batch B / rows) and the number of
     rows; for pricing, the row's ``Strategy`` and the mesh on its cluster (``Mesh``).
Out: :class:`ExpertRegion` (the GraphNodes that run on the exchanged tokens, the tensors
     crossing into and out of them, the weights split over the rows), :func:`row_view`
     (the row's graph as each device sees it inside the region: ``[E, G, ...]`` tensors
     become ``[E / rows, G * rows, ...]``, expert weights ``[E / rows, ...]``),
     :func:`nested_patterns` (a ``patterns_fn`` for ``tapas.search``: inside the region no
     pattern may split the expert or group axis, which the all-to-all moves), and
     :func:`column_all_to_all` / :func:`expert_memory_saving` (what the nesting adds to and
     takes from the row's cost).

The region is every ``expert-einsum`` GraphNode (and any GraphNode fed only by the region
and read only by it, e.g. an activation between two expert einsums). Its activations must
lead with the expert axis ``E`` (the expert weights' axis 0) and then the group axis, as
GShard's ``[E, G, C, M]`` dispatched tokens do; shape-dependent ops (reshapes, slices,
shape reads) inside the region are refused, since their constants hold the single-device
shapes.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tapas.ir import Graph, GraphNode, Kind, TensorInfo, WeightInfo
from tapas.planning.devicemesh import DATA, Mesh
from tapas.planning.cost import CostBreakdown, CostOptions, MemoryEstimate, collective_cost, \
    weight_memory
from tapas.planning.precision import priced_dtype
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["ExpertRegion", "NestingError", "row_view", "nested_patterns", "allowed_pattern",
           "column_all_to_all", "expert_memory_saving"]

# ops whose inputs or outputs carry the single-device shapes (refused inside the region)
_SHAPE_OPS = frozenset({"Reshape", "BroadcastTo", "Fill", "Slice", "StridedSlice", "Shape",
                        "ShapeN", "Size", "Rank", "Tile", "Pad", "PadV2", "Split", "SplitV",
                        "ConcatV2", "Pack", "Unpack", "Transpose", "GatherV2"})


class NestingError(ValueError):
    """The graph has no expert region that nested expert + tensor parallelism can split."""


@dataclasses.dataclass(frozen=True)
class ExpertRegion:
    """The GraphNodes that run on the exchanged tokens of one model (every MoE layer).

    ``experts``: E, the expert axis (axis 0 of the expert weights and of the region's
    activations); ``entries``: tensors the region reads from outside (the dispatched
    tokens), ``exits``: region outputs read outside it (the expert outputs), each with its
    single-device shape; ``weights``: paths of the weights split over the mesh rows on
    axis 0; ``activations``: names of the region's tensors that carry tokens (their axis 1,
    the groups, grows by the rows)."""

    nodes: frozenset[int]
    experts: int
    entries: tuple[TensorInfo, ...]
    exits: tuple[TensorInfo, ...]
    weights: tuple[str, ...]
    activations: frozenset[str]

    @staticmethod
    def of(graph: Graph, rows: int | None = None) -> ExpertRegion:
        """The region of ``graph``; with ``rows``, also check that E splits into them.

        Raises :class:`NestingError` naming the GraphNode, tensor or op that stops it."""
        experts = [n for n in graph.nodes if n.kind is Kind.EXPERT_EINSUM]
        if not experts:
            raise NestingError(f"graph '{graph.name}' has no expert einsum (GraphNode kind "
                               "'expert-einsum', a stacked [E, ...] expert weight): nested "
                               "expert + tensor parallelism needs an MoE layer; use a plain "
                               "ROWSxCOLS mesh")
        producer = {t.name: n.id for n in graph.nodes for t in n.outputs}
        readers: dict[str, set[int]] = {}
        for n in graph.nodes:
            for t in n.inputs:
                readers.setdefault(t.name, set()).add(n.id)
        outputs = {t.name for t in graph.outputs}
        region = {n.id for n in experts}
        grown = True
        while grown:   # GraphNodes between expert einsums (fed and read only by the region)
            grown = False
            for n in graph.nodes:
                if n.id in region or not n.inputs:
                    continue
                fed = all(producer.get(t.name) in region for t in n.inputs)
                read = all(readers.get(t.name) and readers[t.name] <= region
                           and t.name not in outputs for t in n.outputs)
                if fed and read:
                    region.add(n.id)
                    grown = True
        nodes = [n for n in graph.nodes if n.id in region]
        sizes = {w.shape[0] if w.shape else None for n in nodes for w in n.weights}
        if len(sizes) != 1 or None in sizes:
            raise NestingError(f"the expert weights of graph '{graph.name}' do not share one "
                               f"expert axis 0 (sizes {sorted(map(str, sizes))}): nested "
                               "expert + tensor parallelism splits axis 0 of every one")
        e = int(next(iter(sizes)))
        if rows is not None and e % rows:
            raise NestingError(f"{e} experts do not split into {rows} mesh rows: use a row "
                               f"count that divides {e}, or a plain ROWSxCOLS mesh")
        entries: dict[str, TensorInfo] = {}
        exits: dict[str, TensorInfo] = {}
        for n in nodes:
            label = f"GraphNode {n.id} '{n.name}'"
            bad = sorted({op.type for op in n.ops if op.type in _SHAPE_OPS})
            if bad:
                raise NestingError(f"{label} (in the expert region) has shape-dependent ops "
                                   f"{bad}: nested expert + tensor parallelism changes the "
                                   "region's local shapes; use a plain ROWSxCOLS mesh")
            for t in n.inputs:
                if producer.get(t.name) not in region:
                    entries.setdefault(t.name, t)
            for t in n.outputs:
                if t.name in outputs or (readers.get(t.name, set()) - region):
                    exits.setdefault(t.name, t)
        for t in list(entries.values()) + list(exits.values()):
            if t.shape is None or len(t.shape) < 2 or t.shape[0] != e:
                raise NestingError(f"tensor '{t.name}' of shape {t.shape} crosses the expert "
                                   f"region's boundary but does not lead with the {e} experts "
                                   "and a group axis ([E, G, ...]): nested expert + tensor "
                                   "parallelism exchanges such tensors only")
        activations = _activations(nodes, set(entries))
        for n in nodes:
            for op in n.ops:
                for t in op.outputs:
                    if t.name in activations and (t.shape is None or len(t.shape) < 2
                                                  or t.shape[0] != e):
                        raise NestingError(
                            f"GraphNode {n.id} '{n.name}': op '{op.name}' ({op.type}) makes "
                            f"'{t.name}' of shape {t.shape} from the tokens without the "
                            f"expert axis ({e}) in front: nested expert + tensor parallelism "
                            "needs every token tensor of the region as [E, G, ...]")
        weights = tuple(dict.fromkeys(w.path for n in nodes for w in n.weights))
        return ExpertRegion(frozenset(region), e, tuple(entries.values()),
                            tuple(exits.values()), weights, frozenset(activations))

    @functools.cached_property
    def boundary(self) -> dict[str, TensorInfo]:
        """The entries and exits by name (single-device shapes)."""
        return {t.name: t for t in self.entries + self.exits}

    @functools.cached_property
    def entry_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.entries)

    @functools.cached_property
    def exit_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.exits)

    def view_shape(self, name: str, shape: Sequence[int] | None, rows: int,
                   weight: bool = False) -> tuple[int, ...] | None:
        """The shape one row sees inside the region: a token tensor's ``[E, G, ...]`` as
        ``[E / rows, G * rows, ...]``, an expert weight's ``[E, ...]`` (and any other region
        tensor leading with E: the weight read, cast) as ``[E / rows, ...]``, anything else
        unchanged."""
        if shape is None:
            return None
        shape = tuple(int(d) for d in shape)
        if name in self.activations and not weight:
            return (shape[0] // rows, shape[1] * rows) + shape[2:]
        if shape and shape[0] == self.experts:   # a weight, or a value read from one
            return (shape[0] // rows,) + shape[1:]
        return shape


def _activations(nodes: Sequence[GraphNode], entries: set[str]) -> set[str]:
    """Names of the region's tensors computed from its entries (the tokens)."""
    acts = set(entries)
    for n in nodes:   # GraphNodes and their ops are in topological order
        for op in n.ops:
            if any(i.lstrip("^") in acts for i in op.inputs if not i.startswith("^")):
                acts.update(t.name for t in op.outputs)
    return acts


def row_view(graph: Graph, rows: int, region: ExpertRegion | None = None) -> Graph:
    """``graph`` with the region's tensors and expert weights in the shapes one mesh row
    sees (``ExpertRegion.view_shape``); GraphNodes outside the region unchanged."""
    region = ExpertRegion.of(graph, rows) if region is None else region

    def info(t: TensorInfo) -> TensorInfo:
        return dataclasses.replace(t, shape=region.view_shape(t.name, t.shape, rows))

    def weight(w: WeightInfo) -> WeightInfo:
        return dataclasses.replace(w, shape=region.view_shape(w.path, w.shape, rows, True))

    nodes = []
    for n in graph.nodes:
        if n.id not in region.nodes:
            nodes.append(n)
            continue
        ops = tuple(dataclasses.replace(op, outputs=tuple(info(t) for t in op.outputs))
                    for op in n.ops)
        nodes.append(dataclasses.replace(n, ops=ops, inputs=tuple(info(t) for t in n.inputs),
                                         outputs=tuple(info(t) for t in n.outputs),
                                         weights=tuple(weight(w) for w in n.weights)))
    return dataclasses.replace(graph, nodes=tuple(nodes))


def allowed_pattern(pattern: Any, node: GraphNode, region: ExpertRegion) -> str:
    """Why ``pattern`` of region GraphNode ``node`` cannot run nested ("" when it can): the
    all-to-all moves the expert and group axes, so no placement inside the region may split
    them (axes 0 and 1 of a token tensor, axis 0 of an expert weight)."""
    if node.id not in region.nodes:
        return ""
    placed = list(zip((t.name for t in node.inputs), pattern.inputs))
    placed += list(zip((t.name for t in node.outputs), pattern.outputs))
    placed += list(getattr(pattern, "tensors", {}).items())
    for name, p in placed:
        if isinstance(p, Split) and p.axis <= 1 and name in region.activations:
            return (f"it splits '{name}' on axis {p.axis} (the "
                    f"{'expert' if p.axis == 0 else 'group'} axis the all-to-all moves)")
    for path, p in getattr(pattern, "weights", {}).items():
        if isinstance(p, Split) and p.axis == 0:
            return f"it splits weight '{path}' on axis 0 (the experts, split over the rows)"
    return ""


def nested_patterns(graph: Graph, rows: int, base: Callable[..., Sequence[Any]] | None = None
                    ) -> Callable[[GraphNode, Graph, int], list[Any]]:
    """A ``patterns_fn`` for ``tapas.search`` / ``random_plan`` on one row's graph: the
    patterns of ``base`` (default ``tapas.sharding.patterns.patterns_for``), without the
    region's patterns that :func:`allowed_pattern` refuses."""
    region = ExpertRegion.of(graph, rows)
    if base is None:
        from tapas.sharding.patterns import patterns_for as base

    def patterns_fn(node: GraphNode, g: Graph, n: int) -> list[Any]:
        pats = list(base(node, g, n))
        if node.id not in region.nodes:
            return pats
        return [p for p in pats if not allowed_pattern(p, node, region)]
    return patterns_fn


def column_all_to_all(graph: Graph, pattern_of: Callable[[int], Any], mesh: Mesh,
                      options: CostOptions | None = None) -> CostBreakdown:
    """The all-to-alls over a column of ``mesh`` (a ``Mesh`` on its cluster: priced on its
    data axis): each entry tensor forward (groups -> experts) and its conjugate in the
    backward pass, the same for each exit tensor. N (each device's buffer) is the tensor's
    local part in the row, as the consuming (entry) or producing (exit) GraphNode's
    pattern places it on the mesh's ``cols`` devices; ``pattern_of(node_id)`` is the row
    strategy's pattern."""
    options = CostOptions.for_cluster(mesh.cluster) if options is None else options
    rows, cols, axis = mesh.rows, mesh.cols, mesh.axis(DATA)
    region = ExpertRegion.of(graph, rows)
    terms = []
    for t, where in [(t, "entry") for t in region.entries] + \
                    [(t, "exit") for t in region.exits]:
        placement = None
        for n in graph.nodes:
            if n.id not in region.nodes:
                continue
            side = n.inputs if where == "entry" else n.outputs
            for k, u in enumerate(side):
                if u.name == t.name and placement is None:
                    pat = pattern_of(n.id)
                    placement = (pat.inputs if where == "entry" else pat.outputs)[k]
        nbytes = int(placement.local_bytes(t.shape, priced_dtype(t.dtype, options.precision),
                                           cols))
        for backward in (False, True):
            terms.append(collective_cost("A2A", nbytes, axis, options, backward=backward,
                                         label=f"ep {t.name}"))
    return CostBreakdown(tuple(terms))


def expert_memory_saving(graph: Graph, weight_placements: Mapping[str, Placement], rows: int,
                         cols: int, options: CostOptions | None = None) -> MemoryEstimate:
    """Bytes per device the nesting saves: each expert weight (with its gradient and
    optimizer state) is held by one row in ``rows`` instead of by every row."""
    region = ExpertRegion.of(graph, rows)
    saved = MemoryEstimate()
    for w in graph.weights:
        if w.path not in region.weights:
            continue
        p = weight_placements.get(w.path, Replica())
        local = p.local_bytes(w.shape, priced_dtype(w.dtype, options and options.precision,
                                                    weight=True), cols)
        saved = saved + weight_memory(local * (1 - 1 / rows), w.trainable, options)
    return saved

