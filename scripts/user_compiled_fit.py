"""Models from other libraries, compiled as their users compile them, trained through
``tapas.parallelize(model).fit`` against Keras's own ``model.fit`` on one device.

    python scripts/user_compiled_fit.py [--models=keras-mobilenet,hub-bert,...] [--devices=2]
        [--epochs=2] [--tail=0] [--json_out=out/user_compiled_fit.json]

Each model (``tapas.models.corpus``: keras.applications, keras-hub, kimm, ...) is built
twice from the same seed and compiled the same way: AdamW with a CosineDecay warmup
schedule, weight decay off the biases and normalization scales, gradient clipping by norm,
an L2 regularizer on its first Dense or convolution kernel, the loss its corpus entry
trains with and a metric (accuracy for the classifiers, mean absolute error otherwise).
A Keras 2 model (Hugging Face's TF models, the Model Garden's) is compiled with
``tf_keras``'s classes, trained with ``tf_keras``'s ``fit``, without the L2 term and with
its dropout off on both copies (:func:`compile_as_a_user`, :func:`without_keras2_dropout`
say why). One copy trains with Keras's ``fit``, the other with ``ParallelModel.fit`` on N
logical CPU devices under a random plan that splits weights; the script prints the
History of both (loss and metric per epoch) and the largest weight difference, relative
to the largest weight, and writes JSON. The weights are matched by position (a library
that names layers from a global counter names the second copy's otherwise). Exit 1 when
a model differs (tolerance 1e-4) or raises. With ``--tail=K`` the data end with a last
batch of K examples: ParallelModel.fit trains it where that is exact and otherwise drops it
(the JSON's ``tail_dropped`` says why), and Keras's fit is then run without it.
``tests/test_user_compiled_fit.py`` runs one model.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_MODELS = ["keras-mobilenet", "keras-resnet", "hub-bert-classifier", "hub-gpt2", "kimm-vit"]
TOLERANCE = 1e-4
BATCH = 16          # the global batch (each model's corpus specs at this batch)

flags.DEFINE_list("models", DEFAULT_MODELS, "Corpus entries (tapas.models.corpus names).")
flags.DEFINE_integer("devices", 2, "Logical CPU devices.")
flags.DEFINE_integer("epochs", 2, "Epochs of two global batches each.")
flags.DEFINE_enum("plan", "random", ["random", "searched"], "random: a random plan that "
                  "splits a weight of every GraphNode that has one (seed --plan_seed); "
                  "searched: the plan tapas.parallelize searches.")
flags.DEFINE_integer("plan_seed", 1, "Seed of the random plan.")
flags.DEFINE_integer("tail", 0, "Examples after the two global batches (a last, smaller "
                     "batch, fewer than the global batch): trained where that is exact, "
                     "else dropped by ParallelModel.fit and left out of Keras's fit too.")
flags.DEFINE_enum("floatx", "float32", ["float32", "float64"], "Keras's default float type "
                  "for both copies of every model. float64 separates a wrong plan from float32 "
                  "rounding that the model itself amplifies (batch norm's variance as "
                  "E[x^2] - E[x]^2 loses most digits when the mean is large: docs/optimizers.md).")
flags.DEFINE_string("json_out", "out/user_compiled_fit.json", "Where to write the results.")
FLAGS = flags.FLAGS


def compile_as_a_user(model: Any, loss: Any, classifier: bool) -> str | None:
    """AdamW + warmup schedule + decay exclusions + clipnorm, L2 on the first kernel, a
    metric; ``jit_compile=False`` so both sides run the same TensorFlow kernels. A Keras 2
    model (Hugging Face's TF models, the Model Garden's) is compiled with ``tf_keras``'s
    own classes and without the L2 term: a built Keras 2 layer takes a regularizer only
    as ``model.add_loss(lambda: ...)``, which tapas refuses (it reads whole variables;
    ``tests/test_keras_optimizer.py`` trains a Keras 2 ``kernel_regularizer``). Returns
    the regularized kernel's path, or None."""
    from tapas.execution.training import keras2
    if keras2.is_keras2(model):
        import tf_keras as keras
        loss = getattr(keras.losses, type(loss).__name__)()
    else:
        import keras
    schedule = keras.optimizers.schedules.CosineDecay(1e-4, 100, warmup_target=1e-3,
                                                      warmup_steps=2)
    opt = keras.optimizers.AdamW(schedule, weight_decay=0.01, clipnorm=1.0)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta", "norm", "scale"])
    regularized = None
    if not keras2.is_keras2(model):
        kernel = next(w for w in model.trainable_weights
                      if w.path.endswith("kernel") and len(w.shape) >= 2)
        kernel.regularizer = keras.regularizers.L2(1e-4)
        regularized = kernel.path
    metric = "sparse_categorical_accuracy" if classifier else "mae"
    model.compile(optimizer=opt, loss=loss, metrics=[metric], jit_compile=False)
    return regularized


