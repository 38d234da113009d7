"""MoE expert einsum family: a stacked expert weight ``[E, ...]`` applied per expert.

In:  a GraphNode of kind ``expert-einsum`` and its SeedContext.
Out: its seeds (family ``expert``, ``column``, ``row``, ``batch``, ``follow``):

- ``expert``: the weight and the dispatched tokens split on the expert dimension (each
  device runs E / N experts; no communication inside the node);
- ``column``/``row``: a split of the per-expert matrix, as for a dense layer;
- ``batch``: the tokens' leading axis split, the weight replicated.

The nested expert + tensor split needs a 2-D mesh: ``tapas.planning.experts`` splits the
experts over the mesh rows and keeps ``column``/``row`` of these patterns inside a row.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind, WeightInfo
from tapas.sharding.patterns.families.dense import dense_role
from tapas.sharding.patterns.families.shared_seeds import (
    batch_seed, dedupe_names, follow_seeds, weight_seeds)
from tapas.sharding.patterns.pattern import EXPERT, PatternId, PatternSeed, ShardingPattern
from tapas.sharding.patterns.seeds import SeedContext, register
from tapas.sharding.placements import Split


def expert_role(w: WeightInfo, axis: int, pat: ShardingPattern) -> PatternId:
    if axis == 0 and any(isinstance(p, Split) for p in pat.inputs) and not pat.fwd_comms:
        return EXPERT
    return dense_role(w, axis, pat)


@register(Kind.EXPERT_EINSUM)
def expert_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    seeds = weight_seeds(ctx, expert_role) + batch_seed(ctx) + follow_seeds(ctx)
    return dedupe_names(seeds)
