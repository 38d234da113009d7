"""Rules of fused normalizations: FusedBatchNorm.

In:  a FusedBatchNorm :class:`tapas.ir.OpInfo` (its data_format and is_training attributes)
     and its :class:`~tapas.sharding.rules.spec.OpContext`.
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: the scale, offset and statistics follow
     the channel axis; in training the batch statistics need batch and space whole, so only
     channels may be split.

(A layer norm is not one op: its mean and variance are ``Mean`` ops, see
:mod:`tapas.sharding.rules.reduce`.)

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, Labels, OpContext, OpSpec, data_format_axes, rank

BATCH_NORM = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def batch_norm(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    b, c, sp = data_format_axes(op, r)
    xl = Fresh().many(r)
    ch = (xl[c],)
    inputs: tuple[Labels | None, ...] = (xl, ch, ch, ch, ch) + (None,) * (len(op.inputs) - 5)
    outputs = (xl,) + tuple(ch for _ in op.outputs[1:])
    no = frozenset(xl[i] for i in (b, *sp)) if op.attrs.get("is_training", False) else frozenset()
    return OpSpec(inputs, outputs, no_split=no, reduce="none")
