"""Tests for tapas.sharding.gradients: which tensors the gradient reaches."""

import tensorflow as tf

from tapas import capturing
from tapas.sharding.gradients import gradient_flow


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


def test_a_floor_output_is_watched_but_passes_nothing_back_and_sign_passes_zeros():
    """Floor's registered gradient returns None: the tape records it, so its output gets a
    gradient (a collective after it runs its backward half: keras-hub D-FINE's sampling
    offsets), but its input gets none through it. Sign's gradient is zeros: its input's
    gradient is computed."""
    w = tf.Variable(tf.ones([4, 4]), name="w")

    @tf.function
    def f(x):
        h = tf.matmul(x, w)
        return tf.floor(h) * h + tf.sign(h)

    graph = capturing.capture(f, [tf.TensorSpec([2, 4])])
    flow = gradient_flow(graph)
    ops = {op.type: op for node in graph.nodes for op in node.ops}
    floor, sign = ops["Floor"], ops["Sign"]
    assert floor.outputs[0].name in flow.needed
    assert sign.outputs[0].name in flow.needed and sign.inputs[0] in flow.needed
    # the MatMul's output reaches the loss through the product as well, so it is needed;
    # what Floor must not do is make its input needed through itself alone
    from tapas import ir
    only_floor = ir.Graph(nodes=graph.nodes, edges=graph.edges, inputs=graph.inputs,
                          outputs=(floor.outputs[0],), name="floor-only")
    assert floor.inputs[0] not in gradient_flow(only_floor).needed


def test_integer_outputs_carry_no_gradient_back():
    """TopKV2's indices select rows of a detached tensor (keras-hub D-FINE's query
    selection): the scores the indices come from get no gradient through them, so the
    audit must not predict backward collectives on them."""
    w = tf.Variable(tf.ones([4, 4]), name="w")

    @tf.function
    def f(x):
        scores = tf.reduce_sum(tf.matmul(x, w), axis=1)
        _, idx = tf.math.top_k(scores, k=1)
        return tf.gather(tf.stop_gradient(x), idx) * 2.0

    graph = capturing.capture(f, [tf.TensorSpec([3, 4])])
    flow = gradient_flow(graph, input_gradients=True)
    ops = {op.type: op for node in graph.nodes for op in node.ops}
    assert ops["TopKV2"].inputs[0] not in flow.needed
    assert ops["MatMul"].outputs[0].name not in flow.needed


def _registered(op_type):
    """TensorFlow's gradient registration of ``op_type``: "none" (``NotDifferentiable``),
    "missing" (no gradient registered) or the gradient function."""
    from tensorflow.python.framework import ops
    try:
        fn = ops._gradient_registry.lookup(op_type)
    except LookupError:
        return "missing"
    return "none" if fn is None else fn


def _has_inputs(op_type):
    from tensorflow.python.framework import op_def_registry
    op_def = op_def_registry.get(op_type)
    return op_def is not None and len(op_def.input_arg) > 0


def test_every_op_tensorflow_calls_not_differentiable_is_in_the_one_no_gradient_list():
    """Every op type with a placement rule that TensorFlow registers ``NotDifferentiable``
    and that has inputs passes no gradient back in our list too (before, the propagation's
    list had OneHot and the random ops and the gradient flow's had not)."""
    from tapas.sharding import rules
    from tapas.sharding.gradients import NO_GRADIENT
    missing = [t for t in sorted(rules.RULES)
               if _registered(t) == "none" and _has_inputs(t) and t not in NO_GRADIENT]
    assert missing == []


