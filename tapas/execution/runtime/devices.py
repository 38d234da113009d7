"""Devices and ``tf.distribute`` strategies for the runtime.

In:  a device count and type ("auto", "cpu", "gpu"), and the ``TF_CONFIG`` environment
     variable when several worker processes train together.
Out: device names (:func:`setup_devices`: GPUs, or logical CPU devices), the parsed
     ``TF_CONFIG`` (:func:`tf_config`), a ``MirroredStrategy`` or
     ``MultiWorkerMirroredStrategy`` (:func:`make_strategy`), and which replicas this
     process runs (:func:`local_replica_ids`, :func:`task_id`).

Collective keys. TensorFlow identifies a collective by (group key, instance key). A
strategy numbers its groups from ``1 + _collective_key_base`` (0 unless set) and the
collectives of each group from 100, in the order they are traced; the process's collective
executor remembers every (group, instance) it has run. Two ``MirroredStrategy`` objects
created one after the other therefore reuse the same keys, and the second program's
collective number k meets the first program's number k of another type, shape or device
set: "Collective instance 102 expected type 0 ... but got type 2", or "Shape mismatch in
the collective instance 100", after which the process is poisoned. :func:`make_strategy`
gives every ``MirroredStrategy`` it creates its own key range, and reuses the one
``MultiWorkerMirroredStrategy`` of a worker process (one strategy object keeps counting
its instance keys, so any number of programs can share it); :func:`claim_collective_keys`
refuses a strategy created elsewhere whose keys another strategy of this process used.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tapas.execution.runtime import launch

__all__ = ["setup_devices", "tf_config", "make_strategy", "local_replica_ids", "task_id",
           "claim_collective_keys"]

# group keys one MirroredStrategy may take: one per device set it runs collectives over
# (its own devices, plus the rare subsets tf.distribute forms), far fewer than this
_KEY_STRIDE = 1000
_key_lock = threading.Lock()
_next_key_base = 0
# the strategy that first ran programs with each key base, by base (weak: a strategy that
# is gone still left its keys in the collective executor, so its base stays taken)
_key_owners: dict[int, weakref.ref] = {}
# the MultiWorkerMirroredStrategy of this worker process, by TF_CONFIG
_multi_worker: dict[str, tf.distribute.Strategy] = {}


def setup_devices(num_devices: int, device_type: str = "auto") -> list[str]:
    """Names of ``num_devices`` devices for a ``MirroredStrategy``.

    ``device_type`` "auto" takes GPUs when at least ``num_devices`` are present, else splits the
    CPU into logical devices; "cpu"/"gpu" force one. Logical CPU devices can be configured only
    before TensorFlow initialises its runtime, once per process: a later call that needs more
    devices than the process has raises ``RuntimeError`` with the fix.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices}: need at least 1 device")
    if device_type not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device_type={device_type!r}: use 'auto', 'cpu' or 'gpu'")
    gpus = tf.config.list_physical_devices("GPU")
    if device_type != "cpu" and len(gpus) >= num_devices:
        return [d.name for d in tf.config.list_logical_devices("GPU")[:num_devices]]
    if device_type == "gpu":
        raise RuntimeError(f"{num_devices} GPUs requested, {len(gpus)} present; use fewer "
                           "devices or device_type='cpu' (logical CPU devices)")
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is None or len(configured) < num_devices:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
        except RuntimeError:
            pass  # runtime already initialised: checked below
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < num_devices:
        raise RuntimeError(
            f"this process already initialised TensorFlow with {len(logical)} logical CPU "
            f"device(s), {num_devices} are needed: logical devices are fixed once per process. "
            f"Call tapas.execution.runtime.devices.setup_devices({num_devices}) before any TensorFlow op, or run "
            "in a fresh process")
    return [d.name for d in logical[:num_devices]]


