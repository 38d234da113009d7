"""Tests for tapas.mine: Apriori subgraph mining and the FoldedGraph.

Every folding is checked by :func:`check_folded`: instances of a template are isomorphic
to each other as induced subgraphs (networkx, matching signatures and edge ports) and to
the template's own description, no GraphNode is in two instances, and uncovered nodes are
exactly the rest. Synthetic graphs (chains, diamonds, residual blocks, transformer-like
stacks) have known answers; the real-model tests use small presets of the zoo.
"""

import json
import os
import subprocess
import sys

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from networkx.algorithms import isomorphism

import tapas.mining as mine_module
from tapas.ir import Graph, GraphNode, Kind, TensorInfo, WeightInfo
from tapas.mining import (DEFAULT_MIN_SIZE, FoldedGraph, detect_layers, draw_folded,
                          frequent_subgraphs, mine)


# ---- synthetic graphs ---------------------------------------------------------------------

def _t(name):
    return TensorInfo(f"{name}:0", (4, 8), "float32")


def node(name, sig, inputs=(), kind=Kind.DENSE, weights=True):
    """A GraphNode with one output ``name:0`` reading ``inputs`` (names of other nodes)."""
    w = (WeightInfo(f"{name}/kernel", (8, 8), "float32", True, f"{name}/ph"),) if weights else ()
    return GraphNode(0, name, kind, (), tuple(_t(i) for i in inputs), (_t(name),), w, sig)


def inp(name="x"):
    return node(name, "input", (), Kind.INPUT, weights=False)


def chain(labels, repeats, prefix="c"):
    """x -> labels[0] -> labels[1] -> ... repeated ``repeats`` times, then a head."""
    nodes, prev = [inp()], "x"
    for r in range(repeats):
        for j, lab in enumerate(labels):
            name = f"{prefix}{r}_{j}"
            nodes.append(node(name, lab, [prev]))
            prev = name
    nodes.append(node("head", "head", [prev]))
    return Graph.build(nodes, name="chain")


def diamonds(repeats):
    """x -> [a -> (b, c) -> d] x repeats: each block is a diamond."""
    nodes, prev = [inp()], "x"
    for r in range(repeats):
        nodes += [node(f"a{r}", "A", [prev]), node(f"b{r}", "B", [f"a{r}"]),
                  node(f"c{r}", "C", [f"a{r}"]), node(f"d{r}", "D", [f"b{r}", f"c{r}"])]
        prev = f"d{r}"
    return Graph.build(nodes, name="diamonds")


def residual(repeats, prefix="r", sig="", start=None, nodes=None):
    """[norm -> f1 -> f2 -> add(x, f2)] x repeats (a residual stack)."""
    nodes = nodes if nodes is not None else [inp()]
    prev = start or nodes[-1].name
    for r in range(repeats):
        p = f"{prefix}{r}"
        nodes += [node(f"{p}n", "norm" + sig, [prev], Kind.NORM),
                  node(f"{p}f1", "f1" + sig, [f"{p}n"]),
                  node(f"{p}f2", "f2" + sig, [f"{p}f1"]),
                  node(f"{p}add", "add" + sig, [prev, f"{p}f2"], Kind.ELEMENTWISE, weights=False)]
        prev = f"{p}add"
    return nodes


