"""Subprocess entry of tests/test_memory.py: memory per device and per worker.

    python tests/memory_worker.py '{"devices": 2, "checks": ["report"]}'

Checks: ``report`` (``ParallelModel.memory_report`` and fit's memory summary against the
runtime's shards and the process's own peak RSS).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

JOB = json.loads(sys.argv[1])
if devices.tf_config() is None:
    devices.setup_devices(JOB["devices"], "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _mlp(width: int = 64) -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((32,), name="x")
    h = keras.layers.Dense(width, activation="relu", name="up")(x)
    return keras.Model(x, keras.layers.Dense(8, name="down")(h))


def check_report() -> dict:
    from tapas.execution import memory, parallel
    from tapas.capturing import capture
    model = _mlp()
    spec = tf.TensorSpec([8, 32], name="x")
    plan = parallel.random_plan(capture(model, spec), JOB["devices"], 0, p_shard=1.0)
    pm = parallel.parallelize(model, spec, plan, devices=JOB["devices"], optimizer="adam",
                              loss=keras.losses.MeanSquaredError())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 32)).astype("float32")
    y = rng.standard_normal((32, 8)).astype("float32")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = pm.fit(x, y, epochs=1, verbose=2)
    report = pm.memory_report()
    rt = pm.runtime
    shard_bytes = sum(float(np.prod(s.local_shape)) * 4 for s in rt.specs.values())
    return {"predicted": report.predicted, "parts": report.parts, "rows": report.per_worker(),
            "shard_bytes": shard_bytes, "slots": len(rt.optimizer.slot_names),
            "own_rss": memory.peak_rss_bytes(), "table": report.table(),
            "fit_printed": printed.getvalue(),
            "history_memory": history.memory.to_json()}


CHECKS = {"report": check_report}

if __name__ == "__main__":
    run_checks(CHECKS, JOB["checks"])
    finish()
