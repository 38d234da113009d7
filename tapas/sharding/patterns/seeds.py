"""What a family's seed function reads, and the registry of seed functions.

In:  a GraphNode, the graph index and N.
Out: :class:`SeedContext` -- the node, the index and N, :meth:`SeedContext.trial` (the
     pattern a seed gives, memoised) and :meth:`SeedContext.split_all`; the ``register``
     decorator and ``REGISTRY``, the seed functions of every :class:`tapas.ir.Kind`
     (filled by :mod:`tapas.sharding.patterns.families`); :func:`replicate_seed`, the seed
     every GraphNode has.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from tapas.ir import Graph, GraphNode, Kind
from tapas.sharding.patterns.pattern import REPLICATE, PatternSeed, ShardingPattern
from tapas.sharding.patterns.propagation import GraphIndex, Invalid, propagate
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["SeedContext", "SeedFn", "register", "REGISTRY", "replicate_seed"]


@dataclasses.dataclass(frozen=True)
class SeedContext:
    """What a seed function reads: the node, the graph index and the device count."""

    node: GraphNode
    index: GraphIndex
    num_devices: int
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def trial(self, seed: PatternSeed) -> ShardingPattern | None:
        """The pattern ``seed`` gives (named after the seed), or None when invalid; memoised,
        so a family may try seeds to name them by their result."""
        key = _seed_key(seed)
        if key not in self.memo:
            try:
                self.memo[key] = propagate(self.node, self.index, self.num_devices, seed)
            except Invalid as e:
                self.memo[key] = e
        got = self.memo[key]
        if isinstance(got, ShardingPattern):
            return dataclasses.replace(got, name=seed.name, family=seed.family)
        return None

    @property
    def graph(self) -> Graph:
        return self.index.graph

    def split_all(self, axis: int) -> tuple[Placement, ...]:
        """Every node input split on ``axis`` (inputs too small or of other size there, R):
        right-aligned like numpy broadcasting against the first input of largest rank."""
        ins = self.node.inputs
        if not ins:
            return ()
        ref = max(ins, key=lambda t: len(t.shape or ()))
        r = len(ref.shape or ())
        if not 0 <= axis < r:
            return tuple(Replica() for _ in ins)
        size = ref.shape[axis]  # type: ignore[index]
        out: list[Placement] = []
        for t in ins:
            s = t.shape or ()
            a = axis - (r - len(s))
            out.append(Split(a) if 0 <= a < len(s) and s[a] == size and size != 1
                       else Replica())
        return tuple(out)


def _seed_key(seed: PatternSeed) -> tuple[Any, ...]:
    return (seed.inputs, tuple(sorted(seed.weights.items(), key=str)), seed.outputs)


SeedFn = Callable[[GraphNode, SeedContext], Iterable[PatternSeed]]
REGISTRY: dict[Kind, list[SeedFn]] = {k: [] for k in Kind}


def register(*kinds: Kind) -> Callable[[SeedFn], SeedFn]:
    """Register a seed function for GraphNodes of the given kinds."""
    def deco(fn: SeedFn) -> SeedFn:
        for k in kinds:
            REGISTRY[Kind(k)].append(fn)
        return fn
    return deco


def replicate_seed(node: GraphNode) -> PatternSeed:
    """Everything replicated (an input GraphNode's outputs too): valid for every kind."""
    return PatternSeed(REPLICATE, tuple(Replica() for _ in node.inputs),
                       {w.path: Replica() for w in node.weights},
                       tuple(Replica() for _ in node.outputs) if node.kind is Kind.INPUT
                       else None)