def transformer_layer(nodes, p, prev, cross=None):
    """Pre-norm attention (+ optional cross-attention on ``cross``) + FFN; returns output."""
    nodes += [node(f"{p}n1", "norm", [prev], Kind.NORM),
              node(f"{p}q", "proj", [f"{p}n1"]), node(f"{p}k", "proj", [f"{p}n1"]),
              node(f"{p}v", "proj", [f"{p}n1"]),
              node(f"{p}s", "score", [f"{p}q", f"{p}k"], Kind.ATTENTION_SCORE, weights=False),
              node(f"{p}c", "ctx", [f"{p}s", f"{p}v"], Kind.ATTENTION_CONTEXT, weights=False),
              node(f"{p}o", "proj", [f"{p}c"]),
              node(f"{p}a1", "add", [prev, f"{p}o"], Kind.ELEMENTWISE, weights=False)]
    prev = f"{p}a1"
    if cross is not None:
        nodes += [node(f"{p}xn", "norm", [prev], Kind.NORM),
                  node(f"{p}xq", "proj", [f"{p}xn"]), node(f"{p}xk", "proj", [cross]),
                  node(f"{p}xv", "proj", [cross]),
                  node(f"{p}xs", "xscore", [f"{p}xq", f"{p}xk"], Kind.ATTENTION_SCORE,
                       weights=False),
                  node(f"{p}xc", "ctx", [f"{p}xs", f"{p}xv"], Kind.ATTENTION_CONTEXT,
                       weights=False),
                  node(f"{p}xo", "proj", [f"{p}xc"]),
                  node(f"{p}xa", "add", [prev, f"{p}xo"], Kind.ELEMENTWISE, weights=False)]
        prev = f"{p}xa"
    nodes += [node(f"{p}n2", "norm", [prev], Kind.NORM), node(f"{p}wi", "wi", [f"{p}n2"]),
              node(f"{p}wo", "wo", [f"{p}wi"]),
              node(f"{p}a2", "add", [prev, f"{p}wo"], Kind.ELEMENTWISE, weights=False)]
    return f"{p}a2"


def transformer(layers, decoder_layers=0):
    """Embedding, ``layers`` encoder layers, final norm (+ a decoder stack with cross
    attention to the encoder output), head."""
    nodes = [inp(), node("emb", "emb", ["x"], Kind.EMBEDDING)]
    prev = "emb"
    for i in range(layers):
        prev = transformer_layer(nodes, f"e{i}_", prev)
    nodes.append(node("enc_norm", "final_norm", [prev], Kind.NORM))
    enc = prev = "enc_norm"
    if decoder_layers:
        nodes += [inp("y"), node("demb", "demb", ["y"], Kind.EMBEDDING)]
        prev = "demb"
        for i in range(decoder_layers):
            prev = transformer_layer(nodes, f"d{i}_", prev, cross=enc)
        nodes.append(node("dec_norm", "final_norm2", [prev], Kind.NORM))
        prev = "dec_norm"
    nodes.append(node("head", "head", [prev]))
    return Graph.build(nodes, name="transformer")


# ---- the invariant every folding satisfies -------------------------------------------------

def _edge_ports(graph):
    ports = {}
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        o = [t.name for t in src.outputs].index(e.tensor.name)
        i = [t.name for t in dst.inputs].index(e.tensor.name)
        ports.setdefault((e.src, e.dst), set()).add((o, i))
    return ports


def check_folded(folded: FoldedGraph, graph: Graph, ports_matter: bool = True):
    """Instances are isomorphic induced subgraphs (signatures, ports), mapped consistently,
    never overlap; uncovered is the complement; the JSON form round-trips."""
    g = graph.to_networkx()
    ports = _edge_ports(graph)
    for (s, d), p in ports.items():
        g.edges[s, d]["ports"] = tuple(sorted(p))
    seen = set()
    for t in folded.templates:
        assert t.num_instances >= 2, "a template must fold at least two instances"
        assert t.size >= folded.min_size
        first = None
        for inst in t.instances:
            assert len(inst) == t.size and len(set(inst)) == t.size
            assert seen.isdisjoint(inst), f"T{t.id} overlaps another instance"
            seen.update(inst)
            assert tuple(graph.nodes[v].signature for v in inst) == t.signatures
            sub = g.subgraph(inst)
            assert nx.is_weakly_connected(sub)
            # the mapping position -> node reproduces the template's edges exactly
            got = {(inst.index(a), inst.index(b), g.edges[a, b]["ports"] if ports_matter else ())
                   for a, b in sub.edges}
            assert got == {(s, d, tuple(sorted(p)) if ports_matter else ()) for s, d, p in t.edges}
            if first is None:
                first = sub
                continue
            matcher = isomorphism.DiGraphMatcher(
                first, sub, node_match=lambda a, b: a["signature"] == b["signature"],
                edge_match=lambda a, b: a["ports"] == b["ports"] or not ports_matter)
            assert matcher.is_isomorphic(), f"T{t.id}: instance {inst} is not isomorphic"
    assert seen.isdisjoint(folded.uncovered)
    assert seen | set(folded.uncovered) == set(range(len(graph.nodes)))
    assert folded.num_covered == len(seen)
    again = FoldedGraph.loads(json.dumps(folded.to_json()))
    assert again == folded
    return folded


