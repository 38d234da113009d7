"""The steps of a search problem: the GraphNodes of a subset of the graph, in a good order.

In:  a :class:`tapas.ir.Graph`, the ids of the GraphNodes to search, the
     :class:`tapas.planning.table.PatternTable`, an optional ``Allowed`` restriction.
Out: :func:`node_steps`: one :class:`tapas.planning.frontier.Step` per GraphNode (the
     tensors it reads and writes, the patterns it may take and their costs) in the order
     :func:`good_order` picks (one that keeps few tensors live, so the enumeration's
     frontiers stay small); the graph indexes it uses (:func:`producers`,
     :func:`consumers`), cached per graph (:func:`per_graph`).

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from tapas.ir import Graph, GraphNode, TensorInfo
from tapas.planning.frontier import Allowed, Step
from tapas.planning.kept import kept_penalties
from tapas.planning.table import PatternTable
from tapas.sharding.patterns.pattern import Family
from tapas.sharding.placements import Replica

__all__ = ["node_steps", "step_options", "narrow_order", "good_order", "live_width",
           "producers", "consumers", "per_graph"]


def per_graph(cache: dict[int, tuple[Graph, Any]], graph: Graph,
              build: Callable[[Graph], Any]) -> Any:
    """``build(graph)``, cached in ``cache`` for the last few graphs by identity (a search
    asks for the same index of its graph once per unit or evaluated plan; the value must
    be treated as read-only)."""
    hit = cache.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(cache) >= 4:
        cache.pop(next(iter(cache)))
    cache[id(graph)] = (graph, build(graph))
    return cache[id(graph)][1]


def producers(graph: Graph) -> Mapping[str, tuple[int, int]]:
    """Tensor name -> (GraphNode id, output index) of the GraphNode producing it (cached:
    :func:`per_graph`)."""
    def build(g: Graph) -> Mapping[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for node in g.nodes:
            for i, t in enumerate(node.outputs):
                out[t.name] = (node.id, i)
        return MappingProxyType(out)
    return per_graph(_PRODUCERS, graph, build)


_PRODUCERS: dict[int, tuple[Graph, Any]] = {}
_CONSUMERS: dict[int, tuple[Graph, Any]] = {}


def consumers(graph: Graph) -> Mapping[str, tuple[int, ...]]:
    """Tensor name -> the GraphNodes reading it (one entry per edge; cached:
    :func:`per_graph`)."""
    def build(g: Graph) -> Mapping[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        for e in g.edges:
            out.setdefault(e.tensor.name, []).append(e.dst)
        return MappingProxyType({k: tuple(v) for k, v in out.items()})
    return per_graph(_CONSUMERS, graph, build)


def narrow_order(graph: Graph, nodes: Sequence[int]) -> list[int]:
    """A topological order of ``nodes`` that keeps few tensors live at once: the frontier
    the enumeration carries. Greedy: among the ready GraphNodes, the one that frees the
    most tensors (reads them for the last time) net of those it adds, then the one that
    continues the most recently started branch, then the smallest id. Any topological
    order gives the same plans (the enumeration is exact); a narrow one gives fewer
    frontier states on wide graphs (NASNet's cells: many parallel branches)."""
    inside = set(nodes)
    prod = producers(graph)
    readers: dict[str, int] = {}
    preds: dict[int, set[int]] = {v: set() for v in nodes}
    for v in nodes:
        for t in graph.nodes[v].inputs:
            readers[t.name] = readers.get(t.name, 0) + 1
            src = prod.get(t.name)
            if src is not None and src[0] in inside and src[0] != v:
                preds[v].add(src[0])
    succs: dict[int, list[int]] = {v: [] for v in nodes}
    for v, ps in preds.items():
        for u in ps:
            succs[u].append(v)
    waiting = {v: len(ps) for v, ps in preds.items()}
    ready = {v for v, c in waiting.items() if c == 0}
    done_at: dict[int, int] = {}
    order: list[int] = []
    while ready:
        def score(v: int) -> tuple[int, int, int]:
            ins = {t.name for t in graph.nodes[v].inputs}
            freed = sum(1 for name in ins if readers[name] == 1)
            added = sum(1 for t in graph.nodes[v].outputs if readers.get(t.name, 0))
            recent = max((done_at[u] for u in preds[v]), default=-1)
            return (freed - added, recent, -v)
        v = max(ready, key=score)
        ready.discard(v)
        done_at[v] = len(order)
        order.append(v)
        for t in graph.nodes[v].inputs:
            readers[t.name] -= 1
        for w in succs[v]:
            waiting[w] -= 1
            if waiting[w] == 0:
                ready.add(w)
    assert len(order) == len(nodes), "nodes are not a DAG"
    return order


def live_width(graph: Graph, order: Sequence[int]) -> int:
    """The sum over the steps of ``order`` of the tensors live after each (produced, and
    read later within ``order``): a proxy for how many frontier states the enumeration
    carries in that order."""
    pos = {v: i for i, v in enumerate(order)}
    last: dict[str, int] = {}
    for v in order:
        for t in graph.nodes[v].inputs:
            last[t.name] = max(last.get(t.name, -1), pos[v])
    born: dict[str, int] = {}
    for v in order:
        for t in graph.nodes[v].outputs:
            if t.name in last:
                born[t.name] = pos[v]
    return sum(max(0, last[name] - born[name]) for name in born)


def good_order(graph: Graph, nodes: Sequence[int]) -> list[int]:
    """The topological order of ``nodes`` with the smaller :func:`live_width`: their id
    order (the capture's) or :func:`narrow_order`."""
    plain = sorted(nodes)
    narrow = narrow_order(graph, plain)
    return narrow if live_width(graph, narrow) < live_width(graph, plain) else plain


def step_options(table: PatternTable, node: GraphNode, allowed: Allowed | None,
                 penalty: float) -> tuple[tuple[int, float], ...]:
    """The (pattern index, cost) options of ``node``: those ``allowed`` admits, else its
    replicate pattern, else all of them."""
    infos = table.infos[node.id]
    opts = [(i, p.cost(penalty)) for i, p in enumerate(infos)
            if allowed is None or allowed(node, p)]
    if not opts:   # a restriction that leaves nothing falls back to replication
        opts = [(i, p.cost(penalty)) for i, p in enumerate(infos)
                if p.family is Family.REPLICATE]
    return tuple(opts or [(i, p.cost(penalty)) for i, p in enumerate(infos)])


def _reads(graph: Graph, order: Sequence[int]
           ) -> tuple[list[list[tuple[Any, TensorInfo]]], dict[Any, int], set[Any]]:
    """Per step, its (key, tensor) reads; the step of each key's last read; the free keys
    (tensors from outside ``order``, set by their first reader)."""
    prod = producers(graph)
    inside = set(order)
    last_read: dict[Any, int] = {}
    reads_of: list[list[tuple[Any, TensorInfo]]] = []
    free: set[Any] = set()
    for i, v in enumerate(order):
        reads = []
        for t in graph.nodes[v].inputs:
            src = prod.get(t.name)
            if src is not None and src[0] in inside:
                key: Any = src
            else:
                key = ("x", t.name)
                free.add(key)
            reads.append((key, t))
            last_read[key] = i
        reads_of.append(reads)
    return reads_of, last_read, free


def node_steps(graph: Graph, order: Sequence[int], table: PatternTable,
               allowed: Allowed | None, penalty: float,
               keep_outputs: Callable[[int, int, TensorInfo], bool]) -> list[Step]:
    """Steps for ``order`` (a topologically ordered subset of GraphNodes). A tensor from a
    GraphNode outside the subset is an external key, set by its first reader; a written
    tensor stays in the frontier until its last reader in the subset, or to the end when
    ``keep_outputs(node, index, tensor)`` (read outside, or a graph output). ``penalty``
    (seconds per byte) prices each option's memory and, per input its reader keeps for
    the backward, the bytes a resharding grows it to (``Step.kept``)."""
    reads_of, last_read, free = _reads(graph, order)
    prod = producers(graph)
    fixed = {key: Replica() for key in free
             if prod.get(key[1]) is not None and prod[key[1]][0] in table.constant}
    free -= set(fixed)
    held: set[Any] = set()
    writes_of: list[list[tuple[int, Any]]] = []
    for v in order:
        writes = []
        for oi, t in enumerate(graph.nodes[v].outputs):
            key = (v, oi)
            keep = keep_outputs(v, oi, t)
            if keep:
                held.add(key)
            if keep or key in last_read:
                writes.append((oi, key))
        writes_of.append(writes)
    drops_at: dict[int, list[Any]] = {}
    for key, i in last_read.items():
        if key not in held and key not in free and key not in fixed:
            drops_at.setdefault(i, []).append(key)
    return [Step(node=v, reads=tuple(reads_of[i]), writes=tuple(writes_of[i]),
                 drops=tuple(drops_at.get(i, ())),
                 options=step_options(table, graph.nodes[v], allowed, penalty),
                 free=frozenset(free), fixed=fixed,
                 kept=kept_penalties(graph.nodes[v], table.gradients, penalty))
            for i, v in enumerate(order)]
