"""Placements and collectives: how one tensor lies on a 1-D mesh of N devices.

The vocabulary of sharding (paper section 4.4, docs/sharding.md). Pure Python and NumPy,
no TensorFlow.

In:  nothing (plain values built by the pattern stage, the search or by hand).
Out: the three placements of a tensor -- :class:`Split` (``S0``, ``S1``, ...),
     :class:`Replica` (``R``) and :class:`Partial` (``P``) -- each of which knows the local
     shape and size one device holds and how to cut a global array into shards and put it
     back together; :class:`Collective`, the primitives; :class:`Comm`, one collective on
     one tensor in the forward or backward pass; and :func:`reshard`, the collectives that
     turn one placement into another (forward collective plus its backward conjugate).
     SRC expressions over these placements are in :mod:`tapas.sharding.expressions`.

Example::

    >>> [str(c) for c in reshard(parse_placement("P"), Replica(), (8, 64), "float32", "y:0")]
    ['fwd AR y:0 (8, 64) P->R']
    >>> Split(1).local_shape((8, 64), 4)
    (8, 16)
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence

import numpy as np

from tapas.ir import dtype_bytes

__all__ = ["Split", "Replica", "Partial", "Placement", "parse_placement", "is_placement_text",
           "Collective", "Comm", "reshard", "PHASES"]

PHASES = ("fwd", "bwd")


class Collective(str, enum.Enum):
    """A collective primitive; the value is its short name."""

    ALL_REDUCE = "AR"
    ALL_GATHER = "AG"
    REDUCE_SCATTER = "RS"
    ALL_TO_ALL = "A2A"

    @property
    def long_name(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: Collective | str) -> Collective:
        """``Collective`` from itself, a short name ("AR") or a long one ("all_reduce")."""
        if isinstance(value, Collective):
            return value
        if isinstance(value, str):
            key = value.strip()
            for kind in cls:
                if key.upper() == kind.value or key.lower().replace("-", "_") == kind.long_name:
                    return kind
        names = ", ".join(f"{k.value}/{k.long_name}" for k in cls)
        raise ValueError(f"collective {value!r} is unknown: use one of {names}")

    def __str__(self) -> str:
        return self.value


# ---- placements ------------------------------------------------------------------------

def _elements(shape: Sequence[int] | None) -> int:
    size = 1
    for d in shape or ():
        size *= d if d is not None and d > 0 else 1
    return size


class _Placement:
    """What every placement knows about the tensor it places (shared by the three kinds).

    ``shape`` is always the *global* shape; ``n`` the number of devices of the mesh."""

    axis: int | None = None      # the split axis; None for R and P

    def local_shape(self, shape: Sequence[int], n: int) -> tuple[int, ...]:
        """The shape one device holds (a split axis floor-divided by ``n``)."""
        out = [int(d) for d in shape]
        if self.axis is not None and self.axis < len(out):
            out[self.axis] //= n
        return tuple(out)

    def local_bytes(self, shape: Sequence[int] | None, dtype: str, n: int) -> float:
        """Bytes one device holds (unknown dimensions count as 1, unknown dtypes as 4)."""
        try:
            size = float(_elements(shape) * dtype_bytes(dtype))
        except ValueError:
            size = float(_elements(shape) * 4)
        return size / n if self.axis is not None else size

    def shard(self, value: np.ndarray, n: int, i: int) -> np.ndarray:
        """Device ``i``'s part of the global array ``value``."""
        raise NotImplementedError

    def unshard(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The global array from every device's part, in device order."""
        raise NotImplementedError


# Placements are immutable values, made once each: ``Split(1) is Split(1)``. Equality stays
# by value (an unpickled placement is a new object, equal to the interned one), so identity
# is only ever a fast path before ``==``.
_SPLITS: dict[int, Any] = {}
_SINGLETONS: dict[type, Any] = {}


def _interned(cls: type) -> Any:
    found = _SINGLETONS.get(cls)
    if found is None:
        found = _SINGLETONS[cls] = object.__new__(cls)
    return found


@dataclasses.dataclass(frozen=True)
class Split(_Placement):
    """Dimension ``axis`` cut into N equal contiguous shards, shard ``i`` on device ``i``."""

    axis: int

    def __new__(cls, axis: Any = None) -> Split:
        # one object per axis (see _interned): the search compares placements by identity
        # first, millions of times on a wide frontier
        if type(axis) is int and axis >= 0:
            found = _SPLITS.get(axis)
            if found is None:
                found = _SPLITS[axis] = super().__new__(cls)
            return found
        return super().__new__(cls)   # unpickling (no argument), or an invalid axis

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 0:
            raise ValueError(f"Split(axis={self.axis!r}): the axis must be an int >= 0 "
                             "(count dimensions from the front)")

    def __str__(self) -> str:
        return f"S{self.axis}"

    def shard(self, value: np.ndarray, n: int, i: int) -> np.ndarray:
        value = np.asarray(value)
        if self.axis >= value.ndim:
            raise ValueError(f"placement S{self.axis} needs a tensor of rank > {self.axis}, "
                             f"got shape {list(value.shape)}")
        size = value.shape[self.axis]
        if size % n:
            raise ValueError(f"cannot split dimension {self.axis} of size {size} into {n} "
                             f"equal shards (shape {list(value.shape)}, placement S{self.axis}):"
                             f" use a device count that divides {size}, or replicate it")
        step = size // n
        index = [slice(None)] * value.ndim
        index[self.axis] = slice(i * step, (i + 1) * step)
        return value[tuple(index)]

    def unshard(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(p) for p in parts], axis=self.axis)


