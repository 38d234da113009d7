"""Training mode (tapas.execution.program.stateful): dropout and batch norm as ``model.fit`` runs them,
rebuilt exactly on N devices.

In this process (no devices): the training-mode capture's GraphNodes get sharded patterns
(dropout's random draw, batch norm's moment and update nodes), the single-device replay
equals a Keras call with ``training=True`` (outputs, the advanced seed, the new moving
statistics), random plans on simulated shards equal one device (outputs, gradients and
every variable write), and a write the program cannot make is refused with the fix.

In worker processes (tests/training_worker.py, logical CPU devices set once per process):
``tapas.parallelize`` in training mode (the default) against Keras with rtol 1e-5 over a
few optimizer steps, the collective audit equal to the prediction, on 2 and 4 devices:
a dropout + batch-norm MLP under random plans that split the dropout activations and the
batch moments, keras-hub's BERT classifier with a dict batch (both modes), and ``tapas
train --model=path.keras --notraining`` (training mode: tests/test_inputs.py; resnet-tiny's
batch norm in training mode under MultiWorkerMirroredStrategy: tests/test_runtime.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tapas import capturing
from tapas.execution.api import parallel
from tapas.execution.program import reconstruct
from tapas.execution.checking import checker, verify
from matrix import full, only_in_full_matrix  # tests/matrix.py
from worker_main import run_worker  # tests/worker_main.py
from tapas.execution.program.collectives import SimulatedCollectives
from tapas.sharding import patterns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "training_worker.py")
SPEC = tf.TensorSpec([8, 8])


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,), name="x")
    h = keras.layers.Dense(16)(inp)
    h = keras.layers.Dropout(0.3, seed=1)(h)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(inp, keras.layers.Dense(4)(h))


def batch() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8, 8)).astype("float32")


# ---- in this process ----------------------------------------------------------------------

def replay_on_one_device(trace: Any, graph: Any, x: np.ndarray) -> tuple[Any, dict]:
    """The training graph replayed on one device: its output and its variable writes."""
    prog = reconstruct.Program(trace, graph, reconstruct.Plan.replicated(graph, 1))

    @tf.function(autograph=False)
    def run() -> Any:
        writes: dict = {}
        outs = prog([[tf.constant(x)]], prog.trace_weights(), SimulatedCollectives(1), writes)
        return outs[0][0], {k: v[0] for k, v in writes.items()}

    return run()


def test_training_capture_records_seed_states_and_shards_dropout() -> None:
    """The seed generator's state is a Trace state (not a weight); the Dense + dropout
    GraphNode has sharded patterns, and a batch moment node has the batch-split one
    (partial mean + all-reduce: synchronized batch norm)."""
    trace = capturing.trace(mlp(), SPEC, training=True)
    graph = capturing.to_ir(trace)
    assert [v.path.split("/")[-1] for v in trace.states.values()] == ["seed_generator_state"]
    assert all("seed" not in w.path for w in graph.weights)
    dropout = next(n for n in graph.nodes if any("Random" in op.type for op in n.ops))
    names = [p.name for p in patterns.patterns_for(dropout, graph, 2)]
    assert "column" in names and "batch" in names, names
    moments = next(n for n in graph.nodes if "moments" in n.name)
    batch_split = next(p for p in patterns.patterns_for(moments, graph, 2) if p.name == "batch")
    assert [c.kind.value for c in batch_split.comms] == ["AR"]
    assert "partial-mean" in [r.value for r in batch_split.rewrites.values()]


def test_single_device_replay_equals_a_keras_training_call() -> None:
    """The replayed training graph on one device: the output of ``model(x,
    training=True)`` (the same dropout mask), and its writes are the seed state and the
    moving statistics Keras holds after that call."""
    model = mlp()
    trace = capturing.trace(model, SPEC, training=True)
    graph = capturing.to_ir(trace)
    x = batch()
    got, writes = replay_on_one_device(trace, graph, x)
    want = model(x, training=True)   # advances the seed and the moving statistics
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    after = {v.path: v.numpy() for v in model.variables}
    assert sorted(p.split("/")[-1] for p in writes) == ["moving_mean", "moving_variance",
                                                        "seed_generator_state"]
    for path, value in writes.items():
        np.testing.assert_allclose(value.numpy(), after[path], rtol=1e-6, atol=1e-7)
    assert not any(np.allclose(v, 0.0) for p, v in after.items() if p.endswith("moving_mean"))


class Noise(keras.layers.Layer):
    """Dropout through a seed generator with a fixed name: two of them share the Keras
    path 'sg/seed_generator_state'."""

    def __init__(self, seed: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.sg = keras.random.SeedGenerator(seed, name="sg")

    def call(self, x: Any, training: bool = False) -> Any:
        return keras.random.dropout(x, 0.5, seed=self.sg) if training else x


def test_seed_states_sharing_a_keras_path_are_told_apart() -> None:
    """Two seed states with one Keras path are named 'p' and 'p#1' (as weights are), and
    the replay advances each as Keras does."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    model = keras.Model(inp, Noise(2)(keras.layers.Dense(8)(Noise(1)(inp))))
    trace = capturing.trace(model, SPEC, training=True)
    assert sorted(trace.state_paths.values()) == ["sg/seed_generator_state",
                                                   "sg/seed_generator_state#1"]
    graph = capturing.to_ir(trace)
    x = batch()
    got, writes = replay_on_one_device(trace, graph, x)
    want = model(x, training=True)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    after = capturing.tracing.states_by_path(model)
    assert sorted(writes) == sorted(after)
    for path, value in writes.items():
        np.testing.assert_array_equal(value.numpy(), after[path].numpy())


