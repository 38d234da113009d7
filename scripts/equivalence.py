"""Equivalence matrix: every plan TAPAS may run equals the single-device model (issues 5, 11).

    python scripts/equivalence.py [--models=corpus,zoo | NAME,...] [--devices=2,4]
        [--seeds=0,1,2] [--nosearched] [--levels=sim,runtime] [--checker]
        [--optimizer=sgd|adam] [--modes=inference,training] [--cases=JSON]
        [--timeout=900] [--json_out=out/equivalence.json]

Models: zoo presets (``tapas.models``: t5-tiny, t5-tiny-masked, moe-tiny, resnet-tiny,
bert-tiny, llama-tiny), every keras.applications family and keras-hub backbone of
``tapas.models.corpus`` (``--models=corpus``, ``zoo``, ``all`` or names). Plans: the searched
strategy (a V100 node of N devices, with a memory budget of 70 % (else 85 %) of what the
unconstrained search's plan needs, so that it shards: tiny models are cheapest replicated)
and ``tapas.execution.api.parallel.random_plan`` with each seed. Each (model, devices,
plan) runs in a process of its own (logical devices are fixed per process, and a failed
collective poisons its process), with a timeout; a case whose process dies of a signal is
reported with the signal, the C library's message and the Python frames it was in. Levels:

* ``sim`` -- the plan rebuilt and run on N simulated shards in one process
  (``tapas.execution.checking.checker.check_plan``): outputs and the gradients of every weight and
  float input against the same program on one device, within rtol 1e-5 / atol 1e-5 x the
  largest magnitude; and that one-device program's outputs against the Keras model's;
* ``runtime`` -- ``tapas.parallelize`` on N logical CPU devices and ``ParallelModel.verify``
  (outputs, loss, gradients, 2 optimizer steps -- ``--optimizer`` -- and the weights after
  them against Keras) and the collective audit of the step against the prediction, for
  models with one output and a loss (zoo presets: their own; keras.applications: sparse
  crossentropy on 10 classes; keras-hub: mean squared error against random targets). A
  model whose input structure the runtime does not take yet (keras-hub's dict inputs) is
  reported as ``input-structure unsupported`` with the runtime's message, not hidden.

``--modes``: the graph each case runs. ``inference`` (the default): the plan is made on the
inference capture and both levels run it. ``training``: the plan is made on the
training-mode capture (dropout drawing its masks, batch norm updating its moving
statistics) and the runtime level runs ``tapas.parallelize(..., training=True)``, verified
against ``model(x, training=True)`` from the same seed-generator states (the simulated
level runs inference graphs only, so it is skipped).

A runtime case whose outputs and loss are equal but whose gradients are not is measured
against Keras's own float32 error on the worst gradient (the model rebuilt in float32 and
float64 from the same variables and, in training mode, the same dropout masks): where
the parallel program is within twice Keras's distance from exact arithmetic (two float32
programs each that far from exact may differ by twice it), the case is reported as
``float32 noise`` (counted equal, listed apart). Batch norm in training mode over a handful of examples makes gradients
ill-conditioned enough for this (keras-mobilenet on a batch of the corpus).

Rounding that a deep network amplifies, or that flips a ReLU whose input is zero but for
rounding, can make a correct float32 plan differ from one device by more than any
tolerance. A failed case of a Keras 3 model (zoo, keras.applications, keras-hub, kimm) is
therefore run again with the model built in float64 (``keras.config.set_dtype_policy``)
and the same plan (the patterns chosen in float32, by GraphNode, re-applied): equal there
(``float64``: the rerun's levels all pass), the float32 difference is rounding, and the
case is reported as ``float32 noise (equal in float64)``; a wrong plan differs in float64
too. The pattern checker likewise: a Keras 3 model whose checker finds patterns that differ
in float32 is checked again in float64 (every pattern of every GraphNode), and counted
right where none differs there. Keras 2 models (Hugging Face, the Model Garden) have no
such policy and are not rerun.

``--checker`` also runs the pattern checker (``check_node_patterns``) on each model once per
device count. Prints a table and writes JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# batch norm in training mode over corpus.BATCH = 2 examples at 32x32 (1x1 maps at the end)
# is so ill-conditioned that Keras's own float32 gradients of DenseNet differ from float64
# by 2e10; at 8 examples by 0.6 % of the largest gradient
TRAINING_BATCH = 8
ZOO = ("t5-tiny", "t5-tiny-masked", "moe-tiny", "resnet-tiny", "bert-tiny", "llama-tiny")
UNSUPPORTED_INPUTS = ("inputs, the model takes", "structure of `inputs`",
                      "doesn't match the expected structure")

flags.DEFINE_list("models", ["all"], "zoo, corpus, all, or model names.")
flags.DEFINE_list("devices", ["2", "4"], "Device counts.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the random plans.")
flags.DEFINE_bool("searched", True, "Also run the searched strategy.")
flags.DEFINE_list("levels", ["sim", "runtime"], "sim, runtime.")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "Optimizer of the runtime level.")
flags.DEFINE_list("modes", ["inference"], "inference, training: the graph each case runs.")
flags.DEFINE_integer("batch", 0, "Batch of the corpus models (0: corpus.BATCH in inference "
                     "mode, TRAINING_BATCH in training mode).")
flags.DEFINE_bool("checker", False, "Also run the pattern checker per model and N.")
flags.DEFINE_bool("float64_rerun", True, "Run a failed case of a Keras 3 model again in "
                  "float64 with the same plan (see the module docstring).")
flags.DEFINE_bool("slow", False, "Include corpus entries marked slow (NASNet).")
flags.DEFINE_integer("timeout", 900, "Seconds per case process.")
flags.DEFINE_string("json_out", "out/equivalence.json", "Where to write the results.")
flags.DEFINE_string("cases", None, "A JSON list of cases {model, devices, plan, levels} to "
                    "run instead of the matrix (the CI slice).")
flags.DEFINE_string("case", None, "Internal: run one case (JSON) in this process.")
FLAGS = flags.FLAGS


# ---- one case, in its own process ------------------------------------------------------------

def _build(name: str, batch: int | None = None) -> dict[str, Any]:
    """The model, its input specs, its loss and a batch (or None where it has no loss);
    ``batch``: the corpus models' batch size (default ``corpus.BATCH``)."""
    from tapas import models
    if name in models.names():
        e = models.get(name)
        xs, y = e.synthetic_batch()
        return {"model": e.build(seed=0), "specs": list(e.input_spec()), "loss": e.keras_loss(),
                "xs": list(xs), "y": y, "library": "zoo", "name": name}
    from tapas.models import corpus
    entry = corpus.get(name)
    batch = batch or corpus.BATCH
    model, specs = entry.build(batch)
    out = {"model": model, "specs": specs, "library": entry.library, "y": None, "name": name,
           "batch": batch}
    if entry.library == "keras.applications" or len(model.outputs) == 1:
        out.update(loss=entry.loss(), y=entry.synthetic_batch(model, specs)[1])
    return out


