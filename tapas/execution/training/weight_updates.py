"""The optimizer's update one weight at a time, after what it decides over every weight.

In:  a :class:`~tapas.execution.training.keras_optimizer.ShardedOptimizer` and one
     replica's weight values, gradients, slots and state (as its ``apply`` takes them).
Out: :func:`decisions`: what the update reads across weights and replicas (clipping's sums
     of squares, loss scaling's finite flag), computed once; :func:`apply_one`: one
     weight's new value, slots and the new state given those decisions, so that a step can
     compute and assign its weights one after another (``tapas.execution.runtime.step``);
     :class:`Updates`: ``apply_one`` with the update of each kind of weight traced once.
Raises: what ``ShardedOptimizer.apply`` raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from tapas.execution.training.keras_optimizer import ShardedOptimizer

__all__ = ["Updates", "apply_one", "decisions"]


def decisions(opt: ShardedOptimizer, values: Mapping[str, tf.Tensor], grads: Mapping[str, Any],
              slots: Mapping[str, Mapping[str, tf.Tensor]], state: Mapping[str, tf.Tensor],
              iterations: tf.Tensor, learning_rate: tf.Tensor, sum_squares: Callable,
              all_finite: Callable | None = None) -> dict[str, Any]:
    """What the update decides over every weight at once, before any weight is updated
    (arguments as ``opt.apply``): ``sums`` (the whole weights' sums of squares of the
    gradients clipping reads, as ``sum_squares`` returned them) and ``finite`` (loss
    scaling: every replica's gradients finite), each only when the optimizer uses it;
    empty otherwise. It runs ``opt.apply`` and keeps only what its callbacks returned:
    the new values it computes are not used, and a ``tf.function`` prunes them."""
    got: dict[str, Any] = {}
    if opt.loss_scale is None and not (opt.opt.clipnorm or opt.opt.global_clipnorm):
        return got

    def sums(local: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        got["sums"] = sum_squares(local)
        return got["sums"]

    def finite(ok: tf.Tensor) -> tf.Tensor:
        got["finite"] = all_finite(ok)
        return got["finite"]
    opt.apply(values, grads, slots, state, iterations, learning_rate, sums, finite)
    return got


def apply_one(opt: ShardedOptimizer, path: str, value: tf.Tensor, grad: Any,
              slots: Mapping[str, tf.Tensor], state: Mapping[str, tf.Tensor],
              iterations: tf.Tensor, learning_rate: tf.Tensor,
              decided: Mapping[str, Any]) -> tuple[tf.Tensor | None,
                                                   dict[str, tf.Tensor],
                                                   dict[str, tf.Tensor]]:
    """``opt.apply`` for the weight ``path`` alone, given the :func:`decisions` made
    over every weight: (its new value or None where unchanged, its changed slots, the
    new state: the same for every weight). Elementwise, as every supported update is,
    so the weights one at a time equal the whole step."""
    def sums(local: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return decided["sums"]
    new_values, new_slots, new_state = opt.apply(
        {path: value}, {path: grad}, {path: slots}, state, iterations, learning_rate,
        sums, lambda ok: decided["finite"])
    return new_values.get(path), new_slots.get(path, {}), new_state


#: what marks a function the caller's graph keeps as a call (TensorFlow's function
#: attribute; without it, a call inside a ``tf.function`` is inlined when it runs)
_NOT_INLINED = {"_noinline": True}


class Updates:
    """:func:`apply_one` for the weights of one step, each kind of weight's update traced
    once and called per weight.

    Keras's ``update_step`` is traced once per weight inside the step (about 30 to 40
    operations each, ``docs/internals.md``, *Memory*), and every process holds the step's
    graph whole. Weights whose update is the same function of (value, gradient, slots,
    state, step, learning rate) share one ``tf.function``, traced on the first weight of
    their kind and kept as a call in the step's graph (not inlined): the same shard shape
    and dtype, decayed or not by weight decay, a dense gradient, no constraint, and nothing
    the update decides over every weight (clipping by norm, loss scaling, whose sums and
    flags are per step). The update is elementwise and reads a weight only through the
    tensors given, so every weight of a kind gets the operations it would get alone; the
    other weights go through :func:`apply_one` inline, as before."""

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        self._shared: dict[tuple, Any] = {}

    def kind(self, path: str, grad: Any, decided: Mapping[str, Any]) -> tuple | None:
        """What makes ``path``'s update the same as another weight's, or None: its own."""
        info = self.opt.weights[path]
        if (decided or grad is None or isinstance(grad, tf.IndexedSlices)
                or getattr(info.variable, "constraint", None) is not None):
            return None
        return tuple(info.local_shape), info.dtype, self.opt.decays[path]

    def __call__(self, path: str, value: tf.Tensor, grad: Any,
                 slots: Mapping[str, tf.Tensor], state: Mapping[str, tf.Tensor],
                 iterations: tf.Tensor, learning_rate: tf.Tensor,
                 decided: Mapping[str, Any]) -> tuple[tf.Tensor | None,
                                                      dict[str, tf.Tensor],
                                                      dict[str, tf.Tensor]]:
        """As :func:`apply_one`."""
        kind = self.kind(path, grad, decided)
        if kind is None:
            return apply_one(self.opt, path, value, grad, slots, state, iterations,
                             learning_rate, decided)
        fn = self._shared.get(kind)
        if fn is None:   # the first weight of its kind stands for all of them
            fn = self._shared[kind] = tf.function(
                functools.partial(_one, self.opt, path), autograph=False,
                experimental_attributes=_NOT_INLINED)
        return fn(value, grad, dict(slots), dict(state), iterations, learning_rate)

    @property
    def kinds(self) -> int:
        """How many shared updates have been traced."""
        return len(self._shared)


def _one(opt: ShardedOptimizer, path: str, value: tf.Tensor, grad: tf.Tensor,
         slots: dict[str, tf.Tensor], state: dict[str, tf.Tensor], iterations: tf.Tensor,
         learning_rate: tf.Tensor) -> tuple:
    """:func:`apply_one` for ``path``, nothing decided over every weight."""
    return apply_one(opt, path, value, grad, slots, state, iterations, learning_rate, {})
