"""Stage 1, capture: a Keras model or ``tf.function`` -> a :class:`tapas.ir.Graph` of GraphNodes.

In:  a Keras 3 model or layer, or a ``tf.function``, with ``tf.TensorSpec`` input specs.
Out: :class:`tapas.ir.Graph`: GraphNodes (ops used together: MatMul+BiasAdd+ReLU, a whole
     ``tapas.layers`` layer, ...) joined by edges that carry static tensor shapes.

Two steps, one module each:

* :mod:`tapas.capturing.tracing` (TensorFlow): trace a concrete function with static shapes,
  map resource placeholders to Keras weight paths, read the ``tf.Graph`` into plain op
  records (:class:`tapas.capturing.grouping.RawGraph`).
* :mod:`tapas.capturing.grouping` (pure): group the op records into GraphNodes.


TensorFlow is imported on first use of a tracing name, so ``tapas.capturing.grouping``
stays importable without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["capture", "trace", "to_ir", "raw_graph", "Trace", "CaptureError", "weight_paths",
           "weights_by_path"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("tapas.capturing.tracing"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tapas.capturing' has no attribute {name!r}")
