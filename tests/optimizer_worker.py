"""Subprocess entry of tests/test_keras_optimizer.py: ``tapas.parallelize(model).fit`` on N
logical CPU devices, with the optimizer the model is compiled with, against Keras's own
``model.fit`` of the same model on one device.

    python tests/optimizer_worker.py '{"devices": 2, "cases": ["adam", ...]}'

Each case prints one line ``RESULT <json>`` (``tests/worker_main.py``): the History's losses
and the final weights of both sides, whether the plan splits a weight, and which one. The
models are written as a user writes them: a one-input MLP and a two-input (dict) model, MSE,
compiled with the case's optimizer; 32 examples, global batch 8, 3 epochs, no shuffling.
Odd cases use a random plan, even ones the searched plan.
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
from tapas.sharding.placements import Split, parse_placement  # noqa: E402

N = JOB["devices"]
B, EXAMPLES, EPOCHS = 8, 32, 3
O = keras.optimizers


def _adamw() -> Any:
    opt = O.AdamW(O.schedules.CosineDecay(1e-3, 12, warmup_target=3e-2, warmup_steps=2),
                  weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


OPTIMIZERS = {
    "sgd_nesterov": lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(1e-2),
    "adamw_cosine_warmup": _adamw,
    "rmsprop": lambda: O.RMSprop(1e-2, momentum=0.5),
    "lion": lambda: O.Lion(1e-3),
    "clipnorm": lambda: O.SGD(0.1, clipnorm=0.05),
    "global_clipnorm": lambda: O.Adam(1e-2, global_clipnorm=0.1),
    "ema": lambda: O.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    "accumulation": lambda: O.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2),
    # mixed precision: compile wraps the optimizer in a LossScaleOptimizer under
    # mixed_float16; the overflow case starts at a scale whose gradients overflow float16,
    # so the first steps are skipped (and the scale halved) on every device
    "mixed_float16": lambda: O.Adam(1e-2),
    "mixed_float16_overflow": lambda: O.LossScaleOptimizer(O.Adam(1e-2),
                                                           initial_scale=2.0 ** 22),
    "mixed_bfloat16": lambda: O.Adam(1e-2),
}
#: (rtol, atol) of the History and the weights: float32 rounding, or the dtype's
TOLERANCE = {"mixed_float16": (1e-2, 2e-3), "mixed_float16_overflow": (1e-2, 2e-3),
             "mixed_bfloat16": (5e-2, 2e-2)}


def one_input() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(4, name="out")(h), name="mlp")


def dict_inputs() -> keras.Model:
    keras.utils.set_random_seed(0)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(
        keras.layers.Concatenate(name="concat")([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(4, name="out")(h),
                       name="two_inputs")


def data(dict_model: bool) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(1)
    y = rng.standard_normal((EXAMPLES, 4)).astype("float32")
    if dict_model:
        return {"a": rng.standard_normal((EXAMPLES, 6)).astype("float32"),
                "b": rng.standard_normal((EXAMPLES, 4)).astype("float32")}, y
    return rng.standard_normal((EXAMPLES, 6)).astype("float32"), y


def compiled(build: Any, case: str) -> keras.Model:
    policy = next((p for p in ("mixed_float16", "mixed_bfloat16") if case.startswith(p)),
                  "float32")
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = build()
        model.compile(optimizer=OPTIMIZERS[case](), loss="mse")
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return model


def weight_splitting(node: Any, graph: Any, n: int) -> list[Any]:
    """The patterns of ``node`` that split one of its weights, when it has any (a random
    plan over these exercises the shards: clipping norms, slots, decay)."""
    from tapas.sharding import patterns
    every = patterns.patterns_for(node, graph, n)
    splitting = [p for p in every
                 if any(isinstance(parse_placement(v), Split) for v in p.weights.values())]
    return splitting or every


def run_case(index: int, case: str) -> dict[str, Any]:
    dict_model = index % 2 == 1
    build = dict_inputs if dict_model else one_input
    x, y = data(dict_model)
    ref = compiled(build, case)
    want = ref.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0).history
    model = compiled(build, case)
    spec = ({"a": tf.TensorSpec([B, 6]), "b": tf.TensorSpec([B, 4])} if dict_model
            else tf.TensorSpec([B, 6]))
    plan = None
    if index % 2 == 1:
        graph = capturing.capture(compiled(build, case), spec, training=True)
        plan = parallel.random_plan(graph, N, seed=index, patterns_fn=weight_splitting)
    pm = parallel.parallelize(model, spec, plan, devices=N)
    got = pm.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0).history
    return {"model": "dict" if dict_model else "one",
            **compared(pm, ref, got, want, plan, case, build(),
                       lambda: ref.optimizer.dynamic_scale)}


def compared(pm: Any, ref: Any, got: dict, want: dict, plan: Any, case: str, fresh: Any,
             keras_scale: Any) -> dict[str, Any]:
    """What a case reports of ``pm``'s fit against Keras's (``ref``): the History's losses,
    the final weights (within the case's tolerance), the weights the plan splits, how far
    Keras moved the weights from ``fresh`` (the same model untrained), and with loss
    scaling both scales (Keras's read by ``keras_scale()``) and step counters."""
    ours, theirs = pm.global_weights(), capturing.weights_by_path(ref)
    split = sorted(p for p, layout in pm.program.weight_layouts.items()
                   if isinstance(parse_placement(layout.placement), Split))
    rtol, atol = TOLERANCE.get(case.removeprefix("keras2_"), (1e-5, 1e-6))
    scaled = {}
    if "loss_scale" in pm.runtime.opt_state:
        scaled = {"loss_scale": [float(pm.runtime.opt_state["loss_scale"].numpy()),
                                 float(keras_scale().numpy())],
                  "iterations": [int(pm.runtime.iterations.numpy()),
                                 int(ref.optimizer.iterations.numpy())]}
    return {"plan": "random" if plan else "searched",
            "optimizer": pm.runtime.optimizer.name, "split": split,
            "loss_ours": got["loss"], "loss_keras": want["loss"], "rtol": rtol, **scaled,
            "weights_max_abs_diff": max(float(np.max(np.abs(ours[p] - theirs[p].numpy())))
                                        for p in ours),
            "weights_ok": all(np.allclose(ours[p], theirs[p].numpy(), rtol=rtol, atol=atol)
                              for p in ours),
            "moved": max(float(np.max(np.abs(theirs[p].numpy() - w.numpy())))
                         for p, w in capturing.weights_by_path(fresh).items())}


# Keras 2 (tf_keras) models compiled with tf_keras's own optimizers, against tf_keras's
# fit: an embedding whose batch repeats ids (tf_keras sums a sparse gradient's duplicate
# indices before the update; Keras 3 squares each slice), a Dense layer whose
# kernel_regularizer tf_keras keeps as a zero-argument loss of the layer, and weights
# excluded from weight decay
KERAS2 = {
    "keras2_adam_embedding_l2": lambda k: k.optimizers.Adam(1e-2),
    "keras2_adamw_clipvalue": lambda k: _keras2_adamw(k),
    # tf_keras's LossScaleOptimizer at a scale whose gradients overflow float16: the first
    # steps are skipped, and tf_keras (unlike Keras 3) counts them as steps
    "keras2_mixed_float16_overflow": lambda k: k.mixed_precision.LossScaleOptimizer(
        k.optimizers.Adam(1e-2), initial_scale=2.0 ** 22),
}


def _keras2_adamw(k: Any) -> Any:
    opt = k.optimizers.AdamW(1e-2, weight_decay=0.1, clipvalue=0.02)
    opt.exclude_from_weight_decay(var_names=["bias", "emb"])   # get_config leaves them out
    return opt
VOCAB, IDS = 12, 5


def keras2_model(case: str) -> Any:
    import tf_keras as k
    k.utils.set_random_seed(0)
    if "float16" in case:
        k.mixed_precision.set_global_policy("mixed_float16")
    try:
        ids = k.Input((IDS,), dtype="int32", name="ids")
        h = k.layers.Flatten(name="flat")(k.layers.Embedding(VOCAB, 4, name="emb")(ids))
        h = k.layers.Dense(8, activation="tanh", kernel_regularizer=k.regularizers.L2(0.05),
                           name="hidden")(h)
        out = k.layers.Dense(4, name="out", dtype="float32")(h)
        model = k.Model(ids, out, name="keras2")
        model.compile(optimizer=KERAS2[case](k), loss=k.losses.MeanSquaredError())
    finally:
        k.mixed_precision.set_global_policy("float32")
    return model


def run_keras2_case(index: int, case: str) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (EXAMPLES, IDS)).astype("int32")   # ids repeat in a batch
    y = rng.standard_normal((EXAMPLES, 4)).astype("float32")
    ref = keras2_model(case)
    want = ref.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0).history
    spec = tf.TensorSpec([B, IDS], tf.int32)
    plan = None
    if index % 2 == 1:
        graph = capturing.capture(keras2_model(case), spec, training=True)
        plan = parallel.random_plan(graph, N, seed=index, patterns_fn=weight_splitting)
    # verify's reference for a Keras 2 model: a fresh tf_keras optimizer like the user's
    # (not at a loss scale whose gradients overflow: its reference step takes them)
    checked = {"ok": None} if "float16" in case else parallel.parallelize(
        keras2_model(case), spec, plan, devices=N).verify(x[:B], y[:B])
    pm = parallel.parallelize(keras2_model(case), spec, plan, devices=N)
    got = pm.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0).history
    return {"model": "keras2", "regularized": len(ref.losses), "verified": checked["ok"],
            **compared(pm, ref, got, want, plan, case, keras2_model(case),
                       lambda: ref.optimizer.loss_scale)}


def main() -> None:
    checks = {case: (lambda i=i, c=case: (run_keras2_case if c in KERAS2 else run_case)(i, c))
              for i, case in enumerate(JOB["cases"])}
    run_checks(checks, JOB["cases"])
    finish()


if __name__ == "__main__":
    main()
