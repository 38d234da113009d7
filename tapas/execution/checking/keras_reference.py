"""Keras's own training step beside the parallel one: the reference of ``verify``.

In:  a ``ParallelModel`` (its Keras model, the loss and optimizer it trains with), one
     batch and a step count.
Out: the losses of both sides per step (:func:`train_side_by_side`; the Keras model is
     trained as the reference, by ``model.train_on_batch`` with a fresh optimizer of the
     compiled one's class and settings when that is the step the parallel model runs),
     and whether every loss was finite (:func:`finite_losses`); Keras's training loss of a
     model's outputs (:func:`reference_loss`); how much the model's own gradients move
     under float32-sized perturbations (:func:`reference_sensitivity`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["SENSITIVITY_PERTURBATION", "finite_losses", "keras_train_on_batch", "reference_loss",
           "reference_sensitivity", "train_side_by_side"]


def train_side_by_side(pm: Any, call: Any, xs: list, y: Any, steps: int,
                        on_step: Any) -> list[tuple[float, float]]:
    """``steps`` training steps of ``pm`` and of its Keras model; their losses (a
    non-finite one on either side ends the steps: :func:`_finite_losses` reports it).

    The reference is Keras's own step: ``model.train_on_batch`` (its compiled loss and
    ``model.losses``, a fresh optimizer of the compiled one's class and config, so the
    user's optimizer is neither built nor stepped) when the model is compiled with the loss
    ``pm`` trains and runs in training mode; otherwise a ``GradientTape`` step of the loss
    ``pm`` trains with that Keras optimizer's ``apply_gradients``."""
    from tapas.execution.runtime import StepError
    model = pm.model
    optimizer = pm.runtime.optimizer.keras()
    keras_step = keras_train_on_batch(pm, optimizer, xs, y)
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        try:
            got = pm.train_step(xs, y)
        except StepError as e:
            if "not finite" not in str(e):
                raise
            got = math.nan
        seconds = time.perf_counter() - start
        if keras_step is not None:
            ref = keras_step()
        else:
            with tf.GradientTape() as tape:
                ref_loss = reference_loss(pm.runtime, model, y, call())
            g = tape.gradient(ref_loss, model.trainable_weights)
            optimizer.apply_gradients([(gi, w) for gi, w in zip(g, model.trainable_weights)
                                       if gi is not None])
            ref = float(ref_loss)
        losses.append((got, ref))
        if on_step is not None:
            on_step(step, got, ref, seconds)
        if not (math.isfinite(got) and math.isfinite(ref)):
            break
    return losses


def keras_train_on_batch(pm: Any, optimizer: Any, xs: list, y: Any) -> Any:
    """A function running one ``model.train_on_batch`` with ``optimizer`` in place of the
    compiled one (put back after each call) and returning its loss; None when Keras's
    step is not the one ``pm`` trains (an uncompiled model, another loss, or the
    inference graph: train_on_batch always runs in training mode)."""
    model = pm.model
    if not (getattr(model, "compiled", False) and pm.training
            and getattr(pm, "compiled_loss", False)):
        return None
    structure = pm.inputs.pack(xs)

    def step() -> float:
        saved, saved_fn = model.optimizer, model.train_function
        model.optimizer, model.train_function = optimizer, None
        try:
            logs = model.train_on_batch(structure, y, return_dict=True)
        finally:
            model.optimizer, model.train_function = saved, saved_fn
        return float(logs["loss"])
    return step


