"""Tests for tapas.capturing.grouping on hand-written op graphs (no TensorFlow)."""

import pytest

from tapas.capturing.grouping import RawGraph, group_ops
from tapas.ir import Kind, OpInfo, TensorInfo, WeightInfo


class Builder:
    """Writes a RawGraph op by op: b.op("dense/MatMul", "MatMul", ["x", "dense/read"], (4, 8))."""

    def __init__(self):
        self.ops, self.weights, self.inputs, self.control = [], {}, [], {}

    def op(self, name, type_, inputs=(), shape=(4, 8), dtype="float32", **attrs):
        ins = tuple(i if ":" in i else f"{i}:0" for i in inputs)
        self.ops.append(OpInfo(name, type_, ins, (TensorInfo(f"{name}:0", tuple(shape), dtype),),
                               attrs))
        return name

    def input(self, name, shape=(4, 8)):
        self.inputs.append(name)
        return self.op(name, "Placeholder", (), shape)

    def weight(self, path, shape, trainable=True):
        ph = f"{path}/resource"
        self.op(ph, "Placeholder", (), (), "resource")
        self.weights[ph] = WeightInfo(path, tuple(shape), "float32", trainable, ph)
        return self.op(f"{path}/read", "ReadVariableOp", [ph], shape)

    def dense(self, scope, x, units=8, width=8, act="Relu"):
        k = self.weight(f"{scope}/kernel", (width, units))
        b = self.weight(f"{scope}/bias", (units,))
        h = self.op(f"{scope}/MatMul", "MatMul", [x, k], (4, units))
        h = self.op(f"{scope}/BiasAdd", "BiasAdd", [h, b], (4, units))
        return self.op(f"{scope}/{act}", act, [h], (4, units)) if act else h

    def graph(self, *outputs):
        outs = tuple(TensorInfo(f"{o}:0", self._shape(o), "float32") for o in outputs)
        return group_ops(RawGraph(self.ops, self.control, self.inputs, outs, self.weights,
                                  tuple(self.weights.values())))

    def _shape(self, name):
        return next(o.outputs[0].shape for o in self.ops if o.name == name)


def _every_op_once(b, g):
    names = [op.name for n in g.nodes for op in n.ops]
    assert len(names) == len(set(names))
    assert set(names) | set(g.dead_ops) == {op.name for op in b.ops}


def test_dense_layers_are_one_graphnode_each():
    b = Builder()
    x = b.input("x")
    h = b.dense("m/d1", x)
    h = b.dense("m/d2", h)
    h = b.dense("m/d3", h)
    out = b.op("Identity", "Identity", [h])
    g = b.graph(out)
    _every_op_once(b, g)
    assert [n.kind for n in g.nodes] == [Kind.INPUT, Kind.DENSE, Kind.DENSE, Kind.DENSE]
    assert {op.type for op in g.nodes[1].ops} == {"Placeholder", "ReadVariableOp", "MatMul",
                                                  "BiasAdd", "Relu"}
    assert [w.path for w in g.nodes[2].weights] == ["m/d2/bias", "m/d2/kernel"]
    assert g.nodes[1].signature == g.nodes[2].signature
    assert [(e.src, e.dst) for e in g.edges] == [(0, 1), (1, 2), (2, 3)]
    # the graph-output Identity joins the last layer, which so differs structurally
    assert g.nodes[3].outputs[0].name == "Identity:0"
    assert g.nodes[3].signature != g.nodes[2].signature


def test_residual_add_is_its_own_graphnode():
    b = Builder()
    x = b.input("x")
    h = b.dense("m/d1", x, act=None)
    y = b.op("m/add", "AddV2", [h, x])
    g = b.graph(y)
    _every_op_once(b, g)
    assert [n.kind for n in g.nodes] == [Kind.INPUT, Kind.DENSE, Kind.ELEMENTWISE]


