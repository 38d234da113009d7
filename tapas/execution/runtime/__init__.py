"""The ``tf.distribute`` runtime: a per-replica program's shards, steps and checkpoints on devices.

In:  a per-replica program (``tapas.execution.program``), the devices (logical CPU devices,
     GPUs, or the workers named by ``TF_CONFIG``) and the model's global weights.
Out: :class:`Runtime` (``core``: shards, training step, inference, global values,
     checkpoints) and :class:`StepError` (``base``), imported on first use.

Modules:

* the Runtime: ``core`` (the class) mixing in ``step`` (the training step), ``loss`` (each
  output's loss plan and local loss), ``inference`` (evaluate, forward loss, predict),
  ``distribute`` (inputs cut among replicas), ``replicas`` (one body on every replica,
  traced once) and ``values`` (global values, checkpoints); ``base`` (shared helpers).
* the weights: ``shards`` (cut and shared), ``materialize`` (read one at a time),
  ``checkpoints`` (save, restore) and ``reshard`` (a checkpoint read under another layout).
* the devices: ``devices`` (strategies, logical devices, ``TF_CONFIG``), ``launch`` (worker
  processes on the loopback), ``memory`` (the plan's memory beside the measured peak).
* the inputs and failures: ``inputs`` (the model's input structure), ``step_errors`` (a
  failed step's error message).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Runtime", "StepError"]

def __getattr__(name: str) -> Any:
    """``Runtime`` and ``StepError``, imported on first use: importing one module of this
    package (e.g. ``launch``, which needs no TensorFlow) does not import the Runtime."""
    if name == "Runtime":
        return importlib.import_module("tapas.execution.runtime.core").Runtime
    if name == "StepError":
        return importlib.import_module("tapas.execution.runtime.base").StepError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
