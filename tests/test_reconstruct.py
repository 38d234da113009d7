"""tapas.execution.program.reconstruct: single-device replay equals the model; whole-model sharded plans on
simulated shards equal one device, and run exactly the collectives the plan predicts."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import keras

from matrix import pick  # tests/matrix.py
from tapas import capturing, models
from tapas.sharding import patterns, placements
from tapas.execution.checking import audit, verify
from tapas.execution.program import reconstruct as rc
from tapas.planning.cost import Cluster
from tapas.sharding.placements import Collective

R, S, P = placements.Replica(), placements.Split, placements.Partial()


def _mlp(batch=4):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(4)(h), name="mlp"), [tf.TensorSpec([batch, 8])]


def _zoo(name, batch=2):
    entry = models.get(name)
    return entry.build(seed=0), list(entry.input_spec(batch))


def _resnet50():
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    return model, [tf.TensorSpec([2, 32, 32, 3])]


def _inputs(specs, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 16, size=s.shape.as_list()).astype(s.dtype.as_numpy_dtype)
            if s.dtype.is_integer else rng.standard_normal(s.shape.as_list()).astype("float32")
            for s in specs]


# ---- one device -------------------------------------------------------------------------

# ResNet-50 (the largest graph here) under TAPAS_FULL_MATRIX=1: resnet-tiny has its blocks
@pytest.mark.parametrize("build", pick(
    [_mlp, lambda: _zoo("t5-tiny"), lambda: _zoo("moe-tiny"), lambda: _zoo("resnet-tiny")],
    [_mlp, lambda: _zoo("t5-tiny"), lambda: _zoo("moe-tiny"), lambda: _zoo("resnet-tiny"),
     _resnet50]), ids=pick(["mlp", "t5-tiny", "moe-tiny", "resnet-tiny"],
                           ["mlp", "t5-tiny", "moe-tiny", "resnet-tiny", "resnet50"]))
def test_single_device_replay_equals_the_keras_model(build):
    model, specs = build()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    prog = rc.Program(t, g, rc.Plan.replicated(g, 1))
    weights = prog.trace_weights()
    variables = [v for v in model.trainable_weights]
    xs = [tf.constant(x) for x in _inputs(specs)]

    @tf.function
    def replay():
        with tf.GradientTape() as tape:
            out = prog([[x] for x in xs], weights, rc.SimulatedCollectives(1))[0][0]
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, variables)

    @tf.function
    def reference():
        with tf.GradientTape() as tape:
            out = model(xs if len(xs) > 1 else xs[0], training=False)
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, variables)

    (o1, g1), (o2, g2) = replay(), reference()
    guarded = [op for op in replay.get_concrete_function().graph.get_operations()
               if op.type == "EnsureShape"]
    if not guarded:
        np.testing.assert_array_equal(o1.numpy(), o2.numpy())  # the same ops: bit-identical
    else:
        # moe-tiny's attention: the replay keeps Grappler from fusing its scaled scores and
        # causal mask into oneDNN's slow fused batch matmul (tapas/execution/program/replay.py), so
        # that sum is rounded in another order than in Keras's fused kernel
        assert model.name.startswith("gshard_moe"), [op.name for op in guarded]
        np.testing.assert_allclose(o1.numpy(), o2.numpy(), rtol=1e-5, atol=1e-5)
    assert all(a is not None for a in g1)
    for v, a, b in zip(variables, g1, g2):
        a, b = tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(np.abs(b).max(), 1e-6),
                                   err_msg=v.path)


@pytest.mark.parametrize("activation,op", [("softmax", "Softmax"), ("sigmoid", "Sigmoid"),
                                           (None, None)])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.filterwarnings("ignore:.*received `from_logits=True`")  # Keras's, intended here
def test_outputs_of_a_softmax_or_sigmoid_carry_their_logits_as_in_keras(activation, op, n):
    """Keras's crossentropy computes from the logits of a softmax/sigmoid output (even with
    from_logits=True); a loss of the program's local outputs must do the same, here with the
    batch split over n simulated shards."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation=activation)])
    specs = [tf.TensorSpec([4, 8])]
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    assert rc.Program(t, g, rc.Plan.replicated(g, 1)).output_activations == (op,)
    batch = {node.id: next(p for p in patterns.patterns_for(node, g, n) if p.name == "batch")
             for node in g.nodes}
    prog = rc.Program(t, g, rc.Plan(n, batch))
    x = tf.constant(_inputs(specs)[0])
    y = tf.constant([0, 5, 2, 3])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction="sum")
    weights = {p: [w] * n for p, [w] in prog.trace_weights().items()}

    @tf.function
    def replay():
        outs = prog([tf.split(x, n)], weights, rc.SimulatedCollectives(n))[0]
        return tf.add_n([loss(yl, o) for yl, o in zip(tf.split(y, n), outs)])

    want = loss(y, model(x))
    assert (op is not None) == (abs(float(want) - float(loss(y, tf.identity(model(x))))) > 1e-3)
    np.testing.assert_allclose(float(replay()), float(want), rtol=1e-6)


