"""Subprocess entry of tests/test_training_mode.py: models with dropout and batch norm
parallelized in training mode on N logical CPU devices (set once per process).

    python tests/training_worker.py '{"devices": 2, "checks": ["mlp"], "dir": "/tmp/x"}'

Each check prints one line ``RESULT <json>``; a check that raises prints
``RESULT {"check": name, "error": ...}``. Checks:

* ``mlp``: Dense -> Dropout -> BatchNormalization -> Dense -> Dropout -> Dense (one seeded
  and one unseeded dropout) under random plans (``JOB["seeds"]``, SGD for even seeds, Adam
  for odd), verified in training mode;
* ``bert``: keras-hub's BERT classifier of ``tapas.models.corpus`` (dict inputs, dropout
  in every layer) with a dict batch, in the modes of ``JOB["modes"]``;
* ``save``: that classifier compiled and saved as ``<dir>/bert.keras`` for ``tapas train``;
* ``keras2_dropout``: a Keras 2 (tf_keras) MLP whose Dropout draws with a stateful op,
  under random plans: the first step's loss against the graph replayed on one device with
  the same draws, and verify's refusal of training mode;
* ``cond_weights``: a tf.cond whose branches read weights, one only in the branch not
  taken (Keras's gradient of it is None), verified in inference mode;
* ``tfm_fnet``: the Model Garden's FNet (complex activations) verified in inference mode;
* ``hf_bert``: Hugging Face's TFBertModel (tapas.models.corpus's ``hf-bert``) with a dict
  batch: verified against Keras in inference mode, its first training step as above;
* ``resume``: the MLP trained 2 steps, saved, 2 more steps; a fresh program restored from
  the checkpoint takes the same 2 steps: losses, weights and seed states against the first.

Per verified plan: the verify report (``ok`` per quantity), the audit, and what the plan
shards of the training-mode machinery (``dropout_split``: dropout outputs split across the
devices, so each takes its slice of the global mask; ``moments_split``: batch moments
computed over a split batch, i.e. synchronized batch norm).
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
MSE = keras.losses.MeanSquaredError()
QUANTITIES = ("outputs", "loss", "gradients", "step_losses", "weights", "states")


def machinery(pm: Any) -> dict[str, int]:
    """How many dropout outputs the plan splits, and how many batch moments it computes
    over a split batch (partial-mean rewrite of a Mean over axis 0)."""
    dropout = moments = 0
    for node in pm.graph.nodes:
        pat = pm.program.plan.pattern(node)
        tensors = getattr(pat, "tensors", {})
        for op in node.ops:
            name = op.outputs[0].name if op.outputs else ""
            if op.type == "SelectV2" and "dropout" in op.name and \
                    isinstance(parse_placement(tensors.get(name, "R")), Split):
                dropout += 1
            if op.type == "Mean" and "moments" in op.name and \
                    getattr(pat, "rewrites", {}).get(op.name) is not None:
                moments += 1
    return {"dropout_split": dropout, "moments_split": moments}


def verified(pm: Any, x: Any, y: Any, steps: int) -> dict[str, Any]:
    report = pm.verify(x, y, steps=steps)
    audit = pm.audit()
    return {"ok": report["ok"], "mode": report["mode"],
            **{k: {"ok": report[k]["ok"], "max_abs_diff": report[k]["max_abs_diff"]}
               for k in QUANTITIES},
            "states_count": report["states"]["count"], "audit": audit.matches,
            "inference": report.get("inference"),
            "audit_table": audit.table(), "state_values": {k: v.tolist() for k, v in
                                                     pm.global_states().items()},
            "sharded": sum(1 for n in pm.graph.nodes
                           if pm.program.plan.pattern(n).name != "replicate"),
            **machinery(pm)}


def mlp_model(second_dropout: bool = True) -> keras.Model:
    """Layers named, so that a second instance in this process has the same weight paths
    (a checkpoint of one restores into the other); without the second dropout the model
    has the same weights and one seed state fewer."""
    inp = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, name="dense_in")(inp)
    h = keras.layers.Dropout(0.3, seed=1, name="dropout_seeded")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dense(16, activation="relu", name="dense_mid")(h)
    if second_dropout:
        h = keras.layers.Dropout(0.5, name="dropout")(h)
    return keras.Model(inp, keras.layers.Dense(4, name="dense_out")(h), name="dropout_bn_mlp")


def check_mlp() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8)).astype("float32")
    y = rng.standard_normal((8, 4)).astype("float32")
    spec = tf.TensorSpec([8, 8])
    out = {}
    for seed in JOB.get("seeds", [0]):
        keras.utils.set_random_seed(seed)
        model = mlp_model()
        plan = parallel.random_plan(capturing.capture(model, spec, training=True), N, seed)
        pm = parallel.parallelize(model, spec, plan, devices=N, loss=MSE,
                                  optimizer="adam" if seed % 2 else "sgd")
        out[f"random:{seed}"] = verified(pm, x, y, steps=3)
    return out


def bert_classifier() -> tuple[keras.Model, dict[str, tf.TensorSpec]]:
    """The corpus's BERT classifier (``tapas.models.corpus``: keras-hub's BertBackbone,
    mean-pooled sequence output, a Dense head) with ``JOB["bert_layers"]`` layers (1) and
    batch 4, so that a plan may split the batch on 2 and 4 devices; dict specs."""
    import keras_hub
    from tapas.models import corpus
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=corpus.VOCAB, num_layers=JOB.get("bert_layers", 1), num_heads=4,
        hidden_dim=64, intermediate_dim=128, max_sequence_length=corpus.SEQ)
    inputs = {i.name: keras.Input(shape=(corpus.SEQ,), dtype=i.dtype, name=i.name)
              for i in backbone.inputs}   # static: tapas train needs a fixed sequence
    pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs)["sequence_output"])
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(pooled),
                        name="bert_classifier")
    return model, {k: tf.TensorSpec([4, corpus.SEQ], i.dtype, name=k)
                   for k, i in inputs.items()}


def bert_batch(specs: dict[str, tf.TensorSpec]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    seq = specs["token_ids"].shape[1]
    mask = np.ones((4, seq), "int32")
    mask[:, seq - 3:] = 0
    x = {"token_ids": rng.integers(0, 512, (4, seq)).astype("int32"),
         "segment_ids": rng.integers(0, 2, (4, seq)).astype("int32"), "padding_mask": mask}
    return {k: x[k] for k in specs}, rng.standard_normal((4, 3)).astype("float32")


def check_bert() -> dict[str, Any]:
    out = {}
    for mode in JOB.get("modes", ["training"]):
        training = mode == "training"
        model, specs = bert_classifier()
        x, y = bert_batch(specs)
        plan = parallel.random_plan(capturing.capture(model, specs, training=training), N,
                                    JOB.get("bert_seed", 0))
        pm = parallel.parallelize(model, specs, plan, devices=N, loss=MSE, training=training)
        out[mode] = verified(pm, x, y, steps=2)
    return out


def check_save() -> dict[str, Any]:
    model, _ = bert_classifier()
    model.compile(optimizer="sgd", loss="mse")
    path = os.path.join(JOB["dir"], "bert.keras")
    model.save(path)
    return {"path": path}


def check_resume() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 8)).astype("float32")
    y = rng.standard_normal((8, 4)).astype("float32")
    spec = tf.TensorSpec([8, 8])

    def program(plan_seed: int = 3, second_dropout: bool = True) -> Any:
        keras.utils.set_random_seed(3)
        model = mlp_model(second_dropout)
        plan = parallel.random_plan(capturing.capture(model, spec, training=True), N,
                                    plan_seed)
        return parallel.parallelize(model, spec, plan, devices=N, loss=MSE, optimizer="adam")

    first = program()
    for _ in range(2):
        first.train_step(x, y)
    saved = first.save(os.path.join(JOB["dir"], "resume"))

    def states(pm: Any) -> list:   # in program order: Keras numbers the seed generators
        return [v.tolist() for v in pm.global_states().values()]   # of the second model on

    states_at_save = states(first)
    want = [first.train_step(x, y) for _ in range(2)]
    second = program()
    how = second.restore(saved)
    restored_states = states(second)
    got = [second.train_step(x, y) for _ in range(2)]
    other = program(plan_seed=4)             # another layout: the checkpoint is resharded
    other_how = other.restore(saved)
    other_states = states(other)
    other_got = [other.train_step(x, y) for _ in range(2)]
    try:                                     # one seed state fewer: refused, named
        program(second_dropout=False).restore(saved)
        refused = ""
    except ValueError as e:
        refused = str(e)
    w1, w2 = first.global_weights(), second.global_weights()
    return {"refused": refused, "how": how, "want": want, "got": got, "states_at_save": states_at_save,
            "other_how": other_how, "other_states": other_states, "other_got": other_got,
            "restored_states": restored_states, "states_equal": states(first) == states(second),
            "weights_max_diff": max(float(np.abs(w1[p] - w2[p]).max()) for p in w1)}


def keras2_dropout_mlp() -> Any:
    """A Keras 2 (tf_keras) MLP whose Dropout draws with a stateful RandomUniform op, as
    Hugging Face's TF models do."""
    import tf_keras as k2
    k2.utils.set_random_seed(0)
    inp = k2.Input((8,), batch_size=8, name="x")
    h = k2.layers.Dense(16, name="dense_in")(inp)
    h = k2.layers.Dropout(0.5, name="dropout")(h)
    h = k2.layers.Dense(16, activation="relu", name="dense_mid")(h)
    model = k2.Model(inp, k2.layers.Dense(4, name="dense_out")(h), name="keras2_dropout")
    tf.random.set_seed(None)   # no global seed (as usual): the op draws from its own state
    return model