def tf_config() -> dict[str, Any] | None:
    """The parsed ``TF_CONFIG`` environment variable when it names more than one task."""
    text = os.environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not JSON ({e}): {text[:200]!r}") from None
    cluster = cfg.get("cluster", {})
    tasks = sum(len(v) for k, v in cluster.items() if k in ("chief", "worker"))
    if tasks <= 1:
        return None
    if "task" not in cfg:
        raise ValueError("TF_CONFIG has a cluster but no 'task' ({'type': 'worker', 'index': i})")
    return cfg


def process_count() -> int:
    """How many worker processes ``TF_CONFIG`` names (chief and workers); 1 without it."""
    cfg = tf_config()
    if cfg is None:
        return 1
    return sum(len(cfg["cluster"].get(k, ())) for k in ("chief", "worker"))


def is_chief_process() -> bool:
    """Whether this process reports for the job: always without ``TF_CONFIG``; else the
    ``chief`` task, or worker 0 when the cluster has no chief (as ``tapas`` launches it)."""
    cfg = tf_config()
    if cfg is None:
        return True
    task = cfg["task"]
    if task.get("type") == "chief":
        return True
    return "chief" not in cfg["cluster"] and int(task.get("index", 0)) == 0


def make_strategy(num_devices: int | None = None, *, device_type: str = "auto",
                  join_timeout_s: float = 60.0,
                  collective_timeout_s: float | None = None,
                  devices_per_worker: int = 1) -> tf.distribute.Strategy:
    """``MultiWorkerMirroredStrategy`` when ``TF_CONFIG`` names several workers, else a
    ``MirroredStrategy`` over :func:`setup_devices` (``num_devices``).

    With ``TF_CONFIG`` each worker uses its GPUs, or on a host without GPUs
    ``devices_per_worker`` logical CPU devices (TensorFlow's own choice there is one CPU
    device per worker: :func:`_cpu_devices_per_worker`), and N is the number of workers
    times local devices; ``num_devices``, when given, must equal that N. If the
    cluster has not formed within ``join_timeout_s`` a watchdog prints which worker never
    joined and ends this process (``tapas.execution.runtime.launch.JoinWatchdog``: TF holds the GIL while it
    waits, so nothing in this process can raise); ``collective_timeout_s`` bounds every
    collective afterwards (a worker dying).
    """
    cfg = tf_config()
    if cfg is None:
        return _mirrored_strategy(setup_devices(num_devices or 1, device_type))
    text = os.environ["TF_CONFIG"]
    if text in _multi_worker:
        strategy = _multi_worker[text]
        _check_replicas(strategy, num_devices)
        return strategy
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=collective_timeout_s)
    local = _cpu_devices_per_worker(devices_per_worker)
    watchdog = launch.JoinWatchdog(cfg, join_timeout_s) if join_timeout_s else None
    try:
        with local:
            strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    finally:
        if watchdog is not None:
            watchdog.cancel()
    _multi_worker[text] = strategy
    _check_replicas(strategy, num_devices)
    return strategy


