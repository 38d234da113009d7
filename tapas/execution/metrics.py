"""The model's compiled metrics, computed by Keras's own metric objects on the global batch.

In:  a Keras model compiled with ``metrics=`` and/or ``weighted_metrics=`` (strings such
     as ``"mae"`` or ``"sparse_categorical_accuracy"``, functions, ``keras.metrics.Metric``
     objects such as ``keras.metrics.AUC()``, in a list or per output), and each step's
     global values: the model's outputs, the targets and the sample weights, gathered to
     the host (``Runtime.step_values``, kept when ``Runtime.set_step_values(True)``).
Out: :class:`Scores`: Keras's ``CompileMetrics`` built from the model's compile
     configuration with fresh copies of its metric objects (so the Keras model's own
     metrics are never touched), updated with the global ``y``, ``y_pred`` and sample
     weights exactly as Keras's ``train_step``/``test_step`` update them, and its results
     under the names Keras logs (``mae``, ``auc``, ``<output>_<metric>`` per output);
     :func:`keras_order`: ``evaluate``'s list in Keras's order.

An output the plan splits across devices is gathered whole before the update (the
runtime does it inside the step, without gradient), so every metric sees the global
batch, as on one device. The metrics' state (their variables) can be read and set
(:meth:`Scores.state`, :meth:`Scores.load`) to resume an epoch in the middle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

__all__ = ["Scores", "keras_order"]


def _fresh(spec: Any) -> Any:
    """``spec`` (a compile ``metrics`` argument) with every Metric object replaced by a new
    one of the same configuration (names, thresholds...); strings and functions kept."""
    if isinstance(spec, Mapping):
        return {k: _fresh(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_fresh(v) for v in spec)
    if isinstance(spec, keras.metrics.Metric):
        return type(spec).from_config(spec.get_config())
    return spec


def _compiled(model: Any) -> tuple[Any, Any]:
    """(metrics, weighted_metrics) as ``model.compile`` was given them (None, None when
    uncompiled or without metrics)."""
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    return config.get("metrics"), config.get("weighted_metrics")


class Scores:
    """Keras's compiled metrics of one model, on the host (module docstring)."""

    def __init__(self, model: Any) -> None:
        from keras.src.trainers.compile_utils import CompileMetrics
        metrics, weighted = _compiled(model)
        self.single = len(getattr(model, "outputs", None) or [None]) == 1
        self.metrics = CompileMetrics(_fresh(metrics), _fresh(weighted),
                                      output_names=getattr(model, "output_names", None))
        self._pending: list[np.ndarray] | None = None

    @staticmethod
    def of(model: Any) -> Scores | None:
        """The model's Scores, or None when it was compiled without metrics."""
        metrics, weighted = _compiled(model)
        return Scores(model) if (metrics or weighted) else None

    def _variables(self) -> list[Any]:
        return [v for m in self.metrics.metrics for v in m.variables]

    def update(self, values: tuple) -> None:
        """Update with one step's global ``(outputs, targets, sample weights or None)``."""
        outs, y, w = values
        y_pred = outs[0] if self.single else list(outs)
        if not self.metrics.built:
            self.metrics.build(y, y_pred)
            if self._pending is not None:
                self.load(self._pending)
        self.metrics.update_state(y, y_pred, w)

    def results(self) -> dict[str, float]:
        """The metrics' values under Keras's log names ({} before the first update)."""
        if not self.metrics.built:
            return {}
        return {k: float(np.asarray(v)) for k, v in self.metrics.result().items()}

    def reset(self) -> None:
        self.metrics.reset_state()
        self._pending = None

    def names(self) -> list[str]:
        """The metric objects' own names, in Keras's ``metrics_names`` order."""
        return [m.name for m in self.metrics.metrics]

    def state(self) -> list[list]:
        """The metrics' variables as nested lists (JSON), [] before the first update."""
        if not self.metrics.built:
            return [] if self._pending is None else [np.asarray(a).tolist()
                                                     for a in self._pending]
        return [np.asarray(v.numpy()).tolist() for v in self._variables()]

    def load(self, state: list) -> None:
        """Set the variables from :meth:`state` (when built; else at the first update)."""
        if not state:
            return
        if not self.metrics.built:
            self._pending = [np.asarray(a) for a in state]
            return
        variables = self._variables()
        if len(variables) != len(state):
            raise ValueError(f"the saved metric state has {len(state)} variables, the "
                             f"model's metrics {self.names()} have {len(variables)}: resume "
                             "with the model compiled with the same metrics")
        for v, a in zip(variables, state):
            v.assign(np.asarray(a, dtype=v.dtype))
        self._pending = None


def keras_order(logs: Mapping[str, float], scores: Scores | None) -> Any:
    """``evaluate``'s result as Keras returns it without ``return_dict``: the values in
    ``metrics_names`` order (loss, then each metric present in the logs by its name), the
    other keys after them sorted; one value alone as a float."""
    names = ["loss"] + (scores.names() if scores is not None else [])
    values = [logs[n] for n in names if n in logs]
    values += [logs[k] for k in sorted(logs) if k not in names]
    return values[0] if len(values) == 1 else values
