"""tapas.execution.api.fit: ``ParallelModel.fit`` equals Keras's ``Model.fit``, its checkpoints
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
import re

import keras
import numpy as np
import tensorflow as tf
import pytest

import command  # tests/command.py
from tapas.execution.api import fit
from worker_main import run_checked, run_worker  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fit_worker.py")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = str(tmp_path_factory.mktemp("fit"))
    return run_checked(WORKER, {"devices": 2, "dir": d,
                                "checks": ["keras", "resume", "weighted", "inference",
                                           "conveniences", "python_data",
                                           "model_checkpoint", "tails"]})


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
    assert r["hooks"]["ours"]["test_end"] == len(r["epochs"]["ours"])   # validation's
    assert r["csv_rows"] == len(r["epochs"]["ours"]) + 1   # header + one row per epoch
    assert {"loss", "step_seconds", "examples_per_second", "learning_rate",
            "collective_bytes_per_step", "epoch_loss", "epoch_val_loss",
            "GRAPH+collectives"} <= set(r["tags"])   # the graph tab: the parallel step
    assert r["iterations"] == 6 * len(r["epochs"]["ours"])   # 42 examples: 5 batches + 2


def test_validation_split_class_weight_and_validation_freq_equal_keras_fit(two: dict) -> None:
    r = two["conveniences"]
    assert r["keys"][0] == r["keys"][1] and "val_loss" in r["keys"][0], r["keys"]
    assert len(r["val_loss"]["keras"]) == 2   # validated after epochs 2 and 4 only
    for key in r["keys"][1]:
        assert r[key]["ok"], (key, r[key])
    assert r["weights"]["ok"], r["weights"]


def test_keras_fit_conveniences_are_checked_with_the_fix() -> None:
    from tapas.execution.api import fit_arguments as fa
    x, y = np.zeros((10, 2), "float32"), np.arange(10) % 2
    with pytest.raises(ValueError, match="validation_split=1.5.*\\[0, 1\\)"):
        fa.split_for_validation(x, y, None, 1.5, None)
    with pytest.raises(ValueError, match="a tf.data.Dataset: Keras splits arrays only.*"
                                         "validation_data="):
        fa.split_for_validation(tf.data.Dataset.from_tensors((x, y)), None, None, 0.2, None)
    with pytest.raises(ValueError, match="both given"):
        fa.by_class(x, y, np.ones(10), {0: 2.0})
    with pytest.raises(ValueError, match="several outputs"):
        fa.by_class(x, [y, y], None, {0: 2.0})
    with pytest.raises(ValueError, match="validation_freq=0"):
        fa.validates(0, 0)
    _, w = fa.by_class(x, y, None, {1: 4.0})
    assert w.tolist() == [1.0, 4.0] * 5
    with pytest.raises(ValueError, match="class_weight with a generator: Keras does not"):
        fa.by_class((b for b in [(x, y)]), None, None, {1: 4.0})

    class Triples(keras.utils.PyDataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return x, y, np.ones(10)
    weighted, _ = fa.by_class(Triples(), None, None, {1: 4.0})
    with pytest.raises(ValueError, match="PyDataset whose batches are 3-tuples"):
        weighted[0]
    tx, ty, _, (vx, vy) = fa.split_for_validation(x, y, None, 0.3, None)
    assert len(tx) == 7 and vy.tolist() == [1, 0, 1]   # the last examples, as Keras
    assert [fa.validates(e, [1, 3]) for e in range(4)] == [True, False, True, False]


def test_two_workers_read_their_shares_and_fit_equals_keras(tmp_path) -> None:
    """2 worker processes (MultiWorkerMirroredStrategy, a CPU each): a dataset of dict
    elements for 2 epochs, shuffled arrays, and a dataset function reading only its rows;
    a data-parallel plan (each worker reads half of every batch) and a random one whose
    input 'a' is replicated (read whole by both) and 'b' split: all equal Keras fit."""
    results = run_worker(WORKER, {"devices": 2, "dir": str(tmp_path), "checks": ["workers"],
                                  "plan_seed": 2}, 2, 300.0)
    for task, res in enumerate(results):
        r = res["workers"]
        assert "error" not in r, (task, r.get("traceback"))
        half = [0, 4 * task, 4 * task + 4]
        assert r["batch_shares"] == {"inputs": [half, half], "targets": "S0", "cut": True}
        assert r["random_shares"] == {"inputs": [None, half], "targets": "S0", "cut": True}
        for plan in ("batch", "random"):
            assert r[f"{plan}_dataset"]["loss"]["ok"], (task, plan, r[f"{plan}_dataset"])
            assert r[f"{plan}_dataset"]["weights"]["ok"], (task, plan)
            assert r[f"{plan}_arrays_weights"]["ok"], (task, plan, r[f"{plan}_arrays_weights"])
            tags = set(r[f"{plan}_tags"])   # the chief writes TensorBoard, the other nothing
            assert ({"loss", "epoch_loss", "collective_bytes_per_step",
                     "GRAPH+collectives"} <= tags) if task == 0 else not tags, (task, tags)
        # probed with one pipeline for the element spec, then read with this worker's
        assert r["fn_contexts"] == [[1, 0], [2, task]]
        assert r["fn"]["loss"]["ok"] and r["fn"]["weights"]["ok"], r["fn"]
        assert r["evaluate"]["ok"], r["evaluate"]


def test_a_lost_worker_ends_the_survivor_without_a_launcher(tmp_path) -> None:
    """Workers started by hand (TF_CONFIG set here, no tapas launcher): worker 1 is killed
    with SIGKILL while both train; worker 0 ends within 60 s with a WorkerLostError naming
    task 1. Both processes are this test's and are ended by it."""
    import signal
    import subprocess
    import sys
    import time

    from tapas.execution.runtime import launch
    ports = launch.free_ports(2)
    job = json.dumps({"devices": 2, "dir": str(tmp_path), "checks": ["long_fit"]})
    procs = []
    try:
        for i in range(2):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                       TF_CONFIG=launch.tf_config_for(ports, i))
            procs.append(subprocess.Popen([sys.executable, WORKER, job], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        survivor, victim = procs
        deadline = time.monotonic() + 240
        line = ""
        while not line.startswith("STEP 3") and time.monotonic() < deadline:
            line = survivor.stdout.readline()
            assert line or survivor.poll() is None, "worker 0 ended before training"
        assert line.startswith("STEP 3"), "no training step within the deadline"
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        out, _ = survivor.communicate(timeout=90)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    result = next(json.loads(l[len("RESULT "):]) for l in out.splitlines()
                  if l.startswith("RESULT "))
    assert waited < 60, waited
    assert result.get("lost") and "task:1" in result["lost"], result
    assert "resume" in result["lost"]


def test_fit_on_a_dataset_of_dicts_and_evaluate_equal_keras(two: dict) -> None:
    r = two["keras"]
    assert r["dataset_loss"]["ok"], r["dataset_loss"]
    assert r["dataset_weights"]["ok"], r["dataset_weights"]
    assert r["evaluate"]["ok"] and r["evaluate_arrays"]["ok"], (r["evaluate"],
                                                              r["evaluate_arrays"])
    # 42 examples: 5 global batches and 2 rows padded to one; a dataset of 2 batches
    assert r["predict"]["ok"] and len(r["predict"]["ours"]) == 42, r["predict"]
    assert r["predict_dataset"]["ok"] and len(r["predict_dataset"]["ours"]) == 16


def test_evaluate_and_predict_call_callbacks_and_print_as_keras(two: dict) -> None:
    """Keras's hooks in Keras's order with the same logs (running loss per batch, the
    final logs, each batch's outputs), the same progress bar or line (timings aside) for
    each verbose, nothing for verbose=0, and stop_evaluating honoured."""
    r = two["keras"]["evaluate_predict_hooks"]
    for verbose in ("auto", "1", "2", "0"):
        ours, keras_ = r[verbose]["ours"], r[verbose]["keras"]
        assert abs(ours["loss"] - keras_["loss"]) < 1e-5, (verbose, r[verbose])
        for key in ("evaluate_hooks", "predict_hooks"):
            assert _same_hooks(ours[key], keras_[key]), (verbose, key, ours, keras_)
        # values to 4 decimals; the bar's first and last lines (Keras's progress bar skips
        # the updates that follow the previous one within 0.05 s: the middle depends on time)
        for key in ("evaluate_printed", "predict_printed"):
            assert bool(ours[key]) == bool(keras_[key]), (verbose, key, ours, keras_)
            for a, b in zip(ours[key][:1] + ours[key][-1:], keras_[key][:1] + keras_[key][-1:]):
                assert _numbers(a, b, 2e-4), (verbose, key, a, b)
    assert r["0"]["ours"]["evaluate_printed"] == r["0"]["ours"]["predict_printed"] == []
    assert any("loss: " in ln for ln in r["auto"]["ours"]["evaluate_printed"])
    hooks = [h[0] for h in r["1"]["ours"]["predict_hooks"]]
    assert hooks[0] == "predict_begin" and hooks[-1] == "predict_end"
    assert hooks.count("predict_batch_end") == 6   # 42 examples, global batch 8
    stops = r["stop_evaluating"]
    assert abs(stops["ours"]["loss"] - stops["keras"]["loss"]) < 1e-4, stops
    assert _same_hooks(stops["ours"]["hooks"], stops["keras"]["hooks"]), stops
    assert [h[0] for h in r["stop_evaluating"]["ours"]["hooks"]].count("test_batch_end") == 2


def _same_hooks(ours: list, theirs: list) -> bool:
    """The same hooks with the same batches, logs keys and shapes; values within 1e-4."""
    if [(h[0], h[1], sorted(h[2])) for h in ours] != \
            [(h[0], h[1], sorted(h[2])) for h in theirs]:
        return False
    return all(np.allclose(np.asarray(a[2][k], "float64"), np.asarray(b[2][k], "float64"),
                           rtol=1e-4, atol=1e-4) for a, b in zip(ours, theirs) for k in a[2])


def _numbers(a: str, b: str, tol: float) -> bool:
    """Two printed lines equal but for their numbers, which are within ``tol``."""
    pattern = r"-?\d+\.\d+"
    if re.sub(pattern, "#", a) != re.sub(pattern, "#", b):
        return False
    return all(abs(float(u) - float(v)) <= tol for u, v in
               zip(re.findall(pattern, a), re.findall(pattern, b)))


def test_a_pydataset_and_a_generator_train_evaluate_and_predict_as_keras(two: dict) -> None:
    """keras.utils.PyDataset (with one for validation) and Python generators, as Keras's
    fit, evaluate and predict take them: History, weights and outputs equal Keras's; the
    PyDataset's epoch hooks once per pass; shuffled, a permutation of its batches per pass;
    a generator that runs out stops training (after Keras's same epochs) with a warning;
    what Keras refuses or cannot repeat refused with the fix."""
    r = two["python_data"]
    for key in ("loss", "val_loss", "weights"):
        assert r["pydataset"][key]["ok"], (key, r["pydataset"])
    assert r["pydataset"]["hooks"] == [3, 3, [0, 0, 1, 2, 3]]   # (index 0 read once first)
    for key in ("evaluate", "predict", "predict_generator"):
        assert r[key]["ok"], (key, r[key])
    first, second = r["shuffled"]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4] and first != second
    assert r["generator"]["loss"]["ok"] and r["generator"]["weights"]["ok"], r["generator"]
    assert r["ran_out"]["epochs"] == 2 and r["ran_out"]["steps"] == 3, r["ran_out"]
    assert r["ran_out"]["loss"]["ok"], r["ran_out"]
    refused = r["refused"]
    assert "y was given with a PyDataset" in refused["y"] and "leave y out" in refused["y"]
    assert "a generator is read once" in refused["validation"]
    assert "(x, y) pairs" in refused["no_targets"]
    assert "Keras splits arrays only" in refused["split"]
    assert r["class_weight"]["loss"]["ok"] and r["class_weight"]["weights"]["ok"], r


def test_model_checkpoint_writes_keras_files_equal_to_keras_fits(two: dict) -> None:
    """Keras's ModelCheckpoint: the same files as Keras's fit (the best model by val_loss,
    the weights of every epoch), with equal weights and optimizer variables, from which
    Keras's fit goes on equally; ParallelModel.save of a .keras path and save_weights
    equal to the Keras model's state after Keras's fit; a whole-model file of an
    optimizer the model was not compiled with refused before training, with the fix."""
    r = two["model_checkpoint"]
    assert r["files"] == sorted([f"{w}_{e}.weights.h5" for w in ("keras", "ours")
                                 for e in (1, 2, 3)] + ["keras_best.keras",
                                                        "ours_best.keras"]), r["files"]
    assert r["best_weights"] and r["weights_files"] == [True, True, True], r
    opt = r["optimizer"]
    assert opt["names"] and opt["equal"] and opt["count"] == 10, opt   # Adam: 2 + 2 x 4
    assert opt["iterations"] > 0
    assert r["continued"]["ok"], r["continued"]
    assert r["save"] == {"weights": True, "save_weights": True, "optimizer": True}, r["save"]
    assert "compiled with Adam, the runtime steps with SGD" in r["other_optimizer"]
    assert "save_weights_only=True" in r["other_optimizer"]


def test_whole_model_files_keras_cannot_hold_are_refused_with_the_fix() -> None:
    """What Keras's .keras file cannot hold as the runtime does, named before training:
    a Keras 2 optimizer, a loss scale, another optimizer class than the compiled one."""
    import types
    from tapas.execution.runtime.values import GlobalValues

    def runtime(state: dict, cls: type) -> types.SimpleNamespace:
        return types.SimpleNamespace(optimizer=types.SimpleNamespace(state=state,
                                                                     keras_class=cls))

    def model(optimizer):
        return types.SimpleNamespace(name="m", optimizer=optimizer)
    adam = keras.optimizers.Adam()
    GlobalValues.check_optimizer_export(runtime({}, keras.optimizers.Adam), model(adam))
    GlobalValues.check_optimizer_export(runtime({}, keras.optimizers.Adam), model(None))
    with pytest.raises(ValueError, match="compiled with Adam, the runtime steps with SGD.*"
                                         "save_weights_only=True"):
        GlobalValues.check_optimizer_export(runtime({}, keras.optimizers.SGD), model(adam))
    with pytest.raises(ValueError, match="beyond its slots .*a loss scale"):
        GlobalValues.check_optimizer_export(
            runtime({}, keras.optimizers.Adam),
            model(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())))
    tf_keras = pytest.importorskip("tf_keras")
    with pytest.raises(ValueError, match="Keras 2 \\(tf_keras\\) optimizer"):
        GlobalValues.check_optimizer_export(runtime({}, keras.optimizers.Adam),
                                            model(tf_keras.optimizers.Adam()))


