"""Subprocess entry of tests/test_overrides.py: models whose class overrides Keras's step
methods, on 2 logical CPU devices under a random plan.

    python tests/overrides_worker.py '{"devices": 2, "checks": ["refused", "hugging_face"]}'

Checks (one ``RESULT <json>`` line each, ``tests/worker_main.py``):

* ``refused``: a model overriding ``compute_loss`` (an extra term, as in Keras's guide),
  one overriding ``train_step``, one overriding ``predict_step``: ``fit``, ``evaluate``,
  ``verify`` and ``predict`` refuse what they would run differently, before any step, and
  run what they would not; the fix the message gives (the term as ``add_loss`` in a layer)
  trains to the same History and weights as Keras's ``fit`` of the overriding model.
* ``hugging_face``: Hugging Face's ``TFBertForSequenceClassification`` used directly,
  compiled with a loss (its own ``train_step``, allowed as equal to Keras's): ``fit``
  against ``tf_keras``'s ``fit`` (dropout off: Keras 2 draws with stateful ops); compiled
  without a loss, refused with the fix; Keras's ModelCheckpoint (``save_weights_only``)
  writes a file ``tf_keras``'s ``load_weights`` reads back equal to its fit.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
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

N = JOB["devices"]
B = 8


class PenalizedModel(keras.Model):
    """compute_loss adds a penalty on the outputs (Keras's "customizing fit" style)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))


class DoubledStep(keras.Model):
    """A custom train_step (the guide's first example, with the loss doubled)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = 2.0 * self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class LabelsOut(keras.Model):
    """predict_step post-processes the outputs into labels."""

    def predict_step(self, data):
        return keras.ops.argmax(super().predict_step(data), axis=-1)


class Penalty(keras.layers.Layer):
    """The fix the refusal names: the same term added with add_loss in call."""

    def call(self, y_pred):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(y_pred)))
        return y_pred


def build(cls: type = keras.Model, penalty: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), name="x")
    out = keras.layers.Dense(3, name="o")(keras.layers.Dense(8, activation="relu",
                                                            name="h")(inp))
    model = cls(inp, Penalty(name="penalty")(out) if penalty else out)
    model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError(),
                  jit_compile=False)
    return model


def data(n: int = 4 * B) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 6)).astype("float32"),
            rng.standard_normal((n, 3)).astype("float32"))


def parallel_model(model: Any, spec: Any) -> Any:
    plan = parallel.random_plan(capturing.capture(model, spec, training=True), N, 1)
    return parallel.parallelize(model, spec, plan, devices=N)


def sharded(pm: Any) -> int:
    return sum(pm.program.plan.pattern(n).name != "replicate" for n in pm.graph.nodes)


def attempt(fn: Any) -> str:
    try:
        fn()
        return "ran"
    except TypeError as e:
        return f"TypeError: {e}"


def close(a: Any, b: Any, tol: float = 1e-5) -> dict[str, Any]:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return {"ok": a.shape == b.shape and bool(np.allclose(a, b, rtol=tol, atol=tol)),
            "ours": a.tolist() if a.size < 10 else None,
            "theirs": b.tolist() if b.size < 10 else None}


def weights_close(pm: Any, model: Any, tol: float = 1e-5) -> bool:
    ref = {p: v.numpy() for p, v in capturing.weights_by_path(model).items()}
    ours = pm.global_weights()
    return set(ours) <= set(ref) and all(
        np.allclose(ours[p], ref[p], rtol=tol, atol=tol) for p in ours)


def check_refused() -> dict[str, Any]:
    x, y = data()
    spec = tf.TensorSpec([B, 6])
    out: dict[str, Any] = {}
    pm = parallel_model(build(PenalizedModel), spec)
    out["compute_loss"] = {
        "fit": attempt(lambda: pm.fit(x, y, epochs=1, verbose=0)),
        "evaluate": attempt(lambda: pm.evaluate(x, y, verbose=0)),
        "verify": attempt(lambda: pm.verify(x[:B], y[:B], steps=1)),
        "predict": attempt(lambda: pm.predict(x, verbose=0)),
        "steps": int(pm.runtime.iterations.numpy())}
    pm = parallel_model(build(DoubledStep), spec)
    out["train_step"] = {"fit": attempt(lambda: pm.fit(x, y, epochs=1, verbose=0)),
                         "evaluate": attempt(lambda: pm.evaluate(x, y, verbose=0)),
                         "steps": int(pm.runtime.iterations.numpy())}
    pm = parallel_model(build(LabelsOut), spec)
    out["predict_step"] = {"predict": attempt(lambda: pm.predict(x, verbose=0)),
                           "fit": attempt(lambda: pm.fit(x, y, epochs=1, verbose=0))}
    # the fix: Keras's fit of the overriding model against ours of the add_loss model
    ref = build(PenalizedModel)
    want = ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    pm = parallel_model(build(penalty=True), spec)
    got = pm.fit(x, y, epochs=2, shuffle=False, verbose=0)
    out["fix"] = {"loss": close(got.history["loss"], want.history["loss"]), "sharded": sharded(pm),
                  "weights": weights_close(pm, ref),
                  "plain_loss": build().fit(x, y, batch_size=B, epochs=2, shuffle=False,
                                            verbose=0).history["loss"]}
    return out


def check_hugging_face() -> dict[str, Any]:
    try:
        import tf_keras
        import transformers as hf
    except ImportError as e:
        return {"skipped": str(e)}
    cfg = hf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)

    def bert(loss: bool) -> Any:
        tf_keras.utils.set_random_seed(0)
        model = hf.TFBertForSequenceClassification(cfg)
        if loss:
            model.compile(tf_keras.optimizers.Adam(1e-3), loss=tf_keras.losses.
                          SparseCategoricalCrossentropy(from_logits=True))
        else:   # Hugging Face's default: the model's own loss from labels in x
            model.compile(tf_keras.optimizers.Adam(1e-3))
        return model

    rng = np.random.default_rng(0)
    x = {"input_ids": rng.integers(0, 64, (2 * B, 8)).astype("int32"),
         "attention_mask": np.ones((2 * B, 8), "int32")}
    y = rng.integers(0, 3, (2 * B,)).astype("int32")
    spec = {k: tf.TensorSpec([B, 8], tf.int32) for k in x}
    ref = bert(True)
    want = ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    model = bert(True)
    model(x)   # built, as parallelize needs it
    pm = parallel_model(model, spec)
    # Keras's ModelCheckpoint writing a Keras 2 model's weights: tf_keras's own h5 file
    files = os.path.join(tempfile.mkdtemp(), "bert_{epoch}.weights.h5")
    got = pm.fit(x, y, epochs=2, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(files, save_weights_only=True)])
    loaded = bert(True)
    loaded(x)
    loaded.load_weights(files.format(epoch=2))
    unlossed = bert(False)
    unlossed(x)
    try:
        parallel.parallelize(unlossed, spec, devices=N)
        without_loss = "ran"
    except ValueError as e:
        without_loss = f"ValueError: {e}"
    # the two instances' weight paths differ by the model's name: matched in build order
    ref_values = dict(zip(capturing.weights_by_path(model), ref.weights))
    ours = pm.global_weights()
    return {"loss": close(got.history["loss"], want.history["loss"]), "sharded": sharded(pm),
            "weights": len(ours) == len(ref_values) and all(
                np.allclose(ours[p], ref_values[p].numpy(), rtol=1e-5, atol=1e-5)
                for p in ours),
            "without_loss": without_loss,
            "checkpoint": all(np.allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
                              for a, b in zip(loaded.weights, ref.weights))
            and len(loaded.weights) == len(ref.weights) > 0}


if __name__ == "__main__":
    run_checks({"refused": check_refused, "hugging_face": check_hugging_face}, JOB["checks"])
    finish()
