"""The pattern table and the edge coster: what the enumeration reads about patterns and edges.

In:  a :class:`tapas.ir.Graph`, the number of devices N, a
     :class:`tapas.planning.cluster.Cluster`, :class:`tapas.planning.cost.CostOptions` and
     the ShardingPatterns of every GraphNode (``tapas.sharding.patterns.patterns_for``, or
     any function of the same shape).
Out: :class:`PatternTable` -- per GraphNode, one :class:`PatternInfo` per pattern: its
     placements (typed :mod:`tapas.sharding.placements` objects), its family and whether it
     is data parallel, the seconds of its collectives and compute, its memory per device --
     and :class:`EdgeCoster`, the resharding collectives of an edge tensor between two
     placements and their seconds (``tapas.sharding.placements.reshard``, cached).

``patterns_for`` is called once per GraphNode signature: identical GraphNodes have
identical patterns, only their weight paths differ, so they share one row, whose weights are
placed by position (:func:`placed_weights` names them for a GraphNode).

With ``CostOptions.gradient_flow`` (the default) a backward collective is priced only on a
tensor whose gradient the training step computes (``tapas.sharding.gradients``, pure: the
same analysis the collective audit uses), both a pattern's own and an edge's resharding:
the table's ``gradients`` names those tensors, and the :class:`EdgeCoster` built with them
leaves the backward half of a reshard out elsewhere (slicing a replicated padding mask or
integer input for a batch-split reader costs nothing, in either direction).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tapas.sharding.gradients import gradient_flow
from tapas.ir import Graph, GraphNode, Kind, TensorInfo
from tapas.planning import cost as cost_lib
from tapas.planning.cluster import Cluster
from tapas.planning.devicemesh import MODEL
from tapas.planning.kept import grown_bytes
from tapas.planning.cost import CostOptions, CostTerm, MemoryEstimate
from tapas.planning.precision import priced_dtype
from tapas.sharding import losses
from tapas.sharding.patterns import patterns_for
from tapas.sharding.patterns.pattern import REPLICATE, Family, PatternId
from tapas.sharding.placements import Placement, Replica, parse_placement, reshard

__all__ = ["PatternInfo", "PatternTable", "pattern_table", "placed_weights", "constant_nodes",
           "EdgeCoster", "PatternsFn", "ReshardFn", "gradient_tensors"]

# PatternsFn(node, graph, num_devices) -> the node's ShardingPatterns (or objects with the
# same fields: name, inputs, outputs, weights, comms, flops, family, data_parallel; their
# placements may be written as text, "S1", and are read once, into PatternInfo)
PatternsFn = Callable[[GraphNode, Graph, int], Sequence[Any]]
# ReshardFn(src placement, dst placement, tensor) -> tuple of Comm-like objects; raises
# ValueError when no collective turns src into dst
ReshardFn = Callable[[Placement, Placement, TensorInfo], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class PatternInfo:
    """What the search needs of one ShardingPattern of one GraphNode."""

    name: PatternId
    family: Family | None                     # the kind of parallelism (reference plans)
    data_parallel: bool                       # splits the batch axis (data parallelism)
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    # the placement of each of the GraphNode's weights, in ``node.weights`` order (the
    # GraphNodes of a signature share their rows: :func:`placed_weights` pairs them with a
    # GraphNode's own paths)
    weight_placements: tuple[Placement, ...]
    comm_terms: tuple[CostTerm, ...]
    comm_time: float
    compute_time: float
    flops: float
    memory: MemoryEstimate                    # this node's weights (untied) + activations
    note: str = ""                            # what of the node's patterns could not be built

    def cost(self, memory_penalty: float = 0.0) -> float:
        """Seconds per step of this pattern, plus ``memory_penalty`` seconds per byte."""
        c = self.comm_time + self.compute_time
        return c + memory_penalty * self.memory.total if memory_penalty else c


def _summarize(node: GraphNode, pattern: Any, n: int, cluster: Cluster,
               options: CostOptions) -> PatternInfo:
    weights = {f"{w.placeholder}:0" for w in node.weights}
    axis = cluster.axis(n, name=MODEL)   # the search's axis: the 1-D mesh's model axis
    terms = tuple(cost_lib.comm_cost(c, axis, options,
                                     label=f"{node.name} [{pattern.name}] {c.tensor}",
                                     weights=weights)
                  for c in pattern.comms)
    outputs = _placed(pattern.outputs)
    placed = _placed(pattern.weights.get(w.path, _R) for w in node.weights)
    mem = MemoryEstimate()
    precision = options.precision
    for w, pl in zip(node.weights, placed):
        local = pl.local_bytes(w.shape, priced_dtype(w.dtype, precision, weight=True), n)
        mem = mem + cost_lib.weight_memory(local, w.trainable, options)
    act = math.fsum(pl.local_bytes(t.shape, priced_dtype(t.dtype, precision), n)
                    for t, pl in zip(node.outputs, outputs))
    mem = mem + MemoryEstimate(activations=act)
    flops = float(getattr(pattern, "flops", 0.0) or 0.0)
    dense = getattr(pattern, "dense_flops", None)
    elements = float(getattr(pattern, "elements", 0.0) or 0.0)
    return PatternInfo(
        name=_pattern_id(pattern), family=pattern.family,
        data_parallel=bool(pattern.data_parallel), inputs=_placed(pattern.inputs),
        outputs=outputs, weight_placements=placed, comm_terms=terms,
        comm_time=math.fsum(t.total for t in terms),
        compute_time=cost_lib.compute_time(
            flops, cluster, options, dense_flops=None if dense is None else float(dense),
            elements=elements, dense_by_width=getattr(pattern, "dense_by_width", None),
            kernels=getattr(pattern, "kernels", ()),
            dense_by_dtype=getattr(pattern, "dense_by_dtype", None)),
        flops=flops, memory=mem,
        note=getattr(pattern, "note", ""))


_R = Replica()


def _placed(placements: Iterable[Any]) -> tuple[Placement, ...]:
    """A pattern's placements as placement objects (a ``PatternsFn`` may write "S1")."""
    return tuple(parse_placement(p) for p in placements)


