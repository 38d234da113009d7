"""Training jobs on a :class:`tapas.execution.api.parallel.ParallelModel`: Keras-style ``fit``
with Keras callbacks, periodic atomic checkpoints, resume, progress and TensorBoard scalars.

In:  a ParallelModel; the data: NumPy arrays (one array, a list in the program's input
     order, a dict keyed by input name or the model's own structure, as
     ``tapas.execution.runtime.inputs`` takes a batch) with targets ``y``, or a
     ``tf.data.Dataset``, a ``keras.utils.PyDataset`` or a Python generator of ``(x, y)``
     *global* batches; epochs, ``steps_per_epoch``, validation data, Keras
     callbacks, and the checkpoint options (a directory, every K steps, how many to keep,
     resume).
Out: :func:`fit` returns a ``keras.callbacks.History`` (``loss`` per epoch, the mean of the
     epoch's step losses as Keras logs it; ``val_loss`` with validation data; what
     callbacks add, e.g. ``learning_rate``; validation calls the callbacks' ``on_test_*``
     hooks, as Keras's); checkpoint directories ``<dir>/ckpt-<step>`` (the runtime's
     shards, optimizer slots and step counter, ``tapas.execution.runtime.checkpoints``,
     plus ``tapas-fit.json``: epoch,
     step in the epoch, data position, batches consumed, learning rate, seed states, the
     epoch's running loss and the history so far).

Semantics (``docs/running.md``, *fit, checkpoints and resume*):

* The global batch is fixed by the capture: ``batch_size`` must equal it (default: it).
  Arrays are cut into full global batches (shuffled per epoch from ``seed`` unless
  ``shuffle=False``); the rows of a last partial batch are dropped, with a logged note. A
  dataset must yield global batches; a smaller (last) one is dropped with a note saying
  why. Where that is exact (``fit_data.tail_refusal``: each example's outputs depend on its
  own row only, so not with batch norm in training or a mean over the batch; no loss the
  call adds), training, validation and ``evaluate`` take those last examples too, as
  Keras's do, as one more batch filled up with zero-weight repeats (not with
  ``steps_per_epoch``); dropout's masks for its own rows are Keras's.
* An epoch is one pass over the data; with ``steps_per_epoch`` the data are one stream that
  continues across epochs and starts a new pass when it runs out.
* Callbacks are called with Keras's hooks (``on_train_begin``, ``on_epoch_begin``,
  ``on_train_batch_begin``/``end`` with the running mean ``loss``, ``on_epoch_end`` with the
  epoch's logs, ``on_train_end``) and see a :class:`CallbackModel` as ``self.model``
  (``stop_training``, ``optimizer.learning_rate`` settable, ``get_weights``/``set_weights``).
  Keras callbacks that need a Keras model's internals are refused by name, with what to
  use instead (:data:`REFUSED_CALLBACKS`); ``BackupAndRestore`` becomes fit's own
  checkpoints in its ``backup_dir`` with ``resume=True``.
* Checkpoints (every ``checkpoint_every`` steps and at each epoch end) are written into a
  temporary directory and renamed into place (a crash in the middle of a save leaves the
  earlier checkpoints, and nothing half-written is ever taken as a checkpoint); the last
  ``keep`` are kept. ``resume=True`` continues from the newest one in ``checkpoint_dir``
  (``resume_from=`` names a checkpoint or a directory of them): with a deterministic input
  pipeline the result equals the uninterrupted run's, exactly.
"""

from __future__ import annotations

import math
import re
import shutil
import time
import types
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tapas.execution.runtime import checkpoints
from tapas.execution.training import metrics
from tapas.execution.api.callbacks import (CALLBACK_STATE, REFUSED_CALLBACKS, CallbackModel,
                                       TensorBoardScalars, callback_states, check_callbacks,
                                       restore_callback_states)
