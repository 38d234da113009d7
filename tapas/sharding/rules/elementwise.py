"""Rules of elementwise ops: unary functions, binary arithmetic with numpy broadcasting,
casts, selects, bias adds and the softmax family.

In:  an elementwise :class:`tapas.ir.OpInfo` and its :class:`~tapas.sharding.rules.spec.OpContext`.
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: every operand labelled like the output
     it broadcasts against (a size-1 dimension gets a label of its own), and which operands
     may carry a partial sum through the op (``linear``).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, Labels, OpContext, OpSpec, broadcast, rank

# linear unary ops: a partial sum passes through them unreduced
UNARY_LINEAR = frozenset({"Neg", "Identity", "StopGradient", "PreventGradient", "Snapshot",
                          "CheckNumerics", "EnsureShape"})
UNARY = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Gelu", "Erf", "Erfc", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Abs",
    "Sign", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Rint", "Sin", "Cos", "IsNan",
    "IsInf", "IsFinite", "LogicalNot", "Swish"})
ADDITIVE = ("Add", "AddV2", "Sub", "AddN")
PRODUCT = ("Mul", "MulNoNan")
QUOTIENT = ("RealDiv", "Div", "DivNoNan")
BINARY = ("FloorDiv", "FloorMod", "TruncateDiv", "Maximum", "Minimum", "Pow",
          "SquaredDifference", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
          "GreaterEqual", "LogicalAnd", "LogicalOr", "Xdivy", "Xlogy")
TERNARY = ("SelectV2", "Select", "ClipByValue")

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def elementwise(op: OpInfo, ctx: OpContext, data: Sequence[int],
                linear: Literal["all"] | tuple[int, ...]) -> OpSpec:
    """Operands ``data`` broadcast against output 0; the others are meta operands."""
    fresh = Fresh()
    out = ctx.out_shapes[0]
    if out is None:
        raise ValueError("unknown output shape")
    shapes = [ctx.in_shapes[i] for i in data]
    if any(s is None for s in shapes):
        raise ValueError("unknown input shape")
    ins_l, out_l = broadcast(shapes, out, fresh)  # type: ignore[arg-type]
    inputs: list[Labels | None] = [None] * len(op.inputs)
    for i, labs in zip(data, ins_l):
        inputs[i] = labs
    outputs = tuple(out_l if k == 0 else (ctx.out_shapes[k] and fresh.many(len(ctx.out_shapes[k])))
                    for k in range(len(op.outputs)))
    return OpSpec(tuple(inputs), outputs, linear=linear)


def unary_linear(op: OpInfo, ctx: OpContext) -> OpSpec:
    return elementwise(op, ctx, [0], (0,))


def unary(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Also ZerosLike/OnesLike: the output has the input's shape and placement."""
    return elementwise(op, ctx, [0], ())


def cast(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Linear between float types (a partial sum stays a sum), not to or from integers."""
    linear = (0,) if op.attrs.get("SrcT") in _FLOATS and op.attrs.get("DstT") in _FLOATS else ()
    return elementwise(op, ctx, [0], linear)


def additive(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Add, Sub, AddN: linear when every operand is partial together."""
    return elementwise(op, ctx, range(len(op.inputs)), "all")


def product(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Mul: linear in either factor (one of them partial)."""
    return elementwise(op, ctx, [0, 1], (0, 1))


def quotient(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Div: linear in the numerator only."""
    return elementwise(op, ctx, [0, 1], (0,))


def binary(op: OpInfo, ctx: OpContext) -> OpSpec:
    return elementwise(op, ctx, [0, 1], ())


def ternary(op: OpInfo, ctx: OpContext) -> OpSpec:
    return elementwise(op, ctx, [0, 1, 2], ())


def bias_add(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    xl = Fresh().many(rank(x))
    c = 1 if op.attrs.get("data_format", "NHWC") == "NCHW" else len(xl) - 1
    return OpSpec((xl, (xl[c],)), (xl,), linear=())


def softmax(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Softmax, LogSoftmax: elementwise, but the softmax (last) axis is never split."""
    spec = elementwise(op, ctx, [0], ())
    last = spec.inputs[0][-1]  # type: ignore[index]
    return dataclasses.replace(spec, no_split=frozenset({last}))
