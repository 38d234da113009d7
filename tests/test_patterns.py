"""tapas.sharding.patterns (and tapas.sharding.rules): per-op rules, the propagation and every
pattern family.

GraphNodes come from tapas.capture on tiny Keras layers and the tiny zoo models (the
tests may import TensorFlow; the pattern modules may not, see tests/test_placements.py)."""

from __future__ import annotations

import functools

import keras
import pytest
import tensorflow as tf

import tapas
from tapas import models
from tapas.sharding import patterns
from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo
from tapas.sharding.patterns import (Family, PatternId, PatternSeed, explain, pattern_by_name,
                                     patterns_for)
from tapas.sharding.placements import Partial, Replica, Split

R, P = Replica(), Partial()


@functools.lru_cache(maxsize=None)
def _capture(name: str) -> Graph:
    keras.utils.set_random_seed(0)
    if name == "mlp":
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(8)])
        return tapas.capture(m, tf.TensorSpec([4, 8]))
    if name == "dense3":
        m = keras.Sequential([keras.Input((4, 8)), keras.layers.Dense(16)])
        return tapas.capture(m, tf.TensorSpec([2, 4, 8]))
    if name == "odd":
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(10)])
        return tapas.capture(m, tf.TensorSpec([4, 8]))
    if name == "mha":
        x = keras.Input((4, 8))
        y = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
        return tapas.capture(keras.Model(x, y), tf.TensorSpec([2, 4, 8]))
    if name == "convbn":
        m = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(8, 3),
                              keras.layers.BatchNormalization(), keras.layers.ReLU()])
        return tapas.capture(m, tf.TensorSpec([2, 8, 8, 4]))
    if name == "embedding":
        m = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(16, 8)])
        return tapas.capture(m, tf.TensorSpec([2, 4], tf.int32))
    if name == "layernorm":
        m = keras.Sequential([keras.Input((4, 8)), keras.layers.LayerNormalization()])
        return tapas.capture(m, tf.TensorSpec([2, 4, 8]))
    entry = models.get(name)
    if name == "moe-tiny-tapas":     # tapas.layers: whole-layer GraphNodes
        return tapas.capture(entry.build(fast_init=True), list(entry.input_spec(2)))
    return tapas.capture(entry.build(fast_init=True), entry.input_spec())


def _nodes(g: Graph, kind: Kind) -> list[GraphNode]:
    return [n for n in g.nodes if n.kind is kind]


def _by_name(node: GraphNode, g: Graph, n: int) -> dict[str, patterns.ShardingPattern]:
    return {p.name: p for p in patterns_for(node, g, n)}


def _weight(node: GraphNode, suffix: str) -> str:
    return next(w.path for w in node.weights if w.path.endswith(suffix))


def _check_complete(node: GraphNode, pat: patterns.ShardingPattern) -> None:
    """Every op output placed, comms on known tensors, no partial at the boundary."""
    outs = {t.name for op in node.ops for t in op.outputs}
    assert set(pat.tensors) == outs
    assert len(pat.inputs) == len(node.inputs) and len(pat.outputs) == len(node.outputs)
    assert set(pat.weights) == {w.path for w in node.weights}
    known = outs | {t.name for t in node.inputs} | {f"{w.placeholder}:0" for w in node.weights}
    for c in pat.comms:
        assert c.tensor in known, (pat.name, c)
        assert c.phase in ("fwd", "bwd")
    assert not any(isinstance(p, Partial) for p in (*pat.outputs, *pat.weights.values()))
    assert set(pat.rewrites) <= {op.name for op in node.ops}
    assert pat.flops >= 0


# ---- dense / matmul ------------------------------------------------------------------------

