"""Tests for tapas.capturing: Keras models and tf.functions -> tapas.ir.Graph.

Ground truth is the traced tf.Graph itself: every op lands in exactly one GraphNode (or is
dead), edge shapes equal TensorFlow's static shapes, every weight is accounted for.
"""

import collections
import re

import keras
import matrix  # tests/matrix.py
import numpy as np
import pytest
import tensorflow as tf

import tapas
from tapas import capturing
from tapas.ir import Graph, Kind


def check_against_tf(trace, graph):
    """The IR agrees with the traced tf.Graph: ops, dead ops, shapes, weights."""
    tf_graph = trace.graph
    tf_ops = {op.name: op for op in tf_graph.get_operations()}
    names = [op.name for n in graph.nodes for op in n.ops]
    assert len(names) == len(set(names)), "an op is in two GraphNodes"
    assert set(names).isdisjoint(graph.dead_ops)
    assert set(names) | set(graph.dead_ops) == set(tf_ops)
    # dead ops really have no path to an output
    live = set()
    stack = [t.op for t in tf_graph.outputs]
    while stack:
        op = stack.pop()
        if op.name in live:
            continue
        live.add(op.name)
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    assert live.isdisjoint(graph.dead_ops)
    assert set(names) == live
    # edges carry TF's static shapes and dtypes
    for e in graph.edges:
        t = tf_graph.get_tensor_by_name(e.tensor.name)
        assert e.tensor.shape == tuple(t.shape.as_list()), e.tensor.name
        assert e.tensor.dtype == t.dtype.name
        assert e.src < e.dst
    # every weight is in a GraphNode or reported unused
    used = {w.path for w in graph.weights}
    unused = {w.path for w in graph.unused_weights}
    assert used | unused == {w.path for w in trace.model_weights}
    assert not used & unused


def capture_checked(model, spec, **kw):
    t = capturing.trace(model, spec, **kw)
    g = capturing.to_ir(t)
    check_against_tf(t, g)
    return t, g


def mlp(widths=(16, 32, 32, 32, 8), batch=4):
    inp = keras.Input((widths[0],), batch_size=batch)
    h = inp
    for w in widths[1:]:
        h = keras.layers.Dense(w, activation="relu")(h)
    return keras.Model(inp, h)


def test_dense_stack_one_graphnode_per_layer_and_equal_signatures():
    model = mlp()
    _, g = capture_checked(model, tf.TensorSpec([4, 16]))
    dense = [n for n in g.nodes if n.kind == Kind.DENSE]
    assert len(dense) == 4
    assert {op.type for op in dense[1].ops} >= {"MatMul", "BiasAdd", "Relu"}
    assert dense[1].signature == dense[2].signature          # 32 -> 32, twice
    assert dense[0].signature != dense[1].signature          # 16 -> 32
    assert g.num_params == model.count_params()
    assert [w.path for w in dense[0].weights] == sorted(w.path for w in model.layers[1].weights)


def test_capture_returns_graph_and_json_roundtrip():
    g = tapas.capture(mlp(), tf.TensorSpec([4, 16]))
    assert isinstance(g, Graph)
    assert Graph.loads(g.dumps()) == g


def test_transformer_block_kinds():
    x = keras.Input((8, 32), batch_size=2)
    h = keras.layers.LayerNormalization()(x)
    a = keras.layers.MultiHeadAttention(4, 8)(h, h)
    h = keras.layers.Add()([x, a])
    f = keras.layers.Dense(64, activation="gelu")(keras.layers.LayerNormalization()(h))
    h = keras.layers.Add()([h, keras.layers.Dense(32)(f)])
    model = keras.Model(x, h)
    _, g = capture_checked(model, tf.TensorSpec([2, 8, 32]))
    kinds = collections.Counter(n.kind for n in g.nodes)
    assert kinds[Kind.NORM] == 2
    assert kinds[Kind.DENSE] == 6                    # q, k, v, output, two FFN
    assert kinds[Kind.ATTENTION_SCORE] == 1 and kinds[Kind.ATTENTION_CONTEXT] == 1
    assert kinds[Kind.ELEMENTWISE] == 2              # the two residual adds
    score = next(n for n in g.nodes if n.kind == Kind.ATTENTION_SCORE)
    assert "Softmax" in {op.type for op in score.ops}
    qkv = [n for n in g.nodes if n.kind == Kind.DENSE and n.outputs[0].shape == (2, 8, 4, 8)]
    assert len(qkv) == 3 and len({n.signature for n in qkv}) == 1


