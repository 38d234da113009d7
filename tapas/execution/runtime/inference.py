"""Forward-only calls: outputs, the loss and gradients without an update, ``predict``.

In:  a batch (inputs, and targets for the loss) and the runtime's shards.
Out: ``Inference``, mixed into :class:`tapas.execution.runtime.Runtime`: ``evaluate``
     (global outputs, loss and gradients: what ``verify`` compares), ``gradients``,
     ``forward_loss`` (validation; the program's writes dropped) and ``predict`` (the
     program's writes assigned, as a Keras call in training mode).
Raises ``ValueError`` for inputs or targets that do not fit the program.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program import stateful
from tapas.execution.runtime.base import _Replica
from tapas.execution.training import compiled_loss, regularizers, step_outputs
from tapas.sharding.placements import Split

__all__ = ["Inference"]


class Inference:
    """Evaluation and inference, for :class:`~tapas.execution.runtime.Runtime`."""

    def _evaluate(self, xs: Any, y: Any) -> tuple:
        def body(r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tuple:
            share, partial, grads, writes, outs = self._grads(r, xs, y, weights, states)
            full_grads = {}
            for p, g in zip(self.trainable_paths, grads):
                if g is None:
                    continue
                g = tf.convert_to_tensor(g)
                placement = self.specs[p].placement
                full_grads[p] = (r.values.gather_value(g, placement.axis)
                                 if isinstance(placement, Split) else g)
                if self.specs[p].row_axis is not None:   # nested experts: the rows' parts
                    full_grads[p] = r.dp.gather_value(full_grads[p], self.specs[p].row_axis)
            full_outs = [self._dp_output(r, r.values.gather_value(o, pl.axis)
                                         if isinstance(pl, Split) else o)
                         for o, pl in zip(outs, self.output_placements)]
            loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
            return (full_outs, loss, full_grads), writes

        outs, loss, grads = self._replicas(body, (xs, y, self._dist_vars, self.states.dist),
                                           self._assigning_writes)
        first = self.strategy.experimental_local_results
        return ([first(o)[0] for o in outs], first(loss)[0],
                {p: first(g)[0] for p, g in grads.items()})

    @staticmethod
    def _assigning_writes(result: tuple, *args: Any) -> Any:
        """``finish`` of :meth:`_replicas` for a body that returns ``(value, writes)``: the
        writes assigned to the replica's variables (the last two arguments: weights and
        states), as a Keras call in training mode does; returns the value."""
        value, writes = result
        weights, states = args[-2], args[-1]
        with tf.control_dependencies(stateful.assign_writes(writes, weights, states)):
            return tf.nest.map_structure(tf.identity, value)

    def evaluate(self, xs: Any, y: Any) -> tuple[list[np.ndarray], float, dict[str, np.ndarray]]:
        """(outputs, global loss, {path: global gradient}) on the batch, in one traced
        function, without updating anything (what ``verify`` compares)."""
        if not hasattr(self, "_evaluate_fn"):
            self._evaluate_fn = tf.function(self._evaluate, autograph=False)
        outs, loss, grads = self._call("evaluate", self._evaluate_fn, *self._prepare(xs, y))
        return ([o.numpy() for o in outs], float(loss.numpy()),
                {p: g.numpy() for p, g in grads.items()})

    def gradients(self, xs: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        """(global loss, {path: global gradient}) on the batch, without updating anything."""
        _, loss, grads = self.evaluate(xs, y)
        return loss, grads

    def _loss_only(self, xs: Any, y: Any) -> tf.Tensor:
        def body(r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tf.Tensor:
            added: list = []   # writes dropped: no side effects
            outs, _ = self._forward(r, xs, weights, states, added)
            share, partial = compiled_loss.outputs_loss(self, r, outs, y)
            share = regularizers.regularized(self, r, share, partial, weights)
            share = regularizers.with_call_losses(self, r, share, partial, added)
            loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
            return step_outputs.with_step_values(self, r, loss, outs, y)
        loss = self._replicas(body, (xs, y, self._dist_vars, self.states.dist))
        loss, values = loss if isinstance(loss, tuple) else (loss, None)
        first = self.strategy.experimental_local_results(loss)[0]
        return step_outputs.first_values(self, first, values)

    def forward_loss(self, xs: Any, y: Any, *, worker_share: bool = False,
                     sample_weight: Any = None) -> float:
        """The global loss on the batch, forward only: no gradients, and the program's
        writes (advanced seeds, moving statistics) are not assigned, so nothing changes
        (validation in ``tapas.execution.api.fit``; the graph is the program's mode).
        ``worker_share``: as for :meth:`train_step`."""
        if not hasattr(self, "_loss_fn"):
            self._loss_fn = tf.function(self._loss_only, autograph=False)
        return step_outputs.keep_values(self, self._call(
            "loss", self._loss_fn, *self._prepare(xs, y, worker_share, sample_weight)))

    def _replica_predict(self, r: _Replica, xs: tuple, weights: dict, states: dict) -> tuple:
        outs, writes = self._forward(r, xs, weights, states)
        full = [self._dp_output(r, r.values.gather_value(o, p.axis) if isinstance(p, Split)
                                else o)
                for o, p in zip(outs, self.output_placements)]
        return full, writes   # the writes are assigned (training mode: as a Keras call)

    def _predict(self, xs: Any) -> list[tf.Tensor]:
        outs = self._replicas(self._replica_predict, (xs, self._dist_vars, self.states.dist),
                              self._assigning_writes)
        return [self.strategy.experimental_local_results(o)[0] for o in outs]

    def predict(self, xs: Any) -> np.ndarray | list[np.ndarray]:
        """The model's outputs on the global batch (a list when the model has several)."""
        xs = self._check_inputs(xs)
        outs = [o.numpy() for o in self._call("predict", self._predict_fn,
                                               self._distribute(xs, self.input_placements))]
        return outs[0] if len(outs) == 1 else outs
