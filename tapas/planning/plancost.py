"""Exact cost and memory of whole-graph plans (the search's validation of its top plans).

In:  a :class:`tapas.ir.Graph`, its :class:`tapas.planning.table.PatternTable`, an
     :class:`tapas.planning.table.EdgeCoster` and plans (one pattern index per GraphNode).
Out: per plan, its :class:`tapas.planning.cost.PlanCost` (every pattern's collectives, every
     edge's resharding collectives, compute, memory) and the edges that reshard as
     ``(src, dst, input index, from, to)``; the memory of a plan on its own
     (:func:`plan_memory`), a bound no plan goes below (:func:`memory_lower_bound`) and the
     memory per GraphNode (:func:`node_memory`).
Raises ValueError where an edge cannot be resharded (or resharding is off).

:func:`plan_costs` costs several plans that differ in a few GraphNodes (a search's top
plans): the first GraphNode by GraphNode, each later one from the first's per-GraphNode
terms, recomputing only the GraphNodes whose pattern differs and their readers, and summing
compute, activations and weights in the same order from the first place that differs: the
same terms in the same order and the same floating-point sums as costing each plan on its
own (:func:`plan_cost`).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tapas.ir import Graph, TensorInfo
from tapas.planning import cost as cost_lib
from tapas.planning.cost import CostOptions, CostTerm, MemoryEstimate
from tapas.planning.kept import input_kept_bytes, node_resharded_bytes
from tapas.planning.precision import priced_dtype
from tapas.planning.steps import producers
from tapas.planning.table import EdgeCoster, PatternTable, placed_weights
from tapas.sharding.placements import Placement

__all__ = ["plan_cost", "plan_costs", "plan_memory", "memory_lower_bound", "node_memory",
           "weight_reshard_terms", "Resharded"]

# an edge that reshards: (src GraphNode, dst GraphNode, input index of dst, from, to)
Resharded = tuple[int, int, int, Placement, Placement]
Costed = tuple[cost_lib.PlanCost, list[Resharded]]


def plan_cost(graph: Graph, table: PatternTable, patterns: Sequence[int], edges: EdgeCoster,
              ) -> Costed:
    """The exact cost of one whole-graph plan and its resharded edges."""
    return plan_costs(graph, table, [patterns], edges)[0]


def plan_costs(graph: Graph, table: PatternTable, plans: Sequence[Sequence[int]],
               edges: EdgeCoster) -> list[Costed]:
    """:func:`plan_cost` of each of ``plans``, the later ones from the first's terms."""
    if not plans:
        return []
    edges = edges.for_table(table)
    first = _First.of(graph, table, list(plans[0]), edges)
    return [first.result] + [first.other(list(p)) for p in plans[1:]]


def _segment(graph: Graph, table: PatternTable, patterns: Sequence[int], edges: EdgeCoster,
             prod: Any, v: int) -> tuple[list[CostTerm], list[Resharded]]:
    """GraphNode ``v``'s collectives and the resharding of the edges into it."""
    node = graph.nodes[v]
    info = table.infos[v][patterns[v]]
    terms = list(info.comm_terms)
    resharded: list[Resharded] = []
    for j, (t, want) in enumerate(zip(node.inputs, info.inputs)):
        src = prod.get(t.name)
        if src is None:
            continue
        have = table.infos[src[0]][patterns[src[0]]].outputs[src[1]]
        if have is want or have == want:
            continue
        if not edges.allow:
            raise ValueError(f"edge {src[0]} -> {v} ({t.name}): {have} != {want} "
                             "and resharding is off")
        terms.extend(edges.terms(t, have, want,
                                 label=f"reshard {t.name} {have}->{want} for {node.name}"))
        resharded.append((src[0], v, j, have, want))
    return terms, resharded


