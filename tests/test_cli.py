"""Tests for the `tapas` command line: the real console script, in a subprocess."""

import json

import command  # tests/command.py
import pytest

from tapas import cli


def run_tapas(*args, check=True):
    proc = command.run_tapas(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"tapas {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_inspect_default_model_prints_report_and_writes_ir(tmp_path):
    ir_path, report_path = tmp_path / "ir.json", tmp_path / "report.json"
    out = run_tapas("inspect", f"--graph_out={ir_path}", f"--json_out={report_path}").stdout
    for line in ("model            t5-tiny", "TF ops", "GraphNodes by kind:", "attention-score",
                 "capture time", "largest GraphNodes by weight size"):
        assert line in out
    from tapas.ir import Graph
    graph = Graph.loads(ir_path.read_text())
    report = json.loads(report_path.read_text())
    assert report["graph_nodes"] == len(graph.nodes)
    assert report["params"] == graph.num_params == 197_632
    assert sum(report["kinds"].values()) == len(graph.nodes)


def test_mine_prints_templates_and_coverage_and_draws(tmp_path):
    png, folded_path, report_path = (tmp_path / "folded.png", tmp_path / "folded.json",
                                     tmp_path / "report.json")
    out = run_tapas("mine", "--model=t5-tiny", f"--draw={png}", f"--folded_out={folded_path}",
                    f"--json_out={report_path}").stdout
    assert "unique subgraphs (templates) covering" in out and "captured 't5-tiny'" in out
    folded = json.loads(folded_path.read_text())
    report = json.loads(report_path.read_text())
    assert report["folded"] == folded and folded["templates"], out
    # every template line printed: T<id>, its size and instance count
    for t in folded["templates"]:
        assert f"T{t['id']:<8}{len(t['signatures']):>5}{len(t['instances']):>10}" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_mine_min_size_larger_than_graph_folds_nothing_and_bad_values_are_usage_errors():
    out = run_tapas("mine", "--model=t5-tiny", "--min_size=100000").stdout
    assert "0 unique subgraphs" in out and "every GraphNode is its own unique subgraph" in out
    proc = run_tapas("mine", "--model=t5-tiny", "--min_support=1", check=False)
    assert proc.returncode != 0 and "min_support=1: must be an integer >= 2" in proc.stderr


def test_models_lists_the_zoo():
    out = run_tapas("models").stdout
    assert "t5-large" in out and "moe-1.3b" in out and "resnet152-400k" in out


def test_unknown_command_and_model_are_usage_errors():
    # refused before any work: one process runs them all (command.run_tapas_each)
    unknown, typo, missing, missing_train, workers = command.run_tapas_each(
        ["frobnicate"], ["inspect", "--model=t5-lage"],
        ["inspect", "--model=/no/such/model.keras"],
        ["train", "--model=/no/such/model.keras", "--devices=1"],
        ["train", "--model=t5-lage", "--workers=2"])
    assert unknown.returncode != 0 and "usage: tapas" in unknown.stderr
    assert typo.returncode != 0 and "t5-large" in typo.stderr
    assert missing.returncode != 0 and "no such file" in missing.stderr
    assert missing_train.returncode != 0 and "no such file" in missing_train.stderr
    # with --workers: refused before any worker is launched, not once per worker
    assert workers.returncode != 0 and "t5-large" in workers.stderr, workers.stderr[-2000:]
    assert "launching" not in workers.stdout and "worker 1" not in workers.stderr
    from tapas.execution.api import train
    with pytest.raises(train.TrainError, match="no such file"):
        train.train(train.TrainOptions(model="/no/such/model.keras", workers=2))


def test_inspect_a_saved_keras_file(tmp_path):
    import keras
    inp = keras.Input((6,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(5, activation="relu")(inp)))
    path = tmp_path / "m.keras"
    model.save(path)
    out = run_tapas("inspect", f"--model={path}", "--batch_size=2").stdout
    assert "dense" in out and "parameters       53" in out
    # a dict of inputs whose keys are not sorted: captured as the model takes them
    ins = {"z": keras.Input((4,), name="z"), "a": keras.Input((2,), name="a")}
    model = keras.Model(ins, keras.layers.Dense(3)(keras.layers.Concatenate()([ins["z"],
                                                                              ins["a"]])))
    model.save(tmp_path / "d.keras")
    out = run_tapas("inspect", f"--model={tmp_path / 'd.keras'}", "--batch_size=2").stdout
    assert "parameters       21" in out


def test_report_helpers_format_every_field():
    import tensorflow as tf, keras, tapas
    inp = keras.Input((4,), batch_size=2)
    g = tapas.capture(keras.Model(inp, keras.layers.Dense(2)(inp)))
    report = cli.inspect_report(g, 0.5, 0.25, 9, top=3)
    text = cli.format_inspect(report)
    assert "capture time     0.750 s" in text and "dense" in text


def test_search_prints_layer_table_references_timings_and_writes_strategy(tmp_path):
    out_path, report_path = tmp_path / "strategy.json", tmp_path / "report.json"
    out = run_tapas("search", "--model=t5-tiny", "--nodes=1", "--devices_per_node=2",
                    f"--out={out_path}", f"--json_out={report_path}").stdout
    for line in ("strategy for 't5-tiny' on v100-ethernet/1x2 (2 devices), mode gp",
                 "weights split", "reference plans:", "megatron", "ffn-only", "mha-only",
                 "data-parallel", "ranked alternatives", "phase timings:", "enumeration",
                 "candidates generated", f"strategy written to {out_path}",
                 "pricing the loss (SparseCategoricalCrossentropy(from_logits=True))"):
        assert line in out, line
    from tapas.planning.search import Strategy
    saved = Strategy.load(str(out_path))
    report = json.loads(report_path.read_text())
    assert report["strategy"]["patterns"] == list(saved.patterns)
    assert report["loss_priced"] == {"name": "SparseCategoricalCrossentropy",
                                     "from_logits": True, "axis": -1, "ignore_class": None}
    assert saved.num_devices == 2 and len(saved.patterns) == saved.num_nodes
    plain = tmp_path / "plain.json"
    out = run_tapas("search", "--model=t5-tiny", "--nodes=1", "--devices_per_node=2",
                    "--noprice_loss", f"--json_out={plain}").stdout
    assert "pricing the loss" not in out
    assert json.loads(plain.read_text())["loss_priced"] is None
    zero, devices = command.run_tapas_each(
        ["search", "--model=t5-tiny", "--devices_per_node=0"],
        ["search", "--model=t5-tiny", "--devices=4"])
    assert zero.returncode != 0 and "devices_per_node=0: a cluster with no devices" in zero.stderr
    # train's device count is refused, not ignored (it searched one node of 8 V100s)
    assert devices.returncode != 0 and "--devices=4 is the device count of `tapas train`" \
        in devices.stderr and "--nodes=1 --devices_per_node=4" in devices.stderr


def test_each_command_help_lists_its_own_flags_and_exits_0():
    train, search, inspect, overview, unknown, bare = command.run_tapas_each(
        ["train", "--help"], ["search", "--help"], ["inspect", "--help"], ["--help"],
        ["frobnicate", "--help"], [])
    out = train.stdout
    assert train.returncode == 0
    for flag in ("--devices=<int>", "--steps=<int>", "--strategy=<string>", "--[no]resume",
                 "--optimizer=<string>", "--checkpoint_dir=<string>"):
        assert flag in out, flag
    assert "--top=" not in out and "--graph_out=" not in out and "--nodes=" not in out
    assert "continue from the newest whole checkpoint" in out   # the flag's help text
    out = search.stdout
    assert "--nodes=<int>" in out and "--devices_per_node=<int>" in out
    assert "--steps=" not in out and "--checkpoint_dir=" not in out
    out = inspect.stdout
    assert "--top=<int>  (default: 10)" in out and "--graph_out=<string>" in out
    # every flag a command lists is one absl defines (no stale names)
    for name in cli.COMMANDS:
        text = cli.command_help(name)
        assert text.count("\n  --") == len(cli._MODULES[name].FLAG_NAMES)
    out = overview.stdout
    assert overview.returncode == 0
    assert all(f"  {c}" in out for c in cli.COMMANDS) and "tapas COMMAND --help" in out
    assert unknown.returncode == 1 and "unknown command 'frobnicate'" in unknown.stderr
    # bare: points at the help that exists
    assert bare.returncode == 1 and "`tapas COMMAND --help` lists a command's flags" in \
        bare.stderr
    proc = run_tapas(check=False)   # bare: points at the help that exists
    assert proc.returncode == 1 and "`tapas COMMAND --help` lists a command's flags" in \
        proc.stderr
