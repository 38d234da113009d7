"""SRC (Split-Replica-Communication): placements, resharding collectives and expressions.

The vocabulary of sharding (paper section 4.4, docs/sharding.md). Pure Python, no TensorFlow.

In:  nothing (plain values built by the pattern stage, the search or by hand).
Out: the three placements of a tensor on a 1-D mesh of N devices -- :class:`Split`
     (``S0``, ``S1``, ...), :class:`Replica` (``R``) and :class:`Partial` (``P``) --;
     :class:`Comm`, one collective on one tensor in the forward or backward pass;
     :func:`reshard`, the collectives that turn one placement into another (forward
     collective plus its backward conjugate); and SRC expression trees (:class:`Leaf`,
     :class:`Apply`, :class:`Coll`) that print as ``C_AR(MatMul(S1(X), S0(W)))`` and are
     read back by :func:`parse`.

Example::

    >>> from tapas.cost import Collective
    >>> [str(c) for c in reshard(parse_placement("P"), Replica(), (8, 64), "float32", "y:0")]
    ['fwd AR y:0 (8, 64) P->R']
    >>> e = parse("C_AR(MatMul(S1(X), S0(W)))")
    >>> e.arg.args[1]
    Leaf(placement=Split(axis=0), name='W')
    >>> str(e)
    'C_AR(MatMul(S1(X), S0(W)))'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Union

from tapas.cost import Collective, dtype_bytes

__all__ = [
    "Split", "Replica", "Partial", "Placement", "parse_placement", "Comm", "reshard",
    "Leaf", "Apply", "Coll", "Expr", "parse", "PHASES",
]

PHASES = ("fwd", "bwd")


# ---- placements ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Split:
    """Dimension ``axis`` cut into N equal contiguous shards, shard ``i`` on device ``i``."""

    axis: int

    def __post_init__(self) -> None:
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 0:
            raise ValueError(f"Split(axis={self.axis!r}): the axis must be an int >= 0 "
                             "(count dimensions from the front)")

    def __str__(self) -> str:
        return f"S{self.axis}"


@dataclasses.dataclass(frozen=True)
class Replica:
    """Every device holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Partial:
    """Every device holds a full-shape addend; the tensor is their sum."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Split, Replica, Partial]

_PLACEMENT_RE = re.compile(r"^(?:S(\d+)|R|P)$")


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
                    str(d["dtype"]), parse_placement(str(d["src"])),
                    parse_placement(str(d["dst"])), str(d["phase"]),
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
    src, dst = parse_placement(src), parse_placement(dst)
    shape = tuple(int(d) for d in shape)
    for p in (src, dst):
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


# ---- expressions -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Leaf:
    """A tensor with its placement: ``R(X)``, ``S1(W)``, ``P(Y)``."""

    placement: Placement
    name: str

    def __str__(self) -> str:
        return f"{self.placement}({self.name})"


@dataclasses.dataclass(frozen=True)
class Apply:
    """A computation (``MatMul``, ``Dense``, any op name) applied to sub-expressions."""

    op: str
    args: tuple[Expr, ...]

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.op) or _RESERVED_RE.fullmatch(self.op):
            raise ValueError(f"operation name {self.op!r} cannot appear in an SRC expression: "
                             "use letters, digits and '_./:-', and not a placement ('R', 'P', "
                             "'S<k>') or collective ('C_...') name")
        object.__setattr__(self, "args", tuple(self.args))
        if not self.args:
            raise ValueError(f"operation {self.op!r} in an SRC expression needs at least one "
                             "argument")

    def __str__(self) -> str:
        return f"{self.op}({', '.join(str(a) for a in self.args)})"


@dataclasses.dataclass(frozen=True)
class Coll:
    """A collective on a sub-expression: ``C_AR(e)``, ``C_AG1(e)``, ``C_RS0(e)``,
    ``C_A2A12(e)`` (all-to-all from axis 1 to axis 2). ``axes``: () for AR, (a,) for AG and
    RS, (a, b) for A2A."""

    kind: Collective
    axes: tuple[int, ...]
    arg: Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Collective.parse(self.kind))
        object.__setattr__(self, "axes", tuple(self.axes))
        want = {Collective.ALL_REDUCE: 0, Collective.ALL_GATHER: 1,
                Collective.REDUCE_SCATTER: 1, Collective.ALL_TO_ALL: 2}[self.kind]
        if len(self.axes) != want or any(a < 0 for a in self.axes):
            raise ValueError(f"collective C_{self.kind.value} takes {want} axes >= 0, "
                             f"got {self.axes}")

    def __str__(self) -> str:
        axes = self.axes
        if len(axes) == 2 and max(axes) >= 10:
            suffix = f"{axes[0]}_{axes[1]}"
        else:
            suffix = "".join(str(a) for a in axes)
        return f"C_{self.kind.value}{suffix}({self.arg})"


Expr = Union[Leaf, Apply, Coll]

_NAME_RE = re.compile(r"[A-Za-z0-9_./:\-]+")
_RESERVED_RE = re.compile(r"R|P|S\d+|C_.*")
_COLL_RE = re.compile(r"C_(AR|AG|RS|A2A)(\d*)(?:_(\d+))?")
_TOKEN_RE = re.compile(r"\s*(?:([A-Za-z0-9_./:\-]+)|([(),]))")


def parse(text: str) -> Expr:
    """Read an SRC expression back from what ``str()`` prints (whitespace is free)."""
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ValueError(f"SRC expression {text!r}: unexpected character {text[pos]!r} "
                             f"at position {pos}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    expr, i = _parse_expr(text, tokens, 0)
    if i != len(tokens):
        raise ValueError(f"SRC expression {text!r}: trailing input after {str(expr)!r}")
    return expr


def _expect(text: str, tokens: list[str], i: int, tok: str) -> int:
    if i >= len(tokens) or tokens[i] != tok:
        got = tokens[i] if i < len(tokens) else "the end"
        raise ValueError(f"SRC expression {text!r}: expected {tok!r}, found {got!r}")
    return i + 1


def _parse_expr(text: str, tokens: list[str], i: int) -> tuple[Expr, int]:
    if i >= len(tokens) or tokens[i] in "(),":
        got = tokens[i] if i < len(tokens) else "the end"
        raise ValueError(f"SRC expression {text!r}: expected a name, found {got!r}")
    head = tokens[i]
    i = _expect(text, tokens, i + 1, "(")
    if _PLACEMENT_RE.match(head):
        if i >= len(tokens) or tokens[i] in "(),":
            raise ValueError(f"SRC expression {text!r}: placement {head} must wrap a tensor "
                             "name, e.g. R(X)")
        name = tokens[i]
        i = _expect(text, tokens, i + 1, ")")
        return Leaf(parse_placement(head), name), i
    m = _COLL_RE.fullmatch(head)
    if m is not None:
        kind = Collective.parse(m.group(1))
        digits, second = m.group(2), m.group(3)
        if second is not None:
            axes: tuple[int, ...] = (int(digits), int(second))
        elif kind is Collective.ALL_TO_ALL and len(digits) == 2:
            axes = (int(digits[0]), int(digits[1]))
        else:
            axes = (int(digits),) if digits else ()
        arg, i = _parse_expr(text, tokens, i)
        i = _expect(text, tokens, i, ")")
        return Coll(kind, axes, arg), i
    if head.startswith("C_"):
        raise ValueError(f"SRC expression {text!r}: unknown collective {head!r}; use C_AR, "
                         "C_AG<a>, C_RS<a> or C_A2A<a><b>")
    args: list[Expr] = []
    while True:
        arg, i = _parse_expr(text, tokens, i)
        args.append(arg)
        if i < len(tokens) and tokens[i] == ",":
            i += 1
            continue
        i = _expect(text, tokens, i, ")")
        return Apply(head, tuple(args)), i
