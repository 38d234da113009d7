"""tapas.execution.fit: ``ParallelModel.fit`` equals Keras's ``Model.fit``, its checkpoints
are atomic, and a resumed run equals an uninterrupted one exactly.

In worker processes (tests/fit_worker.py, 2 logical CPU devices, a random plan that shards
a two-input model): fit on a dict of arrays and on a ``tf.data.Dataset`` of dict elements
against Keras fit on one device (loss, val_loss and learning-rate history, weights, the
epoch EarlyStopping stops at, the hooks called, CSVLogger rows, TensorBoard tags),
``evaluate`` over a dataset, TerminateOnNaN; a run whose checkpoint save crashes half-way,
resumed by a new ParallelModel, against an uninterrupted run (Adam: weights and slots
bit-equal). In this process: refused callbacks, checkpoint listing, ``tapas train --data``
with ``--checkpoint_dir`` and ``--resume``.
"""

from __future__ import annotations

import json
import os

import keras
import pytest

from tapas.execution import fit
from worker_main import run_worker  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fit_worker.py")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = str(tmp_path_factory.mktemp("fit"))
    (res,) = run_worker(WORKER, {"devices": 2, "dir": d, "checks": ["keras", "resume"]},
                        1, 300.0)
    for name, r in res.items():
        assert "error" not in r, (name, r.get("traceback"))
    return res


def test_fit_on_arrays_equals_keras_fit_with_callbacks(two: dict) -> None:
    r = two["keras"]
    assert r["sharded"] > 0
    # EarlyStopping stops both at the same epoch (before the 6 asked for)
    assert r["epochs"]["ours"] == r["epochs"]["keras"] and len(r["epochs"]["ours"]) < 6
    for key in ("loss", "val_loss", "learning_rate"):
        assert r[key]["ok"], (key, r[key])
    assert r["learning_rate"]["ours"][1] == r["learning_rate"]["ours"][0] / 2
    assert r["weights"]["ok"], r["weights"]
    assert r["hooks"]["ours"] == r["hooks"]["keras"]
    assert r["hooks"]["batch_keys"] == ["loss"]
    assert r["csv_rows"] == len(r["epochs"]["ours"]) + 1   # header + one row per epoch
    assert {"loss", "step_seconds", "examples_per_second", "learning_rate",
            "epoch_loss", "epoch_val_loss"} <= set(r["tags"])
    assert r["iterations"] == 5 * len(r["epochs"]["ours"])


def test_fit_on_a_dataset_of_dicts_and_evaluate_equal_keras(two: dict) -> None:
    r = two["keras"]
    assert r["dataset_loss"]["ok"], r["dataset_loss"]
    assert r["dataset_weights"]["ok"], r["dataset_weights"]
    assert r["evaluate"]["ok"] and r["evaluate_arrays"]["ok"], (r["evaluate"],
                                                              r["evaluate_arrays"])


def test_non_finite_loss_raises_or_terminates_on_nan(two: dict) -> None:
    r = two["keras"]
    assert r["nan_without_callback"].startswith("StepError") and \
        "not finite" in r["nan_without_callback"]
    assert r["terminate_on_nan"]["epochs"] == [0] and r["terminate_on_nan"]["loss_is_nan"]


def test_crash_in_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(two: dict) -> None:
    r = two["resume"]
    assert r["crash"].startswith("injected crash")
    assert r["saves"] == [3, 5, 6, 9]   # every 3 steps and each epoch end (5 steps/epoch)
    assert r["left"] == [".tmp-ckpt-00000009", "ckpt-00000005", "ckpt-00000006"]  # keep=2
    assert r["latest"] == "ckpt-00000006"
    assert r["state"] == {"step": 6, "epoch": 1, "step_in_epoch": 1, "pass_index": 1,
                          "pass_position": 1, "batches_consumed": 6, "loss_count": 1}
    assert r["left_after"] == ["ckpt-00000012", "ckpt-00000015"]   # temporaries removed
    assert r["weights_equal"] and r["slots_equal"], r["weights_max_diff"]
    assert r["iterations"] == [15, 15]
    assert r["history"]["full"] == r["history"]["resumed"]


@pytest.mark.parametrize("callback,fix", [
    (keras.callbacks.ModelCheckpoint("m.keras"), "checkpoint_dir"),
    (keras.callbacks.BackupAndRestore("/tmp/b"), "resume=True"),
    (keras.callbacks.TensorBoard("/tmp/tb"), "tensorboard="),
])
def test_unsupported_keras_callbacks_are_refused_by_name(callback, fix: str) -> None:
    with pytest.raises(ValueError, match=type(callback).__name__) as err:
        fit.fit(None, callbacks=[callback])
    assert fix in str(err.value)


