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
    """``params`` gathered on axis ``a`` at ``indices``. With ``batch_dims`` b the first b
    axes of both are one batch, gathered row by row (a pooler taking each sequence's last
    token): they share their labels, and the gathered table axis is never split (the
    ``vocab-gather`` rewrite is written for a plain lookup)."""
    rp, ri = rank(ctx.in_shapes[0]), rank(ctx.in_shapes[1])
    a = axis(ctx.const(2), rp) if op.type == "GatherV2" else 0
    b = int(op.attrs.get("batch_dims", 0))
    b = b + ri if b < 0 else b
    if not 0 <= b <= min(a, ri):
        raise ValueError(f"batch_dims {b} with gather axis {a} and indices of rank {ri}")
    fresh = Fresh()
    pl = fresh.many(rp)
    il = pl[:b] + fresh.many(ri - b)
    out = pl[:a] + il[b:] + pl[a + 1:]
    inputs: tuple[Labels | None, ...] = (pl, il) + (None,) * (len(op.inputs) - 2)
    if b:
        return OpSpec(inputs, (out,), no_split=frozenset({pl[a]}), linear=(0,), flops="none")
    return OpSpec(inputs, (out,), reduce="gather", linear=(0,), flops="none")


def one_hot(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = int(op.attrs.get("axis", -1))
    a = r if a == -1 else a
    fresh = Fresh()
    il = fresh.many(r)
    new = fresh()
    return OpSpec((il, None, None, None), (il[:a] + (new,) + il[a:],), no_split=frozenset({new}))
