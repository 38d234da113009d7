"""Subprocess entry of tests/test_runtime.py: one process, one device set, many checks.

    python tests/runtime_worker.py '{"devices": 2, "checks": ["mlp"], "dir": "/tmp/x"}'

Logical CPU devices can be set once per process, so every multi-device check runs here, in
its own process (under ``TF_CONFIG`` it is one worker of a MultiWorkerMirroredStrategy). Each
check prints one line ``RESULT <json>``; the parent asserts on them. A check that raises
prints ``RESULT {"check": name, "error": ...}``.

Checks: ``mlp``, ``checkpoint``, ``failed_step``, ``bad_inputs`` (a hand-written program),
``zoo`` (zoo models through ``tapas.parallelize``, searched or random plans), ``programs``
(successive programs and strategies in one process), ``logits``
(softmax/sigmoid outputs: the loss computes from their logits, as Keras's does), ``property``
(hypothesis over random small models and plans), ``empty`` (collectives of empty tensors). The hand-written program is Megatron's MLP (column-parallel then row-parallel dense) and two
other layouts of the same two Dense layers, written against the program protocol of
``tapas.execution.runtime`` with their own f/g collectives, so the runtime is tested without the
reconstruction stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tapas.execution.runtime import devices  # noqa: E402
from worker_main import finish, run_checks  # noqa: E402  (tests/, this script's folder)
from tapas.execution import runtime as rt  # noqa: E402

JOB = json.loads(sys.argv[1])
if devices.tf_config() is None:
    devices.setup_devices(JOB["devices"], "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tapas.execution.checking.verify import compare  # noqa: E402
from tapas.sharding.placements import Replica, Split# noqa: E402

BATCH, D_IN, HIDDEN, CLASSES = 8, 8, 16, 12


@dataclasses.dataclass(frozen=True)
class Layout:
    path: str
    global_shape: tuple[int, ...]
    placement: Any
    trainable: bool = True


class Megatron:
    """f = identity forward / all-reduce backward; g = all-reduce forward / identity backward."""

    @staticmethod
    def f(x: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()

        @tf.custom_gradient
        def fn(x: tf.Tensor) -> Any:
            return tf.identity(x), lambda dy: ctx.all_reduce("sum", dy)
        return fn(x)

    @staticmethod
    def g(x: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()

        @tf.custom_gradient
        def fn(x: tf.Tensor) -> Any:
            return ctx.all_reduce("sum", x), lambda dy: dy
        return fn(x)


# weight placements (kernel1, bias1, kernel2, bias2), input and output placement per layout
LAYOUTS = {
    "megatron": ((Split(1), Split(0), Split(0), Replica()), Replica(), Replica()),
    "data": ((Replica(),) * 4, Split(0), Split(0)),
    "vocab": ((Replica(), Replica(), Split(1), Split(0)), Replica(), Split(1)),
}


class HandMLP:
    """Two Dense layers as a per-replica program under one of LAYOUTS."""

    def __init__(self, model: keras.Model, num_devices: int, layout: str) -> None:
        self.num_devices, self.layout = num_devices, layout
        weights = [model.layers[0].kernel, model.layers[0].bias,
                   model.layers[1].kernel, model.layers[1].bias]
        self.paths = [w.path for w in weights]
        placements, inp, out = LAYOUTS[layout]
        self.weight_layouts = {w.path: Layout(w.path, tuple(w.shape), p)
                               for w, p in zip(weights, placements)}
        self.input_placements, self.output_placements = [inp], [out]
        self.output_shapes, self.output_dtypes = [(BATCH, CLASSES)], ["float32"]

    def __call__(self, inputs: list, weights: dict, coll: Megatron) -> list:
        x = inputs[0][0]
        k1, b1, k2, b2 = [tf.convert_to_tensor(weights[p][0]) for p in self.paths]
        if self.layout == "megatron":
            h = tf.nn.relu(tf.matmul(coll.f(x), k1) + b1)
            return [[coll.g(tf.matmul(h, k2)) + b2]]
        if self.layout == "data":
            k1, b1, k2, b2 = map(coll.f, (k1, b1, k2, b2))
            return [[tf.matmul(tf.nn.relu(tf.matmul(x, k1) + b1), k2) + b2]]
        h = coll.f(tf.nn.relu(tf.matmul(x, k1) + b1))
        return [[tf.matmul(h, k2) + b2]]


def mlp_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((D_IN,)),
                             keras.layers.Dense(HIDDEN, activation="relu", name="d1"),
                             keras.layers.Dense(CLASSES, name="d2")], name="mlp")


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return rng.randn(BATCH, D_IN).astype("float32"), rng.randint(0, CLASSES, size=(BATCH,))


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SPEC = [tf.TensorSpec([BATCH, D_IN], tf.float32, "x")]


def make_runtime(strategy: Any, model: keras.Model, layout: str, optimizer: str,
                 lr: float = 0.1) -> rt.Runtime:
    values = {w.path: w.numpy() for w in model.weights}
    return rt.Runtime(HandMLP(model, strategy.num_replicas_in_sync, layout), strategy, values,
                      SPEC, optimizer=optimizer, learning_rate=lr, loss=LOSS,
                      collectives=lambda function: Megatron())


def keras_reference(model: keras.Model, optimizer: Any, x: np.ndarray, y: np.ndarray,
                    steps: int) -> dict[str, Any]:
    out = model(x).numpy()
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    grads = {w.path: g.numpy() for w, g in
             zip(model.trainable_weights, tape.gradient(loss, model.trainable_weights))}
    for _ in range(steps):
        with tf.GradientTape() as tape:
            step_loss = LOSS(y, model(x))
        optimizer.apply_gradients(zip(tape.gradient(step_loss, model.trainable_weights),
                                      model.trainable_weights))
    return {"out": out, "loss": float(loss), "grads": grads,
            "weights": {w.path: w.numpy() for w in model.weights}}


def worst(pairs: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    res = {k: compare(a, b) for k, (a, b) in pairs.items()}
    return {"ok": all(r["ok"] for r in res.values()),
            "max_abs_diff": max(r["max_abs_diff"] for r in res.values())}


# ---- checks -----------------------------------------------------------------------------------

def check_mlp(strategy: Any) -> dict[str, Any]:
    """Every layout x optimizer: outputs, gradients, loss, weights after 3 steps vs Keras."""
    x, y = data()
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        for opt in ("sgd", "adam"):
            model = mlp_model()
            r = make_runtime(strategy, model, layout, opt)
            got_out = r.predict([x])
            loss, grads = r.gradients([x], y)
            losses = [r.train_step([x], y) for _ in range(3)]
            ref = keras_reference(model, r.optimizer.keras(), x, y, 3)
            weights = r.global_weights()
            out[f"{layout}/{opt}"] = {
                "outputs": worst({"out": (got_out, ref["out"])}),
                "loss": worst({"loss": (loss, ref["loss"])}),
                "gradients": worst({p: (grads[p], ref["grads"][p]) for p in ref["grads"]}),
                "weights": worst({p: (weights[p], ref["weights"][p]) for p in weights}),
                "losses": losses, "iterations": int(r.iterations.numpy())}
    return out


def replica_calls(graph: Any) -> list[dict[str, Any]]:
    """The calls of a function in a traced step graph: the op, whether the callee is kept
    out of line (``_noinline``) and the Grappler options it is instantiated with."""
    from tensorflow.core.protobuf import config_pb2
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    calls = []
    for op in graph.get_operations():
        if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
            continue
        config = config_pb2.ConfigProto()
        config.ParseFromString(op.get_attr("config_proto"))
        rewrite = config.graph_options.rewrite_options
        fdef = library[op.get_attr("f").name]
        calls.append({"device": op.device, "noinline": bool(fdef.attr["_noinline"].b),
                      "nodes": len(fdef.node_def),
                      "constant_folding": int(rewrite.constant_folding),
                      "function_optimization": int(rewrite.function_optimization),
                      "iterations": int(rewrite.meta_optimizer_iterations)})
    return calls


def check_checkpoint(strategy: Any) -> dict[str, Any]:
    """Save after one Adam step; restore into the same layout, into another layout, and
    (when JOB['restore_from'] names a directory from another device count) from there."""
    x, y = data()
    model = mlp_model()
    a = make_runtime(strategy, model, "megatron", "adam")
    a.train_step([x], y)
    path = a.save(os.path.join(JOB["dir"], f"ckpt-{a.num_devices}"))
    out: dict[str, Any] = {"saved": path}
    reference = (a.global_weights(), a.global_slots())
    for layout in ("megatron", "data", "vocab"):
        b = make_runtime(strategy, mlp_model(seed=1), layout, "adam")
        how = b.restore(path)
        w, s = b.global_weights(), b.global_slots()
        out[layout] = {"how": how, "iterations": int(b.iterations.numpy()),
                       "weights_equal": all(np.array_equal(w[p], reference[0][p]) for p in w),
                       "slots_equal": all(np.array_equal(s[k][p], reference[1][k][p])
                                          for k in s for p in s[k])}
        b.train_step([x], y)
        out[layout]["next_step"] = b.global_weights()
    steps_after = [out[layout].pop("next_step") for layout in ("megatron", "data", "vocab")]
    a.train_step([x], y)
    after = a.global_weights()
    out["continue_equal"] = all(compare(s[p], after[p])["ok"] for s in steps_after for p in s)
    fresh = mlp_model(seed=2)
    a.to_keras(fresh)
    out["to_keras_equal"] = all(np.array_equal(w.numpy(), after[w.path]) for w in fresh.weights)
    if JOB.get("restore_from"):
        c = make_runtime(strategy, mlp_model(seed=3), "megatron", "adam")
        out["other_count"] = {"how": c.restore(JOB["restore_from"]),
                              "weights": {p: v.tolist() for p, v in c.global_weights().items()},
                              "iterations": int(c.iterations.numpy())}
    out["weights"] = {p: v.tolist() for p, v in reference[0].items()}
    sgd_path = make_runtime(strategy, mlp_model(), "megatron", "sgd").save(path + "-sgd")
    try:
        make_runtime(strategy, mlp_model(), "megatron", "adam").restore(sgd_path)
        out["optimizer_mismatch"] = "no error"
    except ValueError as e:
        out["optimizer_mismatch"] = str(e)
    return out


def check_failed_step(strategy: Any) -> dict[str, Any]:
    """A step with a non-finite loss raises StepError and changes nothing.

    The bad input is +inf, not NaN: in a tf.function grappler fuses MatMul+BiasAdd+Relu
    into one kernel whose ReLU maps NaN to 0 on some CPUs (eager TF keeps the NaN), so a NaN
    input can give a finite loss; +inf stays inf through that ReLU and makes the logits
    inf/NaN."""
    x, y = data()
    r = make_runtime(strategy, mlp_model(), "megatron", "adam")
    r.train_step([x], y)
    before, slots = r.global_weights(), r.global_slots()
    bad = x.copy()
    bad[0, 0] = np.inf
    try:
        r.train_step([bad], y)
        error = None
    except rt.StepError as e:
        error = str(e)
    after, slots_after = r.global_weights(), r.global_slots()
    unchanged = all(np.array_equal(before[p], after[p]) for p in before) and all(
        np.array_equal(slots[k][p], slots_after[k][p]) for k in slots for p in slots[k])
    iterations = int(r.iterations.numpy())
    loss = r.train_step([x], y)
    return {"error": error, "unchanged": unchanged, "iterations": iterations,
            "next_loss_finite": bool(np.isfinite(loss))}


def check_bad_inputs(strategy: Any) -> dict[str, Any]:
    """Errors raised before anything is built."""
    out = {}
    model = mlp_model()
    n = strategy.num_replicas_in_sync
    values = {w.path: w.numpy() for w in model.weights}

    def attempt(fn: Any) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    prog = HandMLP(model, n + 1, "megatron")
    out["device_count"] = attempt(lambda: rt.Runtime(prog, strategy, values, SPEC,
                                                     collectives=lambda f: Megatron()))
    prog = HandMLP(model, n, "megatron")
    path = prog.paths[0]
    prog.weight_layouts[path] = Layout(path, (D_IN, HIDDEN), Split(0))
    odd = {**values, path: np.zeros((D_IN, HIDDEN), "float32")}
    prog.weight_layouts[path] = Layout(path, (D_IN + 1, HIDDEN), Split(0))
    odd[path] = np.zeros((D_IN + 1, HIDDEN), "float32")
    out["indivisible"] = attempt(lambda: rt.Runtime(prog, strategy, odd, SPEC,
                                                    collectives=lambda f: Megatron()))
    r = make_runtime(strategy, model, "megatron", "sgd")
    out["input_shape"] = attempt(lambda: r.train_step([np.zeros((3, D_IN), "float32")],
                                                     np.zeros(3, "int64")))
    out["too_many_devices"] = attempt(lambda: devices.setup_devices(n + 8, "cpu"))
    out["optimizer"] = attempt(lambda: make_runtime(strategy, model, "megatron", "adafactor"))
    # strategies searched for another device count / another model
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.planning import search
    from tapas.planning.cost import Cluster
    graph = capturing.capture(model, SPEC)
    other_n = search.search(graph, cluster=Cluster.v100_ethernet(1, 2 * n))
    out["strategy_devices"] = attempt(lambda: parallel.parallelize(
        model, SPEC, other_n, distribute_strategy=strategy, loss=LOSS))
    wide = keras.Sequential([keras.Input((D_IN,)), keras.layers.Dense(2 * HIDDEN, name="d1"),
                             keras.layers.Dense(CLASSES, name="d2")], name="wide")
    other_model = search.search(capturing.capture(wide, SPEC),
                                cluster=Cluster.v100_ethernet(1, n))
    out["strategy_model"] = attempt(lambda: parallel.parallelize(
        model, SPEC, other_model, distribute_strategy=strategy, loss=LOSS))
    return out


def check_zoo(strategy: Any) -> dict[str, Any]:
    """For each JOB['zoo'] entry {model, strategies, optimizer, training,
    graph_optimization}: parallelize the model with each strategy ("best": tapas.search on
    a V100 cluster of N devices; "random:SEED": tapas.execution.api.parallel.random_plan) in the
    entry's mode (``training``, default False: the inference graph) and Grappler options
    (default "lean"; the key ends in "/default" for TensorFlow's) and verify it against the
    single-device Keras model."""
    from tapas import capturing, models
    from tapas.execution.api import parallel
    from tapas.planning.cost import Cluster
    n = strategy.num_replicas_in_sync
    out: dict[str, Any] = {}
    for entry in JOB["zoo"]:
        name = entry["model"]
        if name == "resnet50-keras":
            model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
                                                classes=10)
            rng = np.random.RandomState(0)
            xs = [rng.randn(4, 32, 32, 3).astype("float32")]
            y = rng.randint(0, 10, size=(4,))
            # a softmax output: Keras's crossentropy computes from its logits either way
            loss = keras.losses.SparseCategoricalCrossentropy()
            specs = [tf.TensorSpec([4, 32, 32, 3], tf.float32)]
        else:
            e = models.get(name)
            model = e.build(seed=0)
            xs, y = e.synthetic_batch()
            specs, loss = list(e.input_spec()), e.keras_loss()
        initial = [w.numpy() for w in model.weights]
        graph = None
        grappler = entry.get("graph_optimization", "lean")
        for label in entry["strategies"]:
            model.set_weights(initial)
            key = f"{name}/{label}/{entry.get('optimizer', 'sgd')}" + (
                "/default" if grappler == "default" else "")
            if label == "best":
                plan = None
            else:
                if graph is None:
                    graph = capturing.capture(model, specs,
                                              training=entry.get("training", False))
                plan = parallel.random_plan(graph, n, int(label.split(":")[1]))
            try:
                pm = parallel.parallelize(model, specs, plan, distribute_strategy=strategy,
                                          optimizer=entry.get("optimizer", "sgd"),
                                          learning_rate=entry.get("learning_rate"), loss=loss,
                                          cluster=Cluster.v100_ethernet(1, n),
                                          training=entry.get("training", False),
                                          graph_optimization=grappler)
                report = pm.verify(list(xs), y, steps=3)
                audit = pm.audit()
                names = pm.program.plan.patterns
                out[key] = {
                    "optimizer": entry.get("optimizer", "sgd"), "ok": report["ok"],
                    "graph_optimization": pm.runtime.graph_optimization,
                    **{k: report[k] for k in
                                           ("outputs", "loss", "gradients", "weights")},
                    "audit": audit.to_json(), "sharded_nodes": sum(
                        1 for p in names.values() if getattr(p, "name", "") != "replicate"),
                    "trace_seconds": pm.runtime.trace_seconds,
                    "replica_calls": replica_calls(pm.runtime.graphs["train_step"])}
            except Exception as e:  # reported per strategy
                out[key] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:]}
    return out


def _each_pattern_verified(strategy: Any, model: Any, in_shape: tuple, out_shape: tuple,
                           node_of: Any, names: Any = None) -> dict[str, Any]:
    """``model`` (one input ``x`` of ``in_shape``, one output of ``out_shape``, MSE) through
    tapas.parallelize with each pattern of the GraphNode ``node_of(graph)`` (those called
    ``names``, else every one but ``replicate``), the rest replicated, one program after
    another in this process: ``{pattern: verify's outputs, loss, gradients, weights}``."""
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.program.plan import Plan
    from tapas.planning.strategy import graph_digest
    from tapas.sharding.patterns import patterns_for
    n = strategy.num_replicas_in_sync
    specs = [tf.TensorSpec([BATCH, *in_shape], tf.float32, name="x")]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *in_shape)).astype("float32")
    y = rng.standard_normal((BATCH, *out_shape)).astype("float32")
    graph = capturing.capture(model, specs)
    node = node_of(graph)
    initial = [w.numpy() for w in model.weights]
    out: dict[str, Any] = {}
    for pattern in patterns_for(node, graph, n):
        if pattern.name == "replicate" or (names is not None and pattern.name not in names):
            continue
        model.set_weights(initial)
        plan = Plan(n, {node.id: pattern}, graph_digest=graph_digest(graph))
        pm = parallel.parallelize(model, specs, plan, distribute_strategy=strategy,
                                  loss=keras.losses.MeanSquaredError())
        report = pm.verify([x], y, steps=2)
        out[pattern.name] = {k: report[k] for k in ("outputs", "loss", "gradients", "weights")}
    return out