def test_layernorm_moments_join_the_norm():
    b = Builder()
    x = b.input("x")
    h = b.dense("m/d", x)
    gamma = b.weight("m/ln/gamma", (8,))
    mean = b.op("m/ln/mean", "Mean", [h, b.op("m/ln/axis", "Const", (), (1,), "int32")], (4, 1))
    var = b.op("m/ln/var", "Mean", [b.op("m/ln/sqd", "SquaredDifference", [h, mean]), "m/ln/axis"], (4, 1))
    inv = b.op("m/ln/rsqrt", "Rsqrt", [var], (4, 1))
    xc = b.op("m/ln/sub", "Sub", [h, mean])
    y = b.op("m/ln/mul", "Mul", [xc, inv])
    y = b.op("m/ln/scale", "Mul", [y, gamma])
    g = b.graph(y)
    _every_op_once(b, g)
    assert [n.kind for n in g.nodes] == [Kind.INPUT, Kind.DENSE, Kind.NORM]
    norm_types = sorted(op.type for op in g.nodes[2].ops)
    assert norm_types.count("Mean") == 2 and "Rsqrt" in norm_types and "Sub" in norm_types
    assert "Relu" in {op.type for op in g.nodes[1].ops}


def test_attention_score_takes_its_softmax_and_context_follows():
    b = Builder()
    x = b.input("x", (2, 4, 8))
    q = b.dense("a/q", x, act=None)
    k = b.dense("a/k", x, act=None)
    v = b.dense("a/v", x, act=None)
    s = b.op("a/scores", "BatchMatMulV2", [q, k], (2, 4, 4), adj_y=True)
    p = b.op("a/softmax", "Softmax", [b.op("a/scale", "Mul", [s, b.op("a/c", "Const", (), ())], (2, 4, 4))], (2, 4, 4))
    c = b.op("a/context", "BatchMatMulV2", [p, v], (2, 4, 8))
    g = b.graph(c)
    _every_op_once(b, g)
    kinds = [n.kind for n in g.nodes]
    assert kinds.count(Kind.DENSE) == 3
    score = next(n for n in g.nodes if n.kind == Kind.ATTENTION_SCORE)
    assert {op.type for op in score.ops} >= {"BatchMatMulV2", "Mul", "Softmax"}
    assert Kind.ATTENTION_CONTEXT in kinds


def test_dead_ops_are_set_aside_and_constants_follow_their_consumer():
    b = Builder()
    x = b.input("x")
    b.op("m/shape", "Shape", [x], (2,), "int32")      # nobody reads it: dead
    c = b.op("m/two", "Const", (), ())
    y = b.op("m/mul", "Mul", [x, c])
    g = b.graph(y)
    _every_op_once(b, g)
    assert g.dead_ops == ("m/shape",)
    node = next(n for n in g.nodes if any(op.name == "m/mul" for op in n.ops))
    assert {op.name for op in node.ops} == {"m/mul", "m/two"}


def test_unknown_op_becomes_opaque_and_keeps_its_weights():
    b = Builder()
    x = b.input("x")
    ph = "f/w/resource"
    b.op(ph, "Placeholder", (), (), "resource")
    b.weights[ph] = WeightInfo("f/w", (8, 8), "float32", True, ph)
    y = b.op("f/call", "StatefulPartitionedCall", [x, ph])
    z = b.op("f/relu", "Relu", [y])
    g = b.graph(z)
    _every_op_once(b, g)
    opaque = [n for n in g.nodes if n.kind == Kind.OPAQUE]
    assert len(opaque) == 1 and [w.path for w in opaque[0].weights] == ["f/w"]
    assert not any(op.name == "f/relu" for op in opaque[0].ops)