def _plan(graph: Any, n: int, label: str) -> tuple[Any, str]:
    """The plan called ``label`` ("searched" or "random:SEED") and a note."""
    from tapas.execution.api import parallel
    from tapas.execution.program import reconstruct
    from tapas.planning import search
    from tapas.planning.cost import Cluster
    if label.startswith("random:"):
        return parallel.random_plan(graph, n, int(label.split(":")[1])), ""
    cluster = Cluster.v100_ethernet(1, n)
    s = search.search(graph, cluster=cluster)
    note = "no memory budget"
    full = s.memory.total
    for share in (0.7, 0.85):   # a budget below the chosen plan's memory makes it shard
        try:
            s = search.search(graph, cluster=cluster, memory_budget=share * full)
            note = f"memory budget {share:.0%} of the unconstrained plan's"
            break
        except (ValueError, RuntimeError):
            continue
    return reconstruct.Plan.from_strategy(s, graph), note


def _plan_by_names(graph: Any, n: int, names: dict[str, str]) -> Any:
    """The plan choosing, for each GraphNode id, the pattern of that name (a float32 case's
    plan applied to the model rebuilt in float64: the same GraphNodes and patterns)."""
    from tapas.execution.program import reconstruct
    from tapas.planning.strategy import graph_digest
    from tapas.sharding import patterns
    chosen = {}
    for node in graph.nodes:
        want = names.get(str(node.id), "replicate")
        found = [p for p in patterns.patterns_for(node, graph, n) if p.name == want]
        if not found:
            raise ValueError(f"GraphNode {node.id} '{node.name}' has no pattern {want!r} in "
                             "float64: the float32 plan cannot be re-applied")
        chosen[node.id] = found[0]
    # the digest lets tapas.parallelize rebuild the plan on its own capture of the model
    # (the same GraphNodes, tensors named by other counters)
    return reconstruct.Plan(n, chosen, graph_digest=graph_digest(graph))


