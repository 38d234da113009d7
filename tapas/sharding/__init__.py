"""Stage 3a, sharding: how each GraphNode can run on N devices (pure, no TF).

In:  a :class:`tapas.ir.Graph` and a device count N.
Out: for every GraphNode, its :class:`~tapas.sharding.patterns.ShardingPattern` s: the
     placement of every input, weight, output and inner tensor, the collectives the pattern
     needs, and its SRC expression.

* :mod:`tapas.sharding.placements`: ``Split``/``Replica``/``Partial``, ``Collective``,
  ``Comm`` and ``reshard`` -- the vocabulary.
* :mod:`tapas.sharding.expressions`: SRC expressions (``C_AR(MatMul(S1(X), S0(W)))``).
* :mod:`tapas.sharding.rules`: how each TF op type may be split (einsum-style axis labels),
  one table from op type to rule -- where a new op's rule goes.
* :mod:`tapas.sharding.patterns`: the pattern families (which splits to try on each kind
  of GraphNode), the propagation that checks a seed op by op with the rules, and
  ``tapas.layers`` pins.
* :mod:`tapas.sharding.gradients`: which tensors get a gradient in a training step (the
  collectives a pattern's backward runs depend on it).
* :mod:`tapas.sharding.rows`: whether each example's outputs depend on its own row only
  (the batch followed op by op with the rules), what decides whether a smaller last batch
  can be filled up.
"""

from tapas.sharding.placements import (Collective, Comm, Partial, Placement, Replica, Split,
                                       parse_placement, reshard)

__all__ = ["Split", "Replica", "Partial", "Placement", "parse_placement", "Collective", "Comm",
           "reshard"]
