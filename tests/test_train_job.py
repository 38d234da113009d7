"""``tapas train`` jobs on the synthetic batch: ``--steps`` with ``--resume`` is the total
the job reaches (tapas.execution.api.train_job.resumed_length), or the mismatch is said.

moe-tiny's inference graph on 2 logical devices under a random plan, through the command
as a user runs it (tests/command.py)."""

from __future__ import annotations

import json
import os
import types

import pytest

from tests import command

COMMON = ("train", "--model=moe-tiny", "--training=false", "--devices=2", "--strategy=random:0")


def _train(*args: str) -> str:
    proc = command.run_tapas(*COMMON, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("job")
    ck, ref = tmp / "ck", tmp / "ref"
    out = {}
    _train("--steps=4", f"--checkpoint_dir={ck}", f"--json_out={tmp / 'first.json'}")
    out["resumed_out"] = _train("--steps=8", f"--checkpoint_dir={ck}", "--resume",
                                f"--json_out={tmp / 'resumed.json'}")
    out["again_out"] = _train("--steps=8", f"--checkpoint_dir={ck}", "--resume",
                              f"--json_out={tmp / 'again.json'}")
    _train("--steps=8", f"--checkpoint_dir={ref}", f"--json_out={tmp / 'ref.json'}")
    for name in ("first", "resumed", "again", "ref"):
        out[name] = json.loads((tmp / f"{name}.json").read_text())
    out["ck"] = str(ck)
    return out


def test_steps_with_resume_is_the_total_the_job_reaches(runs) -> None:
    """A checkpoint at step 4 whose epoch was complete, then --steps=8 --resume: steps 5 to
    8 are trained, with the losses of an uninterrupted 8-step run."""
    first, resumed, ref = runs["first"], runs["resumed"], runs["ref"]
    assert first["step"] == 4 and len(first["losses"]) == 4
    assert resumed["step"] == 8 and len(resumed["losses"]) == 4
    assert os.path.basename(resumed["resumed_from"]) == "ckpt-00000004"
    assert resumed["losses"] == ref["losses"][4:]
    assert first["losses"] == ref["losses"][:4]
    assert "trains steps 5 to 8" in runs["resumed_out"]


def test_a_job_already_at_its_total_trains_nothing_and_says_so(runs) -> None:
    again = runs["again"]
    assert again["nothing_to_train"] and again["losses"] == [] and again["step"] == 8
    assert "nothing left to train" in runs["again_out"]
    assert "larger --steps" in runs["again_out"]


def test_a_total_epochs_cannot_lay_out_is_refused_with_the_fix(runs) -> None:
    """The checkpoint at step 8 ends epoch 2 (of 4 steps, then 4 more): --steps=3
    --epochs=4 (12 in all) cannot continue it in epochs of 3 steps; without --epochs a
    new epoch runs to the total; epochs of its own length continue as written."""
    from tapas.execution.api import train_job
    from tapas.execution.api.train_data import TrainError

    said: list[str] = []

    def opts(steps: int, epochs: int | None) -> types.SimpleNamespace:
        return types.SimpleNamespace(steps=steps, epochs=epochs, checkpoint_dir=runs["ck"])

    with pytest.raises(TrainError, match=r"step 8.*leave out --epochs.*--steps=12"):
        train_job.resumed_length(opts(3, 4), said.append)
    assert train_job.resumed_length(opts(12, None), said.append) == (3, 4)
    assert "epoch 3 trains steps 9 to 12" in said[-1]
    assert train_job.resumed_length(opts(4, 3), said.append) == (3, 4)   # as written
    assert train_job.resumed_length(opts(4, 2), said.append) is None
    assert "nothing left to train" in said[-1]
