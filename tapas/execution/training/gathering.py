"""The global values of a runtime's shard variables (weights, optimizer slots).

In:  a ``tapas.execution.runtime.Runtime`` (its layouts, strategy and mesh) and per local
     replica its variables by weight path.
Out: ``{path: NumPy array}``: each weight reassembled from its shards
     (``Placement.unshard``), gathered from the other workers when this process does not
     hold them all, and, for weights cut over the mesh rows (nested experts), the rows'
     parts concatenated.
Raises: ValueError when this process holds no whole mesh row and the mesh has several.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program.collectives import gather_values
from tapas.sharding.placements import Split

__all__ = ["global_values"]


def global_values(rt: Any, tensors: Mapping[int, Mapping[str, tf.Variable]],
                  paths: Sequence[str]) -> dict[str, np.ndarray]:
    """The global value of each weight of ``paths`` from ``tensors`` (``{replica: {path:
    variable}}``): the shards of a whole mesh row when this process holds one, else
    all-gathered over the workers (every worker must call it)."""
    split = [p for p in paths if rt.specs[p].row_axis is not None]
    if split:   # nested experts: every row holds its part of these
        out = _over_rows(rt, tensors, split)
        rest = [p for p in paths if p not in out]
        return {**out, **(global_values(rt, tensors, rest) if rest else {})}
    row = rt._local_row()
    if row is not None:
        return {p: rt.specs[p].placement.unshard(
            [tensors[r][p].numpy() for r in row]) for p in paths}
    if rt.rows > 1:
        raise ValueError("this process holds no whole row of the mesh: put each row's "
                         "devices in one worker (rows x cols with cols dividing the "
                         "devices per worker)")
    dist = rt.strategy.experimental_distribute_values_from_function(
        lambda ctx: {p: tensors[ctx.replica_id_in_sync_group][p] for p in paths})

    @tf.function
    def gather(values: Any) -> Any:
        def fn(vals: dict) -> dict:
            return {p: (gather_values(vals[p].read_value(), rt.specs[p].placement.axis)
                        if isinstance(rt.specs[p].placement, Split)
                        else tf.identity(vals[p])) for p in paths}
        return rt.strategy.run(fn, args=(values,))

    out = gather(dist)
    return {p: rt.strategy.experimental_local_results(out[p])[0].numpy() for p in paths}


def _over_rows(rt: Any, tensors: Mapping[int, Mapping[str, tf.Variable]],
               paths: Sequence[str]) -> dict[str, np.ndarray]:
    """Global values of weights cut over the mesh rows (nested experts): each row's part
    from its columns' shards, the rows' parts concatenated. Shards held by other
    workers are all-gathered (every worker must call it)."""
    cols = rt.num_devices
    if rt._all_local():
        shards = {p: [tensors[r][p].numpy() for r in range(rt.num_replicas)]
                  for p in paths}
    else:
        dist = rt.strategy.experimental_distribute_values_from_function(
            lambda ctx: {p: tensors[ctx.replica_id_in_sync_group][p] for p in paths})

        @tf.function
        def gather(values: Any) -> Any:
            def fn(vals: dict) -> dict:   # every replica's shard, stacked in replica order
                return {p: gather_values(vals[p].read_value()[None], 0) for p in paths}
            return rt.strategy.run(fn, args=(values,))

        out = gather(dist)
        shards = {p: list(rt.strategy.experimental_local_results(out[p])[0].numpy())
                  for p in paths}
    return {p: np.concatenate([rt.specs[p].placement.unshard(shards[p][i * cols:
                                                                         (i + 1) * cols])
                               for i in range(rt.rows)], axis=rt.specs[p].row_axis)
            for p in paths}