def test_dense_rank2_megatron_column_then_row() -> None:
    g = _capture("mlp")
    d1, d2 = _nodes(g, Kind.DENSE)
    p1, p2 = _by_name(d1, g, 2), _by_name(d2, g, 2)
    assert {"replicate", "batch", "column", "row"} <= set(p1) & set(p2)
    col, row = p1["column"], p2["row"]
    assert col.weights[_weight(d1, "kernel")] == Split(1)
    assert col.weights[_weight(d1, "bias")] == Split(0)      # the bias follows the kernel
    assert col.inputs == (R,) and col.outputs == (Split(1),)
    assert [(c.phase, c.kind.value, c.tensor) for c in col.comms] == [
        ("bwd", "AR", d1.inputs[0].name)]                      # Megatron's f
    assert row.inputs == (Split(1),) and row.outputs == (R,)
    assert row.weights[_weight(d2, "kernel")] == Split(0)
    assert row.weights[_weight(d2, "bias")] == R
    (ar,) = row.comms
    matmul = next(op for op in d2.ops if op.type == "MatMul")
    assert (ar.phase, ar.kind.value, ar.tensor) == ("fwd", "AR", matmul.outputs[0].name)
    assert row.tensors[matmul.outputs[0].name] == P           # reduced before the bias
    assert "C_AR(MatMul(S1(X), S0(W" in row.expr
    # the valid pair: column's output is what row expects, with no resharding
    assert col.outputs[0] == row.inputs[0]
    # row then row: the first row's output R is not the second's input S1
    assert p1["row"].outputs[0] != row.inputs[0]
    for p in (*p1.values(), *p2.values()):
        _check_complete(d1 if p in p1.values() else d2, p)


def test_dense_batch_split_all_reduces_weight_gradients() -> None:
    g = _capture("mlp")
    d1 = _nodes(g, Kind.DENSE)[0]
    batch = _by_name(d1, g, 2)["batch"]
    assert batch.inputs == (Split(0),) and batch.outputs == (Split(0),)
    assert all(p == R for p in batch.weights.values())
    assert sorted((c.phase, c.kind.value, c.tensor) for c in batch.comms) == sorted(
        ("bwd", "AR", f"{w.placeholder}:0") for w in d1.weights)
    assert batch.flops == pytest.approx(patterns_for(d1, g, 1)[1].flops / 2, rel=0.01)


def test_dense_rank3_splits_last_axis() -> None:
    g = _capture("dense3")
    (d,) = _nodes(g, Kind.DENSE)
    ps = _by_name(d, g, 2)
    assert ps["column"].outputs == (Split(2),)
    assert ps["row"].inputs == (Split(2),) and ps["row"].outputs == (R,)
    assert ps["batch"].inputs == (Split(0),)
    for p in ps.values():
        _check_complete(d, p)


def test_non_divisible_dimension_is_rejected_and_explained() -> None:
    g = _capture("odd")
    (d,) = _nodes(g, Kind.DENSE)
    names = {p.name for p in patterns_for(d, g, 4)}
    assert "column" not in names and "row" in names
    why = explain(d, g, 4, "column")
    kernel = _weight(d, "kernel")
    assert f"'{kernel}'" in why and "size 10" in why and "4 devices" in why
    with pytest.raises(ValueError, match="size 10"):
        pattern_by_name(d, g, 4, "column")
    assert "candidates" in explain(d, g, 4, "no-such-pattern")
    assert "is valid" in explain(d, g, 4, "row")


# ---- attention ---------------------------------------------------------------------------

def test_multi_head_attention_heads_and_batch() -> None:
    g = _capture("mha")
    scores = _nodes(g, Kind.ATTENTION_SCORE) + _nodes(g, Kind.ATTENTION_CONTEXT)
    assert scores
    for n in scores:
        ps = _by_name(n, g, 2)
        assert "batch" in ps and "heads" in ps
        heads = ps["heads"]
        assert all(isinstance(p, Split) for p in heads.inputs) and not heads.fwd_comms
        for p in ps.values():
            _check_complete(n, p)
    # the projections split on heads keep the head dimension whole
    dense = _nodes(g, Kind.DENSE)
    assert dense and all("column" in _by_name(n, g, 2) for n in dense)


# ---- conv ----------------------------------------------------------------------------------

