"""Subprocess entry of tests/test_fit.py: ``ParallelModel.fit`` on N logical CPU devices
(set once per process) against Keras's ``Model.fit`` on one device.

    python tests/fit_worker.py '{"devices": 2, "checks": ["keras", "resume"], "dir": "/tmp/x"}'

Each check prints one line ``RESULT <json>`` (``tests/worker_main.py``). The model: two
inputs ``a`` (6) and ``b`` (4), concatenated, Dense(8, relu), Dense(3), MSE; a random plan
that shards it; 42 examples, global batch 8 (5 batches an epoch and a last one of 2).
Checks:

* ``keras``: fit on a dict of arrays with validation data, LearningRateScheduler,
  EarlyStopping, CSVLogger, TensorBoard scalars and a hook recorder, against Keras fit
  (SGD, the same 40 examples, shuffle off): history (loss, val_loss, learning_rate, the
  epoch EarlyStopping stops at), weights, the hooks called, the CSV rows, the event tags;
  then fit on a ``tf.data.Dataset`` with dict elements and a partial last batch, and
  ``evaluate`` over it, against Keras; ``evaluate`` and ``predict`` with callbacks and each
  ``verbose`` (the hooks, their logs, what is printed, ``stop_evaluating``) against
  Keras's; TerminateOnNaN on a diverging step;
* ``resume``: Adam, shuffled, checkpoints every 3 steps, keep 2: a run whose save at step
  9 crashes between the shards and the fit state (half a file written); the newest
  complete checkpoint is step 6; a new ParallelModel resumes from it and finishes; weights,
  optimizer slots, step counter and history equal an uninterrupted run's exactly; the
  same with a dataset read as one stream (``steps_per_epoch=4`` over passes of 5 batches)
  and a crash raised by a callback after step 7.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

JOB = json.loads(sys.argv[1])
if devices.tf_config() is None:
    devices.setup_devices(JOB["devices"], "cpu")
else:   # one CPU per worker; the strategy before TensorFlow runs anything (collectives)
    devices.make_strategy(JOB["devices"])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tapas import capturing  # noqa: E402
from tapas.execution.api import fit, fit_checkpoints, parallel
from tapas.execution.program import reconstruct  # noqa: E402
from tapas.planning.strategy import graph_digest  # noqa: E402

N = JOB["devices"]
B = 8
SPEC = {"a": tf.TensorSpec([B, 6]), "b": tf.TensorSpec([B, 4])}


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="concat")([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(h),
                       name="two_inputs")


def data(n: int = 42, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {"a": rng.standard_normal((n, 6)).astype("float32"),
         "b": rng.standard_normal((n, 4)).astype("float32")}
    return x, rng.standard_normal((n, 3)).astype("float32")


def batch_plan(graph: Any) -> Any:
    """Data parallel: every GraphNode's batch-splitting pattern (inputs and output split
    on the batch axis)."""
    from tapas.sharding import patterns
    chosen = {n.id: next(p for p in patterns.patterns_for(n, graph, N) if p.data_parallel)
              for n in graph.nodes}
    return reconstruct.Plan(N, chosen, graph_digest=graph_digest(graph))


def parallel_model(optimizer: str, lr: float, plan: str = "random") -> Any:
    model = build()
    graph = capturing.capture(build(), SPEC, training=True)
    plan = (batch_plan(graph) if plan == "batch" else
            parallel.random_plan(graph, N, JOB.get("plan_seed", 1)))
    return parallel.parallelize(model, SPEC, plan, devices=N, optimizer=optimizer,
                                learning_rate=lr, loss=keras.losses.MeanSquaredError())


def schedule(epoch: int, lr: float) -> float:
    return lr * 0.5 if epoch >= 1 else lr


class Hooks(keras.callbacks.Callback):
    """Which hooks were called, how often, and the batch logs' keys."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.batch_keys: set[str] = set()

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def on_train_begin(self, logs=None): self._count("train_begin")
    def on_epoch_begin(self, epoch, logs=None): self._count("epoch_begin")
    def on_train_batch_begin(self, batch, logs=None): self._count("batch_begin")

    def on_train_batch_end(self, batch, logs=None):
        self._count("batch_end")
        self.batch_keys |= set(logs or {})

    def on_epoch_end(self, epoch, logs=None): self._count("epoch_end")
    def on_train_end(self, logs=None): self._count("train_end")
    # (validation in fit calls the test hooks too, as Keras's fit)
    def on_test_begin(self, logs=None): self._count("test_begin")
    def on_test_batch_begin(self, batch, logs=None): self._count("test_batch_begin")
    def on_test_batch_end(self, batch, logs=None): self._count("test_batch_end")
    def on_test_end(self, logs=None): self._count("test_end")


class Record(keras.callbacks.Callback):
    """Every evaluate/predict hook in order, with its batch, logs (rounded) and the
    shape of the predicted outputs; sets ``stop_evaluating`` after batch ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.log: list[list[Any]] = []
        self.stop_after = stop_after

    def _add(self, name: str, batch: Any = None, logs: Any = None) -> None:
        logs = {k: (list(np.shape(v)) if k == "outputs" else round(float(v), 5))
                for k, v in (logs or {}).items()}
        self.log.append([name, batch, logs])

    def on_test_begin(self, logs=None): self._add("test_begin", None, logs)
    def on_test_batch_begin(self, batch, logs=None): self._add("test_batch_begin", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._add("test_batch_end", batch, logs)
        if self.stop_after is not None and batch >= self.stop_after:
            self.model.stop_evaluating = True

    def on_test_end(self, logs=None): self._add("test_end", None, logs)
    def on_predict_begin(self, logs=None): self._add("predict_begin", None, logs)
    def on_predict_batch_begin(self, batch, logs=None): self._add("predict_batch_begin", batch)
    def on_predict_batch_end(self, batch, logs=None): self._add("predict_batch_end", batch, logs)
    def on_predict_end(self, logs=None): self._add("predict_end", None, logs)


def printed(fn: Any) -> tuple[Any, list[str]]:
    """(fn(), what it printed), the progress bar without its timings and terminal codes."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn()
    text = re.sub(r"\x1b\[[0-9;]*m|\x08|\d+m?s(/step)?|[ \t]+(?=\n)", "", out.getvalue())
    return result, [ln.rstrip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]


