"""The checkpoints of a fit job: ``<dir>/ckpt-<step>`` directories, each the runtime's
shards (``tapas.execution.runtime.checkpoints``), ``tapas-fit.json`` (:class:`FitState`), the
callbacks' arrays and a manifest of every file's size and SHA-256.

In:  a ParallelModel, a checkpoint directory, a :class:`FitState`.
Out: :func:`save_checkpoint` writes one atomically (a temporary directory renamed into
     place, verified before any older one is deleted); :func:`restore_checkpoint` loads one,
     or from a directory the newest that is whole and loads, skipping damaged newer ones
     (``FitState.skipped``: which, and why); :func:`usable_checkpoint` says which that is
     without loading; :func:`list_checkpoints` / :func:`latest_checkpoint` list them.
Raises: ``checkpoints.CheckpointWriteError`` (an OSError) from a save that could not write
     (on every worker alike; earlier checkpoints untouched); ValueError naming the
     checkpoint when none under a directory loads, or a given one is damaged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from tapas.execution.runtime import checkpoints

__all__ = ["FitState", "FIT_STATE", "CALLBACK_ARRAYS", "list_checkpoints",
           "latest_checkpoint", "usable_checkpoint", "save_checkpoint", "restore_checkpoint",
           "callback_arrays", "clean_temporaries", "save_paused"]

FIT_STATE = "tapas-fit.json"
CALLBACK_ARRAYS = "tapas-callbacks.npz"
_FORMAT = "tapas-fit-1"
_CKPT = re.compile(r"^ckpt-(\d+)$")


@dataclasses.dataclass
class FitState:
    """Where a fit job stands; written as ``tapas-fit.json`` in each checkpoint."""

    step: int = 0                 # optimizer steps taken (the runtime's step counter)
    epoch: int = 0                # the epoch in progress (or the next one, at an epoch end)
    step_in_epoch: int = 0        # steps of that epoch already taken
    pass_index: int = 0           # the data position: the pass over the data ...
    pass_position: int = 0        # ... and the batches of it consumed
    batches_consumed: int = 0     # batches trained on since the job began
    loss_sum: float = 0.0         # the epoch's step losses so far (its running mean)
    loss_count: float = 0   # examples / global batch (a filled-up last batch: less)
    learning_rate: float = 0.0
    # the learning rate before the epoch's on_epoch_begin: a resumed epoch calls it again
    # from there (a schedule of the current rate then sets the same rate)
    epoch_learning_rate: float = 0.0
    history: dict[str, list] = dataclasses.field(default_factory=dict)
    epochs: list[int] = dataclasses.field(default_factory=list)
    # each callback's own state (callback_states; its arrays in tapas-callbacks.npz)
    callbacks: list = dataclasses.field(default_factory=list)
    # the compiled metrics' variables in the epoch so far (metrics.Scores.state)
    metrics: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> FitState:
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{where}: format {got!r}, expected {_FORMAT!r}; "
                             "was it written by tapas.execution.api.fit?")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def list_checkpoints(directory: str) -> list[str]:
    """The complete checkpoints under ``directory`` (``ckpt-<step>`` holding
    ``tapas-fit.json``), oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _CKPT.match(name)
        if m and os.path.exists(os.path.join(directory, name, FIT_STATE)):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def usable_checkpoint(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest checkpoint under ``directory`` that is whole, or None; the newer ones
    skipped as ``(path, why)``), by ``checkpoints.damage``: files, metadata and checksums,
    without loading it."""
    skipped = []
    for path in reversed(list_checkpoints(directory)):
        why = checkpoints.damage(path, (FIT_STATE,))
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def _write_json_synced(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: str) -> None:
    """Rename ``path`` out of the checkpoints' names, then delete it (a half-deleted
    checkpoint is never listed)."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_temporaries(directory: str) -> None:
    """Remove what interrupted saves left (``.tmp-*``, ``.trash-*``)."""
    for name in os.listdir(directory):
        if name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def save_checkpoint(pm: Any, directory: str, state: FitState, keep: int = 3,
                    arrays: dict[str, np.ndarray] | None = None) -> str:
    """Write the runtime's checkpoint and ``state`` as ``<directory>/ckpt-<step>``, atomically:
    every worker writes its shards into ``.tmp-ckpt-<step>`` (``checkpoints.save``, which
    returns after all have), then the chief adds ``tapas-fit.json`` and the manifest
    (synced), renames the directory into place and verifies it; only then are checkpoints
    beyond the newest ``keep`` deleted. A checkpoint of the same step is replaced. Every
    worker must call it (the shards are per worker). ``arrays``: the callbacks' arrays
    (``callback_states``), written beside the fit state. CheckpointWriteError on every
    worker when a file could not be written (or ``directory`` is gone)."""
    rt = pm.runtime
    name = f"ckpt-{state.step:08d}"
    final = os.path.join(directory, name)
    if not checkpoints.agree(rt, os.path.isdir(directory)):
        raise checkpoints.CheckpointWriteError(f"cannot write the checkpoint {final}: the "
                                               f"checkpoint directory {directory} is gone")
    tmp = os.path.join(directory, f".tmp-{name}")
    checkpoints.save(rt, tmp)
    problem = None
    if rt.task_id == 0:
        try:
            _publish(tmp, final, state, arrays)
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            why = checkpoints.damage(final, (FIT_STATE,))
            if why is not None:
                problem = f"it does not verify after writing ({why})"
            else:
                for old in list_checkpoints(directory)[:-keep]:
                    _remove(old)
    # published on every worker when this returns (no worker writes the next save's files
    # while the chief still moves this one)
    if not checkpoints.agree(rt, problem is None):
        raise checkpoints.CheckpointWriteError(
            f"cannot write the checkpoint {final}: "
            f"{problem or 'the chief worker could not publish it'}")
    return final


