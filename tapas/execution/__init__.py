"""Stage 5, execution: a Strategy -> a parallel TensorFlow program, trained under tf.distribute.

In:  the traced model, its :class:`tapas.ir.Graph` and a
     :class:`tapas.planning.search.Strategy`.
Out: :class:`tapas.execution.api.parallel.ParallelModel`: per-replica programs with real
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
* :mod:`tapas.execution.runtime`: the tf.distribute runtime: the ``Runtime`` (shards,
  training step, inference, checkpoints), the devices and worker processes, the inputs.
* :mod:`tapas.execution.api`: the user API and jobs on it: ``tapas.parallelize`` and
  ``ParallelModel`` (``parallel``), ``fit`` with its callbacks and checkpoint directories,
  and ``tapas train`` (``train`` and its data, measurements, job and worker launch).
"""
