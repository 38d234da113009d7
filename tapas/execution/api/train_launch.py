"""``tapas train --workers=K``: the same command as K worker processes on 127.0.0.1 under
``MultiWorkerMirroredStrategy`` (``tapas.execution.runtime.launch``: free ports, ``TF_CONFIG``,
deadline, clean-up of every worker), worker 0's output and report.

In:  ``train.TrainOptions`` with ``workers`` > 0.
Out: worker 0's report (plus ``worker_seconds``), its output printed; :func:`write_json`.
Raises: ``TrainError`` when a worker fails or the deadline passes (naming the worker, and
     with a checkpoint directory the ``--resume`` command to go on).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from typing import Any

from tapas.execution.api.train_data import TrainError

__all__ = ["launch_workers", "replacement_dir", "write_json"]

#: under --checkpoint_dir: one file per replacement worker announced to --elastic_wait_s
REPLACEMENTS = "replacements"


def write_json(path: str, report: dict[str, Any]) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def _argv(opts: Any, workers: int, report_path: str, resume: bool,
          strategy: str | None) -> list[str]:
    """One worker's command line: this command for ``workers`` processes."""
    argv = [sys.executable, "-m", "tapas.cli", "train", f"--model={opts.model or ''}",
            f"--devices={workers * opts.devices_per_worker}",
            f"--devices_per_worker={opts.devices_per_worker}", f"--steps={opts.steps}",
            f"--cluster={opts.cluster}",
            f"--verify={str(opts.verify).lower()}", f"--json_out={report_path}",
            "--workers=0"]
    if opts.training is not None:
        argv.append(f"--training={str(opts.training).lower()}")
    argv = [a for a in argv if a != "--model="]
    if strategy:
        argv.append(f"--strategy={strategy}")
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
    if resume:
        argv.append("--resume")
    if opts.mesh:
        argv.append(f"--mesh={opts.mesh}")
    argv.append(f"--graph_optimization={opts.graph_optimization}")
    return argv


def _lost(e: Any) -> bool:
    """Whether a LaunchError is a worker ended by a signal (killed, its machine gone), which
    a restart on the others can survive, rather than a failure that would repeat."""
    return getattr(e, "returncode", 0) is not None and getattr(e, "returncode", 0) < 0


def _last_step(output: str) -> int | None:
    """The last step the chief printed (its step lines: epoch, step, loss, seconds), or
    None."""
    output = output.split("\nmemory (", 1)[0]   # (the memory table's rows look alike)
    steps = [int(m.group(1)) for m in _STEP_LINE.finditer(output)]
    return steps[-1] if steps else None


_STEP_LINE = re.compile(r"^\s*\d+\s+(\d+)\s+\S+\s+\d+\.\d+\s*$", re.MULTILINE)


def _redone(e: Any, newest: str | None) -> tuple[str, int, int | None]:
    """Which steps the restart redoes: those after the newest checkpoint's step, up to the
    last one the chief printed before the loss; (the words, the checkpoint's step, that
    last step or None)."""
    from tapas.execution.api import fit as fit_mod
    done = 0
    if newest:
        with open(os.path.join(newest, fit_mod.FIT_STATE)) as f:
            done = int(json.load(f)["step"])
    last = _last_step((getattr(e, "outputs", None) or {}).get(0, ""))
    where = f"from {newest}" if newest else "from the beginning (no checkpoint was written yet)"
    if last is None or last <= done:
        return f"{where} (step {done}; no step after it was finished)", done, None
    return (f"{where} (step {done}; steps {done + 1} to {last}, done before the loss, are "
            "redone)", done, last)


def replacement_dir(checkpoint_dir: str) -> str:
    """The directory where a replacement worker is announced: a file created in it (any
    name) is one worker that joins an ``--elastic_wait_s`` job after a loss."""
    return os.path.join(checkpoint_dir, REPLACEMENTS)


def _await_replacement(opts: Any) -> float | None:
    """Wait up to ``opts.elastic_wait_s`` for a replacement worker (a file in
    :func:`replacement_dir`, taken by removing it); the seconds waited, or None."""
    where = replacement_dir(opts.checkpoint_dir)
    os.makedirs(where, exist_ok=True)
    print(f"\nelastic: waiting up to {opts.elastic_wait_s:g} s for a replacement worker "
          f"(one joins by creating a file in {where})", flush=True)
    start = time.monotonic()
    while True:
        for name in sorted(os.listdir(where)):
            try:
                os.unlink(os.path.join(where, name))
            except FileNotFoundError:   # taken meanwhile
                continue
            return time.monotonic() - start
        if time.monotonic() - start >= opts.elastic_wait_s:
            return None
        time.sleep(0.2)


