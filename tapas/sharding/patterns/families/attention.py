"""Attention family: weight-less batched matmuls/einsums of scores and context, and the
MoE dispatch/combine einsums (kind ``matmul``).

In:  a GraphNode of kind ``attention-score``, ``attention-context`` or a weight-less
     ``matmul``, and its SeedContext.
Out: one seed per label of its first contraction (family ``batch``, ``heads`` or ``split``).

One seed per label of the contraction: ``batch`` (the leading label shared by every
operand), ``heads`` (another label shared by every operand and the output: attention
heads), ``split-...`` for the others (named by the input placements, e.g. ``split-S2-R``
for a MoE dispatch split on the expert axis of the dispatch mask). A contracted label
gives a partial result, all-reduced at the node output.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind
from tapas.sharding.patterns.families.shared_seeds import label_seeds
from tapas.sharding.patterns.pattern import PatternSeed
from tapas.sharding.patterns.seeds import SeedContext, register


@register(Kind.ATTENTION_SCORE, Kind.ATTENTION_CONTEXT)
def attention_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    return label_seeds(ctx, heads=True)


@register(Kind.MATMUL)
def matmul_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    if node.weights:
        return []
    return label_seeds(ctx, heads=False)
