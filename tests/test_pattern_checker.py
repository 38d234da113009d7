"""The pattern checker (issue 4): every ShardingPattern that ``tapas.sharding.patterns`` offers for
every GraphNode of small models is replayed on N = 2 and 4 simulated shards
(``SimulatedCollectives``) and compared with the node on one device: forward outputs,
gradients of every trainable weight and float input, and the collectives it ran against
the ones the pattern declares. A wrong placement rule fails with the node, the pattern and
the largest difference; a pattern reconstruction cannot build fails as "cannot be rebuilt"
(issue 11: every pattern the search may choose must be buildable). Besides Keras's own
layers and the zoo, the models include layers written the way other libraries write them
(a sparse MoE block as one layer of batched einsums, attention masked after its softmax,
a T5-style RMS norm, a position table sliced to the sequence, ConvNeXt's grouped
convolutions); keras-hub's own models are
checked by ``scripts/equivalence.py --checker``."""

import pytest
import tensorflow as tf
import keras

from matrix import pick   # tests/matrix.py
from tapas import capturing, models
from tapas.sharding import patterns
from tapas.execution.checking import checker, nested, verify
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


class SparseMoE(keras.layers.Layer):
    """A sparse MoE block as one layer, the way Mixtral and Qwen3-MoE write it: a router,
    top-k gates, and every expert as one batched einsum over stacked weights."""

    def __init__(self, experts=4, top_k=2, inner=8, **kw):
        super().__init__(**kw)
        self.experts, self.top_k, self.inner = experts, top_k, inner

    def build(self, shape):
        h = shape[-1]
        self.router = self.add_weight((h, self.experts), name="router")
        self.w_in = self.add_weight((self.experts, h, self.inner), name="w_in")
        self.w_out = self.add_weight((self.experts, self.inner, h), name="w_out")

    def call(self, x):
        ops = keras.ops
        logits = ops.einsum("bsh,he->bse", x, self.router)
        top_w, top_i = ops.top_k(logits, self.top_k)
        gates = ops.sum(ops.softmax(top_w)[..., None] * ops.one_hot(top_i, self.experts),
                        axis=-2)
        h = ops.gelu(ops.einsum("bsh,ehi->ebsi", x, self.w_in))
        y = ops.einsum("ebsi,eih->ebsh", h, self.w_out)
        return ops.einsum("ebsh,bse->bsh", y, gates)


class PositionAdd(keras.layers.Layer):
    """A position table longer than the sequence, sliced to it and added (GPT-2)."""

    def build(self, shape):
        self.positions = self.add_weight((shape[1] + 2, shape[-1]), name="positions")

    def call(self, x):
        return x + keras.ops.slice(self.positions, (0, 0), (x.shape[1], x.shape[-1]))[None]


class MaskedAttention(keras.layers.Layer):
    """Attention whose padding mask is applied after the softmax (``where(mask, probs,
    0)``, as keras-hub's attention does), projections in sublayers."""

    def __init__(self, heads=2, **kw):
        super().__init__(**kw)
        self.heads = heads

    def build(self, shapes):
        h = shapes[0][-1]
        self.q, self.k, self.v, self.o = (keras.layers.Dense(h, use_bias=False, name=n)
                                          for n in "qkvo")
        for layer in (self.q, self.k, self.v, self.o):
            layer.build(shapes[0])

    def call(self, inputs):
        ops = keras.ops
        x, mask = inputs
        s, h = x.shape[1], x.shape[-1]

        def heads(t):
            return ops.transpose(ops.reshape(t, (-1, s, self.heads, h // self.heads)),
                                 (0, 2, 1, 3))
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        probs = ops.softmax(ops.einsum("bnqd,bnkd->bnqk", q, k))
        probs = ops.where(ops.cast(mask, "bool")[:, None, None, :], probs, 0.0)
        ctx = ops.reshape(ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3)), (-1, s, h))
        return self.o(ctx)


