"""The model's own Keras optimizer, applied to weight shards.

In:  a Keras 3 optimizer (an instance, e.g. the model's compiled one; a name such as
     "adamw"; or a config dict ``{"class_name": ..., "config": ...}``) and, per trainable
     weight, its path, local shard shape, dtype, whether it is split over the devices and
     the user's variable (for weight-decay exclusions and constraints).
Out: :class:`ShardedOptimizer`: the slot names and initial slot values of a shard, the
     optimizer's own replicated state (Nadam's ``u_product``), and :meth:`apply`, a pure
     function from (weight values, gradients, slots, state, step, learning rate) to their
     new values. The update is Keras's own ``update_step`` (a clone of the optimizer of
     the same class and config, built on shard-shaped template variables that are never
     allocated, run inside a ``keras.StatelessScope``); clipping by norm sums the squares
     of a split weight's shards across devices (``sum_squares``), so it is the norm of the
     whole variable.
Raises: ValueError naming the optimizer or setting the runtime cannot reproduce exactly
     (non-elementwise updates such as Adafactor, LAMB or Muon; a norm constraint on a
     split weight) before anything runs. A LossScaleOptimizer (``mixed_float16``) runs its
     inner optimizer with Keras's dynamic loss scaling.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tapas.execution.training import keras2

__all__ = ["ShardedOptimizer", "WeightInfo", "check_supported", "finite_locally",
           "optimizer_from_flag", "resolve_optimizer", "slot_count", "square_sums"]

#: updates that read more than one element of a weight or gradient: not reproducible
#: shard by shard without collectives the runtime does not insert
_NOT_ELEMENTWISE = {
    "Adafactor": "its second moments are factored into row and column means of the "
                 "whole weight",
    "Lamb": "its trust ratio divides the norm of the whole weight by the norm of its update",
    "Muon": "it orthogonalizes the whole weight's update (Newton-Schulz iterations)",
    "MultiOptimizer": "it dispatches weights to several optimizers",
}
#: what ``exclude_from_weight_decay`` sets on a Keras optimizer
_EXCLUSIONS = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")
#: constraints that act on each element alone, exact on any shard
_ELEMENTWISE_CONSTRAINTS = ("NonNeg",)


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """A trainable weight as one replica holds it."""

    path: str
    local_shape: tuple[int, ...]
    dtype: str
    split: bool = False              # cut over the devices (its norm sums the shards)
    variable: Any = None             # the user's Keras variable, when known


class _Functional(TFOptimizer):
    """Keras's backend-agnostic optimizer methods in place of the TensorFlow backend's,
    which assign ``tf.Variable`` s directly and route through ``tf.distribute``: with
    these, every read and write goes through the current ``keras.StatelessScope``. Mixed
    in after the user's optimizer class, so ``super()`` calls of that class (Nadam's
    ``_backend_update_step``) land here."""

    assign = BaseOptimizer.assign
    assign_add = BaseOptimizer.assign_add
    assign_sub = BaseOptimizer.assign_sub
    _var_key = BaseOptimizer._var_key
    add_variable_from_reference = BaseOptimizer.add_variable_from_reference
    _backend_update_step = BaseOptimizer._backend_update_step


def resolve_optimizer(optimizer: Any, learning_rate: float | None = None) -> Any:
    """A Keras optimizer instance from an instance, a name ("sgd", "adamw", ...), a
    config dict or ``None`` (SGD, Keras's default). ``learning_rate`` replaces the
    optimizer's (on a copy: the user's instance is never changed)."""
    if optimizer is None:
        optimizer = "sgd"
    optimizer = keras2.optimizer(optimizer)   # a Keras 2 (tf_keras) one: its Keras 3 twin
    if isinstance(optimizer, str) or isinstance(optimizer, Mapping):
        try:
            opt = keras.optimizers.get(dict(optimizer) if isinstance(optimizer, Mapping)
                                       else optimizer)
        except (ValueError, TypeError) as e:
            raise ValueError(f"optimizer {optimizer!r} is not a Keras optimizer: give a name "
                             "such as 'sgd', 'adam', 'adamw', 'rmsprop', 'lion', a "
                             "keras.optimizers.Optimizer or its config dict "
                             f"({e})") from None
    elif isinstance(optimizer, BaseOptimizer):
        opt = optimizer
    else:
        raise ValueError(f"optimizer {optimizer!r} ({type(optimizer).__name__}) is not a "
                         "Keras 3 optimizer: pass a keras.optimizers.Optimizer, its name or "
                         "its config dict (a Keras 2 / tf_keras optimizer: build the same "
                         "one from keras.optimizers)")
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        if learning_rate is None:
            return opt
        wrapped = keras.optimizers.LossScaleOptimizer(
            resolve_optimizer(opt.inner_optimizer, learning_rate), opt.initial_scale,
            opt.dynamic_growth_steps)
        return _translated_like(opt, wrapped, learning_rate)
    if learning_rate is not None:
        config = opt.get_config() | {"learning_rate": float(learning_rate)}
        opt = _translated_like(opt, type(opt).from_config(config), learning_rate)
    return opt


def _translated_like(old: Any, new: Any, learning_rate: float | None) -> Any:
    """``new`` (rebuilt from ``old`` at ``learning_rate``) marked as translated from
    ``tf_keras`` when ``old`` was, its original at the new rate."""
    if getattr(old, keras2.FROM_TF_KERAS, False):
        setattr(new, keras2.FROM_TF_KERAS, True)
        setattr(new, keras2.ORIGINAL, lambda rate=None: keras2.original(
            old, learning_rate if rate is None else rate))
    return new


def slot_count(optimizer: Any) -> int:
    """The weight-sized slots ``optimizer`` (a Keras optimizer) keeps per trainable weight:
    its slots on a probe weight (EMA's average and the gradient accumulator included), what
    the search's memory estimate counts (``CostOptions.optimizer_slots``)."""
    probe = WeightInfo("tapas_probe/kernel", (2, 2), "float32")
    return len(ShardedOptimizer(optimizer, [probe]).slot_names)


def optimizer_from_flag(flag: str, value: str | None) -> Any:
    """A command-line optimizer: None (the model's compiled one), a Keras optimizer name,
    or the path of a JSON file of its config (``keras.optimizers.serialize(opt)``).
    Raises ValueError naming the flag and the file when it cannot be read."""
    if value is None or not value.endswith(".json"):
        return value
    try:
        with open(value) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{flag}={value}: cannot read it ({e.strerror}); give a Keras "
                         "optimizer name (sgd, adam, adamw, ...) or a JSON file of "
                         "keras.optimizers.serialize(optimizer)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}={value}: not valid JSON ({e.msg}, line {e.lineno}); write "
                         "it with json.dump(keras.optimizers.serialize(opt), f)") from None