def test_replay_outside_a_tf_function_is_a_clear_error():
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    prog = rc.Program(t, g, rc.Plan.replicated(g, 1))
    with pytest.raises(rc.ReconstructError, match="inside a tf.function"):
        prog([[tf.zeros([4, 8])]], prog.trace_weights(), rc.SimulatedCollectives(1))


# ---- hand-written Megatron MLP ------------------------------------------------------------

def _megatron(g, n):
    d1, d2 = g.nodes[1], g.nodes[2]
    x = g.inputs[0]
    kernel1 = next(w.path for w in d1.weights if w.path.endswith("kernel"))
    bias1 = next(w.path for w in d1.weights if w.path.endswith("bias"))
    kernel2 = next(w.path for w in d2.weights if w.path.endswith("kernel"))
    bias2 = next(w.path for w in d2.weights if w.path.endswith("bias"))
    matmul2 = next(op.outputs[0] for op in d2.ops if op.type == "MatMul")
    column = rc.NodeSharding("column", (R,), (S(1),), {kernel1: S(1), bias1: S(0)},
                             comms=(placements.Comm(Collective.ALL_REDUCE, x.name, x.shape, x.dtype,
                                             P, R, "bwd"),))
    row = rc.NodeSharding("row", (S(1),), (R,), {kernel2: S(0), bias2: R},
                          tensors={matmul2.name: P},
                          comms=(placements.Comm(Collective.ALL_REDUCE, matmul2.name, matmul2.shape,
                                          matmul2.dtype, P, R, "fwd"),))
    return rc.Plan(n, {1: column, 2: row})


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_mlp_equals_one_device_with_one_all_reduce_each_way(n):
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    plan = _megatron(g, n)
    cmp = verify.compare_with_single_device(t, g, plan, _inputs(specs))
    assert cmp.ok(rtol=1e-5, atol=1e-5), str(cmp.worst)
    assert sorted((r.kind.value, r.phase) for r in cmp.audit) == [("AR", "bwd"), ("AR", "fwd")]
    prog = rc.Program(t, g, plan)
    assert audit.compare_audit(cmp.audit, audit.program_comms(prog, input_gradients=True)) == []
    # in training (no input gradient) the backward all-reduce of x is not needed
    assert [r.phase for r in audit.program_comms(prog)] == ["fwd"]
    assert prog.weight_layouts[g.nodes[1].weights[1].path].local_shape[-1] == 16 // n


def test_a_missing_backward_all_reduce_is_caught():
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    plan = _megatron(g, 2)
    broken = dataclasses.replace(plan.patterns[1], comms=())
    cmp = verify.compare_with_single_device(t, g, rc.Plan(2, {1: broken, 2: plan.patterns[2]}),
                                        _inputs(specs))
    assert not cmp.ok()
    assert cmp.worst.what == "gradient of input 0"


def test_resharding_between_nodes_batch_then_row():
    """A batch-split layer feeding a row-split one: an all-to-all moves the split from
    the batch to the hidden dimension (and back for the gradient)."""
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    batch = next(p for p in patterns.patterns_for(g.nodes[1], g, 2) if p.name == "batch")
    row = next(p for p in patterns.patterns_for(g.nodes[2], g, 2) if p.name == "row")
    plan = rc.Plan(2, {1: batch, 2: row})
    cmp = verify.compare_with_single_device(t, g, plan, _inputs(specs))
    assert cmp.ok(), str(cmp.worst)
    kinds = sorted((r.kind.value, r.phase) for r in cmp.audit)
    assert ("A2A", "fwd") in kinds and ("A2A", "bwd") in kinds
    prog = rc.Program(t, g, plan)
    assert audit.compare_audit(cmp.audit, audit.program_comms(prog, input_gradients=True)) == []


# ---- whole models with random valid plans -------------------------------------------------

def _random_plan(g, n, seed):
    rng = np.random.default_rng(seed)
    chosen = {}
    for node in g.nodes:
        pats = patterns.patterns_for(node, g, n)
        chosen[node.id] = pats[int(rng.integers(len(pats)))]
    return rc.Plan(n, chosen)


