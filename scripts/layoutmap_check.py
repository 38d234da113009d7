"""Check that an exported Keras LayoutMap is what runs: TAPAS's plan under Keras 3's
``ModelParallel`` on the JAX backend, against one device, ``DataParallel`` and the
collectives TAPAS predicts.

Two phases, two virtual environments (the JAX one is optional, never a dependency of tapas):

  # 1. TensorFlow venv: capture, search (one V100 node of 8, training-mode graph, the loss
  #    priced) and export every model's layout (weights and, --outputs=all|split|none,
  #    layer outputs) to out/layoutmap/NAME.json
  python scripts/layoutmap_check.py export
  # 2. JAX venv (scripts/baselines/setup.sh, plus `pip install keras-hub==0.32.0`), 8 CPU
  #    devices: train 3 steps on one device, under the exported layout and under
  #    DataParallel; compare losses (rtol 1e-5), the variables' shardings, the compiled train
  #    step's collectives with the prediction; time the steps; write
  #    benchmarks/results/layoutmap_check.json
  .venv-xla/bin/python scripts/layoutmap_check.py check

``scripts/layoutmap_check.sh`` runs both. Models: the zoo's t5-small and bert-base widths at
2 layers, sequence 64, vocabulary 8192 (the presets' depth and vocabulary cut so that a step
runs in seconds on CPU), and keras-hub's BERT, GPT-2 and Llama backbones built from configs
of the same widths (random weights, nothing downloaded), batch 8.

XLA's automatic sharding is not run here: on the CPU backend jax accepts AUTO shardings but
does not run the pass (every input comes back replicated, /work/shared/BASELINES.md), and on
the described TPU topology it compiles but nothing executes, so it has no step time on
these devices (docs/export.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, SEQ, VOCAB, DEVICES = 8, 64, 8192, 8
MODELS = ("t5-small-2l", "bert-base-2l", "hub-bert", "hub-gpt2", "hub-llama")
CLUSTER = "v100"
RTOL = 1e-5


# ---- the models (either backend) --------------------------------------------------------

def _zoo(name: str) -> tuple[Any, Any, Any]:
    """(model, inputs list, targets, loss) of a zoo preset's widths cut to 2 layers."""
    import models
    if name == "t5-small-2l":
        entry = models.get("t5-small")
        config = dataclasses.replace(entry.config, num_layers=2, num_decoder_layers=2,
                                     encoder_seq_len=SEQ, decoder_seq_len=SEQ,
                                     vocab_size=VOCAB)
    else:
        entry = models.get("bert-base")
        config = dataclasses.replace(entry.config, num_layers=2, seq_len=SEQ, vocab_size=VOCAB)
    entry = dataclasses.replace(entry, name=name, config=config, default_batch_size=BATCH)
    model = entry.build(seed=0)
    inputs, targets = entry.synthetic_batch(BATCH, seed=1)
    return model, list(inputs), targets, entry.keras_loss(), list(entry.input_spec(BATCH))


def _hub(name: str) -> tuple[Any, ...]:
    import keras
    import keras_hub
    import numpy as np
    m = keras_hub.models
    text = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=512, intermediate_dim=2048)
    builders = {
        "hub-bert": lambda: m.BertBackbone(num_heads=8, max_sequence_length=SEQ, **text),
        "hub-gpt2": lambda: m.GPT2Backbone(num_heads=8, max_sequence_length=SEQ, **text),
        "hub-llama": lambda: m.LlamaBackbone(num_query_heads=8, num_key_value_heads=4,
                                             **dict(text, intermediate_dim=1408)),
    }
    keras.utils.set_random_seed(0)
    backbone = builders[name]()
    # the sequence output alone: one loss (mean squared error against random targets)
    model = keras.Model(backbone.input, backbone.output["sequence_output"]
                        if isinstance(backbone.output, dict) else backbone.output)
    rng = np.random.default_rng(1)
    inputs = {}
    for i in backbone.inputs:
        key = i.name.split(":")[0]
        if "mask" in key:
            inputs[key] = np.ones((BATCH, SEQ), "int32")
        elif "segment" in key:
            inputs[key] = np.zeros((BATCH, SEQ), "int32")
        else:
            inputs[key] = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
    targets = rng.standard_normal((BATCH, SEQ, 512)).astype("float32")
    specs = {k: (v.shape, str(v.dtype)) for k, v in inputs.items()}
    return model, inputs, targets, keras.losses.MeanSquaredError(), specs