def check_empty(strategy: Any) -> dict[str, Any]:
    """A concat with an empty operand (keras-hub Qwen3.5's chunked linear attention
    concatenates a zero-length slice), its GraphNode split by each non-replicating pattern
    while its producers stay replicated: the backward gathers the empty operand's gradient,
    and TensorFlow's CPU all-gather of an empty tensor crashes the process (before the fix
    this check ended its worker with a segmentation fault). Verified against Keras."""
    inp = keras.Input((8, 4), name="x")
    h = keras.layers.Dense(4, name="d1")(inp)
    a = keras.layers.Dense(4, name="d2")(inp)
    joined = keras.layers.Concatenate(axis=1)([h[:, :7], a[:, :1], h[:, 8:]])  # (B, 0, 4)
    model = keras.Model(inp, keras.layers.Dense(3, name="d3")(joined))

    def concat(graph: Any) -> Any:
        (node,) = [v for v in graph.nodes if any(op.type == "ConcatV2" for op in v.ops)]
        assert any(0 in t.shape for t in node.inputs), [t.shape for t in node.inputs]
        return node
    return _each_pattern_verified(strategy, model, (8, 4), (8, 3), concat)


def check_map_fn(strategy: Any) -> dict[str, Any]:
    """A ``tf.map_fn`` over the batch rows between two Dense layers (keras-hub D-FINE's
    query selection is one): a While loop on the gradient path, trained through
    tapas.parallelize under two plans, two programs in one process (the second's While
    gradient once met the first's rewritten loop body under the same name; before that the
    gradient could not find the replayed loop's body at all). Verified against Keras."""
    inp = keras.Input((6, 8), name="x")
    h = keras.layers.Dense(8, name="d1")(inp)
    mapped = keras.layers.Lambda(lambda t: tf.map_fn(lambda row: tf.tanh(row) * 2.0 + row, t),
                                 output_shape=(6, 8), name="rows")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="d2")(mapped))

    def first_dense(graph: Any) -> Any:
        assert any(op.type.endswith("While") for v in graph.nodes for op in v.ops)
        return next(v for v in graph.nodes if any(w.path.startswith("d1/") for w in v.weights))
    return _each_pattern_verified(strategy, model, (6, 8), (6, 3), first_dense,
                                  ("column", "row"))