from tapas.execution.api import fit_arguments
from tapas.execution.api.evaluation import evaluate, predict, validate
from tapas.execution.api.overrides import check_steps
from tapas.execution.api.fit_data import _Data, _Stream, exact_tail, tail_values
from tapas.execution.api.fit_checkpoints import (FIT_STATE, FitState, callback_arrays,
                                             clean_temporaries, latest_checkpoint,
                                             list_checkpoints, restore_checkpoint,
                                             save_checkpoint, save_paused,
                                             usable_checkpoint)
from tapas.execution.runtime import StepError

__all__ = ["fit", "evaluate", "predict", "CallbackModel", "TensorBoardScalars", "FitState",
           "WorkerLostError", "list_checkpoints", "latest_checkpoint", "usable_checkpoint",
           "save_checkpoint",
           "restore_checkpoint", "callback_states", "restore_callback_states", "FIT_STATE",
           "REFUSED_CALLBACKS", "CALLBACK_STATE"]





class WorkerLostError(RuntimeError):
    """A worker of the cluster stopped (killed, crashed, unreachable) while this one was
    training: TensorFlow's coordination service saw it stop sending heartbeats and aborted
    the collectives. The job is resumable from the newest checkpoint."""


# TF errors with which collectives end when a peer is gone
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                tf.errors.DeadlineExceededError, tf.errors.InternalError)


def _worker_lost(e: Exception, what: str, checkpoint_dir: str | None) -> WorkerLostError:
    tasks = sorted(set(re.findall(r"/job:\w+/replica:\d+/task:\d+", str(e))))
    newest = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    again = (f"run the same fit/command again with resume=True (tapas train --resume): it "
             f"continues from {newest}" if newest else
             "no checkpoint was written yet (pass checkpoint_dir=DIR and checkpoint_every=K "
             "to be able to resume)")
    line = next((ln.strip() for ln in str(e).splitlines() if "unhealthy" in ln
                 or "aborted" in ln.lower()), str(e).splitlines()[0] if str(e) else "")
    who = ", ".join(tasks) if tasks else "a worker (TensorFlow named none)"
    return WorkerLostError(f"{what}: the cluster lost {who} ({type(e).__name__}: {line}); "
                           f"this worker stops too. To go on, start every worker again and "
                           f"{again}")


# ---- fit -------------------------------------------------------------------------------

