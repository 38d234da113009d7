"""tapas.execution.runtime.inputs: a parallel model takes its batch in every form Keras accepts (one
array, a list or tuple, a dict keyed by input name, the model's nested structure), and every
input error names the input, what it should be and the fix.

The multi-device checks run in worker processes (tests/inputs_worker.py: logical CPU devices
are set once per process), started through ``tapas.execution.runtime.launch`` so they always end.
The in-process tests need no devices: they build signatures and batches only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tapas.execution.runtime import inputs
from worker_main import run_worker  # tests/worker_main.py
from tapas.execution.api.parallel import loss_object

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "inputs_worker.py")


def run_job(job: dict[str, Any], timeout_s: float = 400.0) -> dict[str, dict[str, Any]]:
    """Run the worker in one process; its results by check name."""
    return run_worker(WORKER, job, timeout_s=timeout_s)[0]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("keras_hub")
    d = str(tmp_path_factory.mktemp("bert"))
    return run_job({"devices": 2, "dir": d, "checks": ["bert", "errors", "save"]})


def ok(check: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in check, check.get("traceback", check)
    return check


# ---- a keras-hub BERT backbone with a dict of named inputs, on 2 devices -------------------

def test_bert_dict_batch_equals_keras_on_2_devices(bert: dict[str, Any]) -> None:
    """verify with a dict batch: outputs, loss, gradients and 2 Adam steps equal
    single-device Keras (rtol 1e-5); the specs carry the input names in Keras's order."""
    r = ok(bert["bert"])
    assert r["names"] == ["padding_mask", "segment_ids", "token_ids"]
    assert all(f"name='{n}'" in s for n, s in zip(r["names"], r["specs"]))
    assert r["sharded"] > 0
    assert r["verify"]["ok"], r["verify"]
    for what in ("outputs", "loss", "gradients", "step_losses", "weights"):
        assert r["verify"][what]["ok"], (what, r["verify"][what])


def test_bert_predict_and_evaluate_take_dict_list_and_tuple(bert: dict[str, Any]) -> None:
    r = ok(bert["bert"])
    assert r["predict"] < 1e-5
    for form, loss in r["evaluate"].items():
        assert abs(loss - r["keras_loss"]) <= 1e-5 * abs(r["keras_loss"]), form


def test_input_errors_name_the_input_and_the_fix(bert: dict[str, Any]) -> None:
    r = ok(bert["errors"])
    assert "no value for input 'padding_mask'" in r["missing"]
    assert "'padding_mask' (int32 [4, 16])" in r["missing"] and "dict keyed by" in r["missing"]
    assert "input 'token_ids' has shape [4, 8]" in r["shape"] and "[4, 16]" in r["shape"]
    assert "input 'segment_ids' has dtype float32" in r["dtype"]
    assert "x.astype('int32')" in r["dtype"]
    assert "key 'labels', which is no input" in r["extra"]
    assert "list of 1, the model takes 3" in r["count"]
    assert "one ndarray, the model takes 3 inputs" in r["single"]
    assert "input 'token_ids'" in r["spec"] and "static" in r["spec"]


def test_tapas_train_on_a_saved_dict_input_model(bert: dict[str, Any], tmp_path: Any) -> None:
    """`tapas train --model=file.keras`: the saved BERT head (dict inputs, compiled with
    MSE) trains on a random batch in its input structure and verifies against Keras, in
    training mode (the default: dropout on, the same masks as Keras draws)."""
    path = ok(bert["save"])["path"]
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tapas.cli", "train", f"--model={path}", "--devices=2",
         "--steps=1", "--strategy=random:0", "--verify", f"--json_out={out}"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "model bert.keras" in proc.stdout and "verify: PASSED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["verify"]["ok"] and report["devices"] == 2 and report["batch"] == 8
    assert report["mode"] == "training" and report["verify"]["states"]["ok"]
    assert report["verify"]["states"]["count"] > 0   # the dropout layers' seed generators


# ---- list, tuple and nested inputs, on 4 devices ------------------------------------------

def test_list_tuple_and_nested_inputs_on_4_devices(tmp_path: Any) -> None:
    """A two-input model (tuple spec; list, tuple and dict batches) and a nested one
    ([a, {"z": b, "y": c}]: nested and flat batches) verify against Keras on 4 devices."""
    r = ok(run_job({"devices": 4, "dir": str(tmp_path), "checks": ["structures"]})
           ["structures"])
    assert r["list_names"] == ["a", "b"] and r["nested_names"] == ["a", "y", "z"]
    for key in ("list_verify", "nested_verify"):
        assert all(v["ok"] for v in r[key].values()), (key, r[key])
    assert max(r["list_predict"] + r["nested_predict"]) < 1e-5


