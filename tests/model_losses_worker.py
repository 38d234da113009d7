"""Subprocess entry of tests/test_model_losses.py: the model's own losses and metrics under
``ParallelModel.fit`` on N logical CPU devices (2 or 4: ``"devices"``), against Keras's
``Model.fit`` on one.

    python tests/model_losses_worker.py '{"devices": 2, "dir": "/tmp/x", "checks": ["binary"]}'

Each check prints one line ``RESULT <json>`` (``tests/worker_main.py``). The models are
written as a Keras user writes them (a ``keras.Sequential`` and a functional model,
compiled with SGD, a loss name and metrics), 40 training and 16 validation examples,
global batch 8, 3 epochs, shuffle off on both sides; each trained by Keras on one device
and by tapas under a searched plan, a random plan that splits the L2-regularized kernel
(and one that splits the output, when they differ) and a data-parallel plan. Per plan: the
History (every key Keras logs: loss, each metric, val_ of each, per epoch), the weights
after training and ``evaluate`` against Keras's.

* ``classifier``: Sequential, Dense(16, relu, L2 kernel, L1 bias) and Dense(4, softmax,
  an OrthogonalRegularizer kernel), sparse categorical cross-entropy, metrics
  ``sparse_categorical_accuracy`` and a ``SparseTopKCategoricalAccuracy(k=2)``;
* ``binary``: functional, Dense(8, tanh, kernel_regularizer="l2") and Dense(1, sigmoid),
  binary cross-entropy, metrics ``mae`` and ``keras.metrics.AUC()``;
* ``two_outputs``: functional, a shared Dense(16, relu, L2 kernel) under two heads,
  ``value`` (Dense(3), mse, metric mae) and ``label`` (Dense(4, softmax), sparse
  categorical cross-entropy, metric sparse categorical accuracy), loss and
  ``loss_weights`` as dicts by output name, targets a list in output order with
  per-example sample weights in fit and evaluate (Keras 3.15 refuses sample weights with
  a dict of targets: KeyError 0), and a dict of targets in an unweighted evaluate;
* ``resume``: the classifier's job crashed in the middle of its first epoch and resumed
  from a checkpoint by a new ParallelModel: its History (loss and metrics of the epoch
  the crash cut) equals an uninterrupted run's;
* ``workers``: one of 2 worker processes (``TF_CONFIG`` set, a CPU each), the binary
  model under the data-parallel plan, each worker reading its half of every batch: the
  History with its metrics equals Keras's;
* ``call_losses``: the binary model with an activity regularizer and a layer that calls
  ``self.add_loss``: the losses the call adds are part of the program and of the loss.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

JOB = json.loads(sys.argv[1])
N = JOB.get("devices", 2)
if devices.tf_config() is None:
    devices.setup_devices(N, "cpu")
else:   # one CPU per worker; the strategy before TensorFlow runs anything (collectives)
    devices.make_strategy(N)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tapas import capturing  # noqa: E402
from tapas.execution.api import fit, parallel
from tapas.execution.program import reconstruct  # noqa: E402
from tapas.planning.strategy import graph_digest  # noqa: E402
from tapas.sharding.placements import Split  # noqa: E402

B, EPOCHS, LR = 8, 3, 0.1
SPEC = tf.TensorSpec([B, 6])


def classifier() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(0.01),
                           bias_regularizer=keras.regularizers.L1(0.01), name="hidden"),
        keras.layers.Dense(4, activation="softmax", name="probabilities",
                           kernel_regularizer=keras.regularizers.OrthogonalRegularizer(0.01)),
    ], name="classifier")   # named: a resumed job's new model has the same weight paths
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy",
                           keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    return model


def binary() -> keras.Model:
    keras.utils.set_random_seed(0)
    features = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2")(features)
    model = keras.Model(features, keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="binary_crossentropy",
                  metrics=["mae", keras.metrics.AUC(name="auc")])
    return model


def two_outputs() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(0.01))(x)
    value = keras.layers.Dense(3, name="value")(h)
    label = keras.layers.Dense(4, activation="softmax", name="label")(h)
    model = keras.Model(x, [value, label])
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss={"value": "mse", "label": "sparse_categorical_crossentropy"},
                  loss_weights={"value": 0.5, "label": 2.0},
                  metrics={"value": ["mae"], "label": ["sparse_categorical_accuracy"]})
    return model


def data(kind: str, n: int, seed: int) -> tuple[np.ndarray, Any]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    classes = (np.abs(x[:, :4]).argmax(-1) + rng.integers(0, 2, n)) % 4
    if kind == "classifier":
        return x, classes
    if kind == "two_outputs":   # a list of targets in output order
        return x, [x[:, 3:] + 0.1 * rng.standard_normal((n, 3)).astype("float32"), classes]
    return x, (x[:, :1] + 0.5 * rng.standard_normal((n, 1)) > 0).astype("float32")


def _rows(y: Any, n: int) -> Any:
    """The first ``n`` rows of targets (an array or a list of them)."""
    return [v[:n] for v in y] if isinstance(y, list) else y[:n]


def event_tags(logdir: str) -> list[str]:
    """The scalar tags TensorBoard finds under ``logdir``."""
    tags = set()
    for root, _, files in os.walk(logdir):
        for f in files:
            if "tfevents" in f:
                for event in tf.compat.v1.train.summary_iterator(os.path.join(root, f)):
                    tags |= {v.tag for v in event.summary.value}
    return sorted(tags)


def close(a: Any, b: Any, values: bool = True) -> dict[str, Any]:
    """Whether ``a`` (ours) equals ``b`` (Keras's) within rtol 1e-5, atol 1e-6."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    ok = a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))
    out = {"ok": ok, "max_abs_diff": float(np.max(np.abs(a - b))) if a.shape == b.shape
           and a.size else None}
    return {**out, "ours": a.tolist(), "keras": b.tolist()} if values else out


def batch_plan(graph: Any) -> Any:
    from tapas.sharding import patterns
    chosen = {n.id: next(p for p in patterns.patterns_for(n, graph, N) if p.data_parallel)
              for n in graph.nodes}
    return reconstruct.Plan(N, chosen, graph_digest=graph_digest(graph))


def random_plans(build: Callable[[], keras.Model], kernel_of: Callable) -> dict[str, Any]:
    """Random plans by name: the first seed's plan that splits the L2-regularized kernel
    (``kernel_of(model)``), the first that splits the output (when another), and the
    data-parallel plan."""
    model = build()
    trace = capturing.trace(model, SPEC, training=True)
    graph = capturing.to_ir(trace)
    kernel = kernel_of(model).path
    found: dict[str, Any] = {}
    for seed in range(60):
        plan = parallel.random_plan(graph, N, seed)
        program = reconstruct.Program(trace, graph, plan)
        if isinstance(program.weight_layouts[kernel].placement, Split):
            found.setdefault("kernel", (seed, plan))
        if isinstance(program.output_placements[0], Split):
            found.setdefault("output", (seed, plan))
        if len(found) == 2:
            break
    assert "kernel" in found, f"no random plan of 60 splits {kernel}"
    plans = {f"random:{s}": p for s, p in found.values()}
    plans["batch"] = batch_plan(graph)
    return plans


def compare_fit(kind: str, build: Callable[[], keras.Model], kernel_of: Callable,
                weighted: bool = False) -> dict[str, Any]:
    """``weighted``: per-example sample weights in fit and evaluate (one array weighing
    every output's loss, as Keras takes it)."""
    x, y = data(kind, 40, 0)
    xv, yv = data(kind, 16, 1)
    w = np.linspace(0.5, 1.5, 40).astype("float32") if weighted else None
    wv = np.linspace(1.5, 0.5, 16).astype("float32") if weighted else None
    ref = build()
    ref_hist = ref.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                       validation_data=(xv, yv), sample_weight=w)
    ref_eval = ref.evaluate(xv, yv, batch_size=B, verbose=0, sample_weight=wv)
    out: dict[str, Any] = {"keras_keys": sorted(ref_hist.history)}
    plans: dict[str, Any] = {"searched": None, **random_plans(build, kernel_of)}
    for name, plan in plans.items():
        model = build()
        pm = parallel.parallelize(model, SPEC, plan, devices=N)   # the compiled SGD
        shown = io.StringIO()   # the searched plan's run: progress bar and TensorBoard
        logdir = os.path.join(JOB["dir"], f"{kind}_tb") if plan is None else None
        with contextlib.redirect_stdout(shown):
            hist = pm.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=1 if logdir else 0,
                          validation_data=(xv, yv), sample_weight=w, tensorboard=logdir)
        r: dict[str, Any] = {"keys": sorted(hist.history),
                             "output": str(pm.program.output_placements[0]),
                             "regularizers": {t.path: t.how
                                              for t in pm.runtime.regularization}}
        audit = pm.audit()   # the regularizers' collectives counted with the loss's
        r["audit"] = {"matches": audit.matches, "loss": [list(c) for c in audit.loss],
                      "differences": list(audit.differences)}
        if logdir:
            r["progress_bar"] = shown.getvalue()[-3000:]
            r["tags"] = event_tags(logdir)
        r["history"] = {k: close(hist.history.get(k, []), v)
                        for k, v in ref_hist.history.items()}
        pm.to_keras()
        r["weights"] = close(np.concatenate([w.numpy().ravel() for w in model.weights]),
                             np.concatenate([w.numpy().ravel() for w in ref.weights]),
                             values=False)
        r["evaluate"] = close(pm.evaluate(xv, yv, sample_weight=wv), ref_eval)
        r["predict"] = same_structure(pm.predict(xv, verbose=0),
                                      ref.predict(xv, batch_size=B, verbose=0))
        if name.startswith("random:"):   # verify: Keras's compiled loss and model.losses
            fresh = parallel.parallelize(build(), SPEC, plan, devices=N)
            report = fresh.verify(x[:B], _rows(y, B), steps=2)
            r["verify"] = {"ok": bool(report["ok"]), "loss": report.get("loss"),
                           "gradients": report.get("gradients")}
        if isinstance(yv, list):   # targets as a dict by output name (Keras: unweighted)
            by_name = dict(zip(model.output_names, yv))
            r["evaluate_dict"] = close(pm.evaluate(xv, by_name),
                                       ref.evaluate(xv, by_name, batch_size=B, verbose=0))
        out[name] = r
    return out