# (activation, loss, targets, patterns of the input node and the two Dense GraphNodes)
LOGIT_CASES = {
    "softmax-probs-megatron": ("softmax", "scce", "sparse", ("replicate", "column", "row")),
    "softmax-probs-batch": ("softmax", "scce", "sparse", ("batch", "batch", "batch")),
    # keras.applications.ResNet50's case: from_logits=True on a softmax output; Keras still
    # computes from the logits (and warns)
    "softmax-from_logits-megatron": ("softmax", "scce_logits", "sparse",
                                     ("replicate", "column", "row")),
    # class-split sigmoid output, targets split alike: the local logits
    "sigmoid-bce-column": ("sigmoid", "bce", "binary", ("replicate", "replicate", "column")),
    "sigmoid-bce-batch": ("sigmoid", "bce", "binary", ("batch", "batch", "batch")),
    # class-split output, sparse targets: the runtime gathers the logits for the loss
    "sigmoid-scce-column": ("sigmoid", "scce", "sparse", ("replicate", "replicate", "column")),
    # class-split logits (an LM head split by vocabulary): vocabulary-parallel cross-entropy
    "none-scce_logits-column": (None, "scce_logits", "sparse",
                                ("replicate", "replicate", "column")),
    "none-cce_logits-column": (None, "cce_logits", "dense", ("replicate", "replicate", "column")),
    "none-cce_smooth_sum-column": (None, "cce_smooth_sum", "dense",
                                   ("replicate", "replicate", "column")),
}


