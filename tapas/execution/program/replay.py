"""The one place where TAPAS touches TensorFlow internals (reconstruction only).

In:  an operation of a traced ``tf.Graph`` (its type, its NodeDef attributes) and new input
     tensors in the current graph (a ``tf.function`` being traced, or eager).
Out: the same operation re-created in the current graph on the new inputs, recorded on the
     active ``tf.GradientTape`` s so that tape gradients flow through it exactly as through
     the original op (TF-FACTS, "Executing a rewritten graph": re-importing a GraphDef runs
     forward but leaves the tape blind). Two rewrites keep that possible: a function call
     (``PartitionedCall``, no registered gradient) is made as an ``If`` of a constant true
     predicate calling the same function, and a cond or call given a variable's value where
     the traced op took its resource gets functions that take the value (:func:`_as_values`).
     A third avoids a TensorFlow crash: a strided 1x1 ``Conv2D`` (or depthwise convolution)
     is made as a strided slice and a stride-1 convolution (:func:`_strided_pointwise`). A
     fourth avoids a 30x slowdown: a scaled batch matmul plus a mask broadcast over its
     batch (attention scores plus a causal mask) reaches the add through an ``EnsureShape``
     (:func:`_slow_fused_batch_matmul`), which keeps Grappler from fusing the three into
     oneDNN's ``_MklFusedBatchMatMulV2``.

Symbols used, and why:

* ``tf.Graph.create_op`` (public, deprecated in TF 2): creates an op of a given type with
  the NodeDef attributes copied verbatim, so the replayed op has the original's exact
  semantics (strides, padding, einsum equation, transposes, dtypes); shapes are re-inferred
  from the new (possibly local, sliced) inputs.
* ``tf.__internal__.record_gradient`` (exported under ``__internal__``, not covered by the
  API guarantees): records the op on the tape with its attributes, as TF's generated op
  wrappers do; the tape then calls the registered gradient function.
* ``tensorflow.python.eager.execute.must_record_gradient`` (private): whether any tape is
  recording, to skip the bookkeeping when none is.
* ``tensorflow.python.framework.ops.get_default_graph`` is public as
  ``tf.compat.v1.get_default_graph``; used to reach the graph being built.
* ``tf.Graph._is_function``, ``_get_function`` and ``_add_function`` (private methods),
  ``atomic_function.from_function_def`` and ``ops.uid`` (private modules): a replayed op
  that names functions (a While's body, an If's branches) gets renamed copies of them in
  the graph it is created in, where its gradient looks them up (:func:`_own_functions`).
* ``tensorflow.python.ops.script_ops._py_funcs`` (private): the registry where
  ``tf.py_function`` and ``tf.numpy_function`` keep the Python function an op's ``token``
  names; a replayed call looks its function up there (:func:`_python_call`).
* ``tensorflow.python.eager.context.context().function_call_options`` (private, per
  thread): the ``ConfigProto`` a ``tf.function`` is instantiated with on its first call
  (Grappler's options), set for the runtime's step functions by
  :func:`graph_optimization` (the first step's time).

Nothing else in TAPAS imports private TensorFlow modules.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.python.eager import context as _context  # private: function_call_options
from tensorflow.python.eager.polymorphic_function import atomic_function as _atomic  # private
from tensorflow.python.framework.ops import uid as _uid  # private: a process-unique int
from tensorflow.python.eager import execute as _execute  # private: must_record_gradient
from tensorflow.python.ops import script_ops  # private: the registry of Python functions

__all__ = ["replay_op", "ReplayError", "graph_optimization", "GRAPH_OPTIMIZATIONS",
           "check_graph_optimization"]

#: ``"lean"``: Grappler's passes run once, not twice, without the MLIR passes, and on
#: CPU-only devices without the layout and memory optimizers (which change nothing there)
#: and the passes in ``_CPU_LEAN_OFF``; ``"default"``: TensorFlow's own configuration.
GRAPH_OPTIMIZATIONS = ("lean", "default")

#: Grappler passes ``"lean"`` also leaves out on CPU-only devices: constant folding and the
#: arithmetic optimizer (a third of Grappler's time on the replica body, no change to the
#: step time of the T5 and CNN plans measured) and the function optimizer (it specialises
#: each call of the replica function, a copy of the whole body per device, which is then
#: optimised again when the call instantiates it).
_CPU_LEAN_OFF = ("constant_folding", "arithmetic_optimization", "function_optimization")


def check_graph_optimization(mode: str) -> str:
    """``mode`` if it is one of :data:`GRAPH_OPTIMIZATIONS`; a ValueError naming it if not."""
    if mode not in GRAPH_OPTIMIZATIONS:
        raise ValueError(f"graph_optimization={mode!r}: use one of {list(GRAPH_OPTIMIZATIONS)}")
    return mode


class ReplayError(RuntimeError):
    """An op of the traced graph cannot be re-created; the message names it."""


def replay_op(op: tf.Operation, inputs: Sequence[tf.Tensor], name: str | None = None,
              attrs: Mapping[str, Any] | None = None) -> list[tf.Tensor]:
    """Re-create ``op`` (from a traced graph) on ``inputs`` in the current graph.

    The attributes are copied from ``op``'s NodeDef (``attrs``: AttrValues that replace
    some of them); the output shapes are inferred from ``inputs``. Must run while a graph
    is being built (inside ``tf.function``). Returns the new op's outputs, recorded for
    ``tf.GradientTape``.
    """
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly():
        raise ReplayError(f"replaying op '{op.name}' ({op.type}) needs a graph: call the "
                          "reconstructed program inside a tf.function")
    if op.type in PYTHON_OPS:
        return _python_call(op, list(inputs), name)
    node_def = op.node_def
    attrs = {**{k: v for k, v in node_def.attr.items() if not k.startswith("_")},
             **(attrs or {})}
    if any(v.HasField("func") or v.list.func for v in node_def.attr.values()):
        attrs.update(_own_functions(op, graph, _valued_arguments(op, inputs)))
    op_type, op_def, inputs = op.type, op.op_def, list(inputs)
    if op.type in _POINTWISE_CONVS and (axes := _strided_pointwise(inputs, attrs)) is not None:
        inputs[0], attrs = _subsampled(inputs[0], attrs, axes)
    if op.type in _ADDS and (i := _slow_fused_batch_matmul(inputs)) is not None:
        inputs[i] = tf.ensure_shape(inputs[i], inputs[i].shape)
    if op.type in _CALLS_AS_IF and not (
            "_XlaMustCompile" in node_def.attr and node_def.attr["_XlaMustCompile"].b):
        op_type, inputs, attrs = _call_as_if(op, inputs, attrs)
        op_def = None
    try:
        new_op = graph.create_op(op_type, inputs, dtypes=[o.dtype for o in op.outputs],
                                 name=name or op.name, attrs=attrs, op_def=op_def)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
        shapes = [tuple(t.shape.as_list()) if t.shape.rank is not None else None
                  for t in inputs]
        raise ReplayError(f"cannot re-create op '{op.name}' ({op.type}) on inputs of shapes "
                          f"{shapes}: {err}") from err
    outputs = list(new_op.outputs)
    # a StopGradient is left off the tape: its output then counts as a constant, so the
    # collectives applied to it downstream (a slice of batch norm's stopped mean for a
    # split reader) record no backward half that would carry a gradient the StopGradient
    # drops anyway (the audit's prediction leaves those out: tapas.sharding.gradients)
    if op.type != "StopGradient" and _execute.must_record_gradient():
        flat: list[Any] = []
        for key in attrs:
            flat.extend((key, new_op.get_attr(key)))
        tf.__internal__.record_gradient(op_type, list(new_op.inputs), tuple(flat), outputs)
    return outputs


# ops that call back into Python (tf.py_function; tf.numpy_function): re-created as a new
# call of the same Python function (:func:`_python_call`)
PYTHON_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def _python_call(op: tf.Operation, inputs: list, name: str | None) -> list[tf.Tensor]:
    """``op`` (a tf.py_function or tf.numpy_function of the traced graph) as a new call of
    the same registered Python function. A tf.py_function's gradient is that function's
    own, taken by recomputing it under a tape in the backward pass: TensorFlow's keeps
    the forward's tape in a cache keyed by the op, which replicas running one traced
    step side by side would take from each other."""
    token = op.get_attr("token")
    token = token.decode() if isinstance(token, bytes) else token
    registered = script_ops._py_funcs.get(token)
    if registered is None:
        raise ReplayError(f"op '{op.name}' ({op.type}) calls a Python function that is no "
                          "longer registered (the model traced it and was then deleted): "
                          "keep the model alive while its parallel program runs")
    dtypes = [o.dtype for o in op.outputs]
    with tf.name_scope(name or op.name.replace("/", "_")):
        if op.type != "EagerPyFunc":   # tf.numpy_function: no gradient, as traced
            outs = tf.numpy_function(registered, inputs, dtypes,
                                     stateful=op.type == "PyFunc")
            return list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return _differentiable_py_function(registered._func, inputs, dtypes)


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _differentiable_py_function(func: Any, inputs: list, dtypes: list) -> list[tf.Tensor]:
    """``tf.py_function(func, inputs, dtypes)`` whose gradient recomputes ``func`` under a
    tape (float inputs only; others get none)."""
    n_in = len(inputs)

    @tf.custom_gradient
    def call(*xs: tf.Tensor) -> Any:
        outs = _as_list(tf.py_function(func, list(xs), dtypes))

        def grad(*dys: tf.Tensor) -> list:
            floats = [k for k, x in enumerate(xs) if x.dtype.is_floating]

            def backward(*args: tf.Tensor) -> list:
                xs_, dys_ = list(args[:n_in]), list(args[n_in:])
                with tf.GradientTape() as tape:
                    tape.watch([xs_[k] for k in floats])
                    ys = _as_list(func(*xs_))
                gs = tape.gradient(ys, [xs_[k] for k in floats], output_gradients=dys_)
                return [tf.zeros_like(xs_[k]) if g is None else g
                        for k, g in zip(floats, gs)]
            gs = _as_list(tf.py_function(backward, list(xs) + list(dys),
                                         [xs[k].dtype for k in floats]))
            out: list = [None] * n_in
            for k, g in zip(floats, gs):
                out[k] = tf.ensure_shape(g, xs[k].shape)
            return out
        return outs, grad
    return _as_list(call(*inputs))


# convolutions whose strided 1x1 form is replayed as a slice (same attribute names)
_POINTWISE_CONVS = ("Conv2D", "DepthwiseConv2dNative")
_ADDS = ("AddV2", "Add")
_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def _slow_fused_batch_matmul(inputs: Sequence[tf.Tensor]) -> int | None:
    """The operand of an add that Grappler's remapper would fuse into a slow oneDNN kernel:
    ``Mul(BatchMatMul(a, b), scalar)`` of rank 4 or more when the other operand has the
    same rank and size 1 on every batch axis (all but the last two), as attention adds a
    [1, 1, q, k] causal mask to its scaled scores: on TF 2.21's CPU kernels that fused op is
    many times slower than the three ops apart (``docs/tensorflow-notes.md``). The same add
    of a [1, h, q, k], [b, 1, q, k], [b, 1, 1, k] or [1, q, k] operand, or without the
    scale, is not slowed and is left alone. The index of the product's operand, or None."""
    if len(inputs) != 2:
        return None
    for i, (x, other) in enumerate((inputs, inputs[::-1])):
        producer = x.op
        if producer.type != "Mul" or not any(t.op.type in _BATCH_MATMULS
                                             for t in producer.inputs):
            continue
        shape, bshape = x.shape, other.shape
        if shape.rank is None or bshape.rank is None or shape.rank < 4 or \
                bshape.rank != shape.rank:
            continue
        batch = range(shape.rank - 2)
        if all(bshape[a] == 1 for a in batch) and any(shape[a] != 1 for a in batch):
            return i
    return None