def test_model_checkpoint_state_is_kept_for_resume() -> None:
    cb = keras.callbacks.ModelCheckpoint("m.keras", monitor="val_loss", save_best_only=True)
    cb.best, cb._batches_seen_since_last_saving = 0.25, 3
    entries, _ = fit.callback_states([cb])
    assert entries == [{"class": "ModelCheckpoint", "state": {
        "best": 0.25, "_batches_seen_since_last_saving": 3, "_last_batch_seen": None}}]


def test_sample_weights_weigh_the_loss_as_keras(two: dict) -> None:
    r = two["keras"]
    assert r["weighted"]["loss"]["ok"] and r["weighted"]["val_loss"]["ok"], r["weighted"]
    assert r["weighted_weights"]["ok"] and r["weighted_dataset"]["ok"]
    assert r["weighted_evaluate"]["ok"], r["weighted_evaluate"]


def test_weighted_steps_equal_keras_train_on_batch(two: dict) -> None:
    r = two["weighted"]
    assert r["targets"] == ["R", "S0"]
    cases = {k: v for k, v in r.items() if k not in ("check", "targets")}
    assert len(cases) == 6   # 2 plans x 3 reductions
    for name, v in cases.items():
        assert v["loss"]["ok"] and v["weights"]["ok"], (name, v)


