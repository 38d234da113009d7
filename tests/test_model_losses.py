"""The model's own losses and metrics under ``ParallelModel.fit`` equal Keras's ``fit``.

In a worker process (tests/model_losses_worker.py; 2 and 4 logical CPU devices): a
``keras.Sequential`` classifier and a functional binary model, written and compiled as a
user writes them (SGD, a loss name, weight regularizers, metrics), trained 3 epochs by
Keras on one device and by tapas (with the compiled optimizer) under a searched plan,
random plans (one splits the L2-regularized kernel, one the output) and the data-parallel
plan: the History (loss, every metric and every ``val_`` metric, per epoch), the final
weights, ``evaluate``, the audit (the regularizers' collectives), the progress bar and
TensorBoard's ``epoch_<name>`` scalars of the searched plan's run and, for the random
plans, ``verify`` (Keras's compiled loss and ``model.losses`` as the reference) equal
Keras's (rtol 1e-5); likewise a functional model with two outputs, a loss and
``loss_weights`` per output and sample weights, and a model whose call adds losses (an
activity regularizer, ``self.add_loss``). A job
crashed in the middle of an epoch and resumed from its checkpoint continues the epoch's
metrics.
"""

from __future__ import annotations

import os

import pytest

from matrix import pick  # tests/matrix.py
from worker_main import run_checked, run_worker  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "model_losses_worker.py")


# 4 devices in the suite, 2 as well under TAPAS_FULL_MATRIX=1 (the same checks, one split size)
@pytest.fixture(scope="module", params=pick([4], [2, 4]),
                ids=pick(["4_devices"], ["2_devices", "4_devices"]))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = str(tmp_path_factory.mktemp("model_losses"))
    return run_checked(WORKER, {"devices": request.param, "dir": d,
                                "checks": ["classifier", "binary", "two_outputs",
                                           "call_losses", "resume", "dict_outputs"]}, 600.0)


def _plans(r: dict) -> list[str]:
    return [k for k, v in r.items() if isinstance(v, dict) and "history" in v]


def _check_plans(r: dict, metrics: set[str]) -> None:
    assert set(r["keras_keys"]) == {"loss", "val_loss"} | metrics | {f"val_{m}"
                                                                     for m in metrics}
    plans = _plans(r)
    assert "searched" in plans and "batch" in plans and any(p.startswith("random:")
                                                            for p in plans)
    for name in plans:
        p = r[name]
        assert p["keys"] == r["keras_keys"], (name, p["keys"])
        for key, c in p["history"].items():
            assert c["ok"], (name, key, c)
        assert p["weights"]["ok"], (name, p["weights"])
        assert p["evaluate"]["ok"], (name, p["evaluate"])
        assert p["predict"]["ok"], (name, p["predict"])   # Keras's structure and values
        assert p["audit"]["matches"], (name, p["audit"])
        if name.startswith("random:"):
            assert p["verify"]["ok"], (name, p["verify"])
    # the searched plan's run: every log in the progress bar and in TensorBoard, by
    # Keras's names (TensorBoard's epoch_<name>, as Keras's TensorBoard callback writes)
    searched = r["searched"]
    for key in r["keras_keys"]:
        assert f"{key}: " in searched["progress_bar"], (key, searched["progress_bar"])
        assert f"epoch_{key}" in searched["tags"], (key, searched["tags"])
    # the L2-regularized kernel split over the devices: its shards' terms summed
    assert any("sum-of-shards" in r[p]["regularizers"].values() for p in plans)
    # and the output split across the devices in one plan (the data-parallel one at least)
    assert any(r[p]["output"].startswith("S") for p in plans)


def test_classifier_regularizers_and_accuracy_equal_keras_fit(results: dict) -> None:
    r = results["classifier"]
    _check_plans(r, {"sparse_categorical_accuracy", "top2"})
    # the orthogonal regularizer is not a sum of per-element terms: gathered when split
    hows = {h for p in _plans(r) for h in r[p]["regularizers"].values()}
    assert {"replicated", "sum-of-shards", "gathered"} <= hows, hows
    # a split kernel's term: one all-reduce of its value (4 bytes); a gathered one: the
    # kernel's 16 x 4 float32 values all-gathered (256 bytes)
    losses = [c for p in _plans(r) for c in r[p]["audit"]["loss"]]
    assert ["AR", 4] in losses and ["AG", 256] in losses, losses