def callbacks(csv: str) -> list[Any]:
    return [keras.callbacks.LearningRateScheduler(schedule),
            keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.05, patience=1),
            keras.callbacks.CSVLogger(csv), Hooks()]


def close(a: Any, b: Any) -> dict[str, Any]:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    ok = a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))
    return {"ok": ok, "max_abs_diff": float(np.max(np.abs(a - b))) if a.shape == b.shape
            else None, "ours": a.tolist(), "keras": b.tolist()}


def weights_close(pm: Any, model: keras.Model) -> dict[str, Any]:
    ours = pm.global_weights()
    ref = capturing.weights_by_path(model)
    diffs = {p: float(np.max(np.abs(ours[p] - ref[p].numpy()))) for p in ours}
    return {"ok": all(np.allclose(ours[p], ref[p].numpy(), rtol=1e-5, atol=1e-6)
                      for p in ours), "max_abs_diff": max(diffs.values())}


def event_tags(logdir: str) -> list[str]:
    tags = set()
    for root, _, files in os.walk(logdir):
        for f in files:
            if "tfevents" in f:
                for event in tf.compat.v1.train.summary_iterator(os.path.join(root, f)):
                    tags |= {v.tag for v in event.summary.value}
                    if event.HasField("graph_def"):   # the graph tab: collectives in it?
                        graph = tf.compat.v1.GraphDef.FromString(event.graph_def)
                        ops = {n.op for n in graph.node} | {
                            n.op for fn in graph.library.function for n in fn.node_def}
                        tags.add("GRAPH" + ("+collectives" if any(
                            o.startswith("Collective") for o in ops) else ""))
    return sorted(tags)


def check_keras() -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = data()
    xv, yv = data(16, seed=1)
    d = JOB["dir"]
    pm = parallel_model("sgd", 0.05)
    out["sharded"] = sum(1 for n in pm.graph.nodes
                         if pm.program.plan.pattern(n).name != "replicate")
    ours_cb = callbacks(os.path.join(d, "ours.csv"))
    hist = pm.fit(x, y, epochs=6, shuffle=False, validation_data=(xv, yv), verbose=2,
                  callbacks=ours_cb, tensorboard=os.path.join(d, "tb"))
    ref = build()
    ref.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                jit_compile=False)
    keras_cb = callbacks(os.path.join(d, "keras.csv"))
    ref_hist = ref.fit(x, y, batch_size=B, epochs=6,   # 42: the last 2 a batch of their own
                       shuffle=False, validation_data=(xv, yv), verbose=0,
                       callbacks=keras_cb)
    out["epochs"] = {"ours": hist.epoch, "keras": ref_hist.epoch}
    for key in ("loss", "val_loss", "learning_rate"):
        out[key] = close(hist.history.get(key, []), ref_hist.history.get(key, []))
    out["weights"] = weights_close(pm, ref)
    out["hooks"] = {"ours": ours_cb[-1].calls, "keras": keras_cb[-1].calls,
                    "batch_keys": sorted(ours_cb[-1].batch_keys)}
    with open(os.path.join(d, "ours.csv")) as f:
        out["csv_rows"] = len(f.read().strip().splitlines())
    out["tags"] = event_tags(os.path.join(d, "tb"))
    out["iterations"] = int(pm.runtime.iterations.numpy())

    # a dataset of dict elements with a partial last batch, on a fresh program
    pm2 = parallel_model("sgd", 0.05)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    hist2 = pm2.fit(ds, epochs=2, verbose=0)
    ref2 = build()
    ref2.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                 jit_compile=False)
    ref_hist2 = ref2.fit(ds, epochs=2, verbose=0)
    out["dataset_loss"] = close(hist2.history["loss"], ref_hist2.history["loss"])
    out["dataset_weights"] = weights_close(pm2, ref2)
    val_ds = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(B)
    out["evaluate"] = close(pm2.evaluate(val_ds), ref2.evaluate(val_ds, verbose=0))
    out["evaluate_arrays"] = close(pm2.evaluate(xv, yv), ref2.evaluate(xv, yv, verbose=0,
                                                                        batch_size=B))

    out["predict"] = close(pm2.predict(x), ref2.predict(x, verbose=0, batch_size=B))  # 42 rows
    out["predict_dataset"] = close(pm2.predict(val_ds), ref2.predict(val_ds, verbose=0))
    out["evaluate_predict_hooks"] = check_evaluate_predict_hooks(pm2, ref2)

    # sample weights (Keras's weighting): arrays with weighted validation data, then a
    # dataset of (x, y, w) triples, on fresh programs against Keras fit
    w = np.random.default_rng(5).uniform(0, 2, 42).astype("float32")
    wv = np.random.default_rng(6).uniform(0, 2, 16).astype("float32")
    pm_w = parallel_model("sgd", 0.05)
    h_w = pm_w.fit(x, y, sample_weight=w, epochs=2, shuffle=False, verbose=0,
                   validation_data=(xv, yv, wv))
    ref_w = build()
    ref_w.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                  jit_compile=False)
    rh_w = ref_w.fit(x, y, sample_weight=w, batch_size=B, epochs=2, shuffle=False, verbose=0,
                     validation_data=(xv, yv, wv))
    out["weighted"] = {k: close(h_w.history[k], rh_w.history[k]) for k in ("loss", "val_loss")}
    out["weighted_weights"] = weights_close(pm_w, ref_w)
    pm_w2 = parallel_model("sgd", 0.05)
    pm_w2.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(B), epochs=1, verbose=0)
    ref_w2 = build()
    ref_w2.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                   jit_compile=False)
    ref_w2.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(B), epochs=1, verbose=0)
    out["weighted_dataset"] = weights_close(pm_w2, ref_w2)
    out["weighted_evaluate"] = close(pm_w2.evaluate(xv, yv, sample_weight=wv),
                                     ref_w2.evaluate(xv, yv, sample_weight=wv, verbose=0,
                                                     batch_size=B))

    # EarlyStopping(restore_best_weights): get_weights/set_weights of the callback model
    def stopper() -> Any:
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1,
                                             restore_best_weights=True)
    h_ours = pm2.fit(x, y, epochs=4, shuffle=False, verbose=0, callbacks=[stopper()])
    h_keras = ref2.fit(x, y, batch_size=B, epochs=4, shuffle=False, verbose=0,
                       callbacks=[stopper()])
    out["restore_best"] = {"epochs": [h_ours.epoch, h_keras.epoch],
                           "weights": weights_close(pm2, ref2)}

    # a diverging step: refused by the runtime (weights unchanged), seen as a NaN loss
    pm2.runtime.learning_rate.assign(1e30)
    before = int(pm2.runtime.iterations.numpy())
    try:
        pm2.fit(x, y, epochs=1, verbose=0)
        out["nan_without_callback"] = "no error"
    except Exception as e:  # the StepError, as train_step raises it
        out["nan_without_callback"] = f"{type(e).__name__}: {e}"
    pm2.runtime.learning_rate.assign(1e30)
    hist3 = pm2.fit(x, y, epochs=3, verbose=0,
                    callbacks=[keras.callbacks.TerminateOnNaN()])
    out["terminate_on_nan"] = {"epochs": hist3.epoch,
                               "loss_is_nan": bool(np.isnan(hist3.history["loss"][-1])),
                               "steps_taken": int(pm2.runtime.iterations.numpy()) - before}
    return out


