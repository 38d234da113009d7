"""The global values of a step that the compiled metrics are computed from.

In:  a :class:`tapas.execution.runtime.Runtime` with ``keep_step_values`` set
     (``Runtime.set_step_values(True)``: ``tapas.execution.api.fit`` sets it when the model has
     compiled metrics or several outputs), and inside a replica body its local outputs,
     targets and sample weights.
Out: ``Runtime.step_values`` after each ``train_step`` / ``forward_loss``: NumPy
     ``(outputs, targets per output, sample weights per output or None, each output's
     unweighted global loss (several outputs))``, every value global: an output, target or
     weight split across the devices is all-gathered inside the step (no gradient, not in
     the audit: it is read, not trained), and over the mesh rows.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tapas.sharding.placements import Replica, Split

__all__ = ["set_step_values", "with_step_values", "first_values", "keep_values"]

_FUNCTIONS = ("train_step", "loss")   # the traced functions whose result carries them


def set_step_values(rt: Any, on: bool) -> None:
    """Whether ``rt``'s training step and ``forward_loss`` keep their global values in
    ``rt.step_values``; when this changes the two functions are traced again, with fresh
    audit records."""
    if bool(on) == rt.keep_step_values:
        return
    rt.keep_step_values = bool(on)
    rt._train_fn = tf.function(rt._train_step, autograph=False)
    rt.__dict__.pop("_loss_fn", None)
    for key in _FUNCTIONS:
        rt.audits.pop(key, None)
        rt.dp_audits.pop(key, None)
    rt.loss_comms = [c for c in rt.loss_comms if c[0] not in _FUNCTIONS]
    rt.regularizer_comms = [c for c in getattr(rt, "regularizer_comms", [])
                            if c[0] not in _FUNCTIONS]


def with_step_values(rt: Any, r: Any, loss: tf.Tensor, outs: list, target: Any) -> Any:
    """In a replica body: ``loss``, or ``(loss, values)`` when kept, the values being the
    global (outputs, targets, sample weights, outputs' losses from ``r.notes``)."""
    if not rt.keep_step_values:
        return loss
    k = len(rt.output_losses or [None])
    if k == 1:
        ys, ws = ([target[0]], [target[1]]) if isinstance(target, tuple) else ([target], [])
    else:
        ys, ws = list(target[:k]), list(target[k:])

    def whole(x: tf.Tensor, placement: Any) -> tf.Tensor:
        if isinstance(placement, Split):
            x = r.values.gather_value(x, placement.axis)
        return rt._dp_output(r, x)
    places = [Replica() if p.target_axis is None else Split(p.target_axis)
              for p in rt._plans()]
    values = ([whole(o, p) for o, p in zip(outs, rt.output_placements)],
              [whole(v, p) for v, p in zip(ys, places)],
              [whole(v, p) for v, p in zip(ws, rt._weight_placements())],
              r.notes.get("output_losses", []))
    return loss, values


def first_values(rt: Any, loss: tf.Tensor, values: Any) -> Any:
    """Outside the replicas: ``loss``, or ``(loss, the first local replica's values)``."""
    if values is None:
        return loss
    first = rt.strategy.experimental_local_results
    return loss, tf.nest.map_structure(lambda v: first(v)[0], values)


def keep_values(rt: Any, result: Any) -> float:
    """The loss of a traced function's result as a float; its values, when it carries
    them, into ``rt.step_values`` as NumPy."""
    if isinstance(result, tuple):
        result, (outs, ys, ws, output_losses) = result
        rt.step_values = ([o.numpy() for o in outs], [v.numpy() for v in ys],
                          [v.numpy() for v in ws] or None,
                          [float(v.numpy()) for v in output_losses])
    return float(result.numpy())
