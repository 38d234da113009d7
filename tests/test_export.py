"""tapas.export and `tapas export`: a strategy as a Keras 3 distribution LayoutMap.

A two-layer feed-forward block (Dense 512 -> 2048 -> 512, a LayerNorm and a head) searched on
one V100 node of 8 splits the block Megatron-style (the first kernel and its bias on their
output axis, the second kernel on its input axis) and replicates the rest: the export must
key exactly those weights, by their Keras paths, with those axes on the model axis, and
nothing else. The JAX side (the LayoutMap trained and compiled under ModelParallel) needs
the optional JAX venv: scripts/layoutmap_check.py, docs/export.md.
"""

from __future__ import annotations

import json
import os
import runpy

import keras
import pytest
import tensorflow as tf

from tapas import capturing
from tapas.export import (cost_layout, export_layout, key_matches, layout_map, load_layout,
                          placements_from_layouts)
from tapas.export.layouts import LayoutExport
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.search import search
from tapas.sharding.losses import LossSpec
from tests.command import run_tapas, run_tapas_each

DEVICES = [f"cpu:{i}" for i in range(8)]
SPLIT = {"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", None)}


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 512), name="x")
    h = keras.layers.Dense(2048, activation="relu", name="up")(inp)
    h = keras.layers.Dense(512, name="down")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(inp, keras.layers.Dense(512, name="head")(h), name="ffn")


@pytest.fixture(scope="module")
def planned():
    model = _model()
    graph = capturing.capture(model, [tf.TensorSpec((8, 32, 512), tf.float32, name="x")],
                              training=True, name="ffn")
    cluster = Cluster.resolve("v100", 1, 8)
    loss = keras.losses.MeanSquaredError()
    strategy = search(graph, cluster=cluster, loss=loss)
    options = CostOptions.for_cluster(cluster, loss=LossSpec.of(loss))
    return model, graph, strategy, options, export_layout(strategy, graph, options=options)


def test_layouts_key_exactly_the_split_weights(planned):
    model, _, _, _, layout = planned
    assert layout.mesh_shape == (1, 8) and tuple(layout.axis_names) == ("batch", "model")
    assert {k: tuple(v) for k, v in layout.layouts.items()} == SPLIT
    matches = key_matches(layout.layouts, [w.path for w in model.weights])
    for path, keys in matches.items():
        assert keys == ([path] if path in SPLIT else []), path


def test_replicated_weights_get_no_entry(planned):
    model, _, _, _, layout = planned
    assert sorted(layout.replicated) == sorted(w.path for w in model.weights
                                               if w.path not in SPLIT)
    lm = layout.to_keras(DEVICES)
    assert lm["down/bias"] is None and lm["head/kernel"] is None
    assert tuple(lm["down/kernel"].axes) == ("model", None)
    assert tuple(layout_map(planned[2], planned[1], devices=DEVICES)["up/kernel"].axes) == \
        (None, "model")


def test_costs_and_predicted_collectives(planned):
    _, _, strategy, _, layout = planned
    # the layouts pin the whole plan: same cost, nothing left to GSPMD's choice
    assert layout.unexpressed == ()
    assert layout.cost["difference"] == 0.0
    assert layout.cost["strategy"] == pytest.approx(strategy.total_cost)
    # the row-split kernel's partial sums: one forward all-reduce of (8, 32, 512) float32
    assert [(p["kind"], p["phase"], p["bytes"], p["count"]) for p in layout.predicted] == \
        [("AR", "fwd", 8 * 32 * 512 * 4, 1)]


def test_json_and_python_round_trip(planned, tmp_path):
    layout = planned[4]
    layout.save(str(tmp_path / "l.json"))
    layout.save(str(tmp_path / "l.py"))
    assert load_layout(str(tmp_path / "l.json")) == layout
    from_py = load_layout(str(tmp_path / "l.py"))
    assert dict(from_py.layouts) == dict(layout.layouts)
    assert from_py.mesh_shape == layout.mesh_shape
    # the module builds the LayoutMap with Keras alone
    module = runpy.run_path(str(tmp_path / "l.py"))
    lm = module["layout_map"](DEVICES)
    assert tuple(lm["up/bias"].axes) == ("model",) and lm["norm/gamma"] is None
    assert module["device_mesh"](DEVICES).shape == (1, 8)