def first_step_against_one_device(model: Any, spec: Any, x: Any, y: Any, plan_seed: int
                                  ) -> dict[str, Any]:
    """A training-mode plan of a graph with stateful random ops: the first step's loss on N
    devices and the loss of the same graph replayed on one device with the same draws
    (step 0), whether the draws repeat for a step and change with it, and what verify
    says."""
    from tapas.execution.program import reconstruct
    from tapas.execution.program.collectives import SimulatedCollectives
    trace = capturing.trace(model, spec, training=True)
    graph = capturing.to_ir(trace)
    single = reconstruct.Program(trace, graph, reconstruct.Plan.replicated(graph, 1))
    weights = single.trace_weights()
    xs = [tf.constant(x[t.name.split(":")[0]]) for t in graph.inputs] if isinstance(x, dict) \
        else [tf.constant(x)]
    draw = tf.function(lambda step: single([[v] for v in xs], weights,
                                           SimulatedCollectives(1), seed=step)[0][0],
                       autograph=False)
    drawn = [draw(tf.constant(step, tf.int64)).numpy() for step in (0, 0, 1)]
    reference = float(MSE(y, drawn[0]))
    plan = parallel.random_plan(graph, N, plan_seed)
    pm = parallel.parallelize(model, spec, plan, devices=N, loss=MSE)
    try:
        pm.verify(x, y)
        refused = ""
    except ValueError as e:
        refused = str(e)
    loss = float(pm.train_step(x, y))
    return {"loss": loss, "reference": reference, "refused": refused,
            "same_seed_same_draw": bool(np.array_equal(drawn[0], drawn[1])),
            "next_step_other_draw": not np.array_equal(drawn[0], drawn[2]),
            "stateful_random": len(pm.program.stateful_random),
            "sharded": sum(1 for n in pm.graph.nodes
                           if pm.program.plan.pattern(n).name != "replicate"), **machinery(pm)}


