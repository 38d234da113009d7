"""``tapas train --workers=K --elastic``: a worker killed mid-epoch, the job restarts by
itself on the workers that remain from the newest checkpoint (resharded for them, the plan
drawn again for the new device count) and reaches the requested step count; the log and
the report say which steps are redone, and the weights it resumed with are the
checkpoint's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

from tests import command
from tests.test_fit import _two_input_model
from tests.test_memory import _reassembled

EPOCHS, BATCHES = 4, 6   # 42 examples: 5 batches of 8 an epoch and one of 2


def _scalars(logdir) -> dict:
    """``{tag: {step: value}}`` of every event file under ``logdir`` (the later write of a
    step wins, as TensorBoard shows a redone step)."""
    import tensorflow as tf
    out: dict = {}
    for name in sorted(os.listdir(logdir), key=lambda n: os.path.getmtime(logdir / n)):
        for event in tf.compat.v1.train.summary_iterator(str(logdir / name)):
            for v in event.summary.value:
                if v.HasField("tensor"):
                    out.setdefault(v.tag, {})[event.step] = float(tf.make_ndarray(v.tensor))
    return out


def _save_model_and_data(tmp_path) -> None:
    """The two-input model compiled with SGD as m.keras, 42 examples of its data as d.npz."""
    model = _two_input_model()
    model.compile("sgd", "mse")
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", a=rng.standard_normal((42, 6)).astype("float32"),
             b=rng.standard_normal((42, 4)).astype("float32"),
             y=rng.standard_normal((42, 3)).astype("float32"))


def test_elastic_job_survives_a_killed_worker(tmp_path) -> None:
    from tapas.execution.api import fit
    _save_model_and_data(tmp_path)
    common = [f"--model={tmp_path / 'm.keras'}", f"--data={tmp_path / 'd.npz'}",
              "--strategy=random:0", f"--epochs={EPOCHS}"]
    ck, out_json = tmp_path / "ck", tmp_path / "elastic.json"
    argv = [sys.executable, "-m", "tapas.cli", "train", *common, "--workers=3", "--elastic",
            "--elastic_wait_s=1", f"--checkpoint_dir={ck}", "--checkpoint_every=3", f"--json_out={out_json}",
            f"--tensorboard={tmp_path / 'tb'}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=command.ROOT)
    try:
        command.kill_worker_after_first_checkpoint(proc, ck, 150)
        # up to the restart's line, which names the checkpoint it resumes from
        head = _read_until(proc, "; restarting on", "")
        resumed = re.search(r"restarting on 2 workers from (\S+) \(step", head)
        assert resumed, head[-3000:]
        shutil.copytree(resumed.group(1), tmp_path / "at_resume" / os.path.basename(
            resumed.group(1)))   # before the restarted job's newer checkpoints replace it
        out, _ = proc.communicate(timeout=240)
        out = head + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "elastic: worker 1 lost (exit code -9); restarting on 2 workers from" in out, out
    assert "elastic: no replacement within 1 s" in out, out[-4000:]   # --elastic_wait_s
    report = json.loads(out_json.read_text())
    start = int(os.path.basename(report["resumed_from"]).split("-")[1])
    assert 3 <= start < EPOCHS * BATCHES
    (restart,) = report["elastic"]
    redone = restart.pop("redone_steps")
    assert restart.pop("replacement_after_s") is None
    assert restart == {"lost_worker": 1, "exit_code": -9, "workers": 2, "resumed_step": start}
    # the log says which steps the lost job had finished after the checkpoint
    assert redone == list(range(start + 1, start + 1 + len(redone)))
    assert (f"(step {start}; steps {start + 1} to {redone[-1]}, done before the loss, are "
            "redone)" if redone else f"(step {start}; no step after it was finished)") in out
    assert report["workers"] == 2 and report["step"] == EPOCHS * BATCHES
    assert len(report["history"]["loss"]) == EPOCHS
    assert len(report["losses"]) == EPOCHS * BATCHES - start   # nothing skipped
    # TensorBoard: 3 workers from step 0, 2 (and one restart) from the resume point
    scalars = _scalars(tmp_path / "tb")
    assert scalars["workers"][0] == 3 and scalars["workers"][start] == 2
    assert scalars["elastic_restarts"] == {start: 1.0}
    assert max(scalars["loss"]) == EPOCHS * BATCHES
    # the same job without the loss, on 2 devices: the same weights up to float rounding
    # (the steps before the restart ran under the 3-device plan)
    ref = tmp_path / "ref"
    proc = command.run_tapas("train", *common, "--devices=2", f"--checkpoint_dir={ref}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = _reassembled(ck / os.path.basename(fit.latest_checkpoint(str(ck))))
    theirs = _reassembled(ref / os.path.basename(fit.latest_checkpoint(str(ref))))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # the weights at the resume point are the checkpoint's: the checkpoint resumed by one
    # process on 2 devices (the same plan) ends with the elastic job's weights
    at = tmp_path / "at_resume"
    proc = command.run_tapas("train", *common, "--devices=2", f"--checkpoint_dir={at}",
                             "--resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = _reassembled(at / os.path.basename(fit.latest_checkpoint(str(at))))
    for k in ours:
        np.testing.assert_allclose(ours[k], again[k], rtol=1e-6, atol=1e-7, err_msg=k)


def _read_until(proc, words: str, head: str) -> str:
    while words not in head and (line := proc.stdout.readline()):
        head += line
    assert words in head, head[-3000:]
    return head


def test_elastic_waits_for_a_replacement_worker(tmp_path) -> None:
    """``--elastic_wait_s``: after a loss a replacement joins (a file in
    CHECKPOINT_DIR/replacements) and the job goes on with 3 workers to the requested step
    (no replacement within the wait: the test above, which finishes on 2)."""
    from tapas.execution.api.train_launch import replacement_dir
    _save_model_and_data(tmp_path)
    ck, out_json = tmp_path / "ck", tmp_path / "elastic.json"
    argv = [sys.executable, "-m", "tapas.cli", "train", f"--model={tmp_path / 'm.keras'}",
            f"--data={tmp_path / 'd.npz'}", "--strategy=random:0", f"--epochs={EPOCHS}",
            "--workers=3", "--elastic", "--elastic_wait_s=60", f"--checkpoint_dir={ck}",
            "--checkpoint_every=3", f"--json_out={out_json}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=command.ROOT)
    try:
        command.kill_worker_after_first_checkpoint(proc, ck, 150)
        head = _read_until(proc, "elastic: waiting up to 60 s for a replacement", "")
        (tmp_path / "standby").write_text("")
        os.replace(tmp_path / "standby", os.path.join(replacement_dir(str(ck)), "standby"))
        out, _ = proc.communicate(timeout=240)
        out = head + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "elastic: a replacement joined after" in out, out[-4000:]
    assert re.search(r"restarting on 3 workers from \S+ \(step \d+", out), out[-4000:]
    report = json.loads(out_json.read_text())
    (joined,) = report["elastic"]
    assert joined["workers"] == 3 and joined["replacement_after_s"] is not None
    assert report["workers"] == 3 and report["step"] == EPOCHS * BATCHES
    assert not os.listdir(replacement_dir(str(ck)))   # the replacement was taken
