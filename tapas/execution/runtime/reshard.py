"""Restoring a checkpoint under another layout, slice by slice: each process reads only the
old shards that overlap the slices its replicas hold, one at a time.

In:  a Runtime (its layouts, local replicas, shard and slot variables), a checkpoint's
     layout (``tapas-checkpoint.json``) and ``{key: reader}`` of its per-worker files.
Out: :func:`restore_shards` assigns every local shard (and, with the same optimizer, its
     slots) from the overlapping parts of the old shards and returns the bytes read. Each
     old shard is read at most once per weight and slot, and only when one of this
     process's replicas holds part of it: a weight kept on the same axis on half the
     devices reads two old shards per new one, on twice the devices half of one old shard
     file; a weight whose split axis changes reads every old shard that crosses its slice.
     Peak extra memory: one old shard and one new shard.
Raises: ``CheckpointDamagedError`` naming the missing shard's key (a worker's file absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tapas.sharding.placements import Partial, Placement, parse_placement

__all__ = ["restore_shards", "box", "CheckpointWeights"]

Box = tuple[tuple[int, int], ...]


def box(shape: tuple[int, ...], placement: Placement, n: int, j: int,
        row_axis: int | None = None, rows: int = 1, row: int = 0) -> Box:
    """The part of a global tensor of ``shape`` that shard ``j`` of ``n`` holds under
    ``placement`` (after the mesh row ``row`` of ``rows`` took its part of ``row_axis``),
    as ``(start, stop)`` per axis."""
    b = [(0, int(d)) for d in shape]
    if row_axis is not None:
        size = int(shape[row_axis]) // rows
        b[row_axis] = (row * size, (row + 1) * size)
    axis = getattr(placement, "axis", None)
    if axis is not None:
        start, stop = b[axis]
        step = (stop - start) // n
        b[axis] = (start + j * step, start + (j + 1) * step)
    return tuple(b)


def _overlap(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _local(region: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(region, origin))


def _old_shards(w: Mapping[str, Any], k: int, suffix: str, meta: Mapping[str, Any]
                ) -> list[tuple[str, Box]]:
    """Every old shard of weight ``k`` (its key and global box; a replicated one once per
    mesh row)."""
    p = parse_placement(w["placement"])
    if isinstance(p, Partial):
        raise ValueError(f"weight '{w['path']}' is stored P (partial sums), which no "
                         "pattern writes: the checkpoint's layout file was altered")
    n = int(meta["num_devices"])
    row_axis = w.get("row_axis")
    rows = int(meta.get("mesh_rows", 1)) if row_axis is not None else 1
    shape = tuple(int(d) for d in w["shape"])
    out = []
    for row in range(rows):
        for j in range(n if p.axis is not None else 1):
            out.append((f"r{row * n + j}/w{k}{suffix}/.ATTRIBUTES/VARIABLE_VALUE",
                        box(shape, p, n, j, row_axis, rows, row)))
    return out


def _assemble(rt: Any, spec: Any, replicas: Any, olds: list[tuple[str, Box]],
              keys: Mapping[str, Any], where: str) -> tuple[dict[int, np.ndarray], int]:
    """Each of ``replicas``' shards of the weight laid out as ``spec``, assembled from the
    old shards that overlap it, read one at a time; and the bytes read."""
    from tapas.execution.runtime.checkpoints import CheckpointDamagedError
    wants = {r: box(spec.global_shape, spec.placement, rt.num_devices, r % rt.num_devices,
                    spec.row_axis, rt.rows, r // rt.num_devices) for r in replicas}
    parts = {r: np.empty([hi - lo for lo, hi in b], dtype=spec.dtype) for r, b in wants.items()}
    read = 0
    for key, have in olds:
        hits = {r: o for r, want in wants.items() if (o := _overlap(want, have)) is not None}
        if not hits:
            continue
        if key not in keys:
            raise CheckpointDamagedError(f"checkpoint {where} lacks the shard {key}: a "
                                         "worker's file is missing")
        old = keys[key].get_tensor(key)
        read += int(old.nbytes)
        for r, region in hits.items():
            parts[r][_local(region, wants[r])] = old[_local(region, have)]
        del old
    return parts, read


def _fill(rt: Any, path: str, targets: dict[int, Any], olds: list[tuple[str, Box]],
          keys: Mapping[str, Any], where: str) -> int:
    """Each local replica's shard of ``path`` (:func:`_assemble`) assigned to
    ``targets[replica]``; the bytes read."""
    parts, read = _assemble(rt, rt.specs[path], targets, olds, keys, where)
    for r, var in targets.items():
        var.assign(parts.pop(r))
    return read


def restore_shards(rt: Any, meta: Mapping[str, Any], keys: Mapping[str, Any],
                   same_optimizer: bool, where: str, weights: bool = True) -> int:
    """Every weight of ``rt`` (unless ``weights`` is False: its shards were made from this
    checkpoint, :class:`CheckpointWeights`) and, when ``same_optimizer``, its slots,
    restored from the overlapping old shards (module docstring); returns the bytes read."""
    read = 0
    for k, w in enumerate(meta["weights"]):
        path = w["path"]
        if weights:
            read += _fill(rt, path, {r: rt._vars[r][path] for r in rt.local_replicas},
                          _old_shards(w, k, "", meta), keys, where)
        if path in rt.trainable_paths and same_optimizer:
            for s in rt.optimizer.slot_names:
                read += _fill(rt, path, {r: rt._slots[r][path][s] for r in rt.local_replicas},
                              _old_shards(w, k, f"_{s}", meta), keys, where)
    return read


class CheckpointWeights:
    """The weights of the checkpoint at ``path`` as a source of shards for
    ``tapas.execution.runtime.shards.make_shards``: each local replica's shard of a weight is
    assembled from the old shards that overlap it (:func:`_assemble`), so the runtime's
    shards are created from the checkpoint directly, never initialized first and never
    whole unless the new layout holds them whole. ``read_bytes`` counts what was read."""

    def __init__(self, path: str) -> None:
        import json
        import os

        from tapas.execution.runtime import checkpoints
        with open(os.path.join(path, checkpoints.CHECKPOINT_META)) as f:
            self.meta = json.load(f)
        self.path, self.read_bytes = path, 0
        self.keys = checkpoints.shard_keys(path)
        self._index = {w["path"]: k for k, w in enumerate(self.meta["weights"])}

    def __contains__(self, path: object) -> bool:
        return path in self._index

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.meta["weights"][self._index[path]]["shape"])

    def dtype(self, path: str) -> str:
        w = self.meta["weights"][self._index[path]]
        if "dtype" in w:
            return str(w["dtype"])
        key = f"r0/w{self._index[path]}/.ATTRIBUTES/VARIABLE_VALUE"
        return self.keys[key].get_variable_to_dtype_map()[key].name

    def shard_parts(self, rt: Any, spec: Any) -> dict[int, np.ndarray]:
        """Each local replica's shard of the weight laid out as ``spec``."""
        k = self._index[spec.path]
        parts, read = _assemble(rt, spec, rt.local_replicas,
                                _old_shards(self.meta["weights"][k], k, "", self.meta),
                                self.keys, self.path)
        self.read_bytes += read
        return parts
