"""The training of ``tapas train``: plain steps (:func:`run_steps`) or a job through
``ParallelModel.fit`` (:func:`run_job`: data, epochs, checkpoints, resume, TensorBoard).

In:  ``train.TrainOptions``, the ParallelModel, the synthetic batch, the report dict and the
     chief's ``say``.
Out: the losses, step times, throughput, history, checkpoint and resume point in the report.
     With ``--resume`` on the synthetic batch, ``--steps`` x ``--epochs`` is the total step
     count the job reaches (:func:`resumed_length`): a checkpoint at step 4 and ``--steps=8``
     trains steps 5 to 8; a checkpoint already there (or beyond) trains nothing and says so.
Raises: ``TrainError`` for data that cannot be read, a fit error, or a step total that
     ``--epochs`` cannot lay out from the checkpoint (naming both and the fix).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from tapas.execution.api.train_data import TrainError, load_npz, load_tfrecord, tf_errors

__all__ = ["run_steps", "run_job", "resumed_length"]


def run_steps(opts: Any, pm: Any, xs: Any, y: Any, report: dict[str, Any],
              say: Any) -> dict[str, Any] | None:
    """``opts.steps`` training steps (side by side with Keras when ``opts.verify``), their
    losses, times and throughput into ``report``; returns the verify report, if any."""
    say(f"\n{'step':>4} {'loss':>12} {'keras loss':>12} {'seconds':>9}")
    step_times: list[float] = []

    def on_step(step: int, loss: float, ref: float | None, seconds: float) -> None:
        step_times.append(seconds)
        ref_text = f"{ref:>12.6f}" if ref is not None else f"{'':>12}"
        say(f"{step + 1:>4} {loss:>12.6f} {ref_text} {seconds:>9.3f}")

    check = None
    if opts.verify:
        check = pm.verify(xs, y, steps=opts.steps, on_step=on_step)
        report["verify"] = check
        report["losses"] = [a for a, _ in check["losses"]]
    else:
        losses = []
        for step in range(opts.steps):
            t = time.perf_counter()
            losses.append(pm.train_step(xs, y))
            on_step(step, losses[-1], None, time.perf_counter() - t)
        report["losses"] = losses
    report["step_seconds"] = step_times
    _say_throughput(step_times, len(y), report, say, "\n")
    return check


def _say_throughput(step_times: list[float], batch: int, report: dict[str, Any], say: Any,
                    lead: str = "") -> None:
    later = step_times[1:]
    if later:
        mean = sum(later) / len(later)
        report["throughput_examples_per_s"] = batch / mean
        say(f"{lead}step time {mean:.3f} s after the first (first step, with tracing: "
            f"{step_times[0]:.2f} s); throughput {batch / mean:.1f} examples/s")


def resumed_length(opts: Any, say: Any) -> tuple[int, int] | None:
    """``(epochs, steps_per_epoch)`` for ``fit`` on the synthetic batch so that the job ends
    at step ``opts.steps * (opts.epochs or 1)`` in all, counted from the beginning of the
    job, whatever step the newest whole checkpoint in ``opts.checkpoint_dir`` holds; None
    when that checkpoint is already at that step or beyond (nothing to train: said).

    A checkpoint whose epochs had ``opts.steps`` steps continues as written. One whose
    epochs had another length (written with another ``--steps``) continues its epoch in
    progress, or a new one, up to the total, when ``--epochs`` is not given; with
    ``--epochs`` the total cannot be laid out in epochs of ``--steps`` steps from it, and
    that is a TrainError naming the checkpoint's step and epoch and the fix."""
    from tapas.execution.api import fit_checkpoints
    steps, epochs = opts.steps, opts.epochs or 1
    total = steps * epochs
    found, _ = fit_checkpoints.usable_checkpoint(opts.checkpoint_dir)
    if not found:
        return epochs, steps
    with open(os.path.join(found, fit_checkpoints.FIT_STATE)) as f:
        state = fit_checkpoints.FitState.from_json(json.load(f), found)
    done, epoch, in_epoch = state.step, state.epoch, state.step_in_epoch
    asked = (f"--steps={steps}" + (f" x --epochs={opts.epochs}" if opts.epochs else "")
             + f" asks for {total} steps in all")
    if done >= total:
        say(f"note: the checkpoint {found} is at step {done}; {asked}, so there is nothing "
            f"left to train (pass a larger --steps to train on from step {done + 1})")
        return None
    if epoch * steps + in_epoch == done and in_epoch < steps:
        return epochs, steps   # its epochs had --steps steps: fit continues as written
    if opts.epochs:
        raise TrainError(
            f"the checkpoint {found} is at step {done}: epoch {epoch + 1} with {in_epoch} "
            f"of its steps taken, so its epochs did not have {steps} steps; {asked}, which "
            f"epochs of {steps} steps cannot reach from there: leave out --epochs and give "
            f"--steps={total} (the total step count), or resume with the --steps it was "
            "written with")
    say(f"note: the checkpoint {found} is at step {done} (epoch {epoch + 1}, {in_epoch} of "
        f"its steps taken); {asked}: epoch {epoch + 1} trains steps {done + 1} to {total}")
    return epoch + 1, in_epoch + total - done