class RMSNorm(keras.layers.Layer):
    """T5's layer norm: no mean, no offset, a scale."""

    def build(self, shape):
        self.scale = self.add_weight((shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        ops = keras.ops
        return x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + 1e-6) * \
            self.scale


def _library_layers():
    x = keras.Input((8, 16))
    mask = keras.Input((8,), dtype="int32")
    y = PositionAdd()(x)
    y = RMSNorm()(keras.layers.Add()([y, MaskedAttention()([y, mask])]))
    y = SparseMoE()(y)
    return keras.Model([x, mask], y, name="library_layers"), \
        [tf.TensorSpec([4, 8, 16]), tf.TensorSpec([4, 8], tf.int32)]


class LayerScale(keras.layers.Layer):
    """ConvNeXt's per-channel scale of a residual branch."""

    def build(self, shape):
        self.gamma = self.add_weight((shape[-1],), initializer="ones", name="gamma")

    def call(self, x):
        return x * self.gamma


def _grouped_conv():
    """A ConvNeXt block (depthwise 7x7 written as ``Conv2D(groups=channels)``, layer norm,
    an inverted MLP, a layer scale) and a grouped 3x3 convolution (ResNeXt): Keras runs both
    as XLA calls, capture lowers them (``tapas.capturing.lowering``)."""
    x = keras.Input((8, 8, 8))
    y = keras.layers.Conv2D(8, 7, padding="same", groups=8)(x)
    y = keras.layers.LayerNormalization(epsilon=1e-6)(y)
    y = keras.layers.Dense(16, activation="gelu")(y)
    y = keras.layers.Dense(8)(y)
    y = keras.layers.Add()([x, LayerScale()(y)])
    y = keras.layers.Conv2D(8, 3, padding="same", groups=2)(y)
    return keras.Model(x, y, name="grouped_conv"), [tf.TensorSpec([4, 8, 8, 8])]


class RecurrentState(keras.layers.Layer):
    """A linear-attention read of a recurrent state that starts as a constant per batch row
    and head (Qwen3.5's gated delta net: ``q @ zeros((b, heads, d, d))``); the state is
    used again outside the read. The constant has the batch and head dimensions of the
    batched matmul, so a pattern that splits them must slice it."""

    def call(self, q):
        ops = keras.ops
        b, h, _, d = q.shape
        rows = ops.cast(ops.arange(b), "float32")[:, None, None, None]
        state = ops.full((b, h, d, d), 0.5) + 0.1 * rows
        return ops.matmul(q, state) + ops.mean(state, axis=(2, 3), keepdims=True)

    def compute_output_shape(self, shape):
        return shape


def _recurrent_state():
    x = keras.Input((8, 16))
    q = keras.layers.Reshape((8, 2, 8))(keras.layers.Dense(16)(x))
    q = keras.layers.Permute((2, 1, 3))(q)
    y = RecurrentState()(q)
    return keras.Model(x, keras.layers.Dense(4)(y), name="recurrent_state"), \
        [tf.TensorSpec([4, 8, 16])]


class PadToMaxPool(keras.layers.Layer):
    """keras-hub ResNet-v2's stem: padding with ``-inf`` before a valid max-pooling, so the
    padded tensor (a node output) holds infinities in both programs."""

    def call(self, x):
        ops = keras.ops
        padded = ops.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=float("-inf"))
        return ops.max_pool(padded, 3, strides=2, padding="valid")


def _inf_padding():
    x = keras.Input((8, 8, 4))
    y = keras.layers.Conv2D(8, 3, padding="same")(x)
    y = PadToMaxPool()(y)
    return keras.Model(x, keras.layers.Conv2D(4, 1)(y), name="inf_padding"), \
        [tf.TensorSpec([4, 8, 8, 4])]


class TensorArrayRecurrence(keras.layers.Layer):
    """A recurrence unrolled over a static sequence into a ``tf.TensorArray`` and stacked
    (keras-hub RWKV-7's time mixing): GraphNodes joined by TensorList handles."""

    def call(self, x):
        steps = tf.TensorArray(x.dtype, size=x.shape[1])
        h = tf.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = 0.5 * h + tf.tanh(x[:, t])
            steps = steps.write(t, h)
        return tf.transpose(steps.stack(), (1, 0, 2))

    def compute_output_shape(self, shape):
        return shape


def _tensor_array():
    x = keras.Input((4, 8))
    y = TensorArrayRecurrence()(keras.layers.Dense(8)(x))
    return keras.Model(x, keras.layers.Dense(4)(y), name="tensor_array"), \
        [tf.TensorSpec([4, 4, 8])]


class PrefixMask(keras.layers.Layer):
    """BLIP-2's language model: ones for its query tokens concatenated before the text's
    padding mask, batch by batch (a constant operand of a concat split on the batch)."""

    def call(self, inputs):
        ops = keras.ops
        x, mask = inputs
        queries = ops.ones((x.shape[0], x.shape[1] - mask.shape[1]), "bool")
        full = ops.concatenate([queries, ops.cast(mask, "bool")], axis=1)
        return x * ops.cast(full, x.dtype)[:, :, None]

    def compute_output_shape(self, shapes):
        return shapes[0]