def without_keras2_dropout(model: Any) -> int:
    """Set the rate of every Dropout layer of a Keras 2 ``model`` to 0; how many. Keras 2
    draws its masks with stateful random ops, which the parallel program draws statelessly
    (other numbers, by design: docs/running.md, *Training mode*), so the two copies can be
    compared only without them. A Keras 3 model's dropout is compared as it is."""
    from tapas.execution.training import keras2
    if not keras2.is_keras2(model):
        return 0
    layers = [x for x in model._flatten_layers() if type(x).__name__ == "Dropout"]
    for layer in layers:
        layer.rate = 0.0
    return len(layers)


def _data(entry: Any, model: Any, specs: Any, tail: int = 0) -> tuple[Any, Any]:
    """Two global batches of the model's synthetic inputs and targets, concatenated, and
    the first ``tail`` examples of a third (a last, smaller batch)."""
    import numpy as np
    parts = [entry.synthetic_batch(model, specs, seed) for seed in (1, 2, 3)]
    cut = [BATCH, BATCH, tail]

    def joined(arrays: list) -> Any:
        return np.concatenate([a[:k] for a, k in zip(arrays, cut)])
    x1 = parts[0][0]
    if isinstance(x1, dict):
        x = {k: joined([p[0][k] for p in parts]) for k in x1}
    elif isinstance(x1, (list, tuple)):
        x = [joined([p[0][i] for p in parts]) for i in range(len(x1))]
    else:   # one input, one array
        x = joined([p[0] for p in parts])
    return x, joined([p[1] for p in parts])


def _first(x: Any, n: int) -> Any:
    """The first ``n`` examples of the inputs ``x`` (an array, a list or a dict of them)."""
    if isinstance(x, dict):
        return {k: v[:n] for k, v in x.items()}
    return [v[:n] for v in x] if isinstance(x, (list, tuple)) else x[:n]


def weight_splitting(node: Any, graph: Any, n: int) -> list[Any]:
    """The patterns of ``node`` that split one of its weights, when it has any."""
    from tapas.sharding import patterns
    from tapas.sharding.placements import Split, parse_placement
    every = patterns.patterns_for(node, graph, n)
    return [p for p in every if any(isinstance(parse_placement(v), Split)
                                    for v in p.weights.values())] or every


