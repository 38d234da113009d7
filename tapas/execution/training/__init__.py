"""The model's own training pieces, on the shards of a per-replica program.

In:  the Keras model (its compiled loss, metrics, optimizer, weight regularizers) and the
     program's placements.
Out: what the runtime's training step calls to compute them as Keras does on one device.

* :mod:`.losses`, :mod:`.compiled_loss`, :mod:`.loss_collectives`: the loss where the
  output lies; the compiled loss per output with its ``loss_weights``; the collectives the
  loss needs, recorded for the audit.
* :mod:`.metrics`, :mod:`.step_outputs`: the compiled metrics on the global batch, and the
  global values they are computed from.
* :mod:`.regularizers`: ``model.losses`` on the shards, counted once.
* :mod:`.keras_optimizer`, :mod:`.keras2`: the model's Keras optimizer on weight shards;
  Keras 2 (``tf_keras``) optimizers and losses as their Keras 3 equivalents.
* :mod:`.step_reductions`: what a step reduces over replicas besides the program's own
  collectives.
* :mod:`.gathering`: the global values of shard variables (weights, optimizer slots).
"""
