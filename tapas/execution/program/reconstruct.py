"""Reconstruction: a captured graph and a sharding plan become a per-replica TF program.

In:  a :class:`tapas.capturing.Trace` (the traced ``tf.Graph`` and the variables its
     resource placeholders stand for), its :class:`tapas.ir.Graph`, and a :class:`Plan`:
     the ShardingPattern of every GraphNode on N devices (docs/sharding.md), from a
     ``Strategy`` (:meth:`Plan.from_strategy`) or written by hand (:class:`NodeSharding`).
Out: :class:`Program`, a callable that replays the captured ops one by one in the current
     ``tf.function``, with *local* shapes, on local input and weight shards, and inserts
     the collectives the plan asks for through a :class:`tapas.execution.program.collectives.Collectives`.

How each op is re-created:

* graph-input placeholders take the caller's local inputs; ``ReadVariableOp`` of a model
  weight takes the caller's local shard (a variable is read with ``read_value``, so tapes
  watch it);
* every other op is replayed with its original type and attributes
  (``tapas.execution.program.replay.replay_op``) on the local inputs; shapes are re-inferred. Ops whose
  inputs carry a shape (``Reshape``, ``BroadcastTo``, ``Fill``) get the *local* shape,
  computed from the global shape in the IR and the op output's placement in the
  pattern's ``tensors``;
* ops named in the pattern's ``rewrites`` get a different local program (``vocab-gather``:
  a gather from a vocabulary-split table);
* after each op, the local shape is checked against the placement (a constant the pattern
  splits is sliced locally); a mismatch is a :class:`ReconstructError` naming the node, the
  pattern and the op;
* forward comms of the pattern run right after the op producing their tensor; backward
  comms (Megatron's ``f``) wrap the tensor where the node reads it; between GraphNodes the
  producer's output placement is resharded into what the consumer expects
  (``tapas.sharding.placements.reshard``), once per (tensor, placement).

All local replicas of one program instance run op by op side by side: with
``SimulatedCollectives(N)`` every value is a list of N local tensors (one process, one
device); with ``ReplicaContextCollectives()`` a list of one (the current replica). Control
dependencies of the traced graph are not replayed: a training-mode graph's variable writes
(dropout's seed state, batch norm's moving statistics) are collected as new values that
the caller assigns after the step (``tapas.execution.program.stateful``), and a read after a write
in the same replay sees the written value.

Example (single device: forward and tape gradients equal the model's)::

    t = tapas.capturing.trace(model, tf.TensorSpec([8, 16]))
    prog = Program(t, tapas.capturing.to_ir(t), Plan.replicated(graph, 1))
    fn = tf.function(lambda x: prog([[x]], prog.trace_weights(), SimulatedCollectives(1)))
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program import replay, stateful
from tapas.sharding.gradients import NO_GRADIENT
# the plan types stay importable from here (reconstruct.Plan, .NodeSharding, ...)
from tapas.execution.program.plan import NodeSharding, Plan, ReconstructError, WeightLayout
from tapas import ir
from tapas.sharding import placements, rules
from tapas.sharding.patterns import Rewrite
from tapas.execution.program.collectives import (Audit, Collectives, CommRecord, ReplicaContextCollectives,
                                         SimulatedCollectives, local_slice)
from tapas.sharding.placements import Collective
from tapas.sharding.placements import Partial, Placement, Replica, Split

__all__ = ["NodeSharding", "Plan", "Program", "WeightLayout", "ReconstructError", "Audit",
           "CommRecord", "SimulatedCollectives", "ReplicaContextCollectives", "REWRITES"]

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
# local programs that differ from "the same op on local shapes" (named by the patterns,
# tapas.sharding.patterns.Rewrite); each has its lowering in _LOWERINGS below:
#   vocab-gather  GatherV2 from a row-split table (see _Run._vocab_gather); result P
#   partial-mean  a Mean over a split axis: the local mean divided by N; result P
#   global-shape  Shape/Size/Rank/ShapeN of a split tensor: the global value, a constant
REWRITES = tuple(r.value for r in Rewrite)
# activations whose output Keras's crossentropy losses replace by the activation's input
# (the logits): keras.activations.softmax/sigmoid tag their output with ``_keras_logits``,
# and in graph mode (``model.fit``) the losses also look for a Softmax/Sigmoid producer op
# (``keras.src.backend.tensorflow.nn._get_logits``). A model output made by one of these
# carries its local logits the same way (``Program.output_logits``), so that the runtime's
# loss equals the Keras model's.
LOGIT_ACTIVATIONS = frozenset({"Softmax", "Sigmoid"})
_PASS_THROUGH = frozenset({"Identity", "IdentityN", "Snapshot"})


def _place(p: Any) -> Placement:
    return placements.parse_placement(p) if isinstance(p, str) else p


class Program:
    """The per-replica program of ``trace`` under ``plan`` (see the module docstring).

    Building it checks the plan against the graph (every split divides, the pattern shapes
    match the node) before any TensorFlow op is created.
    """

    def __init__(self, trace: Any, graph: ir.Graph, plan: Plan, expert_rows: int = 1) -> None:
        self.trace = trace
        self.plan = plan
        self.num_devices = int(plan.num_devices)
        if self.num_devices < 1:
            raise ReconstructError(f"plan has num_devices={plan.num_devices}: it must be >= 1")
        # nested expert + tensor parallelism (tapas.planning.experts): the expert region runs
        # on tokens exchanged over the mesh column, in the shapes one row sees there
        self.expert_rows = int(expert_rows)
        self.region = None
        self.source_graph = graph
        if self.expert_rows > 1:
            from tapas.planning import experts
            try:
                self.region = experts.ExpertRegion.of(graph, self.expert_rows)
            except experts.NestingError as e:
                raise ReconstructError(str(e)) from None
            plan.check_graph(graph)
            for node in graph.nodes:
                why = experts.allowed_pattern(plan.pattern(node), node, self.region)
                if why:
                    raise ReconstructError(
                        f"GraphNode {node.id} '{node.name}' (pattern "
                        f"'{getattr(plan.pattern(node), 'name', '?')}') cannot run with its "
                        f"experts split over the mesh rows: {why}; search the row with "
                        "tapas.planning.experts.nested_patterns (tapas search --mesh=RxC:experts)"
                        " or choose another pattern for it")
            graph = experts.row_view(graph, self.expert_rows, self.region)
        self.graph = graph
        self._tf_ops = {op.name: op for op in trace.graph.get_operations()}
        self._weight_of_ph = {ph: w.path for ph, w in trace.weights.items()}
        # variables the graph reads and writes that are no weights (seed states)
        self.states = stateful.states_of(trace)
        self._state_of_ph = {ph: s.path for ph, s in self.states.items()}
        self._constant_of_ph = dict(getattr(trace, "constants", {}))
        # program order of the traced ops, and of each seed state's writes (stateful); an
        # inference graph has no seed states and skips it (a pass over every traced op)
        self._op_order = {op.name: i for i, op in enumerate(trace.graph.get_operations())} \
            if self.states else {}
        self._state_writes: dict[str, list[int]] = {}
        for n in graph.nodes if self.states else ():
            for op in n.ops:
                ph = op.inputs[0].split(":")[0] if op.inputs else ""
                if op.type in stateful.WRITE_OPS and ph in self._state_of_ph:
                    self._state_writes.setdefault(self._state_of_ph[ph], []).append(
                        self._op_order[op.name])
        self.has_writes = any(op.type in stateful.WRITE_OPS for n in graph.nodes for op in n.ops)
        # stateful random ops (Keras 2's dropout, tf.random.uniform): drawn from a seed the
        # caller passes per step (:func:`_draw`); their names, for the error verify gives
        self.stateful_random = tuple(op.name for n in graph.nodes for op in n.ops
                                     if op.type in STATEFUL_RANDOM)
        # graph inputs by tensor name: the trace's placeholders for a whole model, any
        # tensors for a sub-graph (the pattern checker runs one GraphNode alone)
        self._input_names = tuple(t.name for t in graph.inputs)
        self._info = {t.name: t for n in graph.nodes for op in n.ops for t in op.outputs}
        self._check_plan()
        self.weight_layouts = self._weight_layouts()
        self.input_placements = self._boundary_placements(self._input_names)
        self.output_placements = self._output_placements()
        self.output_logits = tuple(self._logits_of(t.name) for t in graph.outputs)
        # per output: "Softmax"/"Sigmoid" when its local values carry ``_keras_logits``
        self.output_activations = tuple(self._tf_ops[a].type if a else None
                                        for a in self.output_logits)
        # global shape and dtype per output (the loss plan: tapas.execution.training.losses)
        self.output_shapes = tuple(tuple(t.shape) for t in graph.outputs)
        self.output_dtypes = tuple(t.dtype for t in graph.outputs)

    # ---- validation and layouts --------------------------------------------------------
    def _check_plan(self) -> None:
        if self.region is None:   # else checked on the source graph (__init__)
            self.plan.check_graph(self.graph)
        n_dev = self.num_devices
        for node in self.graph.nodes:
            pat = self.plan.pattern(node)
            label = f"GraphNode {node.id} '{node.name}' (pattern '{getattr(pat, 'name', '?')}')"
            if len(pat.inputs) != len(node.inputs) or len(pat.outputs) != len(node.outputs):
                raise ReconstructError(
                    f"{label}: the pattern places {len(pat.inputs)} input(s) and "
                    f"{len(pat.outputs)} output(s), the node has {len(node.inputs)} and "
                    f"{len(node.outputs)}: the plan was made for another graph")
            checks = [(t.name, t.shape, _place(p)) for t, p in zip(node.inputs, pat.inputs)]
            checks += [(t.name, t.shape, _place(p)) for t, p in zip(node.outputs, pat.outputs)]
            for w in node.weights:
                if w.path not in pat.weights:
                    raise ReconstructError(f"{label} has no placement for weight '{w.path}': "
                                           "every weight of the node needs one (R or S(axis))")
                checks.append((w.path, w.shape, _place(pat.weights[w.path])))
            for name, p in getattr(pat, "tensors", {}).items():
                info = self._info.get(name)
                if info is not None and info.dtype != "resource":  # a weight's handle
                    checks.append((name, info.shape, _place(p)))
            for name, shape, p in checks:
                if isinstance(p, Split):
                    if shape is None or p.axis >= len(shape):
                        raise ReconstructError(f"{label}: '{name}' of shape {shape} cannot be "
                                               f"split on axis {p.axis}")
                    if shape[p.axis] % n_dev:
                        raise ReconstructError(
                            f"{label}: dimension {p.axis} of '{name}' has size "
                            f"{shape[p.axis]}, not divisible by {n_dev} devices: choose a "
                            "pattern that splits another dimension, or another device count")
            for op_name, rule in getattr(pat, "rewrites", {}).items():
                if rule not in REWRITES:
                    raise ReconstructError(f"{label}: op '{op_name}' asks for rewrite "
                                           f"'{rule}', known rewrites are {list(REWRITES)}")

        trainable = {w.path: w.trainable for w in self.graph.weights}
        stateful.check_writes(self.graph.nodes, self._weight_of_ph, self._state_of_ph,
                              lambda path: trainable.get(path, False))

    def _weight_layouts(self) -> dict[str, WeightLayout]:
        """Each weight stored as its first reader (``Graph.readers``) wants it."""
        layouts: dict[str, WeightLayout] = {}
        readers = [(node, w) for node in self.graph.nodes for w in node.weights
                   if self.graph.reads(node.id, w.path)]
        listed = [(node, w) for node in self.graph.nodes for w in node.weights]
        for node, w in readers + listed:   # a weight no GraphNode reads: its first lister
            if w.path in layouts:
                continue
            p = _place(self.plan.pattern(node).weights[w.path])
            layouts[w.path] = WeightLayout(w.path, tuple(w.shape), w.dtype, p,
                                           p.local_shape(w.shape, self.num_devices),
                                           w.trainable)
            if self.region is not None and w.path in self.region.weights:
                # w is the row view (experts / rows): the global weight has them all
                whole = (w.shape[0] * self.expert_rows,) + tuple(w.shape[1:])
                layouts[w.path] = WeightLayout(w.path, whole, w.dtype, p,
                                               p.local_shape(w.shape, self.num_devices),
                                               w.trainable, 0, self.expert_rows)
        return layouts

    def _boundary_placements(self, names: Sequence[str]) -> tuple:
        out = []
        for name in names:
            found: Placement | None = None
            for node in self.graph.nodes:  # the producer's placement
                for k, t in enumerate(node.outputs):
                    if t.name == name:
                        found = _place(self.plan.pattern(node).outputs[k])
            for node in self.graph.nodes:  # else (a sub-graph input) the first consumer's
                for k, t in enumerate(node.inputs):
                    if found is None and t.name == name:
                        found = _place(self.plan.pattern(node).inputs[k])
            out.append(found if found is not None else Replica())
        return tuple(out)

    def _output_placements(self) -> tuple:
        return self._boundary_placements([t.name for t in self.graph.outputs])

    def _logits_of(self, name: str) -> str | None:
        """The name of the Softmax/Sigmoid op that makes the output ``name`` (through
        identities), or ``None``: its input is what Keras's crossentropy uses instead of the
        output (see ``LOGIT_ACTIVATIONS``)."""
        try:
            t = self.trace.graph.get_tensor_by_name(name)
        except (KeyError, ValueError):
            return None
        while t.op.type in _PASS_THROUGH and t.op.inputs:
            t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
        if t.op.type in LOGIT_ACTIVATIONS and t.op.name in self._tf_ops:
            return t.op.name
        return None

    def trace_weights(self) -> dict[str, list[Any]]:
        """The traced model's own variables, ``{path: [variable]}`` (single device), seed
        states included."""
        out = {self._weight_of_ph[ph]: [v] for ph, v in self.trace.variables.items()}
        out.update({self._state_of_ph[ph]: [v] for ph, v in self.trace.states.items()})
        return out

    def stored_placement(self, path: str) -> Placement:
        """How variable ``path`` lies across the devices: a weight as its layout says, a
        seed state replicated."""
        layout = self.weight_layouts.get(path)
        return layout.placement if layout is not None else Replica()

    # ---- the program --------------------------------------------------------------------
    def __call__(self, inputs: Sequence[Sequence[Any]], weights: Mapping[str, Sequence[Any]],
                 collectives: Collectives, writes: dict | None = None,
                 column: Collectives | None = None, seed: Any = None) -> list[list[tf.Tensor]]:
        """Run the program for the local replicas of ``collectives``.

        ``inputs[k][r]``: local part of trace input ``k`` on local replica ``r``;
        ``weights[path][r]``: local shard (tensor or variable), seed states included (a
        state missing there is read from the traced model's variable). Returns
        ``outputs[k][r]``; ``writes``, when given, receives the variable writes of a
        training-mode graph: ``{path: [new local value per replica]}`` in the stored
        placement (``stored_placement``), for the caller to assign. ``column``: the
        collectives over the replica's mesh column (its group of ``expert_rows`` devices),
        which a program with nested experts exchanges the expert region's tokens over.
        ``seed``: an integer scalar (the runtime's step number) that the graph's stateful
        random ops (:data:`STATEFUL_RANDOM`) draw from, the same on every replica; None: 0.
        """
        if collectives.num_devices != self.num_devices:
            raise ReconstructError(f"the plan is for {self.num_devices} devices but the "
                                   f"collectives span {collectives.num_devices}: build the "
                                   "program with a plan for this device count")
        if self.region is not None and (column is None
                                        or column.num_devices != self.expert_rows):
            raise ReconstructError(f"the program splits its experts over {self.expert_rows} "
                                   "mesh rows: call it with column= the collectives of the "
                                   "replica's mesh column")
        run = _Run(self, collectives, column, seed)
        outs = run.execute(inputs, weights)
        if writes is not None:
            writes.update(run.writes.values)
        return outs

    def source_info(self, name: str) -> ir.TensorInfo:
        """Tensor ``name`` with its single-device shape (``_info`` has the row view's shape
        inside an expert region)."""
        if self.region is not None and name in self.region.boundary:
            return self.region.boundary[name]
        return self._info[name]

    def values(self, inputs: Sequence[Sequence[Any]], weights: Mapping[str, Sequence[Any]],
               collectives: Collectives, names: Sequence[str],
               column: Collectives | None = None, seed: Any = None
               ) -> dict[str, list[tf.Tensor]]:
        """Like calling the program, but return the local values of the tensors ``names``
        (outputs of GraphNodes) instead of the graph outputs."""
        run = _Run(self, collectives, column, seed)
        run.execute(inputs, weights)
        missing = [n for n in names if n not in run.env]
        if missing:
            raise ReconstructError(f"tensors {missing[:3]} are no GraphNode outputs of "
                                   f"'{self.graph.name}'")
        return {n: run.env[n] for n in names}


class _Run:
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
        label = (f"GraphNode {node.id} '{node.name}' ({node.kind.value}, pattern "
                 f"'{getattr(pat, 'name', '?')}')")
        view: dict[str, list] = {}
        vplace: dict[str, Placement] = {}
        fwd: dict[str, list[placements.Comm]] = {}
        bwd: dict[str, list[placements.Comm]] = {}
        for c in getattr(pat, "comms", ()):
            (fwd if c.phase == "fwd" else bwd).setdefault(c.tensor, []).append(c)
        reads: dict[str, list[str]] = {}  # weight path or placeholder tensor -> reads
        # a later read of a trainable weight this GraphNode read already (ALBERT's one layer
        # applied twice) takes the first read's value, so the gradients of both add up
        # before the one backward collective the pattern has for the weight
        again: dict[str, str] = {}
        for op in node.ops:
            ph = op.inputs[0].split(":")[0] if op.inputs else ""
            if op.type == "ReadVariableOp" and ph in self.p._weight_of_ph:
                path = self.p._weight_of_ph[ph]
                first = reads.get(path, [None])[0]
                layout = self.p.weight_layouts.get(path)
                if first is not None and layout is not None and layout.trainable and \
                        first not in fwd and op.outputs[0].name not in fwd:
                    again[op.outputs[0].name] = first
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
            for c in bwd.pop(key, []):
                for nm in names:
                    bwd.setdefault(nm, []).append(c)
        into_region = self.p.region is not None and node.id in self.p.region.nodes
        for k, t in enumerate(node.inputs):
            want = _place(pat.inputs[k])
            view[t.name] = self._edge(t.name, want, into_region)
            vplace[t.name] = want
            self._apply_bwd(t.name, view, vplace, fwd, bwd)
        tensors = {name: _place(pl) for name, pl in getattr(pat, "tensors", {}).items()}
        rewrites = getattr(pat, "rewrites", {})
        for op in node.ops:
            if op.type == "Placeholder":
                name = op.outputs[0].name
                if name in self.env:  # a graph input
                    view[name], vplace[name] = self.env[name], self.place[name]
                elif op.name in self.p._constant_of_ph:  # captured from Python: a constant
                    value = tf.constant(self.p._constant_of_ph[op.name])
                    view[name], vplace[name] = self._conform(
                        [value] * self.n_local, None, tensors.get(name), op.outputs[0], label,
                        op)
                elif op.name not in self.p._weight_of_ph and \
                        op.name not in self.p._state_of_ph:
                    raise ReconstructError(f"{label}: placeholder '{op.name}' is neither a "
                                           "graph input, a model variable nor a captured "
                                           "constant")
                continue
            if op.type in stateful.WRITE_OPS:
                stateful.record_write(self, op, view, vplace, label)
                continue
            if op.outputs and op.outputs[0].name in again:
                first = again[op.outputs[0].name]
                view[op.outputs[0].name], vplace[op.outputs[0].name] = view[first], vplace[first]
                continue
            if not op.outputs:
                continue  # NoOp and other control-only ops
            handles = op.inputs[:1] if op.type in _RESOURCE_GATHERS else \
                op.inputs if op.type in _CALLS else ()
            for handle in handles:
                if handle not in view and handle.split(":")[0] in self.p._weight_of_ph:
                    view[handle], vplace[handle] = self._weight_value(handle, pat)
                    self._apply_bwd(handle, view, vplace, fwd, bwd)
            if op.name in self._want_logits and op.inputs[0] in view:
                self.logits[op.name] = (view[op.inputs[0]], vplace[op.inputs[0]])
            vals_per_out = self._make(op, node, pat, label, view, vplace, tensors, rewrites)
            for j, out in enumerate(op.outputs):
                vals, plc = vals_per_out[j]
                comms = fwd.get(out.name, [])
                pre = _place(comms[0].src) if comms else tensors.get(out.name)
                vals, plc = self._conform(vals, plc, pre, out, label, op)
                for c in comms:
                    if _place(c.src) != plc:
                        raise ReconstructError(
                            f"{label}: forward {c.kind.value} on '{out.name}' expects it "
                            f"placed {c.src}, the op yields {plc}")
                    partial_grad = any(b.kind == Collective.REDUCE_SCATTER
                                       for b in bwd.get(out.name, []))
                    vals = self.reshard(vals, plc, _place(c.dst), out.name, partial_grad)
                    plc = _place(c.dst)
                view[out.name], vplace[out.name] = vals, plc
                self._apply_bwd(out.name, view, vplace, fwd, bwd)
        for k, t in enumerate(node.outputs):
            want = _place(pat.outputs[k])
            if t.name not in view:
                raise ReconstructError(f"{label}: output '{t.name}' was not produced")
            if vplace[t.name] != want:
                raise ReconstructError(
                    f"{label}: output '{t.name}' ends placed {vplace[t.name]} but the "
                    f"pattern says {want}: the pattern lacks a collective")
            self.env[t.name], self.place[t.name] = view[t.name], want

    def _apply_bwd(self, name: str, view: dict, vplace: dict, fwd: dict, bwd: dict) -> None:
        for c in bwd.get(name, []):
            conj = []
            for f in fwd.get(name, []):
                conj += [b for b in placements.reshard(_place(f.src), _place(f.dst), f.shape, f.dtype,
                                                name) if b.phase == "bwd"]
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
                axis = c.axis if c.axis is not None else _place(c.src).axis
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
        want = _place(pat.weights[path])
        written = self.writes.read(path, want)
        return (written if written is not None else self._read_weight(path, want)), want

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
_LOWERINGS: Mapping[Rewrite, Callable[[_Run, ir.OpInfo, list, dict, str], list]] = {
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


# ---- one GraphNode alone (the pattern checker) --------------------------------------------
