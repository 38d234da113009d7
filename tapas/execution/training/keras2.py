"""Keras 2 (``tf_keras``) optimizers and losses as their Keras 3 equivalents.

In:  an optimizer or loss object of ``tf_keras`` (the one a Keras 2 model was compiled with).
Out: the Keras 3 object of the same class name and settings (:func:`optimizer`,
     :func:`loss`), so a Keras 2 model trains with what its user compiled; other objects are
     returned unchanged (:func:`is_keras2` says which are Keras 2's).
Raises: ValueError naming the setting that has no Keras 3 counterpart and the Keras 3
     class to build by hand instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras

__all__ = ["is_keras2", "loss", "optimizer"]

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
    cls = getattr(keras.optimizers, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"the Keras 2 optimizer {name} has no Keras 3 class of that name: "
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
    return cls(**config)


def loss(obj: Any) -> Any:
    """The Keras 3 loss equivalent to a ``tf_keras`` loss object (same class, same
    settings, the reduction renamed)."""
    if not is_keras2(obj):
        return obj
    name = type(obj).__name__
    cls = getattr(keras.losses, name, None)
    if not (isinstance(cls, type) and issubclass(cls, keras.losses.Loss)):
        raise ValueError(f"the Keras 2 loss {name} has no Keras 3 class of that name: pass "
                         "loss=<a keras.losses.Loss> (Keras 3) to tapas.parallelize")
    config = dict(obj.get_config())
    if "reduction" in config:
        config["reduction"] = _REDUCTIONS.get(config["reduction"], config["reduction"])
    return cls(**_translate(obj, cls, "loss", config))
