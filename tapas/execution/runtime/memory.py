"""Memory per device and per worker: the plan's prediction beside the measured peak.

In:  a ParallelModel (its plan, graph, runtime and strategy); every worker calls
     :func:`memory_report` (it all-reduces one small vector).
Out: :class:`MemoryReport`: per replica the plan's predicted bytes per device
     (``tapas.planning.explore.plan_memory``, or the searched Strategy's own estimate, with
     the runtime's optimizer slots), the measured peak (on CPU devices the process's peak
     resident set size, ``/proc/self/status`` VmHWM or ``getrusage``; on GPUs the
     device's peak from ``tf.config.experimental.get_memory_info``), the worker and the
     process's peak RSS; ``table()`` and ``to_json()``. :func:`peak_rss_bytes` is the
     process's peak RSS alone.
Raises: nothing of its own (a device whose memory TensorFlow cannot report is measured by
     its process's RSS).
Also :func:`release_free_heap`: the C heap's free pages given back to the system, which
the runtime calls when one of its functions has traced (before its first run, and after
the call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import resource
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["MemoryReport", "memory_report", "peak_rss_bytes", "predicted_bytes",
           "release_free_heap", "RELEASE_HEAP_ENV"]

# set to 0 to keep the C heap's free pages (release_free_heap does nothing)
RELEASE_HEAP_ENV = "TAPAS_RELEASE_HEAP"


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (VmHWM; ru_maxrss where /proc is
    absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the pages the C heap holds free back to the system (glibc's ``malloc_trim(0)``,
    every arena); False where the C library has no such call or ``TAPAS_RELEASE_HEAP=0``.

    Tracing a step and instantiating it (the trace, Grappler's passes, the executor's
    kernels) allocates and frees a lot of small C memory. glibc keeps those pages; the
    tensors cannot reuse them (TensorFlow keeps its tensors in its own pool), so they
    would stay in the process's resident set beside the tensors' peak of the next steps
    (docs/internals.md, *Memory*). Costs a walk over the heap's free lists (2-3 ms on
    t5-small's worker): the runtime calls it only when one of its functions traced."""
    if os.environ.get(RELEASE_HEAP_ENV, "1").strip() == "0":
        return False
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _device_peak(device: str) -> int | None:
    """An accelerator's peak bytes in use, or None on CPU devices (TensorFlow's CPU
    allocator does not track them without a flag)."""
    name = device.rsplit("/", 1)[-1] if "/device:" in device else device
    if "CPU" in name.upper():
        return None
    try:
        return int(tf.config.experimental.get_memory_info(name.replace("device:", ""))["peak"])
    except (ValueError, tf.errors.OpError):
        return None


def predicted_bytes(pm: Any) -> tuple[float, dict[str, float]]:
    """The plan's memory per device and its parts (weights, gradients, optimizer,
    activations), the optimizer term counted with the runtime's slots per trainable weight
    (Adam 2, momentum SGD 1, SGD 0, ...)."""
    from tapas.planning.cost import Cluster, CostOptions, MemoryEstimate
    rt = pm.runtime
    estimate = getattr(pm.strategy, "memory", None)
    if not isinstance(estimate, MemoryEstimate):
        estimate = pm.__dict__.get("_tapas_plan_memory")   # priced once per ParallelModel
    if not isinstance(estimate, MemoryEstimate):
        from tapas.planning.explore import plan_memory
        from tapas.planning.table import pattern_table
        n = pm.program.num_devices
        cluster = Cluster.loopback_cpu(n)
        table = pattern_table(pm.graph, n, cluster,
                              CostOptions.for_cluster(cluster, optimizer="sgd"))
        plan = pm.program.plan
        try:
            estimate = plan_memory(pm.graph, table, [
                table.index(node.id, plan.pattern(node).name) for node in pm.graph.nodes])
        except KeyError:   # a pattern of another generator (nested experts): the shards
            estimate = _shard_memory(rt)
        pm.__dict__["_tapas_plan_memory"] = estimate
    slots = len(rt.optimizer.slot_names)
    parts = {"weights": estimate.weights, "gradients": estimate.gradients,
             "optimizer": estimate.gradients * slots, "activations": estimate.activations}
    return float(sum(parts.values())), parts