def _strided_pointwise(inputs: Sequence[tf.Tensor], attrs: Mapping[str, Any]
                       ) -> tuple[int, int] | None:
    """The spatial axes of a ``Conv2D`` or ``DepthwiseConv2dNative`` with a 1x1 filter, a
    stride above 1 and no dilation or padding (a ResNet-style shortcut, MobileOne's and
    RepVGG's 1x1 stem branch), or None.

    TensorFlow 2.21's oneDNN filter gradient of such a convolution corrupts the heap for
    some shapes (1 or 3 or 5 images of 32x32x3 at stride 2: ``free(): invalid size``, a
    segmentation fault; 2, 4 or 8 images run; the depthwise one over 3 images of one
    channel; ``docs/tensorflow-notes.md``). A plan that
    splits the batch makes those shapes from a batch Keras runs safely, so the replay makes
    the op as the exact equivalent TensorFlow differentiates safely: every stride-th pixel,
    then the convolution at stride 1 (a 1x1 filter reads only those pixels; with "SAME" or
    "VALID" both give ceil(size / stride) outputs per axis and pad nothing)."""
    kernel = inputs[1].shape
    if kernel.rank != 4 or kernel[0] != 1 or kernel[1] != 1:
        return None
    axes = (2, 3) if attrs["data_format"].s == b"NCHW" else (1, 2)
    strides, dilations = list(attrs["strides"].list.i), list(attrs["dilations"].list.i)
    padding = attrs["padding"].s
    if any(d != 1 for d in dilations) or all(strides[a] == 1 for a in axes) or not (
            padding in (b"SAME", b"VALID") or
            (padding == b"EXPLICIT" and not any(attrs["explicit_paddings"].list.i))):
        return None
    return axes


