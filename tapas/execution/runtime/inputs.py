"""The inputs of a parallel program: the structure the Keras model is called with, the flat
order the program takes, and the checks between a batch and both.

In:  a Keras model and the input specs given to ``tapas.parallelize`` (a ``tf.TensorSpec``,
     a list or tuple, a dict keyed by input name, or a nested structure, as Keras accepts
     for the model), or ``None`` for a model whose inputs have static shapes.
Out: :class:`InputSignature`: one named, static ``tf.TensorSpec`` per model input in the
     program's order, the structure to capture and call the Keras model with
     (:meth:`InputSignature.spec_structure`, :meth:`InputSignature.pack`), and
     :meth:`InputSignature.flatten`, which turns a batch in any accepted form into the
     program's list of arrays, naming the input, the expected shape and dtype and the fix
     when something does not fit. :func:`synthetic_inputs` makes a random batch and
     :func:`synthetic_batch` targets too, for a model that comes without data
     (``tapas train --model=file.keras``).

The program's order is Keras's flattening order (``keras.tree.flatten`` of ``model.input``:
lists in order, dict keys sorted), which is also the order in which ``tf.function`` flattens
the structure when the model is captured, so the two always agree.

A batch may be given as:

* one array, when the model has one input;
* a list or tuple, one array per input in ``model.inputs`` order (Keras's flattening order);
* a dict keyed by input name (the model's dict keys, or its ``keras.Input`` names);
* the very structure the model was built with (a dict, a list with a dict inside, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["InputSignature", "synthetic_inputs", "synthetic_batch", "keras_structure"]


def keras_structure(model: Any) -> Any:
    """The structure of ``KerasTensor`` s the model is called with, or ``None`` (a
    subclassed model, which has no symbolic inputs)."""
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    try:
        flat = list(model.inputs or [])
    except (AttributeError, ValueError):
        return None
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else flat


def _leaf_names(structure: Any) -> list[str]:
    """A name per leaf: its dict key when it sits in a dict, else the ``keras.Input`` (or
    spec) name, else its position; a name that two leaves would share becomes the path."""
    names = []
    pairs = keras.tree.flatten_with_path(structure)
    for k, (path, leaf) in enumerate(pairs):
        if path and isinstance(path[-1], str):
            names.append(path[-1])
        else:
            name = getattr(leaf, "name", None)
            names.append(name.split(":")[0] if name else f"input_{k}")
    if len(set(names)) < len(names):
        names = ["/".join(str(p) for p in path) or f"input_{k}"
                 for k, (path, _) in enumerate(pairs)]
    return names


def _describe(name: str, spec: tf.TensorSpec) -> str:
    return f"'{name}' ({spec.dtype.name} {spec.shape.as_list()})"


@dataclasses.dataclass(frozen=True)
class InputSignature:
    """The model inputs: ``specs`` (named, static, global; the program's order) and the
    structure the Keras model takes (``structure``: that structure with the input index
    ``k`` at each leaf)."""

    specs: tuple[tf.TensorSpec, ...]
    structure: Any

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def describe(self) -> str:
        """``'token_ids' (int32 [8, 16]), ...``: every input, in the program's order."""
        return ", ".join(_describe(n, s) for n, s in zip(self.names, self.specs))

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def of(cls, model: Any, input_spec: Any = None) -> InputSignature:
        """The signature of ``model`` called with ``input_spec`` (module docstring). Every
        spec must be static; it takes the model's input name."""
        template = keras_structure(model)
        if template is None:
            if input_spec is None:
                raise ValueError(f"model '{getattr(model, 'name', model)}' has no symbolic "
                                 "inputs (a subclassed model): pass input_spec, e.g. "
                                 "tf.TensorSpec([8, 16], tf.float32) per input")
            template = input_spec
        names = _leaf_names(template)
        leaves = keras.tree.flatten(template)
        if input_spec is None:
            given = [tf.TensorSpec(tuple(t.shape), t.dtype) for t in leaves]
        else:
            given = _match(input_spec, template, names, "input spec")
        specs = []
        for name, leaf, spec in zip(names, leaves, given):
            if not isinstance(spec, tf.TensorSpec):
                raise ValueError(f"the input spec for input '{name}' is a "
                                 f"{type(spec).__name__}, not a tf.TensorSpec: give e.g. "
                                 f"tf.TensorSpec({_example_shape(leaf)}, tf.{_dtype(leaf)})")
            specs.append(_checked_spec(name, leaf, spec))
        index = keras.tree.pack_sequence_as(template, list(range(len(specs))))
        return cls(tuple(specs), index)

    def per_row(self, rows: int, purpose: str | None = None) -> InputSignature:
        """The signature of one row of a mesh with ``rows`` rows: axis 0 (the batch) of
        every input divided by ``rows`` (``tapas.planning.mesh``). ``purpose``: why the
        batch is divided, for the error of one that does not divide (default: mesh rows)."""
        if rows == 1:
            return self
        specs = []
        for name, spec in zip(self.names, self.specs):
            shape = spec.shape.as_list()
            if not shape or shape[0] % rows:
                raise ValueError(
                    f"input '{name}' has shape {shape}: its batch (axis 0) does not split "
                    + (f"into {rows} ({purpose}); use a batch that is a multiple of {rows}"
                       if purpose else f"into {rows} mesh rows; use a batch that is a "
                       f"multiple of {rows} or fewer rows"))
            specs.append(tf.TensorSpec([shape[0] // rows] + shape[1:], spec.dtype, name=name))
        return dataclasses.replace(self, specs=tuple(specs))

    def spec_structure(self) -> Any:
        """The specs in the model's structure: what ``tapas.capture`` traces the model with."""
        return self.pack(self.specs)

    def pack(self, flat: Sequence[Any]) -> Any:
        """Values in the program's order, put into the structure the Keras model takes."""
        flat = list(flat)
        return keras.tree.map_structure(lambda k: flat[k], self.structure)

    # -- a batch ----------------------------------------------------------------------------

    def flatten(self, x: Any, shapes: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
        """The batch ``x`` (any accepted form) as one array per input, in the program's
        order and dtypes; ``ValueError`` names the input that does not fit and the fix.
        ``shapes``: the shape each input must have (default: the global one; a worker's
        share of it under MultiWorkerMirroredStrategy)."""
        values = _match(x, self.structure, list(self.names), "batch", self.describe())
        shapes = shapes or [None] * len(values)
        return [_checked_array(name, spec, v, shape)
                for name, spec, v, shape in zip(self.names, self.specs, values, shapes)]


def _match(x: Any, template: Any, names: list[str], what: str,
           described: str | None = None) -> list[Any]:
    """The leaves of ``x`` in the order of ``template``'s leaves (named ``names``): ``x`` is
    one value, a flat list/tuple, a dict by name, or ``template``'s own structure."""
    n = len(names)
    described = described or ", ".join(f"'{k}'" for k in names)
    forms = (f"give one value per model input: a dict keyed by input name, a list in this "
             f"order, or the model's own structure; the inputs are {described}")
    if keras.tree.is_nested(template) and keras.tree.is_nested(x):
        try:
            keras.tree.assert_same_structure(keras.tree.lists_to_tuples(x),
                                             keras.tree.lists_to_tuples(template))
            return keras.tree.flatten(x)
        except (ValueError, TypeError):
            pass
    if isinstance(x, Mapping):
        missing = [k for k in names if k not in x]
        if missing:
            also = f" (nor for {', '.join(repr(m) for m in missing[1:])})" if missing[1:] else ""
            raise ValueError(f"the {what} has no value for input '{missing[0]}'{also}: it has "
                             f"keys {sorted(map(str, x))}; {forms}")
        extra = [k for k in x if k not in names]
        if extra:
            raise ValueError(f"the {what} has key {extra[0]!r}, which is no input of the "
                             f"model: {forms}")
        return [x[k] for k in names]
    if isinstance(x, (list, tuple)):
        if len(x) != n or any(keras.tree.is_nested(v) for v in x):
            raise ValueError(f"the {what} is a {type(x).__name__} of {len(x)}, the model "
                             f"takes {n} input(s): {forms}")
        return list(x)
    if n != 1:
        raise ValueError(f"the {what} is one {type(x).__name__}, the model takes {n} "
                         f"inputs: {forms}")
    return [x]


def _dtype(leaf: Any) -> str:
    return tf.as_dtype(getattr(leaf, "dtype", None) or "float32").name


def _example_shape(leaf: Any) -> list:
    shape = getattr(leaf, "shape", None)
    return [8 if d is None else int(d) for d in shape] if shape is not None else [8]


def _checked_spec(name: str, leaf: Any, spec: tf.TensorSpec) -> tf.TensorSpec:
    """``spec`` named ``name`` after checking it against the model's input ``leaf``."""
    shape = spec.shape
    if shape.rank is None or not shape.is_fully_defined():
        raise ValueError(f"input '{name}': the spec has shape {shape}, the program needs a "
                         f"static one (the global batch): e.g. tf.TensorSpec("
                         f"{_example_shape(leaf)}, tf.{_dtype(leaf)})")
    want = getattr(leaf, "shape", None)
    if want is not None and leaf is not spec:
        want = list(want)
        if len(want) != shape.rank or any(w is not None and w != g
                                          for w, g in zip(want, shape.as_list())):
            raise ValueError(f"input '{name}' takes shape {want} (None: any size), the spec "
                             f"says {shape.as_list()}: give tf.TensorSpec("
                             f"{_example_shape(leaf)}, tf.{_dtype(leaf)}) with your batch size")
        want_dt = tf.as_dtype(leaf.dtype)
        if (want_dt.is_integer, want_dt.is_floating) != (spec.dtype.is_integer,
                                                         spec.dtype.is_floating):
            raise ValueError(f"input '{name}' takes {want_dt.name}, the spec says "
                             f"{spec.dtype.name}: use tf.TensorSpec({shape.as_list()}, "
                             f"tf.{want_dt.name})")
    return tf.TensorSpec(shape, spec.dtype, name=name)


def _checked_array(name: str, spec: tf.TensorSpec, value: Any,
                   shape: Sequence[int] | None = None) -> np.ndarray:
    """``value`` as an array of ``spec``'s dtype, after checking its shape (``shape``, by
    default the spec's) and kind."""
    if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        kind = type(value).__name__
        fix = "tf.sparse.to_dense(x)" if kind == "SparseTensor" else "x.to_tensor()"
        raise ValueError(f"input '{name}' is a tf.{kind}; the program takes a dense "
                         f"{spec.dtype.name} {spec.shape.as_list()} (it was captured dense): "
                         f"pass {fix}")
    x = np.asarray(value)
    want = list(shape) if shape is not None else spec.shape.as_list()
    if list(x.shape) != want:
        what = ("the global batch" if shape is None else
                f"this worker's share of the global {spec.shape.as_list()}")
        raise ValueError(f"input '{name}' has shape {list(x.shape)}, the program was built "
                         f"for {want} ({spec.dtype.name}, {what}): pass that shape, "
                         "or parallelize again with a tf.TensorSpec of the new shape")
    if x.dtype.kind == "f" and spec.dtype.is_integer:
        raise ValueError(f"input '{name}' has dtype {x.dtype.name}, the model takes "
                         f"{spec.dtype.name} (ids or a mask): pass integers, e.g. "
                         f"x.astype('{spec.dtype.name}')")
    if x.dtype.kind not in "biuf":
        raise ValueError(f"input '{name}' has dtype {x.dtype}, the model takes "
                         f"{spec.dtype.name}: pass a numeric array")
    return x.astype(spec.dtype.as_numpy_dtype, copy=False)


# ---- a batch for a model without data ---------------------------------------------------------

def _vocabulary(model: Any) -> int:
    """The smallest ``input_dim`` of the model's embeddings: integer inputs drawn below it
    are valid ids for every embedding (and 0/1 masks when it is 2); 2 without one."""
    sizes = [int(layer.input_dim) for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, keras.layers.Embedding)]
    return max(2, min(sizes)) if sizes else 2


def synthetic_inputs(model: Any, signature: InputSignature, seed: int = 0) -> Any:
    """A random batch in the model's input structure: floats standard normal, integers
    below the smallest embedding size, booleans."""
    return _synthetic(model, signature, np.random.default_rng(seed))


def _synthetic(model: Any, signature: InputSignature, rng: np.random.Generator) -> Any:
    high = _vocabulary(model)
    flat = []
    for spec in signature.specs:
        shape = spec.shape.as_list()
        if spec.dtype.is_bool:
            flat.append(rng.integers(0, 2, shape).astype(bool))
        elif spec.dtype.is_integer:
            flat.append(rng.integers(0, high, shape).astype(spec.dtype.as_numpy_dtype))
        else:
            flat.append(rng.standard_normal(shape).astype(spec.dtype.as_numpy_dtype))
    return signature.pack(flat)


def synthetic_batch(model: Any, signature: InputSignature, loss: Any,
                    seed: int = 0, output_shape: Sequence[int] | None = None
                    ) -> tuple[Any, np.ndarray]:
    """A random batch in the model's input structure (:func:`synthetic_inputs`) and targets
    the loss accepts: class ids for a sparse crossentropy, one-hot rows for a crossentropy,
    0/1 for a binary one, standard normal otherwise (shaped like the model's one output).
    ``output_shape``: that output's shape for this batch (a captured graph's,
    ``ParallelModel.graph.outputs[0].shape``), needed when the Keras model's symbolic
    output leaves a dimension open (a backbone's sequence length)."""
    rng = np.random.default_rng(seed)
    xs = _synthetic(model, signature, rng)
    outputs = list(model.outputs)
    if len(outputs) != 1:
        raise ValueError(f"model '{model.name}' has {len(outputs)} outputs: training needs "
                         "one (wrap the model with a head that returns one tensor)")
    if output_shape is not None:
        shape = [signature.specs[0].shape[0], *[int(d) for d in list(output_shape)[1:]]]
    else:
        dims = list(outputs[0].shape[1:])
        if any(d is None for d in dims):
            raise ValueError(f"model '{model.name}' has output shape {tuple(outputs[0].shape)}"
                             ": a dimension beyond the batch is open, so the targets' shape "
                             "is unknown; pass output_shape (the captured graph's: "
                             "ParallelModel.graph.outputs[0].shape)")
        shape = [signature.specs[0].shape[0], *[int(d) for d in dims]]
    kind = type(loss).__name__
    if kind == "SparseCategoricalCrossentropy":
        y = rng.integers(0, shape[-1], shape[:-1])
    elif kind == "CategoricalCrossentropy":
        y = np.eye(shape[-1], dtype="float32")[rng.integers(0, shape[-1], shape[:-1])]
    elif kind == "BinaryCrossentropy":
        y = rng.integers(0, 2, shape).astype("float32")
    else:
        y = rng.standard_normal(shape).astype("float32")
    return xs, y