def model_spec(model: keras.Model) -> list[tf.TensorSpec]:
    """SPEC named after the model's input: ``tapas.parallelize`` captures with the model's
    input names, so a hand-made plan (which names tensors) is made on the same names."""
    return [tf.TensorSpec([BATCH, D_IN], tf.float32, name=model.inputs[0].name)]


def check_logits(strategy: Any) -> dict[str, Any]:
    """Model outputs made by a softmax or sigmoid: Keras's crossentropy losses compute from
    the logits, and so must the reconstructed program (outputs, loss, gradients and weights
    after 3 steps against Keras), for replicated, batch-split and class-split outputs."""
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.program import reconstruct
    from tapas.sharding import patterns
    n = strategy.num_replicas_in_sync
    losses = {"scce": keras.losses.SparseCategoricalCrossentropy(),
              "scce_logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "bce": keras.losses.BinaryCrossentropy(),
              "cce_logits": keras.losses.CategoricalCrossentropy(from_logits=True),
              "cce_smooth_sum": keras.losses.CategoricalCrossentropy(
                  from_logits=True, label_smoothing=0.1, reduction="sum")}
    rng = np.random.RandomState(1)
    x = rng.randn(BATCH, D_IN).astype("float32")
    out: dict[str, Any] = {}
    for name, (act, loss, targets, names) in LOGIT_CASES.items():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((D_IN,), batch_size=BATCH),
                                  keras.layers.Dense(HIDDEN, activation="relu", name="d1"),
                                  keras.layers.Dense(CLASSES, activation=act, name="d2")])
        if targets == "sparse":
            y = rng.randint(0, CLASSES, size=(BATCH,))
        elif targets == "dense":   # a distribution over the classes per example
            y = rng.dirichlet(np.ones(CLASSES), size=BATCH).astype("float32")
        else:
            y = rng.randint(0, 2, size=(BATCH, CLASSES)).astype("float32")
        spec = model_spec(model)
        graph = capturing.capture(model, spec)
        chosen = {}
        for node, want in zip(graph.nodes, names):
            (chosen[node.id],) = [p for p in patterns.patterns_for(node, graph, n)
                                  if p.name == want]
        pm = parallel.parallelize(model, spec, reconstruct.Plan(n, chosen),
                                  distribute_strategy=strategy, optimizer="adam",
                                  learning_rate=0.01, loss=losses[loss])
        report = pm.verify([x], y, steps=3)
        out[name] = {"activation": pm.program.output_activations[0], "ok": report["ok"],
                     **{k: report[k] for k in ("outputs", "loss", "gradients", "weights")},
                     "loss_comms": [k for fn, k, _ in pm.runtime.loss_comms
                                    if fn == "train_step"],
                     "loss_bytes": sorted([k, b] for fn, k, b in pm.runtime.loss_comms
                                          if fn == "train_step"),
                     "priced_loss": _priced_loss(graph, chosen, n, losses[loss]),
                     "audit": pm.audit().matches, "audit_table": pm.audit().table()}
    out["moved_activation"] = _moved_activation(strategy, x)
    return out


