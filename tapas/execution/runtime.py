"""Runtime: train and run a per-replica program under ``tf.distribute`` (paper 4.5).

In:  a *per-replica program* (``tapas.execution.program.reconstruct.Program``, or any object with the same
     protocol, below), a ``tf.distribute`` strategy over N devices
     (``tapas.execution.devices``), a Keras optimizer (``tapas.execution.training.keras_optimizer``)
     and a Keras loss.
Out: :class:`Runtime`, which holds every weight as per-device shards and runs training steps,
     ``predict``, checkpoints, and writes the global weights back into the Keras model.

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
  names several workers (``tapas.execution.devices.make_strategy``). The training code is
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

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.capturing.tracing import weights_by_path
from tapas.execution import checkpoints, shards
from tapas.execution.program import replay, stateful
from tapas.execution.program.collectives import (Audit, KeyedCollectives, KeyedGroup,
                                                 ReplicaContextCollectives)
from tapas.execution.training import (compiled_loss, gathering, loss_collectives, losses,
                                      regularizers, step_outputs, step_reductions as reductions)
from tapas.execution.devices import claim_collective_keys, local_replica_ids, task_id
from tapas.execution.program.plan import WeightLayout
from tapas.sharding.placements import Partial, Replica, Split, parse_placement

__all__ = ["Runtime", "StepError"]

# Keras loss reductions the runtime reproduces (no sample weights): a sum, or a sum / count
_REDUCTIONS = frozenset({"sum", "sum_over_batch_size", "mean", "mean_with_sample_weight"})
# the output activations whose logits a program hands to the loss (tapas.execution.program.reconstruct:
# LOGIT_ACTIVATIONS), recomputed after the logits are gathered for the loss
_ACTIVATIONS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "Softmax": tf.nn.softmax, "Sigmoid": tf.math.sigmoid}


class StepError(RuntimeError):
    """A training step failed; weights, optimizer slots and the step counter are unchanged."""


def _placed(x: tf.Tensor) -> tf.Tensor:
    """``x`` with a device: a tensor created under no device scope (MultiWorkerMirrored's
    replica function opens none) is refused by its collectives ("destinations can not be
    empty"); the current device scope (``Runtime._on_device``) places the copy."""
    if getattr(x, "device", "x"):
        return x
    return tf.identity(x)


# ---- placements --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Replica:
    """What a replica program body sees besides its tensors: the program's collectives
    (``coll``), collectives for values nothing differentiates (``values``: the loss, outputs
    and gradients gathered to be read), the replica id (an int, or a tensor when the body is
    traced once for every replica) and whether this trace records the loss's collectives."""

    coll: Any
    values: Any
    rid: int | tf.Tensor
    records: bool
    dp: Any = None    # collectives over the replica's mesh column (rows > 1), else None
    notes: dict = dataclasses.field(default_factory=dict, compare=False)   # step values


def _read(args: Any) -> Any:
    """``args`` with every variable read (a replica program body takes tensors only). A
    plain resource read: ``Variable.read_value`` adds an identity and several Python layers
    per read, and the step reads every weight and slot on every replica (t5-small on 4
    devices: 1,572 reads while the first step is traced)."""
    return tf.nest.map_structure(
        lambda a: tf.raw_ops.ReadVariableOp(resource=a.handle, dtype=a.dtype)
        if isinstance(a, tf.Variable) else a, args)


def _spec(a: Any) -> Any:
    """The ``tf.TensorSpec`` of a tensor or variable (other values are kept)."""
    if isinstance(a, (tf.Tensor, tf.Variable)):
        return tf.TensorSpec(a.shape, a.dtype)
    return a


def _axis(placement: Any) -> int | None:
    p = parse_placement(placement)
    if isinstance(p, Partial):
        raise ValueError("a weight, input or output cannot be placed P (partial sums): "
                         "patterns reduce their partial sums inside the node")
    return p.axis if isinstance(p, Split) else None


# ---- the runtime ------------------------------------------------------------------------------

class Runtime:
    """Shards, training step, ``predict`` and checkpoints of one program under one strategy.

    ``initial_weights`` maps every weight path of ``program.weight_layouts`` to its global
    value (NumPy); ``input_specs`` are the ``tf.TensorSpec`` s of the program's inputs.
    ``collectives(function)`` makes the program's collectives object inside a replica while
    ``function`` ("train_step", "predict", "evaluate") is traced (default:
    ``tapas.execution.program.reconstruct.ReplicaContextCollectives`` recording into ``audits[function]``).

    ``mesh_rows`` > 1 runs a 2-D mesh (``tapas.planning.mesh``): the strategy's replicas form
    ``mesh_rows`` rows of ``program.num_devices`` devices (replica r is row r // cols,
    column r % cols); each row runs the program on its share of the batch (axis 0 of every
    input and target cut into the rows; ``input_specs`` are one row's), with its collectives
    over the row's devices, and every trainable weight's gradient is all-reduced over the
    column (data parallelism across the rows). ``num_devices`` stays the program's (a row's)
    device count; ``num_replicas`` is the strategy's.
    """

    def __init__(self, program: Any, strategy: tf.distribute.Strategy,
                 initial_weights: Mapping[str, np.ndarray], input_specs: Sequence[tf.TensorSpec],
                 *, optimizer: Any = "sgd", loss: Any = None,
                 collectives: Callable[[str], Any] | None = None, mesh_rows: int = 1,
                 graph_optimization: str = "lean", learning_rate: float | None = None,
                 keras_variables: Mapping[str, Any] | None = None) -> None:
        self.graph_optimization = replay.check_graph_optimization(graph_optimization)
        # Grappler keeps the layout and memory optimizers for accelerators (replay)
        self._accelerators = any("CPU" not in d.upper().rsplit("/", 1)[-1]
                                 for d in strategy.extended.worker_devices)
        self.program, self.strategy = program, strategy
        self.num_replicas = int(strategy.num_replicas_in_sync)
        self.num_devices = int(program.num_devices)
        self.rows = int(mesh_rows)
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
        self.input_placements = [parse_placement(p) for p in program.input_placements]
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
        # weight's global value at a time (tapas.execution.shards)
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
        values = {p: self.optimizer.initial_slots(p) for p in self.trainable_paths}
        self._slots: dict[int, dict[str, dict[str, tf.Variable]]] = {}
        for r in self.local_replicas:
            with tf.device(self._device[r]):
                self._slots[r] = {p: {name: tf.Variable(v, trainable=False,
                                                        name=f"{name}{k}_r{r}")
                                      for name, v in values[p].items()}
                                  for k, p in enumerate(self.trainable_paths)}
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

    # -- building blocks ------------------------------------------------------------------

    def _j(self, replica: int) -> int:
        """The shard index (mesh column) of a replica."""
        return replica % self.num_devices

    def _cut(self, spec: WeightLayout, value: np.ndarray, replica: int) -> np.ndarray:
        """Replica ``replica``'s part of the global ``value`` (``shards.cut``)."""
        return shards.cut(self, spec, value, replica)

    def _global_spec(self, spec: tf.TensorSpec) -> tf.TensorSpec:
        """A row's input spec as the global one: axis 0 (the batch) times the rows."""
        if self.rows == 1:
            return spec
        shape = spec.shape.as_list()
        if not shape or shape[0] is None:
            raise ValueError(f"input '{spec.name}' has shape {shape}: a mesh with rows cuts "
                             "axis 0 (the batch), which must be static")
        return tf.TensorSpec([shape[0] * self.rows] + shape[1:], spec.dtype, name=spec.name)

    def _claim_mesh_keys(self) -> dict[str, Any]:
        """Collective group keys for the mesh's rows and columns, taken from the strategy's
        own group-key counter (so no other group of this strategy uses them; every worker
        takes them at the same point, so they agree), and a counter for their instance keys
        (one for the runtime: no two collectives of its functions share a key)."""
        launchers = self._launchers()
        if launchers is None:
            raise ValueError("a mesh with rows needs a strategy that launches collectives per "
                             "device (MirroredStrategy or MultiWorkerMirroredStrategy with "
                             "collective ops: tapas.execution.devices.make_strategy)")
        counter = launchers[0]._collective_keys
        with counter._lock:
            base = counter._group_key
            counter._group_key += self.rows + self.num_devices
        return {"rows": [base + i for i in range(self.rows)],
                "cols": [base + self.rows + j for j in range(self.num_devices)],
                "instance": itertools.count(100)}

    def _check_divisible(self, what: str, shape: tuple[int, ...], placement: Any) -> None:
        axis = _axis(placement)
        if axis is None:
            return
        if axis >= len(shape) or shape[axis] % self.num_devices:
            size = shape[axis] if axis < len(shape) else "missing"
            raise ValueError(f"{what}: placement S{axis} splits dimension {axis} (size {size}, "
                             f"shape {list(shape)}) into {self.num_devices} devices, which does "
                             "not divide; choose a strategy for this device count or another "
                             "device count")

    def _default_collectives(self, function: str) -> Any:
        from tapas.execution.program import reconstruct
        if function not in self.audits:
            self.audits[function] = reconstruct.Audit()
        return reconstruct.ReplicaContextCollectives(audit=self.audits[function])

    def _distribute(self, arrays: Sequence[np.ndarray], placements: Sequence[Any],
                    worker_share: bool = False) -> Any:
        """Per-replica values of ``arrays``: global arrays, or with ``worker_share`` this
        worker's shares of them (:meth:`worker_share`), cut among its local replicas."""
        arrays = [np.asarray(a) for a in arrays]
        cut = worker_share and not self._all_local()
        if self.rows > 1:   # axis 0 into the rows (this worker's rows), then as placed
            cols = self.num_devices
            first_row = self.local_replicas[0] // cols if cut else 0
            n_rows = len(self.local_replicas) // cols if cut else self.rows

            def row_fn(ctx: tf.distribute.experimental.ValueContext) -> tuple[tf.Tensor, ...]:
                r = ctx.replica_id_in_sync_group
                i, j = divmod(r, cols)
                with tf.device(self._device[r]):
                    return tuple(tf.constant(p.shard(Split(0).shard(a, n_rows, i - first_row),
                                                     cols, j))
                                 for a, p in zip(arrays, placements))

            return self.strategy.experimental_distribute_values_from_function(row_fn)
        n = len(self.local_replicas) if cut else self.num_devices
        first = self.local_replicas[0] if cut else 0

        def value_fn(ctx: tf.distribute.experimental.ValueContext) -> tuple[tf.Tensor, ...]:
            r = ctx.replica_id_in_sync_group
            with tf.device(self._device[r]):
                return tuple(tf.constant(p.shard(a, n, r - first))
                             for a, p in zip(arrays, placements))

        return self.strategy.experimental_distribute_values_from_function(value_fn)

    def worker_share(self, placement: Any, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """The part of a global tensor of ``shape`` placed ``placement`` that this worker's
        replicas read: ``(axis, start, stop)`` along the split axis, or None for the whole
        tensor (a replicated tensor, or every replica in this process). The replicas of a
        worker are consecutive (``devices.local_replica_ids``), so the share is one
        contiguous slab: what a worker's input pipeline has to produce."""
        placement = parse_placement(placement)
        if self._all_local():
            return None
        if self.rows > 1:   # the rows of this worker, along axis 0
            if self._local_row() is None or len(self.local_replicas) % self.num_devices:
                raise ValueError("this worker holds no whole rows of the mesh: put each row's "
                                 "devices in one worker")
            step = int(shape[0]) // self.rows
            first = self.local_replicas[0] // self.num_devices
            return (0, first * step, (first + len(self.local_replicas) // self.num_devices)
                    * step)
        if not isinstance(placement, Split):
            return None
        size = int(shape[placement.axis])
        self._check_divisible("a worker's share", tuple(shape), placement)
        step = size // self.num_devices
        return (placement.axis, self.local_replicas[0] * step,
                (self.local_replicas[-1] + 1) * step)

    def _check_inputs(self, xs: Sequence[Any], worker_share: bool = False) -> list[np.ndarray]:
        if not isinstance(xs, (list, tuple)):
            xs = [xs]
        if len(xs) != len(self.input_specs):
            names = ", ".join(f"'{s.name or k}'" for k, s in enumerate(self.input_specs))
            raise ValueError(f"got {len(xs)} inputs, the program takes {len(self.input_specs)} "
                             f"({names}): pass one array per input in this order (a "
                             "ParallelModel also takes a dict keyed by input name)")
        out = []
        for x, spec, p in zip(xs, self.input_specs, self.input_placements):
            x = np.asarray(x)
            shape = list(spec.shape.as_list())
            share = self.worker_share(p, shape) if worker_share else None
            if share is not None:
                shape[share[0]] = share[2] - share[1]
            if list(x.shape) != shape:
                what = (f"this worker's share {shape} of the global shape "
                        f"{spec.shape.as_list()} (placed {p}; Runtime.worker_share)"
                        if share is not None else
                        f"{shape} (global shape; capture again for another batch size)")
                raise ValueError(f"input '{spec.name}' has shape {list(x.shape)}, the program "
                                 f"was built for {what}")
            out.append(x.astype(spec.dtype.as_numpy_dtype, copy=False))
        return out

    def target_placement(self, y_ndim: int) -> Any:
        """How the targets (of rank ``y_ndim``) are placed for the loss: R, or S(axis) when
        the loss is computed on an output split on a batch or sequence axis."""
        plan = self._loss_plan(np.zeros((0,) * y_ndim))
        return Replica() if plan.target_axis is None else Split(plan.target_axis)

    # several outputs (compiled_loss.output_losses, set by parallelize): a loss per output,
    # Keras's loss weights, the output names; None: ``loss`` for the one output
    output_losses: list | None = None
    loss_weights: list | None = None
    output_names: list | None = None

    def _loss_of(self, k: int) -> Any:
        return self.loss if self.output_losses is None else self.output_losses[k]

    def _loss_plan(self, y: np.ndarray, k: int = 0) -> losses.LossPlan:
        """How the loss of output ``k`` is computed for targets ``y`` (module losses)."""
        p = self.output_placements[k]
        shapes = getattr(self.program, "output_shapes", None)
        if not shapes and isinstance(p, Split):
            raise ValueError(f"the program's output is placed {p} but the program has no "
                             "output_shapes: give it the global output shapes (and "
                             "output_dtypes) so that the runtime can plan the loss")
        shape = tuple(shapes[k]) if shapes else ()
        dtype = (getattr(self.program, "output_dtypes", None) or ("float32",) * (k + 1))[k]
        activation = (getattr(self.program, "output_activations", None) or (None,) * (k + 1))[k]
        return losses.plan_loss(self._loss_of(k), p, shape, dtype, y.ndim, self.num_devices,
                                activation)

    def _local_loss(self, r: _Replica, out: tf.Tensor, target: Any,
                    k: int = 0) -> tuple[tf.Tensor, bool]:
        """(this replica's share of the global loss of output ``k``, whether shares must
        be summed).

        ``target``: the local targets, or ``(targets, sample weights)`` (Keras's
        weighting: the per-example values times the weights; the mean over the values, or
        over the weights' global sum for ``mean_with_sample_weight``).

        The reduction is done here, not by ``Loss.__call__``: inside a replica context Keras
        divides the loss by the number of replicas (tf.distribute's sum-of-replica-losses
        convention), which is not this runtime's convention.
        """
        y, weight = target if isinstance(target, tuple) else (target, None)
        p = self.output_placements[k]
        plan, loss_fn = self._plans()[k], self._loss_of(k)
        activation = (getattr(self.program, "output_activations", None) or (None,) * (k + 1))[k]
        logits = getattr(out, "_keras_logits", None)
        if activation in _ACTIVATIONS and logits is None:
            raise ValueError(
                f"the model output is a {activation} of logits that this plan places unlike "
                f"the output (placed {p}): a Keras crossentropy computes from those logits, "
                "so the runtime cannot train this plan (predict works); choose a pattern for "
                "the last GraphNode without a collective after the activation, e.g. the "
                "searched one or 'replicate'")
        if plan.method == "vocab-parallel":
            per_example = loss_collectives.vocab_parallel(self, r, out, y, loss_fn)
        else:
            if plan.method == "gather":
                if logits is None:
                    out = loss_collectives.gather_for_loss(self, r, out, p.axis)
                else:  # Keras's crossentropy reads the logits: gather those, not the output
                    logits = loss_collectives.gather_for_loss(self, r, logits, p.axis)
                    out = _ACTIVATIONS[activation](logits)
                    out._keras_logits = logits
            per_example = loss_fn.call(y, losses.as_loss_dtype(out, loss_fn))
        total = tf.cast(tf.size(per_example), per_example.dtype)
        if plan.partial:
            total = total * self.num_devices
        if weight is not None:   # Keras: the values times the weights, expanded to their rank
            w = tf.cast(weight, per_example.dtype)
            if loss_fn.reduction == "mean_with_sample_weight":   # over the weights' sum
                total = tf.reduce_sum(w)
                if isinstance(self._weight_placements()[k], Split):   # each on one replica
                    total = loss_collectives.all_reduce(self, r, total)
            w = tf.reshape(w, w.shape.as_list() + [1] * (per_example.shape.rank - w.shape.rank))
            per_example = per_example * w
        if r.dp is not None:   # a mesh row's share of the global loss (the rows add up to it)
            if weight is not None and loss_fn.reduction == "mean_with_sample_weight":
                total = r.dp.sum_value(total)     # the weights' global sum
            else:
                total = total * self.rows         # equal rows: the global count
        loss = tf.reduce_sum(per_example)
        if loss_fn.reduction != "sum":
            loss = tf.math.divide_no_nan(loss, tf.cast(total, loss.dtype))
        return loss, plan.partial

    def _plans(self) -> list:
        return getattr(self, "loss_plans", None) or [self.loss_plan]

    def _weight_placements(self) -> list:
        return getattr(self, "weight_placements", None) or [self.weight_placement]

    def _forward(self, r: _Replica, xs: Sequence[tf.Tensor], weights: Mapping[str, tf.Tensor],
                 states: Mapping[str, tf.Tensor], call_losses: list | None = None
                 ) -> tuple[list, dict]:
        """(local model outputs, {path: new local value} the program writes: training
        mode); the local values of the losses the call adds go to ``call_losses``."""
        local = {p: [weights[p]] for p in self.paths}
        local.update({p: [v] for p, v in states.items()})
        extra: dict[str, Any] = {}
        if getattr(self.program, "region", None) is not None:
            extra["column"] = r.dp   # nested experts: tokens exchanged over the mesh column
        if getattr(self.program, "stateful_random", ()):
            extra["seed"] = self.iterations   # Keras 2's dropout: a new draw each step, the
            # same draw on every replica
        writes: dict[str, list] = {}
        outs = [o[0] for o in self.program([[x] for x in xs], local, r.coll, *(
            [writes] if getattr(self.program, "has_writes", False) else []), **extra)]
        n = len(self.output_placements)
        (call_losses if call_losses is not None else []).extend(outs[n:])
        return outs[:n], {p: v[0] for p, v in writes.items()}

    def _on_device(self, fn: Callable) -> Callable:
        """``fn`` run under its replica's device scope: MultiWorkerMirroredStrategy opens none
        around the replica function, and its all-reduce (forward, and in the backward pass
        the tape runs) needs tensors placed on a device."""
        def wrapped(*args: Any) -> Any:
            ctx = tf.distribute.get_replica_context()
            rid = tf.get_static_value(ctx.replica_id_in_sync_group)
            device = self._device.get(int(rid) if rid is not None else -1,
                                      self._device[self.local_replicas[0]])
            with tf.device(device):
                # the tf.function's input placeholders have no device under MWMS either
                args = tf.nest.map_structure(
                    lambda a: _placed(a) if isinstance(a, tf.Tensor) else a, args)
                return fn(*args)
        return wrapped

    # -- one program body, every replica ----------------------------------------------------

    def _launchers(self) -> list | None:
        """The strategy's per-device ``CollectiveReplicaLauncher`` s when the replica bodies
        can be traced once (:meth:`_replicas`), else None: a custom ``collectives``
        factory, a strategy whose collectives are not launched per device
        (``MirroredStrategy`` with ``NcclAllReduce`` or another ``cross_device_ops``), or
        one device (nothing to launch)."""
        if self._collectives != self._default_collectives or self.num_replicas < 2:
            return None
        launchers = getattr(getattr(self.strategy.extended, "_cross_device_ops", None),
                            "_launchers", None)
        if not launchers or len(launchers) != len(self.local_replicas):
            return None
        return list(launchers)

    def _keyed_group(self, launchers: list) -> KeyedGroup:
        """The strategy's collective group, for :class:`KeyedCollectives`: each instance key
        is taken from the strategy's own counter for *every* local device at once (the
        counters advance in step: every device runs the same collectives), so keys fixed
        at trace time never meet the ones the strategy hands out when a step is called."""
        first = launchers[0]
        counter = first._collective_keys

        def next_key() -> int:
            keys = {counter.get_instance_key(lc._group_key, lc._device) for lc in launchers}
            if len(keys) != 1:
                raise RuntimeError(f"the devices' collective instance keys differ ({sorted(keys)}):"
                                   " a collective ran on some devices only; build a new "
                                   "strategy (tapas.execution.devices.make_strategy)")
            return keys.pop()

        options = first._options
        return KeyedGroup(int(first._group_key), int(first._group_size),
                          options.implementation.value, float(options.timeout_seconds or 0),
                          next_key)

    def _replicas(self, body: Callable, args: tuple,
                  finish: Callable | None = None) -> Any:
        """``strategy.run`` of ``body(r, *tensors)`` on every replica, where ``r`` is the
        replica's :class:`_Replica` and the tensors are the replica's local values of
        ``args`` with every variable read; then, in the replica, ``finish(result, *args)``
        (with the variables themselves, to assign them) when given.

        Traced *once*: with the strategy's collective launchers the body is traced a single
        time as a function of (replica id, ordering token, tensors) with
        :class:`KeyedCollectives`, and each replica calls it on its device, so the Python
        replay, its gradients and TensorFlow's bookkeeping of the traced ops are done once,
        not once per replica (the first step's time, issue 11). The calls are not inlined:
        each device instantiates and optimises its own copy when the step first runs.
        Otherwise (see :meth:`_launchers`) the body is traced in each replica with the
        ``ReplicaContext``'s collectives."""
        launchers = self._launchers()
        if launchers is None:
            def replica(*a: Any) -> Any:
                coll = self._collectives(self._tracing)
                rid = coll.replica_ids()[0] if hasattr(coll, "replica_ids") else \
                    tf.get_static_value(tf.distribute.get_replica_context()
                                        .replica_id_in_sync_group)
                static = tf.get_static_value(rid) if isinstance(rid, tf.Tensor) else rid
                r = _Replica(coll, ReplicaContextCollectives(self.num_devices), rid,
                             static is not None and int(static) == self.local_replicas[0])
                result = body(r, *_read(a))
                return finish(result, *a) if finish else result
            return self.strategy.run(self._on_device(replica), args=args)

        local = self.strategy.experimental_local_results
        first = tf.nest.map_structure(
            lambda a: local(a)[0] if isinstance(a, tf.distribute.DistributedValues) else a,
            args)
        tokens = [getattr(lc, "_ordering_token", None) for lc in launchers]
        use_token = all(t is not None for t in tokens)
        group = self._keyed_group(launchers)
        if self._tracing not in self.audits:
            self.audits[self._tracing] = Audit()

        mesh = self._mesh_keys

        def sub_group(size: int, key: tf.Tensor) -> KeyedGroup:
            return dataclasses.replace(group, group_key=key, group_size=size,
                                       next_key=lambda: next(mesh["instance"]))

        def traced(ids: tf.Tensor, token: Any, *a: Any) -> Any:
            # ids: [replica id within the row, row, row group key, column group key]
            audit = self.audits[self._tracing]
            if mesh is None:
                coll = KeyedCollectives(self.num_devices, ids[0], group, token, audit=audit)
                return body(_Replica(coll, coll, ids[0], True), *a)
            coll = KeyedCollectives(self.num_devices, ids[0],
                                    sub_group(self.num_devices, ids[2]), token, audit=audit)
            dp = KeyedCollectives(self.rows, ids[1], sub_group(self.rows, ids[3]), token,
                                  audit=self.dp_audits.setdefault(self._tracing, Audit()))
            return body(_Replica(coll, coll, ids[0], True, dp), *a)

        # out of line: each replica's call instantiates its own copy of the body on its
        # device, under the runtime's Grappler options (set again below: strategy.run calls
        # the replicas in threads of its own); Grappler then optimises N copies of the body
        # one at a time instead of one graph holding all N (the first step, issue 11)
        fn = tf.function(traced, autograph=False,
                         experimental_attributes={"_noinline": True}).get_concrete_function(
            tf.TensorSpec([4], tf.int32), tf.TensorSpec([], tf.resource) if use_token else None,
            *tf.nest.map_structure(_spec, first))

        def replica(*a: Any) -> Any:
            rid = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
            token = tokens[self.local_replicas.index(rid)].handle if use_token else None
            if mesh is None:
                ids = [rid, 0, 0, 0]
            else:
                i, j = divmod(rid, self.num_devices)
                ids = [j, i, mesh["rows"][i], mesh["cols"][j]]
            with replay.graph_optimization(self.graph_optimization, self._accelerators):
                result = fn(tf.constant(ids, tf.int32), token, *_read(a))
            return finish(result, *a) if finish else result
        return self.strategy.run(self._on_device(replica), args=args)

    # -- training -------------------------------------------------------------------------

    # the model's weight regularizers (tapas.execution.training.regularizers.plan_regularizers)
    regularization: list = []

    def _grads(self, r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tuple:
        """(loss share, whether shares are summed, gradients of the trainable weights in
        ``trainable_paths`` order (None where the loss does not depend on one), writes)."""
        trainable = [weights[p] for p in self.trainable_paths]
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            added: list = []
            outs, writes = self._forward(r, xs, weights, states, added)
            share, partial = compiled_loss.outputs_loss(self, r, outs, y)
            share = regularizers.regularized(self, r, share, partial, weights)
            share = regularizers.with_call_losses(self, r, share, partial, added)
            scaled = share
            if self.optimizer.loss_scale is not None:   # Keras's optimizer.scale_loss
                scaled = tf.cast(share, tf.float32) * self.opt_state["loss_scale"]
        grads = tape.gradient(scaled, trainable)
        if r.dp is not None:   # data parallel over the mesh column: the rows' gradients add up
            # (not those of weights cut over the rows: each row holds other experts, whose
            # gradients the all-to-all's backward already brought from every row)
            grads = [None if g is None else
                     g if self.specs[p].row_axis is not None else reductions.dp_grad(self, r, p, g)
                     for p, g in zip(self.trainable_paths, grads)]
        return share, partial, grads, writes, outs

    # whether the training step and forward_loss also return the global outputs, targets
    # and sample weights (``step_values``: what metrics are computed from); set_step_values
    keep_step_values = False
    step_values: tuple | None = None

    def set_step_values(self, on: bool) -> None:
        """Whether steps keep their global values (module ``step_outputs``)."""
        step_outputs.set_step_values(self, on)

    def _dp_loss(self, r: _Replica, loss: tf.Tensor) -> tf.Tensor:
        """The global loss from a row's (the rows' losses add up; 1-D: the loss itself)."""
        return loss if r.dp is None else r.dp.sum_value(loss)

    def _dp_output(self, r: _Replica, out: tf.Tensor) -> tf.Tensor:
        """The global output from a row's (concatenated over the rows on axis 0)."""
        return out if r.dp is None else r.dp.gather_value(out, 0)

    def _replica_compute(self, r: _Replica, xs: tuple, y: Any, weights: dict, slots: dict,
                         states: dict) -> tuple:
        share, partial, grads, writes, outs = self._grads(r, xs, y, weights, states)
        new_values, new_slots, new_state = self.optimizer.apply(
            {p: weights[p] for p in self.trainable_paths},
            dict(zip(self.trainable_paths, grads)), slots,
            {k: v.read_value() for k, v in self.opt_state.items()},
            self.iterations.read_value(), self.learning_rate.read_value(),
            lambda sums: reductions.sum_squares(self, r, sums),
            lambda ok: reductions.all_finite(self, r, ok))
        new: dict[str, dict[str, tf.Tensor]] = {p: {"value": v} for p, v in new_values.items()}
        for p, upd in new_slots.items():
            new.setdefault(p, {}).update(upd)
        loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
        return step_outputs.with_step_values(self, r, loss, outs, y), new, writes, new_state

    def _replica_assign(self, new: dict, writes: dict, weights: dict, slots: dict,
                        states: dict, deps: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(deps):
            ops = stateful.assign_writes(writes, weights, states)
            for p, upd in new.items():   # plain resource writes (see _read)
                for k, value in upd.items():
                    var = weights[p] if k == "value" else slots[p][k]
                    ops.append(tf.raw_ops.AssignVariableOp(resource=var.handle, value=value))
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def _train_step(self, xs: Any, y: Any) -> tf.Tensor:
        # the traced step's graph, for TensorBoard's graph tab (fit's tensorboard=)
        self.graphs["train_step"] = tf.compat.v1.get_default_graph()
        loss, new, writes, state = self._replicas(
            self._replica_compute, (xs, y, self._dist_vars, self._dist_slots, self.states.dist))
        loss, values = loss if isinstance(loss, tuple) else (loss, None)
        local = self.strategy.experimental_local_results
        local_losses = local(loss)
        everything = tf.nest.flatten(local((new, writes, state)))
        with tf.control_dependencies(everything + list(local_losses)):
            checks = [tf.debugging.check_numerics(l, "tapas: the loss is not finite")
                      for l in local_losses]
        done = self.strategy.run(self._on_device(self._replica_assign),
                                 args=(new, writes, self._dist_vars, self._dist_slots,
                                       self.states.dist, checks))
        with tf.control_dependencies(local(done)):
            taken = dict(local(state)[0])   # the same on every replica
            step_taken = taken.pop("step_taken")
            for k, v in taken.items():
                self.opt_state[k].assign(v)
            self.iterations.assign_add(step_taken)
            return step_outputs.first_values(self, tf.identity(local_losses[0]), values)

    def _prepare(self, xs: Any, y: Any, worker_share: bool = False,
                 sample_weight: Any = None) -> tuple[Any, Any]:
        if self.loss is None:
            raise ValueError("this runtime has no loss: pass loss=<keras loss> to train")
        for loss in self.output_losses or [self.loss]:
            if getattr(loss, "reduction", None) not in _REDUCTIONS or not hasattr(loss, "call"):
                raise ValueError(f"loss {loss!r}: the runtime needs a keras.losses.Loss with "
                                 f"reduction in {sorted(_REDUCTIONS)} (per-example values "
                                 "from Loss.call, reduced by the runtime)")
        if len(self.output_placements) != len(self.output_losses or [self.loss]):
            raise ValueError(f"the model has {len(self.output_placements)} outputs and "
                             f"{len(self.output_losses or [self.loss])} losses: give one "
                             "loss per output (a list or a dict keyed by output name)")
        xs = self._check_inputs(xs, worker_share)
        if self.output_losses is not None and len(self.output_losses) > 1:
            return compiled_loss.prepare_outputs(self, xs, y, worker_share, sample_weight)
        y = np.asarray(y)
        self.loss_plan = self._loss_plan(y)
        tp = Replica() if self.loss_plan.target_axis is None else Split(self.loss_plan.target_axis)
        dist_x = self._distribute(xs, self.input_placements, worker_share)
        if sample_weight is None:
            dist_y = self._distribute([y], [tp], worker_share)
            return dist_x, (dist_y[0] if isinstance(dist_y, tuple) else dist_y)
        w = self._check_weights(sample_weight, y)
        self.weight_placement = self.sample_weight_placement(y.ndim, w.ndim)
        return dist_x, self._distribute([y, w], [tp, self.weight_placement], worker_share)

    def sample_weight_placement(self, y_ndim: int, w_ndim: int) -> Any:
        """Sample weights of rank ``w_ndim`` follow the targets' placement
        (:meth:`target_placement`) on the axes they have; else they are replicated."""
        tp = self.target_placement(y_ndim)
        return tp if isinstance(tp, Split) and tp.axis < w_ndim else Replica()

    def _check_weights(self, sample_weight: Any, y: np.ndarray) -> np.ndarray:
        """Sample weights as float32, with a shape that leads the targets' (Keras: one per
        example, or per target element)."""
        w = np.asarray(sample_weight, dtype=np.float32)
        if w.ndim == 0 or w.ndim > y.ndim or w.shape != y.shape[:w.ndim]:
            raise ValueError(f"sample_weight has shape {list(w.shape)}, the targets "
                             f"{list(y.shape)}: give one weight per example (shape "
                             f"{list(y.shape[:1])}) or per target element (a leading part "
                             f"of {list(y.shape)})")
        return w

    def _call(self, key: str, fn: Callable, *args: Any) -> Any:
        """Run one tf.function, timing its first call (the trace), under the runtime's
        Grappler options (:func:`tapas.execution.program.replay.graph_optimization`)."""
        first = key not in self.trace_seconds
        self._tracing = key
        start = time.perf_counter()
        try:
            with replay.graph_optimization(self.graph_optimization, self._accelerators):
                result = fn(*args)
        finally:
            self._tracing = ""
        if first:
            self.trace_seconds[key] = time.perf_counter() - start
        return result

    def _evaluate(self, xs: Any, y: Any) -> tuple:
        def body(r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tuple:
            share, partial, grads, writes, outs = self._grads(r, xs, y, weights, states)
            full_grads = {}
            for p, g in zip(self.trainable_paths, grads):
                if g is None:
                    continue
                g = tf.convert_to_tensor(g)
                placement = self.specs[p].placement
                full_grads[p] = (r.values.gather_value(g, placement.axis)
                                 if isinstance(placement, Split) else g)
                if self.specs[p].row_axis is not None:   # nested experts: the rows' parts
                    full_grads[p] = r.dp.gather_value(full_grads[p], self.specs[p].row_axis)
            full_outs = [self._dp_output(r, r.values.gather_value(o, pl.axis)
                                         if isinstance(pl, Split) else o)
                         for o, pl in zip(outs, self.output_placements)]
            loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
            return (full_outs, loss, full_grads), writes

        outs, loss, grads = self._replicas(body, (xs, y, self._dist_vars, self.states.dist),
                                           self._assigning_writes)
        first = self.strategy.experimental_local_results
        return ([first(o)[0] for o in outs], first(loss)[0],
                {p: first(g)[0] for p, g in grads.items()})

    @staticmethod
    def _assigning_writes(result: tuple, *args: Any) -> Any:
        """``finish`` of :meth:`_replicas` for a body that returns ``(value, writes)``: the
        writes assigned to the replica's variables (the last two arguments: weights and
        states), as a Keras call in training mode does; returns the value."""
        value, writes = result
        weights, states = args[-2], args[-1]
        with tf.control_dependencies(stateful.assign_writes(writes, weights, states)):
            return tf.nest.map_structure(tf.identity, value)

    def evaluate(self, xs: Any, y: Any) -> tuple[list[np.ndarray], float, dict[str, np.ndarray]]:
        """(outputs, global loss, {path: global gradient}) on the batch, in one traced
        function, without updating anything (what ``verify`` compares)."""
        if not hasattr(self, "_evaluate_fn"):
            self._evaluate_fn = tf.function(self._evaluate, autograph=False)
        outs, loss, grads = self._call("evaluate", self._evaluate_fn, *self._prepare(xs, y))
        return ([o.numpy() for o in outs], float(loss.numpy()),
                {p: g.numpy() for p, g in grads.items()})

    def gradients(self, xs: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        """(global loss, {path: global gradient}) on the batch, without updating anything."""
        _, loss, grads = self.evaluate(xs, y)
        return loss, grads

    def _loss_only(self, xs: Any, y: Any) -> tf.Tensor:
        def body(r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tf.Tensor:
            added: list = []   # writes dropped: no side effects
            outs, _ = self._forward(r, xs, weights, states, added)
            share, partial = compiled_loss.outputs_loss(self, r, outs, y)
            share = regularizers.regularized(self, r, share, partial, weights)
            share = regularizers.with_call_losses(self, r, share, partial, added)
            loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
            return step_outputs.with_step_values(self, r, loss, outs, y)
        loss = self._replicas(body, (xs, y, self._dist_vars, self.states.dist))
        loss, values = loss if isinstance(loss, tuple) else (loss, None)
        first = self.strategy.experimental_local_results(loss)[0]
        return step_outputs.first_values(self, first, values)

    def forward_loss(self, xs: Any, y: Any, *, worker_share: bool = False,
                     sample_weight: Any = None) -> float:
        """The global loss on the batch, forward only: no gradients, and the program's
        writes (advanced seeds, moving statistics) are not assigned, so nothing changes
        (validation in ``tapas.execution.fit``; the graph is the program's mode).
        ``worker_share``: as for :meth:`train_step`."""
        if not hasattr(self, "_loss_fn"):
            self._loss_fn = tf.function(self._loss_only, autograph=False)
        return step_outputs.keep_values(self, self._call(
            "loss", self._loss_fn, *self._prepare(xs, y, worker_share, sample_weight)))

    def train_step(self, xs: Any, y: Any, *, worker_share: bool = False,
                   sample_weight: Any = None) -> float:
        """One optimizer step on the global batch ``(xs, y)``; returns the global loss.

        ``worker_share=True``: ``xs`` and ``y`` are only this worker's shares of the global
        batch (:meth:`worker_share` of each input's placement and of
        :meth:`target_placement`), as a per-worker input pipeline reads them under
        ``MultiWorkerMirroredStrategy``; with every replica in this process they are the
        global batch. ``sample_weight``: Keras's per-example (or per target element)
        weights of the loss, placed like the targets.

        All or nothing: on failure (e.g. a non-finite loss) raises :class:`StepError` and
        leaves weights, slots and the step counter unchanged.
        """
        dist_x, dist_y = self._prepare(xs, y, worker_share, sample_weight)
        try:
            loss = self._call("train_step", self._train_fn, dist_x, dist_y)
        except (tf.errors.InvalidArgumentError, tf.errors.CancelledError) as e:
            from tapas.execution.step_errors import step_error
            raise step_error(self, e, xs, y) from None
        return step_outputs.keep_values(self, loss)

    # -- inference ------------------------------------------------------------------------

    def _replica_predict(self, r: _Replica, xs: tuple, weights: dict, states: dict) -> tuple:
        outs, writes = self._forward(r, xs, weights, states)
        full = [self._dp_output(r, r.values.gather_value(o, p.axis) if isinstance(p, Split)
                                else o)
                for o, p in zip(outs, self.output_placements)]
        return full, writes   # the writes are assigned (training mode: as a Keras call)

    def _predict(self, xs: Any) -> list[tf.Tensor]:
        outs = self._replicas(self._replica_predict, (xs, self._dist_vars, self.states.dist),
                              self._assigning_writes)
        return [self.strategy.experimental_local_results(o)[0] for o in outs]

    def predict(self, xs: Any) -> np.ndarray | list[np.ndarray]:
        """The model's outputs on the global batch (a list when the model has several)."""
        xs = self._check_inputs(xs)
        outs = [o.numpy() for o in self._call("predict", self._predict_fn,
                                               self._distribute(xs, self.input_placements))]
        return outs[0] if len(outs) == 1 else outs

    # -- global values --------------------------------------------------------------------

    def _all_local(self) -> bool:
        return len(self.local_replicas) == self.num_replicas

    def _local_row(self) -> list[int] | None:
        """The replicas of the first mesh row this process holds whole, or None."""
        first = -(-self.local_replicas[0] // self.num_devices) * self.num_devices
        row = list(range(first, first + self.num_devices))
        return row if all(r in self._device for r in row) else None

    def _global(self, tensors: Mapping[int, Mapping[str, tf.Variable]],
                paths: Sequence[str]) -> dict[str, np.ndarray]:
        return gathering.global_values(self, tensors, paths)

    def global_weights(self) -> dict[str, np.ndarray]:
        """Every weight's global value, reassembled from the shards."""
        return self._global(self._vars, self.paths)

    def global_slots(self) -> dict[str, dict[str, np.ndarray]]:
        """Every optimizer slot's global value: ``{slot name: {path: value}}``."""
        return {k: self._global({r: {p: s[p][k] for p in s} for r, s in self._slots.items()},
                                self.trainable_paths)
                for k in self.optimizer.slot_names}

    def set_global_weights(self, values: Mapping[str, np.ndarray],
                           slots: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        """Cut global values into this layout's shards and assign them."""
        for r in self.local_replicas:
            for p, v in values.items():
                self._vars[r][p].assign(self._cut(self.specs[p], v, r))
            for k, per_path in (slots or {}).items():
                for p, v in per_path.items():
                    self._slots[r][p][k].assign(
                        self._cut(self.specs[p], v, r))

    def finalize_variable_values(self) -> None:
        """Keras's ``finalize_variable_values`` at the end of ``fit``: with ``use_ema`` the
        weights become their moving averages (the "average" slots); else nothing."""
        if not self.optimizer.use_ema:
            return
        for r in self.local_replicas:
            for p in self.trainable_paths:
                self._vars[r][p].assign(self._slots[r][p]["average"])

    def to_keras(self, model: Any) -> Any:
        """Write the global weights into the single-device Keras ``model`` (matched by
        weight path), gathered and assigned one weight at a time; returns ``model``."""
        by_path = weights_by_path(model)
        missing = [p for p in self.paths if p not in by_path]
        if missing:
            raise ValueError(f"the Keras model has no weight {missing[0]!r} (and "
                             f"{len(missing) - 1} more): is it the model this runtime was "
                             "built from?")
        for p in self.paths:
            by_path[p].assign(self._global(self._vars, [p])[p])
        return model

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, path: str) -> str:
        """Write shards, optimizer slots and the step counter under directory ``path``
        (``tapas.execution.checkpoints.save``)."""
        return checkpoints.save(self, path)

    def _barrier(self) -> None:
        """Wait for every worker (a scalar all-reduce); nothing to wait for in one process."""
        if self._all_local():
            return
        if not hasattr(self, "_barrier_fn"):
            def fn() -> tf.Tensor:
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))
            self._barrier_fn = tf.function(lambda: self.strategy.run(fn), autograph=False)
        self._barrier_fn()

    def restore(self, path: str) -> str:
        """Load a checkpoint written by :meth:`save`: directly when the layout is this one,
        else by reassembling each weight and slot from the old shards and cutting it again
        (``tapas.execution.checkpoints.restore``). Returns "direct" or "resharded"."""
        return checkpoints.restore(self, path)