# the zoo presets with one random plan each in the suite, two under TAPAS_FULL_MATRIX=1
@pytest.mark.parametrize("name,n,seeds", [("mlp", 2, range(3)), ("mlp", 4, range(3)),
                                          ("t5-tiny", 2, pick(range(1), range(2))),
                                          ("moe-tiny", 2, pick(range(1), range(2))),
                                          ("resnet-tiny", 2, pick(range(1), range(2)))])
def test_random_whole_model_plans_equal_one_device(name, n, seeds):
    model, specs = _mlp() if name == "mlp" else _zoo(name, batch=4)
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    xs = _inputs(specs)
    for seed in seeds:
        plan = _random_plan(g, n, seed)
        try:
            cmp = verify.compare_with_single_device(t, g, plan, xs)
        except rc.ReconstructError as err:
            # only a plan that needs a partial value at a node boundary may be refused
            assert "partial" in str(err), str(err)
            continue
        names = {i: plan.patterns[i].name for i in plan.patterns}
        assert cmp.ok(rtol=1e-5, atol=1e-5), f"seed {seed}: {cmp.worst}; plan {names}"
        prog = rc.Program(t, g, plan)
        diff = audit.compare_audit(cmp.audit, audit.program_comms(prog, input_gradients=True))
        assert diff == [], f"seed {seed}: {diff}"


class _IndexedBias(keras.layers.Layer):
    """A bias looked up by an index tensor the layer computes once in Python, as keras-hub
    Swin's window attention holds its relative position index: the traced function captures
    it (a placeholder fed from outside, above 128 elements; TensorFlow embeds smaller ones as
    Const ops), neither an input nor a variable."""

    def build(self, shape):
        self.table = self.add_weight(shape=(6,), name="table")
        i = np.arange(shape[-1])
        self.index = tf.constant((i[:, None] - i[None, :]) % 6, tf.int32)   # an eager tensor

    def call(self, x):
        return x + tf.gather(self.table, self.index)


def test_a_tensor_captured_from_python_is_a_constant_of_every_plan():
    x = keras.Input((16, 16))
    h = keras.layers.Dense(16, name="d1")(x)
    model = keras.Model(x, keras.layers.Dense(8, name="d2")(_IndexedBias(name="bias")(h)))
    specs = [tf.TensorSpec([4, 16, 16])]
    t = capturing.trace(model, specs)
    (index,) = t.constants.values()
    assert index.shape == (16, 16) and index[3, 1] == 2 and index[1, 3] == 4
    g = capturing.to_ir(t)
    assert any(op.type == "Placeholder" and op.name in t.constants
               for node in g.nodes for op in node.ops)
    xs = _inputs(specs)
    for n, seed in ((2, 0), (2, 1), (4, 2)):
        plan = _random_plan(g, n, seed)
        cmp = verify.compare_with_single_device(t, g, plan, xs)
        assert cmp.ok(rtol=1e-5, atol=1e-5), f"N={n} seed {seed}: {cmp.worst}"


class _QueryTokens(keras.layers.Layer):
    """BLIP-2's Q-Former input: learned query tokens broadcast to the batch (ops on the
    weight alone)."""

    def build(self, shape):
        self.tokens = self.add_weight(shape=(1, 4, shape[-1]), name="tokens")

    def call(self, x):
        return keras.ops.broadcast_to(self.tokens, (x.shape[0], 4, x.shape[-1]))

    def compute_output_shape(self, shape):
        return (shape[0], 4, shape[-1])


