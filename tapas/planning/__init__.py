"""Stages 3b and 4, planning: sharding patterns + a cluster -> the best Strategy (pure, no TF;
the measurements that calibrate a cluster are :mod:`tapas.execution.calibration.profiling`).

In:  a :class:`tapas.ir.Graph`, its :class:`tapas.mining.FoldedGraph`, the patterns of
     :mod:`tapas.sharding` and a :class:`tapas.planning.cluster.Cluster`.
Out: a :class:`tapas.planning.search.Strategy`: one pattern per GraphNode, the resharding
     collectives between them, the predicted cost, and the reference plans for comparison.

* :mod:`tapas.planning.cluster`: the cluster S(m, n), its links and presets
  (:mod:`tapas.planning.hardware`: the presets' constants and their sources).
* :mod:`tapas.planning.cost`: the overlap-aware alpha-beta costs, compute and memory.
* :mod:`tapas.planning.precision`: the dtype each FLOP and byte is priced in (mixed precision).
* :mod:`tapas.execution.calibration.fitting`: fitting alpha, beta, epsilon, gamma to measurements.
* :mod:`tapas.planning.table`: every GraphNode's patterns summarised and costed; edge costs.
* :mod:`tapas.planning.frontier`: the enumeration engine (DP over frontiers of placements).
* :mod:`tapas.planning.explore`: enumeration with early stopping, gp (per template) and es.
* :mod:`tapas.planning.branches`: independent branches searched alone, folded into their join.
* :mod:`tapas.planning.references`: the reference plans (Megatron, data parallel, ...).
* :mod:`tapas.planning.strategy`: the Strategy and its JSON format.
* :mod:`tapas.planning.report`: the readable report of a Strategy.
* :mod:`tapas.planning.search`: ``tapas.search``, the pipeline of the phases above.
"""