def check_keras2_dropout() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8)).astype("float32")
    y = rng.standard_normal((8, 4)).astype("float32")
    return {f"random:{seed}": first_step_against_one_device(
        keras2_dropout_mlp(), tf.TensorSpec([8, 8]), x, y, seed)
        for seed in JOB.get("seeds", [0])}


def check_hf_bert() -> dict[str, Any]:
    """Hugging Face's TFBertModel (the corpus's hf-bert: a dict of token ids, attention mask
    and token types; embeddings looked up straight from the variables; Keras 2 dropout in
    every layer) under a random plan: verified against Keras in inference mode, and its
    first training step against one device with the same draws."""
    from tapas.models import corpus
    entry = corpus.get("hf-bert")
    model, specs = entry.build()
    x, y = entry.synthetic_batch(model, specs)
    out = {}
    for seed in JOB.get("seeds", [0])[:1]:   # one plan: the suite's time
        trace_graph = capturing.capture(model, specs, training=False)
        plan = parallel.random_plan(trace_graph, N, seed)
        pm = parallel.parallelize(model, specs, plan, devices=N, loss=MSE, training=False)
        out[f"inference random:{seed}"] = verified(pm, x, y, steps=2)
        out[f"training random:{seed}"] = first_step_against_one_device(model, specs, x, y, seed)
    return out


