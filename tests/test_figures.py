"""The paper-figure scripts: Figure 6's TAPAS side on a tiny slice, and the libtpu log parser.

The XLA baseline itself needs the optional .venv-xla (scripts/baselines/setup.sh) and is not
run here; its log parser is tested on a real libtpu log captured from a t5-tiny compile
(tests/fixtures/xla_autoshard_t5_tiny.log).
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "xla_autoshard_t5_tiny.log"


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_autoshard_log_parser_reads_a_real_libtpu_log() -> None:
    xla = _load(ROOT / "scripts" / "baselines" / "xla_autoshard.py", "xla_autoshard")
    parsed = xla.parse_autoshard_log(FIXTURE.read_text())
    # "Starting the auto sharding pass" at 21:43:08.932781, "Auto Sharding took 75 seconds"
    # at 21:44:24.601421.
    assert parsed["passes"] == [{"seconds": 75.66864, "reported_s": 75.0}]
    assert parsed["pass_s"] == 75.66864
    assert parsed["status"] == "MPSOLVER_OPTIMAL"
    assert parsed["ilp_variables"] == [5491]          # a line without a glog prefix
    assert parsed["ilp_nodes"] == [840]
    assert parsed["solver_ms"] == [75267]
    assert parsed["objectives"] == [1.65975e+06]
    assert parsed["mesh_shapes"] == ["[8, 1]"]
    assert parsed["memory_budget_bytes"] == 283368
    assert (parsed["memory_bytes"], parsed["memory_lower_bound_bytes"]) == (278548, 259400)
    assert parsed["options"] == {"memory_budget_per_device": "0 GB", "memory_budget_ratio": "1.1",
                                 "device_mesh_shape": "[8,1]", "solver_timeout_in_seconds": "60"}


def test_autoshard_log_parser_edge_cases() -> None:
    xla = _load(ROOT / "scripts" / "baselines" / "xla_autoshard.py", "xla_autoshard")
    empty = xla.parse_autoshard_log("no glog here\n")
    assert empty["pass_s"] is None and empty["status"] is None and empty["passes"] == []
    # A pass that never finished (killed by the outer timeout) has no time.
    started = FIXTURE.read_text().splitlines()[0]
    assert xla.parse_autoshard_log(started)["pass_s"] is None
    # Over midnight: 23:59:59.5 -> 00:00:01.0 is 1.5 s.
    over = ("I1123 23:59:59.500000 1 auto_sharding.cc:3961] Starting the auto sharding pass\n"
            "I1124 00:00:01.000000 1 auto_sharding.cc:3931] Auto Sharding took 1 seconds\n")
    assert xla.parse_autoshard_log(over)["pass_s"] == 1.5


def test_figure6_tapas_side_writes_json_and_png(tmp_path: pathlib.Path) -> None:
    out, png = tmp_path / "fig6.json", tmp_path / "fig6.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figure6_search_time.py"), "--models=t5-tiny",
         "--systems=gp,es", "--es_limit=60", f"--json_out={out}", f"--png_out={png}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["figure"] == "TAPAS Figure 6" and data["devices"] == 8
    assert data["systems"] == ["gp", "es"]
    (row,) = data["results"]
    assert row["model"] == "t5-tiny" and row["series"] == "other"
    assert row["graph_nodes"] > 0 and "xla" not in row
    assert row["gp"]["finished"] and row["gp"]["seconds"] > 0 and row["gp"]["cost_s"] > 0
    assert row["es"]["finished"] and row["es"]["cost_s"] <= row["gp"]["cost_s"] * (1 + 1e-9)
    assert png.stat().st_size > 0
    assert "t5-tiny" in proc.stdout and "XLA/GP" in proc.stdout


def test_figure6_reports_a_missing_baseline_venv(tmp_path: pathlib.Path) -> None:
    # in a process of its own: the script defines absl flags (--devices, ...) that another
    # test's import of tapas.cli may already have defined in this one
    code = f"""if True:
        import importlib.util, json
        spec = importlib.util.spec_from_file_location(
            "figure6_search_time", {str(ROOT / "scripts" / "figure6_search_time.py")!r})
        fig6 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fig6)
        fig6.FLAGS(["figure6", "--xla_python={tmp_path / 'nowhere' / 'python'}"])
        print(json.dumps({{"row": fig6.xla_autoshard("t5-tiny"),
                          "depth": fig6.series_of("t5-large-depth24"),
                          "moe": fig6.series_of("moe-1.3b")}}))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["row"]["ok"] and "scripts/baselines/setup.sh" in got["row"]["error"]
    assert got["depth"] == ["depth", 24.0]
    assert got["moe"] == ["moe", None]


