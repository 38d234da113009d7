"""Subprocess entry of tests/test_memory.py: memory per device and per worker.

    python tests/memory_worker.py '{"devices": 2, "checks": ["report"]}'

Checks: ``report`` (``ParallelModel.memory_report`` and fit's memory summary against the
runtime's shards and the process's own peak RSS), ``materialize`` (a lazily built model
trained under a memory limit), ``reshard_save`` / ``reshard_restore`` (a checkpoint restored
under another layout and device count: the bytes each process reads).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)

# the job (a worker process); empty when the test imports this file for deep_mlp
JOB = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if JOB and devices.tf_config() is None:
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
    from tapas.execution.runtime import memory
    from tapas.execution.api import parallel
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


def check_release_heap() -> dict:
    """How often the runtime gives the C heap's free pages back (memory.release_free_heap,
    counted) over three train steps and two predicts: when a function traced, before its
    first run and after the call."""
    from tapas.execution.runtime import memory
    from tapas.execution.api import parallel
    calls = []
    original = memory.release_free_heap
    memory.release_free_heap = lambda: calls.append(1) or original()
    model = _mlp()
    pm = parallel.parallelize(model, tf.TensorSpec([8, 32], name="x"), devices=JOB["devices"],
                              optimizer="adam", loss=keras.losses.MeanSquaredError())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype("float32")
    y = rng.standard_normal((8, 8)).astype("float32")
    counts = {}
    for k in range(3):
        pm.train_step(x, y)
        counts[f"train {k + 1}"] = len(calls)
    pm.predict(x)
    counts["predict"] = len(calls)
    pm.predict(x)
    counts["predict again"] = len(calls)
    return counts


def _vm_data() -> int:
    """This process's private writable virtual memory (what RLIMIT_DATA limits), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def deep_mlp(width: int, depth: int, frozen: int = 0) -> keras.Model:
    """``frozen`` non-trainable Dense layers (a frozen backbone), then ``depth`` trainable
    ones, then a Dense(8) head; every layer ``width`` wide."""
    x = keras.Input((width,), name="x")
    h = x
    for k in range(frozen):
        h = keras.layers.Dense(width, activation="relu", trainable=False, name=f"f{k}")(h)
    for k in range(depth):
        h = keras.layers.Dense(width, activation="relu", name=f"d{k}")(h)
    return keras.Model(x, keras.layers.Dense(8, name="out")(h))


def _splitting_weights(node, graph, n) -> list:
    """A GraphNode's patterns that split every kernel it has (all of them if none do)."""
    from tapas.sharding.patterns import patterns_for
    from tapas.sharding.placements import Replica
    pats = patterns_for(node, graph, n)
    split = [p for p in pats if p.weights and not any(
        isinstance(w, Replica) for path, w in p.weights.items() if path.endswith("kernel"))]
    return split or pats


def check_materialize() -> dict:
    """A model built lazily (tapas.execution.runtime.materialize; eagerly with ``eager``) and
    parallelized over the workers, under RLIMIT_DATA = this process's VmData now +
    ``limit_mib`` when given: two SGD steps, then the checkpoint written to ``dir`` (each
    worker its shards; the parent reassembles them and compares them with Keras). With
    ``restore``: that checkpoint restored under this run's layout (``plan_seed``; with
    ``direct``, the shards created from its slices, never initialized), then one step."""
    import resource

    from tapas.capturing import capture
    from tapas.execution.runtime import materialize, memory
    from tapas.execution.api import parallel
    strategy = devices.make_strategy(devices_per_worker=1) if devices.tf_config() \
        else devices.make_strategy(JOB["devices"])
    stages = {"start": _vm_data()}
    if JOB.get("limit_mib"):
        limit = stages["start"] + int(JOB["limit_mib"] * 2**20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    width, depth, frozen = JOB["width"], JOB["depth"], JOB.get("frozen", 0)
    keras.utils.set_random_seed(0)
    if JOB.get("eager"):
        model = deep_mlp(width, depth, frozen)
    else:
        model = materialize.build_lazily(lambda: deep_mlp(width, depth, frozen))
    stages["built"] = _vm_data()
    spec = tf.TensorSpec([8, width], name="x")
    n = strategy.num_replicas_in_sync
    plan = parallel.random_plan(capture(model, spec), n, JOB.get("plan_seed", 0), p_shard=1.0,
                                patterns_fn=_splitting_weights)
    pm = parallel.parallelize(model, spec, plan, distribute_strategy=strategy,
                              optimizer=keras.optimizers.SGD(0.01),
                              loss=keras.losses.MeanSquaredError(),
                              weights_from=JOB.get("restore") if JOB.get("direct") else None)
    stages["sharded"] = _vm_data()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, width)).astype("float32")
    y = rng.standard_normal((8, 8)).astype("float32")
    if JOB.get("restore"):   # the checkpoint of another run, under this run's layout
        how = pm.restore(JOB["restore"])
        stages["restored"] = _vm_data()
        return {"how": how, "step": int(pm.runtime.iterations.numpy()),
                "loss": pm.train_step(x, y), "stages": stages,
                "placements": {p: str(s.placement) for p, s in pm.runtime.specs.items()},
                "peak_rss": memory.peak_rss_bytes(),
                "limit": resource.getrlimit(resource.RLIMIT_DATA)[0]}
    losses = [pm.train_step(x, y) for _ in range(2)]
    stages["trained"] = _vm_data()
    rt = pm.runtime
    pm.save(JOB["dir"])   # each worker its own shards (the parent reassembles and compares)
    stages["saved"] = _vm_data()
    placements = {p: str(s.placement) for p, s in rt.specs.items()}
    return {"losses": losses, "paths": rt.paths, "stages": stages, "placements": placements,
            "peak_rss": memory.peak_rss_bytes(), "task": rt.task_id,
            "limit": resource.getrlimit(resource.RLIMIT_DATA)[0]}


