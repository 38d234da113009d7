"""The runtime's optimizers: Keras's SGD and Adam, applied to weight shards.

In:  an optimizer name ("sgd", "adam") or instance and a learning rate; per weight shard
     its value, its local gradient, its optimizer slots and the step number.
Out: :class:`SGD` / :class:`Adam` (:func:`make_optimizer`), whose ``update`` gives the new
     shard and slot values with Keras 3's arithmetic, op for op, and whose ``keras()`` is
     the equivalent Keras optimizer (the single-device reference of ``verify``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

__all__ = ["SGD", "Adam", "Optimizer", "make_optimizer"]


@dataclasses.dataclass(frozen=True)
class SGD:
    """``keras.optimizers.SGD`` on shards: same hyper-parameters, same arithmetic."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    name = "sgd"

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def keras(self) -> Any:
        import keras
        return keras.optimizers.SGD(self.learning_rate, momentum=self.momentum,
                                    nesterov=self.nesterov)

    def scalars(self, step: tf.Tensor, learning_rate: Any, dtype: tf.DType
                ) -> dict[str, tf.Tensor]:
        """The step's scalars in ``dtype``, shared by every weight of that dtype (made once
        per step, not once per weight: the traced step has fewer ops to build and
        optimise)."""
        lr = tf.cast(self.learning_rate if learning_rate is None else learning_rate, dtype)
        return {"lr": lr, "momentum": tf.cast(self.momentum, dtype)}

    def update(self, var: tf.Tensor, grad: tf.Tensor, slots: Mapping[str, tf.Tensor],
               step: tf.Tensor, grad_square: tf.Tensor | None = None,
               learning_rate: Any = None, scalars: Mapping[str, tf.Tensor] | None = None
               ) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """(new variable value, new slot values) for one weight; ``step`` counts from 1;
        ``learning_rate`` (a scalar tensor or variable) replaces ``self.learning_rate``
        (the runtime passes its learning-rate variable, which callbacks may change);
        ``scalars``: :meth:`scalars` of this step in the weight's dtype, when made
        already."""
        c = scalars if scalars is not None else self.scalars(step, learning_rate, var.dtype)
        lr = c["lr"]
        grad = tf.cast(grad, var.dtype)
        if not self.momentum:
            return var - grad * lr, {}
        momentum = c["momentum"]
        m = slots["momentum"] * momentum - grad * lr
        if self.nesterov:
            return var + (m * momentum - grad * lr), {"momentum": m}
        return var + m, {"momentum": m}


@dataclasses.dataclass(frozen=True)
class Adam:
    """``keras.optimizers.Adam`` on shards (Keras 3 bias correction folded into the step
    size, epsilon added to sqrt(v)): same hyper-parameters, same arithmetic."""

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    name = "adam"
    slot_names = ("momentum", "velocity")

    def keras(self) -> Any:
        import keras
        return keras.optimizers.Adam(self.learning_rate, beta_1=self.beta_1,
                                     beta_2=self.beta_2, epsilon=self.epsilon)

    def scalars(self, step: tf.Tensor, learning_rate: Any, dtype: tf.DType
                ) -> dict[str, tf.Tensor]:
        """The step's scalars in ``dtype`` (as :meth:`SGD.scalars`): the bias-corrected step
        size and the constants of the moment updates."""
        lr = tf.cast(self.learning_rate if learning_rate is None else learning_rate, dtype)
        local_step = tf.cast(step, dtype)
        beta_1_power = tf.pow(tf.cast(self.beta_1, dtype), local_step)
        beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), local_step)
        return {"alpha": lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power),
                "one_minus_beta_1": tf.constant(1 - self.beta_1, dtype),
                "one_minus_beta_2": tf.constant(1 - self.beta_2, dtype),
                "epsilon": tf.constant(self.epsilon, dtype)}

    def update(self, var: tf.Tensor, grad: tf.Tensor, slots: Mapping[str, tf.Tensor],
               step: tf.Tensor, grad_square: tf.Tensor | None = None,
               learning_rate: Any = None, scalars: Mapping[str, tf.Tensor] | None = None
               ) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """``grad_square``: what Keras squares for the second moment. For a sparse
        (``IndexedSlices``) gradient Keras squares each slice *before* summing duplicate
        rows (``keras.ops.square`` maps over the slices), which is not ``square(grad)``.
        ``learning_rate`` and ``scalars`` as for :meth:`SGD.update`."""
        dtype = var.dtype
        c = scalars if scalars is not None else self.scalars(step, learning_rate, dtype)
        grad = tf.cast(grad, dtype)
        m, v = slots["momentum"], slots["velocity"]
        m = m + (grad - m) * c["one_minus_beta_1"]
        squared = tf.square(grad) if grad_square is None else tf.cast(grad_square, dtype)
        v = v + (squared - v) * c["one_minus_beta_2"]
        return var - (m * c["alpha"]) / (tf.sqrt(v) + c["epsilon"]), \
            {"momentum": m, "velocity": v}


Optimizer = SGD | Adam


def make_optimizer(name: str | Optimizer, learning_rate: float | None = None) -> Optimizer:
    """:class:`SGD` or :class:`Adam` from a name ("sgd", "adam") and a learning rate."""
    if isinstance(name, (SGD, Adam)):
        return name
    kinds = {"sgd": SGD, "adam": Adam}
    if not isinstance(name, str) or name.lower() not in kinds:
        raise ValueError(f"optimizer={name!r}: use 'sgd' or 'adam' (or a "
                         "tapas.execution.optimizers.SGD / Adam instance)")
    cls = kinds[name.lower()]
    return cls() if learning_rate is None else cls(learning_rate=learning_rate)
