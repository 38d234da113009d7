"""Subprocess entry of tests/test_inputs.py: models whose inputs are a dict, a list or a
nested structure, parallelized on N logical CPU devices (set once per process).

    python tests/inputs_worker.py '{"devices": 2, "checks": ["bert"], "dir": "/tmp/x"}'

Each check prints one line ``RESULT <json>``; a check that raises prints
``RESULT {"check": name, "error": ...}``. Checks: ``bert`` (a keras-hub BERT backbone with a
pooling and Dense head, dict batches), ``structures`` (list, tuple and nested inputs),
``errors`` (what a wrong batch is told), ``save`` (the BERT head model compiled and saved as
``<dir>/bert.keras`` for ``tapas train``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

JOB = json.loads(sys.argv[1])
devices.setup_devices(JOB["devices"], "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tapas import capturing  # noqa: E402
from tapas.execution.api import parallel  # noqa: E402

BATCH, SEQ, VOCAB = 4, 16, 512
N = JOB["devices"]


def bert_model(layers: int = 2, seed: int = 0) -> keras.Model:
    """keras-hub's BertBackbone (small config) under a mean-pooling and Dense head: three
    named int32 inputs given as a dict, one float output."""
    import keras_hub
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=layers,
                                             num_heads=4,
                                             hidden_dim=64, intermediate_dim=128,
                                             max_sequence_length=SEQ)
    inputs = {name: keras.Input((SEQ,), dtype="int32", name=name)
              for name in ("token_ids", "segment_ids", "padding_mask")}
    pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs)["sequence_output"])
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(pooled), name="bert_head")


def bert_batch(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((BATCH, SEQ), "int32")
    mask[:, SEQ - 3:] = 0
    x = {"token_ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
         "segment_ids": rng.integers(0, 2, (BATCH, SEQ)).astype("int32"),
         "padding_mask": mask}
    return x, rng.standard_normal((BATCH, 4)).astype("float32")


BERT_SPEC = {name: tf.TensorSpec([BATCH, SEQ], tf.int32)
             for name in ("token_ids", "segment_ids", "padding_mask")}
MSE = keras.losses.MeanSquaredError()


def summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: {"ok": report[k]["ok"], "max_abs_diff": report[k]["max_abs_diff"]}
            for k in ("outputs", "loss", "gradients", "step_losses", "weights")}


def check_bert() -> dict[str, Any]:
    """Dict batches through parallelize, verify (outputs, loss, gradients, 2 Adam steps
    against single-device Keras), predict, and evaluate with the batch as a dict, a list
    and a tuple (one trace each for verify's two functions and predict)."""
    model = bert_model()
    # the inference graph (dropout off), as Keras's model(x) below: training mode is
    # tests/test_training_mode.py's
    plan = parallel.random_plan(capturing.capture(model, BERT_SPEC), N, JOB.get("seed", 0))
    pm = parallel.parallelize(model, BERT_SPEC, plan, devices=N, optimizer="adam",
                              learning_rate=0.01, loss=MSE, training=False)
    x, y = bert_batch()
    out = {"names": list(pm.inputs.names),
           "specs": [str(s) for s in pm.runtime.input_specs],
           "sharded": sum(1 for p in plan.patterns.values() if p.name != "replicate")}
    report = pm.verify(x, y, steps=2)
    out["verify"] = {"ok": report["ok"], **summary(report)}
    want = model(x).numpy()   # the trained Keras model, same weights as the parallel one
    as_list = [x[k] for k in sorted(x)]   # model.inputs order: Keras's flattening order
    out["predict"] = float(np.abs(pm.predict(x) - want).max())
    out["evaluate"] = {form: pm.evaluate(batch, y) for form, batch in
                       (("dict", x), ("list", as_list), ("tuple", tuple(as_list)))}
    out["keras_loss"] = float(MSE(y, want))
    return out


def two_input_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8)(a), keras.layers.Dense(8)(b)])
    return keras.Model([a, b], keras.layers.Dense(4)(keras.layers.Activation("relu")(h)))


