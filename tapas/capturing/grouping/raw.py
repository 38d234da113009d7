"""What grouping reads: the plain op records of a traced graph, and name-scope helpers.

In:  nothing (definitions).
Out: :class:`RawGraph` (built by :mod:`tapas.capturing.tracing`), scope and tensor-name
     helpers, the ``tapas.layers`` scope marker.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


from tapas.ir import Kind, OpInfo, TensorInfo, WeightInfo



@dataclasses.dataclass(frozen=True)
class RawGraph:
    """Plain records of a traced graph, in topological order.

    ``weights`` maps the name of each resource placeholder that stands for a model
    variable to that variable; ``model_weights`` lists every weight the model owns (to
    report the ones the trace never reads).
    """

    ops: Sequence[OpInfo]
    control_inputs: Mapping[str, Sequence[str]]
    inputs: Sequence[str]                 # names of graph-input placeholder ops, in order
    outputs: Sequence[TensorInfo]
    weights: Mapping[str, WeightInfo]
    model_weights: Sequence[WeightInfo] = ()
    name: str = "graph"
    pins: Mapping[str, str] = dataclasses.field(default_factory=dict)  # weight path -> pin
    call_losses: int = 0     # the last outputs that are losses the model's call added


def op_name(tensor_name: str) -> str:
    return tensor_name.rpartition(":")[0] if ":" in tensor_name else tensor_name


def scope_of(name: str) -> tuple[str, ...]:
    parts = name.split("/")
    return tuple(parts[:-1])


class ScopeTrie:
    """Longest match of an op scope against the scopes of GraphNodes (for tie-breaks)."""

    def __init__(self) -> None:
        self.root: dict = {}

    def add(self, scope: tuple[str, ...]) -> None:
        node = self.root
        for part in scope:
            node = node.setdefault(part, {})

    def depth(self, scope: tuple[str, ...]) -> int:
        node, d = self.root, 0
        for part in scope:
            if part not in node:
                break
            node, d = node[part], d + 1
        return d


# The name-scope component tapas.layers puts around a layer's ops ("tapas.dense"; TF may
# append "_1" when one scope holds two calls).
MARKER = "tapas."


def tapas_marker(scope: tuple[str, ...]) -> tuple[tuple[str, ...], Kind] | None:
    """``(scope prefix through the marker, kind)`` for an op inside a tapas layer."""
    for k, part in enumerate(scope):
        if part.startswith(MARKER):
            name = part[len(MARKER):]
            base, _, suffix = name.rpartition("_")
            if base and suffix.isdigit():
                name = base
            try:
                return scope[:k + 1], Kind(name)
            except ValueError:
                return None
    return None


def common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
