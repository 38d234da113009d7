"""The model's compiled metrics, computed by Keras's own metric objects on the global batch.

In:  a Keras model compiled with ``metrics=`` and/or ``weighted_metrics=`` (strings such
     as ``"mae"`` or ``"sparse_categorical_accuracy"``, functions, ``keras.metrics.Metric``
     objects such as ``keras.metrics.AUC()`` -- a Keras 2 model's ``tf_keras`` ones as their
     Keras 3 twins -- in a list or per output), and each step's
     global values: the model's outputs, the targets and the sample weights, gathered to
     the host, and with several outputs each one's unweighted loss
     (``Runtime.step_values``, kept when ``Runtime.set_step_values(True)``:
     ``tapas.execution.training.step_outputs``).
Out: :class:`Scores`: Keras's ``CompileMetrics`` built from the model's compile
     configuration with fresh copies of its metric objects (so the Keras model's own
     metrics are never touched), updated with the global ``y``, ``y_pred`` and sample
     weights exactly as Keras's ``train_step``/``test_step`` update them, and its results
     under the names Keras logs (``mae``, ``auc``, ``<output>_<metric>`` per output),
     with several outputs also each output's loss as Keras's ``CompileLoss`` logs it
     (``<output>_loss``: the mean over the batches of its unweighted loss);
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

from tapas.execution.training import keras2
from tapas.execution.training.compiled_loss import loss_names

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
    if keras2.is_keras2_metric(spec):   # a tf_keras metric object: its Keras 3 twin
        return keras2.metric(spec)
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
        self.active = bool(metrics or weighted)
        self.metrics = CompileMetrics(_fresh(metrics) or None, _fresh(weighted) or None,
                                      output_names=getattr(model, "output_names", None))
        # each output's loss (several outputs): Keras's Mean trackers, by log name
        self.losses = [keras.metrics.Mean(name=n) for n in
                       loss_names(list(getattr(model, "output_names", None) or []))]
        # weighed by the batch's examples: Keras 3 weighs them by the batch's static size,
        # which its traced steps do not know (each batch counts once), an eager model's
        # do; tf_keras by the batch's dynamic size
        self.by_rows = bool(getattr(model, "run_eagerly", False)) or \
            keras2.is_keras2_layer(model)
        self._pending: list[np.ndarray] | None = None

    @staticmethod
    def of(model: Any) -> Scores | None:
        """The model's Scores, or None when it was compiled without metrics and has one
        output."""
        metrics, weighted = _compiled(model)
        several = len(getattr(model, "outputs", None) or [None]) > 1
        return Scores(model) if (metrics or weighted or several) else None

    def _variables(self) -> list[Any]:
        return [v for m in self.metrics.metrics + self.losses for v in m.variables]

    def update(self, values: tuple) -> None:
        """Update with one step's global values (``Runtime.step_values``: outputs,
        targets and sample weights (or None) per output, the outputs' losses)."""
        outs, ys, ws, output_losses = values
        rows = int(np.shape(outs[0])[0]) if self.by_rows else None
        for tracker, value in zip(self.losses, output_losses):
            tracker.update_state(value, sample_weight=rows)
        if not self.active:
            return
        y_pred, y = (outs[0], ys[0]) if self.single else (list(outs), list(ys))
        w = None if ws is None else (ws[0] if self.single else list(ws))
        if not self.metrics.built:
            self.metrics.build(y, y_pred)
            if self._pending is not None:
                self.load(self._pending)
        self.metrics.update_state(y, y_pred, w)

    def results(self) -> dict[str, float]:
        """The metrics' values under Keras's log names ({} before the first update)."""
        out = {}
        if self.metrics.built:
            out = {k: float(np.asarray(v)) for k, v in self.metrics.result().items()}
        for tracker in self.losses:
            out[tracker.name] = float(np.asarray(tracker.result()))
        return out

    def reset(self) -> None:
        self.metrics.reset_state()
        for tracker in self.losses:
            tracker.reset_state()
        self._pending = None

    def names(self) -> list[str]:
        """The metric objects' own names, in Keras's ``metrics_names`` order (the
        compiled metrics, then each output's loss)."""
        return [m.name for m in self.metrics.metrics] + [m.name for m in self.losses]

    def state(self) -> list[list]:
        """The metrics' variables as nested lists (JSON), [] before the first update."""
        if self.active and not self.metrics.built:
            return [] if self._pending is None else [np.asarray(a).tolist()
                                                     for a in self._pending]
        return [np.asarray(v.numpy()).tolist() for v in self._variables()]

    def load(self, state: list) -> None:
        """Set the variables from :meth:`state` (when built; else at the first update)."""
        if not state:
            return
        if self.active and not self.metrics.built:
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
