"""Keras 2 (``tf_keras``) optimizers, losses, metrics and weight regularizers, as the
runtime reads Keras 3's.

In:  an optimizer, loss or metric object of ``tf_keras`` (the one a Keras 2 model was
     compiled with); a Keras 2 model (its layers' zero-argument losses).
Out: the Keras 3 object of the same class name and settings (:func:`optimizer`,
     :func:`loss`, :func:`metric`: a fresh one, the user's never updated), so a Keras 2
     model trains with what its user compiled; other objects are returned unchanged
     (:func:`is_keras2`, :func:`is_keras2_metric` say which are Keras 2's). A translated
     optimizer keeps the weights excluded from weight decay, a ``LossScaleOptimizer``
     (what ``tf_keras`` compiles under ``mixed_float16``) becomes Keras 3's around the
     translated inner one, and each carries :data:`FROM_TF_KERAS`, for where the runtime
     must follow ``tf_keras``'s ``apply_gradients`` rather than Keras 3's: it sums a sparse
     gradient's duplicate indices (an embedding lookup's, a token twice in the batch) after
     clipping and before the update, where Keras 3 updates with the slices as they are,
     which Adam-like updates square one by one (:func:`deduplicated`); and under dynamic
     loss scaling a skipped step still advances the step counter, and the scale never
     halves below 1.
     :func:`weight_regularizers`: ``{id(variable): regularizer}`` of the weights a Keras 2
     model regularizes (a Keras 3 variable carries its regularizer; a Keras 2 layer keeps a
     zero-argument loss per regularized weight instead).
Raises: ValueError naming the setting that has no Keras 3 counterpart and the Keras 3
     class to build by hand instead; naming a zero-argument loss added with
     ``add_loss(callable)`` that is not a weight's regularizer (the runtime cannot compute
     it on shards).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import keras
import tensorflow as tf

__all__ = ["FROM_TF_KERAS", "ORIGINAL", "deduplicated", "is_keras2", "is_keras2_layer",
           "is_keras2_metric", "loss", "metric", "optimizer", "original", "weight_regularizers"]

#: the attribute set (True) on a Keras 3 optimizer translated from a ``tf_keras`` one
#: (:func:`optimizer`): the runtime's update then does what ``tf_keras`` does where Keras
#: 3 differs (:func:`deduplicated` sparse gradients; loss scaling's skipped steps counted)
FROM_TF_KERAS = "_tapas_from_tf_keras"
#: the attribute holding, on a translated optimizer, a function of the learning rate (None:
#: the user's) that builds a fresh ``tf_keras`` optimizer of the user's class and settings:
#: ``verify``'s reference steps a Keras 2 model with it (:func:`original`)
ORIGINAL = "_tapas_tf_keras_original"

#: settings Keras 2 writes into every config that mean nothing to Keras 3
_IGNORED = {"name", "jit_compile", "is_legacy_optimizer", "fn"}
#: Keras 2 loss reductions -> Keras 3's
_REDUCTIONS = {"auto": "sum_over_batch_size", "sum_over_batch_size": "sum_over_batch_size",
               "sum": "sum", "none": "none"}


def is_keras2(obj: Any) -> bool:
    """Whether ``obj`` comes from ``tf_keras`` (or TensorFlow's bundled Keras 2)."""
    module = type(obj).__module__
    return module.startswith(("tf_keras", "keras.src.legacy", "tensorflow.python.keras"))


def _defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k not in ("self", "args", "kwargs")}


def _twin(obj: Any, module: Any, base: type, what: str, fix: str, label: str = "") -> type:
    """The Keras 3 class of ``module`` named as ``obj``'s class (a subclass of ``base``),
    or ValueError saying that the Keras 2 ``what`` (``label``: its name) has none, and
    the ``fix``."""
    name = type(obj).__name__
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"the Keras 2 {what} {name}{label} has no Keras 3 class of that "
                         f"name: {fix}")
    return cls


def _translate(obj: Any, cls: type, what: str, config: dict[str, Any]) -> dict[str, Any]:
    accepted = _defaults(cls)
    out = {}
    for key, value in config.items():
        if key in _IGNORED:
            continue
        if key not in accepted:
            if value in (None, False, 0):
                continue
            raise ValueError(f"the Keras 2 {what} {type(obj).__name__} sets {key}={value!r}, "
                             f"which keras.{what}s.{cls.__name__} (Keras 3) has no setting "
                             f"for: compile the model with a keras.{what}s.{cls.__name__} "
                             "built by hand, or pass it to tapas.parallelize")
        out[key] = value
    return out


