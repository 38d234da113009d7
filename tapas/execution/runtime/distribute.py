"""The runtime's inputs: checked against the program and cut among the replicas.

In:  global arrays (or this worker's shares of them) and their placements.
Out: ``InputDistribution``, mixed into :class:`tapas.execution.runtime.Runtime`: the
     per-replica values of arrays (axis 0 into the mesh rows, then as placed), the share of
     a global tensor a worker reads, the inputs checked against the program's specs.
Raises ``ValueError`` naming the input, its shape and the expected one, or a split that does
not divide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.runtime.base import _axis
from tapas.sharding.placements import Placement, Split

__all__ = ["InputDistribution"]


class InputDistribution:
    """Inputs and their distribution, for :class:`~tapas.execution.runtime.Runtime`."""

    def _global_spec(self, spec: tf.TensorSpec) -> tf.TensorSpec:
        """A row's input spec as the global one: axis 0 (the batch) times the rows."""
        if self.rows == 1:
            return spec
        shape = spec.shape.as_list()
        if not shape or shape[0] is None:
            raise ValueError(f"input '{spec.name}' has shape {shape}: a mesh with rows cuts "
                             "axis 0 (the batch), which must be static")
        return tf.TensorSpec([shape[0] * self.rows] + shape[1:], spec.dtype, name=spec.name)

    def _check_divisible(self, what: str, shape: tuple[int, ...], placement: Any) -> None:
        axis = _axis(placement)
        if axis is None:
            return
        if axis >= len(shape) or shape[axis] % self.num_devices:
            size = shape[axis] if axis < len(shape) else "missing"
            raise ValueError(f"{what}: placement S{axis} splits dimension {axis} (size {size}, "
                             f"shape {list(shape)}) into {self.num_devices} devices, which does "
                             "not divide; choose a strategy for this device count or another "
                             "device count")

    def _distribute(self, arrays: Sequence[np.ndarray], placements: Sequence[Any],
                    worker_share: bool = False) -> Any:
        """Per-replica values of ``arrays``: global arrays, or with ``worker_share`` this
        worker's shares of them (:meth:`worker_share`), cut among its local replicas."""
        arrays = [np.asarray(a) for a in arrays]
        cut = worker_share and not self._all_local()
        if self.rows > 1:   # axis 0 into the rows (this worker's rows), then as placed
            cols = self.num_devices
            first_row = self.local_replicas[0] // cols if cut else 0
            n_rows = len(self.local_replicas) // cols if cut else self.rows

            def row_fn(ctx: tf.distribute.experimental.ValueContext) -> tuple[tf.Tensor, ...]:
                r = ctx.replica_id_in_sync_group
                i, j = divmod(r, cols)
                with tf.device(self._device[r]):
                    return tuple(tf.constant(p.shard(Split(0).shard(a, n_rows, i - first_row),
                                                     cols, j))
                                 for a, p in zip(arrays, placements))

            return self.strategy.experimental_distribute_values_from_function(row_fn)
        n = len(self.local_replicas) if cut else self.num_devices
        first = self.local_replicas[0] if cut else 0

        def value_fn(ctx: tf.distribute.experimental.ValueContext) -> tuple[tf.Tensor, ...]:
            r = ctx.replica_id_in_sync_group
            with tf.device(self._device[r]):
                return tuple(tf.constant(p.shard(a, n, r - first))
                             for a, p in zip(arrays, placements))

        return self.strategy.experimental_distribute_values_from_function(value_fn)

    def worker_share(self, placement: Placement, shape: Sequence[int]
                     ) -> tuple[int, int, int] | None:
        """The part of a global tensor of ``shape`` placed ``placement`` that this worker's
        replicas read: ``(axis, start, stop)`` along the split axis, or None for the whole
        tensor (a replicated tensor, or every replica in this process). The replicas of a
        worker are consecutive (``devices.local_replica_ids``), so the share is one
        contiguous slab: what a worker's input pipeline has to produce."""
        if self._all_local():
            return None
        if self.rows > 1:   # the rows of this worker, along axis 0
            if self._local_row() is None or len(self.local_replicas) % self.num_devices:
                raise ValueError("this worker holds no whole rows of the mesh: put each row's "
                                 "devices in one worker")
            step = int(shape[0]) // self.rows
            first = self.local_replicas[0] // self.num_devices
            return (0, first * step, (first + len(self.local_replicas) // self.num_devices)
                    * step)
        if not isinstance(placement, Split):
            return None
        size = int(shape[placement.axis])
        self._check_divisible("a worker's share", tuple(shape), placement)
        step = size // self.num_devices
        return (placement.axis, self.local_replicas[0] * step,
                (self.local_replicas[-1] + 1) * step)

    def _check_inputs(self, xs: Sequence[Any], worker_share: bool = False) -> list[np.ndarray]:
        if not isinstance(xs, (list, tuple)):
            xs = [xs]
        if len(xs) != len(self.input_specs):
            names = ", ".join(f"'{s.name or k}'" for k, s in enumerate(self.input_specs))
            raise ValueError(f"got {len(xs)} inputs, the program takes {len(self.input_specs)} "
                             f"({names}): pass one array per input in this order (a "
                             "ParallelModel also takes a dict keyed by input name)")
        out = []
        for x, spec, p in zip(xs, self.input_specs, self.input_placements):
            x = np.asarray(x)
            shape = list(spec.shape.as_list())
            share = self.worker_share(p, shape) if worker_share else None
            if share is not None:
                shape[share[0]] = share[2] - share[1]
            if list(x.shape) != shape:
                what = (f"this worker's share {shape} of the global shape "
                        f"{spec.shape.as_list()} (placed {p}; Runtime.worker_share)"
                        if share is not None else
                        f"{shape} (global shape; capture again for another batch size)")
                raise ValueError(f"input '{spec.name}' has shape {list(x.shape)}, the program "
                                 f"was built for {what}")
            out.append(x.astype(spec.dtype.as_numpy_dtype, copy=False))
        return out
