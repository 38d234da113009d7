"""Check that an exported Keras LayoutMap is what runs: TAPAS's plan under Keras 3's
``ModelParallel`` on the JAX backend, against one device, ``DataParallel`` and the
collectives TAPAS predicts.

Two phases, two virtual environments (the JAX one is optional, never a dependency of tapas):

  # 1. TensorFlow venv: capture, search (one V100 node of 8, training-mode graph, the loss
  #    priced) and export every model's layout (weights and, --outputs=all|split|none,
  #    layer outputs) to out/layoutmap/NAME.json
  python scripts/layoutmap_check.py export
  # 2. JAX venv (scripts/baselines/setup.sh, plus `pip install keras-hub==0.32.0`): XLA's
  #    automatic sharding solved for a described TPU topology of 8 chips
  #    (scripts/layoutmap_autoshard.py: out/layoutmap/NAME.auto.json)
  .venv-xla/bin/python scripts/layoutmap_autoshard.py
  # 3. JAX venv, 8 CPU devices: train 3 steps on one device, under the exported layout,
  #    under DataParallel and under XLA auto-sharding's layouts; compare losses (rtol 1e-5),
  #    the variables' shardings, the compiled train step's collectives with the prediction;
  #    time the plans in interleaved rounds (one step of each per round); write
  #    benchmarks/results/layoutmap_check.json
  .venv-xla/bin/python scripts/layoutmap_check.py check

``scripts/layoutmap_check.sh`` runs all three. Models: the zoo's t5-small and bert-base widths at
2 layers, sequence 64, vocabulary 8192 (the presets' depth and vocabulary cut so that a step
runs in seconds on CPU), and keras-hub's BERT, GPT-2 and Llama backbones built from configs
of the same widths (random weights, nothing downloaded), batch 8.

XLA's automatic sharding does not run on the CPU backend (jax accepts AUTO shardings there
and returns them replicated, /work/shared/BASELINES.md), so its plan here is the weight and
input layouts the pass chose for the TPU topology, laid out on the CPU devices with Keras's
``ModelParallel`` (scripts/layoutmap_autoshard.py); GSPMD propagates everything else.
A model without a solve file runs without that plan.
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
                                 else nbytes // DEVICES, cluster.axis(DEVICES)).total)
        diffs.append({"kind": kind, "bytes": nbytes, "compiled": got[key],
                      "predicted": want[key],
                      "seconds": (got[key] - want[key]) * price})
    matched = sum(min(got[k], want[k]) for k in got)
    return {"compiled": sum(got.values()), "predicted": sum(want.values()),
            "matched": matched, "differences": diffs,
            "difference_seconds": sum(d["seconds"] for d in diffs)}


def _fit(model: Any, inputs: Any, targets: Any, loss: Any, steps: int) -> tuple[list[float], Any]:
    """Compile ``model`` (SGD 0.01), train ``steps`` steps; the losses and the function Keras
    jitted for its train step (to lower it again)."""
    import keras
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    before = len(_JITTED)
    losses = [float(model.train_on_batch(inputs, targets)) for _ in range(steps)]
    return losses, _JITTED[-1] if len(_JITTED) > before else None


def _compiled_step(model: Any, jitted: Any, inputs: Any, targets: Any) -> str:
    """The HLO text of the train step Keras compiled for ``model`` (its jitted
    ``train_step``, lowered with the model's current state and the distributed batch; call
    it in the model's distribution scope)."""
    import keras.src.backend.jax.trainer as trainer
    model.jax_state_sync()
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True,
                                 purge_model_variables=False)
    data = trainer._distribute_data((inputs, targets, None))
    return jitted.lower(state, data).compile().as_text()


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


def _auto_parallel(auto: Any, devices: Any) -> Any:
    """XLA auto-sharding's layouts (``layoutmap_autoshard.auto_layout``) as a Keras
    distribution: ``ModelParallel`` with its weights' LayoutMap, whose ``get_data_layout``
    gives each input the solver's layout (by shape) instead of a batch split."""
    import keras
    from layoutmap_autoshard import layout_export

    class AutoParallel(keras.distribution.ModelParallel):
        def get_data_layout(self, data_shape: Any) -> Any:
            axes = auto["data_layouts"].get(tuple(data_shape))
            if axes is None:
                raise ValueError(f"no XLA auto-sharding layout for an input of shape "
                                 f"{tuple(data_shape)} (solved: {list(auto['data_layouts'])})"
                                 ": re-run scripts/layoutmap_autoshard.py for this model")
            return keras.distribution.TensorLayout(axes, self.device_mesh)

    export = layout_export("auto", auto["solved"], len(devices))
    return export, AutoParallel(layout_map=export.to_keras(devices), batch_dim_name="batch")


