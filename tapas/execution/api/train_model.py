"""The model ``tapas train`` trains, as the training job receives it: a source it checks
before any work and builds once the devices exist.

In:  a saved model's path (:class:`SavedModelSource`); zoo presets are resolved by the
     command line (``tapas.cli.train_models``), which hands the job a source of the same
     shape (``name``, ``check()``, ``build(opts)``).
Out: :class:`BuiltModel` (the model, its name, input specs, a synthetic batch, its Keras
     loss).
Raises: ``TrainError`` naming ``--model``, what is wrong and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

from tapas.execution.api.train_data import TrainError

__all__ = ["BuiltModel", "ModelSource", "SavedModelSource", "is_path", "saved_model_source"]


@dataclasses.dataclass(frozen=True)
class BuiltModel:
    """A model ready to train: its input specs, a synthetic batch ``(xs, y)`` in its
    input structure and the Keras loss it trains with."""

    model: Any
    name: str
    specs: Any
    xs: Any
    y: Any
    loss: Any


class ModelSource(Protocol):
    """What the training job needs of ``--model``: ``check()`` raises ``TrainError`` before
    any work; ``build(opts)`` builds (after the devices are configured)."""

    name: str

    def check(self) -> None: ...

    def build(self, opts: Any) -> BuiltModel: ...


def is_path(name: str) -> bool:
    """Whether ``--model`` names a saved model's file rather than a zoo preset."""
    return name.endswith(".keras") or os.path.sep in name


def saved_model_source(name: str | None) -> SavedModelSource:
    """The source of a saved model's path; ``TrainError`` for anything else (a zoo name is
    resolved by the command line, ``tapas.cli.train_models.model_source``)."""
    if not name or not is_path(name):
        raise TrainError(f"--model={name or ''}: the training job takes the path of a model "
                         "saved with model.save('name.keras'); a zoo name is resolved by "
                         "`tapas train` (tapas.cli.train_models.model_source)")
    return SavedModelSource(name)


@dataclasses.dataclass(frozen=True)
class SavedModelSource:
    """A model saved with ``model.save('name.keras')``, trained on a random batch in its
    input structure (``tapas.execution.runtime.inputs.synthetic_batch``) with its compiled
    loss (mean squared error when it was saved uncompiled)."""

    name: str

    def check(self) -> None:
        if not os.path.exists(self.name):
            raise TrainError(f"--model={self.name}: no such file; give a zoo name (tapas "
                             "models) or the path of a model saved with "
                             "model.save('name.keras')")
        from tapas.execution.api import preflight
        try:
            preflight.check_model_file(self.name)
        except preflight.PreflightError as e:
            raise TrainError(str(e)) from None

    def build(self, opts: Any) -> BuiltModel:
        """The model with batch ``opts.batch_size`` (default 8)."""
        model, specs, xs, y, loss = _load(self.name, opts.batch_size)
        return BuiltModel(model, os.path.basename(self.name), specs, xs, y, loss)


def _load(path: str, batch_size: int | None) -> tuple[Any, Any, Any, Any, Any]:
    """(model, input specs in its structure with batch ``batch_size`` (default 8), a
    synthetic batch in that structure, targets, loss) of the saved model at ``path``."""
    import keras
    import tensorflow as tf

    from tapas.execution.api import parallel
    from tapas.execution.runtime import inputs
    try:
        import keras_hub  # noqa: F401  (registers its layers, which saved models name)
    except ImportError:
        pass
    try:
        model = keras.saving.load_model(path)
    except Exception as e:  # Keras raises many types for a file it cannot read
        raise TrainError(f"--model={path}: Keras cannot load it ({type(e).__name__}: "
                         f"{str(e)[:300]}); save it with model.save('name.keras') and import "
                         "the library that defines its custom layers") from None
    batch = batch_size or 8
    structure = inputs.keras_structure(model)
    if structure is None:
        raise TrainError(f"--model={path}: the model has no symbolic inputs (a subclassed "
                         "model); save a functional or Sequential model built on keras.Input")
    leaves = keras.tree.flatten(structure)
    unknown = [(t.name, list(t.shape)) for t in leaves if None in tuple(t.shape)[1:]]
    if unknown:
        raise TrainError(f"--model={path}: input '{unknown[0][0]}' has shape {unknown[0][1]}; "
                         "tapas train needs every dimension but the batch fixed: build the "
                         "model with keras.Input(shape=(...)) of static size and save it again")
    specs = keras.tree.pack_sequence_as(structure, [
        tf.TensorSpec((batch,) + tuple(t.shape)[1:], t.dtype) for t in leaves])
    try:
        loss = parallel.training_loss(model)
        signature = inputs.InputSignature.of(model, specs)
        xs, y = inputs.synthetic_batch(model, signature, loss)
    except ValueError as e:
        raise TrainError(f"--model={path}: {e}") from None
    return model, specs, xs, y, loss