def _priced_loss(graph: Any, chosen: dict[int, Any], n: int, loss: Any) -> list[list[Any]]:
    """The loss collectives [kind, global bytes] that the search prices for the plan
    ``chosen`` (CostOptions.loss): what the runtime runs, if the two agree."""
    from tapas.planning.cluster import Cluster
    from tapas.planning.cost import CostOptions
    from tapas.planning.table import pattern_table
    table = pattern_table(graph, n, Cluster.loopback_cpu(n), CostOptions(loss=loss))
    terms = [t for node in graph.nodes
             for t in table.infos[node.id][table.index(node.id, chosen[node.id].name)].comm_terms
             if t.label.startswith("loss ")]
    return sorted([t.kind.value, t.nbytes] for t in terms)


def _moved_activation(strategy: Any, x: np.ndarray) -> dict[str, Any]:
    """A hand plan whose last GraphNode all-gathers its softmax output while the logits stay
    batch-split: predict works; training is refused with a clear error (the logits a Keras
    crossentropy needs are placed unlike the output)."""
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.program import reconstruct
    from tapas.sharding import patterns, placements
    n = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((D_IN,), batch_size=BATCH),
                              keras.layers.Dense(CLASSES, activation="softmax", name="d")])
    spec = model_spec(model)
    graph = capturing.capture(model, spec)
    batch = {node.id: next(p for p in patterns.patterns_for(node, graph, n)
                           if p.name == "batch") for node in graph.nodes}
    last = graph.nodes[-1]
    (soft,) = [op.outputs[0] for op in last.ops if op.type == "Softmax"]
    gather = placements.reshard(Split(0), Replica(), soft.shape, soft.dtype, soft.name)
    after = {t.name: Replica() for t in last.outputs}  # the output Identity follows: R
    batch[last.id] = reconstruct.NodeSharding(
        "batch-then-gather", batch[last.id].inputs, (Replica(),),
        dict(batch[last.id].weights), {**batch[last.id].tensors, **after},
        tuple(batch[last.id].comms) + gather)
    pm = parallel.parallelize(model, spec, reconstruct.Plan(n, batch),
                              distribute_strategy=strategy, loss=LOSS)
    result = {"predict_equal": bool(np.allclose(pm.predict([x]), model(x).numpy(),
                                                rtol=1e-5, atol=1e-6)),
              "activation": pm.program.output_activations[0]}
    try:
        pm.train_step([x], np.zeros(BATCH, "int64"))
        result["train_error"] = None
    except (ValueError, RuntimeError) as e:
        result["train_error"] = f"{type(e).__name__}: {e}"
    return result