def test_layout_read_back_rejects_what_keras_or_tapas_cannot_apply(planned):
    model = planned[0]
    ranks = {w.path: len(w.shape) for w in model.weights}

    def read(layouts):
        return placements_from_layouts(LayoutExport("m", "", "", (1, 8), layouts, {}), ranks)
    with pytest.raises(ValueError, match="has 2 axes, the weight 1"):
        read({r"up/.*": (None, "model")})     # the regex catches the bias too
    with pytest.raises(ValueError, match="matches keys"):
        read({r"up/k.*": (None, "model"), r"up/ke.*": (None, "model")})
    # Keras takes an exact key before any regex: the regex shadowed by it applies to nothing
    with pytest.raises(ValueError, match=r"\['up/k\.\*'\] match no weight"):
        read({"up/kernel": (None, "model"), r"up/k.*": ("model", None)})
    with pytest.raises(ValueError, match="match no weight"):
        read({"dense_9/kernel": (None, "model")})
    with pytest.raises(ValueError, match="model axis 'model' only"):
        read({"up/kernel": ("batch", None)})
    with pytest.raises(ValueError, match="has 1 axes, the weight 2"):
        read({"up/kernel": ("model",)})
    with pytest.raises(ValueError, match="not a mesh axis"):
        read({"up/kernel": ("x", None)})


def test_regex_key_reads_back_as_keras_applies_it(planned):
    model = planned[0]
    ranks = {w.path: len(w.shape) for w in model.weights}
    got = placements_from_layouts(
        LayoutExport("m", "", "", (1, 8), {r"(up|down)/kernel": (None, "model")}, {}), ranks)
    assert got["up/kernel"] == got["down/kernel"] == "S1"
    assert {p for p, v in got.items() if v != "R"} == {"up/kernel", "down/kernel"}


def test_edited_layout_costs_its_plan_and_names_the_difference(planned):
    _, graph, strategy, options, layout = planned
    edited = dict(layout.layouts)
    edited["down/kernel"] = (None, "model")     # by hand: the second kernel column-split
    cost = cost_layout(strategy, graph, LayoutExport("ffn", "", "", (1, 8), edited, {}),
                       options)
    assert dict(cost.changed) == {"down/kernel": ("S0", "S1")}
    down = [n.id for n in graph.nodes if any(w.path == "down/kernel" for w in n.weights)]
    assert set(down) <= set(cost.node_changes)
    # the searched plan is the cheapest: the edit costs more, by what the cost model says
    assert cost.difference > 0
    assert cost.strategy_total == pytest.approx(strategy.total_cost)
    assert "down/kernel: S0 in the strategy, S1 in the layout" in cost.explain(graph)
    with pytest.raises(ValueError, match="over 4 devices, the strategy over 8"):
        cost_layout(strategy, graph, LayoutExport("ffn", "", "", (2, 4), edited, {}), options)


def test_mesh_rows_add_the_data_parallel_all_reduces(planned):
    _, graph, strategy, options, _ = planned
    layout = export_layout(strategy, graph, "2x8", options)
    assert layout.mesh_shape == (2, 8)
    grads = [p for p in layout.predicted if p["group"] == 2]
    # every trainable weight's local gradient over the 2 rows: split ones by their 8 shards
    assert {p["tensor"]: p["bytes"] for p in grads}["up/kernel"] == 512 * 2048 * 4 // 8
    assert {p["tensor"]: p["bytes"] for p in grads}["head/kernel"] == 512 * 512 * 4
    with pytest.raises(ValueError, match="columns must be the strategy's 8 devices"):
        export_layout(strategy, graph, "2x4")
    # a mesh made on a cluster prices its rows' all-reduces on that cluster's data axis
    two_nodes = Cluster.v100_ethernet(2, 8)
    bound = export_layout(strategy, graph, two_nodes.mesh(2, 8), options)
    assert bound.predicted == export_layout(strategy, graph, "2x8", options,
                                            cluster=two_nodes).predicted
    one_node = Cluster.v100_ethernet(1, 16)
    inside = export_layout(strategy, graph, one_node.mesh(2, 8), options)
    seconds = {p["tensor"]: p["seconds"] for p in inside.predicted if p["group"] == 2}
    assert seconds["up/kernel"] < {p["tensor"]: p["seconds"] for p in bound.predicted
                                   if p["group"] == 2}["up/kernel"]   # NVLink, not Ethernet


