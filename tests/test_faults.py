"""Bad input and faults: each ends in an error that names the cause and the fix, before any
work is done where it can be found up front, and no checkpoint is lost.

In a worker process (tests/faults_worker.py, 2 logical CPU devices): a damaged newest
checkpoint (truncated data, truncated fit state or layout, flipped bytes, a missing index)
is skipped with its reason and the run resumes from the one before, bit-equal to the
uninterrupted run; a checkpoint directory gone mid-run pauses saving while training goes
on; an unwritable one is refused before the first step. Through the ``tapas`` command: a
truncated or empty strategy file, impossible counts, ``--data`` that does not fit the
model, ``--learning_rate`` with ``--resume``. The launcher: its workers die with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import command  # tests/command.py
from worker_main import run_checked  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "faults_worker.py")


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = str(tmp_path_factory.mktemp("faults"))
    return run_checked(WORKER, {"dir": d, "checks": ["damaged", "paused", "unwritable",
                                                     "step_error", "py_function"]})


@pytest.mark.parametrize("damage, why", [
    ("truncated data", "has 2526 bytes, 5053 were written"),
    ("truncated tapas-fit.json", "tapas-fit.json cannot be read (JSONDecodeError"),
    ("truncated tapas-checkpoint.json", "tapas-checkpoint.json cannot be read"),
    ("flipped bytes", "its SHA-256 does not match"),
    ("missing index", "task0.index is missing"),
])
def test_a_damaged_newest_checkpoint_is_skipped_and_resume_is_exact(faults, damage, why):
    r = faults["damaged"][damage]
    assert r["usable"] == r["resumed_from"] == "ckpt-00000012", r
    assert [p for p, _ in r["skipped"]] == ["ckpt-00000015"]
    if damage == "truncated data":   # the sizes depend on the model: the form is checked
        assert "bytes," in r["skipped"][0][1] and "(truncated?)" in r["skipped"][0][1]
    else:
        assert why in r["skipped"][0][1], r["skipped"]
    assert any("skipping the checkpoint" in w and "ckpt-00000015" in w for w in r["warnings"])
    assert r["step"] == 20 and r["equal"], r   # weights and Adam slots bit-equal


def test_a_checkpoint_directory_gone_mid_run_pauses_saving_and_training_goes_on(faults):
    r = faults["paused"]
    assert r["step"] == 20 and r["equal"], r
    # the saves of steps 5 and 6 (directory away) skipped with a warning; 3 kept, 9 on
    assert len(r["warnings"]) == 2 and all("saving is paused and training goes on" in w
                                           for w in r["warnings"]), r["warnings"]
    assert "ckpt-00000005" in r["warnings"][0] and "is gone" in r["warnings"][0]
    assert r["kept"][:2] == ["ckpt-00000003", "ckpt-00000009"] and "ckpt-00000020" in r["kept"]


def test_an_unwritable_checkpoint_directory_is_refused_before_the_first_step(faults):
    r = faults["unwritable"]
    assert r["step"] == 0
    assert "cannot create it (Not a directory)" in r["uncreatable"]
    assert "is not writable" in r["read_only"] and "give --checkpoint_dir" in r["read_only"]
    # one checkpoint's size is estimated from its variables (the data files hold them plus
    # small headers), and a disk without room for it is refused with both sizes
    assert r["bytes"] <= r["saved_bytes"] <= r["bytes"] * 1.2 + 4096, r
    assert "MiB free, but one checkpoint of this model takes about" in r["no_space"]


def test_a_failed_replica_reports_tensorflows_own_error_not_the_cancellation(faults):
    r = faults["step_error"]
    assert len(r["errors"]) == 3
    for e in r["errors"]:
        assert e.startswith("StepError: training step 1 failed, weights unchanged"), e
        assert "Received a label value of 7 which is outside the valid range of [0, 4)" in e
        assert "RecvAsync" not in e and "[[" not in e, e
    assert r["unchanged"] and r["step"] == 1 and np.isfinite(r["good_loss"])


# ---- the command line ------------------------------------------------------------------------

def _err(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def test_a_truncated_or_empty_strategy_file_is_named_with_the_fix(tmp_path):
    truncated, empty = tmp_path / "t.json", tmp_path / "e.json"
    truncated.write_text('{"format": "tapas-strategy-1", "graph_name": "t5", "pat')
    empty.write_text("")
    err = _err(command.run_tapas("train", "--model=t5-tiny", "--devices=2",
                                 f"--strategy={truncated}", timeout=120))
    assert f"strategy file {truncated} is not valid JSON" in err and "truncated?" in err
    assert f"tapas search --out={truncated}" in err
    err = _err(command.run_tapas("train", "--model=t5-tiny", "--devices=2", "--training",
                                 f"--strategy={empty}", timeout=120))
    assert f"strategy file {empty} is empty" in err
    # the Python API: a ValueError naming the file, whatever the mode
    from tapas.planning.strategy import Strategy
    with pytest.raises(ValueError, match="is not valid JSON"):
        Strategy.load(str(truncated))
    with pytest.raises(ValueError, match="'random:SEED' is the command line's form"):
        Strategy.load("random:1")


@pytest.mark.parametrize("args, message", [
    (("--devices=0",), "--devices=0: the device count must be at least 1: pass --devices=N"),
    (("--devices=-1",), "--devices=-1: the device count must be at least 1"),
    (("--workers=-2",), "--workers=-2: the worker count cannot be negative"),
    (("--checkpoint_dir=CK", "--checkpoint_every=-5"), "--checkpoint_every=-5: the step "
                                                       "count between checkpoints must be"),
    (("--strategy=random:x",), "the seed 'x' is not an integer"),
])
def test_impossible_counts_are_refused_before_the_model_is_built(tmp_path, args, message):
    args = [a.replace("CK", str(tmp_path / "ck")) for a in args]
    start = time.monotonic()
    proc = command.run_tapas("train", "--model=t5-tiny", *args, timeout=120)
    assert message in _err(proc)
    assert "model t5-tiny" not in proc.stdout and time.monotonic() - start < 60


def test_data_that_does_not_fit_the_model_is_refused_before_the_capture(tmp_path):
    """t5-tiny takes int32 ids below 512 ([2, 16] each) and class ids y of [16] per
    example: each mistake is named with the fix, before anything is captured."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (4, 16)).astype("int32")
    good = dict(encoder_input_ids=ids, decoder_input_ids=ids, y=ids)
    cases = [({"encoder_input_ids": ids + 100000}, "holds the id 100", "largest embedding "
              "has 512 rows"),
             ({"y": ids[:, 0]}, "'y' holds examples of shape []", "of shape [16] per example"),
             ({"y": ids + 600}, "'y' holds the class id", "has 512 classes"),
             ({"encoder_input_ids": ids[:, :12]}, "holds examples of shape [12]",
              "the model takes [16] per example"),
             ({"decoder_input_ids": ids.astype("float32")}, "has dtype float32",
              "x.astype('int32')")]
    lines = []
    for k, (change, *_) in enumerate(cases):
        path = tmp_path / f"d{k}.npz"
        np.savez(path, **{**good, **change})
        lines.append(["train", "--model=t5-tiny", "--devices=2", "--strategy=random:0",
                      f"--data={path}"])
    for (change, *says), proc in zip(cases, command.run_tapas_each(*lines, timeout=300)):
        err = _err(proc)
        for s in says:
            assert s in err, (change.keys(), err[-1500:])
        assert "reconstructed" not in proc.stdout   # refused before the capture


