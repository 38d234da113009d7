"""Reproduce the paper's Figure 7: training throughput of the plans TAPAS finds, against data
parallelism, Megatron and a ZeRO-2-style sharded optimizer.

    python scripts/figure7_throughput.py [--models=resnet50-1k,...,moe-1.3b] [--devices=8]
        [--measure=t5-tiny,moe-tiny,resnet-tiny] [--measure_devices=4] [--steps=5]
        [--repeats=3] [--cluster=benchmarks/results/cluster_cpu4.json] [--xla_json=FILE]
        [--json_out=out/figure7_throughput.json] [--png_out=out/figure7_throughput.png]

**Predicted** (no GPUs here), for each model on one node of ``--devices`` V100s
(``Cluster.v100_ethernet``): the cost model's step time and the throughput in TFLOPS (the
model's training FLOPs per step, forward FLOPs of every GraphNode times 3, over the step
time, for the whole node) of

* ``TAPAS``: the searched plan;
* ``data-parallel``, ``megatron`` (transformers), ``expert`` (MoE): the reference plans of
  the same search (``tapas.planning.references``);
* ``XLA`` (with ``--xla_json``): XLA's automatic sharding of the same preset (compiled for 8
  TPU v5e chips by ``scripts/baselines/xla_autoshard.py``), its parameter shardings costed
  by this cost model: the cheapest plan with every parameter placed as XLA placed it
  (``tapas.planning.search.plan_with_weights``); parameters that no 1-D TAPAS placement
  describes (XLA splitting one on two axes) are left to the search and counted;
* ``zero-2`` (ResNet, MoE, as the paper): data parallelism whose gradient all-reduce of each
  weight becomes a reduce-scatter (backward, overlapped: gamma) and an all-gather of the
  updated parameters (not overlapped), optimizer state and gradients sharded N ways. It is
  priced by the cost model from the data-parallel plan's weights; the runtime does not run
  it (so it has no measured row).

**Measured** (here, ``--measure`` presets on ``--measure_devices`` logical CPU devices): the
median ``train_step`` time of the same kinds of plans (TAPAS, data-parallel, megatron or
expert where they apply), next to the cost model's prediction on the profiled CPU cluster
(``--cluster``), and whether the predicted order of the plans is the measured order (ties:
measured times within ``--tie_tol`` of each other). Prints both tables, writes JSON and a
PNG (predicted TFLOPS per plan and model; measured against predicted step time).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks"))

from absl import app, flags, logging  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)

flags.DEFINE_list("models", ["resnet50-1k", "resnet50-10k", "resnet50-100k", "t5-small",
                             "t5-base", "t5-large", "moe-380m", "moe-1.3b"],
                  "Zoo presets, costed on one V100 node.")
flags.DEFINE_integer("devices", 8, "V100s in the node (the paper: 8).")
flags.DEFINE_list("measure", ["t5-tiny", "moe-tiny", "resnet-tiny"],
                  "Small presets whose plans are run here (empty: none).")
flags.DEFINE_integer("measure_devices", 4, "Logical CPU devices for the measured part.")
flags.DEFINE_integer("batch_size", 8, "Global batch of the measured part.")
flags.DEFINE_integer("steps", 5, "Timed steps per round (measured part).")
flags.DEFINE_integer("repeats", 3, "Rounds of timed steps (measured part).")
flags.DEFINE_float("tie_tol", 0.05, "Relative difference under which measured times tie.")
flags.DEFINE_string("cluster", "benchmarks/results/cluster_cpu4.json",
                    "Cluster file of the logical CPU devices (tapas profile) for the "
                    "measured part's predictions.")
flags.DEFINE_string("xla_json", None, "A JSON of XLA's auto-sharding on the same presets "
                    "(`.venv-xla/bin/python scripts/baselines/xla_autoshard.py --models=... "
                    "--devices=8 --json_out=FILE`): its parameter shardings are costed by the "
                    "cost model as the column XLA (plan_with_weights).")
flags.DEFINE_string("json_out", "out/figure7_throughput.json", "Where to write the JSON.")
flags.DEFINE_string("png_out", "out/figure7_throughput.png", "Where to write the plot.")
FLAGS = flags.FLAGS

REFERENCES = ("data-parallel", "megatron", "expert")


def training_flops(strategy) -> float:
    """Forward FLOPs of the whole model (each GraphNode's replicated pattern) times 3."""
    table = strategy._table
    total = 0.0
    for infos in table.infos:
        whole = [i for i in infos if i.name == "replicate"]
        total += (whole[0] if whole else max(infos, key=lambda i: i.flops)).flops
    return 3.0 * total


def zero2(graph, strategy, cluster) -> dict:
    """The ZeRO-2-style plan priced from the data-parallel reference (module docstring)."""
    from tapas.ir import dtype_bytes
    from tapas.planning.cost import CostOptions, collective_cost
    dp = next((a for a in strategy.references if a.name == "data-parallel" and not a.error),
              None)
    if dp is None:
        return {"error": "no data-parallel reference plan"}
    opts = CostOptions.for_cluster(cluster)
    n = cluster.num_devices
    saved = added = 0.0
    grads = optimizer = 0.0
    for w in graph.weights:
        if not w.trainable:
            continue
        nbytes = w.num_elements * dtype_bytes(w.dtype)
        saved += collective_cost("AR", nbytes, cluster.axis(n), opts, backward=True).total
        added += (collective_cost("RS", nbytes, cluster.axis(n), opts, backward=True).total
                  + collective_cost("AG", nbytes, cluster.axis(n), opts, backward=False).total)
        grads += nbytes
        optimizer += 2 * nbytes          # Adam: two moments
    comm = dp.communication - saved + added
    return {"cost": dp.compute + comm, "communication": comm, "compute": dp.compute,
            "memory": dp.memory - (grads + optimizer) * (1 - 1 / n)}


def _xla_module():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines",
                        "xla_autoshard.py")
    spec = importlib.util.spec_from_file_location("xla_autoshard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def xla_rows(path: str | None) -> dict:
    """The rows of an xla_autoshard.py JSON that carry parameter shardings, by model."""
    if not path:
        return {}
    import json
    with open(path) as f:
        rows = json.load(f).get("results", [])
    return {r["model"]: r for r in rows if r.get("weight_shardings")}


def xla_plan(graph, row: dict, cluster) -> dict:
    """XLA's parameter shardings costed by the cost model: the cheapest plan with every
    parameter placed as XLA placed it (the rest of the plan, activations and unweighted
    GraphNodes, the search's), and the parameters no TAPAS pattern places that way."""
    from tapas.planning.search import plan_with_weights
    placements, unmapped = _xla_module().tapas_placements(row["weight_shardings"],
                                                          cluster.num_devices)
    # es: XLA places each layer on its own (gp would give a repeated layer its template's)
    r = plan_with_weights(graph, placements, cluster=cluster, mode="es")
    unmapped.update(r.unmapped)
    return {"cost": r.cost.total, "communication": r.cost.communication,
            "compute": r.cost.compute, "memory": r.cost.memory.total,
            "weights": len(row["weight_shardings"]),
            "weights_split": sum(1 for p in placements.values() if p != "R"),
            "unmapped": unmapped}


def predicted(name: str, xla: dict | None = None) -> dict:
    import tapas
    from tapas import models
    from tapas.planning.cluster import Cluster
    from tapas.planning.search import search
    entry = models.get(name)
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec()), name=name)
    cluster = Cluster.v100_ethernet(1, FLAGS.devices)
    s = search(graph, cluster=cluster)
    flops = training_flops(s)
    plans = {"TAPAS": {"cost": s.total_cost, "communication": float(s.cost["communication"]),
                       "compute": float(s.cost["compute"]), "memory": float(s.memory.total)}}
    for alt in s.references:
        if alt.name in REFERENCES and not alt.error:
            plans[alt.name] = {"cost": alt.cost, "communication": alt.communication,
                               "compute": alt.compute, "memory": alt.memory}
    if name.startswith(("resnet", "moe")):
        plans["zero-2"] = zero2(graph, s, cluster)
    if xla and name in xla:
        plans["XLA"] = xla_plan(graph, xla[name], cluster)
    for p in plans.values():
        if "cost" in p:
            p["tflops"] = flops / p["cost"] / 1e12 if p["cost"] > 0 else 0.0
    line = ", ".join(f"{k} {v['cost'] * 1e3:.1f} ms ({v['tflops']:.1f} TFLOPS)"
                     for k, v in plans.items() if "cost" in v)
    print(f"  {name}: {line}", flush=True)
    return {"model": name, "batch": int(list(entry.input_spec())[0].shape[0]),
            "training_flops": flops, "plans": plans}