def test_repeated_blocks_share_signatures_across_depth():
    def block(h, i):
        a = keras.layers.Dense(32, activation="relu", name=f"b{i}_fc")(h)
        return keras.layers.LayerNormalization(name=f"b{i}_ln")(keras.layers.Add()([h, a]))
    x = keras.Input((32,), batch_size=4)
    h = x
    for i in range(5):
        h = block(h, i)
    model = keras.Model(x, keras.layers.Dense(3)(h))
    _, g = capture_checked(model, tf.TensorSpec([4, 32]))
    per_block = collections.defaultdict(list)
    for n in g.nodes:
        for w in n.weights:
            if w.path.startswith("b"):
                per_block[int(w.path[1])].append((n.kind, n.signature))
                break
    sigs = [sorted(set(v)) for _, v in sorted(per_block.items())]
    assert len(sigs) == 5 and all(s == sigs[1] for s in sigs[1:4])


def test_keras_applications_resnet50_all_weights_and_conv_bn_relu_fused():
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    _, g = capture_checked(model, tf.TensorSpec([2, 32, 32, 3]))
    assert g.num_params == model.count_params()
    convs = [n for n in g.nodes if n.kind == Kind.CONV]
    assert len(convs) == 53
    bottleneck_mid = [n for n in convs if {op.type for op in n.ops} >= {"Conv2D", "Relu"}
                      and len(n.weights) == 6]     # kernel, bias, BN gamma/beta/mean/var
    assert bottleneck_mid, "Conv + BatchNorm + ReLU should be one GraphNode"
    sig_counts = collections.Counter(n.signature for n in convs)
    assert max(sig_counts.values()) >= 5            # the repeated blocks of stage 4


def test_keras_applications_vgg16():
    model = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    _, g = capture_checked(model, tf.TensorSpec([2, 32, 32, 3]))
    kinds = collections.Counter(n.kind for n in g.nodes)
    assert kinds[Kind.CONV] == 13 and kinds[Kind.DENSE] == 3
    assert g.num_params == model.count_params()


def test_convnext_grouped_convolutions_are_lowered():
    """Keras runs ConvNeXt's depthwise convolutions as XLA function calls; capture traces
    them as depthwise convolutions (tapas.capturing.lowering), so nothing is opaque."""
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=10)
    _, g = capture_checked(model, tf.TensorSpec([1, 32, 32, 3]))
    assert not [n.name for n in g.nodes if n.kind == Kind.OPAQUE]
    types = collections.Counter(op.type for n in g.nodes for op in n.ops)
    assert types["DepthwiseConv2dNative"] == 18      # one per ConvNeXt block (3+3+9+3)
    assert g.num_params == model.count_params()


def test_nested_function_calls_do_not_crash_and_keep_weights():
    w = tf.Variable(tf.random.normal([8, 4]), name="inner_w")

    @tf.function(jit_compile=True)
    def inner(x):
        return tf.nn.relu(x @ w)

    @tf.function
    def outer(x):
        return tf.reduce_sum(inner(x * 2.0), axis=-1)

    _, g = capture_checked(outer, tf.TensorSpec([2, 8]))
    opaque = [n for n in g.nodes if n.kind == Kind.OPAQUE]
    assert len(opaque) == 1 and [x.path for x in opaque[0].weights] == ["inner_w"]