def build(name: str) -> tuple[Any, ...]:
    """(model, inputs, targets, loss, specs) of ``name``. Call ``keras.backend.clear_session``
    before each build (outside a distribution's scope: it clears the distribution too), so
    that auto-generated layer names, hence weight paths, are the same in every build."""
    return _zoo(name) if name in ("t5-small-2l", "bert-base-2l") else _hub(name)


# ---- phase 1: export (TensorFlow backend) -----------------------------------------------

def export(names: list[str], out_dir: str, outputs: str = "all") -> None:
    import tensorflow as tf

    from tapas import capturing
    from tapas.export import export_layout
    from tapas.planning.cluster import Cluster
    from tapas.planning.cost import CostOptions
    from tapas.planning.search import search
    from tapas.sharding.losses import LossSpec
    os.makedirs(out_dir, exist_ok=True)
    cluster = Cluster.resolve(CLUSTER, 1, DEVICES)
    import keras
    for name in names:
        keras.backend.clear_session()
        model, _, _, loss, specs = build(name)
        if isinstance(specs, dict):
            specs = {k: tf.TensorSpec(s, d, name=k) for k, (s, d) in specs.items()}
        start = time.perf_counter()
        graph = capturing.capture(model, specs, training=True, name=name)
        strategy = search(graph, cluster=cluster, loss=loss)
        options = CostOptions.for_cluster(cluster, loss=LossSpec.of(loss))
        layout = export_layout(strategy, graph, options=options, layers=model,
                               outputs=outputs)
        layout.save(os.path.join(out_dir, f"{name}.json"))
        strategy.save(os.path.join(out_dir, f"{name}.strategy.json"))
        print(f"{name}: {len(graph.nodes)} GraphNodes, {len(layout.layouts)} weights split, "
              f"{len(layout.outputs)} layer outputs pinned, "
              f"{len(layout.replicated)} replicated, {len(layout.unexpressed)} pattern "
              f"group(s) unpinned, {time.perf_counter() - start:.1f} s", flush=True)


# ---- phase 2: check (JAX backend) ---------------------------------------------------------

