"""tapas.execution.program.replay: Grappler options of the runtime's step functions
(``graph_optimization``); ``replay_op`` itself is exercised by every reconstruction test
(tests/test_reconstruct.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from tapas.execution.program import replay

RC = rewriter_config_pb2.RewriterConfig


def _current() -> config_pb2.ConfigProto:
    config = config_pb2.ConfigProto()
    config.ParseFromString(context.context().function_call_options.config_proto_serialized)
    return config


def test_lean_on_cpus_runs_the_passes_once_without_layout_memory_and_mlir() -> None:
    before = context.context().function_call_options.config_proto_serialized
    with replay.graph_optimization("lean", accelerators=False):
        rewrite = _current().graph_options.rewrite_options
        assert rewrite.meta_optimizer_iterations == RC.ONE
        assert rewrite.layout_optimizer == RC.OFF
        assert rewrite.memory_optimization == RC.NO_MEM_OPT
        assert rewrite.disable_tfg_optimizer
        assert (rewrite.constant_folding, rewrite.arithmetic_optimization,
                rewrite.function_optimization) == (RC.OFF, RC.OFF, RC.OFF)
        assert not rewrite.disable_meta_optimizer   # pruning, CSE, remapper, ... run
        assert rewrite.remapping == RC.DEFAULT
        assert rewrite.common_subgraph_elimination == RC.DEFAULT
    assert context.context().function_call_options.config_proto_serialized == before


def test_lean_with_accelerators_keeps_layout_memory_folding_and_arithmetic() -> None:
    with replay.graph_optimization("lean", accelerators=True):
        rewrite = _current().graph_options.rewrite_options
        assert rewrite.meta_optimizer_iterations == RC.ONE
        assert rewrite.layout_optimizer == RC.DEFAULT
        assert rewrite.memory_optimization == RC.DEFAULT_MEM_OPT
        assert (rewrite.constant_folding, rewrite.arithmetic_optimization,
                rewrite.function_optimization) == (RC.DEFAULT, RC.DEFAULT, RC.DEFAULT)


def test_options_the_user_set_are_kept_and_restored_after_an_error() -> None:
    ctx = context.context()
    saved = copy.copy(ctx.function_call_options)
    config = _current()
    config.graph_options.rewrite_options.layout_optimizer = RC.ON
    config.graph_options.rewrite_options.meta_optimizer_iterations = RC.TWO
    config.graph_options.rewrite_options.constant_folding = RC.ON
    options = copy.copy(saved)
    options.config_proto_serialized = config
    ctx.function_call_options = options
    try:
        user = ctx.function_call_options.config_proto_serialized
        with pytest.raises(RuntimeError, match="inside"):
            with replay.graph_optimization("lean", accelerators=False):
                rewrite = _current().graph_options.rewrite_options
                assert rewrite.layout_optimizer == RC.ON
                assert rewrite.meta_optimizer_iterations == RC.TWO
                assert rewrite.constant_folding == RC.ON
                assert rewrite.arithmetic_optimization == RC.OFF   # not set by the user
                raise RuntimeError("inside")
        assert ctx.function_call_options.config_proto_serialized == user
    finally:
        ctx.function_call_options = saved


def test_default_changes_nothing_and_unknown_modes_are_refused() -> None:
    before = context.context().function_call_options.config_proto_serialized
    with replay.graph_optimization("default", accelerators=False):
        assert context.context().function_call_options.config_proto_serialized == before
    with pytest.raises(ValueError, match=r"graph_optimization='fast'.*\['lean', 'default'\]"):
        with replay.graph_optimization("fast", accelerators=False):
            pass


def test_a_function_first_called_under_lean_computes_the_same() -> None:
    x = tf.constant(np.random.RandomState(0).randn(4, 8).astype("float32"))
    w = tf.constant(np.random.RandomState(1).randn(8, 3).astype("float32"))

    def f(a: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(tf.matmul(a, w) + 1.0) * 2.0 - tf.reduce_mean(a)

    lean, default = tf.function(f), tf.function(f)
    with replay.graph_optimization("lean", accelerators=False):
        got = lean(x).numpy()
    with replay.graph_optimization("default", accelerators=False):
        want = default(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(lean(x).numpy(), want, rtol=1e-6)   # later calls: same program


def _traced_conv(x_shape, kernel_shape, strides, padding, depthwise=False):
    """A traced graph holding one ``Conv2D`` (or ``DepthwiseConv2dNative``) of these shapes
    (NHWC)."""
    @tf.function
    def f(x, k):
        if depthwise:
            return tf.nn.depthwise_conv2d(x, k, [1, strides, strides, 1], padding)
        return tf.nn.conv2d(x, k, strides, padding)
    graph = f.get_concrete_function(tf.TensorSpec(x_shape), tf.TensorSpec(kernel_shape)).graph
    kind = "DepthwiseConv2dNative" if depthwise else "Conv2D"
    return next(op for op in graph.get_operations() if op.type == kind)


@pytest.mark.parametrize("batch,channels,padding,depthwise", [
    (1, 3, "VALID", False), (3, 3, "SAME", False), (2, 3, "VALID", False),
    (3, 1, "SAME", True)])
def test_strided_pointwise_conv_is_replayed_as_a_slice_and_equals_the_convolution(
        batch: int, channels: int, padding: str, depthwise: bool) -> None:
    """A 1x1 stride-2 convolution of 32x32 images: TensorFlow 2.21's oneDNN filter gradient
    of it over 1 or 3 images of 3 channels (the depthwise one: 3 images of 1 channel)
    corrupts the heap (a crash; docs/tensorflow-notes.md). The replay makes it as a strided
    slice and a stride-1 convolution: no strided convolution left in the step, the output
    and both gradients equal to exact arithmetic (numpy)."""
    rng = np.random.RandomState(0)
    cout = channels if depthwise else 48
    x = rng.rand(batch, 32, 32, channels).astype(np.float32)
    k = rng.randn(1, 1, channels, 1 if depthwise else cout).astype(np.float32)
    dy = rng.randn(batch, 16, 16, cout).astype(np.float32)
    op = _traced_conv(x.shape, k.shape, 2, padding, depthwise)

    @tf.function
    def step(x, k):
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            (y,) = replay.replay_op(op, [x, k])
            loss = tf.reduce_sum(y * dy)
        return y, tape.gradient(loss, [x, k])

    for _ in range(20):   # the crash needed a few repetitions
        y, (dx, dk) = step(tf.constant(x), tf.constant(k))
    graph = step.get_concrete_function(tf.constant(x), tf.constant(k)).graph
    convs = [o for o in graph.get_operations() if o.type.startswith(("Conv2D", "Depthwise"))]
    assert convs and all(list(o.get_attr("strides")) == [1, 1, 1, 1] for o in convs)
    sub, d64 = x[:, ::2, ::2, :].astype(np.float64), dy.astype(np.float64)
    w = k[0, 0].astype(np.float64)
    if depthwise:   # channel c times its own weight
        w = np.diag(w[:, 0])
    want_y = np.einsum("bhwc,co->bhwo", sub, w)
    want_dw = np.einsum("bhwc,bhwo->co", sub, d64)
    want_dx = np.zeros(x.shape)
    want_dx[:, ::2, ::2, :] = np.einsum("bhwo,co->bhwc", d64, w)
    got_dw = np.diag(dk.numpy()[0, 0, :, 0]) if depthwise else dk.numpy()[0, 0]
    np.testing.assert_allclose(y.numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_dw, np.diag(np.diag(want_dw)) if depthwise else want_dw,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx.numpy(), want_dx, rtol=1e-5, atol=1e-5)


def test_other_convolutions_are_replayed_as_they_are() -> None:
    """A 3x3 strided convolution and a 1x1 convolution at stride 1 keep their op."""
    for kernel, strides in (((3, 3, 3, 8), 2), ((1, 1, 3, 8), 1)):
        op = _traced_conv((2, 8, 8, 3), kernel, strides, "SAME")

        @tf.function
        def f(x, k):
            return replay.replay_op(op, [x, k])[0]
        graph = f.get_concrete_function(tf.TensorSpec((2, 8, 8, 3)), tf.TensorSpec(kernel)).graph
        (conv,) = [o for o in graph.get_operations() if o.type == "Conv2D"]
        assert list(conv.get_attr("strides")) == [1, strides, strides, 1]
        assert not [o for o in graph.get_operations() if o.type == "StridedSlice"]


def _traced_add(mask_shape: tuple[int, ...], scaled: bool = True) -> tf.Operation:
    @tf.function
    def f(q, k, mask):
        s = tf.matmul(q, k, transpose_b=True)
        return (s * 0.35 if scaled else s) + mask
    graph = f.get_concrete_function(tf.TensorSpec((8, 2, 4, 3)), tf.TensorSpec((8, 2, 4, 3)),
                                    tf.TensorSpec(mask_shape)).graph
    return next(op for op in graph.get_operations() if op.type == "AddV2")


@pytest.mark.parametrize("mask_shape,scaled,guarded", [
    ((1, 1, 4, 4), True, True),      # attention scores + a causal mask: the slow fusion
    ((1, 2, 4, 4), True, False),     # a per-head bias: not slowed, left alone
    ((8, 1, 4, 4), True, False),     # a per-example mask: not slowed
    ((8, 1, 1, 4), True, False),     # a padding mask: not slowed
    ((1, 4, 4), True, False),        # a rank-3 mask: not slowed
    ((1, 1, 4, 4), False, False),    # no scale: no slow fusion
])
def test_scaled_batch_matmul_plus_broadcast_mask_reaches_the_add_through_ensure_shape(
        mask_shape: tuple[int, ...], scaled: bool, guarded: bool) -> None:
    """Grappler fuses BatchMatMul * scalar + a [1, 1, q, k] mask into oneDNN's
    _MklFusedBatchMatMulV2, which took 15 ms where the ops apart take 0.5 ms (TF 2.21, CPU;
    docs/tensorflow-notes.md). The replayed add reads the product through an EnsureShape,
    which the remapper does not look through; values and gradients are unchanged."""
    rng = np.random.RandomState(0)
    q, k = rng.randn(8, 2, 4, 3).astype(np.float32), rng.randn(8, 2, 4, 3).astype(np.float32)
    mask = rng.randn(*mask_shape).astype(np.float32)
    op = _traced_add(mask_shape, scaled)

    @tf.function
    def step(q, k, mask):
        with tf.GradientTape() as tape:
            tape.watch([q, k])
            s = tf.matmul(q, k, transpose_b=True)
            (y,) = replay.replay_op(op, [s * 0.35 if scaled else s, mask])
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [q, k])

    y, (dq, dk) = step(tf.constant(q), tf.constant(k), tf.constant(mask))
    graph = step.get_concrete_function(tf.constant(q), tf.constant(k), tf.constant(mask)).graph
    (add,) = [o for o in graph.get_operations() if o.type == "AddV2" and o.name == "add"]
    assert [t.op.type for t in add.inputs][0] == ("EnsureShape" if guarded else "Mul" if scaled
                                                    else "BatchMatMulV2")
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
    want = (s * 0.35 if scaled else s) + mask
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    ds = 2 * want * (0.35 if scaled else 1.0)
    np.testing.assert_allclose(dq.numpy(), np.einsum("bhqk,bhkd->bhqd", ds, k), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(dk.numpy(), np.einsum("bhqk,bhqd->bhkd", ds, q), rtol=1e-4,
                               atol=1e-4)
