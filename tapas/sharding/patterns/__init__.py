"""Sharding patterns: the parallel implementations of each GraphNode (paper 4.4).

In:  a :class:`tapas.ir.GraphNode`, its :class:`tapas.ir.Graph` and the number of devices N.
Out: :func:`patterns_for` -- the valid :class:`ShardingPattern` s of the node, in a stable
     order, ``replicate`` first; :func:`explain` -- why a named pattern is invalid;
     :func:`pattern_by_name` (a name given as text) and :func:`pattern_by_id` (a typed
     :class:`PatternId`, e.g. from a Strategy).

The pipeline of this package, one module each:

* :mod:`~.pattern` -- ``ShardingPattern``, ``PatternSeed``, ``Family``, ``Rewrite``;
* :mod:`~.families` -- per :class:`tapas.ir.Kind`, the seeds to try (registered with
  ``@register`` in :mod:`~.seeds`): which inputs and weights to split;
* :mod:`~.propagation` -- a seed through the node's ops with the per-op rules of
  :mod:`tapas.sharding.rules`, which decide the placement of every tensor, the
  collectives and the local rewrites;
* :mod:`~.pins` -- the ``shard=`` pins of ``tapas.layers`` layers;
* :mod:`~.cache` -- graph indexes, and patterns per GraphNode signature, renamed onto
  identical nodes;
* this module -- the valid patterns of a node, and ``explain``.
 Results are cached
per (signature, weight shapes, N): identical GraphNodes (the layers of a T5) are
propagated once and renamed.

Example::

    >>> from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo
    >>> x = TensorInfo("x:0", (8, 16), "float32")
    >>> w = WeightInfo("dense/kernel", (16, 32), "float32", True, "w")
    >>> ops = (OpInfo("w", "Placeholder", (), (TensorInfo("w:0", (), "resource"),)),
    ...        OpInfo("r", "ReadVariableOp", ("w:0",), (TensorInfo("r:0", (16, 32), "float32"),)),
    ...        OpInfo("mm", "MatMul", ("x:0", "r:0"), (TensorInfo("mm:0", (8, 32), "float32"),)))
    >>> xin = GraphNode(0, "x", Kind.INPUT, (OpInfo("x", "Placeholder", (), (x,)),), (), (x,), ())
    >>> dense = GraphNode(1, "dense", Kind.DENSE, ops, (x,), (ops[2].outputs[0],), (w,))
    >>> g = Graph.build([xin, dense])
    >>> [p.name for p in patterns_for(g.nodes[1], g, 4)]
    ['replicate', 'batch', 'row', 'column']
    >>> print(pattern_by_name(g.nodes[1], g, 4, "row").expr)
    C_AR(MatMul(S1(X), S0(W)))

This package imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tapas.ir import Graph, GraphNode
from tapas.sharding.patterns import cache, families
from tapas.sharding.patterns.pattern import (REPLICATE, Family, PatternId, PatternSeed, Rewrite,
                                             ShardingPattern)
from tapas.sharding.patterns.pins import PinError, apply_pin
from tapas.sharding.patterns.propagation import Invalid, propagate
from tapas.sharding.patterns.seeds import REGISTRY, SeedContext, register, replicate_seed
from tapas.sharding.placements import Replica

__all__ = ["ShardingPattern", "PatternSeed", "PatternId", "Family", "Rewrite", "register",
           "REGISTRY", "REPLICATE", "patterns_for", "explain", "pattern_by_name",
           "pattern_by_id", "clear_cache", "Invalid", "PinError"]

_ = families  # imported to fill the registry


def clear_cache() -> None:
    """Forget cached graph indexes and patterns."""
    cache.clear()


def _check_n(num_devices: int) -> None:
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r}: must be an int >= 1 (the size of the "
                         "1-D device mesh)")


_BUILD_ERRORS = (ValueError, KeyError, IndexError, TypeError, ArithmeticError)


def _seeds(node: GraphNode, ctx: SeedContext,
           failed: list[str] | None = None) -> list[PatternSeed]:
    """``replicate`` and every family's seeds for ``node``. A family function that fails
    for an unexpected reason is recorded in ``failed`` (when given) and skipped."""
    seeds = [replicate_seed(node)]
    names = {REPLICATE}
    for fn in REGISTRY[node.kind]:
        try:
            proposed = list(fn(node, ctx))
        except _BUILD_ERRORS as e:
            if failed is None:
                raise
            failed.append(f"{fn.__name__} ({type(e).__name__}: {e})")
            continue
        for s in proposed:
            if s.family is None:
                raise TypeError(f"seed function {fn.__module__}.{fn.__qualname__} proposed "
                                f"seed {s.name!r} for GraphNode '{node.name}' without a "
                                "family: pass PatternSeed(..., family=Family.<kind>)")
            if s.name not in names:
                names.add(s.name)
                seeds.append(s)
    return seeds


def _compute(node: GraphNode, ctx: SeedContext) -> list[ShardingPattern]:
    """The node's patterns. A seed that fails for an unexpected reason (a bug, or an op
    this stage has not met) is left out, never fatal: the node keeps ``replicate``, with
    a note saying what could not be built, and the search reports the note."""
    out: list[ShardingPattern] = []
    keys: set[Any] = set()
    failed: list[str] = []
    for seed in _seeds(node, ctx, failed):
        try:
            if seed.family is Family.REPLICATE:
                pat = propagate(node, ctx.index, ctx.num_devices, seed, replicate_unknown=True)
            else:
                pat = ctx.trial(seed)
                if pat is None:
                    continue
        except Invalid:
            continue
        except _BUILD_ERRORS as e:
            failed.append(f"{seed.name!r} ({type(e).__name__}: {e})")
            continue
        k = pat.key()
        if k in keys:
            continue
        keys.add(k)
        out.append(pat)
    if not failed:
        return out
    note = f"pattern(s) {', '.join(failed)} could not be built and were left out"
    if not out or out[0].family is not Family.REPLICATE:
        out.insert(0, bare_replicate(node))
    out[0] = dataclasses.replace(out[0], note=note)
    return out


def bare_replicate(node: GraphNode) -> ShardingPattern:
    """``replicate`` written down without propagation: every tensor whole on every device,
    no collective (what the node does on one device, on each of them)."""
    r = Replica()
    return ShardingPattern(
        name=REPLICATE, inputs=tuple(r for _ in node.inputs),
        outputs=tuple(r for _ in node.outputs), weights={w.path: r for w in node.weights},
        tensors={t.name: r for op in node.ops for t in op.outputs}, comms=(), rewrites={},
        expr=f"{''.join(p.capitalize() for p in node.kind.value.split('-'))}(R(X))", flops=0.0,
        family=REPLICATE.family)


def patterns_for(node: GraphNode, graph: Graph, num_devices: int) -> list[ShardingPattern]:
    """The valid sharding patterns of ``node`` on ``num_devices`` devices, ``replicate``
    first, then the families' patterns in their order (identical implementations once).

    A node pinned by its ``tapas.layers`` layer (``GraphNode.pin``) has just the pattern
    the pin selects; :class:`PinError` when the pin cannot be honoured (``pins.py``)."""
    pats = _unpinned(node, graph, num_devices)
    if node.pin is None:
        return pats
    return apply_pin(node, pats, num_devices,
                     lambda name: explain(node, graph, num_devices, name))


def _unpinned(node: GraphNode, graph: Graph, num_devices: int) -> list[ShardingPattern]:
    _check_n(num_devices)
    pats = cache.lookup(node, num_devices)
    if pats is not None:
        return pats
    pats = _compute(node, SeedContext(node, cache.graph_index(graph), num_devices))
    cache.store(node, num_devices, pats)
    return list(pats)


def pattern_by_name(node: GraphNode, graph: Graph, num_devices: int,
                    name: str) -> ShardingPattern:
    """The valid pattern called ``name``; ValueError (with :func:`explain`'s reason) if none."""
    for p in patterns_for(node, graph, num_devices):
        if p.name == name:
            return p
    raise ValueError(explain(node, graph, num_devices, name))


def pattern_by_id(node: GraphNode, graph: Graph, num_devices: int,
                  pattern_id: PatternId) -> ShardingPattern | None:
    """The valid pattern of ``node`` whose id is ``pattern_id`` (family and variant), or
    None when it has none (a strategy from an older pattern stage)."""
    for p in patterns_for(node, graph, num_devices):
        if p.name == pattern_id and p.family is pattern_id.family:
            return p
    return None


def explain(node: GraphNode, graph: Graph, num_devices: int, name: str) -> str:
    """Why pattern ``name`` is not a valid pattern of ``node`` on ``num_devices`` devices
    (or that it is valid)."""
    _check_n(num_devices)
    ctx = SeedContext(node, cache.graph_index(graph), num_devices)
    seeds = _seeds(node, ctx)
    seed = next((s for s in seeds if s.name == name), None)
    if seed is None:
        return (f"GraphNode '{node.name}' (kind {node.kind.value}) has no pattern named "
                f"{name!r}; its candidates are: {', '.join(s.name for s in seeds)}")
    try:
        pat = propagate(node, ctx.index, num_devices, seed,
                        replicate_unknown=(seed.family is Family.REPLICATE))
    except Invalid as e:
        return (f"pattern {name!r} of GraphNode '{node.name}' is invalid on {num_devices} "
                f"devices: {e}")
    valid = {p.name for p in _unpinned(node, graph, num_devices)}
    if name not in valid:
        same = next(p.name for p in _unpinned(node, graph, num_devices)
                    if p.key() == pat.key())
        return (f"pattern {name!r} of GraphNode '{node.name}' is valid on {num_devices} "
                f"devices but is the same implementation as {same!r}, listed under that name")
    return f"pattern {name!r} of GraphNode '{node.name}' is valid on {num_devices} devices"