def test_val_loss_and_evaluate_run_in_inference_mode_as_keras(two: dict) -> None:
    """Dropout + batch norm: training-mode steps, inference-mode validation, evaluate and
    predict (the same weight shards, a copy of those the inference plan must place
    otherwise), as Keras's."""
    for seed, r in two["inference"].items():
        if seed == "check":
            continue
        for key in ("loss", "val_loss", "evaluate", "predict", "predict_padded",
                    "predict_batch"):
            assert r[key]["ok"], (seed, key, r[key])
        assert r["separate"] and r["shared"] > 0, (seed, r)
    assert two["inference"]["seed 0"]["resynced"]   # this plan needs copies


def test_a_last_batch_is_filled_up_where_exact_else_dropped_saying_why(two: dict) -> None:
    """Dropout: every example trains, as in Keras's fit (the masks of the filled-up batch's
    own rows are Keras's). Rows combined (a batch mean, batch norm's statistics): the last
    3 examples are dropped with a note naming the op, and training equals Keras's fit on
    the first 40. evaluate counts all 43 where the inference graph keeps the rows apart
    (batch norm on its moving statistics), the first 40 where it does not; predict refuses
    a last batch whose padding changes the outputs, and pads one whose rows' outputs are the
    same padded either way (an op without a rule, lgamma)."""
    r = {k: v for k, v in two["tails"].items() if k != "check"}
    assert len(r) == 8
    for name, v in r.items():
        assert v["loss"]["ok"] and v["weights"]["ok"] and v["evaluate"]["ok"], (name, v)
        if name.startswith("dropout"):
            assert v["notes"] == [], (name, v["notes"])
        else:
            assert len(v["notes"]) == 1 and "the last 3 examples" in v["notes"][0]
            op = {"centred": "centre_1/Mean", "batch_norm": "bn_1/moments",
                  "unruled": "lgamma_1/Lgamma"}[name.split()[0]]
            assert f"would not be exact: op '" in v["notes"][0] and op in v["notes"][0], \
                (name, v["notes"])
        if name.startswith("centred"):
            assert "a last batch of 3 rows" in v["predict"] and "centre_1/Mean" in v["predict"]
            assert "give a multiple of 8 examples" in v["predict"], v["predict"]
        else:
            assert v["predict"]["ok"], (name, v["predict"])


