"""Benchmark: alpha-beta constants of all-reduce and all-gather on logical CPU devices.

    python benchmarks/measure_collectives.py [--devices=4] [--repeats=7]
        [--min_kib=1] [--max_mib=64] [--json_out=out/collectives_cpu.json]

Splits the one physical CPU into ``--devices`` logical devices (once, before any op), builds a
``tf.distribute.MirroredStrategy`` over them and times, inside a ``tf.function``:

- all-reduce: ``ReplicaContext.all_reduce(SUM)`` of an ``nbytes`` float32 tensor per replica;
- all-gather: ``ReplicaContext.all_gather`` of an ``nbytes / W`` shard per replica, so that the
  gathered result is ``nbytes`` (the convention of ``tapas.planning.cost``: N is the full size).

Message sizes go from ``--min_kib`` KiB to ``--max_mib`` MiB by factors of 4; each point is
the median of ``--repeats`` timed calls after one warm-up call. For each primitive it fits

    t(N) = a + beta * x(N),   x(N) = ring factor * N   (2(W-1)/W for all-reduce, (W-1)/W otherwise)

by least squares on relative error (every size weighs the same, so the small sizes pin the
intercept and the large ones the slope), and reports ``alpha' = a / W`` (paper eq. 2 charges
alpha' * W), ``beta`` (s/byte) and the bandwidth 1/beta. ``epsilon_vs_all_reduce`` is
beta(primitive) / beta(all-reduce): how much more or less efficient a primitive is per ring
byte than all-reduce on this machine. With ``--matmul_n`` it also times one float32 matmul
on one logical device, a rough peak FLOP/s for the ``Cluster.loopback_cpu`` preset.

The logical devices share the machine's cores and memory, so these are loopback numbers for
tests and for ranking on this machine, not figures for any real interconnect. Runtime is
about a minute on 2 cores with the defaults.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags, logging  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py, beside this script)

flags.DEFINE_integer("devices", 4, "Number of logical CPU devices (the group size W).")
flags.DEFINE_integer("repeats", 7, "Timed calls per message size (the median is reported).")
flags.DEFINE_integer("min_kib", 1, "Smallest message in KiB.")
flags.DEFINE_integer("max_mib", 64, "Largest message in MiB.")
flags.DEFINE_integer("matmul_n", 2048, "Also time an n x n float32 matmul on one device "
                     "(peak FLOP/s estimate); 0 skips it.")
flags.DEFINE_string("json_out", "out/collectives_cpu.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS


def ring_factor(kind: str, w: int) -> float:
    """Bytes on the busiest link per byte of message, ring algorithm (see tapas/planning/cost.py)."""
    return 2.0 * (w - 1) / w if kind == "all_reduce" else (w - 1) / w


def fit_alpha_beta(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least squares of t = a + b x minimising relative error; returns (a, b)."""
    import numpy as np
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(ts, dtype=np.float64)
    w = 1.0 / t  # relative error: (a + b x - t) / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    return float(a), float(b)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # TF logs one INFO line per collective build
    import tensorflow as tf

    n = FLAGS.devices
    if n < 2:
        raise app.UsageError(f"--devices={n}: a collective needs at least 2 devices")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    w = strategy.num_replicas_in_sync

    sizes = []
    size = FLAGS.min_kib * 1024
    while size <= FLAGS.max_mib * 1024 * 1024:
        sizes.append(size)
        size *= 4

    def all_reduce_step(x):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)[:1]

    def all_gather_step(x):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(x, axis=0)[:1]

    steps = {"all_reduce": all_reduce_step, "all_gather": all_gather_step}
    rows = []
    for kind, step in steps.items():
        fn = tf.function(lambda v, step=step: strategy.run(step, args=(v,)))
        for nbytes in sizes:
            # all-reduce: every replica holds N bytes; all-gather: N / W each, N gathered
            elems = nbytes // 4 if kind == "all_reduce" else max(1, nbytes // 4 // w)

            def make(ctx, elems=elems):
                return tf.ones([elems], tf.float32) * tf.cast(ctx.replica_id_in_sync_group + 1,
                                                               tf.float32)

            value = strategy.experimental_distribute_values_from_function(make)
            fn(value)  # trace + warm-up
            times = []
            for _ in range(FLAGS.repeats):
                t0 = time.perf_counter()
                out = fn(value)
                for t in strategy.experimental_local_results(out):
                    t.numpy()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            x = ring_factor(kind, w) * nbytes
            rows.append({"kind": kind, "bytes": nbytes, "ring_bytes": x,
                         "median_s": med, "all_s": times,
                         "ring_gb_per_s": x / med / 1e9})
            print(f"{kind:<11} {nbytes:>11,} B  {med * 1e3:9.3f} ms  "
                  f"{x / med / 1e9:7.3f} GB/s (ring bytes)", flush=True)

    fits = {}
    for kind in steps:
        pts = [r for r in rows if r["kind"] == kind]
        a, b = fit_alpha_beta([r["ring_bytes"] for r in pts], [r["median_s"] for r in pts])
        fits[kind] = {"intercept_s": a, "alpha_per_worker_s": a / w, "beta_s_per_byte": b,
                      "bandwidth_bytes_per_s": 1.0 / b if b > 0 else None}
    for kind in fits:
        fits[kind]["epsilon_vs_all_reduce"] = (fits[kind]["beta_s_per_byte"]
                                               / fits["all_reduce"]["beta_s_per_byte"])

    matmul = None
    if FLAGS.matmul_n:
        m = FLAGS.matmul_n
        with tf.device(devices[0]):
            a = tf.random.normal([m, m])
            mm = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)))
            mm(a).numpy()
            times = []
            for _ in range(FLAGS.repeats):
                t0 = time.perf_counter()
                mm(a).numpy()
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        matmul = {"n": m, "median_s": med, "flop_per_s": 2.0 * m ** 3 / med}

    print()
    print(f"W = {w} logical CPU devices")
    print(f"{'primitive':<11} {'intercept us':>12} {'alpha/W us':>11} {'beta s/B':>11} "
          f"{'GB/s':>7} {'eps vs AR':>9}")
    for kind, f in fits.items():
        print(f"{kind:<11} {f['intercept_s'] * 1e6:>12.1f} {f['alpha_per_worker_s'] * 1e6:>11.1f} "
              f"{f['beta_s_per_byte']:>11.3e} {f['bandwidth_bytes_per_s'] / 1e9:>7.3f} "
              f"{f['epsilon_vs_all_reduce']:>9.3f}")

    if matmul:
        print(f"float32 matmul {matmul['n']}^2 on one logical device: "
              f"{matmul['median_s'] * 1e3:.1f} ms, {matmul['flop_per_s'] / 1e9:.1f} GFLOP/s")

    result = {"benchmark": "collectives_cpu",
              "date": datetime.date.today().isoformat(),
              "devices": w, "repeats": FLAGS.repeats,
              "tensorflow": tf.__version__,
              "machine": report.machine(),
              "model": "t = intercept + beta * ring_factor * N; alpha' = intercept / W",
              "fits": fits, "matmul": matmul, "rows": rows}
    report.write_json(FLAGS.json_out, result)


if __name__ == "__main__":
    app.run(main)