def _restart(opts: Any, e: Any, workers: int, strategy: str | None
             ) -> tuple[str | None, dict[str, Any]]:
    """Say what ``--elastic`` does after ``e`` lost a worker: the job again on one worker
    fewer, from the newest checkpoint, its plan searched again; returns the strategy flag
    for the new cluster (a Strategy file was made for the old device count) and the
    restart's record."""
    from tapas.execution.api import fit as fit_mod
    newest = fit_mod.latest_checkpoint(opts.checkpoint_dir)
    if strategy and not strategy.startswith("random:"):
        strategy = None
    how, done, last = _redone(e, newest)
    plan = ("a random plan for" if strategy else "a plan searched again for")
    print(f"\nelastic: worker {getattr(e, 'worker', '?')} lost (exit code "
          f"{getattr(e, 'returncode', '?')}); restarting on {workers} workers {how}, with "
          f"{plan} {workers * opts.devices_per_worker} devices and the checkpoint resharded",
          flush=True)
    return strategy, {"lost_worker": e.worker, "exit_code": e.returncode, "workers": workers,
                      "resumed_step": done, "redone_steps": [] if last is None
                      else list(range(done + 1, last + 1))}


def launch_workers(opts: Any) -> dict[str, Any]:
    """``opts.workers`` processes of this command (worker 0's output printed, its report
    returned). With ``opts.elastic``, a worker lost (ended by a signal) restarts the job on
    the workers that remain, with ``--resume`` from the newest checkpoint (resharded for
    the new device count, the plan searched again; ``--strategy=random:S`` draws one for
    it), until it finishes or one worker is left; ``report["elastic"]`` lists the
    restarts. With ``opts.elastic_wait_s`` it first waits that long for a replacement
    worker (:func:`replacement_dir`): one that joins keeps the worker count."""
    from tapas.execution.runtime import launch
    fd, report_path = tempfile.mkstemp(suffix=".json", prefix="tapas-train-")
    os.close(fd)
    workers, resume, strategy, restarts = opts.workers, opts.resume, opts.strategy, []
    try:
        while True:
            argv = _argv(opts, workers, report_path, resume, strategy)
            print(f"launching {workers} workers on 127.0.0.1 (MultiWorkerMirroredStrategy)",
                  flush=True)
            try:
                # unbuffered: a lost job's chief has printed every step it finished
                env = {"PYTHONUNBUFFERED": "1"} if getattr(opts, "elastic", False) else {}
                if restarts:
                    env["TAPAS_ELASTIC_RESTARTS"] = str(len(restarts))
                results = launch.launch(lambda i: argv, workers, timeout_s=opts.timeout_s,
                                        env=env or None)
                break
            except launch.LaunchError as e:
                if not (getattr(opts, "elastic", False) and _lost(e) and workers > 1):
                    raise
                wait = getattr(opts, "elastic_wait_s", None)
                waited = _await_replacement(opts) if wait else None
                if wait:
                    print("elastic: " + (f"a replacement joined after {waited:.1f} s"
                                         if waited is not None else
                                         f"no replacement within {wait:g} s"), flush=True)
                workers, resume = workers - (waited is None), True
                strategy, record = _restart(opts, e, workers, strategy)
                if wait:
                    record["replacement_after_s"] = (None if waited is None
                                                     else round(waited, 1))
                restarts.append(record)
        print(results[0].output, end="")
        with open(report_path) as f:
            report = json.load(f)
    except launch.LaunchError as e:
        _failed(opts, e, report_path)
    finally:
        os.unlink(report_path)
    report["worker_seconds"] = [round(r.seconds, 2) for r in results]
    if restarts:
        report["elastic"] = restarts
    if opts.json_out:
        write_json(opts.json_out, report)
    return report


def _failed(opts: Any, e: Exception, report_path: str) -> None:
    """A TrainError for a failed launch: what the chief reported before it (e.g. verify's
    table) into --json_out, and the --resume command to go on."""
    if opts.json_out:
        try:
            with open(report_path) as f:
                partial = json.load(f)
        except (OSError, ValueError):
            partial = None
        if partial:
            write_json(opts.json_out, {**partial, "error": str(e)})
    hint = ""
    if opts.checkpoint_dir:
        from tapas.execution.api import fit as fit_mod
        newest = fit_mod.latest_checkpoint(opts.checkpoint_dir)
        hint = (f"\nto continue from the newest checkpoint ({newest}), run the same "
                "command with --resume" if newest else
                "\nno checkpoint was written yet; run the command again")
    raise TrainError(f"{e}{hint}") from None
