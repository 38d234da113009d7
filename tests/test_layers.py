"""tapas.layers: ordinary Keras layers that capture as exactly one GraphNode each."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapas
from tapas import layers as L
from tapas.ir import Kind


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# (layer factory, input shape without batch, expected kind); every layer of tapas.layers
CASES = {
    "DenseLayer": (lambda: L.DenseLayer(6, activation="relu"), (5,), Kind.DENSE),
    "DenseLayer3d": (lambda: L.DenseLayer(6, use_bias=False), (3, 5), Kind.DENSE),
    "MultiHeadAttention": (lambda: L.MultiHeadAttention(2, 4, causal=True), (6, 8),
                           Kind.ATTENTION),
    "FeedForward": (lambda: L.FeedForward(12, activation="gelu", gated=True), (3, 8),
                    Kind.FEED_FORWARD),
    "LayerNorm": (lambda: L.LayerNorm(), (3, 8), Kind.NORM),
    "RMSNorm": (lambda: L.LayerNorm(rms=True), (3, 8), Kind.NORM),
    "Conv2D": (lambda: L.Conv2D(4, 3, strides=2, activation="relu"), (8, 8, 3), Kind.CONV),
    "MoE": (lambda: L.MoE(4, 8, top_k=2), (3, 8), Kind.MOE),
}


def _model(factory, shape, batch=2):
    x = keras.Input(shape, batch_size=batch)
    return keras.Model(x, factory()(x))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_layer_trains_in_plain_keras(name):
    factory, shape, _ = CASES[name]
    model = _model(factory, shape, batch=None)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x = _x(8, *shape)
    y = np.zeros((8,) + tuple(model.output_shape[1:]), "float32") + 0.5
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)) and history[-1] < history[0], history
    changed = [not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)]
    assert all(changed), f"{name}: some weights received no gradient: {changed}"


def test_embedding_trains_in_plain_keras():
    ids = keras.Input((5,), dtype="int32")
    model = keras.Model(ids, L.DenseLayer(1)(L.Embedding(20, 4)(ids)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.random.default_rng(0).integers(0, 20, (16, 5)).astype("int32")
    loss = model.fit(x, np.ones((16, 5, 1), "float32"), epochs=3, verbose=0).history["loss"]
    assert loss[-1] < loss[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_capture_yields_one_graph_node_of_the_layer_kind(name):
    factory, shape, kind = CASES[name]
    model = _model(factory, shape)
    graph = tapas.capture(model)
    heavy = [n for n in graph.nodes if n.kind not in (Kind.INPUT, Kind.RESHAPE)]
    assert [n.kind for n in heavy] == [kind], [(n.kind, n.name) for n in graph.nodes]
    assert {w.path for w in heavy[0].weights} == {w.path for w in model.weights}


def test_layers_stay_one_graph_node_inside_any_model():
    """Sequential, functional with residual adds, and a subclassed model: one GraphNode per
    tapas layer call, the glue between them outside."""
    seq = keras.Sequential([keras.Input((6, 8), batch_size=2), L.LayerNorm(),
                            L.DenseLayer(16, activation="relu"), L.DenseLayer(8)])
    kinds = collections.Counter(n.kind for n in tapas.capture(seq).nodes)
    assert kinds[Kind.NORM] == 1 and kinds[Kind.DENSE] == 2

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm1, self.att = L.LayerNorm(), L.MultiHeadAttention(2, 4)
            self.norm2, self.ffn = L.LayerNorm(rms=True), L.FeedForward(16)
            self.moe = L.MoE(2, 8, top_k=1)

        def call(self, x):
            h = x + self.att(self.norm1(x))
            h = h + self.ffn(self.norm2(h))
            return h + self.moe(h)

    block = Block()
    block(_x(2, 6, 8))
    graph = tapas.capture(block, tf.TensorSpec([2, 6, 8]))
    kinds = collections.Counter(n.kind for n in graph.nodes)
    assert kinds[Kind.ATTENTION] == 1 and kinds[Kind.FEED_FORWARD] == 1
    assert kinds[Kind.MOE] == 1 and kinds[Kind.NORM] == 2
    assert kinds[Kind.ELEMENTWISE] == 3          # the three residual adds
    assert sum(len(n.weights) for n in graph.nodes) == len(block.weights)


def test_equal_layers_get_equal_signatures_and_a_shared_layer_one_node_per_call():
    x = keras.Input((8,), batch_size=2)
    model = keras.Model(x, L.DenseLayer(8, activation="tanh")(L.DenseLayer(8, activation="tanh")(x)))
    dense = [n for n in tapas.capture(model).nodes if n.kind == Kind.DENSE]
    assert len(dense) == 2 and dense[0].signature == dense[1].signature
    shared = L.DenseLayer(8, activation="tanh")
    model = keras.Model(x, shared(shared(x)))
    dense = [n for n in tapas.capture(model).nodes if n.kind == Kind.DENSE]
    assert len(dense) == 2 and all(n.weights == dense[0].weights for n in dense)


def test_pins_are_recorded_and_part_of_the_signature():
    x = keras.Input((8,), batch_size=2)
    h = L.DenseLayer(16, shard="column")(x)
    h = L.DenseLayer(16)(h)
    y = L.DenseLayer(8, shard="C_AR(MatMul(S1(X), S0(W)))")(h)
    graph = tapas.capture(keras.Model(x, y))
    dense = [n for n in graph.nodes if n.kind == Kind.DENSE]
    assert [n.pin for n in dense] == ["column", None, "C_AR(MatMul(S1(X), S0(W)))"]
    # same shapes (16 -> 16 and 8 -> 16 differ, so compare a pinned/unpinned twin)
    twin_x = keras.Input((8,), batch_size=2)
    twin = keras.Model(twin_x, L.DenseLayer(16)(twin_x))
    (twin_node,) = [n for n in tapas.capture(twin).nodes if n.kind == Kind.DENSE]
    assert twin_node.signature != dense[0].signature
    assert tapas.ir.Graph.loads(graph.dumps()).nodes[dense[0].id].pin == "column"


def test_bad_pins_and_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"DenseLayer\(shard='diagonal'\).*column, row"):
        L.DenseLayer(4, shard="diagonal")
    with pytest.raises(ValueError, match="not a valid SRC expression"):
        L.DenseLayer(4, shard="C_AR(MatMul(S1(X)")
    with pytest.raises(TypeError, match="a pin is a string"):
        L.Conv2D(4, 3, shard=1)
    with pytest.raises(ValueError, match=r"MoE\(top_k=5\).*num_experts=4"):
        L.MoE(4, 8, top_k=5)
    with pytest.raises(ValueError, match=r"FeedForward\(d_ff=0\)"):
        L.FeedForward(0)


def test_config_round_trip_and_keras_file(tmp_path):
    x = keras.Input((6, 8), batch_size=2)
    ids = keras.Input((6,), batch_size=2, dtype="int32")
    h = x + L.Embedding(30, 8, shard="vocab")(ids)
    h = h + L.MultiHeadAttention(2, 4, shard="heads")(L.LayerNorm()(h))
    h = h + L.FeedForward(16, gated=True, activation="gelu")(h)
    h = h + L.MoE(2, 8)(h)
    model = keras.Model([x, ids], L.DenseLayer(5, shard="row")(h))
    inputs = [_x(2, 6, 8), np.arange(12, dtype="int32").reshape(2, 6)]
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(model.predict(inputs, verbose=0),
                                  loaded.predict(inputs, verbose=0))
    assert [getattr(layer, "shard", None) for layer in loaded.layers] == \
           [getattr(layer, "shard", None) for layer in model.layers]


def _copy_and_compare(tapas_layer, keras_layer, x, transform=None):
    tapas_layer(x)
    keras_layer(x)
    weights = keras_layer.get_weights()
    tapas_layer.set_weights(transform(weights) if transform else weights)
    np.testing.assert_allclose(tapas_layer(x).numpy(), keras_layer(x).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_same_weights_same_outputs_as_plain_keras_layers():
    x3 = _x(2, 5, 8)
    _copy_and_compare(L.DenseLayer(6, activation="relu"),
                      keras.layers.Dense(6, activation="relu"), x3)
    _copy_and_compare(L.MultiHeadAttention(2, 4),
                      _KerasSelfAttention(keras.layers.MultiHeadAttention(2, 4)), x3)
    _copy_and_compare(L.LayerNorm(epsilon=1e-3), keras.layers.LayerNormalization(epsilon=1e-3),
                      x3)
    _copy_and_compare(L.Conv2D(4, 3, strides=2, activation="relu"),
                      keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
                      _x(2, 8, 8, 3))
    _copy_and_compare(L.FeedForward(12, activation="relu"), _KerasMLP(12, 8), x3)
    ids = np.array([[1, 4, 2], [0, 9, 9]], "int32")
    _copy_and_compare(L.Embedding(10, 3), keras.layers.Embedding(10, 3), ids)


class _KerasSelfAttention(keras.layers.Layer):
    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def call(self, x):
        return self.mha(x, x)


class _KerasMLP(keras.layers.Layer):
    def __init__(self, d_ff, d):
        super().__init__()
        self.wi, self.wo = keras.layers.Dense(d_ff, activation="relu"), keras.layers.Dense(d)

    def call(self, x):
        return self.wo(self.wi(x))


@pytest.mark.parametrize("name,kinds", [
    ("t5-tiny-tapas", {Kind.ATTENTION: 6, Kind.FEED_FORWARD: 4, Kind.NORM: 12}),
    ("moe-tiny-tapas", {Kind.ATTENTION: 2, Kind.FEED_FORWARD: 1, Kind.MOE: 1, Kind.NORM: 5}),
])
def test_zoo_models_built_from_tapas_layers(name, kinds):
    from tapas import models
    entry = models.get(name)
    model = entry.build(seed=0)
    graph = tapas.capture(model, list(entry.input_spec(2)))
    counts = collections.Counter(n.kind for n in graph.nodes)
    assert {k: counts[k] for k in kinds} == kinds
    assert graph.num_params == entry.param_count() == model.count_params()
    assert not any(n.kind in (Kind.DENSE, Kind.MATMUL) and not n.weights for n in graph.nodes)
    # it trains in plain Keras
    (inputs, targets) = entry.synthetic_batch(2)
    model.compile(keras.optimizers.SGD(0.01), entry.keras_loss())
    loss = model.train_on_batch(list(inputs), targets)
    assert np.isfinite(loss)


def test_whole_layer_kinds_get_their_sharding_patterns():
    """tapas.sharding.patterns.families.whole_layer: heads for attention, Megatron column-row for the
    feed-forward, batch for all three (the MoE's expert split is not offered: see
    tapas.layers.MoE)."""
    from tapas import models
    from tapas.sharding import patterns
    entry = models.get("moe-tiny-tapas")
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec(2)))
    names = {}
    for n in graph.nodes:
        if n.kind in (Kind.ATTENTION, Kind.FEED_FORWARD, Kind.MOE):
            names[n.kind] = [p.name for p in patterns.patterns_for(n, graph, 2)]
    assert names == {Kind.ATTENTION: ["replicate", "batch", "heads"],
                     Kind.FEED_FORWARD: ["replicate", "batch", "column-row"],
                     Kind.MOE: ["replicate", "batch"]}
    att = next(n for n in graph.nodes if n.kind == Kind.ATTENTION)
    heads = patterns.pattern_by_name(att, graph, 2, "heads")
    assert [c.kind.value for c in heads.fwd_comms] == ["AR"]
    assert {str(p) for path, p in heads.weights.items() if path.endswith("kernel")} == {"S0", "S1"}


# Runs in its own process: logical CPU devices are set once, before TensorFlow runs an op.
_PARALLEL_SCRIPT = r"""
import json, sys
import numpy as np
from tapas.execution.runtime import devices
devices.setup_devices(2)
import keras, tensorflow as tf
import tapas
from tapas import layers as tl

