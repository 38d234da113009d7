"""tapas.execution.api.overrides: a model class that overrides Keras's step methods is
refused by the ParallelModel runs that would skip them, with the fix, and only by those.

In this process: which definitions count as overrides (Keras's own, Keras 2's own and
Hugging Face's compiled-loss step do not). In a worker (tests/overrides_worker.py, 2
logical CPU devices, random plans): ``fit``/``evaluate``/``verify``/``predict`` refused or
run as the method each calls; the fix the message names trains equal to Keras's ``fit`` of
the overriding model; Hugging Face's TFBertForSequenceClassification used directly trains
equal to ``tf_keras``'s ``fit``, and is refused with the fix when compiled without a loss.
"""

from __future__ import annotations

import os

import keras
import pytest

from tapas.execution.api import overrides
from worker_main import run_checked  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "overrides_worker.py")


class Loss(keras.Model):
    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs)


class Step(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


class Below(Step):   # inherits the override
    pass


def test_overrides_are_found_where_they_are_defined() -> None:
    plain = keras.Sequential([keras.layers.Dense(2)])
    for method in ("train_step", "compute_loss", "compute_metrics", "test_step",
                   "predict_step"):
        assert overrides.overridden(plain, method) is None
        assert overrides.overridden(keras.Model(), method) is None
    assert overrides.overridden(Loss(), "compute_loss") is Loss
    assert overrides.overridden(Loss(), "train_step") is None
    assert overrides.overridden(Below(), "train_step") is Step
    overrides.check_steps(Loss(), "predict")   # predict never calls compute_loss
    with pytest.raises(TypeError, match=r"Below overrides train_step \(defined in "
                                        r".*test_overrides\.Step\); ParallelModel\.fit "):
        overrides.check_steps(Below(), "fit")
    with pytest.raises(TypeError, match=r"fit's validation .* self\.add_loss"):
        overrides.check_steps(Loss(), "validation")


def test_keras2_models_keep_their_own_steps() -> None:
    tf_keras = pytest.importorskip("tf_keras")
    model = tf_keras.Sequential([tf_keras.layers.Dense(2)])
    for method in ("train_step", "compute_loss", "test_step", "predict_step"):
        assert overrides.overridden(model, method) is None


@pytest.fixture(scope="module")
def worker() -> dict:
    return run_checked(WORKER, {"devices": 2, "checks": ["refused", "hugging_face"]})


def test_runs_that_would_skip_an_override_are_refused_before_any_step(worker: dict) -> None:
    r = worker["refused"]
    loss, step, predict = r["compute_loss"], r["train_step"], r["predict_step"]
    for run in ("fit", "evaluate", "verify"):
        assert loss[run].startswith("TypeError: PenalizedModel overrides compute_loss"), loss
        assert "self.add_loss(...) in call()" in loss[run]
    assert loss["predict"] == "ran" and loss["steps"] == 0
    assert step["fit"].startswith("TypeError: DoubledStep overrides train_step"), step
    assert step["evaluate"] == "ran" and step["steps"] == 0
    assert predict["predict"].startswith("TypeError: LabelsOut overrides predict_step")
    assert "pm.predict(x)'s outputs" in predict["predict"]
    assert predict["fit"] == "ran"


def test_the_fix_named_trains_equal_to_keras_fit_of_the_overriding_model(worker: dict) -> None:
    fix = worker["refused"]["fix"]
    assert fix["sharded"] > 0
    assert fix["loss"]["ok"] and fix["weights"], fix
    # the term counts: Keras's fit without it logs another loss
    assert min(abs(a - b) for a, b in zip(fix["loss"]["theirs"], fix["plain_loss"])) > 1e-3


def test_hugging_face_model_used_directly_trains_equal_to_tf_keras_fit(worker: dict) -> None:
    r = worker["hugging_face"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["sharded"] > 0
    assert r["loss"]["ok"] and r["weights"], r
    assert r["without_loss"].startswith("ValueError: the model was compiled without a loss")
    assert "pass the labels as y" in r["without_loss"]
    # ModelCheckpoint(save_weights_only=True) of a Keras 2 model: tf_keras's own file
    assert r["checkpoint"], r