def optimizer(obj: Any) -> Any:
    """The Keras 3 optimizer equivalent to a ``tf_keras`` one (same class, same settings;
    a learning-rate schedule rebuilt from its config)."""
    if not is_keras2(obj):
        return obj
    name = type(obj).__name__
    if name.startswith("LossScaleOptimizer"):
        return _loss_scaled(obj)
    cls = _twin(obj, keras.optimizers, keras.optimizers.Optimizer, "optimizer",
                "compile the model with a keras.optimizers optimizer (Keras 3)")
    config = _translate(obj, cls, "optimizer", dict(obj.get_config()))
    lr = config.get("learning_rate")
    if isinstance(lr, dict):
        lr = {**lr, "config": {k: v for k, v in lr.get("config", {}).items()
                               if not (k == "name" and v is None)}}
        try:
            config["learning_rate"] = keras.optimizers.schedules.deserialize(lr)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the Keras 2 optimizer {name}'s learning-rate schedule "
                             f"{lr.get('class_name')} has no Keras 3 equivalent ({e}): build "
                             f"keras.optimizers.{name} with a keras.optimizers.schedules "
                             "schedule") from None
    elif lr is not None:
        config["learning_rate"] = float(lr)
    out = cls(**config)
    # exclude_from_weight_decay's settings, which get_config does not carry: the names as
    # Keras 3 takes them, the variables by the key both Kerases give a tf.Variable
    names = list(getattr(obj, "_exclude_from_weight_decay_names", None) or ())
    keys = set(getattr(obj, "_exclude_from_weight_decay", None) or ())
    if names or keys:
        out.exclude_from_weight_decay(var_names=names or None)
        out._exclude_from_weight_decay = keys
    setattr(out, FROM_TF_KERAS, True)
    user_class, user_config = type(obj), dict(obj.get_config())

    def fresh(rate: float | None = None) -> Any:
        config = user_config if rate is None else {**user_config, "learning_rate": rate}
        twin = user_class.from_config(config)
        twin._exclude_from_weight_decay_names = list(names)
        twin._exclude_from_weight_decay = list(keys)
        return twin
    setattr(out, ORIGINAL, fresh)
    return out


def original(opt: Any, learning_rate: float | None = None) -> Any:
    """A fresh ``tf_keras`` optimizer like the one ``opt`` (a Keras 3 optimizer or
    ``LossScaleOptimizer``) was translated from, at ``learning_rate`` if given; None when
    ``opt`` was not translated from ``tf_keras``."""
    fresh = getattr(opt, ORIGINAL, None)
    return None if fresh is None else fresh(learning_rate)


def is_keras2_metric(obj: Any) -> bool:
    """Whether ``obj`` is a ``tf_keras`` metric object (one of the user's subclasses too)."""
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(obj, tf_keras.metrics.Metric)


def metric(obj: Any) -> Any:
    """A fresh Keras 3 metric equivalent to a ``tf_keras`` metric object (same class, name
    and settings). Keras 3 would otherwise call the Keras 2 object as a function and
    average what its running state returns batch by batch."""
    if not is_keras2_metric(obj):
        return obj
    cls = _twin(obj, keras.metrics, keras.metrics.Metric, "metric",
                "compile the model with the metric's name as a string (e.g. 'accuracy', "
                "'mae'), or pass a keras.metrics metric built by hand", f" ('{obj.name}')")
    config = dict(obj.get_config())
    keep = {k: v for k, v in config.items() if k == "name"}
    return cls(**keep, **_translate(obj, cls, "metric", config))


def _loss_scaled(obj: Any) -> Any:
    """Keras 3's ``LossScaleOptimizer`` for ``tf_keras``'s (``LossScaleOptimizerV3``, what
    ``compile`` wraps the optimizer in under ``mixed_float16``): the inner optimizer
    translated, the same initial scale and growth steps."""
    if not getattr(obj, "dynamic", True):
        raise ValueError(f"the Keras 2 optimizer {type(obj).__name__} has a fixed loss scale "
                         f"({obj.initial_scale}): keras.optimizers.LossScaleOptimizer (Keras "
                         "3) scales dynamically only; build the tf_keras LossScaleOptimizer "
                         "with dynamic=True, or train without loss scaling")
    inner = optimizer(obj.inner_optimizer)
    out = keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=float(obj.initial_scale),
        dynamic_growth_steps=int(obj.dynamic_growth_steps))
    setattr(out, FROM_TF_KERAS, True)
    wrapper, scale, steps = type(obj), float(obj.initial_scale), int(obj.dynamic_growth_steps)
    setattr(out, ORIGINAL, lambda rate=None: wrapper(
        original(inner, rate), initial_scale=scale, dynamic_growth_steps=steps))
    return out