@dataclasses.dataclass(frozen=True)
class Replica(_Placement):
    """Every device holds the whole tensor."""

    def __new__(cls) -> Replica:
        return _interned(cls)

    def __str__(self) -> str:
        return "R"

    def shard(self, value: np.ndarray, n: int, i: int) -> np.ndarray:
        return np.asarray(value)

    def unshard(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.asarray(parts[0])


@dataclasses.dataclass(frozen=True)
class Partial(_Placement):
    """Every device holds a full-shape addend; the tensor is their sum."""

    def __new__(cls) -> Partial:
        return _interned(cls)

    def __str__(self) -> str:
        return "P"

    def shard(self, value: np.ndarray, n: int, i: int) -> np.ndarray:
        raise ValueError("a global value cannot be sharded as P (partial sums): place it R or "
                         "S(axis); patterns reduce their partial sums inside the node")

    def unshard(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.sum([np.asarray(p) for p in parts], axis=0)


Placement = Split | Replica | Partial

_PLACEMENT_RE = re.compile(r"^(?:S(\d+)|R|P)$")


def is_placement_text(text: str) -> bool:
    """Whether ``text`` is a placement's short form (``"S1"``, ``"R"``, ``"P"``)."""
    return _PLACEMENT_RE.match(text) is not None


def parse_placement(text: str | Placement) -> Placement:
    """``Split``/``Replica``/``Partial`` from its short form (``"S1"``, ``"R"``, ``"P"``)."""
    if isinstance(text, (Split, Replica, Partial)):
        return text
    m = _PLACEMENT_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"placement {text!r} is not one of 'R', 'P' or 'S<axis>' "
                         "(e.g. 'S0', 'S2')")
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    return Replica() if text.strip() == "R" else Partial()


# ---- collectives -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective of kind ``kind`` on tensor ``tensor`` (global ``shape``, ``dtype``).

    ``src`` and ``dst`` may be given in their short forms ("S1"): they are parsed here.
    ``phase`` "fwd": applied to the tensor right after the op producing it, before any
    consumer reads it. ``phase`` "bwd": applied to the *gradient* of the tensor (``src`` and
    ``dst`` are then the placements of the gradient). ``axis`` is the split axis of an
    all-gather or reduce-scatter and the source axis of an all-to-all.
    """

    kind: Collective
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    src: Placement
    dst: Placement
    phase: str
    axis: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Comm phase {self.phase!r} for '{self.tensor}': use 'fwd' or 'bwd'")
        object.__setattr__(self, "kind", Collective.parse(self.kind))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "src", parse_placement(self.src))
        object.__setattr__(self, "dst", parse_placement(self.dst))

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        """Size of the global tensor in bytes."""
        return self.num_elements * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.phase} {self.kind.value} {self.tensor} {self.shape} {self.src}->{self.dst}"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind.value, "tensor": self.tensor, "shape": list(self.shape),
                "dtype": self.dtype, "src": str(self.src), "dst": str(self.dst),
                "phase": self.phase, "axis": self.axis}

    @staticmethod
    def from_json(d: dict[str, object]) -> Comm:
        return Comm(Collective.parse(str(d["kind"])), str(d["tensor"]),
                    tuple(d["shape"]),  # type: ignore[arg-type]
                    str(d["dtype"]), str(d["src"]), str(d["dst"]), str(d["phase"]),
                    None if d.get("axis") is None else int(d["axis"]))  # type: ignore[arg-type]


def reshard(src: Placement, dst: Placement, shape: Sequence[int], dtype: str,
            tensor: str) -> tuple[Comm, ...]:
    """The collectives that turn ``tensor`` placed as ``src`` into ``dst``: the forward one
    (if any) and its backward conjugate on the gradient (if any), in that order.

    ====================  ==================  =====================
    from -> to            forward             backward (gradient)
    ====================  ==================  =====================
    P -> R                AllReduce           identity
    S(a) -> R             AllGather(a)        slice (free)
    P -> S(a)             ReduceScatter(a)    AllGather(a)
    S(a) -> S(b)          AllToAll(a -> b)    AllToAll(b -> a)
    R -> S(a)             slice (free)        AllGather(a)
    equal placements      nothing             nothing
    ====================  ==================  =====================

    ``R -> R`` needs a backward all-reduce only when the consumer makes the gradient
    partial; that is the consumer's business (a pattern's own backward comm), not a
    resharding.
    """
    shape = tuple(int(d) for d in shape)
    for p in (src, dst):
        if not isinstance(p, (Split, Replica, Partial)):
            raise TypeError(f"resharding '{tensor}': {p!r} is not a placement; pass Split(axis), "
                            "Replica() or Partial() (parse_placement reads the short forms)")
        if isinstance(p, Split) and p.axis >= len(shape):
            raise ValueError(f"placement {p} of '{tensor}' names axis {p.axis}, but the tensor "
                             f"has rank {len(shape)} (shape {shape})")
    if isinstance(dst, Partial):
        if isinstance(src, Partial):
            return ()
        raise ValueError(f"resharding '{tensor}' from {src} to P: no collective produces a "
                         "partial sum; reshard to R or S(axis) instead")
    if src == dst:
        return ()

    def comm(kind: Collective, a: Placement, b: Placement, phase: str,
             axis: int | None) -> Comm:
        return Comm(kind, tensor, shape, dtype, a, b, phase, axis)

    r = Replica()
    if isinstance(src, Partial):
        if isinstance(dst, Replica):
            return (comm(Collective.ALL_REDUCE, src, dst, "fwd", None),)
        return (comm(Collective.REDUCE_SCATTER, src, dst, "fwd", dst.axis),
                comm(Collective.ALL_GATHER, dst, r, "bwd", dst.axis))
    if isinstance(src, Split):
        if isinstance(dst, Replica):
            return (comm(Collective.ALL_GATHER, src, dst, "fwd", src.axis),)
        return (comm(Collective.ALL_TO_ALL, src, dst, "fwd", src.axis),
                comm(Collective.ALL_TO_ALL, dst, src, "bwd", dst.axis))
    # src is R, dst is S(a): a local slice; the gradient of the slice is gathered back
    return (comm(Collective.ALL_GATHER, dst, r, "bwd", dst.axis),)