def fit(pm: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None,
        epochs: int = 1, verbose: Any = "auto", callbacks: Sequence[Any] | None = None,
        validation_data: Any = None, validation_steps: int | None = None,
        shuffle: bool = True, seed: int = 0, initial_epoch: int = 0,
        steps_per_epoch: int | None = None, checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None, keep: int = 3, resume: bool = False,
        resume_from: str | None = None, tensorboard: str | None = None,
        sample_weight: Any = None, validation_split: float = 0.0,
        class_weight: Any = None, validation_freq: Any = 1,
        validation_batch_size: int | None = None) -> Any:
    """Train ``pm`` as Keras's ``Model.fit`` does (module docstring); returns the History.

    ``checkpoint_dir``: write checkpoints there at each epoch end and, with
    ``checkpoint_every=K``, after every K-th step; ``keep`` the newest. ``resume=True``:
    continue from the newest checkpoint in ``checkpoint_dir`` when there is one (start
    afresh otherwise, as Keras's BackupAndRestore); ``resume_from=PATH``: from that
    checkpoint (or the newest under that directory), which must exist. ``tensorboard``:
    a log directory for :class:`TensorBoardScalars`. ``sample_weight``: with arrays, the
    loss's weight of each example (or target element), as Keras's ``fit`` takes it; a
    dataset yields ``(x, y, sample_weight)`` triples instead. ``verbose``: 0 silent, 1 or "auto" a
    progress bar (Keras's ProgbarLogger; on the chief worker only), 2 one line per epoch.
    ``validation_split``, ``class_weight``, ``validation_freq`` and
    ``validation_batch_size`` as Keras's ``fit`` (:mod:`.fit_arguments`).
    """
    _check_arguments(epochs, initial_epoch, steps_per_epoch, checkpoint_dir, checkpoint_every,
                     resume, keep)
    callbacks, backup = _backup_and_restore(callbacks, checkpoint_dir, checkpoint_every)
    if backup is not None:
        checkpoint_dir, checkpoint_every, resume = backup[:3]
    user_callbacks = check_callbacks(callbacks)
    for cb in user_callbacks:   # a whole-model file refused now, not at the first save
        if isinstance(cb, keras.callbacks.ModelCheckpoint) and not cb.save_weights_only:
            pm.runtime.check_optimizer_export(pm.model)
    fit_arguments.validates(0, validation_freq)   # refused now if malformed
    check_steps(pm.model, "fit")
    if validation_data is not None or validation_split:
        check_steps(pm.model, "validation")
    x, y, sample_weight, validation_data = fit_arguments.split_for_validation(
        x, y, sample_weight, validation_split, validation_data)
    x, sample_weight = fit_arguments.by_class(x, y, sample_weight, class_weight)
    rt = pm.runtime
    data = _Data(pm, x, y, batch_size, shuffle, seed, sample_weight=sample_weight,
                 pad_last=steps_per_epoch is None and exact_tail(rt))
    val = _validation_data(pm, validation_data, validation_batch_size or batch_size)
    view = CallbackModel(pm)
    chief = view.is_chief
    if checkpoint_dir and chief:   # refused now, not at the first save, when unwritable
        _prepare_directory(rt, checkpoint_dir)
    source, state = _start_state(pm, checkpoint_dir, resume, resume_from, initial_epoch)
    if tensorboard:
        user_callbacks.append(TensorBoardScalars(tensorboard))
    memory, verbose = verbose != 0, 0 if not chief else 1 if verbose == "auto" else verbose
    steps_shown = steps_per_epoch or data.num_batches
    cbs = keras.callbacks.CallbackList(user_callbacks, add_history=True,
                                       add_progbar=verbose != 0, verbose=verbose,
                                       epochs=epochs, steps=steps_shown, model=view)
    history = cbs._history
    history.resumed_from = state.path if source is not None else None   # (after skips)
    loop = _Loop(pm, data, view, cbs, state, user_callbacks, checkpoint_dir=checkpoint_dir,
                 checkpoint_every=checkpoint_every, keep=keep, steps_per_epoch=steps_per_epoch)
    loop.begin(source)
    logs: dict[str, float] = {}
    epoch_logs: dict[str, float] | None = None
    for epoch in range(state.epoch, epochs):
        loop.begin_epoch(epoch)
        logs = loop.train_epoch(logs)
        if loop.stream.exhausted and loop.state.loss_count == 0:
            break   # a generator that ran out before the epoch's first step (warned)
        epoch_logs = loop.end_epoch(
            epoch, val if fit_arguments.validates(epoch, validation_freq) else None,
            validation_steps)
        if view.stop_training:
            break
    rt.finalize_variable_values()   # EMA: the weights become their averages, as Keras
    cbs.on_train_end(logs=epoch_logs or logs)
    _finish(pm, history, memory, chief, checkpoint_dir if backup and backup[3] else None)
    return history


