"""The runtime's loss: each output's loss plan and a replica's share of the global loss.

In:  the targets (and sample weights) of a batch, the program's output placements, shapes,
     dtypes and activations, the Keras loss of each output.
Out: ``LossPlanning``, mixed into :class:`tapas.execution.runtime.Runtime`: the loss plans
     (``tapas.execution.training.losses``), the targets' and sample weights' placements,
     the batch checked and distributed for a step, and inside a replica its share of the
     global loss (Megatron's convention: the shares sum to the Keras loss).
Raises ``ValueError`` for a loss the runtime cannot reduce, a loss count unlike the output
count, sample weights of another shape, or a plan that cannot be trained.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.runtime.base import _ACTIVATIONS, _REDUCTIONS, _Replica
from tapas.execution.training import compiled_loss, loss_collectives, losses
from tapas.sharding.patterns.pattern import REPLICATE
from tapas.sharding.placements import Replica, Split

__all__ = ["LossPlanning"]


class LossPlanning:
    """Loss plans and local losses, for :class:`~tapas.execution.runtime.Runtime`."""

    def _prepare(self, xs: Any, y: Any, worker_share: bool = False,
                 sample_weight: Any = None) -> tuple[Any, Any]:
        if self.loss is None:
            raise ValueError("this runtime has no loss: pass loss=<keras loss> to train")
        for loss in self.output_losses or [self.loss]:
            if getattr(loss, "reduction", None) not in _REDUCTIONS or not hasattr(loss, "call"):
                raise ValueError(f"loss {loss!r}: the runtime needs a keras.losses.Loss with "
                                 f"reduction in {sorted(_REDUCTIONS)} (per-example values "
                                 "from Loss.call, reduced by the runtime)")
        if len(self.output_placements) != len(self.output_losses or [self.loss]):
            raise ValueError(f"the model has {len(self.output_placements)} outputs and "
                             f"{len(self.output_losses or [self.loss])} losses: give one "
                             "loss per output (a list or a dict keyed by output name)")
        xs = self._check_inputs(xs, worker_share)
        if self.output_losses is not None and len(self.output_losses) > 1:
            return compiled_loss.prepare_outputs(self, xs, y, worker_share, sample_weight)
        y = np.asarray(y)
        self.loss_plan = self._loss_plan(y)
        tp = Replica() if self.loss_plan.target_axis is None else Split(self.loss_plan.target_axis)
        dist_x = self._distribute(xs, self.input_placements, worker_share)
        if sample_weight is None:
            dist_y = self._distribute([y], [tp], worker_share)
            return dist_x, (dist_y[0] if isinstance(dist_y, tuple) else dist_y)
        w = self._check_weights(sample_weight, y)
        self.weight_placement = self.sample_weight_placement(y.ndim, w.ndim)
        return dist_x, self._distribute([y, w], [tp, self.weight_placement], worker_share)

    def sample_weight_placement(self, y_ndim: int, w_ndim: int) -> Any:
        """Sample weights of rank ``w_ndim`` follow the targets' placement
        (:meth:`target_placement`) on the axes they have; else they are replicated."""
        tp = self.target_placement(y_ndim)
        return tp if isinstance(tp, Split) and tp.axis < w_ndim else Replica()

    def _check_weights(self, sample_weight: Any, y: np.ndarray) -> np.ndarray:
        """Sample weights as float32, with a shape that leads the targets' (Keras: one per
        example, or per target element)."""
        w = np.asarray(sample_weight, dtype=np.float32)
        if w.ndim == 0 or w.ndim > y.ndim or w.shape != y.shape[:w.ndim]:
            raise ValueError(f"sample_weight has shape {list(w.shape)}, the targets "
                             f"{list(y.shape)}: give one weight per example (shape "
                             f"{list(y.shape[:1])}) or per target element (a leading part "
                             f"of {list(y.shape)})")
        return w

    def target_placement(self, y_ndim: int) -> Any:
        """How the targets (of rank ``y_ndim``) are placed for the loss: R, or S(axis) when
        the loss is computed on an output split on a batch or sequence axis."""
        plan = self._loss_plan(np.zeros((0,) * y_ndim))
        return Replica() if plan.target_axis is None else Split(plan.target_axis)

    def _loss_of(self, k: int) -> Any:
        return self.loss if self.output_losses is None else self.output_losses[k]

    def _loss_plan(self, y: np.ndarray, k: int = 0) -> losses.LossPlan:
        """How the loss of output ``k`` is computed for targets ``y`` (module losses)."""
        p = self.output_placements[k]
        shapes = getattr(self.program, "output_shapes", None)
        if not shapes and isinstance(p, Split):
            raise ValueError(f"the program's output is placed {p} but the program has no "
                             "output_shapes: give it the global output shapes (and "
                             "output_dtypes) so that the runtime can plan the loss")
        shape = tuple(shapes[k]) if shapes else ()
        dtype = (getattr(self.program, "output_dtypes", None) or ("float32",) * (k + 1))[k]
        activation = (getattr(self.program, "output_activations", None) or (None,) * (k + 1))[k]
        return losses.plan_loss(self._loss_of(k), p, shape, dtype, y.ndim, self.num_devices,
                                activation)

    def _local_loss(self, r: _Replica, out: tf.Tensor, target: Any,
                    k: int = 0) -> tuple[tf.Tensor, bool]:
        """(this replica's share of the global loss of output ``k``, whether shares must
        be summed).

        ``target``: the local targets, or ``(targets, sample weights)`` (Keras's
        weighting: the per-example values times the weights; the mean over the values, or
        over the weights' global sum for ``mean_with_sample_weight``).

        The reduction is done here, not by ``Loss.__call__``: inside a replica context Keras
        divides the loss by the number of replicas (tf.distribute's sum-of-replica-losses
        convention), which is not this runtime's convention.
        """
        y, weight = target if isinstance(target, tuple) else (target, None)
        p = self.output_placements[k]
        plan, loss_fn = self._plans()[k], self._loss_of(k)
        activation = (getattr(self.program, "output_activations", None) or (None,) * (k + 1))[k]
        logits = getattr(out, "_keras_logits", None)
        if activation in _ACTIVATIONS and logits is None:
            raise ValueError(
                f"the model output is a {activation} of logits that this plan places unlike "
                f"the output (placed {p}): a Keras crossentropy computes from those logits, "
                "so the runtime cannot train this plan (predict works); choose a pattern for "
                "the last GraphNode without a collective after the activation, e.g. the "
                f"searched one or {REPLICATE!r}")
        if plan.method == "vocab-parallel":
            per_example = loss_collectives.vocab_parallel(self, r, out, y, loss_fn)
        else:
            if plan.method == "gather":
                if logits is None:
                    out = loss_collectives.gather_for_loss(self, r, out, p.axis)
                else:  # Keras's crossentropy reads the logits: gather those, not the output
                    logits = loss_collectives.gather_for_loss(self, r, logits, p.axis)
                    out = _ACTIVATIONS[activation](logits)
                    out._keras_logits = logits
            per_example = loss_fn.call(y, losses.as_loss_dtype(out, loss_fn))
        total = tf.cast(tf.size(per_example), per_example.dtype)
        if plan.partial:
            total = total * self.num_devices
        if weight is not None:   # Keras: the values times the weights, expanded to their rank
            w = tf.cast(weight, per_example.dtype)
            if loss_fn.reduction == "mean_with_sample_weight":   # over the weights' sum
                total = tf.reduce_sum(w)
                if isinstance(self._weight_placements()[k], Split):   # each on one replica
                    total = loss_collectives.all_reduce(self, r, total)
            w = tf.reshape(w, w.shape.as_list() + [1] * (per_example.shape.rank - w.shape.rank))
            per_example = per_example * w
        if r.dp is not None:   # a mesh row's share of the global loss (the rows add up to it)
            if weight is not None and loss_fn.reduction == "mean_with_sample_weight":
                total = r.dp.sum_value(total)     # the weights' global sum
            else:
                total = total * self.rows         # equal rows: the global count
        loss = tf.reduce_sum(per_example)
        if loss_fn.reduction != "sum":
            loss = tf.math.divide_no_nan(loss, tf.cast(total, loss.dtype))
        return loss, plan.partial

    def _plans(self) -> list:
        return getattr(self, "loss_plans", None) or [self.loss_plan]

    def _weight_placements(self) -> list:
        return getattr(self, "weight_placements", None) or [self.weight_placement]
