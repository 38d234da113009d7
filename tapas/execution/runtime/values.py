"""Global values of the runtime's shards: read, written, saved and restored.

In:  the runtime's shard variables and optimizer slots, or global NumPy values.
Out: ``GlobalValues``, mixed into :class:`tapas.execution.runtime.Runtime`: every weight's
     and slot's global value (reassembled from the shards), global values cut into this
     layout and assigned, the weights and the optimizer's state written into the Keras
     model (for Keras's own saving), checkpoints
     (``tapas.execution.runtime.checkpoints``).
Raises ``ValueError`` when the Keras model lacks one of the runtime's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tapas.capturing.tracing import weights_by_path
from tapas.execution.runtime import checkpoints, shards
from tapas.execution.program.plan import WeightLayout
from tapas.execution.training import gathering

__all__ = ["GlobalValues"]

_EXPORT_FIX = ("save the weights only (ModelCheckpoint(save_weights_only=True), "
               "to_keras().save_weights) or a resumable checkpoint (fit's checkpoint_dir)")


class GlobalValues:
    """Global values and checkpoints, for :class:`~tapas.execution.runtime.Runtime`."""

    def _j(self, replica: int) -> int:
        """The shard index (mesh column) of a replica."""
        return replica % self.num_devices

    def _cut(self, spec: WeightLayout, value: np.ndarray, replica: int) -> np.ndarray:
        """Replica ``replica``'s part of the global ``value`` (``shards.cut``)."""
        return shards.cut(self, spec, value, replica)

    def _global(self, tensors: Mapping[int, Mapping[str, tf.Variable]],
                paths: Sequence[str]) -> dict[str, np.ndarray]:
        return gathering.global_values(self, tensors, paths)

    def global_weights(self) -> dict[str, np.ndarray]:
        """Every weight's global value, reassembled from the shards."""
        return self._global(self._vars, self.paths)

    def global_slots(self) -> dict[str, dict[str, np.ndarray]]:
        """Every optimizer slot's global value: ``{slot name: {path: value}}``."""
        return {k: self._global({r: {p: s[p][k] for p in s} for r, s in self._slots.items()},
                                self.trainable_paths)
                for k in self.optimizer.slot_names}

    def set_global_weights(self, values: Mapping[str, np.ndarray],
                           slots: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
        """Cut global values into this layout's shards and assign them."""
        for r in self.local_replicas:
            for p, v in values.items():
                self._vars[r][p].assign(self._cut(self.specs[p], v, r))
            for k, per_path in (slots or {}).items():
                for p, v in per_path.items():
                    self._slots[r][p][k].assign(
                        self._cut(self.specs[p], v, r))

    def finalize_variable_values(self) -> None:
        """Keras's ``finalize_variable_values`` at the end of ``fit``: with ``use_ema`` the
        weights become their moving averages (the "average" slots); else nothing."""
        if not self.optimizer.use_ema:
            return
        for r in self.local_replicas:
            for p in self.trainable_paths:
                self._vars[r][p].assign(self._slots[r][p]["average"])

    def to_keras(self, model: Any) -> Any:
        """Write the global weights into the single-device Keras ``model`` (matched by
        weight path), gathered and assigned one weight at a time; returns ``model``."""
        by_path = weights_by_path(model)
        missing = [p for p in self.paths if p not in by_path]
        if missing:
            raise ValueError(f"the Keras model has no weight {missing[0]!r} (and "
                             f"{len(missing) - 1} more): is it the model this runtime was "
                             "built from?")
        for p in self.paths:
            by_path[p].assign(self._global(self._vars, [p])[p])
        return model

    def optimizer_to_keras(self, model: Any) -> Any:
        """Write the optimizer's state into ``model.optimizer`` (Keras 3), so that Keras's
        own ``model.save`` writes what the parallel optimizer holds: each weight's slots
        (gathered one weight at a time, matched by Keras's slot names), the step counter
        and the learning rate; the optimizer is built first when it is not. Returns it, or
        None for a model compiled without one. ``ValueError`` names what cannot be written
        and the fix: a Keras 2 optimizer, another class than the one the runtime steps with,
        or state beyond the slots (a loss scale)."""
        opt, ours = getattr(model, "optimizer", None), self.optimizer
        if opt is None:
            return None
        self.check_optimizer_export(model)
        by_path = weights_by_path(model)
        if not opt.built:
            opt.build(model.trainable_variables)
        by_name = {v.name: v for v in opt.variables}
        for p in self.trainable_paths:
            prefix = by_path[p].path.replace("/", "_")
            for k in ours.slot_names:
                target = by_name.get(f"{prefix}_{k}")
                if target is None:
                    raise ValueError(f"{type(opt).__name__} of model '{model.name}' has no "
                                     f"slot '{prefix}_{k}' for weight {p!r}: {_EXPORT_FIX}")
                target.assign(self._global(
                    {r: {p: s[p][k]} for r, s in self._slots.items()}, [p])[p])
        opt.iterations.assign(int(self.iterations.numpy()))
        if not ours.has_schedule:
            opt.learning_rate = float(self.learning_rate.numpy())
        return opt

    def check_optimizer_export(self, model: Any) -> None:
        """``ValueError`` when :meth:`optimizer_to_keras` cannot write this runtime's
        optimizer state into ``model.optimizer`` (ModelCheckpoint's whole-model files
        checked before training)."""
        opt, ours = getattr(model, "optimizer", None), self.optimizer
        if opt is None:
            return
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise ValueError(f"model '{model.name}' has a Keras 2 (tf_keras) optimizer, whose "
                             f"state the parallel optimizer does not write: {_EXPORT_FIX}")
        if isinstance(opt, keras.optimizers.LossScaleOptimizer) or ours.state:
            raise ValueError(f"the optimizer keeps state beyond its slots "
                             f"({', '.join(ours.state) or 'a loss scale'}), which Keras's "
                             f"file would not hold as the runtime does: {_EXPORT_FIX}")
        if type(opt) is not ours.keras_class:
            raise ValueError(f"model '{model.name}' is compiled with "
                             f"{type(opt).__name__}, the runtime steps with "
                             f"{ours.keras_class.__name__}: {_EXPORT_FIX}")

    def save(self, path: str) -> str:
        """Write shards, optimizer slots and the step counter under directory ``path``
        (``tapas.execution.runtime.checkpoints.save``)."""
        return checkpoints.save(self, path)

    def restore(self, path: str) -> str:
        """Load a checkpoint written by :meth:`save`: directly when the layout is this one,
        else by reassembling each weight and slot from the old shards and cutting it again
        (``tapas.execution.runtime.checkpoints.restore``). Returns "direct" or "resharded"."""
        return checkpoints.restore(self, path)
