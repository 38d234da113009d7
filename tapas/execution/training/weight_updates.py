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

from tapas.execution.training.keras_optimizer import (  # its gradient helpers too
    ShardedOptimizer, _divided, _scaled, finite_locally, square_sums)

__all__ = ["Updates", "apply_one", "decisions"]


def decisions(opt: ShardedOptimizer, values: Mapping[str, tf.Tensor], grads: Mapping[str, Any],
              slots: Mapping[str, Mapping[str, tf.Tensor]], state: Mapping[str, tf.Tensor],
              iterations: tf.Tensor, learning_rate: tf.Tensor, sum_squares: Callable,
              all_finite: Callable | None = None) -> dict[str, Any]:
    """What the update decides over every weight at once, before any weight is updated
    (arguments as ``opt.apply``): ``sums`` (the whole weights' sums of squares of the
    gradients clipping by norm reads, as ``sum_squares`` returned them) and ``finite``
    (loss scaling: every replica's gradients finite), each only when the optimizer uses
    it; empty otherwise. Computed as ``opt.apply`` computes them, in its order: the
    gradients unscaled by the loss scale, then by ``loss_scale_factor``, then averaged
    with the accumulated ones (gradient accumulation), then squared and summed; nothing
    of the update itself is traced."""
    got: dict[str, Any] = {}
    inner = opt.opt
    clips = any(c is not None and c > 0 for c in (inner.clipnorm, inner.global_clipnorm))
    if opt.loss_scale is None and not clips:
        return got
    if opt.loss_scale is not None:   # ShardedOptimizer._apply_scaled
        got["finite"] = all_finite(finite_locally(
            [g for g in grads.values() if g is not None]))
        scale = tf.convert_to_tensor(state["loss_scale"], tf.float32)
        grads = {p: None if g is None else _divided(g, scale) for p, g in grads.items()}
    if clips:   # ShardedOptimizer.apply, _accumulate and _clip
        live = [p for p in opt.templates if p in values and grads.get(p) is not None]
        g = [grads[p] for p in live]
        if inner.loss_scale_factor is not None:
            g = [_scaled(x, 1.0 / inner.loss_scale_factor) for x in g]
        if inner.gradient_accumulation_steps:
            k = inner.gradient_accumulation_steps
            g = [(tf.convert_to_tensor(x) + slots[p]["gradient_accumulator"]) / k
                 for p, x in zip(live, g)]
        got["sums"] = sum_squares(square_sums(live, g))
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
    state, step, learning rate, what was decided over every weight) share one
    ``tf.function``, traced on the first weight of their kind and kept as a call in the
    step's graph (not inlined): the same shard shape and dtype, decayed or not by weight
    decay, a dense gradient and no constraint. What :func:`decisions` found is passed in:
    loss scaling's finite flag, and clipping's sums of squares (global clipping: every
    weight's; clipping per weight: this weight's, under the path the update was traced
    with). The update is elementwise and reads a weight only through the tensors given,
    so every weight of a kind gets the operations it would get alone; the other weights
    go through :func:`apply_one` inline."""

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        self._shared: dict[tuple, tuple[str, Any]] = {}

    def kind(self, path: str, grad: Any, decided: Mapping[str, Any]) -> tuple | None:
        """What makes ``path``'s update the same as another weight's, or None: its own."""
        info = self.opt.weights[path]
        if (grad is None or isinstance(grad, tf.IndexedSlices)
                or getattr(info.variable, "constraint", None) is not None):
            return None
        return (tuple(info.local_shape), info.dtype, self.opt.decays[path],
                tuple(sorted(decided)))

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
        if kind not in self._shared:   # the first weight of its kind stands for all
            self._shared[kind] = path, tf.function(
                functools.partial(apply_one, self.opt, path), autograph=False,
                experimental_attributes=_NOT_INLINED)
        traced, fn = self._shared[kind]
        given = dict(decided)
        clipnorm = self.opt.opt.clipnorm
        if "sums" in given and clipnorm and clipnorm > 0:   # clipped by its own norm
            given["sums"] = {traced: decided["sums"][path]}
        return fn(value, grad, dict(slots), dict(state), iterations, learning_rate, given)

    @property
    def kinds(self) -> int:
        """How many shared updates have been traced."""
        return len(self._shared)
