"""The local program of one captured op on every local replica (reconstruction's op level).

In:  a replay (:class:`tapas.execution.program.run.Run`: the program, the collectives, the
     local values so far) and one ``tapas.ir.OpInfo`` with its local inputs and the
     placements its GraphNode's pattern gives them.
Out: ``[(local values, placement or None)]`` per output of the op: the op replayed on local
     shapes (shape inputs made local, replicated operands sliced where a split one
     broadcasts or contracts against them), or a pattern's rewrite (vocab-gather,
     partial-mean, global-shape), a ResourceGather of a local table, a stateful random
     draw made stateless; the local shape checked against the placement
     (:meth:`LocalOps._conform`). Raises ``ReconstructError`` naming the GraphNode, the
     pattern and the op.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tapas import ir
from tapas.execution.program import replay, stateful
from tapas.execution.program.collectives import local_slice
from tapas.execution.program.plan import ReconstructError
from tapas.sharding import rules
from tapas.sharding.patterns import Rewrite
from tapas.sharding.placements import Partial, Placement, Replica, Split

__all__ = ["LocalOps", "STATEFUL_RANDOM"]

# op type -> index of the input that holds the op's output shape (a Slice's size: its kept
# axes are whole, so a split one takes the local size)
_SHAPE_INPUT = {"Reshape": 1, "BroadcastTo": 1, "Fill": 0, "Slice": 2}
# element-wise ops with broadcasting: a replicated operand that has the split dimension of
# the output is sliced locally (tapas.sharding.patterns.ops: "one that has it is sliced locally")
_BROADCASTING = frozenset({
    "AddV2", "Add", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv",
    "FloorMod", "Maximum", "Minimum", "SquaredDifference", "Pow", "SelectV2", "Select",
    "BiasAdd", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual",
    "LogicalAnd", "LogicalOr", "Atan2", "Xdivy", "Xlogy"})
# concatenations: a replicated operand with the output's split dimension (not the concat
# axis: that is never split) is sliced locally, as for the element-wise ops
_CONCATS = frozenset({"ConcatV2", "Concat"})
# contractions: a replicated operand that has the label the other operands split is sliced
# locally on it (the propagation's ("slice", axis): a constant state in a batched matmul)
_CONTRACTIONS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


class LocalOps:
    """The op-level half of a replay (mixed into :class:`tapas.execution.program.run.Run`,
    which holds ``p`` (the Program), ``n``, ``n_local``, ``rids``, ``seed`` and ``_info``)."""

    def _make(self, op: ir.OpInfo, node: ir.GraphNode, pat: Any, label: str, view: dict,
              vplace: dict, tensors: dict, rewrites: Mapping[str, str]) -> list:
        """Create ``op`` for every local replica; returns ``[(values, placement)]`` per output."""
        if op.type == "ReadVariableOp" and op.inputs[0].split(":")[0] in self.p._weight_of_ph:
            return [self._weight_value(op.inputs[0], pat)]
        if op.type == "ReadVariableOp" and op.inputs[0].split(":")[0] in self.p._state_of_ph:
            return [(stateful.read_state(self, self.p._state_of_ph[op.inputs[0].split(":")[0]], op),
                     Replica())]
        for name in op.inputs:
            if name.startswith("^"):
                continue
            if name not in view:
                base = name.split(":")[0]
                if base in self.p._weight_of_ph:
                    raise ReconstructError(f"{label}: op '{op.name}' ({op.type}) reads weight "
                                           f"'{self.p._weight_of_ph[base]}' directly; only "
                                           "ReadVariableOp reads are supported")
                raise ReconstructError(f"{label}: op '{op.name}' reads '{name}', which is "
                                       "neither an input of the node nor produced inside it")
        ins = [view[name] for name in op.inputs]
        rule = rewrites.get(op.name)
        if rule is not None:
            return _LOWERINGS[Rewrite(rule)](self, op, ins, vplace, label)
        tf_op = self.p._tf_ops[op.name]
        idx = _SHAPE_INPUT.get(op.type)
        if idx is not None and idx < len(ins):
            out = op.outputs[0]
            plc = tensors.get(out.name)
            if plc is not None and out.shape is not None and all(d >= 0 for d in out.shape):
                target = plc.local_shape(out.shape, self.n)
                dt = tf_op.inputs[idx].dtype
                ins = list(ins)
                ins[idx] = [tf.constant(target, dtype=dt)] * self.n_local
        if op.type in _BROADCASTING or op.type in _CONCATS:
            ins = self._slice_broadcast(op, ins, view, vplace, tensors.get(op.outputs[0].name))
        elif op.type in _CONTRACTIONS:
            ins = self._slice_contraction(op, ins, vplace)
        if op.type in _RESOURCE_GATHERS:
            return [(_gather_values(tf_op, ins, self.n_local), None)]
        if op.type in STATEFUL_RANDOM:
            return [(_draw(tf_op, ins, self.n_local, self.seed), None)]
        per_replica = self._replay(op, ins, label, _squeezed_axes(tf_op))
        return [([outs[j] for outs in per_replica], None) for j in range(len(op.outputs))]

    def _replay(self, op: ir.OpInfo, ins: list, label: str,
                attrs: Mapping[str, Any] | None = None) -> list:
        """The traced op re-created on every local replica's inputs: outputs per replica."""
        tf_op = self.p._tf_ops[op.name]
        per_replica = []
        for r in range(self.n_local):
            try:
                per_replica.append(replay.replay_op(tf_op, [x[r] for x in ins], attrs=attrs))
            except replay.ReplayError as err:
                raise ReconstructError(f"{label}: {err}") from err
        return per_replica

    def _partial_mean(self, op: ir.OpInfo, ins: list, label: str) -> list:
        """A Mean over a split axis: the mean over all devices is the sum of the local
        means divided by N, so each local mean / N is a partial sum (P)."""
        per_replica = self._replay(op, ins, label)
        return [([o * tf.constant(1.0 / self.n, o.dtype) for o in
                  (outs[j] for outs in per_replica)], Partial()) for j in range(len(op.outputs))]

    def _slice_broadcast(self, op: ir.OpInfo, ins: list, view: dict, vplace: dict,
                         out_place: Placement | None) -> list:
        if not isinstance(out_place, Split) or op.outputs[0].shape is None:
            return ins
        rank = len(op.outputs[0].shape)
        axis = out_place.axis
        out = list(ins)
        for i, name in enumerate(op.inputs):
            info = self._info(name)
            if not isinstance(vplace.get(name), Replica) or info.shape is None:
                continue
            a = axis - (rank - len(info.shape))  # broadcasting aligns the trailing axes
            if 0 <= a < len(info.shape) and info.shape[a] == op.outputs[0].shape[axis] and \
                    info.shape[a] > 1:
                # a plain local slice: the gradient of the replicated operand becomes
                # partial, and the pattern's backward comms reduce it where it must be whole
                out[i] = self._plain_slices(ins[i], a)
        return out

    def _slice_contraction(self, op: ir.OpInfo, ins: list, vplace: dict) -> list:
        """A contraction whose split operands split a label (its rule's, from the global
        shapes) that a replicated operand has too: that operand's local slice on it, as the
        propagation assumed (its gradient is the slice's, reduced by the pattern's comms)."""
        placed = [vplace.get(name) for name in op.inputs]
        if not (any(isinstance(p, Split) for p in placed) and
                any(isinstance(p, Replica) for p in placed)):
            return ins              # nothing to slice: no rule lookup on the common path
        shapes = tuple(self._info(name).shape for name in op.inputs)
        if any(s is None for s in shapes):
            return ins
        spec = rules.spec_for(op, rules.OpContext(shapes, tuple(t.shape for t in op.outputs),
                                                  lambda i: None))
        if isinstance(spec, str):
            return ins
        labels = [labs[vplace[name].axis] for name, labs in zip(op.inputs, spec.inputs)
                  if labs is not None and isinstance(vplace.get(name), Split)]
        if not labels:
            return ins
        out = list(ins)
        for i, (name, labs) in enumerate(zip(op.inputs, spec.inputs)):
            if labs is not None and isinstance(vplace.get(name), Replica) and labels[0] in labs:
                out[i] = self._plain_slices(ins[i], labs.index(labels[0]))
        return out

    def _plain_slices(self, vals: list, axis: int) -> list:
        return [local_slice(v, axis, self.n, rid) for v, rid in zip(vals, self.rids)]

    def _global_shape(self, tf_op: tf.Operation, label: str) -> list:
        """Shape, Size, Rank or ShapeN of split tensors: the traced (global) values."""
        out = []
        for j, t in enumerate(tf_op.outputs):
            src_shape = tf_op.inputs[j if tf_op.type == "ShapeN" else 0].shape
            if not src_shape.is_fully_defined():
                raise ReconstructError(f"{label}: '{tf_op.name}' ({tf_op.type}) of a tensor "
                                       f"with dynamic shape {src_shape}: TAPAS needs static "
                                       "shapes")
            dims = src_shape.as_list()
            value = {"Size": int(np.prod(dims)), "Rank": len(dims)}.get(tf_op.type, dims)
            out.append(([tf.constant(value, dtype=t.dtype)] * self.n_local, Replica()))
        return out

    def _conform(self, vals: list, plc: Placement | None, want: Placement | None,
                 out: ir.TensorInfo, label: str, op: ir.OpInfo) -> tuple[list, Placement]:
        """Check the local shape against the expected placement; infer it when unknown."""
        if plc is not None and want is None:
            return vals, plc
        if out.shape is None or any(d < 0 for d in out.shape):
            return vals, (want if want is not None else Replica())
        got = tuple(vals[0].shape.as_list()) if vals[0].shape.rank is not None else None
        glob = tuple(out.shape)
        if want is None:
            if got == glob:
                return vals, Replica()
            diff = [a for a in range(len(glob)) if got is not None and got[a] != glob[a]]
            if got is not None and len(got) == len(glob) and len(diff) == 1 and \
                    got[diff[0]] * self.n == glob[diff[0]]:
                return vals, Split(diff[0])
            raise ReconstructError(f"{label}: op '{op.name}' ({op.type}) yields local shape "
                                   f"{got} for global {glob}, which is no placement on "
                                   f"{self.n} devices: name it in the pattern's tensors")
        expect = want.local_shape(glob, self.n)
        if got == expect:
            return vals, want
        if got is None or (None in got and len(got) == len(expect) and all(
                g is None or g == e for g, e in zip(got, expect))):
            # an op whose shape TensorFlow cannot infer (tf.py_function: the capture's
            # set_shape is not replayed): the placement's shape, checked when it runs
            return [tf.ensure_shape(v, expect) for v in vals], want
        if got == glob and isinstance(want, Split):
            # computed whole from replicated values (e.g. a constant): keep this device's
            # part (plain slice; the pattern's backward comms handle the partial gradient)
            return self._plain_slices(vals, want.axis), want
        raise ReconstructError(
            f"{label}: op '{op.name}' ({op.type}) yields local shape {got}, but its output "
            f"'{out.name}' (global {glob}) is placed {want}, i.e. local {expect}: the "
            "pattern's placement rule for this op is wrong")

    def _vocab_gather(self, op: ir.OpInfo, ins: list, vplace: dict, label: str) -> list:
        """GatherV2 from a table split on the gathered axis (an embedding's rows, or axis 1
        of a (1, positions, dim) table: PARSeq's position queries): look up the ids this
        shard owns, zeros for the others; the sum over devices (P) is the full lookup."""
        if op.type not in ("GatherV2", "ResourceGather"):
            raise ReconstructError(f"{label}: rewrite 'vocab-gather' applies to GatherV2, not "
                                   f"'{op.name}' ({op.type})")
        table_name, ids_name = op.inputs[0], op.inputs[1]
        tf_op = self.p._tf_ops[op.name]
        axis = tf.get_static_value(tf_op.inputs[2]) if len(op.inputs) > 2 else 0
        rank = tf_op.inputs[0].shape.rank
        if axis is not None and rank is not None and int(axis) < 0:
            axis = int(axis) + rank
        if axis is None or (tf_op.type == "GatherV2" and tf_op.get_attr("batch_dims") != 0):
            raise ReconstructError(f"{label}: 'vocab-gather' needs a constant gather axis and "
                                   f"no batch dimensions in '{op.name}'")
        axis = int(axis)
        if not isinstance(vplace.get(table_name), Split) or vplace[table_name].axis != axis or \
                not isinstance(vplace.get(ids_name), Replica):
            raise ReconstructError(f"{label}: 'vocab-gather' needs the table split on the "
                                   f"gathered axis (S{axis}) and replicated ids, got "
                                   f"{vplace.get(table_name)} and {vplace.get(ids_name)}")
        out = []
        for table, ids, rid in zip(ins[0], ins[1], self.rids):
            rows = table.shape[axis]
            start = tf.cast(rid, ids.dtype) * rows
            local = ids - start
            mine = tf.logical_and(local >= 0, local < rows)
            got = tf.gather(table, tf.where(mine, local, tf.zeros_like(local)), axis=axis)
            mask = tf.cast(mine, got.dtype)
            out.append(got * tf.reshape(mask, [1] * axis + mask.shape.as_list() + [1] *
                                        (got.shape.rank - axis - mask.shape.rank)))
        return out