def nested_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    a, b, c = keras.Input((6,), name="a"), keras.Input((4,), name="b"), keras.Input((2,),
                                                                                     name="c")
    h = keras.layers.Concatenate()([a, b, c])
    return keras.Model([a, {"z": b, "y": c}], keras.layers.Dense(4)(h))


def check_structures() -> dict[str, Any]:
    """A list-input model (tuple spec, list/tuple/dict batches) and a nested one
    ([a, {"z": b, "y": c}]: specs and batches in that structure, or flat)."""
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal((8, d)).astype("float32") for d in (6, 4, 2))
    y = rng.standard_normal((8, 4)).astype("float32")
    out: dict[str, Any] = {}
    model = two_input_model()
    spec = (tf.TensorSpec([8, 6]), tf.TensorSpec([8, 4]))
    plan = parallel.random_plan(capturing.capture(model, list(spec)), N, 1)
    pm = parallel.parallelize(model, spec, plan, devices=N, loss=MSE)
    out["list_names"] = list(pm.inputs.names)
    out["list_verify"] = summary(pm.verify((a, b), y, steps=1))
    want = model([a, b]).numpy()
    out["list_predict"] = [float(np.abs(pm.predict(batch) - want).max())
                           for batch in ([a, b], (a, b), {"a": a, "b": b})]
    model = nested_model()
    spec = [tf.TensorSpec([8, 6]), {"z": tf.TensorSpec([8, 4]), "y": tf.TensorSpec([8, 2])}]
    plan = parallel.random_plan(capturing.capture(model, spec), N, 2)
    pm = parallel.parallelize(model, spec, plan, devices=N, loss=MSE)
    out["nested_names"] = list(pm.inputs.names)
    out["nested_verify"] = summary(pm.verify([a, {"z": b, "y": c}], y, steps=1))
    want = model([a, {"z": b, "y": c}]).numpy()
    out["nested_predict"] = [float(np.abs(pm.predict(batch) - want).max())
                             for batch in ([a, {"z": b, "y": c}], [a, c, b],
                                           {"a": a, "z": b, "y": c})]
    return out


def attempt(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def check_errors() -> dict[str, Any]:
    """A wrong batch or spec: each message names the input, what it should be and the fix."""
    model = bert_model()
    plan = parallel.random_plan(capturing.capture(model, BERT_SPEC), N, 0)
    pm = parallel.parallelize(model, BERT_SPEC, plan, devices=N, loss=MSE, training=False)
    x, y = bert_batch()
    no_mask = {k: v for k, v in x.items() if k != "padding_mask"}
    short = {**x, "token_ids": x["token_ids"][:, :8]}
    floats = {**x, "segment_ids": x["segment_ids"].astype("float32")}
    extra = {**x, "labels": y}
    bad_spec = {**BERT_SPEC, "token_ids": tf.TensorSpec([BATCH, None], tf.int32)}
    return {"missing": attempt(lambda: pm.train_step(no_mask, y)),
            "shape": attempt(lambda: pm.predict(short)),
            "dtype": attempt(lambda: pm.verify(floats, y)),
            "extra": attempt(lambda: pm.evaluate(extra, y)),
            "count": attempt(lambda: pm.predict([x["token_ids"]])),
            "single": attempt(lambda: pm.predict(x["token_ids"])),
            "spec": attempt(lambda: parallel.parallelize(model, bad_spec, plan, devices=N,
                                                         training=False))}


def check_save() -> dict[str, Any]:
    """The BERT head model (one layer: tapas train traces it twice), compiled with its loss,
    saved for ``tapas train --model=``."""
    model = bert_model(layers=1)
    model.compile(optimizer="sgd", loss="mse")
    path = os.path.join(JOB["dir"], "bert.keras")
    model.save(path)
    return {"path": path}


CHECKS = {"bert": check_bert, "structures": check_structures, "errors": check_errors,
          "save": check_save}


if __name__ == "__main__":
    run_checks(CHECKS, JOB["checks"])
    finish()
