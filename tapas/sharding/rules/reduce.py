"""Rules of reductions, scans, top-k and losses.

In:  a reducing :class:`tapas.ir.OpInfo` and its :class:`~tapas.sharding.rules.spec.OpContext`
     (the constant reduction axes).
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: a split reduced axis leaves a partial
     sum (Sum, L2Loss), a partial mean (Mean: the ``partial-mean`` rewrite) or is refused
     (Max, ArgMax, ...); a scanned, ranked or class axis is never split.

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, OpContext, OpSpec, axes, axis, rank

# what a split reduced axis leaves: "sum" a partial sum, "mean" a partial mean, "none" refused
REDUCE_KIND = {"Sum": "sum", "Mean": "mean", "EuclideanNorm": "none", "Max": "none",
               "Min": "none", "Prod": "none", "All": "none", "Any": "none"}
ARG_REDUCE = ("ArgMax", "ArgMin")
SCAN = ("Cumsum", "Cumprod")


def reduce(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    reduced = axes(ctx.const(1), r)
    keep = bool(op.attrs.get("keep_dims", False))
    fresh = Fresh()
    xl = fresh.many(r)
    out = tuple(fresh() if (i in reduced) else xl[i] for i in range(r)
                if keep or i not in reduced)
    linear = (0,) if REDUCE_KIND[op.type] in ("sum", "mean") else ()
    return OpSpec((xl, None), (out,), reduce=REDUCE_KIND[op.type], linear=linear,
                  flops="reduce")


def arg_reduce(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = axis(ctx.const(1), r)
    xl = Fresh().many(r)
    return OpSpec((xl, None), (tuple(lab for i, lab in enumerate(xl) if i != a),),
                  reduce="none", flops="reduce")


def scan(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = axis(ctx.const(1), r)
    xl = Fresh().many(r)
    return OpSpec((xl, None), (xl,), no_split=frozenset({xl[a]}),
                  linear=(0,) if op.type == "Cumsum" else ())


def top_k(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    fresh = Fresh()
    xl = fresh.many(r)
    ol = xl[:-1] + (fresh(),)
    return OpSpec((xl, None), (ol, ol), no_split=frozenset({xl[-1], ol[-1]}))


def l2_loss(op: OpInfo, ctx: OpContext) -> OpSpec:
    xl = Fresh().many(rank(ctx.in_shapes[0]))
    return OpSpec((xl,), ((),), reduce="sum", flops="reduce")


def sparse_softmax_xent(op: OpInfo, ctx: OpContext) -> OpSpec:
    b, c = "b", "c"
    return OpSpec(((b, c), (b,)), ((b,), (b, c)), no_split=frozenset({c}))


def softmax_xent(op: OpInfo, ctx: OpContext) -> OpSpec:
    b, c = "b", "c"
    return OpSpec(((b, c), (b, c)), ((b,), (b, c)), no_split=frozenset({c}))
