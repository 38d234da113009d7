"""Rules of ops that move data between axes: reshapes, transposes, concatenation, stacking,
splitting and broadcasting.

In:  a shape-changing :class:`tapas.ir.OpInfo` and its
     :class:`~tapas.sharding.rules.spec.OpContext` (static shapes, constant axes and
     permutations).
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: an axis that maps to one contiguous
     axis of the output keeps its label (a split passes through); merged-in factors,
     concatenated, stacked, split and broadcast axes are never split. These ops only move
     data (``flops="none"``) and are linear.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import (Fresh, Labels, OpContext, OpSpec, Shape, axis, broadcast,
                                       rank)

SQUEEZE = ("Squeeze", "ExpandDims")
TRANSPOSE = ("Transpose", "ConjugateTranspose")


def _take(dims: Shape, group: list[int], k: int) -> tuple[int, int]:
    """Add dimension ``k`` of ``dims`` to ``group``: (its size, the next index)."""
    group.append(k)
    return dims[k], k + 1


def _reshape_groups(src: Shape, dst: Shape) -> list[tuple[list[int], list[int]]]:
    """src and dst dimensions grouped into consecutive runs of equal product (size-1
    dimensions at the end of one side join the last run)."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = 1
        # take at least one dimension from each side that still has some
        if i < len(src):
            d, i = _take(src, gi, i)
            pi *= d
        if j < len(dst):
            d, j = _take(dst, gj, j)
            pj *= d
        while pi != pj or (i < len(src) and src[i] == 1 and pi == pj and j >= len(dst)) \
                or (j < len(dst) and dst[j] == 1 and pi == pj and i >= len(src)):
            if pi <= pj and i < len(src):
                d, i = _take(src, gi, i)
                pi *= d
            elif j < len(dst):
                d, j = _take(dst, gj, j)
                pj *= d
            elif i < len(src):
                d, i = _take(src, gi, i)
                pi *= d
            else:
                raise ValueError(f"reshape {src} -> {dst}: element counts differ")
        groups.append((gi, gj))
    return groups


def reshape_labels(src: Shape, dst: Shape, fresh: Fresh) -> tuple[Labels, Labels,
                                                                  frozenset[str]]:
    """Group src and dst dimensions into runs of equal product; in each run the first
    non-1 input dimension and the first non-1 output dimension share a label (a split of
    the leading factor stays a contiguous split), every other dimension is private and
    may not be split."""
    sl: list[str] = [""] * len(src)
    dl: list[str] = [""] * len(dst)
    no: set[str] = set()
    for gi, gj in _reshape_groups(src, dst):
        lead_i = next((k for k in gi if src[k] != 1), None)
        lead_j = next((k for k in gj if dst[k] != 1), None)
        shared = fresh() if lead_i is not None and lead_j is not None else None
        for labels, group, lead in ((sl, gi, lead_i), (dl, gj, lead_j)):
            for k in group:
                if k == lead and shared is not None:
                    labels[k] = shared
                else:
                    labels[k] = fresh()
                    no.add(labels[k])
    return tuple(sl), tuple(dl), frozenset(no)


def reshape(op: OpInfo, ctx: OpContext) -> OpSpec:
    src, dst = ctx.in_shapes[0], ctx.out_shapes[0]
    if src is None or dst is None:
        raise ValueError("unknown shapes")
    sl, dl, no = reshape_labels(tuple(src), tuple(dst), Fresh())
    return OpSpec((sl, None), (dl,), no_split=no, linear=(0,), flops="none")


def squeeze(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Squeeze, ExpandDims: a reshape (with an axis operand for ExpandDims)."""
    spec = reshape(op, ctx)
    inputs = spec.inputs + (None,) * (len(op.inputs) - len(spec.inputs))
    return dataclasses.replace(spec, inputs=inputs[:len(op.inputs)])


def transpose(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    perm = ctx.const(1)
    if perm is None:
        raise ValueError("the permutation is not a known constant")
    perm = [int(p) for p in (perm if isinstance(perm, list) else [perm])]
    if sorted(perm) != list(range(r)):
        raise ValueError(f"permutation {perm} does not fit rank {r}")
    xl = Fresh().many(r)
    return OpSpec((xl, None), (tuple(xl[p] for p in perm),), linear=(0,), flops="none")


def concat(op: OpInfo, ctx: OpContext) -> OpSpec:
    """ConcatV2: the concatenated axis is never split; linear in all operands together."""
    n = len(op.inputs) - 1
    r = rank(ctx.out_shapes[0])
    a = axis(ctx.const(n), r)
    fresh = Fresh()
    base = list(fresh.many(r))
    no = set()
    ins = []
    for _ in range(n):
        labs = list(base)
        labs[a] = fresh()
        no.add(labs[a])
        ins.append(tuple(labs))
    out = list(base)
    no.add(out[a])
    return OpSpec(tuple(ins) + (None,), (tuple(out),), no_split=frozenset(no), linear="all",
                  flops="none")


def pack(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = axis(op.attrs.get("axis", 0), r + 1)
    fresh = Fresh()
    xl = fresh.many(r)
    new = fresh()
    return OpSpec(tuple(xl for _ in op.inputs), (xl[:a] + (new,) + xl[a:],),
                  no_split=frozenset({new}), linear="all", flops="none")


def unpack(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = rank(ctx.in_shapes[0])
    a = axis(op.attrs.get("axis", 0), r)
    xl = Fresh().many(r)
    out = xl[:a] + xl[a + 1:]
    return OpSpec((xl,), tuple(out for _ in op.outputs), no_split=frozenset({xl[a]}),
                  linear=(0,), flops="none")


def _split_spec(op: OpInfo, r: int, a: int, data: int, arity: int) -> OpSpec:
    """Operand ``data`` (rank ``r``) of ``arity`` operands cut along axis ``a`` into the
    op's outputs."""
    fresh = Fresh()
    xl = fresh.many(r)
    outs = []
    no = {xl[a]}
    for _ in op.outputs:
        o = list(xl)
        o[a] = fresh()
        no.add(o[a])
        outs.append(tuple(o))
    inputs: list[Labels | None] = [None] * arity
    inputs[data] = xl
    return OpSpec(tuple(inputs), tuple(outs), no_split=frozenset(no), linear=(data,),
                  flops="none")


def split(op: OpInfo, ctx: OpContext) -> OpSpec:
    """Split(axis, value)."""
    r = rank(ctx.in_shapes[1])
    return _split_spec(op, r, axis(ctx.const(0), r), 1, 2)


def split_v(op: OpInfo, ctx: OpContext) -> OpSpec:
    """SplitV(value, size_splits, axis)."""
    r = rank(ctx.in_shapes[0])
    return _split_spec(op, r, axis(ctx.const(2), r), 0, 3)


def broadcast_to(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    if x is None or out is None:
        raise ValueError("unknown shapes")
    (xl,), ol = broadcast([x], out, Fresh())
    no = frozenset(lab for lab in ol if lab not in xl)
    return OpSpec((xl, None), (ol,), no_split=no, linear=(0,), flops="none")
