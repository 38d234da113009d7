"""Keras ``fit``'s data conveniences, turned into what :func:`tapas.execution.api.fit.fit`
runs: ``validation_split``, ``class_weight``, ``validation_freq``.

In:  fit's ``x``, ``y``, ``sample_weight`` and ``validation_data`` (arrays, or a
     ``tf.data.Dataset``, ``keras.utils.PyDataset`` or generator of ``(x, y[,
     sample_weight])`` global batches), and those arguments as Keras's ``Model.fit`` takes
     them.
Out: :func:`split_for_validation`: the arrays' last ``validation_split`` of the examples
     as the validation data, the rest to train on (Keras's own cut); :func:`by_class`:
     sample weights from ``class_weight`` (Keras's own helpers: each example weighted by
     its class, a one-hot or probability target by its argmax; a dataset mapped as Keras
     maps it, a PyDataset's batches weighted as Keras's adapter weighs them);
     :func:`validates`: whether an epoch ends with a validation pass.
Raises: ValueError naming the argument, the constraint and the fix (both ``class_weight``
     and ``sample_weight``, ``class_weight`` with several outputs, a dataset function or a
     generator, ``validation_split`` with anything but arrays or outside [0, 1), a
     ``validation_freq`` that is neither a positive count nor a list of epochs).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils
from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

__all__ = ["by_class", "split_for_validation", "validates"]


def split_for_validation(x: Any, y: Any, sample_weight: Any, validation_split: float,
                         validation_data: Any) -> tuple[Any, Any, Any, Any]:
    """(x, y, sample_weight, validation_data) after Keras's ``validation_split``: the last
    ``floor(n * validation_split)`` examples (before any shuffling) become the validation
    data, unless ``validation_data`` is given, which wins (as in Keras)."""
    if not 0.0 <= float(validation_split) < 1.0:
        raise ValueError(f"validation_split={validation_split}: give a fraction in [0, 1) "
                         "of the examples to hold out (the last ones, as Keras)")
    if not validation_split or validation_data is not None:
        return x, y, sample_weight, validation_data
    kind = ("tf.data.Dataset" if isinstance(x, tf.data.Dataset) else
            "keras.utils.PyDataset" if isinstance(x, keras.utils.PyDataset) else
            "generator" if isinstance(x, types.GeneratorType) else
            "dataset function" if callable(x) else None)
    if kind is not None:
        raise ValueError(f"validation_split={validation_split} with a {kind}: Keras splits "
                         "arrays only; pass validation_data=<another dataset> (or arrays "
                         "for x and y)")
    (x, y, sample_weight), (vx, vy, vw) = array_slicing.train_validation_split(
        (x, y, sample_weight), validation_split=validation_split)
    return x, y, sample_weight, (vx, vy) if vw is None else (vx, vy, vw)


def by_class(x: Any, y: Any, sample_weight: Any,
             class_weight: Mapping[int, float] | None) -> tuple[Any, Any]:
    """(x, sample_weight) with ``class_weight`` ({class index: weight}) turned into sample
    weights as Keras's ``fit`` does: per example for arrays; a dataset's or a PyDataset's
    ``(x, y)`` batches become ``(x, y, weights)``."""
    if class_weight is None:
        return x, sample_weight
    if not isinstance(class_weight, Mapping):
        raise ValueError(f"class_weight={class_weight!r}: give a dict of class index -> "
                         "weight, e.g. {0: 1.0, 1: 5.0}")
    if sample_weight is not None:
        raise ValueError("class_weight and sample_weight were both given: Keras takes one "
                         "or the other; fold the class weights into sample_weight")
    if isinstance(x, tf.data.Dataset):
        return x.map(make_class_weight_map_fn(class_weight)), None
    if isinstance(x, keras.utils.PyDataset):
        return _ClassWeighted(x, class_weight), None
    if isinstance(x, types.GeneratorType):
        raise ValueError("class_weight with a generator: Keras does not take it either; "
                         "yield (x, y, sample_weight) batches, or give a keras.utils."
                         "PyDataset or a tf.data.Dataset")
    if callable(x):
        raise ValueError("class_weight with a dataset function: map the class weights into "
                         "its (x, y, sample_weight) batches, or pass a tf.data.Dataset")
    if isinstance(y, (list, tuple, Mapping)):
        raise ValueError("class_weight with several outputs: Keras supports it for one "
                         "output only; pass sample_weight per output instead")
    return x, data_adapter_utils.class_weight_to_sample_weights(np.asarray(y), class_weight)


class _ClassWeighted(keras.utils.PyDataset):
    """A PyDataset's batches with sample weights from ``class_weight``, as Keras's
    PyDataset adapter adds them."""

    def __init__(self, source: Any, class_weight: Mapping[int, float]) -> None:
        super().__init__()
        self.source, self.class_weight = source, class_weight

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_batches(self) -> int | None:
        return self.source.num_batches

    def __getitem__(self, i: int) -> tuple:
        batch = tuple(self.source[i])
        if len(batch) != 2:
            raise ValueError(f"class_weight with a PyDataset whose batches are "
                             f"{len(batch)}-tuples: it takes (x, y) batches; fold the class "
                             "weights into their sample weights instead")
        x, y = batch
        return x, y, data_adapter_utils.class_weight_to_sample_weights(np.asarray(y),
                                                                       self.class_weight)

    def on_epoch_begin(self) -> None:
        self.source.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.source.on_epoch_end()


def validates(epoch: int, validation_freq: Any) -> bool:
    """Whether epoch ``epoch`` (0-based) ends with validation: every ``validation_freq``-th
    epoch for a count, the (1-based) epochs listed for a list, as Keras's ``fit``."""
    if isinstance(validation_freq, bool) or not (
            (isinstance(validation_freq, int) and validation_freq >= 1)
            or (isinstance(validation_freq, (list, tuple))
                and all(isinstance(e, int) for e in validation_freq))):
        raise ValueError(f"validation_freq={validation_freq!r}: give a count >= 1 (validate "
                         "every that many epochs) or a list of 1-based epochs")
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