def check_evaluate_predict_hooks(pm: Any, ref: keras.Model) -> dict[str, Any]:
    """evaluate and predict with callbacks and each verbose against Keras's on the same
    weights: the hooks in order with their logs, what is printed, and a callback that
    stops evaluation after its second batch."""
    x, _ = data()
    xv, yv = data(21, seed=1)   # 2 global batches and a last one of 5, as Keras counts it
    out: dict[str, Any] = {}
    for verbose in ("auto", 1, 2, 0):
        runs = {}
        for who, evaluate, predict in (
                ("ours", lambda cb: pm.evaluate(xv, yv, verbose=verbose, callbacks=cb),
                 lambda cb: pm.predict(x, verbose=verbose, callbacks=cb)),
                ("keras", lambda cb: ref.evaluate(xv, yv, batch_size=B, verbose=verbose,
                                                  callbacks=cb),
                 lambda cb: ref.predict(x, batch_size=B, verbose=verbose, callbacks=cb))):
            e, p = Record(), Record()
            loss, e_text = printed(lambda: evaluate([e]))
            _, p_text = printed(lambda: predict([p]))
            runs[who] = {"loss": float(loss), "evaluate_hooks": e.log, "evaluate_printed":
                         e_text, "predict_hooks": p.log, "predict_printed": p_text}
        out[str(verbose)] = runs
    stops = {}
    for who, evaluate in (("ours", lambda cb: pm.evaluate(xv, yv, verbose=0, callbacks=cb)),
                          ("keras", lambda cb: ref.evaluate(xv, yv, batch_size=B, verbose=0,
                                                            callbacks=cb))):
        r = Record(stop_after=1)
        stops[who] = {"loss": round(float(evaluate([r])), 5), "hooks": r.log}
    out["stop_evaluating"] = stops
    return out


