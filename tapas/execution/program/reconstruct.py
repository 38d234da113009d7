"""Reconstruction: a captured graph and a sharding plan become a per-replica TF program.

In:  a :class:`tapas.capturing.Trace` (the traced ``tf.Graph`` and the variables its
     resource placeholders stand for), its :class:`tapas.ir.Graph`, and a :class:`Plan`:
     the ShardingPattern of every GraphNode on N devices (docs/sharding.md), from a
     ``Strategy`` (:meth:`Plan.from_strategy`) or written by hand (:class:`NodeSharding`).
Out: :class:`Program`, a callable that replays the captured ops one by one in the current
     ``tf.function``, with *local* shapes, on local input and weight shards, and inserts
     the collectives the plan asks for through a
     :class:`tapas.execution.program.collectives.Collectives`.

How each op is re-created:

* graph-input placeholders take the caller's local inputs; ``ReadVariableOp`` of a model
  weight takes the caller's local shard (a variable is read with ``read_value``, so tapes
  watch it);
* every other op is replayed with its original type and attributes
  (``tapas.execution.program.replay.replay_op``) on the local inputs; shapes are
  re-inferred. Ops whose
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

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from tapas import ir
from tapas.execution.program import stateful
# the plan types stay importable from here (reconstruct.Plan, .NodeSharding, ...)
from tapas.execution.program.collectives import (Audit, Collectives, CommRecord,
                                                 ReplicaContextCollectives,
                                                 SimulatedCollectives)
from tapas.execution.program.local_ops import STATEFUL_RANDOM
from tapas.execution.program.plan import NodeSharding, Plan, ReconstructError, WeightLayout
from tapas.execution.program.run import Run
from tapas.sharding.patterns import Rewrite
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["NodeSharding", "Plan", "Program", "WeightLayout", "ReconstructError", "Audit",
           "CommRecord", "SimulatedCollectives", "ReplicaContextCollectives", "REWRITES",
           "STATEFUL_RANDOM"]

# local programs that differ from "the same op on local shapes" (named by the patterns,
# tapas.sharding.patterns.Rewrite); each has its lowering in ``local_ops._LOWERINGS``:
#   vocab-gather  GatherV2 from a row-split table (``LocalOps._vocab_gather``); result P
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
            checks = [(t.name, t.shape, p) for t, p in zip(node.inputs, pat.inputs)]
            checks += [(t.name, t.shape, p) for t, p in zip(node.outputs, pat.outputs)]
            for w in node.weights:
                if w.path not in pat.weights:
                    raise ReconstructError(f"{label} has no placement for weight '{w.path}': "
                                           "every weight of the node needs one (R or S(axis))")
                checks.append((w.path, w.shape, pat.weights[w.path]))
            for name, p in getattr(pat, "tensors", {}).items():
                info = self._info.get(name)
                if info is not None and info.dtype != "resource":  # a weight's handle
                    checks.append((name, info.shape, p))
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
            p = self.plan.pattern(node).weights[w.path]
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
                        found = self.plan.pattern(node).outputs[k]
            for node in self.graph.nodes:  # else (a sub-graph input) the first consumer's
                for k, t in enumerate(node.inputs):
                    if found is None and t.name == name:
                        found = self.plan.pattern(node).inputs[k]
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
        run = Run(self, collectives, column, seed)
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
        run = Run(self, collectives, column, seed)
        run.execute(inputs, weights)
        missing = [n for n in names if n not in run.env]
        if missing:
            raise ReconstructError(f"tensors {missing[:3]} are no GraphNode outputs of "
                                   f"'{self.graph.name}'")
        return {n: run.env[n] for n in names}
