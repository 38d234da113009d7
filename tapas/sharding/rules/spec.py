"""What an op rule returns and what it may read.

In:  nothing (definitions).
Out: :class:`OpSpec` -- a label per axis of every operand and output, as in an einsum
     equation, and what a split of each label means; :class:`OpContext` -- the static
     shapes of an op's operands and outputs and the value of its small constant operands;
     ``Rule``, the signature of a rule; and the label helpers the rules share
     (:class:`Fresh` label names, :func:`rank`, :func:`axis`, :func:`axes`,
     :func:`broadcast`, :func:`data_format_axes`).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from collections.abc import Callable, Sequence
from typing import Any, Literal

from tapas.ir import OpInfo

__all__ = ["Labels", "Shape", "Reduction", "FlopsKind", "OpSpec", "OpContext", "Rule", "Fresh",
           "rank", "axis", "axes", "broadcast", "data_format_axes"]

Labels = tuple[str, ...]
Shape = tuple[int, ...]
# what a split label missing from the outputs leaves: a partial sum ("sum"), a partial
# mean ("mean": the partial-mean rewrite), a masked lookup ("gather": vocab-gather), or
# nothing valid ("none")
Reduction = Literal["sum", "mean", "gather", "none"]
# how the flops of the op are counted (tapas.sharding.patterns.propagation.flops)
FlopsKind = Literal["contract", "conv", "depthwise", "reduce", "elementwise", "none"]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Axis labels of one op's operands and what a split of each label means
    (see :mod:`tapas.sharding.rules`)."""

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels | None, ...]
    no_split: frozenset[str] = frozenset()
    reduce: Reduction = "none"
    linear: Literal["all"] | tuple[int, ...] = ()   # "all" or indices of inputs that may be P
    meta_any: bool = False                 # meta inputs may have any placement
    flops: FlopsKind = "elementwise"
    global_shape: bool = False             # output is the *global* shape of input 0


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What a rule may read: input shapes and the value of constant inputs."""

    in_shapes: tuple[Shape | None, ...]
    out_shapes: tuple[Shape | None, ...]
    const: Callable[[int], Any]   # value of input i if it is a small constant, else None


Rule = Callable[[OpInfo, OpContext], OpSpec]


class Fresh:
    """Fresh label names: a, b, ..., z, then l27, l28, ..."""

    def __init__(self) -> None:
        self._it = (c for c in itertools.chain(
            string.ascii_lowercase, (f"l{i}" for i in itertools.count(27))))

    def __call__(self) -> str:
        return next(self._it)

    def many(self, k: int) -> Labels:
        return tuple(self() for _ in range(k))


def rank(shape: Shape | None) -> int:
    if shape is None:
        raise ValueError("unknown rank")
    return len(shape)


def axis(value: Any, rank: int) -> int:
    """``value`` as an axis in ``[0, rank)`` (negative axes count from the end)."""
    a = int(value)
    if not -rank <= a < max(rank, 1):
        raise ValueError(f"axis {a} out of range for rank {rank}")
    return a % rank if rank else 0


def axes(value: Any, rank: int) -> tuple[int, ...]:
    """A constant axis or list of axes, sorted and deduplicated."""
    if value is None:
        raise ValueError("axes are not a known constant")
    vals = value if isinstance(value, list) else [value]
    return tuple(sorted({axis(v, rank) for v in vals}))


def broadcast(shapes: Sequence[Shape], out: Shape, fresh: Fresh) -> tuple[tuple[Labels, ...],
                                                                          Labels]:
    """numpy broadcasting: output labels, and each input's labels (right-aligned; an input
    dimension of size 1 against a larger output dimension gets a label of its own)."""
    out_labels = fresh.many(len(out))
    ins = []
    for s in shapes:
        off = len(out) - len(s)
        labs = []
        for i, d in enumerate(s):
            j = i + off
            if j >= 0 and d == out[j] and d != 1:
                labs.append(out_labels[j])
            else:
                labs.append(fresh())
        ins.append(tuple(labs))
    return tuple(ins), out_labels


def data_format_axes(op: OpInfo, rank: int) -> tuple[int, int, tuple[int, ...]]:
    """(batch axis, channel axis, spatial axes) from the op's data_format attribute."""
    fmt = str(op.attrs.get("data_format", "NHWC"))
    if fmt.startswith("NC"):
        return 0, 1, tuple(range(2, rank))
    return 0, rank - 1, tuple(range(1, rank - 1))
