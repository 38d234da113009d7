"""Running one body on every replica of the runtime's strategy.

In:  a replica body ``body(r, *tensors)`` (``r``: a ``base._Replica``) and its arguments
     (distributed values, variables); the strategy's collective launchers when it has them.
Out: ``ReplicaCalls``, mixed into :class:`tapas.execution.runtime.Runtime`: ``strategy.run``
     of the body, traced once for every replica with keyed collectives where the strategy
     launches them per device (else in each replica); the mesh's group keys; timed
     ``tf.function`` calls under the runtime's Grappler options, the C heap's free pages
     given back after a call that traced; a barrier over workers.
Raises ``ValueError`` for a mesh with rows on a strategy without per-device launchers, and
``RuntimeError`` when the devices' collective instance keys disagree.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tapas.execution.program import replay
from tapas.execution.program.collectives import (Audit, KeyedCollectives, KeyedGroup,
                                                 ReplicaContextCollectives)
from tapas.execution.runtime import memory
from tapas.execution.runtime.base import _placed, _read, _Replica, _spec

__all__ = ["ReplicaCalls"]


def _tracing_count(fn: Callable) -> int | None:
    """How many times the tf.function ``fn`` has traced (None: not a tf.function)."""
    count = getattr(fn, "experimental_get_tracing_count", None)
    return count() if count is not None else None


class ReplicaCalls:
    """Replica bodies under the strategy, for :class:`~tapas.execution.runtime.Runtime`
    (reads its strategy, devices, mesh keys, collectives factory and audits)."""

    def _all_local(self) -> bool:
        return len(self.local_replicas) == self.num_replicas

    def _local_row(self) -> list[int] | None:
        """The replicas of the first mesh row this process holds whole, or None."""
        first = -(-self.local_replicas[0] // self.num_devices) * self.num_devices
        row = list(range(first, first + self.num_devices))
        return row if all(r in self._device for r in row) else None

    def _claim_mesh_keys(self) -> dict[str, Any]:
        """Collective group keys for the mesh's rows and columns, taken from the strategy's
        own group-key counter (so no other group of this strategy uses them; every worker
        takes them at the same point, so they agree), and a counter for their instance keys
        (one for the runtime: no two collectives of its functions share a key)."""
        launchers = self._launchers()
        if launchers is None:
            raise ValueError("a mesh with rows needs a strategy that launches collectives per "
                             "device (MirroredStrategy or MultiWorkerMirroredStrategy with "
                             "collective ops: tapas.execution.runtime.devices.make_strategy)")
        counter = launchers[0]._collective_keys
        with counter._lock:
            base = counter._group_key
            counter._group_key += self.rows + self.num_devices
        return {"rows": [base + i for i in range(self.rows)],
                "cols": [base + self.rows + j for j in range(self.num_devices)],
                "instance": itertools.count(100)}

    def _default_collectives(self, function: str) -> Any:
        from tapas.execution.program import reconstruct
        if function not in self.audits:
            self.audits[function] = reconstruct.Audit()
        return reconstruct.ReplicaContextCollectives(audit=self.audits[function])

    def _call(self, key: str, fn: Callable, *args: Any) -> Any:
        """Run one tf.function, timing its first call (the trace), under the runtime's
        Grappler options (:func:`tapas.execution.program.replay.graph_optimization`); after
        a call that traced, the C heap's free pages go back to the system
        (:func:`tapas.execution.runtime.memory.release_free_heap`)."""
        first = key not in self.trace_seconds
        traces = _tracing_count(fn)
        self._tracing = key
        start = time.perf_counter()
        try:
            with replay.graph_optimization(self.graph_optimization, self._accelerators):
                if first and traces is not None:
                    # traced before it runs: what the trace freed goes back before the
                    # step's tensors are made
                    fn.get_concrete_function(*args)
                    memory.release_free_heap()
                result = fn(*args)
        finally:
            self._tracing = ""
        if first:
            self.trace_seconds[key] = time.perf_counter() - start
        if first if traces is None else _tracing_count(fn) != traces:
            memory.release_free_heap()
        return result

    def _on_device(self, fn: Callable) -> Callable:
        """``fn`` run under its replica's device scope: MultiWorkerMirroredStrategy opens none
        around the replica function, and its all-reduce (forward, and in the backward pass
        the tape runs) needs tensors placed on a device."""
        def wrapped(*args: Any) -> Any:
            ctx = tf.distribute.get_replica_context()
            rid = tf.get_static_value(ctx.replica_id_in_sync_group)
            device = self._device.get(int(rid) if rid is not None else -1,
                                      self._device[self.local_replicas[0]])
            with tf.device(device):
                # the tf.function's input placeholders have no device under MWMS either
                args = tf.nest.map_structure(
                    lambda a: _placed(a) if isinstance(a, tf.Tensor) else a, args)
                return fn(*args)
        return wrapped

    def _launchers(self) -> list | None:
        """The strategy's per-device ``CollectiveReplicaLauncher`` s when the replica bodies
        can be traced once (:meth:`_replicas`), else None: a custom ``collectives``
        factory, a strategy whose collectives are not launched per device
        (``MirroredStrategy`` with ``NcclAllReduce`` or another ``cross_device_ops``), or
        one device (nothing to launch)."""
        if self._collectives != self._default_collectives or self.num_replicas < 2:
            return None
        launchers = getattr(getattr(self.strategy.extended, "_cross_device_ops", None),
                            "_launchers", None)
        if not launchers or len(launchers) != len(self.local_replicas):
            return None
        return list(launchers)

    def _keyed_group(self, launchers: list) -> KeyedGroup:
        """The strategy's collective group, for :class:`KeyedCollectives`: each instance key
        is taken from the strategy's own counter for *every* local device at once (the
        counters advance in step: every device runs the same collectives), so keys fixed
        at trace time never meet the ones the strategy hands out when a step is called."""
        first = launchers[0]
        counter = first._collective_keys

        def next_key() -> int:
            keys = {counter.get_instance_key(lc._group_key, lc._device) for lc in launchers}
            if len(keys) != 1:
                raise RuntimeError(f"the devices' collective instance keys differ ({sorted(keys)}):"
                                   " a collective ran on some devices only; build a new "
                                   "strategy (tapas.execution.runtime.devices.make_strategy)")
            return keys.pop()

        options = first._options
        return KeyedGroup(int(first._group_key), int(first._group_size),
                          options.implementation.value, float(options.timeout_seconds or 0),
                          next_key)

    def _replicas(self, body: Callable, args: tuple,
                  finish: Callable | None = None, handles: bool = False) -> Any:
        """``strategy.run`` of ``body(r, *tensors)`` on every replica, where ``r`` is the
        replica's :class:`_Replica` and the tensors are the replica's local values of
        ``args`` with every variable read (``handles``: as its resource handle, for a body
        that reads and assigns it); then, in the replica, ``finish(result, *args)``.

        Traced *once*: with the strategy's collective launchers the body is traced a single
        time as a function of (replica id, ordering token, tensors) with
        :class:`KeyedCollectives`, and each replica calls it on its device, so the Python
        replay, its gradients and TensorFlow's bookkeeping of the traced ops are done once,
        not once per replica (docs/internals.md, *Overhead*). The calls are not inlined:
        each device instantiates and optimises its own copy when the step first runs.
        Otherwise (see :meth:`_launchers`) the body is traced in each replica with the
        ``ReplicaContext``'s collectives."""
        launchers = self._launchers()
        read, spec = (_handles, _handle_spec) if handles else (_read, _spec)
        if launchers is None:
            def replica(*a: Any) -> Any:
                coll = self._collectives(self._tracing)
                rid = coll.replica_ids()[0] if hasattr(coll, "replica_ids") else \
                    tf.get_static_value(tf.distribute.get_replica_context()
                                        .replica_id_in_sync_group)
                static = tf.get_static_value(rid) if isinstance(rid, tf.Tensor) else rid
                r = _Replica(coll, ReplicaContextCollectives(self.num_devices), rid,
                             static is not None and int(static) == self.local_replicas[0])
                result = body(r, *read(a))
                return finish(result, *a) if finish else result
            return self.strategy.run(self._on_device(replica), args=args)

        local = self.strategy.experimental_local_results
        first = tf.nest.map_structure(
            lambda a: local(a)[0] if isinstance(a, tf.distribute.DistributedValues) else a,
            args)
        tokens = [getattr(lc, "_ordering_token", None) for lc in launchers]
        use_token = all(t is not None for t in tokens)
        group = self._keyed_group(launchers)
        if self._tracing not in self.audits:
            self.audits[self._tracing] = Audit()

        mesh = self._mesh_keys

        def sub_group(size: int, key: tf.Tensor) -> KeyedGroup:
            return dataclasses.replace(group, group_key=key, group_size=size,
                                       next_key=lambda: next(mesh["instance"]))

        def traced(ids: tf.Tensor, token: Any, *a: Any) -> Any:
            # ids: [replica id within the row, row, row group key, column group key]
            audit = self.audits[self._tracing]
            if mesh is None:
                coll = KeyedCollectives(self.num_devices, ids[0], group, token, audit=audit)
                return body(_Replica(coll, coll, ids[0], True), *a)
            coll = KeyedCollectives(self.num_devices, ids[0],
                                    sub_group(self.num_devices, ids[2]), token, audit=audit)
            dp = KeyedCollectives(self.rows, ids[1], sub_group(self.rows, ids[3]), token,
                                  audit=self.dp_audits.setdefault(self._tracing, Audit()))
            return body(_Replica(coll, coll, ids[0], True, dp), *a)

        # out of line: each replica's call instantiates its own copy of the body on its
        # device, under the runtime's Grappler options (set again below: strategy.run calls
        # the replicas in threads of its own); Grappler then optimises N copies of the body
        # one at a time instead of one graph holding all N (docs/internals.md, *Overhead*)
        fn = tf.function(traced, autograph=False,
                         experimental_attributes={"_noinline": True}).get_concrete_function(
            tf.TensorSpec([4], tf.int32), tf.TensorSpec([], tf.resource) if use_token else None,
            *tf.nest.map_structure(spec, first))

        def replica(*a: Any) -> Any:
            rid = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
            token = tokens[self.local_replicas.index(rid)].handle if use_token else None
            if mesh is None:
                ids = [rid, 0, 0, 0]
            else:
                i, j = divmod(rid, self.num_devices)
                ids = [j, i, mesh["rows"][i], mesh["cols"][j]]
            with replay.graph_optimization(self.graph_optimization, self._accelerators):
                result = fn(tf.constant(ids, tf.int32), token, *read(a))
            return finish(result, *a) if finish else result
        return self.strategy.run(self._on_device(replica), args=args)

    def _barrier(self) -> None:
        """Wait for every worker (a scalar all-reduce); nothing to wait for in one process."""
        if self._all_local():
            return
        if not hasattr(self, "_barrier_fn"):
            def fn() -> tf.Tensor:
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))
            self._barrier_fn = tf.function(lambda: self.strategy.run(fn), autograph=False)
        self._barrier_fn()


def _handles(args: Any) -> Any:
    """``args`` with every variable as its resource handle."""
    return tf.nest.map_structure(
        lambda a: a.handle if isinstance(a, tf.Variable) else a, args)


def _handle_spec(a: Any) -> Any:
    """:func:`_spec`, a variable's being its resource handle's."""
    return tf.TensorSpec([], tf.resource) if isinstance(a, tf.Variable) else _spec(a)