def test_conv_batch_norm_channel_splits() -> None:
    g = _capture("convbn")
    (c,) = _nodes(g, Kind.CONV)
    ps = _by_name(c, g, 2)
    assert {"batch", "out-channel", "in-channel"} <= set(ps)
    out = ps["out-channel"]
    assert out.weights[_weight(c, "kernel")] == Split(3) and out.outputs == (Split(3),)
    for suffix in ("gamma", "beta", "moving_mean", "moving_variance"):
        assert out.weights[_weight(c, suffix)] == Split(0)   # batch norm follows
    inc = ps["in-channel"]
    assert inc.inputs == (Split(3),) and inc.weights[_weight(c, "kernel")] == Split(2)
    assert [x.kind.value for x in inc.fwd_comms] == ["AR"]
    conv = next(op for op in c.ops if op.type == "Conv2D")
    assert inc.fwd_comms[0].tensor == conv.outputs[0].name   # reduced before the norm
    for p in ps.values():
        _check_complete(c, p)


# ---- embedding ----------------------------------------------------------------------------

def test_embedding_vocab_and_hidden() -> None:
    g = _capture("embedding")
    (e,) = _nodes(g, Kind.EMBEDDING)
    ps = _by_name(e, g, 2)
    vocab, hidden = ps["vocab"], ps["hidden"]
    table = e.weights[0].path
    assert vocab.weights[table] == Split(0) and vocab.outputs == (R,)
    gather = next(op for op in e.ops if op.type in ("GatherV2", "ResourceGather"))
    assert vocab.rewrites == {gather.name: "vocab-gather"}
    assert [(c.phase, c.kind.value) for c in vocab.comms] == [("fwd", "AR")]
    assert hidden.weights[table] == Split(1) and hidden.outputs == (Split(2),)
    assert ps["batch"].inputs == (Split(0),)
    assert "vocab" not in {p.name for p in patterns_for(e, g, 32)}
    assert "not divisible by 32 devices" in explain(e, g, 32, "vocab")


# ---- norm / elementwise / softmax / reshape / reduce ----------------------------------------

def test_layer_norm_hidden_split_reduces_its_statistics() -> None:
    g = _capture("layernorm")
    (n,) = _nodes(g, Kind.NORM)
    ps = _by_name(n, g, 2)
    assert {"batch", "follow-S1", "follow-S2"} <= set(ps)
    hid = ps["follow-S2"]
    assert hid.outputs == (Split(2),)
    assert all(p == Split(0) for p in hid.weights.values())
    assert set(hid.rewrites.values()) == {"partial-mean"}
    # only the (tiny) statistics are all-reduced, never the normalized output
    assert hid.fwd_comms and all(c.shape[-1] == 1 for c in hid.fwd_comms)
    for p in ps.values():
        _check_complete(n, p)


def test_softmax_axis_is_never_split() -> None:
    g = _capture("t5-tiny")
    sm = next(n for n in g.nodes if n.kind is Kind.SOFTMAX)
    names = {p.name for p in patterns_for(sm, g, 2)}
    assert "follow-S1" in names and "follow-S3" not in names
    assert "needs that dimension whole" in explain(sm, g, 2, "follow-S3")


def test_elementwise_last_axis_split() -> None:
    g = _capture("t5-tiny")
    add = next(n for n in g.nodes if n.kind is Kind.ELEMENTWISE and len(n.inputs) == 2)
    ps = _by_name(add, g, 2)
    rank = len(add.outputs[0].shape)
    assert ps[f"follow-S{rank - 1}"].outputs == (Split(rank - 1),)
    assert not ps[f"follow-S{rank - 1}"].comms