def same_structure(ours: Any, theirs: Any) -> dict[str, Any]:
    """Whether two predictions have the same structure (dict, list, tuple, array) and
    values (rtol 1e-5)."""
    kinds = [type(v).__name__ for v in (ours, theirs)]
    try:
        keras.tree.assert_same_structure(ours, theirs)
    except (ValueError, TypeError) as e:
        return {"ok": False, "kinds": kinds, "error": str(e)[:300]}
    return {"ok": kinds[0] == kinds[1] and all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
        zip(keras.tree.flatten(ours), keras.tree.flatten(theirs))), "kinds": kinds}


def check_dict_outputs() -> dict[str, Any]:
    """A model whose outputs are a dict, compiled with a loss per output name, fit on a
    dict of targets under a random plan: History, weights and predict's dict against
    Keras's."""
    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        x = keras.Input((6,), name="x")
        h = keras.layers.Dense(16, activation="relu")(x)
        model = keras.Model(x, {"value": keras.layers.Dense(3, name="value")(h),
                                "label": keras.layers.Dense(4, name="label")(h)})
        model.compile(optimizer=keras.optimizers.SGD(LR),
                      loss={"value": "mse", "label": keras.losses.
                            SparseCategoricalCrossentropy(from_logits=True)},
                      metrics={"value": ["mae"], "label": ["sparse_categorical_accuracy"]},
                      jit_compile=False)
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype("float32")
    y = {"value": rng.standard_normal((40, 3)).astype("float32"),
         "label": rng.integers(0, 4, (40,))}
    ref = build()
    want = ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    graph = capturing.capture(build(), SPEC, training=True)
    model = build()
    pm = parallel.parallelize(model, SPEC, parallel.random_plan(graph, N, 1), devices=N)
    got = pm.fit(x, y, epochs=2, shuffle=False, verbose=0)
    pm.to_keras()
    # 21 examples: 2 global batches and a last one of 5 (Keras counts all 21)
    part = {k: v[:21] for k, v in y.items()}
    ours_eval = pm.evaluate(x[:21], part, verbose=0, return_dict=True)
    keras_eval = ref.evaluate(x[:21], part, batch_size=B, verbose=0, return_dict=True)
    return {"history": close(got.history["loss"], want.history["loss"]),
            "evaluate_partial": {k: close(ours_eval.get(k, np.nan), v)
                                 for k, v in keras_eval.items()},
            "weights": close(np.concatenate([w.numpy().ravel() for w in model.weights]),
                             np.concatenate([w.numpy().ravel() for w in ref.weights]),
                             values=False),
            "predict": same_structure(pm.predict(x, verbose=0),
                                      ref.predict(x, batch_size=B, verbose=0))}