def build(use_tapas):
    keras.utils.set_random_seed(0)
    x = keras.Input((6, 8), batch_size=4)
    if use_tapas:
        h = x + tl.MultiHeadAttention(2, 4, shard="heads")(tl.LayerNorm()(x))
        h = h + tl.FeedForward(16, shard="column-row")(tl.LayerNorm()(h))
        y = tl.DenseLayer(8, shard="column")(h)
    else:
        n = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        h = x + keras.layers.MultiHeadAttention(2, 4)(n, n)
        f = keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(
            keras.layers.LayerNormalization(epsilon=1e-6)(h)))
        y = keras.layers.Dense(8)(h + f)
    return keras.Model(x, y)

tap, ker = build(True), build(False)
ker.set_weights(tap.get_weights())
rng = np.random.default_rng(0)
xb = rng.standard_normal((4, 6, 8)).astype("float32")
yb = rng.standard_normal((4, 6, 8)).astype("float32")
out = {"keras_equal": float(np.abs(tap(xb) - ker(xb)).max())}
ds = devices.make_strategy(2)
for name, model in (("tapas", tap), ("keras", ker)):
    pm = tapas.parallelize(model, tf.TensorSpec([4, 6, 8]), distribute_strategy=ds,
                           optimizer="adam", loss=keras.losses.MeanSquaredError())
    out[name + "_predict"] = np.asarray(pm.predict(xb)).tolist()
    rep = pm.verify(xb, yb, steps=3)
    out[name + "_ok"] = bool(rep["ok"])
    out[name + "_audit"] = bool(pm.audit().matches)
    out[name + "_patterns"] = sorted({pm.strategy.pattern(n.id).name for n in pm.graph.nodes
                                      if n.pin})
print("RESULT " + json.dumps(out))
"""


def test_tapas_and_plain_keras_twins_parallelize_to_the_same_numbers(tmp_path):
    """Issue 6: a model of pinned tapas layers and the same model of plain Keras layers
    (same weights) give the same outputs, and both parallelize on 2 devices to programs
    equal to their single-device model (outputs, gradients, 3 Adam steps) with the audit
    equal to the prediction; the tapas model keeps its pins."""
    import json
    import os
    import subprocess
    import sys
    path = tmp_path / "twins.py"
    path.write_text(_PARALLEL_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=600, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["keras_equal"] < 1e-5
    assert r["tapas_ok"] and r["keras_ok"], r
    assert r["tapas_audit"] and r["keras_audit"], r
    assert r["tapas_patterns"] == ["column", "column-row", "heads"]
    diff = np.abs(np.array(r["tapas_predict"]) - np.array(r["keras_predict"])).max()
    assert diff < 1e-5 * max(1.0, np.abs(np.array(r["keras_predict"])).max())
