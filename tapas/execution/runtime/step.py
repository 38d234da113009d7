"""The training step: forward, loss, gradients and the optimizer, all or nothing.

In:  a prepared batch (``loss.LossPlanning._prepare``) and the runtime's shards, slots and
     seed states.
Out: ``TrainingStep``, mixed into :class:`tapas.execution.runtime.Runtime`: the program's
     forward pass in a replica, the gradients of the global loss and what the Keras
     optimizer's update decides over every weight (clipping's norms, loss scaling's
     finite flag: ``weight_updates.decisions``); once every replica's results exist and
     the loss is finite, the update of each weight computed and assigned one weight at a
     time; ``train_step`` returns the global loss.
Raises :class:`~tapas.execution.runtime.StepError` when a step fails (nothing changed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.runtime.base import _Replica
from tapas.execution.training import (compiled_loss, regularizers, step_outputs,
                                      step_reductions as reductions, weight_updates)

__all__ = ["TrainingStep"]


class TrainingStep:
    """The training step, for :class:`~tapas.execution.runtime.Runtime`."""

    def _forward(self, r: _Replica, xs: Sequence[tf.Tensor], weights: Mapping[str, tf.Tensor],
                 states: Mapping[str, tf.Tensor], call_losses: list | None = None
                 ) -> tuple[list, dict]:
        """(local model outputs, {path: new local value} the program writes: training
        mode); the local values of the losses the call adds go to ``call_losses``."""
        local = {p: [weights[p]] for p in self.paths}
        local.update({p: [v] for p, v in states.items()})
        extra: dict[str, Any] = {}
        if getattr(self.program, "region", None) is not None:
            extra["column"] = r.dp   # nested experts: tokens exchanged over the mesh column
        if getattr(self.program, "stateful_random", ()):
            extra["seed"] = self.iterations   # Keras 2's dropout: a new draw each step, the
            # same draw on every replica
        writes: dict[str, list] = {}
        outs = [o[0] for o in self.program([[x] for x in xs], local, r.coll, *(
            [writes] if getattr(self.program, "has_writes", False) else []), **extra)]
        n = len(self.output_placements)
        (call_losses if call_losses is not None else []).extend(outs[n:])
        return outs[:n], {p: v[0] for p, v in writes.items()}

    def _grads(self, r: _Replica, xs: tuple, y: Any, weights: dict, states: dict) -> tuple:
        """(loss share, whether shares are summed, gradients of the trainable weights in
        ``trainable_paths`` order (None where the loss does not depend on one), writes)."""
        trainable = [weights[p] for p in self.trainable_paths]
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            added: list = []
            outs, writes = self._forward(r, xs, weights, states, added)
            share, partial = compiled_loss.outputs_loss(self, r, outs, y)
            share = regularizers.regularized(self, r, share, partial, weights)
            share = regularizers.with_call_losses(self, r, share, partial, added)
            scaled = share
            if self.optimizer.loss_scale is not None:   # Keras's optimizer.scale_loss
                scaled = tf.cast(share, tf.float32) * self.opt_state["loss_scale"]
        grads = tape.gradient(scaled, trainable)
        if r.dp is not None:   # data parallel over the mesh column: the rows' gradients add up
            # (not those of weights cut over the rows: each row holds other experts, whose
            # gradients the all-to-all's backward already brought from every row)
            grads = [None if g is None else
                     g if self.specs[p].row_axis is not None else reductions.dp_grad(self, r, p, g)
                     for p, g in zip(self.trainable_paths, grads)]
        return share, partial, grads, writes, outs

    def set_step_values(self, on: bool) -> None:
        """Whether steps keep their global values (module ``step_outputs``)."""
        step_outputs.set_step_values(self, on)

    def _dp_loss(self, r: _Replica, loss: tf.Tensor) -> tf.Tensor:
        """The global loss from a row's (the rows' losses add up; 1-D: the loss itself)."""
        return loss if r.dp is None else r.dp.sum_value(loss)

    def _dp_output(self, r: _Replica, out: tf.Tensor) -> tf.Tensor:
        """The global output from a row's (concatenated over the rows on axis 0)."""
        return out if r.dp is None else r.dp.gather_value(out, 0)

    def _opt_inputs(self) -> tuple:
        """The optimizer's replicated state, step counter and learning rate, read."""
        return ({k: v.read_value() for k, v in self.opt_state.items()},
                self.iterations.read_value(), self.learning_rate.read_value())

    def _replica_compute(self, r: _Replica, xs: tuple, y: Any, weights: dict, slots: dict,
                         states: dict) -> tuple:
        """(loss, gradients: {path: dense} and {path: (values, indices, dense_shape)} of
        the sparse ones, writes, the optimizer's decisions over every weight)."""
        share, partial, grads, writes, outs = self._grads(r, xs, y, weights, states)
        grads = {p: g for p, g in zip(self.trainable_paths, grads) if g is not None}
        decided = weight_updates.decisions(
            self.optimizer, {p: weights[p] for p in self.trainable_paths}, grads, slots,
            *self._opt_inputs(),
            lambda sums: reductions.sum_squares(self, r, sums),
            lambda ok: reductions.all_finite(self, r, ok))
        dense = {p: g for p, g in grads.items() if not isinstance(g, tf.IndexedSlices)}
        sparse = {p: (g.values, g.indices, g.dense_shape) for p, g in grads.items()
                  if isinstance(g, tf.IndexedSlices)}
        loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
        return (step_outputs.with_step_values(self, r, loss, outs, y), (dense, sparse),
                writes, decided)

    def _replica_update(self, r: _Replica, grads: tuple, writes: dict, decided: dict,
                        checks: list, weights: dict, slots: dict, states: dict) -> dict:
        """After ``checks`` (the decision that the step is taken): the writes, then each
        trainable weight's update computed and assigned one weight at a time (its new
        value and slots exist only until assigned; ``weights``, ``slots``, ``states``
        are resource handles); returns the optimizer's new state."""
        dense, sparse = grads
        state, iterations, lr = self._opt_inputs()
        first = self.local_replicas[0]
        after: list = list(checks)
        with tf.control_dependencies(after):
            after = [tf.raw_ops.AssignVariableOp(
                resource=states[p] if p in states else weights[p], value=v)
                for p, v in writes.items()] or after
        new_state = {k: v for k, v in state.items()}
        new_state["step_taken"] = tf.constant(1, tf.int64)
        updates = self._updates()
        for p in self.trainable_paths:
            g = dense.get(p, None if p not in sparse else tf.IndexedSlices(*sparse[p]))
            with tf.control_dependencies(after):
                old = {k: _read_like(slots[p][k], v) for k, v in self._slots[first][p].items()}
                value = _read_like(weights[p], self._vars[first][p])
                new, new_slots, new_state = updates(p, value, g, old, state, iterations,
                                                    lr, decided)
                ops = [tf.raw_ops.AssignVariableOp(resource=slots[p][k], value=v)
                       for k, v in new_slots.items()]
                if new is not None:
                    ops.append(tf.raw_ops.AssignVariableOp(resource=weights[p], value=new))
            after = ops or after
        with tf.control_dependencies(after):
            return {k: tf.identity(v) for k, v in new_state.items()}

    def _updates(self) -> weight_updates.Updates:
        """The optimizer's per-weight updates, each kind traced once (kept across traces
        of the step)."""
        got = getattr(self, "_weight_updates", None)
        if got is None or got.opt is not self.optimizer:
            got = self._weight_updates = weight_updates.Updates(self.optimizer)
        return got

    def _train_step(self, xs: Any, y: Any) -> tf.Tensor:
        # the traced step's graph, for TensorBoard's graph tab (fit's tensorboard=)
        self.graphs["train_step"] = tf.compat.v1.get_default_graph()
        loss, grads, writes, decided = self._replicas(
            self._replica_compute, (xs, y, self._dist_vars, self._dist_slots, self.states.dist))
        loss, values = loss if isinstance(loss, tuple) else (loss, None)
        local = self.strategy.experimental_local_results
        local_losses = local(loss)
        everything = tf.nest.flatten(local((grads, writes, decided)))
        with tf.control_dependencies(everything + list(local_losses)):
            checks = [tf.debugging.check_numerics(l, "tapas: the loss is not finite")
                      for l in local_losses]
        state = self._replicas(self._replica_update, (
            grads, writes, decided, checks, self._dist_vars, self._dist_slots,
            self.states.dist), handles=True)
        taken = dict(local(state)[0])   # the same on every replica
        with tf.control_dependencies(tf.nest.flatten(local(state))):
            step_taken = taken.pop("step_taken")
            for k, v in taken.items():
                self.opt_state[k].assign(v)
            self.iterations.assign_add(step_taken)
            return step_outputs.first_values(self, tf.identity(local_losses[0]), values)

    def train_step(self, xs: Any, y: Any, *, worker_share: bool = False,
                   sample_weight: Any = None) -> float:
        """One optimizer step on the global batch ``(xs, y)``; returns the global loss.

        ``worker_share=True``: ``xs`` and ``y`` are only this worker's shares of the global
        batch (:meth:`worker_share` of each input's placement and of
        :meth:`target_placement`), as a per-worker input pipeline reads them under
        ``MultiWorkerMirroredStrategy``; with every replica in this process they are the
        global batch. ``sample_weight``: Keras's per-example (or per target element)
        weights of the loss, placed like the targets.

        All or nothing: on failure (e.g. a non-finite loss) raises :class:`StepError` and
        leaves weights, slots and the step counter unchanged.
        """
        dist_x, dist_y = self._prepare(xs, y, worker_share, sample_weight)
        try:
            loss = self._call("train_step", self._train_fn, dist_x, dist_y)
        except (tf.errors.InvalidArgumentError, tf.errors.CancelledError) as e:
            from tapas.execution.runtime.step_errors import step_error
            raise step_error(self, e, xs, y) from None
        return step_outputs.keep_values(self, loss)


def _read_like(handle: tf.Tensor, variable: tf.Variable) -> tf.Tensor:
    """The value of the variable ``handle`` points to, with ``variable``'s dtype and shape
    (one replica's handle to a variable like another replica's ``variable``)."""
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=variable.dtype)
    value.set_shape(variable.shape)
    return value
