"""scripts/row_census.py on two corpus models: a keras.applications MobileNet combines the
examples of a batch in batch norm's moments in training and keeps them apart in inference;
keras-hub's BERT keeps them apart in both (its dropout is followed like an input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_census_says_which_models_keep_rows_apart_and_why_not(tmp_path):
    out = tmp_path / "census.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "row_census.py"),
         "--models=keras-mobilenet,hub-bert", f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "conv1_bn_1/moments" in r["keras-mobilenet"]["training"]
    assert r["keras-mobilenet"]["inference"] is None
    assert r["hub-bert"] == {"training": None, "inference": None}
    assert "training: batch norm 1, rows apart 1" in proc.stdout
    assert "inference: rows apart 2" in proc.stdout
