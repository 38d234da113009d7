"""The caches of the pattern stage: graph indexes, and patterns per GraphNode signature.

In:  graphs and GraphNodes, and the patterns computed for them.
Out: :func:`graph_index` (one :class:`GraphIndex` per graph, the last few kept),
     :func:`lookup` / :func:`store` (the patterns of a node on N devices; an identical node
     -- same signature, op types, weight and tensor shapes, e.g. the layers of a T5 --
     gets the cached patterns renamed onto its own ops, tensors and weights, family and
     placements unchanged) and :func:`clear`.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from tapas.ir import Graph, GraphNode
from tapas.sharding.patterns.pattern import ShardingPattern
from tapas.sharding.patterns.propagation import GraphIndex

__all__ = ["clear", "graph_index", "lookup", "store"]

_LOCK = threading.Lock()
_INDEX: dict[int, tuple[Graph, GraphIndex]] = {}
_CACHE: dict[tuple[Any, ...], tuple[GraphNode, list[ShardingPattern]]] = {}
_MAX_INDEXES = 4


def clear() -> None:
    """Forget cached graph indexes and patterns."""
    with _LOCK:
        _INDEX.clear()
        _CACHE.clear()


def graph_index(graph: Graph) -> GraphIndex:
    """The index of ``graph`` (cached by identity)."""
    with _LOCK:
        hit = _INDEX.get(id(graph))
        if hit is not None and hit[0] is graph:
            return hit[1]
    idx = GraphIndex(graph)
    with _LOCK:
        if len(_INDEX) >= _MAX_INDEXES:
            _INDEX.pop(next(iter(_INDEX)))
        _INDEX[id(graph)] = (graph, idx)
    return idx


def _cache_key(node: GraphNode, n: int) -> tuple[Any, ...]:
    return (node.signature or node.name, node.kind, n, len(node.ops),
            tuple((w.shape, w.trainable) for w in node.weights),
            tuple(t.shape for t in node.inputs), tuple(t.shape for t in node.outputs))


def lookup(node: GraphNode, n: int) -> list[ShardingPattern] | None:
    """The cached patterns of ``node`` (or of an identical node, renamed), or None."""
    with _LOCK:
        hit = _CACHE.get(_cache_key(node, n))
    if hit is None:
        return None
    ref, pats = hit
    if ref is node:
        return list(pats)
    return _rename(ref, node, pats)


def store(node: GraphNode, n: int, pats: list[ShardingPattern]) -> None:
    with _LOCK:
        _CACHE[_cache_key(node, n)] = (node, pats)


def _rename(ref: GraphNode, node: GraphNode,
            pats: list[ShardingPattern]) -> list[ShardingPattern] | None:
    if len(ref.ops) != len(node.ops) or len(ref.weights) != len(node.weights):
        return None
    tmap: dict[str, str] = {}
    omap: dict[str, str] = {}
    for a, b in zip(ref.ops, node.ops):
        if a.type != b.type or len(a.outputs) != len(b.outputs):
            return None
        omap[a.name] = b.name
        for ta, tb in zip(a.outputs, b.outputs):
            tmap[ta.name] = tb.name
    for ta, tb in zip(ref.inputs, node.inputs):
        tmap[ta.name] = tb.name
    wmap: dict[str, str] = {}
    for wa, wb in zip(ref.weights, node.weights):
        if wa.shape != wb.shape:
            return None
        wmap[wa.path] = wb.path
        tmap[f"{wa.placeholder}:0"] = f"{wb.placeholder}:0"
    out = []
    for p in pats:
        try:
            out.append(dataclasses.replace(
                p,
                weights={wmap[k]: v for k, v in p.weights.items()},
                tensors={tmap[k]: v for k, v in p.tensors.items()},
                comms=tuple(dataclasses.replace(c, tensor=tmap[c.tensor]) for c in p.comms),
                rewrites={omap[k]: v for k, v in p.rewrites.items()}))
        except KeyError:
            return None
    return out
