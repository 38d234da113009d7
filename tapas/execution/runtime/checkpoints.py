"""Checkpoints of a :class:`tapas.execution.runtime.Runtime`: its weight shards, optimizer
slots, step counter and seed-generator states (training mode: the dropout seeds, so a
restored program draws the masks the saved one would have drawn next).

In:  a Runtime (its shards, slots, step counter, seed states, weight layouts, optimizer and
     strategy) and a directory.
Out: :func:`save` writes one ``tf.train.Checkpoint`` file per process plus
     ``tapas-checkpoint.json`` (the layout, :func:`layout`); :func:`restore` reads them back,
     directly when the layout is the runtime's, else each local shard and slot from the
     parts of the old shards that overlap it, reading only those ("resharded",
     ``tapas.execution.runtime.reshard``);
     :func:`write_manifest` records every file's size and SHA-256 (``tapas-manifest.json``),
     :func:`damage` says what of a checkpoint directory no longer matches it (or None);
     :func:`prepare_directory` makes a checkpoint directory and proves it writable;
     :func:`check_space` that it has room for one more checkpoint (:func:`checkpoint_bytes`).
Raises: :class:`CheckpointWriteError` (an ``OSError``) when a save cannot write its files,
     on every worker alike; :class:`CheckpointDirectoryError` (a ``ValueError``) naming the
     directory and the fix when it cannot be made or written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import tensorflow as tf


__all__ = ["CHECKPOINT_META", "MANIFEST", "layout", "save", "restore", "write_manifest",
           "damage", "prepare_directory", "shard_keys", "checkpoint_bytes", "check_space", "agree", "CheckpointWriteError",
           "CheckpointDamagedError", "CheckpointDirectoryError"]

CHECKPOINT_META = "tapas-checkpoint.json"
MANIFEST = "tapas-manifest.json"
_FORMAT = "tapas-checkpoint-1"
_MANIFEST_FORMAT = "tapas-manifest-1"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (on this worker or another); earlier checkpoints
    are untouched."""


class CheckpointDamagedError(ValueError):
    """A checkpoint whose files are incomplete or do not match each other."""


class CheckpointDirectoryError(ValueError):
    """A checkpoint directory that cannot be created or written."""


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
    """Write shards, optimizer slots and the step counter under directory ``path``; every
    worker's files exist when it returns, on every worker. CheckpointWriteError on every
    worker when one of them could not write."""
    problem = None
    try:
        os.makedirs(path, exist_ok=True)
        _checkpoint(rt).write(os.path.join(path, f"task{rt.task_id}"))
        if rt.task_id == 0:
            with open(os.path.join(path, CHECKPOINT_META), "w") as f:
                json.dump(layout(rt), f, indent=1)
    except (OSError, tf.errors.OpError) as e:
        problem = f"{type(e).__name__}: {_first_line(e)}"
    if not agree(rt, problem is None):
        raise CheckpointWriteError(f"cannot write the checkpoint {path}: "
                                   f"{problem or 'another worker could not write its files'}")
    return path