def test_only_complete_checkpoints_are_listed(tmp_path) -> None:
    for name, complete in [("ckpt-00000004", True), ("ckpt-00000010", True),
                           ("ckpt-00000012", False), (".tmp-ckpt-00000014", True)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / fit.FIT_STATE).write_text(json.dumps({}))
    assert [os.path.basename(p) for p in fit.list_checkpoints(str(tmp_path))] == \
        ["ckpt-00000004", "ckpt-00000010"]
    assert fit.latest_checkpoint(str(tmp_path)).endswith("ckpt-00000010")
    assert fit.latest_checkpoint(str(tmp_path / "none")) is None
    with pytest.raises(ValueError, match="tapas-fit-1"):
        fit.FitState.from_json({"format": "other"}, "x")


# ---- tapas train --data / --checkpoint_dir / --resume --------------------------------------

def _two_input_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="concat")([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(h))


def _tapas_train(*args: str) -> dict:
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tapas.cli", "train", *args],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"out": proc.stdout, "err": proc.stderr}


def test_tapas_train_data_checkpoints_and_resume_equal_an_uninterrupted_run(tmp_path) -> None:
    """--data=file.npz for 1 epoch with --checkpoint_every=2, then the same command with
    --epochs=2 --resume: the second epoch's losses and the final checkpoint's every variable
    equal a 2-epoch run without interruption."""
    import numpy as np
    import tensorflow as tf
    model = _two_input_model()
    model.compile("sgd", "mse")
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", a=rng.standard_normal((42, 6)).astype("float32"),
             b=rng.standard_normal((42, 4)).astype("float32"),
             y=rng.standard_normal((42, 3)).astype("float32"))
    common = [f"--model={tmp_path / 'm.keras'}", f"--data={tmp_path / 'd.npz'}",
              "--devices=2", "--strategy=random:0"]
    ck, ck2, tb = tmp_path / "ck", tmp_path / "ck2", tmp_path / "tb"
    first = _tapas_train(*common, "--epochs=1", f"--checkpoint_dir={ck}",
                         "--checkpoint_every=2", f"--tensorboard={tb}",
                         f"--json_out={tmp_path / 'r1.json'}")
    assert "dropped" in first["err"]   # 42 examples: 5 batches of 8, 2 dropped (noted)
    _tapas_train(*common, "--epochs=2", f"--checkpoint_dir={ck}", "--resume",
                 f"--json_out={tmp_path / 'r2.json'}")
    _tapas_train(*common, "--epochs=2", f"--checkpoint_dir={ck2}",
                 f"--json_out={tmp_path / 'r3.json'}")
    r1, r2, r3 = (json.loads((tmp_path / f"r{k}.json").read_text()) for k in (1, 2, 3))
    assert r2["resumed_from"].endswith("ckpt-00000005")
    assert len(r1["losses"]) == len(r2["losses"]) == 5 and r2["step"] == r3["step"] == 10
    assert r1["losses"] + r2["losses"] == r3["losses"]
    assert r2["history"] == r3["history"] and len(r3["history"]["loss"]) == 2
    assert sorted(os.listdir(ck)) == ["ckpt-00000004", "ckpt-00000005", "ckpt-00000010"]
    a = tf.train.load_checkpoint(str(ck / "ckpt-00000010" / "task0"))
    b = tf.train.load_checkpoint(str(ck2 / "ckpt-00000010" / "task0"))
    keys = [k for k in a.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")]
    assert len(keys) >= 5   # the step counter and the shards of 4 weights on 2 replicas
    for k in keys:
        np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), err_msg=k)
    assert any(f.startswith("events") for f in os.listdir(tb))


def test_npz_layout_is_checked_with_the_fix(tmp_path) -> None:
    import numpy as np

    from tapas.execution import inputs, train

    import tensorflow as tf
    signature = inputs.InputSignature.of(_two_input_model(), {
        "a": tf.TensorSpec([8, 6]), "b": tf.TensorSpec([8, 4])})

    class Fake:
        inputs = signature

    np.savez(tmp_path / "d.npz", a=np.zeros((4, 6)), y=np.zeros((4, 3)), z=np.zeros(4))
    with pytest.raises(train.TrainError, match=r"missing \['b'\], unexpected \['z'\]"):
        train.load_npz(str(tmp_path / "d.npz"), Fake())
    np.savez(tmp_path / "ok.npz", a=np.zeros((4, 6)), b=np.ones((4, 4)), y=np.zeros((4, 3)))
    x, y = train.load_npz(str(tmp_path / "ok.npz"), Fake())
    assert sorted(x) == ["a", "b"] and y.shape == (4, 3)