def check_resume() -> dict[str, Any]:
    x, y = data(40)   # 5 global batches an epoch
    d = JOB["dir"]
    kw = dict(epochs=3, shuffle=True, seed=7, verbose=0, checkpoint_every=3, keep=2,
              callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
    out: dict[str, Any] = {}
    full = parallel_model("adam", 0.01)
    full_hist = full.fit(x, y, checkpoint_dir=os.path.join(d, "full"), **kw)

    ck = os.path.join(d, "crashed")
    real = fit_checkpoints._write_json_synced
    saves = []

    def crashing(path: str, state: dict[str, Any]) -> None:
        saves.append(state["step"])
        if state["step"] == 9:
            with open(path, "w") as f:
                f.write(json.dumps(state)[:40])    # half a file, then the process "dies"
            raise RuntimeError("injected crash in the middle of the save at step 9")
        real(path, state)

    fit_checkpoints._write_json_synced = crashing
    first = parallel_model("adam", 0.01)
    try:
        first.fit(x, y, checkpoint_dir=ck, **kw)
        out["crash"] = "no crash"
    except RuntimeError as e:
        out["crash"] = str(e)
    finally:
        fit_checkpoints._write_json_synced = real
    out["saves"] = saves
    out["left"] = sorted(os.listdir(ck))
    out["latest"] = os.path.basename(fit.latest_checkpoint(ck) or "")
    with open(os.path.join(fit.latest_checkpoint(ck), fit.FIT_STATE)) as f:
        st = json.load(f)
    out["state"] = {k: st[k] for k in ("step", "epoch", "step_in_epoch", "pass_index",
                                       "pass_position", "batches_consumed", "loss_count")}

    resumed = parallel_model("adam", 0.01)
    hist = resumed.fit(x, y, checkpoint_dir=ck, resume=True, **kw)
    out["left_after"] = sorted(os.listdir(ck))
    w_full, w_res = full.global_weights(), resumed.global_weights()
    out["weights_equal"] = all(np.array_equal(w_full[p], w_res[p]) for p in w_full)
    out["weights_max_diff"] = max(float(np.max(np.abs(w_full[p] - w_res[p]))) for p in w_full)
    s_full, s_res = full.runtime.global_slots(), resumed.runtime.global_slots()
    out["slots_equal"] = all(np.array_equal(s_full[k][p], s_res[k][p])
                             for k in s_full for p in s_full[k])
    out["iterations"] = [int(full.runtime.iterations.numpy()),
                         int(resumed.runtime.iterations.numpy())]
    out["history"] = {"full": full_hist.history, "resumed": hist.history,
                      "epochs": [full_hist.epoch, hist.epoch]}

    # each epoch's last batch of 2 examples (42: filled up, trained as Keras trains it)
    # across a crash after step 10, resumed from step 8's checkpoint
    x42, y42 = data()

    class CrashAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 10:
                raise RuntimeError("injected crash after step 10")

    kw = dict(epochs=3, shuffle=True, seed=7, verbose=0, checkpoint_every=4)
    t_full = parallel_model("adam", 0.01)
    th_full = t_full.fit(x42, y42, checkpoint_dir=os.path.join(d, "tail_full"), **kw)
    t_dir = os.path.join(d, "tail")
    try:
        parallel_model("adam", 0.01).fit(x42, y42, checkpoint_dir=t_dir,
                                         callbacks=[CrashAfter()], **kw)
    except RuntimeError:
        pass
    t_res = parallel_model("adam", 0.01)
    th_res = t_res.fit(x42, y42, checkpoint_dir=t_dir, resume=True, **kw)
    w1, w2 = t_full.global_weights(), t_res.global_weights()
    out["tail"] = {"resumed_from": os.path.basename(th_res.resumed_from or ""),
                   "steps": [int(t_full.runtime.iterations.numpy()),
                             int(t_res.runtime.iterations.numpy())],
                   "weights_equal": all(np.array_equal(w1[p], w2[p]) for p in w1),
                   "history": [th_full.history, th_res.history]}

    # a dataset (5 batches a pass) as one stream over epochs of 4 steps: the data position
    # rolls into new passes; a callback crash after step 7, checkpoints every 2 steps
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    kw = dict(epochs=3, steps_per_epoch=4, verbose=0, checkpoint_every=2)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 7:
                raise RuntimeError("injected crash after step 7")

    whole = parallel_model("adam", 0.01)
    whole.fit(ds, checkpoint_dir=os.path.join(d, "ds_full"), **kw)
    broken = parallel_model("adam", 0.01)
    try:
        broken.fit(ds, checkpoint_dir=os.path.join(d, "ds"), callbacks=[Crash()], **kw)
    except RuntimeError as e:
        out["ds_crash"] = str(e)
    with open(os.path.join(fit.latest_checkpoint(os.path.join(d, "ds")), fit.FIT_STATE)) as f:
        st = json.load(f)
    out["ds_state"] = {k: st[k] for k in ("step", "epoch", "step_in_epoch", "pass_index",
                                          "pass_position", "batches_consumed")}
    again = parallel_model("adam", 0.01)
    again.fit(ds, checkpoint_dir=os.path.join(d, "ds"), resume=True, **kw)
    w1, w2 = whole.global_weights(), again.global_weights()
    out["ds_weights_equal"] = all(np.array_equal(w1[p], w2[p]) for p in w1)
    with open(os.path.join(fit.latest_checkpoint(os.path.join(d, "ds")), fit.FIT_STATE)) as f:
        a = json.load(f)
    with open(os.path.join(fit.latest_checkpoint(os.path.join(d, "ds_full")),
                           fit.FIT_STATE)) as f:
        b = json.load(f)
    keys = ("step", "pass_index", "pass_position", "batches_consumed", "history")
    out["ds_final"] = [{k: a[k] for k in keys}, {k: b[k] for k in keys}]

    # the same through keras.callbacks.BackupAndRestore (fit's checkpoints in its backup_dir)
    bk = os.path.join(d, "backup")
    kw = dict(epochs=3, steps_per_epoch=4, verbose=0)
    crashed = parallel_model("adam", 0.01)
    try:
        crashed.fit(ds, callbacks=[keras.callbacks.BackupAndRestore(bk, save_freq=2),
                                   Crash()], **kw)
    except RuntimeError:
        pass
    out["backup_left"] = sorted(os.listdir(bk))
    restarted = parallel_model("adam", 0.01)
    bk_hist = restarted.fit(ds, callbacks=[keras.callbacks.BackupAndRestore(bk, save_freq=2)],
                            **kw)
    w3 = restarted.global_weights()
    out["backup_weights_equal"] = all(np.array_equal(w1[p], w3[p]) for p in w1)
    out["backup_history"] = [bk_hist.history, b["history"]]
    out["backup_deleted"] = not os.path.exists(bk)

    # callbacks' own state: EarlyStopping's patience counter and best weights carry over a
    # crash (after epoch 2's checkpoint) into the resumed run, which stops where the
    # uninterrupted one does and restores the same best weights
    def stopper() -> Any:
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=2,
                                             restore_best_weights=True)

    class CrashAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("injected crash before epoch 3")

    kw = dict(epochs=8, shuffle=False, verbose=0)
    es_full = parallel_model("sgd", 0.05)
    h_full = es_full.fit(x, y, callbacks=[stopper()], **kw)
    es_dir = os.path.join(d, "es")
    try:
        parallel_model("sgd", 0.05).fit(x, y, callbacks=[stopper(), CrashAt()],
                                        checkpoint_dir=es_dir, **kw)
    except RuntimeError:
        pass
    with open(os.path.join(fit.latest_checkpoint(es_dir), fit.FIT_STATE)) as f:
        out["es_saved"] = json.load(f)["callbacks"]
    out["es_arrays"] = sorted(os.listdir(fit.latest_checkpoint(es_dir)))
    es_res = parallel_model("sgd", 0.05)
    h_res = es_res.fit(x, y, callbacks=[stopper()], checkpoint_dir=es_dir, resume=True, **kw)
    w1, w2 = es_full.global_weights(), es_res.global_weights()
    out["es"] = {"epochs": [h_full.epoch, h_res.epoch],
                 "weights_equal": all(np.array_equal(w1[p], w2[p]) for p in w1)}
    try:
        parallel_model("sgd", 0.05).fit(
            x, y, callbacks=[keras.callbacks.ReduceLROnPlateau(monitor="loss"), stopper()],
            checkpoint_dir=es_dir, resume=True, **kw)
        out["es_mismatch"] = "accepted"
    except ValueError as e:
        out["es_mismatch"] = str(e)
    return out