def check_supported(opt: Any) -> None:
    """Refuse, by name and with the reason, an optimizer whose update is not elementwise."""
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer
    name = type(opt).__name__
    for cls in type(opt).__mro__:
        if cls.__name__ in _NOT_ELEMENTWISE:
            raise ValueError(f"optimizer {name} cannot run on weight shards: "
                             f"{_NOT_ELEMENTWISE[cls.__name__]}. Use an elementwise "
                             "optimizer (SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, "
                             "Adadelta, Lion, Ftrl)")


def _clone(opt: Any) -> Any:
    """A fresh optimizer of ``opt``'s class and config with :class:`_Functional`'s methods."""
    cls = type(opt)
    functional = type(f"Sharded{cls.__name__}", (cls, _Functional), {})
    try:
        return functional.from_config(opt.get_config())
    except Exception as e:  # a custom class or schedule whose config does not round-trip
        raise ValueError(f"optimizer {cls.__name__}: cannot rebuild it from its config "
                         f"({type(e).__name__}: {e}); give it a get_config/from_config that "
                         "round-trips") from None


def _initial(variable: Any) -> np.ndarray:
    """The initial value of an optimizer variable, allocated or deferred."""
    if getattr(variable, "_value", None) is None and getattr(variable, "_initializer", None):
        return np.asarray(variable._initializer(variable.shape, variable.dtype))
    return np.asarray(variable.numpy())


def _forget_deferred(variables: Sequence[Any]) -> None:
    """Drop ``variables`` from Keras's list of deferred variables, which the next exit of
    an outer ``StatelessScope`` would allocate: the templates never hold values."""
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    ids = {id(v) for v in variables}
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if id(v) not in ids])