def test_tf_function_with_plain_variables_and_assert():
    w1 = tf.Variable(tf.random.normal([8, 16]), name="w1")
    w2 = tf.Variable(tf.random.normal([16, 4]), name="w2")

    @tf.function
    def f(x):
        tf.debugging.assert_all_finite(x, "x must be finite")
        tf.debugging.assert_less(tf.reduce_max(x), 100.0)
        return tf.nn.softmax(tf.nn.relu(x @ w1) @ w2)

    t, g = capture_checked(f, tf.TensorSpec([2, 8]))
    assert sorted(w.path for w in g.weights) == ["w1", "w2"]
    assert sum(n.kind == Kind.DENSE for n in g.nodes) == 2
    types = {op.type for n in g.nodes for op in n.ops}
    assert "Assert" in types or "CheckNumerics" in types


def test_training_mode_batchnorm_updates_are_captured():
    x = keras.Input((8, 8, 3), batch_size=2)
    h = keras.layers.Conv2D(4, 3, use_bias=False)(x)
    h = keras.layers.BatchNormalization()(h)
    model = keras.Model(x, keras.layers.ReLU()(h))
    _, g = capture_checked(model, tf.TensorSpec([2, 8, 8, 3]), training=True)
    types = [op.type for n in g.nodes for op in n.ops]
    assert types.count("AssignVariableOp") == 2
    assert sum(n.kind == Kind.CONV for n in g.nodes) == 1


def test_multiple_inputs_embedding_and_dict_specs():
    ids = keras.Input((6,), batch_size=3, dtype="int32", name="ids")
    feats = keras.Input((4,), batch_size=3, name="feats")
    e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([e, feats]))
    model = keras.Model([ids, feats], out)
    _, g = capture_checked(model, [tf.TensorSpec([3, 6], tf.int32), tf.TensorSpec([3, 4])])
    assert sum(n.kind == Kind.EMBEDDING for n in g.nodes) == 1
    assert sum(n.kind == Kind.INPUT for n in g.nodes) == 2
    # the model's own inputs are used when no spec is given
    g2 = tapas.capture(model)
    assert [n.signature for n in g2.nodes] == [n.signature for n in g.nodes]
    # specs named otherwise (or not at all) give the model's input names, so the graph is
    # the one tapas.parallelize captures and a plan made on it fits there
    from tapas.planning.strategy import graph_digest
    g3 = tapas.capture(model, [tf.TensorSpec([3, 6], tf.int32, name="x"),
                               tf.TensorSpec([3, 4], name="y")])
    assert [t.name for t in g3.inputs] == [t.name for t in g2.inputs] == ["ids:0", "feats:0"]
    assert graph_digest(g3) == graph_digest(g2) == graph_digest(g)


def test_batch_size_fills_unknown_batch_dimension():
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(4)(inp))
    g = tapas.capture(model, batch_size=5)
    assert g.inputs[0].shape == (5, 16)
    g = tapas.capture(model, tf.TensorSpec([None, 16]), batch_size=3)
    assert g.inputs[0].shape == (3, 16)


# ---- errors a user can cause -------------------------------------------------------------

def test_error_unbuilt_model_without_spec():
    model = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(tapas.CaptureError, match="never built.*input_spec"):
        tapas.capture(model)


def test_unbuilt_subclassed_model_advice_is_whole_and_following_it_works():
    """The first error says everything the capture needs (the model called once, and a
    spec), so following it does not meet a second error."""
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    model = Sub()
    with pytest.raises(tapas.CaptureError, match=r"call it once on a batch \(model\(x\)\), "
                                                 r"then pass input_spec="):
        tapas.capture(model)
    model(np.zeros((8, 16), "float32"))
    g = tapas.capture(model, tf.TensorSpec([8, 16]))
    assert g.inputs[0].shape == (8, 16)


def test_error_dynamic_batch_dimension_names_it():
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(4)(inp))
    with pytest.raises(tapas.CaptureError, match=r"dimension 0 .* dynamic.*batch_size"):
        tapas.capture(model)
    with pytest.raises(tapas.CaptureError, match=r"dimension 1 .*dynamic"):
        tapas.capture(model, tf.TensorSpec([4, None]), batch_size=4)


