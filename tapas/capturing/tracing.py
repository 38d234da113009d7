"""Capture: a Keras model or ``tf.function`` becomes a ``tapas.ir.Graph`` (paper 4.2).

In:  a Keras 3 model (or built layer), a ``tf.function``, or a ``ConcreteFunction``, plus
     input specs (``tf.TensorSpec``: one, a list, a dict, or the nested structure the
     model is called with) with static shapes. A dict's specs are listed in the order
     ``tf.function`` flattens it (keys sorted): the order of the graph's inputs.
Out: :class:`tapas.ir.Graph` of GraphNodes (see ``tapas.capturing.grouping`` for how ops are
     grouped), with every weight mapped back to its Keras variable path.

Two steps, timed separately by the benchmark:

* :func:`trace` -- trace a concrete function with static shapes (``training=False`` by
  default) and find which resource placeholder stands for which model variable, through
  the concrete function's captures (not through name scopes, which Keras renumbers).
* :func:`to_ir` -- read the ``tf.Graph`` into plain op records and group them.

:func:`capture` does both. Example::

    graph = tapas.capture(model, tf.TensorSpec([8, 128], tf.int32))
    print(graph.kind_counts())
"""

from __future__ import annotations

import dataclasses
import gc
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import keras

from tapas.capturing import grouping, lowering
from tapas import ir

__all__ = ["capture", "trace", "to_ir", "Trace", "CaptureError"]

_SMALL_CONST = 16  # constants with at most this many elements keep their value in the IR
# Attributes that never matter for what an op computes; skipped when reading ops.
_SKIP_ATTRS = frozenset({"value", "_class", "_output_shapes", "_XlaCompile", "f", "config",
                         "config_proto", "executor_type", "_read_only_resource_inputs",
                         "_collective_manager_ids", "_has_manual_control_dependencies",
                         "shared_name", "container", "debug_name",
                         # a py_function's registry key: new at every capture of the same
                         # model (the function is the same; the replay reuses the op)
                         "token"})