def _check_variables(weights: Mapping[str, WeightInfo]) -> None:
    """Refuse weights the runtime cannot update exactly on shards."""
    for w in weights.values():
        v = w.variable
        if v is None:
            continue
        if getattr(v, "overwrite_with_gradient", False):
            raise ValueError(f"weight '{w.path}' is overwritten with its gradient "
                             "(float8 scaling): the runtime does not support it")
        c = getattr(v, "constraint", None)
        if c is not None and w.split and type(c).__name__ not in _ELEMENTWISE_CONSTRAINTS:
            raise ValueError(f"weight '{w.path}' has constraint {type(c).__name__}, "
                             "which reads the whole weight, and the plan splits it: "
                             "pin it replicated or drop the constraint")


def _decays(user: Any, w: WeightInfo) -> bool:
    """Whether Keras's optimizer decays this weight (its exclusions by variable and by
    name, asked of the user's optimizer with the user's variable)."""
    if user.weight_decay is None:
        return False
    if w.variable is None:
        return True
    return bool(user._use_weight_decay(w.variable))


class ShardedOptimizer:
    """One Keras optimizer's update, run functionally on every replica's shards."""

    def __init__(self, optimizer: Any, weights: Sequence[WeightInfo],
                 learning_rate: float | None = None) -> None:
        user = resolve_optimizer(optimizer, learning_rate)
        check_supported(user)
        # translated from tf_keras: its apply_gradients where Keras 3's differs (keras2)
        self.from_tf_keras = bool(getattr(user, keras2.FROM_TF_KERAS, False))
        # a Keras 2 model's reference (keras()): a fresh tf_keras optimizer, the user's own
        self._original = functools.partial(keras2.original, user) if self.from_tf_keras \
            else None
        # dynamic loss scaling (mixed_float16): (initial scale, growth steps), or None
        self.loss_scale: tuple[float, int] | None = None
        self._wrapper = None
        if isinstance(user, keras.optimizers.LossScaleOptimizer):
            self.loss_scale = (float(user.initial_scale), int(user.dynamic_growth_steps))
            self._wrapper = keras.optimizers.serialize(user)
            user = user.inner_optimizer
        self.keras_class = type(user)
        self.name = type(user).__name__.lower()
        self.config = user.get_config()
        self.weights = {w.path: w for w in weights}
        _check_variables(self.weights)
        self.decays = {w.path: _decays(user, w) for w in weights}
        # exclude_from_weight_decay's settings, which get_config does not carry
        self._exclusions = {a: getattr(user, a) for a in _EXCLUSIONS if hasattr(user, a)}
        self.opt = _clone(user)
        self._build(list(weights), user)
        self.has_schedule = not isinstance(self.opt._learning_rate, keras.Variable)
        self.learning_rate = float(np.asarray(
            self.opt._learning_rate if not self.has_schedule
            else self.opt._learning_rate(0)))
        if user.built and int(np.asarray(user.iterations)):
            logging.warning("the optimizer %s has taken %d steps already; its slots are not "
                            "carried over: the parallel job starts the optimizer afresh",
                            type(user).__name__, int(np.asarray(user.iterations)))

    # -- construction -----------------------------------------------------------------------

    def _build(self, weights: list[WeightInfo], user: Any) -> None:
        """Template variables of the shards' shapes, and the clone built on them, deferred
        (nothing allocated) unless the optimizer creates a variable with a constant
        initial value (Nadam), which Keras does not defer."""
        made: dict[int, list[tuple[str, Any]]] = {}

        def recording(reference: Any, name: str | None = None, initializer: Any = "zeros"):
            var = _Functional.add_variable_from_reference(self.opt, reference, name=name,
                                                          initializer=initializer)
            made.setdefault(id(reference), []).append((name or "var", var))
            return var

        self.opt.add_variable_from_reference = recording
        try:
            with keras.StatelessScope(initialize_variables=False):
                self.templates = {w.path: keras.Variable(
                    initializer="zeros", shape=w.local_shape, dtype=w.dtype,
                    trainable=True, name=f"shard{k}") for k, w in enumerate(weights)}
            try:
                with keras.StatelessScope(initialize_variables=False):
                    self.opt.build(list(self.templates.values()))
            except ValueError:   # a constant-initialized variable: build allocated
                made.clear()
                self.opt = _clone(user)
                self.opt.add_variable_from_reference = recording
                self.opt.build(list(self.templates.values()))
        finally:
            self.opt.__dict__.pop("add_variable_from_reference", None)
        self.slots = {p: dict(made.get(id(t), [])) for p, t in self.templates.items()}
        names = {tuple(s) for s in self.slots.values()}
        if len(names) > 1:
            raise ValueError(f"optimizer {self.name} gives weights different slots {names}: "
                             "the runtime needs one set of slots per weight")
        self.slot_names = tuple(next(iter(names))) if names else ()
        slot_ids = {id(v) for s in self.slots.values() for v in s.values()}
        skip = slot_ids | {id(self.opt._iterations), id(self.opt._learning_rate)}
        self.state = {f"state{k}": v for k, v in enumerate(
            v for v in self.opt.variables if id(v) not in skip)}
        _forget_deferred(list(self.templates.values())
                         + [v for s in self.slots.values() for v in s.values()])

    # -- values -------------------------------------------------------------------------------

    def initial_slots(self, path: str) -> dict[str, np.ndarray]:
        """The initial value of each slot of one shard of ``path``."""
        return {k: _initial(v) for k, v in self.slots[path].items()}

    def initial_state(self) -> dict[str, np.ndarray]:
        """The optimizer's own replicated variables (not slots, step or learning rate);
        with loss scaling also ``loss_scale`` (float32) and ``scale_steps`` (int64), as
        Keras's LossScaleOptimizer's ``dynamic_scale`` and ``step_counter``."""
        state = {k: _initial(v) for k, v in self.state.items()}
        if self.loss_scale is not None:
            state["loss_scale"] = np.float32(self.loss_scale[0])
            state["scale_steps"] = np.int64(0)
        return state

    @property
    def use_ema(self) -> bool:
        return bool(self.opt.use_ema)

    def describe(self) -> dict[str, Any]:
        """JSON-able name and config (schedules serialized as Keras does)."""
        config = keras.saving.serialize_keras_object(self.keras_class.from_config(self.config))
        return {"name": self.name, "slots": list(self.slot_names),
                "keras": json.loads(json.dumps(config, default=str))}

    def summary(self) -> str:
        """One line: the class and the settings that differ from Keras's defaults."""
        rate = (type(self.opt._learning_rate).__name__ if self.has_schedule
                else f"{self.learning_rate:g}")
        parts = [f"learning_rate={rate}"]
        for key in ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                    "gradient_accumulation_steps", "loss_scale_factor"):
            value = self.config.get(key)
            if value not in (None, False, 0):
                parts.append(f"{key}={value:g}" if isinstance(value, float) else
                             f"{key}={value}")
        if self.loss_scale is not None:
            parts.append(f"dynamic loss scale from {self.loss_scale[0]:g}")
        return f"{self.keras_class.__name__}({', '.join(parts)})"

    def keras(self) -> Any:
        """A fresh Keras optimizer of the same class and config (Keras's own, unchanged),
        wrapped in its LossScaleOptimizer when it had one; for one translated from
        ``tf_keras``, a fresh ``tf_keras`` optimizer of the user's class and settings (its
        ``apply_gradients`` is what a Keras 2 model's ``fit`` runs)."""
        if self._original is not None:
            return self._original()
        if self._wrapper is not None:
            opt = keras.optimizers.deserialize(self._wrapper)
            inner = opt.inner_optimizer
        else:
            opt = inner = self.keras_class.from_config(self.config)
        for attr, value in self._exclusions.items():
            setattr(inner, attr, value)
        return opt

    def current_learning_rate(self, iterations: Any, variable: Any) -> float:
        """The rate the next step uses: the schedule's at ``iterations`` (steps taken),
        else ``variable``'s value (each a number or a variable)."""
        if not self.has_schedule:
            return float(np.asarray(variable))
        k = self.opt.gradient_accumulation_steps or 1
        return float(np.asarray(self.opt._learning_rate(int(np.asarray(iterations)) // k)))

    # -- the update ---------------------------------------------------------------------------

    def apply(self, values: Mapping[str, tf.Tensor], grads: Mapping[str, Any],
              slots: Mapping[str, Mapping[str, tf.Tensor]], state: Mapping[str, tf.Tensor],
              iterations: tf.Tensor, learning_rate: tf.Tensor,
              sum_squares: Callable[[dict[str, tf.Tensor]], dict[str, tf.Tensor]],
              all_finite: Callable[[tf.Tensor], tf.Tensor] | None = None,
              ) -> tuple[dict[str, tf.Tensor], dict[str, dict[str, tf.Tensor]],
                         dict[str, tf.Tensor]]:
        """One optimizer step on one replica's shards, as Keras's ``apply`` does it.

        ``values``: every trainable weight's shard; ``grads``: its local gradient (None: the
        loss does not depend on it, no update, as Keras); ``slots`` and ``state`` as
        :meth:`initial_slots` / :meth:`initial_state`; ``iterations``: steps taken (int64);
        ``learning_rate``: the rate variable's value (unused under a schedule);
        ``sum_squares({path: local sum of squares})``: the sums over the whole weights
        (a split weight's shards all-reduced); ``all_finite(local flag)``: whether every
        replica's gradients are finite (loss scaling only: the gradients are of the loss
        times ``state["loss_scale"]``; a non-finite one skips the step on every replica
        and halves the scale, as Keras's LossScaleOptimizer). Returns the new weight
        values, slot values and state, each only where it changed; the state's
        ``step_taken`` (int64, 1 or 0) says whether the step counter advances."""
        if self.loss_scale is not None:
            return self._apply_scaled(values, grads, slots, state, iterations,
                                      learning_rate, sum_squares, all_finite)
        opt = self.opt
        paths = [p for p in self.templates if p in values]   # all, or one (apply_one)
        mapping = [(self.templates[p], values[p]) for p in paths]
        mapping += [(self.slots[p][k], slots[p][k]) for p in paths for k in self.slot_names]
        mapping += [(v, state[k]) for k, v in self.state.items()]
        mapping.append((opt._iterations, iterations))
        if not self.has_schedule:
            mapping.append((opt._learning_rate, learning_rate))
        live = [p for p in paths if grads.get(p) is not None]
        with keras.StatelessScope(mapping, initialize_variables=False) as scope:
            g = [grads[p] for p in live]
            if opt.loss_scale_factor is not None:
                g = [_scaled(x, 1.0 / opt.loss_scale_factor) for x in g]
            if opt.gradient_accumulation_steps:
                self._accumulate(scope, live, g, iterations, sum_squares)
            else:
                self._update(live, g, sum_squares)
            if opt.use_ema:
                self._ema(scope, paths)
            self._constrain(live)
        new_values = {p: v for p in paths
                      if (v := scope.get_current_value(self.templates[p])) is not values[p]}
        new_slots = {p: {k: scope.get_current_value(self.slots[p][k])
                         for k in self.slot_names} for p in paths}
        new_slots = {p: s for p, s in new_slots.items()
                     if any(s[k] is not slots[p][k] for k in s)}
        new_state = {k: scope.get_current_value(v) for k, v in self.state.items()}
        new_state["step_taken"] = tf.constant(1, tf.int64)
        return new_values, new_slots, new_state

    def _apply_scaled(self, values: Mapping[str, tf.Tensor], grads: Mapping[str, Any],
                      slots: Mapping[str, Mapping[str, tf.Tensor]],
                      state: Mapping[str, tf.Tensor], iterations: tf.Tensor,
                      learning_rate: tf.Tensor, sum_squares: Callable,
                      all_finite: Callable | None) -> tuple[dict, dict, dict]:
        """Keras's LossScaleOptimizer around :meth:`apply`: the gradients unscaled, the
        step taken only when every replica's are finite, the scale doubled after
        ``dynamic_growth_steps`` finite steps in a row and halved after a non-finite one."""
        if all_finite is None:
            raise ValueError("loss scaling needs all_finite: the runtime's check that every "
                             "replica's gradients are finite")
        live = [g for g in grads.values() if g is not None]
        local = finite_locally(live)
        finite = all_finite(local)
        scale = tf.convert_to_tensor(state["loss_scale"], tf.float32)
        steps = tf.convert_to_tensor(state["scale_steps"], tf.int64)
        unscaled = {p: None if g is None else _divided(g, scale) for p, g in grads.items()}
        inner = {k: v for k, v in state.items() if k in self.state}
        self.loss_scale, saved = None, self.loss_scale
        try:
            new_values, new_slots, new_state = self.apply(
                values, unscaled, slots, inner, iterations, learning_rate, sum_squares)
        finally:
            self.loss_scale = saved
        new_values = {p: tf.where(finite, v, values[p]) for p, v in new_values.items()}
        new_slots = {p: {k: tf.where(finite, v, slots[p][k]) for k, v in s.items()}
                     for p, s in new_slots.items()}
        new_state = {k: tf.where(finite, v, inner[k]) for k, v in new_state.items()
                     if k in inner}
        new_state.update(_next_scale(finite, scale, steps, saved[1], self.from_tf_keras))
        return new_values, new_slots, new_state

    def _update(self, live: list[str], g: list[Any], sum_squares: Callable) -> None:
        """Clipping, weight decay and the optimizer's update step (Keras's order)."""
        opt = self.opt
        g = _clip(opt, live, g, sum_squares, per_slice=self.from_tf_keras)
        if self.from_tf_keras:
            g = [keras2.deduplicated(x) for x in g]
        for p in live:
            if self.decays[p]:
                t = self.templates[p]
                lr = tf.cast(opt.learning_rate, t.dtype)
                wd = tf.cast(opt.weight_decay, t.dtype)
                t.assign(t - t * wd * lr)
        opt._backend_update_step(g, [self.templates[p] for p in live], opt.learning_rate)

    def _accumulate(self, scope: Any, live: list[str], g: list[Any], iterations: tf.Tensor,
                    sum_squares: Callable) -> None:
        """Gradient accumulation: every ``gradient_accumulation_steps``-th step updates with
        the mean of the accumulated gradients and resets them; the others add to them."""
        k = self.opt.gradient_accumulation_steps
        is_update = tf.equal((iterations + 1) % k, 0)
        accs = {p: self.slots[p]["gradient_accumulator"] for p in live}
        summed = [tf.convert_to_tensor(x) + scope.get_current_value(accs[p])
                  for p, x in zip(live, g)]
        acc_ids = {id(v) for v in accs.values()}
        held = [self.templates[p] for p in self.templates]
        held += [v for s in self.slots.values() for v in s.values() if id(v) not in acc_ids]
        held += list(self.state.values())
        before = {id(v): scope.get_current_value(v) for v in held}
        self._update(live, [s / k for s in summed], sum_squares)
        for v in held:
            now = scope.get_current_value(v)
            if now is not before[id(v)]:
                scope.add_update((v, tf.where(is_update, now, before[id(v)])))
        for p, s in zip(live, summed):
            scope.add_update((accs[p], tf.where(is_update, tf.zeros_like(s), s)))

    def _ema(self, scope: Any, paths: list[str]) -> None:
        """Keras's moving average of the weights (of ``paths``), and its periodic
        overwrite."""
        opt = self.opt
        averages = opt._model_variables_moving_average
        index = {id(t): i for i, t in enumerate(opt._trainable_variables)}
        ts = [self.templates[p] for p in paths]
        opt.__dict__["_model_variables_moving_average"] = [averages[index[id(t)]] for t in ts]
        try:   # Keras pairs the variables it is given with its list of averages
            opt._update_model_variables_moving_average(ts)
        finally:
            opt.__dict__["_model_variables_moving_average"] = averages
        if opt.ema_overwrite_frequency:
            now = tf.equal((opt.iterations + 1) % opt.ema_overwrite_frequency, 0)
            for p in paths:
                t, average = self.templates[p], self.slots[p]["average"]
                scope.add_update((t, tf.where(now, scope.get_current_value(average),
                                              scope.get_current_value(t))))

    def _constrain(self, live: list[str]) -> None:
        """The weights' own constraints after the update, as Keras's ``apply``."""
        for p in live:
            c = getattr(self.weights[p].variable, "constraint", None)
            if c is not None:
                t = self.templates[p]
                t.assign(c(t))


def _values(x: Any) -> tf.Tensor:
    return x.values if isinstance(x, tf.IndexedSlices) else x


def finite_locally(grads: Sequence[Any]) -> tf.Tensor:
    """Whether every one of ``grads`` (dense or sparse) is finite on this replica."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads])


def square_sums(paths: Sequence[str], grads: Sequence[Any]) -> dict[str, tf.Tensor]:
    """Per path, this replica's sum of squares of its gradient (what clipping by norm
    sums over the devices)."""
    return {p: tf.reduce_sum(tf.square(_values(x))) for p, x in zip(paths, grads)}


def _divided(x: Any, scale: tf.Tensor) -> Any:
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(x.values / tf.cast(scale, x.values.dtype), x.indices,
                                x.dense_shape)
    return x / tf.cast(scale, x.dtype)


def _scaled(x: Any, scale: Any) -> Any:
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(x.values * tf.cast(scale, x.values.dtype), x.indices,
                                x.dense_shape)
    return x * tf.cast(scale, x.dtype)


def _next_scale(finite: tf.Tensor, scale: tf.Tensor, steps: tf.Tensor, growth_steps: int,
                tf_keras: bool) -> dict[str, tf.Tensor]:
    """Dynamic loss scaling's next ``loss_scale``, ``scale_steps`` and ``step_taken``:
    doubled after ``growth_steps`` finite steps in a row, halved after a non-finite one,
    which is skipped. Keras 3 counts taken steps only; ``tf_keras`` (``tf_keras=True``)
    counts a skipped one too, never halves below 1 and grows only to a finite scale."""
    grow = tf.equal(steps, growth_steps - 1)
    halved, grown = scale * 0.5, scale * 2.0
    if tf_keras:
        halved = tf.maximum(halved, 1.0)
        grown = tf.where(tf.math.is_finite(grown), grown, scale)
    return {"loss_scale": tf.where(finite, tf.where(grow, grown, scale), halved),
            "scale_steps": tf.where(finite & ~grow, steps + 1, tf.zeros_like(steps)),
            "step_taken": tf.ones([], tf.int64) if tf_keras else tf.cast(finite, tf.int64)}


def _clip_by_norm(x: Any, l2sum: tf.Tensor, clipnorm: float) -> Any:
    """``tf.clip_by_norm`` (what Keras's TensorFlow optimizer calls) given the sum of
    squares of the whole weight's gradient."""
    values = _values(x)
    l2sum = tf.cast(l2sum, values.dtype)
    pred = l2sum > 0
    l2sum_safe = tf.where(pred, l2sum, tf.ones_like(l2sum))
    l2norm = tf.where(pred, tf.sqrt(l2sum_safe), l2sum)
    clip = tf.cast(clipnorm, values.dtype)
    clipped = values * clip / tf.maximum(l2norm, clip)
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(clipped, x.indices, x.dense_shape)
    return clipped


def _clip(opt: Any, live: list[str], g: list[Any], sum_squares: Callable,
          per_slice: bool = False) -> list[Any]:
    """Keras's ``clipnorm`` (per weight), ``global_clipnorm`` and ``clipvalue``, with
    the norms of whole weights; ``per_slice``: ``clipvalue`` clips a sparse gradient's
    slices before their duplicates are summed (``tf_keras``), not the dense sum (Keras 3)."""
    if opt.clipnorm and opt.clipnorm > 0:
        sq = sum_squares(square_sums(live, g))
        return [_clip_by_norm(x, sq[p], opt.clipnorm) for p, x in zip(live, g)]
    if opt.global_clipnorm and opt.global_clipnorm > 0:
        sq = sum_squares(square_sums(live, g))
        norm = tf.sqrt(tf.add_n(list(sq.values())))   # every weight's (apply_one too)
        clip = tf.cast(opt.global_clipnorm, norm.dtype)
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
        scale = scale + (norm - norm)   # NaN for a non-finite norm, as Keras
        return [_scaled(x, scale) for x in g]
    if opt.clipvalue and opt.clipvalue > 0:
        v = opt.clipvalue
        return [tf.IndexedSlices(tf.clip_by_value(x.values, -v, v), x.indices, x.dense_shape)
                if per_slice and isinstance(x, tf.IndexedSlices)
                else tf.clip_by_value(tf.convert_to_tensor(x), -v, v) for x in g]
    return g