def test_error_rank_and_dtype_mismatch():
    model = mlp()
    with pytest.raises(tapas.CaptureError, match="rank 2 .* rank 3"):
        tapas.capture(model, tf.TensorSpec([4, 16, 1]))
    with pytest.raises(tapas.CaptureError, match="dtype float32 .* int32"):
        tapas.capture(model, tf.TensorSpec([4, 16], tf.int32))
    with pytest.raises(tapas.CaptureError, match="must be 16"):
        tapas.capture(model, tf.TensorSpec([4, 15]))
    with pytest.raises(tapas.CaptureError, match="1 input.* 2 input spec"):
        tapas.capture(model, [tf.TensorSpec([4, 16]), tf.TensorSpec([4, 16])])


def test_error_not_a_model():
    with pytest.raises(tapas.CaptureError, match="neither a Keras model.*tf.function"):
        tapas.capture(lambda x: x, tf.TensorSpec([2]))
    with pytest.raises(tapas.CaptureError, match="tf.TensorSpec"):
        tapas.capture(mlp(), np.zeros((4, 16)))


def test_error_tf_function_without_spec():
    with pytest.raises(tapas.CaptureError, match="needs input_spec"):
        tapas.capture(tf.function(lambda x: x * 2))


# ---- the model zoo: identical blocks have identical signatures -----------------------------

def _signatures_by_block(graph, pattern):
    """Map block id -> sorted (kind, signature) of the GraphNodes named inside that block.
    (Test-side only: uses the zoo's own layer names to know which block is which.)"""
    import re
    blocks = collections.defaultdict(list)
    for n in graph.nodes:
        m = re.search(pattern, n.name)
        if m:
            blocks[m.groups()].append((n.kind.value, n.signature))
    return {k: sorted(v) for k, v in blocks.items()}


def _zoo_capture(family_module, config, batch=2):
    model = family_module.build_model(config, fast_init=True)
    t, g = capture_checked(model, list(family_module.input_spec(config, batch)))
    assert g.num_params == model.count_params()
    return g


def test_t5_blocks_after_the_first_share_signatures():
    import dataclasses
    from tapas import models
    cfg = dataclasses.replace(models.get("t5-tiny").config, num_layers=4, num_decoder_layers=4)
    g = _zoo_capture(models.t5, cfg)
    blocks = _signatures_by_block(g, r"(encoder|decoder)_block_(\d+)")
    for stack in ("encoder", "decoder"):
        sigs = [blocks[(stack, str(i))] for i in range(4)]
        assert sigs[1] == sigs[2] == sigs[3], stack
        assert sigs[0] != sigs[1], f"{stack} block 0 computes the position bias"
    assert sum(n.kind == Kind.ATTENTION_SCORE for n in g.nodes) == 4 + 8   # self + cross


def test_moe_layers_share_signatures_and_experts_are_expert_einsums():
    import dataclasses
    from tapas import models
    cfg = dataclasses.replace(models.get("moe-tiny").config, num_layers=6)
    g = _zoo_capture(models.moe, cfg)
    experts = [n for n in g.nodes if n.kind == Kind.EXPERT_EINSUM]
    assert len(experts) == 2 * cfg.num_moe_blocks          # wi and wo per MoE layer
    assert all(n.weights[0].shape[0] == cfg.num_experts for n in experts)
    blocks = _signatures_by_block(g, r"block_(\d+)")
    moe_blocks = [blocks[(str(i),)] for i in range(6) if cfg.is_moe_block(i)]
    dense_blocks = [blocks[(str(i),)] for i in range(6) if not cfg.is_moe_block(i)]
    assert all(b == moe_blocks[0] for b in moe_blocks[1:])
    assert all(b == dense_blocks[1] for b in dense_blocks[2:])
    assert moe_blocks[0] != dense_blocks[1]


def test_resnet_bottlenecks_within_a_stage_share_signatures():
    import dataclasses
    from tapas import models
    cfg = dataclasses.replace(models.get("resnet-tiny").config, block_counts=(2, 3, 3, 2))
    g = _zoo_capture(models.resnet, cfg)
    blocks = _signatures_by_block(g, r"stage(\d)_block(\d+)")
    for stage, count in zip("1234", cfg.block_counts):
        later = [blocks[(stage, str(b))] for b in range(2, count + 1)]
        assert all(s == later[0] for s in later), f"stage {stage}"
        assert blocks[(stage, "1")] != later[0], "the first block has the projection shortcut"


