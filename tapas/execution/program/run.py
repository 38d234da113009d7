"""One replay of a per-replica program: GraphNode by GraphNode, with the plan's collectives.

In:  a :class:`tapas.execution.program.reconstruct.Program`, the collectives of the local
     replicas (and of the mesh column, for nested experts), the local inputs and weights.
Out: :meth:`Run.execute`: the local values of the graph outputs (and, in ``env``, of every
     GraphNode output; in ``writes``, the variable writes of a training-mode graph).
     Between GraphNodes each tensor is resharded from its producer's placement into its
     consumer's, once per (tensor, placement); the pattern's forward comms run after the op
     making their tensor, its backward comms wrap the tensor where the node reads it.
     Raises ``ReconstructError`` naming the GraphNode, the pattern and the op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tapas import ir
from tapas.execution.program import stateful
from tapas.execution.program.collectives import Collectives
from tapas.execution.program.local_ops import _CALLS, _RESOURCE_GATHERS, LocalOps
from tapas.execution.program.plan import ReconstructError
from tapas.sharding import placements
from tapas.sharding.gradients import NO_GRADIENT
from tapas.sharding.placements import Collective, Partial, Placement, Replica, Split

if TYPE_CHECKING:
    from tapas.execution.program.reconstruct import Program

__all__ = ["Run"]


class Resharding:
    """Moving tensors between placements (mixed into :class:`Run`, which holds ``p``,
    ``coll``, ``column``, ``env``, ``place`` and ``cache``)."""

    def reshard(self, vals: list, have: Placement, want: Placement, name: str,
                partial_grad: bool = False, info: ir.TensorInfo | None = None) -> list:
        """Turn ``vals`` (placed ``have``) into ``want`` with the conjugate collectives."""
        if have == want:
            return vals
        info = self._info(name) if info is None else info
        shape, dtype, c = info.shape, info.dtype, self.coll
        if isinstance(want, Partial):
            raise ReconstructError(f"'{name}' is placed {have}; nothing turns it into a partial "
                                   "sum P: the pattern must place it R or S(axis)")
        if isinstance(have, Partial):
            if isinstance(want, Replica):
                return c.all_reduce(vals, name, shape, dtype)
            return c.reduce_scatter(vals, want.axis, name, shape, dtype)
        if isinstance(have, Split):
            if isinstance(want, Replica):
                return c.all_gather(vals, have.axis, name, shape, dtype, partial_grad)
            return c.all_to_all(vals, have.axis, want.axis, name, shape, dtype)
        return c.scatter(vals, want.axis, name, shape, dtype)

    def _edge(self, name: str, want: Placement, into_region: bool = False) -> list:
        region = self.p.region
        if region is not None:
            inside = into_region and name in region.entry_names
            outside = not into_region and name in region.exit_names
            if inside or outside:
                return self._exchanged(name, want, inside)
        have = self.place[name]
        if have == want:
            return self.env[name]
        key = (name, str(want))
        if key not in self.cache:
            self.cache[key] = self.reshard(self.env[name], have, want, name)
        return self.cache[key]

    def _exchanged(self, name: str, want: Placement, entry: bool) -> list:
        """A tensor crossing the expert region's boundary (nested experts): into the
        region, resharded in the row as the region's GraphNode wants it and then exchanged
        over the mesh column (groups -> experts: ``[E, G]`` becomes ``[E / rows, G * rows]``);
        out of it, exchanged back first (experts -> groups), then resharded. The all-to-all
        moves axes 0 and 1, which no placement inside the region splits."""
        key = (name, str(want), "entry" if entry else "exit")
        if key in self.cache:
            return self.cache[key]
        outer = self.p.source_info(name)
        have = self.place[name]
        vals = self.env[name]
        c = self.column
        # audited as the tensor over the whole column (its global size, as in 1-D): every
        # expert, every row's groups; each device's buffer is 1/rows of it
        if entry:
            vals = self.reshard(vals, have, want, name)
            shape = vals[0].shape.as_list()
            shape[1] *= c.num_devices
            vals = c.all_to_all(vals, 1, 0, name, shape, outer.dtype)
        else:
            shape = vals[0].shape.as_list()
            shape[0] *= c.num_devices
            vals = c.all_to_all(vals, 0, 1, name, shape, outer.dtype)
            if have != want:
                vals = self.reshard(vals, have, want, name, info=outer)
        self.cache[key] = vals
        return vals


@dataclasses.dataclass
class _NodeState:
    """What one GraphNode's replay keeps: its pattern, local values and placements by
    tensor name, its comms by tensor, and the repeated weight reads it folds together."""

    pat: Any
    label: str
    view: dict[str, list] = dataclasses.field(default_factory=dict)
    vplace: dict[str, Placement] = dataclasses.field(default_factory=dict)
    fwd: dict[str, list[placements.Comm]] = dataclasses.field(default_factory=dict)
    bwd: dict[str, list[placements.Comm]] = dataclasses.field(default_factory=dict)
    again: dict[str, str] = dataclasses.field(default_factory=dict)
    tensors: dict[str, Placement] = dataclasses.field(default_factory=dict)
    rewrites: Mapping[str, str] = dataclasses.field(default_factory=dict)


class Run(Resharding, LocalOps):
    """One replay of a Program (state of one trace)."""

    def __init__(self, prog: Program, coll: Collectives, column: Collectives | None = None,
                 seed: Any = None) -> None:
        self.p = prog
        self.seed = seed
        self.coll = coll
        self.column = column
        self.n = prog.num_devices
        self.rids = coll.replica_ids()
        self.n_local = len(self.rids)
        self.env: dict[str, list] = {}
        self.place: dict[str, Placement] = {}
        self.cache: dict[tuple[str, str], list] = {}
        # activation op name -> (local logits, placement) as the activation read them
        self.logits: dict[str, tuple[list, Placement]] = {}
        self._want_logits = {name for name in prog.output_logits if name}
        self.writes = stateful.Writes(prog.stored_placement, self.n, self.rids)

    # ---- helpers --------------------------------------------------------------------
    def _info(self, name: str) -> ir.TensorInfo:
        info = self.p._info.get(name)
        if info is None:
            t = self.p.trace.graph.get_tensor_by_name(name)
            info = ir.TensorInfo(name, tuple(t.shape.as_list()), t.dtype.name)
        return info

    # ---- the replay ------------------------------------------------------------------
    def execute(self, inputs: Sequence[Sequence[Any]], weights: Mapping[str, Sequence[Any]]
                ) -> list[list[tf.Tensor]]:
        p = self.p
        if len(inputs) != len(p._input_names):
            raise ReconstructError(f"the program takes {len(p._input_names)} input(s) "
                                   f"{list(p._input_names)}, got {len(inputs)}")
        for k, name in enumerate(p._input_names):
            vals = [tf.convert_to_tensor(x) for x in inputs[k]]
            if len(vals) != self.n_local:
                raise ReconstructError(f"input '{name}' has {len(vals)} local part(s); the "
                                       f"collectives run {self.n_local} local replica(s)")
            info = self._info(name)
            # (a length the traced graph leaves unknown, as the input of one GraphNode run
            # alone can have, is not checked)
            want = None if info.shape is None else p.input_placements[k].local_shape(
                [-1 if d is None else d for d in info.shape], self.n)
            for v in vals:
                got = tuple(v.shape.as_list())
                if want is not None and (len(got) != len(want) or
                                         any(w >= 0 and g != w for g, w in zip(got, want))):
                    raise ReconstructError(
                        f"input '{name}' has local shape {tuple(v.shape.as_list())}; placed "
                        f"{p.input_placements[k]} on {self.n} devices it must be {want}")
            self.env[name] = vals
            self.place[name] = p.input_placements[k]
        self.weights = weights
        for node in p.graph.nodes:
            self._node(node)
        # (an output made inside an expert region is exchanged back out of it first)
        outs = [self._edge(t.name, self.place[t.name]) for t in p.graph.outputs]
        for t, act, vals in zip(p.graph.outputs, p.output_logits, outs):
            if act is not None:
                self._tag_logits(t.name, act, vals)
        return outs

    def _tag_logits(self, name: str, act: str, vals: list) -> None:
        """Give each local output made by a Softmax/Sigmoid its local logits, the way Keras's
        activations do (``_keras_logits``), so that a Keras crossentropy loss of the local
        output computes from the logits, as it does on the Keras model. Logits placed unlike
        the output (a pattern that moves the activation's output) are not handed over: only a
        loss needs them, and the runtime refuses to train such a plan with a clear error."""
        logits, plc = self.logits[act]
        if plc == self.place[name]:
            for out, lg in zip(vals, logits):
                out._keras_logits = lg

    def _node(self, node: ir.GraphNode) -> None:
        pat = self.p.plan.pattern(node)
        s = _NodeState(pat, f"GraphNode {node.id} '{node.name}' ({node.kind.value}, pattern "
                            f"'{getattr(pat, 'name', '?')}')")
        for c in getattr(pat, "comms", ()):
            (s.fwd if c.phase == "fwd" else s.bwd).setdefault(c.tensor, []).append(c)
        self._weight_reads(node, s)
        into_region = self.p.region is not None and node.id in self.p.region.nodes
        for k, t in enumerate(node.inputs):
            want = pat.inputs[k]
            s.view[t.name] = self._edge(t.name, want, into_region)
            s.vplace[t.name] = want
            self._apply_bwd(t.name, s.view, s.vplace, s.fwd, s.bwd)
        s.tensors = dict(getattr(pat, "tensors", {}))
        s.rewrites = getattr(pat, "rewrites", {})
        for op in node.ops:
            if op.type == "Placeholder":
                self._placeholder(op, s)
            elif op.type in stateful.WRITE_OPS:
                stateful.record_write(self, op, s.view, s.vplace, s.label)
            elif op.outputs and op.outputs[0].name in s.again:
                first = s.again[op.outputs[0].name]
                s.view[op.outputs[0].name] = s.view[first]
                s.vplace[op.outputs[0].name] = s.vplace[first]
            elif op.outputs:   # (NoOp and other control-only ops have none)
                self._op(op, node, s)
        for k, t in enumerate(node.outputs):
            want = pat.outputs[k]
            if t.name not in s.view:
                raise ReconstructError(f"{s.label}: output '{t.name}' was not produced")
            if s.vplace[t.name] != want:
                raise ReconstructError(
                    f"{s.label}: output '{t.name}' ends placed {s.vplace[t.name]} but the "
                    f"pattern says {want}: the pattern lacks a collective")
            self.env[t.name], self.place[t.name] = s.view[t.name], want

    def _weight_reads(self, node: ir.GraphNode, s: _NodeState) -> None:
        """Move the pattern's backward comms on a weight to where the node reads it, and
        note in ``s.again`` a later read of a trainable weight the node read already
        (ALBERT's one layer applied twice): it takes the first read's value, so the
        gradients of both add up before the one backward collective the pattern has."""
        reads: dict[str, list[str]] = {}  # weight path or placeholder tensor -> reads
        for op in node.ops:
            ph = op.inputs[0].split(":")[0] if op.inputs else ""
            if op.type == "ReadVariableOp" and ph in self.p._weight_of_ph:
                path = self.p._weight_of_ph[ph]
                first = reads.get(path, [None])[0]
                layout = self.p.weight_layouts.get(path)
                if first is not None and layout is not None and layout.trainable and \
                        first not in s.fwd and op.outputs[0].name not in s.fwd:
                    s.again[op.outputs[0].name] = first
                    continue
                reads.setdefault(path, []).append(op.outputs[0].name)
                reads.setdefault(op.inputs[0], []).append(op.outputs[0].name)
            elif op.type in _RESOURCE_GATHERS and ph in self.p._weight_of_ph:
                # a lookup straight from the variable (Hugging Face's TF embeddings:
                # tf.gather(self.weight, ids)) reads it as a value named by its handle
                reads.setdefault(self.p._weight_of_ph[ph], []).append(op.inputs[0])
            elif op.type in _CALLS:   # a tf.cond or call whose body reads variables: the
                for name in op.inputs:   # values are passed in (replay.replay_op)
                    base = name.split(":")[0]
                    if base in self.p._weight_of_ph and name not in reads.get(
                            self.p._weight_of_ph[base], ()):
                        reads.setdefault(self.p._weight_of_ph[base], []).append(name)
        for key, names in reads.items():  # bwd comms on a weight apply where it is read
            for c in s.bwd.pop(key, []):
                for nm in names:
                    s.bwd.setdefault(nm, []).append(c)

    def _placeholder(self, op: ir.OpInfo, s: _NodeState) -> None:
        """A graph input, a model variable or state (read by its ReadVariableOp), or a
        constant captured from Python."""
        name = op.outputs[0].name
        if name in self.env:  # a graph input
            s.view[name], s.vplace[name] = self.env[name], self.place[name]
        elif op.name in self.p._constant_of_ph:  # captured from Python: a constant
            value = tf.constant(self.p._constant_of_ph[op.name])
            s.view[name], s.vplace[name] = self._conform(
                [value] * self.n_local, None, s.tensors.get(name), op.outputs[0], s.label, op)
        elif op.name not in self.p._weight_of_ph and op.name not in self.p._state_of_ph:
            raise ReconstructError(f"{s.label}: placeholder '{op.name}' is neither a graph "
                                   "input, a model variable nor a captured constant")

    def _op(self, op: ir.OpInfo, node: ir.GraphNode, s: _NodeState) -> None:
        """``op`` on every local replica, its outputs placed as the pattern says and their
        forward comms run."""
        view, vplace, label = s.view, s.vplace, s.label
        handles = op.inputs[:1] if op.type in _RESOURCE_GATHERS else \
            op.inputs if op.type in _CALLS else ()
        for handle in handles:
            if handle not in view and handle.split(":")[0] in self.p._weight_of_ph:
                view[handle], vplace[handle] = self._weight_value(handle, s.pat)
                self._apply_bwd(handle, view, vplace, s.fwd, s.bwd)
        if op.name in self._want_logits and op.inputs[0] in view:
            self.logits[op.name] = (view[op.inputs[0]], vplace[op.inputs[0]])
        vals_per_out = self._make(op, node, s.pat, label, view, vplace, s.tensors, s.rewrites)
        for j, out in enumerate(op.outputs):
            vals, plc = vals_per_out[j]
            comms = s.fwd.get(out.name, [])
            pre = comms[0].src if comms else s.tensors.get(out.name)
            vals, plc = self._conform(vals, plc, pre, out, label, op)
            for c in comms:
                if c.src != plc:
                    raise ReconstructError(
                        f"{label}: forward {c.kind.value} on '{out.name}' expects it "
                        f"placed {c.src}, the op yields {plc}")
                partial_grad = any(b.kind == Collective.REDUCE_SCATTER
                                   for b in s.bwd.get(out.name, []))
                vals = self.reshard(vals, plc, c.dst, out.name, partial_grad)
                plc = c.dst
            view[out.name], vplace[out.name] = vals, plc
            self._apply_bwd(out.name, view, vplace, s.fwd, s.bwd)

    def _apply_bwd(self, name: str, view: dict, vplace: dict, fwd: dict, bwd: dict) -> None:
        for c in bwd.get(name, []):
            conj = []
            for f in fwd.get(name, []):
                conj += [b for b in placements.reshard(f.src, f.dst, f.shape, f.dtype, name)
                         if b.phase == "bwd"]
            if any(b.kind == c.kind and b.axis == c.axis for b in conj) or (
                    c.kind == Collective.REDUCE_SCATTER and
                    any(f.kind == Collective.ALL_GATHER for f in fwd.get(name, []))):
                continue  # the conjugate of a forward comm: inserted with it
            label, shape, dtype = c.tensor, c.shape, c.dtype  # as the plan names it
            made_by = self.p._tf_ops.get(name.split(":")[0])
            if c.kind == Collective.ALL_REDUCE and made_by is not None and \
                    made_by.type in NO_GRADIENT:
                continue  # its gradient stops there (batch norm's StopGradient of the mean):
                # nothing to reduce, and the audit's prediction leaves it out too
            if c.kind == Collective.ALL_REDUCE:
                view[name] = self.coll.all_reduce_grad(view[name], label, shape, dtype)
            elif c.kind == Collective.ALL_GATHER and isinstance(vplace[name], Replica):
                axis = c.axis if c.axis is not None else c.src.axis
                view[name] = self.coll.scatter(view[name], axis, label, shape, dtype)
                vplace[name] = Split(axis)
            else:
                raise ReconstructError(f"backward {c.kind.value} on '{name}' (placed "
                                       f"{vplace[name]}) is not the conjugate of a forward "
                                       "collective and not an all-reduce of a partial gradient")

    def _read_weight(self, path: str, want: Placement) -> list:
        layout = self.p.weight_layouts[path]
        if path not in self.weights:
            raise ReconstructError(f"no local shards for weight '{path}': pass weights[path] "
                                   f"with one value per local replica")
        vals = [tf.convert_to_tensor(w) for w in self.weights[path]]
        if len(vals) != self.n_local:
            raise ReconstructError(f"weight '{path}' has {len(vals)} local shard(s); the "
                                   f"collectives run {self.n_local} local replica(s)")
        for v in vals:
            if tuple(v.shape.as_list()) != layout.local_shape:
                raise ReconstructError(
                    f"weight '{path}' has local shape {tuple(v.shape.as_list())}; placed "
                    f"{layout.placement} on {self.n} devices it must be {layout.local_shape}")
        if layout.placement == want:
            return vals
        key = (f"weight:{path}", str(want))
        if key not in self.cache:  # a tied weight read with another placement
            info = ir.TensorInfo(path, layout.row_shape, layout.dtype)
            self.p._info.setdefault(path, info)
            self.cache[key] = self.reshard(vals, layout.placement, want, path)
        return self.cache[key]

    def _weight_value(self, handle: str, pat: Any) -> tuple[list, Placement]:
        """(local values, placement) of the weight whose resource is ``handle``, as the
        pattern places it (the step's last write of it, if a GraphNode wrote it)."""
        path = self.p._weight_of_ph[handle.split(":")[0]]
        want = pat.weights[path]
        written = self.writes.read(path, want)
        return (written if written is not None else self._read_weight(path, want)), want
