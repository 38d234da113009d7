"""The collectives a runtime's loss needs, recorded for the audit.

In:  a ``Runtime`` (``rt``: ``num_devices``, ``loss_comms``, the function being traced)
     and, inside a replica body, its replica (``r``: ``values``, ``rid``, ``records``).
Out: :func:`all_gather` and :func:`all_reduce` of a tensor for the loss, each recorded as
     (function, kind, global bytes) in ``rt.loss_comms``; :func:`gather_for_loss`, an
     all-gather whose gradient is the replica's slice; :func:`vocab_parallel`, Keras's
     cross-entropy of logits split on the class axis (``losses.vocab_parallel_crossentropy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program.collectives import local_slice
from tapas.execution.training import losses

__all__ = ["all_gather", "all_reduce", "gather_for_loss", "vocab_parallel"]


def all_gather(rt: Any, r: Any, x: tf.Tensor, axis: int) -> tf.Tensor:
    """All-gather for the loss, recorded (kind, global bytes) in ``rt.loss_comms``."""
    if r.records:
        rt.loss_comms.append((rt._tracing, "AG", int(np.prod(x.shape))
                              * rt.num_devices * x.dtype.size))
    return r.values.gather_value(x, axis)


def all_reduce(rt: Any, r: Any, x: tf.Tensor) -> tf.Tensor:
    """All-reduce (sum) for the loss, recorded in ``rt.loss_comms``."""
    if r.records:
        rt.loss_comms.append((rt._tracing, "AR", int(np.prod(x.shape)) * x.dtype.size))
    return r.values.sum_value(x)


def gather_for_loss(rt: Any, r: Any, out: tf.Tensor, axis: int) -> tf.Tensor:
    """``out`` all-gathered on ``axis``; backward: this replica's slice of the gradient."""
    n = rt.num_devices

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            return local_slice(dy, axis, n, r.rid)
        return all_gather(rt, r, x, axis), grad

    return gather(out)


def vocab_parallel(rt: Any, r: Any, logits: tf.Tensor, y: tf.Tensor, loss: Any) -> tf.Tensor:
    """Per-example cross-entropy of ``loss`` (a Keras loss) on logits split on the last
    axis, without gathering them."""
    kw = getattr(loss, "_fn_kwargs", None) or {}
    return losses.vocab_parallel_crossentropy(
        logits, y, sparse=type(loss).__name__ == "SparseCategoricalCrossentropy",
        label_smoothing=float(kw.get("label_smoothing") or 0.0),
        num_devices=rt.num_devices, replica_id=r.rid,
        all_gather=lambda x: all_gather(rt, r, x, len(x.shape) - 1),
        all_reduce=lambda x: all_reduce(rt, r, x))
