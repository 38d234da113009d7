"""The pattern checker (issue 4): every ShardingPattern that ``tapas.sharding.patterns`` offers for
every GraphNode of small models is replayed on N = 2 and 4 simulated shards
(``SimulatedCollectives``) and compared with the node on one device: forward outputs,
gradients of every trainable weight and float input, and the collectives it ran against
the ones the pattern declares. A wrong placement rule fails with the node, the pattern and
the largest difference."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tapas import capturing, models
from tapas.sharding import patterns
from tapas.execution import audit, reconstruct as rc, verify
from tapas.ir import Kind


def _mlp():
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(8)(h), name="mlp"), [tf.TensorSpec([4, 8])]


def _mha():
    x = keras.Input((8, 16))
    y = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)(x, x)
    y = keras.layers.LayerNormalization()(keras.layers.Add()([x, y]))
    return keras.Model(x, y, name="mha"), [tf.TensorSpec([4, 8, 16])]


def _conv_bn():
    x = keras.Input((8, 8, 4))
    y = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.GlobalAveragePooling2D()(y)
    return keras.Model(x, keras.layers.Dense(4)(y), name="conv_bn"), [tf.TensorSpec([4, 8, 8, 4])]


def _embedding():
    x = keras.Input((6,), dtype="int32")
    y = keras.layers.Embedding(32, 8)(x)
    return keras.Model(x, keras.layers.Dense(4)(y), name="embedding"), \
        [tf.TensorSpec([4, 6], tf.int32)]


def _layer_norm():
    x = keras.Input((6, 8))
    y = keras.layers.LayerNormalization()(keras.layers.Dense(8)(x))
    return keras.Model(x, y, name="layer_norm"), [tf.TensorSpec([4, 6, 8])]


def _zoo(name):
    def build():
        entry = models.get(name)
        return entry.build(seed=0), list(entry.input_spec(4))
    return build


MODELS = {"mlp": _mlp, "mha": _mha, "conv-bn": _conv_bn, "embedding": _embedding,
          "layer-norm": _layer_norm, "t5-tiny": _zoo("t5-tiny"), "moe-tiny": _zoo("moe-tiny"),
          "resnet-tiny": _zoo("resnet-tiny")}


def _inputs(specs, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        shape = s.shape.as_list()
        if s.dtype.is_integer:
            out.append(rng.integers(0, 16, size=shape).astype(s.dtype.as_numpy_dtype))
        else:
            out.append(rng.standard_normal(shape).astype(s.dtype.as_numpy_dtype))
    return out


_CAPTURED = {}


def _captured(name):
    if name not in _CAPTURED:
        keras.utils.set_random_seed(0)
        model, specs = MODELS[name]()
        t = capturing.trace(model, specs)
        g = capturing.to_ir(t)
        names = [i.name for n in g.nodes for i in n.inputs]
        values = verify.intermediate_values(t, g, _inputs(specs), names)
        _CAPTURED[name] = (t, g, values)
    return _CAPTURED[name]


def check_node_patterns(t, g, values, num_devices):
    """(number checked, failure messages) for every pattern of every GraphNode."""
    failures, checked = [], 0
    seen = set()
    for node in g.nodes:
        # identical GraphNodes (same signature: a repeated layer) have identical patterns
        if node.kind == Kind.INPUT or (node.signature and node.signature in seen):
            continue
        seen.add(node.signature)
        sub = verify.node_graph(g, node.id)
        args = [values[i.name] for i in node.inputs]
        for pat in patterns.patterns_for(node, g, num_devices):
            checked += 1
            where = (f"GraphNode {node.id} '{node.name}' ({node.kind.value}), pattern "
                     f"'{pat.name}' {pat.expr}, N={num_devices}")
            plan = rc.Plan(num_devices, {0: pat})
            try:
                cmp = verify.compare_with_single_device(t, sub, plan, args)
            except (rc.ReconstructError, ValueError) as err:
                failures.append(f"{where}: cannot be rebuilt: {err}")
                continue
            if not cmp.ok(rtol=1e-5, atol=1e-5):
                failures.append(f"{where}: largest difference {cmp.worst}")
                continue
            mismatch = audit.compare_audit(cmp.audit, audit.program_comms(
                rc.Program(t, sub, plan), input_gradients=True))
            if mismatch:
                failures.append(f"{where}: collectives differ from the pattern's comms: "
                                + "; ".join(mismatch))
    return checked, failures


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_pattern_of_every_node_matches_one_device(name, num_devices):
    t, g, values = _captured(name)
    checked, failures = check_node_patterns(t, g, values, num_devices)
    assert checked > 0
    assert not failures, f"{len(failures)} of {checked} patterns are wrong:\n" + \
        "\n".join(failures[:20])


def test_the_checker_catches_a_wrong_rule():
    """Drop the backward all-reduce from the column pattern (Megatron's f): the gradient of
    the replicated input comes out partial and the checker names node and pattern."""
    import dataclasses
    t, g, values = _captured("mlp")
    node = next(n for n in g.nodes if n.kind == Kind.DENSE)
    column = next(p for p in patterns.patterns_for(node, g, 2) if p.name == "column")
    broken = dataclasses.replace(column, comms=())

    original = patterns.patterns_for

    def patched(n, graph, num_devices):
        pats = original(n, graph, num_devices)
        return [broken if (n.id == node.id and p.name == "column") else p for p in pats]

    patterns.patterns_for = patched
    try:
        checked, failures = check_node_patterns(t, g, values, 2)
    finally:
        patterns.patterns_for = original
    assert len(failures) == 1, failures
    assert f"'{node.name}'" in failures[0] and "'column'" in failures[0]
    assert "gradient of input 0" in failures[0]
