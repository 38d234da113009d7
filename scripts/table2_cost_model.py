"""The paper's Table 2: how well the cost model ranks strategies against measured step times.

    python scripts/table2_cost_model.py [--models=t5-tiny,resnet-tiny,moe-tiny] [--top_k=5]
        [--steps=10] [--repeats=3] [--cluster=benchmarks/results/cluster_cpu4.json]
        [--out=out/table2]

For each model, in one process with 4 logical CPU devices (``--devices``):

1. ``tapas.search`` on the profiled cluster (``--cluster``, a ``tapas profile`` file) with
   every cost term on returns the top ``--top_k`` plans and the reference plans
   (Megatron, FFN-only, MHA-only, expert, data parallel, replicate, those that apply);
   plans with identical patterns are merged.
2. Each distinct plan is reconstructed (``tapas.parallelize`` with a hand-made
   ``tapas.execution.plan.Plan``, inference graph as ``benchmarks/bench_train.py``) and its
   ``train_step`` timed ONCE: ``--repeats`` rounds of ``--steps`` steps after a warm-up step,
   the median of all steps and the interquartile range as the spread.
3. The same plans are re-costed (``tapas.planning.explore.plan_cost``, no rerun) under the
   ablation rows: baseline (constant filter, gradient overlap and collective efficiency
   off), +CF, +CF+GO, +CF+GO+EC, and beyond the paper +CF+GO+EC+WR (a weight read in two
   placements priced as the runtime reshards it), and ranked; ``tapas.planning.ranking`` scores the rank of the
   measured-best plan (measured ties within noise count for the model, predicted ties
   against it).

Prints the table beside the paper's, writes ``table2.json`` and one scatter PNG per row of
predicted against measured step time (the cost model's seconds are for the profiled
constants; a least-squares scale through the origin maps them onto measured seconds, and the
plot says the scale) with the y = x line.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from absl import app, flags, logging  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py: the timed training step)

flags.DEFINE_integer("devices", 4, "Logical CPU devices.")
flags.DEFINE_list("models", ["t5-tiny", "t5-tiny-tapas", "t5-tiny-masked", "t5-small",
                             "resnet-tiny", "moe-tiny", "moe-tiny-tapas"], "Zoo models.")
flags.DEFINE_integer("top_k", 5, "Top plans of the search to run (plus the reference plans).")
flags.DEFINE_integer("steps", 10, "Timed steps per round.")
flags.DEFINE_integer("repeats", 3, "Rounds of --steps timed steps per plan.")
flags.DEFINE_integer("batch_size", 8, "Global batch (divisible by --devices).")
flags.DEFINE_float("tie_tol", 0.05, "Relative tolerance under which measured times tie.")
flags.DEFINE_string("cluster", "benchmarks/results/cluster_cpu4.json",
                    "A cluster file written by `tapas profile`.")
flags.DEFINE_string("recost", None, "Re-cost the runs of an earlier table2.json (its plans, "
                    "measured medians and spreads) under every row of this script, without "
                    "measuring again (e.g. after a cost-model change); writes "
                    "table2_recost.json.")
flags.DEFINE_string("out", "out/table2", "Directory for table2.json and the PNGs.")
FLAGS = flags.FLAGS

PAPER = {"baseline": {"acc@1": 0.53, "mrr": 0.71}, "+CF+GO+EC": {"acc@1": 0.87, "acc@5": 1.0,
                                                                  "mrr": 0.92}}
ROWS = {"baseline": dict(constant_filter=False, gradient_overlap=False,
                         collective_efficiency=False),
        "+CF": dict(constant_filter=True, gradient_overlap=False, collective_efficiency=False),
        "+CF+GO": dict(constant_filter=True, gradient_overlap=True, collective_efficiency=False),
        "+CF+GO+EC": dict(constant_filter=True, gradient_overlap=True,
                          collective_efficiency=True),
        # beyond the paper: a weight read in two placements (a tied embedding) priced as
        # the runtime moves it (CostOptions.weight_reshards)
        "+CF+GO+EC+WR": dict(constant_filter=True, gradient_overlap=True,
                             collective_efficiency=True, weight_reshards=True),
        # ... and the training loss's collectives on the output's placement (the model's
        # Keras loss: CostOptions.loss, as `tapas search` and `tapas train` price it)
        "+CF+GO+EC+WR+L": dict(constant_filter=True, gradient_overlap=True,
                               collective_efficiency=True, weight_reshards=True, loss=True)}


def candidates(graph, cluster, top_k: int) -> list[dict]:
    """The distinct plans to run: the search's top ``top_k`` and its reference plans, each
    ``{"names": [...], "patterns": (pattern name per GraphNode)}``."""
    from tapas.planning.search import search
    s = search(graph, cluster=cluster, top_k=top_k)
    out: dict[tuple[str, ...], list[str]] = {}
    for alt in list(s.alternatives)[:top_k] + list(s.references):
        if alt.error:
            continue
        pats = tuple(alt.changes.get(v, p) for v, p in enumerate(s.patterns))
        out.setdefault(pats, []).append(alt.name)
    return [{"names": names, "patterns": pats} for pats, names in out.items()]


def recost(graph, cluster, plans: list[dict], loss) -> dict[str, list[float]]:
    """Each ablation row's predicted step time (seconds) of every plan; ``loss`` (the
    model's Keras loss) is priced in the rows that say ``loss=True``."""
    from tapas.planning import explore as ex
    from tapas.planning.cost import CostOptions
    from tapas.planning.table import EdgeCoster, pattern_table
    n = cluster.num_devices
    out = {}
    for row, changes in ROWS.items():
        changes = dict(changes)
        changes["loss"] = loss if changes.get("loss") else None
        opts = CostOptions.for_cluster(cluster, **changes)
        table = pattern_table(graph, n, cluster, opts)
        edges = EdgeCoster(n, cluster, opts)
        costs = []
        for plan in plans:
            idx = []
            for v, name in enumerate(plan["patterns"]):
                names = [i.name for i in table.infos[v]]
                if name not in names:
                    raise ValueError(f"row {row}: GraphNode {v} has no pattern {name!r} (has "
                                     f"{names}); the plan cannot be re-costed")
                idx.append(names.index(name))
            costs.append(ex.plan_cost(graph, table, idx, edges)[0].total)
        out[row] = costs
    return out