def _subsampled(x: tf.Tensor, attrs: Mapping[str, Any], axes: tuple[int, int]
                ) -> tuple[tf.Tensor, dict[str, Any]]:
    """``x`` at every stride-th pixel of ``axes``, and ``attrs`` with strides of 1."""
    strides = list(attrs["strides"].list.i)
    index = [slice(None)] * 4
    for a in axes:
        index[a] = slice(None, None, strides[a])
    ones = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=[1, 1, 1, 1]))
    return x[tuple(index)], {**attrs, "strides": ones}


# function calls (a nested tf.function: Hugging Face LED's compute_hidden_states) have no
# registered gradient; an If of a constant true predicate with the function as both
# branches calls it too, and TensorFlow differentiates If (cond_v2)
_CALLS_AS_IF = {"PartitionedCall": "StatelessIf", "StatefulPartitionedCall": "If"}


def _call_as_if(op: tf.Operation, inputs: list, attrs: dict[str, Any]
                ) -> tuple[str, list, dict[str, Any]]:
    """(op type, inputs, attributes) of the If that calls ``op``'s function."""
    function = attrs["f"]
    return _CALLS_AS_IF[op.type], [tf.constant(True)] + inputs, {
        "Tcond": attr_value_pb2.AttrValue(type=tf.bool.as_datatype_enum),
        "Tin": attrs["Tin"], "Tout": attrs["Tout"],
        "then_branch": function, "else_branch": function,
        "output_shapes": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
            shape=[o.shape.as_proto() for o in op.outputs]))}


