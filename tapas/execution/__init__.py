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
* :mod:`tapas.execution.checking`: the sharded program against the single-device model
  (``verify``, ``keras_reference``), the collective audit, the pattern checker.
* :mod:`tapas.execution.calibration`: ``tapas profile`` and one model's compute,
  communication and kernel timings, fitted into the cost model's constants.
"""
