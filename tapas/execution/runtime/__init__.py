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

from tapas.execution.runtime.base import StepError
from tapas.execution.runtime.core import Runtime

__all__ = ["Runtime", "StepError"]
