"""Flops one device spends on one op under a pattern.

In:  the op, its :class:`~tapas.sharding.rules.OpSpec`, the placements of its operands, the
     split label, and the shapes and placements the forward pass has found.
Out: :func:`op_flops` -- 2 x the local contraction volume for contractions and
     convolutions (a depthwise convolution's output element reads one channel's window),
     the local input size for reductions, the local output size for
     elementwise ops, 0 for data movement; :func:`op_elements` -- the elements a
     memory-bound op touches on one device (the local output of an elementwise op, of a
     depthwise convolution or of an op that copies data: a transpose, concat, slice, pad,
     gather...; the local input of a reduction; 0 for contractions, dense convolutions and
     ops that only relabel or pass on a buffer: a reshape, an identity), what
     ``tapas.planning.cost.compute_time`` prices at the cluster's elementwise rate when it
     has one; :func:`gemm_width`, the width of the matrix multiply a contraction or dense
     convolution runs on one device, and :func:`width_bucket`, the power of two whose
     rate prices it (``Cluster.device_width_efficiency``); :func:`volume`, a shape's
     element count.

This module imports no TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tapas.ir import OpInfo
from tapas.sharding import rules
from tapas.sharding.placements import Placement, Replica
from tapas.sharding.rules import gather, shape, slicing

__all__ = ["op_flops", "op_elements", "gemm_width", "width_bucket", "volume", "DENSE_KINDS",
           "COPYING_OPS", "ALIASING_OPS"]

# the flops kinds priced at the FLOP rate (``dense_flops``); every other op is memory-bound.
# A depthwise convolution is too: kh x kw multiply-adds per output element, one channel's
# window, no reuse across channels; measured here its training step runs at the rate of an
# elementwise op per output element, 20-50 x slower per FLOP than a dense convolution
DENSE_KINDS = frozenset({"contract", "conv"})
# data-movement ops (``flops="none"``) whose kernels write a new buffer: priced by their
# output's elements like an elementwise op; the other "none" ops (reshape, squeeze,
# identity, shape queries, constants, variable reads) only relabel or alias a buffer
COPYING_OPS = frozenset({*shape.TRANSPOSE, "ConcatV2", "Pack", "Unpack", "Split", "SplitV",
                         "BroadcastTo", *slicing.PAD, "Tile", "ReverseV2", "Roll",
                         "MatrixBandPart", "Slice", "StridedSlice", *gather.GATHER, "OneHot"})
# ops the rules count as elementwise that hand their input on without touching it
ALIASING_OPS = frozenset({"Identity", "StopGradient", "PreventGradient", "Snapshot",
                          "EnsureShape"})


def volume(shape: Sequence[int]) -> float:
    """Element count (negative dimensions count as 0)."""
    out = 1.0
    for x in shape:
        out *= max(int(x), 0)
    return out


def op_flops(n: int, op: OpInfo, spec: rules.OpSpec, names: Sequence[str],
             in_pl: Sequence[Placement], label: str | None,
             shapes: Mapping[str, tuple[int, ...] | None],
             produced: Mapping[str, Placement]) -> float:
    if spec.flops == "none" or not op.outputs:
        return 0.0
    if spec.flops == "contract":
        return _contraction(n, spec, names, label, shapes)
    out = op.outputs[0]
    out_local = produced.get(out.name, Replica()).local_shape(out.shape or (), n)
    if spec.flops == "conv":
        kshape = shapes.get(names[1]) or ()
        kl = spec.inputs[1] or ()
        k = volume(kshape[:-1])
        if label is not None and len(kl) >= 2 and kl[-2] == label:
            k /= n
        return 2.0 * volume(out_local) * k
    if spec.flops == "depthwise":   # each output reads one channel's window: kh x kw
        return 2.0 * volume(out_local) * volume((shapes.get(names[1]) or ())[:-2])
    if spec.flops == "reduce":
        return volume(in_pl[0].local_shape(shapes.get(names[0]) or (), n))
    return volume(out_local)


def _local_sizes(n: int, spec: rules.OpSpec, names: Sequence[str], label: str | None,
                 shapes: Mapping[str, tuple[int, ...] | None]) -> dict[str, int]:
    """Every operand label's size on one device (the split one divided by N)."""
    sizes: dict[str, int] = {}
    for x, labs in zip(names, spec.inputs):
        if labs is None:
            continue
        for lab, d in zip(labs, shapes.get(x) or ()):
            sizes[lab] = max(sizes.get(lab, 1), d)
    if label is not None and label in sizes:
        sizes[label] //= n
    return sizes


