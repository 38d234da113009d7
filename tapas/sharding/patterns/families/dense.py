"""Dense / matmul family: data parallel, column and row (Megatron) splits.

In:  a GraphNode of kind ``dense`` or ``matmul`` that reads weights, and its SeedContext.
Out: its seeds, one per pattern below (family ``batch``, ``column``, ``row``, ``follow``):

- ``batch``: the input split on axis 0, weights replicated (their gradients all-reduced);
- ``column``: the kernel split on an output axis, the input replicated (its gradient
  all-reduced: Megatron's ``f``), the output split on its last axis (for a
  projection reshaped to heads, on the heads axis); the bias follows the kernel;
- ``row``: the kernel split on its contracted axis, the input split on its last axis; the
  partial output is all-reduced before the bias (``C_AR(MatMul(S1(X), S0(W)))``);
- ``follow-S{a}``: the input split on another axis, weights inferred.

A second kernel axis of the same role is named ``column-2`` etc.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind, WeightInfo
from tapas.sharding.patterns.families.shared_seeds import (
    batch_seed, dedupe_names, follow_seeds, weight_seeds)
from tapas.sharding.patterns.pattern import COLUMN, ROW, PatternId, PatternSeed, ShardingPattern
from tapas.sharding.patterns.seeds import SeedContext, register


def dense_role(w: WeightInfo, axis: int, pat: ShardingPattern) -> PatternId:
    return ROW if pat.fwd_comms else COLUMN


@register(Kind.DENSE, Kind.MATMUL)
def dense_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    if not node.weights:
        return []
    return dedupe_names(batch_seed(ctx) + weight_seeds(ctx, dense_role) + follow_seeds(ctx))