def _keras_inputs(built: dict[str, Any], graph: Any, arrays: list) -> Any:
    """``arrays`` (one per graph input) in the structure the Keras model takes."""
    if isinstance(built["specs"], dict):
        return {t.name.split(":")[0]: a for t, a in zip(graph.inputs, arrays)}
    return arrays if len(arrays) > 1 else arrays[0]


def _sim(built: dict[str, Any], trace: Any, graph: Any, plan: Any) -> dict[str, Any]:
    """The plan on simulated shards against one device, and one device against Keras."""
    import numpy as np
    import tensorflow as tf
    from tapas.execution.checking import checker, verify
    arrays = list(built["xs"]) if built["library"] == "zoo" else checker.synthetic_inputs(graph)
    out = checker.check_plan(trace, graph, plan, arrays)
    replay = verify.intermediate_values(trace, graph, arrays, [t.name for t in graph.outputs])
    got = built["model"](_keras_inputs(built, graph, arrays), training=False)
    want = [np.asarray(v) for v in tf.nest.flatten(got)]
    mine = [replay[t.name] for t in graph.outputs]
    if len(want) != len(mine):
        out["keras"] = f"{len(mine)} outputs against Keras's {len(want)}"
        out["ok"] = False
        return out
    diffs = [verify.compare(a, b) for a, b in zip(mine, want)]
    out["keras_diff"] = max(d["max_abs_diff"] for d in diffs)
    out["ok"] = out["ok"] and all(d["ok"] for d in diffs)
    return out