def test_tied_embedding_is_listed_with_why_and_cost():
    """t5-small's widths at 2 layers (the JAX check's t5-small-2l): the LM head reads the
    shared embedding vocabulary-split while the lookup stores it replicated; a LayoutMap
    gives a weight one layout, so the export lists the head with that reason and prices it."""
    import dataclasses

    import models
    entry = models.get("t5-small")
    entry = dataclasses.replace(entry, config=dataclasses.replace(
        entry.config, num_layers=2, num_decoder_layers=2, encoder_seq_len=64,
        decoder_seq_len=64, vocab_size=8192))
    model = entry.build(fast_init=True)
    graph = capturing.capture(model, list(entry.input_spec(8)), training=True, name="t5")
    cluster = Cluster.resolve("v100", 1, 8)
    strategy = search(graph, cluster=cluster, loss=entry.keras_loss())
    head = next(n for n in graph.nodes if "lm_head" in n.name)
    assert strategy.patterns[head.id] == "column", "the searched plan changed: pick a model " \
        "whose LM head the search splits"
    layout = export_layout(strategy, graph, options=CostOptions.for_cluster(
        cluster, loss=LossSpec.of(entry.keras_loss())))
    [gap] = layout.unexpressed
    assert gap.nodes == ((head.id, head.name),) and gap.chosen == "column"
    assert "reads shared_embedding/embeddings (S0, stored R)" in gap.why
    assert layout.cost["difference"] > 0
    assert layout.cost["strategy"] == pytest.approx(strategy.total_cost)
    # every Keras weight path matches one key if split, none if replicated
    matches = key_matches(layout.layouts, [w.path for w in model.weights])
    assert {p for p, ks in matches.items() if ks} == set(layout.weights)
    assert all(len(ks) <= 1 for ks in matches.values())


# ---- the command line ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "ffn.keras"
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    model.save(str(path))
    return path


def test_cli_exports_and_costs_an_edited_layout(saved, tmp_path):
    out = tmp_path / "layout.json"
    r = run_tapas("export", f"--model={saved}", "--batch_size=8", "--training",
                  "--format=keras-layoutmap", f"--out={out}")
    assert r.returncode == 0, r.stderr
    assert "3 weight(s) split over 'model', 5 replicated" in r.stdout
    assert "4 layer output(s) pinned" in r.stdout
    d = json.loads(out.read_text())
    assert {k: tuple(v) for k, v in d["layouts"].items()} == SPLIT
    # the loaded model's layer outputs, by their paths (the split one and the replicated)
    assert d["outputs"]["up/output"] == [None, None, "model"]
    assert d["outputs"]["head/output"] == [None, None, None]
    d["layouts"]["down/kernel"] = [None, "model"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    py = tmp_path / "layout.py"
    r = run_tapas("export", f"--model={saved}", "--batch_size=8", "--training",
                  f"--out={py}", f"--pin_from={edited}", f"--json_out={tmp_path / 'r.json'}")
    assert r.returncode == 0, r.stderr
    assert "weight down/kernel: S0 in the strategy, S1 in the layout" in r.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["pinned"]["difference"] > 0
    assert os.path.exists(py)


def test_cli_help_and_bad_flags(tmp_path):
    helped, txt, missing, no_out, mesh = run_tapas_each(
        ["export", "--help"], ["export", "--model=bert-tiny", "--out=layout.txt"],
        ["export", "--model=bert-tiny", f"--out={tmp_path}/l.json",
         f"--strategy={tmp_path}/none.json"],
        ["export", "--model=bert-tiny"],
        ["export", "--model=bert-tiny", f"--out={tmp_path}/l.json", "--mesh=2x4",
         "--devices_per_node=4"])
    assert helped.returncode == 0 and "--pin_from" in helped.stdout and "--format" in \
        helped.stdout
    assert txt.returncode == 1 and "end the path with one of them" in txt.stderr
    assert missing.returncode == 1 and "--strategy=" in missing.stderr and \
        "no such file" in missing.stderr
    assert no_out.returncode == 1 and "--out is required" in no_out.stderr
    assert mesh.returncode == 1 and "--mesh=2x4 has 8 devices, the cluster 4" in mesh.stderr


# ---- reading a compiled program's collectives (scripts/layoutmap_check.py; no JAX here) ----

def _check_script(name: str = "layoutmap_check"):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hlo_collectives_of_a_compiled_cpu_program():
    """tests/fixtures/hlo_collectives_cpu8.txt: the collective lines of two programs jax 0.6.2
    compiled for 8 CPU devices (a column- then row-split matmul's gradient: its forward
    all-reduce; a shard_map of all_gather, psum_scatter, all_to_all and ppermute on a
    (64, 64) float32 array split on its rows). Bytes as TAPAS counts them: the global tensor."""
    script = _check_script()
    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                           "hlo_collectives_cpu8.txt")
    with open(fixture) as f:
        got = script.hlo_collectives(f.read())
    assert [(c["kind"], c["bytes"], c["group"]) for c in got] == [
        ("AR", 8 * 64 * 512 * 4, 8), ("AG", 64 * 64 * 4, 8), ("RS", 64 * 64 * 4, 8),
        # the CPU all-to-all is one tuple of 8 per-peer pieces: one collective
        ("A2A", 64 * 64 * 4, 8), ("CP", 8 * 64 * 4, 8)]
    # a combined all-reduce (a tuple, with XLA's /*index=5*/ comments) counts per element
    combined = ("%ar = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/"
                "f32[2,4]{1,0}) all-reduce(%a, %b, %c, %d, %e, %f), replica_groups=[1,8]<=[8]")
    assert [c["bytes"] for c in script.hlo_collectives(combined)] == [16] * 5 + [32]
    diff = script.compare(got[:1], [{"kind": "AR", "bytes": 8 * 64 * 512 * 4, "count": 2}],
                          Cluster.resolve("v100", 1, 8))
    assert diff["matched"] == 1 and [(d["compiled"], d["predicted"]) for d in
                                     diff["differences"]] == [(1, 2)]
    assert diff["difference_seconds"] < 0      # one all-reduce fewer than predicted


