"""Models whose weights are never allocated whole, and the weights' values one at a time.

In:  a function that builds a Keras model (:func:`build_lazily`); a Keras model and the
     paths of the weights a program keeps (:func:`weight_values`).
Out: :func:`build_lazily` returns the model with every weight (``model.weights``)
     unallocated: its Keras variable holds a ``tf.Variable`` handle created without a value
     (TensorFlow's ``UninitializedVariable``: a capture traces it, nothing reads it) and
     keeps its Keras initializer; every other variable (seed-generator states) is
     initialized as Keras would. :func:`weight_values` is a mapping ``{path: NumPy value}``
     that computes each value when it is read, not before (an allocated weight's
     ``numpy()``; an unallocated one's initializer, whose draws are those Keras's eager
     build makes for the same seed: a Keras initializer holds an integer seed, drawn when
     the layer is constructed, and draws statelessly from it), so the runtime holds one
     whole weight at a time while it cuts the shards (``tapas.execution.runtime.shards``).
     :func:`is_lazy` tells a model built so.
Raises: ValueError naming the weight when an unallocated weight is read without its
     initializer (a model not built by :func:`build_lazily`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
# TensorFlow's variable without a value (what tf.saved_model loads into): private, used
# only here
from tensorflow.python.ops.resource_variable_ops import UninitializedVariable

__all__ = ["build_lazily", "is_lazy", "weight_values", "LAZY_ATTRIBUTE"]

LAZY_ATTRIBUTE = "_tapas_lazy_weights"


def build_lazily(build: Callable[[], Any]) -> Any:
    """``build()`` inside ``keras.StatelessScope`` (Keras defers every variable's
    initialization there); then each weight gets an unallocated handle of its shape and
    dtype and keeps its initializer, and the other variables are initialized now. The
    Keras seed must be set (``keras.utils.set_random_seed``) before, as for an eager build
    that the values are to equal."""
    from keras.src.backend.common import global_state
    with keras.StatelessScope(initialize_variables=False):
        model = build()
    pending = list(global_state.get_global_attribute("uninitialized_variables") or [])
    weights = {id(w) for w in model.weights}
    lazy = []
    for v in pending:
        if id(v) in weights:
            v._initialize(UninitializedVariable(   # a handle without a value: no memory
                shape=v.shape, dtype=v.dtype, trainable=v.trainable, name=v.name))
            lazy.append(v)
    rest = [v for v in pending if id(v) not in weights]
    global_state.set_global_attribute("uninitialized_variables", [])
    for v in rest:
        v._deferred_initialize()
    setattr(model, LAZY_ATTRIBUTE, {id(v) for v in lazy})
    return model


def is_lazy(model: Any) -> bool:
    """Whether ``model`` was built by :func:`build_lazily` (its weights unallocated)."""
    return bool(getattr(model, LAZY_ATTRIBUTE, None))


class _Values(Mapping):
    """``{path: value}`` computed on reading (module docstring)."""

    def __init__(self, variables: Mapping[str, Any], lazy: set[int]) -> None:
        self._variables, self._lazy = dict(variables), lazy

    def __getitem__(self, path: str) -> np.ndarray:
        v = self._variables[path]
        if id(v) not in self._lazy:
            return np.asarray(v.numpy())
        init = getattr(v, "_initializer", None)
        if init is None:
            raise ValueError(f"weight '{path}' is unallocated and has no initializer: build "
                             "the model with tapas.execution.runtime.materialize.build_lazily")
        with tf.device("/cpu:0"):
            return np.asarray(init(tuple(v.shape), dtype=v.dtype))

    def __contains__(self, path: object) -> bool:   # (Mapping's would compute the value)
        return path in self._variables

    def __iter__(self) -> Iterator[str]:
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._variables[path].shape)

    def dtype(self, path: str) -> str:
        return tf.as_dtype(self._variables[path].dtype).name


def weight_values(model: Any, paths: Any) -> _Values:
    """The values of the weights of ``model`` named in ``paths`` (the program's), each
    computed when it is read (module docstring)."""
    from tapas import capturing
    variables = capturing.weights_by_path(model)
    return _Values({p: v for p, v in variables.items() if p in paths},
                   getattr(model, LAZY_ATTRIBUTE, set()) or set())
