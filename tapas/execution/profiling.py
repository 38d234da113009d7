"""``tapas profile``: measure this machine's collectives and compute, fit the cost model.

In:  a device count W (logical CPU devices, or the GPUs when at least W are present:
     ``tapas.execution.devices.make_strategy``; or, in a process whose ``TF_CONFIG`` names
     K workers, the K workers' devices under ``MultiWorkerMirroredStrategy``: ``tapas
     profile --workers=K`` starts them on 127.0.0.1), message sizes, repeats.
Out: a :class:`Profile`: one row per (primitive, size) measured, the fits of
     ``tapas.planning.calibrate`` (alpha', beta, epsilon per primitive with R^2), the
     compute rates fitted to training steps of reference blocks, the achieved matmul and
     convolution FLOP/s, the FLOP rate of matrix multiplies by width, the measured gamma,
     and the profiled ``Cluster`` (``Profile.save`` writes the cluster file ``tapas search
     --cluster=...`` reads, with the measurements under ``"profile"``; ``Profile.plot``
     the residual PNG).

Each collective is timed as the runtime launches it (``ReplicaContextCollectives`` inside
``MirroredStrategy.run`` in a ``tf.function``), as a chain: (min t_k - min t_1) / (k - 1)
over k chained collectives and one, so the call's dispatch cancels; a point costing
milliseconds is timed up to 4 x more often, until its calls took 0.4 s (not across worker
processes, which must all make the same calls). What is measured and how it is fitted:
``docs/cost.md``, "Calibrating".
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.collectives import Audit, ReplicaContextCollectives
from tapas.execution.devices import make_strategy, process_count
from tapas.planning.calibrate import (KIB, MIB, ComputeFit, FitError, Profile,
                                      fit_collectives, fit_compute, fit_gamma, parse_sizes,
                                      profiled_cluster)
from tapas.planning.widths import effective_flops
from tapas.planning.cost import DEFAULT_GAMMA, ring_factor
from tapas.sharding.placements import Collective

__all__ = ["profile", "Profile", "parse_sizes", "DEFAULT_SIZES", "PRIMITIVES"]

#: 1 KiB to 16 MiB by factors of 4 (8 sizes)
DEFAULT_SIZES: tuple[int, ...] = tuple(KIB * 4 ** i for i in range(8))
PRIMITIVES: tuple[Collective, ...] = (Collective.ALL_REDUCE, Collective.ALL_GATHER,
                                      Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL)

Progress = Callable[[str], None]
# a point's timed rounds continue past ``repeats`` (up to EXTRA_REPEATS x) until they took
# MIN_POINT_SECONDS: the small messages, whose calls take milliseconds, get more chances
MIN_POINT_SECONDS = 0.4
EXTRA_REPEATS = 4


def _chain_length(nbytes: int) -> int:
    return 8 if nbytes <= 256 * KIB else 4 if nbytes <= 4 * MIB else 3


def _shapes(kind: Collective, nbytes: int, w: int) -> tuple[list[int], list[int], int]:
    """(per-replica input shape, global shape the audit records, N actually used): a
    [rows, cols] float32 tensor of about ``nbytes``, rows and cols multiples of W."""
    cols = 8 * w
    rows = max(w, round(nbytes / 4 / cols / w) * w)
    n = rows * cols * 4
    if kind is Collective.ALL_GATHER:
        return [rows // w, cols], [rows, cols], n
    return [rows, cols], [rows, cols], n


def _run_op(coll: ReplicaContextCollectives, kind: Collective, x: tf.Tensor,
            shape: list[int]) -> tf.Tensor:
    if kind is Collective.ALL_REDUCE:
        return coll.all_reduce([x], "profile", shape, "float32")[0]
    if kind is Collective.ALL_GATHER:
        return coll.all_gather([x], 0, "profile", shape, "float32")[0]
    if kind is Collective.REDUCE_SCATTER:
        return coll.reduce_scatter([x], 0, "profile", shape, "float32")[0]
    return coll.all_to_all([x], 0, 1, "profile", shape, "float32")[0]


class _Timer:
    """Calls of per-replica functions under one strategy, timed to completion."""

    def __init__(self, strategy: tf.distribute.Strategy, sync: bool = False) -> None:
        self.strategy = strategy
        self.w = strategy.num_replicas_in_sync
        self.audit = Audit()
        # worker processes: end every compute call with a one-number all-reduce so the
        # workers' calls run at the same time (within one process the replicas of a call
        # already do); the empty call pays it too, so the difference is the compute
        self.sync = sync

    def done(self, x: tf.Tensor) -> tf.Tensor:
        """A compute call's result: ``x``, synchronised across workers when ``sync``."""
        if not self.sync:
            return x
        return tf.distribute.get_replica_context().all_reduce("sum", x)

    def step_result(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        """A training step's result: one number of every gradient, so TensorFlow prunes
        none of them from what is timed (:meth:`done` of it)."""
        return self.done(tf.stack([tf.reshape(g, [-1])[0] for g in grads]))

    def values(self, shape: Sequence[int]) -> Any:
        """Per-replica float32 tensors of ``shape``, replica r filled with r + 1."""
        def make(ctx):
            return tf.fill(list(shape), tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
        return self.strategy.experimental_distribute_values_from_function(make)

    def function(self, replica_fn: Callable[..., Any]) -> Callable[..., Any]:
        strategy = self.strategy
        return tf.function(lambda *args: strategy.run(replica_fn, args=args))

    def call(self, fn: Callable[..., Any], *args: Any) -> float:
        start = time.perf_counter()
        out = fn(*args)
        for t in tf.nest.flatten(self.strategy.experimental_local_results(out)):
            t.numpy()
        return time.perf_counter() - start

    def timed(self, fns: Sequence[Callable[..., Any]], args: Sequence[Any],
              repeats: int) -> list[list[float]]:
        """Each of ``fns`` called once to warm up, then in turn ``repeats`` times, and more
        (up to ``EXTRA_REPEATS`` x) while the rounds took under ``MIN_POINT_SECONDS``: cheap
        points get more chances at an undisturbed call. The times per function."""
        for fn in fns:
            self.call(fn, *args)
        times: list[list[float]] = [[] for _ in fns]
        start = time.perf_counter()
        rounds = 0
        # worker processes run exactly ``repeats`` rounds: a count that depends on each
        # worker's own clock would leave one worker calling a collective the others have
        # moved past (mismatched collective instances)
        extend = not self.sync
        while rounds < repeats or (extend and rounds < EXTRA_REPEATS * repeats and
                                   time.perf_counter() - start < MIN_POINT_SECONDS):
            for i, fn in enumerate(fns):
                times[i].append(self.call(fn, *args))
            rounds += 1
        return times

    def chain(self, kind: Collective, k: int, shape: list[int]) -> Callable[..., Any]:
        def replica_fn(x):
            coll = ReplicaContextCollectives(self.w, self.audit)
            prev = None
            for _ in range(k):
                with tf.control_dependencies([] if prev is None else [prev]):
                    out = _run_op(coll, kind, tf.identity(x), shape)
                prev = out
            return tf.reshape(prev, [-1])[:1]
        return self.function(replica_fn)


def _measure_collective(timer: _Timer, kind: Collective, nbytes: int,
                        repeats: int) -> dict[str, Any]:
    local, full, n = _shapes(kind, nbytes, timer.w)
    k = _chain_length(n)
    value = timer.values(local)
    one, many = timer.chain(kind, 1, full), timer.chain(kind, k, full)
    t1, tk = timer.timed([one, many], [value], repeats)
    return {"kind": kind.value, "bytes": n, "requested_bytes": nbytes, "chain": k,
            "seconds": (min(tk) - min(t1)) / (k - 1),
            "median_based_s": (statistics.median(tk) - statistics.median(t1)) / (k - 1),
            "call_1_s": min(t1), "call_1_all_s": t1, "call_k_all_s": tk, "repeats": len(t1),
            "ring_bytes": ring_factor(kind, timer.w) * n}


def _matmul_rate(timer: _Timer, n: int, repeats: int, devices: list[str]) -> dict[str, Any]:
    """FLOP/s of an n x n float32 matmul per device, all devices at once and one alone."""
    a = timer.values([n, n])

    def replica_mm(x):
        return timer.done(tf.reshape(tf.matmul(x, x), [-1])[:1])

    def replica_empty(x):
        return timer.done(tf.reshape(x, [-1])[:1])

    empty, mm = timer.function(replica_empty), timer.function(replica_mm)
    te, tm = timer.timed([empty, mm], [a], repeats)
    seconds = min(tm) - min(te)
    flops = 2.0 * n ** 3
    with tf.device(devices[0]):
        x = tf.fill([n, n], 1.0)
        alone = tf.function(lambda v: tf.reshape(tf.matmul(v, v), [-1])[:1])
        alone(x).numpy()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            alone(x).numpy()
            times.append(time.perf_counter() - start)
    alone_s = min(times)
    return {"n": n, "flops": flops, "seconds_all_devices": seconds,
            "flop_per_s_per_device": flops / seconds if seconds > 0 else float("nan"),
            "seconds_one_device_alone": alone_s, "flop_per_s_one_device_alone": flops / alone_s}


def _conv_rate(timer: _Timer, repeats: int) -> dict[str, Any]:
    """FLOP/s of a 3x3, 64 -> 64 channel convolution of a [8, 32, 32, 64] batch per device,
    all devices at once."""
    b, h, c = 8, 32, 64
    x = timer.values([b, h, h, c])
    kernel = tf.fill([3, 3, c, c], 0.01)

    def replica_conv(v):
        y = tf.nn.conv2d(v, kernel, strides=1, padding="SAME")
        return timer.done(tf.reshape(y, [-1])[:1])

    def replica_empty(v):
        return timer.done(tf.reshape(v, [-1])[:1])

    te, tc = timer.timed([timer.function(replica_empty), timer.function(replica_conv)],
                         [x], repeats)
    seconds = min(tc) - min(te)
    flops = 2.0 * b * h * h * 9 * c * c
    return {"shape": [b, h, h, c], "kernel": [3, 3, c, c], "flops": flops,
            "seconds_all_devices": seconds,
            "flop_per_s_per_device": flops / seconds if seconds > 0 else float("nan")}


def _transformer_block(shape: Sequence[int]) -> Any:
    """A pre-norm transformer encoder layer on [batch, sequence, width]: layer norm, Keras
    multi-head attention (4 heads), residual, layer norm, a GELU MLP of 4 x width,
    residual."""
    import keras
    d = int(shape[-1])
    x = keras.Input(tuple(shape[1:]))
    h = keras.layers.LayerNormalization()(x)
    h = keras.layers.MultiHeadAttention(4, d // 4)(h, h)
    x2 = keras.layers.Add()([x, h])
    h = keras.layers.LayerNormalization()(x2)
    h = keras.layers.Dense(4 * d, activation="gelu")(h)
    h = keras.layers.Dense(d)(h)
    return keras.Model(x, keras.layers.Add()([x2, h]))


def _residual_block(shape: Sequence[int]) -> Any:
    """A ResNet basic block on [batch, height, width, channels]: two 3x3 convolutions with
    batch norm and ReLU, residual."""
    import keras
    c = int(shape[-1])
    x = keras.Input(tuple(shape[1:]))
    h = keras.layers.Conv2D(c, 3, padding="same", use_bias=False)(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(c, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(x, keras.layers.ReLU()(keras.layers.Add()([x, h])))


def _inverted_residual_block(shape: Sequence[int]) -> Any:
    """A MobileNetV2 inverted residual block: 1x1 expansion (4x), batch norm, ReLU6, 3x3
    depthwise convolution, batch norm, ReLU6, 1x1 projection, batch norm, residual."""
    import keras
    c = int(shape[-1])
    x = keras.Input(tuple(shape[1:]))
    h = keras.layers.Conv2D(4 * c, 1, use_bias=False)(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU(6.0)(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU(6.0)(h)
    h = keras.layers.Conv2D(c, 1, use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(x, keras.layers.Add()([x, h]))


#: the blocks whose training steps give the compute rates, each at four per-device input
#: shapes: layers as real models have them, in mixes from matmul-bound (the residual block)
#: to memory-bound (the inverted residual block), so that the two rates separate
REFERENCE_BLOCKS: tuple[tuple[str, Callable[[Sequence[int]], Any],
                              tuple[tuple[int, ...], ...]], ...] = (
    ("transformer", _transformer_block,
     ((8, 16, 64), (16, 32, 64), (64, 16, 64), (32, 64, 128))),
    ("residual", _residual_block,
     ((8, 16, 16, 16), (16, 32, 32, 16), (32, 16, 16, 32), (64, 16, 16, 32))),
    ("inverted residual", _inverted_residual_block,
     ((8, 16, 16, 8), (16, 32, 32, 8), (32, 16, 16, 16), (64, 16, 16, 16))))


def _counted_work(block: Any, shape: Sequence[int]
                  ) -> tuple[float, float, dict[int, float]]:
    """The forward FLOPs of the matmuls and convolutions, the elements of the memory-bound
    ops and the FLOPs per matrix-multiply width bucket that the cost model counts for
    ``block`` on ``shape`` on one device: the replicate pattern's ``dense_flops``,
    ``elements`` and ``dense_by_width`` summed over the captured GraphNodes (inference
    graph, as the search captures a model)."""
    from tapas.capturing import capture
    from tapas.sharding.patterns import patterns_for
    graph = capture(block, [tf.TensorSpec(list(shape), tf.float32)], training=False)
    patterns = [patterns_for(node, graph, 1)[0] for node in graph.nodes]
    by_width: dict[int, float] = {}
    for p in patterns:
        for w, f in p.dense_by_width.items():
            by_width[w] = by_width.get(w, 0.0) + f
    return (float(sum(p.dense_flops for p in patterns)),
            float(sum(p.elements for p in patterns)), dict(sorted(by_width.items())))


#: the matrix-multiply widths whose FLOP rate the profile measures (powers of two:
#: ``Cluster.device_width_efficiency``'s keys)
WIDTHS: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
# the depths of the two stacks of matmuls timed per width: their difference is
# WIDTH_DEPTHS[1] - WIDTH_DEPTHS[0] layers and nothing else (no loss, no dispatch)
WIDTH_DEPTHS = (2, 6)


def _width_rows(width: int) -> int:
    """Rows of the [rows, width] activations at ``width``: 16384 (a CNN's pixels per device
    at batch 16, 32 x 32) up to width 64, fewer above so a layer stays under 0.3 GFLOP."""
    return max(1024, min(16384, 2 ** 27 // width ** 2))


def _width_rates(timer: _Timer, repeats: int, widths: Sequence[int] = WIDTHS
                 ) -> dict[str, Any]:
    """The FLOP rate of a matrix multiply by its width: per width w, the training step
    (forward, input and weight gradients) of a stack of [rows, w] x [w, w] matmuls at two
    depths, all devices at once; the deeper stack's extra time is its extra layers' alone,
    so rate = 3 x 2 x rows x w^2 x (extra layers) / (extra time). ``efficiency``: each rate
    over the fastest (``Cluster.device_width_efficiency``), or ``error`` when fewer than two
    widths gave a rate (noise)."""
    shallow, deep = WIDTH_DEPTHS
    points = []
    for w in widths:
        rows = _width_rows(w)
        x = timer.values([rows, w])

        def stack(depth: int) -> Callable[..., Any]:
            def replica_step(v, depth=depth, w=w):
                weights = [tf.fill([w, w], 1.0 / w) for _ in range(depth)]
                with tf.GradientTape() as tape:
                    tape.watch([v, *weights])
                    h = v
                    for m in weights:
                        h = tf.matmul(h, m)
                    loss = tf.reduce_sum(h)
                grads = tape.gradient(loss, [v, *weights])
                return timer.step_result(grads)
            return timer.function(replica_step)

        t_short, t_deep = timer.timed([stack(shallow), stack(deep)], [x], repeats)
        seconds = min(t_deep) - min(t_short)
        flops = 3.0 * 2.0 * rows * w * w * (deep - shallow)
        points.append({"width": w, "rows": rows, "depths": [shallow, deep],
                       "extra_seconds": seconds, "flops": flops,
                       "flop_per_s_per_device": flops / seconds if seconds > 0 else None})
    rates = {p["width"]: p["flop_per_s_per_device"] for p in points
             if p["flop_per_s_per_device"]}
    out: dict[str, Any] = {
        "step": "forward, input and weight gradients of [rows, w] x [w, w] matmul stacks, "
                f"depth {deep} less depth {shallow}; every device at once",
        "points": points}
    if len(rates) < 2:
        out.update(efficiency=None, error=f"{len(rates)} of {len(points)} widths gave a rate "
                   "(a deeper stack no slower than a shallower one: noise)")
        return out
    best = max(rates.values())
    out.update(efficiency={str(w): r / best for w, r in sorted(rates.items())},
               peak_flop_per_s_per_device=best)
    return out


def _compute_rates(timer: _Timer, repeats: int, backward_factor: float = 2.0,
                   blocks: Sequence[tuple[str, Callable[[Sequence[int]], Any],
                                          Sequence[Sequence[int]]]] = REFERENCE_BLOCKS,
                   widths: Mapping[int, float] | None = None
                   ) -> tuple[dict[str, Any], ComputeFit | None]:
    """The device's FLOP rate and elementwise rate in a training step, in the cost model's
    own units: per block and shape, the training step (forward, input and weight gradients,
    every gradient used so none is pruned) on every device at once, less an empty call,
    against the FLOPs and elements the cost model counts for it (:func:`_counted_work`;
    with ``widths``, the measured width efficiency, each width bucket's FLOPs in peak-rate
    FLOPs as the cost model prices them: ``tapas.planning.widths.effective_flops``);
    :func:`tapas.planning.calibrate.fit_compute` fits both rates at once. The record (the
    points, the fit or why there is none) and the fit (None when it failed)."""
    strategy = timer.strategy
    points = []
    for name, make, shapes in blocks:
        for shape in shapes:
            counted, elements, by_width = _counted_work(make(shape), shape)
            dense = effective_flops(counted, by_width, widths)
            with strategy.scope():
                block = make(shape)

            def replica_step(x, block=block):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(block(x, training=False))
                grads = tape.gradient(loss, [x, *block.trainable_variables])
                return timer.step_result(grads)   # the weight gradients stay in the step

            def replica_empty(x):
                return timer.done(tf.reshape(x, [-1])[:1])

            te, ts = timer.timed([timer.function(replica_empty),
                                  timer.function(replica_step)],
                                 [timer.values(list(shape))], repeats)
            points.append({"block": name, "shape": list(shape), "dense_flops": dense,
                           "counted_dense_flops": counted,
                           "dense_by_width": {str(w): f for w, f in by_width.items()},
                           "elements": elements, "seconds": min(ts) - min(te),
                           "step_s": min(ts), "empty_s": min(te)})
    out: dict[str, Any] = {
        "blocks": [name for name, _, _ in blocks],
        "step": "forward, input and weight gradients, inference graph; every device at once",
        "backward_flops_factor": backward_factor,
        "dense_flops": ("in peak-rate FLOPs: each width bucket's counted FLOPs over its "
                        "measured efficiency" if widths else "as counted"),
        "points": points}
    # a step no slower than an empty call is noise (a loaded machine): left out of the fit
    usable = [p for p in points if p["seconds"] > 0]
    out["left_out"] = [f"{p['block']} {p['shape']}" for p in points if p["seconds"] <= 0]
    try:
        fit = fit_compute([p["dense_flops"] for p in usable], [p["elements"] for p in usable],
                          [p["seconds"] for p in usable], backward_factor)
    except FitError as e:
        out.update(rate=None, dense_rate=None, error=str(e))
        return out, None
    out.update(rate=fit.elementwise_rate, dense_rate=fit.dense_rate, fit=fit.to_json(),
               r2=fit.r2, max_relative_residual=fit.max_relative_residual)
    return out, fit


def _overlap_trial(timer: _Timer, nbytes: int, flop_rate: float,
                   repeats: int) -> dict[str, float]:
    """One gamma trial: an all-reduce of ``nbytes``, a matmul chain sized to take about as
    long, and both at once (module docstring)."""
    local, full, n = _shapes(Collective.ALL_REDUCE, nbytes, timer.w)
    m = 256
    comm_fn = timer.chain(Collective.ALL_REDUCE, 1, full)
    x = timer.values(local)
    w_mat = timer.values([m, m])
    # estimate the all-reduce's time to size the compute beside it
    t_comm = min(timer.timed([comm_fn], [x], 3)[0])
    count = max(1, round(t_comm * flop_rate / (2.0 * m ** 3)))

    def compute(wm):
        y = wm
        for _ in range(count):
            y = tf.tanh(tf.matmul(y, wm) * (1.0 / m))
        return timer.done(tf.reshape(y, [-1])[:1])

    def replica_empty(v, wm):
        return tf.reshape(v, [-1])[:1], timer.done(tf.reshape(wm, [-1])[:1])

    def replica_comm(v, wm):
        coll = ReplicaContextCollectives(timer.w, timer.audit)
        return tf.reshape(_run_op(coll, Collective.ALL_REDUCE, v, full), [-1])[:1], \
            timer.done(tf.reshape(wm, [-1])[:1])

    def replica_compute(v, wm):
        return tf.reshape(v, [-1])[:1], compute(wm)

    def replica_both(v, wm):
        coll = ReplicaContextCollectives(timer.w, timer.audit)
        return tf.reshape(_run_op(coll, Collective.ALL_REDUCE, v, full), [-1])[:1], \
            compute(wm)

    fns = [timer.function(f) for f in (replica_empty, replica_comm, replica_compute,
                                       replica_both)]
    times = timer.timed(fns, [x, w_mat], repeats)
    med = [min(t) for t in times]
    return {"bytes": n, "matmuls": count, "matmul_n": m, "empty": med[0], "comm": med[1],
            "compute": med[2], "both": med[3]}


def _device_memory(devices: list[str]) -> tuple[float, str]:
    """Bytes of memory per device and where the figure comes from."""
    if "GPU" in devices[0].upper():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            return float(out[0]) * MIB, "nvidia-smi memory.total of GPU 0"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
        return 0.0, "unknown: nvidia-smi did not answer; pass device_memory="
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total), "this machine's RAM, shared by all logical CPU devices"


def profile(devices: int = 4, *, sizes: Sequence[int] | None = None,
            primitives: Sequence[Collective | str] | None = None, repeats: int = 7,
            device_type: str = "auto", matmul_n: int = 1024, conv: bool = True,
            gamma: bool = True, elementwise: bool = True, widths: bool = True,
            device_memory: float | None = None,
            progress: Progress | None = print) -> Profile:
    """Measure the collectives the runtime launches and the compute rate on ``devices``
    devices, fit the cost model and return the :class:`Profile` (module docstring).

    Logical CPU devices are fixed once per process: call this before any other TensorFlow
    work in the process (``tapas profile`` runs in its own). ``progress`` gets one line per
    measurement (None: silent). ``device_memory`` (bytes) overrides the memory read from
    the machine. ``elementwise=False`` skips the reference blocks' training steps: the FLOP
    rate is then the matmul's and there is no elementwise rate (the cluster prices every op
    by its FLOPs at the matmul rate, as the paper). ``widths=False`` skips the matmul
    stacks of several widths: every matrix multiply is then priced at the one FLOP rate
    (no ``device_width_efficiency``).
    """
    start = time.perf_counter()
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        raise ValueError(f"devices={devices!r}: a collective needs at least 2 devices")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 3:
        raise ValueError(f"repeats={repeats!r}: at least 3 timed calls per point are needed")
    sizes = sorted(set(DEFAULT_SIZES if sizes is None else sizes))
    if len(sizes) < 2:
        raise ValueError(f"sizes={sizes}: a line needs at least two message sizes")
    kinds = [Collective.parse(k) for k in (primitives or PRIMITIVES)]
    if Collective.ALL_REDUCE not in kinds:
        kinds.insert(0, Collective.ALL_REDUCE)
    say = progress or (lambda line: None)
    strategy = make_strategy(devices, device_type=device_type)
    names = list(strategy.extended.worker_devices)
    nodes = process_count()
    timer = _Timer(strategy, sync=nodes > 1)
    w = timer.w
    local = ", ".join(n.split("/")[-1] for n in names)
    say(f"profiling on {w} devices "
        + (f"({local})" if nodes == 1 else f"in {nodes} worker processes ({local} in each)")
        + f", {len(sizes)} sizes x {len(kinds)} primitives, {repeats} repeats each")
    say(f"{'primitive':<15} {'N bytes':>12} {'chain':>5} {'one call ms':>11} "
        f"{'collective ms':>13} {'ring GB/s':>9}")
    rows = []
    for kind in kinds:
        for nbytes in sizes:
            # a chain no slower than one call is noise: again, up to 3 attempts (once in
            # worker processes, which must all make the same calls: it is then left out)
            for attempt in range(1, 2 if timer.sync else 4):
                row = _measure_collective(timer, kind, nbytes, repeats)
                row["attempts"] = attempt
                if row["seconds"] > 0:
                    break
            rows.append(row)
            rate = row["ring_bytes"] / row["seconds"] / 1e9 if row["seconds"] > 0 else 0.0
            say(f"{kind.long_name:<15} {row['bytes']:>12,} {row['chain']:>5} "
                f"{row['call_1_s'] * 1e3:>11.3f} {row['seconds'] * 1e3:>13.3f} {rate:>9.3f}")
    notes = []
    usable = [r for r in rows if r["seconds"] > 0]
    dropped = [f"{r['kind']} {r['bytes']:,} B" for r in rows if r["seconds"] <= 0]
    if dropped:
        notes.append(f"left out of the fits, the chain was no slower than one call in 3 "
                     f"attempts (noise larger than the collective): {', '.join(dropped)}")
    try:
        fits = fit_collectives(usable, w)
    except FitError as e:
        raise RuntimeError(f"the measurements on {w} devices give no fit: {e}. The machine "
                           f"may be busy (load {os.getloadavg()[0]:.1f}): measure again with "
                           "more repeats or larger sizes") from None

    for kind, f in fits.items():
        bad = [f"{x / ring_factor(kind, w):,.0f} B ({r:+.0%})"
               for (x, _), r in zip(f.fit.points, f.fit.relative_residuals) if abs(r) > 0.5]
        if bad:
            notes.append(f"{kind.long_name}: the line misses these sizes by more than 50 % "
                         f"({', '.join(bad)}): noise from other processes, or a time that is "
                         "not linear in N there (see the residual plot)")

    compute: dict[str, Any] = {"matmul": _matmul_rate(timer, matmul_n, repeats, names)}
    mm = compute["matmul"]
    say(f"matmul {matmul_n}^2: {mm['seconds_all_devices'] * 1e3:.1f} ms with all devices, "
        f"{mm['flop_per_s_per_device'] / 1e9:.2f} GFLOP/s per device")
    if conv:
        compute["conv"] = _conv_rate(timer, repeats)
        say(f"conv 3x3 {compute['conv']['shape']}: "
            f"{compute['conv']['flop_per_s_per_device'] / 1e9:.2f} GFLOP/s per device")
    flop_rate = mm["flop_per_s_per_device"]
    if not flop_rate > 0:
        raise RuntimeError(f"matmul {matmul_n}^2 took no longer than an empty call "
                           f"({mm['seconds_all_devices']} s): use a larger matmul_n")
    table = None
    if widths:
        compute["widths"] = _width_rates(timer, repeats)
        eff = compute["widths"]["efficiency"]
        if eff is None:
            notes.append(f"FLOP rate by width not measured ({compute['widths']['error']}): "
                         "every matrix multiply priced at one rate")
        else:
            table = {int(k): v for k, v in eff.items()}
            say("matmul FLOP rate by width, of the fastest: " + ", ".join(
                f"{w}: {e:.2f}" for w, e in table.items()))
    compute_fit = None
    if elementwise:
        rates, compute_fit = _compute_rates(timer, repeats, widths=table)
        compute["blocks"] = rates
        if compute_fit is None:
            notes.append(f"compute rates not fitted ({rates['error']}): the FLOP rate is the "
                         "matmul's and memory-bound ops stay priced by their FLOPs at it")
        else:
            say(f"training steps of {len(rates['points'])} reference blocks: "
                f"{compute_fit.dense_rate / 1e9:.2f} GFLOP/s (matmuls, convolutions) and "
                f"{compute_fit.elementwise_rate / 1e9:.2f} G elements/s (memory-bound ops) "
                f"per device with all devices, R^2 {compute_fit.r2:.3f}")

    gamma_fit = None
    if gamma:
        trials = []
        for nbytes in (MIB, 4 * MIB):
            t = _overlap_trial(timer, nbytes, flop_rate, repeats)
            trials.append(t)
            say(f"overlap {t['bytes'] / MIB:.1f} MiB all-reduce beside {t['matmuls']} matmuls "
                f"{t['matmul_n']}^2: empty {t['empty'] * 1e3:.2f} ms, all-reduce "
                f"{t['comm'] * 1e3:.2f} ms, compute {t['compute'] * 1e3:.2f} ms, both "
                f"{t['both'] * 1e3:.2f} ms")
        gamma_fit = fit_gamma(trials)
        if gamma_fit is None:
            notes.append(f"gamma not measured: in every overlap trial the all-reduce or the "
                         f"compute took no longer than an empty call (noise); the prior "
                         f"{DEFAULT_GAMMA} stays in force")
    else:
        notes.append(f"gamma not measured: the prior {DEFAULT_GAMMA} stays in force")

    memory_source = "given"
    if device_memory is None:
        device_memory, memory_source = _device_memory(names)
        if device_memory <= 0:
            raise RuntimeError(f"device memory {memory_source}: pass device_memory=BYTES")
    kind_name = "gpu" if "GPU" in names[0].upper() else "cpu"
    where = "GPUs" if kind_name == "gpu" else "logical CPU devices"
    if nodes > 1:
        where = (f"{'GPUs' if kind_name == 'gpu' else 'CPU devices'} in {nodes} "
                 "MultiWorkerMirroredStrategy worker processes")
    date = datetime.date.today().isoformat()
    cluster = profiled_cluster(f"profiled-{kind_name}", fits, device_memory, flop_rate,
                               gamma_fit, where, date, nodes=nodes, compute=compute_fit,
                               width_efficiency=table)
    cluster = dataclasses.replace(cluster, sources={
        **cluster.sources, "device_memory": f"{memory_source} ({device_memory / 2**30:.1f} GiB)"})
    return Profile(cluster, fits, rows, compute, gamma_fit, names,
                   time.perf_counter() - start, date, notes, tf.__version__)