# ---- layer-output layouts ("<layer path>/output") -----------------------------------------

def test_split_layer_outputs_are_pinned_by_their_layer_path(planned):
    from tapas.export import check_keys, layer_paths
    model, graph, strategy, options, _ = planned
    layout = export_layout(strategy, graph, options=options, layers=model, outputs="split")
    # the Megatron block leaves the first Dense's (ReLU'd) output split on its hidden axis;
    # the second's is all-reduced (replicated): "split" pins only the split one
    assert {k: tuple(v) for k, v in layout.outputs.items()} == {
        "up/output": (None, None, "model")}
    everything = export_layout(strategy, graph, options=options, layers=model)
    assert {k: tuple(v) for k, v in everything.outputs.items()} == {
        "up/output": (None, None, "model"), "down/output": (None, None, None),
        "norm/output": (None, None, None), "head/output": (None, None, None)}
    # each key matches its own layer's output and nothing else (no weight, no other layer)
    paths = layer_paths(model)
    for key, hits in check_keys(everything.outputs, paths,
                                [w.path for w in model.weights]).items():
        assert hits == [key], (key, hits)
    lm = everything.to_keras(DEVICES)
    assert tuple(lm["up/output"].axes) == (None, None, "model")
    assert lm["up/kernel"] is not None and lm["up"] is None
    # the weights' layouts are the same as without outputs
    assert dict(everything.layouts) == dict(planned[4].layouts)
    assert export_layout(strategy, graph, options=options, layers=model,
                         outputs="none").outputs == {}


def test_layer_outputs_survive_json_and_python_round_trip(planned, tmp_path):
    model, graph, strategy, options, _ = planned
    layout = export_layout(strategy, graph, options=options, layers=model, outputs="all")
    layout.save(str(tmp_path / "o.json"))
    layout.save(str(tmp_path / "o.py"))
    assert load_layout(str(tmp_path / "o.json")) == layout
    from_py = load_layout(str(tmp_path / "o.py"))
    assert dict(from_py.outputs) == dict(layout.outputs) and len(layout.outputs) == 4
    lm = runpy.run_path(str(tmp_path / "o.py"))["layout_map"](DEVICES)
    assert tuple(lm["up/output"].axes) == (None, None, "model")
    assert tuple(lm["head/output"].axes) == (None, None, None)
    # output keys are not weights: the weights read back alone
    assert placements_from_layouts(from_py, {w.path: len(w.shape) for w in graph.weights})[
        "up/kernel"] == "S1"