def test_a_weight_consumed_through_weight_side_ops_is_stored_where_it_is_read():
    """A GraphNode lists the weights of the weight-side ops whose outputs it consumes (the
    layer-normed query tokens); it reaches them as inputs, not reads. Stored placement,
    the cost model's weight reshards and the audit's prediction count only the GraphNodes
    that read the weight (keras-hub BLIP-2's audit predicted an all-gather and an
    all-to-all of the query tokens that the program never ran)."""
    x = keras.Input((8, 16))
    tokens = keras.layers.LayerNormalization(name="norm")(_QueryTokens(name="query")(x))
    q = keras.layers.Dense(16, name="q")(tokens)
    k = keras.layers.Dense(16, use_bias=False, name="k")(tokens)  # its bias: no gradient
    scores = keras.layers.Softmax()(keras.ops.einsum("bqd,bkd->bqk", q, k))
    mixed = keras.ops.einsum("bqk,bkd->bqd", scores, keras.layers.Dense(16, name="v")(tokens))
    model = keras.Model(x, keras.layers.Dense(8, name="out")(mixed + tokens))
    specs = [tf.TensorSpec([4, 8, 16])]
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    listers = [n for n in g.nodes for w in n.weights if w.path.endswith("tokens")]
    readers = [n for n in listers if any(n.reads(w) for w in n.weights
                                         if w.path.endswith("tokens"))]
    assert len(readers) == 1 and len(listers) > 1, [n.name for n in listers]
    xs = _inputs(specs)
    differs = 0
    for n, seed in ((2, 0), (2, 1), (2, 2), (4, 3), (4, 4)):
        plan = _random_plan(g, n, seed)
        path = next(w.path for w in readers[0].weights if w.path.endswith("tokens"))
        want = {str(plan.pattern(node).weights[path]) for node in listers}
        differs += len(want) > 1
        cmp = verify.compare_with_single_device(t, g, plan, xs)
        assert cmp.ok(rtol=1e-5, atol=1e-5), f"N={n} seed {seed}: {cmp.worst}"
        prog = rc.Program(t, g, plan)
        assert str(prog.weight_layouts[path].placement) == str(
            plan.pattern(readers[0]).weights[path])
        diff = audit.compare_audit(cmp.audit, audit.program_comms(prog, input_gradients=True))
        assert diff == [], f"N={n} seed {seed}: {diff}"
    assert differs, "no plan gave the listers other placements than the reader"


class _FloorProjection(keras.layers.Layer):
    """A projection of its input rounded down: it reads the tensor, passes no gradient
    back to it."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], shape[-1]), name="kernel")

    def call(self, x):
        return tf.matmul(tf.floor(x), self.kernel)


def test_a_node_that_reads_a_tensor_without_a_gradient_runs_no_backward_comm_of_it():
    """``h`` gets a gradient through one GraphNode; another reads it only through Floor. A
    backward all-reduce of ``h`` in the second GraphNode's pattern never runs (its readers
    pass nothing back), though ``h`` has a gradient: keras-hub D-FINE reads its encoder
    memory in one GraphNode only to select by it, and the prediction counted that
    GraphNode's backward all-reduce."""
    from tapas.sharding.gradients import gradient_flow
    from tapas.sharding.placements import Comm, Partial, Replica
    x = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="h")(x)
    a = keras.layers.Dense(16, name="a")(h)
    b = _FloorProjection(name="b")(h)
    g = capturing.capture(keras.Model(x, keras.layers.Add()([a, b])), [tf.TensorSpec([4, 8, 16])])
    flow = gradient_flow(g)
    hidden = next(t for n in g.nodes for t in n.outputs if t.name.startswith(
        next(n.name for n in g.nodes if any(w.path.startswith("h/") for w in n.weights))))
    readers = [n for n in g.nodes if hidden.name in {t.name for t in n.inputs}]
    comm = Comm(Collective.ALL_REDUCE, hidden.name, hidden.shape, hidden.dtype, Partial(),
                Replica(), "bwd")
    runs = {any(op.type == "Floor" for op in n.ops): audit._pattern_comm_runs(comm, n, flow)
            for n in readers}
    assert hidden.name in flow.needed and runs == {True: False, False: True}, runs


def test_searched_strategy_runs_and_matches_its_prediction():
    model, specs = _zoo("t5-tiny", batch=4)
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    from tapas.planning import search
    strategy = search.search(g, cluster=Cluster.loopback_cpu(4))
    plan = rc.Plan.from_strategy(strategy, g)
    # the one plan type: the Strategy rides along (bound to g) for its resharding edges
    assert plan.strategy is not None and plan.strategy.graph_digest == plan.graph_digest
    assert rc.Plan.of(plan, g) is plan and rc.Plan.of(strategy, g).patterns == plan.patterns
    cmp = verify.compare_with_single_device(t, g, plan, _inputs(specs))
    assert cmp.ok(rtol=1e-5, atol=1e-5), str(cmp.worst)
    prog = rc.Program(t, g, plan)
    assert audit.compare_audit(cmp.audit, audit.program_comms(prog, input_gradients=True)) == []
    # the same patterns without the Strategy: the reshards between GraphNodes predicted
    bare = rc.Program(t, g, dataclasses.replace(plan, strategy=None))
    assert audit.compare_audit(cmp.audit, audit.program_comms(bare, input_gradients=True)) == []


# ---- bad input ----------------------------------------------------------------------------

