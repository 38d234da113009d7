"""Rules of convolutions, pooling and image resizes (NHWC or NCHW; spatial dimensions are
never split).

In:  a convolution, pooling or image resize :class:`tapas.ir.OpInfo` and its
     :class:`~tapas.sharding.rules.spec.OpContext`.
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: batch and channels may be split (a
     convolution's input channels leave a partial sum), spatial axes and kernel windows not.

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, Labels, OpContext, OpSpec, data_format_axes, rank

CONV = ("Conv1D", "Conv2D", "Conv3D")
POOL = ("MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D")
RESIZE = ("ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea")


def _windowed(op: OpInfo, ctx: OpContext) -> tuple[Fresh, list[str], list[str], int, int,
                                                  frozenset[str]]:
    """Labels of a sliding-window op's input and output: fresh labels per axis, the batch
    axis shared; returns (fresh, input labels, output labels, rank, channel axis, the
    spatial labels of both, which may never be split)."""
    r = rank(ctx.in_shapes[0])
    b, c, sp = data_format_axes(op, r)
    fresh = Fresh()
    xl = list(fresh.many(r))
    ol = list(fresh.many(r))
    ol[b] = xl[b]
    return fresh, xl, ol, r, c, frozenset(xl[i] for i in sp) | frozenset(ol[i] for i in sp)


def conv(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh, xl, ol, r, c, spatial = _windowed(op, ctx)
    co = fresh()
    ol[c] = co
    kl = tuple(fresh.many(r - 2)) + (xl[c], co)
    spatial = spatial | frozenset(kl[:-2])
    return OpSpec((tuple(xl), kl), (tuple(ol),), no_split=spatial, reduce="sum",
                  linear=(0, 1), flops="conv")


def depthwise_conv(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Channels split with the input (output channel c*m + j is contiguous in c); the
    channel multiplier has a label of its own that is never split."""
    fresh, xl, ol, r, c, spatial = _windowed(op, ctx)
    ol[c] = xl[c]
    mult = fresh()
    kl = tuple(fresh.many(r - 2)) + (xl[c], mult)
    no = spatial | frozenset(kl[:-2]) | {mult}
    return OpSpec((tuple(xl), kl), (tuple(ol),), no_split=no, reduce="none", linear=(0, 1),
                  flops="depthwise")


def pool(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Batch and channels kept; average pooling is linear, max pooling is not."""
    _, xl, ol, _, c, no = _windowed(op, ctx)
    ol[c] = xl[c]
    inputs: list[Labels | None] = [tuple(xl)] + [None] * (len(op.inputs) - 1)
    linear = (0,) if op.type.startswith("Avg") else ()
    return OpSpec(tuple(inputs), (tuple(ol),), no_split=no, linear=linear, flops="reduce")


def resize(op: OpInfo, ctx: OpContext) -> OpSpec:
    """An image resize (NHWC images, a constant or computed size): batch and channels kept,
    height and width never split; linear in the image (its interpolation weights depend on
    the sizes only)."""
    _, xl, ol, _, c, no = _windowed(op, ctx)
    ol[c] = xl[c]
    inputs: list[Labels | None] = [tuple(xl)] + [None] * (len(op.inputs) - 1)
    return OpSpec(tuple(inputs), (tuple(ol),), no_split=no, linear=(0,), flops="reduce")