def shapes(folded):
    return sorted((t.size, t.num_instances) for t in folded.templates)


# ---- synthetic graphs with known answers ---------------------------------------------------

def test_chain_folds_into_its_repeated_unit():
    g = chain(["A", "B", "C"], 6)
    f = check_folded(mine(g), g)
    assert shapes(f) == [(3, 6)]
    assert f.templates[0].signatures == ("A", "B", "C")
    assert [g.nodes[v].name for v in f.uncovered] == ["x", "head"]
    assert f.min_support == 6 and f.stats.layers_detected == 6


def test_chain_with_explicit_low_support_still_gives_one_unit():
    # min_support=2 makes every window of up to half the chain frequent; the tiling guard
    # keeps the template at one repetition.
    g = chain(["A", "B", "C", "D"], 8)
    f = check_folded(mine(g, min_support=2), g)
    assert shapes(f) == [(4, 8)]


def test_without_tiling_guard_low_support_prefers_multi_layer_windows():
    g = chain(["A", "B", "C"], 4)
    f = check_folded(mine(g, min_support=2, tiling_guard=False, split_layers=False,
                          max_rounds=1), g)
    assert shapes(f) == [(6, 2)]      # two layers per instance: what the guard prevents
    # layer splitting cuts each window into its two (identical) layers, which merge
    f = check_folded(mine(g, min_support=2, tiling_guard=False, max_rounds=1), g)
    assert shapes(f) == [(3, 4)]


def test_diamonds():
    g = diamonds(5)
    f = check_folded(mine(g), g)
    assert shapes(f) == [(4, 5)]
    t = f.templates[0]
    assert t.signatures == ("A", "B", "C", "D")
    assert {(s, d) for s, d, _ in t.edges} == {(0, 1), (0, 2), (1, 3), (2, 3)}


def test_residual_blocks():
    g = Graph.build(residual(7) + [node("head", "head", ["r6add"])])
    f = check_folded(mine(g), g)
    assert shapes(f) == [(4, 7)]
    kinds = f.templates[0].kind_counts()
    assert kinds == {"dense": 2, "elementwise": 1, "norm": 1}


def test_transformer_stack_one_template_per_layer():
    g = transformer(6)
    f = check_folded(mine(g), g)
    assert shapes(f) == [(12, 6)]
    assert f.coverage == pytest.approx(72 / 76)
    assert sorted(g.nodes[v].name for v in f.uncovered) == ["emb", "enc_norm", "head", "x"]


def test_encoder_decoder_folds_into_block_sized_templates():
    g = transformer(5, 5)
    f = check_folded(mine(g), g)
    assert shapes(f) == [(12, 5), (20, 5)]
    assert f.num_templates <= 8 and f.coverage > 0.9


def test_stages_with_different_repetition_counts_all_fold():
    # Like ResNet: 6 blocks of one type, then 3 of another; round 1 takes the first
    # stage (min_support 6), round 2 the second (3 layers detected among the rest).
    nodes = residual(6, "s", sig="@1")
    nodes = residual(3, "t", sig="@2", nodes=nodes)
    g = Graph.build(nodes + [node("head", "head", ["t2add"])])
    f = check_folded(mine(g), g)
    assert shapes(f) == [(4, 3), (4, 6)]
    assert [r.min_support for r in f.stats.rounds][:2] == [6, 3]
    assert [t.round for t in f.templates] == [1, 2]


def test_no_repetition_every_node_is_its_own_subgraph():
    g = chain(["A", "B", "C", "D", "E"], 1)
    f = check_folded(mine(g), g)
    assert f.templates == () and f.num_unique == len(g.nodes) == 7
    assert f.coverage == 0.0
    assert "every GraphNode is its own unique subgraph" in f.summary()
    assert detect_layers(g) == 1


