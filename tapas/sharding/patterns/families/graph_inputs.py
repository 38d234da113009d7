"""Graph inputs: the ``batch`` pattern (every output split on axis 0) of an input GraphNode.

In:  a GraphNode of kind ``input`` and its :class:`~tapas.sharding.patterns.seeds.SeedContext`.
Out: its ``batch`` seed (none when an output's shape is unknown). Constants and opaque
     GraphNodes get only ``replicate``, which every kind has
     (:func:`tapas.sharding.patterns.seeds.replicate_seed`).

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import GraphNode, Kind
from tapas.sharding.patterns.pattern import BATCH, PatternSeed
from tapas.sharding.patterns.seeds import SeedContext, register
from tapas.sharding.placements import Replica, Split


@register(Kind.INPUT)
def input_patterns(node: GraphNode, ctx: SeedContext) -> Iterable[PatternSeed]:
    if not node.outputs or not all(t.shape for t in node.outputs):
        return []
    return [PatternSeed(BATCH, tuple(Replica() for _ in node.inputs),
                        outputs=tuple(Split(0) for _ in node.outputs))]