@contextlib.contextmanager
def _cpu_devices_per_worker(k: int) -> Iterator[None]:
    """While a ``MultiWorkerMirroredStrategy`` is built: ``k`` logical CPU devices per worker
    on a host without GPUs. TensorFlow's ``CollectiveAllReduceExtended`` takes one CPU device
    per worker whatever the logical configuration (``_initialize_local_devices``); its
    collectives, launchers and ``tf.distribute`` replicas work over several local devices
    as they do over a worker's GPUs, so that method is wrapped for this one construction
    (as ``_mirrored_strategy`` sets the key base) and the worker's ``k`` logical devices
    configured first (the process must not have started TensorFlow's runtime yet). With GPUs TensorFlow's choice (every visible GPU) stands; ``k`` must then
    be their number."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"devices_per_worker={k!r}: must be a positive int")
    gpus = tf.config.list_physical_devices("GPU")
    if k == 1 or gpus:
        if gpus and k not in (1, len(gpus)):
            raise ValueError(f"devices_per_worker={k} but this worker sees {len(gpus)} GPUs, "
                             "all of which MultiWorkerMirroredStrategy uses: make "
                             "CUDA_VISIBLE_DEVICES name that many")
        yield
        return
    # (configured, not listed: listing would start the runtime before the strategy
    # configures its collective ops, which TensorFlow refuses)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * k)
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    cls = cars.CollectiveAllReduceExtended
    original = cls.__dict__["_initialize_local_devices"]

    def local_devices(self: Any, resolver: Any, worker_device: str) -> Any:
        found, kind = original(self, resolver, worker_device)
        if kind == "CPU":
            found = tuple(f"{worker_device}/device:CPU:{i}" for i in range(k))
        return found, kind

    with _key_lock:
        cls._initialize_local_devices = local_devices
        try:
            yield
        finally:
            cls._initialize_local_devices = original


def _check_replicas(strategy: tf.distribute.Strategy, num_devices: int | None) -> None:
    """``num_devices``, when given, must be the multi-worker strategy's replica count."""
    if num_devices is not None and strategy.num_replicas_in_sync != num_devices:
        raise ValueError(f"TF_CONFIG gives {strategy.num_replicas_in_sync} replicas "
                         f"(workers x local devices) but num_devices={num_devices}; make them "
                         "equal or leave num_devices out")


def _mirrored_strategy(devices: list[str]) -> tf.distribute.Strategy:
    """A ``MirroredStrategy`` over ``devices`` whose collective group keys no other strategy
    of this process uses (module docstring). TensorFlow reads the key base from the class
    attribute ``_collective_key_base`` when the strategy is built (its own tests raise it
    the same way); it is set for this one construction and restored."""
    global _next_key_base
    cls = tf.distribute.MirroredStrategy
    with _key_lock:
        _next_key_base += _KEY_STRIDE
        saved = cls.__dict__.get("_collective_key_base", 0)
        cls._collective_key_base = _next_key_base
        try:
            return cls(devices)
        finally:
            cls._collective_key_base = saved


def claim_collective_keys(strategy: tf.distribute.Strategy) -> None:
    """Record that ``strategy`` runs programs in this process; raise ``ValueError`` when
    another strategy (alive or not) already ran programs with the same collective keys,
    which would abort the collectives of both (module docstring)."""
    base = getattr(strategy.extended, "_collective_key_base", None)
    if base is None:   # a strategy without collective keys (one device, parameter servers)
        return
    with _key_lock:
        owner = _key_owners.get(int(base))
        if owner is None:
            _key_owners[int(base)] = weakref.ref(strategy)
            return
        if owner() is strategy:
            return
    raise ValueError(
        f"this {type(strategy).__name__} numbers its collectives from group key {base + 1}, "
        "like another tf.distribute strategy that already ran a parallel program in this "
        "process: their collectives would collide and TensorFlow would abort both "
        "('Collective instance ... expected type ...'). Pass devices=N (tapas gives each "
        "strategy it makes its own keys: tapas.execution.runtime.devices.make_strategy), or create "
        "one strategy and pass that same object to every tapas.parallelize call")


def local_replica_ids(strategy: tf.distribute.Strategy) -> list[int]:
    """The global ids of the replicas this process runs (all of them under one process)."""
    local = len(strategy.extended.worker_devices)
    resolver = getattr(strategy, "cluster_resolver", None)
    task = int(resolver.task_id or 0) if resolver is not None and resolver.task_type else 0
    return [task * local + i for i in range(local)]


def task_id(strategy: tf.distribute.Strategy) -> int:
    """This worker's index under ``MultiWorkerMirroredStrategy``; 0 otherwise."""
    resolver = getattr(strategy, "cluster_resolver", None)
    return int(resolver.task_id or 0) if resolver is not None and resolver.task_type else 0