def _runtime(built: dict[str, Any], plan: Any, n: int, optimizer: str,
             training: bool) -> dict[str, Any]:
    """tapas.parallelize on N devices in the given mode, ParallelModel.verify against Keras
    and the collective audit of the training step against the plan's prediction."""
    import tapas
    if built.get("loss") is None:
        return {"status": "not run: the runtime trains one model output"}
    xs = built.get("xs")
    if xs is None:
        from tapas.execution.checking import checker
        graph = tapas.capture(built["model"], built["specs"])
        xs = _keras_inputs(built, graph, checker.synthetic_inputs(graph))
    initial = [v.numpy() for v in built["model"].variables]
    try:
        # the plan was made on run_case's capture, in the same mode
        pm = tapas.parallelize(built["model"], built["specs"], plan, devices=n,
                               loss=built["loss"], optimizer=optimizer, training=training)
        if training and pm.program.stateful_random:
            return _runtime_stateful_random(pm, xs, built["y"])
        report = pm.verify(xs, built["y"], steps=2)
        audit = pm.audit()
    except Exception as e:  # noqa: BLE001 -- classified and reported, never hidden
        msg = f"{type(e).__name__}: {e}"
        if isinstance(built["specs"], dict) and any(k in msg for k in UNSUPPORTED_INPUTS):
            return {"status": "input-structure unsupported", "error": msg[:500]}
        return {"status": "error", "error": msg[:2000]}
    keys = ("outputs", "loss", "gradients", "weights")
    ok = report["ok"] and audit.matches
    out = {"status": "ok" if ok else "MISMATCH", "audit_matches": audit.matches,
           **{k: report[k]["max_abs_diff"] for k in keys}}
    grads = report["gradients"]
    import keras
    # (the float64 twin is built under Keras 3's dtype policy: Keras 2 models, Hugging
    # Face's and the Model Garden's, have none, so their mismatches stay mismatches)
    if not ok and report["states"]["ok"] and grads["worst"] is not None and \
            isinstance(built["model"], keras.Model):
        out_noise, grad_noise = _float32_noise(built, initial, xs, training, grads["worst"])
        out.update(keras_f32_noise=grad_noise, keras_f32_output_noise=out_noise,
                   worst_gradient=grads["worst"])
        # two float32 programs, each as far from exact arithmetic as Keras is, may differ
        # from each other by up to twice that
        if audit.matches and (report["outputs"]["ok"] or
                              report["outputs"]["max_abs_diff"] <= 2 * out_noise) \
                and grads["max_abs_diff"] <= 2 * grad_noise:
            out["status"] = "float32 noise"
    return out


def _runtime_stateful_random(pm: Any, xs: Any, y: Any) -> dict[str, Any]:
    """Training mode of a graph with stateful random ops (Keras 2's dropout: Hugging Face's
    TF models), whose draws Keras cannot replay, so ``verify`` refuses it: the program's
    plan on simulated shards against the graph replayed on one device with the same draws
    (outputs, gradients, writes), then two training steps on the devices (finite losses)
    and the collective audit of the training step against the plan's prediction."""
    import numpy as np
    from tapas.execution.checking import verify
    program = pm.program
    cmp = verify.compare_with_single_device(program.trace, pm.graph, program.plan,
                                            pm.inputs.flatten(xs))
    losses = [float(pm.train_step(xs, y)) for _ in range(2)]
    audit = pm.audit()
    ok = cmp.ok() and audit.matches and bool(np.all(np.isfinite(losses)))
    return {"status": "ok" if ok else "MISMATCH", "audit_matches": audit.matches,
            "reference": "the graph on one device, the same draws (stateful random ops: "
                         "Keras's own draws cannot be replayed)",
            "sim_worst": str(cmp.worst), "losses": losses}


@contextlib.contextmanager
def _float32_masks(active: bool) -> Iterator[None]:
    """While active, Keras's dropout (TensorFlow backend) draws its keep mask in float32
    whatever the input's dtype, and applies it in the input's dtype: a float64 model then
    drops exactly the units its float32 twin drops from the same seed (uniform draws in
    float64 are other numbers)."""
    if not active:
        yield
        return
    import tensorflow as tf
    from keras.src.backend.tensorflow import random as tf_random
    original = tf_random.dropout

    def dropout(inputs: Any, rate: float, noise_shape: Any = None, seed: Any = None) -> Any:
        ones = tf.ones(tf.shape(inputs), tf.float32)
        mask = original(ones, rate, noise_shape=noise_shape, seed=seed)
        return inputs * tf.cast(mask, inputs.dtype)

    tf_random.dropout = dropout
    try:
        yield
    finally:
        tf_random.dropout = original


def _loss_in(loss: Any, dtype: str) -> Any:
    """``loss`` computing in ``dtype`` (a Keras loss computes in its own dtype, floatx)."""
    return type(loss).from_config({**loss.get_config(), "dtype": dtype})