def test_tfrecord_data_that_does_not_fit_is_refused_before_the_capture(tmp_path):
    """The same checks on TFRecord files (``save_tfrecord``'s layout): a missing feature,
    a token id beyond the vocabulary in the first batch, and a file that is no TFRecord."""
    from tapas.execution.api.train_data import save_tfrecord
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (4, 16)).astype("int32")
    (tmp_path / "junk.tfrecord").write_bytes(b"not a record" * 10)
    cases = [(dict(encoder_input_ids=ids), "missing ['decoder_input_ids']"),
             (dict(encoder_input_ids=ids, decoder_input_ids=ids + 1000),
              "but the model's largest embedding has 512 rows"),
             (None, "TensorFlow cannot read its records")]
    paths = []
    for k, (x, _) in enumerate(cases):
        paths.append(tmp_path / ("junk.tfrecord" if x is None else f"d{k}.tfrecord"))
        if x is not None:
            save_tfrecord(str(paths[-1]), x, ids)
    procs = command.run_tapas_each(*(["train", "--model=t5-tiny", "--devices=2",
                                      "--strategy=random:0", f"--data={p}"] for p in paths),
                                   timeout=300)
    for (_, says), path, proc in zip(cases, paths, procs):
        err = _err(proc)
        assert says in err and f"--data={path}" in err, err[-1500:]
        assert "reconstructed" not in proc.stdout   # refused before the capture


