"""The exactness matrix (``scripts/search_exactness.py``) reports what the search says.

A slice of the matrix: a zoo preset searched exactly, the same graph under a beam too
narrow for it (beam-limited with a bound, or exact when the beam cut only dearer
prefixes, as the Strategy says), a search stopped by its time limit, and the script run
end to end on one preset, its JSON resumable.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import search_exactness  # noqa: E402
from models import capture_preset  # noqa: E402
from tapas.planning.explore import ExploreOptions  # noqa: E402


@pytest.fixture(scope="module")
def t5_tiny():
    return capture_preset("t5-tiny")[0]


def test_rows_say_exact_beam_limited_or_timeout_as_the_search_does(t5_tiny):
    exact = search_exactness.search_row(t5_tiny, 4, None)
    assert exact["status"] == "exact" and exact["bound"] is None and exact["beam"] == 0
    assert exact["seconds"] > 0 and exact["cost_s"] > 0
    narrow = search_exactness.search_row(t5_tiny, 4, None, ExploreOptions(max_states=2))
    assert narrow["beam"] > 0 and narrow["cost_s"] >= exact["cost_s"] * (1 - 1e-12)
    if narrow["status"] == "beam-limited":
        assert narrow["bound"] is None or narrow["cost_s"] / exact["cost_s"] - 1 <= \
            narrow["bound"] + 1e-12
    else:      # proven: nothing cheaper than the plan was cut
        assert narrow["cost_s"] == pytest.approx(exact["cost_s"], rel=1e-9)
    stopped = search_exactness.search_row(t5_tiny, 4, 1e-6)
    assert stopped["status"] == "timeout" and "time limit" in stopped["error"]
    s = search_exactness.summary([{"model": "a", "searches": [exact, stopped]},
                                  {"model": "b", "error": "ValueError: x"}])
    assert s["searches"] == {"exact": 1, "timeout": 1}
    assert [(e["model"], e["status"]) for e in s["exceptions"]] == [("a", "timeout"),
                                                                     ("b", "error")]


def test_the_script_writes_a_resumable_table(tmp_path):
    out = tmp_path / "exactness.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "search_exactness.py"),
           "--zoo=resnet-tiny", "--corpus=none", "--devices=2", f"--json_out={out}"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "resnet-tiny" in first.stdout and "2: exact" in first.stdout
    data = json.loads(out.read_text())
    (row,) = data["models"]
    assert row["model"] == "resnet-tiny" and row["searches"][0]["status"] == "exact"
    assert data["summary"]["searches"] == {"exact": 1}
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "resnet-tiny " not in again.stdout   # already there
    assert json.loads(out.read_text())["models"] == data["models"]