def test_early_stopping_restores_the_best_weights_as_keras(two: dict) -> None:
    r = two["keras"]["restore_best"]
    assert r["epochs"][0] == r["epochs"][1] == [0, 1]   # no epoch improves by 10
    assert r["weights"]["ok"], r["weights"]   # both back at epoch 1's weights


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
    (keras.callbacks.TensorBoard("/tmp/tb"), "tensorboard="),
])
def test_unsupported_keras_callbacks_are_refused_by_name(callback, fix: str) -> None:
    with pytest.raises(ValueError, match=type(callback).__name__) as err:
        fit.fit(None, callbacks=[callback])
    assert fix in str(err.value)


def test_a_keras2_callback_is_refused_naming_its_keras3_twin() -> None:
    import tf_keras
    with pytest.raises(TypeError, match="Keras 2.*keras.callbacks.EarlyStopping"):
        fit.fit(None, callbacks=[tf_keras.callbacks.EarlyStopping()])
    with pytest.raises(TypeError, match="not a keras.callbacks.Callback"):
        fit.fit(None, callbacks=[object()])


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


def _variables(directory) -> dict:
    """Every variable of a checkpoint directory, over its per-worker files."""
    import tensorflow as tf
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".index"):
            reader = tf.train.load_checkpoint(os.path.join(directory, f[:-len(".index")]))
            out.update({k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                        if k.endswith("VARIABLE_VALUE")})
    return out