class PositionQueries(keras.layers.Layer):
    """PARSeq's decoder: position queries kept as a (1, positions, dim) table and looked up
    along axis 1."""

    def build(self, shape):
        self.queries = self.add_weight((1, shape[1] + 2, shape[-1]), name="queries")

    def call(self, x):
        ops = keras.ops
        return x + ops.take(self.queries, ops.arange(x.shape[1]), axis=1)


def _prefix_and_positions():
    x = keras.Input((12, 8))
    mask = keras.Input((8,), dtype="int32")
    y = PrefixMask()([keras.layers.Dense(8)(x), mask])
    y = PositionQueries()(y)
    return keras.Model([x, mask], keras.layers.Dense(4)(y), name="prefix_and_positions"), \
        [tf.TensorSpec([4, 12, 8]), tf.TensorSpec([4, 8], tf.int32)]


class RowMap(keras.layers.Layer):
    """A ``tf.map_fn`` over the batch rows (keras-hub D-FINE's query selection): a While
    loop on the gradient path, replayed by two programs (the sharded one and the one-device
    reference) in one process."""

    def call(self, x):
        return tf.map_fn(lambda row: tf.tanh(row) * 2.0 + row, x)

    def compute_output_shape(self, shape):
        return shape


def _row_map():
    x = keras.Input((6, 8))
    y = RowMap()(keras.layers.Dense(8)(x))
    return keras.Model(x, keras.layers.Dense(4)(y), name="row_map"), [tf.TensorSpec([4, 6, 8])]


def _resource_gather():
    """A Keras 2 (tf_keras) embedding that looks its ids up straight from the variable, as
    Hugging Face's TF models do (``tf.gather(self.weight, ids)``: a ResourceGather, no
    ReadVariableOp), its table also read by the output projection (tied)."""
    import tf_keras as k2

    class Embeddings(k2.layers.Layer):
        def build(self, shape):
            self.weight = self.add_weight(name="weight", shape=(32, 8))

        def call(self, ids, project=False):
            if project:
                return tf.matmul(ids, self.weight, transpose_b=True)
            return tf.gather(params=self.weight, indices=ids)

    ids = k2.Input((6,), batch_size=4, dtype="int32")
    emb = Embeddings()
    h = k2.layers.Dense(8, activation="tanh")(emb(ids))
    return k2.Model(ids, emb(h, project=True), name="resource_gather"), \
        [tf.TensorSpec([4, 6], tf.int32)]


