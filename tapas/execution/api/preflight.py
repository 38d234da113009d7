"""Checks of ``tapas train``'s options and data made before any model is captured or any
plan searched: each mistake found here costs a second, not a capture and a search.

In:  the run's options (``tapas.execution.api.train.TrainOptions``); after the model is built,
     the model, its input specs and loss, and the ``--data`` ``.npz`` or TFRecord files.
Out: nothing when everything fits; the run then proceeds as before. :func:`say_resume`
     prints which checkpoint ``--resume`` continues from, the damaged ones it skips, and
     that ``--learning_rate`` yields to the checkpoint's rate.
Raises: :class:`PreflightError` (a ValueError) naming the flag or file, the value, the
     constraint and the fix: a device, worker, step or batch count below 1, a strategy
     file that cannot be read or is not a strategy, a checkpoint directory that cannot be
     created or written, ``--data`` arrays whose names, per-example shapes, dtypes, token
     ids or labels do not fit the model.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["PreflightError", "check_options", "check_data", "check_npz", "check_tfrecord",
           "check_model_file", "say_resume"]


class PreflightError(ValueError):
    """An option or input that cannot work, found before the run starts."""


def _at_least_one(flag: str, value: int | None, fix: str) -> None:
    if value is not None and value < 1:
        raise PreflightError(f"--{flag}={value}: the {fix[0]} must be at least 1: pass "
                             f"--{flag}=N with N >= 1{fix[1]}")


def check_options(opts: Any) -> None:
    """The counts, the combinations, the ``--data`` files, the strategy file and the
    checkpoint directory of ``opts``."""
    from tapas.execution.api.train_data import data_files
    if opts.steps < 1:
        raise PreflightError(f"--steps={opts.steps}: need at least 1 step")
    if opts.is_job and opts.verify:
        raise PreflightError("--verify compares --steps steps on the synthetic batch with the "
                             "Keras model; it cannot be combined with --data, --epochs, "
                             "--checkpoint_dir, --resume or --tensorboard: run them separately")
    if opts.data and not data_files(opts.data):
        raise PreflightError(f"--data={opts.data}: no such file; give an .npz with one array per "
                             "model input (named by input name) and the targets as 'y', or "
                             ".tfrecord file(s) (a glob or a comma-separated list) of "
                             "tf.train.Example records (docs/running.md)")
    if opts.epochs is not None and opts.epochs < 1:
        raise PreflightError(f"--epochs={opts.epochs}: need at least 1 epoch")
    if (opts.checkpoint_every or opts.resume) and not opts.checkpoint_dir:
        raise PreflightError("--checkpoint_every and --resume need --checkpoint_dir=DIR")
    if getattr(opts, "elastic", False) and (opts.workers < 2 or not opts.checkpoint_dir
                                            or opts.mesh):
        raise PreflightError("--elastic restarts a --workers=K job (K >= 2) on the workers "
                             "that remain from its newest checkpoint: give --workers=K and "
                             "--checkpoint_dir=DIR (and no --mesh, whose shape is fixed)")
    wait = getattr(opts, "elastic_wait_s", None)
    if wait is not None and (wait <= 0 or not getattr(opts, "elastic", False)):
        raise PreflightError(f"--elastic_wait_s={wait:g}: it is how long an --elastic job "
                             "waits for a replacement worker after a loss; give a positive "
                             "number of seconds with --elastic, or leave it out")
    if opts.devices_per_worker < 1 or (opts.devices_per_worker > 1 and not opts.workers
                                       and not os.environ.get("TF_CONFIG")):
        raise PreflightError(f"--devices_per_worker={opts.devices_per_worker}: it sets the "
                             "devices of each process of --workers=K (at least 1); for one "
                             "process use --devices=N")
    if not opts.workers:
        _at_least_one("devices", opts.devices, ("device count", ""))
    if opts.workers < 0:
        raise PreflightError(f"--workers={opts.workers}: the worker count cannot be "
                             "negative: pass --workers=K with K >= 2 for K processes, or "
                             "leave it out (one process)")
    _at_least_one("batch_size", opts.batch_size, ("global batch", " (or leave it out for "
                                                  "the model's batch)"))
    _at_least_one("checkpoint_every", opts.checkpoint_every,
                  ("step count between checkpoints", " (or leave it out: a checkpoint at "
                   "each epoch end)"))
    if opts.strategy:
        check_strategy(opts.strategy)
    if opts.checkpoint_dir:
        from tapas.execution.runtime import checkpoints
        try:
            checkpoints.prepare_directory(opts.checkpoint_dir)
        except checkpoints.CheckpointDirectoryError as e:
            raise PreflightError(f"--checkpoint_dir={opts.checkpoint_dir}: {e}") from None


def check_model_file(path: str) -> None:
    """``--model=path``: a ``.keras`` file must be the zip archive Keras writes."""
    import zipfile
    if path.endswith(".keras") and os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise PreflightError(f"--model={path}: not a Keras archive (a .keras file is the zip "
                             f"model.save('name.keras') writes; this is "
                             f"{os.path.getsize(path)} bytes of something else): save the "
                             "model again")


def check_strategy(strategy: str) -> None:
    """``--strategy``: ``random:SEED`` with an integer seed, or a readable strategy file."""
    if strategy.startswith("random:"):
        seed = strategy.split(":", 1)[1]
        if not seed.lstrip("-").isdigit():
            raise PreflightError(f"--strategy={strategy}: the seed {seed!r} is not an "
                                 "integer: pass --strategy=random:SEED, e.g. random:0")
        return
    if not os.path.exists(strategy):
        raise PreflightError(f"--strategy={strategy}: no such file (give a Strategy JSON from "
                             "`tapas search --out=...`, 'random:SEED', or leave it out to "
                             "search)")
    from tapas.planning.strategy import Strategy
    try:
        Strategy.load(strategy)
    except ValueError as e:
        raise PreflightError(f"--strategy={strategy}: {e}") from None


def check_npz(path: str, model: Any, specs: Any, loss: Any) -> None:
    """The arrays of ``--data=path`` (an ``.npz``) against the model's inputs (names,
    per-example shapes, dtypes, token ids below the embeddings' vocabulary) and its output
    (the targets' values per example; class ids within the classes)."""
    import numpy as np

    from tapas.execution.runtime.inputs import InputSignature
    from tapas.execution.api.train_data import load_npz
    try:
        signature = InputSignature.of(model, specs)
    except ValueError:
        return   # the capture reports it, with its own fix

    class _Named:
        inputs = signature

    try:
        x, y = load_npz(path, _Named())
    except (OSError, ValueError) as e:
        raise PreflightError(f"--data={path}: numpy cannot read it as an .npz "
                             f"({type(e).__name__}: {e}): write it with np.savez(path, y=..., "
                             "one array per input name)") from None
    vocabulary = _largest_vocabulary(model)
    for name, spec in zip(signature.names, signature.specs):
        _check_input(path, name, np.asarray(x[name]), spec, vocabulary)
    _check_targets(path, np.asarray(y), model, loss)


def check_data(data: str | None, model: Any, specs: Any, loss: Any) -> None:
    """``--data`` (an ``.npz`` or TFRecord files; nothing when not given) against the
    model: :func:`check_npz` or :func:`check_tfrecord`."""
    if data:
        (check_npz if data.endswith(".npz") else check_tfrecord)(data, model, specs, loss)


def check_tfrecord(spec: str, model: Any, specs: Any, loss: Any) -> None:
    """The TFRecord files of ``--data=spec`` against the model, as :func:`check_npz` checks
    an ``.npz``: the first record's features (names, values per example: the layout
    ``load_tfrecord`` reads), then the first global batch's values (token ids, labels)."""
    import keras
    import numpy as np

    from tapas.execution.runtime.inputs import InputSignature
    from tapas.execution.api.train_data import TrainError, load_tfrecord, tf_errors
    try:
        signature = InputSignature.of(model, specs)
    except ValueError:
        return   # the capture reports it, with its own fix
    outputs = keras.tree.flatten(getattr(model, "outputs", None) or [])
    shapes = [tuple(int(signature.specs[0].shape[0]) if d is None else d
                    for d in o.shape) for o in outputs[:1]]

    class _Named:   # what load_tfrecord reads of a ParallelModel
        inputs = signature

        class program:   # noqa: N801
            output_shapes = shapes if shapes and None not in shapes[0] else None

    try:
        x, y = next(iter(load_tfrecord(spec, _Named()).take(1)), (None, None))
    except TrainError as e:
        raise PreflightError(str(e)) from None
    except tf_errors() as e:
        raise PreflightError(f"--data={spec}: TensorFlow cannot read its records "
                             f"({type(e).__name__}: {str(e).splitlines()[0]}): write them "
                             "with tapas.execution.api.train.save_tfrecord") from None
    if x is None:
        return   # fewer examples than one batch: load_tfrecord's caller says so
    vocabulary = _largest_vocabulary(model)
    for name, s in zip(signature.names, signature.specs):
        _check_input(spec, name, np.asarray(x[name]), s, vocabulary)
    _check_targets(spec, np.asarray(y), model, loss)


def _check_input(path: str, name: str, a: Any, spec: Any, vocabulary: int | None) -> None:
    want = spec.shape.as_list()[1:]
    if list(a.shape[1:]) != want:
        raise PreflightError(f"--data={path}: input '{name}' holds examples of shape "
                             f"{list(a.shape[1:])} (array {list(a.shape)}), the model takes "
                             f"{want} per example ({spec.dtype.name}): save it with that "
                             "shape, the first axis counting the examples")
    if a.dtype.kind not in "biuf":
        raise PreflightError(f"--data={path}: input '{name}' has dtype {a.dtype}, the model "
                             f"takes {spec.dtype.name}: save a numeric array")
    if spec.dtype.is_integer and a.dtype.kind == "f":
        raise PreflightError(f"--data={path}: input '{name}' has dtype {a.dtype.name}, the "
                             f"model takes {spec.dtype.name} (ids or a mask): save integers, "
                             f"e.g. x.astype('{spec.dtype.name}')")
    if spec.dtype.is_integer and vocabulary and a.size and int(a.max()) >= vocabulary:
        raise PreflightError(f"--data={path}: input '{name}' holds the id {int(a.max())}, "
                             f"but the model's largest embedding has {vocabulary} rows (ids "
                             f"0 to {vocabulary - 1}): map the ids into the vocabulary the "
                             "model was built with")


def _check_targets(path: str, y: Any, model: Any, loss: Any) -> None:
    import keras
    outputs = getattr(model, "outputs", None)
    if not outputs or len(keras.tree.flatten(outputs)) != 1:
        return
    out = list(keras.tree.flatten(outputs)[0].shape[1:])
    if any(d is None for d in out):
        return
    sparse = isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
    want = out[:-1] if sparse else out
    per_example = math.prod(y.shape[1:])
    if per_example != math.prod(want):
        kind = "class ids" if sparse else "targets"
        raise PreflightError(f"--data={path}: 'y' holds examples of shape {list(y.shape[1:])}"
                             f" (array {list(y.shape)}), but the model's output is {out} per "
                             f"example, so its {type(loss).__name__} takes {kind} of shape "
                             f"{want} per example: save y with that shape")
    if sparse and y.size and out[-1]:
        ignore = getattr(loss, "ignore_class", None)
        ids = y if ignore is None else y[y != ignore]
        if ids.size and (ids.min() < 0 or ids.max() >= out[-1]):
            bad = int(ids.max()) if ids.max() >= out[-1] else int(ids.min())
            raise PreflightError(f"--data={path}: 'y' holds the class id {bad}, but the "
                                 f"model has {out[-1]} classes (ids 0 to {out[-1] - 1}): "
                                 "save labels within them")


def _largest_vocabulary(model: Any) -> int | None:
    """The most rows of any Embedding layer of ``model`` (None without one): an integer
    input at or above it cannot index any of them."""
    import keras
    sizes = [int(layer.input_dim) for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, keras.layers.Embedding)]
    return max(sizes) if sizes else None