def test_learning_rate_with_resume_is_reported_and_damage_is_said(tmp_path):
    ck = tmp_path / "ck"
    common = ["train", "--model=t5-tiny", "--devices=2", "--strategy=random:0", "--steps=2",
              f"--checkpoint_dir={ck}", "--checkpoint_every=1"]
    proc = command.run_tapas(*common, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(ck / "ckpt-00000002" / "tapas-checkpoint.json", "r+") as f:
        f.truncate(40)
    proc = command.run_tapas(*common, "--epochs=2", "--resume", "--learning_rate=0.5",
                             timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping the damaged checkpoint" in proc.stdout and "ckpt-00000002" in proc.stdout
    assert f"resuming from {ck / 'ckpt-00000001'}" in proc.stdout
    assert "--learning_rate=0.5 is not used: --resume continues at the checkpoint's " \
           "learning rate (0.001" in proc.stderr, proc.stderr[-2000:]   # t5-tiny: AdamW(1e-3)


def test_the_launchers_workers_die_with_it(tmp_path):
    """A launcher killed with SIGKILL takes its workers with it (they would otherwise train
    on as orphans)."""
    pids = tmp_path / "pids"
    worker = ("import os, sys, time; open(sys.argv[1] + str(os.getpid()), 'w').close(); "
              "time.sleep(120)")
    code = ("import sys; from tapas.execution.runtime import launch; "
            f"launch.launch(lambda i: [sys.executable, '-c', {worker!r}, {str(pids)!r} + '/'],"
            " 2, timeout_s=120)")
    pids.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [int(p) for p in os.listdir(pids)]
        assert len(workers) == 2
        os.kill(launcher.pid, signal.SIGKILL)   # the process this test started
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:   # the workers this test started, if they outlived it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_reliability_cases_script_gives_clear_verdicts_on_a_slice(tmp_path):
    """scripts/reliability_cases.py on 4 of its cases (those that end before a model is
    built): each clear or working, the table and the JSON rows written."""
    rows_path = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                        "reliability_cases.py"),
                           "--only=train-help,bare,devices-0,strategy-truncated",
                           f"--json_out={rows_path}"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(rows_path.read_text())
    assert [(r["id"], r["verdict"]) for r in rows] == [
        ("train-help", "works"), ("bare", "clear"), ("devices-0", "clear"),
        ("strategy-truncated", "clear")]
    assert "clear: 3, works: 1" in proc.stdout


def test_the_reliability_verdicts_tell_a_crash_from_an_unclear_or_silent_error():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import reliability_cases as rc
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    case = rc.Case("x", "x", (), ("the fix",))
    assert rc.verdict(case, 1, "tapas train: bad: the fix") == "clear"
    assert rc.verdict(case, 1, "tapas train: bad") == "unclear"
    assert rc.verdict(case, 1, "Traceback (most recent call last):\n the fix") == "crash"
    assert rc.verdict(case, 0, "ran anyway") == "silent"
    assert rc.verdict(case, None, "") == "hang"
    assert rc.verdict(rc.Case("y", "y", (), ("done",), rc=0), 0, "done") == "works"


def test_a_sparse_or_ragged_batch_is_named_with_the_dense_fix():
    """A model captured with dense inputs (keras.Input(sparse=True) too) is given a
    tf.SparseTensor or a tf.RaggedTensor: the input, the dense shape and the conversion."""
    import keras
    import tensorflow as tf

    from tapas.execution.runtime.inputs import InputSignature
    inp = keras.Input((5,), name="x", sparse=True)
    signature = InputSignature.of(keras.Model(inp, keras.layers.Dense(2)(inp)),
                                  tf.TensorSpec([4, 5], name="x"))
    dense = np.eye(4, 5, dtype="float32")
    with pytest.raises(ValueError, match=r"input 'x' is a tf.SparseTensor; the program takes "
                                         r"a dense float32 \[4, 5\].*tf.sparse.to_dense\(x\)"):
        signature.flatten(tf.sparse.from_dense(dense))
    with pytest.raises(ValueError, match=r"is a tf.RaggedTensor.*x.to_tensor\(\)"):
        signature.flatten(tf.RaggedTensor.from_tensor(dense))
    assert signature.flatten(dense)[0].shape == (4, 5)



def test_a_py_function_is_named_stable_and_replicated():
    """A Lambda around tf.py_function: two captures of the model have one digest (the
    op's per-capture token is left out) and the search notes name the op it must run
    whole."""
    import numpy as np
    import tensorflow as tf
    import keras
    import tapas
    from tapas.planning.search import _unruled_notes
    from tapas.planning.strategy import graph_digest

    x = keras.Input((6,), name="x")

    def sine(t):
        y = tf.py_function(np.sin, [t], tf.float32)
        y.set_shape(t.shape)
        return y
    h = keras.layers.Lambda(sine, name="pyf")(keras.layers.Dense(8)(x))
    model = keras.Model(x, keras.layers.Dense(3)(h))
    spec = tf.TensorSpec([4, 6])
    first, second = tapas.capture(model, spec), tapas.capture(model, spec)
    assert graph_digest(first) == graph_digest(second)
    (note,) = _unruled_notes(first)
    assert "EagerPyFunc have no sharding rule" in note and "pyf" in note


def test_a_py_function_runs_replicated_and_verifies(faults):
    """Replicated inside random plans that split its neighbours, on 2 devices: the
    function is called anew per replica (its gradient recomputed under a tape, never
    another replica's cached tape) and the steps equal Keras's."""
    r = {k: v for k, v in faults["py_function"].items() if k.startswith("random:")}
    assert len(r) == 3 and all(v["ok"] for v in r.values()), r
    assert any(set(v["patterns"]) - {"replicate"} for v in r.values()), r