def test_table1_counts_each_level_on_tiny_presets(tmp_path: pathlib.Path) -> None:
    """Table 1 on t5-tiny and moe-tiny: every level's V and E counted, each level no larger
    than the one before it, gp's candidates counted and es's too (finished here)."""
    out, png = tmp_path / "t1.json", tmp_path / "t1.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table1_complexity.py"),
         "--models=t5-tiny,moe-tiny", "--es_limit=60", f"--json_out={out}",
         f"--png_out={png}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["rows"]] == ["t5-tiny", "moe-tiny"]
    for r in data["rows"]:
        ops, gn, fold = r["ops"], r["graph_nodes"], r["folded"]
        assert ops["V"] > gn["V"] >= fold["V"] > 0 and ops["E"] > gn["E"] >= fold["E"] > 0
        assert r["C"] == round(ops["V"] / gn["V"], 2) and r["L"] >= 2   # both repeat a block
        assert fold["templates"] >= 1 and fold["V"] < gn["V"]
        assert r["gp"]["generated"] > 0 and r["es"]["generated"] > 0
        paper = (ops["V"] + ops["E"]) / (2 * (ops["V"] / gn["V"]) * r["L"])
        assert abs(r["paper_formula"] - paper) <= 0.05
    assert png.stat().st_size > 0 and "paper" in proc.stdout


def test_figure8_weak_scaling_on_a_tiny_preset(tmp_path: pathlib.Path) -> None:
    """Figure 8's script on moe-tiny over S(1, 2) and S(2, 2): the batch grows with the
    devices, gp and es both finish with costs, the gap is computed, the JSON says the costs
    are predicted."""
    out, png = tmp_path / "f8.json", tmp_path / "f8.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figure8_weak_scaling.py"), "--models=t5-tiny",
         "--nodes=1,2", "--devices_per_node=2", "--es_limit=60", f"--json_out={out}",
         f"--png_out={png}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["predicted"] is True and data["figure"] == "TAPAS Figure 8"
    assert [(r["devices"], r["batch"]) for r in data["rows"]] == [(2, 4), (4, 8)]
    for r in data["rows"]:
        assert r["gp"]["finished"] and r["es"]["finished"], r
        assert r["es"]["cost_s"] <= r["gp"]["cost_s"] * (1 + 1e-9)
        assert r["gap"] == r["gp"]["cost_s"] / r["es"]["cost_s"] - 1
        assert sum(r["gp"]["patterns"].values()) > 0
    assert png.stat().st_size > 0 and "predicted by the cost model" in proc.stdout


def test_figure7_throughput_on_tiny_presets(tmp_path: pathlib.Path) -> None:
    """Figure 7's script, predicted on 2 V100s for resnet-tiny and moe-tiny (with the
    ZeRO-2-style plan priced from data parallelism: the same compute, a reduce-scatter and an
    all-gather in place of each all-reduce, less memory) and measured for t5-tiny on 2
    logical CPU devices (each plan timed, its prediction beside it, the pairs the cost model
    orders as measured counted)."""
    out, png = tmp_path / "f7.json", tmp_path / "f7.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figure7_throughput.py"),
         "--models=resnet-tiny,moe-tiny", "--devices=2", "--measure=t5-tiny",
         "--measure_devices=2", "--batch_size=4", "--steps=1", "--repeats=2",
         f"--json_out={out}", f"--png_out={png}"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["figure"] == "TAPAS Figure 7" and data["predicted_devices"] == 2
    for r in data["predicted"]:
        plans = r["plans"]
        assert {"TAPAS", "data-parallel", "zero-2"} <= set(plans), plans.keys()
        dp, z2 = plans["data-parallel"], plans["zero-2"]
        assert z2["compute"] == dp["compute"] and z2["memory"] < dp["memory"]
        assert plans["TAPAS"]["cost"] <= dp["cost"] * (1 + 1e-9)
        assert all(p["tflops"] > 0 for p in plans.values())
        assert r["training_flops"] > 0
    (m,) = data["measured"]
    assert m["model"] == "t5-tiny" and "TAPAS" in m["plans"] and m["pairs"] >= 1
    for p in m["plans"].values():
        assert p["measured_s"] > 0 and p["predicted_s"] >= 0
    assert png.stat().st_size > 0 and "measured here" in proc.stdout


