"""Checkpoints of a :class:`tapas.execution.runtime.Runtime`: its weight shards, optimizer
slots, step counter and seed-generator states (training mode: the dropout seeds, so a
restored program draws the masks the saved one would have drawn next).

In:  a Runtime (its shards, slots, step counter, seed states, weight layouts, optimizer and
     strategy) and a directory.
Out: :func:`save` writes one ``tf.train.Checkpoint`` file per process plus
     ``tapas-checkpoint.json`` (the layout, :func:`layout`); :func:`restore` reads them back,
     directly when the layout is the runtime's, else by reassembling every weight and slot
     from the old shards and cutting it again for this layout ("resharded").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.sharding.placements import Partial, Placement, parse_placement

__all__ = ["CHECKPOINT_META", "layout", "save", "restore"]

CHECKPOINT_META = "tapas-checkpoint.json"
_FORMAT = "tapas-checkpoint-1"


def _checkpoint(rt: Any) -> tf.train.Checkpoint:
    index = {p: k for k, p in enumerate(rt.paths)}
    replicas = {}
    for r in rt.local_replicas:
        objs = {f"w{index[p]}": v for p, v in rt._vars[r].items()}
        for p, slots in rt._slots[r].items():
            objs.update({f"w{index[p]}_{k}": v for k, v in slots.items()})
        objs.update({f"s{k}": rt.states.vars[r][p] for k, p in enumerate(rt.states.paths)})
        replicas[f"r{r}"] = tf.train.Checkpoint(**objs)
    state = {f"opt_{k}": v for k, v in getattr(rt, "opt_state", {}).items()}
    return tf.train.Checkpoint(iterations=rt.iterations, **state, **replicas)


def layout(rt: Any) -> dict[str, Any]:
    """The JSON description of ``rt``'s layout written next to a checkpoint."""
    return {"format": _FORMAT, "num_devices": rt.num_devices,
            "mesh_rows": getattr(rt, "rows", 1),   # 2-D mesh: the devices are a row's
            "optimizer": rt.optimizer.describe(),
            "weights": [{"path": s.path, "shape": list(s.global_shape),
                         "placement": str(s.placement), "trainable": s.trainable,
                         "dtype": s.dtype, "row_axis": s.row_axis} for s in rt.specs.values()],
            "states": list(rt.states.paths)}


def save(rt: Any, path: str) -> str:
    """Write shards, optimizer slots and the step counter under directory ``path``."""
    os.makedirs(path, exist_ok=True)
    _checkpoint(rt).write(os.path.join(path, f"task{rt.task_id}"))
    if rt.task_id == 0:
        with open(os.path.join(path, CHECKPOINT_META), "w") as f:
            json.dump(layout(rt), f, indent=1)
    rt._barrier()   # every worker's file exists when save returns, on every worker
    return path


def _read_meta(rt: Any, path: str) -> dict[str, Any]:
    """The layout of the checkpoint at ``path``, checked against ``rt``'s weights and
    optimizer."""
    meta_path = os.path.join(path, CHECKPOINT_META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path}: no {CHECKPOINT_META}; is it a directory written "
                                "by ParallelModel.save / Runtime.save?")
    with open(meta_path) as f:
        meta = json.load(f)
    old = {w["path"]: w for w in meta["weights"]}
    missing = sorted(set(rt.paths) - set(old))
    extra = sorted(set(old) - set(rt.paths))
    if missing or extra:
        raise ValueError(f"checkpoint {path} holds other weights: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}; it was written for another model")
    for p in rt.paths:
        if tuple(old[p]["shape"]) != rt.specs[p].global_shape:
            raise ValueError(f"checkpoint {path}: weight '{p}' has shape {old[p]['shape']}, "
                             f"this model's is {list(rt.specs[p].global_shape)}")
    old_opt = meta["optimizer"]["name"]
    if not _same_optimizer(meta, rt) and rt.optimizer.slot_names:
        raise ValueError(f"checkpoint {path} was written with optimizer '{old_opt}' (slots "
                         f"{_slots(meta)}), this runtime uses '{rt.optimizer.name}' (slots "
                         f"{list(rt.optimizer.slot_names)}), whose slots it lacks; restore "
                         f"with optimizer='{old_opt}' and the same settings")
    return meta


def _slots(meta: Mapping[str, Any]) -> list[str]:
    """The slot names a checkpoint holds (older checkpoints name only SGD or Adam)."""
    opt = meta["optimizer"]
    if "slots" in opt:
        return list(opt["slots"])
    return ["momentum", "velocity"] if opt["name"] == "adam" else \
        ["momentum"] if opt.get("momentum") else []


def _same_optimizer(meta: Mapping[str, Any], rt: Any) -> bool:
    return (meta["optimizer"]["name"] == rt.optimizer.name
            and _slots(meta) == list(rt.optimizer.slot_names))