def small_model(kind: str, width: int,
                depth: int) -> tuple[keras.Model, list, list[np.ndarray], np.ndarray]:
    """A small MLP or self-attention model, its input specs and integer targets."""
    rng = np.random.RandomState(width * 10 + depth)
    if kind == "mlp":
        x = keras.Input((2 * width,), batch_size=4, name="x")
        h = x
        for i in range(depth):
            h = keras.layers.Dense(4 * width, activation="relu", name=f"dense{i}")(h)
        out = keras.layers.Dense(2 * width, name="head")(h)
        xs = [rng.randn(4, 2 * width).astype("float32")]
        y = rng.randint(0, 2 * width, size=(4,))
    else:
        x = keras.Input((4, 2 * width), batch_size=4, name="x")
        h = x
        for i in range(depth):
            a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=width, name=f"mha{i}")(h, h)
            h = keras.layers.LayerNormalization(name=f"norm{i}")(h + a)
        out = keras.layers.Dense(2 * width, name="head")(h)
        xs = [rng.randn(4, 4, 2 * width).astype("float32")]
        y = rng.randint(0, 2 * width, size=(4, 4))
    model = keras.Model(x, out, name=f"{kind}{width}x{depth}")
    return model, [tf.TensorSpec(xs[0].shape, tf.float32, "x")], xs, y