@dataclasses.dataclass
class _First:
    """The first plan's cost, kept per GraphNode (its terms, reshards, the running sums of
    compute and activations before it) and per weight (its local size, the running memory
    sums before it), so that a plan differing in a few GraphNodes is costed from it."""

    graph: Graph
    table: PatternTable
    edges: EdgeCoster
    patterns: list[int]
    segments: list[list[CostTerm]]
    resharded: list[list[Resharded]]
    readers: list[list[int]]             # per GraphNode: the GraphNodes reading its outputs
    compute: list[float]                 # compute summed before each GraphNode
    memory: _Memory
    result: Costed

    @staticmethod
    def of(graph: Graph, table: PatternTable, patterns: list[int], edges: EdgeCoster) -> _First:
        prod = producers(graph)
        segments, resharded = [], []
        readers: list[list[int]] = [[] for _ in graph.nodes]
        compute, c = [], 0.0
        for node in graph.nodes:
            v = node.id
            seg, resh = _segment(graph, table, patterns, edges, prod, v)
            segments.append(seg)
            resharded.append(resh)
            for t in node.inputs:
                src = prod.get(t.name)
                if src is not None:
                    readers[src[0]].append(v)
            compute.append(c)
            c += table.infos[v][patterns[v]].compute_time
        compute.append(c)
        memory = _Memory.of(graph, table, patterns, table.options,
                            [_kept(graph, table, resh) for resh in resharded])
        result = _costed(graph, table, patterns, edges, segments, resharded, c,
                         memory.estimate)
        return _First(graph, table, edges, patterns, segments, resharded, readers, compute,
                      memory, result)

    def other(self, patterns: list[int]) -> Costed:
        """The cost of ``patterns`` from this plan's per-GraphNode terms."""
        graph, table = self.graph, self.table
        diff = [v for v, (a, b) in enumerate(zip(patterns, self.patterns)) if a != b]
        if not diff:
            return self.result[0], list(self.result[1])
        touched = set(diff)
        for v in diff:
            touched.update(self.readers[v])
        segments, resharded = list(self.segments), list(self.resharded)
        prod = producers(graph)
        for v in sorted(touched):
            segments[v], resharded[v] = _segment(graph, table, patterns, self.edges, prod, v)
        c = self.compute[diff[0]]
        for v in range(diff[0], len(graph.nodes)):
            c += table.infos[v][patterns[v]].compute_time
        kept = {v: _kept(graph, table, resharded[v]) for v in touched}
        return _costed(graph, table, patterns, self.edges, segments, resharded, c,
                       self.memory.other(patterns, diff, kept))


def _kept(graph: Graph, table: PatternTable, resharded: Sequence[Resharded]) -> float:
    """The bytes one GraphNode keeps of its resharded inputs (``resharded``: its edges as
    :func:`_segment` found them), as ``kept.node_resharded_bytes`` counts them."""
    return sum(input_kept_bytes(graph.nodes[v], j, have, want, table.num_devices,
                                table.options, table.gradients)
               for _, v, j, have, want in resharded)


def _costed(graph: Graph, table: PatternTable, patterns: Sequence[int], edges: EdgeCoster,
            segments: list[list[CostTerm]], resharded: list[list[Resharded]], compute: float,
            memory: MemoryEstimate) -> Costed:
    terms = list(itertools.chain.from_iterable(segments))
    if table.options.weight_reshards:
        terms.extend(weight_reshard_terms(graph, table, patterns, edges))
    return (cost_lib.PlanCost(cost_lib.CostBreakdown(terms), compute, memory),
            list(itertools.chain.from_iterable(resharded)))


def weight_reshard_terms(graph: Graph, table: PatternTable, patterns: Sequence[int],
                         edges: EdgeCoster) -> list[CostTerm]:
    """The collectives that move a weight read in several placements: stored as its first
    reader (in GraphNode order) wants it, resharded once per other placement wanted (with
    the gradient's conjugate), as the runtime runs it (``tapas.execution.checking.audit``). Only
    GraphNodes that read the weight count (``Graph.readers``)."""
    stored: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    terms: list[CostTerm] = []
    for node in graph.nodes:
        info = table.infos[node.id][patterns[node.id]]
        shapes = {w.path: w for w in node.weights if graph.reads(node.id, w.path)}
        for path, want in placed_weights(node, info):
            if path not in shapes:
                continue
            have = stored.setdefault(path, want)
            if have == want or (path, str(want)) in seen:
                continue
            seen.add((path, str(want)))
            w = shapes[path]
            terms.extend(edges.terms(TensorInfo(path, tuple(w.shape), w.dtype), have, want,
                                     label=f"reshard weight {path} {have}->{want}",
                                     weight=True))
    return terms