def restore(rt: Any, path: str) -> str:
    """Load a checkpoint written by :func:`save` into ``rt``: directly when the layout is
    ``rt``'s, else by reassembling each weight and slot from the old shards and cutting it
    again. Returns "direct" or "resharded"."""
    meta = _read_meta(rt, path)
    old = {w["path"]: w for w in meta["weights"]}
    same = (meta["num_devices"] == rt.num_devices
            and meta.get("mesh_rows", 1) == getattr(rt, "rows", 1)
            and _same_optimizer(meta, rt)
            and all(old[p]["placement"] == str(rt.specs[p].placement)
                    and old[p].get("row_axis") == rt.specs[p].row_axis for p in rt.paths)
            and [w["path"] for w in meta["weights"]] == rt.paths
            and len(meta.get("states", [])) == len(rt.states.paths)
            and os.path.exists(os.path.join(path, f"task{rt.task_id}.index")))
    if same:
        _checkpoint(rt).read(os.path.join(path, f"task{rt.task_id}")) \
            .assert_existing_objects_matched()
        return "direct"
    _restore_resharded(rt, path, meta)
    return "resharded"


def _stored_placement(text: str) -> Placement:
    p = parse_placement(text)
    if isinstance(p, Partial):
        raise ValueError("a weight, input or output cannot be placed P (partial sums): "
                         "patterns reduce their partial sums inside the node")
    return p


def _restore_resharded(rt: Any, path: str, meta: Mapping[str, Any]) -> None:
    readers = [tf.train.load_checkpoint(os.path.join(path, f[:-len(".index")]))
               for f in sorted(os.listdir(path)) if f.endswith(".index")]
    keys: dict[str, Any] = {}
    for reader in readers:
        for key in reader.get_variable_to_shape_map():
            keys[key] = reader
    n_old = int(meta["num_devices"])   # a mesh row's devices

    def read_row(k: int, suffix: str, p: Placement, row: int) -> np.ndarray:
        parts = []
        for j in range(n_old if p.axis is not None else 1):
            key = f"r{row * n_old + j}/w{k}{suffix}/.ATTRIBUTES/VARIABLE_VALUE"
            if key not in keys:
                raise ValueError(f"checkpoint {path} lacks the shard {key}: a worker's file "
                                 "is missing")
            parts.append(keys[key].get_tensor(key))
        return p.unshard(parts)

    def read(k: int, suffix: str, w: Mapping[str, Any]) -> np.ndarray:
        p = _stored_placement(w["placement"])
        if w.get("row_axis") is None:
            return read_row(k, suffix, p, 0)
        # nested experts: each mesh row holds its part of axis row_axis
        return np.concatenate([read_row(k, suffix, p, i)
                               for i in range(int(meta.get("mesh_rows", 1)))],
                              axis=int(w["row_axis"]))

    values, slots = {}, {k: {} for k in rt.optimizer.slot_names}
    same_opt = _same_optimizer(meta, rt)
    for k, w in enumerate(meta["weights"]):
        values[w["path"]] = read(k, "", w)
        if w["path"] in rt.trainable_paths and same_opt:
            for s in rt.optimizer.slot_names:
                slots[s][w["path"]] = read(k, f"_{s}", w)
    rt.set_global_weights(values, slots)
    values = {}
    for k, p in _state_order(rt, meta, path).items():
        key = next((key for r in range(n_old)   # replicated: any replica's copy
                    if (key := f"r{r}/s{k}/.ATTRIBUTES/VARIABLE_VALUE") in keys), None)
        if key is None:
            raise ValueError(f"checkpoint {path} lacks seed state s{k} ('{p}'): a worker's "
                             "file is missing")
        values[p] = keys[key].get_tensor(key)
    rt.states.set_values(values)
    for k, var in getattr(rt, "opt_state", {}).items():
        key = f"opt_{k}/.ATTRIBUTES/VARIABLE_VALUE"
        if same_opt and key in keys:
            var.assign(keys[key].get_tensor(key))
    step_key = "iterations/.ATTRIBUTES/VARIABLE_VALUE"
    rt.iterations.assign(int(keys[step_key].get_tensor(step_key)) if step_key in keys else 0)


def _state_order(rt: Any, meta: Mapping[str, Any], path: str) -> dict[int, str]:
    """``{index in the checkpoint: this runtime's state path}``. Seed states are matched by
    order when their paths differ: Keras numbers unnamed seed generators per process
    (``seed_generator_4``), so a second instance of a model in one process has other state
    paths in the same order. A checkpoint without states (an inference-mode program's)
    leaves them as they are."""
    old, new = list(meta.get("states", [])), rt.states.paths
    if not old or not new:
        return {}
    if sorted(old) == sorted(new):
        return {k: p for k, p in enumerate(old)}
    if len(old) == len(new):
        return dict(enumerate(new))
    raise ValueError(f"checkpoint {path} holds {len(old)} seed states ({old[:3]}), this "
                     f"program reads {len(new)} ({new[:3]}): it was written for a model "
                     "with other dropout layers; restore it into the same architecture")