def check_property(strategy: Any) -> dict[str, Any]:
    """Hypothesis: random small MLP/attention models x random valid plans x SGD/Adam train
    like the single-device model, and the audit equals the prediction."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tapas import capturing
    from tapas.execution.api import parallel
    n = strategy.num_replicas_in_sync
    seen: list[str] = []

    @settings(max_examples=JOB.get("examples", 3), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(["mlp", "attention"]), width=st.sampled_from([2, 4]),
           depth=st.integers(1, 2), seed=st.integers(0, 10_000),
           optimizer=st.sampled_from(["sgd", "adam"]))
    def prop(kind: str, width: int, depth: int, seed: int, optimizer: str) -> None:
        keras.utils.set_random_seed(seed)
        model, specs, xs, y = small_model(kind, width, depth)
        plan = parallel.random_plan(capturing.capture(model, specs), n, seed)
        pm = parallel.parallelize(model, specs, plan, distribute_strategy=strategy,
                                  optimizer=optimizer, learning_rate=0.01, loss=LOSS)
        report = pm.verify(xs, y, steps=2)
        audit = pm.audit()
        sharded = sum(1 for p in plan.patterns.values() if p.name != "replicate")
        seen.append(f"{kind} w{width} d{depth} seed {seed} {optimizer}: {sharded} sharded")
        bad = [k for k in ("outputs", "loss", "gradients", "weights") if not report[k]["ok"]]
        assert not bad, {k: report[k] for k in bad}
        assert audit.matches, audit.table()

    try:
        prop()
        failure = None
    except Exception as e:  # the falsifying example is in the message
        failure = f"{type(e).__name__}: {e}"[:3000]
    return {"examples": seen, "failure": failure}


def check_programs(strategy: Any) -> dict[str, Any]:
    """Successive parallel programs in one process (a notebook, a sweep): for each
    JOB['programs'] entry [seed, devices], a fresh three-Dense model and a random plan,
    ``tapas.parallelize(devices=N)`` (a new MirroredStrategy each time, or this worker's
    MultiWorkerMirroredStrategy again) and ``verify``; then one more program on the
    worker's own strategy object, and two MirroredStrategy objects made by hand (the second
    reuses the first one's collective keys and must be refused, naming the fix)."""
    from tapas import capturing
    from tapas.execution.api import parallel
    spec = tf.TensorSpec([BATCH, D_IN], tf.float32, "x")
    rng = np.random.RandomState(0)
    x, y = rng.randn(BATCH, D_IN).astype("float32"), rng.randn(BATCH, 4).astype("float32")

    def program(seed: int, **where: Any) -> Any:
        keras.utils.set_random_seed(seed)
        inp = keras.Input((D_IN,), batch_size=BATCH)
        h = keras.layers.Dense(HIDDEN, activation="relu")(inp)
        h = keras.layers.Dense(HIDDEN, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(4)(h))
        n = where.get("devices") or where["distribute_strategy"].num_replicas_in_sync
        plan = parallel.random_plan(capturing.capture(model, spec), n, seed)
        return parallel.parallelize(model, spec, plan, loss=keras.losses.MeanSquaredError(),
                                    **where)

    def verified(pm: Any) -> dict[str, Any]:
        report = pm.verify(x, y, steps=1)
        return {"ok": report["ok"], "devices": pm.num_devices,
                "collectives": len(pm.runtime.audits["evaluate"].records)}

    out: dict[str, Any] = {}
    for seed, count in JOB["programs"]:
        try:
            out[f"seed {seed} on {count}"] = verified(program(seed, devices=count))
        except Exception as e:  # reported per program: the next ones still run
            out[f"seed {seed} on {count}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    out["shared strategy"] = verified(program(7, distribute_strategy=strategy))
    if devices.tf_config() is None:
        names = devices.setup_devices(strategy.num_replicas_in_sync, "cpu")
        first = tf.distribute.MirroredStrategy(names)
        out["hand-made strategy"] = verified(program(8, distribute_strategy=first))
        try:
            program(9, distribute_strategy=tf.distribute.MirroredStrategy(names))
            out["second hand-made strategy"] = None
        except ValueError as e:
            out["second hand-made strategy"] = str(e)
    return out


def check_mesh(strategy: Any) -> dict[str, Any]:
    """For each JOB['mesh'] entry {model, mesh, seed, optimizer}: a 2-D mesh ParallelModel
    (data parallel over the rows; a random plan of one row's inference graph, or the
    searched one for seed -1, on the columns) verified against the single-device Keras
    model; the mesh columns' gradient all-reduces (``Runtime.dp_audits``) against the cost
    model's (``tapas.planning.mesh.gradient_all_reduce``: one per trainable weight, its local
    shard's bytes); a checkpoint of the mesh restored into a 1-D program of the same model."""
    from tapas import capturing, models
    from tapas.execution.api import parallel
    from tapas.planning import mesh as mesh_lib
    out: dict[str, Any] = {}
    for entry in JOB["mesh"]:
        key = f"{entry['model']}/{entry['mesh']}/{entry['seed']}/{entry['optimizer']}"
        try:
            mesh = mesh_lib.Mesh.parse(entry["mesh"])
            if entry.get("nodes"):   # the mesh on a V100 cluster: the search takes its row's
                from tapas.planning.cluster import Cluster
                mesh = mesh.on(Cluster.v100_ethernet(entry["nodes"],
                                                     mesh.num_devices // entry["nodes"]))
            if entry["model"].startswith("keras-"):   # keras.applications (models.corpus)
                from models import corpus
                c = corpus.get(entry["model"])
                model, specs = c.build(batch=8)
                rng = np.random.RandomState(0)
                xs = [rng.randn(*s.shape).astype("float32") for s in specs]
                y = rng.randint(0, int(model.output_shape[-1]), size=(8,))
                keras_loss = keras.losses.SparseCategoricalCrossentropy()   # softmax output
                rebuild = lambda: c.build(batch=8)[0]  # noqa: E731
            else:
                e = models.get(entry["model"])
                model = e.build(seed=0)
                xs, y = e.synthetic_batch()
                specs, keras_loss = list(e.input_spec()), e.keras_loss()
                rebuild = lambda: e.build(seed=1)  # noqa: E731
            row = [tf.TensorSpec([s.shape[0] // mesh.rows] + s.shape.as_list()[1:], s.dtype,
                                 name=s.name) for s in specs]
            graph = capturing.capture(model, row, training=False)
            nested = None
            if mesh.experts:   # nested experts: the region keeps experts and groups whole
                from tapas.planning import experts
                nested = experts.nested_patterns(graph, mesh.rows)
            plan = None if entry["seed"] < 0 else parallel.random_plan(
                graph, mesh.cols, entry["seed"], patterns_fn=nested)
            pm = parallel.parallelize(model, specs, plan, distribute_strategy=strategy,
                                      mesh=mesh, optimizer=entry["optimizer"],
                                      loss=keras_loss, training=False)
            report = pm.verify(list(xs), y, steps=2)
            # batched predict and fit over two global batches (verify trained the Keras model
            # side by side, so both hold the same weights)
            twice = [np.concatenate([x, x]) for x in xs]
            got = pm.predict(twice, batch_size=len(y))
            want = model.predict(twice if len(twice) > 1 else twice[0], batch_size=len(y),
                                 verbose=0)
            history = pm.fit(twice, np.concatenate([y, y]), batch_size=len(y), epochs=1,
                             verbose=0).history
            rt = pm.runtime
            from tapas.execution.api.train import column_audit
            ran, priced = ({"|".join(k): v for k, v in d.items()}
                           for d in column_audit(pm, mesh))
            path = rt.save(os.path.join(JOB["dir"], f"mesh-{entry['mesh']}-{entry['seed']}"))
            weights = rt.global_weights()
            flat = parallel.parallelize(rebuild(), specs, None,
                                        distribute_strategy=strategy, training=False,
                                        optimizer=entry["optimizer"], loss=keras_loss)
            how = flat.runtime.restore(path)
            restored = flat.runtime.global_weights()
            out[key] = {"ok": report["ok"], **{k: report[k] for k in
                                               ("outputs", "loss", "gradients", "weights")},
                        "dp_ran": ran, "dp_priced": priced,
                        "predict": compare(np.asarray(got), np.asarray(want)),
                        "fit_losses": history["loss"],
                        "sharded_nodes": sum(1 for n in pm.graph.nodes if
                                             pm.program.plan.pattern(n).name != "replicate"),
                        "row_split": sorted(p for p, s in rt.specs.items()
                                            if s.row_axis is not None),
                        "search_cluster": getattr(getattr(pm.strategy, "cluster", None),
                                                  "name", None),
                        "restore": how, "restored_equal": all(
                            np.array_equal(restored[p], weights[p]) for p in weights)}
        except Exception as err:  # reported per entry
            out[key] = {"error": f"{type(err).__name__}: {err}",
                        "traceback": traceback.format_exc()[-3000:]}
    return out


CHECKS = {"property": check_property, "mesh": check_mesh, "programs": check_programs, "zoo": check_zoo,
          "mlp": check_mlp,
          "logits": check_logits,
          "checkpoint": check_checkpoint, "failed_step": check_failed_step,
          "bad_inputs": check_bad_inputs, "empty": check_empty, "map_fn": check_map_fn}


def main() -> None:
    strategy = devices.make_strategy(None if devices.tf_config() else JOB["devices"],
                                join_timeout_s=JOB.get("join_timeout_s", 60.0))
    print("JOINED", flush=True)
    run_checks(CHECKS, JOB["checks"], strategy)


if __name__ == "__main__":
    main()
    finish()
