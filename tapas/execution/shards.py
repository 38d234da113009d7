"""A runtime's weight shards, made one weight at a time from the weights' global values.

In:  a ``Runtime`` being built (its program's weight layouts, mesh rows, device count,
     local replicas and their devices) and ``initial_weights``: a mapping ``{path: global
     value}``, read once per weight (``tapas.execution.materialize.weight_values`` computes
     each value on reading, so at most one whole weight exists at a time).
Out: :func:`make_shards` returns the layouts (``WeightLayout`` with the values' dtypes and
     local shapes) and, per local replica, ``{path: tf.Variable}`` of its shard;
     :func:`cut` is a replica's part of one global value.
Raises: ValueError naming the weight when a value is missing, of another shape than the
     program's, cut over another number of mesh rows, or not divisible by its placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.plan import WeightLayout
from tapas.sharding.placements import Split, parse_placement

__all__ = ["make_shards", "cut"]


def cut(rt: Any, spec: WeightLayout, value: np.ndarray, replica: int) -> np.ndarray:
    """Replica ``replica``'s part of the global ``value`` of a weight laid out as ``spec``:
    its row's part first when the weight is cut over the mesh rows (nested experts), then
    the row placement's shard."""
    if getattr(spec, "row_axis", None) is not None:
        value = Split(spec.row_axis).shard(value, rt.rows, replica // rt.num_devices)
    return spec.placement.shard(value, rt.num_devices, replica % rt.num_devices)


def _layout(rt: Any, path: str, layout: Any, value: np.ndarray) -> WeightLayout:
    shape = tuple(int(d) for d in layout.global_shape)
    if tuple(value.shape) != shape:
        raise ValueError(f"weight '{path}': initial value has shape {list(value.shape)}, "
                         f"the program expects {list(shape)}")
    row_axis = getattr(layout, "row_axis", None)
    if row_axis is not None and (rt.rows != layout.rows or shape[row_axis] % rt.rows):
        raise ValueError(f"weight '{path}' of shape {list(shape)} is cut into "
                         f"{layout.rows} mesh rows on axis {row_axis} but the runtime "
                         f"has {rt.rows} rows: build the program for this mesh")
    placement = parse_placement(layout.placement)
    spec = WeightLayout(path, shape, tf.as_dtype(value.dtype).name, placement,
                        (), bool(layout.trainable), row_axis, rt.rows)
    rt._check_divisible(f"weight '{path}'", spec.row_shape, placement)
    return dataclasses.replace(spec, local_shape=placement.local_shape(spec.row_shape,
                                                                       rt.num_devices))


def make_shards(rt: Any, initial_weights: Mapping[str, Any]
                ) -> tuple[dict[str, WeightLayout], dict[int, dict[str, tf.Variable]]]:
    """Every weight of ``rt.program.weight_layouts``, in order: its global value read once,
    checked, cut into each local replica's shard variable (named ``w<k>_r<replica>`` on the
    replica's device), and dropped before the next weight is read."""
    specs: dict[str, WeightLayout] = {}
    shards: dict[int, dict[str, tf.Variable]] = {r: {} for r in rt.local_replicas}
    for k, (path, layout) in enumerate(rt.program.weight_layouts.items()):
        if path not in initial_weights:
            raise ValueError(f"no initial value for weight '{path}'")
        value = np.asarray(initial_weights[path])
        spec = specs[path] = _layout(rt, path, layout, value)
        for r in rt.local_replicas:
            # a copy: TensorFlow may keep a NumPy view's buffer, which is the whole value's
            part = np.array(cut(rt, spec, value, r), copy=True)
            with tf.device(rt._device[r]):
                shards[r][path] = tf.Variable(part, trainable=spec.trainable,
                                              name=f"w{k}_r{r}")
        del value, part
    return specs, shards