def _publish(tmp: str, final: str, state: FitState, arrays: Any) -> None:
    """The chief's part of a save: the callbacks' arrays, the fit state and the manifest
    into ``tmp`` (synced), then ``tmp`` renamed to ``final``."""
    if arrays:   # the callbacks' arrays (EarlyStopping's best weights)
        with open(os.path.join(tmp, CALLBACK_ARRAYS), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
    _write_json_synced(os.path.join(tmp, FIT_STATE), state.to_json())
    checkpoints.write_manifest(tmp)
    if os.path.exists(final):
        _remove(final)
    os.rename(tmp, final)


def save_paused(error: Exception, step: int, directory: str) -> None:
    """Warn that the checkpoint of ``step`` could not be written and training goes on
    (the next checkpoint tries again); the newest checkpoint kept is named."""
    newest = latest_checkpoint(directory) or (
        "none" if os.path.isdir(directory) else "none here (the directory is gone)")
    logging.warning("fit: %s; saving is paused and training goes on (the next checkpoint "
                    "tries again once %s is writable); the newest checkpoint kept is %s",
                    error, directory, newest)


# errors of reading a damaged checkpoint (a model or optimizer that does not match raises
# other ValueErrors, which no older checkpoint cures)
_DAMAGE = (OSError, IndexError, KeyError, json.JSONDecodeError, UnicodeDecodeError,
           tf.errors.OpError, checkpoints.CheckpointDamagedError)


def restore_checkpoint(pm: Any, path: str) -> FitState:
    """Load ``path`` into ``pm``: weights, optimizer slots, step counter, learning rate and
    seed states; returns its FitState (``.path``: the checkpoint read; ``.skipped``: the
    newer checkpoints passed over, ``(path, why)``; the callbacks' states are set by
    ``fit``). ``path`` is a checkpoint, or a directory of them: the newest that is whole
    and loads."""
    if os.path.exists(os.path.join(path, FIT_STATE)):
        why = checkpoints.damage(path, (FIT_STATE,))
        if why is not None:
            raise ValueError(f"checkpoint {path} is damaged: {why}; resume from an older "
                             f"one (give its directory's parent to take the newest whole one)")
        try:
            return _restore_one(pm, path, [])
        except _DAMAGE as e:
            raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: "
                             f"{_line(e)}); resume from an older one") from None
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"resume from {path}: no {FIT_STATE} there and no "
                                "complete ckpt-<step> directory under it; give a "
                                "checkpoint_dir written by fit(checkpoint_dir=...)")
    skipped: list[tuple[str, str]] = []
    for candidate in reversed(found):
        why = checkpoints.damage(candidate, (FIT_STATE,))
        if why is None:
            try:
                return _restore_one(pm, candidate, skipped)
            except _DAMAGE as e:
                why = f"it cannot be read ({type(e).__name__}: {_line(e)})"
        logging.warning("fit: skipping the checkpoint %s: %s", candidate, why)
        skipped.append((candidate, why))
    listing = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
    raise ValueError(f"resume from {path}: none of its {len(found)} checkpoints is whole "
                     f"({listing}); move them away and start afresh (without --resume / "
                     "resume=True)")


def _line(e: BaseException) -> str:
    text = (getattr(e, "message", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _restore_one(pm: Any, path: str, skipped: list[tuple[str, str]]) -> FitState:
    with open(os.path.join(path, FIT_STATE)) as f:
        try:
            state = FitState.from_json(json.load(f), path)
        except ValueError as e:
            raise checkpoints.CheckpointDamagedError(str(e)) from None
    rt = pm.runtime
    rt.restore(path)
    if int(rt.iterations.numpy()) != state.step:
        raise checkpoints.CheckpointDamagedError(
            f"checkpoint {path}: its shards hold step {int(rt.iterations.numpy())} but "
            f"{FIT_STATE} says {state.step}; the directory was altered")
    rt.learning_rate.assign(state.learning_rate)   # the seed states: in the shards' files
    state.path = path
    state.skipped = list(skipped)
    return state


def callback_arrays(path: str) -> dict[str, np.ndarray]:
    """The callbacks' arrays saved in checkpoint ``path`` ({} without any)."""
    file = os.path.join(path, CALLBACK_ARRAYS)
    if not os.path.exists(file):
        return {}
    with np.load(file) as f:
        return {k: f[k] for k in f.files}