class CaptureError(ValueError):
    """The model or its input specs cannot be traced; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """A traced model: the concrete function and the variables its placeholders stand for."""

    concrete_function: Any                     # tf.types.experimental.ConcreteFunction
    input_specs: tuple[tf.TensorSpec, ...]
    input_names: tuple[str, ...]               # names of the graph-input placeholder ops
    variables: Mapping[str, Any]               # placeholder op name -> variable
    weights: Mapping[str, ir.WeightInfo]       # placeholder op name -> WeightInfo
    model_weights: tuple[ir.WeightInfo, ...]   # every weight the model owns
    name: str
    seconds: float
    # weight path -> sharding pin of the tapas.layers layer that owns it (``shard=``)
    pins: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # placeholder op name -> a model variable the graph reads that is no weight: the
    # state of a Keras SeedGenerator (dropout in training mode), read and advanced by the
    # step (tapas.execution.program.stateful)
    states: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # placeholder op name -> the path of that state, unique as weight paths are
    # (:func:`state_paths`)
    state_paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # placeholder op name -> the value of a tensor the traced function captured from
    # Python (an eager tensor a layer computed once, e.g. keras-hub Swin's relative
    # position index): a constant of the program, like a Const op
    constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # names of the tensors the model's call added as losses (a layer's activity
    # regularizer, ``self.add_loss``): Keras adds their sums to the training loss; the IR
    # lists them after the model's outputs (``ir.Graph.call_losses``)
    call_losses: tuple[str, ...] = ()

    @property
    def graph(self) -> tf.Graph:
        return self.concrete_function.graph


def capture(model_or_function: Any, input_spec: Any = None, *, batch_size: int | None = None,
            training: bool = False, name: str | None = None) -> ir.Graph:
    """Trace ``model_or_function`` with ``input_spec`` and convert it into GraphNodes.

    Args:
      model_or_function: a Keras model or built layer, a ``tf.function`` or a
        ``ConcreteFunction``.
      input_spec: a ``tf.TensorSpec``, a list/tuple of them (one per model input) or a
        dict keyed by input name. May be omitted for a Keras model that knows its inputs.
      batch_size: fills an unknown leading (batch) dimension, in the spec or in the model's
        own inputs.
      training: trace the training-mode graph (dropout, batch-norm statistics updates).
      name: the Graph's name (default: the model's name).
    """
    return to_ir(trace(model_or_function, input_spec, batch_size=batch_size,
                       training=training, name=name))


# ---- tracing ---------------------------------------------------------------------------

def _sorted_dicts(spec: Any) -> Any:
    """``spec`` with every dict's keys in sorted order (the order ``tf.nest`` and Keras
    flatten them in): the same model traced from a dict in another key order must give the
    same graph, GraphNode ids included, or a plan made on one capture does not fit the
    other."""
    if isinstance(spec, dict):
        return {k: _sorted_dicts(spec[k]) for k in sorted(spec)}
    if isinstance(spec, (list, tuple)) and not hasattr(spec, "_fields"):
        return type(spec)(_sorted_dicts(x) for x in spec)
    return spec


def trace(model_or_function: Any, input_spec: Any = None, *, batch_size: int | None = None,
          training: bool = False, name: str | None = None) -> Trace:
    """Trace a concrete function with static shapes; see :func:`capture`."""
    start = time.perf_counter()
    input_spec = _sorted_dicts(input_spec)
    if _is_keras_layer(model_or_function):
        with lowering.grouped_convolutions_lowered():
            cf, specs, model_weights, label = _trace_keras(model_or_function, input_spec,
                                                           batch_size, training)
        variables = list(model_or_function.weights)
        others = state_variables(model_or_function)
        pins = _pins(model_or_function)
    elif hasattr(model_or_function, "get_concrete_function") or _is_concrete(model_or_function):
        with lowering.grouped_convolutions_lowered():
            cf, specs, label = _trace_function(model_or_function, input_spec, batch_size)
        variables = list(cf.variables)
        others = []
        model_weights = ()
        pins = {}
    else:
        raise CaptureError(
            f"tapas.capture got a {type(model_or_function).__name__}, which is neither a Keras "
            "model/layer (Keras 3, or Keras 2 from tf_keras) nor a tf.function: wrap a Python "
            "function with @tf.function, or pass a keras.Model")
    by_handle = {id(h): v for v in variables if (h := _handle(v)) is not None}
    state_by_handle = {id(h): v for v in others if (h := _handle(v)) is not None}
    captured_ids = set()
    var_of: dict[str, Any] = {}
    states: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    path_of_state = {id(v): p for v, p in zip(others, weight_paths(others))}
    for external, internal in cf.graph.captures:
        captured_ids.add(id(internal))
        v = by_handle.get(id(external))
        if v is not None:
            var_of[internal.op.name] = v
        elif id(external) in state_by_handle:
            states[internal.op.name] = state_by_handle[id(external)]
        elif external.dtype != tf.resource and hasattr(external, "numpy"):
            constants[internal.op.name] = external.numpy()
    path_of = {id(v): p for v, p in zip(variables, weight_paths(variables))}
    weights = {ph: _weight_info(v, ph, path_of[id(v)]) for ph, v in var_of.items()}
    if not model_weights:
        model_weights = tuple(weights.values())
    else:
        model_weights = tuple(_weight_info(v, "", path_of[id(v)]) for v in model_weights)
    input_names = tuple(t.op.name for t in cf.graph.inputs if id(t) not in captured_ids)
    call_losses = (call_loss_tensors(model_or_function, cf.graph)
                   if _is_keras_layer(model_or_function) else ())
    return Trace(concrete_function=cf, input_specs=tuple(specs), input_names=input_names,
                 variables=var_of, weights=weights, model_weights=model_weights,
                 name=name or label, seconds=time.perf_counter() - start, pins=pins,
                 states=states, constants=constants,
                 state_paths={ph: path_of_state[id(v)] for ph, v in states.items()},
                 call_losses=tuple(t.name for t in call_losses))


def call_loss_tensors(model: Any, graph: tf.Graph) -> list[tf.Tensor]:
    """The losses ``model``'s call added while ``graph`` was traced, in layer order: Keras
    (3, and 2's tf_keras) keeps them in each layer's ``_losses`` as tensors of the traced
    graph (activity regularizers, ``self.add_loss(tensor)``)."""
    layers = [model] + list(model._flatten_layers(include_self=False)) \
        if hasattr(model, "_flatten_layers") else [model]
    found: list[tf.Tensor] = []
    for layer in layers:
        for x in getattr(layer, "_losses", None) or []:
            if getattr(x, "graph", None) is graph and not any(x is f for f in found):
                found.append(x)
    return found


# The attribute a layer carries its ``shard=`` pin in (``tapas.layers.TapasLayer``); capture
# reads it by name, so this stage never imports the layers built on top of it.
PIN_ATTRIBUTE = "tapas_pin"


def _pins(layer: Any) -> dict[str, str]:
    """``{weight path: pin}`` for every layer inside ``layer`` pinned by a string in its
    ``PIN_ATTRIBUTE`` (the ``tapas.layers`` layers built with ``shard=``)."""
    found = [layer]
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is not None:
        found = list(flatten(include_self=True, recursive=True))
    path_of = {id(v): p for p, v in weights_by_path(layer).items()}
    pins: dict[str, str] = {}
    for sub in found:
        pin = getattr(sub, PIN_ATTRIBUTE, None)
        if isinstance(pin, str):
            for w in sub.weights:
                pins[path_of.get(id(w), w.path)] = pin
    return pins


def _is_keras_layer(obj: Any) -> bool:
    """A Keras 3 layer or model, or a Keras 2 (``tf_keras``) one when tf_keras is in use:
    both trace the same way, and a Keras 2 weight is named by its variable name
    (``dense/kernel``) where Keras 3 gives a path."""
    if isinstance(obj, keras.Layer):
        return True
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(obj, tf_keras.layers.Layer)


def _is_concrete(obj: Any) -> bool:
    return hasattr(obj, "graph") and hasattr(obj, "structured_input_signature")


def _handle(v: Any) -> Any:
    inner = getattr(v, "value", None)  # keras.Variable wraps a tf.Variable
    if inner is not None and hasattr(inner, "handle"):
        return inner.handle
    return getattr(v, "handle", None)


def weight_paths(variables: Sequence[Any]) -> list[str]:
    """The path TAPAS names each of ``variables`` by, in order: its Keras path (its
    variable name for Keras 2 and plain ``tf.Variable`` s), with ``#k`` appended to the k-th
    later variable whose path an earlier one already has. Keras paths are not unique:
    keras-hub T5's encoder and decoder each own a ``self_attention/embeddings`` (their
    relative-attention biases), and weights are matched by path everywhere (capture, plans,
    the runtime's values, checkpoints). Pass them in ``model.weights`` order, as capture
    does, so that the same model gives the same paths."""
    seen: dict[str, int] = {}
    out = []
    for v in variables:
        base = getattr(v, "path", None) or v.name.split(":")[0]
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append(base if k == 0 else f"{base}#{k}")
    return out


def state_variables(model: Any) -> list[Any]:
    """The variables of the Keras ``model`` that are no weights (the states of its seed
    generators), in ``model.variables`` order."""
    weights = list(getattr(model, "weights", ()))
    return [v for v in getattr(model, "variables", ()) if all(v is not w for w in weights)]


def states_by_path(model: Any) -> dict[str, Any]:
    """``{path: variable}`` for every non-weight variable of the Keras ``model`` (seed
    generator states), named as capture names them (:func:`weight_paths`' rule: a repeated
    path's later variables get ``#k``)."""
    states = state_variables(model)
    return dict(zip(weight_paths(states), states))


def weights_by_path(model: Any) -> dict[str, Any]:
    """``{path: variable}`` for every weight of the Keras ``model``, named as capture names
    them (:func:`weight_paths`)."""
    variables = list(model.weights)
    return dict(zip(weight_paths(variables), variables))


def _weight_info(v: Any, placeholder: str, path: str) -> ir.WeightInfo:
    shape = tuple(int(d) for d in v.shape)
    dtype = tf.as_dtype(v.dtype).name
    return ir.WeightInfo(path=path, shape=shape, dtype=dtype,
                         trainable=bool(getattr(v, "trainable", True)), placeholder=placeholder)


def _as_spec_list(input_spec: Any) -> tuple[list[tf.TensorSpec], list[str] | None]:
    """Normalize a spec argument into a flat list (and the keys, for a dict)."""
    if isinstance(input_spec, tf.TensorSpec):
        return [input_spec], None
    if isinstance(input_spec, Mapping):
        keys = list(input_spec)
        specs = [input_spec[k] for k in keys]
    elif isinstance(input_spec, (list, tuple)):
        keys, specs = None, list(input_spec)
    else:
        raise CaptureError(
            f"input_spec must be a tf.TensorSpec, a list of them or a dict of them, got "
            f"{type(input_spec).__name__}: e.g. tf.TensorSpec([8, 128], tf.int32)")
    for k, s in enumerate(specs):
        if not isinstance(s, tf.TensorSpec):
            label = keys[k] if keys else k
            raise CaptureError(f"input_spec[{label!r}] is a {type(s).__name__}, not a "
                               "tf.TensorSpec: e.g. tf.TensorSpec([8, 128], tf.int32)")
    return specs, keys


def _fill_static(spec: tf.TensorSpec, label: str, batch_size: int | None) -> tf.TensorSpec:
    shape = spec.shape
    if shape.rank is None:
        raise CaptureError(f"input {label} has unknown rank: give a tf.TensorSpec with a "
                           "full static shape, e.g. tf.TensorSpec([8, 128])")
    dims = list(shape.as_list())
    for d, size in enumerate(dims):
        if size is None:
            if d == 0 and batch_size is not None:
                dims[0] = int(batch_size)
                continue
            fix = ("pass batch_size=N to tapas.capture or a spec with a concrete batch size"
                   if d == 0 else "give this dimension a concrete size in the spec")
            raise CaptureError(f"dimension {d} of input {label} is dynamic (shape "
                               f"{tuple(dims)}); tapas needs static shapes: {fix}")
    if batch_size is not None and dims and spec.shape[0] is not None and dims[0] != batch_size:
        raise CaptureError(f"input {label} has batch size {dims[0]} but batch_size="
                           f"{batch_size} was passed: drop one of them")
    return tf.TensorSpec(dims, spec.dtype, name=spec.name)


def _trace_keras(model: keras.Layer, input_spec: Any, batch_size: int | None,
                 training: bool):
    label = model.name
    model_inputs = None
    try:
        model_inputs = list(model.inputs) if getattr(model, "inputs", None) else None
    except (AttributeError, ValueError):
        model_inputs = None
    if input_spec is None:
        if not model_inputs:
            raise CaptureError(
                f"model '{label}' was never built and no input_spec was given: "
                + ("" if model.built else "call it once on a batch (model(x)), then ")
                + "pass input_spec=tf.TensorSpec([batch, ...], dtype) (one per input), or "
                "build the model with keras.Input first")
        input_spec = [tf.TensorSpec(tuple(t.shape), t.dtype, name=_input_name(t, k))
                      for k, t in enumerate(model_inputs)]
    input_spec = _dict_as_input_list(model, input_spec)
    if isinstance(input_spec, Mapping) or (isinstance(input_spec, (list, tuple)) and any(
            tf.nest.is_nested(s) for s in input_spec)):
        cf, specs = _trace_keras_structure(model, input_spec, batch_size, training, label)
        return cf, specs, list(model.weights), label
    specs, _ = _as_spec_list(input_spec)
    labels = [f"'{specs[k].name}'" if specs[k].name else str(k) for k in range(len(specs))]
    specs = [_fill_static(s, f"{labels[k]} of model '{label}'", batch_size)
             for k, s in enumerate(specs)]
    if model_inputs:
        _check_against_model(label, model_inputs, specs, labels)
        # the graph's inputs take the model's input names, whatever the specs are called:
        # a plan made on this capture then fits the one tapas.parallelize makes
        specs = [tf.TensorSpec(s.shape, s.dtype, name=_input_name(t, k))
                 for k, (t, s) in enumerate(zip(model_inputs, specs))]
    if not model.built:
        raise CaptureError(f"model '{label}' is not built: call it once on a batch, or "
                           "build it with keras.Input, before capturing")
    if len(specs) == 1:
        fn = tf.function(lambda x: model(x, training=training))
        cf = fn.get_concrete_function(specs[0])
    else:
        fn = tf.function(lambda *xs: model(list(xs), training=training))
        cf = fn.get_concrete_function(*specs)
    return cf, specs, list(model.weights), label


def _dict_as_input_list(model: Any, input_spec: Any) -> Any:
    """A dict of specs keyed by the input names of a model whose inputs are a list (as
    Keras matches such a dict): the list in the model's order, which is the order
    ``tapas.parallelize`` feeds them in (keras-hub Gemma3n). Anything else as it is."""
    if not isinstance(input_spec, Mapping):
        return input_spec
    try:
        structure = model.input
    except (AttributeError, ValueError):
        return input_spec
    if not isinstance(structure, (list, tuple)) or any(tf.nest.is_nested(t) for t in structure):
        return input_spec
    names = [_input_name(t, k) for k, t in enumerate(structure)]
    if sorted(names) != sorted(input_spec) or len(set(names)) != len(names):
        return input_spec
    return [input_spec[n] for n in names]


def _trace_keras_structure(model: Any, input_spec: Any, batch_size: int | None,
                           training: bool, label: str) -> tuple[Any, list[tf.TensorSpec]]:
    """Trace ``model`` called with a dict or nested structure of specs. The specs come back
    in the order ``tf.function`` flattens the structure (dict keys sorted), which is the
    order of the graph's input placeholders and of Keras's ``model.inputs``; an unnamed
    spec takes its dict key (its path when two share a key), as ``tapas.parallelize``
    names the inputs, so a plan made on this graph binds to the program's."""
    flat = tf.nest.flatten(input_spec)
    paths = ["/".join(str(p) for p in path) for path, _ in keras.tree.flatten_with_path(
        tf.nest.map_structure(lambda s: 0, input_spec))]
    keys = [path.split("/")[-1] for path in paths]
    specs = []
    for path, key, s in zip(paths, keys, flat):
        if not isinstance(s, tf.TensorSpec):
            raise CaptureError(f"input_spec[{path!r}] is a {type(s).__name__}, not a "
                               "tf.TensorSpec: e.g. tf.TensorSpec([8, 128], tf.int32)")
        if s.name is None:   # the placeholder named as the runtime names the input
            s = tf.TensorSpec(s.shape, s.dtype, name=key if keys.count(key) == 1 else path)
        specs.append(_fill_static(s, f"'{path}' of model '{label}'", batch_size))
    if not model.built:
        raise CaptureError(f"model '{label}' is not built: call it once on a batch, or "
                           "build it with keras.Input, before capturing")
    fn = tf.function(lambda d: model(d, training=training))
    cf = fn.get_concrete_function(tf.nest.pack_sequence_as(input_spec, specs))
    return cf, specs


def _input_name(t: Any, k: int) -> str:
    name = getattr(t, "name", None) or f"input_{k}"
    return name.split(":")[0]


def _check_against_model(label: str, model_inputs: list, specs: list[tf.TensorSpec],
                         labels: list[str]) -> None:
    if len(model_inputs) != len(specs):
        names = [_input_name(t, k) for k, t in enumerate(model_inputs)]
        raise CaptureError(f"model '{label}' takes {len(model_inputs)} input(s) {names} but "
                           f"{len(specs)} input spec(s) were given: pass one tf.TensorSpec "
                           "per model input, in order")
    for k, (t, s) in enumerate(zip(model_inputs, specs)):
        want = tuple(t.shape)
        if len(want) != s.shape.rank:
            raise CaptureError(f"input {labels[k]} of model '{label}' has rank {len(want)} "
                               f"(shape {want}) but the spec has rank {s.shape.rank} (shape "
                               f"{tuple(s.shape.as_list())}): give a spec of shape "
                               f"{tuple('batch' if d is None else d for d in want)}")
        for d, (a, b) in enumerate(zip(want, s.shape.as_list())):
            if a is not None and a != b:
                raise CaptureError(f"dimension {d} of input {labels[k]} of model '{label}' "
                                   f"must be {a}, the spec says {b}")
        want_dt = tf.as_dtype(t.dtype)
        if want_dt.is_integer != s.dtype.is_integer or want_dt.is_floating != s.dtype.is_floating:
            raise CaptureError(f"input {labels[k]} of model '{label}' has dtype {want_dt.name} "
                               f"but the spec says {s.dtype.name}: use tf.TensorSpec(shape, "
                               f"tf.{want_dt.name})")


def _trace_function(fn: Any, input_spec: Any, batch_size: int | None):
    label = getattr(fn, "__name__", None) or getattr(fn, "name", None) or "function"
    if _is_concrete(fn) and not hasattr(fn, "get_concrete_function"):
        if input_spec is not None:
            raise CaptureError("a ConcreteFunction is already traced: do not pass input_spec")
        for t in fn.inputs:
            if t.dtype != tf.resource and not t.shape.is_fully_defined():
                raise CaptureError(f"the ConcreteFunction's input '{t.op.name}' has shape "
                                   f"{t.shape}: trace it with a fully static tf.TensorSpec")
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in fn.inputs if t.dtype != tf.resource]
        return fn, specs, label
    if input_spec is None:
        raise CaptureError(f"tf.function '{label}' needs input_spec: pass "
                           "tf.TensorSpec([batch, ...], dtype) for each argument")
    specs, keys = _as_spec_list(input_spec)
    labels = [f"'{keys[k]}'" if keys else str(k) for k in range(len(specs))]
    specs = [_fill_static(s, f"{labels[k]} of '{label}'", batch_size) for k, s in enumerate(specs)]
    if keys is not None:
        cf = fn.get_concrete_function(**dict(zip(keys, specs)))
    else:
        cf = fn.get_concrete_function(*specs)
    return cf, specs, label


# ---- reading the tf.Graph ----------------------------------------------------------------

def to_ir(t: Trace, progress: Callable[[int, int], None] | None = None) -> ir.Graph:
    """Read the traced ``tf.Graph`` into op records and group them into GraphNodes;
    ``progress(done, total)`` is told the ops read so far (every 1,000)."""
    # Both passes allocate many small objects that all live to the end: pausing the
    # cyclic garbage collector meanwhile saves its repeated full scans.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return grouping.group_ops(raw_graph(t, progress))
    finally:
        if enabled:
            gc.enable()


def raw_graph(t: Trace, progress: Callable[[int, int], None] | None = None
              ) -> grouping.RawGraph:
    """The traced graph as plain records (no TF objects), ready for grouping."""
    graph = t.graph
    ops = []
    control: dict[str, tuple[str, ...]] = {}
    every = graph.get_operations()
    for k, op in enumerate(every):
        if progress is not None and k % 1000 == 0:
            progress(k, len(every))
        node_def = op.node_def
        attrs = {}
        for key, value in node_def.attr.items():
            if key in _SKIP_ATTRS or key.startswith("_"):  # "_..." is TF bookkeeping
                continue
            v = _attr_value(value)
            if v is not None:
                attrs[key] = v
        outputs = tuple(ir.TensorInfo(o.name, _shape(o.shape), o.dtype.name) for o in op.outputs)
        value = None
        if op.type == "Const":
            shape = outputs[0].shape
            if shape is not None and int(np.prod(shape, dtype=np.int64)) <= _SMALL_CONST:
                value = _const_value(node_def.attr["value"].tensor)
        ops.append(ir.OpInfo(op.name, op.type, tuple(i.name for i in op.inputs), outputs,
                             attrs, value))
        if op.control_inputs:
            control[op.name] = tuple(c.name for c in op.control_inputs)
    outputs = [o for o in graph.outputs if o is not None]
    losses = [graph.get_tensor_by_name(name) for name in t.call_losses]
    outputs = tuple(ir.TensorInfo(o.name, _shape(o.shape), o.dtype.name)
                    for o in outputs + losses)
    return grouping.RawGraph(ops=ops, control_inputs=control, inputs=t.input_names,
                             outputs=outputs, weights=t.weights,
                             model_weights=t.model_weights, name=t.name, pins=t.pins,
                             call_losses=len(losses))


def _shape(shape: tf.TensorShape) -> tuple[int, ...] | None:
    if shape.rank is None:
        return None
    return tuple(-1 if d is None else int(d) for d in shape.as_list())


def _const_value(tensor_proto: Any) -> Any:
    try:
        arr = tf.make_ndarray(tensor_proto)
    except Exception:  # e.g. string or variant constants: the shape is enough
        return None
    if arr.dtype.kind in "biuf":
        return arr.tolist()
    if arr.dtype.kind in "SO":
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x)
                for x in arr.ravel().tolist()]
    return None


