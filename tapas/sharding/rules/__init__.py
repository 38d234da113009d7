"""Per-TF-op sharding rules, einsum style: the one table from op type to rule.

In:  one :class:`tapas.ir.OpInfo` with the static shapes of its inputs and a way to read
     the value of small constant inputs (axes, permutations): an :class:`OpContext`.
Out: :func:`spec_for` -- an :class:`OpSpec`, a label per axis of every input and output as
     in an einsum equation (``MatMul`` is ``"mk,kn->mn"``), or a string saying why the op
     cannot be described (then every non-replicate pattern of its GraphNode is invalid).

**Adding the sharding rule of a new TF op**: write a function ``(OpInfo, OpContext) ->
OpSpec`` in the module of its op family (or reuse one there) and add the op type to
:data:`RULES` below; if the op passes no gradient to its inputs, add it to
``tapas.sharding.gradients.NO_GRADIENT`` too. A rule raises ``ValueError`` when it cannot
read the op's attributes or constants. The modules:

===============================  ===========================================================
:mod:`~.spec`                    ``OpSpec``, ``OpContext`` and the label helpers
:mod:`~.elementwise`             unary and binary arithmetic, casts, selects, bias add, softmax
:mod:`~.matmul`                  MatMul, BatchMatMul, Einsum
:mod:`~.conv`                    convolutions, pooling and image resizes
:mod:`~.norm`                    FusedBatchNorm
:mod:`~.reduce`                  reductions, scans, top-k, losses
:mod:`~.shape`                   reshape, transpose, concat, pack/unpack, split, broadcast
:mod:`~.slicing`                 slices, pads, tiles, reversals, rolls, band masks
:mod:`~.gather`                  GatherV2 (the ``vocab-gather`` rewrite), OneHot
:mod:`~.plumbing`                shape queries, constants, variable reads and writes, random
===============================  ===========================================================

What a spec means (the propagation engine, ``tapas.sharding.patterns.propagation``, reads
it). On a 1-D mesh an op computes locally when at most one label is split:

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

This package imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapas.ir import OpInfo
from tapas.sharding.rules import (conv, elementwise, gather, matmul, norm, plumbing, reduce,
                                  shape, slicing)
from tapas.sharding.rules.spec import OpContext, OpSpec, Rule

__all__ = ["OpSpec", "OpContext", "Rule", "RULES", "spec_for", "CONTRACTION_OPS",
           "STATEFUL_RANDOM"]

STATEFUL_RANDOM = plumbing.STATEFUL_RANDOM


def _each(types: Iterable[str], rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(types, rule)


RULES: dict[str, Rule] = {
    # elementwise
    **_each(elementwise.UNARY_LINEAR, elementwise.unary_linear),
    **_each(elementwise.UNARY, elementwise.unary),
    **_each(("ZerosLike", "OnesLike"), elementwise.unary),
    "Cast": elementwise.cast,
    **_each(elementwise.ADDITIVE, elementwise.additive),
    **_each(elementwise.PRODUCT, elementwise.product),
    **_each(elementwise.QUOTIENT, elementwise.quotient),
    **_each(elementwise.BINARY, elementwise.binary),
    **_each(elementwise.TERNARY, elementwise.ternary),
    "BiasAdd": elementwise.bias_add,
    **_each(("Softmax", "LogSoftmax"), elementwise.softmax),
    # contractions
    "MatMul": matmul.matmul,
    **_each(matmul.BATCH_MATMUL, matmul.batch_matmul),
    "Einsum": matmul.einsum,
    # convolution, pooling, batch norm
    **_each(conv.CONV, conv.conv),
    "DepthwiseConv2dNative": conv.depthwise_conv,
    **_each(conv.POOL, conv.pool),
    **_each(conv.RESIZE, conv.resize),
    **_each(norm.BATCH_NORM, norm.batch_norm),
    # reductions and losses
    **_each(reduce.REDUCE_KIND, reduce.reduce),
    **_each(reduce.ARG_REDUCE, reduce.arg_reduce),
    **_each(reduce.SCAN, reduce.scan),
    "TopKV2": reduce.top_k,
    "L2Loss": reduce.l2_loss,
    "SparseSoftmaxCrossEntropyWithLogits": reduce.sparse_softmax_xent,
    "SoftmaxCrossEntropyWithLogits": reduce.softmax_xent,
    # moving data between axes
    "Reshape": shape.reshape,
    **_each(shape.SQUEEZE, shape.squeeze),
    **_each(shape.TRANSPOSE, shape.transpose),
    "ConcatV2": shape.concat,
    "Pack": shape.pack,
    "Unpack": shape.unpack,
    "Split": shape.split,
    "SplitV": shape.split_v,
    "BroadcastTo": shape.broadcast_to,
    # slicing, padding, tiling
    **_each(slicing.PAD, slicing.pad),
    "Tile": slicing.tile,
    "ReverseV2": slicing.reverse,
    "Roll": slicing.roll,
    "MatrixBandPart": slicing.band_part,
    "Slice": slicing.slice_,
    "StridedSlice": slicing.strided_slice,
    # lookups
    **_each(gather.GATHER, gather.gather),
    "OneHot": gather.one_hot,
    # shapes, constants, plumbing
    **_each(plumbing.SHAPE_QUERY, plumbing.shape_query),
    "ShapeN": plumbing.shape_n,
    **_each(plumbing.CONSTANT, plumbing.constant),
    "NoOp": plumbing.no_op,
    **_each(plumbing.RANDOM + plumbing.STATEFUL_RANDOM, plumbing.random),
    **_each(plumbing.VARIABLE_WRITES, plumbing.variable_write),
    "ReadVariableOp": plumbing.read_variable,
    "IdentityN": plumbing.identity_n,
}

# contractions: the ops whose labels the attention and MoE families split one by one
CONTRACTION_OPS = frozenset({"MatMul", *matmul.BATCH_MATMUL, "Einsum"})

def spec_for(op: OpInfo, ctx: OpContext) -> OpSpec | str:
    """The spec of ``op``, or why there is none."""
    rule = RULES.get(op.type)
    if rule is None:
        return f"op '{op.name}' has type {op.type}, which has no placement rule"
    try:
        return rule(op, ctx)
    except (TypeError, ValueError, IndexError, KeyError) as e:
        return f"op '{op.name}' ({op.type}): cannot read its attributes or constants ({e})"