# ops that call functions, and the number of their inputs before the functions' arguments
_ARGUMENT_OFFSET = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1,
                    "PartitionedCall": 0, "StatefulPartitionedCall": 0}


def _valued_arguments(op: tf.Operation, inputs: Sequence[tf.Tensor]) -> dict[int, tf.DType]:
    """Function argument index -> dtype, for the arguments where the traced op passed a
    variable's resource and the replay passes the variable's value (a tf.cond whose branch
    reads a model variable: Hugging Face LED; the program holds weights as values)."""
    valued = {}
    for i, (old, new) in enumerate(zip(op.inputs, inputs)):
        if old.dtype == tf.resource and getattr(new, "dtype", tf.resource) != tf.resource:
            if op.type not in _ARGUMENT_OFFSET:
                raise ReplayError(f"op '{op.name}' ({op.type}) takes a variable as input {i}: "
                                  "a loop that carries a model variable cannot be rebuilt; "
                                  "read the variable before the loop")
            valued[i - _ARGUMENT_OFFSET[op.type]] = new.dtype
    return valued


def _own_functions(op: tf.Operation, graph: tf.Graph,
                   valued: Mapping[int, tf.DType] | None = None) -> dict[str, Any]:
    """Attribute overrides that give a replayed op that names functions (a While's cond and
    body, an If's branches, a PartitionedCall's callee) copies of them under names of its
    own, added to ``graph``. The gradient of a While (a ``map_fn``: keras-hub D-FINE) looks
    its body up in the graph that holds the op, and rewrites the op to output the
    accumulators it needs under ``<body name>_rewritten``: two programs replaying the same
    traced While with one name would register two different functions under one name."""
    overrides: dict[str, Any] = {}
    for key, value in op.node_def.attr.items():
        if key.startswith("_") or not (value.HasField("func") or value.list.func):
            continue
        new = attr_value_pb2.AttrValue()
        new.CopyFrom(value)
        funcs = [new.func] if value.HasField("func") else list(new.list.func)
        for func in funcs:
            func.name = _renamed_copy(op.graph, func.name, graph, valued or {})
        overrides[key] = new
    if valued:   # the argument types the op declares
        tin = attr_value_pb2.AttrValue()
        tin.CopyFrom(op.node_def.attr["Tin"])
        for j, dtype in valued.items():
            tin.list.type[j] = dtype.as_datatype_enum
        overrides["Tin"] = tin
    return overrides


def _renamed_copy(source: tf.Graph, name: str, graph: tf.Graph,
                  valued: Mapping[int, tf.DType]) -> str:
    """A copy of function ``name`` of ``source`` (or of a graph it is nested in) added to
    ``graph`` under a new name, the functions it calls beside it, with the ``valued``
    arguments taking values instead of resources (:func:`_as_values`); the new name."""
    found = None
    while found is None and source is not None:
        found = source._get_function(name)
        source = getattr(source, "outer_graph", None)
    if found is None:
        raise ReplayError(f"function '{name}' is not in the traced graph's library")
    fdef = function_pb2.FunctionDef()
    fdef.CopyFrom(found.cached_definition)
    fdef.signature.name = f"{name}_replay{_uid()}"
    _as_values(fdef, valued)
    copy_ = _atomic.from_function_def(fdef, found.function_type)
    for child in getattr(found, "children", ()):
        if not graph._is_function(child.name):
            graph._add_function(child)
    graph._add_function(copy_)
    return fdef.signature.name