def test_single_node_and_empty_graph():
    g = Graph.build([inp()])
    f = check_folded(mine(g), g)
    assert f.templates == () and f.uncovered == (0,)
    empty = Graph(nodes=(), edges=(), inputs=(), outputs=())
    f = check_folded(mine(empty), empty)
    assert f.num_nodes == 0 and f.templates == () and f.coverage == 0.0
    assert "0 GraphNodes" in f.summary()


def test_min_size_larger_than_the_graph_gives_an_empty_result():
    g = chain(["A", "B"], 3)
    f = check_folded(mine(g, min_size=100), g)
    assert f.templates == () and len(f.uncovered) == len(g.nodes)
    # larger than the repeated unit but smaller than the graph: also nothing
    f = check_folded(mine(g, min_size=3), g)
    assert f.templates == ()


@pytest.mark.parametrize("kwargs", [dict(min_support=1), dict(min_support=0),
                                    dict(min_size=0), dict(max_rounds=0)])
def test_invalid_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError, match="must be"):
        mine(chain(["A"], 3), **kwargs)


def test_min_size_one_allows_single_node_templates():
    # A B A B A C: [A B] x2 is the largest; the third A is alone.
    nodes, prev = [inp()], "x"
    for i, lab in enumerate("ABABAC"):
        nodes.append(node(f"n{i}", lab, [prev]))
        prev = f"n{i}"
    g = Graph.build(nodes)
    f = check_folded(mine(g, min_support=2, min_size=1), g)
    assert (2, 2) in shapes(f)
    assert f.num_covered == 4


def test_ports_distinguish_wiring():
    # Block i computes s = score(q, k); in half of the blocks q and k are swapped.
    def block(nodes, p, prev, swap):
        nodes += [node(f"{p}q", "q", [prev]), node(f"{p}k", "k", [prev])]
        a, b = (f"{p}k", f"{p}q") if swap else (f"{p}q", f"{p}k")
        nodes.append(node(f"{p}s", "s", [a, b], weights=False))
        return f"{p}s"

    nodes, prev = [inp()], "x"
    for i in range(8):
        prev = block(nodes, f"b{i}_", prev, swap=i % 2 == 1)
    g = Graph.build(nodes)
    strict = check_folded(mine(g, min_support=2), g)
    loose = check_folded(mine(g, min_support=2, match_ports=False), g, ports_matter=False)
    assert shapes(loose) == [(3, 8)]
    assert all(t.num_instances == 4 for t in strict.templates if t.size == 3)


def test_symmetric_patterns_are_deduplicated_by_isomorphism():
    # Two identical parallel branches per block: colour refinement cannot tell them
    # apart, so candidates are compared with an isomorphism search.
    nodes, prev = [inp()], "x"
    for i in range(5):
        p = f"b{i}_"
        nodes += [node(f"{p}a", "A", [prev]), node(f"{p}l", "L", [f"{p}a"]),
                  node(f"{p}r", "L", [f"{p}a"]),
                  node(f"{p}j", "J", [f"{p}l", f"{p}r"], weights=False)]
        prev = f"{p}j"
    g = Graph.build(nodes)
    f = check_folded(mine(g, match_ports=False), g, ports_matter=False)
    assert shapes(f) == [(4, 5)]
    levels = list(frequent_subgraphs(g, 5, match_ports=False, closure=False))
    # size 3: {a, l, r} (l/r symmetric), {a, l, j}, {l, r, j}... each counted once
    for level in levels:
        for sub in level:
            assert len({tuple(sorted(e)) for e in sub.embeddings}) == len(sub.embeddings)


@pytest.mark.parametrize("make", [lambda: chain(["A", "B", "C"], 5), lambda: diamonds(4),
                                  lambda: transformer(3), lambda: transformer(4),
                                  lambda: Graph.build(residual(5))])
