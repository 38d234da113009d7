"""The training step: forward, loss, gradients and the optimizer, all or nothing.

In:  a prepared batch (``loss.LossPlanning._prepare``) and the runtime's shards, slots and
     seed states.
Out: ``TrainingStep``, mixed into :class:`tapas.execution.runtime.Runtime`: the program's
     forward pass in a replica, the gradients of the global loss, the Keras optimizer's
     update computed on every replica, then assigned only once every replica's results
     exist and the loss is finite; ``train_step`` returns the global loss.
Raises :class:`~tapas.execution.runtime.StepError` when a step fails (nothing changed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.program import stateful
from tapas.execution.runtime.base import _Replica
from tapas.execution.training import (compiled_loss, regularizers, step_outputs,
                                      step_reductions as reductions)

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

    def _replica_compute(self, r: _Replica, xs: tuple, y: Any, weights: dict, slots: dict,
                         states: dict) -> tuple:
        share, partial, grads, writes, outs = self._grads(r, xs, y, weights, states)
        new_values, new_slots, new_state = self.optimizer.apply(
            {p: weights[p] for p in self.trainable_paths},
            dict(zip(self.trainable_paths, grads)), slots,
            {k: v.read_value() for k, v in self.opt_state.items()},
            self.iterations.read_value(), self.learning_rate.read_value(),
            lambda sums: reductions.sum_squares(self, r, sums),
            lambda ok: reductions.all_finite(self, r, ok))
        new: dict[str, dict[str, tf.Tensor]] = {p: {"value": v} for p, v in new_values.items()}
        for p, upd in new_slots.items():
            new.setdefault(p, {}).update(upd)
        loss = self._dp_loss(r, r.values.sum_value(share) if partial else share)
        return step_outputs.with_step_values(self, r, loss, outs, y), new, writes, new_state

    def _replica_assign(self, new: dict, writes: dict, weights: dict, slots: dict,
                        states: dict, deps: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(deps):
            ops = stateful.assign_writes(writes, weights, states)
            for p, upd in new.items():   # plain resource writes (see _read)
                for k, value in upd.items():
                    var = weights[p] if k == "value" else slots[p][k]
                    ops.append(tf.raw_ops.AssignVariableOp(resource=var.handle, value=value))
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def _train_step(self, xs: Any, y: Any) -> tf.Tensor:
        # the traced step's graph, for TensorBoard's graph tab (fit's tensorboard=)
        self.graphs["train_step"] = tf.compat.v1.get_default_graph()
        loss, new, writes, state = self._replicas(
            self._replica_compute, (xs, y, self._dist_vars, self._dist_slots, self.states.dist))
        loss, values = loss if isinstance(loss, tuple) else (loss, None)
        local = self.strategy.experimental_local_results
        local_losses = local(loss)
        everything = tf.nest.flatten(local((new, writes, state)))
        with tf.control_dependencies(everything + list(local_losses)):
            checks = [tf.debugging.check_numerics(l, "tapas: the loss is not finite")
                      for l in local_losses]
        done = self.strategy.run(self._on_device(self._replica_assign),
                                 args=(new, writes, self._dist_vars, self._dist_slots,
                                       self.states.dist, checks))
        with tf.control_dependencies(local(done)):
            taken = dict(local(state)[0])   # the same on every replica
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