# the lowering of each rewrite: (run, op, local inputs, their placements, label) ->
# [(local values, placement)] per output of the op
_LOWERINGS: Mapping[Rewrite, Callable[[LocalOps, ir.OpInfo, list, dict, str], list]] = {
    Rewrite.VOCAB_GATHER: lambda run, op, ins, vplace, label:
        [(run._vocab_gather(op, ins, vplace, label), Partial())],
    Rewrite.GLOBAL_SHAPE: lambda run, op, ins, vplace, label:
        run._global_shape(run.p._tf_ops[op.name], label),
    Rewrite.PARTIAL_MEAN: lambda run, op, ins, vplace, label: run._partial_mean(op, ins, label),
}


# ops that run functions whose bodies may read variables through resource arguments: the
# replay passes the values instead (tapas.execution.program.replay._as_values)
_CALLS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
                    "PartitionedCall", "StatefulPartitionedCall"})
# lookups that read a variable themselves; replayed as the same lookup of its local value
_RESOURCE_GATHERS = frozenset({"ResourceGather", "ResourceGatherNd"})


def _gather_values(tf_op: tf.Operation, ins: list, n_local: int) -> list:
    """A ResourceGather / ResourceGatherNd re-created on each replica's local table value
    (``ins[0]``) as GatherV2 / GatherNd: the same rows, and a gradient (IndexedSlices) that
    flows to the value read, as the runtime's other weight reads."""
    if tf_op.type == "ResourceGatherNd":
        return [tf.gather_nd(ins[0][r], ins[1][r]) for r in range(n_local)]
    batch_dims = tf_op.get_attr("batch_dims")
    return [tf.gather(ins[0][r], ins[1][r], axis=batch_dims, batch_dims=batch_dims)
            for r in range(n_local)]