def _function_name(name: str) -> str:
    """A function attribute's name without the process-unique number TensorFlow appends
    (``..._map_while_body_66``): the same model captured twice has the same GraphNode
    signatures, so a plan made on one capture applies to the other."""
    return re.sub(r"_\d+$", "", name)


def _attr_value(value: Any) -> Any:
    which = value.WhichOneof("value")
    if which == "s":
        return value.s.decode(errors="replace")
    if which in ("i", "f", "b"):
        return getattr(value, which)
    if which == "type":
        return tf.as_dtype(value.type).name
    if which == "shape":
        return _proto_shape(value.shape)
    if which == "func":
        return _function_name(value.func.name)
    if which == "list":
        lst = value.list
        if lst.s:
            return [s.decode(errors="replace") for s in lst.s]
        if lst.i:
            return list(lst.i)
        if lst.f:
            return list(lst.f)
        if lst.b:
            return list(lst.b)
        if lst.type:
            return [tf.as_dtype(t).name for t in lst.type]
        if lst.shape:
            return [_proto_shape(s) for s in lst.shape]
        if lst.func:
            return [_function_name(f.name) for f in lst.func]
        return []
    return None


def _proto_shape(shape_proto: Any) -> list[int] | None:
    if shape_proto.unknown_rank:
        return None
    return [int(d.size) for d in shape_proto.dim]
