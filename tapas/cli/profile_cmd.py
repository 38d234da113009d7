"""``tapas profile``: measure this machine's collectives and compute and write a cluster
file for the cost model (``tapas.execution.calibration.profiling``).

In:  ``--devices`` (or ``--workers``), ``--sizes``, ``--repeats``, ``--out``, ``--plot``,
     ``--gamma``, ``--elementwise``, ``--widths``, ``--json_out``.
Out: the cluster file and its residual plot; the profile as a dict.
Raises: ``absl.app.UsageError`` for fewer than 2 devices or workers, or bad sizes; a failed
     worker prints ``tapas profile: <why>`` and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from absl import app, flags

from tapas.cli.common import FLAGS

flags.DEFINE_string("sizes", None, "profile: message sizes, 'SMALLEST:LARGEST' (by factors "
                    "of 4) or a list '4KiB,1MiB,...' (default 1KiB:16MiB).")
flags.DEFINE_integer("repeats", 7, "profile: timed calls per point (the fastest is used).")
flags.DEFINE_string("plot", None, "profile: the residual plot PNG (default: beside --out, "
                    "NAME_residuals.png; '' for none).")
flags.DEFINE_boolean("gamma", True, "profile: measure the overlap factor gamma (--nogamma "
                     "keeps the prior).")
flags.DEFINE_boolean("elementwise", True, "profile: fit the FLOP rate and the elementwise "
                     "rate (at which the cost model prices memory-bound ops) to training "
                     "steps of reference blocks (--noelementwise: the FLOP rate of a matmul, "
                     "every op priced by its FLOPs at it, as the paper).")
flags.DEFINE_boolean("widths", True, "profile: measure the FLOP rate of matrix multiplies "
                     "by their width (8 to 256), at which the cost model prices thin layers "
                     "(--nowidths: every width at one rate).")

SUMMARY = ("measure this machine's collectives and compute; write a cluster file for the cost "
           'model')
USAGE = ('tapas profile --devices=N [--sizes=1KiB:16MiB] [--repeats=7] --out=cluster.json '
         '[--plot=residuals.png] [--nogamma]')
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('devices', 'workers', 'sizes', 'repeats', 'out', 'plot', 'gamma', 'elementwise',
              'widths', 'json_out')


def cmd_profile() -> dict[str, Any]:
    """Measure the collectives and compute of --devices devices, fit the cost model, write
    the cluster file (tapas.execution.calibration.profiling)."""
    from absl import logging
    # tf.distribute logs every collective at INFO, tf.function each new point's trace at
    # WARNING (every size is a new function, on purpose)
    logging.set_verbosity(logging.ERROR)
    from tapas.execution.calibration import profiling
    try:
        sizes = None if FLAGS.sizes is None else profiling.parse_sizes(FLAGS.sizes)
    except ValueError as e:
        raise app.UsageError(f"--sizes={FLAGS.sizes}: {e}") from None
    if FLAGS.devices < 2:
        raise app.UsageError(f"--devices={FLAGS.devices}: a collective needs at least 2 "
                             "devices; use --devices=2 or more")
    if FLAGS.repeats < 3:
        raise app.UsageError(f"--repeats={FLAGS.repeats}: at least 3 timed calls per "
                             "point are needed; use --repeats=3 or more")
    out = FLAGS.out or os.path.join("out", "cluster.json")
    plot = FLAGS.plot if FLAGS.plot is not None else os.path.splitext(out)[0] + "_residuals.png"
    if FLAGS.workers:
        return _profile_workers(out, plot)
    from tapas.execution.runtime import devices
    chief = devices.is_chief_process()
    result = profiling.profile(FLAGS.devices, sizes=sizes, repeats=FLAGS.repeats,
                               gamma=FLAGS.gamma, elementwise=FLAGS.elementwise,
                               widths=FLAGS.widths,
                               progress=(lambda line: print(line, flush=True)) if chief else None)
    if not chief:   # every worker measured (the collectives need them all); one writes
        print(f"worker {devices.tf_config()['task'].get('index')}: done; worker 0 writes "
              "the cluster file")
        return {}
    print()
    print(result.table())
    result.save(out)
    print(f"\ncluster file written to {out} ({result.seconds:.1f} s); use it with "
          f"`tapas search --cluster={out}`")
    if plot:
        why_not = result.plot(plot)
        print(f"residual plot: {why_not}" if why_not else f"residual plot written to {plot}")
    return {"cluster": result.cluster.to_json(), "profile": result.to_json()}


def _profile_workers(out: str, plot: str) -> dict[str, Any]:
    """``tapas profile --workers=K``: the same command in K processes on 127.0.0.1 under
    MultiWorkerMirroredStrategy (one device each); worker 0 writes the cluster file, the
    plot and the JSON report; its output is printed; every worker is stopped on failure."""
    from tapas.execution.runtime import launch
    k = FLAGS.workers
    if k < 2:
        raise app.UsageError(f"--workers={k}: a collective needs at least 2 workers; use "
                             "--workers=2 or more, or --workers=0 for logical devices")
    if FLAGS["devices"].present and FLAGS.devices != k:
        raise app.UsageError(f"--devices={FLAGS.devices} with --workers={k}: each worker "
                             f"has one device, so the profile spans {k}; leave --devices "
                             f"out or set it to {k}")
    argv = [sys.executable, "-m", "tapas.cli", "profile", f"--devices={k}", "--workers=0",
            f"--repeats={FLAGS.repeats}", f"--gamma={str(FLAGS.gamma).lower()}",
            f"--elementwise={str(FLAGS.elementwise).lower()}",
            f"--widths={str(FLAGS.widths).lower()}",
            f"--out={os.path.abspath(out)}",
            f"--plot={os.path.abspath(plot) if plot else ''}"]
    if FLAGS.sizes is not None:
        argv.append(f"--sizes={FLAGS.sizes}")
    fd, report_path = tempfile.mkstemp(suffix=".json", prefix="tapas-profile-")
    os.close(fd)
    print(f"launching {k} workers on 127.0.0.1 (MultiWorkerMirroredStrategy)", flush=True)
    try:
        results = launch.launch(lambda i: argv + ([f"--json_out={report_path}"] if i == 0
                                                  else []), k, timeout_s=1800.0)
        print(results[0].output, end="")
        with open(report_path) as f:
            report = json.load(f)
    except launch.LaunchError as e:
        # a failed run (a worker lost or timed out), not a usage mistake: no flag listing
        print(f"tapas profile: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        os.unlink(report_path)
    report["worker_seconds"] = [round(r.seconds, 2) for r in results]
    return report