def _as_values(fdef: function_pb2.FunctionDef, valued: Mapping[int, tf.DType]) -> None:
    """Edit ``fdef`` so that each argument of ``valued`` takes the variable's value: its
    type becomes the value's, and its reads (``ReadVariableOp``) become ``Identity`` s.
    Any other use of the resource (a write, a nested call) cannot take a value."""
    renamed: dict[str, str] = {}
    for j, dtype in valued.items():
        arg = fdef.signature.input_arg[j]
        arg.type = dtype.as_datatype_enum
        arg.ClearField("handle_data")
        for table in (fdef.arg_attr, fdef.resource_arg_unique_id):
            if j in table:
                del table[j]
        for node in fdef.node_def:
            if not any(x == arg.name or x.startswith(arg.name + ":") for x in node.input):
                continue
            if node.op != "ReadVariableOp":
                raise ReplayError(f"function '{fdef.signature.name}' uses variable argument "
                                  f"'{arg.name}' in '{node.name}' ({node.op}), not only "
                                  "reads it: it cannot take the variable's value")
            node.op = "Identity"
            node.attr["T"].CopyFrom(node.attr["dtype"])
            del node.attr["dtype"]
            renamed[f"{node.name}:value:"] = f"{node.name}:output:"
    if renamed:   # (ReadVariableOp's output is called "value", Identity's "output")
        def rename(ref: str) -> str:
            for old, new in renamed.items():
                if ref.startswith(old):
                    return new + ref[len(old):]
            return ref
        for node in fdef.node_def:
            node.input[:] = [rename(x) for x in node.input]
        for key in list(fdef.ret):
            fdef.ret[key] = rename(fdef.ret[key])


@contextlib.contextmanager
def graph_optimization(mode: str, accelerators: bool) -> Iterator[None]:
    """While active, a ``tf.function`` called (in this thread) for the first time is
    instantiated with Grappler options for ``mode`` (:data:`GRAPH_OPTIMIZATIONS`).

    The runtime's step function calls one copy of the replica body per device and each
    device optimises its copy, so Grappler's work grows with the device count
    (``docs/internals.md``, "Graph optimization").
    ``"lean"`` runs the passes once, without the MLIR ("tfg") passes (attribute
    consolidation, a topological sort, control-flow sinking: no change to these graphs)
    and, when ``accelerators`` is False, without the layout optimizer (it rewrites GPU
    convolutions' data format), the memory optimizer (swapping and recomputation for
    accelerator memory) and the passes in ``_CPU_LEAN_OFF`` (constant folding, arithmetic
    and function optimizers), none of which changed a measured step time.
    The options are per thread: a function called in another thread (``strategy.run``'s
    replica threads) needs them set there too. Options the user set in TensorFlow's config
    (``tf.config.optimizer.set_experimental_options``) are kept. A function is optimised
    once, on its first call: later calls run the same instantiation whatever the options.
    """
    if check_graph_optimization(mode) == "default":
        yield
        return
    ctx = _context.context()
    saved = ctx.function_call_options
    options = copy.copy(saved)
    options.config_proto_serialized = _lean_config(saved.config_proto_serialized, accelerators)
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = saved


@functools.lru_cache(maxsize=16)
def _lean_config(base: bytes, accelerators: bool) -> config_pb2.ConfigProto:
    """The serialized ``ConfigProto`` ``base`` with the lean Grappler options, parsed and
    edited once per configuration (the runtime enters :func:`graph_optimization` on every
    step); callers must not modify it."""
    config = config_pb2.ConfigProto()
    config.ParseFromString(base)
    rewrite = config.graph_options.rewrite_options
    rc = rewriter_config_pb2.RewriterConfig
    if rewrite.meta_optimizer_iterations == rc.DEFAULT_NUM_ITERS:
        rewrite.meta_optimizer_iterations = rc.ONE
    rewrite.disable_tfg_optimizer = True
    if not accelerators:
        if rewrite.layout_optimizer == rc.DEFAULT:
            rewrite.layout_optimizer = rc.OFF
        if rewrite.memory_optimization == rc.DEFAULT_MEM_OPT:
            rewrite.memory_optimization = rc.NO_MEM_OPT
        for name in _CPU_LEAN_OFF:
            if getattr(rewrite, name) == rc.DEFAULT:
                setattr(rewrite, name, rc.OFF)
    return config