def run_model(name: str, devices: int, epochs: int, seed: int | None,
              tail: int = 0) -> dict[str, Any]:
    """Keras's fit and ParallelModel.fit of one corpus model, compiled the same way, under a
    random plan (``seed``) or the searched one (``seed=None``), on two global batches and
    ``tail`` more examples. Where ParallelModel.fit drops those (``fit_data.tail_refusal``
    says why), Keras's fit is run without them."""
    import numpy as np

    from tapas import capturing
    from tapas.execution.api import fit_data, parallel
    from tapas.models import corpus
    from tapas.sharding.placements import Split, parse_placement
    entry = corpus.get(name)
    classifier = entry.library in ("keras.applications", "kimm")
    ref, specs = entry.build(BATCH)
    without_keras2_dropout(ref)
    compile_as_a_user(ref, entry.loss(), classifier)
    model, specs = entry.build(BATCH)
    dropout_off = without_keras2_dropout(model)
    regularized = compile_as_a_user(model, entry.loss(), classifier)
    plan = None
    if seed is not None:
        graph = capturing.capture(model, specs, training=True)
        plan = parallel.random_plan(graph, devices, seed, patterns_fn=weight_splitting)
    pm = parallel.parallelize(model, specs, plan, devices=devices)
    x, y = _data(entry, ref, specs, tail)
    dropped = fit_data.tail_refusal(pm.runtime) if tail else None
    got = pm.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history
    kept = 2 * BATCH + (0 if dropped else tail)
    want = ref.fit(_first(x, kept), y[:kept], batch_size=BATCH, epochs=epochs, shuffle=False,
                   verbose=0).history
    # the two copies' weights by position: a library that names its layers from a global
    # counter (keras-hub's Mixtral and RWKV-7) gives the second copy other paths
    theirs = dict(zip(capturing.weights_by_path(model), capturing.weights_by_path(ref).values()))
    ours = pm.global_weights()
    scale = max(float(np.abs(v.numpy()).max()) for v in theirs.values())
    diffs = sorted(((float(np.abs(ours[p] - theirs[p].numpy()).max()), p) for p in ours),
                   reverse=True)
    diff = diffs[0][0]
    history_diff = max(abs(a - b) / max(abs(b), 1e-12) for k in want
                       for a, b in zip(got.get(k, [np.inf]), want[k]))
    split = sum(1 for layout in pm.program.weight_layouts.values()
                if isinstance(parse_placement(layout.placement), Split))
    return {"model": name, "library": entry.library, "plan": FLAGS.plan, "floatx": FLAGS.floatx,
            "parameters": int(ref.count_params()),
            "weights_split": split, "regularized": regularized, "tail": tail,
            "tail_dropped": dropped,
            "keras2_dropout_off": dropout_off,
            "optimizer": pm.runtime.optimizer.summary(), "history_keras": want,
            "history_tapas": {k: list(v) for k, v in got.items()},
            "history_max_rel_diff": history_diff, "weights_max_abs_diff": diff,
            "weights_scale": scale, "worst_weights": [[p, d] for d, p in diffs[:3]],
            "ok": history_diff <= TOLERANCE and diff <= TOLERANCE * max(scale, 1.0)
            and set(got) == set(want)}


def main(argv: list[str]) -> None:
    del argv
    from tapas.execution.runtime import devices
    devices.setup_devices(FLAGS.devices, "cpu")
    import keras
    keras.config.set_floatx(FLAGS.floatx)
    results = []
    for name in FLAGS.models:
        try:
            seed = FLAGS.plan_seed if FLAGS.plan == "random" else None
            results.append(run_model(name, FLAGS.devices, FLAGS.epochs, seed, FLAGS.tail))
        except Exception as e:  # reported in the table and the JSON, exit 1
            results.append({"model": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]})
    print(f"{'model':<20} {'library':<19} {'split':>5} {'history rel diff':>17} "
          f"{'weights |diff| / max|w|':>24}  ok" + ("  last batch" if FLAGS.tail else ""))
    for r in results:
        if "error" in r:
            print(f"{r['model']:<20} ERROR {r['error'][:200]}")
            continue
        print(f"{r['model']:<20} {r['library']:<19} {r['weights_split']:>5} "
              f"{r['history_max_rel_diff']:>17.2e} "
              f"{r['weights_max_abs_diff'] / max(r['weights_scale'], 1.0):>24.2e}  "
              f"{'yes' if r['ok'] else 'NO'}" + (
                  ("  dropped: " + r["tail_dropped"][:90] if r["tail_dropped"] else
                   f"  trained ({r['tail']} examples)") if FLAGS.tail else ""))
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(results, f, indent=1, default=float)
    print(f"wrote {FLAGS.json_out}")
    sys.stdout.flush()
    os._exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    app.run(main)