def test_the_no_gradient_ops_with_a_registered_gradient_return_none_and_sign_returns_zeros():
    """An op of the list that has a registered gradient returns None for the input (or
    refuses: PreventGradient); the ops of the list TensorFlow registers nothing for have
    outputs no gradient can flow through; Sign, left out, passes zeros back."""
    from tapas.sharding.gradients import NO_GRADIENT, differentiable
    x = tf.constant([[0.4, -1.6], [2.5, 0.0]])
    built = {"ArgMax": lambda v: tf.math.argmax(v, 1), "ArgMin": lambda v: tf.math.argmin(v, 1),
             "Floor": tf.floor, "Ceil": tf.math.ceil, "Round": tf.round, "Rint": tf.math.rint}
    registered = {t for t in NO_GRADIENT if callable(_registered(t))}
    assert registered == set(built) | {"PreventGradient"}
    for op_type, fn in built.items():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.cast(fn(x), tf.float32)
        assert tape.gradient(y, x) is None, op_type
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.raw_ops.PreventGradient(input=x)
    try:
        tape.gradient(y, x)
        raise AssertionError("PreventGradient's gradient did not raise")
    except LookupError:
        pass
    from tensorflow.python.framework import op_def_registry
    for op_type in sorted(t for t in NO_GRADIENT if _registered(t) == "missing"):
        op_def = op_def_registry.get(op_type)
        attrs = {a.name: a for a in op_def.attr}
        # every type its outputs may have (fixed, or an attribute's allowed values) is one
        # no gradient can flow through
        types = [t for a in op_def.output_arg
                 for t in ([a.type] if a.type else attrs[a.type_attr].allowed_values.list.type)]
        assert types and not any(differentiable(tf.dtypes.as_dtype(t).name) for t in types), \
            op_type
    assert "Sign" not in NO_GRADIENT
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.sign(x)
    assert tape.gradient(y, x).numpy().tolist() == [[0.0, 0.0], [0.0, 0.0]]


def _flow_over_all_ops(graph, sources):
    """The whole-graph walk, every op at once in one topological order."""
    from tapas.sharding import gradients
    order = gradients.topological_ops([op for node in graph.nodes for op in node.ops])
    return gradients._forward(order, sources), gradients._backward(graph, order)


def test_the_memoized_flow_per_graph_node_equals_the_walk_over_all_ops(monkeypatch):
    """The flow is evaluated once per GraphNode signature and boundary state: on a stack of
    identical layers whose first computes a bias that every later layer reads (and with
    input gradients, and a layer without gradient through it), it is the walk over all
    ops, and the repeated layers are evaluated once, not once per layer."""
    import keras

    from tapas.sharding import gradients

    class Block(keras.layers.Layer):
        def __init__(self, first, **kw):
            super().__init__(**kw)
            self.first = first
            self.dense = keras.layers.Dense(8)
            self.norm = keras.layers.LayerNormalization()
            self.bias = keras.layers.Dense(8) if first else None

        def call(self, x, bias=None):
            if self.first:
                bias = self.bias(keras.ops.ones((2, 8)))
            return self.norm(x + self.dense(x) + bias), bias

    x_in = keras.Input((8,), batch_size=2)
    x, bias = x_in, None
    for i in range(6):
        x, bias = Block(i == 0, name=f"block{i}")(x, bias)
    x = x + keras.ops.stop_gradient(keras.layers.Dense(8)(x))
    model = keras.Model(x_in, x)
    graph = capturing.capture(model)
    calls = []
    real = gradients._node_forward
    monkeypatch.setattr(gradients, "_node_forward",
                        lambda *a: calls.append(a[0].signature) or real(*a))
    for input_gradients in (False, True):
        flow = gradient_flow(graph, input_gradients=input_gradients)
        sources = {w.placeholder + ":0" for w in graph.weights if w.trainable}
        if input_gradients:
            sources |= {t.name for t in graph.inputs if t.dtype.startswith("float")}
        forward, backward = _flow_over_all_ops(graph, sources)
        assert (flow.forward, flow.backward) == (forward, backward)
        paths = {w.path for w in graph.weights if w.trainable}
        detached = {p for p in paths if not p.startswith("block")}
        assert detached and not detached & flow.needed     # behind the stop_gradient
        assert paths - detached <= flow.needed
    # a source made by an op with inputs (an inner tensor): the walk over all ops answers
    inner = next(t.name for n in graph.nodes[len(graph.nodes) // 2:] for op in n.ops
                 if op.inputs for t in op.outputs if t.dtype == "float32")
    assert gradients._flow_by_node(graph, {inner}) is None
    flow = gradient_flow(graph, input_gradients=[inner])
    assert (flow.forward, flow.backward) == _flow_over_all_ops(graph, {inner} | {
        w.placeholder + ":0" for w in graph.weights if w.trainable})
    signatures = [n.signature for n in graph.nodes]
    repeated = {s for s in signatures if signatures.count(s) > 1}
    assert repeated, [n.name for n in graph.nodes]
    assert len(calls) < 2 * len(graph.nodes), (len(calls), len(graph.nodes))
    assert all(calls.count(s) < 2 * signatures.count(s) for s in repeated)