def test_killed_worker_then_resume_equals_an_uninterrupted_run(tmp_path) -> None:
    """``tapas train --workers=2 --data=... --checkpoint_every=3``; worker 1 killed with
    SIGKILL once a checkpoint exists: the run exits non-zero within 60 s naming it. The
    same command with --resume finishes; its step losses, the final checkpoint's every
    variable and the step and batch counts equal a 2-device run without interruption."""
    import subprocess
    import sys
    import time

    import numpy as np
    model = _two_input_model()
    model.compile("sgd", "mse")
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", a=rng.standard_normal((42, 6)).astype("float32"),
             b=rng.standard_normal((42, 4)).astype("float32"),
             y=rng.standard_normal((42, 3)).astype("float32"))
    epochs, steps = 10, 10 * 6   # 42 examples: 5 batches of 8 an epoch and one of 2
    common = [f"--model={tmp_path / 'm.keras'}", f"--data={tmp_path / 'd.npz'}",
              "--strategy=random:0", f"--epochs={epochs}"]
    ck, ref, tb = tmp_path / "ck", tmp_path / "ref", tmp_path / "tb"
    job = [*common, "--workers=2", f"--checkpoint_dir={ck}", "--checkpoint_every=3",
           f"--tensorboard={tb}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen([sys.executable, "-m", "tapas.cli", "train", *job],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        killed = command.kill_worker_after_first_checkpoint(proc, ck, 120)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert time.monotonic() - killed < 60
    assert "worker 1" in out or "task:1" in out, out[-3000:]
    assert "--resume" in out, out[-3000:]

    _tapas_train(*job, "--resume", f"--json_out={tmp_path / 'resumed.json'}")
    _tapas_train(*common, "--devices=2", f"--checkpoint_dir={ref}",
                 f"--json_out={tmp_path / 'ref.json'}")
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    full = json.loads((tmp_path / "ref.json").read_text())
    start = int(os.path.basename(resumed["resumed_from"]).split("-")[1])
    assert 3 <= start < steps
    assert resumed["step"] == full["step"] == steps
    assert resumed["losses"] == full["losses"][start:]   # no step repeated or skipped
    assert resumed["history"] == full["history"]
    with open(os.path.join(resumed["checkpoint"], fit.FIT_STATE)) as f:
        state = json.load(f)
    assert (state["step"], state["batches_consumed"], state["epoch"]) == (steps, steps, epochs)
    ours, theirs = _variables(resumed["checkpoint"]), _variables(full["checkpoint"])
    assert sorted(ours) == sorted(theirs) and len(ours) >= 9   # step + 4 weights x 2 shards
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    assert any(f.startswith("events") for f in os.listdir(tb))


def test_npz_layout_is_checked_with_the_fix(tmp_path) -> None:
    import numpy as np

    from tapas.execution.runtime import inputs

    from tapas.execution.api import train

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


def test_tapas_train_on_tfrecord_files_equals_keras_fit(tmp_path) -> None:
    """``tapas train --data='part-*.tfrecord'`` (two files, read in order, a partial last
    batch dropped) for 2 epochs on 2 devices: the epoch losses (the second epoch's after
    the first's updates) equal Keras fit on the same examples in the same order."""
    import numpy as np

    from tapas.execution.api import train
    model = _two_input_model()
    model.compile("sgd", "mse")
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((21, k)).astype("float32") for k in (6, 4))
    y = rng.standard_normal((21, 3)).astype("float32")
    train.save_tfrecord(str(tmp_path / "part-0.tfrecord"), {"a": a[:13], "b": b[:13]}, y[:13])
    train.save_tfrecord(str(tmp_path / "part-1.tfrecord"), {"a": a[13:], "b": b[13:]}, y[13:])
    _tapas_train(f"--model={tmp_path / 'm.keras'}", f"--data={tmp_path / 'part-*.tfrecord'}",
                 "--batch_size=8", "--devices=2", "--strategy=random:0", "--epochs=2",
                 f"--json_out={tmp_path / 'r.json'}")
    report = json.loads((tmp_path / "r.json").read_text())
    ref = _two_input_model()
    ref.compile("sgd", "mse")
    hist = ref.fit({"a": a[:16], "b": b[:16]}, y[:16], batch_size=8, epochs=2,
                   shuffle=False, verbose=0)
    assert report["step"] == 4   # 2 global batches an epoch, 5 examples dropped
    np.testing.assert_allclose(report["history"]["loss"], hist.history["loss"], rtol=1e-5)