def _pattern_id(pattern: Any) -> PatternId:
    """A pattern's typed id (a ``PatternsFn`` may name its patterns by plain strings)."""
    name = pattern.name
    if isinstance(name, PatternId):
        return name
    return PatternId.parse(name) if pattern.family is None else PatternId(name, pattern.family)


@dataclasses.dataclass(frozen=True)
class PatternTable:
    """The patterns of every GraphNode: ``infos[node_id]`` lists its PatternInfos in
    ``patterns_for`` order (a pattern's index is its position there)."""

    infos: tuple[tuple[PatternInfo, ...], ...]
    num_devices: int
    signatures: int          # distinct signatures for which patterns_for was called
    seconds: float
    options: CostOptions = dataclasses.field(default_factory=CostOptions)
    generate_seconds: float = 0.0   # of ``seconds``: inside patterns_for (the rest: costing)
    constant: frozenset[int] = frozenset()   # GraphNodes filtered to replicate (constants)
    # the tensors (and trainable weight paths) whose gradient the training step computes
    # (CostOptions.gradient_flow), None: every backward collective is priced
    gradients: frozenset[str] | None = None

    def index(self, node_id: int, name: str) -> int:
        """The index of GraphNode ``node_id``'s pattern called ``name``."""
        for i, p in enumerate(self.infos[node_id]):
            if p.name == name:
                return i
        names = [p.name for p in self.infos[node_id]]
        raise KeyError(f"GraphNode {node_id} has no pattern {name!r}: it has {names}")


def pattern_table(graph: Graph, num_devices: int, cluster: Cluster,
                  options: CostOptions | None = None,
                  patterns_fn: PatternsFn | None = None) -> PatternTable:
    """Summarise every GraphNode's patterns, calling ``patterns_fn`` once per signature."""
    start = time.perf_counter()
    options = CostOptions.for_cluster(cluster) if options is None else options
    patterns_fn = patterns_fn or patterns_for
    first_of: dict[str, int] = {}
    infos: list[tuple[PatternInfo, ...]] = []
    generate = 0.0
    constant = constant_nodes(graph) if options.constant_filter else frozenset()
    gradients = gradient_tensors(graph) if options.gradient_flow else None
    comm_tensors: dict[str, list[list[tuple[bool, str | None]]]] = {}   # per signature
    for node in graph.nodes:
        key = node.signature or f"#{node.id}"
        if key in first_of:
            # same signature: the same row (placements and costs; the weights by position)
            infos.append(infos[first_of[key]])
            continue
        t = time.perf_counter()
        pats = tuple(patterns_fn(node, graph, num_devices))
        generate += time.perf_counter() - t
        if not pats:
            raise ValueError(f"patterns_for returned no pattern for GraphNode {node.id} "
                             f"'{node.name}' ({node.kind.value}): every kind must at least "
                             f"offer {REPLICATE!r}")
        first_of[key] = node.id
        infos.append(tuple(_summarize(node, p, num_devices, cluster, options) for p in pats))
        comm_tensors[key] = [[(getattr(c, "phase", "fwd") == "bwd", getattr(c, "tensor", None))
                              for c in p.comms] for p in pats]
    if gradients is not None:
        # the first GraphNode's tensor positions per signature (and, at None, the terms kept)
        names: dict[Any, Any] = {}
        infos = [_gradients_only(graph, node, infos[v], first_of, comm_tensors, gradients,
                                 names) for v, node in enumerate(graph.nodes)]
    infos = [_only_replicate(row) if v in constant else row for v, row in enumerate(infos)]
    if options.loss is not None:
        infos = _with_loss(graph, infos, num_devices, cluster, options)
    return PatternTable(tuple(infos), num_devices, len(first_of), time.perf_counter() - start,
                        options, generate, frozenset(constant), gradients)


