"""Stage 5, execution: a Strategy -> a parallel TensorFlow program, trained under tf.distribute.

In:  the traced model, its :class:`tapas.ir.Graph` and a
     :class:`tapas.planning.search.Strategy`.
Out: :class:`tapas.execution.parallel.ParallelModel`: per-replica programs with real
     collectives, a training step under MirroredStrategy / MultiWorkerMirroredStrategy,
     checkpoints, the collective audit and the comparison with the single-device model.

* :mod:`tapas.execution.plan`: the sharding plan (a pattern per GraphNode), weight layouts.
* :mod:`tapas.execution.reconstruct`: plan -> per-replica program.
* :mod:`tapas.execution.stateful`: training-mode graphs: seed states, dropout masks, variable
  writes (batch norm's moving statistics).
* :mod:`tapas.execution.collectives`: the collectives (simulated or ``ReplicaContext``).
* :mod:`tapas.execution.audit`: the collectives a plan predicts against those recorded.
* :mod:`tapas.execution.verify`: the sharded program against the single-device model.
* :mod:`tapas.execution.runtime`: shards and the training step under a tf.distribute strategy.
* :mod:`tapas.execution.devices`, :mod:`tapas.execution.keras_optimizer`,
  :mod:`tapas.execution.checkpoints`: its devices and strategies, the model's Keras
  optimizer on the shards, checkpoints.
* :mod:`tapas.execution.parallel`: ``tapas.parallelize`` and ``ParallelModel``.
* :mod:`tapas.execution.compiled_loss`, :mod:`tapas.execution.regularizers`,
  :mod:`tapas.execution.metrics`: the model's compiled loss per output with its
  ``loss_weights``, its weight regularizers on the shards, its compiled metrics on the
  global batch.
* :mod:`tapas.execution.train`, :mod:`tapas.execution.launch`: ``tapas train`` and its
  loopback worker processes.
* :mod:`tapas.execution.profiling`: ``tapas profile``: the runtime's collectives and compute
  timed on the devices, fitted (``tapas.planning.calibrate``) into a cluster file.
* :mod:`tapas.execution.compute_scale`: one model's compute factor
  (``CostOptions.compute_scale``): its replicated step timed at two batch sizes against the
  cost model's price.
* :mod:`tapas.execution.kernels`: each kernel of a model's patterns timed at its local
  shapes (``CostOptions.kernel_times``).
* :mod:`tapas.execution.communication_scale`: one model's communication factor
  (``CostOptions.communication_scale``): its data-parallel step timed with and without its
  collectives against the cost model's price of them.
"""