def check_workers() -> dict[str, Any]:
    """One of 2 workers (MultiWorkerMirroredStrategy, one CPU each): fit on a dataset of
    dict elements (2 epochs, TensorBoard) and on shuffled arrays, and through a dataset
    function that reads only this worker's rows, for a data-parallel plan (each worker
    reads its half of every batch) and a random tensor-parallel one, against Keras fit."""
    x, y = data()
    d = os.path.join(JOB["dir"], f"task{fit_task()}")
    os.makedirs(d, exist_ok=True)
    out: dict[str, Any] = {}

    def keras_fit(train: Any, epochs: int, **kw: Any) -> keras.Model:
        ref = build()
        ref.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                    jit_compile=False)
        ref.fit(train, epochs=epochs, verbose=0, **kw)
        return ref

    first40 = ({k: v[:40] for k, v in x.items()}, y[:40])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)   # a partial last batch
    ref = keras_fit(tf.data.Dataset.from_tensor_slices(first40).batch(B), 2)
    ref_all = keras_fit(ds, 2)   # the last 2 examples a batch of their own, as fit takes them
    ref_shuffled = None
    for plan in ("batch", "random"):
        pm = parallel_model("sgd", 0.05, plan)
        data_ = fit._Data(pm, ds, None, None, False, 0)
        out[f"{plan}_shares"] = {"inputs": data_.shares, "targets": str(data_.y_place),
                                 "cut": data_.cut}
        hist = pm.fit(ds, epochs=2, verbose=0, tensorboard=os.path.join(d, f"tb_{plan}"))
        out[f"{plan}_dataset"] = {"loss": close(hist.history["loss"],
                                                ref_all.history.history["loss"]),
                                  "weights": weights_close(pm, ref_all)}
        out[f"{plan}_tags"] = event_tags(os.path.join(d, f"tb_{plan}"))
        # shuffled arrays: Keras's order is its own, so compare with fit on one process
        # taking the same order: each epoch's examples in fit's order, batched (its last
        # batch of 2 too), one dataset of both epochs
        pm2 = parallel_model("sgd", 0.05, plan)
        pm2.fit(x, y, epochs=2, shuffle=True, seed=3, verbose=0)
        if ref_shuffled is None:
            orders = [np.random.default_rng([3, e]).permutation(42) for e in range(2)]
            epochs_ = [tf.data.Dataset.from_tensor_slices(
                ({k: v[o] for k, v in x.items()}, y[o])).batch(B) for o in orders]
            ref_shuffled = keras_fit(epochs_[0].concatenate(epochs_[1]), 1)
        out[f"{plan}_arrays_weights"] = weights_close(pm2, ref_shuffled)

    # a dataset function: each worker reads only its rows of every global batch
    seen: list[Any] = []

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        seen.append([ctx.num_input_pipelines, ctx.input_pipeline_id])
        rows = B // ctx.num_input_pipelines
        lo = ctx.input_pipeline_id * rows
        idx = np.concatenate([np.arange(k * B + lo, k * B + lo + rows) for k in range(5)])
        return tf.data.Dataset.from_tensor_slices(
            ({k: v[idx] for k, v in x.items()}, y[idx])).batch(rows, drop_remainder=True)

    pm3 = parallel_model("sgd", 0.05, "batch")
    hist3 = pm3.fit(dataset_fn, epochs=2, verbose=0)
    out["fn_contexts"] = seen
    out["fn"] = {"loss": close(hist3.history["loss"], ref.history.history["loss"]),
                 "weights": weights_close(pm3, ref)}
    # every example, its last batch of 2 too (filled up, then cut into the workers' shares)
    out["evaluate"] = close(pm3.evaluate(ds), ref.evaluate(ds, verbose=0))
    return out


def check_weighted_steps() -> dict[str, Any]:
    """One training step with sample weights against Keras's ``train_on_batch``, for each
    reduction and random plans (targets placed R and S0), weights per target element
    of a sequence output."""
    def seq_model() -> keras.Model:
        keras.utils.set_random_seed(0)
        t = keras.Input((4, 6), name="t")
        h = keras.layers.Dense(8, activation="relu", name="h")(t)
        return keras.Model(t, keras.layers.Dense(3, name="o")(h))

    spec = tf.TensorSpec([B, 4, 6])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, 4, 6)).astype("float32")
    y = rng.standard_normal((B, 4, 3)).astype("float32")
    # per target element of the sequence (Keras refuses one weight per example here;
    # fit's test covers those on a 2-D output)
    weights = {"element": rng.uniform(0, 2, (B, 4)).astype("float32")}
    out: dict[str, Any] = {"targets": []}
    for seed in JOB.get("seeds", [0, 1]):   # targets placed R, then S0
        graph = capturing.capture(seq_model(), spec, training=True)
        plan = parallel.random_plan(graph, N, seed)
        for reduction in ("sum_over_batch_size", "mean_with_sample_weight", "sum"):
            loss = keras.losses.MeanSquaredError(reduction=reduction)
            for kind, w in weights.items():
                pm = parallel.parallelize(seq_model(), spec, plan, devices=N, loss=loss,
                                          learning_rate=0.1)
                ours = pm.train_step(x, y, sample_weight=w)
                ref = seq_model()
                ref.compile(keras.optimizers.SGD(0.1), loss, jit_compile=False)
                theirs = ref.train_on_batch(x, y, sample_weight=w)
                out[f"{seed} {reduction} {kind}"] = {"loss": close(ours, theirs),
                                                     "weights": weights_close(pm, ref)}
        out["targets"].append(str(pm.runtime.target_placement(3)))
    return out