def test_indivisible_weight_split_is_refused_before_building():
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    plan = _megatron(g, 3)  # 16 hidden units over 3 devices
    with pytest.raises(rc.ReconstructError, match="not divisible by 3 devices"):
        rc.Program(t, g, plan)


def test_plan_for_another_graph_and_wrong_device_count_are_named():
    model, specs = _mlp()
    t = capturing.trace(model, specs)
    g = capturing.to_ir(t)
    wrong = rc.Plan(2, {1: rc.NodeSharding("x", (R, R), (R,), {})})
    with pytest.raises(rc.ReconstructError, match="made for another graph"):
        rc.Program(t, g, wrong)
    prog = rc.Program(t, g, _megatron(g, 2))
    with pytest.raises(rc.ReconstructError, match="plan is for 2 devices"):
        prog([[tf.zeros([4, 8])]] * 4, {}, rc.SimulatedCollectives(4))


def test_shard_and_unshard_round_trip():
    x = np.arange(24, dtype="float32").reshape(4, 6)
    parts = [S(1).shard(x, 3, i) for i in range(3)]
    assert parts[1].shape == (4, 2)
    np.testing.assert_array_equal(S(1).unshard(parts), x)
    assert R.unshard([x, x]) is x
    with pytest.raises(ValueError, match="cannot be sharded as P"):
        P.shard(x, 2, 0)


def test_a_cond_whose_branch_reads_a_variable_takes_its_value() -> None:
    """A tf.cond whose branch reads a model variable (Hugging Face LED's global attention)
    passes the variable's resource into the branch; the program holds weights as values,
    so the replayed cond gets branches that take the value (their reads become
    identities): equal to Keras on one device, and random plans on 2 shards equal one
    device, gradients included (before: refused, 'reads weight directly')."""
    class Gated(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight((shape[-1], shape[-1]), name="kernel")

        def call(self, x):
            return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.relu(tf.matmul(x, self.kernel)),
                           lambda: x)

    keras.utils.set_random_seed(0)
    x = keras.Input((4,), batch_size=2)
    model = keras.Model(x, keras.layers.Dense(4)(Gated()(x)))
    from tapas.execution.api import parallel
    from tapas.execution.program.collectives import SimulatedCollectives
    trace = capturing.trace(model, tf.TensorSpec([2, 4]))
    graph = capturing.to_ir(trace)
    assert any(op.type in ("If", "StatelessIf") for n in graph.nodes for op in n.ops)
    prog = rc.Program(trace, graph, rc.Plan.replicated(graph, 1))
    value = np.abs(np.random.default_rng(0).standard_normal((2, 4))).astype("float32")
    run = tf.function(lambda: prog([[tf.constant(value)]], prog.trace_weights(),
                                   SimulatedCollectives(1))[0][0], autograph=False)
    np.testing.assert_allclose(run().numpy(), model(value).numpy(), rtol=1e-6)
    for seed in range(3):
        cmp = verify.compare_with_single_device(trace, graph, parallel.random_plan(graph, 2, seed),
                                                [value])
        assert cmp.ok(), cmp.worst
        assert any("gated/kernel" in d.what for d in cmp.differences)


@tf.function
def _helper(h: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(h) * 2.0 + tf.tanh(h)


def test_a_nested_tf_function_call_is_differentiated() -> None:
    """A layer that calls a tf.function (Hugging Face LED's compute_hidden_states): the trace
    holds a PartitionedCall, which has no registered gradient, so a plan through it could
    not train ("gradient registry has no entry for: PartitionedCall"). It is replayed as an
    If of a constant true predicate calling the same function (differentiable): random
    plans on 2 shards equal one device, gradients included."""
    class Helped(keras.layers.Layer):
        def call(self, x):
            return _helper(x)

    keras.utils.set_random_seed(0)
    x = keras.Input((4,), batch_size=2)
    h = Helped()(keras.layers.Dense(8)(x))
    model = keras.Model(x, keras.layers.Dense(4)(h))
    from tapas.execution.api import parallel
    trace = capturing.trace(model, tf.TensorSpec([2, 4]))
    graph = capturing.to_ir(trace)
    assert any(op.type == "PartitionedCall" for n in graph.nodes for op in n.ops)
    value = np.random.default_rng(0).standard_normal((2, 4)).astype("float32")
    for seed in range(3):
        cmp = verify.compare_with_single_device(trace, graph, parallel.random_plan(graph, 2, seed),
                                                [value])
        assert cmp.ok(), cmp.worst