def gradient_tensors(graph: Graph) -> frozenset[str] | None:
    """The tensors (and trainable weight paths) whose gradient a training step over
    ``graph`` computes (``tapas.sharding.gradients.gradient_flow``), or None when the graph
    does not show where its weights are read (a GraphNode IR written by hand, whose ops
    leave out the weights' reads): then nothing is known to go without a gradient."""
    unread = {f"{w.placeholder}:0" for w in graph.weights if w.trainable}
    for node in graph.nodes:      # a captured weight is read in its own GraphNode
        if node.weights and unread:
            unread.difference_update(*[op.inputs for op in node.ops])
    if unread:                    # elsewhere, or nowhere (a hand-written IR)
        unread.difference_update(*[op.inputs for node in graph.nodes for op in node.ops])
        if unread:
            return None
    return gradient_flow(graph).needed


def _tensor_at(node: GraphNode, where: tuple[int, ...]) -> str:
    """The name at a position :func:`_where` gave (in another GraphNode of the signature)."""
    if where[0] == 0:
        return node.inputs[where[1]].name
    if where[0] == 1:
        return node.ops[where[1]].outputs[where[2]].name
    return f"{node.weights[where[1]].placeholder}:0"


def _counts(node: GraphNode) -> tuple[int, int, int]:
    """How many inputs, ops and weights ``node`` has (with its signature: how many tensors
    a collective can be on, each op's outputs being part of the signature)."""
    return len(node.inputs), len(node.ops), len(node.weights)


