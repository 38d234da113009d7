"""Convolution family (NHWC; spatial dimensions are never split).

In:  a GraphNode of kind ``conv`` and its SeedContext.
Out: its seeds (family ``batch``, ``column`` for out-channel, ``row`` for in-channel):

- ``batch``: the input split on axis 0 (data parallel);
- ``out-channel``: the kernel split on its output channels, the input replicated; a batch
  norm and bias that follow are split with it;
- ``in-channel``: the kernel split on its input channels, the input split on channels;
  the partial output is all-reduced (before a batch norm or bias).

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind, WeightInfo
from tapas.sharding.patterns.families.shared_seeds import batch_seed, dedupe_names, weight_seeds
from tapas.sharding.patterns.pattern import (IN_CHANNEL, OUT_CHANNEL, PatternId, PatternSeed,
                                             ShardingPattern)
from tapas.sharding.patterns.seeds import SeedContext, register


def conv_role(w: WeightInfo, axis: int, pat: ShardingPattern) -> PatternId:
    return IN_CHANNEL if pat.fwd_comms else OUT_CHANNEL


@register(Kind.CONV)
def conv_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    return dedupe_names(batch_seed(ctx) + weight_seeds(ctx, conv_role))