def check_inference_mode() -> dict[str, Any]:
    """A model with dropout and batch norm, trained in training mode: its ``val_loss`` and
    ``evaluate`` run the inference graph (``ParallelModel.for_inference``) on the trained
    weights, as Keras's do; random plans whose inference graph (Dense and batch norm fused
    into one GraphNode) cannot keep every weight where training keeps it."""
    def dropout_bn() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6,), name="x")
        h = keras.layers.Dense(8, activation="relu", name="h")(inp)
        h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dropout(0.5, name="drop")(h))
        return keras.Model(inp, keras.layers.Dense(3, name="o")(h))

    spec = tf.TensorSpec([B, 6])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6)).astype("float32")
    y = rng.standard_normal((32, 3)).astype("float32")
    ref = dropout_bn()
    ref.compile(keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError(), jit_compile=False)
    rh = ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_data=(x, y))
    out: dict[str, Any] = {}
    for seed in (0, 2):
        plan = parallel.random_plan(capturing.capture(dropout_bn(), spec, training=True), N,
                                    seed)
        pm = parallel.parallelize(dropout_bn(), spec, plan, devices=N, learning_rate=0.1,
                                  loss=keras.losses.MeanSquaredError())
        h = pm.fit(x, y, epochs=2, shuffle=False, verbose=0, validation_data=(x, y))
        inf = pm.for_inference()
        out[f"seed {seed}"] = {
            "loss": close(h.history["loss"], rh.history["loss"]),
            "val_loss": close(h.history["val_loss"], rh.history["val_loss"]),
            "evaluate": close(pm.evaluate(x, y), ref.evaluate(x, y, batch_size=B, verbose=0)),
            # 32 examples in 4 batches, then 30 (a padded last batch), then one batch
            "predict": close(pm.predict(x), ref.predict(x, batch_size=B, verbose=0)),
            "predict_padded": close(pm.predict(x[:30]), ref.predict(x[:30], batch_size=B,
                                                                    verbose=0)),
            "predict_batch": close(pm.predict(x[:B]), ref.predict(x[:B], verbose=0)),
            "separate": inf is not pm and not inf.training,
            "resynced": inf.runtime.resynced,
            "shared": sum(inf.runtime._vars[r][p] is pm.runtime._vars[r][p]
                          for r in pm.runtime.local_replicas for p in pm.runtime.paths)}
    return out


def check_tails() -> dict[str, Any]:
    """43 examples in batches of 8 (a last batch of 3), random plans: with dropout the last
    batch is filled up and every epoch equals Keras's fit over all 43 (the filled-up batch
    draws Keras's masks for its own rows); a model that centres each batch on its mean
    (rows combined) and one with batch norm drop it, with a note naming why, and equal
    Keras's fit over the first 40; evaluate (the inference graph: batch norm keeps rows
    apart there) counts all 43 as Keras's does, except where the centring drops them;
    predict gives all 43 outputs as Keras's, and refuses the centred model's, naming why. A
    model with an op the rules do not know (lgamma, row by row) drops the last 3 in fit and
    evaluate, and predict checks that padding does not reach its rows and gives all 43."""
    from tapas.execution.api import fit_data

    def build(kind: str) -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6,), name="x")
        h = keras.layers.Dense(8, activation="relu", name="h")(inp)
        if kind == "centred":
            h = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True),
                                    name="centre")(h)
        if kind == "unruled":   # row by row, with an op the sharding rules do not know
            h = keras.layers.Lambda(lambda t: tf.math.lgamma(tf.abs(t) + 1.0), name="lgamma")(h)
        h = keras.layers.Dropout(0.3, name="drop")(h)
        if kind == "batch_norm":
            h = keras.layers.BatchNormalization(name="bn")(h)
        model = keras.Model(inp, keras.layers.Dense(3, name="o")(h))
        model.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                      jit_compile=False)
        return model

    spec = tf.TensorSpec([B, 6], name="x")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((43, 6)).astype("float32")
    y = rng.standard_normal((43, 3)).astype("float32")
    notes: list[str] = []
    warning = fit_data.logging.warning
    fit_data.logging.warning = lambda msg, *a: (notes.append(msg % a), warning(msg, *a))[1]
    out: dict[str, Any] = {}
    try:
        for kind in ("dropout", "centred", "batch_norm", "unruled"):
            for seed in (0, 2):
                ref = build(kind)
                kept = 43 if kind == "dropout" else 40
                want = ref.fit(x[:kept], y[:kept], batch_size=B, epochs=2, shuffle=False,
                               verbose=0).history
                model = build(kind)
                plan = parallel.random_plan(capturing.capture(model, spec, training=True), N,
                                            seed)
                pm = parallel.parallelize(model, spec, plan, devices=N)
                del notes[:]
                got = pm.fit(x, y, epochs=2, shuffle=False, verbose=0).history
                out[f"{kind} {seed}"] = {
                    "loss": close(got["loss"], want["loss"]),
                    "weights": weights_close(pm, ref), "notes": list(notes),
                    # centring and lgamma are not known to keep rows apart in inference
                    # either: evaluate drops the last 3 there
                    "evaluate": close(pm.evaluate(x, y, verbose=0),
                                      ref.evaluate(x[:40], y[:40], batch_size=B, verbose=0)
                                      if kind in ("centred", "unruled") else
                                      ref.evaluate(x, y, batch_size=B, verbose=0))}
                if kind == "centred":   # predict cannot drop examples: refused, with why
                    try:
                        pm.predict(x, verbose=0)
                        out[f"{kind} {seed}"]["predict"] = "ran"
                    except ValueError as e:
                        out[f"{kind} {seed}"]["predict"] = str(e)
                else:
                    out[f"{kind} {seed}"]["predict"] = close(
                        pm.predict(x, verbose=0), ref.predict(x, batch_size=B, verbose=0))
    finally:
        fit_data.logging.warning = warning
    return out


