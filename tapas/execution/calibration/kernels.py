"""Time the kernels a model's patterns run, for ``CostOptions.kernel_times`` (``"K"``).

In:  kernel keys (``tapas.planning.kernel_times.graph_kernels``: every contraction and
     convolution of a captured graph, at its local operand shapes under each of its
     patterns on N devices), a ``tf.distribute`` strategy of N replicas (logical CPU
     devices, GPUs, or worker processes), repeats.
Out: :class:`tapas.planning.kernel_times.KernelTimes` -- per key, the seconds of one
     training step of that op on one device while all N compute theirs at once: the
     forward op and the gradient of each floating-point operand (``tf.GradientTape``, so
     the backward kernels TensorFlow runs for it in a model: a convolution's
     ``Conv2DBackpropInput`` and ``Conv2DBackpropFilter``, a matmul's two matmuls).

How: per key, one function runs ``copies`` independent instances of the step (each on
its own operands, so nothing is shared or merged between them) and another runs none (the
same operands handed back); both are called in turn ``repeats`` times after a warm-up call
(more while a round took under 0.4 s, as ``tapas profile`` does), and the kernel's time is
(fastest call with the copies - fastest empty call) / copies: the dispatch every call pays
cancels. An op TensorFlow cannot build from its key (a type ``tf.raw_ops`` lacks, an
operand that is not a floating-point tensor) is reported in ``KernelTimes.failed`` and
keeps the cost model's rates.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.runtime.devices import process_count
from tapas.execution.calibration.timing import Timer
from tapas.planning.kernel_times import KernelTimes
from tapas.sharding.patterns.kernels import parse_kernel_key

__all__ = ["measure_kernels", "build_kernel", "check_kernel_times", "resolve_kernel_times"]

Progress = Callable[[str], None]


def build_kernel(key: str) -> tuple[Callable[..., tf.Tensor], list[list[int]], tf.DType]:
    """``(op(*operands) -> output, operand shapes, dtype)`` for a kernel key; ValueError
    (saying why) when ``tf.raw_ops`` cannot run it."""
    d = parse_kernel_key(key)
    op_type, attrs, shapes = d["op"], dict(d["attrs"]), [list(s) for s in d["shapes"]]
    fn = getattr(tf.raw_ops, op_type, None)
    if fn is None:
        raise ValueError(f"tf.raw_ops has no op {op_type!r}")
    dtype = tf.as_dtype(d["dtype"])
    if not dtype.is_floating:
        raise ValueError(f"{op_type} of dtype {dtype.name}: only floating-point kernels are "
                         "timed (they are the ones with gradients)")
    params = inspect.signature(fn).parameters
    names = [p for p in params if p != "name" and p not in attrs]
    kwargs = {k: v for k, v in attrs.items() if k in params}
    if op_type == "Einsum":
        def run(*xs: tf.Tensor) -> tf.Tensor:
            return fn(inputs=list(xs), **kwargs)
    else:
        if len(names) < len(shapes):
            raise ValueError(f"{op_type} takes {names} but its key has {len(shapes)} operands")

        def run(*xs: tf.Tensor) -> tf.Tensor:
            return fn(**dict(zip(names, xs)), **kwargs)
    return run, shapes, dtype


def _values(strategy: tf.distribute.Strategy, shape: Sequence[int], dtype: tf.DType) -> Any:
    """Per-replica tensors of ``shape`` and ``dtype`` (small values: a product of a few
    operands stays finite in every floating-point dtype)."""
    def make(ctx: Any) -> tf.Tensor:
        return tf.fill(list(shape), tf.constant(0.01 * (ctx.replica_id_in_sync_group + 1),
                                                dtype))
    return strategy.experimental_distribute_values_from_function(make)


def _step(run: Callable[..., tf.Tensor], xs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The op's output and the gradient of each operand (the output as its own cotangent:
    no extra op)."""
    with tf.GradientTape() as tape:
        tape.watch(list(xs))
        y = run(*xs)
    return [y, *tape.gradient(y, list(xs), output_gradients=y)]


