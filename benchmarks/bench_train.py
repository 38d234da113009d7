"""Benchmark: training-step time of the reconstructed program against the single-device model.

    python benchmarks/bench_train.py [--devices=4] [--models=t5-tiny,resnet-tiny]
        [--strategies=best,random:0] [--steps=10] [--sides=keras,mirrored,tapas]
        [--each_side_alone] [--json_out=out/bench_train.json]

In one process with ``--devices`` logical CPU devices: for each model, the single-device Keras
training step (``tf.function``: forward, Keras loss, GradientTape, ``keras.optimizers.SGD``)
and, for each strategy ("best": ``tapas.search`` on a V100 cluster of N devices;
"random:SEED": ``tapas.execution.api.parallel.random_plan``), ``ParallelModel.train_step`` on the same
batch. Reports the median step time of ``--steps`` steps after the first, their ratio
(parallel / single device), and the first step's time (tracing the replayed program and
TensorFlow's first run of the graph) against the single-device first step, in wall time,
in process CPU time (steadier on a shared machine) and in user CPU time (without the
kernel's work of handing out fresh memory, which a virtual machine with lazily backed
memory makes several times dearer; the JSON has the system time and page faults too).
Issue 11's target: a first step at
most 2x the single-device one for t5-tiny, t5-small and t5-base on 4 devices
(``--models=t5-tiny,t5-small,t5-base --strategies=best``).

Beside both, TensorFlow's own way of training the same model on the same N devices: Keras
data parallelism under the ``MirroredStrategy`` (``--sides=mirrored``: the model built in
``strategy.scope()``, the batch split over the replicas, ``GradientTape`` in
``strategy.run``, ``keras.optimizers.SGD`` all-reducing the gradients), so a first step can
be compared with what any N-device TensorFlow program pays here. ``--sides`` picks what
runs (``keras``, ``mirrored``, ``tapas``); a later program in a process reuses memory an
earlier one touched, so for first steps ``--each_side_alone`` runs each side in a fresh
process of this script and merges their results into one table and JSON.

The logical devices share this machine's cores, so no speed-up is expected here: the ratio
measures the overhead of the reconstructed program (op-by-op replay, collectives, per-step
input distribution), not what N accelerators would give.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

flags.DEFINE_integer("devices", 4, "Logical CPU devices (N).")
flags.DEFINE_list("models", ["t5-tiny", "resnet-tiny"], "Zoo models.")
flags.DEFINE_list("strategies", ["best", "random:0"], "'best' or 'random:SEED'.")
flags.DEFINE_integer("steps", 10, "Timed steps after the first.")
flags.DEFINE_integer("batch_size", 8, "Global batch (divisible by --devices for a batch split).")
flags.DEFINE_list("graph_optimization", ["lean"], "Grappler options of the parallel step "
                  "(tapas.parallelize(graph_optimization=...)): lean or default (both: one "
                  "after the other in this process; the later program's first step then "
                  "reuses memory the earlier one touched, so compare first steps across "
                  "separate runs).")
flags.DEFINE_list("sides", ["keras", "mirrored", "tapas"], "What to run, in this order: keras "
                  "(single device), mirrored (Keras data parallel under MirroredStrategy on "
                  "the N devices), tapas (ParallelModel.train_step per --strategies).")
flags.DEFINE_bool("each_side_alone", False, "Run each of --sides in its own process (this "
                  "script again, one after the other) and merge their results: first steps "
                  "that no earlier program in the process flattered.")
flags.DEFINE_string("json_out", "out/bench_train.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    sides = _check_sides(FLAGS.sides)
    if "mirrored" in sides and FLAGS.batch_size % FLAGS.devices:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} does not split over "
                             f"--devices={FLAGS.devices}: the data-parallel baseline "
                             "(--sides=mirrored) needs a multiple of --devices")
    if FLAGS.each_side_alone:
        _each_side_alone(sides)
        return
    from tapas.execution.runtime import devices
    devices.setup_devices(FLAGS.devices, "cpu")
    import keras
    import tensorflow as tf

    from tapas import capturing, models
    from tapas.execution.api import parallel
    from tapas.planning.cost import Cluster
    logging.set_verbosity(logging.WARNING)
    n = FLAGS.devices
    strategy = devices.make_strategy(n)
    rows, baselines = [], {}
    for name in FLAGS.models:
        entry = models.get(name)
        model = entry.build(seed=0)
        xs, y = entry.synthetic_batch(FLAGS.batch_size)
        specs = list(entry.input_spec(FLAGS.batch_size))
        initial = [w.numpy() for w in model.weights]
        loss_fn = entry.keras_loss()
        opt = keras.optimizers.SGD()
        inputs = [tf.constant(x) for x in xs]

        @tf.function
        def keras_step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(inputs, training=False))
            grads = tape.gradient(loss, model.trainable_weights)
            opt.apply_gradients(zip(grads, model.trainable_weights))
            return loss

        measured = {}
        if "keras" in sides:
            measured["keras"] = _time(lambda: keras_step().numpy(), FLAGS.steps)
        if "mirrored" in sides:
            measured["mirrored"] = _time(_mirrored_step(entry, strategy, xs, y, n), FLAGS.steps)
        baselines[name] = {side: {"first": first, "step_s": statistics.median(times)}
                           for side, (first, times) in measured.items()}
        for side, b in baselines[name].items():
            print(f"{name} {side}: first step {b['first']['wall']:.1f} s (system CPU "
                  f"{b['first']['sys']:.1f} s, page faults {b['first']['faults']:,}), "
                  f"{b['step_s'] * 1e3:.1f} ms a step", flush=True)
        for label, grappler in [(s, g) for s in FLAGS.strategies
                                for g in FLAGS.graph_optimization if "tapas" in sides]:
            model.set_weights(initial)
            plan = None
            if label.startswith("random:"):
                plan = parallel.random_plan(capturing.capture(model, specs), n,
                                            int(label.split(":")[1]))
            start = time.perf_counter()
            # the inference graph, as the Keras step above (training=False)
            pm = parallel.parallelize(model, specs, plan, distribute_strategy=strategy,
                                      loss=loss_fn, cluster=Cluster.v100_ethernet(1, n),
                                      training=False, graph_optimization=grappler)
            build_s = time.perf_counter() - start
            first, times = _time(lambda: pm.train_step(list(xs), y), FLAGS.steps)
            sharded = sum(1 for node in pm.graph.nodes
                          if pm.program.plan.pattern(node).name != "replicate")
            row = {"model": name, "strategy": label, "graph_optimization": grappler,
                   "devices": n, "batch": len(y),
                   "sharded_nodes": sharded, "graph_nodes": len(pm.graph.nodes),
                   "parallel_step_s": statistics.median(times),
                   "first_step_s": first["wall"], "first_step_cpu_s": first["cpu"],
                   "first_step_user_s": first["user"],
                   "first_step_sys_s": first["sys"], "first_step_page_faults": first["faults"],
                   "build_s": build_s, "audit_matches": pm.audit().matches}
            _compare(row, baselines[name])
            rows.append(row)
            print(f"{name} {label} ({grappler}): first step {first['wall']:.1f} s (system CPU "
                  f"{first['sys']:.1f} s, page faults {first['faults']:,}), "
                  f"{row['parallel_step_s'] * 1e3:.1f} ms a step", flush=True)
    _print_table(baselines, rows)
    _write(sides, baselines, rows, alone=False)


def _write(sides: list[str], baselines: dict, rows: list[dict], alone: bool) -> None:
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "devices": FLAGS.devices, "steps": FLAGS.steps, "sides": sides,
           "each_side_alone": alone, "baselines": baselines, "rows": rows}
    d = os.path.dirname(FLAGS.json_out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwritten to {FLAGS.json_out}")


def _each_side_alone(sides: list[str]) -> None:
    """Each side in a fresh process of this script; their JSONs merged, the TAPAS rows
    compared with the baselines of the other processes."""
    import subprocess
    import tempfile
    baselines: dict[str, dict] = {name: {} for name in FLAGS.models}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            path = os.path.join(tmp, f"{side}.json")
            cmd = [sys.executable, os.path.abspath(__file__), f"--devices={FLAGS.devices}",
                   f"--models={','.join(FLAGS.models)}",
                   f"--strategies={','.join(FLAGS.strategies)}", f"--steps={FLAGS.steps}",
                   f"--batch_size={FLAGS.batch_size}",
                   f"--graph_optimization={','.join(FLAGS.graph_optimization)}",
                   f"--sides={side}", f"--json_out={path}"]
            print(f"--- {side}, in its own process", flush=True)
            if subprocess.run(cmd).returncode:
                raise SystemExit(f"bench_train: the {side} process failed (its output above)")
            with open(path) as f:
                part = json.load(f)
            for name, measured in part["baselines"].items():
                baselines[name].update(measured)
            rows += part["rows"]
    for row in rows:
        _compare(row, baselines[row["model"]])
    _print_table(baselines, rows)
    _write(sides, baselines, rows, alone=True)


def _print_table(baselines: dict, rows: list[dict]) -> None:
    """The summary: each model's baselines, then its TAPAS rows with their ratios."""
    print(f"\n{'model':<12} {'side':<14} {'sharded':>9} {'step ms':>9} {'first step s':>12} "
          f"{'/ 1 device':>10} {'CPU':>5} {'user':>5} {'/ mirrored':>10} {'audit':>6}")

    def cell(x: float | None, fmt: str, width: int) -> str:
        return f"{'-' if x is None else format(x, fmt):>{width}}"
    for name, sides_of in baselines.items():
        for side, b in sides_of.items():
            single = sides_of.get("keras")
            ratio = b["first"]["wall"] / single["first"]["wall"] if single else None
            print(f"{name:<12} {side:<14} {'':>9} {b['step_s'] * 1e3:>9.1f} "
                  f"{b['first']['wall']:>12.1f} {cell(ratio, '.1f', 10)} {'':>5} {'':>5} "
                  f"{'':>10} {'':>6}")
        for r in (r for r in rows if r["model"] == name):
            side = f"{r['strategy']} {r['graph_optimization']}"
            print(f"{name:<12} {side:<14} {r['sharded_nodes']:>4}/{r['graph_nodes']:<4} "
                  f"{r['parallel_step_s'] * 1e3:>9.1f} {r['first_step_s']:>12.1f} "
                  f"{cell(r.get('first_step_ratio'), '.1f', 10)} "
                  f"{cell(r.get('first_step_cpu_ratio'), '.1f', 5)} "
                  f"{cell(r.get('first_step_user_ratio'), '.1f', 5)} "
                  f"{cell(r.get('first_step_vs_mirrored'), '.1f', 10)} "
                  f"{'same' if r['audit_matches'] else 'DIFF':>6}")