def test_auto_named_layers_get_their_own_output():
    """Keras names layers dense, dense_1, ...; TF makes a re-entered scope unique with the
    same suffix (dense -> dense_1): the weights read in a scope decide whose it is."""
    from tapas.export import check_keys, layer_paths, output_layouts
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 512), name="x")
    first = keras.layers.Dense(2048, activation="relu")
    second = keras.layers.Dense(512)
    model = keras.Model(inp, second(first(inp)))
    graph = capturing.capture(model, [tf.TensorSpec((8, 32, 512), tf.float32, name="x")],
                              training=True)
    strategy = search(graph, cluster=Cluster.resolve("v100", 1, 8),
                      loss=keras.losses.MeanSquaredError())
    paths = layer_paths(model)
    layouts, placements, _ = output_layouts(strategy, graph, paths, "all")
    assert placements == {first.path: "S2", second.path: "R"}, (paths, placements)
    for key, hits in check_keys(layouts, paths, [w.path for w in model.weights]).items():
        assert hits == [key]


def test_layers_returning_several_tensors_get_no_output_key():
    """Keras applies an output layout to the whole call result; on a tuple the JAX backend
    fails while the functional model is built, so such layers are left out."""
    from tapas.export import layer_paths
    keras.backend.clear_session()
    inp = keras.Input((16,), name="x")
    inner = keras.Model(inp, [keras.layers.Dense(8, name="a")(inp),
                              keras.layers.Dense(4, name="b")(inp)], name="two")
    outer_in = keras.Input((16,), name="y")
    first, _ = inner(outer_in)
    model = keras.Model(outer_in, keras.layers.Dense(2, name="c")(first))
    paths = layer_paths(model)
    assert "two" not in paths and "c" in paths
    assert layer_paths(["p", "q/r"]) == ["p", "q/r"] and layer_paths(len) == []


# ---- XLA auto-sharding's layouts as a Keras layout (scripts/layoutmap_autoshard.py) --------

def test_xla_auto_layouts_become_a_keras_layout():
    """A solve's shardings (ways per axis, as the TPU compile reports them) laid out on a
    (1, 8) mesh: a weight split 8 ways on one axis keys that axis on "model", an unsplit one
    gets no key, each input keeps its own axis (the sequence here), and what a 1-D layout
    cannot say (a 2 x 4 split, two inputs of one shape split differently, an updated weight
    returned in another layout) is listed, not silently changed."""
    script = _check_script("layoutmap_autoshard")
    w = lambda shape, ways: {"shape": shape, "ways": ways}
    solved = {"weights": {"up/kernel": w([512, 2048], [1, 8]), "up/bias": w([2048], [8]),
                          "norm/gamma": w([512], [1]), "odd/kernel": w([64, 64], [2, 4]),
                          "down/kernel": w([2048, 512], [8, 1])},
              "updated": {"down/kernel": w([2048, 512], [1, 8])},
              "inputs": {"tokens": w([8, 64], [1, 8]), "mask": w([8, 64], [8, 1]),
                         "targets": w([8, 64, 512], [1, 1, 8])}}
    t = script.auto_layout(solved, 8)
    assert t["mesh_shape"] == (1, 8)
    assert t["layouts"] == {"up/kernel": (None, "model"), "up/bias": ("model",),
                            "down/kernel": ("model", None)}
    assert t["weights"] == {"up/kernel": "S1", "up/bias": "S0", "down/kernel": "S0"}
    assert t["replicated"] == ("norm/gamma", "odd/kernel")
    assert t["data_layouts"] == {(8, 64): (None, "model"),
                                 (8, 64, 512): (None, None, "model")}
    assert t["data"]["mask"] == ("model", None)
    assert set(t["unmapped"]) == {"odd/kernel", "input mask", "updated down/kernel"}
    assert "2 x 4 ways" in t["unmapped"]["odd/kernel"]
    layout_map = script.layout_export("m", solved, 8).to_keras(DEVICES)
    assert tuple(layout_map["up/kernel"].axes) == (None, "model")
    assert layout_map["norm/gamma"] is None