UNUSED_BY_FAMILY = {"bert": {"pooler/kernel", "pooler/bias"}}


# Presets whose blocks a smaller preset of the CI slice already has: a wider classifier head
# (resnet*-10k ... -400k), the same block repeated more times (t5-large-depthN, resnet101/152,
# moe-1.3b/2.4b, bert-large, llama-1b, t5-base) or a pinned twin (*-tapas of a large model).
# Capturing them took 7 of the suite's minutes; TAPAS_FULL_MATRIX=1 captures every preset.
_SAME_BLOCKS_AS_A_SMALLER = re.compile(
    r"resnet\d+-(10k|100k|250k|400k)|resnet(101|152)-1k|t5-large-depth\d+|"
    r"t5-large-masked-depth(12|24|48)|moe-(1\.3b|2\.4b)(-tapas)?|t5-large-tapas|bert-large|"
    r"llama-1b|t5-base")


def _capture_presets() -> list[str]:
    from tapas import models
    if matrix.full():
        return models.names()
    return [n for n in models.names() if not _SAME_BLOCKS_AS_A_SMALLER.fullmatch(n)]


@pytest.mark.parametrize("name", _capture_presets())
def test_every_zoo_preset_captures_with_every_weight(name):
    """Issue 2: capture works on every zoo preset, every weight accounted for (batch 1,
    zero-initialised weights: the structure is what capture reads). CI captures one preset
    per block structure (above); ``bash scripts/test_full.sh -k
    every_zoo_preset`` captures all of them."""
    import gc
    from tapas import models
    entry = models.get(name)
    model = entry.build(fast_init=True)
    g = tapas.capture(model, list(entry.input_spec(1)))
    unused = sum(int(np.prod(w.shape)) for w in g.unused_weights)
    assert g.num_params + unused == entry.param_count() == model.count_params()
    # only BERT has a dead branch: the backbone's pooler, which the masked-LM head ignores
    assert {w.path for w in g.unused_weights} == UNUSED_BY_FAMILY.get(entry.family, set())
    assert not any(n.kind == Kind.OPAQUE for n in g.nodes)
    del model, g
    keras.backend.clear_session()
    gc.collect()


def test_weights_read_only_by_a_dead_branch_are_unused_not_a_graphnode():
    """Issue 10: a backbone's pooler whose output nothing reads. TF still orders its
    variable reads before the function returns (control edges); those reads are dead."""
    from tapas import models
    entry = models.get("bert-tiny")
    g = tapas.capture(entry.build(seed=0), list(entry.input_spec()))
    assert {w.path for w in g.unused_weights} == {"pooler/kernel", "pooler/bias"}
    assert all(n.outputs for n in g.nodes), "a GraphNode whose results nobody reads"
    assert any("pooler" in op for op in g.dead_ops)


def test_tied_embedding_lookup_and_lm_head_are_two_graphnodes():
    """Issue 10: in a one-layer decoder the embedding lookup and the tied LM head reading
    the same table lie a few ops apart; they are still two GraphNodes."""
    from tapas.models import llama
    config = llama.LlamaConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                               intermediate_size=176, vocab_size=512, seq_len=16)
    g = tapas.capture(llama.build_model(config, seed=0), list(llama.input_spec(config, 2)))
    readers = [n for n in g.nodes if any(w.path.endswith("token_embedding/embeddings")
                                         for w in n.weights)]
    assert sorted(n.kind.value for n in readers) == ["dense", "embedding"]


