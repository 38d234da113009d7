"""One propagation problem: a seed on a GraphNode on N devices, and why it can fail.

In:  a GraphNode, its :class:`~tapas.sharding.patterns.propagation.index.GraphIndex`, the
     device count N and a :class:`~tapas.sharding.patterns.pattern.PatternSeed`.
Out: :class:`Trial` (what every pass of the propagation reads, with the divisibility
     check) and :class:`Invalid` (a seed that gives no pattern, with the reason).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from tapas.ir import GraphNode, WeightInfo
from tapas.sharding.patterns.pattern import PatternSeed
from tapas.sharding.patterns.propagation.index import GraphIndex
from tapas.sharding.placements import Placement, Split

__all__ = ["Invalid", "Trial", "FLOAT_DTYPES"]

# dtypes that carry gradients
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64",
                          "complex128", "half", "float", "double"})


class Invalid(Exception):
    """A seed that gives no valid pattern; ``str()`` says why."""


@dataclasses.dataclass(frozen=True, eq=False)
class Trial:
    """Seed ``seed`` on ``node`` on ``n`` devices. ``replicate_unknown``: an op without a
    rule is allowed when all its inputs are replicated (the all-replicated pattern only)."""

    node: GraphNode
    index: GraphIndex
    n: int
    seed: PatternSeed
    replicate_unknown: bool

    @functools.cached_property
    def weight_ops(self) -> dict[str, WeightInfo]:
        """The node's weights by the name of their resource placeholder op."""
        return {w.placeholder: w for w in self.node.weights}

    @functools.cached_property
    def weight_tensors(self) -> dict[str, WeightInfo]:
        """The node's weights by their resource tensor (``placeholder:0``)."""
        return {f"{w.placeholder}:0": w for w in self.node.weights}

    def check_divisible(self, what: str, shape: Sequence[int] | None, p: Placement) -> None:
        """Invalid when ``p`` splits a dimension of ``shape`` that N does not divide."""
        if not isinstance(p, Split):
            return
        if shape is None or p.axis >= len(shape):
            raise Invalid(f"{what} has shape {shape}, which has no dimension {p.axis} to split")
        if any(d < 0 for d in shape):
            # a length the traced graph leaves unknown (Hugging Face MobileViT's resize in
            # a tf.cond): the collectives that would reshard a piece of it need its shape
            raise Invalid(f"{what} has shape {shape}, dynamic in the traced graph: it stays "
                          "whole")
        d = shape[p.axis]
        if d % self.n != 0 or d < self.n:
            raise Invalid(f"dimension {p.axis} of {what} has size {d}, not divisible by "
                          f"{self.n} devices")
