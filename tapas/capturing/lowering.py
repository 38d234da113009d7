"""Keras operations that TAPAS traces as other, equivalent TensorFlow ops (capture only).

In:  a Keras model being traced by :func:`tapas.capturing.tracing.trace`.
Out: the same model's graph, except that Keras's *grouped convolutions* (``Conv1D/2D/3D``
     with ``groups > 1``: ConvNeXt's depthwise 7x7, ResNeXt- and RegNet-style blocks) are
     traced as ordinary TensorFlow ops instead of an XLA function call; Keras 2's
     (``tf_keras``, Hugging Face's TF models) as well.

Why: TensorFlow has no CPU kernel for a grouped ``Conv2D``, so Keras's TensorFlow backend
runs every grouped convolution as a ``tf.function(jit_compile=True)`` call
(``keras.src.backend.tensorflow.nn.conv``). In the traced graph that is one
``StatefulPartitionedCall`` that reads the kernel variable inside its body: an opaque op
whose weight reads reconstruction cannot re-place (it would be refused even replicated).
Traced through :func:`grouped_convolutions_lowered` instead:

* ``groups == input channels`` on a 2-D convolution (depthwise; output channels ``C * m``):
  the kernel ``(kh, kw, 1, C*m)`` is reshaped to ``(kh, kw, C, m)`` and fed to
  ``tf.nn.depthwise_conv2d`` -- the same sums (output channel ``c*m + j`` reads input
  channel ``c`` with filter ``[:, :, 0, c*m + j]`` in both), a kernel every device has, and
  ops the sharding rules know (``Reshape``, ``DepthwiseConv2dNative``);
* any other ``groups``: the input and kernel are split into ``groups`` pieces along the
  channel axis, each piece convolved with ``tf.nn.convolution``, the results concatenated.

Only the captured graph changes; the Keras model keeps running its XLA call, so the
parallel program and the model agree to rounding (different summation order), which
``verify`` tolerates. Cases TensorFlow cannot express without XLA (channels-first 3-D,
strides together with dilation on a depthwise convolution) keep Keras's own path, and
stay opaque GraphNodes.

This module patches one attribute of Keras's TensorFlow backend (the module function
``conv``), and when tf_keras is in use one method of its convolution base class
(``Conv._jit_compiled_convolution_op``, the same XLA call), for the duration of a trace and
restores them afterwards; it is the only place TAPAS touches Keras internals.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["grouped_convolutions_lowered", "MAX_GROUPS_SPLIT"]

MAX_GROUPS_SPLIT = 64   # grouped convolutions with more groups (not depthwise) keep Keras's path

_lock = threading.Lock()


def _tuple(value: Any, rank: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * rank
    value = tuple(int(v) for v in value)
    return value * rank if len(value) == 1 else value


def _lowered_conv(original: Any) -> Any:
    def conv(inputs: Any, kernel: Any, strides: Any = 1, padding: str = "valid",
             data_format: str | None = None, dilation_rate: Any = 1) -> Any:
        from keras.src import backend
        fmt = backend.standardize_data_format(data_format)
        rank = len(inputs.shape) - 2
        channels = inputs.shape[-1] if fmt == "channels_last" else inputs.shape[1]
        in_per_group = kernel.shape[-2]
        if (fmt != "channels_last" or channels is None or in_per_group is None
                or channels == in_per_group or channels % in_per_group):
            return original(inputs, kernel, strides, padding, data_format, dilation_rate)
        groups = channels // in_per_group
        strides_t, dilations = _tuple(strides, rank), _tuple(dilation_rate, rank)
        pad = padding.upper()
        if rank == 2 and in_per_group == 1:
            if max(strides_t) > 1 and max(dilations) > 1:
                return original(inputs, kernel, strides, padding, data_format, dilation_rate)
            kh, kw, _, out = kernel.shape
            depthwise = tf.reshape(kernel, (kh, kw, channels, out // channels))
            return tf.nn.depthwise_conv2d(inputs, depthwise, (1, *strides_t, 1), pad,
                                          dilations=dilations)
        if groups > MAX_GROUPS_SPLIT:
            return original(inputs, kernel, strides, padding, data_format, dilation_rate)
        pieces = tf.split(inputs, groups, axis=-1)
        kernels = tf.split(kernel, groups, axis=-1)
        outs = [tf.nn.convolution(x, k, strides_t, pad, dilations=dilations)
                for x, k in zip(pieces, kernels)]
        return tf.concat(outs, axis=-1)

    return conv


@contextlib.contextmanager
def grouped_convolutions_lowered() -> Iterator[None]:
    """Within the block, Keras grouped convolutions trace as plain TensorFlow ops.

    Only Keras's TensorFlow backend is patched (the one TAPAS traces); the patch is undone
    on exit, also when tracing raises. Traces are serialized by a lock, so two threads
    tracing at once do not undo each other's patch.
    """
    try:
        from keras.src.backend.tensorflow import nn as tf_backend_nn
    except ImportError:          # another Keras layout: trace what Keras produces
        tf_backend_nn = None
    keras2 = _keras2_conv_class()
    with _lock:
        if tf_backend_nn is not None:
            original = tf_backend_nn.conv
            tf_backend_nn.conv = _lowered_conv(original)
        if keras2 is not None:
            original2 = keras2.__dict__["_jit_compiled_convolution_op"]
            keras2._jit_compiled_convolution_op = _keras2_grouped_conv(original2)
        try:
            yield
        finally:
            if tf_backend_nn is not None:
                tf_backend_nn.conv = original
            if keras2 is not None:
                keras2._jit_compiled_convolution_op = original2


def _keras2_conv_class() -> Any:
    """Keras 2's (tf_keras) convolution base class when tf_keras is in use (imported by the
    caller's model; never imported here), else None."""
    if "tf_keras" not in sys.modules:
        return None
    try:
        from tf_keras.src.layers.convolutional import base_conv
    except ImportError:
        return None
    conv = getattr(base_conv, "Conv", None)
    return conv if "_jit_compiled_convolution_op" in getattr(conv, "__dict__", {}) else None


def _keras2_grouped_conv(original: Any) -> Any:
    """Keras 2's grouped convolution (``Conv._jit_compiled_convolution_op``: a
    ``tf.function(jit_compile=True)`` of the layer's convolution, one ``PartitionedCall``
    whose gradient the tape cannot record; Hugging Face's ConvNeXt, RegNet, SegFormer and
    Wav2Vec2 use it) lowered as Keras 3's is; cases it cannot lower run the original."""
    def op(self: Any, inputs: Any, kernel: Any) -> Any:
        def keep(*_args: Any) -> Any:
            return original.__get__(self, type(self))(inputs, kernel)
        padding = "valid" if self.padding == "causal" else self.padding
        return _lowered_conv(keep)(inputs, kernel, self.strides, padding, self.data_format,
                                   self.dilation_rate)
    return op