def _reshard_model() -> tuple:
    from tapas.capturing import capture
    from tapas.execution.api import parallel
    strategy = devices.make_strategy(devices_per_worker=1) if devices.tf_config() \
        else devices.make_strategy(JOB["devices"])   # first: before any op
    keras.utils.set_random_seed(0)
    model = _mlp(width=256)
    spec = tf.TensorSpec([8, 32], name="x")
    plan = parallel.random_plan(capture(model, spec), strategy.num_replicas_in_sync,
                                JOB["seed"], p_shard=1.0, patterns_fn=_splitting_weights)
    pm = parallel.parallelize(model, spec, plan, distribute_strategy=strategy,
                              optimizer="adam", loss=keras.losses.MeanSquaredError(),
                              weights_from=JOB["dir"] if JOB.get("direct") else None)
    return pm


def check_reshard_save() -> dict:
    """One Adam step under one layout, saved to ``dir``; the global weights and slots
    beside it (``global.npz``) for the restoring side to compare."""
    pm = _reshard_model()
    rng = np.random.default_rng(0)
    pm.train_step(rng.standard_normal((8, 32)).astype("float32"),
                  rng.standard_normal((8, 8)).astype("float32"))
    pm.save(JOB["dir"])
    rt = pm.runtime
    arrays = {f"w:{p}": v for p, v in rt.global_weights().items()}
    arrays.update({f"{k}:{p}": v for k, per in rt.global_slots().items() for p, v in per.items()})
    np.savez(os.path.join(JOB["dir"], "global.npz"), **arrays)
    return {"placements": {p: str(s.placement) for p, s in rt.specs.items()}}


def check_reshard_restore() -> dict:
    """The checkpoint of ``check_reshard_save`` restored under another layout (with
    ``direct``, the shards created from it: ``parallelize(weights_from=...)``): the bytes
    this process read, its replicas and layout, and whether every weight and slot equals
    the saved global value."""
    pm = _reshard_model()
    rt = pm.runtime
    how = pm.restore(JOB["dir"])
    saved = dict(np.load(os.path.join(JOB["dir"], "global.npz")))
    weights, slots = rt.global_weights(), rt.global_slots()
    worst = max([float(np.abs(weights[p] - saved[f"w:{p}"]).max()) for p in weights]
                + [float(np.abs(v - saved[f"{k}:{p}"]).max())
                   for k, per in slots.items() for p, v in per.items()])
    return {"how": how, "read": rt.restore_read_bytes, "replicas": rt.local_replicas,
            "placements": {p: str(s.placement) for p, s in rt.specs.items()},
            "shapes": {p: list(s.global_shape) for p, s in rt.specs.items()},
            "trainable": rt.trainable_paths, "slots": list(rt.optimizer.slot_names),
            "worst": worst, "step": int(rt.iterations.numpy())}


CHECKS = {"report": check_report, "release_heap": check_release_heap,
          "materialize": check_materialize, "reshard_save": check_reshard_save,
          "reshard_restore": check_reshard_restore}

if __name__ == "__main__":
    run_checks(CHECKS, JOB["checks"])
    finish()