def _shard_memory(rt: Any) -> Any:
    """The runtime's shards per device (weights, and gradients of the trainable ones);
    activations not predicted."""
    from tapas.planning.cost import MemoryEstimate
    weights = gradients = 0.0
    for path, spec in rt.specs.items():
        b = float(np.prod(spec.local_shape)) * tf.as_dtype(spec.dtype).size
        weights += b
        gradients += b if spec.trainable else 0.0
    return MemoryEstimate(weights=weights, gradients=gradients)


@dataclasses.dataclass
class MemoryReport:
    """Per replica (global id order): its worker, the predicted and measured bytes."""

    predicted: float                    # per device, from the plan
    parts: dict[str, float]             # weights, gradients, optimizer, activations
    workers: list[int]                  # the worker of each replica
    measured: list[float]               # each replica's device peak (its process's RSS on CPU)
    process_rss: list[float]            # the peak RSS of each replica's process
    on_cpu: bool

    def per_worker(self) -> list[dict[str, Any]]:
        """One row per worker: its devices, the plan's prediction for them together, its
        process's peak RSS and (on GPUs) its devices' peaks."""
        rows = []
        for w in sorted(set(self.workers)):
            ids = [r for r, k in enumerate(self.workers) if k == w]
            rows.append({"worker": w, "devices": len(ids),
                         "predicted_bytes": self.predicted * len(ids),
                         "peak_rss_bytes": self.process_rss[ids[0]],
                         "device_peak_bytes": None if self.on_cpu
                         else [self.measured[r] for r in ids]})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"predicted_per_device_bytes": self.predicted, "parts": self.parts,
                "on_cpu": self.on_cpu, "workers": self.per_worker()}

    def table(self) -> str:
        mib = 2.0 ** 20
        head = ("memory (the plan's prediction vs the measured peak; on CPU devices the "
                "peak resident set of the worker's process, TensorFlow's runtime included):")
        lines = [head, f"{'worker':>6} {'devices':>7} {'predicted MiB':>14} "
                       f"{'peak RSS MiB':>13}" + ("" if self.on_cpu else "  device peaks MiB")]
        for row in self.per_worker():
            peaks = "" if self.on_cpu else "  " + ", ".join(
                f"{b / mib:.1f}" for b in row["device_peak_bytes"])
            lines.append(f"{row['worker']:>6} {row['devices']:>7} "
                         f"{row['predicted_bytes'] / mib:>14.1f} "
                         f"{row['peak_rss_bytes'] / mib:>13.1f}{peaks}")
        parts = ", ".join(f"{k} {v / mib:.2f}" for k, v in self.parts.items())
        lines.append(f"per device the plan predicts {self.predicted / mib:.2f} MiB ({parts})")
        return "\n".join(lines)


def memory_report(pm: Any) -> MemoryReport:
    """Every worker's measurements, gathered by one all-reduce of a vector with a slot per
    replica (each replica fills its own); every worker must call it."""
    rt = pm.runtime
    strategy = rt.strategy
    n = rt.num_replicas
    local = rt.local_replicas
    rss = float(peak_rss_bytes())
    own: dict[int, np.ndarray] = {}
    for r in local:
        peak = _device_peak(rt._device[r])
        vec = np.zeros(3 * n, np.float64)
        vec[r] = (rss if peak is None else peak) / 1024.0
        vec[n + r] = rss / 1024.0
        vec[2 * n + r] = float(rt.task_id) + 1.0
        own[r] = vec
    cpu = all(_device_peak(rt._device[r]) is None for r in local)
    if len(local) == n:
        total = sum(own.values())
    else:
        held = {}   # a collective refuses a tensor with no device: a variable on each
        for r in local:
            with tf.device(rt._device[r]):
                held[r] = tf.Variable(own[r].astype(np.float32), trainable=False)
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: held[ctx.replica_id_in_sync_group])

        def fn(v: Any) -> tf.Tensor:
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM,
                                                                  v.read_value())

        result = tf.function(lambda v: strategy.run(fn, args=(v,)), autograph=False)(values)
        total = strategy.experimental_local_results(result)[0].numpy().astype(np.float64)
    predicted, parts = predicted_bytes(pm)
    return MemoryReport(predicted, parts,
                        [int(round(w)) - 1 for w in total[2 * n:]],
                        [float(b) * 1024.0 for b in total[:n]],
                        [float(b) * 1024.0 for b in total[n:2 * n]], bool(cpu))