def test_figure7_costs_xla_s_parameter_shardings(tmp_path: pathlib.Path) -> None:
    """--xla_json: XLA's plan for t5-tiny on 8 TPU chips (a real xla_autoshard.py row,
    tests/fixtures/xla_autoshard_t5_tiny.json) costed by the cost model, every parameter
    placed as XLA placed it; it cannot cost less than the searched plan."""
    out = tmp_path / "f7.json"
    fixture = ROOT / "tests" / "fixtures" / "xla_autoshard_t5_tiny.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figure7_throughput.py"), "--models=t5-tiny",
         "--measure=", f"--xla_json={fixture}", f"--json_out={out}", "--png_out="],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["predicted"]
    xla = r["plans"]["XLA"]
    shardings = json.loads(fixture.read_text())["results"][0]["weight_shardings"]
    assert xla["weights"] == len(shardings) == 47
    assert xla["weights_split"] == sum(1 for s in shardings.values() if s["axes"]) == 45
    assert xla["unmapped"] == {}
    assert xla["cost"] >= r["plans"]["TAPAS"]["cost"] * (1 - 1e-9) and xla["tflops"] > 0
    assert "XLA on t5-tiny: 45 of 47 parameters split, 0 not placeable" in proc.stdout


def test_figure9_strategies_on_tiny_presets(tmp_path: pathlib.Path) -> None:
    """Figure 9's script on t5-tiny and moe-tiny over 2 devices: one instance of every
    template with each GraphNode's pattern and family, the weighted GraphNodes outside the
    templates, the Megatron comparison; JSON and PNG."""
    out, png = tmp_path / "f9.json", tmp_path / "f9"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figure9_strategies.py"),
         "--models=t5-tiny,moe-tiny", "--devices=2", f"--json_out={out}", f"--png_dir={png}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["figure"] == "TAPAS Figure 9" and data["predicted"] is True
    assert [r["model"] for r in data["rows"]] == ["t5-tiny", "moe-tiny"]
    for r in data["rows"]:
        assert r["templates"] and r["cost"] >= 0
        for t in r["templates"]:
            assert t["instances"] >= 2 and t["nodes"]
            assert all(n["pattern"] and n["kind"] for n in t["nodes"])
        ids = [n["id"] for t in r["templates"] for n in t["nodes"]] + \
            [n["id"] for n in r["uncovered"]]
        assert len(ids) == len(set(ids)) and max(ids) < r["graph_nodes"]
    assert "megatron" in data["rows"][0]["references"]
    assert (png / "t5-tiny.png").stat().st_size > 0 and (png / "moe-tiny.png").exists()
    assert "T0 x" in proc.stdout


def test_paper_driver_runs_steps_and_summarises(tmp_path: pathlib.Path) -> None:
    """scripts/paper.py --quick: each chosen step in its own process, its files under --out,
    the minutes per step printed and written to paper.json; an unknown step is refused."""
    out = tmp_path / "paper"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "paper.py"), "--quick", "--noxla",
         "--only=table1,figure9", f"--out={out}", f"--graph_cache={tmp_path / 'graphs'}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "=== [1/2] table1" in proc.stdout and "=== [2/2] figure9" in proc.stdout
    summary = json.loads((out / "paper.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["table1", "figure9"]
    assert all(s["returncode"] == 0 and s["seconds"] > 0 for s in summary["steps"])
    assert summary["quick"] is True and summary["xla"] is False
    assert (out / "table1_complexity.json").exists() and (out / "table1_complexity.png").exists()
    assert (out / "figure9_strategies.json").exists()
    assert list((out / "figure9").glob("*.png"))
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "paper.py"), "--only=figure11"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "the steps are table1, figure10, figure6" in bad.stderr


def test_xla_shardings_become_tapas_placements() -> None:
    xla = _load(ROOT / "scripts" / "baselines" / "xla_autoshard.py", "xla_autoshard")
    placements, unmapped = xla.tapas_placements({
        "dense/kernel": {"shape": [64, 256], "axes": [1], "ways": [8]},
        "dense/bias": {"shape": [256], "axes": [], "ways": []},
        "emb/embeddings": {"shape": [512, 64], "axes": [0, 1], "ways": [2, 4]},
        "norm/scale": {"shape": [64], "axes": [0], "ways": [4]}}, 8)
    assert placements == {"dense/kernel": "S1", "dense/bias": "R"}
    assert set(unmapped) == {"emb/embeddings", "norm/scale"}
    assert "2 x 4 ways on axes [0, 1]" in unmapped["emb/embeddings"]
