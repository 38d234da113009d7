"""Timing per-replica functions under one tf.distribute strategy, as the runtime runs them.

In:  a ``tf.distribute.Strategy`` (and, across worker processes, ``sync=True``).
Out: :class:`Timer`: per-replica values, ``tf.function``-wrapped replica functions, calls
     timed to completion (warm-up, then rounds until ``repeats`` and ``MIN_POINT_SECONDS``),
     and chains of k collectives as ``ReplicaContextCollectives`` launches them
     (:func:`run_collective`). Used by ``tapas profile`` and the kernel timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tapas.execution.program.collectives import Audit, ReplicaContextCollectives
from tapas.sharding.placements import Collective

__all__ = ["Timer", "run_collective", "check_pairs", "MIN_POINT_SECONDS", "EXTRA_REPEATS"]


def check_pairs(steps: Any, repeats: Any) -> None:
    """ValueError unless ``steps`` and ``repeats`` (a calibration's timed pairs) are ints
    >= 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or \
            isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"steps={steps!r}, repeats={repeats!r}: each must be an int >= 1 "
                         "(timed pairs = steps x repeats; 10 is enough on an idle machine)")
# a point's timed rounds continue past ``repeats`` (up to EXTRA_REPEATS x) until they took
# MIN_POINT_SECONDS: the small messages, whose calls take milliseconds, get more chances
MIN_POINT_SECONDS = 0.4
EXTRA_REPEATS = 4


def run_collective(coll: ReplicaContextCollectives, kind: Collective, x: tf.Tensor,
            shape: list[int]) -> tf.Tensor:
    if kind is Collective.ALL_REDUCE:
        return coll.all_reduce([x], "profile", shape, "float32")[0]
    if kind is Collective.ALL_GATHER:
        return coll.all_gather([x], 0, "profile", shape, "float32")[0]
    if kind is Collective.REDUCE_SCATTER:
        return coll.reduce_scatter([x], 0, "profile", shape, "float32")[0]
    return coll.all_to_all([x], 0, 1, "profile", shape, "float32")[0]


class Timer:
    """Calls of per-replica functions under one strategy, timed to completion."""

    def __init__(self, strategy: tf.distribute.Strategy, sync: bool = False) -> None:
        self.strategy = strategy
        self.w = strategy.num_replicas_in_sync
        self.audit = Audit()
        # worker processes: end every compute call with a one-number all-reduce so the
        # workers' calls run at the same time (within one process the replicas of a call
        # already do); the empty call pays it too, so the difference is the compute
        self.sync = sync

    def done(self, x: tf.Tensor) -> tf.Tensor:
        """A compute call's result: ``x``, synchronised across workers when ``sync``."""
        if not self.sync:
            return x
        return tf.distribute.get_replica_context().all_reduce("sum", x)

    def step_result(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        """A training step's result: one number of every gradient, so TensorFlow prunes
        none of them from what is timed (:meth:`done` of it)."""
        return self.done(tf.stack([tf.reshape(g, [-1])[0] for g in grads]))

    def values(self, shape: Sequence[int]) -> Any:
        """Per-replica float32 tensors of ``shape``, replica r filled with r + 1."""
        def make(ctx):
            return tf.fill(list(shape), tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
        return self.strategy.experimental_distribute_values_from_function(make)

    def function(self, replica_fn: Callable[..., Any]) -> Callable[..., Any]:
        strategy = self.strategy
        return tf.function(lambda *args: strategy.run(replica_fn, args=args))

    def call(self, fn: Callable[..., Any], *args: Any) -> float:
        start = time.perf_counter()
        out = fn(*args)
        for t in tf.nest.flatten(self.strategy.experimental_local_results(out)):
            t.numpy()
        return time.perf_counter() - start

    def timed(self, fns: Sequence[Callable[..., Any]], args: Sequence[Any],
              repeats: int) -> list[list[float]]:
        """Each of ``fns`` called once to warm up, then in turn ``repeats`` times, and more
        (up to ``EXTRA_REPEATS`` x) while the rounds took under ``MIN_POINT_SECONDS``: cheap
        points get more chances at an undisturbed call. The times per function."""
        for fn in fns:
            self.call(fn, *args)
        times: list[list[float]] = [[] for _ in fns]
        start = time.perf_counter()
        rounds = 0
        # worker processes run exactly ``repeats`` rounds: a count that depends on each
        # worker's own clock would leave one worker calling a collective the others have
        # moved past (mismatched collective instances)
        extend = not self.sync
        while rounds < repeats or (extend and rounds < EXTRA_REPEATS * repeats and
                                   time.perf_counter() - start < MIN_POINT_SECONDS):
            for i, fn in enumerate(fns):
                times[i].append(self.call(fn, *args))
            rounds += 1
        return times

    def chain(self, kind: Collective, k: int, shape: list[int]) -> Callable[..., Any]:
        def replica_fn(x):
            coll = ReplicaContextCollectives(self.w, self.audit)
            prev = None
            for _ in range(k):
                with tf.control_dependencies([] if prev is None else [prev]):
                    out = run_collective(coll, kind, tf.identity(x), shape)
                prev = out
            return tf.reshape(prev, [-1])[:1]
        return self.function(replica_fn)
