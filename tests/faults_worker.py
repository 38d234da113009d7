"""Subprocess entry of tests/test_faults.py: checkpoint faults of ``ParallelModel.fit`` on
2 logical CPU devices (set once per process).

    python tests/faults_worker.py '{"checks": ["damaged", "step_error"], "dir": D}'

Each check prints one line ``RESULT <json>`` (``tests/worker_main.py``). The model: two
inputs ``a`` (6) and ``b`` (4), concatenated, Dense(8, relu), Dense(3), MSE; Adam; a random
plan that shards it; 40 examples, global batch 8 (5 steps an epoch), shuffled.

* ``damaged``: a 4-epoch run checkpointing every 3 steps (and at epoch ends) keeps them
  all; then, for each kind of damage to ckpt-15 (a truncated data file, truncated
  ``tapas-fit.json`` or ``tapas-checkpoint.json``, flipped bytes in the data file, a
  missing index), a copy of the directory without the checkpoints after step 15 is resumed
  by a new ParallelModel: which checkpoint it read, which it skipped and why, and whether
  its final weights and Adam slots equal the uninterrupted run's bit for bit.
* ``paused``: the checkpoint directory is moved away after step 4 and back after step 8:
  the steps in between train, their saves are skipped with a warning, the checkpoints kept
  in the moved directory, and the final weights equal an uninterrupted run's.
* ``unwritable``: a checkpoint directory that cannot be created, and one that cannot be
  written, are refused before the first step (the step counter stays 0); the estimate of
  one checkpoint's bytes against what a save writes, and a disk too small refused.
* ``step_error``: a 4-class classifier's step on labels of 7, three times: the errors
  raised (TensorFlow's own message wanted), the weights unchanged, then a good step.
* ``py_function``: a model calling tf.py_function, under random plans, verified.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

JOB = json.loads(sys.argv[1])
devices.setup_devices(2, "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from tapas import capturing  # noqa: E402
from tapas.execution.runtime import checkpoints  # noqa: E402
from tapas.execution.api import fit, parallel  # noqa: E402

B = 8
SPEC = {"a": tf.TensorSpec([B, 6]), "b": tf.TensorSpec([B, 4])}


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="concat")([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(h))


def data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal((40, 6)).astype("float32"),
         "b": rng.standard_normal((40, 4)).astype("float32")}
    return x, rng.standard_normal((40, 3)).astype("float32")


def parallel_model() -> Any:
    graph = capturing.capture(build(), SPEC, training=True)
    return parallel.parallelize(build(), SPEC, parallel.random_plan(graph, 2, 1), devices=2,
                                optimizer="adam", learning_rate=0.01,
                                loss=keras.losses.MeanSquaredError())


def equal_state(a: Any, b: Any) -> bool:
    wa, wb = a.global_weights(), b.global_weights()
    sa, sb = a.runtime.global_slots(), b.runtime.global_slots()
    return (all(np.array_equal(wa[p], wb[p]) for p in wa)
            and all(np.array_equal(sa[k][p], sb[k][p]) for k in sa for p in sa[k]))


class Warnings:
    """The messages absl logs at WARNING while it is open."""

    def __enter__(self) -> list[str]:
        import logging as std
        self.seen: list[str] = []
        seen = self.seen

        class Keep(std.Handler):
            def emit(self, record: Any) -> None:
                if record.levelno >= std.WARNING:
                    seen.append(record.getMessage())
        self.handler = Keep()
        logging.get_absl_logger().addHandler(self.handler)
        return self.seen

    def __exit__(self, *exc: Any) -> None:
        logging.get_absl_logger().removeHandler(self.handler)


def _truncate(path: str, fraction: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * fraction))


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _data_file(ckpt: str) -> str:
    return os.path.join(ckpt, next(n for n in sorted(os.listdir(ckpt)) if ".data-" in n))


DAMAGE = {
    "truncated data": lambda c: _truncate(_data_file(c)),
    "truncated tapas-fit.json": lambda c: _truncate(os.path.join(c, fit.FIT_STATE)),
    "truncated tapas-checkpoint.json":
        lambda c: _truncate(os.path.join(c, checkpoints.CHECKPOINT_META)),
    "flipped bytes": lambda c: _flip(_data_file(c)),
    "missing index": lambda c: os.remove(os.path.join(c, "task0.index")),
}

KW = dict(epochs=4, shuffle=True, seed=3, verbose=0, checkpoint_every=3, keep=20)


def check_damaged() -> dict[str, Any]:
    x, y = data()
    base = os.path.join(JOB["dir"], "base")
    full = parallel_model()
    full.fit(x, y, checkpoint_dir=base, **KW)
    out: dict[str, Any] = {"saved": [os.path.basename(p) for p in fit.list_checkpoints(base)]}
    for name, spoil in DAMAGE.items():
        d = os.path.join(JOB["dir"], name.replace(" ", "_"))
        shutil.copytree(base, d)
        for p in fit.list_checkpoints(d):
            if int(p.rsplit("-", 1)[1]) > 15:
                shutil.rmtree(p)
        spoil(os.path.join(d, "ckpt-00000015"))
        found, skipped = fit.usable_checkpoint(d)
        resumed = parallel_model()
        with Warnings() as warned:
            hist = resumed.fit(x, y, checkpoint_dir=d, resume=True, **KW)
        out[name] = {"usable": os.path.basename(found or ""),
                     "skipped": [(os.path.basename(p), why) for p, why in skipped],
                     "resumed_from": os.path.basename(hist.resumed_from or ""),
                     "warnings": warned,
                     "step": int(resumed.runtime.iterations.numpy()),
                     "equal": equal_state(full, resumed)}
    return out


def check_paused() -> dict[str, Any]:
    x, y = data()
    d = os.path.join(JOB["dir"], "paused")
    away = d + "-away"

    class Move(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = int(self.model.optimizer.iterations)
            if step == 4:
                os.rename(d, away)
            elif step == 8:
                os.rename(away, d)

    pm = parallel_model()
    with Warnings() as warned:
        pm.fit(x, y, checkpoint_dir=d, callbacks=[Move()], **KW)
    reference = parallel_model()
    reference.fit(x, y, checkpoint_dir=os.path.join(JOB["dir"], "paused-ref"), **KW)
    return {"step": int(pm.runtime.iterations.numpy()), "warnings": warned,
            "kept": sorted(os.listdir(d)), "equal": equal_state(pm, reference)}


def check_unwritable() -> dict[str, Any]:
    x, y = data()
    pm = parallel_model()
    blocker = os.path.join(JOB["dir"], "a-file")
    with open(blocker, "w") as f:
        f.write("not a directory")
    if os.geteuid() == 0:
        read_only = "/sys"   # a directory even root cannot create files in
    else:
        read_only = os.path.join(JOB["dir"], "read-only")
        os.makedirs(read_only)
        os.chmod(read_only, 0o555)
    out: dict[str, Any] = {}
    for name, d in (("uncreatable", os.path.join(blocker, "ck")), ("read_only", read_only)):
        try:
            pm.fit(x, y, checkpoint_dir=d, **KW)
            out[name] = "trained"
        except checkpoints.CheckpointDirectoryError as e:
            out[name] = str(e)
    out["step"] = int(pm.runtime.iterations.numpy())
    need = checkpoints.checkpoint_bytes(pm.runtime)
    out["bytes"] = need
    pm.save(os.path.join(JOB["dir"], "one"))   # what one checkpoint's shards take on disk
    out["saved_bytes"] = sum(os.path.getsize(os.path.join(JOB["dir"], "one", f))
                             for f in os.listdir(os.path.join(JOB["dir"], "one"))
                             if ".data-" in f)
    try:
        checkpoints.check_space(JOB["dir"], 2**62)
        out["no_space"] = "accepted"
    except checkpoints.CheckpointDirectoryError as e:
        out["no_space"] = str(e)
    return out


def check_step_error() -> dict[str, Any]:
    """Labels beyond the classes of a 4-class classifier, three times (whichever replica's
    error TensorFlow raises first), then a good step."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), name="x")
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(8)(inp)))
    spec = tf.TensorSpec([B, 6], name="x")
    graph = capturing.capture(model, spec, training=True)
    pm = parallel.parallelize(model, spec, parallel.random_plan(graph, 2, 0), devices=2,
                              loss=keras.losses.SparseCategoricalCrossentropy(
                                  from_logits=True))
    x = np.random.default_rng(0).standard_normal((B, 6)).astype("float32")
    before = pm.global_weights()
    errors = []
    for _ in range(3):
        try:
            pm.train_step(x, np.full((B,), 7))
            errors.append("no error")
        except Exception as e:  # noqa: BLE001  (its class and message are the result)
            errors.append(f"{type(e).__name__}: {e}")
    after = pm.global_weights()
    unchanged = all(np.array_equal(before[p], after[p]) for p in before)
    loss = pm.train_step(x, np.arange(B) % 4)
    return {"errors": errors, "unchanged": unchanged, "good_loss": loss,
            "step": int(pm.runtime.iterations.numpy())}