def test_binary_mae_and_auc_equal_keras_fit(results: dict) -> None:
    _check_plans(results["binary"], {"mae", "auc"})


def test_two_outputs_with_loss_weights_and_sample_weights_equal_keras_fit(
        results: dict) -> None:
    """Compiled with a loss and loss_weights per output name: the weighted total, each
    output's own loss (``value_loss``, ``label_loss``) and metrics (``value_mae``,
    ``label_sparse_categorical_accuracy``), their val_ logs, the weights and evaluate
    (with sample weights; and with a dict of targets) equal Keras's."""
    r = results["two_outputs"]
    _check_plans(r, {"value_loss", "label_loss", "value_mae",
                     "label_sparse_categorical_accuracy"})
    for name in _plans(r):
        assert r[name]["evaluate_dict"]["ok"], (name, r[name]["evaluate_dict"])
        assert len(r[name]["evaluate"]["ours"]) == 5   # loss, 2 losses, 2 metrics


def test_dict_outputs_train_and_predict_as_keras(results: dict) -> None:
    """Outputs as a dict, a loss per output name, a dict of targets: History and weights
    equal Keras's fit, evaluate on 21 examples (a last batch of 5) equal Keras's, and
    predict returns Keras's dict of arrays."""
    r = results["dict_outputs"]
    assert r["history"]["ok"] and r["weights"]["ok"], r
    # a last partial batch counted as Keras counts it: loss, each output's, the metrics
    assert len(r["evaluate_partial"]) == 5, r["evaluate_partial"]
    for key, c in r["evaluate_partial"].items():
        assert c["ok"], (key, c)
    assert r["predict"]["ok"] and r["predict"]["kinds"] == ["dict", "dict"], r["predict"]
    two = results["two_outputs"]["searched"]["predict"]
    assert two["ok"] and two["kinds"] == ["list", "list"], two   # a list stays a list


def test_losses_the_call_adds_equal_keras_fit(results: dict) -> None:
    """An L1 activity regularizer and a layer's ``self.add_loss`` (both captured as extra
    outputs of the program) are in the loss as Keras adds ``model.losses``: History,
    weights, evaluate and verify equal Keras's under every plan."""
    r = results["call_losses"]
    assert len(r["captured"]) == 2, r["captured"]
    _check_plans(r, {"mae"})


def test_a_resumed_epoch_continues_its_metrics(results: dict) -> None:
    """Crashed before step 4 of epoch 1 and resumed from the checkpoint of step 2: the
    epoch's accuracy and top-2 accuracy count its first two steps (the metric state in
    the checkpoint), so the History equals the uninterrupted run's."""
    r = results["resume"]
    assert r["raised"]
    assert r["keys"] == ["loss", "sparse_categorical_accuracy", "top2"]
    for key, c in r["history"].items():
        assert c["ok"], (key, c)


def test_metrics_over_two_workers_equal_keras_fit(tmp_path) -> None:
    """2 worker processes (MultiWorkerMirroredStrategy), each reading its half of every
    batch: loss, mae, AUC and their val_ values, computed from the outputs and targets
    gathered over both workers, equal Keras fit on one device, on both workers."""
    results = run_worker(WORKER, {"devices": 2, "dir": str(tmp_path),
                                  "checks": ["workers"]}, 2, 300.0)
    for task, res in enumerate(results):
        r = res["workers"]
        assert "error" not in r, (task, r.get("traceback"))
        assert r["cut"], r   # each worker reads only its share
        assert r["keys"] == r["keras_keys"] == ["auc", "loss", "mae", "val_auc", "val_loss",
                                                "val_mae"], r["keys"]
        for key, c in r["history"].items():
            assert c["ok"], (task, key, c)