class DynamicTruncate(keras.layers.Layer):
    """Keeps a data-dependent number of positions (all of them here), so the traced graph
    has a tensor of unknown length, whose shape is then read (Hugging Face LED's
    Longformer attention pads to a window computed so)."""

    def call(self, x):
        keep = tf.reduce_max(tf.cast(tf.reduce_sum(tf.abs(x), -1) >= 0, tf.int32)
                             * tf.range(1, tf.shape(x)[1] + 1))
        h = x[:, :keep]                                     # (batch, None, features)
        shape = tf.shape(h)
        return tf.reshape(tf.nn.relu(h), tf.concat([shape[:2], [2, x.shape[-1] // 2]], 0))

    def compute_output_shape(self, shape):
        return (shape[0], None, 2, shape[-1] // 2)


def _dynamic_shape():
    x = keras.Input((6, 8), batch_size=4)
    h = DynamicTruncate()(keras.layers.Dense(8)(x))
    return keras.Model(x, keras.layers.Dense(4)(h), name="dynamic_shape"), \
        [tf.TensorSpec([4, 6, 8])]


def _grouped_conv_bn():
    """A RegNet block's grouped 3x3 convolution (4 groups, no bias) and batch norm: lowered
    to a Split of input and kernel and one convolution per group, the first group's in the
    GraphNode of the Split, the other kernel pieces node outputs (Hugging Face RegNet)."""
    x = keras.Input((8, 8, 16))
    y = keras.layers.Conv2D(16, 3, padding="same", groups=4, use_bias=False)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization()(y))
    y = keras.layers.GlobalAveragePooling2D()(y)
    return keras.Model(x, keras.layers.Dense(4)(y), name="grouped_conv_bn"), \
        [tf.TensorSpec([4, 8, 8, 16])]


def _zoo(name):
    def build():
        entry = models.get(name)
        return entry.build(seed=0), list(entry.input_spec(4))
    return build


MODELS = {"mlp": _mlp, "mha": _mha, "conv-bn": _conv_bn, "embedding": _embedding,
          "layer-norm": _layer_norm, "t5-tiny": _zoo("t5-tiny"), "moe-tiny": _zoo("moe-tiny"),
          "resnet-tiny": _zoo("resnet-tiny"), "library-layers": _library_layers,
          "grouped-conv": _grouped_conv, "recurrent-state": _recurrent_state,
          "inf-padding": _inf_padding, "tensor-array": _tensor_array,
          "prefix-and-positions": _prefix_and_positions, "row-map": _row_map,
          "resource-gather": _resource_gather, "dynamic-shape": _dynamic_shape,
          "grouped-conv-bn": _grouped_conv_bn}

_CAPTURED = {}


def _captured(name, build=None):
    """(trace, graph, GraphNode input values) of ``MODELS[name]`` (or ``build()``), once."""
    if name not in _CAPTURED:
        keras.utils.set_random_seed(0)
        model, specs = (build or MODELS[name])()
        t = capturing.trace(model, specs)
        g = capturing.to_ir(t)
        names = [i.name for n in g.nodes for i in n.inputs]
        values = verify.intermediate_values(t, g, checker.synthetic_inputs(g), names)
        _CAPTURED[name] = (t, g, values)
    return _CAPTURED[name]


def check_node_patterns(t, g, values, num_devices):
    """(number checked, failure messages) for every pattern of every GraphNode."""
    return checker.check_node_patterns(t, g, values, num_devices)


# the zoo presets take a minute each: the CI slice checks each on one device count (moe-tiny
# and t5-tiny on 4, resnet-tiny on 2; the same patterns at the other split size run under
# TAPAS_FULL_MATRIX=1), the small graphs on both
_ONE_COUNT = {("moe-tiny", 2), ("t5-tiny", 2), ("resnet-tiny", 4)}
CASES = pick([(name, n) for name in MODELS for n in (2, 4) if (name, n) not in _ONE_COUNT],
             [(name, n) for name in MODELS for n in (2, 4)])


@pytest.mark.parametrize("name,num_devices", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_every_pattern_of_every_node_matches_one_device(name, num_devices):
    t, g, values = _captured(name)
    checked, failures = check_node_patterns(t, g, values, num_devices)
    assert checked > 0
    assert not failures, f"{len(failures)} of {checked} patterns are wrong:\n" + \
        "\n".join(failures[:20])


def test_every_pattern_of_keras_hub_deberta_v3_matches_one_device():
    """keras-hub DeBERTa-v3 projects its layer-normed relative embeddings, which later
    layers read too, with the attention's own query and key layers, inside one GraphNode.
    The propagation once left the gradient of those embeddings (a node output, whose
    consumers outside the node send a full gradient) partial and all-reduced it with the
    outside gradient in it (rel_embedding's gradient N times too large), and offered a
    ``row`` pattern that sliced the node's output: now every pattern it offers for every
    GraphNode equals the node on one device."""
    from tapas.models import corpus
    t, g, values = _captured("hub-deberta-v3", corpus.get("hub-deberta-v3").build)
    checked, failures = check_node_patterns(t, g, values, 2)
    assert checked > 50
    assert not failures, f"{len(failures)} of {checked} patterns are wrong:\n" + \
        "\n".join(failures[:20])


def test_every_pattern_of_hugging_face_albert_matches_one_device():
    """Hugging Face ALBERT (Keras 2) applies its one shared layer twice inside one
    GraphNode, which reads each weight twice: the backward all-reduce of a replicated
    weight's partial gradient ran once per read where the pattern (and the cost model)
    has one; a later read now takes the first read's value, so the gradients add up before
    the one collective. Its embeddings also assert their ids with string messages, which
    the checker compared as floats (a false alarm on every model of the library)."""
    from tapas.models import corpus
    t, g, values = _captured("hf-albert", corpus.get("hf-albert").build)
    checked, failures = check_node_patterns(t, g, values, 2)
    assert checked > 50
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


def _check_with(name, node_ops, pattern_name, transform, num_devices=2):
    """Run the checker on ``name`` with one pattern replaced by ``transform(pattern, node)``
    (the first GraphNode whose op types include ``node_ops``); its failures for that node."""
    import dataclasses
    t, g, values = _captured(name)
    node = next(n for n in g.nodes if node_ops <= {o.type for o in n.ops}
                and any(p.name == pattern_name for p in
                        patterns.patterns_for(n, g, num_devices)))
    original = patterns.patterns_for

    def patched(n, graph, n_dev):
        return [dataclasses.replace(p, comms=transform(p, n))
                if (n.id == node.id and p.name == pattern_name) else p
                for p in original(n, graph, n_dev)]

    patterns.patterns_for = patched
    try:
        _, failures = checker.check_node_patterns(t, g, values, num_devices)
    finally:
        patterns.patterns_for = original
    return node, failures


def test_the_checker_catches_a_gather_placed_upstream_of_a_masked_softmax():
    """What the propagation once produced for keras-hub Mixtral's attention (pattern
    'split-R-R-S2'): the backward all-gather of the probabilities on the node input instead
    of the SelectV2 output the context matmul reads sliced. Reconstruction slices the input,
    SelectV2 meets its whole mask: the checker reports the pattern as not buildable."""
    import dataclasses

    def upstream(p, node):
        select = next(o for o in node.ops if o.type == "SelectV2")
        probs = next(x for x in select.inputs if x in {t.name for t in node.inputs})
        return tuple(dataclasses.replace(c, tensor=probs) if c.tensor == select.outputs[0].name
                     else c for c in p.comms)

    node, failures = _check_with("library-layers", {"SelectV2", "BatchMatMulV2"},
                                 "split-R-R-S2", upstream)
    assert len(failures) == 1, failures
    assert f"'{node.name}'" in failures[0] and "'split-R-R-S2'" in failures[0]
    assert "cannot be rebuilt" in failures[0]


def test_the_checker_catches_moe_gates_left_whole():
    """The MoE combine einsum split on experts reads its gates sliced on the expert axis;
    without the all-gather that slices them (the propagation once passed their gradient on
    as a partial sum through the Sum that makes them) reconstruction slices the replicated
    gates locally and their gradient stays a slice: the checker reports the wrong gradient
    (before contractions sliced replicated operands: "cannot be rebuilt")."""
    def no_gather(p, node):
        return tuple(c for c in p.comms if not (c.phase == "bwd" and c.kind.value == "AG"))

    node, failures = _check_with("library-layers", {"OneHot", "Sum", "Einsum"},
                                 "split-R-R-S0", no_gather)
    assert len(failures) == 1, failures
    assert "'split-R-R-S0'" in failures[0] and "gradient of input" in failures[0]


@pytest.mark.parametrize("rows,num_devices", [(2, 2), (4, 1)])
def test_every_nested_expert_pattern_matches_one_device(rows, num_devices):
    """The 2-D pattern checker: every pattern the nested expert + tensor search may give
    moe-tiny's expert einsums, with the experts cut over ``rows`` mesh rows, the tokens
    exchanged over the columns and the pattern in each row of ``num_devices``, equals the
    GraphNode on one device run on each row's share (outputs, weight and token
    gradients)."""
    t, g, values = _captured("moe-tiny")
    checked, failures = checker.check_nested_patterns(t, g, values, num_devices, rows)
    assert checked >= (3 if num_devices > 1 else 1)
    assert not failures, "\n".join(failures[:10])


def test_the_nested_checker_catches_a_wrong_exchange():
    """Break the all-to-all back out of the expert region (the experts come back in reverse
    order): every nested pattern differs from one device and the checker says so."""
    from tapas.execution.program.run import Run
    t, g, values = _captured("moe-tiny")
    original = Run._exchanged

    def broken(self, name, want, entry):
        vals = original(self, name, want, entry)
        return vals if entry else [v[::-1] for v in vals]   # the experts reversed

    Run._exchanged = broken
    try:
        checked, failures = checker.check_nested_patterns(t, g, values, 2, 2)
    finally:
        Run._exchanged = original
    assert checked and len(failures) == checked
    assert all("largest difference" in f and "2x2:experts" in f for f in failures), failures[:2]


@pytest.mark.parametrize("seed", pick([0], [0, 1]))   # seed 1: TAPAS_FULL_MATRIX=1
def test_whole_moe_model_nested_plan_matches_one_device(seed):
    """A random nested plan of the whole moe-tiny on a 2x2:experts mesh, simulated: each row
    runs its share of the batch, the expert region on exchanged tokens; outputs and every
    gradient equal the single-device graph run on each row's share."""
    import numpy as np

    from tapas.execution.api import parallel
    from tapas.planning import experts
    t, g, _ = _captured("moe-tiny")
    plan = parallel.random_plan(g, 2, seed, patterns_fn=experts.nested_patterns(g, 2))
    inputs = [np.concatenate([a, b]) for a, b in zip(checker.synthetic_inputs(g, seed=1),
                                                    checker.synthetic_inputs(g, seed=2))]
    cmp = nested.compare_nested(t, g, plan, inputs, rows=2)
    assert cmp.ok(), cmp.worst
    assert any(d.what.startswith("gradient of") and "moe/wi" in d.what
               for d in cmp.differences)
