"""The optimizer's update one weight at a time, after what it decides over every weight.

In:  a :class:`~tapas.execution.training.keras_optimizer.ShardedOptimizer` and one
     replica's weight values, gradients, slots and state (as its ``apply`` takes them).
Out: :func:`decisions`: what the update reads across weights and replicas (clipping's sums
     of squares, loss scaling's finite flag), computed once; :func:`apply_one`: one
     weight's new value, slots and the new state given those decisions, so that a step can
     compute and assign its weights one after another (``tapas.execution.runtime.step``).
Raises: what ``ShardedOptimizer.apply`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from tapas.execution.training.keras_optimizer import ShardedOptimizer

__all__ = ["apply_one", "decisions"]


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