def check_long_fit() -> dict[str, Any]:
    """Train for long (a worker of a cluster started by hand, TF_CONFIG set by the test),
    printing ``STEP <n>`` after each step; another worker is killed meanwhile: the error
    this worker ends with (a WorkerLostError naming the lost task, or none)."""
    x, y = data()

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print(f"STEP {int(self.model.optimizer.iterations)}", flush=True)

    pm = parallel_model("sgd", 0.05, "batch")
    try:
        pm.fit(x, y, epochs=100000, verbose=0, callbacks=[Steps()])
        return {"lost": None}
    except fit.WorkerLostError as e:
        return {"lost": str(e)}


def check_keras_conveniences() -> dict[str, Any]:
    """``validation_split``, ``class_weight`` and ``validation_freq`` (with compiled and
    weighted metrics) against Keras's ``fit`` with the same arguments, under a random
    plan."""
    def classifier() -> keras.Model:
        keras.utils.set_random_seed(0)
        inp = keras.Input((6,), name="x")
        h = keras.layers.Dense(8, activation="relu", name="h")(inp)
        model = keras.Model(inp, keras.layers.Dense(3, name="o")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["sparse_categorical_accuracy"],
                      weighted_metrics=["sparse_categorical_accuracy"], jit_compile=False)
        return model

    rng = np.random.default_rng(3)
    x = rng.standard_normal((5 * B, 6)).astype("float32")
    y = rng.integers(0, 3, (5 * B,))
    kw = dict(batch_size=B, epochs=4, verbose=0, shuffle=False, validation_split=0.2,
              class_weight={0: 1.0, 1: 3.0, 2: 0.5}, validation_freq=2)
    ref = classifier()
    want = ref.fit(x, y, **kw).history
    spec = tf.TensorSpec([B, 6])
    plan = parallel.random_plan(capturing.capture(classifier(), spec, training=True), N, 1)
    pm = parallel.parallelize(classifier(), spec, plan, devices=N)
    got = pm.fit(x, y, **kw).history
    return {"keys": [sorted(got), sorted(want)],
            **{k: close(got.get(k, []), v) for k, v in want.items()},
            "weights": weights_close(pm, ref)}


class Batches(keras.utils.PyDataset):
    """Global batches of (x, y) by index, recording the indices asked and the epoch hooks."""

    def __init__(self, x: Any, y: Any) -> None:
        super().__init__()
        self.x, self.y = x, y
        self.asked: list[int] = []
        self.begins = self.ends = 0

    def __len__(self) -> int:
        return len(self.y) // B

    def __getitem__(self, i: int) -> Any:
        self.asked.append(int(i))
        rows = slice(i * B, (i + 1) * B)
        return {k: v[rows] for k, v in self.x.items()}, self.y[rows]

    def on_epoch_begin(self) -> None:
        self.begins += 1

    def on_epoch_end(self) -> None:
        self.ends += 1


def generator(x: Any, y: Any, batches: int) -> Any:
    for i in range(batches):
        rows = slice(i * B, (i + 1) * B)
        yield {k: v[rows] for k, v in x.items()}, y[rows]


def check_python_data() -> dict[str, Any]:
    """A keras.utils.PyDataset and a Python generator, as Keras's fit, evaluate and predict
    take them, against Keras's on one device (40 examples: 5 full global batches)."""
    x, y = data(40)
    xv, yv = data(16, seed=1)
    out: dict[str, Any] = {}

    def keras_ref() -> keras.Model:
        ref = build()
        ref.compile(keras.optimizers.SGD(0.05), keras.losses.MeanSquaredError(),
                    jit_compile=False)
        return ref

    # a PyDataset with a PyDataset for validation, 3 epochs
    pm, ref = parallel_model("sgd", 0.05), keras_ref()
    ours_ds, val_ds = Batches(x, y), Batches(xv, yv)
    h = pm.fit(ours_ds, epochs=3, shuffle=False, verbose=0, validation_data=val_ds)
    rh = ref.fit(Batches(x, y), epochs=3, shuffle=False, verbose=0,
                 validation_data=Batches(xv, yv))
    out["pydataset"] = {k: close(h.history[k], rh.history[k]) for k in ("loss", "val_loss")}
    out["pydataset"]["weights"] = weights_close(pm, ref)
    out["pydataset"]["hooks"] = [ours_ds.begins, ours_ds.ends, ours_ds.asked[:5]]
    out["evaluate"] = close(pm.evaluate(Batches(xv, yv), verbose=0),
                            ref.evaluate(Batches(xv, yv), verbose=0))
    out["predict"] = close(pm.predict(Batches(x, y), verbose=0),
                           ref.predict(Batches(x, y), verbose=0))
    out["predict_generator"] = close(pm.predict(generator(x, y, 5), verbose=0),
                                     ref.predict(generator(x, y, 5), verbose=0))
    # class_weight: each batch weighted by its targets' classes, as Keras's adapter does
    pm, ref = parallel_model("sgd", 0.05), keras_ref()
    weights = {0: 1.0, 1: 3.0, 2: 0.5}
    h = pm.fit(Batches(x, y), epochs=2, shuffle=False, verbose=0, class_weight=weights)
    rh = ref.fit(Batches(x, y), epochs=2, shuffle=False, verbose=0, class_weight=weights)
    out["class_weight"] = {"loss": close(h.history["loss"], rh.history["loss"]),
                           "weights": weights_close(pm, ref)}
    # shuffled: each pass a permutation of the batches drawn from the seed
    shuffled = Batches(x, y)
    parallel_model("sgd", 0.05).fit(shuffled, epochs=2, shuffle=True, seed=3, verbose=0)
    out["shuffled"] = [shuffled.asked[1:6], shuffled.asked[6:11]]   # (asked[0]: the peek)
    # a generator read as one stream over epochs of 2 steps
    pm, ref = parallel_model("sgd", 0.05), keras_ref()
    h = pm.fit(generator(x, y, 5), epochs=2, steps_per_epoch=2, verbose=0)
    rh = ref.fit(generator(x, y, 5), epochs=2, steps_per_epoch=2, verbose=0)
    out["generator"] = {"loss": close(h.history["loss"], rh.history["loss"]),
                        "weights": weights_close(pm, ref)}
    # one that runs out: the epochs before equal Keras's, then training stops
    pm, ref = parallel_model("sgd", 0.05), keras_ref()
    h = pm.fit(generator(x, y, 3), epochs=4, steps_per_epoch=2, verbose=0)
    rh = ref.fit(generator(x, y, 3), epochs=4, steps_per_epoch=2, verbose=0)
    out["ran_out"] = {"epochs": len(h.history["loss"]),
                      "loss": close(h.history["loss"], rh.history["loss"][:2]),
                      "steps": int(pm.runtime.iterations.numpy())}
    refused = {}
    for name, call in (
            ("y", lambda: pm.fit(Batches(x, y), y, verbose=0)),
            ("validation", lambda: pm.fit(x, y, verbose=0,
                                          validation_data=generator(xv, yv, 2))),
            ("no_targets", lambda: pm.fit((v for v in [x]), verbose=0)),
            ("split", lambda: pm.fit(Batches(x, y), verbose=0, validation_split=0.2))):
        try:
            call()
            refused[name] = "ran"
        except ValueError as e:
            refused[name] = str(e)
    out["refused"] = refused
    return out


