"""The real cause of a training step that failed on one replica while the others were
cancelled: TensorFlow then raises the cancellation ("RecvAsync is cancelled") and drops the
failing op's own error.

In:  a Runtime (its loss, its program's output shape and dtype, its weights' global
     shapes), the step's batch ``(xs, y)`` as given to ``train_step``.
Out: :func:`step_error`: the exception ``train_step`` raises; :func:`op_message`: an op
     error's own sentence; :func:`cancelled_cause` a sentence:
     TensorFlow's own error for the batch's labels (the loss evaluated eagerly on one
     device) or for token ids beyond every embedding table (a gather on one device), or,
     when neither fails, what to run to see the failing op's error.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["step_error", "cancelled_cause", "op_message"]


def step_error(rt: Any, e: tf.errors.OpError, xs: Any, y: Any) -> Exception:
    """What ``Runtime.train_step`` raises for a failed step: a ``StepError`` (weights
    unchanged) with TensorFlow's own message, or with the real cause when one replica
    failed and cancelled the others; ``e`` itself for a cancellation across workers (a
    worker may be lost: ``fit`` reports which)."""
    from tapas.execution.runtime import StepError
    step = int(rt.iterations.numpy()) + 1
    if isinstance(e, tf.errors.CancelledError):
        if not rt._all_local():
            return e
        return StepError(f"training step {step} failed, weights unchanged: "
                         f"{cancelled_cause(rt, xs, y)}")
    return StepError(f"training step {step} failed, weights unchanged: {op_message(e)}")


def cancelled_cause(rt: Any, xs: Any, y: Any) -> str:
    """Why the step on ``(xs, y)`` failed, as TensorFlow says it on one device."""
    for check in (_label_error, _id_error):
        try:
            found = check(rt, xs, y)
        except Exception:  # noqa: BLE001  (a diagnosis must not hide the step's failure)
            found = None
        if found:
            return found
    return ("a replica failed and TensorFlow reported only the cancellation of the others "
            "(RecvAsync is cancelled); the labels and ids of the batch are in range: run "
            "ParallelModel.verify(x, y) on this batch (the Keras model on one device) to see "
            "the failing op's own error")


def op_message(e: tf.errors.OpError) -> str:
    """TensorFlow's own sentence in ``e``'s message (a ``tapas:`` check's line first),
    without the traceback, node and function decorations."""
    lines = [ln.strip() for ln in (e.message or "").splitlines() if ln.strip()]
    ours = [ln for ln in lines if "tapas:" in ln]
    said = [ln for ln in lines if not ln.startswith(_DECORATION)]
    line = (ours or said or lines or [type(e).__name__])[0 if ours else -1]
    line = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", line)
    line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line)   # "(0) INVALID_ARGUMENT: ..."
    return re.sub(r"\s*\[Op:[^\]]*\].*$", "", line).strip()


_DECORATION = ("[[", "File ", "Detected at node", "Graph execution error", "<stack traces")


def _label_error(rt: Any, xs: Any, y: Any) -> str | None:
    """The loss of the batch's targets against zero outputs of the program's output shape,
    eagerly on the CPU: TensorFlow's error for labels outside the classes."""
    shapes = getattr(rt.program, "output_shapes", None)
    if rt.loss is None or not shapes or y is None:
        return None
    dtype = (getattr(rt.program, "output_dtypes", None) or ("float32",))[0]
    with tf.device("/cpu:0"):
        try:
            rt.loss(tf.constant(np.asarray(y)), tf.zeros(tuple(shapes[0]), dtype))
        except tf.errors.InvalidArgumentError as e:
            return f"the targets y: {op_message(e)}"
    return None


def _id_error(rt: Any, xs: Any, y: Any) -> str | None:
    """A gather from a table of the largest embedding's rows, eagerly on the CPU, for each
    integer input: TensorFlow's error for an id beyond every embedding."""
    rows = [spec.global_shape[0] for path, spec in rt.specs.items()
            if path.rsplit("/", 1)[-1] in ("embeddings", "embedding")
            and len(spec.global_shape) == 2]
    if not rows:
        return None
    if isinstance(xs, dict):
        names, values = [f"input '{k}'" for k in xs], list(xs.values())
    elif isinstance(xs, (list, tuple)):
        names, values = [f"input {k}" for k in range(len(xs))], list(xs)
    else:
        names, values = ["the input"], [xs]
    with tf.device("/cpu:0"):
        table = tf.zeros((max(rows), 1))
        for name, value in zip(names, values):
            a = np.asarray(value)
            if a.dtype.kind not in "iu":
                continue
            try:
                tf.gather(table, a)
            except tf.errors.InvalidArgumentError as e:
                return (f"{name}: {op_message(e)} (the largest embedding has {max(rows)} "
                        "rows)")
    return None
