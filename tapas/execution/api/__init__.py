"""The user API and training jobs on the runtime: ``tapas.parallelize``, ``fit``, ``tapas train``.

In:  a Keras model, a strategy (searched, a file, a hand-made plan or ``random:SEED``), the
     devices; for jobs the data, epochs, callbacks and checkpoint options, or the options of
     ``tapas train``.
Out: a :class:`~tapas.execution.api.parallel.ParallelModel` (``parallel``) with Keras's
     ``fit``/``evaluate``/``predict`` (``fit``, ``fit_data``, ``fit_checkpoints``,
     ``callbacks``); ``tapas train``'s report (``train``: the job; ``train_data``,
     ``train_calibration``, ``train_job``, ``train_launch``, ``preflight``: its data, its
     measurements before the search, the fit job, its worker processes, the checks before
     anything is built).
"""