def test_tfrecord_layout_is_checked_with_the_fix(tmp_path) -> None:
    import numpy as np
    import tensorflow as tf

    from tapas.execution.runtime import inputs

    from tapas.execution.api import train
    signature = inputs.InputSignature.of(_two_input_model(), {
        "a": tf.TensorSpec([8, 6]), "b": tf.TensorSpec([8, 4])})

    class Fake:
        inputs = signature

        class program:
            output_shapes = [[8, 3]]

    path = str(tmp_path / "bad.tfrecord")
    train.save_tfrecord(path, {"a": np.zeros((2, 6)), "c": np.zeros((2, 4))}, np.zeros((2, 3)))
    with pytest.raises(train.TrainError, match=r"missing \['b'\], unexpected \['c'\]"):
        train.load_tfrecord(path, Fake())
    train.save_tfrecord(path, {"a": np.zeros((2, 5)), "b": np.zeros((2, 4))}, np.zeros((2, 3)))
    with pytest.raises(train.TrainError, match=r"'a' holds 5 values .* shape \[6\]"):
        train.load_tfrecord(path, Fake())
    train.save_tfrecord(path, {"a": np.zeros((2, 6)), "b": np.zeros((2, 4))}, np.zeros((2, 2)))
    with pytest.raises(train.TrainError, match=r"'y' holds 2 values per example.*\[3\]"):
        train.load_tfrecord(path, Fake())
    # class ids (one integer per example) for a 3-way output
    train.save_tfrecord(path, {"a": np.ones((9, 6)), "b": np.ones((9, 4))},
                        np.arange(9) % 3)
    (x, y), = train.load_tfrecord(path, Fake()).take(1).as_numpy_iterator()
    assert x["a"].shape == (8, 6) and y.dtype == np.int32 and y.tolist() == [0, 1, 2] * 2 + [0, 1]