def say_resume(opts: Any, say: Any) -> None:
    """Which checkpoint ``--resume`` continues from, the damaged newer ones it skips (and
    why), and that ``--learning_rate`` yields to the checkpoint's rate."""
    import json
    import sys

    from tapas.execution.api import fit_checkpoints
    found, skipped = fit_checkpoints.usable_checkpoint(opts.checkpoint_dir)
    for path, why in skipped:
        say(f"\nskipping the damaged checkpoint {path}: {why}")
    if not found:
        say(f"\nno checkpoint in {opts.checkpoint_dir} yet: starting from the beginning"
            if not skipped else "")
        return
    say(f"\nresuming from {found}")
    if opts.learning_rate is not None:
        try:
            with open(os.path.join(found, fit_checkpoints.FIT_STATE)) as f:
                rate = f"{float(json.load(f)['learning_rate']):.6g}"
        except (OSError, ValueError, KeyError, TypeError):
            rate = "unreadable"
        message = (f"--learning_rate={opts.learning_rate} is not used: --resume continues "
                   f"at the checkpoint's learning rate ({rate}) with its weights and "
                   "optimizer state; to train at another rate, start a new run (a new "
                   "--checkpoint_dir) from weights saved with ParallelModel.to_keras()")
        say(f"note: {message}")
        print(f"tapas train: warning: {message}", file=sys.stderr, flush=True)
