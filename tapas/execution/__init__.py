"""Stage 5, execution: a Strategy -> a parallel TensorFlow program, trained under tf.distribute.

In:  the traced model, its :class:`tapas.ir.Graph` and a
     :class:`tapas.planning.search.Strategy`.
Out: :class:`tapas.execution.parallel.ParallelModel`: per-replica programs with real
     collectives, a training step under MirroredStrategy / MultiWorkerMirroredStrategy,
     checkpoints, the collective audit and the comparison with the single-device model.

One package per concern:

* :mod:`tapas.execution.program`: plan -> per-replica program (the plan, reconstruction,
  op replay, training-mode state, the collectives).
* :mod:`tapas.execution.training`: the model's own training pieces on the shards: its
  compiled loss and metrics, regularizers, Keras optimizer (Keras 2 ones translated), what
  a step reduces and returns, the global values of shard variables.
* :mod:`tapas.execution.checking`: the sharded program against the single-device model
  (``verify``, ``keras_reference``), the collective audit, the pattern checker.
* :mod:`tapas.execution.calibration`: ``tapas profile`` and one model's compute,
  communication and kernel timings, fitted into the cost model's constants.
* the runtime and the user API, flat here until they get a package of their own:
  :mod:`~tapas.execution.runtime` (shards and the training step under a tf.distribute
  strategy), :mod:`~tapas.execution.devices`, :mod:`~tapas.execution.inputs`,
  :mod:`~tapas.execution.checkpoints`, :mod:`~tapas.execution.parallel`
  (``tapas.parallelize``, ``ParallelModel``), :mod:`~tapas.execution.fit`,
  :mod:`~tapas.execution.train` and :mod:`~tapas.execution.launch` (``tapas train`` and
  its loopback worker processes).
"""