#: random ops that draw from a hidden per-op state (Keras 2's ``Dropout``, ``tf.random.uniform``
#: without a seed): replayed as the stateless draw :func:`_draw`
STATEFUL_RANDOM = frozenset(rules.STATEFUL_RANDOM)


def _draw(tf_op: tf.Operation, ins: list, n_local: int, seed: Any) -> list:
    """A stateful random op (``RandomUniform``, ``RandomStandardNormal``, ``TruncatedNormal``,
    ``RandomUniformInt``) re-created as the stateless draw of the same distribution from the
    seed (``seed``, a hash of the op's name): the same numbers on every replica, whatever its
    device. Replayed as it is, each device's copy of the op would draw from its own state,
    so the copies of a replicated tensor would differ from device to device (a dropout mask
    on a replicated activation: the replicas of every later value disagree). The draw has
    the traced (global) shape; a consumer that splits it keeps its slice (the rule:
    ``tapas.sharding.rules.plumbing.random``), so every device uses its part of one draw,
    as the single-device program would. Each step draws anew when ``seed`` is the step
    number (the runtime's). The draws are not Keras's: Keras 2 draws from the ops' own
    states, which nothing can replay (``verify`` says so for training mode)."""
    out = tf_op.outputs[0]
    key = tf.constant(zlib.crc32(tf_op.name.encode()) & 0x7FFFFFFF, tf.int64)
    step = tf.constant(0, tf.int64) if seed is None else tf.cast(seed, tf.int64)
    pair = tf.stack([step, key])
    static = out.shape.is_fully_defined()
    values = []
    for r in range(n_local):
        shape = out.shape.as_list() if static else ins[0][r]
        if tf_op.type == "RandomUniformInt":
            values.append(tf.random.stateless_uniform(shape, pair, ins[1][r], ins[2][r],
                                                      dtype=out.dtype))
        elif tf_op.type == "RandomUniform":
            values.append(tf.random.stateless_uniform(shape, pair, dtype=out.dtype))
        elif tf_op.type == "RandomStandardNormal":
            values.append(tf.random.stateless_normal(shape, pair, dtype=out.dtype))
        else:
            values.append(tf.random.stateless_truncated_normal(shape, pair, dtype=out.dtype))
    return values


def _squeezed_axes(tf_op: tf.Operation) -> dict[str, Any] | None:
    """A Squeeze of every size-1 axis (no ``squeeze_dims``) names the axes it squeezed in
    the traced graph, so that a local shape whose split axis has size 1 (a 4-channel bias
    on 4 devices) keeps that axis; None for every other op."""
    if tf_op.type != "Squeeze" or list(tf_op.get_attr("squeeze_dims")) or \
            tf_op.inputs[0].shape.rank is None or tf_op.outputs[0].shape.rank is None:
        return None
    axes = [a for a, d in enumerate(tf_op.inputs[0].shape.as_list()) if d == 1]
    if len(axes) != tf_op.inputs[0].shape.rank - tf_op.outputs[0].shape.rank:
        return None            # an unknown dimension may have been squeezed too
    return {"squeeze_dims": tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(i=axes))}