def test_closure_finds_what_exhaustive_apriori_finds(make):
    g = make()
    fast = mine(g)
    slow = mine(g, closure=False)
    assert [(t.signatures, t.instances) for t in fast.templates] == \
        [(t.signatures, t.instances) for t in slow.templates]
    assert slow.stats.frequent >= fast.stats.frequent


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_repeated_blocks_fold_consistently(data):
    """Random blocks (small label alphabet, so symmetric and look-alike structure is
    common) repeated a few times: every folding satisfies the invariants."""
    size = data.draw(st.integers(2, 6), label="block size")
    labels = data.draw(st.lists(st.sampled_from("ABC"), min_size=size, max_size=size))
    inputs = [data.draw(st.lists(st.integers(-1, i - 1), min_size=1, max_size=2, unique=True))
              for i in range(size)]
    repeats = data.draw(st.integers(2, 5), label="repeats")
    nodes, prev = [inp()], "x"
    for r in range(repeats):
        for i in range(size):
            srcs = [prev if j < 0 else f"b{r}_{j}" for j in inputs[i]]
            nodes.append(node(f"b{r}_{i}", labels[i], srcs))
        prev = f"b{r}_{size - 1}"
    g = Graph.build(nodes)
    for kwargs in (dict(), dict(min_support=2, min_size=1), dict(match_ports=False)):
        f = check_folded(mine(g, **kwargs), g, ports_matter=kwargs.get("match_ports", True))
        assert f.num_covered <= len(g.nodes) - 1


def test_frequent_subgraphs_levels():
    g = diamonds(4)
    levels = list(frequent_subgraphs(g, 4, closure=False))
    sizes = [sorted(len(s.signatures) for s in level) for level in levels]
    assert sizes[0] == [1, 1, 1, 1]                  # A, B, C, D
    assert all(set(s) == {k + 1} for k, s in enumerate(sizes) if s)
    assert levels[-1] == []                           # Algorithm 1 stops at an empty level
    top = max((s for level in levels for s in level), key=lambda s: s.size)
    assert top.size == 4 and top.support == 4
    for level in levels:
        for sub in level:
            assert sub.support >= 4
            for emb in sub.embeddings:
                assert tuple(g.nodes[v].signature for v in emb) == sub.signatures


def test_detect_layers():
    assert detect_layers(transformer(7)) == 7
    assert detect_layers(transformer(4, 4)) == 4
    assert detect_layers(chain(["A", "B"], 9)) == 9
    nodes = residual(5, "s", sig="@1")
    nodes = residual(2, "t", sig="@2", nodes=nodes)
    g = Graph.build(nodes)
    assert detect_layers(g) == 5
    assert detect_layers(g, nodes=range(21, len(g.nodes))) == 2
    # a repeated signature that never repeats back to back: the smallest useful support
    nodes, prev = [inp()], "x"
    for i, lab in enumerate("ABCAD"):
        nodes.append(node(f"n{i}", lab, [prev]))
        prev = f"n{i}"
    assert detect_layers(Graph.build(nodes)) == 2


def test_progress_callback_and_stats():
    seen = []
    g = transformer(4)
    f = mine(g, progress=seen.append)
    assert seen == list(f.stats.levels)
    assert [s.level for s in seen if s.round == 1][:3] == [1, 2, 3]
    assert seen[0].frequent == len({"norm", "proj", "score", "ctx", "add", "wi", "wo"})
    assert f.stats.seconds > 0 and f.stats.candidates >= f.stats.frequent
    r1 = f.stats.rounds[0]
    assert r1.min_support == 4 and r1.min_support_source == "detected layers"


