"""Follow-your-input family: norm, elementwise, softmax, reshape, reduce.

In:  a GraphNode of kind ``norm``, ``elementwise``, ``softmax``, ``reshape`` or ``reduce``,
     and its SeedContext.
Out: its seeds (family ``batch`` and ``follow``):

- ``batch``: every input split on axis 0;
- ``follow-S{a}``: every input split on axis a (inputs broadcast against it stay
  replicated); valid where the op rules allow it -- an elementwise op on its last axis,
  a layer norm on its hidden axis (its mean becomes a partial mean, all-reduced), not a
  softmax on its softmax axis.

Weights (a norm's scale and offset) are inferred: split where every use is split.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind
from tapas.sharding.patterns.families.shared_seeds import batch_seed, follow_seeds
from tapas.sharding.patterns.pattern import PatternSeed
from tapas.sharding.patterns.seeds import SeedContext, register


@register(Kind.NORM, Kind.ELEMENTWISE, Kind.SOFTMAX, Kind.RESHAPE, Kind.REDUCE)
def follow_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    return batch_seed(ctx) + follow_seeds(ctx)
