"""Rules of contractions: MatMul, BatchMatMul and Einsum.

In:  a contraction :class:`tapas.ir.OpInfo` (its transpose/adjoint attributes or einsum
     equation) and its :class:`~tapas.sharding.rules.spec.OpContext`.
Out: its :class:`~tapas.sharding.rules.spec.OpSpec`: a contracted label split leaves a
     partial sum (``reduce="sum"``), a kept label splits the output; linear in every operand.

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas.ir import OpInfo
from tapas.sharding.rules.spec import Fresh, OpContext, OpSpec, broadcast, rank

BATCH_MATMUL = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def matmul(op: OpInfo, ctx: OpContext) -> OpSpec:
    a = ("k", "m") if op.attrs.get("transpose_a") else ("m", "k")
    b = ("n", "k") if op.attrs.get("transpose_b") else ("k", "n")
    return OpSpec((a, b), (("m", "n"),), reduce="sum", linear=(0, 1), flops="contract")


def batch_matmul(op: OpInfo, ctx: OpContext) -> OpSpec:
    xs, ys, out = ctx.in_shapes[0], ctx.in_shapes[1], ctx.out_shapes[0]
    if xs is None or ys is None or out is None:
        raise ValueError("unknown shapes")
    fresh = Fresh()
    (xb, yb), ob = broadcast([xs[:-2], ys[:-2]], out[:-2], fresh)
    m, k, n = fresh(), fresh(), fresh()
    xl = xb + ((k, m) if op.attrs.get("adj_x", False) else (m, k))
    yl = yb + ((n, k) if op.attrs.get("adj_y", False) else (k, n))
    return OpSpec((xl, yl), (ob + (m, n),), reduce="sum", linear=(0, 1), flops="contract")


def _einsum_terms(op: OpInfo) -> tuple[list[str], str]:
    eq = str(op.attrs.get("equation", "")).replace(" ", "")
    if "->" not in eq:
        raise ValueError(f"einsum equation {eq!r} has no '->'")
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(op.inputs):
        raise ValueError(f"einsum equation {eq!r} has {len(terms)} operands, op has "
                         f"{len(op.inputs)}")
    return terms, rhs


def einsum(op: OpInfo, ctx: OpContext) -> OpSpec:
    terms, rhs = _einsum_terms(op)
    # expand '...' into per-operand broadcast labels (right-aligned numpy broadcasting)
    n_ell = 0
    for t, s in zip(terms, ctx.in_shapes):
        if "..." in t:
            n_ell = max(n_ell, rank(s) - (len(t) - 3))
    ell = tuple(f"E{i}" for i in range(n_ell))

    def expand(term: str, rank: int | None) -> list[str]:
        if "..." not in term:
            return list(term)
        pre, post = term.split("...")
        k = (rank if rank is not None else 0) - len(pre) - len(post)
        return list(pre) + list(ell[n_ell - k:] if k else ()) + list(post)

    ins = [expand(t, rank(s)) for t, s in zip(terms, ctx.in_shapes)]
    out = expand(rhs, rank(ctx.out_shapes[0]))
    # a label whose size differs between operands (size-1 broadcast) gets a private label
    sizes: dict[str, int] = {}
    for labs, s in zip(ins, ctx.in_shapes):
        for lab, d in zip(labs, s or ()):
            if d != 1:
                sizes.setdefault(lab, d)
    fresh = Fresh()
    fixed_ins = []
    for labs, s in zip(ins, ctx.in_shapes):
        fixed_ins.append(tuple(lab if (d != 1 or sizes.get(lab, 1) == 1) else "_" + fresh()
                               for lab, d in zip(labs, s or ())))
    return OpSpec(tuple(fixed_ins), (tuple(out),), reduce="sum",
                  linear=tuple(range(len(op.inputs))), flops="contract")
