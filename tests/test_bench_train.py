"""benchmarks/bench_train.py end to end on the smallest T5, each side in its own process:
the table, and a JSON whose first-step figures (wall, CPU, user CPU, system CPU, page
faults) are consistent with the single-device and the MirroredStrategy baselines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")


def test_bench_train_reports_first_step_and_steady_step(tmp_path: Any) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--models=t5-tiny", "--strategies=random:0", "--steps=2",
         "--devices=2", "--batch_size=4", "--each_side_alone", f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "/ mirrored" in proc.stdout and "page faults" in proc.stdout
    for side in ("keras", "mirrored", "tapas"):
        assert f"--- {side}, in its own process" in proc.stdout
    d = json.loads(out.read_text())
    assert d["each_side_alone"] and d["sides"] == ["keras", "mirrored", "tapas"]
    base = d["baselines"]["t5-tiny"]
    assert set(base) == {"keras", "mirrored"}
    for b in base.values():
        assert b["step_s"] > 0 and b["first"]["wall"] > 0 and b["first"]["faults"] >= 0
    rows = d["rows"]
    assert len(rows) == 1
    r = rows[0]
    assert r["model"] == "t5-tiny" and r["devices"] == 2 and r["graph_optimization"] == "lean"
    assert r["sharded_nodes"] > 0 and r["audit_matches"]
    for side in ("first_step", "single_first_step", "mirrored_first_step"):
        assert r[f"{side}_s"] > 0 and r[f"{side}_cpu_s"] >= r[f"{side}_sys_s"] >= 0
        assert r[f"{side}_page_faults"] >= 0
    assert r["single_first_step_s"] == base["keras"]["first"]["wall"]
    assert r["first_step_ratio"] == pytest.approx(r["first_step_s"] / r["single_first_step_s"])
    assert r["first_step_vs_mirrored"] == pytest.approx(
        r["first_step_s"] / r["mirrored_first_step_s"])
    assert r["first_step_user_ratio"] > 0 and r["ratio"] > 0


def test_bench_train_refuses_an_unknown_side_and_an_unsplittable_batch() -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--sides=keras,xla", "--models=t5-tiny"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "--sides=keras,xla: use one or more of ['keras', 'mirrored', 'tapas']" in \
        proc.stderr, proc.stderr[-2000:]
    odd = subprocess.run([sys.executable, SCRIPT, "--sides=mirrored", "--devices=4",
                          "--batch_size=6", "--models=t5-tiny"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert odd.returncode != 0
    assert "--batch_size=6 does not split over --devices=4" in odd.stderr, odd.stderr[-2000:]