def _compare(row: dict, baselines: dict) -> None:
    """Set beside a TAPAS ``row`` the same model's baselines (``keras``: one device,
    ``mirrored``: Keras data parallel) measured in this run, and the ratios to them."""
    for prefix, side in (("single", "keras"), ("mirrored", "mirrored")):
        base = baselines.get(side)
        if base is None:
            continue
        f = base["first"]
        row.update({f"{prefix}_step_s": base["step_s"], f"{prefix}_first_step_s": f["wall"],
                    f"{prefix}_first_step_cpu_s": f["cpu"],
                    f"{prefix}_first_step_sys_s": f["sys"],
                    f"{prefix}_first_step_page_faults": f["faults"]})
    single, mirrored = baselines.get("keras"), baselines.get("mirrored")
    if single is not None:
        f = single["first"]
        row.update({"ratio": row["parallel_step_s"] / single["step_s"],
                    "first_step_ratio": row["first_step_s"] / f["wall"],
                    "first_step_cpu_ratio": row["first_step_cpu_s"] / f["cpu"],
                    "first_step_user_ratio": row["first_step_user_s"] / f["user"]})
    if mirrored is not None:
        row["first_step_vs_mirrored"] = row["first_step_s"] / mirrored["first"]["wall"]


def _check_sides(sides: list[str]) -> list[str]:
    known = ("keras", "mirrored", "tapas")
    bad = [x for x in sides if x not in known]
    if bad or not sides:
        raise app.UsageError(f"--sides={','.join(sides)}: use one or more of {list(known)}")
    return sides


