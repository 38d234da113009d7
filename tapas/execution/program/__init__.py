"""Plan -> per-replica program: the TF ops of a captured graph replayed on local shards,
with the collectives the plan asks for.

In:  a traced model (``tapas.capturing.Trace``), its :class:`tapas.ir.Graph` and a plan (a
     ShardingPattern per GraphNode).
Out: :class:`tapas.execution.program.reconstruct.Program`, callable in a ``tf.function`` on
     local inputs and weight shards; errors (:class:`~.plan.ReconstructError`) name the
     GraphNode, the pattern and the op.

* :mod:`.plan`: the plan (``Plan``, ``NodeSharding``) and how weights are stored.
* :mod:`.reconstruct`: ``Program``; its replay (:mod:`.run`) and the op-level local
  programs (:mod:`.local_ops`).
* :mod:`.replay`: re-creating one captured op (the one place touching TF internals).
* :mod:`.stateful`: training-mode graphs: variable writes and random draws.
* :mod:`.collectives`: the collectives, simulated in one process or through tf.distribute.
"""