def measure(model, entry, graph, plan: dict, strategy, n: int) -> dict:
    """Median, interquartile range and all step times of one plan's ``train_step``."""
    del n   # the strategy's replicas
    return report.timed_plan(model, entry, graph, plan["patterns"], strategy,
                             FLAGS.batch_size, FLAGS.steps, FLAGS.repeats)


def scale_of(pred: list[float], meas: list[float]) -> float:
    """Least-squares scale through the origin mapping predicted onto measured seconds."""
    den = sum(p * p for p in pred)
    return sum(p * m for p, m in zip(pred, meas)) / den if den > 0 else 1.0


def plot(rows: list[dict], row: str, path: str) -> float:
    """Scatter of (scaled) predicted against measured step time of every run; the scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pred = [r["predicted_s"][row] for r in rows]
    meas = [r["median_s"] for r in rows]
    s = scale_of(pred, meas)
    fig, ax = plt.subplots(figsize=(5, 5))
    for model in sorted({r["model"] for r in rows}):
        pts = [(r["predicted_s"][row] * s * 1e3, r["median_s"] * 1e3) for r in rows
               if r["model"] == model]
        ax.scatter(*zip(*pts), label=model, s=18)
    hi = max(max(meas) * 1e3, max(pred) * s * 1e3) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="y = x")
    ax.set_xlabel(f"predicted step time x {s:.3g} (ms)")
    ax.set_ylabel("measured median step time (ms)")
    ax.set_title(f"Table 2 runs, cost model {row}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return s


def _slug(row: str) -> str:
    """A file-name form of an ablation row: "+CF+GO" -> "CF_GO"."""
    return row.strip("+").replace("+", "_")


def rank_table(ranks: dict) -> dict:
    """Acc@1, Acc@5, MRR per ablation row, printed beside the paper's."""
    from tapas.planning import ranking
    table = {row: {**ranking.table_metrics(ranks[row], 5), "ranks": ranks[row]}
             for row in ROWS}
    print(f"\n{'row':<14} {'Acc@1':>6} {'Acc@5':>6} {'MRR':>6}   paper Acc@1 Acc@5 MRR")
    for row, t in table.items():
        p = PAPER.get(row, {})
        print(f"{row:<14} {t['acc@1']:>6.2f} {t['acc@5']:>6.2f} {t['mrr']:>6.2f}   "
              f"{p.get('acc@1', '-'):>11} {p.get('acc@5', '-'):>5} {p.get('mrr', '-'):>4}")
    return table