def measure_kernels(keys: Iterable[str], strategy: tf.distribute.Strategy, *,
                    repeats: int = 3, copies: int = 2,
                    progress: Progress | None = print) -> KernelTimes:
    """Time every kernel of ``keys`` on ``strategy``'s replicas (module docstring)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: at least 1 timed call per kernel")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies={copies!r}: at least 1 instance per timed call")
    keys = list(dict.fromkeys(keys))
    # one new function per kernel is the point here, not a retracing mistake: TensorFlow's
    # warning about it is silenced while they are timed
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        return _measure(keys, strategy, repeats, copies, progress)
    finally:
        logger.setLevel(level)


def _measure(keys: list[str], strategy: tf.distribute.Strategy, repeats: int, copies: int,
             progress: Progress | None) -> KernelTimes:
    say = progress or (lambda line: None)
    timer = Timer(strategy, sync=process_count() > 1)
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    start = time.perf_counter()
    for i, key in enumerate(keys):
        if i and i % 10 == 0:
            say(f"kernels: {i}/{len(keys)} timed ({time.perf_counter() - start:.0f} s)")
        try:
            run, shapes, dtype = build_kernel(key)
        except (ValueError, TypeError) as e:
            failed[key] = str(e)
            continue
        operands = [[_values(strategy, s, dtype) for s in shapes] for _ in range(copies)]
        flat = [x for xs in operands for x in xs]

        def with_copies(*args: tf.Tensor) -> tf.Tensor:
            outs = []
            for c in range(copies):
                outs += _step(run, args[c * len(shapes):(c + 1) * len(shapes)])
            return timer.step_result(outs)

        def empty(*args: tf.Tensor) -> tf.Tensor:
            return timer.step_result(list(args))

        try:
            full, none = timer.timed([timer.function(with_copies), timer.function(empty)],
                                     flat, repeats)
        except (tf.errors.OpError, ValueError, TypeError) as e:
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            continue
        seconds[key] = max(min(full) - min(none), 0.0) / copies
    say(f"kernels: {len(seconds)} of {len(keys)} timed, {len(failed)} left to the rates "
        f"({time.perf_counter() - start:.0f} s)")
    return KernelTimes(seconds, strategy.num_replicas_in_sync, failed,
                       source=f"tapas.execution.calibration.kernels.measure_kernels(repeats={repeats}, "
                              f"copies={copies})")


def check_kernel_times(value: str, cluster_name: str, num_devices: int) -> KernelTimes | None:
    """``--kernel_times`` checked before anything is measured: None for ``"measure"``, else
    the times in the file an earlier ``measure`` wrote (it must exist and be for
    ``num_devices`` devices). Kernel times are this machine's, priced beside the cluster's
    rates, so a preset ``cluster_name`` (another machine's datasheet) is refused.
    ValueError names the value and the fix."""
    from tapas.planning.cost import CLUSTER_PRESETS
    if cluster_name in CLUSTER_PRESETS:
        raise ValueError(f"kernel times are measured on this machine's devices and priced "
                         f"beside the cluster's rates, and the cluster {cluster_name!r} is a "
                         "preset, not this machine: profile it (tapas profile --devices=N "
                         "--out=cluster.json) and pass --cluster=cluster.json")
    if str(value).strip().lower() == "measure":
        return None
    path = str(value)
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r}: give 'measure' or the kernel-times JSON an "
                         "earlier --kernel_times=measure wrote")
    try:
        times = KernelTimes.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a kernel-times file ({type(e).__name__}: {e}): give one "
                         "that --kernel_times=measure wrote") from None
    if times.num_devices != num_devices:
        raise ValueError(f"its kernels were timed on {times.num_devices} devices, the "
                         f"cluster has {num_devices}: measure again (--kernel_times=measure)")
    return times


def resolve_kernel_times(value: str, graph: Any, cluster: Any, cluster_name: str,
                         make_strategy: Callable[[int], tf.distribute.Strategy],
                         save_to: str | None = None,
                         progress: Progress | None = print) -> KernelTimes:
    """``--kernel_times`` of ``tapas search``: the file's times, or (``"measure"``) every
    kernel of ``graph``'s patterns on the cluster's N devices timed here
    (:func:`measure_kernels` on ``make_strategy(N)``), written to ``save_to`` when given so
    a later search can reuse them. A file's kernels that ``graph`` does not run are
    ignored; kernels it runs that the file lacks keep the cost model's rates."""
    from tapas.planning.kernel_times import graph_kernels
    n = cluster.num_devices
    given = check_kernel_times(value, cluster_name, n)
    if given is not None:
        return given
    keys = graph_kernels(graph, n)
    say = progress or (lambda line: None)
    say(f"timing the {len(keys)} kernels of the model's patterns on {n} devices "
        "(--kernel_times=measure)")
    times = measure_kernels(keys, make_strategy(n), progress=progress)
    if save_to:
        folder = os.path.dirname(save_to)
        if folder:
            os.makedirs(folder, exist_ok=True)
        times.save(save_to)
        say(f"kernel times written to {save_to} (reuse: --kernel_times={save_to})")
    return times