def deduplicated(grad: Any) -> Any:
    """``grad`` with the values of each repeated index summed into one slice, as
    ``tf_keras``'s ``apply_gradients`` passes a sparse gradient (``tf.IndexedSlices``) to
    its update: the indices in order of first appearance. Anything else unchanged."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def loss(obj: Any) -> Any:
    """The Keras 3 loss equivalent to a ``tf_keras`` loss object (same class, same
    settings, the reduction renamed). Hugging Face's ``dummy_loss`` (what its TF models
    compile when given no loss: the model computes its own loss from labels in ``x``) is
    refused with the fix."""
    if getattr(obj, "__name__", "") == "dummy_loss" and \
            str(getattr(obj, "__module__", "")).startswith("transformers"):
        raise ValueError(
            "the model was compiled without a loss: a Hugging Face TF model then computes "
            "its own loss from labels passed inside x (transformers' dummy_loss), which the "
            "parallel program does not take; compile it with the loss of its head, e.g. "
            "model.compile(optimizer, loss=tf_keras.losses.SparseCategoricalCrossentropy("
            "from_logits=True)), and pass the labels as y")
    if not is_keras2(obj):
        return obj
    cls = _twin(obj, keras.losses, keras.losses.Loss, "loss",
                "pass loss=<a keras.losses.Loss> (Keras 3) to tapas.parallelize")
    config = dict(obj.get_config())
    if "reduction" in config:
        config["reduction"] = _REDUCTIONS.get(config["reduction"], config["reduction"])
    return cls(**_translate(obj, cls, "loss", config))


def weight_regularizers(model: Any) -> dict[int, Any]:
    """``{id(variable): regularizer}`` for every weight a Keras 2 ``model`` regularizes.

    ``tf_keras``'s ``add_weight(regularizer=...)`` (a layer's ``kernel_regularizer``,
    ``bias_regularizer``...) does not put the regularizer on the variable, as Keras 3
    does: the layer keeps ``functools.partial(_loss_for_variable, variable)``, a closure
    over the regularizer, among its zero-argument losses (``_callable_losses``, what
    ``model.losses`` evaluates). Empty for a Keras 3 model. Raises ValueError for any
    other zero-argument loss (``model.add_loss(lambda: ...)``): it reads whole variables
    of the user's choosing, which the runtime does not hold."""
    if not is_keras2_layer(model):
        return {}
    found: dict[int, Any] = {}
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    for layer in layers:
        for tagged in getattr(layer, "_callable_losses", None) or ():
            # add_loss wraps each one: functools.partial(_tag_callable, loss)
            loss = tagged.args[0] if getattr(tagged, "args", None) else tagged
            variable, regularizer = _regularized(loss)
            if variable is None:
                raise ValueError(
                    f"the Keras 2 layer '{layer.name}' has a loss added with add_loss("
                    f"{getattr(loss, '__name__', type(loss).__name__)}), a function of no "
                    "arguments that reads whole variables: tapas computes a weight's "
                    "regularizer on its shards and the losses a layer's call adds, but not "
                    "such a function. Give the layer a kernel_regularizer (or "
                    "bias_regularizer...) instead, or call self.add_loss(tensor) inside a "
                    "layer's call")
            found[id(variable)] = regularizer
    return found


def is_keras2_layer(model: Any) -> bool:
    """Whether ``model`` is a ``tf_keras`` layer or model (a user's subclass too)."""
    return any(c.__module__.startswith(("tf_keras", "keras.src.legacy",
                                        "tensorflow.python.keras"))
               for c in type(model).__mro__)


def _regularized(loss: Any) -> tuple[Any, Any]:
    """(variable, regularizer) of a zero-argument loss ``tf_keras`` made for a weight's
    regularizer (``Layer._handle_weight_regularization``), else (None, None)."""
    func = getattr(loss, "func", None)
    if getattr(func, "__name__", "") != "_loss_for_variable" or len(loss.args) != 1:
        return None, None
    cells = dict(zip(func.__code__.co_freevars, func.__closure__ or ()))
    if "regularizer" not in cells:
        return None, None
    return loss.args[0], cells["regularizer"].cell_contents