class _Loop:
    """``fit``'s epochs and steps on one job's state (:class:`FitState`): the runtime's
    steps, the callbacks' hooks, the running logs and metrics, and the checkpoints."""

    def __init__(self, pm: Any, data: _Data, view: CallbackModel, cbs: Any, state: FitState,
                 user_callbacks: list, *, checkpoint_dir: str | None,
                 checkpoint_every: int | None, keep: int, steps_per_epoch: int | None) -> None:
        self.pm, self.rt, self.data, self.view, self.cbs = pm, pm.runtime, data, view, cbs
        self.history, self.state, self.user_callbacks = cbs._history, state, user_callbacks
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.keep, self.steps_per_epoch = keep, steps_per_epoch
        self.stream = _Stream(data, state.pass_index, state.pass_position)
        # the compiled metrics, on the global batch (Keras's)
        self.scores = metrics.Scores.of(pm.model)
        self.rt.set_step_values(self.scores is not None)
        if self.scores is not None:
            self.scores.load(state.metrics)

    def begin(self, source: str | None) -> None:
        """``on_train_begin``, then the history and callback states resumed from ``source``
        (after on_train_begin reset them)."""
        state, history = self.state, self.history
        self.cbs.on_train_begin()
        history.epoch, history.history = list(state.epochs), {k: list(v) for k, v in
                                                              state.history.items()}
        if source is not None:
            restore_callback_states(self.user_callbacks, state.callbacks,
                                    callback_arrays(state.path), state.path)

    def checkpoint(self, position: tuple[int, int] | None = None) -> None:
        """Save the job's state (at the stream's ``position``: where the next batch starts)."""
        rt, state, stream = self.rt, self.state, self.stream
        state.step = int(rt.iterations.numpy())
        state.pass_index, state.pass_position = position or (stream.pass_index,
                                                             stream.position)
        state.learning_rate = float(rt.learning_rate.numpy())
        state.history = {k: list(v) for k, v in self.history.history.items()}
        state.epochs = list(self.history.epoch)
        state.callbacks, arrays = callback_states(self.user_callbacks)
        state.metrics = self.scores.state() if self.scores is not None else []
        try:
            save_checkpoint(self.pm, self.checkpoint_dir, state, self.keep, arrays)
        except checkpoints.CheckpointWriteError as e:   # e.g. the directory gone read-only
            save_paused(e, state.step, self.checkpoint_dir)
        except _PEER_ERRORS as e:   # a worker lost during the save's barrier
            if rt._all_local():
                raise
            raise _worker_lost(e, f"the checkpoint of step {state.step}",
                               self.checkpoint_dir) from None

    def begin_epoch(self, epoch: int) -> None:
        """A new epoch's running loss, metrics and data pass, and ``on_epoch_begin``; an
        epoch resumed in its middle gets its hooks again, then the saved rate."""
        rt, state = self.rt, self.state
        if state.step_in_epoch == 0:
            state.loss_sum, state.loss_count = 0.0, 0
            if self.scores is not None:
                self.scores.reset()
            state.epoch_learning_rate = float(rt.learning_rate.numpy())
            if self.steps_per_epoch is None:
                self.stream.start_pass(epoch)
            self.cbs.on_epoch_begin(epoch)
        else:
            rt.learning_rate.assign(state.epoch_learning_rate)
            self.cbs.on_epoch_begin(epoch)
            rt.learning_rate.assign(state.learning_rate)

    def train_epoch(self, logs: dict[str, float]) -> dict[str, float]:
        """The epoch's steps, until its data or ``steps_per_epoch`` run out or a callback
        stops training; returns the last step's logs (``logs`` when there was none)."""
        state, stream, every = self.state, self.stream, self.steps_per_epoch
        pending = False   # a step checkpoint is due: written once another step follows
        while every is None or state.step_in_epoch < every:
            position = (stream.pass_index, stream.position)
            batch = stream.next(roll=every is not None)
            if batch is None:
                if stream.exhausted:   # as Keras's fit: a warning, and training stops
                    logging.warning("%s: the generator ran out of data after %d batches; "
                                    "training stops at epoch %d (a generator is read once: "
                                    "make it yield at least steps_per_epoch x epochs "
                                    "batches, or give a keras.utils.PyDataset or a "
                                    "tf.data.Dataset, read again every epoch)",
                                    self.data.what, state.batches_consumed, state.epoch + 1)
                    self.view.stop_training = True
                break
            if pending:   # (at the epoch's end, the epoch-end checkpoint takes its place)
                self.checkpoint(position)
                pending = False
            logs, failed = self.step(batch)
            if failed is not None:
                if self.view.stop_training:
                    break
                raise failed
            pending = bool(self.checkpoint_every) and \
                int(self.rt.iterations.numpy()) % self.checkpoint_every == 0
            if self.view.stop_training:
                break
        return logs

    def step(self, batch: tuple) -> tuple[dict[str, float], StepError | None]:
        """One training step with its batch hooks: (the running logs, the step's error
        when its loss was not finite, which a callback may answer by stopping)."""
        rt, state = self.rt, self.state
        self.cbs.on_train_batch_begin(state.step_in_epoch)
        start = time.perf_counter()
        failed: StepError | None = None
        try:
            loss = rt.train_step(batch[0], batch[1], worker_share=self.data.cut,
                                 sample_weight=batch[2])
        except StepError as e:
            if "not finite" not in str(e):
                raise
            failed, loss = e, math.nan
        except _PEER_ERRORS as e:
            if rt._all_local():
                raise
            raise _worker_lost(e, f"step {int(rt.iterations.numpy()) + 1}",
                               self.checkpoint_dir) from None
        seconds = time.perf_counter() - start
        rows, b = batch[3], self.data.batch
        state.batches_consumed += 1
        state.loss_sum += loss * rows / b   # a filled-up last batch counts its examples,
        state.loss_count += rows / b        # as Keras's loss tracker weighs it
        state.step_in_epoch += 1
        self.view.last_step = {"step": int(rt.iterations.numpy()), "loss": loss,
                               "seconds": seconds, "examples": rows}
        if self.scores is not None and failed is None:
            self.scores.update(rt.step_values if rows == b else tail_values(
                rt, rt.step_values, rows, b, self.data.had_weights))
        logs = {"loss": state.loss_sum / state.loss_count,
                **(self.scores.results() if self.scores is not None else {})}
        self.cbs.on_train_batch_end(state.step_in_epoch - 1, dict(logs))
        return logs, failed

    def end_epoch(self, epoch: int, val: _Data | None,
                  validation_steps: int | None) -> dict[str, float]:
        """The epoch's logs (with validation), ``on_epoch_end``, the next pass and the
        epoch-end checkpoint; returns the logs."""
        state, scores = self.state, self.scores
        if state.loss_count == 0:
            raise ValueError(f"epoch {epoch + 1}: the data yielded no full global batch of "
                             f"{self.data.batch}")
        epoch_logs = {"loss": state.loss_sum / state.loss_count,
                      **(scores.results() if scores is not None else {})}
        if val is not None:
            val_logs = validate(self.pm.for_inference(), val, validation_steps,
                                metrics.Scores.of(self.pm.model), self.cbs, self.view)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        self.cbs.on_epoch_end(epoch, epoch_logs)
        state.epoch, state.step_in_epoch = epoch + 1, 0
        state.loss_sum, state.loss_count = 0.0, 0
        if self.steps_per_epoch is None:
            self.stream.start_pass(epoch + 1)
        if self.checkpoint_dir:
            self.checkpoint()
        return epoch_logs


