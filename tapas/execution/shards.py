"""A runtime's weight shards, made one weight at a time from the weights' global values.

In:  a ``Runtime`` being built (its program's weight layouts, mesh rows, device count,
     local replicas and their devices) and ``initial_weights``: a mapping ``{path: global
     value}``, read once per weight (``tapas.execution.materialize.weight_values`` computes
     each value on reading, so at most one whole weight exists at a time).
Out: :func:`make_shards` returns the layouts (``WeightLayout`` with the values' dtypes and
     local shapes) and, per local replica, ``{path: tf.Variable}`` of its shard;
     :func:`cut` is a replica's part of one global value; :func:`share` a runtime for
     another program of the same model on the same shard variables.
Raises: ValueError naming the weight when a value is missing, of another shape than the
     program's, cut over another number of mesh rows, or not divisible by its placement.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program import stateful
from tapas.execution.training import regularizers
from tapas.execution.program.plan import WeightLayout
from tapas.sharding.placements import Replica, Split, parse_placement

__all__ = ["make_shards", "cut", "share"]


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


def share(rt: Any, program: Any, input_specs: Sequence[tf.TensorSpec]) -> Any:
    """A runtime that runs another program of the same model (e.g. its inference-mode
    graph) on ``rt``'s weights: the same shard variables where the program lays a weight
    out as ``rt`` does, the same step counter and learning rate; its own collectives,
    traced functions and seed states. A weight the program places otherwise gets shard
    variables of its own (``resynced``), cut from ``rt``'s global value now and again by
    ``Runtime.refresh``."""
    other = copy.copy(rt)
    other.source, other.resynced = rt, []
    other.specs = dict(rt.specs)
    other._vars = {r: dict(v) for r, v in rt._vars.items()}
    for path, layout in program.weight_layouts.items():
        if path not in rt.specs:
            raise ValueError(f"weight '{path}' of the other program is not one of this "
                             "runtime's: the programs come from different models")
        spec, placement = rt.specs[path], parse_placement(layout.placement)
        if placement != spec.placement:
            rt._check_divisible(f"weight '{path}'", spec.row_shape, placement)
            other.specs[path] = dataclasses.replace(
                spec, placement=placement,
                local_shape=placement.local_shape(spec.row_shape, rt.num_devices))
            other.resynced.append(path)
    values = rt._global(rt._vars, other.resynced) if other.resynced else {}
    for r in rt.local_replicas:
        with tf.device(rt._device[r]):
            for k, path in enumerate(other.resynced):
                other._vars[r][path] = tf.Variable(
                    rt._cut(other.specs[path], values[path], r),
                    trainable=False, name=f"resynced{k}_r{r}")
    other._dist_vars = rt.strategy.experimental_distribute_values_from_function(
        lambda ctx: other._vars[ctx.replica_id_in_sync_group])
    other.program, other.row_specs = program, list(input_specs)
    other.input_specs = [rt._global_spec(s) for s in other.row_specs]
    other.input_placements = [parse_placement(p) for p in program.input_placements]
    other.output_placements, other.call_loss_placements = regularizers.split_outputs(program)
    if rt._collectives == rt._default_collectives:   # record into its own audits
        other._collectives = other._default_collectives
    other.audits, other.trace_seconds, other.graphs, other.loss_comms = {}, {}, {}, []
    other.dp_audits = {}
    other.loss_plan, other.weight_placement = None, Replica()
    other.states = stateful.StateStore(getattr(program, "states", {}), rt.strategy,
                                       {r: rt._device[r] for r in rt.local_replicas})
    for name in ("_loss_fn", "_evaluate_fn"):
        other.__dict__.pop(name, None)
    other._train_fn = tf.function(other._train_step, autograph=False)
    other._predict_fn = tf.function(other._predict, autograph=False)
    return other