_HLO_OP = re.compile(r"=\s*(\([^()]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                     r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                     r"(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1,
          "f64": 8, "s64": 8, "u64": 8}
_KIND = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return DEVICES


def hlo_collectives(text: str) -> list[dict[str, Any]]:
    """Every collective of a compiled HLO module's text: kind (TAPAS's short name, CP for a
    collective-permute), bytes as TAPAS counts them (the global tensor: an all-reduce's or
    all-gather's result, a reduce-scatter's or all-to-all's result times the group), the
    group size. A tuple-shaped all-reduce, all-gather or reduce-scatter (collectives XLA
    combined) counts once per element; a tuple-shaped all-to-all is one collective whose
    buffer is split in one piece per peer (the CPU backend's form), its elements summed."""
    out = []
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if m is None:
            continue
        kind, group = _KIND[m.group(2)], _group_size(line)
        sizes = []
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            sizes.append(n * _BYTES.get(dtype, 4))
        if kind == "A2A":
            sizes = [sum(sizes)]
        for nbytes in sizes:
            out.append({"kind": kind, "bytes": nbytes * group if kind in ("RS", "A2A")
                        else nbytes, "group": group})
    return out


def compare(ran: list[dict[str, Any]], predicted: list[dict[str, Any]],
            cluster: Any) -> dict[str, Any]:
    """The compiled program's collectives against the prediction, as multisets of (kind,
    bytes): matched, and each difference with its cost under the cost model."""
    from tapas.planning.cost import collective_cost
    got = Counter((r["kind"], r["bytes"]) for r in ran)
    want: Counter = Counter()
    for p in predicted:
        want[(p["kind"], p["bytes"])] += p["count"]
    diffs = []
    for key in sorted(set(got) | set(want)):
        if got[key] == want[key]:
            continue
        kind, nbytes = key
        price = (0.0 if kind == "CP" else
                 collective_cost(kind if kind != "A2A" else "A2A", nbytes if kind != "A2A"
                                 else nbytes // DEVICES, DEVICES, cluster).total)
        diffs.append({"kind": kind, "bytes": nbytes, "compiled": got[key],
                      "predicted": want[key],
                      "seconds": (got[key] - want[key]) * price})
    matched = sum(min(got[k], want[k]) for k in got)
    return {"compiled": sum(got.values()), "predicted": sum(want.values()),
            "matched": matched, "differences": diffs,
            "difference_seconds": sum(d["seconds"] for d in diffs)}


def _train(model: Any, inputs: Any, targets: Any, loss: Any, steps: int, timed: int
           ) -> tuple[list[float], float]:
    import keras
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    losses = [float(model.train_on_batch(inputs, targets)) for _ in range(steps)]
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        model.train_on_batch(inputs, targets)
        times.append(time.perf_counter() - start)
    return losses, statistics.median(times)


def _compiled_step(model: Any, inputs: Any, targets: Any) -> str:
    """The HLO text of the train step Keras compiled for ``model`` (its jitted
    ``train_step``, lowered with the model's current state and the distributed batch)."""
    import keras.src.backend.jax.trainer as trainer
    model.jax_state_sync()
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True,
                                 purge_model_variables=False)
    data = trainer._distribute_data((inputs, targets, None))
    return _JITTED[-1].lower(state, data).compile().as_text()


_JITTED: list[Any] = []


def _record_jit() -> None:
    """Keep every function Keras's JAX trainer jits (to lower its train step again)."""
    import keras.src.backend.jax.trainer as trainer
    original = trainer.jit

    def recording(fn: Any, *args: Any, **kwargs: Any) -> Any:
        jitted = original(fn, *args, **kwargs)
        _JITTED.append(jitted)
        return jitted
    trainer.jit = recording


def _sharding_mismatches(model: Any, layout: Any) -> list[str]:
    """Variables whose placed sharding is not the layout's (or that are split without one)."""
    from tapas.export import key_matches
    matches = key_matches(layout.layouts, [v.path for v in model.weights])
    bad = []
    for v in model.weights:
        keys = matches[v.path]
        want = tuple(layout.layouts[keys[0]]) if len(keys) == 1 else (None,) * len(v.shape)
        # (a variable Keras leaves on one device, e.g. a seed state, has no spec: unsplit)
        spec = tuple(getattr(v.value.sharding, "spec", ()))
        spec += (None,) * (len(v.shape) - len(spec))
        if len(keys) > 1 or spec != want:
            bad.append(f"{v.path}: placed {spec}, layout {want} (keys {keys})")
    return bad


def _check_model(name: str, layout: Any, cluster: Any, steps: int, timed: int
                 ) -> dict[str, Any]:
    import jax
    import keras
    keras.backend.clear_session()
    model, inputs, targets, loss, _ = build(name)
    weights = model.get_weights()
    single, t_single = _train(model, inputs, targets, loss, steps, timed)
    row: dict[str, Any] = {"model": name, "params": model.count_params(),
                           "weights_split": len(layout.layouts),
                           "weights_replicated": len(layout.replicated),
                           "outputs_pinned": len(layout.outputs),
                           "outputs_split": sum(any(a is not None for a in axes)
                                                for axes in layout.outputs.values())}
    unknown = [p for p in layout.weights if p not in {v.path for v in model.weights}]
    row["layout_paths_missing_from_model"] = unknown
    runs = {"layoutmap": keras.distribution.ModelParallel(
        layout_map=layout.to_keras(jax.devices()), batch_dim_name="batch"),
        "data_parallel": keras.distribution.DataParallel(devices=jax.devices())}
    row["losses"] = {"single": single}
    row["step_seconds"] = {"single": t_single}
    for label, distribution in runs.items():
        keras.backend.clear_session()
        with distribution.scope():
            model, inputs, targets, loss, _ = build(name)
            model.set_weights(weights)
            if label == "layoutmap":
                row["sharding_mismatches"] = _sharding_mismatches(model, layout)
            losses, seconds = _train(model, inputs, targets, loss, steps, timed)
            if label == "layoutmap":
                hlo = _compiled_step(model, inputs, targets)
        row["losses"][label] = losses
        row["step_seconds"][label] = seconds
        row[f"{label}_max_rel_loss_diff"] = max(abs(a - b) / abs(b)
                                                for a, b in zip(losses, single))
        row[f"{label}_losses_equal"] = all(abs(a - b) <= RTOL * abs(b)
                                           for a, b in zip(losses, single))
    row["collectives"] = compare(hlo_collectives(hlo), list(layout.predicted), cluster)
    s = row["step_seconds"]
    row["ratio_layoutmap_over_data_parallel"] = s["layoutmap"] / s["data_parallel"]
    row["ratio_layoutmap_over_single"] = s["layoutmap"] / s["single"]
    row["cost_model"] = dict(layout.cost)
    row["unexpressed"] = [u.to_json() for u in layout.unexpressed]
    return row


def check(names: list[str], out_dir: str, result: str, steps: int, timed: int) -> None:
    import jax
    import keras

    from tapas.export import load_layout
    from tapas.planning.cluster import Cluster
    if keras.backend.backend() != "jax" or len(jax.devices()) < DEVICES:
        raise SystemExit(f"check needs KERAS_BACKEND=jax and {DEVICES} devices (got "
                         f"{keras.backend.backend()}, {len(jax.devices())}): run it in the JAX "
                         "venv, as scripts/layoutmap_check.sh does")
    _record_jit()
    cluster = Cluster.resolve(CLUSTER, 1, DEVICES)
    rows = []
    for name in names:
        start = time.perf_counter()
        row = _check_model(name, load_layout(os.path.join(out_dir, f"{name}.json")), cluster,
                           steps, timed)
        row["check_seconds"] = time.perf_counter() - start
        rows.append(row)
        c = row["collectives"]
        print(f"{name}: losses equal {row['layoutmap_losses_equal']} (max rel "
              f"{row['layoutmap_max_rel_loss_diff']:.2e}), shardings off "
              f"{len(row['sharding_mismatches'])}, collectives compiled {c['compiled']} "
              f"predicted {c['predicted']} matched {c['matched']} (difference "
              f"{c['difference_seconds'] * 1e3:+.3f} ms), step layoutmap "
              f"{row['step_seconds']['layoutmap'] * 1e3:.1f} ms, data parallel "
              f"{row['step_seconds']['data_parallel'] * 1e3:.1f} ms, one device "
              f"{row['step_seconds']['single'] * 1e3:.1f} ms", flush=True)
    _table(rows)
    with open(result, "w") as f:
        json.dump({"jax": jax.__version__, "keras": keras.__version__, "batch": BATCH,
                   "seq": SEQ, "vocab": VOCAB, "devices": DEVICES, "cluster": CLUSTER,
                   "steps": steps, "timed_steps": timed, "rtol": RTOL, "models": rows},
                  f, indent=1)
    print(f"written {result}")


def _table(rows: list[dict[str, Any]]) -> None:
    print("| model | split / replicated | losses equal (max rel) | collectives compiled / "
          "predicted / matched | layoutmap ms | DataParallel ms | one device ms | "
          "layoutmap / DP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, s = r["collectives"], r["step_seconds"]
        print(f"| {r['model']} | {r['weights_split']} / {r['weights_replicated']} | "
              f"{r['layoutmap_losses_equal']} ({r['layoutmap_max_rel_loss_diff']:.1e}) | "
              f"{c['compiled']} / {c['predicted']} / {c['matched']} | "
              f"{s['layoutmap'] * 1e3:.0f} | {s['data_parallel'] * 1e3:.0f} | "
              f"{s['single'] * 1e3:.0f} | {r['ratio_layoutmap_over_data_parallel']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["export", "check"])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out_dir", default=os.path.join(ROOT, "out", "layoutmap"))
    parser.add_argument("--result", default=os.path.join(ROOT, "benchmarks", "results",
                                                         "layoutmap_check.json"))
    parser.add_argument("--outputs", default="all", choices=["all", "split", "none"],
                        help="layer outputs to pin (export): all, the split ones, none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timed", type=int, default=5)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    if args.phase == "export":
        export(names, args.out_dir, args.outputs)
    else:
        check(names, args.out_dir, args.result, args.steps, args.timed)


if __name__ == "__main__":
    main()
