"""Benchmark: peak memory per worker on 1, 2 and 4 workers beside the plan's prediction.

    python benchmarks/bench_memory.py [--model=t5-small] [--workers=1,2,4]
        [--budget_gib=1.8] [--baseline=t5-tiny] [--steps=2] [--json_out=PATH]
    python benchmarks/bench_memory.py --phases [--tf_peak] [--model=t5-small] [--steps=3]

For each worker count K, ``tapas train --model=MODEL --workers=K --steps=STEPS
--memory_budget_gib=BUDGET/K`` (the search made to fit the model's training state into K
devices, the budget raised by 25 % steps when no plan fits it; the zoo model built with its weights unallocated, each worker creating only its
shards: ``tapas.execution.runtime.materialize``) and its memory report (``tapas.execution.runtime.memory``):
per worker the plan's predicted bytes for its device and the peak resident set of its
process. The bound each worker should stay within: the prediction plus the runtime's fixed
overhead (the peak RSS of ``--baseline``, a tiny model, on one worker, minus its own
prediction) plus the model's largest single weight (what materialization holds at once).
Beside it, the same bound with the tiny model's overhead measured on the same number of
workers (the multi-worker runtime's own: its server, collectives and their buffers), as
``bound_same_workers_bytes``.
Prints a table and writes JSON (default ``benchmarks/results/bench_memory_<model>.json``,
with the date, the CPU count, the 1-minute load average at the start and the end, and the
workers' ``MALLOC_ARENA_MAX``: the launcher's default unless this environment sets one, and
``TAPAS_RELEASE_HEAP``: 0 when the runtime kept the C heap's free pages).
``--phases``: where a worker's memory goes, in one process on one device: the resident set
after each phase and glibc's heap (bytes in use, the arenas' size: ``mallinfo2``), with
``--tf_peak`` also the bytes TensorFlow's tensors hold, and the traced step's operations
and the first step's seconds, the bytes of Python's objects after each phase, and the
resident set by kind of mapping after the last step (JSON
``bench_memory_phases_<model>.json``); with
``--own_updates`` every weight's optimizer update traced on its own inside the step, as
before ``weight_updates.Updates`` shared them (to compare the two in one sitting);
``--optimizer`` and ``--global_clipnorm`` another optimizer than the zoo model's.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2.0 ** 20


def _train(model: str, workers: int, steps: int, budget: float | None) -> dict:
    """One ``tapas train`` run's report (its memory rows, the time it took)."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [sys.executable, "-m", "tapas.cli", "train", f"--model={model}",
            f"--workers={workers}", f"--steps={steps}", f"--json_out={out}"]
    if budget is not None:
        argv.append(f"--memory_budget_gib={budget}")
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    with open(out) as f:
        report = json.load(f)
    os.unlink(out)
    report["wall_seconds"] = time.perf_counter() - start
    return report


def _overhead(baseline: str, workers: int, steps: int) -> float:
    """The runtime's fixed overhead on ``workers`` workers: the largest peak RSS of a
    worker of the tiny ``baseline`` model minus its prediction."""
    report = _train(baseline, workers, steps, None)["memory"]
    return max(w["peak_rss_bytes"] - w["predicted_bytes"] for w in report["workers"])