def test_one_dropout_layer_applied_three_times_draws_three_masks_as_keras() -> None:
    """keras-hub ESM-2's encoder applies one Dropout layer (one seed generator) three times
    per call. The three advances of its state (read, add 1, assign: nothing from the
    activations) are grouped into the first dropout's GraphNode, so the later dropouts'
    reads are replayed after all three writes; each must still see the state as it was at
    its place in the program (it saw the last write: the outputs differed by 2.3 on ESM-2,
    on one device too)."""
    keras.utils.set_random_seed(0)
    drop = keras.layers.Dropout(0.5)
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, name="d1")(drop(inp))
    h = keras.layers.Dense(8, name="d2")(drop(h))
    model = keras.Model(inp, drop(h) + h)
    trace = capturing.trace(model, SPEC, training=True)
    graph = capturing.to_ir(trace)
    x = batch()
    (path,) = set(trace.state_paths.values())
    before = capturing.tracing.states_by_path(model)[path].numpy()
    got, writes = replay_on_one_device(trace, graph, x)
    want = model(x, training=True)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    after = capturing.tracing.states_by_path(model)[path].numpy()
    assert not np.array_equal(before, after)
    np.testing.assert_array_equal(writes[path].numpy(), after)
    for seed in range(2):
        plan = parallel.random_plan(graph, 2, seed)
        assert checker.check_plan(trace, graph, plan, [x])["ok"]


@pytest.mark.parametrize("n", [2, 4])
def test_random_plans_on_simulated_shards_equal_one_device(n: int) -> None:
    """Random plans over the training graph on N simulated shards: outputs, gradients and
    every variable write equal one device, with the dropout activation split in some; the
    collectives run are the predicted ones (none in the backward pass for a slice of batch
    norm's StopGradient of the mean, whose gradient TensorFlow drops)."""
    from tapas.execution.checking import audit
    trace = capturing.trace(mlp(), SPEC, training=True)
    graph = capturing.to_ir(trace)
    split_dropout = 0
    for seed in range(3):
        plan = parallel.random_plan(graph, n, seed)
        cmp = verify.compare_with_single_device(trace, graph, plan, [batch()])
        writes = [d.what for d in cmp.differences if d.what.startswith("write")]
        assert len(writes) == 3, writes
        assert cmp.ok(), cmp.worst
        assert not audit.compare_audit(cmp.audit, audit.program_comms(
            reconstruct.Program(trace, graph, plan), input_gradients=True))
        got = checker.check_plan(trace, graph, plan, [batch()])
        assert got["ok"] and got["sharded"] > 0, got
        split_dropout += sum(1 for node in graph.nodes for op in node.ops
                             if op.type == "SelectV2" and str(
                                 plan.pattern(node).tensors.get(op.outputs[0].name, "R"))
                             .startswith("S"))
    assert split_dropout > 0