def test_summary_json_networkx_and_drawing(tmp_path):
    g = transformer(3, 3)
    f = check_folded(mine(g), g)
    text = f.summary()
    assert "2 unique subgraphs" in text and "T0" in text and "T1" in text
    assert "% " in text or "%)" in text
    d = json.loads(f.dumps())
    assert d["format"] == "tapas.mine.FoldedGraph/1" and d["num_templates"] == 2
    h = f.to_networkx()
    assert h.number_of_nodes() == sum(t.num_instances for t in f.templates) + len(f.uncovered)
    assert nx.is_weakly_connected(h)
    assert all(h.nodes[u]["template"] is not None for u in h if u.startswith("T"))
    path = draw_folded(f, g, str(tmp_path / "folded.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="pass the graph given to mine"):
        draw_folded(f, transformer(1), str(tmp_path / "bad.png"))


def test_node_assignment():
    g = chain(["A", "B"], 3)
    f = mine(g, min_size=2)
    where = f.node_assignment()
    assert where[0] is None and where[-1] is None
    assert {where[v][0] for v in range(1, 7)} == {0}
    assert [where[v][2] for v in range(1, 7)] == [0, 1, 0, 1, 0, 1]


def test_tapas_mine_is_the_function_and_imports_no_tensorflow():
    import tapas
    g = chain(["A", "B", "C"], 3)
    f = tapas.mine(g)
    assert isinstance(f, FoldedGraph) and shapes(f) == shapes(mine_module.mine(g))
    code = "import sys, tapas.mining; assert 'tensorflow' not in sys.modules, 'TF imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_default_min_size_is_documented_value():
    assert DEFAULT_MIN_SIZE == 3
    assert mine(chain(["A", "B", "C"], 3)).min_size == DEFAULT_MIN_SIZE


# ---- mining on a window of a deep stack (tapas.mining.window) ------------------------------

def _same_as_plain_apriori(graph, **kwargs):
    """Mine with and without the window: the same FoldedGraph (statistics aside)."""
    plain = mine(graph, window=False, **kwargs)
    fast = check_folded(mine(graph, **kwargs), graph, kwargs.get("match_ports", True))
    a, b = plain.to_json(), fast.to_json()
    a.pop("stats")
    b.pop("stats")
    assert a == b
    return fast


def masked_stack(layers):
    """A pre-norm stack whose every layer reads one attention bias computed from a mask
    input (a GraphNode shared by all layers), with an interloper -- a GraphNode of the
    head, scheduled in the middle of the stack -- as capture may order them."""
    nodes = [inp(), inp("m"), node("emb", "emb", ["x"], Kind.EMBEDDING),
             node("bias", "bias", ["m"], Kind.ELEMENTWISE, weights=False)]
    prev = "emb"
    for i in range(layers):
        p = f"l{i}_"
        nodes += [node(f"{p}n", "norm", [prev], Kind.NORM), node(f"{p}q", "proj", [f"{p}n"]),
                  node(f"{p}k", "proj", [f"{p}n"]),
                  node(f"{p}s", "score", [f"{p}q", f"{p}k", "bias"], Kind.ATTENTION_SCORE,
                       weights=False),
                  node(f"{p}o", "out", [f"{p}s"]),
                  node(f"{p}a", "add", [prev, f"{p}o"], Kind.ELEMENTWISE, weights=False)]
        prev = f"{p}a"
        if i == layers // 2:
            nodes.append(node("mask_head", "mask_head", ["m"], Kind.ELEMENTWISE, weights=False))
    nodes.append(node("head", "head", [prev, "mask_head"]))
    return Graph.build(nodes, name="masked")


def alternating(pairs):
    """GShard-like: layers alternate between an FFN and an expert block, both opening with
    the same attention, so the pair is cut into two templates interleaved along the
    stack (T0 T1 T0 T1 ...)."""
    nodes, prev = [inp(), node("emb", "emb", ["x"], Kind.EMBEDDING)], "emb"
    for i in range(2 * pairs):
        p = f"l{i}_"
        nodes += [node(f"{p}n", "norm", [prev], Kind.NORM), node(f"{p}q", "proj", [f"{p}n"]),
                  node(f"{p}o", "out", [f"{p}q"]),
                  node(f"{p}a", "add", [prev, f"{p}o"], Kind.ELEMENTWISE, weights=False),
                  node(f"{p}n2", "norm", [f"{p}a"], Kind.NORM)]
        body = ["wi", "wo"] if i % 2 == 0 else ["gate", "expert", "combine"]
        last = f"{p}n2"
        for j, sig in enumerate(body):
            nodes.append(node(f"{p}b{j}", sig, [last]))
            last = f"{p}b{j}"
        nodes.append(node(f"{p}a2", "add", [f"{p}a", last], Kind.ELEMENTWISE, weights=False))
        prev = f"{p}a2"
    nodes.append(node("head", "head", [prev]))
    return Graph.build(nodes, name="alternating")


def rotary_stack(layers):
    """A stack whose layer i reads output i of one shared GraphNode (Llama's rotary tables
    come out of one GraphNode, one output per layer)."""
    outs = tuple(TensorInfo(f"rot:{i}", (4, 8), "float32") for i in range(layers))
    rot = GraphNode(0, "rot", Kind.MATMUL, (), (_t("x"),), outs, (), "rot")
    nodes, prev = [inp(), rot], "x"
    for i in range(layers):
        p = f"l{i}_"
        q = node(f"{p}q", "proj", [prev])
        q = GraphNode(0, q.name, q.kind, (), q.inputs + (outs[i],), q.outputs, q.weights,
                      q.signature)
        nodes += [node(f"{p}n", "norm", [prev], Kind.NORM), q,
                  node(f"{p}o", "out", [f"{p}q", f"{p}n"]),
                  node(f"{p}a", "add", [prev, f"{p}o"], Kind.ELEMENTWISE, weights=False)]
        prev = f"{p}a"
    return Graph.build(nodes + [node("head", "head", [prev])], name="rotary")


def test_window_deep_stack_same_folding_as_plain_apriori():
    g = transformer(16)
    f = _same_as_plain_apriori(g)
    assert shapes(f) == [(12, 16)]
    assert f.stats.rounds[0].copies_skipped == 16 - 6     # 3 + 3 layers mined
    assert f.stats.levels[0].embeddings < 12 * 8           # level 1 saw 6 layers, not 16


def test_window_encoder_decoder_cuts_both_stacks():
    g = transformer(12, 12)
    f = _same_as_plain_apriori(g)
    assert shapes(f) == [(12, 12), (20, 12)]
    assert f.stats.rounds[0].copies_skipped == 12 - 6


def test_window_shared_input_and_interloper():
    g = masked_stack(14)
    f = _same_as_plain_apriori(g)
    assert f.stats.rounds[0].copies_skipped > 0 and f.coverage > 0.9


def test_window_interleaved_templates():
    g = alternating(12)
    f = _same_as_plain_apriori(g)
    assert shapes(f) == [(8, 12), (9, 12)]
    assert f.stats.rounds[0].copies_skipped == 12 - 6     # pairs of layers
    starts = sorted((min(i), t.id) for t in f.templates for i in t.instances)
    assert [tid for _, tid in starts[:4]] in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_window_shared_node_with_one_output_per_layer():
    g = rotary_stack(14)
    f = _same_as_plain_apriori(g)
    assert f.stats.rounds[0].copies_skipped == 14 - 6 and shapes(f) == [(4, 14)]


def test_window_not_used_on_short_or_aperiodic_stacks():
    f = mine(transformer(8))                # 8 - 6 layers to skip: too few to bother
    assert f.stats.rounds[0].copies_skipped == 0
    # a skip connection over two layers breaks the translation symmetry of the wiring
    nodes = residual(14)
    nodes.append(node("far", "far", ["r2add", "r9add"]))
    g = Graph.build(nodes + [node("head", "head", ["r13add", "far"])])
    f = _same_as_plain_apriori(g)
    assert all(r.copies_skipped == 0 for r in f.stats.rounds)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_window_random_deep_stacks_same_folding(data):
    """Random blocks (with a GraphNode every layer may read) repeated 10 to 14 times."""
    size = data.draw(st.integers(2, 5), label="block size")
    labels = data.draw(st.lists(st.sampled_from("ABC"), min_size=size, max_size=size))
    inputs = [data.draw(st.lists(st.integers(-2, i - 1), min_size=1, max_size=2, unique=True))
              for i in range(size)]
    repeats = data.draw(st.integers(10, 14), label="repeats")
    nodes, prev = [inp(), inp("m"), node("hub", "H", ["m"])], "x"
    for r in range(repeats):
        for i in range(size):
            srcs = [prev if j == -1 else "hub" if j == -2 else f"b{r}_{j}" for j in inputs[i]]
            nodes.append(node(f"b{r}_{i}", labels[i], srcs))
        prev = f"b{r}_{size - 1}"
    g = Graph.build(nodes + [node("head", "Z", [prev])])
    for kwargs in (dict(), dict(min_size=1), dict(match_ports=False)):
        _same_as_plain_apriori(g, **kwargs)


# ---- real models (small presets of the zoo, and keras.applications) ------------------------

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def capture():
    tapas = pytest.importorskip("tapas")
    try:
        return tapas.capture
    except (AttributeError, ImportError) as e:   # capture not available yet
        pytest.skip(f"tapas.capture unavailable: {e}")


@pytest.fixture(scope="module")
def zoo():
    try:
        from tapas.models import moe, resnet, t5
    except ImportError as e:
        pytest.skip(f"model zoo unavailable: {e}")
    return t5, moe, resnet


def _capture(capture, module, config, batch=2):
    model = module.build_model(config, fast_init=True)
    return capture(model, module.input_spec(config, batch))


def test_t5_folds_into_a_few_block_templates(capture, zoo):
    t5 = zoo[0]
    cfg = t5.T5Config(num_layers=12, num_decoder_layers=12, d_model=32, d_ff=64, num_heads=2,
                      d_kv=16, vocab_size=128, encoder_seq_len=8, decoder_seq_len=8)
    g = _capture(capture, t5, cfg)
    f = check_folded(mine(g), g)
    assert f.num_templates <= 8 and f.coverage >= 0.95, f.summary()
    big = [t for t in f.templates if t.num_instances >= 11]
    assert len(big) == 2, f.summary()
    enc, dec = sorted(big, key=lambda t: t.size)
    assert "encoder" in enc.name and "decoder" in dec.name
    # the decoder block has two attentions (self, cross), the encoder block one
    assert dec.kinds.count("attention-context") == 2 and enc.kinds.count("attention-context") == 1


def test_t5_tiny_preset(capture, zoo):
    from tapas import models
    entry = models.get("t5-tiny")
    g = capture(entry.build(fast_init=True), entry.input_spec())
    f = check_folded(mine(g), g)
    assert f.num_templates >= 2 and f.coverage > 0.8


def test_resnet_folds_into_bottleneck_block_types(capture, zoo):
    resnet = zoo[2]
    cfg = resnet.ResNetConfig(depth=50, block_counts=(3, 4, 6, 3), width=8, image_size=32,
                              num_classes=10)
    g = _capture(capture, resnet, cfg)
    f = check_folded(mine(g), g)
    blocks = [t for t in f.templates if t.kind_counts() == {"conv": 3, "elementwise": 1}]
    # the identity blocks of stages 3 (5 of them) and 2 (3) and 4 (2) are templates
    assert sorted(t.num_instances for t in blocks)[-3:] in ([2, 3, 5], [3, 3, 5]), f.summary()
    assert f.templates[0].num_instances == 5 and f.min_support == 5


def test_keras_resnet50(capture):
    keras = pytest.importorskip("keras")
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    g = capture(model, tf.TensorSpec([2, 32, 32, 3], tf.float32))
    f = check_folded(mine(g), g)
    assert f.templates[0].num_instances == 5            # conv4 identity blocks
    assert f.templates[0].kind_counts() == {"conv": 3, "elementwise": 1}
    assert all(t.kind_counts().get("conv", 0) >= 2 for t in f.templates)


def test_moe_folds_into_its_dense_and_moe_layers(capture, zoo):
    moe = zoo[1]
    cfg = moe.MoEConfig(num_layers=6, d_model=32, d_ff=64, num_heads=2, num_experts=4,
                        vocab_size=128, seq_len=8)
    g = _capture(capture, moe, cfg)
    f = check_folded(mine(g), g)
    assert f.coverage > 0.85, f.summary()
    experts = [v for v, n in enumerate(g.nodes) if n.kind == Kind.EXPERT_EINSUM]
    ffn = [v for v, n in enumerate(g.nodes) if n.kind == Kind.DENSE and "/ffn" in n.name]
    assert experts and ffn
    where = f.node_assignment()
    assert all(where[v] is not None for v in experts + ffn), f.summary()
    # one template per layer type: MoE layers (expert einsums) and dense layers (FFN)
    moe_t = {where[v][0] for v in experts}
    dense_t = {where[v][0] for v in ffn}
    assert len(moe_t) == 1 and len(dense_t) == 1 and moe_t != dense_t, f.summary()
    for tid in moe_t | dense_t:
        assert f.templates[tid].kinds.count("attention-score") == 1   # one layer each
        assert f.templates[tid].num_instances == 3
