"""Collectives of the reconstructed program, with explicit forward and backward semantics.

In:  per-replica local tensors, as a list over the replicas *this program instance* runs:
     all N of them for :class:`SimulatedCollectives` (every shard in one process, on one
     device: tests and the pattern checker), or one, the current replica's, for
     :class:`ReplicaContextCollectives` (inside ``tf.distribute.Strategy.run``).
Out: the collective's result per local replica, differentiable with the conjugate
     gradient of docs/sharding.md, and an :class:`Audit` record of every collective run.

Gradient convention (Megatron's): every replica differentiates its own loss. The gradient
of a replicated (``R``) tensor is the full gradient on every replica, that of a split
(``S(a)``) tensor the gradient of the local slice. Hence:

=======================  =====================  ==========================
operation                forward                backward (gradient)
=======================  =====================  ==========================
``all_reduce``           AllReduce (P -> R)     identity (Megatron ``g``)
``all_reduce_grad``      identity               AllReduce (Megatron ``f``)
``all_gather(a)``        AllGather (S(a) -> R)  local slice (ReduceScatter
                                                if the gradient is partial)
``reduce_scatter(a)``    ReduceScatter (P->S)   AllGather
``all_to_all(a, b)``     AllToAll (S(a)->S(b))  AllToAll (S(b) -> S(a))
``scatter(a)``           local slice (R->S(a))  AllGather
=======================  =====================  ==========================

TensorFlow's gradients of ``ReplicaContext.all_reduce`` assume the global loss is the *sum*
of the replica losses, so every operation here has a ``tf.custom_gradient``. Under a
``ReplicaContext`` a reduce-scatter is an all-reduce and a local slice, an all-to-all an
all-gather and a local slice (``docs/internals.md``, "How it runs"); the :class:`Audit`
records the *logical* collective (kind and global bytes), what the cost model predicts.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tapas.sharding.placements import Collective
from tapas.ir import dtype_bytes

__all__ = ["CommRecord", "Audit", "Collectives", "SimulatedCollectives",
           "GroupedSimulatedCollectives",
           "ReplicaContextCollectives", "KeyedCollectives", "KeyedGroup", "local_slice"]

Tensors = list  # list[tf.Tensor], one per local replica


@dataclasses.dataclass(frozen=True)
class CommRecord:
    """One collective the program ran: ``bytes`` is the size of the *global* tensor."""

    kind: Collective
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    phase: str            # "fwd" or "bwd" (on the gradient of ``tensor``)
    axis: int | None = None

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        axis = "" if self.axis is None else f" axis {self.axis}"
        return f"{self.phase} {self.kind.value} {self.tensor} {self.shape}{axis}"


class Audit:
    """The collectives a reconstructed program inserted, in the order they were traced.

    Forward records appear when the program is traced, backward ones when
    ``tape.gradient`` is traced. Thread-safe (MirroredStrategy traces replicas in threads).
    """

    def __init__(self) -> None:
        self._records: list[CommRecord] = []
        self._lock = threading.Lock()

    def add(self, record: CommRecord) -> None:
        with self._lock:
            self._records.append(record)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    @property
    def records(self) -> tuple[CommRecord, ...]:
        with self._lock:
            return tuple(self._records)

    def counts(self) -> dict[tuple[str, str], int]:
        """``{(kind, phase): count}``, e.g. ``{("AR", "fwd"): 4}``."""
        return dict(Counter((r.kind.value, r.phase) for r in self.records))

    def bytes(self) -> dict[tuple[str, str], int]:
        """``{(kind, phase): total global bytes}``."""
        out: Counter = Counter()
        for r in self.records:
            out[(r.kind.value, r.phase)] += r.bytes
        return dict(out)

    def table(self) -> str:
        """A readable table: one line per (kind, phase) with count and bytes."""
        counts, sizes = self.counts(), self.bytes()
        lines = [f"{'collective':<10} {'phase':<5} {'count':>6} {'bytes':>14}"]
        for key in sorted(counts):
            lines.append(f"{key[0]:<10} {key[1]:<5} {counts[key]:>6} {sizes[key]:>14,}")
        return "\n".join(lines)


def local_slice(x: tf.Tensor, axis: int, num_shards: int, index: int | tf.Tensor) -> tf.Tensor:
    """Shard ``index`` of ``x`` cut into ``num_shards`` equal pieces along ``axis``."""
    size = x.shape[axis]
    if size is None or size % num_shards:
        raise ValueError(f"cannot cut dimension {axis} of size {size} (shape {x.shape}) into "
                         f"{num_shards} equal shards: the size must be a multiple of the "
                         "device count")
    piece = size // num_shards
    static = tf.get_static_value(index) if isinstance(index, tf.Tensor) else index
    if static is not None:
        begin = [0] * x.shape.rank
        begin[axis] = int(static) * piece
    else:
        begin = tf.one_hot(axis, x.shape.rank, dtype=tf.int32) * tf.cast(index, tf.int32) * piece
    # static sizes where known: with a begin that is a tensor (the replica id of a body
    # traced once) a -1 would leave the result's shape unknown
    sizes = [-1 if d is None else d for d in x.shape.as_list()]
    sizes[axis] = piece
    return tf.slice(x, begin, sizes)


def _like(grad: tf.Tensor, value: tf.Tensor) -> tf.Tensor:
    """``grad`` dense (an embedding lookup's gradient arrives as ``IndexedSlices``, which
    collectives do not take) and with the static shape of ``value`` (collectives'
    gradients lose it)."""
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    if value.shape.is_fully_defined() and not grad.shape.is_fully_defined():
        return tf.ensure_shape(grad, value.shape)
    return grad


class Collectives:
    """Collectives over the N devices of a strategy, on lists of local-replica tensors.

    Subclasses supply three differentiation-free primitives (sum, gather, all-to-all) and
    the replica indices; this class wraps them in custom gradients and records them.
    """

    def __init__(self, num_devices: int, audit: Audit | None = None) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices={num_devices}: a collective group needs at least "
                             "one device")
        self.num_devices = num_devices
        self.audit = audit if audit is not None else Audit()

    # ---- to implement ----------------------------------------------------------------
    def replica_ids(self) -> list[int | tf.Tensor]:
        """The global replica index of each local replica, in list order."""
        raise NotImplementedError

    def _sum(self, xs: Tensors) -> Tensors:
        raise NotImplementedError

    def _gather(self, xs: Tensors, axis: int) -> Tensors:
        raise NotImplementedError

    def _all_to_all(self, xs: Tensors, split_axis: int, concat_axis: int) -> Tensors:
        raise NotImplementedError

    def _records(self) -> bool:
        """Whether this instance writes to the audit (one replica per program trace)."""
        return True

    def _reduce_scatter(self, xs: Tensors, axis: int) -> Tensors:
        # all-to-all of the [N, ...] stack of pieces, then a local sum over the sources
        n = self.num_devices
        stacked = [tf.stack(tf.split(x, n, axis=axis), axis=0) for x in xs]
        received = self._all_to_all(stacked, 0, 0)
        return [tf.reduce_sum(r, axis=0) for r in received]

    # ---- semantic operations ---------------------------------------------------------
    def _local_slices(self, xs: Tensors, axis: int) -> Tensors:
        return [local_slice(x, axis, self.num_devices, i)
                for x, i in zip(xs, self.replica_ids())]

    def _record(self, kind: Collective, name: str, shape: Sequence[int], dtype: str,
                phase: str, axis: int | None) -> None:
        if self._records():
            self.audit.add(CommRecord(kind, name, tuple(int(d) for d in shape), dtype,
                                      phase, axis))

    def _custom(self, xs: Tensors, fwd: Callable[[Tensors], Tensors],
                bwd: Callable[[Tensors], Tensors]) -> Tensors:
        @tf.custom_gradient
        def op(*args):
            ys = fwd(list(args))

            def grad(*dys):
                dys = [tf.zeros_like(y) if d is None else _like(d, y) for d, y in zip(dys, ys)]
                return bwd(dys)
            return ys, grad
        return list(op(*xs))

    def all_reduce(self, xs: Tensors, name: str, shape: Sequence[int], dtype: str) -> Tensors:
        """P -> R: forward all-reduce, backward identity."""
        self._record(Collective.ALL_REDUCE, name, shape, dtype, "fwd", None)
        return self._custom(xs, self._sum, lambda dys: dys)

    def all_reduce_grad(self, xs: Tensors, name: str, shape: Sequence[int],
                        dtype: str) -> Tensors:
        """Forward identity, backward all-reduce of the (partial) gradient."""
        def bwd(dys):
            self._record(Collective.ALL_REDUCE, name, shape, dtype, "bwd", None)
            return self._sum(dys)
        return self._custom(xs, lambda ys: [tf.identity(y) for y in ys], bwd)

    def all_gather(self, xs: Tensors, axis: int, name: str, shape: Sequence[int],
                   dtype: str, partial_grad: bool = False) -> Tensors:
        """S(axis) -> R: forward all-gather, backward local slice of the (full) gradient;
        with ``partial_grad`` (the consumers make the gradient a partial sum) backward
        reduce-scatter instead."""
        self._record(Collective.ALL_GATHER, name, shape, dtype, "fwd", axis)
        if not partial_grad:
            return self._custom(xs, lambda ys: self._gather(ys, axis),
                                lambda dys: self._local_slices(dys, axis))

        def bwd(dys):
            self._record(Collective.REDUCE_SCATTER, name, shape, dtype, "bwd", axis)
            return self._reduce_scatter(dys, axis)
        return self._custom(xs, lambda ys: self._gather(ys, axis), bwd)

    def reduce_scatter(self, xs: Tensors, axis: int, name: str, shape: Sequence[int],
                       dtype: str) -> Tensors:
        """P -> S(axis): forward reduce-scatter, backward all-gather."""
        self._record(Collective.REDUCE_SCATTER, name, shape, dtype, "fwd", axis)

        def bwd(dys):
            self._record(Collective.ALL_GATHER, name, shape, dtype, "bwd", axis)
            return self._gather(dys, axis)
        return self._custom(xs, lambda ys: self._reduce_scatter(ys, axis), bwd)

    def all_to_all(self, xs: Tensors, src_axis: int, dst_axis: int, name: str,
                   shape: Sequence[int], dtype: str) -> Tensors:
        """S(src_axis) -> S(dst_axis); the gradient goes back S(dst_axis) -> S(src_axis)."""
        self._record(Collective.ALL_TO_ALL, name, shape, dtype, "fwd", src_axis)

        def bwd(dys):
            self._record(Collective.ALL_TO_ALL, name, shape, dtype, "bwd", dst_axis)
            return self._all_to_all(dys, src_axis, dst_axis)
        return self._custom(xs, lambda ys: self._all_to_all(ys, dst_axis, src_axis), bwd)

    def scatter(self, xs: Tensors, axis: int, name: str, shape: Sequence[int],
                dtype: str) -> Tensors:
        """R -> S(axis): forward local slice (free), backward all-gather of the gradient."""
        def bwd(dys):
            self._record(Collective.ALL_GATHER, name, shape, dtype, "bwd", axis)
            return self._gather(dys, axis)
        return self._custom(xs, lambda ys: self._local_slices(ys, axis), bwd)


class SimulatedCollectives(Collectives):
    """All N replicas in one program, on the current device: AR is a sum, AG a concat."""

    def replica_ids(self) -> list[int]:
        return list(range(self.num_devices))

    def _check(self, xs: Tensors) -> None:
        if len(xs) != self.num_devices:
            raise ValueError(f"SimulatedCollectives over {self.num_devices} devices got "
                             f"{len(xs)} tensors: pass one per replica")

    def _sum(self, xs: Tensors) -> Tensors:
        self._check(xs)
        total = tf.add_n(xs)
        return [total] * self.num_devices

    def _gather(self, xs: Tensors, axis: int) -> Tensors:
        self._check(xs)
        full = tf.concat(xs, axis=axis)
        return [full] * self.num_devices

    def _all_to_all(self, xs: Tensors, split_axis: int, concat_axis: int) -> Tensors:
        self._check(xs)
        n = self.num_devices
        pieces = [tf.split(x, n, axis=split_axis) for x in xs]
        return [tf.concat([pieces[i][j] for i in range(n)], axis=concat_axis)
                for j in range(n)]


class GroupedSimulatedCollectives(Collectives):
    """Every replica of a 2-D mesh in one program, collectives within groups of them: the
    local list holds all replicas, ``groups`` lists the positions of each group (a mesh
    row, or a mesh column), and each collective runs as :class:`SimulatedCollectives`
    inside every group. ``num_devices`` is the group size; a replica's id is its index in
    its group. For the 2-D pattern checker (``tapas.execution.checking.nested.compare_nested``)."""

    def __init__(self, groups: Sequence[Sequence[int]], audit: Audit | None = None) -> None:
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"groups of sizes {sorted(sizes)}: every group needs as many "
                             "replicas")
        super().__init__(sizes.pop(), audit)
        self.groups = [list(g) for g in groups]
        self._size = sum(len(g) for g in self.groups)
        self._ids = [0] * self._size
        for g in self.groups:
            for k, pos in enumerate(g):
                self._ids[pos] = k
        self._inner = SimulatedCollectives(self.num_devices)

    def replica_ids(self) -> list[int]:
        return list(self._ids)

    def _per_group(self, xs: Tensors, fn: Callable[[Tensors], Tensors]) -> Tensors:
        if len(xs) != self._size:
            raise ValueError(f"grouped collectives over {self._size} replicas got {len(xs)} "
                             "tensors: pass one per replica")
        out: list[Any] = [None] * self._size
        for g in self.groups:
            for pos, y in zip(g, fn([xs[pos] for pos in g])):
                out[pos] = y
        return out

    def _sum(self, xs: Tensors) -> Tensors:
        return self._per_group(xs, self._inner._sum)

    def _gather(self, xs: Tensors, axis: int) -> Tensors:
        return self._per_group(xs, lambda ys: self._inner._gather(ys, axis))

    def _all_to_all(self, xs: Tensors, split_axis: int, concat_axis: int) -> Tensors:
        return self._per_group(xs, lambda ys: self._inner._all_to_all(ys, split_axis,
                                                                      concat_axis))


# dtypes TF's collective kernels take (CollectiveReduceV2 / CollectiveGatherV2)
_COLLECTIVE_DTYPES = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})


def _in_collective_dtype(x: tf.Tensor, collective: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """``collective(x)`` for any dtype: the kernels take only float16/32/64 and int32/64, so
    a boolean (an attention mask), a small integer or a bfloat16 tensor travels as int32 or
    float32 and is cast back (exact: every value of those dtypes is representable), and a
    complex one as its real and imaginary parts. ``collective`` must act on the leading
    axes only (a sum, or a gather or exchange along an axis of ``x``)."""
    if x.dtype in _COLLECTIVE_DTYPES:
        return collective(x)
    if x.dtype.is_complex:   # real and imaginary parts side by side on a new last axis
        # (Model Garden's FNet: its Fourier mixing's complex activations)
        parts = collective(tf.stack([tf.math.real(x), tf.math.imag(x)], axis=-1))
        return tf.complex(parts[..., 0], parts[..., 1])
    carrier = tf.float32 if x.dtype.is_floating else tf.int32
    return tf.cast(collective(tf.cast(x, carrier)), x.dtype)


def _empty(x: tf.Tensor) -> bool:
    """Whether ``x`` statically has no elements (a dimension of size 0: a zero-length slice
    of a sequence, as keras-hub Qwen3.5's chunked linear attention concatenates). No
    collective is launched for it: TensorFlow 2.21's CPU all-gather of an empty tensor
    crashes the process (a segmentation fault, `docs/running.md`), and the result is
    known from the shapes alone. Shapes are static and equal on every replica, so every
    replica skips the same collectives."""
    return x.shape.is_fully_defined() and x.shape.num_elements() == 0


class _OneReplica(Collectives):
    """The collectives of one replica (a list of one local tensor): all-to-all and
    reduce-scatter from the sum and gather primitives of a subclass (module docstring), and
    :meth:`sum_value` / :meth:`gather_value` for values nothing differentiates."""

    def _all_to_all(self, xs: Tensors, split_axis: int, concat_axis: int) -> Tensors:
        (rid,) = self.replica_ids()
        out = []
        for x in xs:
            (everyone,) = self._gather([tf.expand_dims(x, 0)], 0)  # [N, ...x]
            mine = local_slice(everyone, split_axis + 1, self.num_devices, rid)
            out.append(tf.concat(tf.unstack(mine, axis=0), axis=concat_axis))
        return out

    def _reduce_scatter(self, xs: Tensors, axis: int) -> Tensors:
        (rid,) = self.replica_ids()
        return [local_slice(s, axis, self.num_devices, rid) for s in self._sum(xs)]

    def sum_value(self, x: tf.Tensor) -> tf.Tensor:
        """All-reduce (sum) of ``x``, with no gradient and no audit record."""
        return self._sum([x])[0]

    def gather_value(self, x: tf.Tensor, axis: int) -> tf.Tensor:
        """All-gather of ``x`` along ``axis``, with no gradient and no audit record."""
        return self._gather([x], axis)[0]


class ReplicaContextCollectives(_OneReplica):
    """One replica of a ``tf.distribute`` strategy: collectives through the current
    ``ReplicaContext`` (``all_reduce``, ``all_gather``); call inside ``Strategy.run``.

    Only replica 0 writes the audit, so one program trace gives one record per collective.
    """

    def __init__(self, num_devices: int | None = None, audit: Audit | None = None) -> None:
        ctx = tf.distribute.get_replica_context()
        n = num_devices if num_devices is not None else (
            ctx.num_replicas_in_sync if ctx is not None else 1)
        super().__init__(n, audit)

    @staticmethod
    def _ctx() -> Any:
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise RuntimeError("ReplicaContextCollectives used outside a replica context: "
                               "call the program inside tf.distribute.Strategy.run")
        return ctx

    def replica_ids(self) -> list[int | tf.Tensor]:
        rid = self._ctx().replica_id_in_sync_group
        static = tf.get_static_value(rid) if isinstance(rid, tf.Tensor) else rid
        return [int(static) if static is not None else rid]

    def _records(self) -> bool:
        rid = self.replica_ids()[0]
        return isinstance(rid, int) and rid == 0

    def _launcher(self) -> Any:
        """This replica's ``CollectiveReplicaLauncher`` while a function is traced under a
        strategy that runs collective ops (MirroredStrategy, MultiWorkerMirroredStrategy),
        else None. Collectives launched on it directly, as TensorFlow itself does under XLA
        (``MirroredExtended._replica_ctx_all_reduce``), skip the ``merge_call`` that stops
        every replica thread at each collective while tracing, and ``all_gather``'s protocol
        for uneven shapes (a second all-gather of the shapes, pads and slices): shapes here
        are static and equal on every replica. Each device numbers its collectives in
        program order either way, so the two paths can be mixed."""
        if tf.executing_eagerly():
            return None
        ctx = self._ctx()
        launchers = getattr(getattr(ctx.strategy.extended, "_cross_device_ops", None),
                            "_launchers", None)
        local = getattr(ctx, "_replica_id", None)
        if not launchers or not isinstance(local, int) or not 0 <= local < len(launchers):
            return None
        return launchers[local]

    def _sum(self, xs: Tensors) -> Tensors:
        launcher = self._launcher()
        if launcher is not None:
            reduce = launcher.all_reduce
        else:
            def reduce(v):
                return self._ctx().all_reduce(tf.distribute.ReduceOp.SUM, v)
        return [x if _empty(x) else tf.ensure_shape(_in_collective_dtype(x, reduce), x.shape)
                for x in xs]

    def _gather(self, xs: Tensors, axis: int) -> Tensors:
        launcher = self._launcher()
        out = []
        for x in xs:
            shape = x.shape.as_list()
            shape[axis] = None if shape[axis] is None else shape[axis] * self.num_devices
            if _empty(x):
                out.append(tf.zeros(shape, x.dtype))
                continue
            if launcher is not None and x.shape.is_fully_defined():
                gathered = _in_collective_dtype(
                    x, lambda v: _gather_on_axis(launcher, v, axis, self.num_devices))
            else:
                gathered = _in_collective_dtype(
                    x, lambda v: self._ctx().all_gather(v, axis=axis))
            out.append(tf.ensure_shape(gathered, shape))
        return out



def _gather_on_axis(launcher: Any, x: tf.Tensor, axis: int, n: int) -> tf.Tensor:
    """All-gather of ``x`` along ``axis`` on one launcher (of a group of ``n``)."""
    return _on_axis(lambda v: launcher._all_gather(v, None), x, axis, n)


def _on_axis(gather0: Callable[[tf.Tensor], tf.Tensor], x: tf.Tensor, axis: int,
             n: int) -> tf.Tensor:
    """``gather0`` (an all-gather over ``n`` devices, which concatenates along dimension 0)
    along ``axis``.

    The devices' pieces are gathered stacked on a new leading axis ([n, *x.shape]), that
    axis is moved next to ``axis`` and the two are merged: one transpose, of the gathered
    tensor, that moves whole runs of the dimensions after ``axis``. Moving ``axis`` itself to
    the front and back instead takes two transposes that move every element on its own:
    2-4 x slower for a channel (last) axis on CPU, work that the cost model does not price
    (it prices the gather's bytes)."""
    if axis == 0:
        return gather0(x)
    moved = tf.transpose(gather0(x[None]),
                         list(range(1, axis + 1)) + [0] + list(range(axis + 1, x.shape.rank + 1)))
    if x.shape.is_fully_defined():
        merged = x.shape.as_list()
        merged[axis] *= n
    else:
        dims = tf.shape(x)
        merged = tf.concat([dims[:axis], dims[axis:axis + 1] * n, dims[axis + 1:]], 0)
    return tf.reshape(moved, merged)


@dataclasses.dataclass(frozen=True)
class KeyedGroup:
    """What a replica needs to launch raw collective ops itself: the strategy's group of N
    devices (``group_key``), the implementation (``hint``: ``"RING"``, ``"NCCL"`` or
    ``"AUTO"``), a timeout (0: none) and ``next_key()``, which hands out one instance key
    for every local device at once (``tapas.execution.runtime`` takes them from the
    strategy's own key counters, so they never collide with the strategy's collectives)."""

    group_key: int
    group_size: int
    hint: str
    timeout_s: float
    next_key: Callable[[], int]


class KeyedCollectives(_OneReplica):
    """One replica's collectives as raw ``CollectiveReduceV2`` / ``CollectiveGatherV2`` ops
    with instance keys fixed when the program is traced, so that one trace serves every
    replica: the runtime traces the replica program *once*, with the replica id and the
    device's ordering token as arguments, and calls that function on each device
    (``tapas.execution.runtime``; TensorFlow places a called function's ops on the caller's
    device). Every replica launches the same collectives with the same keys in the same
    order, as the strategy's own launchers do; the ordering token (the launcher's) keeps
    them in program order on each device.

    ``replica_id``: a scalar int32 tensor (an argument of the traced function);
    ``ordering_token``: a resource tensor or None. The one trace writes the audit."""

    def __init__(self, num_devices: int, replica_id: tf.Tensor, group: KeyedGroup,
                 ordering_token: tf.Tensor | None = None, audit: Audit | None = None) -> None:
        if group.group_size != num_devices:
            raise ValueError(f"the collective group has {group.group_size} devices, the "
                             f"program {num_devices}")
        super().__init__(num_devices, audit)
        self.replica_id, self.group, self.token = replica_id, group, ordering_token

    def replica_ids(self) -> list[int | tf.Tensor]:
        return [self.replica_id]

    def _common(self) -> dict[str, Any]:
        g = self.group
        if not hasattr(self, "_group_tensors"):
            # one constant each for the whole trace, not two per collective (the graph's
            # size is the first step's time)
            self._group_tensors = (tf.constant(g.group_size, tf.int32),
                                   tf.constant(g.group_key, tf.int32)
                                   if isinstance(g.group_key, int) else g.group_key)
        size, key = self._group_tensors
        return dict(group_size=size, group_key=key, instance_key=g.next_key(),
                    ordering_token=[] if self.token is None else [self.token],
                    communication_hint=g.hint.lower(), timeout_seconds=float(g.timeout_s))

    def _reduce(self, x: tf.Tensor) -> tf.Tensor:
        return tf.raw_ops.CollectiveReduceV2(input=x, merge_op="Add", final_op="Id",
                                             **self._common())

    def _gather0(self, x: tf.Tensor) -> tf.Tensor:
        return tf.raw_ops.CollectiveGatherV2(input=x, **self._common())

    def _sum(self, xs: Tensors) -> Tensors:
        return [x if _empty(x) else
                tf.ensure_shape(_in_collective_dtype(x, self._reduce), x.shape) for x in xs]

    def _gather(self, xs: Tensors, axis: int) -> Tensors:
        out = []
        for x in xs:
            shape = x.shape.as_list()
            if shape[axis] is None:
                raise ValueError(f"all-gather of a tensor of shape {shape} along axis {axis}: "
                                 "the collectives need static shapes")
            shape[axis] *= self.num_devices
            if _empty(x):
                out.append(tf.zeros(shape, x.dtype))
                continue
            gathered = _in_collective_dtype(
                x, lambda v: _on_axis(self._gather0, v, axis, self.num_devices))
            out.append(tf.ensure_shape(gathered, shape))
        return out


def gather_values(x: tf.Tensor, axis: int) -> tf.Tensor:
    """All-gather of ``x`` along ``axis`` inside ``Strategy.run``, with no gradient and no
    audit record: for values that nothing differentiates (outputs, gradients and weights
    gathered to be read, a loss value)."""
    return ReplicaContextCollectives().gather_value(x, axis)


def sum_values(x: tf.Tensor) -> tf.Tensor:
    """All-reduce (sum) of ``x`` inside ``Strategy.run``, with no gradient and no audit
    record (see :func:`gather_values`)."""
    return ReplicaContextCollectives().sum_value(x)
