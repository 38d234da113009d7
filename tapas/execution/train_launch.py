"""``tapas train --workers=K``: the same command as K worker processes on 127.0.0.1 under
``MultiWorkerMirroredStrategy`` (``tapas.execution.launch``: free ports, ``TF_CONFIG``,
deadline, clean-up of every worker), worker 0's output and report.

In:  ``train.TrainOptions`` with ``workers`` > 0.
Out: worker 0's report (plus ``worker_seconds``), its output printed; :func:`write_json`.
Raises: ``TrainError`` when a worker fails or the deadline passes (naming the worker, and
     with a checkpoint directory the ``--resume`` command to go on).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from tapas.execution.train_data import TrainError

__all__ = ["launch_workers", "write_json"]


def write_json(path: str, report: dict[str, Any]) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def launch_workers(opts: Any) -> dict[str, Any]:
    from tapas.execution import launch
    fd, report_path = tempfile.mkstemp(suffix=".json", prefix="tapas-train-")
    os.close(fd)
    argv = [sys.executable, "-m", "tapas.cli", "train", f"--model={opts.model or ''}",
            f"--devices={opts.workers * opts.devices_per_worker}",
            f"--devices_per_worker={opts.devices_per_worker}", f"--steps={opts.steps}",
            f"--cluster={opts.cluster}",
            f"--verify={str(opts.verify).lower()}", f"--json_out={report_path}",
            "--workers=0"]
    if opts.training is not None:
        argv.append(f"--training={str(opts.training).lower()}")
    argv = [a for a in argv if a != "--model="]
    if opts.strategy:
        argv.append(f"--strategy={opts.strategy}")
    if opts.learning_rate is not None:
        argv.append(f"--learning_rate={opts.learning_rate}")
    if opts.optimizer is not None:
        argv.append(f"--optimizer={opts.optimizer}")
    if opts.batch_size is not None:
        argv.append(f"--batch_size={opts.batch_size}")
    if opts.memory_budget_gib is not None:
        argv.append(f"--memory_budget_gib={opts.memory_budget_gib}")
    for flag in ("data", "epochs", "checkpoint_dir", "checkpoint_every", "tensorboard",
                 "compute_scale", "kernel_times", "communication_scale"):
        if getattr(opts, flag) is not None:
            argv.append(f"--{flag}={getattr(opts, flag)}")
    if opts.resume:
        argv.append("--resume")
    if opts.mesh:
        argv.append(f"--mesh={opts.mesh}")
    argv.append(f"--graph_optimization={opts.graph_optimization}")
    print(f"launching {opts.workers} workers on 127.0.0.1 (MultiWorkerMirroredStrategy)",
          flush=True)
    try:
        results = launch.launch(lambda i: argv, opts.workers, timeout_s=opts.timeout_s)
        print(results[0].output, end="")
        with open(report_path) as f:
            report = json.load(f)
    except launch.LaunchError as e:
        if opts.json_out:   # what the chief reported before the failure (e.g. verify's table)
            try:
                with open(report_path) as f:
                    partial = json.load(f)
            except (OSError, ValueError):
                partial = None
            if partial:
                write_json(opts.json_out, {**partial, "error": str(e)})
        hint = ""
        if opts.checkpoint_dir:
            from tapas.execution import fit as fit_mod
            newest = fit_mod.latest_checkpoint(opts.checkpoint_dir)
            hint = (f"\nto continue from the newest checkpoint ({newest}), run the same "
                    "command with --resume" if newest else
                    "\nno checkpoint was written yet; run the command again")
        raise TrainError(f"{e}{hint}") from None
    finally:
        os.unlink(report_path)
    report["worker_seconds"] = [round(r.seconds, 2) for r in results]
    if opts.json_out:
        write_json(opts.json_out, report)
    return report