@dataclasses.dataclass
class _Memory:
    """A plan's memory (:func:`plan_memory`) with what a plan differing in a few
    GraphNodes reuses: the activations summed before each GraphNode, each weight's local
    size (the largest over its readers) in the order first read, and the weights' sums
    before each weight."""

    graph: Graph
    table: PatternTable
    options: CostOptions
    patterns: Sequence[int]
    sizes: dict[tuple[int, Any, str], float]
    acts: list[float]
    weights: dict[str, tuple[float, bool]]
    position: dict[str, int]
    before: list[tuple[float, float, float]]
    each: dict[tuple[float, bool], MemoryEstimate]
    kept: list[float]                # per GraphNode, its kept resharded inputs' bytes
    estimate: MemoryEstimate

    @staticmethod
    def of(graph: Graph, table: PatternTable, patterns: Sequence[int],
           options: CostOptions, kept: list[float] | None = None) -> _Memory:
        """``kept``: per GraphNode, its kept resharded inputs' bytes when already known."""
        n = table.num_devices
        readers = graph.readers
        # a deep stack's layers hold weights of a few shapes in the same placements (the
        # table's rows share their Placement objects): their local sizes are computed once
        sizes: dict[tuple[int, Any, str], float] = {}
        weights: dict[str, tuple[float, bool]] = {}
        acts, act = [], 0.0
        for node in graph.nodes:
            info = table.infos[node.id][patterns[node.id]]
            for w, pl in zip(node.weights, info.weight_placements):
                if node.id not in readers.get(w.path, ()):
                    continue
                key = (id(pl), w.shape, w.dtype)
                b = sizes.get(key)
                if b is None:
                    b = sizes[key] = pl.local_bytes(
                        w.shape, priced_dtype(w.dtype, options.precision, True), n)
                held = weights.get(w.path)
                if held is None or held[0] < b:
                    weights[w.path] = (b, w.trainable)
            acts.append(act)
            act += info.memory.activations
        acts.append(act)
        if kept is None:
            prod = producers(graph)
            kept = [node_resharded_bytes(node, table, patterns, prod, options)
                    for node in graph.nodes]
        each: dict[tuple[float, bool], MemoryEstimate] = {}
        before, total = _weight_sums(list(weights.values()), (0.0, 0.0, 0.0), each, options)
        return _Memory(graph, table, options, patterns, sizes, acts, weights,
                       {p: i for i, p in enumerate(weights)}, before, each, kept,
                       MemoryEstimate(total[0], total[1], total[2], act + sum(kept)))

    def other(self, patterns: Sequence[int], diff: Sequence[int],
              touched: Mapping[int, float]) -> MemoryEstimate:
        """The memory of ``patterns``, which differ from this plan at GraphNodes ``diff``
        (ascending); ``touched``: those GraphNodes and the ones reading their outputs, each
        with its kept resharded inputs' bytes under ``patterns``."""
        graph, table = self.graph, self.table
        act = self.acts[diff[0]]
        for v in range(diff[0], len(graph.nodes)):
            act += table.infos[v][patterns[v]].memory.activations
        kept = list(self.kept)
        for v, b in touched.items():
            kept[v] = b
        act += sum(kept)
        readers = graph.readers
        paths = {w.path for v in diff for w in graph.nodes[v].weights
                 if v in readers.get(w.path, ())}
        changed = {}
        for path in paths:
            held = self._held(path, patterns)
            if held != self.weights[path]:
                changed[path] = held
        if not changed:
            e = self.estimate
            return MemoryEstimate(e.weights, e.gradients, e.optimizer, act)
        start = min(self.position[p] for p in changed)
        tail = [changed.get(p, held) for p, held in
                itertools.islice(self.weights.items(), start, None)]
        _, total = _weight_sums(tail, self.before[start], self.each, self.options)
        return MemoryEstimate(total[0], total[1], total[2], act)

    def _held(self, path: str, patterns: Sequence[int]) -> tuple[float, bool]:
        """Weight ``path``'s local size (the largest over its readers, the first reader of
        that size in GraphNode order) and whether it is trainable, under ``patterns``."""
        n = self.table.num_devices
        held: tuple[float, bool] | None = None
        for v in sorted(self.graph.readers[path]):
            node = self.graph.nodes[v]
            info = self.table.infos[v][patterns[v]]
            for w, pl in zip(node.weights, info.weight_placements):
                if w.path != path:
                    continue
                key = (id(pl), w.shape, w.dtype)
                b = self.sizes.get(key)
                if b is None:
                    b = self.sizes[key] = pl.local_bytes(
                        w.shape, priced_dtype(w.dtype, self.options.precision, True), n)
                if held is None or held[0] < b:
                    held = (b, w.trainable)
        assert held is not None
        return held