def _where(node: GraphNode, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Where each of ``names`` is in ``node``: an input (0, i), op i's output k (1, i, k),
    weight i's tensor (2, i); the last of these places, in that order, where it appears
    (a placeholder op's output is also its weight's tensor)."""
    places = ([(t.name, (0, i)) for i, t in enumerate(node.inputs)]
              + [(t.name, (1, i, k)) for i, op in enumerate(node.ops)
                 for k, t in enumerate(op.outputs)]
              + [(f"{w.placeholder}:0", (2, i)) for i, w in enumerate(node.weights)])
    where: dict[str, tuple[int, ...]] = {}
    for name, place in places:
        if name in names:
            where[name] = place
    return where


def _gradients_only(graph: Graph, node: GraphNode, row: tuple[PatternInfo, ...],
                    first_of: dict[str, int], comm_tensors: dict[str, list],
                    gradients: frozenset[str], names: dict[Any, Any]
                    ) -> tuple[PatternInfo, ...]:
    """``row`` (``node``'s patterns) without the backward collectives on tensors whose
    gradient is never computed (not in ``gradients``). A row shared with the first GraphNode
    of the signature names that node's tensors: they are mapped to ``node``'s by position
    (found once per signature)."""
    key = node.signature or f"#{node.id}"
    tensors = comm_tensors[key]
    if not any(bwd for comms in tensors for bwd, _ in comms):
        return row
    first = graph.nodes[first_of[key]]
    rename: dict[str, str] = {}
    state: tuple[Any, ...] | None = None
    if first.id != node.id:
        if key not in names:
            wanted = {name for comms in tensors for bwd, name in comms if bwd and name}
            names[key] = (_where(first, wanted), _counts(first))
        where, counts = names[key]
        if _counts(node) != counts:
            return row      # not the same structure after all: price every collective
        renamed = [_tensor_at(node, place) for place in where.values()]
        # the dropped collectives follow from which of those tensors get a gradient
        state = (key, tuple([name in gradients for name in renamed]))
        rename = dict(zip(where, renamed))
    known = names.setdefault(("drops",), {})
    drops = known.get(state) if state is not None else None
    if drops is None:
        # (the terms are the pattern's comms in order; the loss's are added later)
        drops = tuple(frozenset(k for k, (bwd, name) in enumerate(comms)
                                if bwd and name is not None
                                and rename.get(name, name) not in gradients)
                      for comms in tensors)
        if state is not None:
            known[state] = drops
    # the GraphNodes of a signature share its row: one copy per set of drops
    shared = names.setdefault(("rows",), {})
    hit = shared.get((id(row), drops))
    if hit is not None and hit[0] is row:
        return hit[1]
    out = []
    kept_terms = names.setdefault(None, {})   # (terms, dropped) -> (kept terms, seconds)
    for info, comms, drop in zip(row, tensors, drops):
        if not drop or len(comms) != len(info.comm_terms):
            out.append(info)
            continue
        memo = (id(info.comm_terms), drop)   # a signature's rows share their terms
        if memo not in kept_terms:
            terms = tuple(t for k, t in enumerate(info.comm_terms) if k not in drop)
            kept_terms[memo] = (terms, math.fsum(t.total for t in terms), info.comm_terms)
        kept = object.__new__(PatternInfo)   # (PatternInfo has no checks to re-run)
        kept.__dict__.update(info.__dict__)
        kept.__dict__["comm_terms"], kept.__dict__["comm_time"] = kept_terms[memo][:2]
        out.append(kept)
    shared[(id(row), drops)] = (row, tuple(out))
    return tuple(out)


def _with_loss(graph: Graph, infos: list[tuple[PatternInfo, ...]], n: int, cluster: Cluster,
               options: CostOptions) -> list[tuple[PatternInfo, ...]]:
    """``infos`` with the training loss's collectives (``options.loss``) added to the
    patterns of the GraphNode making the model's output, as each pattern places it
    (``tapas.sharding.losses.plan_loss``, the plan the runtime runs and audits). Only a
    model with one output is trained (the runtime's rule); others are left unpriced."""
    if len(graph.outputs) != 1 or graph.outputs[0].shape is None:
        return infos
    out = graph.outputs[0]
    made = [(node.id, i) for node in graph.nodes for i, t in enumerate(node.outputs)
            if t.name == out.name]
    if not made:
        return infos
    v, k = made[0]
    spec = options.loss
    assert spec is not None
    activation = losses.output_activation(graph, out.name)
    target_ndim = spec.target_ndim(len(out.shape))
    row = []
    for info in infos[v]:
        plan = losses.plan_loss(spec, info.outputs[k], out.shape, out.dtype, target_ndim, n,
                                activation)
        if not plan.collectives:
            row.append(info)
            continue
        extra = tuple(cost_lib.comm_cost(_LossComm(kind, nbytes), cluster.axis(n, name=MODEL),
                                         options, label=f"loss [{plan.method}] {out.name}")
                      for kind, nbytes in plan.collectives)
        terms = info.comm_terms + extra
        row.append(dataclasses.replace(info, comm_terms=terms,
                                       comm_time=math.fsum(t.total for t in terms)))
    return infos[:v] + [tuple(row)] + infos[v + 1:]


@dataclasses.dataclass(frozen=True)
class _LossComm:
    """A loss collective as ``cost.comm_cost`` reads it (forward: the loss's own gradient
    is local in every method)."""

    kind: str
    bytes: int
    phase: str = "fwd"


def placed_weights(node: GraphNode, info: PatternInfo) -> tuple[tuple[str, Placement], ...]:
    """(weight path, placement) of each of ``node``'s weights under its pattern ``info``."""
    return tuple(zip([w.path for w in node.weights], info.weight_placements))


def constant_nodes(graph: Graph) -> frozenset[int]:
    """The GraphNodes that compute only from graph inputs and constants, with no weight:
    padding-mask biases, position ids, rotary tables, shape arithmetic (not the graph
    inputs themselves, whose placement says how the batch is fed).

    The paper's *constant filtering*: such a node is computed whole on every device (its
    ``replicate`` pattern), so every reader can take the split it wants by a local slice.
    Searching their placements would only multiply the frontier, since these tensors live
    from the start of the model to its last layer (every layer reads the mask)."""
    producer = {t.name: node.id for node in graph.nodes for t in node.outputs}
    constant: set[int] = set()
    for node in graph.nodes:
        if node.kind is Kind.INPUT or node.weights:
            continue
        sources = [producer.get(t.name) for t in node.inputs]
        if all(s is None or s in constant or graph.nodes[s].kind is Kind.INPUT
               for s in sources):
            constant.add(node.id)
    return frozenset(constant)


def _only_replicate(row: tuple[PatternInfo, ...]) -> tuple[PatternInfo, ...]:
    kept = tuple(info for info in row if info.family is Family.REPLICATE)
    return kept or row


def _default_reshard(src: Placement, dst: Placement, tensor: TensorInfo) -> Sequence[Any]:
    return reshard(src, dst, tensor.shape or (), tensor.dtype, tensor.name)


class EdgeCoster:
    """The resharding collectives of an edge tensor between two placements, and their cost
    (cached by shape, dtype and placements). ``cost`` returns None where no collective
    turns one placement into the other, or where resharding is not allowed."""

    def __init__(self, num_devices: int, cluster: Cluster, options: CostOptions,
                 reshard_fn: ReshardFn | None = None, allow_reshard: bool = True,
                 gradients: frozenset[str] | None = None) -> None:
        self.n, self.cluster, self.options = num_devices, cluster, options
        self.axis = cluster.axis(num_devices, name=MODEL)   # the 1-D mesh's model axis
        self.allow = allow_reshard
        # the tensors whose gradient is computed (PatternTable.gradients): the backward half
        # of a reshard of any other tensor never runs; None: every one is priced
        self.gradients = gradients
        self.reshard_fn: ReshardFn = reshard_fn or _default_reshard
        self._cache: dict[tuple[Any, ...], float | None] = {}
        self._by_id: dict[tuple[int, int, int], tuple[Any, Any, Any, float | None]] = {}
        self._grown: dict[tuple[Any, ...], float] = {}

    def comms(self, tensor: TensorInfo, src: Placement, dst: Placement) -> tuple[Any, ...]:
        """The Comms turning ``src`` into ``dst`` (ValueError if none can), without the
        backward ones where ``tensor`` gets no gradient (``gradients``)."""
        if src == dst:
            return ()
        comms = tuple(self.reshard_fn(src, dst, tensor))
        if self._gradient_free(tensor):
            comms = tuple(c for c in comms if getattr(c, "phase", "fwd") != "bwd")
        return comms

    def for_table(self, table: PatternTable) -> EdgeCoster:
        """This coster, or one like it that knows ``table.gradients`` (a table priced with
        ``CostOptions.gradient_flow`` prices a plan's reshards with them too)."""
        if table.gradients is None or self.gradients is table.gradients or \
                self.gradients == table.gradients:
            return self
        return EdgeCoster(self.n, self.cluster, self.options, self.reshard_fn, self.allow,
                          table.gradients)

    def _gradient_free(self, tensor: TensorInfo) -> bool:
        return self.gradients is not None and tensor.name not in self.gradients

    def terms(self, tensor: TensorInfo, src: Placement, dst: Placement,
              label: str = "", weight: bool = False) -> tuple[CostTerm, ...]:
        """The cost terms of those Comms (``weight``: ``tensor`` is a weight, its
        backward collectives reduce its gradient)."""
        names = (tensor.name,) if weight else ()
        return tuple(cost_lib.comm_cost(c, self.axis, self.options, label=label,
                                        weights=names)
                     for c in self.comms(tensor, src, dst))

    def cost(self, tensor: TensorInfo, src: Placement, dst: Placement) -> float | None:
        """Seconds to turn ``src`` into ``dst``; None if it cannot be done (or is not allowed)."""
        # by the objects' identities first (a search asks for the same few edges millions of
        # times on a wide frontier); the entry holds the objects, so their ids stay theirs
        hit = self._by_id.get((id(tensor), id(src), id(dst)))
        if hit is not None:
            return hit[3]
        if src == dst:
            return 0.0
        if not self.allow:
            return None
        key = (tensor.shape, tensor.dtype, src, dst, self._gradient_free(tensor))
        if key not in self._cache:
            try:
                terms = self.terms(tensor, src, dst)
                self._cache[key] = math.fsum(t.total for t in terms)
            except ValueError:
                self._cache[key] = None
        self._by_id[(id(tensor), id(src), id(dst))] = (tensor, src, dst, self._cache[key])
        return self._cache[key]

    def grown_bytes(self, tensor: TensorInfo, src: Placement, dst: Placement) -> float:
        """``tapas.planning.kept.grown_bytes`` of an edge, cached by shape, dtype and
        placements (the frontier asks for the same few edges many times)."""
        if src is dst:
            return 0.0
        key = (tensor.shape, tensor.dtype, src, dst)
        got = self._grown.get(key)
        if got is None:
            got = self._grown[key] = grown_bytes(tensor, src, dst, self.n,
                                                 self.options.precision)
        return got
