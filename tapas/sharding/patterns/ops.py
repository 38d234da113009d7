"""Per-TF-op placement rules, einsum style.

In:  one :class:`tapas.ir.OpInfo` with the static shapes of its inputs and a way to read
     the value of small constant inputs (axes, permutations).
Out: an :class:`OpSpec` -- a label per axis of every input and output, as in an einsum
     equation (``MatMul`` is ``"mk,kn->mn"``) -- or a string saying why the op cannot be
     described (then every non-replicate pattern of its GraphNode is invalid).

The propagation engine (``tapas.sharding.patterns.engine``) reads a spec like this. On a 1-D mesh an
op computes locally when at most one label is split:

- a label shared by an input and an output: the output is split on that axis
  (batch, column, heads);
- a label in the inputs only (contracted/reduced): each device holds a partial sum of the
  output (``P``) when ``reduce`` is ``"sum"`` (MatMul, Sum, Conv2D input channels), needs a
  local rewrite for ``"mean"`` (``partial-mean``: the local mean scaled by the shard's
  share) and ``"gather"`` (``vocab-gather``), and is not allowed for ``"none"`` (Max, ArgMax,
  Softmax's axis goes in ``no_split`` instead);
- a label in ``no_split`` (a softmax axis, conv spatial dimensions, sliced or padded axes,
  the merged-in factors of a reshape) may not be split at all;
- a replicated input that lacks the split label is read whole by every device; one that
  has it is sliced locally (both cost nothing forward; the engine works out the backward
  comms).

Size-1 (broadcast) dimensions always get their own label, so they are never split with the
dimension they broadcast against. ``linear`` says which inputs may carry a partial sum
through the op without reducing it first: ``"all"`` (every data input partial together:
Add, Sub, AddN, ConcatV2), a tuple of indices (at most one of them partial: Mul,
MatMul, RealDiv's numerator, Reshape), or ``()`` (none: Relu, Softmax, Rsqrt, ...).
``inputs[i] is None`` marks a *meta* operand (a shape, axis, permutation or other
constant) that must be replicated -- or, with ``meta_any``, may be anything because only its
static shape is read (``Shape``, ``ZerosLike``).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from collections.abc import Callable, Sequence
from typing import Any

from tapas.ir import OpInfo

__all__ = ["OpSpec", "OpContext", "RULES", "rule_for", "spec_for", "has_rule",
           "CONTRACTION_OPS", "NO_GRAD_OPS"]

Labels = tuple[str, ...]
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Axis labels of one op's operands and what a split of each label means."""

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels | None, ...]
    no_split: frozenset[str] = frozenset()
    reduce: str = "none"                  # "sum" | "mean" | "gather" | "none"
    linear: str | tuple[int, ...] = ()     # "all" or indices of inputs that may be P
    meta_any: bool = False                 # meta inputs may have any placement
    flops: str = "elementwise"             # "contract" | "conv" | "reduce" | "elementwise" | "none"
    global_shape: bool = False             # output is the *global* shape of input 0


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What a rule may read: input shapes and the value of constant inputs."""

    in_shapes: tuple[Shape | None, ...]
    out_shapes: tuple[Shape | None, ...]
    const: Callable[[int], Any]   # value of input i if it is a small constant, else None


Rule = Callable[[OpInfo, OpContext], "OpSpec | str"]
RULES: dict[str, Rule] = {}

CONTRACTION_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                             "Einsum"})
# ops whose outputs carry no gradient to their inputs
NO_GRAD_OPS = frozenset({"StopGradient", "PreventGradient", "Shape", "ShapeN", "Size", "Rank",
                         "ZerosLike", "OnesLike", "ArgMax", "ArgMin", "Less", "LessEqual",
                         "Greater", "GreaterEqual", "Equal", "NotEqual", "OneHot", "Floor",
                         "Ceil", "Round", "Rint", "Sign", "IsNan", "IsInf", "IsFinite",
                         "LogicalNot", "LogicalAnd", "LogicalOr"})


def rule(*types: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in types:
            RULES[t] = fn
        return fn
    return deco


def has_rule(op_type: str) -> bool:
    return op_type in RULES


def rule_for(op_type: str) -> Rule | None:
    return RULES.get(op_type)


def spec_for(op: OpInfo, ctx: OpContext) -> OpSpec | str:
    """The spec of ``op``, or why there is none."""
    fn = RULES.get(op.type)
    if fn is None:
        return f"op '{op.name}' has type {op.type}, which has no placement rule"
    try:
        return fn(op, ctx)
    except (TypeError, ValueError, IndexError, KeyError) as e:
        return f"op '{op.name}' ({op.type}): cannot read its attributes or constants ({e})"


# ---- label helpers -----------------------------------------------------------------------

class _Fresh:
    """Fresh label names: a, b, ..., z, then l27, l28, ..."""

    def __init__(self) -> None:
        self._it = (c for c in itertools.chain(
            string.ascii_lowercase, (f"l{i}" for i in itertools.count(27))))

    def __call__(self) -> str:
        return next(self._it)

    def many(self, k: int) -> Labels:
        return tuple(self() for _ in range(k))


def _rank(shape: Shape | None) -> int:
    if shape is None:
        raise ValueError("unknown rank")
    return len(shape)


def _axis(value: Any, rank: int) -> int:
    a = int(value)
    if not -rank <= a < max(rank, 1):
        raise ValueError(f"axis {a} out of range for rank {rank}")
    return a % rank if rank else 0


def _axes(value: Any, rank: int) -> tuple[int, ...]:
    if value is None:
        raise ValueError("axes are not a known constant")
    vals = value if isinstance(value, list) else [value]
    return tuple(sorted({_axis(v, rank) for v in vals}))


def _broadcast(shapes: Sequence[Shape], out: Shape, fresh: _Fresh) -> tuple[tuple[Labels, ...],
                                                                            Labels]:
    """numpy broadcasting: output labels, and each input's labels (right-aligned; an input
    dimension of size 1 against a larger output dimension gets a label of its own)."""
    out_labels = fresh.many(len(out))
    ins = []
    for s in shapes:
        off = len(out) - len(s)
        labs = []
        for i, d in enumerate(s):
            j = i + off
            if j >= 0 and d == out[j] and d != 1:
                labs.append(out_labels[j])
            else:
                labs.append(fresh())
        ins.append(tuple(labs))
    return tuple(ins), out_labels


def _elementwise(op: OpInfo, ctx: OpContext, data: Sequence[int],
                 linear: str | tuple[int, ...]) -> OpSpec:
    fresh = _Fresh()
    out = ctx.out_shapes[0]
    if out is None:
        raise ValueError("unknown output shape")
    shapes = [ctx.in_shapes[i] for i in data]
    if any(s is None for s in shapes):
        raise ValueError("unknown input shape")
    ins_l, out_l = _broadcast(shapes, out, fresh)  # type: ignore[arg-type]
    inputs: list[Labels | None] = [None] * len(op.inputs)
    for i, labs in zip(data, ins_l):
        inputs[i] = labs
    outputs = tuple(out_l if k == 0 else (ctx.out_shapes[k] and fresh.many(len(ctx.out_shapes[k])))
                    for k in range(len(op.outputs)))
    return OpSpec(tuple(inputs), outputs, linear=linear)


# ---- elementwise ---------------------------------------------------------------------------

_UNARY_LINEAR = frozenset({"Neg", "Identity", "StopGradient", "PreventGradient", "Snapshot",
                           "CheckNumerics", "EnsureShape"})
_UNARY = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Gelu", "Erf", "Erfc", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Abs",
    "Sign", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Rint", "Sin", "Cos", "IsNan",
    "IsInf", "IsFinite", "LogicalNot", "Swish"})


@rule(*_UNARY_LINEAR)
def _unary_linear(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0], (0,))


@rule(*_UNARY)
def _unary(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0], ())


@rule("Cast")
def _cast(op: OpInfo, ctx: OpContext) -> OpSpec:
    floats = ("float16", "bfloat16", "float32", "float64")
    linear = (0,) if op.attrs.get("SrcT") in floats and op.attrs.get("DstT") in floats else ()
    return _elementwise(op, ctx, [0], linear)


@rule("ZerosLike", "OnesLike")
def _like(op: OpInfo, ctx: OpContext) -> OpSpec:
    spec = _elementwise(op, ctx, [0], ())
    return spec


@rule("ClipByValue")
def _clip(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0, 1, 2], ())


@rule("Add", "AddV2", "Sub", "AddN")
def _add(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, range(len(op.inputs)), "all")


@rule("Mul", "MulNoNan")
def _mul(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0, 1], (0, 1))


@rule("RealDiv", "Div", "DivNoNan")
def _div(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0, 1], (0,))


@rule("FloorDiv", "FloorMod", "TruncateDiv", "Maximum", "Minimum", "Pow", "SquaredDifference",
      "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
      "LogicalOr", "Xdivy", "Xlogy")
def _binary(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0, 1], ())


@rule("SelectV2", "Select")
def _select(op: OpInfo, ctx: OpContext) -> OpSpec:
    return _elementwise(op, ctx, [0, 1, 2], ())


@rule("BiasAdd")
def _bias_add(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    fresh = _Fresh()
    xl = fresh.many(_rank(x))
    c = 1 if op.attrs.get("data_format", "NHWC") == "NCHW" else len(xl) - 1
    return OpSpec((xl, (xl[c],)), (xl,), linear=())


@rule("Softmax", "LogSoftmax")
def _softmax(op: OpInfo, ctx: OpContext) -> OpSpec:
    spec = _elementwise(op, ctx, [0], ())
    return dataclasses.replace(spec, no_split=frozenset({spec.inputs[0][-1]}))  # type: ignore[index]


# ---- matrix products ---------------------------------------------------------------------

@rule("MatMul")
def _matmul(op: OpInfo, ctx: OpContext) -> OpSpec:
    a = ("k", "m") if op.attrs.get("transpose_a") else ("m", "k")
    b = ("n", "k") if op.attrs.get("transpose_b") else ("k", "n")
    return OpSpec((a, b), (("m", "n"),), reduce="sum", linear=(0, 1), flops="contract")


@rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(op: OpInfo, ctx: OpContext) -> OpSpec:
    xs, ys, out = ctx.in_shapes[0], ctx.in_shapes[1], ctx.out_shapes[0]
    if xs is None or ys is None or out is None:
        raise ValueError("unknown shapes")
    fresh = _Fresh()
    nb = len(out) - 2
    (xb, yb), ob = _broadcast([xs[:-2], ys[:-2]], out[:-2], fresh)
    m, k, n = fresh(), fresh(), fresh()
    adj_x = op.attrs.get("adj_x", False)
    adj_y = op.attrs.get("adj_y", False)
    xl = xb + ((k, m) if adj_x else (m, k))
    yl = yb + ((n, k) if adj_y else (k, n))
    assert len(ob) == nb
    return OpSpec((xl, yl), (ob + (m, n),), reduce="sum", linear=(0, 1), flops="contract")


@rule("Einsum")
def _einsum(op: OpInfo, ctx: OpContext) -> OpSpec:
    eq = str(op.attrs.get("equation", "")).replace(" ", "")
    if "->" not in eq:
        raise ValueError(f"einsum equation {eq!r} has no '->'")
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(op.inputs):
        raise ValueError(f"einsum equation {eq!r} has {len(terms)} operands, op has "
                         f"{len(op.inputs)}")
    # expand '...' into per-operand broadcast labels (right-aligned numpy broadcasting)
    ell_out = ctx.out_shapes[0]
    n_ell = 0
    for t, s in zip(terms, ctx.in_shapes):
        if "..." in t:
            n_ell = max(n_ell, _rank(s) - (len(t) - 3))
    ell = tuple(f"E{i}" for i in range(n_ell))

    def expand(term: str, rank: int | None) -> list[str]:
        if "..." not in term:
            return list(term)
        pre, post = term.split("...")
        k = (rank if rank is not None else 0) - len(pre) - len(post)
        return list(pre) + list(ell[n_ell - k:] if k else ()) + list(post)

    ins = [expand(t, _rank(s)) for t, s in zip(terms, ctx.in_shapes)]
    out = expand(rhs, _rank(ell_out))
    # a label whose size differs between operands (size-1 broadcast) gets a private label
    sizes: dict[str, int] = {}
    for labs, s in zip(ins, ctx.in_shapes):
        for lab, d in zip(labs, s or ()):
            if d != 1:
                sizes.setdefault(lab, d)
    fresh = _Fresh()
    fixed_ins = []
    for labs, s in zip(ins, ctx.in_shapes):
        fixed_ins.append(tuple(lab if (d != 1 or sizes.get(lab, 1) == 1) else "_" + fresh()
                               for lab, d in zip(labs, s or ())))
    return OpSpec(tuple(fixed_ins), (tuple(out),), reduce="sum",
                  linear=tuple(range(len(op.inputs))), flops="contract")


# ---- convolution, pooling, batch norm ------------------------------------------------------

def _nhwc(op: OpInfo, rank: int) -> tuple[int, int, tuple[int, ...]]:
    """(batch axis, channel axis, spatial axes) from the data_format attribute."""
    fmt = str(op.attrs.get("data_format", "NHWC"))
    if fmt.startswith("NC"):
        return 0, 1, tuple(range(2, rank))
    return 0, rank - 1, tuple(range(1, rank - 1))


@rule("Conv1D", "Conv2D", "Conv3D")
def _conv(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    b, c, sp = _nhwc(op, r)
    fresh = _Fresh()
    xl = list(fresh.many(r))
    ol = list(fresh.many(r))
    ol[b] = xl[b]
    co = fresh()
    ol[c] = co
    kl = tuple(fresh.many(r - 2)) + (xl[c], co)
    spatial = frozenset(xl[i] for i in sp) | frozenset(ol[i] for i in sp) | frozenset(kl[:-2])
    return OpSpec((tuple(xl), kl), (tuple(ol),), no_split=spatial, reduce="sum",
                  linear=(0, 1), flops="conv")


@rule("DepthwiseConv2dNative")
def _depthwise(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, f = ctx.in_shapes[0], ctx.in_shapes[1]
    r = _rank(x)
    b, c, sp = _nhwc(op, r)
    fresh = _Fresh()
    xl = list(fresh.many(r))
    ol = list(fresh.many(r))
    ol[b] = xl[b]
    ol[c] = xl[c]      # channel multiplier m: output channel c*m + j, contiguous in c
    mult = fresh()
    kl = tuple(fresh.many(r - 2)) + (xl[c], mult)
    no = frozenset(xl[i] for i in sp) | frozenset(ol[i] for i in sp) | frozenset(kl[:-2]) | {mult}
    if f is not None and f[-1] != 1:
        no = no  # the multiplier label is private; a split on channels still maps through
    return OpSpec((tuple(xl), kl), (tuple(ol),), no_split=no, reduce="none", linear=(0, 1),
                  flops="conv")


@rule("MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D")
def _pool(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    b, c, sp = _nhwc(op, r)
    fresh = _Fresh()
    xl = list(fresh.many(r))
    ol = list(fresh.many(r))
    ol[b], ol[c] = xl[b], xl[c]
    no = frozenset(xl[i] for i in sp) | frozenset(ol[i] for i in sp)
    inputs: list[Labels | None] = [tuple(xl)] + [None] * (len(op.inputs) - 1)
    linear = (0,) if op.type.startswith("Avg") else ()
    return OpSpec(tuple(inputs), (tuple(ol),), no_split=no, linear=linear, flops="reduce")


@rule("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
def _batch_norm(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    b, c, sp = _nhwc(op, r)
    fresh = _Fresh()
    xl = fresh.many(r)
    ch = (xl[c],)
    inputs: tuple[Labels | None, ...] = (xl, ch, ch, ch, ch) + (None,) * (len(op.inputs) - 5)
    outputs = (xl,) + tuple(ch for _ in op.outputs[1:])
    # training mode reduces over batch and space for the statistics: only channels split
    no = frozenset(xl[i] for i in (b, *sp)) if op.attrs.get("is_training", False) else frozenset()
    return OpSpec(inputs, outputs, no_split=no, reduce="none")


# ---- reductions --------------------------------------------------------------------------

_REDUCE_KIND = {"Sum": "sum", "Mean": "mean", "EuclideanNorm": "none", "Max": "none",
                "Min": "none", "Prod": "none", "All": "none", "Any": "none"}


@rule(*_REDUCE_KIND)
def _reduce(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    axes = _axes(ctx.const(1), r)
    keep = bool(op.attrs.get("keep_dims", False))
    fresh = _Fresh()
    xl = fresh.many(r)
    out = tuple(fresh() if (i in axes) else xl[i] for i in range(r) if keep or i not in axes)
    linear = (0,) if _REDUCE_KIND[op.type] in ("sum", "mean") else ()
    return OpSpec((xl, None), (out,), reduce=_REDUCE_KIND[op.type], linear=linear,
                  flops="reduce")


@rule("ArgMax", "ArgMin")
def _argmax(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    a = _axis(ctx.const(1), r)
    fresh = _Fresh()
    xl = fresh.many(r)
    return OpSpec((xl, None), (tuple(l for i, l in enumerate(xl) if i != a),), reduce="none",
                  flops="reduce")


@rule("Cumsum", "Cumprod")
def _cumsum(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    a = _axis(ctx.const(1), r)
    xl = _Fresh().many(r)
    return OpSpec((xl, None), (xl,), no_split=frozenset({xl[a]}),
                  linear=(0,) if op.type == "Cumsum" else ())


@rule("TopKV2")
def _topk(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    fresh = _Fresh()
    xl = fresh.many(r)
    ol = xl[:-1] + (fresh(),)
    return OpSpec((xl, None), (ol, ol), no_split=frozenset({xl[-1], ol[-1]}))


@rule("L2Loss")
def _l2loss(op: OpInfo, ctx: OpContext) -> OpSpec:
    xl = _Fresh().many(_rank(ctx.in_shapes[0]))
    return OpSpec((xl,), ((),), reduce="sum", flops="reduce")


@rule("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_xent(op: OpInfo, ctx: OpContext) -> OpSpec:
    b, c = "b", "c"
    return OpSpec(((b, c), (b,)), ((b,), (b, c)), no_split=frozenset({c}))


@rule("SoftmaxCrossEntropyWithLogits")
def _xent(op: OpInfo, ctx: OpContext) -> OpSpec:
    b, c = "b", "c"
    return OpSpec(((b, c), (b, c)), ((b,), (b, c)), no_split=frozenset({c}))


# ---- shape manipulation ------------------------------------------------------------------

def _reshape_labels(src: Shape, dst: Shape, fresh: _Fresh) -> tuple[Labels, Labels,
                                                                   frozenset[str]]:
    """Group src and dst dimensions into runs of equal product; in each run the first
    non-1 input dimension and the first non-1 output dimension share a label (a split of
    the leading factor stays a contiguous split), every other dimension is private and
    may not be split."""
    sl: list[str] = [""] * len(src)
    dl: list[str] = [""] * len(dst)
    no: set[str] = set()
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        # take at least one dimension from each side that still has some
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj or (i < len(src) and src[i] == 1 and pi == pj and j >= len(dst)) \
                or (j < len(dst) and dst[j] == 1 and pi == pj and i >= len(src)):
            if pi <= pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            elif i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            else:
                raise ValueError(f"reshape {src} -> {dst}: element counts differ")
        lead_i = next((k for k in gi if src[k] != 1), None)
        lead_j = next((k for k in gj if dst[k] != 1), None)
        shared = fresh() if lead_i is not None and lead_j is not None else None
        for k in gi:
            if k == lead_i and shared is not None:
                sl[k] = shared
            else:
                sl[k] = fresh()
                no.add(sl[k])
        for k in gj:
            if k == lead_j and shared is not None:
                dl[k] = shared
            else:
                dl[k] = fresh()
                no.add(dl[k])
    return tuple(sl), tuple(dl), frozenset(no)


@rule("Reshape")
def _reshape(op: OpInfo, ctx: OpContext) -> OpSpec:
    src, dst = ctx.in_shapes[0], ctx.out_shapes[0]
    if src is None or dst is None:
        raise ValueError("unknown shapes")
    sl, dl, no = _reshape_labels(tuple(src), tuple(dst), _Fresh())
    return OpSpec((sl, None), (dl,), no_split=no, linear=(0,), flops="none")


@rule("Squeeze", "ExpandDims")
def _squeeze(op: OpInfo, ctx: OpContext) -> OpSpec:
    spec = _reshape(op, ctx)
    inputs = spec.inputs + (None,) * (len(op.inputs) - len(spec.inputs))
    return dataclasses.replace(spec, inputs=inputs[:len(op.inputs)])


@rule("Transpose", "ConjugateTranspose")
def _transpose(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    perm = ctx.const(1)
    if perm is None:
        raise ValueError("the permutation is not a known constant")
    perm = [int(p) for p in (perm if isinstance(perm, list) else [perm])]
    if sorted(perm) != list(range(r)):
        raise ValueError(f"permutation {perm} does not fit rank {r}")
    xl = _Fresh().many(r)
    return OpSpec((xl, None), (tuple(xl[p] for p in perm),), linear=(0,), flops="none")


@rule("ConcatV2")
def _concat(op: OpInfo, ctx: OpContext) -> OpSpec:
    n = len(op.inputs) - 1
    r = _rank(ctx.out_shapes[0])
    a = _axis(ctx.const(n), r)
    fresh = _Fresh()
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


@rule("Pack")
def _pack(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    a = _axis(op.attrs.get("axis", 0), r + 1)
    fresh = _Fresh()
    xl = fresh.many(r)
    new = fresh()
    return OpSpec(tuple(xl for _ in op.inputs), (xl[:a] + (new,) + xl[a:],),
                  no_split=frozenset({new}), linear="all", flops="none")


@rule("Unpack")
def _unpack(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    a = _axis(op.attrs.get("axis", 0), r)
    xl = _Fresh().many(r)
    out = xl[:a] + xl[a + 1:]
    return OpSpec((xl,), tuple(out for _ in op.outputs), no_split=frozenset({xl[a]}),
                  linear=(0,), flops="none")


@rule("Split")
def _split(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[1])
    a = _axis(ctx.const(0), r)
    fresh = _Fresh()
    xl = fresh.many(r)
    outs = []
    no = {xl[a]}
    for _ in op.outputs:
        o = list(xl)
        o[a] = fresh()
        no.add(o[a])
        outs.append(tuple(o))
    return OpSpec((None, xl), tuple(outs), no_split=frozenset(no), linear=(1,), flops="none")


@rule("SplitV")
def _splitv(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    a = _axis(ctx.const(2), r)
    fresh = _Fresh()
    xl = fresh.many(r)
    outs = []
    no = {xl[a]}
    for _ in op.outputs:
        o = list(xl)
        o[a] = fresh()
        no.add(o[a])
        outs.append(tuple(o))
    return OpSpec((xl, None, None), tuple(outs), no_split=frozenset(no), linear=(0,),
                  flops="none")


def _keep_axes_spec(op: OpInfo, ctx: OpContext, kept: Sequence[bool],
                    linear: tuple[int, ...] = (0,)) -> OpSpec:
    """Output has the input's rank; axis i keeps its label iff kept[i]."""
    r = len(kept)
    fresh = _Fresh()
    xl = fresh.many(r)
    ol = tuple(xl[i] if kept[i] else fresh() for i in range(r))
    no = frozenset(xl[i] for i in range(r) if not kept[i]) | frozenset(
        ol[i] for i in range(r) if not kept[i])
    inputs = (xl,) + (None,) * (len(op.inputs) - 1)
    return OpSpec(inputs, (ol,), no_split=no, linear=linear, flops="none")


