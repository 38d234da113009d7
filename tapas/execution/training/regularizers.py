"""The model's weight regularization losses (``model.losses``), on the shards, counted once.

In:  a Keras model, the runtime's weight layouts (placement, row axis) and the number of
     devices of a program row.
Out: :func:`plan_regularizers`: one :class:`Term` per trainable weight Keras regularizes
     (``kernel_regularizer``, ``bias_regularizer``, ``embeddings_regularizer``... any
     regularizer a variable carries: ``variable.regularizer``, what Keras's
     ``Layer.losses`` reads; a Keras 2 model's, which its layers keep as zero-argument
     losses: ``keras2.weight_regularizers``), or a ``ValueError`` naming a loss the
     runtime cannot compute exactly (before anything runs); :func:`replica_value`: inside
     a replica, the term this replica adds to its loss share (:func:`regularized`: added
     to a runtime's).
     :func:`with_call_losses`: the losses the model's call adds (activity regularizers,
     ``self.add_loss``), which capture makes extra outputs of the program
     (``ir.Graph.call_losses``), added to a replica's loss share.

How a regularizer is computed (Keras adds ``regularizer(variable)`` to the loss):

* a replicated weight: on the whole weight, on every replica;
* a weight split on an axis, under ``L1``, ``L2`` or ``L1L2`` (a sum of per-element
  terms): each replica regularizes its shard; the value is all-reduced (forward sum,
  backward identity), so the gradient of a shard is the local term (``sum-of-shards``);
* a split weight under any other regularizer (``OrthogonalRegularizer``, one of the
  user's): the weight is all-gathered first (backward: the local slice of the gradient of
  the whole weight), so every replica computes Keras's value (``gathered``).

Every replica thus holds the term's full value ``v`` with its own weight's exact
gradient. :func:`replica_value` then fits it to the loss convention: where the replicas'
loss shares are summed (a batch-split output), each adds ``v / N`` with the gradient of
``v`` (a value scale, identity backward); on a mesh of several rows, whose gradients of a
weight not cut over the rows are summed over the rows, each row adds ``v / rows`` (value
and gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from tapas.execution.training import keras2
from tapas.sharding.placements import Replica, Split

__all__ = ["Term", "plan_regularizers", "replica_value", "regularized", "split_outputs",
           "with_call_losses", "value_scale", "predicted_comms", "predicted_call_loss_comms",
           "SUM_OF_ELEMENTS"]

# Keras regularizers that are a sum of per-element terms: the shards' values add up
SUM_OF_ELEMENTS = frozenset({"L1", "L2", "L1L2"})


@dataclasses.dataclass(frozen=True)
class Term:
    """One regularized weight: ``how`` is ``replicated``, ``sum-of-shards`` or ``gathered``
    (module docstring); ``axis`` the weight's split axis; ``row_axis`` the mesh-row axis it
    is cut on (nested experts) or None."""

    path: str
    regularizer: Any
    how: str
    axis: int | None
    row_axis: int | None


def _keras_class(reg: Any) -> str:
    """The Keras (3, or 2's ``tf_keras``) class name of a regularizer object, '' for
    anything else (a function, a subclass of the user's: its arithmetic may be anything)."""
    cls = type(reg)
    return cls.__name__ if cls.__module__.startswith(("keras", "tf_keras")) else ""


def plan_regularizers(model: Any, specs: Mapping[str, Any], weight_paths: Mapping[str, Any]
                      ) -> list[Term]:
    """The :class:`Term` of every trainable weight of ``model`` with a regularizer.
    ``specs``: the runtime's layouts by path (``placement``, ``row_axis``);
    ``weight_paths``: {path: Keras variable} (``tapas.capturing.weights_by_path``)."""
    by_variable = {id(v): p for p, v in weight_paths.items()}
    keras2_regularizers = keras2.weight_regularizers(model)
    terms = []
    for v in getattr(model, "trainable_weights", []):
        reg = getattr(v, "regularizer", None) or keras2_regularizers.get(id(v))
        if reg is None:
            continue
        path = by_variable.get(id(v), getattr(v, "path", str(v)))
        spec = specs.get(path)
        if spec is None:
            raise ValueError(
                f"weight '{path}' carries a regularizer ({type(reg).__name__}) but the "
                "traced graph never reads it, so the runtime holds no shard of it and "
                "cannot add its loss (Keras adds it to model.losses): remove the "
                "regularizer or the unused weight, or use the weight in the model's call")
        axis = spec.placement.axis if isinstance(spec.placement, Split) else None
        if axis is None:
            how = "replicated"
        elif _keras_class(reg) in SUM_OF_ELEMENTS:
            how = "sum-of-shards"
        elif spec.row_axis is None:
            how = "gathered"
        else:
            raise ValueError(
                f"weight '{path}' is cut over the mesh rows (axis {spec.row_axis}) and split "
                f"on axis {axis}, and its regularizer {type(reg).__name__} is not a sum of "
                f"per-element terms ({sorted(SUM_OF_ELEMENTS)}), so its shards' values "
                "cannot be added up: use one of those regularizers, or a plan/mesh that "
                "keeps this weight whole")
        terms.append(Term(path, reg, how, axis, spec.row_axis))
    return terms


def predicted_comms(terms: list[Term], specs: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """The collectives :func:`replica_value` adds to a step, (kind, global bytes) each:
    an all-reduce of a scalar per ``sum-of-shards`` term, an all-gather of the weight per
    ``gathered`` one (``specs``: the runtime's layouts, ``global_shape`` and ``dtype``)."""
    out = []
    for t in terms:
        size = tf.as_dtype(specs[t.path].dtype).size
        if t.how == "sum-of-shards":
            out.append(("AR", size))
        elif t.how == "gathered":
            count = 1
            for d in specs[t.path].row_shape:
                count *= int(d)
            out.append(("AG", count * size))
    return tuple(out)


def predicted_call_loss_comms(rt: Any) -> tuple[tuple[str, int], ...]:
    """The collectives :func:`with_call_losses` adds to a step of ``rt``: an all-reduce of
    the sum of each call loss that is not replicated (the loss's dtype)."""
    if rt.num_devices == 1:
        return ()
    graph = getattr(rt.program, "graph", None)
    if not getattr(graph, "call_losses", 0):
        return ()
    infos = graph.outputs[len(graph.outputs) - graph.call_losses:]
    sizes = [tf.as_dtype(t.dtype).size if tf.as_dtype(t.dtype).is_floating else 4
             for t in infos]   # a loss that is not a float is cast to the loss's float32
    return tuple(("AR", size) for size, p in zip(sizes, rt.call_loss_placements)
                 if not isinstance(p, Replica))


def value_scale(x: tf.Tensor, k: float) -> tf.Tensor:
    """``x * k`` forward, the identity backward."""
    @tf.custom_gradient
    def scale(t: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        return t * tf.cast(k, t.dtype), lambda dy: dy
    return scale(x)


def _summed(x: tf.Tensor, sum_value: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """All-reduce (sum) forward, the identity backward."""
    @tf.custom_gradient
    def total(t: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        return sum_value(t), lambda dy: dy
    return total(x)


def _gathered(x: tf.Tensor, axis: int, gather_value: Callable, local_slice: Callable
              ) -> tf.Tensor:
    """All-gather forward, the local slice of the gradient backward."""
    @tf.custom_gradient
    def whole(t: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        return gather_value(t, axis), lambda dy: local_slice(dy, axis)
    return whole(x)


def replica_value(terms: list[Term], weights: Mapping[str, tf.Tensor], *, partial: bool,
                  num_devices: int, rows: int, sum_value: Callable, gather_value: Callable,
                  local_slice: Callable, record: Callable[[str, int], None]) -> tf.Tensor | None:
    """The regularization this replica adds to its loss share (None without terms).

    ``weights``: the replica's local weight values (differentiated by the caller's tape);
    ``partial``: whether the replicas' loss shares are summed; ``sum_value(x)`` and
    ``gather_value(x, axis)``: collectives over the row's devices without gradient;
    ``local_slice(x, axis)``: this replica's slice of a whole tensor; ``record(kind,
    global bytes)`` is told each collective added."""
    if not terms:
        return None
    total = None
    for t in terms:
        w = weights[t.path]
        if t.how == "gathered":
            whole = _gathered(w, t.axis, gather_value, local_slice)
            record("AG", int(whole.shape.num_elements()) * whole.dtype.size)
            v = t.regularizer(whole)
        else:
            v = tf.convert_to_tensor(t.regularizer(w))
            if t.how == "sum-of-shards":
                record("AR", v.dtype.size)
                v = _summed(v, sum_value)
        if rows > 1 and t.row_axis is None:   # the rows' gradients of it are summed
            v = v / tf.cast(rows, v.dtype)
        total = v if total is None else total + v
    if partial and num_devices > 1:   # the replicas' shares are summed: each adds 1/N
        total = value_scale(total, 1.0 / num_devices)
    return total


def split_outputs(program: Any) -> tuple[list, list]:
    """(placements of the model's outputs, placements of the losses its call adds): the
    program's outputs end with the call losses (``ir.Graph.call_losses``)."""
    every = list(program.output_placements)
    n = len(every) - getattr(getattr(program, "graph", None), "call_losses", 0)
    return every[:n], every[n:]


def with_call_losses(rt: Any, r: Any, share: tf.Tensor, partial: bool,
                     values: list) -> tf.Tensor:
    """In a replica body of ``rt``: ``share`` plus this replica's part of the losses the
    model's call added (``values``: their local values, placed as
    ``rt.call_loss_placements``). Keras adds the sum of each (cast to float when it is
    not); a loss split or partial over the devices is all-reduced first (forward sum,
    backward identity), so every replica holds the whole sum with its own part's exact
    gradient, and then enters the loss as a regularizer does (:func:`replica_value`)."""
    if not values:
        return share
    if rt.rows > 1:
        raise ValueError(
            f"the model's call adds {len(values)} loss(es) (activity regularizers or "
            f"add_loss), and this plan runs on a mesh of {rt.rows} rows whose batch is "
            "split over the rows: each row would see a part of the batch, and a loss that "
            "is not a sum over examples would be counted once per row. Use a "
            "one-dimensional plan (no nested experts) for this model, or drop the call "
            "losses")
    total = None
    for v, placement in zip(values, rt.call_loss_placements):
        v = tf.convert_to_tensor(v)
        v = tf.reduce_sum(v if v.dtype.is_floating else tf.cast(v, share.dtype))
        if not isinstance(placement, Replica) and rt.num_devices > 1:
            if r.records:
                rt.regularizer_comms.append((rt._tracing, "AR", v.dtype.size))
            v = _summed(v, r.values.sum_value)
        v = tf.cast(v, share.dtype)
        total = v if total is None else total + v
    if partial and rt.num_devices > 1:   # the replicas' shares are summed: each adds 1/N
        total = value_scale(total, 1.0 / rt.num_devices)
    return share + total


def regularized(rt: Any, r: Any, share: tf.Tensor, partial: bool,
                weights: Mapping[str, tf.Tensor]) -> tf.Tensor:
    """In a replica body of ``rt`` (a ``Runtime``; ``r`` its replica): ``share`` plus this
    replica's part of the model's weight regularization losses (``rt.regularization``,
    :func:`replica_value`); the collectives it adds go to ``rt.regularizer_comms``
    (function, kind, global bytes), once per trace."""
    from tapas.execution.program.collectives import local_slice

    def record(kind: str, nbytes: int) -> None:
        if r.records:
            rt.regularizer_comms.append((rt._tracing, kind, nbytes))
    if r.records:
        rt.regularizer_comms = [c for c in getattr(rt, "regularizer_comms", [])
                                if c[0] != rt._tracing]
    extra = replica_value(
        rt.regularization, weights, partial=partial, num_devices=rt.num_devices,
        rows=rt.rows, sum_value=r.values.sum_value, gather_value=r.values.gather_value,
        local_slice=lambda x, axis: local_slice(x, axis, rt.num_devices, r.rid),
        record=record)
    return share if extra is None else share + tf.cast(extra, share.dtype)
