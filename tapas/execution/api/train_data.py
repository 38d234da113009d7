"""``tapas train --data``: the training data files a job reads.

In:  a ``--data`` value (an ``.npz`` path, or TFRecord files: one path, a comma-separated
     list or glob patterns) and the ParallelModel whose inputs and output they feed.
Out: the arrays by input name and the targets (:func:`load_npz`), a ``tf.data.Dataset``
     of global batches (:func:`load_tfrecord`), the files named (:func:`data_files`), and
     the writer of the TFRecord layout (:func:`save_tfrecord`).
Raises: :class:`TrainError` naming the file, what it holds and what the model takes.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["TrainError", "data_files", "load_npz", "load_tfrecord", "save_tfrecord",
           "tf_errors"]


class TrainError(RuntimeError):
    """``tapas train`` could not run (bad options, a failed worker)."""


def load_npz(path: str, pm: Any) -> tuple[dict[str, Any], Any]:
    """(inputs by name, targets) from an ``.npz`` holding one array per model input, named
    by input name (``pm.inputs.names``; ``x`` for a one-input model also), and ``y``."""
    import numpy as np
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    names = list(pm.inputs.names)
    if len(names) == 1 and "x" in arrays and names[0] not in arrays:
        arrays[names[0]] = arrays.pop("x")
    missing = [k for k in names + ["y"] if k not in arrays]
    extra = sorted(set(arrays) - set(names) - {"y"})
    if missing or extra:
        raise TrainError(f"--data={path}: it holds {sorted(arrays)}; the model's inputs are "
                         f"{pm.inputs.describe()} (per example; the first axis counts the "
                         f"examples) plus the targets 'y': missing {missing}, unexpected "
                         f"{extra}. Save it with np.savez(path, y=targets, "
                         f"{', '.join(f'{k}=...' for k in names)})")
    return {k: arrays[k] for k in names}, arrays["y"]


def tf_errors() -> type:
    """TensorFlow's error base class (reading a file that is not a TFRecord raises one)."""
    import tensorflow as tf
    return tf.errors.OpError


def data_files(spec: str) -> list[str]:
    """The files ``--data`` names: one path, a comma-separated list or glob patterns (in
    sorted order within a pattern); [] when none exists."""
    import glob
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        out += sorted(glob.glob(part)) if glob.has_magic(part) else \
            ([part] if os.path.exists(part) else [])
    return out


def _target_shape(pm: Any, size: int, path: str) -> list[int]:
    """The per-example shape of targets with ``size`` values: the output's per-example
    shape, or that without its last axis (class ids for a crossentropy over logits), or a
    scalar."""
    import numpy as np
    out = list((getattr(pm.program, "output_shapes", None) or [[0]])[0])[1:]
    for shape in (out, out[:-1], []):
        if int(np.prod(shape, dtype=np.int64)) == size:
            return shape
    raise TrainError(f"--data={path}: the feature 'y' holds {size} values per example, but "
                     f"the model's output has per-example shape {out}: give targets of "
                     f"that shape, of {out[:-1]} (class ids), or one value per example")


def save_tfrecord(path: str, x: Any, y: Any) -> str:
    """Write examples as ``--data`` reads them: one ``tf.train.Example`` per example, a
    feature per model input (``x``: a dict by input name, or one array named ``x``) and
    ``y``, each flattened (``int64_list`` for integer arrays, ``float_list`` otherwise)."""
    import numpy as np
    import tensorflow as tf
    arrays = dict(x) if isinstance(x, dict) else {"x": x}
    arrays["y"] = y
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    n = len(arrays["y"])
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(n):
            feature = {}
            for k, v in arrays.items():
                flat = v[i].reshape(-1)
                feature[k] = (tf.train.Feature(int64_list=tf.train.Int64List(value=flat))
                              if v.dtype.kind in "biu" else
                              tf.train.Feature(float_list=tf.train.FloatList(value=flat)))
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
    return path


def load_tfrecord(spec: str, pm: Any) -> Any:
    """A ``tf.data.Dataset`` of (inputs by name, targets) global batches from TFRecord
    files of ``tf.train.Example`` records (:func:`save_tfrecord`'s layout): a feature per
    model input, named by input name (``x`` for a one-input model also), holding the
    example's values flattened (its per-example shape is the input's), and ``y`` (the
    per-example shape: the output's, the output's without its last axis for class ids, or
    one value). Files are read in the order given; the last partial batch is dropped."""
    import numpy as np
    import tensorflow as tf
    files = data_files(spec)
    first = next(iter(tf.data.TFRecordDataset(files[:1]).take(1)), None)
    if first is None:
        raise TrainError(f"--data={spec}: {files[0]} holds no record")
    example = tf.train.Example.FromString(first.numpy()).features.feature
    names = list(pm.inputs.names)
    keys = dict(zip(names, names))
    if len(names) == 1 and "x" in example and names[0] not in example:
        keys[names[0]] = "x"
    missing = [k for k in list(keys.values()) + ["y"] if k not in example]
    extra = sorted(set(example) - set(keys.values()) - {"y"})
    if missing or extra:
        raise TrainError(f"--data={spec}: its records hold the features {sorted(example)}; "
                         f"the model's inputs are {pm.inputs.describe()} (per example) plus "
                         f"the targets 'y': missing {missing}, unexpected {extra} "
                         "(tapas.execution.api.train.save_tfrecord writes the layout)")

    def kind(feature: Any) -> tuple[Any, int]:
        which = feature.WhichOneof("kind")
        values = getattr(feature, which).value
        return (tf.int64 if which == "int64_list" else tf.float32), len(values)

    parse, shapes = {}, {}
    for name, spec_ in zip(names, pm.inputs.specs):
        dtype, size = kind(example[keys[name]])
        shape = spec_.shape.as_list()[1:]
        if size != int(np.prod(shape, dtype=np.int64)):
            raise TrainError(f"--data={spec}: feature '{keys[name]}' holds {size} values per "
                             f"example, input '{name}' takes per-example shape {shape}")
        parse[keys[name]], shapes[name] = tf.io.FixedLenFeature(shape, dtype), spec_.dtype
    y_dtype, y_size = kind(example["y"])
    parse["y"] = tf.io.FixedLenFeature(_target_shape(pm, y_size, spec), y_dtype)

    def decode(record: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        f = tf.io.parse_single_example(record, parse)
        return ({name: tf.cast(f[keys[name]], shapes[name]) for name in names},
                tf.cast(f["y"], tf.int32 if y_dtype == tf.int64 else tf.float32))

    batch = int(pm.inputs.specs[0].shape[0])
    return tf.data.TFRecordDataset(files).map(decode).batch(batch, drop_remainder=True)