def _first_line(e: BaseException) -> str:
    text = getattr(e, "message", None) or str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def agree(rt: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every worker (a scalar all-reduce of the failures; ``ok``
    itself in one process). Every worker must call it: it is also a barrier."""
    if rt._all_local():
        return ok
    state = rt.__dict__.get("_tapas_agree")
    if state is None:   # one function on every worker (the same collective each call), the
        # flag read from a variable on this worker's device (a collective refuses a tensor
        # with no device)
        with tf.device(rt.strategy.extended.worker_devices[0]):
            flag = tf.Variable(0.0, trainable=False)

        def replica() -> tf.Tensor:
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, flag.read_value())
        state = rt._tapas_agree = (flag, tf.function(lambda: rt.strategy.run(replica),
                                                     autograph=False))
    flag, fn = state
    flag.assign(0.0 if ok else 1.0)
    first = rt.strategy.experimental_local_results(fn())[0]
    return float(first.numpy()) == 0.0


# ---- integrity ------------------------------------------------------------------------------

def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(path: str) -> None:
    """Record the size and SHA-256 of every file of checkpoint directory ``path`` in
    ``tapas-manifest.json`` (synced): written last, once the other files are complete."""
    files = {name: {"size": os.path.getsize(os.path.join(path, name)),
                    "sha256": _digest(os.path.join(path, name))}
             for name in sorted(os.listdir(path)) if name != MANIFEST}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def damage(path: str, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with checkpoint directory ``path``, or None when it is whole: a
    ``required`` file or an index missing, a metadata file that is not JSON, a file whose
    size or SHA-256 differs from the manifest's (a directory without a manifest is checked
    for the rest only)."""
    if not os.path.isdir(path):
        return "the directory is gone"
    names = set(os.listdir(path))
    for name in (*required, CHECKPOINT_META):
        if name not in names:
            return f"{name} is missing"
    for name in sorted(n for n in names if n.endswith(".json")):
        try:
            with open(os.path.join(path, name)) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{name} cannot be read ({type(e).__name__}: {_first_line(e)})"
    for name in sorted(names):   # every task's data files come with its index
        if ".data-" in name and f"{name.split('.data-')[0]}.index" not in names:
            return f"{name.split('.data-')[0]}.index is missing"
    if MANIFEST not in names:
        return None
    with open(os.path.join(path, MANIFEST)) as f:
        files = json.load(f).get("files", {})
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if name not in names:
            return f"{name} is missing"
        size = os.path.getsize(file)
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written (truncated?)"
        if _digest(file) != want["sha256"]:
            return f"{name} differs from what was written (its SHA-256 does not match)"
    return None


def prepare_directory(directory: str) -> None:
    """Create checkpoint directory ``directory`` if needed and prove it writable (a file
    created and removed); CheckpointDirectoryError naming it and the fix otherwise."""
    fix = ("give --checkpoint_dir (checkpoint_dir=) a directory this user can write, "
           "e.g. one under your home or the working directory")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointDirectoryError(f"checkpoint directory {directory}: cannot create it "
                                       f"({e.strerror or e}): {fix}") from None
    if not os.path.isdir(directory):
        raise CheckpointDirectoryError(f"checkpoint directory {directory}: it is a file, "
                                       f"not a directory: {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointDirectoryError(f"checkpoint directory {directory} is not writable "
                                       f"({e.strerror or e}): no checkpoint could be saved; "
                                       f"{fix} (to resume from checkpoints in a read-only "
                                       "one, copy them there first)") from None


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
    ``rt``'s, else each local shard and slot from the parts of the old shards that overlap
    it, reading only those (``tapas.execution.runtime.reshard``; the bytes read are left in
    ``rt.restore_read_bytes``). Returns "direct" or "resharded"."""
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
    if same:   # (shards made from it too: read again, one tensor at a time)
        rt.weights_source = None
        _checkpoint(rt).read(os.path.join(path, f"task{rt.task_id}")) \
            .assert_existing_objects_matched()
        return "direct"
    _restore_resharded(rt, path, meta)
    return "resharded"


def shard_keys(path: str) -> dict[str, Any]:
    """``{key: reader}`` of every tensor in the per-worker files of checkpoint ``path``."""
    keys: dict[str, Any] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".index"):
            reader = tf.train.load_checkpoint(os.path.join(path, f[:-len(".index")]))
            for key in reader.get_variable_to_shape_map():
                keys[key] = reader
    return keys


def _made_from(rt: Any, path: str) -> int | None:
    """The bytes read to create ``rt``'s shards from checkpoint ``path``
    (``reshard.CheckpointWeights``), or None when they were not made from it."""
    source = getattr(rt, "weights_source", None)
    if source is None or os.path.realpath(source.path) != os.path.realpath(path):
        return None
    return int(source.read_bytes)


def _restore_resharded(rt: Any, path: str, meta: Mapping[str, Any]) -> None:
    keys = shard_keys(path)
    n_old = int(meta["num_devices"])   # a mesh row's devices
    from tapas.execution.runtime import reshard   # each process reads only the old shards it needs
    same_opt = _same_optimizer(meta, rt)
    made = _made_from(rt, path)   # shards created from this checkpoint: only the rest
    rt.weights_source = None      # (once: a later restore of it reads the weights again)
    rt.restore_read_bytes = reshard.restore_shards(rt, meta, keys, same_opt, path,
                                                   weights=made is None) + (made or 0)
    values = {}
    for k, p in _state_order(rt, meta, path).items():
        key = next((key for r in range(n_old)   # replicated: any replica's copy
                    if (key := f"r{r}/s{k}/.ATTRIBUTES/VARIABLE_VALUE") in keys), None)
        if key is None:
            raise CheckpointDamagedError(f"checkpoint {path} lacks seed state s{k} ('{p}'): a "
                                         "worker's file is missing")
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


def checkpoint_bytes(rt: Any) -> int:
    """The bytes of one checkpoint of ``rt``: every replica's weight shards and optimizer
    slots (a replicated weight once per replica, as they are saved), over all workers."""
    local = 0
    for r in rt.local_replicas:
        variables = list(rt._vars[r].values())
        variables += [v for slots in rt._slots[r].values() for v in slots.values()]
        local += sum(v.shape.num_elements() * v.dtype.size for v in variables)
    return local * rt.num_replicas // max(1, len(rt.local_replicas))


def check_space(directory: str, need: int) -> None:
    """CheckpointDirectoryError when ``directory``'s file system has less than ``need``
    bytes free (one checkpoint), naming both and the fix."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointDirectoryError(
            f"checkpoint directory {directory}: {free / 2**20:.1f} MiB free, but one "
            f"checkpoint of this model takes about {need / 2**20:.1f} MiB: free space there, "
            "or give --checkpoint_dir (checkpoint_dir=) a directory on a larger disk")