def recost_file(path: str) -> None:
    """--recost: the plans of an earlier run (its patterns, or the same search again when
    the file has none), re-costed under every row of ROWS, ranked against the medians it
    measured."""
    from tapas import capturing, models
    from tapas.planning import ranking
    from tapas.planning.cluster import Cluster
    with open(path) as f:
        old = json.load(f)
    cluster = Cluster.load(old.get("cluster", FLAGS.cluster))
    batch = int(old.get("batch_size", FLAGS.batch_size))
    ranks: dict = {row: {} for row in ROWS}
    runs = []
    names = list(dict.fromkeys(r["model"] for r in old["runs"]))
    for name in names:
        mine = [r for r in old["runs"] if r["model"] == name]
        entry = models.get(name)
        graph = capturing.capture(entry.build(fast_init=True),
                                  list(entry.input_spec(batch)), training=False)
        if all("patterns" in r for r in mine):
            plans = [{"names": r["plan"].split("/"), "patterns": tuple(r["patterns"])}
                     for r in mine]
        else:   # an older file: the search is deterministic, so the same plans come back
            by_label = {"/".join(p["names"]): p
                        for p in candidates(graph, cluster, int(old["top_k"]))}
            missing = [r["plan"] for r in mine if r["plan"] not in by_label]
            if missing:
                raise ValueError(f"{path}: the plans {missing} of {name} are not what the "
                                 "search returns today and the file has no patterns: "
                                 "measure again")
            plans = [by_label[r["plan"]] for r in mine]
        predicted = recost(graph, cluster, plans, entry.keras_loss())
        for i, r in enumerate(mine):
            runs.append({**r, "predicted_s": {row: predicted[row][i] for row in ROWS}})
        medians = [r["median_s"] for r in mine]
        spreads = [r["iqr_s"] for r in mine]
        for row in ROWS:
            ranks[row][name] = ranking.best_rank(medians, predicted[row], spreads,
                                                 float(old.get("tie_tol", FLAGS.tie_tol)))
        print(f"{name}: rank of the measured-best plan "
              + ", ".join(f"{row} {ranks[row][name]}" for row in ROWS), flush=True)
    table = rank_table(ranks)
    out = {**old, "recosted_from": path, "rows": ROWS, "table": table, "runs": runs,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv)}
    os.makedirs(FLAGS.out, exist_ok=True)
    dest = os.path.join(FLAGS.out, "table2_recost.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nre-costed (not measured again); written to {dest}")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.recost:
        recost_file(FLAGS.recost)
        return
    from tapas.execution import devices
    devices.setup_devices(FLAGS.devices, "cpu")
    from tapas import capturing, models
    from tapas.planning import ranking
    from tapas.planning.cluster import Cluster
    n = FLAGS.devices
    cluster = Cluster.load(FLAGS.cluster)
    if cluster.num_devices != n:
        raise ValueError(f"--cluster={FLAGS.cluster} has {cluster.num_devices} devices but "
                         f"--devices={n}: profile with `tapas profile --devices={n}`")
    strategy = devices.make_strategy(n)
    runs, ranks = [], {row: {} for row in ROWS}
    load_before = os.getloadavg()
    for name in FLAGS.models:
        entry = models.get(name)
        model = entry.build(seed=0)
        graph = capturing.capture(model, list(entry.input_spec(FLAGS.batch_size)),
                                  training=False)
        plans = candidates(graph, cluster, FLAGS.top_k)
        predicted = recost(graph, cluster, plans, entry.keras_loss())
        meas = []
        for i, plan in enumerate(plans):
            m = measure(model, entry, graph, plan, strategy, n)
            meas.append(m)
            run = {"model": name, "plan": "/".join(plan["names"]),
                   "patterns": list(plan["patterns"]),
                   "sharded_nodes": sum(p != "replicate" for p in plan["patterns"]),
                   "predicted_s": {row: predicted[row][i] for row in ROWS}, **m}
            runs.append(run)
            print(f"[{name} {i + 1}/{len(plans)}] {run['plan']}: measured "
                  f"{m['median_s'] * 1e3:.1f} ms (IQR {m['iqr_s'] * 1e3:.1f}), predicted "
                  f"{predicted['+CF+GO+EC'][i] * 1e3:.2f} ms (+CF+GO+EC)", flush=True)
        medians = [m["median_s"] for m in meas]
        spreads = [m["iqr_s"] for m in meas]
        for row in ROWS:
            ranks[row][name] = ranking.best_rank(medians, predicted[row], spreads,
                                                 FLAGS.tie_tol)
    os.makedirs(FLAGS.out, exist_ok=True)
    scales = {row: plot(runs, row, os.path.join(FLAGS.out, f"table2_scatter_{_slug(row)}.png"))
              for row in ROWS}
    table = rank_table(ranks)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
           "cluster": FLAGS.cluster, "devices": n, "top_k": FLAGS.top_k, "steps": FLAGS.steps,
           "batch_size": FLAGS.batch_size,
           "repeats": FLAGS.repeats, "tie_tol": FLAGS.tie_tol, "rows": ROWS, "paper": PAPER,
           "table": table, "scatter_scale": scales, "runs": runs}
    path = os.path.join(FLAGS.out, "table2.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    app.run(main)