def _load_data(opts: Any, pm: Any, xs: Any, y: Any) -> tuple[Any, Any, int | None]:
    """(x, targets, steps_per_epoch) of the job: the --data file, else the synthetic batch
    with --steps steps per epoch."""
    if not opts.data:
        return xs, y, opts.steps
    try:
        if opts.data.endswith(".npz"):
            x, targets = load_npz(opts.data, pm)
        else:
            x, targets = load_tfrecord(opts.data, pm), None
    except (OSError, ValueError, tf_errors()) as e:
        raise TrainError(f"--data={opts.data}: {e}") from None
    return x, targets, None


def run_job(opts: Any, pm: Any, xs: Any, y: Any, report: dict[str, Any], say: Any) -> None:
    """A training job through ``ParallelModel.fit``: the --data file (epochs of it) or the
    synthetic batch (--steps steps per epoch; with --resume, the total of
    :func:`resumed_length`), checkpoints, resume, TensorBoard; the loss of every step, the
    epochs' losses and where it resumed into ``report``."""
    from tapas.execution.api import fit as fit_mod
    x, targets, steps_per_epoch = _load_data(opts, pm, xs, y)
    epochs = opts.epochs or 1
    if opts.resume:
        from tapas.execution.api import preflight
        preflight.say_resume(opts, say)
        if not opts.data and opts.checkpoint_dir:
            length = resumed_length(opts, say)
            if length is None:
                _nothing_to_train(opts, report, say)
                return
            epochs, steps_per_epoch = length
    losses: list[float] = []
    step_times: list[float] = []
    printer, bar = _printer(pm, epochs, losses, step_times, say)
    try:
        with bar or contextlib.nullcontext():
            history = pm.fit(x, targets, epochs=epochs, steps_per_epoch=steps_per_epoch,
                             verbose=0, callbacks=[printer],
                             checkpoint_dir=opts.checkpoint_dir,
                             checkpoint_every=opts.checkpoint_every, resume=opts.resume,
                             tensorboard=opts.tensorboard)
    except (ValueError, FileNotFoundError, fit_mod.WorkerLostError, tf_errors()) as e:
        raise TrainError(str(e)) from None
    if opts.resume:   # the checkpoint read, after any damaged newer one was skipped
        report["resumed_from"] = getattr(history, "resumed_from", None)
    report.update({"losses": losses, "step_seconds": step_times, "epochs": epochs,
                   "history": history.history, "step": int(pm.runtime.iterations.numpy())})
    if opts.checkpoint_dir:
        report["checkpoint"] = fit_mod.latest_checkpoint(opts.checkpoint_dir)
        say(f"\ncheckpoint: {report['checkpoint']} (step {report['step']})")
    _say_throughput(step_times, int(pm.inputs.specs[0].shape[0]), report, say)


def _nothing_to_train(opts: Any, report: dict[str, Any], say: Any) -> None:
    """The report of a resumed job whose checkpoint already reached its total."""
    from tapas.execution.api import fit_checkpoints
    found, _ = fit_checkpoints.usable_checkpoint(opts.checkpoint_dir)
    with open(os.path.join(found, fit_checkpoints.FIT_STATE)) as f:
        state = fit_checkpoints.FitState.from_json(json.load(f), found)
    report.update({"losses": [], "step_seconds": [], "history": state.history,
                   "step": state.step, "checkpoint": found, "resumed_from": found,
                   "nothing_to_train": True})
    say(f"\ncheckpoint: {found} (step {state.step}); nothing trained")


def _printer(pm: Any, epochs: int, losses: list[float], step_times: list[float],
             say: Any) -> tuple[Any, Any]:
    """The callback that prints (or draws, on a terminal) every step and epoch and collects
    the step losses and times; and the progress bar it draws, or None."""
    import keras

    from tapas.progress import ProgressBar
    bar = ProgressBar("epoch", delay=0.0) if pm.runtime.task_id == 0 else None
    if bar is None or not bar.enabled:
        bar = None
        say(f"\n{'epoch':>5} {'step':>6} {'loss':>12} {'seconds':>9}")
    state = {"epoch": 0}

    class Printer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            state["epoch"] = epoch
            if bar is not None:
                bar.phase(f"epoch {epoch + 1}/{epochs}", (self.params or {}).get("steps"))

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            info = self.model.last_step
            losses.append(info["loss"])
            step_times.append(info["seconds"])
            if bar is not None:
                bar.update(batch + 1, detail=f"step {info['step']}, loss {info['loss']:.6f}")
                return
            say(f"{state['epoch'] + 1:>5} {info['step']:>6} {info['loss']:>12.6f} "
                f"{info['seconds']:>9.3f}")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if bar is not None:
                bar.close()
            say(f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k} {v:.6f}" for k, v in
                                                          (logs or {}).items()))

    return Printer(), bar
