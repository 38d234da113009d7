"""Embedding family: gathers from a weight table.

In:  a GraphNode of kind ``embedding`` and its SeedContext.
Out: its seeds (family ``row`` for vocab, ``hidden``, ``batch``, ``follow``):

- ``vocab``: the table split on its rows; each device looks up the ids that fall into
  its shard (rewrite ``vocab-gather``: ids shifted by the shard's first row, rows outside
  the shard zeroed), the partial result is all-reduced;
- ``hidden``: the table split on its embedding axis, the output split on its last axis;
- ``batch``: the ids split on axis 0 (data parallel), the table replicated.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind, WeightInfo
from tapas.sharding.patterns.families.shared_seeds import (
    batch_seed, dedupe_names, follow_seeds, weight_seeds)
from tapas.sharding.patterns.pattern import (HIDDEN, ROW, VOCAB, PatternId, PatternSeed, Rewrite,
                                             ShardingPattern)
from tapas.sharding.patterns.seeds import SeedContext, register


def embedding_role(w: WeightInfo, axis: int, pat: ShardingPattern) -> PatternId:
    if Rewrite.VOCAB_GATHER in pat.rewrites.values():
        return VOCAB
    return ROW if pat.fwd_comms else HIDDEN


@register(Kind.EMBEDDING)
def embedding_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    return dedupe_names(batch_seed(ctx) + weight_seeds(ctx, embedding_role)
                        + follow_seeds(ctx))
