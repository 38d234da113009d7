"""Tests for tapas.ir: the pure GraphNode IR (no TensorFlow)."""

import doctest
import json
import sys

import networkx as nx
import pytest

from tapas import ir
from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo


def _t(name, shape=(4, 8), dtype="float32"):
    return TensorInfo(name, tuple(shape), dtype)


def _dense(name, inp, units=8, width=8):
    w = WeightInfo(f"{name}/kernel", (width, units), "float32", True, f"{name}/ph")
    out = _t(f"{name}/MatMul:0", (4, units))
    ops = (OpInfo(f"{name}/read", "ReadVariableOp", (f"{name}/ph:0",), (_t(f"{name}/read:0", (width, units)),)),
           OpInfo(f"{name}/MatMul", "MatMul", (inp.name, f"{name}/read:0"), (out,)))
    node = GraphNode(id=0, name=name, kind=Kind.DENSE, ops=ops, inputs=(inp,), outputs=(out,),
                     weights=(w,), signature=ir.compute_signature(ops, (inp,), (out,), (w,)))
    return node, out


def _chain(n=3):
    x = _t("x:0")
    nodes = [GraphNode(0, "x", Kind.INPUT, (OpInfo("x", "Placeholder", (), (x,)),), (), (x,), ())]
    cur = x
    for i in range(n):
        node, cur = _dense(f"d{i}", cur)
        nodes.append(node)
    return Graph.build(nodes, inputs=(x,), outputs=(cur,), name="chain")


def test_module_doctest():
    failures, _ = doctest.testmod(ir)
    assert failures == 0


def test_build_derives_edges_in_order():
    g = _chain(3)
    assert [n.id for n in g.nodes] == [0, 1, 2, 3]
    assert [(e.src, e.dst) for e in g.edges] == [(0, 1), (1, 2), (2, 3)]
    assert g.edges[1].tensor.shape == (4, 8)
    assert g.num_params == 3 * 64
    assert g.predecessors(2) == [1] and g.successors(2) == [3]
    assert g.kind_counts() == {"dense": 3, "input": 1}


def test_identical_layers_have_identical_signatures_names_do_not_matter():
    g = _chain(3)
    assert g.nodes[1].signature == g.nodes[2].signature == g.nodes[3].signature
    wider, _ = _dense("other", _t("y:0"), units=16)
    assert wider.signature != g.nodes[1].signature


def test_signature_covers_which_tensors_the_node_exposes():
    # keras-hub RWKV-7: layer 0 and layer 1 group the same ops into one GraphNode, but only
    # layer 1's reads an intermediate outside; sharing patterns between them gave one a
    # pattern with too few output placements (IndexError in the search)
    x = _t("x:0")
    node, out = _dense("d", x)
    read = node.ops[0].outputs[0]
    both = ir.compute_signature(node.ops, (x,), (out, read), node.weights)
    assert both != node.signature
    assert both == ir.compute_signature(node.ops, (x,), (out, read), node.weights)
    assert ir.compute_signature(node.ops, (x,), (read, out), node.weights) != both


def test_json_roundtrip_is_lossless():
    g = _chain(2)
    again = Graph.loads(g.dumps())
    assert again == g
    assert json.loads(g.dumps(indent=1))["format"] == "tapas.ir.Graph/1"


def test_from_json_rejects_other_documents():
    with pytest.raises(ValueError, match="not a TAPAS IR graph"):
        Graph.from_json({"format": "something"})


def test_build_rejects_unknown_tensor_and_bad_order():
    g = _chain(2)
    with pytest.raises(ValueError, match="no GraphNode produces"):
        Graph.build(g.nodes[1:])
    with pytest.raises(ValueError, match="topological order"):
        Graph.build([g.nodes[0], g.nodes[2], g.nodes[1]])


def test_graph_validates_ids():
    g = _chain(1)
    with pytest.raises(ValueError, match="ordered by id"):
        Graph(nodes=(g.nodes[1],), edges=(), inputs=(), outputs=())


def test_to_networkx_keeps_attributes():
    g = _chain(2)
    d = g.to_networkx()
    assert isinstance(d, nx.DiGraph)
    assert d.number_of_nodes() == 3 and d.number_of_edges() == 2
    assert d.nodes[1]["signature"] == g.nodes[1].signature
    assert d.nodes[1]["kind"] == "dense"
    assert d.edges[0, 1]["tensors"][0].shape == (4, 8)
    assert nx.is_directed_acyclic_graph(d)


def test_ir_imports_no_tensorflow():
    import subprocess
    code = "import sys, tapas, tapas.ir, tapas.capturing.grouping; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
