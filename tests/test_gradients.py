"""Tests for tapas.execution.gradients: which tensors the gradient reaches."""

import tensorflow as tf

from tapas import capturing
from tapas.execution.gradients import gradient_flow


def test_the_gradient_flows_through_a_tensor_list():
    """A loop's TensorArray (keras-hub RWKV-7's unrolled recurrence stacks its states):
    the handles are variants, and TensorFlow differentiates through TensorListSetItem and
    TensorListStack, so the stacked values get a gradient. Before, the flow stopped at the
    variant, and the collective audit missed the backward all-gather of a split reader of
    the stacked values."""
    w = tf.Variable(tf.ones([4, 4]), name="w")

    @tf.function
    def f(x):
        states = tf.TensorArray(tf.float32, size=3)
        h = x
        for i in range(3):
            h = tf.tanh(tf.matmul(h, w))
            states = states.write(i, h)
        return tf.reduce_sum(states.stack(), axis=0)

    graph = capturing.capture(f, [tf.TensorSpec([2, 4])])
    flow = gradient_flow(graph)
    stacked = [t.name for node in graph.nodes for op in node.ops if op.type == "TensorListStack"
               for t in op.outputs]
    assert stacked, [op.type for node in graph.nodes for op in node.ops]
    assert set(stacked) <= flow.forward and set(stacked) <= flow.needed