@pytest.mark.parametrize("gap", [4, 12])
def test_shared_layer_applied_twice_is_two_graphnodes_with_one_weight(gap):
    b = Builder()
    x = b.input("x")
    k = b.weight("m/shared/kernel", (8, 8))
    h = b.op("m/shared/MatMul", "MatMul", [x, k])
    for i in range(gap):
        h = b.op(f"m/relu{i}", "Relu", [h])
    k2 = b.op("m/shared/read2", "ReadVariableOp", ["m/shared/kernel/resource"], (8, 8))
    y = b.op("m/shared/MatMul_1", "MatMul", [h, k2])
    g = b.graph(y)
    _every_op_once(b, g)
    dense = [n for n in g.nodes if n.kind == Kind.DENSE]
    assert len(dense) == 2
    assert all([w.path for w in n.weights] == ["m/shared/kernel"] for n in dense)
    assert g.num_params == 64  # listed by both GraphNodes that read it, counted once
    assert len(g.weights) == 1


def test_layer_with_two_projections_gives_two_graphnodes():
    b = Builder()
    x = b.input("x")
    wi = b.weight("ffn/wi", (8, 16))
    wo = b.weight("ffn/wo", (16, 8))
    h = b.op("ffn/relu", "Relu", [b.op("ffn/mm1", "MatMul", [x, wi], (4, 16))], (4, 16))
    y = b.op("ffn/mm2", "MatMul", [h, wo])
    g = b.graph(y)
    _every_op_once(b, g)
    dense = [n for n in g.nodes if n.kind == Kind.DENSE]
    assert [[w.path for w in n.weights] for n in dense] == [["ffn/wi"], ["ffn/wo"]]
    assert "Relu" in {op.type for op in dense[0].ops}


def test_a_sublayers_projection_between_its_parents_weights_stays_its_own():
    # keras-hub RWKV-7's time mix: the layer's own mixing weights are read on both sides of
    # its receptance Dense (x * mix -> receptance -> * scale). The parent's seeds are a few
    # hops apart, so the ops between them joined the parent's seed, the Dense's MatMul too,
    # which then seeded its own layer's GraphNode as well: an AssertionError in capture.
    # Now the MatMul seeds the Dense's GraphNode, which absorbs the parent's elementwise
    # neighbours
    b = Builder()
    x = b.input("x")
    mix = b.weight("tm/mix", (8,))
    scale = b.weight("tm/scale", (8,))
    h = b.op("tm/mul", "Mul", [x, mix])
    h = b.dense("tm/receptance", h, act=None)
    y = b.op("tm/mul_1", "Mul", [h, scale])
    g = b.graph(y)
    _every_op_once(b, g)
    owner = {op.name: n.id for n in g.nodes for op in n.ops}
    node = g.nodes[owner["tm/receptance/MatMul"]]
    assert node.kind == Kind.DENSE
    assert owner["tm/receptance/BiasAdd"] == node.id
    assert {"tm/receptance/bias", "tm/receptance/kernel"} <= {w.path for w in node.weights}


def test_expert_einsum_is_recognised():
    b = Builder()
    x = b.input("x", (4, 2, 3, 8))  # experts, groups, capacity, model
    w = b.weight("moe/wi", (4, 8, 16))
    y = b.op("moe/einsum", "Einsum", [x, w], (4, 2, 3, 16), equation="egcm,emh->egch")
    g = b.graph(y)
    assert g.nodes[1].kind == Kind.EXPERT_EINSUM
    b2 = Builder()
    x = b2.input("x", (2, 3, 8))
    w = b2.weight("mha/q", (8, 2, 4))
    y = b2.op("mha/einsum", "Einsum", [x, w], (2, 3, 2, 4), equation="abc,cde->abde")
    assert b2.graph(y).nodes[1].kind == Kind.DENSE


@pytest.mark.parametrize("n_layers", [1, 5])
def test_graph_is_topologically_ordered(n_layers):
    b = Builder()
    h = b.input("x")
    for i in range(n_layers):
        h = b.dense(f"m/d{i}", h)
    g = b.graph(h)
    assert all(e.src < e.dst for e in g.edges)
    assert len(g.nodes) == n_layers + 1
