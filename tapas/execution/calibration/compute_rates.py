"""The compute rates of ``tapas profile``: matmul, convolution, matmul FLOP rate by width,
and the two rates of the cost model fitted to training steps of reference blocks.

In:  a :class:`tapas.execution.calibration.timing.Timer` on the devices, repeats.
Out: JSON-ready records (seconds, FLOPs, FLOP/s per device) and, for the reference blocks,
     the :class:`tapas.execution.calibration.fitting.ComputeFit` of the dense FLOP rate and
     the elementwise rate (None, with the record's ``error``, when the fit fails).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.calibration.fitting import ComputeFit, FitError, fit_compute
from tapas.execution.calibration.timing import Timer
from tapas.planning.widths import effective_flops

__all__ = ["matmul_rate", "conv_rate", "width_rates", "compute_rates", "REFERENCE_BLOCKS",
           "WIDTHS"]


def matmul_rate(timer: Timer, n: int, repeats: int, devices: list[str]) -> dict[str, Any]:
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


def conv_rate(timer: Timer, repeats: int) -> dict[str, Any]:
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


def width_rates(timer: Timer, repeats: int, widths: Sequence[int] = WIDTHS
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


def compute_rates(timer: Timer, repeats: int, backward_factor: float = 2.0,
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
    :func:`tapas.execution.calibration.fitting.fit_compute` fits both rates at once. The record (the
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