def _finish(pm: Any, history: Any, memory: bool, chief: bool, delete: str | None) -> None:
    """fit's end: with ``verbose`` (on every worker: it all-reduces) the plan's memory per
    device beside each worker's measured peak as ``history.memory`` (printed by the chief);
    ``delete``: BackupAndRestore's directory, removed by the chief."""
    if memory:
        history.memory = pm.memory_report()
        if chief:
            print(history.memory.table(), flush=True)
    if delete and chief:   # BackupAndRestore(delete_checkpoint)
        shutil.rmtree(delete, ignore_errors=True)


def _prepare_directory(rt: Any, checkpoint_dir: str) -> None:
    """The checkpoint directory made, checked writable with room for one checkpoint, and
    cleared of a crashed save's temporaries (``tapas.execution.runtime.checkpoints``)."""
    checkpoints.prepare_directory(checkpoint_dir)
    clean_temporaries(checkpoint_dir)
    checkpoints.check_space(checkpoint_dir, checkpoints.checkpoint_bytes(rt))


def _start_state(pm: Any, checkpoint_dir: str | None, resume: bool, resume_from: str | None,
                 initial_epoch: int) -> tuple[str | None, FitState]:
    """(the checkpoint resumed from or None, the FitState the job starts in)."""
    source = resume_from or (checkpoint_dir if resume and checkpoint_dir and
                             latest_checkpoint(checkpoint_dir) else None)
    if resume_from is None and resume and source is None:
        logging.info("fit: no checkpoint in %s yet; starting at epoch %d", checkpoint_dir,
                     initial_epoch)
    if source is None:
        return None, FitState(epoch=initial_epoch, pass_index=initial_epoch,
                              learning_rate=float(pm.runtime.learning_rate.numpy()))
    state = restore_checkpoint(pm, source)
    logging.info("fit: resumed at step %d (epoch %d, step %d of it; %d batches consumed)",
                 state.step, state.epoch + 1, state.step_in_epoch, state.batches_consumed)
    return source, state