def _weight_sums(weights: Sequence[tuple[float, bool]], start: tuple[float, float, float],
                 each: dict[tuple[float, bool], MemoryEstimate], options: CostOptions
                 ) -> tuple[list[tuple[float, float, float]], list[float]]:
    """The weights', gradients' and optimizer states' bytes summed over ``weights`` from
    ``start`` (in the order ``MemoryEstimate.__add__`` would), and the sums before each."""
    total = list(start)
    before = []
    for b, trainable in weights:
        before.append((total[0], total[1], total[2]))
        m = each.get((b, trainable))
        if m is None:
            m = each[(b, trainable)] = cost_lib.weight_memory(b, trainable, options)
        total[0] += m.weights
        total[1] += m.gradients
        total[2] += m.optimizer
    return before, total


def plan_memory(graph: Graph, table: PatternTable, patterns: Sequence[int],
                options: CostOptions | None = None) -> MemoryEstimate:
    """Per-device memory of a plan: each weight once (a tied weight at its largest local
    size), its gradient and optimizer state, every GraphNode's outputs, and the resharded
    inputs the backward pass keeps that are larger than their producer's shard
    (``tapas.planning.kept``)."""
    options = table.options if options is None else options
    return _Memory.of(graph, table, patterns, options).estimate


def memory_lower_bound(graph: Graph, table: PatternTable,
                       options: CostOptions | None = None) -> float:
    """Bytes per device that no plan of ``table`` goes below: every GraphNode's outputs at
    their smallest over its patterns, every weight at the largest over its readers of the
    smallest local size each reader's patterns give it (the smallest parts need not come
    from one plan, so this is a bound, not a plan's memory)."""
    options = table.options if options is None else options
    n = table.num_devices
    act = 0.0
    weights: dict[str, tuple[float, bool]] = {}
    for node in graph.nodes:
        infos = table.infos[node.id]
        act += min(info.memory.activations for info in infos)
        for k, w in enumerate(node.weights):
            if not graph.reads(node.id, w.path):
                continue
            dtype = priced_dtype(w.dtype, options.precision, weight=True)
            b = min(info.weight_placements[k].local_bytes(w.shape, dtype, n) for info in infos)
            if w.path not in weights or weights[w.path][0] < b:
                weights[w.path] = (b, w.trainable)
    mem = MemoryEstimate(activations=act)
    for b, trainable in weights.values():
        mem = mem + cost_lib.weight_memory(b, trainable, options)
    return mem.total


def node_memory(graph: Graph, table: PatternTable, patterns: Sequence[int]) -> list[float]:
    """Bytes per device attributable to each GraphNode (its weights, untied, and outputs)."""
    return [table.infos[v][patterns[v]].memory.total for v in range(len(graph.nodes))]