def _shape_read_graph(length: int) -> tuple[Graph, GraphNode]:
    """One GraphNode: h = relu(x); reshape(h, shape(h)); x of shape (4, length, 8)."""
    x = TensorInfo("x:0", (4, length, 8), "float32")
    h = TensorInfo("h:0", (4, length, 8), "float32")
    shape = TensorInfo("s:0", (3,), "int32")
    y = TensorInfo("y:0", (4, length, 8), "float32")
    ops = (OpInfo("h", "Relu", ("x:0",), (h,)), OpInfo("s", "Shape", ("h:0",), (shape,)),
           OpInfo("y", "Reshape", ("h:0", "s:0"), (y,)))
    node = GraphNode(0, "shape_read", Kind.ELEMENTWISE, ops, (x,), (y,), (), "sig")
    return Graph((node,), (), (x,), (y,)), node


def test_the_shape_of_a_dynamic_tensor_is_never_read_from_a_split() -> None:
    """A Shape of a split tensor reads the traced (global) value (the global-shape
    rewrite); where the traced graph does not know that shape (Hugging Face LED's
    Longformer attention: (4, 8, 4, None)) no constant stands in for it, so the patterns
    that would split it are not offered (LED's random plans failed in reconstruction)."""
    from tapas.sharding.patterns import Rewrite
    static_graph, static_node = _shape_read_graph(6)
    assert Rewrite.GLOBAL_SHAPE in \
        _by_name(static_node, static_graph, 2)["follow-S2"].rewrites.values()
    g, node = _shape_read_graph(-1)   # (capture writes an unknown length as -1)
    offered = patterns_for(node, g, 2)
    assert offered and all(Rewrite.GLOBAL_SHAPE not in p.rewrites.values() for p in offered)
    assert "dynamic in the traced graph" in explain(node, g, 2, "follow-S2")


# ---- MoE -----------------------------------------------------------------------------------

def test_moe_expert_split() -> None:
    g = _capture("moe-tiny")
    experts = _nodes(g, Kind.EXPERT_EINSUM)
    assert experts
    for n in experts:
        ex = _by_name(n, g, 2)["expert"]
        assert all(p == Split(0) for p in ex.weights.values()) and not ex.comms
        assert ex.outputs == (Split(0),)
    # dispatch/combine einsums (kind matmul) follow: some split keeps the expert axis
    mm = _nodes(g, Kind.MATMUL)
    assert mm and all(len(patterns_for(n, g, 2)) > 1 for n in mm)


# ---- every GraphNode of every tiny zoo model -------------------------------------------------

@pytest.mark.parametrize("name", ["t5-tiny", "moe-tiny", "resnet-tiny"])
@pytest.mark.parametrize("num_devices", [2, 4])
def test_every_zoo_node_has_valid_complete_patterns(name: str, num_devices: int) -> None:
    g = _capture(name)
    split_somewhere = 0
    for node in g.nodes:
        ps = patterns_for(node, g, num_devices)
        assert ps and ps[0].name == "replicate" and ps[0].is_replicated, node.name
        assert len({p.name for p in ps}) == len(ps)
        assert len({p.key() for p in ps}) == len(ps)
        for p in ps:
            _check_complete(node, p)
        split_somewhere += len(ps) > 1
    assert split_somewhere > len(g.nodes) // 2


# ---- pattern roles as data: family and data_parallel ------------------------------------------

_DATA_PARALLEL_NAMES = {"batch", "follow-S0", "split-S0-S0"}


@pytest.mark.parametrize("name", ["t5-tiny", "moe-tiny", "resnet-tiny", "moe-tiny-tapas"])
def test_every_zoo_pattern_has_a_family_and_data_parallel_means_the_batch_split(
        name: str) -> None:
    """Families come from the seed functions, not from the names; ``data_parallel`` is
    true exactly for the patterns the reference data-parallel plan has always used."""
    g = _capture(name)
    families: set[Family] = set()
    for node in g.nodes:
        for p in patterns_for(node, g, 2):
            assert isinstance(p.family, Family), (node.name, p.name)
            assert p.data_parallel == (p.name in _DATA_PARALLEL_NAMES), (node.name, p.name)
            families.add(p.family)
            head = p.name.split("-")[0]
            if head in ("batch", "follow", "split", "heads", "hidden", "expert", "replicate"):
                assert p.family.value == head, (node.name, p.name)
    assert {Family.REPLICATE, Family.BATCH} <= families


