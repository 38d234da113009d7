"""Measuring this machine for the cost model: ``tapas profile`` and one model's factors.

In:  devices (logical CPU devices, GPUs or worker processes) and, for the per-model
     factors, a Keras model with its captured graph.
Out: a profiled ``Cluster`` file, and the factors ``CostOptions`` reads
     (``compute_scale``, ``communication_scale``, ``kernel_times``).

* :mod:`.timing`: per-replica functions timed under a tf.distribute strategy.
* :mod:`.profiling`: ``tapas profile``: the collectives, timed as the runtime launches them,
  and the compute rates (:mod:`.compute_rates`), fitted by :mod:`.fitting` (pure numpy: lines
  through the measurements, the cost model's constants and the profiled cluster).
* :mod:`.compute_scale`: one model's compute factor: its replicated step timed at two batch
  sizes against the cost model's price.
* :mod:`.communication_scale`: one model's communication factor: its data-parallel step
  timed with and without its collectives against the price of them.
* :mod:`.kernels`: each kernel of a model's patterns timed at its local shapes.
"""
