"""What a training step reduces over replicas besides the program's own collectives.

In:  a ``tapas.execution.runtime.Runtime`` (its weight layouts, optimizer and audits), a
     replica's collectives (``_Replica``: ``values`` over the mesh row, ``dp`` over the
     mesh column) and local tensors.
Out: the runtime's :class:`ShardedOptimizer` (:func:`make_optimizer`); a gradient summed
     over the mesh column (:func:`dp_grad`: dense all-reduced, or a sparse one kept as
     slices, as one device's), recorded in the runtime's ``dp_audits``; the sums of squares
     of whole weights' gradients (:func:`sum_squares`, for clipping) and whether every
     replica's gradients are finite (:func:`all_finite`, for loss scaling).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tapas.execution.program.collectives import Audit, CommRecord
from tapas.execution.training.keras_optimizer import ShardedOptimizer, WeightInfo
from tapas.sharding.placements import Collective, Split

__all__ = ["all_finite", "dp_grad", "dp_record", "dp_sum", "make_optimizer", "sum_squares"]


def make_optimizer(rt: Any, optimizer: Any, learning_rate: float | None,
                   keras_variables: Mapping[str, Any]) -> ShardedOptimizer:
    """The Keras optimizer on this layout's shards
    (``tapas.execution.training.keras_optimizer``)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    return ShardedOptimizer(optimizer, [
        WeightInfo(p, tuple(rt.specs[p].local_shape), rt.specs[p].dtype,
                   isinstance(rt.specs[p].placement, Split)
                   or rt.specs[p].row_axis is not None, keras_variables.get(p))
        for p in rt.trainable_paths], learning_rate)


def sum_squares(rt: Any, r: Any, sums: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """Sums of squares of local gradients -> of the whole weights' gradients: one
    all-reduce over the row for the split weights (and one over the column for weights
    cut over the mesh rows)."""
    out = {p: tf.cast(v, tf.float32) for p, v in sums.items()}
    split = [p for p in out if isinstance(rt.specs[p].placement, Split)]
    if split:
        total = r.values.sum_value(tf.stack([out[p] for p in split]))
        out.update({p: total[i] for i, p in enumerate(split)})
    rows = [p for p in out if rt.specs[p].row_axis is not None]
    if rows:
        total = r.dp.sum_value(tf.stack([out[p] for p in rows]))
        out.update({p: total[i] for i, p in enumerate(rows)})
    return out


def all_finite(rt: Any, r: Any, ok: tf.Tensor) -> tf.Tensor:
    """Whether ``ok`` holds on every replica (a count of the failing ones all-reduced
    over the row, and over the column on a 2-D mesh)."""
    bad = 1.0 - tf.cast(ok, tf.float32)
    bad = r.values.sum_value(bad) if rt.num_devices > 1 else bad
    if r.dp is not None:
        bad = r.dp.sum_value(bad)
    return tf.equal(bad, 0.0)


def dp_grad(rt: Any, r: Any, path: str, g: Any) -> Any:
    """A gradient summed over the mesh column. A sparse one (an embedding lookup's
    ``IndexedSlices``) stays sparse as one device's would be, for optimizers that
    square each slice before duplicates add up (Keras's Adam): when every row looked
    up the same indices (a lookup shared by the batch: T5's relative position bias) the
    global slices are the rows' slices summed; otherwise (per-example lookups: token
    embeddings) they are the rows' slices side by side. Which one holds is checked on
    the values (the rows' indices gathered and compared). An optimizer without slots
    takes the dense sum. The slices' exchanges are recorded in ``dp_audits`` as what
    they are (an all-reduce of the values, all-gathers of values and indices)."""
    if not isinstance(g, tf.IndexedSlices):
        return dp_sum(rt, r, path, g)
    if not rt.optimizer.slot_names:
        return dp_sum(rt, r, path, tf.convert_to_tensor(g))
    indices = tf.cast(g.indices, tf.int32)
    dp_record(rt, Collective.ALL_GATHER, path + ":indices", indices)
    everyone = r.dp.gather_value(indices[None], 0)                 # [rows, slices]
    shared = tf.reduce_all(tf.equal(everyone, everyone[:1]))
    summed = dp_sum(rt, r, path, g.values)
    dp_record(rt, Collective.ALL_GATHER, path, g.values)
    side_by_side = r.dp.gather_value(g.values, 0)
    values, idx = tf.cond(shared, lambda: (summed, indices),
                          lambda: (side_by_side, tf.reshape(everyone, [-1])))
    return tf.IndexedSlices(values, idx, g.dense_shape)


def dp_sum(rt: Any, r: Any, path: str, g: tf.Tensor) -> tf.Tensor:
    """All-reduce of a gradient over the mesh column, recorded in ``dp_audits``."""
    dp_record(rt, Collective.ALL_REDUCE, path, g)
    return r.dp.sum_value(g)


def dp_record(rt: Any, kind: Collective, path: str, t: tf.Tensor) -> None:
    """Record a collective over the mesh column in the runtime's ``dp_audits``."""
    audit = rt.dp_audits.setdefault(rt._tracing, Audit())
    audit.add(CommRecord(kind, path, tuple(t.shape.as_list()), t.dtype.name, "bwd"))