def _check_arguments(epochs: int, initial_epoch: int, steps_per_epoch: int | None,
                     checkpoint_dir: str | None, checkpoint_every: int | None, resume: bool,
                     keep: int) -> None:
    """``fit``'s counts and their combinations, each refused with its fix."""
    if epochs < 1 or initial_epoch < 0:
        raise ValueError(f"epochs={epochs}, initial_epoch={initial_epoch}: need epochs >= 1 "
                         "and initial_epoch >= 0")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch}: need at least 1, or None (one "
                         "pass over the data per epoch)")
    if checkpoint_every is not None and (checkpoint_every < 1 or not checkpoint_dir):
        raise ValueError(f"checkpoint_every={checkpoint_every}: needs checkpoint_dir=DIR and "
                         "a step count >= 1")
    if resume and not checkpoint_dir:
        raise ValueError("resume=True needs checkpoint_dir=DIR (where fit writes and looks "
                         "for checkpoints); or pass resume_from=PATH")
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1)")


def _validation_data(pm: Any, validation_data: Any, batch_size: int | None) -> Any:
    """The validation data as batches of the inference-mode program (as Keras), or None."""
    if validation_data is None:
        return None
    vx, vy, vw = _split_validation(validation_data)
    ev = pm.for_inference()
    return _Data(ev, vx, vy, batch_size, False, 0, what="validation data",
                 sample_weight=vw, pad_last=exact_tail(ev.runtime))


def _backup_and_restore(callbacks: Any, checkpoint_dir: str | None,
                        checkpoint_every: int | None) -> tuple[list, tuple | None]:
    """``keras.callbacks.BackupAndRestore`` taken out of ``callbacks`` and turned into
    fit's own checkpoints: (other callbacks, (checkpoint_dir=its backup_dir,
    checkpoint_every=its integer save_freq or None for "epoch", resume=True, delete the
    directory after a successful fit)) or None without one."""
    rest, found = [], []
    for cb in list(callbacks or []):
        (found if isinstance(cb, keras.callbacks.BackupAndRestore) else rest).append(cb)
    if not found:
        return rest, None
    if len(found) > 1 or checkpoint_dir is not None or checkpoint_every is not None:
        raise ValueError("BackupAndRestore stands for fit(checkpoint_dir=its backup_dir, "
                         "resume=True): give one, and no checkpoint_dir/checkpoint_every "
                         "besides (or drop it and pass those)")
    cb = found[0]
    freq = cb.save_freq
    if freq not in ("epoch",) and not (isinstance(freq, int) and freq > 0):
        raise ValueError(f"BackupAndRestore(save_freq={freq!r}): fit checkpoints at each "
                         "epoch end ('epoch') and every K steps (an integer K); pass one "
                         "of those")
    every = None if freq == "epoch" else int(freq)
    return rest, (cb.backup_dir, every, True, bool(cb.delete_checkpoint))


def _split_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    if isinstance(validation_data, types.GeneratorType):
        raise ValueError("validation_data: a generator is read once, and validation runs "
                         "after every epoch: give a keras.utils.PyDataset, a tf.data.Dataset "
                         "or arrays")
    if isinstance(validation_data, (tf.data.Dataset, keras.utils.PyDataset)):
        return validation_data, None, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return (*validation_data, None)[:3]
    raise ValueError("validation_data: give (x_val, y_val), (x_val, y_val, "
                     "sample_weight_val), or a tf.data.Dataset or keras.utils.PyDataset of "
                     f"(x, y[, sample_weight]) global batches, got {type(validation_data).__name__}"
                     + (f" of {len(validation_data)}" if isinstance(validation_data,
                                                                    (tuple, list)) else ""))
