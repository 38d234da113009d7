"""benchmarks/bench_train.py end to end on the smallest T5: the table, and a JSON whose
first-step figures (wall, CPU, user CPU, system CPU, page faults) are consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_train_reports_first_step_and_steady_step(tmp_path: Any) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"),
         "--models=t5-tiny", "--strategies=random:0", "--steps=2", "--devices=2",
         "--batch_size=4", f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "user ratio" in proc.stdout and "page faults" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    r = rows[0]
    assert r["model"] == "t5-tiny" and r["devices"] == 2 and r["graph_optimization"] == "lean"
    assert r["sharded_nodes"] > 0 and r["audit_matches"]
    for side in ("first_step", "single_first_step"):
        assert r[f"{side}_s"] > 0 and r[f"{side}_cpu_s"] >= r[f"{side}_sys_s"] >= 0
        assert r[f"{side}_page_faults"] >= 0
    assert abs(r["first_step_ratio"] - r["first_step_s"] / r["single_first_step_s"]) < 1e-9
    assert r["first_step_user_ratio"] > 0 and r["ratio"] > 0