def check_py_function() -> dict[str, Any]:
    """A Lambda around tf.py_function (a differentiable eager function, and a NumPy one
    with no gradient in an inference model): replicated in random plans that split its
    neighbours, verified against Keras for 2 steps."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), name="x")

    def sine(t: Any) -> Any:
        y = tf.py_function(lambda u: 2.0 * tf.sin(u), [t], tf.float32)
        y.set_shape(t.shape)
        return y
    h = keras.layers.Lambda(sine, name="pyf")(keras.layers.Dense(8)(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    spec = tf.TensorSpec([B, 6], name="x")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, 6)).astype("float32")
    y = rng.standard_normal((B, 3)).astype("float32")
    graph = capturing.capture(model, spec, training=True)
    out: dict[str, Any] = {}
    for seed in range(3):
        plan = parallel.random_plan(graph, 2, seed)
        pm = parallel.parallelize(model, spec, plan, devices=2)
        report = pm.verify(x, y, steps=2)
        out[f"random:{seed}"] = {"ok": bool(report["ok"]), "patterns": sorted(
            {str(p.name) for p in plan.patterns.values()})}
    return out


if __name__ == "__main__":
    run_checks({"damaged": check_damaged, "paused": check_paused,
                "unwritable": check_unwritable, "step_error": check_step_error,
                "py_function": check_py_function},
               JOB["checks"])
    finish()
