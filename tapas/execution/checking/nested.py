"""The sharded program on a ``rows x N`` mesh with nested experts against one device.

In:  a traced model or GraphNode, its :class:`tapas.ir.Graph` (one row's), a plan for N
     devices, inputs over the whole mesh and the row count.
Out: :func:`compare_nested`: a :class:`tapas.execution.checking.verify.Comparison` of the
     outputs and gradients of all ``rows * N`` replicas (simulated in one program) against
     the single-device graph run on each row's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas import ir
from tapas.execution.checking.verify import (Comparison, Difference, _Case, _reference_run,
                                             _weights_and_inputs)
from tapas.execution.program.collectives import Audit, GroupedSimulatedCollectives
from tapas.execution.program.plan import Plan
from tapas.execution.program.reconstruct import Program
from tapas.sharding.placements import Placement, Split

__all__ = ["compare_nested"]


def compare_nested(trace: Any, graph: ir.Graph, plan: Any, inputs: Sequence[Any], rows: int,
                   seed: int = 0) -> Comparison:
    """``compare_with_single_device`` on a ``rows x N`` mesh with nested experts
    (``tapas.planning.experts``), all ``rows * N`` replicas simulated in one program:
    ``plan`` (for N devices) runs in every row, the expert region's tokens exchanged over
    the columns, each expert weight cut into the rows on axis 0 and every other weight
    whole in each row (its gradient summed over the rows). Each row takes its share of
    every input and output: axis 1 (the groups) of a tensor crossing the region's boundary
    (``[E, G, ...]``), axis 0 otherwise. ``graph`` is one row's (one expert GraphNode's,
    or a whole model's); ``inputs`` are the arrays over the whole mesh."""
    prog = Program(trace, graph, plan, expert_rows=rows)
    n, region = prog.num_devices, prog.region
    in_axis = [1 if t.name in region.boundary else 0 for t in graph.inputs]
    out_axis = [1 if t.name in region.boundary else 0 for t in graph.outputs]
    rng = np.random.default_rng(seed)
    values, paths, trainable, arrays, floats = _weights_and_inputs(trace, prog, graph, inputs)

    def over_mesh(shape: Sequence[int], axis: int) -> list[int]:
        return [d * rows if a == axis else d for a, d in enumerate(shape)]

    coeffs = tuple(rng.standard_normal(over_mesh(t.shape, a)).astype(t.dtype)
                   if t.dtype.startswith("float") else None
                   for t, a in zip(graph.outputs, out_axis))
    replicas = [divmod(r, n) for r in range(rows * n)]     # (row, column)

    def cut(value: np.ndarray, row_axis: int | None, plc: Placement, i: int, j: int) -> Any:
        if row_axis is not None:
            value = Split(row_axis).shard(value, rows, i)
        return tf.constant(plc.shard(value, n, j))

    def row_axis_of(path: str) -> int | None:
        return prog.weight_layouts[path].row_axis

    audit = Audit()

    @tf.function(autograph=False)
    def sharded():
        row = GroupedSimulatedCollectives([[i * n + j for j in range(n)]
                                           for i in range(rows)], audit)
        column = GroupedSimulatedCollectives([[i * n + j for i in range(rows)]
                                              for j in range(n)], audit)
        local_w = {p: [cut(values[p], row_axis_of(p), prog.weight_layouts[p].placement, i, j)
                       for i, j in replicas] for p in paths}
        local_x = [[cut(x, in_axis[k], prog.input_placements[k], i, j) for i, j in replicas]
                   for k, x in enumerate(arrays)]
        with tf.GradientTape() as tape:
            tape.watch([w for p in paths for w in local_w[p]])
            tape.watch([x for k in floats for x in local_x[k]])
            outs = prog(local_x, local_w, row, column=column)
            loss = tf.constant(0.0)
            for k, c in enumerate(coeffs):
                if c is None:
                    continue
                plc = prog.output_placements[k]
                for (i, j), o in zip(replicas, outs[k]):
                    share = plc.shard(Split(out_axis[k]).shard(c, rows, i), n, j)
                    loss += tf.cast(tf.reduce_sum(o * share), tf.float32)
        grads = tape.gradient(loss, ([local_w[p] for p in trainable],
                                     [local_x[k] for k in floats]),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outs, grads

    s_outs, (s_wg, s_xg) = sharded()
    r_outs, r_wg, r_xg = _nested_reference(trace, graph, prog, rows, values, paths, trainable,
                                           arrays, floats, coeffs, in_axis, out_axis)

    def whole(locals_: Sequence[Any], plc: Placement, row_axis: int | None) -> np.ndarray:
        return _whole(locals_, plc, row_axis, rows, n)

    diffs = [_nested_difference(f"output {k} '{graph.outputs[k].name}'",
                         whole(so, prog.output_placements[k], out_axis[k]), ro)
             for k, (so, ro) in enumerate(zip(s_outs, r_outs))]
    diffs += [_nested_difference(f"gradient of '{p}'", whole(sg, prog.weight_layouts[p].placement,
                                                       row_axis_of(p)), rg)
              for p, sg, rg in zip(trainable, s_wg, r_wg)]
    diffs += [_nested_difference(f"gradient of input {k}",
                          whole(sg, prog.input_placements[k], in_axis[k]), rg)
              for k, sg, rg in zip(floats, s_xg, r_xg)]
    return Comparison(tuple(diffs), audit.records)


def _nested_reference(trace: Any, graph: ir.Graph, prog: Any, rows: int, values: Any,
                      paths: Any, trainable: Any, arrays: Any, floats: Any, coeffs: Any,
                      in_axis: Sequence[int], out_axis: Sequence[int]) -> tuple[list, list, list]:
    """:func:`compare_nested`'s reference: the single-device graph on each row's share, the
    rows' outputs and input gradients side by side, their weight gradients summed (the
    rows' losses add up)."""
    single = Program(trace, graph, Plan.replicated(graph, 1))
    per_row = [_reference_run(_Case(prog, values, paths, trainable,
                                    tuple(Split(a).shard(x, rows, i)
                                          for a, x in zip(in_axis, arrays)), floats,
                                    tuple(None if c is None else Split(a).shard(c, rows, i)
                                          for a, c in zip(out_axis, coeffs))), single)
               for i in range(rows)]

    def dense(x: Any) -> np.ndarray:   # (an embedding's gradient is IndexedSlices)
        return np.asarray(tf.convert_to_tensor(x))

    r_outs = [np.concatenate([dense(r[0][k]) for r in per_row], axis=out_axis[k])
              for k in range(len(graph.outputs))]
    r_wg = [np.sum([dense(r[1][0][q]) for r in per_row], axis=0)
            for q in range(len(trainable))]
    r_xg = [np.concatenate([dense(r[1][1][q]) for r in per_row], axis=in_axis[k])
            for q, k in enumerate(floats)]
    return r_outs, r_wg, r_xg


def _whole(locals_: Sequence[Any], plc: Placement, row_axis: int | None, rows: int,
           n: int) -> np.ndarray:
    """The global value from every replica's part on a ``rows x n`` mesh: each row's from
    its columns, then the rows concatenated on ``row_axis`` (None: summed, a gradient of a
    weight every row holds)."""
    per_row = []
    for i in range(rows):
        parts = [np.asarray(tf.convert_to_tensor(locals_[i * n + j]), np.float64)
                 for j in range(n)]
        per_row.append(np.concatenate(parts, axis=plc.axis) if isinstance(plc, Split)
                       else parts[0])
    return np.concatenate(per_row, axis=row_axis) if row_axis is not None \
        else np.sum(per_row, axis=0)


def _nested_difference(what: str, got: np.ndarray, ref: Any) -> Difference:
    ref = np.asarray(tf.convert_to_tensor(ref), np.float64)
    return Difference(what, float(np.max(np.abs(got - ref))) if ref.size else 0.0,
                      float(np.max(np.abs(ref))) if ref.size else 0.0)