def test_resume_across_a_filled_up_last_batch_is_exact(two: dict) -> None:
    """42 examples (6 steps an epoch, the last of 2 examples), shuffled, Adam: crashed
    after step 10 and resumed from step 8's checkpoint, bit-equal to the uninterrupted
    run, with the same History."""
    r = two["resume"]["tail"]
    assert r["resumed_from"] == "ckpt-00000008" and r["steps"] == [18, 18], r
    assert r["weights_equal"] and r["history"][0] == r["history"][1], r


def test_resume_of_a_dataset_stream_across_passes_is_exact(two: dict) -> None:
    r = two["resume"]
    assert r["ds_crash"] == "injected crash after step 7"
    # 5 full batches a pass: step 6 is the first of pass 1
    assert r["ds_state"] == {"step": 6, "epoch": 1, "step_in_epoch": 2, "pass_index": 1,
                             "pass_position": 1, "batches_consumed": 6}
    assert r["ds_weights_equal"]
    resumed, full = r["ds_final"]
    assert resumed == full and full["step"] == full["batches_consumed"] == 12
    assert (full["pass_index"], full["pass_position"]) == (2, 2)


def test_backup_and_restore_is_fits_checkpoints_and_resume(two: dict) -> None:
    r = two["resume"]
    assert r["backup_left"] == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]  # keep=3
    assert r["backup_weights_equal"]
    assert r["backup_history"][0] == r["backup_history"][1]
    assert r["backup_deleted"]   # delete_checkpoint=True (Keras's default) after success


def test_callback_state_is_checkpointed_and_resumed(two: dict) -> None:
    """EarlyStopping's counter and best weights survive a crash: the resumed run stops at
    the uninterrupted run's epoch with its best weights; other stateful callbacks refused."""
    r = two["resume"]
    (saved,) = r["es_saved"]
    assert saved["class"] == "EarlyStopping" and saved["state"]["wait"] == 1
    assert saved["state"]["best_weights"] == {"arrays": 4}
    assert "tapas-callbacks.npz" in r["es_arrays"]
    full, resumed = r["es"]["epochs"]
    assert full == resumed == [0, 1, 2], r["es"]   # patience 2: stops after epoch 3
    assert r["es"]["weights_equal"]
    assert "['EarlyStopping']" in r["es_mismatch"] and "ReduceLROnPlateau" in r["es_mismatch"]


def test_backup_and_restore_with_checkpoint_dir_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="BackupAndRestore stands for fit"):
        fit.fit(None, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))],
                checkpoint_dir=str(tmp_path))
