"""tapas.execution.devices: which process reports for a job, read from TF_CONFIG."""

from __future__ import annotations

import json

import pytest

from tapas.execution import devices


def _config(monkeypatch, cluster, task) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": task}))


def test_without_tf_config_one_process_reports(monkeypatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert devices.process_count() == 1 and devices.is_chief_process()


@pytest.mark.parametrize("cluster, task, count, chief", [
    ({"worker": ["a:1", "b:2", "c:3"]}, {"type": "worker", "index": 0}, 3, True),
    ({"worker": ["a:1", "b:2", "c:3"]}, {"type": "worker", "index": 2}, 3, False),
    ({"chief": ["a:1"], "worker": ["b:2"]}, {"type": "chief", "index": 0}, 2, True),
    ({"chief": ["a:1"], "worker": ["b:2"]}, {"type": "worker", "index": 0}, 2, False),
    ({"worker": ["a:1"]}, {"type": "worker", "index": 0}, 1, True),   # one task: no cluster
])
def test_tf_config_names_the_processes_and_the_chief(monkeypatch, cluster, task, count,
                                                     chief) -> None:
    _config(monkeypatch, cluster, task)
    assert devices.process_count() == count
    assert devices.is_chief_process() == chief


def test_a_cluster_without_a_task_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]}}))
    with pytest.raises(ValueError, match="no 'task'"):
        devices.process_count()