@pytest.mark.parametrize("name", ["t5-tiny", "moe-tiny", "resnet-tiny"])
def test_pattern_names_are_typed_ids_read_back_from_their_text(name: str) -> None:
    """Every pattern's name is a PatternId carrying the pattern's family; its text (what a
    Strategy file holds) parses back to an equal id of the same family."""
    g = _capture(name)
    for node in g.nodes:
        for p in patterns_for(node, g, 2):
            assert isinstance(p.name, PatternId) and p.name.family is p.family, p.name
            back = PatternId.parse(str(p.name))
            assert back == p.name and back.family is p.family, (node.name, p.name)
            assert patterns.pattern_by_id(node, g, 2, back) is not None
    assert PatternId.parse("column-row").family is Family.COLUMN_ROW
    assert PatternId.parse("column-2").family is Family.COLUMN
    with pytest.raises(ValueError, match="'diagonal' belongs to no pattern family"):
        PatternId.parse("diagonal")


def test_families_of_weight_splits_follow_what_the_split_does() -> None:
    """in-channel and vocab leave partial sums (row), out-channel does not (column)."""
    g = _capture("convbn")
    (c,) = _nodes(g, Kind.CONV)
    ps = _by_name(c, g, 2)
    assert ps["in-channel"].family is Family.ROW and ps["out-channel"].family is Family.COLUMN
    g = _capture("embedding")
    (e,) = _nodes(g, Kind.EMBEDDING)
    ps = _by_name(e, g, 2)
    assert ps["vocab"].family is Family.ROW and ps["hidden"].family is Family.HIDDEN
    g = _capture("mlp")
    d1 = _nodes(g, Kind.DENSE)[0]
    ps = _by_name(d1, g, 2)
    assert (ps["row"].family, ps["column"].family) == (Family.ROW, Family.COLUMN)
    assert ps["batch"].data_parallel and not ps["row"].data_parallel


def test_a_seed_without_a_family_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _capture("layernorm")
    (n,) = _nodes(g, Kind.NORM)

    def no_family(node: GraphNode, ctx) -> list[PatternSeed]:
        return [PatternSeed("mystery", tuple(R for _ in node.inputs))]

    monkeypatch.setitem(patterns.REGISTRY, Kind.NORM, [*patterns.REGISTRY[Kind.NORM], no_family])
    patterns.clear_cache()
    try:
        with pytest.raises(TypeError, match="'mystery'.*without a family.*family=Family"):
            patterns_for(n, g, 2)
    finally:
        patterns.clear_cache()


def test_identical_nodes_share_names_and_get_their_own_tensors() -> None:
    g = _capture("t5-tiny")
    by_sig: dict[str, list[GraphNode]] = {}
    for n in g.nodes:
        by_sig.setdefault(n.signature, []).append(n)
    a, b = next(v for v in by_sig.values() if len(v) > 1 and v[0].weights)[:2]
    pa, pb = patterns_for(a, g, 2), patterns_for(b, g, 2)
    assert [p.name for p in pa] == [p.name for p in pb]
    for x, y in zip(pa, pb):
        _check_complete(b, y)
        assert x.inputs == y.inputs and x.outputs == y.outputs and x.expr == y.expr
        assert x.family is y.family and x.data_parallel == y.data_parallel
        assert set(y.weights) == {w.path for w in b.weights}


def test_unknown_op_only_replicates() -> None:
    x = TensorInfo("x:0", (4, 8), "float32")
    y = TensorInfo("f:0", (4, 8), "float32")
    src = GraphNode(0, "x", Kind.INPUT, (OpInfo("x", "Placeholder", (), (x,)),), (), (x,), ())
    weird = GraphNode(1, "f", Kind.ELEMENTWISE, (OpInfo("f", "FooBar", ("x:0",), (y,)),),
                      (x,), (y,), ())
    g = Graph.build([src, weird])
    assert [p.name for p in patterns_for(g.nodes[1], g, 2)] == ["replicate"]
    assert "FooBar, which has no placement rule" in explain(g.nodes[1], g, 2, "batch")
    assert [p.name for p in patterns_for(g.nodes[0], g, 2)] == ["replicate", "batch"]


