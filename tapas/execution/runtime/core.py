"""Runtime: train and run a per-replica program under ``tf.distribute`` (paper 4.5).

In:  a *per-replica program* (``tapas.execution.program.reconstruct.Program``, or any object with the same
     protocol, below), a ``tf.distribute`` strategy over N devices
     (``tapas.execution.runtime.devices``), a Keras optimizer (``tapas.execution.training.keras_optimizer``)
     and a Keras loss.
Out: :class:`Runtime`, which holds every weight as per-device shards and runs training steps,
     ``predict``, checkpoints, and writes the global weights back into the Keras model; its
     methods come from the classes it mixes in (``step``, ``inference``, ``loss``,
     ``distribute``, ``replicas``, ``values``).
Raises ``ValueError`` when the program's device count, inputs or splits do not fit the
strategy's replicas or the input specs; :class:`StepError` when a training step fails.

The program protocol (``docs/sharding.md``; ``tapas.execution.program.reconstruct`` implements it)::

    program.num_devices                     # N
    program.weight_layouts                  # {path: layout: .placement .global_shape .trainable}
    program.input_placements                # one placement per model input (R or S(a))
    program.output_placements               # one placement per model output (R or S(a))
    program.output_shapes, .output_dtypes   # global shape and dtype per output (optional;
                                            # needed to train an output split on an axis)
    program.states, program.has_writes      # optional: seed states {placeholder: StateInfo},
                                            # whether the graph writes variables
    outs = program(inputs, weights, collectives[, writes])
        # inputs:  [[local tensor]] per model input;   weights: {path: [local value]}
        # (a tensor: the runtime reads each shard variable once and differentiates the values)
        # returns: [[local tensor]] per model output  (one local replica per strategy.run call)
        # writes:  a dict the program fills with {path: [new local value]} (training mode)

How it maps onto TensorFlow:

* Devices: N logical CPU devices (set once per process, ``devices.setup_devices``) or the GPUs
  present; ``MirroredStrategy`` over them, or ``MultiWorkerMirroredStrategy`` when ``TF_CONFIG``
  names several workers (``tapas.execution.runtime.devices.make_strategy``). The training code is
  the same for both.
* Weights: every replica holds its shard as a plain ``tf.Variable`` created under
  ``tf.device`` (not mirrored); the shards reach the replicas through
  ``strategy.experimental_distribute_values_from_function``. Optimizer slots are sharded
  like their weight.
* Traced once: when the strategy launches its collectives per device (MirroredStrategy and
  MultiWorkerMirroredStrategy with collective ops, as ``devices.make_strategy`` builds them),
  each replica body (the program, loss and gradients; the optimizer arithmetic) is traced a
  single time as a function of the replica id and the local tensors, with collectives as raw
  ops whose keys are fixed at trace time (``collectives.KeyedCollectives``), and every
  replica calls that function on its device. Otherwise it is traced in each replica.
* Training step, inside ``strategy.run``: forward through the program, the local loss,
  ``GradientTape`` backward, then the model's Keras optimizer's own ``update_step`` on the
  local shards, computed as values (``keras_optimizer.ShardedOptimizer``: Keras optimizers
  cannot assign non-mirrored variables inside ``strategy.run``).
* Loss semantics (Megatron's, not ``tf.distribute``'s sum of replica losses): the program has
  already inserted every collective, so the tape of replica i yields the local slice of
  dL/dW for the *global* loss L. For a replicated output each replica computes the full
  Keras loss L; for an output split on an axis the per-example loss keeps (batch, sequence),
  replica i computes its share ``sum(local per-example loss) / global count`` (the shares sum
  to L); for an output split on its last axis (class logits) the runtime all-gathers it first,
  with a gradient that is the local slice (recorded in the audit as phase ``"loss"``).
  Gradients are never aggregated a second time. Several outputs: each output's loss on
  its placement, times Keras's loss weight, summed (``compiled_loss.outputs_loss``); the
  model's weight regularizers are added on the shards, counted once
  (``regularizers.regularized``).
* A step is all-or-nothing: new weights and slots are computed on every replica first; the
  assignments run only after every replica's results exist and the global loss is finite. A
  failed step raises :class:`StepError` and leaves weights, slots and the step counter as
  they were.
* Training mode (a graph captured with ``training=True``): the program reads dropout's seed
  from the runtime's replicated copy of each Keras ``SeedGenerator`` state
  (``stateful.StateStore``) and returns its variable writes (the advanced seed, batch
  norm's moving statistics: ``tapas.execution.program.stateful``); they are assigned with the
  weights after the step (all or nothing). ``evaluate`` and ``predict`` run the same graph
  and assign its writes too, as a Keras call with ``training=True`` does.
* Checkpoints: ``tf.train.Checkpoint`` of the shards, slots and step counter, one file per
  process, plus ``tapas-checkpoint.json`` with the layout. Restoring into the same layout reads
  the shards directly; into another device count or layout, each weight is reassembled from
  its old shards and cut again (:meth:`Runtime.restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.runtime import shards
from tapas.execution.runtime.devices import claim_collective_keys, local_replica_ids, task_id
from tapas.execution.program import replay, stateful
from tapas.execution.runtime.distribute import InputDistribution
from tapas.execution.runtime.inference import Inference
from tapas.execution.runtime.loss import LossPlanning
from tapas.execution.runtime.replicas import ReplicaCalls
from tapas.execution.runtime.step import TrainingStep
from tapas.execution.runtime.values import GlobalValues
from tapas.execution.training import losses, regularizers, step_reductions as reductions
from tapas.planning.devicemesh import Mesh
from tapas.sharding.placements import Replica

__all__ = ["Runtime"]


def _runtime_mesh(mesh: Any, rows: int | None, cols: int) -> Mesh:
    """The runtime's mesh: ``mesh`` (parsed from ``"RxC"``), else ``rows`` x ``cols``
    (``mesh_rows``, the keyword before meshes were objects); refused when they disagree."""
    if mesh is None:
        return Mesh(1 if rows is None else int(rows), cols)
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
    if (rows is not None and rows != mesh.rows) or mesh.cols != cols:
        raise ValueError(f"mesh {mesh} does not match mesh_rows={rows} and the program's "
                         f"{cols} devices per row: give the mesh alone, with cols = {cols}")
    return mesh


class Runtime(TrainingStep, Inference, LossPlanning, InputDistribution, ReplicaCalls,
              GlobalValues):
    """Shards, training step, ``predict`` and checkpoints of one program under one strategy.

    ``initial_weights`` maps every weight path of ``program.weight_layouts`` to its global
    value (NumPy); ``input_specs`` are the ``tf.TensorSpec`` s of the program's inputs.
    ``collectives(function)`` makes the program's collectives object inside a replica while
    ``function`` ("train_step", "predict", "evaluate") is traced (default:
    ``tapas.execution.program.reconstruct.ReplicaContextCollectives`` recording into ``audits[function]``).

    ``mesh`` (a ``tapas.planning.devicemesh.Mesh`` or ``"RxC"``; default ``1 x N``, the
    program's devices; ``mesh_rows=R`` is read as an ``R x N`` mesh) with rows > 1 runs a 2-D
    mesh (``tapas.planning.mesh``): the strategy's replicas form its rows of
    ``program.num_devices`` = cols devices (replica r is row r // cols,
    column r % cols); each row runs the program on its share of the batch (axis 0 of every
    input and target cut into the rows; ``input_specs`` are one row's), with its collectives
    over the row's devices, and every trainable weight's gradient is all-reduced over the
    column (data parallelism across the rows). ``num_devices`` stays the program's (a row's)
    device count; ``num_replicas`` is the strategy's.
    """

    # several outputs (compiled_loss.output_losses, set by parallelize): a loss per output,
    # Keras's loss weights, the output names; None: ``loss`` for the one output
    output_losses: list | None = None
    loss_weights: list | None = None
    output_names: list | None = None

    # the model's weight regularizers (tapas.execution.training.regularizers.plan_regularizers)
    regularization: list = []

    # whether the training step and forward_loss also return the global outputs, targets
    # and sample weights (``step_values``: what metrics are computed from); set_step_values
    keep_step_values = False
    step_values: tuple | None = None

    def __init__(self, program: Any, strategy: tf.distribute.Strategy,
                 initial_weights: Mapping[str, np.ndarray], input_specs: Sequence[tf.TensorSpec],
                 *, optimizer: Any = "sgd", loss: Any = None,
                 collectives: Callable[[str], Any] | None = None, mesh: Any = None,
                 mesh_rows: int | None = None,
                 graph_optimization: str = "lean", learning_rate: float | None = None,
                 keras_variables: Mapping[str, Any] | None = None) -> None:
        self.graph_optimization = replay.check_graph_optimization(graph_optimization)
        # Grappler keeps the layout and memory optimizers for accelerators (replay)
        self._accelerators = any("CPU" not in d.upper().rsplit("/", 1)[-1]
                                 for d in strategy.extended.worker_devices)
        self.program, self.strategy = program, strategy
        self.num_replicas = int(strategy.num_replicas_in_sync)
        self.num_devices = int(program.num_devices)
        self.mesh = _runtime_mesh(mesh, mesh_rows, self.num_devices)
        self.rows = self.mesh.rows
        if self.rows < 1 or self.num_devices * self.rows != self.num_replicas:
            raise ValueError(f"the program was built for {program.num_devices} devices"
                             + (f" per row of a {self.rows}-row mesh" if self.rows > 1 else "")
                             + f" but the strategy has {self.num_replicas} replicas; rebuild "
                             "one of them so that the device counts match")
        claim_collective_keys(strategy)
        self.loss = loss
        self.audits: dict[str, Any] = {}
        self.dp_audits: dict[str, Any] = {}   # the mesh columns' gradient all-reduces
        self._tracing = ""
        self._collectives = collectives or self._default_collectives
        self.row_specs = list(input_specs)
        self.input_specs = [self._global_spec(s) for s in self.row_specs]
        self.input_placements = list(program.input_placements)
        self.output_placements, self.call_loss_placements = regularizers.split_outputs(program)
        if len(self.input_placements) != len(self.input_specs):
            raise ValueError(f"the program has {len(self.input_placements)} inputs but "
                             f"{len(self.input_specs)} input specs were given")
        for spec, p in zip(self.row_specs, self.input_placements):
            self._check_divisible(f"input '{spec.name}'", tuple(spec.shape), p)
        self.local_replicas = local_replica_ids(strategy)
        self.task_id = task_id(strategy)
        devices = list(strategy.extended.worker_devices)
        self._device = dict(zip(self.local_replicas, devices))
        # the layouts (with the values' dtypes) and each local replica's shards, one
        # weight's global value at a time (tapas.execution.runtime.shards)
        self.specs, self._vars = shards.make_shards(self, initial_weights)
        self.paths = list(self.specs)
        self.trainable_paths = [p for p in self.paths if self.specs[p].trainable]
        self.optimizer = reductions.make_optimizer(self, optimizer, learning_rate,
                                                   keras_variables or {})
        self._init_optimizer_state(devices[0])
        self.states = stateful.StateStore(getattr(program, "states", {}), strategy,
                                          {r: self._device[r] for r in self.local_replicas})
        self._mesh_keys = self._claim_mesh_keys() if self.rows > 1 else None
        self._dist_vars = strategy.experimental_distribute_values_from_function(
            lambda ctx: self._vars[ctx.replica_id_in_sync_group])
        self._dist_slots = strategy.experimental_distribute_values_from_function(
            lambda ctx: self._slots[ctx.replica_id_in_sync_group])
        # autograph off: the replayed program has no Python control flow on tensors, and
        # converting every function it calls doubled the first step's tracing time
        # (t5-tiny, 2 devices: 125 s -> 70 s on a loaded 2-core machine, same losses)
        self._train_fn = tf.function(self._train_step, autograph=False)
        self._predict_fn = tf.function(self._predict, autograph=False)
        self.trace_seconds: dict[str, float] = {}
        self.graphs: dict[str, tf.Graph] = {}   # traced functions' graphs, by function
        # collectives the runtime adds for the loss: (function, kind, global bytes)
        self.loss_comms: list[tuple[str, str, int]] = []
        self.loss_plan: losses.LossPlan | None = None   # set for each batch's targets
        self.weight_placement: Any = Replica()           # and its sample weights

    def _init_optimizer_state(self, first_device: str) -> None:
        """The optimizer slots of every local replica's shards; on the first device the
        step counter, the learning rate (a variable, so that a callback changes it without
        tracing again; float32 as Keras's) and the optimizer's own replicated variables
        (Nadam's u_product, the loss scale and its counter), by name."""
        self._slots = shards.make_slots(self)   # one weight's initial values at a time
        with tf.device(first_device):
            self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations")
            self.opt_state = {k: tf.Variable(v, trainable=False, name=f"opt_{k}")
                              for k, v in self.optimizer.initial_state().items()}
            self.learning_rate = tf.Variable(float(self.optimizer.learning_rate),
                                             dtype=tf.float32, trainable=False,
                                             name="learning_rate")

    def sharing(self, program: Any, input_specs: Sequence[tf.TensorSpec]) -> Runtime:
        """A runtime that runs another program of the same model (e.g. its inference-mode
        graph) on *this* runtime's weights (``shards.share``)."""
        return shards.share(self, program, input_specs)

    def refresh(self) -> None:
        """Re-cut the ``resynced`` weights from the source runtime's current values (a
        runtime made by :meth:`sharing`; every worker must call it: it gathers)."""
        source = getattr(self, "source", None)
        if source is None or not self.resynced:
            return
        values = source._global(source._vars, self.resynced)
        for r in self.local_replicas:
            for p in self.resynced:
                self._vars[r][p].assign(self._cut(self.specs[p], values[p], r))
