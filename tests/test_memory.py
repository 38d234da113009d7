"""Memory per device and per worker (tapas.execution.memory): the plan's prediction beside
the measured peak, from ``ParallelModel.memory_report``, fit's end and ``tapas train``."""

from __future__ import annotations

import json
import os

import pytest

from tests import command
from tests.worker_main import run_worker

WORKER = os.path.join(os.path.dirname(__file__), "memory_worker.py")
MIB = 2.0 ** 20


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback", result)
    return result


def test_peak_rss_is_the_process_high_water_mark() -> None:
    import resource

    from tapas.execution import memory
    block = bytearray(64 * 2**20)   # touched: resident
    peak = memory.peak_rss_bytes()
    assert peak >= len(block)
    assert abs(peak - resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) < 16 * MIB


def test_parallel_model_reports_the_plan_beside_the_measured_peak() -> None:
    """2 logical devices in one process, every weight split (a random plan): the predicted
    weights are the runtime's shards, the optimizer term Adam's two slots of the trainable
    ones, the measured value the process's peak RSS; fit(verbose=2) prints the table and
    keeps it as ``history.memory``."""
    r = _ok(run_worker(WORKER, {"devices": 2, "checks": ["report"]})[0]["report"])
    parts = r["parts"]
    assert parts["weights"] == pytest.approx(r["shard_bytes"])
    assert parts["optimizer"] == pytest.approx(2 * parts["gradients"])
    assert r["predicted"] == pytest.approx(sum(parts.values()))
    assert parts["activations"] > 0
    (row,) = r["rows"]
    assert row["worker"] == 0 and row["devices"] == 2
    assert row["predicted_bytes"] == pytest.approx(2 * r["predicted"])
    assert 100 * MIB < row["peak_rss_bytes"] <= r["own_rss"]
    assert "predicted MiB" in r["table"] and "peak RSS MiB" in r["table"]
    assert "predicted MiB" in r["fit_printed"]
    assert r["history_memory"]["workers"][0]["peak_rss_bytes"] > 100 * MIB


def test_tapas_train_prints_every_workers_peak(tmp_path) -> None:
    """``tapas train --workers=2``: one row per worker, each its own process's peak RSS
    (gathered by an all-reduce), beside the plan's prediction for its device."""
    out = tmp_path / "r.json"
    proc = command.run_tapas("train", "--model=moe-tiny", "--training=false", "--workers=2",
                             "--strategy=random:0", "--steps=2", f"--json_out={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mem = json.loads(out.read_text())["memory"]
    rows = mem["workers"]
    assert [r["worker"] for r in rows] == [0, 1]
    for r in rows:
        assert r["devices"] == 1 and r["peak_rss_bytes"] > 100 * MIB
        assert r["predicted_bytes"] == pytest.approx(mem["predicted_per_device_bytes"])
    assert "peak RSS MiB" in proc.stdout
    lines = [ln.split() for ln in proc.stdout.splitlines()]
    assert sum(1 for ln in lines if len(ln) == 4 and ln[0] in "01" and ln[1] == "1") == 2
