"""tapas.capturing.lowering: Keras grouped convolutions are traced as plain TensorFlow ops
(Keras itself runs them as XLA function calls, which reconstruction cannot rebuild), with
the same values as Keras; everything else is traced as Keras writes it."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tapas import capturing
from tapas.capturing import lowering
from tapas.ir import Kind

CALLS = {"StatefulPartitionedCall", "PartitionedCall"}


def _op_types(trace):
    return {op.type for op in trace.graph.get_operations()}


@pytest.mark.parametrize("layer, shape, lowered_to", [
    (lambda: keras.layers.Conv2D(12, 3, padding="same", groups=12), (2, 8, 8, 12),
     "DepthwiseConv2dNative"),                                         # ConvNeXt's depthwise
    (lambda: keras.layers.Conv2D(24, 3, strides=2, padding="same", groups=12), (2, 8, 8, 12),
     "DepthwiseConv2dNative"),                                         # channel multiplier 2
    (lambda: keras.layers.Conv2D(16, 3, strides=2, padding="same", groups=4),
     (2, 8, 8, 12), "Split"),                                          # ResNeXt-style groups
    (lambda: keras.layers.Conv1D(8, 3, padding="causal", groups=2), (2, 10, 6), "Split"),
], ids=["depthwise", "multiplier", "groups", "conv1d"])
def test_grouped_convolution_is_traced_without_a_function_call(layer, shape, lowered_to):
    keras.utils.set_random_seed(0)
    x = keras.Input(shape[1:])
    model = keras.Model(x, layer()(x))
    trace = capturing.trace(model, tf.TensorSpec(shape))
    types = _op_types(trace)
    assert not types & CALLS, types
    assert lowered_to in types
    graph = capturing.to_ir(trace)
    assert not [n for n in graph.nodes if n.kind == Kind.OPAQUE]
    value = np.random.default_rng(0).standard_normal(shape).astype("float32")
    want = model(value).numpy()
    got = trace.concrete_function(tf.constant(value)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("layer, shape, lowered_to", [
    (lambda k2: k2.layers.Conv2D(12, 3, padding="same", groups=12), (2, 8, 8, 12),
     "DepthwiseConv2dNative"),                                         # HF ConvNeXt, SegFormer
    (lambda k2: k2.layers.Conv2D(16, 3, strides=2, padding="same", groups=4),
     (2, 8, 8, 12), "Split"),                                          # HF RegNet
    (lambda k2: k2.layers.Conv1D(8, 4, padding="valid", groups=4), (2, 10, 8), "Split"),
], ids=["depthwise", "groups", "conv1d"])   # (Conv1D: Wav2Vec2's positional convolution)
def test_keras2_grouped_convolution_is_lowered_and_trains_on_shards(layer, shape, lowered_to):
    """Keras 2 (tf_keras, Hugging Face's TF models) runs a grouped convolution as a
    tf.function(jit_compile=True) call: a PartitionedCall in the trace, which the tape of
    the reconstructed program could not differentiate ("gradient registry has no entry
    for: PartitionedCall"). It is lowered as Keras 3's is; random plans on 2 simulated
    shards equal one device, gradients included; the method is restored after the trace."""
    import tf_keras as k2
    from tapas.execution.api import parallel
    from tapas.execution.checking import verify
    from tf_keras.src.layers.convolutional import base_conv
    original = base_conv.Conv.__dict__["_jit_compiled_convolution_op"]
    k2.utils.set_random_seed(0)
    x = k2.Input(shape[1:], batch_size=shape[0])
    model = k2.Model(x, k2.layers.Dense(4)(layer(k2)(x)))
    trace = capturing.trace(model, tf.TensorSpec(shape))
    assert base_conv.Conv.__dict__["_jit_compiled_convolution_op"] is original
    types = _op_types(trace)
    assert not types & CALLS, types
    assert lowered_to in types
    value = np.random.default_rng(0).standard_normal(shape).astype("float32")
    want = model(value).numpy()
    got = trace.concrete_function(tf.constant(value)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    graph = capturing.to_ir(trace)
    for seed in range(2):
        cmp = verify.compare_with_single_device(trace, graph,
                                                parallel.random_plan(graph, 2, seed), [value])
        assert cmp.ok(), cmp.worst


def test_keras_keeps_its_own_convolution_outside_a_trace():
    from keras.src.backend.tensorflow import nn as tf_backend_nn
    original = tf_backend_nn.conv
    x = keras.Input((6, 6, 4))
    model = keras.Model(x, keras.layers.Conv2D(4, 3, groups=4)(x))
    capturing.trace(model, tf.TensorSpec((1, 6, 6, 4)))
    assert tf_backend_nn.conv is original
    with pytest.raises(RuntimeError, match="inside"):
        with lowering.grouped_convolutions_lowered():
            assert tf_backend_nn.conv is not original
            raise RuntimeError("inside")
    assert tf_backend_nn.conv is original


def test_an_ordinary_convolution_is_traced_as_keras_writes_it():
    x = keras.Input((6, 6, 4))
    model = keras.Model(x, keras.layers.Conv2D(8, 3)(x))
    types = _op_types(capturing.trace(model, tf.TensorSpec((1, 6, 6, 4))))
    assert "Conv2D" in types and not {"Split", "DepthwiseConv2dNative"} & types
