"""``tapas profile``: measure this machine's collectives and compute, fit the cost model.

In:  a device count W (logical CPU devices, or the GPUs when at least W are present:
     ``tapas.execution.runtime.devices.make_strategy``; or, in a process whose ``TF_CONFIG`` names
     K workers, the K workers' devices under ``MultiWorkerMirroredStrategy``: ``tapas
     profile --workers=K`` starts them on 127.0.0.1), message sizes, repeats.
Out: a :class:`Profile`: one row per (primitive, size) measured, the fits of
     ``tapas.execution.calibration.fitting`` (alpha', beta, epsilon per primitive with R^2), the
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
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.calibration.compute_rates import (compute_rates, conv_rate,
                                                       matmul_rate, width_rates)
from tapas.execution.calibration.fitting import (KIB, MIB, FitError, Profile, fit_collectives,
                                                 fit_gamma, parse_sizes, profiled_cluster)
from tapas.execution.calibration.timing import Timer, run_collective
from tapas.execution.program.collectives import ReplicaContextCollectives
from tapas.execution.runtime.devices import make_strategy, process_count
from tapas.planning.cost import DEFAULT_GAMMA, ring_factor
from tapas.sharding.placements import Collective

__all__ = ["profile", "Profile", "parse_sizes", "DEFAULT_SIZES", "PRIMITIVES"]

#: 1 KiB to 16 MiB by factors of 4 (8 sizes)
DEFAULT_SIZES: tuple[int, ...] = tuple(KIB * 4 ** i for i in range(8))
PRIMITIVES: tuple[Collective, ...] = (Collective.ALL_REDUCE, Collective.ALL_GATHER,
                                      Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL)

Progress = Callable[[str], None]


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

def _measure_collective(timer: Timer, kind: Collective, nbytes: int,
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

def _overlap_trial(timer: Timer, nbytes: int, flop_rate: float,
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
        return tf.reshape(run_collective(coll, Collective.ALL_REDUCE, v, full), [-1])[:1], \
            timer.done(tf.reshape(wm, [-1])[:1])

    def replica_compute(v, wm):
        return tf.reshape(v, [-1])[:1], compute(wm)

    def replica_both(v, wm):
        coll = ReplicaContextCollectives(timer.w, timer.audit)
        return tf.reshape(run_collective(coll, Collective.ALL_REDUCE, v, full), [-1])[:1], \
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


def _collectives(timer: Timer, kinds: Sequence[Collective], sizes: Sequence[int],
                 repeats: int, say: Progress) -> tuple[list[dict[str, Any]], Any, list[str]]:
    """Every (primitive, size) timed, the lines fitted through them, and notes on the
    points left out or missed by more than 50 %."""
    w = timer.w
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
    return rows, fits, notes


def _compute(timer: Timer, repeats: int, names: list[str], say: Progress, notes: list[str], *,
             matmul_n: int, conv: bool, widths: bool, elementwise: bool
             ) -> tuple[dict[str, Any], dict[int, float] | None, Any]:
    """The compute measurements (matmul, convolution, FLOP rate by width, the reference
    blocks' fitted rates), the width efficiency table and the compute fit (None when not
    measured or not fitted; ``notes`` says why)."""
    compute: dict[str, Any] = {"matmul": matmul_rate(timer, matmul_n, repeats, names)}
    mm = compute["matmul"]
    say(f"matmul {matmul_n}^2: {mm['seconds_all_devices'] * 1e3:.1f} ms with all devices, "
        f"{mm['flop_per_s_per_device'] / 1e9:.2f} GFLOP/s per device")
    if conv:
        compute["conv"] = conv_rate(timer, repeats)
        say(f"conv 3x3 {compute['conv']['shape']}: "
            f"{compute['conv']['flop_per_s_per_device'] / 1e9:.2f} GFLOP/s per device")
    flop_rate = mm["flop_per_s_per_device"]
    if not flop_rate > 0:
        raise RuntimeError(f"matmul {matmul_n}^2 took no longer than an empty call "
                           f"({mm['seconds_all_devices']} s): use a larger matmul_n")
    table = None
    if widths:
        compute["widths"] = width_rates(timer, repeats)
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
        rates, compute_fit = compute_rates(timer, repeats, widths=table)
        compute["blocks"] = rates
        if compute_fit is None:
            notes.append(f"compute rates not fitted ({rates['error']}): the FLOP rate is the "
                         "matmul's and memory-bound ops stay priced by their FLOPs at it")
        else:
            say(f"training steps of {len(rates['points'])} reference blocks: "
                f"{compute_fit.dense_rate / 1e9:.2f} GFLOP/s (matmuls, convolutions) and "
                f"{compute_fit.elementwise_rate / 1e9:.2f} G elements/s (memory-bound ops) "
                f"per device with all devices, R^2 {compute_fit.r2:.3f}")
    return compute, table, compute_fit


def _gamma(timer: Timer, flop_rate: float, repeats: int, say: Progress,
           notes: list[str]) -> Any:
    """Gamma from overlap trials at 1 and 4 MiB (None, with a note, when noise hid it)."""
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
    return gamma_fit


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
    timer = Timer(strategy, sync=nodes > 1)
    w = timer.w
    local = ", ".join(n.split("/")[-1] for n in names)
    say(f"profiling on {w} devices "
        + (f"({local})" if nodes == 1 else f"in {nodes} worker processes ({local} in each)")
        + f", {len(sizes)} sizes x {len(kinds)} primitives, {repeats} repeats each")
    rows, fits, notes = _collectives(timer, kinds, sizes, repeats, say)
    compute, table, compute_fit = _compute(timer, repeats, names, say, notes, matmul_n=matmul_n,
                                           conv=conv, widths=widths, elementwise=elementwise)
    flop_rate = compute["matmul"]["flop_per_s_per_device"]
    gamma_fit = _gamma(timer, flop_rate, repeats, say, notes) if gamma else None
    if not gamma:
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
