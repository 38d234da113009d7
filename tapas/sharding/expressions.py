"""SRC (Split-Replica-Communication) expressions: a sharding pattern written as a formula.

Pure Python, no TensorFlow (paper section 4.4, docs/sharding.md).

In:  placements (:mod:`tapas.sharding.placements`) and op names.
Out: expression trees -- :class:`Leaf` (a placed tensor, ``S1(X)``), :class:`Apply` (an
     operation, ``MatMul(...)``) and :class:`Coll` (a collective, ``C_AR(...)``) -- that print
     as ``C_AR(MatMul(S1(X), S0(W)))`` and are read back by :func:`parse`.

Example::

    >>> e = parse("C_AR(MatMul(S1(X), S0(W)))")
    >>> e.arg.args[1]
    Leaf(placement=Split(axis=0), name='W')
    >>> str(e)
    'C_AR(MatMul(S1(X), S0(W)))'
"""

from __future__ import annotations

import dataclasses
import re

from tapas.sharding.placements import Collective, Placement, is_placement_text, parse_placement

__all__ = ["Leaf", "Apply", "Coll", "Expr", "parse"]


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


Expr = Leaf | Apply | Coll

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
    if is_placement_text(head):
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
