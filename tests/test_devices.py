"""tapas.execution.runtime.devices: which process reports for a job, read from TF_CONFIG; local
devices per worker."""

from __future__ import annotations

import json

import pytest

from tapas.execution.runtime import devices


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


def test_devices_per_worker_is_checked_and_leaves_tensorflow_as_it_was() -> None:
    """`make_strategy(devices_per_worker=D)`: D must be a positive int; D = 1 (and hosts
    with GPUs) leave TensorFlow's choice of local devices alone. (D = 2 across two worker
    processes is run end to end in tests/test_mesh.py.)"""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    original = cars.CollectiveAllReduceExtended.__dict__["_initialize_local_devices"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="devices_per_worker"):
            with devices._cpu_devices_per_worker(bad):
                pass
    with devices._cpu_devices_per_worker(1):
        assert cars.CollectiveAllReduceExtended.__dict__["_initialize_local_devices"] \
            is original
    assert cars.CollectiveAllReduceExtended.__dict__["_initialize_local_devices"] is original