def _mirrored_step(entry: Any, strategy: Any, xs: list, y: Any, n: int) -> Any:
    """TensorFlow's own data parallelism of ``entry``'s model on ``strategy``'s N devices:
    the model and its SGD built in ``strategy.scope()``, each replica's share of the batch
    (rows ``i*B/N ..``), the loss scaled by 1/N, the gradients all-reduced by the Keras
    optimizer. Returns a function running one step (the global loss, as a float)."""
    import keras
    import tensorflow as tf
    batch = len(y)   # a multiple of n (main checks --batch_size first)
    with strategy.scope():
        model = entry.build(seed=0)
        opt = keras.optimizers.SGD()
        opt.build(model.trainable_weights)
    loss_fn = entry.keras_loss()
    share = batch // n

    def local(ctx: Any) -> tuple:
        i = ctx.replica_id_in_sync_group * share
        return [tf.constant(x[i:i + share]) for x in xs], tf.constant(y[i:i + share])
    data = strategy.experimental_distribute_values_from_function(local)

    def replica(data: tuple) -> tf.Tensor:
        x, t = data
        with tf.GradientTape() as tape:
            loss = loss_fn(t, model(x, training=False)) / n
        grads = tape.gradient(loss, model.trainable_weights)
        opt.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    @tf.function
    def step() -> tf.Tensor:
        return strategy.reduce("SUM", strategy.run(replica, args=(data,)), axis=None)
    return lambda: float(step().numpy())


def _time(fn, steps: int) -> tuple[dict[str, float], list[float]]:
    """(the first call's wall, process CPU, user and system CPU seconds and minor page
    faults; [wall s of each later call]). The CPU time of the first call (tracing and graph
    optimization, every thread of the process) is steadier than its wall time on a shared
    machine; its system time is mostly the kernel handing the process fresh memory (page
    faults), which on a virtual machine whose host backs memory lazily costs far more than
    on bare metal (docs/running.md, Overhead)."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    first = {"wall": wall, "cpu": user + system, "user": user, "sys": system,
             "faults": after.ru_minflt - before.ru_minflt}
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, times


if __name__ == "__main__":
    app.run(main)
