"""Sources: graph inputs get ``batch`` (split on axis 0); constants and opaque GraphNodes
get only ``replicate``, which every kind has (added by ``patterns_for``).

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind
from tapas.sharding.patterns.pattern import Family, PatternSeed
from tapas.sharding.patterns.seeds import SeedContext, register
from tapas.sharding.placements import Replica, Split


@register(Kind.INPUT)
def input_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    if not node.outputs or not all(t.shape for t in node.outputs):
        return []
    return [PatternSeed("batch", tuple(Replica() for _ in node.inputs),
                        outputs=tuple(Split(0) for _ in node.outputs), family=Family.BATCH)]


def replicate_seed(node: GraphNode) -> PatternSeed:
    return PatternSeed("replicate", tuple(Replica() for _ in node.inputs),
                       {w.path: Replica() for w in node.weights},
                       tuple(Replica() for _ in node.outputs) if node.kind is Kind.INPUT
                       else None, family=Family.REPLICATE)
