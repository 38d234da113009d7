"""Rules of ops that keep the rank but change some axes: slices, pads, tiles, reversals,
rolls and band masks.

In:  such an :class:`tapas.ir.OpInfo` and its :class:`~tapas.sharding.rules.spec.OpContext`
     (the constant begins, sizes, paddings, multiples or axes).
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: an axis the op leaves untouched keeps
     its label (a split passes through); an axis it slices, pads, tiles, reverses or rolls
     is never split (nor is any axis whose constants are unknown).

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, OpContext, OpSpec, Shape, axes, rank

PAD = ("Pad", "PadV2", "MirrorPad")


def keep_axes_spec(op: OpInfo, kept: Sequence[bool], linear: tuple[int, ...] = (0,)) -> OpSpec:
    """Output has the input's rank; axis i keeps its label iff kept[i]."""
    r = len(kept)
    fresh = Fresh()
    xl = fresh.many(r)
    ol = tuple(xl[i] if kept[i] else fresh() for i in range(r))
    no = frozenset(xl[i] for i in range(r) if not kept[i]) | frozenset(
        ol[i] for i in range(r) if not kept[i])
    inputs = (xl,) + (None,) * (len(op.inputs) - 1)
    return OpSpec(inputs, (ol,), no_split=no, linear=linear, flops="none")


def pad(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Unpadded axes kept; PadV2 is linear only with a zero pad value."""
    r = rank(ctx.in_shapes[0])
    pads = ctx.const(1)
    kept = [False] * r if pads is None else [list(p) == [0, 0] for p in pads]
    linear: tuple[int, ...] = (0,)
    if op.type == "PadV2":
        linear = (0,) if ctx.const(2) in (0, 0.0) else ()
    return keep_axes_spec(op, kept, linear)


def tile(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    mult = ctx.const(1)
    if mult is not None:
        kept = [int(m) == 1 for m in mult]
    else:   # multiples computed in the graph: an axis of unchanged size is tiled once
        x, out = ctx.in_shapes[0], ctx.out_shapes[0]
        kept = [x is not None and out is not None and x[i] is not None and x[i] > 0
                and out[i] == x[i] for i in range(r)]
    return keep_axes_spec(op, kept, ())


def reverse(op: OpInfo, ctx: OpContext) -> OpSpec:
    """ReverseV2(x, axes)."""
    r = rank(ctx.in_shapes[0])
    moved = axes(ctx.const(1), r)
    return keep_axes_spec(op, [i not in moved for i in range(r)])


def roll(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Roll(x, shift, axes)."""
    r = rank(ctx.in_shapes[0])
    moved = axes(ctx.const(2), r)
    return keep_axes_spec(op, [i not in moved for i in range(r)])


def band_part(op: OpInfo, ctx: OpContext) -> OpSpec:
    """MatrixBandPart: the two matrix axes are masked, the batch axes kept."""
    r = rank(ctx.in_shapes[0])
    return keep_axes_spec(op, [i < r - 2 for i in range(r)], ())


def slice_(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Slice(x, begin, size): an axis is kept when the slice takes all of it."""
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    r = rank(x)
    begin = ctx.const(1)
    if begin is None or out is None:
        kept = [False] * r
    else:
        begin = begin if isinstance(begin, list) else [begin]
        kept = [int(begin[i]) == 0 and out[i] == x[i] for i in range(r)]  # type: ignore[index]
    return keep_axes_spec(op, kept)


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _strided_labels(op: OpInfo, x: Shape, xl: tuple[str, ...], fresh: Fresh,
                    consts: tuple[list[Any], list[Any], list[Any]]) -> tuple[list[str], set[str]]:
    """Output labels of a StridedSlice and its never-split labels: an input axis taken
    whole (or covered by the ellipsis, ``x[..., 2:]``) keeps its label; a new, partly taken
    or strided axis gets a private label; a shrunk axis disappears."""
    begin, end, strides = consts
    masks = {k: int(op.attrs.get(k, 0)) for k in ("begin_mask", "end_mask", "new_axis_mask",
                                                   "shrink_axis_mask", "ellipsis_mask")}
    r = len(x)
    ol: list[str] = []
    kept_in: set[int] = set()
    no: set[str] = set()
    a = 0  # input axis
    for s in range(len(begin)):
        bit = 1 << s
        if masks["ellipsis_mask"] & bit:
            # the axes no later entry of the spec takes (a new axis takes none)
            later = sum(1 for t in range(s + 1, len(begin))
                        if not masks["new_axis_mask"] & (1 << t))
            for _ in range(r - a - later):
                ol.append(xl[a])
                kept_in.add(a)
                a += 1
            continue
        if masks["new_axis_mask"] & bit:
            lab = fresh()
            no.add(lab)
            ol.append(lab)
            continue
        if a >= r:
            raise ValueError("slice spec longer than the input rank")
        d = x[a]
        b0 = 0 if masks["begin_mask"] & bit else int(begin[s])
        e0 = d if masks["end_mask"] & bit else int(end[s])
        if masks["shrink_axis_mask"] & bit:
            a += 1
            continue
        if int(strides[s]) == 1 and b0 in (0, -d) and e0 >= d:
            ol.append(xl[a])
            kept_in.add(a)
        else:
            lab = fresh()
            no.add(lab)
            ol.append(lab)
        a += 1
    for rest in range(a, r):
        ol.append(xl[rest])
        kept_in.add(rest)
    no |= {xl[i] for i in range(r) if i not in kept_in}
    return ol, no


def strided_slice(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    r = rank(x)
    fresh = Fresh()
    xl = fresh.many(r)
    begin, end, strides = ctx.const(1), ctx.const(2), ctx.const(3)
    inputs = (xl,) + (None,) * (len(op.inputs) - 1)
    if begin is None or end is None or strides is None or out is None:
        ol = fresh.many(rank(out))
        return OpSpec(inputs, (ol,), no_split=frozenset(xl) | frozenset(ol), flops="none")
    labels, no = _strided_labels(op, x, xl, fresh,  # type: ignore[arg-type]
                                 (_as_list(begin), _as_list(end), _as_list(strides)))
    if len(labels) != len(out):
        raise ValueError(f"slice spec gives rank {len(labels)}, the output has rank {len(out)}")
    return OpSpec(inputs, (tuple(labels),), no_split=frozenset(no), linear=(0,), flops="none")
