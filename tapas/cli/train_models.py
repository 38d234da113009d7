"""``tapas train --model=NAME``: the model zoo preset or saved model the training job builds.

In:  ``--model`` (a zoo name, default the zoo's default, or a saved ``.keras`` path).
Out: a model source for ``tapas.execution.api.train.train`` (``name``, ``check()``,
     ``build(opts)`` -> ``tapas.execution.api.train_model.BuiltModel``): a zoo preset built
     with seed 0, compiled with its optimizer and loss, on its synthetic batch.
Raises: ``TrainError`` (from ``check``) naming the zoo's choices for an unknown name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tapas import models
from tapas.execution.api.train_data import TrainError
from tapas.execution.api.train_model import BuiltModel, is_path, saved_model_source

__all__ = ["ZooModelSource", "model_source"]


def model_source(name: str | None) -> Any:
    """The source of ``--model``: a saved model's path or a zoo preset (the default when
    ``name`` is None)."""
    name = name or models.DEFAULT_MODEL
    return saved_model_source(name) if is_path(name) else ZooModelSource(name)


@dataclasses.dataclass(frozen=True)
class ZooModelSource:
    """A zoo preset, trained on its synthetic data with its compiled optimizer and loss."""

    name: str

    def check(self) -> None:
        try:
            models.get(self.name)
        except ValueError as e:
            raise TrainError(f"--model={self.name}: {e} (give a zoo name, which trains on "
                             "the model's synthetic data, or the path of a saved .keras "
                             "model)") from None

    def build(self, opts: Any) -> BuiltModel:
        """The preset compiled as a user would, with batch ``opts.batch_size``."""
        entry = models.get(self.name)
        model = _compiled(entry, opts)
        xs, y = entry.synthetic_batch(opts.batch_size)
        return BuiltModel(model, self.name, list(entry.input_spec(opts.batch_size)), list(xs),
                          y, entry.keras_loss())


def _compiled(entry: Any, opts: Any) -> Any:
    """The zoo model compiled with its optimizer and loss (seed 0). Its weights are left
    unallocated (``tapas.execution.runtime.materialize.build_lazily``: each worker then
    creates only its shards) unless something runs the Keras model itself: ``--verify``
    and the ``measure`` calibrations."""
    from tapas.execution.runtime import materialize
    eager = opts.verify or any(v is not None for v in (opts.compute_scale, opts.kernel_times,
                                                         opts.communication_scale))
    if eager:
        return entry.build_compiled(seed=0)
    model = materialize.build_lazily(lambda: entry.build(seed=0))
    model.compile(optimizer=entry.keras_optimizer(), loss=entry.keras_loss())
    return model