# ---- signatures and batches in this process (no devices) ----------------------------------

def dict_model() -> keras.Model:
    ins = {"tokens": keras.Input((5,), dtype="int32", name="tokens"),
           "mask": keras.Input((5,), dtype="int32", name="mask")}
    h = keras.layers.Embedding(7, 3)(ins["tokens"]) * keras.ops.expand_dims(
        keras.ops.cast(ins["mask"], "float32"), -1)
    return keras.Model(ins, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def test_signature_of_a_dict_model_orders_names_like_keras() -> None:
    model = dict_model()
    sig = inputs.InputSignature.of(model, {"tokens": tf.TensorSpec([4, 5], tf.int32),
                                           "mask": tf.TensorSpec([4, 5], tf.int32)})
    assert sig.names == tuple(t.name for t in model.inputs) == ("mask", "tokens")
    tokens, mask = np.ones((4, 5), "int64"), np.zeros((4, 5), "int32")
    for batch in ({"tokens": tokens, "mask": mask}, [mask, tokens], (mask, tokens)):
        flat = sig.flatten(batch)
        assert [a.dtype for a in flat] == [np.int32, np.int32]
        np.testing.assert_array_equal(flat[1], tokens)
    packed = sig.pack(sig.flatten({"tokens": tokens, "mask": mask}))
    assert set(packed) == {"tokens", "mask"}
    np.testing.assert_array_equal(packed["tokens"], tokens)
    assert sig.spec_structure()["tokens"].name == "tokens"


def test_signature_refuses_specs_that_do_not_fit_the_model() -> None:
    model = dict_model()
    with pytest.raises(ValueError, match=r"input 'tokens' takes shape \[None, 5\].*\[4, 6\]"):
        inputs.InputSignature.of(model, {"tokens": tf.TensorSpec([4, 6], tf.int32),
                                         "mask": tf.TensorSpec([4, 5], tf.int32)})
    with pytest.raises(ValueError, match=r"input 'mask' takes int32, the spec says float32"):
        inputs.InputSignature.of(model, {"tokens": tf.TensorSpec([4, 5], tf.int32),
                                         "mask": tf.TensorSpec([4, 5], tf.float32)})
    with pytest.raises(ValueError, match=r"no value for input 'mask'"):
        inputs.InputSignature.of(model, {"tokens": tf.TensorSpec([4, 5], tf.int32)})


def test_signature_of_a_subclassed_model_takes_the_spec_structure() -> None:
    class TwoIn(keras.Model):
        def call(self, xs: Any) -> Any:
            return xs["p"] + xs["q"]
    sig = inputs.InputSignature.of(TwoIn(), {"q": tf.TensorSpec([2, 3]),
                                             "p": tf.TensorSpec([2, 3])})
    assert sig.names == ("p", "q")
    with pytest.raises(ValueError, match="has no symbolic inputs"):
        inputs.InputSignature.of(TwoIn())


def test_synthetic_batch_fits_the_inputs_and_the_loss() -> None:
    model = dict_model()
    sig = inputs.InputSignature.of(model, {"tokens": tf.TensorSpec([4, 5], tf.int32),
                                           "mask": tf.TensorSpec([4, 5], tf.int32)})
    x, y = inputs.synthetic_batch(model, sig, loss_object("sparse_categorical_crossentropy"))
    assert set(x) == {"tokens", "mask"} and x["tokens"].dtype == np.int32
    assert x["tokens"].max() < 7 and y.shape == (4,) and y.max() < 2
    x, y = inputs.synthetic_batch(model, sig, loss_object("mse"))
    assert y.shape == (4, 2) and y.dtype == np.float32
    model(x)   # Keras takes the batch as built


def test_loss_object_from_names_and_functions() -> None:
    assert isinstance(loss_object("mse"), keras.losses.MeanSquaredError)
    assert isinstance(loss_object(keras.losses.binary_crossentropy),
                      keras.losses.BinaryCrossentropy)
    with pytest.raises(ValueError, match="needs a keras.losses.Loss object"):
        loss_object(lambda y, p: y - p)