def _float32_noise(built: dict[str, Any], initial: list, xs: Any, training: bool,
                   path: str) -> tuple[float, float]:
    """How far Keras's own float32 outputs and gradient of weight ``path`` are from exact
    arithmetic: the model built again in float32 and in float64 from the same weights and
    variables (seed states included), the same batch and mode; the largest difference of
    the outputs and of that gradient. A parallel program whose gradient differs from Keras's by no more than this
    differs by rounding (ill-conditioned gradients: batch norm over a few examples in
    training mode amplifies it). In training mode both draw dropout from the same seed
    states, the float64 model its masks in float32 (:func:`_float32_masks`), so both drop
    the same units."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tapas.capturing.tracing import weights_by_path
    grads, outs = {}, {}
    # the weight by its position among the model's variables: a rebuilt model's layers may
    # be named by another count (kimm's `depthwise_conv2d_101` became `_201`)
    wanted = weights_by_path(built["model"])[path]
    position = next(i for i, v in enumerate(built["model"].variables) if v is wanted)
    policy = keras.config.dtype_policy()
    try:
        for dtype in ("float32", "float64"):
            keras.config.set_dtype_policy(dtype)
            keras.utils.set_random_seed(0)
            model = _build(built["name"], built.get("batch"))["model"]
            for v, a in zip(model.variables, initial):
                v.assign(a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a)
            x = tf.nest.map_structure(
                lambda a: a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a, xs)
            target = tf.constant(built["y"]) if not np.issubdtype(
                np.asarray(built["y"]).dtype, np.floating) else tf.constant(built["y"], dtype)
            with tf.GradientTape() as tape, _float32_masks(dtype == "float64"):
                got = model(x, training=training)
                loss = _loss_in(built["loss"], dtype)(target, got)
            outs[dtype] = [np.asarray(o, np.float64) for o in tf.nest.flatten(got)]
            g = tape.gradient(loss, model.variables[position])
            grads[dtype] = np.asarray(tf.convert_to_tensor(g), np.float64)  # IndexedSlices too
            keras.backend.clear_session()
    finally:
        keras.config.set_dtype_policy(policy)
    out_noise = max(float(np.abs(a - b).max()) for a, b in zip(outs["float32"], outs["float64"]))
    return out_noise, float(np.abs(grads["float32"] - grads["float64"]).max())


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One (model, devices, plan) case: the levels asked for, or the pattern checker."""
    from tapas.execution.runtime import devices
    n = case["devices"]
    devices.setup_devices(n)
    import keras
    from tapas import capturing
    keras.utils.set_random_seed(0)
    training = case.get("mode", "inference") == "training"
    if case.get("dtype", "float32") != "float32":
        keras.config.set_dtype_policy(case["dtype"])
    built = _build(case["model"], case.get("batch") or (TRAINING_BATCH if training else None))
    if case.get("dtype", "float32") != "float32" and built.get("loss") is not None:
        # a Keras loss computes in its own dtype (floatx, float32), not the policy's
        built["loss"] = _loss_in(built["loss"], case["dtype"])
    trace = capturing.trace(built["model"], built["specs"], training=training)
    graph = capturing.to_ir(trace)
    if case["plan"] == "checker":
        from tapas.execution.checking import checker, verify
        names = [i.name for nd in graph.nodes for i in nd.inputs]
        values = verify.intermediate_values(trace, graph, checker.synthetic_inputs(graph), names)
        checked, failures = checker.check_node_patterns(trace, graph, values, n)
        return {"ok": not failures, "checked": checked, "failures": failures[:20]}
    if case.get("patterns"):
        plan, note = _plan_by_names(graph, n, case["patterns"]), "the float32 case's plan"
    else:
        plan, note = _plan(graph, n, case["plan"])
    result: dict[str, Any] = {"note": note, "ok": True, "sharded": sum(
        1 for p in plan.patterns.values() if getattr(p, "name", "") != "replicate"),
        "patterns": {str(k): getattr(p, "name", "") for k, p in plan.patterns.items()}}
    if "sim" in case["levels"] and not training:
        result["sim"] = _sim(built, trace, graph, plan)
        result["ok"] = result["ok"] and result["sim"]["ok"]
    if "runtime" in case["levels"]:
        result["runtime"] = _runtime(built, plan, n, case.get("optimizer", "sgd"), training)
        result["ok"] = result["ok"] and result["runtime"]["status"] in (
            "ok", "float32 noise", "input-structure unsupported",
            "not run: the runtime trains one model output")
    return result