def check_model_checkpoint() -> dict[str, Any]:
    """Keras's ModelCheckpoint (the best whole model by val_loss, the weights every epoch)
    against Keras's fit with the same callbacks, Adam under a random plan: the files
    written, their weights, the whole model's optimizer variables, and one more epoch of
    Keras's fit from each loaded file."""
    x, y = data(40)
    xv, yv = data(16, seed=1)
    d = os.path.join(JOB["dir"], "model_checkpoint")
    os.makedirs(d, exist_ok=True)

    def compiled() -> keras.Model:
        model = build()
        model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError(),
                      jit_compile=False)
        return model

    def checkpoints(who: str) -> list[Any]:
        return [keras.callbacks.ModelCheckpoint(f"{d}/{who}_best.keras", monitor="val_loss",
                                                save_best_only=True),
                keras.callbacks.ModelCheckpoint(f"{d}/{who}_{{epoch}}.weights.h5",
                                                save_weights_only=True)]

    graph = capturing.capture(build(), SPEC, training=True)
    pm = parallel.parallelize(compiled(), SPEC, parallel.random_plan(graph, N, 1), devices=N)
    pm.fit(x, y, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv),
           callbacks=checkpoints("ours"))
    ref = compiled()
    ref.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
            validation_data=(xv, yv), callbacks=checkpoints("keras"))
    out: dict[str, Any] = {"files": sorted(os.listdir(d))}
    # ParallelModel.save of a .keras path and save_weights: Keras's files, as ref's
    final = os.path.join(JOB["dir"], "final")
    os.makedirs(final, exist_ok=True)
    pm.save(f"{final}/ours.keras")
    pm.save_weights(f"{final}/ours.weights.h5")
    ours, theirs = keras.models.load_model(f"{final}/ours.keras"), build()
    theirs.load_weights(f"{final}/ours.weights.h5")
    out["save"] = {"weights": all(np.allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
                                  for a, b in zip(ours.weights, ref.weights)),
                   "save_weights": all(np.allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                                   atol=1e-6)
                                       for a, b in zip(theirs.weights, ref.weights)),
                   "optimizer": all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                atol=1e-7) for a, b in
                                    zip(ours.optimizer.variables, ref.optimizer.variables))}
    ours, theirs = (keras.models.load_model(f"{d}/{w}_best.keras") for w in ("ours", "keras"))
    out["best_weights"] = all(np.allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
                                  for a, b in zip(ours.weights, theirs.weights))
    out["optimizer"] = {"names": [v.name for v in ours.optimizer.variables] ==
                        [v.name for v in theirs.optimizer.variables],
                        "count": len(ours.optimizer.variables),
                        "equal": all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                 atol=1e-7) for a, b in
                                     zip(ours.optimizer.variables, theirs.optimizer.variables)),
                        "iterations": int(ours.optimizer.iterations.numpy())}
    out["continued"] = close(
        ours.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0).history["loss"],
        theirs.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0).history["loss"])
    per_epoch = []
    for epoch in (1, 2, 3):
        a, b = build(), build()
        a.load_weights(f"{d}/ours_{epoch}.weights.h5")
        b.load_weights(f"{d}/keras_{epoch}.weights.h5")
        per_epoch.append(all(np.allclose(u.numpy(), v.numpy(), rtol=1e-5, atol=1e-6)
                             for u, v in zip(a.weights, b.weights)))
    out["weights_files"] = per_epoch
    # another optimizer than the compiled one: its whole-model file refused with the fix
    other = parallel.parallelize(compiled(), SPEC, parallel.random_plan(graph, N, 1),
                                 devices=N, optimizer="sgd", learning_rate=0.1)
    try:
        other.fit(x, y, epochs=1, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(f"{d}/other.keras")])
        out["other_optimizer"] = "ran"
    except ValueError as e:
        out["other_optimizer"] = str(e)
    return out


def fit_task() -> int:
    cfg = devices.tf_config()
    return int(cfg["task"]["index"]) if cfg else 0


if __name__ == "__main__":
    run_checks({"keras": check_keras, "resume": check_resume, "workers": check_workers,
                "weighted": check_weighted_steps, "inference": check_inference_mode,
                "long_fit": check_long_fit, "conveniences": check_keras_conveniences,
                "python_data": check_python_data, "model_checkpoint": check_model_checkpoint,
                "tails": check_tails},
               JOB["checks"])
    finish()