def finite_losses(losses: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Fails, naming the step, when either side's loss is not finite."""
    for i, (got, want) in enumerate(losses):
        if not (math.isfinite(got) and math.isfinite(want)):
            return {"ok": False, "max_abs_diff": float("inf"),
                    "message": f"step {i + 1}: the loss is not finite (parallel {got}, "
                               f"Keras {want})"}
    return {"ok": True, "max_abs_diff": 0.0}


def reference_loss(rt: Any, model: Any, y: Any, out: Any) -> tf.Tensor:
    """Keras's training loss of the outputs ``out`` as the runtime trains it: each output's
    loss (``keras.losses.Loss.__call__``) times its loss weight, summed, plus
    ``model.losses`` (the weight regularizers, read inside the caller's tape), as Keras's
    ``compute_loss``."""
    from tapas.execution.training.compiled_loss import output_targets
    losses = rt.output_losses or [rt.loss]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    ys = output_targets(y, rt.output_names or ["output"] * len(losses)) \
        if len(losses) > 1 else [y]
    terms = [fn(t, o) * (1.0 if w is None else w) for fn, t, o, w in
             zip(losses, ys, outs, rt.loss_weights or [None] * len(losses))]
    terms += [tf.reduce_sum(v) for v in model.losses]
    return tf.add_n(terms) if len(terms) > 1 else terms[0]


#: relative size of the weight perturbation :func:`reference_sensitivity` applies: about
#: one float32 rounding step (2**-23 = 1.2e-7)
SENSITIVITY_PERTURBATION = 1e-7


def reference_sensitivity(model: Any, call: Any, loss_fn: Any, y: Any,
                          relative: float = SENSITIVITY_PERTURBATION,
                          seed: int = 0, atol_factor: float = 1e-5) -> dict[str, Any]:
    """How much the single-device model's own gradients (and first output) move when its
    trainable weights are perturbed by ``relative`` (each element times
    1 + relative * N(0, 1)): float32 rounding in another order of operations perturbs a
    program by about that much, so a difference from a parallel program of this size is
    rounding, not a wrong plan. Some models are ill-conditioned this way in training mode
    (batch norm over a handful of values: keras.applications MobileNetV2 at 32x32 with a
    batch of 8, whose last feature maps are 1x1, moves its gradients by 7e-4 against a
    tolerance of 2e-4).

    Both gradients are taken at the model's current weights (in ``verify``, after its
    steps) from the same state: every variable of ``model`` (moving statistics, seed
    generators) is saved first and restored after each call, so dropout draws the same
    masks and the model is left as it was. Returns the largest gradient
    difference, the scale and tolerance ``verify`` uses for gradients, and ``exceeds``:
    whether the model's own sensitivity is above that tolerance; the same for the first
    output (``outputs_max_abs_diff``, ``outputs_tolerance``, ``outputs_exceed``)."""
    saved = [v.numpy() for v in model.variables]
    rng = np.random.default_rng(seed)

    def restore() -> None:
        for v, value in zip(model.variables, saved):
            v.assign(value)

    def run(perturb: bool) -> tuple[np.ndarray, list[np.ndarray]]:
        restore()
        if perturb:
            for w in model.trainable_weights:
                value = w.numpy()
                if value.dtype.kind == "f":
                    noise = rng.standard_normal(value.shape).astype(value.dtype)
                    w.assign(value * (1 + relative * noise))
        with tf.GradientTape() as tape:
            out = call()
            loss = loss_fn(y, out)
        grads = tape.gradient(loss, model.trainable_weights)
        first = tf.nest.flatten(out)[0]
        return np.asarray(first, np.float64), [
            np.zeros(w.shape, np.float64) if g is None
            else np.asarray(tf.convert_to_tensor(g), np.float64)
            for g, w in zip(grads, model.trainable_weights)]

    try:
        (out0, base), (out1, moved) = run(False), run(True)
    finally:
        restore()
    scale = max((float(np.abs(g).max()) for g in base if g.size), default=0.0)
    diff = max((float(np.abs(a - b).max()) for a, b in zip(base, moved) if a.size),
               default=0.0)
    tolerance = atol_factor * scale
    out_scale = float(np.abs(out0).max()) if out0.size else 0.0
    out_diff = float(np.abs(out0 - out1).max()) if out0.size else 0.0
    return {"relative_perturbation": relative, "max_abs_diff": diff, "scale": scale,
            "tolerance": tolerance, "exceeds": diff > tolerance,
            "outputs_max_abs_diff": out_diff, "outputs_tolerance": atol_factor * out_scale,
            "outputs_exceed": out_diff > atol_factor * out_scale}
