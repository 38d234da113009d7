"""Honour the sharding pins of ``tapas.layers`` layers (``shard=``).

In:  a pinned GraphNode (``GraphNode.pin``: a pattern name or an SRC expression) and its
     valid patterns.
Out: the one pattern the pin selects, or :class:`PinError` naming the layer, why the pin
     cannot be honoured on this many devices, the patterns that would be valid, and the fix.

A pattern name selects the pattern of that name. An SRC expression selects the patterns
whose own expression agrees with it: the same collectives (kind and axes, counted), and
every leaf of the pin placed as some leaf of the pattern with the same letter (``X`` for
inputs, ``W`` for weights) is placed. ``C_AR(MatMul(S1(X), S0(W)))`` therefore selects a
dense layer's ``row`` pattern, whose expression also shows the bias add. An expression
matching several patterns is refused as ambiguous.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from tapas.sharding import expressions
from tapas.ir import GraphNode
from tapas.sharding.patterns.pattern import ShardingPattern

__all__ = ["PinError", "apply_pin"]


class PinError(ValueError):
    """A layer's ``shard=`` pin cannot be honoured; the message says why and what to do."""


def apply_pin(node: GraphNode, patterns: Sequence[ShardingPattern], num_devices: int,
              explain: Callable[[str], str]) -> list[ShardingPattern]:
    """``patterns`` restricted to what ``node.pin`` selects (all of them when unpinned)."""
    pin = node.pin
    if pin is None:
        return list(patterns)
    if "(" not in pin:
        chosen = [p for p in patterns if p.name == pin]
        if not chosen:
            raise PinError(_message(node, patterns, num_devices, explain(pin)))
        return chosen
    want = _shape_of(expressions.parse(pin))
    chosen = [p for p in patterns if _agrees(want, _shape_of(expressions.parse(p.expr)))]
    if len(chosen) == 1:
        return chosen
    if not chosen:
        exprs = "; ".join(f"{p.name}: {p.expr}" for p in patterns)
        raise PinError(_message(node, patterns, num_devices,
                                f"no valid pattern has the expression {pin!r} (valid here: "
                                f"{exprs})"))
    names = ", ".join(p.name for p in chosen)
    raise PinError(f"{_layer(node)} is pinned to the SRC expression {pin!r}, which matches "
                   f"several patterns ({names}): pin one of them by name instead")


def _layer(node: GraphNode) -> str:
    paths = sorted({w.path.rpartition("/")[0] for w in node.weights if "/" in w.path})
    what = f"layer '{paths[0]}'" if paths else "a layer"
    return f"{what} (GraphNode {node.id} '{node.name}', kind {node.kind.value})"


def _message(node: GraphNode, patterns: Sequence[ShardingPattern], num_devices: int,
             reason: str) -> str:
    valid = ", ".join(p.name for p in patterns)
    return (f"{_layer(node)} is pinned to shard={node.pin!r}, which cannot be honoured on "
            f"{num_devices} devices: {reason}. Fix: use a device count its split dimension "
            f"divides, pin one of the patterns valid here ({valid}), or pass shard=None to let "
            "tapas search")


_Shape = tuple[Counter, dict[str, set[str]]]


def _shape_of(expr: expressions.Expr) -> _Shape:
    """(collectives as (kind, axes) counts, {leaf letter: placements seen})."""
    colls: Counter = Counter()
    leaves: dict[str, set[str]] = {}
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, expressions.Leaf):
            leaves.setdefault(e.name[:1].upper(), set()).add(str(e.placement))
        elif isinstance(e, expressions.Coll):
            colls[(e.kind, e.axes)] += 1
            stack.append(e.arg)
        else:
            stack.extend(e.args)
    return colls, leaves


def _agrees(pin: _Shape, pattern: _Shape) -> bool:
    pin_colls, pin_leaves = pin
    colls, leaves = pattern
    if pin_colls != colls:
        return False
    return all(places <= leaves.get(letter, set()) for letter, places in pin_leaves.items())