def check_classifier() -> dict[str, Any]:
    return compare_fit("classifier", classifier, lambda m: m.layers[0].kernel)


def check_binary() -> dict[str, Any]:
    return compare_fit("binary", binary, lambda m: m.layers[1].kernel)


def check_two_outputs() -> dict[str, Any]:
    return compare_fit("two_outputs", two_outputs, lambda m: m.layers[1].kernel,
                       weighted=True)


class Crash(keras.callbacks.Callback):
    """Stops the job (an exception) before the 4th step of the first epoch."""

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if batch == 3 and not getattr(self.model, "resumed", False):
            raise RuntimeError("crash")


def check_resume() -> dict[str, Any]:
    """The classifier under a random plan, 2 epochs, checkpoints every 2 steps: a run that
    crashes before step 4, resumed by a new ParallelModel from step 2 (in the middle of
    epoch 1: its metrics' state from the checkpoint), against an uninterrupted run."""
    x, y = data("classifier", 40, 0)
    graph = capturing.capture(classifier(), SPEC, training=True)
    plan = parallel.random_plan(graph, N, 0)

    def job(directory: str, callbacks: list) -> Any:
        pm = parallel.parallelize(classifier(), SPEC, plan, devices=N)
        return pm.fit(x, y, epochs=2, shuffle=False, verbose=0, callbacks=callbacks,
                      checkpoint_dir=directory, checkpoint_every=2, resume=True)
    whole = job(os.path.join(JOB["dir"], "whole"), [])
    crashed = os.path.join(JOB["dir"], "crashed")
    try:
        job(crashed, [Crash()])
        raised = False
    except RuntimeError:
        raised = True
    resumed = job(crashed, [])
    return {"raised": raised, "keys": sorted(resumed.history),
            "history": {k: close(resumed.history.get(k, []), v)
                        for k, v in whole.history.items()}}