# ---- the matrix -------------------------------------------------------------------------------

def _models() -> list[str]:
    from tapas.models import corpus
    chosen: list[str] = []
    for m in FLAGS.models:
        if m in ("zoo", "all"):
            chosen += list(ZOO)
        if m in ("corpus", "all"):
            chosen += [e.name for e in corpus.entries() if FLAGS.slow or not e.slow]
        if m not in ("zoo", "corpus", "all"):
            chosen.append(m)
    return list(dict.fromkeys(chosen))


def _cases() -> list[dict[str, Any]]:
    """``--cases``, or the matrix: device counts x models x (checker,) searched, seeds."""
    if FLAGS.cases:
        given = json.loads(FLAGS.cases)   # a case without a mode runs in each of --modes
        return [dict(c, levels=c.get("levels", FLAGS.levels), mode=c.get("mode", m))
                for c in given for m in ([None] if "mode" in c else FLAGS.modes)]
    plans = (["checker"] if FLAGS.checker else []) + (["searched"] if FLAGS.searched else []) \
        + [f"random:{s}" for s in FLAGS.seeds]
    return [{"model": m, "devices": n, "plan": p, "levels": FLAGS.levels,
             "optimizer": FLAGS.optimizer, "mode": mode, "batch": FLAGS.batch}
            for mode in FLAGS.modes for n in map(int, FLAGS.devices) for m in _models()
            for p in plans]


