"""Benchmark: training-step time of the reconstructed program against the single-device model.

    python benchmarks/bench_train.py [--devices=4] [--models=t5-tiny,resnet-tiny]
        [--strategies=best,random:0] [--steps=10] [--json_out=out/bench_train.json]

In one process with ``--devices`` logical CPU devices: for each model, the single-device Keras
training step (``tf.function``: forward, Keras loss, GradientTape, ``keras.optimizers.SGD``)
and, for each strategy ("best": ``tapas.search`` on a V100 cluster of N devices;
"random:SEED": ``tapas.execution.parallel.random_plan``), ``ParallelModel.train_step`` on the same
batch. Reports the median step time of ``--steps`` steps after the first, their ratio
(parallel / single device), and the first step's time (tracing the replayed program and
TensorFlow's first run of the graph) against the single-device first step, in wall time,
in process CPU time (steadier on a shared machine) and in user CPU time (without the
kernel's work of handing out fresh memory, which a virtual machine with lazily backed
memory makes several times dearer; the JSON has the system time and page faults too).
Issue 11's target: a first step at
most 2x the single-device one for t5-tiny, t5-small and t5-base on 4 devices
(``--models=t5-tiny,t5-small,t5-base --strategies=best``).

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
flags.DEFINE_string("json_out", "out/bench_train.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    from tapas.execution import devices, optimizers
    devices.setup_devices(FLAGS.devices, "cpu")
    import tensorflow as tf

    from tapas import capturing, models
    from tapas.execution import parallel
    from tapas.planning.cost import Cluster
    logging.set_verbosity(logging.WARNING)
    n = FLAGS.devices
    strategy = devices.make_strategy(n)
    rows = []
    for name in FLAGS.models:
        entry = models.get(name)
        model = entry.build(seed=0)
        xs, y = entry.synthetic_batch(FLAGS.batch_size)
        specs = list(entry.input_spec(FLAGS.batch_size))
        initial = [w.numpy() for w in model.weights]
        loss_fn = entry.keras_loss()
        opt = optimizers.SGD().keras()
        inputs = [tf.constant(x) for x in xs]

        @tf.function
        def keras_step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(inputs, training=False))
            grads = tape.gradient(loss, model.trainable_weights)
            opt.apply_gradients(zip(grads, model.trainable_weights))
            return loss

        single_first, single = _time(lambda: keras_step().numpy(), FLAGS.steps)
        for label, grappler in [(s, g) for s in FLAGS.strategies
                                for g in FLAGS.graph_optimization]:
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
                   "single_step_s": statistics.median(single),
                   "parallel_step_s": statistics.median(times),
                   "ratio": statistics.median(times) / statistics.median(single),
                   "first_step_s": first["wall"], "single_first_step_s": single_first["wall"],
                   "first_step_cpu_s": first["cpu"],
                   "single_first_step_cpu_s": single_first["cpu"],
                   "first_step_ratio": first["wall"] / single_first["wall"],
                   "first_step_cpu_ratio": first["cpu"] / single_first["cpu"],
                   "first_step_user_ratio": first["user"] / single_first["user"],
                   "first_step_sys_s": first["sys"], "single_first_step_sys_s": single_first["sys"],
                   "first_step_page_faults": first["faults"],
                   "single_first_step_page_faults": single_first["faults"],
                   "build_s": build_s, "audit_matches": pm.audit().matches}
            rows.append(row)
            print(f"{name} {label} ({grappler}): first step {first['wall']:.1f} s vs "
                  f"{single_first['wall']:.1f} s (system CPU {first['sys']:.1f} s vs "
                  f"{single_first['sys']:.1f} s, page faults {first['faults']:,} vs "
                  f"{single_first['faults']:,}), {row['parallel_step_s'] * 1e3:.1f} ms vs "
                  f"{row['single_step_s'] * 1e3:.1f} ms single device", flush=True)
    print(f"\n{'model':<12} {'strategy':<9} {'grappler':<8} {'sharded':>9} {'1-device ms':>11} "
          f"{'N-device ms':>11} {'ratio':>6} {'first step s':>12} {'1-device':>9} "
          f"{'ratio':>6} {'CPU ratio':>9} {'user ratio':>10} {'audit':>6}")
    for r in rows:
        print(f"{r['model']:<12} {r['strategy']:<9} {r['graph_optimization']:<8} "
              f"{r['sharded_nodes']:>4}/{r['graph_nodes']:<4} "
              f"{r['single_step_s'] * 1e3:>11.1f} {r['parallel_step_s'] * 1e3:>11.1f} "
              f"{r['ratio']:>6.1f} {r['first_step_s']:>12.1f} "
              f"{r['single_first_step_s']:>9.1f} {r['first_step_ratio']:>6.1f} "
              f"{r['first_step_cpu_ratio']:>9.1f} {r['first_step_user_ratio']:>10.1f} "
              f"{'same' if r['audit_matches'] else 'DIFF':>6}")
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "devices": n, "steps": FLAGS.steps, "rows": rows}
    d = os.path.dirname(FLAGS.json_out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwritten to {FLAGS.json_out}")


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