def _contraction(n: int, spec: rules.OpSpec, names: Sequence[str], label: str | None,
                 shapes: Mapping[str, tuple[int, ...] | None]) -> float:
    """2 x the product of every label's size, the split one divided by N."""
    return 2.0 * volume(list(_local_sizes(n, spec, names, label, shapes).values()))


def gemm_width(n: int, op: OpInfo, spec: rules.OpSpec, names: Sequence[str],
               label: str | None, shapes: Mapping[str, tuple[int, ...] | None],
               produced: Mapping[str, Placement]) -> float | None:
    """The width of the matrix multiply a contraction or dense convolution runs on one
    device: seen as ``[M, K] x [K, N]`` per batch entry (a convolution's K is its window
    times its local input channels, N its local output channels, M the rest of its
    output), the geometric mean of the two smallest of M, N and K. A CPU or GPU kernel
    runs far below its peak rate on thin operands (``docs/cost.md``, "Compute"), and a
    split on a channel or hidden axis thins them. None for other ops and for contractions of other than two operands.

    >>> from tapas.ir import OpInfo, TensorInfo
    >>> from tapas.sharding.rules import OpSpec
    >>> mm = OpSpec((("m", "k"), ("k", "n")), (("m", "n"),), flops="contract")
    >>> op = OpInfo("mm", "MatMul", (), (TensorInfo("y", (1024, 16), "float32"),))
    >>> shapes = {"x": (1024, 64), "w": (64, 16)}
    >>> gemm_width(1, op, mm, ["x", "w"], None, shapes, {})   # sqrt(64 x 16)
    32.0
    >>> gemm_width(4, op, mm, ["x", "w"], "k", shapes, {})    # K split 4 ways: sqrt(16 x 16)
    16.0
    """
    if spec.flops == "contract":
        if len(spec.inputs) != 2 or any(labs is None for labs in spec.inputs) or \
                not spec.outputs or spec.outputs[0] is None:
            return None
        sizes = _local_sizes(n, spec, names, label, shapes)
        a, b = (set(labs) for labs in spec.inputs)
        out = set(spec.outputs[0])
        dims = [volume([sizes.get(x, 1) for x in group])
                for group in (a & out - b, b & out - a, a & b - out)]
    elif spec.flops == "conv":
        kshape, kl = shapes.get(names[1]) or (), spec.inputs[1] or ()
        if len(kshape) < 3 or len(kl) != len(kshape) or not op.outputs:
            return None
        cin = kshape[-2] // (n if label == kl[-2] else 1)
        cout = kshape[-1] // (n if label == kl[-1] else 1)
        out = op.outputs[0]
        local = produced.get(out.name, Replica()).local_shape(out.shape or (), n)
        dims = [volume(local) / max(cout, 1), float(cout), volume(kshape[:-2]) * cin]
    else:
        return None
    small = sorted(max(d, 1.0) for d in dims)[:2]
    return math.sqrt(small[0] * small[1])


def width_bucket(width: float) -> int:
    """The power of two at or below ``width`` (at least 1): the key under which a pattern
    keeps the FLOPs of matrix multiplies that wide (``ShardingPattern.dense_by_width``)."""
    return 1 << max(0, int(math.floor(math.log2(max(width, 1.0)) + 1e-9)))


def op_elements(n: int, op: OpInfo, spec: rules.OpSpec, names: Sequence[str],
                in_pl: Sequence[Placement], shapes: Mapping[str, tuple[int, ...] | None],
                produced: Mapping[str, Placement]) -> float:
    """Elements a memory-bound op reads or writes on one device (see the module docstring):
    what its time is proportional to where it runs at memory speed, not at the matmul
    rate."""
    if not op.outputs or spec.flops in DENSE_KINDS:
        return 0.0
    if (spec.flops == "none" and op.type not in COPYING_OPS) or op.type in ALIASING_OPS:
        return 0.0
    if spec.flops == "reduce":
        return volume(in_pl[0].local_shape(shapes.get(names[0]) or (), n))
    return sum(volume(produced.get(t.name, Replica()).local_shape(t.shape or (), n))
               for t in op.outputs)