def _spawn(case: dict[str, Any]) -> dict[str, Any]:
    """Run ``case`` in a child process; its result, or why it has none."""
    # -X faulthandler: a case that kills its process (a TensorFlow kernel corrupting the
    # heap) still prints where Python was
    cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--case",
           json.dumps(case)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.timeout,
                              env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {FLAGS.timeout} s",
                "seconds": FLAGS.timeout}
    seconds = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "seconds": seconds}
    if proc.returncode < 0:
        return {"ok": False, "seconds": seconds, "error": _killed(proc.returncode, proc.stderr)}
    return {"ok": False, "seconds": seconds,
            "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def _killed(returncode: int, stderr: str) -> str:
    """Why a case process died of a signal: the signal, the C library's or Python's last
    words, and the Python frames faulthandler printed for the thread that died."""
    import signal
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    lines = stderr.splitlines()
    said = [ln for ln in lines if ln.startswith("Fatal Python error") or
            any(w in ln for w in ("free(", "corrupted", "double free", "malloc(",
                                  "could not execute a primitive"))]
    frames, started = [], False
    for ln in lines:
        if ln.startswith(("Current thread", "Thread 0x")):
            if frames:
                break
            started = True
        elif started and ln.strip().startswith("File "):
            frames.append(ln.strip())
    # the innermost frame, then the nearest frames outside installed packages (TAPAS's)
    shown = frames[:1] + [f for f in frames[1:] if "site-packages" not in f][:3]
    return (f"killed by {name}: {'; '.join(dict.fromkeys(said)) or 'no message'}"
            + (f"; in {' <- '.join(shown)}" if shown else ""))


def _float64_rerunnable(case: dict[str, Any], r: dict[str, Any]) -> bool:
    """Whether a failed case may be run again in float64: a plan that was built and run,
    or the pattern checker, of a Keras 3 model (Keras 2 models have no dtype policy)."""
    if "error" in r or ("patterns" not in r and case["plan"] != "checker"):
        return False
    if case.get("mode", "inference") == "training":   # dropout draws differ by dtype
        return False
    from tapas import models
    if case["model"] in models.names():
        return True
    from tapas.models import corpus
    return corpus.get(case["model"]).library in ("keras.applications", "keras-hub", "kimm")


def _with_float64_rerun(case: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """``r`` with the float64 rerun of its plan attached; ok, as float32 noise, when every
    level passes in float64."""
    again = _spawn({**case, "dtype": "float64"} if case["plan"] == "checker" else
                   {**case, "dtype": "float64", "patterns": r["patterns"]})
    rt = again.get("runtime", {})
    passed = again.get("ok", False) and rt.get("status", "ok") != "float32 noise"
    out = {**r, "float64": {k: v for k, v in again.items() if k != "patterns"}}
    if passed:
        out["ok"] = True
        out["status"] = "float32 noise (equal in float64)"
    return out


def _row(case: dict[str, Any], r: dict[str, Any]) -> str:
    """One line of the table."""
    head = (f"{case['devices']:>2} {case['model']:<24} {case['plan']:<9} "
            f"{case.get('mode', 'inference')[:5]:<5} {r.get('sharded', ''):>4}")
    if "error" in r:
        return f"{head} ERROR {r['error'][-160:]!r}"
    if case["plan"] == "checker":
        f64 = r.get("float64")
        rerun = "" if f64 is None else (
            f" in float32; in float64 {len(f64.get('failures', []))} of "
            f"{f64.get('checked', '-')} wrong" + (": float32 noise" if r.get("ok") else "")
            if "error" not in f64 else f"; float64 rerun: {f64['error'][-120:]}")
        return f"{head} {r['checked']} patterns, {len(r['failures'])} wrong{rerun}"
    sim = r.get("sim", {})
    rt = r.get("runtime", {})
    sim_s = (f"sim {'ok' if sim['ok'] else 'FAIL'} keras "
             f"{sim.get('keras_diff', float('nan')):.1e}") if sim else "sim -"
    rt_s = f"runtime {rt.get('status', '-')}"
    if "keras_f32_noise" in rt:
        rt_s += (f" [Keras's own float32 error: outputs {rt['keras_f32_output_noise']:.1e}, "
                 f"worst gradient '{rt['worst_gradient']}' {rt['keras_f32_noise']:.1e}]")
    if "gradients" in rt:
        rt_s += (f" (out {rt['outputs']:.1e} grad {rt['gradients']:.1e} w {rt['weights']:.1e}"
                 f" audit {'=' if rt['audit_matches'] else 'DIFF'})")
    problem = sim.get("problem") or rt.get("error", "")
    if "float64" in r:
        f64 = r["float64"]
        verdict = ("equal in float64: float32 noise" if r.get("status", "").startswith(
            "float32 noise") else "DIFFERS in float64 too" if "error" not in f64 else
            f"no float64 rerun: {f64['error'][-160:]}")
        problem = (f"[{verdict}: sim {f64.get('sim', {}).get('worst', '-')}; runtime "
                   f"{f64.get('runtime', {}).get('status', f64.get('error', '-'))}] "
                   + problem)
    return f"{head} {sim_s} | {rt_s} | {r['seconds']:.0f} s {problem[:300]}"


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.case:
        result = run_case(json.loads(FLAGS.case))
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return
    rows = []
    for case in _cases():
        r = _spawn(case)
        if not r.get("ok") and FLAGS.float64_rerun and _float64_rerunnable(case, r):
            r = _with_float64_rerun(case, r)
        rows.append({"case": case, "result": r})
        print(_row(case, r), flush=True)
    failed = [x for x in rows if not x["result"].get("ok")]
    noise = [x for x in rows if x["result"].get("runtime", {}).get("status") == "float32 noise"]
    f64 = [x for x in rows if x["result"].get("status") == "float32 noise (equal in float64)"]
    print(f"\n{len(rows)} cases, {len(rows) - len(failed)} ok ({len(noise)} of them beyond "
          f"the tolerance by less than Keras's own float32 error, {len(f64)} equal only in "
          f"float64), {len(failed)} failed")
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"written to {FLAGS.json_out}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
