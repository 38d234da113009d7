"""Rules of lookups: GatherV2/ResourceGather and OneHot.

In:  a gather or one-hot :class:`tapas.ir.OpInfo` and its
     :class:`~tapas.sharding.rules.spec.OpContext` (the constant gather axis).
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`. A gather from a table split on the
     gathered axis is the ``vocab-gather`` rewrite (``reduce="gather"``: shifted ids, rows
     outside the shard zeroed, a partial result); the other table axes and the ids' axes
     pass through. A one-hot's new (class) axis is never split.

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, Labels, OpContext, OpSpec, axis, rank

GATHER = ("GatherV2", "Gather", "ResourceGather")


def gather(op: OpInfo, ctx: OpContext) -> OpSpec:
    rp, ri = rank(ctx.in_shapes[0]), rank(ctx.in_shapes[1])
    a = axis(ctx.const(2), rp) if op.type == "GatherV2" else 0
    if int(op.attrs.get("batch_dims", 0)) != 0:
        raise ValueError("batch_dims != 0 is not supported")
    fresh = Fresh()
    pl = fresh.many(rp)
    il = fresh.many(ri)
    out = pl[:a] + il + pl[a + 1:]
    inputs: tuple[Labels | None, ...] = (pl, il) + (None,) * (len(op.inputs) - 2)
    return OpSpec(inputs, (out,), reduce="gather", linear=(0,), flops="none")


def one_hot(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = int(op.attrs.get("axis", -1))
    a = r if a == -1 else a
    fresh = Fresh()
    il = fresh.many(r)
    new = fresh()
    return OpSpec((il, None, None, None), (il[:a] + (new,) + il[a:],), no_split=frozenset({new}))