def test_keras2_tf_keras_models_capture_like_keras3_ones():
    """Issue 10: much production code still builds Keras 2 models (tf_keras). They capture
    as Keras 3 models do, their weights named by variable name."""
    import tf_keras as k2
    x = k2.Input((16,), batch_size=4, name="x")
    h = k2.layers.Dense(64, activation="relu", name="up")(x)
    model2 = k2.Model(x, k2.layers.Dense(16, name="down")(h), name="mlp2")
    g2 = tapas.capture(model2)
    inputs = keras.Input((16,), batch_size=4, name="x")
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    g3 = tapas.capture(keras.Model(inputs, keras.layers.Dense(16, name="down")(h)))
    assert sorted(w.path for w in g2.weights) == ["down/bias", "down/kernel", "up/bias",
                                                  "up/kernel"]
    assert g2.num_params == model2.count_params() == g3.num_params
    assert [n.kind for n in g2.nodes] == [n.kind for n in g3.nodes]
    assert [[w.shape for w in n.weights] for n in g2.nodes] == \
        [[w.shape for w in n.weights] for n in g3.nodes]
    strategy = tapas.search(g2, cluster=tapas.Cluster.v100_ethernet(1, 2))
    assert len(strategy.patterns) == len(g2.nodes)
    with pytest.raises(tapas.CaptureError, match="Keras 2 from tf_keras"):
        tapas.capture(object())