def check_workers() -> dict[str, Any]:
    """One of 2 workers (MultiWorkerMirroredStrategy, a CPU each) reading its half of
    every batch (the data-parallel plan): the binary model's History (loss, mae, AUC and
    their val_ values, from outputs and targets gathered over both workers) against Keras
    fit on one device."""
    x, y = data("binary", 40, 0)
    xv, yv = data("binary", 16, 1)
    ref = binary()
    ref_hist = ref.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                       validation_data=(xv, yv))
    model = binary()
    pm = parallel.parallelize(model, SPEC, batch_plan(capturing.capture(
        binary(), SPEC, training=True)), devices=N)
    hist = pm.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(xv, yv))
    return {"cut": fit._Data(pm, x, y, None, False, 0).cut,
            "keys": sorted(hist.history), "keras_keys": sorted(ref_hist.history),
            "history": {k: close(hist.history.get(k, []), v)
                        for k, v in ref_hist.history.items()}}


class AddsLoss(keras.layers.Layer):
    """A layer as Keras's guide writes one: it adds a penalty of its input to the loss."""

    def call(self, x: Any) -> Any:
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
        return x


def call_losses() -> keras.Model:
    """The binary model with losses its call adds: an L1 activity regularizer on the hidden
    layer (Keras divides it by the batch size) and a layer that adds a penalty of its
    input (``self.add_loss``)."""
    keras.utils.set_random_seed(0)
    features = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2", name="sparse_code",
                           activity_regularizer=keras.regularizers.L1(0.01))(features)
    h = AddsLoss(name="penalty")(h)
    model = keras.Model(features, keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="binary_crossentropy",
                  metrics=["mae"])
    return model


def check_call_losses() -> dict[str, Any]:
    out = compare_fit("binary", call_losses, lambda m: m.get_layer("sparse_code").kernel)
    trace = capturing.trace(call_losses(), SPEC, training=True)
    out["captured"] = list(trace.call_losses)
    return out


if __name__ == "__main__":
    run_checks({"classifier": check_classifier, "binary": check_binary,
                "two_outputs": check_two_outputs, "call_losses": check_call_losses,
                "resume": check_resume, "workers": check_workers,
                "dict_outputs": check_dict_outputs}, JOB["checks"])
    finish()