def _plans(layout: Any, auto: Any) -> dict[str, tuple[Any, Any]]:
    """label -> (distribution or None for one device, the LayoutExport its weights follow)."""
    import jax
    import keras
    plans = {"single": (None, None),
             "layoutmap": (keras.distribution.ModelParallel(
                 layout_map=layout.to_keras(jax.devices()), batch_dim_name="batch"), layout),
             "data_parallel": (keras.distribution.DataParallel(devices=jax.devices()), None)}
    if auto is not None:
        export, distribution = _auto_parallel(auto, jax.devices())
        plans["xla_auto"] = (distribution, export)
    return plans


def _collective_summary(ran: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = Counter(r["kind"] for r in ran)
    return {"count": len(ran), "by_kind": dict(sorted(kinds.items())),
            "bytes": sum(r["bytes"] for r in ran)}


def _auto_row(auto: Any, hlo: str) -> dict[str, Any]:
    """What XLA auto-sharding chose and what its layouts compiled to, on the TPU topology
    (the solver's own program) and on the CPU devices (GSPMD's propagation from them)."""
    solved, cpu = auto["solved"], hlo_collectives(hlo)
    tpu = solved["tpu_collectives"]
    common = Counter((c["kind"], c["bytes"]) for c in cpu) & \
        Counter((c["kind"], c["bytes"]) for c in tpu)
    return {"weights_split": len(auto["layouts"]), "weights_replicated":
            len(auto["replicated"]), "data": {k: list(v) if v else None
                                              for k, v in auto["data"].items()},
            "unmapped": auto["unmapped"], "solve_compile_s": solved["compile_s"],
            "memory_budget": solved["memory_budget"], "topology": solved["topology"],
            "collectives_cpu": _collective_summary(cpu),
            "collectives_tpu": _collective_summary(tpu),
            "collectives_cpu_also_in_tpu": sum(common.values())}


def _time_rounds(models: dict[str, Any], plans: dict[str, Any], rounds: int
                 ) -> dict[str, list[float]]:
    """One train step of each plan per round, the plans interleaved (round-robin), so that
    the machine's load changes hit every plan alike: label -> seconds per round."""
    import contextlib

    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(rounds):
        for label, (model, inputs, targets) in models.items():
            distribution = plans[label][0]
            with distribution.scope() if distribution else contextlib.nullcontext():
                start = time.perf_counter()
                model.train_on_batch(inputs, targets)
                times[label].append(time.perf_counter() - start)
    return times


def _ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Median over rounds of each round's step-time ratio (exported over the others, XLA
    auto-sharding over DataParallel)."""
    pairs = [("layoutmap", "data_parallel"), ("layoutmap", "xla_auto"),
             ("xla_auto", "data_parallel"), ("layoutmap", "single")]
    return {f"{a}_over_{b}": statistics.median(x / y for x, y in zip(times[a], times[b]))
            for a, b in pairs if a in times and b in times}


def _check_model(name: str, layout: Any, auto: Any, cluster: Any, steps: int, rounds: int
                 ) -> dict[str, Any]:
    """One model's row: every plan built from the same weights, trained ``steps`` steps
    (losses against one device's), the exported and XLA-auto train steps compiled (their
    collectives), then timed in ``rounds`` interleaved rounds."""
    import contextlib

    import keras
    keras.backend.clear_session()
    weights = build(name)[0].get_weights()
    row: dict[str, Any] = {"model": name, "weights_split": len(layout.layouts),
                           "weights_replicated": len(layout.replicated),
                           "outputs_pinned": len(layout.outputs),
                           "outputs_split": sum(any(a is not None for a in axes)
                                                for axes in layout.outputs.values()),
                           "losses": {}, "sharding_mismatches": {}}
    plans, models, hlo = _plans(layout, auto), {}, {}
    for label, (distribution, export) in plans.items():
        keras.backend.clear_session()
        with distribution.scope() if distribution else contextlib.nullcontext():
            model, inputs, targets, loss, _ = build(name)
            model.set_weights(weights)
            if export is not None:
                row["sharding_mismatches"][label] = _sharding_mismatches(model, export)
            row["losses"][label], jitted = _fit(model, inputs, targets, loss, steps)
            if export is not None:
                hlo[label] = _compiled_step(model, jitted, inputs, targets)
        models[label] = (model, inputs, targets)
        row["params"] = model.count_params()
    single = row["losses"]["single"]
    for label, losses in row["losses"].items():
        row[f"{label}_max_rel_loss_diff"] = max(abs(a - b) / abs(b)
                                                for a, b in zip(losses, single))
        row[f"{label}_losses_equal"] = all(abs(a - b) <= RTOL * abs(b)
                                           for a, b in zip(losses, single))
    unknown = [p for p in layout.weights if p not in {v.path for v in model.weights}]
    row["layout_paths_missing_from_model"] = unknown
    row["collectives"] = compare(hlo_collectives(hlo["layoutmap"]), list(layout.predicted),
                                 cluster)
    if auto is not None:
        row["xla_auto"] = _auto_row(auto, hlo["xla_auto"])
    times = _time_rounds(models, plans, rounds)
    row["step_seconds_rounds"] = times
    row["step_seconds"] = {k: statistics.median(v) for k, v in times.items()}
    row["ratios"] = _ratios(times)
    row["cost_model"] = dict(layout.cost)
    row["unexpressed"] = [u.to_json() for u in layout.unexpressed]
    return row


def _load_auto(out_dir: str, name: str) -> Any:
    """The XLA auto-sharding solve of ``name`` laid out for Keras, or None when
    ``scripts/layoutmap_autoshard.py`` wrote none (then the row has no such column)."""
    from layoutmap_autoshard import auto_layout
    path = os.path.join(out_dir, f"{name}.auto.json")
    if not os.path.exists(path):
        print(f"{name}: no {path}: XLA auto-sharding left out (run "
              "scripts/layoutmap_autoshard.py)", flush=True)
        return None
    with open(path) as f:
        solved = json.load(f)
    return dict(auto_layout(solved, DEVICES), solved=solved)


def _print_row(row: dict[str, Any]) -> None:
    c, s, r = row["collectives"], row["step_seconds"], row["ratios"]
    auto = row.get("xla_auto")
    print(f"{row['model']}: losses equal {row['layoutmap_losses_equal']} (max rel "
          f"{row['layoutmap_max_rel_loss_diff']:.2e}), shardings off "
          f"{sum(map(len, row['sharding_mismatches'].values()))}, collectives compiled "
          f"{c['compiled']} predicted {c['predicted']} matched {c['matched']} (difference "
          f"{c['difference_seconds'] * 1e3:+.3f} ms); step s " + ", ".join(
              f"{k} {v:.2f}" for k, v in s.items()) + "; ratios " + ", ".join(
              f"{k} {v:.2f}" for k, v in r.items())
          + (f"; XLA auto: losses equal {row['xla_auto_losses_equal']}, "
             f"{auto['weights_split']} weights split, data {auto['data']}, collectives CPU "
             f"{auto['collectives_cpu']['count']} TPU {auto['collectives_tpu']['count']}"
             if auto else ""), flush=True)


def check(names: list[str], out_dir: str, result: str, steps: int, rounds: int) -> None:
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
        row = _check_model(name, load_layout(os.path.join(out_dir, f"{name}.json")),
                           _load_auto(out_dir, name), cluster, steps, rounds)
        row["check_seconds"] = time.perf_counter() - start
        rows.append(row)
        _print_row(row)
    _table(rows)
    previous = {}
    if os.path.exists(result):
        with open(result) as f:
            previous = json.load(f).get("other_runs", {})
    with open(result, "w") as f:
        json.dump({"jax": jax.__version__, "keras": keras.__version__, "batch": BATCH,
                   "seq": SEQ, "vocab": VOCAB, "devices": DEVICES, "cluster": CLUSTER,
                   "steps": steps, "rounds": rounds, "rtol": RTOL, "models": rows,
                   "other_runs": previous}, f, indent=1)
    print(f"written {result}")


def _table(rows: list[dict[str, Any]]) -> None:
    print("| model | losses equal: exported / XLA auto | collectives compiled / predicted / "
          "matched | XLA auto collectives CPU / TPU | step s: exported / DP / XLA auto / one "
          "device | exported / DP | exported / XLA auto | XLA auto / DP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, s, q, a = r["collectives"], r["step_seconds"], r["ratios"], r.get("xla_auto")
        print(f"| {r['model']} | {r['layoutmap_losses_equal']} / "
              f"{r.get('xla_auto_losses_equal', '-')} | {c['compiled']} / {c['predicted']} / "
              f"{c['matched']} | " + (f"{a['collectives_cpu']['count']} / "
                                      f"{a['collectives_tpu']['count']}" if a else "-")
              + " | " + " / ".join(f"{s[k]:.2f}" if k in s else "-" for k in
                                   ("layoutmap", "data_parallel", "xla_auto", "single"))
              + " | " + " | ".join(f"{q[k]:.2f}" if k in q else "-" for k in
                                   ("layoutmap_over_data_parallel", "layoutmap_over_xla_auto",
                                    "xla_auto_over_data_parallel")) + " |")


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
    parser.add_argument("--rounds", type=int, default=7,
                        help="timed rounds (check): one step of each plan per round")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    if args.phase == "export":
        export(names, args.out_dir, args.outputs)
    else:
        check(names, args.out_dir, args.result, args.steps, args.rounds)


if __name__ == "__main__":
    main()