def test_dict_and_nested_specs_come_back_in_the_graph_input_order():
    """tf.function flattens a dict by sorted key: the trace lists its specs in that order
    (the order of the graph's input placeholders and of model.inputs), not the dict's; a
    nested structure ([a, {"z": b, "y": c}]) is traced as the model takes it."""
    ins = {"tokens": keras.Input((5,), dtype="int32", name="tokens"),
           "mask": keras.Input((5,), dtype="int32", name="mask")}
    h = keras.layers.Embedding(7, 3)(ins["tokens"]) * keras.ops.expand_dims(
        keras.ops.cast(ins["mask"], "float32"), -1)
    model = keras.Model(ins, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    t = tapas.capturing.trace(model, {"tokens": tf.TensorSpec([2, 5], tf.int32, name="tokens"),
                                      "mask": tf.TensorSpec([2, 5], tf.int32, name="mask")})
    assert [s.name for s in t.input_specs] == ["mask", "tokens"] == list(t.input_names)
    assert [x.name for x in model.inputs] == ["mask", "tokens"]
    # the dict in either key order: the same graph, GraphNode ids included (a plan made on
    # one capture must fit the other: keras-hub Mixtral's plan was refused by parallelize)
    from tapas.planning.strategy import graph_digest
    specs = {"tokens": tf.TensorSpec([2, 5], tf.int32, name="tokens"),
             "mask": tf.TensorSpec([2, 5], tf.int32, name="mask")}
    one = tapas.capture(model, specs)
    other = tapas.capture(model, dict(reversed(list(specs.items()))))
    assert graph_digest(one) == graph_digest(other)
    assert [(e.src, e.dst) for e in one.edges] == [(e.src, e.dst) for e in other.edges]
    a, b, c = (keras.Input((d,), name=n) for d, n in ((3, "a"), (2, "b"), (1, "c")))
    nested = keras.Model([a, {"z": b, "y": c}],
                         keras.layers.Dense(2)(keras.layers.Concatenate()([a, b, c])))
    spec = [tf.TensorSpec([4, 3], name="a"),
            {"z": tf.TensorSpec([4, 2], name="b"), "y": tf.TensorSpec([4, 1], name="c")}]
    t = tapas.capturing.trace(nested, spec)
    assert [tuple(s.shape) for s in t.input_specs] == [(4, 3), (4, 1), (4, 2)]
    with pytest.raises(tapas.CaptureError, match=r"input_spec\['1/z'\] is a int"):
        tapas.capturing.trace(nested, [spec[0], {"z": 3, "y": spec[1]["y"]}])


def test_weights_whose_keras_paths_repeat_get_distinct_paths():
    """Keras paths are not unique (keras-hub T5's encoder and decoder each own a
    'self_attention/embeddings'): the later weight is named 'path#1', so that each weight
    keeps its own value through the plan, the rebuilt program and the runtime. Before, the
    one-device replay of keras-hub T5 read the encoder's bias in the decoder (6e-3 off)."""
    from tapas.execution.checking import verify

    class Two(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(4, name="proj")
            self.b = keras.layers.Dense(4, name="proj")

        def call(self, x):
            return self.b(self.a(x))

    model = Two()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype("float32")
    model(x)
    assert [w.path for w in model.weights] == ["two/proj/kernel", "two/proj/bias"] * 2
    t, g = capture_checked(model, tf.TensorSpec([2, 4]))
    paths = ["two/proj/kernel", "two/proj/bias", "two/proj/kernel#1", "two/proj/bias#1"]
    assert [w.path for w in t.model_weights] == paths
    assert sorted(w.path for w in g.weights) == sorted(paths)
    assert list(capturing.weights_by_path(model)) == paths
    replay = verify.intermediate_values(t, g, [x], [g.outputs[0].name])[g.outputs[0].name]
    np.testing.assert_allclose(replay, model(x).numpy(), rtol=1e-6)


def test_a_model_with_a_loop_has_the_same_digest_when_captured_again():
    """A While loop's cond and body functions get a process-unique number in their names on
    every trace; the GraphNode signatures leave it out, so a plan made on one capture of a
    model with a ``tf.map_fn`` applies to tapas.parallelize's own capture of it."""
    from tapas.planning.strategy import graph_digest
    inp = keras.Input((6, 8))
    mapped = keras.layers.Lambda(lambda t: tf.map_fn(tf.tanh, t), output_shape=(6, 8))(
        keras.layers.Dense(8)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(mapped))
    specs = [tf.TensorSpec([4, 6, 8])]
    first, second = capturing.capture(model, specs), capturing.capture(model, specs)
    loops = [op for n in first.nodes for op in n.ops if op.type.endswith("While")]
    assert loops and not re.search(r"_\d+$", loops[0].attrs["body"])
    assert graph_digest(first) == graph_digest(second)


def test_unnamed_dict_specs_take_their_keys_as_tapas_parallelize_names_the_inputs():
    """A subclassed model called with a dict (Hugging Face's TF models), captured with
    unnamed specs: the placeholders are named by the keys, as tapas.parallelize names the
    inputs, so a plan made on this capture binds to the program's graph (it was refused:
    the placeholders were called 'd' and 'd_1')."""
    class DictModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed, self.out = keras.layers.Embedding(7, 3), keras.layers.Dense(2)

        def call(self, d):
            mask = keras.ops.expand_dims(keras.ops.cast(d["mask"], "float32"), -1)
            return self.out(keras.ops.sum(self.embed(d["tokens"]) * mask, axis=1))

    model = DictModel()
    model({"tokens": np.zeros((2, 5), "int32"), "mask": np.ones((2, 5), "int32")})
    from tapas.planning.strategy import graph_digest
    unnamed = {k: tf.TensorSpec([2, 5], tf.int32) for k in ("tokens", "mask")}
    named = {k: tf.TensorSpec([2, 5], tf.int32, name=k) for k in ("tokens", "mask")}
    t = tapas.capturing.trace(model, unnamed)
    assert list(t.input_names) == ["mask", "tokens"]
    assert graph_digest(tapas.capture(model, unnamed, training=True)) == \
        graph_digest(tapas.capture(model, named, training=True))


def test_a_dict_of_specs_for_a_model_with_a_list_of_inputs_follows_the_model_order():
    """keras-hub Gemma3n takes a list of named inputs; a dict of specs keyed by their names
    (which Keras matches by name) is captured in the model's order, the order
    tapas.parallelize feeds them in, so a plan made on it fits parallelize's capture."""
    from tapas.planning.strategy import graph_digest
    ids = keras.Input((6,), dtype="int32", name="token_ids")
    mask = keras.Input((6,), dtype="bool", name="a_mask")
    h = keras.layers.Embedding(16, 4)(ids) * keras.ops.cast(mask, "float32")[..., None]
    model = keras.Model([ids, mask], keras.layers.Dense(2)(h))
    specs = {"a_mask": tf.TensorSpec([2, 6], tf.bool), "token_ids": tf.TensorSpec([2, 6], tf.int32)}
    from_dict = capturing.capture(model, specs)
    from_list = capturing.capture(model, [specs["token_ids"], specs["a_mask"]])
    assert [t.dtype for t in from_dict.inputs] == ["int32", "bool"]
    assert graph_digest(from_dict) == graph_digest(from_list)