def measured(name: str, strategy) -> dict:
    """The TAPAS plan and the references that apply, run here and predicted on --cluster."""
    from tapas import capturing, models
    from tapas.planning.cluster import Cluster
    from tapas.planning.search import search
    entry = models.get(name)
    model = entry.build(seed=0)
    graph = capturing.capture(model, list(entry.input_spec(FLAGS.batch_size)))
    cluster = Cluster.load(FLAGS.cluster)
    n = FLAGS.measure_devices
    if cluster.num_devices != n:
        cluster = cluster.with_shape(1, n)
    s = search(graph, cluster=cluster)
    plans = {"TAPAS": (tuple(s.patterns), s.total_cost)}
    for alt in s.references:
        if alt.name in REFERENCES and not alt.error:
            pats = tuple(alt.changes.get(v, p) for v, p in enumerate(s.patterns))
            plans[alt.name] = (pats, alt.cost)
    rows = {}
    for label, (pats, cost) in plans.items():
        t = report.timed_plan(model, entry, graph, pats, strategy, FLAGS.batch_size,
                              FLAGS.steps, FLAGS.repeats)
        rows[label] = {"predicted_s": cost, "measured_s": t["median_s"], "iqr_s": t["iqr_s"],
                       "same_as": [k for k, (p, _) in plans.items() if p == pats and k != label]}
    labels = list(rows)
    # pairs the cost model orders as measured (a measured tie within --tie_tol agrees either way)
    agree = total = 0
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            ma, mb = rows[a]["measured_s"], rows[b]["measured_s"]
            pa, pb = rows[a]["predicted_s"], rows[b]["predicted_s"]
            total += 1
            tie = abs(ma - mb) <= FLAGS.tie_tol * min(ma, mb)
            agree += tie or (ma < mb) == (pa < pb)
    best_measured = min(rows, key=lambda k: rows[k]["measured_s"])
    best_predicted = min(rows, key=lambda k: rows[k]["predicted_s"])
    line = ", ".join(f"{k} {v['measured_s'] * 1e3:.1f} ms (pred {v['predicted_s'] * 1e3:.2f})"
                     for k, v in rows.items())
    print(f"  {name}: {line}; pairs in the measured order {agree}/{total}", flush=True)
    return {"model": name, "devices": n, "batch": FLAGS.batch_size, "plans": rows,
            "pairs_agree": agree, "pairs": total, "best_measured": best_measured,
            "best_predicted": best_predicted,
            "best_within_tie": rows[best_predicted]["measured_s"]
            <= (1 + FLAGS.tie_tol) * rows[best_measured]["measured_s"]}