def _largest_weight(model: str) -> int:
    """The model's largest single weight in bytes (from shapes; nothing allocated)."""
    import numpy as np

    from tapas import models
    from tapas.execution.runtime import materialize
    entry = models.get(model)
    built = materialize.build_lazily(lambda: entry.build(seed=0))
    return max(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in built.weights)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_mib() -> dict[str, float]:
    """glibc's heap over all its arenas (``mallinfo2``): the bytes in use and the arenas'
    size, in MiB (not the blocks it maps on their own, where large tensors live); empty
    where the C library has no ``mallinfo2``."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    info.restype = _MallInfo2
    got = info()
    return {"heap_in_use_mib": round(got.uordblks / MIB, 1),
            "arenas_mib": round(got.arena / MIB, 1)}


def _python_mib() -> float | None:
    """The bytes Python's own allocator holds in its arenas (``sys._debugmallocstats``),
    MiB: the Python objects (traced graphs' operations, the IR, Keras's layers)."""
    import re
    with tempfile.TemporaryFile("w+") as out:   # it writes to the C stderr
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        found = re.search(r"^Total\s*=\s*([\d,]+)", out.read(), re.M)
    return None if found is None else round(int(found.group(1).replace(",", "")) / MIB, 1)


def _resident_by_mapping() -> dict[str, float]:
    """The resident set by kind of mapping (``/proc/self/smaps``), MiB: TensorFlow's
    libraries, the brk heap (glibc's main arena), anonymous mappings of 64 MiB and more
    (TensorFlow's tensor pool regions, glibc's other arenas) and of less (Python's arenas,
    blocks glibc maps on their own, thread stacks), other files."""
    got: dict[str, float] = {}
    kind = "other files"
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                name = fields[5] if len(fields) > 5 else ""
                kind = ("tensorflow's libraries" if "tensorflow" in name else
                        "brk heap" if name == "[heap]" else
                        "other files" if name else
                        "anonymous >= 64 MiB" if end - start >= 64 << 20 else
                        "anonymous < 64 MiB")
            elif fields[0] == "Rss:":
                got[kind] = got.get(kind, 0.0) + int(fields[1]) / 1024.0
    return {k: round(v, 1) for k, v in sorted(got.items())}


def _rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line[:5]] = int(line.split()[1]) / 1024.0
    return got["VmRSS"], got["VmHWM"]


def _optimizer(entry: object, name: str | None, global_clipnorm: float | None) -> object:
    """The zoo model's optimizer, or ``name`` (a Keras name or a JSON config file), with
    ``global_clipnorm`` set when given."""
    from tapas.execution.training import keras_optimizer
    opt = (entry.keras_optimizer() if name is None else keras_optimizer.resolve_optimizer(
        keras_optimizer.optimizer_from_flag("--optimizer", name)))
    if global_clipnorm is not None:
        opt = type(opt).from_config(opt.get_config() | {"global_clipnorm": global_clipnorm})
    return opt


def phases(model: str, budget: float, steps: int, tf_peak: bool,
           own_updates: bool = False, optimizer: str | None = None,
           global_clipnorm: float | None = None) -> list[dict]:
    """One process, one device: the resident set after each phase of ``tapas train`` (TF
    started, the lazy build, capture, search, the shards, the optimizer slots, each step),
    sampled by wrapping the functions that do them. ``tf_peak``: TensorFlow's CPU
    allocator made a BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC``), whose bytes in use by
    tensors (now and at their peak) are reported beside the resident set."""
    if tf_peak:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"   # before TensorFlow starts
    from tapas.execution.runtime import devices
    devices.setup_devices(1)
    import tensorflow as tf

    from tapas import models
    from tapas.execution.runtime import materialize, shards
    from tapas.execution.api import parallel
    from tapas.execution.training import weight_updates
    if own_updates:   # no kind shared: every weight's update inline, as before
        weight_updates.Updates.kind = lambda self, path, grad, decided: None
    rows: list[dict] = []

    def mark(name: str) -> None:
        rss, hwm = _rss_mib()
        row = {"phase": name, "rss_mib": round(rss, 1), "peak_mib": round(hwm, 1),
               **_malloc_mib(), "python_mib": _python_mib()}
        if tf_peak:
            info = tf.config.experimental.get_memory_info("CPU:0")
            row.update(tensors_mib=round(info["current"] / MIB, 1),
                       tensors_peak_mib=round(info["peak"] / MIB, 1))
        rows.append(row)
        print(f"{name:>24} {rss:>9.1f} {hwm:>9.1f} {row.get('heap_in_use_mib', 0):>9.1f} "
              f"{row.get('arenas_mib', 0):>9.1f} {row['python_mib'] or 0:>9.1f}" + (
                  f" {row['tensors_mib']:>12.1f} {row['tensors_peak_mib']:>13.1f}" if tf_peak
                  else ""), flush=True)

    def wrapped(module: object, name: str) -> None:
        original = getattr(module, name)

        def call(*args: object, **kwargs: object) -> object:
            out = original(*args, **kwargs)
            mark(name.strip("_"))
            return out
        setattr(module, name, call)

    print(f"{'phase':>24} {'RSS MiB':>9} {'peak MiB':>9} {'heap MiB':>9} {'arenas':>9} "
          f"{'Python':>9}"
          + (f" {'tensors MiB':>12} {'tensors peak':>13}" if tf_peak else ""))
    mark("tensorflow started")
    entry = models.get(model)
    keras_model = materialize.build_lazily(lambda: entry.build(seed=0))
    mark("lazy build")
    for module, name in ((parallel, "_capture"), (parallel, "_search"),
                         (shards, "make_shards"), (shards, "make_slots")):
        wrapped(module, name)
    xs, y = entry.synthetic_batch(None)
    pm = parallel.parallelize(keras_model, list(entry.input_spec(None)), devices=1,
                              optimizer=_optimizer(entry, optimizer, global_clipnorm),
                              loss=entry.keras_loss(),
                              search_options={"memory_budget": budget * 2**30})
    mark("parallelize")
    for k in range(steps):
        start = time.perf_counter()
        pm.train_step(list(xs), y)
        mark(f"step {k + 1}")
        rows[-1]["seconds"] = round(time.perf_counter() - start, 2)
        if k == 0:
            graph = pm.runtime.graphs["train_step"]
            rows[-1]["step_graph_operations"] = len(graph.get_operations()) + sum(
                len(f.node_def) for f in graph.as_graph_def().library.function)
            print(f"{'':>24} first step {rows[-1]['seconds']:.2f} s, the traced step "
                  f"{rows[-1]['step_graph_operations']} operations (its functions' "
                  "included)", flush=True)
    rows[-1]["resident_by_mapping_mib"] = _resident_by_mapping()
    print(f"{'':>24} after the last step, resident by mapping (MiB): " + ", ".join(
              f"{k} {v}" for k, v in rows[-1]["resident_by_mapping_mib"].items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--budget_gib", type=float, default=1.8)
    parser.add_argument("--baseline", default="t5-tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--phases", action="store_true",
                        help="instead: the resident set after each phase, one process")
    parser.add_argument("--tf_peak", action="store_true",
                        help="with --phases: TensorFlow's tensor bytes too (BFC allocator)")
    parser.add_argument("--own_updates", action="store_true",
                        help="with --phases: every weight's update traced on its own")
    parser.add_argument("--optimizer", default=None,
                        help="with --phases: a Keras optimizer name or JSON config file "
                             "(default: the zoo model's)")
    parser.add_argument("--global_clipnorm", type=float, default=None,
                        help="with --phases: the optimizer clips by this global norm")
    args = parser.parse_args()
    if args.phases:
        rows = phases(args.model, args.budget_gib, args.steps, args.tf_peak,
                      args.own_updates, args.optimizer, args.global_clipnorm)
        out = args.json_out or os.path.join(ROOT, "benchmarks", "results",
                                            f"bench_memory_phases_{args.model}.json")
        with open(out, "w") as f:
            json.dump({"model": args.model, "budget_gib": args.budget_gib, "rows": rows,
                       "tf_peak": args.tf_peak, "own_updates": args.own_updates,
                       "optimizer": args.optimizer, "global_clipnorm": args.global_clipnorm,
                       "date": datetime.date.today().isoformat()},
                      f, indent=1)
        print(f"wrote {out}")
        return
    from tapas.execution.runtime import launch
    counts = [int(w) for w in args.workers.split(",")]
    load_before = os.getloadavg()
    overheads = {k: _overhead(args.baseline, k, args.steps) for k in sorted({1, *counts})}
    overhead = overheads[1]
    largest = _largest_weight(args.model)
    rows = []
    print(f"{args.model}: fixed overhead {overhead / MIB:.0f} MiB ({args.baseline}, one "
          f"worker; on K workers: " + ", ".join(f"{k}: {v / MIB:.0f}" for k, v in
                                               overheads.items())
          + f" MiB), largest weight {largest / MIB:.1f} MiB")
    print(f"{'workers':>7} {'worker':>6} {'predicted MiB':>14} {'peak RSS MiB':>13} "
          f"{'bound MiB':>10} {'within':>7} {'bound K MiB':>12} {'within':>7} {'seconds':>8}")
    for k in counts:
        budget = args.budget_gib / k
        report = None
        for _ in range(4):   # no plan within the budget: 25 % more, said in the JSON
            try:
                report = _train(args.model, k, args.steps, budget)
                break
            except RuntimeError as e:
                if "no strategy fits the memory budget" not in str(e):
                    error = str(e)[-1500:]   # (e.g. killed for memory): said, and on
                    break
                budget *= 1.25
                error = f"no plan on {k} devices within {budget:.2f} GiB"
        if report is None:
            rows.append({"workers": k, "error": error, "budget_gib": budget})
            print(f"{k:>7} failed: {error[-300:]}")
            continue
        for w in report["memory"]["workers"]:
            bound = w["predicted_bytes"] + overhead + largest
            bound_k = w["predicted_bytes"] + overheads[k] + largest
            row = {"workers": k, "worker": w["worker"], "predicted_bytes": w["predicted_bytes"],
                   "peak_rss_bytes": w["peak_rss_bytes"], "bound_bytes": bound,
                   "within": w["peak_rss_bytes"] <= bound,
                   "bound_same_workers_bytes": bound_k,
                   "within_same_workers": w["peak_rss_bytes"] <= bound_k,
                   "parts": report["memory"]["parts"], "budget_gib": budget,
                   "wall_seconds": round(report["wall_seconds"], 1)}
            rows.append(row)
            print(f"{k:>7} {w['worker']:>6} {w['predicted_bytes'] / MIB:>14.1f} "
                  f"{w['peak_rss_bytes'] / MIB:>13.1f} {bound / MIB:>10.1f} "
                  f"{str(row['within']):>7} {bound_k / MIB:>12.1f} "
                  f"{str(row['within_same_workers']):>7} {row['wall_seconds']:>8.1f}")
    out = args.json_out or os.path.join(ROOT, "benchmarks", "results",
                                        f"bench_memory_{args.model}.json")
    with open(out, "w") as f:
        json.dump({"model": args.model, "baseline": args.baseline, "steps": args.steps,
                   "budget_gib": args.budget_gib, "overhead_bytes": overhead,
                   "overhead_bytes_by_workers": {str(k): v for k, v in overheads.items()},
                   "largest_weight_bytes": largest, "rows": rows,
                   "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
                   "load_average_1min": [round(load_before[0], 2),
                                         round(os.getloadavg()[0], 2)],   # start, end
                   "worker_env": {**{k: os.environ.get(k, v) for k, v in
                                     launch.WORKER_ENV_DEFAULTS.items()},
                                  # memory.RELEASE_HEAP_ENV (its module imports TensorFlow)
                                  "TAPAS_RELEASE_HEAP":
                                      os.environ.get("TAPAS_RELEASE_HEAP", "1")}},
                  f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