def keras2_dropout_mlp() -> Any:
    import tf_keras as k2
    k2.utils.set_random_seed(0)
    inp = k2.Input((8,), batch_size=8)
    h = k2.layers.Dropout(0.5)(k2.layers.Dense(16)(inp))
    model = k2.Model(inp, k2.layers.Dense(4)(k2.layers.Dense(16, activation="relu")(h)))
    tf.random.set_seed(None)   # no global seed (as usual): the op draws from its own state
    return model


@pytest.mark.parametrize("n", [2, 4])
def test_keras2_dropout_draws_one_mask_that_every_shard_slices(n: int) -> None:
    """Keras 2's Dropout (Hugging Face's TF models) draws with a stateful RandomUniform op.
    Replayed as it was, each device's copy drew its own mask (a replicated activation held
    other values on every device; a split one was not a slice of one mask). It is drawn
    statelessly from the step number: random plans on N simulated shards equal one device
    (outputs, gradients), the draw is the same for the same step and new for the next."""
    trace = capturing.trace(keras2_dropout_mlp(), SPEC, training=True)
    graph = capturing.to_ir(trace)
    single = reconstruct.Program(trace, graph, reconstruct.Plan.replicated(graph, 1))
    assert len(single.stateful_random) == 1
    draw = tf.function(lambda step: single([[tf.constant(batch())]], single.trace_weights(),
                                           SimulatedCollectives(1), seed=step)[0][0],
                       autograph=False)
    draws = [draw(tf.constant(step, tf.int64)).numpy() for step in (0, 0, 1)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    split = 0
    for seed in range(3):
        plan = parallel.random_plan(graph, n, seed)
        cmp = verify.compare_with_single_device(trace, graph, plan, [batch()])
        assert cmp.ok(), cmp.worst
        split += sum(1 for node in graph.nodes for op in node.ops if op.type == "SelectV2"
                     and str(plan.pattern(node).tensors.get(op.outputs[0].name, "R"))
                     .startswith("S"))
    assert split > 0


def test_a_split_read_of_the_stopped_batch_mean_runs_no_backward_gather() -> None:
    """Random plan 15 on 2 shards reads batch norm's StopGradient of the mean split: the
    forward slices it and TensorFlow drops its gradient, so no backward all-gather may run
    (it did, outside the prediction, when the replayed StopGradient was on the tape)."""
    from tapas.execution.checking import audit
    from tapas.sharding.placements import Split, parse_placement
    trace = capturing.trace(mlp(), SPEC, training=True)
    graph = capturing.to_ir(trace)
    plan = parallel.random_plan(graph, 2, 15)
    stopped = [t.name for n in graph.nodes for op in n.ops if op.type == "StopGradient"
               for t in op.outputs]
    assert any(isinstance(parse_placement(p), Split) for n in graph.nodes
               for t, p in zip(n.inputs, plan.pattern(n).inputs) if t.name in stopped)
    cmp = verify.compare_with_single_device(trace, graph, plan, [batch()])
    assert cmp.ok(), cmp.worst
    assert not audit.compare_audit(cmp.audit, audit.program_comms(
        reconstruct.Program(trace, graph, plan), input_gradients=True))


class _Counter(keras.layers.Layer):
    """Writes a *trainable* weight in its forward pass (what no optimizer step can share)."""

    def build(self, shape: Any) -> None:
        self.count = self.add_weight(shape=(shape[-1],), initializer="zeros", name="count")

    def call(self, x: Any, training: bool = False) -> Any:
        if training:
            self.count.assign_add(tf.reduce_sum(x, axis=0))
        return x + self.count


def test_a_forward_write_to_a_trainable_weight_is_refused_with_the_fix() -> None:
    inp = keras.Input((8,), name="x")
    model = keras.Model(inp, keras.layers.Dense(4)(_Counter(name="counter")(inp)))
    trace = capturing.trace(model, SPEC, training=True)
    graph = capturing.to_ir(trace)
    with pytest.raises(reconstruct.ReconstructError,
                       match=r"writes the trainable weight 'counter/count'.*make it "
                             r"non-trainable"):
        reconstruct.Program(trace, graph, reconstruct.Plan.replicated(graph, 2))


def test_a_plan_of_the_inference_graph_runs_in_inference_mode_unless_told_otherwise() -> None:
    """training=None (parallelize's default): a plan made on tapas.capture's default graph,
    which dropout and batch norm make differ from the training graph, runs in inference mode
    (with a warning) instead of being refused; training=True refuses it naming the flag; a
    plan of the training graph runs in training mode. (`tapas search --out=s.json` then
    `tapas train --strategy=s.json` on a batch-norm model was refused before.)"""
    import tapas
    from tapas.execution.api.parallel import random_plan
    model = mlp()
    loss = keras.losses.MeanSquaredError()
    inference_plan = random_plan(capturing.capture(model, SPEC), 1, 0)
    pm = tapas.parallelize(model, SPEC, inference_plan, devices=1, loss=loss)
    assert pm.training is False
    with pytest.raises(reconstruct.ReconstructError, match="training flag"):
        tapas.parallelize(model, SPEC, inference_plan, devices=1, loss=loss, training=True)
    training_plan = random_plan(capturing.capture(model, SPEC, training=True), 1, 0)
    assert tapas.parallelize(model, SPEC, training_plan, devices=1, loss=loss).training is True


# ---- on N devices (worker processes) ------------------------------------------------------

def run_job(job: dict[str, Any], timeout_s: float = 500.0) -> dict[str, dict[str, Any]]:
    """Run the worker in one process (always ended); its results by check name."""
    return run_worker(WORKER, job, timeout_s=timeout_s)[0]


def ok(check: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in check, check.get("traceback", check)
    return check


def assert_equal_to_keras(r: dict[str, Any], mode: str = "training") -> None:
    assert r["mode"] == mode
    bad = {k: r[k] for k in ("outputs", "loss", "gradients", "step_losses", "weights",
                             "states") if not r[k]["ok"]}
    assert r["ok"] and not bad, bad
    assert r["audit"], r["audit_table"]
    assert r["sharded"] > 0


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = str(tmp_path_factory.mktemp("training2"))
    return run_job({"devices": 2, "dir": d, "checks": ["mlp", "resume", "keras2_dropout",
                                                       "hf_bert", "cond_weights",
                                                       "tfm_fnet"],
                    "seeds": [0, 1]})


def test_dropout_and_batch_norm_mlp_random_plans_on_2_devices(two_devices: dict) -> None:
    """Random plans (SGD and Adam): equal to Keras in training mode over 3 steps, the seed
    states advanced as Keras's (4 draws: verify's first batch and 3 steps); between the
    plans, dropout activations split and batch moments over a split batch."""
    r = ok(two_devices["mlp"])
    for label in ("random:0", "random:1"):
        assert_equal_to_keras(r[label])
        # verify also checked the inference graph on the trained weights (as evaluate runs)
        assert r[label]["inference"]["ok"] and r[label]["inference"]["count"] == 2
        assert r[label]["states_count"] == 2
        assert [1, 4] in r[label]["state_values"].values()   # Dropout(seed=1): [1, 0] + 4 draws
    assert sum(r[k]["dropout_split"] for k in ("random:0", "random:1")) > 0
    assert sum(r[k]["moments_split"] for k in ("random:0", "random:1")) > 0


def test_keras2_dropout_trains_with_one_draw_on_every_device(two_devices: dict) -> None:
    """Keras 2's stateful dropout on 2 devices: the first step's loss equals the graph
    replayed on one device with the same draws (every device sliced one mask), and verify
    says why training mode cannot be compared with Keras instead of reporting a
    difference."""
    r = ok(two_devices["keras2_dropout"])
    for label in ("random:0", "random:1"):
        got = r[label]
        assert got["stateful_random"] == 1
        np.testing.assert_allclose(got["loss"], got["reference"], rtol=1e-5)
        assert "stateful op" in got["refused"] and "training=False" in got["refused"]
        assert got["same_seed_same_draw"] and got["next_step_other_draw"]


def test_hugging_face_bert_with_a_dict_batch_in_both_modes(two_devices: dict) -> None:
    """Hugging Face's TFBertModel (Keras 2: its embeddings read straight from the
    variables, its dropout stateful) under a random plan on 2 devices: equal to Keras in
    inference mode (outputs, gradients, 2 steps, audit = prediction), and in training mode
    its first step equals the graph on one device with the same draws."""
    r = ok(two_devices["hf_bert"])
    assert_equal_to_keras(r["inference random:0"], mode="inference")
    got = r["training random:0"]
    assert got["stateful_random"] > 0 and got["sharded"] > 0
    np.testing.assert_allclose(got["loss"], got["reference"], rtol=1e-5)
    assert "stateful op" in got["refused"]


def test_a_cond_reading_weights_trains_and_an_untaken_branch_has_a_zero_gradient(
        two_devices: dict) -> None:
    """A tf.cond whose branches read weights (Hugging Face LED) through tapas.parallelize on
    2 devices: equal to Keras in inference mode over 2 steps; Keras's gradient of the
    weight only the untaken branch reads is None, which verify takes as zero (it crashed
    converting None)."""
    r = ok(two_devices["cond_weights"])
    for label in ("random:0", "random:1"):
        assert_equal_to_keras(r[label], mode="inference")


def test_model_garden_fnet_with_split_complex_activations_equals_keras(
        two_devices: dict) -> None:
    """The TensorFlow Model Garden's FNet mixes tokens with Fourier transforms in complex
    numbers; the runtime's collectives carried complex values as int32 (the simulation,
    whose collectives are concatenations, was right): a random plan that splits them is
    equal to Keras on 2 devices."""
    r = ok(two_devices["tfm_fnet"])
    assert_equal_to_keras(r["random:0"], mode="inference")
    assert r["random:0"]["complex_split"] > 0


def test_a_restored_training_mode_program_draws_the_saved_programs_next_masks(
        two_devices: dict) -> None:
    """Checkpoints hold the seed-generator states: a program restored from one takes the
    same steps (same dropout masks, so the same losses and weights) as the program that
    saved it went on to take; also when restored into another plan's layout."""
    r = ok(two_devices["resume"])
    assert r["how"] == "direct"
    assert r["restored_states"] == r["states_at_save"]
    assert len(r["states_at_save"]) == 2 and r["states_equal"]
    np.testing.assert_allclose(r["got"], r["want"], rtol=1e-6)
    assert r["weights_max_diff"] <= 1e-6
    # into another plan's layout (resharded): the same states, the same steps to rounding
    assert r["other_how"] == "resharded" and r["other_states"] == r["states_at_save"]
    np.testing.assert_allclose(r["other_got"], r["want"], rtol=1e-5)
    # into the same weights with one dropout fewer: the state counts are named
    assert "holds 2 seed states" in r["refused"] and "reads 1" in r["refused"], r["refused"]


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("keras_hub")
    d = str(tmp_path_factory.mktemp("training4"))
    checks = ["mlp", "bert", "save"] if full() else ["bert", "save"]
    return run_job({"devices": 4, "dir": d, "checks": checks, "seeds": [2],
                    "modes": ["training", "inference"], "bert_seed": 1}, timeout_s=600)


@only_in_full_matrix   # the same checks run on 2 devices in the suite
def test_dropout_and_batch_norm_mlp_random_plan_on_4_devices(four_devices: dict) -> None:
    assert_equal_to_keras(ok(four_devices["mlp"])["random:2"])


def test_bert_classifier_dict_batch_both_modes_on_4_devices(four_devices: dict) -> None:
    """keras-hub BERT with a head, a dict batch and a random plan: training mode (dropout
    in every layer, masks drawn as one device draws them) and inference mode."""
    r = ok(four_devices["bert"])
    assert_equal_to_keras(r["training"])
    assert r["training"]["states_count"] > 0
    assert_equal_to_keras(r["inference"], mode="inference")
    assert r["inference"]["states_count"] == 0


def test_bert_classifier_dict_batch_training_mode_on_2_devices() -> None:
    """The same on 2 devices, in training mode (inference mode on 2 devices:
    tests/test_inputs.py), with dropout activations split."""
    pytest.importorskip("keras_hub")
    r = ok(run_job({"devices": 2, "checks": ["bert"], "modes": ["training"],
                    "bert_seed": 0})["bert"])["training"]
    assert_equal_to_keras(r)
    assert r["dropout_split"] > 0


def test_tapas_train_on_a_saved_bert_classifier_without_training_mode(
        four_devices: dict, tmp_path: Any) -> None:
    """`tapas train --model=file.keras --notraining` trains the inference graph, verified
    against Keras called with training=False (the default, training mode, is
    tests/test_inputs.py::test_tapas_train_on_a_saved_dict_input_model)."""
    path = ok(four_devices["save"])["path"]
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tapas.cli", "train", f"--model={path}", "--devices=2",
         "--steps=2", "--strategy=random:0", "--verify", f"--json_out={out}", "--notraining"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mode: inference" in proc.stdout and "verify: PASSED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "inference" and report["verify"]["mode"] == "inference"
    assert report["verify"]["ok"] and report["audit"]["matches"]