def plot(pred: list[dict], meas: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    kinds = ["data-parallel", "megatron", "expert", "zero-2", "XLA", "TAPAS"]
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        xs = [i + k * width for i, r in enumerate(pred) if "cost" in r["plans"].get(kind, {})]
        ys = [r["plans"][kind]["tflops"] for r in pred if "cost" in r["plans"].get(kind, {})]
        if xs:
            ax.bar(xs, ys, width, label=kind)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(pred))])
    ax.set_xticklabels([r["model"] for r in pred], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"predicted TFLOPS ({FLAGS.devices} V100s)")
    ax.set_title("Predicted throughput (cost model)")
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    for r in meas:
        xs = [v["predicted_s"] * 1e3 for v in r["plans"].values()]
        ys = [v["measured_s"] * 1e3 for v in r["plans"].values()]
        ax2.plot(xs, ys, "o", label=r["model"])
        for (label, v), x, y in zip(r["plans"].items(), xs, ys):
            ax2.annotate(label, (x, y), fontsize=6)
    ax2.set_xlabel("predicted step time on the profiled CPU cluster (ms)")
    ax2.set_ylabel("measured median step time (ms)")
    ax2.set_title(f"Measured here ({FLAGS.measure_devices} logical CPU devices)")
    if meas:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.measure:   # logical devices are fixed before TensorFlow's first op
        from tapas.execution.runtime import devices
        devices.setup_devices(FLAGS.measure_devices, "cpu")
    print(f"Figure 7: throughput of the plans, predicted on one node of {FLAGS.devices} "
          "V100s (cost model; no GPUs here)")
    xla = xla_rows(FLAGS.xla_json)
    pred = [predicted(name, xla) for name in FLAGS.models]
    meas = []
    if FLAGS.measure:
        strategy = devices.make_strategy(FLAGS.measure_devices)
        print(f"\nmeasured here: {FLAGS.measure_devices} logical CPU devices, batch "
              f"{FLAGS.batch_size}, median of {FLAGS.steps * FLAGS.repeats} steps")
        meas = [measured(name, strategy) for name in FLAGS.measure]
    kinds = ["TAPAS", "data-parallel", "megatron", "expert", "zero-2"] + (["XLA"] if xla else [])
    print(f"\npredicted TFLOPS on {FLAGS.devices} V100s (step ms):")
    print(f"{'model':<15}" + "".join(f"{k:>20}" for k in kinds))
    for r in pred:
        cells = []
        for k in kinds:
            p = r["plans"].get(k, {})
            cells.append(f"{p['tflops']:>9.1f} ({p['cost'] * 1e3:>7.1f})" if "cost" in p
                         else f"{'-':>20}")
        print(f"{r['model']:<15}" + "".join(f"{c:>20}" for c in cells))
    if meas:
        print("\nmeasured here (median step ms; predicted on the profiled CPU cluster):")
        for r in meas:
            cells = ", ".join(f"{k} {v['measured_s'] * 1e3:.1f} (pred {v['predicted_s'] * 1e3:.2f})"
                              for k, v in r["plans"].items())
            print(f"  {r['model']:<12} {cells}; predicted order holds for {r['pairs_agree']}/"
                  f"{r['pairs']} pairs; best predicted {r['best_predicted']}, best measured "
                  f"{r['best_measured']}" + (" (within the tie tolerance)"
                                            if r["best_within_tie"] else ""))
    for r in pred:
        x = r["plans"].get("XLA")
        if x:
            print(f"  XLA on {r['model']}: {x['weights_split']} of {x['weights']} parameters "
                  f"split, {len(x['unmapped'])} not placeable as XLA placed them (left to "
                  "the search)")
    print("Paper (Figure 7, 8 V100s): TAPAS's plans match or beat Megatron on T5, DP and "
          "ZeRO-2 on ResNet and MoE as they grow (TFLOPS).")
    out = {"figure": "TAPAS Figure 7", "predicted_devices": FLAGS.devices,
           "machine": report.machine(), "predicted": pred, "measured": meas,
           "tie_tol": FLAGS.tie_tol}
    if FLAGS.json_out:
        report.write_json(FLAGS.json_out, out)
    if FLAGS.png_out:
        plot(pred, meas, FLAGS.png_out)
        print(f"plot written to {FLAGS.png_out}")


if __name__ == "__main__":
    app.run(main)