@rule("Pad", "PadV2", "MirrorPad")
def _pad(op: OpInfo, ctx: OpContext) -> OpSpec:
    x = ctx.in_shapes[0]
    r = _rank(x)
    pads = ctx.const(1)
    if pads is None:
        kept = [False] * r
    else:
        kept = [list(p) == [0, 0] for p in pads]
    linear: tuple[int, ...] = (0,)
    if op.type == "PadV2":
        v = ctx.const(2)
        linear = (0,) if v in (0, 0.0) else ()
    return _keep_axes_spec(op, ctx, kept, linear)


@rule("Tile")
def _tile(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    mult = ctx.const(1)
    kept = [False] * r if mult is None else [int(m) == 1 for m in mult]
    return _keep_axes_spec(op, ctx, kept, ())


@rule("ReverseV2")
def _reverse(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    axes = _axes(ctx.const(1), r)
    return _keep_axes_spec(op, ctx, [i not in axes for i in range(r)])


@rule("Roll")
def _roll(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    axes = _axes(ctx.const(2), r)
    return _keep_axes_spec(op, ctx, [i not in axes for i in range(r)])


@rule("MatrixBandPart")
def _band(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    return _keep_axes_spec(op, ctx, [i < r - 2 for i in range(r)], ())


@rule("Slice")
def _slice(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    r = _rank(x)
    begin = ctx.const(1)
    if begin is None or out is None:
        kept = [False] * r
    else:
        begin = begin if isinstance(begin, list) else [begin]
        kept = [int(begin[i]) == 0 and out[i] == x[i] for i in range(r)]  # type: ignore[index]
    return _keep_axes_spec(op, ctx, kept)


@rule("StridedSlice")
def _strided_slice(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    r = _rank(x)
    fresh = _Fresh()
    xl = fresh.many(r)
    begin, end, strides = ctx.const(1), ctx.const(2), ctx.const(3)
    masks = {k: int(op.attrs.get(k, 0)) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                                   "new_axis_mask", "shrink_axis_mask")}
    inputs = (xl,) + (None,) * (len(op.inputs) - 1)
    if begin is None or end is None or strides is None or masks["ellipsis_mask"] or out is None:
        ol = fresh.many(_rank(out))
        return OpSpec(inputs, (ol,), no_split=frozenset(xl) | frozenset(ol), flops="none")
    begin = begin if isinstance(begin, list) else [begin]
    end = end if isinstance(end, list) else [end]
    strides = strides if isinstance(strides, list) else [strides]
    ol: list[str] = []
    kept_in: set[int] = set()
    no: set[str] = set()
    a = 0  # input axis
    for s in range(len(begin)):
        bit = 1 << s
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
        full = (int(strides[s]) == 1 and b0 in (0, -d) and (e0 >= d))
        if masks["shrink_axis_mask"] & bit:
            a += 1
            continue
        if full:
            ol.append(xl[a])
            kept_in.add(a)
        else:
            lab = fresh()
            no.add(lab)
            ol.append(lab)
        a += 1
    while a < r:
        ol.append(xl[a])
        kept_in.add(a)
        a += 1
    no |= {xl[i] for i in range(r) if i not in kept_in}
    if len(ol) != len(out):
        raise ValueError(f"slice spec gives rank {len(ol)}, the output has rank {len(out)}")
    return OpSpec(inputs, (tuple(ol),), no_split=frozenset(no), linear=(0,), flops="none")


@rule("BroadcastTo")
def _broadcast_to(op: OpInfo, ctx: OpContext) -> OpSpec:
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    if x is None or out is None:
        raise ValueError("unknown shapes")
    fresh = _Fresh()
    (xl,), ol = _broadcast([x], out, fresh)
    no = frozenset(l for l in ol if l not in xl)
    return OpSpec((xl, None), (ol,), no_split=no, linear=(0,), flops="none")


@rule("GatherV2", "Gather", "ResourceGather")
def _gather(op: OpInfo, ctx: OpContext) -> OpSpec:
    p, idx = ctx.in_shapes[0], ctx.in_shapes[1]
    rp, ri = _rank(p), _rank(idx)
    if op.type == "GatherV2":
        axis = _axis(ctx.const(2), rp)
    else:
        axis = 0
    if int(op.attrs.get("batch_dims", 0)) != 0:
        raise ValueError("batch_dims != 0 is not supported")
    fresh = _Fresh()
    pl = fresh.many(rp)
    il = fresh.many(ri)
    out = pl[:axis] + il + pl[axis + 1:]
    inputs: tuple[Labels | None, ...] = (pl, il) + (None,) * (len(op.inputs) - 2)
    return OpSpec(inputs, (out,), reduce="gather", linear=(0,), flops="none")


@rule("OneHot")
def _one_hot(op: OpInfo, ctx: OpContext) -> OpSpec:
    r = _rank(ctx.in_shapes[0])
    a = int(op.attrs.get("axis", -1))
    a = r if a == -1 else a
    fresh = _Fresh()
    il = fresh.many(r)
    new = fresh()
    return OpSpec((il, None, None, None), (il[:a] + (new,) + il[a:],), no_split=frozenset({new}))


# ---- shapes, constants, plumbing ----------------------------------------------------------

@rule("Shape", "Size", "Rank")
def _shape(op: OpInfo, ctx: OpContext) -> OpSpec:
    out = ctx.out_shapes[0]
    return OpSpec((None,), (_Fresh().many(_rank(out)),), meta_any=True, flops="none",
                  global_shape=True)


@rule("ShapeN")
def _shape_n(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh = _Fresh()
    return OpSpec(tuple(None for _ in op.inputs),
                  tuple(fresh.many(_rank(s)) for s in ctx.out_shapes), meta_any=True,
                  flops="none", global_shape=True)


@rule("Const", "Range", "Fill", "LinSpace", "BroadcastArgs")
def _const(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh = _Fresh()
    return OpSpec(tuple(None for _ in op.inputs),
                  tuple(None if s is None else fresh.many(len(s)) for s in ctx.out_shapes),
                  flops="none")


@rule("NoOp")
def _noop(op: OpInfo, ctx: OpContext) -> OpSpec:
    return OpSpec(tuple(None for _ in op.inputs), (), flops="none")


@rule("ReadVariableOp")
def _read(op: OpInfo, ctx: OpContext) -> OpSpec:
    out = ctx.out_shapes[0]
    xl = _Fresh().many(_rank(out))
    return OpSpec((xl,), (xl,), linear=(0,), flops="none")


@rule("IdentityN")
def _identity_n(op: OpInfo, ctx: OpContext) -> OpSpec:
    fresh = _Fresh()
    labs = tuple(fresh.many(_rank(s)) for s in ctx.in_shapes)
    # each output i is input i; linear in all, no mixing between them
    return OpSpec(labs, labs, linear=tuple(range(len(labs))), flops="none")
