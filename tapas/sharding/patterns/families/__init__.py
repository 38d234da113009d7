"""The pattern families: which splits to try on each kind of GraphNode.

In:  a GraphNode and its :class:`~tapas.sharding.patterns.seeds.SeedContext`.
Out: :class:`~tapas.sharding.patterns.pattern.PatternSeed` s, each named and given its
     :class:`~tapas.sharding.patterns.pattern.Family`; the propagation turns each into a
     pattern or rejects it. Importing this package registers every family's seed
     functions (``@register(Kind...)``) in :data:`tapas.sharding.patterns.seeds.REGISTRY`.

=================  =====================================================================
module             kinds and patterns
=================  =====================================================================
``dense``          dense, matmul with weights: batch, column, row, follow-S{a}
``conv``           conv: batch, out-channel (column), in-channel (row)
``embedding``      embedding: batch, vocab (row), hidden, follow-S{a}
``moe``            expert einsum: expert, column, row, batch, follow-S{a}
``attention``      attention score/context, weight-less matmul: batch, heads, split-...
``follow``         norm, elementwise, softmax, reshape, reduce: batch, follow-S{a}
``graph_inputs``   input: batch
``whole_layer``    ``tapas.layers`` attention, feed-forward, MoE: batch, heads, column-row
``shared_seeds``   the helpers the families share (batch, follow, weight and label splits)
=================  =====================================================================

Every GraphNode also has ``replicate`` (:func:`tapas.sharding.patterns.seeds.replicate_seed`).
A new family: a module here with a seed function per kind, decorated with ``@register``,
imported below; every seed it yields must name its ``family``.

This package imports no TensorFlow.
"""

from __future__ import annotations

from tapas.sharding.patterns.families import (attention, conv, dense, embedding, follow,
                                              graph_inputs, moe, whole_layer)

__all__ = ["attention", "conv", "dense", "embedding", "follow", "graph_inputs", "moe",
           "whole_layer"]
