"""The training loss of a parallel program, computed where its output lies.

In:  the model's Keras loss, the placement of the program's one output (``R`` or ``S(a)``),
     the output's global shape and dtype, the targets' rank, the number of devices.
Out: a :class:`LossPlan`: how each replica computes its share of the global loss, where
     the targets go, and the collectives that costs (kind and global bytes: the audit's
     prediction for the loss); :func:`vocab_parallel_crossentropy`, the per-example
     softmax cross-entropy of class-split logits.

Methods (``LossPlan.method``):

* ``local``: the per-example loss of the local slice. Right when the output is replicated,
  when it is split on an axis the per-example loss keeps (Keras losses reduce the last
  axis only: batch or sequence splits), and when it is split on the last axis and the loss
  is a mean over that axis of per-element terms (MSE, MAE, binary cross-entropy, Huber,
  log-cosh, MSLE); the targets are split alike.
* ``vocab-parallel``: logits split on the class axis (an LM head split by vocabulary) under
  ``(Sparse)CategoricalCrossentropy(from_logits=True)``. Megatron's vocabulary-parallel
  cross-entropy: each replica takes the max and the sum of exponentials of its slice, and
  the logit of the target class where it holds it; an all-gather of the per-row maxima
  ``[..., N]`` and one all-reduce of the packed per-row sums ``[..., 2]`` (``[..., 3]`` for
  dense targets) give every replica the full per-example loss. Nothing grows with the
  vocabulary. The gradient of the local logits is local: ``softmax(z)_slice - y_slice``.
* ``gather``: any other loss of an output split on its last axis: the output (or the
  logits of a softmax/sigmoid output) is all-gathered first (a collective as large as the
  output).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tapas.ir import dtype_bytes
from tapas.sharding.placements import Placement, Split

__all__ = ["LossPlan", "plan_loss", "vocab_parallel_crossentropy", "MEAN_OVER_LAST_AXIS"]

# Keras losses whose per-example value is a mean over the last axis of per-element terms:
# the mean of the local slice's means is the global mean
MEAN_OVER_LAST_AXIS = frozenset({
    "MeanSquaredError", "MeanAbsoluteError", "MeanSquaredLogarithmicError",
    "BinaryCrossentropy", "Huber", "LogCosh"})
_CROSSENTROPY = {"CategoricalCrossentropy": False, "SparseCategoricalCrossentropy": True}


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """How the runtime computes the loss of a placed output (see the module docstring)."""

    method: str                            # "local", "vocab-parallel" or "gather"
    axis: int | None                       # the output's split axis (None: replicated)
    target_axis: int | None                # targets split on this axis (None: replicated)
    collectives: tuple[tuple[str, int], ...]   # (kind, global bytes) per loss collective
    why: str = ""

    @property
    def partial(self) -> bool:
        """Whether each replica's loss is a share that the replicas sum (local per-example
        losses of split targets), rather than the full loss on every replica."""
        return self.method == "local" and self.target_axis is not None


def _kwargs(loss: Any) -> dict[str, Any]:
    return dict(getattr(loss, "_fn_kwargs", None) or {})


def plan_loss(loss: Any, placement: Placement, out_shape: Sequence[int], out_dtype: str,
              target_ndim: int, num_devices: int, activation: str | None = None) -> LossPlan:
    """The :class:`LossPlan` of ``loss`` on an output of global ``out_shape`` placed
    ``placement``, with targets of rank ``target_ndim``; ``activation`` is the output's
    softmax/sigmoid whose logits a Keras cross-entropy reads (None: the output itself)."""
    if not isinstance(placement, Split):
        return LossPlan("local", None, None, (), "replicated output")
    axis = placement.axis
    last = len(out_shape) - 1
    name = type(loss).__name__
    if axis < last:      # the per-example loss keeps this axis: split the targets alike
        target = axis if axis < target_ndim else None
        return LossPlan("local", axis, target, (), f"split on axis {axis}, kept per example")
    kw = _kwargs(loss)
    if name in _CROSSENTROPY and activation is None and kw.get("from_logits") and \
            kw.get("axis", -1) in (-1, last) and kw.get("ignore_class") is None:
        sparse = _CROSSENTROPY[name]
        rows = math.prod(out_shape[:-1])
        b = dtype_bytes(out_dtype)
        comms = (("AG", rows * num_devices * b), ("AR", rows * (2 if sparse else 3) * b))
        return LossPlan("vocab-parallel", axis, None if sparse else axis, comms,
                        "class-split logits, softmax cross-entropy")
    if name in MEAN_OVER_LAST_AXIS and target_ndim == len(out_shape):
        return LossPlan("local", axis, axis, (), f"{name} is a mean over the split axis")
    nbytes = math.prod(out_shape) * dtype_bytes(out_dtype)
    return LossPlan("gather", axis, None, (("AG", nbytes),),
                    f"{name} of an output split on its class axis: gathered first")


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
