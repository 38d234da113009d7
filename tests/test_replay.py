"""tapas.execution.replay: Grappler options of the runtime's step functions
(``graph_optimization``); ``replay_op`` itself is exercised by every reconstruction test
(tests/test_reconstruct.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from tapas.execution import replay

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
        assert not rewrite.disable_meta_optimizer   # constant folding, remapper, ... run
    assert context.context().function_call_options.config_proto_serialized == before


def test_lean_with_accelerators_keeps_layout_and_memory_optimizers() -> None:
    with replay.graph_optimization("lean", accelerators=True):
        rewrite = _current().graph_options.rewrite_options
        assert rewrite.meta_optimizer_iterations == RC.ONE
        assert rewrite.layout_optimizer == RC.DEFAULT
        assert rewrite.memory_optimization == RC.DEFAULT_MEM_OPT


def test_options_the_user_set_are_kept_and_restored_after_an_error() -> None:
    ctx = context.context()
    saved = copy.copy(ctx.function_call_options)
    config = _current()
    config.graph_options.rewrite_options.layout_optimizer = RC.ON
    config.graph_options.rewrite_options.meta_optimizer_iterations = RC.TWO
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
