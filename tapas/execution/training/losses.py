"""The training loss of a parallel program, computed where its output lies.

In:  the model's Keras loss, the placement of the program's one output (``R`` or ``S(a)``),
     the output's global shape and dtype, the targets' rank, the number of devices.
Out: a :class:`LossPlan` (:func:`plan_loss`, from the pure :mod:`tapas.sharding.losses`,
     which the search prices too: the methods and what each moves are described there);
     :func:`vocab_parallel_crossentropy`, the per-example softmax cross-entropy of
     class-split logits, the ``vocab-parallel`` method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tapas.sharding.losses import MEAN_OVER_LAST_AXIS, LossPlan, LossSpec, plan_loss

__all__ = ["LossPlan", "LossSpec", "as_loss_dtype", "plan_loss", "vocab_parallel_crossentropy",
           "MEAN_OVER_LAST_AXIS"]


def vocab_parallel_crossentropy(logits: tf.Tensor, labels: tf.Tensor, *, sparse: bool,
                                label_smoothing: float, num_devices: int, replica_id: Any,
                                all_gather: Callable[[tf.Tensor], tf.Tensor],
                                all_reduce: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """The per-example softmax cross-entropy of logits split on their last axis.

    ``logits`` is this replica's slice ``[..., V/N]`` (replica ``replica_id`` holds classes
    ``[replica_id * V/N, (replica_id + 1) * V/N)``); ``labels`` are class ids ``[...]``
    (``sparse``) or this replica's slice of the target distribution ``[..., V/N]``.
    ``all_gather(x)`` concatenates ``[..., 1]`` tensors of every replica on the last axis,
    ``all_reduce(x)`` sums over replicas. Returns the full ``[...]`` loss on every replica;
    its gradient with respect to the local logits is the local slice of the global one.
    """
    local_v = int(logits.shape[-1])
    vocab = local_v * num_devices
    dtype = logits.dtype

    @tf.custom_gradient
    def xent(z: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        maxima = all_gather(tf.reduce_max(z, axis=-1, keepdims=True))
        m = tf.reduce_max(maxima, axis=-1)
        e = tf.exp(z - m[..., None])
        if sparse:
            ids = tf.cast(labels, tf.int64) - tf.cast(replica_id, tf.int64) * local_v
            held = (ids >= 0) & (ids < local_v)
            safe = tf.where(held, ids, tf.zeros_like(ids))
            picked = tf.gather(z, safe, axis=-1, batch_dims=len(z.shape) - 1)
            picked = tf.where(held, picked, tf.zeros_like(picked))
            total = all_reduce(tf.stack([tf.reduce_sum(e, -1), picked], -1))
            s, target = total[..., 0], total[..., 1]
            loss = tf.math.log(s) + m - target
            onehot = tf.one_hot(safe, local_v, dtype=dtype) * tf.cast(held, dtype)[..., None]
            weight = tf.ones_like(s)
        else:
            y = tf.cast(labels, dtype)
            if label_smoothing:
                y = y * (1.0 - label_smoothing) + label_smoothing / vocab
            total = all_reduce(tf.stack([tf.reduce_sum(e, -1), tf.reduce_sum(y * z, -1),
                                         tf.reduce_sum(y, -1)], -1))
            s, yz, weight = total[..., 0], total[..., 1], total[..., 2]
            loss = (tf.math.log(s) + m) * weight - yz
            onehot = y

        def grad(dy: tf.Tensor) -> tf.Tensor:
            softmax = e / s[..., None]
            return dy[..., None] * (softmax * weight[..., None] - onehot)
        return loss, grad

    return xent(logits)


def as_loss_dtype(out: tf.Tensor, loss: Any) -> tf.Tensor:
    """The output in the loss's dtype, as ``keras.losses.Loss.__call__`` converts it (a
    float16 output of a mixed-precision model is scored in float32)."""
    dtype = getattr(loss, "dtype", None)
    if dtype is None or not out.dtype.is_floating or out.dtype == tf.as_dtype(dtype):
        return out
    logits = getattr(out, "_keras_logits", None)
    cast = tf.cast(out, dtype)
    if logits is not None:
        cast._keras_logits = tf.cast(logits, dtype)
    return cast