def test_bad_device_count() -> None:
    g = _capture("mlp")
    with pytest.raises(ValueError, match="num_devices=0"):
        patterns_for(g.nodes[1], g, 0)


def test_a_seed_that_cannot_be_built_leaves_replicate_with_a_note(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = _capture("mlp")
    d1 = _nodes(g, Kind.DENSE)[0]

    def broken(self, seed):
        raise ValueError(f"cannot build {seed.name}")

    monkeypatch.setattr(patterns.SeedContext, "trial", broken)
    patterns.clear_cache()
    try:
        pats = patterns_for(d1, g, 2)
    finally:
        patterns.clear_cache()
    assert [p.name for p in pats] == ["replicate"]
    assert "(ValueError: cannot build " in pats[0].note
    assert "could not be built and were left out" in pats[0].note
    monkeypatch.undo()
    patterns.clear_cache()
    assert patterns_for(d1, g, 2)[0].note == ""        # the real patterns again


def test_even_replicate_failing_gives_a_bare_replicate(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _capture("mlp")
    d1 = _nodes(g, Kind.DENSE)[0]

    def broken(*args, **kwargs):
        raise KeyError("no rule")

    monkeypatch.setattr(patterns, "propagate", broken)
    monkeypatch.setattr(patterns.SeedContext, "trial", lambda self, seed: broken())
    patterns.clear_cache()
    try:
        (rep,) = patterns_for(d1, g, 2)
    finally:
        patterns.clear_cache()
    _check_complete(d1, rep)
    assert rep.is_replicated and rep.family is Family.REPLICATE and "'replicate'" in rep.note


def test_a_node_nobody_reads_has_patterns() -> None:
    # a dead branch that still reads its weights (a backbone's unused pooler)
    x = TensorInfo("x:0", (4, 8), "float32")
    r = TensorInfo("r:0", (8, 8), "float32")
    w = WeightInfo("pooler/kernel", (8, 8), "float32", True, "w")
    src = GraphNode(0, "x", Kind.INPUT, (OpInfo("x", "Placeholder", (), (x,)),), (), (x,), ())
    unread = GraphNode(1, "pooler", Kind.CONSTANT,
                       (OpInfo("w", "Placeholder", (), (TensorInfo("w:0", (), "resource"),)),
                        OpInfo("r", "ReadVariableOp", ("w:0",), (r,))), (), (), (w,))
    g = Graph.build([src, unread])
    pats = patterns_for(g.nodes[1], g, 2)
    assert pats[0].name == "replicate" and pats[0].expr.startswith("Unread(")


def test_depthwise_convolution_flops_read_one_channel_window() -> None:
    """A depthwise 3x3 convolution's output element reads 9 inputs of its own channel, not
    9 x in_channels (the count that made EfficientNet's predicted step 6x its measured
    one on CPU): 2 x output elements x 9, halved where its channels split over 2 devices."""
    x = keras.Input((8, 8, 16), batch_size=2)
    y = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    graph = tapas.capture(keras.Model(x, y), [tf.TensorSpec((2, 8, 8, 16), tf.float32)])
    (node,) = [n for n in graph.nodes if any(op.type == "DepthwiseConv2dNative" for op in n.ops)]
    whole = pattern_by_name(node, graph, 1, "replicate")
    out = 2 * 8 * 8 * 16
    # the convolution, and the output's Identity counted as one elementwise op per element
    assert whole.flops == pytest.approx(2 * out * 9 + out)
    split = [p for p in patterns_for(node, graph, 2) if p.name != "replicate"]
    assert split and all(p.flops == pytest.approx(whole.flops / 2) for p in split)
    # memory-bound where the cost model has an elementwise rate: its output's elements, no
    # FLOPs at the matmul rate (the Identity passes the buffer on: nothing)
    assert (whole.dense_flops, whole.elements) == (0.0, out)
    assert all(p.elements == pytest.approx(out / 2) for p in split)


def test_patterns_split_their_flops_into_contractions_and_memory_bound_elements() -> None:
    """``dense_flops`` counts the matmul (2 x 24 x 8 x 16 on one device), ``elements`` what
    the bias add, the ReLU and the transpose write (3 x 4 x 6 x 16; the Identity and the
    reshapes touch nothing); a batch or column split halves both, a row split only the
    matmul (its bias add and ReLU run on the whole, all-reduced output)."""
    x = keras.Input((6, 8), batch_size=4)
    h = keras.layers.Dense(16, activation="relu", name="up")(x)
    y = keras.layers.Permute((2, 1), name="perm")(h)
    graph = tapas.capture(keras.Model(x, y), [tf.TensorSpec((4, 6, 8), tf.float32)])
    (node,) = [n for n in graph.nodes if any(op.type == "MatMul" for op in n.ops)]
    assert {"BiasAdd", "Relu", "Transpose", "Identity"} <= {op.type for op in node.ops}
    whole = pattern_by_name(node, graph, 2, "replicate")
    assert whole.dense_flops == 2 * 24 * 8 * 16
    assert whole.elements == 3 * 4 * 6 * 16
    assert whole.flops == whole.dense_flops + 3 * 4 * 6 * 16   # BiasAdd, Relu, Identity
    for name in ("batch", "column"):
        half = pattern_by_name(node, graph, 2, name)
        assert (half.dense_flops, half.elements) == (whole.dense_flops / 2, whole.elements / 2)
    row = pattern_by_name(node, graph, 2, "row")
    assert (row.dense_flops, row.elements) == (whole.dense_flops / 2, whole.elements)


def test_patterns_key_their_matmul_flops_by_the_local_width() -> None:
    """``dense_by_width`` keeps the matmul's FLOPs under the power of two at or below the
    width of the matrix multiply on one device (the geometric mean of the two smallest of
    M, N and K): a [128, 32] x [32, 64] matmul is 45 wide (bucket 32); on 4 devices a
    column split leaves [128, 32] x [32, 16] (22.6: bucket 16), a row split [128, 8] x
    [8, 64] (22.6: bucket 16), a batch split [32, 32] x [32, 64] (32: bucket 32). A
    convolution is the matrix multiply of its window."""
    x = keras.Input((32,), batch_size=128)
    graph = tapas.capture(keras.Model(x, keras.layers.Dense(64, name="d")(x)),
                          [tf.TensorSpec((128, 32), tf.float32)])
    (node,) = [n for n in graph.nodes if any(op.type == "MatMul" for op in n.ops)]
    expect = {"replicate": 32, "column": 16, "row": 16, "batch": 32}
    for name, bucket in expect.items():
        p = pattern_by_name(node, graph, 4, name)
        assert dict(p.dense_by_width) == {bucket: p.dense_flops}, name
    # a 3x3 convolution 8 -> 16 channels on [4, 8, 8, 8]: M = 256, K = 72, N = 16 (33.9:
    # bucket 32); an in- or out-channel split on 2 devices halves K or N (24: bucket 16)
    x = keras.Input((8, 8, 8), batch_size=4)
    graph = tapas.capture(keras.Model(x, keras.layers.Conv2D(16, 3, padding="same")(x)),
                          [tf.TensorSpec((4, 8, 8, 8), tf.float32)])
    (node,) = [n for n in graph.nodes if any(op.type == "Conv2D" for op in n.ops)]
    expect = {"replicate": 32, "batch": 32, "in-channel": 16, "out-channel": 16}
    for name, bucket in expect.items():
        p = pattern_by_name(node, graph, 2, name)
        assert dict(p.dense_by_width) == {bucket: p.dense_flops}, name
