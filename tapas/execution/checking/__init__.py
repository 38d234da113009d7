"""Checking a sharded program against what Keras/TF compute on one device.

In:  a :class:`tapas.execution.program.plan.Plan`, its per-replica program and the
     single-device Keras model.
Out: comparison reports and errors naming the first tensor that differs.

* :mod:`.verify`: the sharded program (simulated shards) against the single-device model,
  outputs, losses and gradients; :mod:`.nested`: the same on a mesh with nested experts.
* :mod:`.keras_reference`: Keras's own training step (``train_on_batch``) as the reference
  of ``ParallelModel.verify_training``.
* :mod:`.audit`: the collectives a plan predicts against those the program records.
* :mod:`.checker`: every pattern of every GraphNode (and whole plans) checked with both.
"""
