"""tapas.export's report of the activations an exported LayoutMap leaves open
(``Unexpressed.kind == "activations"``, tapas.export.open_nodes).

bert-base's widths at 2 layers (the JAX check's bert-base-2l) searched on one V100 node of
8 splits each encoder layer's attention output projection on its output axis (``column``)
and gathers it before the residual sum, which reads the replicated layer input beside it;
the MLM head's transform is split the same way before its norm. No weight key or layer
output fixes how the residual sum and the MLM norm run: the export must list them, with the
alternatives GSPMD's propagation has and their cost, and the compiled check's observation
(benchmarks/results/layoutmap_check.json: fewer 1.5 MiB all-gathers, 2 KiB all-reduces of
normalisation statistics) must be what those alternatives do. A block whose every
GraphNode is fixed by its weights and layer outputs gets no entry.
"""

from __future__ import annotations

import dataclasses
import json
import os

import keras
import pytest
import tensorflow as tf

from tapas import capturing
from tapas.export import export_layout
from tapas.export.layouts import LayoutExport
from tapas.ir import Kind
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.search import search
from tapas.sharding.losses import LossSpec
from tapas.sharding.patterns import patterns_for

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                       "layoutmap_check.json")


@pytest.fixture(scope="module")
def bert():
    import models
    entry = models.get("bert-base")
    entry = dataclasses.replace(entry, config=dataclasses.replace(
        entry.config, num_layers=2, seq_len=64, vocab_size=8192))
    model = entry.build(fast_init=True)
    graph = capturing.capture(model, list(entry.input_spec(8)), training=True,
                              name="bert-base-2l")
    cluster = Cluster.resolve("v100", 1, 8)
    strategy = search(graph, cluster=cluster, loss=entry.keras_loss()).bind(graph)
    options = CostOptions.for_cluster(cluster, loss=LossSpec.of(entry.keras_loss()))
    layout = export_layout(strategy, graph, options=options, layers=model)
    return model, graph, strategy, layout


def _open(layout):
    return {v: u for u in layout.unexpressed if u.kind == "activations" for v, _ in u.nodes}


def _split_feeds(graph, strategy):
    """(residual sums, norms) that read a split dense output: the GraphNodes the test
    expects open, found from the graph and the strategy, not by name."""
    producer = {t.name: n.id for n in graph.nodes for t in n.outputs}
    sums, norms = [], []
    for node in graph.nodes:
        feeds = [producer.get(t.name) for t in node.inputs]
        split = [u for u in feeds if u is not None and graph.nodes[u].kind == Kind.DENSE
                 and strategy.patterns[u] == "column"]
        if split and node.kind == Kind.ELEMENTWISE and len(feeds) == 2:
            sums.append(node.id)
        elif split and node.kind == Kind.NORM:
            norms.append(node.id)
    return sums, norms


def test_residual_sums_and_norm_are_listed_with_their_alternatives(bert):
    _, graph, strategy, layout = bert
    sums, norms = _split_feeds(graph, strategy)
    assert len(sums) == 2 and len(norms) == 1, "the searched plan changed: the test " \
        "expects each layer's attention output and the MLM transform split (column)"
    found = _open(layout)
    for v in sums + norms:
        u = found[v]
        assert u.chosen == "replicate" and u.emitted == "follow-S2"
        names = [a for a, _ in u.alternatives]
        costs = [c for _, c in u.alternatives]
        assert names[0] == "follow-S2" and costs == sorted(costs)
        assert "replicate" not in names and costs[0] > 0
        assert f"{costs[0] * 1e3:+.4f} ms" in u.why
    # the split dense layers are fixed by their weight keys, the attention core by the
    # replicated q/k/v outputs next to it: not listed
    dense = [n.id for n in graph.nodes if n.kind == Kind.DENSE and n.id not in
             {v for u in layout.unexpressed if u.kind == "weights" for v, _ in u.nodes}]
    assert dense and not set(dense) & set(found)
    assert set(found) == set(sums + norms)
    # the weight comparison's GraphNode (the tied MLM decoder) is listed once, as before
    weights = [u for u in layout.unexpressed if u.kind == "weights"]
    assert len(weights) == 1 and not {v for v, _ in weights[0].nodes} & set(found)


def test_open_activations_survive_json_python_and_cli_summary(bert, tmp_path, capsys):
    from tapas.cli.export_cmd import _say
    _, _, _, layout = bert
    back = LayoutExport.from_json(json.loads(layout.dumps()))
    assert back.unexpressed == layout.unexpressed
    assert "activations left open: propagation may take follow-S2" in layout.to_python()
    _say(layout)
    out = capsys.readouterr().out
    assert "activations open: GraphNode(s)" in out and "may take 'follow-S2' (+" in out


