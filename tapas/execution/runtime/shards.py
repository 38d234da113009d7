"""A runtime's weight shards, made one weight at a time from the weights' global values or
from a checkpoint's slices.

In:  a ``Runtime`` being built (its program's weight layouts, mesh rows, device count,
     local replicas and their devices) and ``initial_weights``: a mapping ``{path: global
     value}``, read once per weight (``tapas.execution.runtime.materialize.weight_values`` computes
     each value on reading, so at most one whole weight exists at a time), or a shard
     source (``tapas.execution.runtime.reshard.CheckpointWeights``: each replica's part assembled
     from a checkpoint's slices, no weight initialized or held whole).
Out: :func:`make_shards` returns the layouts (``WeightLayout`` with the values' dtypes and
     local shapes) and, per local replica, ``{path: tf.Variable}`` of its shard;
     :func:`make_slots` the optimizer slots of the shards, one weight at a time;
     :func:`cut` is a replica's part of one global value; :func:`share` a runtime for
     another program of the same model on the same shard variables.
Raises: ValueError naming the weight when a value is missing (or the checkpoint lacks it),
     of another shape than the program's, cut over another number of mesh rows, or not
     divisible by its placement.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program import stateful
from tapas.execution.training import regularizers
from tapas.execution.program.plan import WeightLayout
from tapas.sharding.placements import Replica, Split

__all__ = ["make_shards", "make_slots", "cut", "share"]


def cut(rt: Any, spec: WeightLayout, value: np.ndarray, replica: int) -> np.ndarray:
    """Replica ``replica``'s part of the global ``value`` of a weight laid out as ``spec``:
    its row's part first when the weight is cut over the mesh rows (nested experts), then
    the row placement's shard."""
    if getattr(spec, "row_axis", None) is not None:
        value = Split(spec.row_axis).shard(value, rt.rows, replica // rt.num_devices)
    return spec.placement.shard(value, rt.num_devices, replica % rt.num_devices)


def _layout(rt: Any, path: str, layout: Any, shape: tuple[int, ...], dtype: Any
            ) -> WeightLayout:
    want = tuple(int(d) for d in layout.global_shape)
    if tuple(shape) != want:
        raise ValueError(f"weight '{path}': initial value has shape {list(shape)}, "
                         f"the program expects {list(want)}")
    shape = want
    row_axis = getattr(layout, "row_axis", None)
    if row_axis is not None and (rt.rows != layout.rows or shape[row_axis] % rt.rows):
        raise ValueError(f"weight '{path}' of shape {list(shape)} is cut into "
                         f"{layout.rows} mesh rows on axis {row_axis} but the runtime "
                         f"has {rt.rows} rows: build the program for this mesh")
    placement = layout.placement
    spec = WeightLayout(path, shape, tf.as_dtype(dtype).name, placement,
                        (), bool(layout.trainable), row_axis, rt.rows)
    rt._check_divisible(f"weight '{path}'", spec.row_shape, placement)
    return dataclasses.replace(spec, local_shape=placement.local_shape(spec.row_shape,
                                                                       rt.num_devices))


def _parts(rt: Any, path: str, layout: Any, source: Any
           ) -> tuple[WeightLayout, Callable[[int], np.ndarray]]:
    """A weight's layout and a function giving a local replica's part: from a shard
    source (``source.shard_parts``: a checkpoint's slices) or cut from the global value."""
    if path not in source:
        raise ValueError(f"no initial value for weight '{path}'" + (
            f": the checkpoint {source.path} holds no such weight (it was written for "
            "another model)" if hasattr(source, "shard_parts") else ""))
    if hasattr(source, "shard_parts"):
        spec = _layout(rt, path, layout, source.shape(path), source.dtype(path))
        return spec, source.shard_parts(rt, spec).pop
    value = np.asarray(source[path])
    spec = _layout(rt, path, layout, value.shape, value.dtype)
    # a copy: TensorFlow may keep a NumPy view's buffer, which is the whole value's
    return spec, lambda r: np.array(cut(rt, spec, value, r), copy=True)


def make_shards(rt: Any, initial_weights: Any
                ) -> tuple[dict[str, WeightLayout], dict[int, dict[str, tf.Variable]]]:
    """Every weight of ``rt.program.weight_layouts``, in order: its local replicas' parts
    made (its global value read once, checked and cut; or, from a shard source such as
    ``tapas.execution.runtime.reshard.CheckpointWeights``, assembled from the slices it holds),
    each put into the replica's shard variable (named ``w<k>_r<replica>`` on the replica's
    device), and dropped before the next weight. A shard source is kept as
    ``rt.weights_source`` (its restore then reads only the rest)."""
    specs: dict[str, WeightLayout] = {}
    shards: dict[int, dict[str, tf.Variable]] = {r: {} for r in rt.local_replicas}
    for k, (path, layout) in enumerate(rt.program.weight_layouts.items()):
        spec, part = _parts(rt, path, layout, initial_weights)
        specs[path] = spec
        for r in rt.local_replicas:
            with tf.device(rt._device[r]):
                shards[r][path] = tf.Variable(part(r), trainable=spec.trainable,
                                              name=f"w{k}_r{r}")
        del part   # (and the global value it holds)
    rt.weights_source = initial_weights if hasattr(initial_weights, "shard_parts") else None
    return specs, shards


def make_slots(rt: Any) -> dict[int, dict[str, dict[str, tf.Variable]]]:
    """Per local replica, ``{path: {slot name: tf.Variable}}`` of every trainable weight's
    optimizer slots (named ``<slot><k>_r<replica>``), one weight's initial values made at a
    time (all of them at once held every slot twice while the variables copied them)."""
    slots: dict[int, dict[str, dict[str, tf.Variable]]] = {r: {} for r in rt.local_replicas}
    for k, path in enumerate(rt.trainable_paths):
        values = rt.optimizer.initial_slots(path)
        for r in rt.local_replicas:
            with tf.device(rt._device[r]):
                slots[r][path] = {name: tf.Variable(v, trainable=False, name=f"{name}{k}_r{r}")
                                  for name, v in values.items()}
        del values
    return slots


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
        spec, placement = rt.specs[path], layout.placement
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
    other.input_placements = list(program.input_placements)
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