def check_cond_weights() -> dict[str, Any]:
    """A layer with a tf.cond whose branches read weights (Hugging Face LED's global
    attention), one weight only in the branch the batch does not take, so Keras's own
    gradient of it is None: random plans verified in inference mode."""
    class Gated(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight((shape[-1], shape[-1]), name="kernel")
            self.other = self.add_weight((shape[-1], shape[-1]), name="other")

        def call(self, x):
            return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.tanh(tf.matmul(x, self.kernel)),
                           lambda: tf.matmul(x, self.other))

    out = {}
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal((8, 8))).astype("float32")
    y = rng.standard_normal((8, 4)).astype("float32")
    spec = tf.TensorSpec([8, 8])
    for seed in JOB.get("seeds", [0]):
        keras.utils.set_random_seed(seed)
        inp = keras.Input((8,), name="x")
        h = Gated(name="gated")(keras.layers.Dense(8, name="dense_in")(inp))
        model = keras.Model(inp, keras.layers.Dense(4, name="dense_out")(h))
        plan = parallel.random_plan(capturing.capture(model, spec, training=False), N, seed)
        pm = parallel.parallelize(model, spec, plan, devices=N, loss=MSE, training=False)
        out[f"random:{seed}"] = verified(pm, x, y, steps=2)
    return out


def check_tfm_fnet() -> dict[str, Any]:
    """The Model Garden's FNet (Fourier mixing in complex numbers) under random plans,
    verified in inference mode: plans that split its complex activations."""
    from tapas.models import corpus
    entry = corpus.get("tfm-fnet")
    model, specs = entry.build()
    x, y = entry.synthetic_batch(model, specs)
    out = {}
    for seed in JOB.get("seeds", [0])[:1]:   # one plan: the suite's time
        plan = parallel.random_plan(capturing.capture(model, specs, training=False), N, seed)
        pm = parallel.parallelize(model, specs, plan, devices=N, loss=MSE, training=False)
        got = verified(pm, x, y, steps=2)
        got["complex_split"] = sum(
            1 for node in pm.graph.nodes for op in node.ops for t in op.outputs
            if t.dtype.startswith("complex") and str(pm.program.plan.pattern(node).tensors.get(
                t.name, "R")).startswith("S"))
        out[f"random:{seed}"] = got
    return out


CHECKS = {"mlp": check_mlp, "cond_weights": check_cond_weights, "tfm_fnet": check_tfm_fnet, "bert": check_bert, "save": check_save, "resume": check_resume,
          "keras2_dropout": check_keras2_dropout, "hf_bert": check_hf_bert}

if __name__ == "__main__":
    run_checks(CHECKS, JOB["checks"])
    finish()