def test_compiled_check_differences_are_the_listed_alternatives(bert):
    """The compiled program (JAX, 8 CPU devices, layoutmap_check.json) has fewer 1.5 MiB
    all-gathers than predicted and 2 KiB all-reduces the prediction lacks: the former are
    the gathers the strategy places on edges into the listed GraphNodes, which their
    cheapest alternative reads split; the latter the norm statistics the listed norm's
    alternative all-reduces."""
    _, graph, strategy, layout = bert
    with open(RESULTS) as f:
        row = next(m for m in json.load(f)["models"] if m["model"] == "bert-base-2l")
    diff = {(d["kind"], d["bytes"]): d["compiled"] - d["predicted"]
            for d in row["collectives"]["differences"]}
    found = _open(layout)
    gathers = [e for e in strategy.edge_comms if e.dst in found
               for c in e.comms if c.kind.value == "AG" and c.phase == "fwd"]
    activation = 8 * 64 * 768 * 4
    assert {graph.nodes[e.dst].inputs[e.input_index].num_elements * 4
            for e in gathers} == {activation}
    assert 0 < len(gathers) <= -diff[("AG", activation)]
    for e in gathers:
        u = found[e.dst]
        node = graph.nodes[e.dst]
        alt = next(p for p in patterns_for(node, graph, 8) if p.name == u.emitted)
        assert str(alt.inputs[e.input_index]) == str(e.src_placement)   # read as it comes
    statistics = 8 * 64 * 4
    assert diff[("AR", statistics)] > 0
    norms = [v for v in found if graph.nodes[v].kind == Kind.NORM]
    for v in norms:
        alt = next(p for p in patterns_for(graph.nodes[v], graph, 8)
                   if p.name == found[v].emitted)
        assert any(c.kind.value == "AR" and c.bytes == statistics for c in alt.comms)


def test_a_block_fixed_by_its_weights_and_outputs_leaves_nothing_open():
    """A Megatron feed-forward block, its norm and a head: the split kernels fix the
    block, the replicated ones with the replicated activations between them the rest."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 512), name="x")
    h = keras.layers.Dense(2048, activation="relu", name="up")(inp)
    h = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(512, name="down")(h))
    model = keras.Model(inp, keras.layers.Dense(512, name="head")(h), name="ffn")
    graph = capturing.capture(model, [tf.TensorSpec((8, 32, 512), tf.float32, name="x")],
                              training=True, name="ffn")
    cluster = Cluster.resolve("v100", 1, 8)
    loss = keras.losses.MeanSquaredError()
    strategy = search(graph, cluster=cluster, loss=loss)
    options = CostOptions.for_cluster(cluster, loss=LossSpec.of(loss))
    assert "column" in strategy.patterns and "row" in strategy.patterns
    for layers in (model, None):
        layout = export_layout(strategy, graph, options=options, layers=layers)
        assert layout.unexpressed == ()


def test_a_layer_output_inside_a_graphnode_pins_its_pattern():
    """The bert-base preset (sequence 512, batch 8): the searched plan splits the MLM
    decoder's logits over the batch (``batch``), and its layer output, produced inside the
    decoder's GraphNode (the graph's output is an Identity after it), carries that split as
    its `/output` key: the decoder is pinned by it, not listed; without the layer outputs
    nothing reaches its batch split and it is listed, replicated the cheapest way left."""
    import models
    entry = models.get("bert-base")
    model = entry.build(fast_init=True)
    graph = capturing.capture(model, list(entry.input_spec(8)), training=True,
                              name="bert-base")
    cluster = Cluster.resolve("v100", 1, 8)
    strategy = search(graph, cluster=cluster, loss=entry.keras_loss())
    options = CostOptions.for_cluster(cluster, loss=LossSpec.of(entry.keras_loss()))
    decoder = next(n for n in graph.nodes if n.name.endswith("mlm_decoder_1"))
    assert strategy.patterns[decoder.id] == "batch", "the searched plan changed: the " \
        "test expects the MLM decoder split over the batch"
    from tapas.export import layer_paths, pinned_outputs
    inside = {t.name for op in decoder.ops for t in op.outputs} - \
        {t.name for t in decoder.outputs}
    assert set(pinned_outputs(strategy, graph, layer_paths(model))) & inside
    layout = export_layout(strategy, graph, options=options, layers=model)
    assert layout.outputs["mlm_decoder/output"] == ("model", None, None)
    assert decoder.id not in _open(layout)
    bare = export_layout(strategy, graph, options=options)
    assert _open(bare)[decoder.id].emitted == "replicate"
