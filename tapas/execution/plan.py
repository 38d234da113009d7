"""The sharding plan a program is rebuilt from, and how its weights are stored.

In:  the ShardingPattern of each GraphNode on N devices (from a ``tapas.planning.search``
     Strategy, :meth:`Plan.from_strategy`, or hand-written as :class:`NodeSharding`).
Out: :class:`Plan` (a pattern per GraphNode; nodes left out are replicated),
     :class:`WeightLayout` (one weight's global shape, placement and local shape) and
     :class:`ReconstructError`, raised when a plan cannot be rebuilt as a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tapas import ir
from tapas.sharding import placements
from tapas.sharding.placements import Placement, Replica

__all__ = ["ReconstructError", "NodeSharding", "replicated", "Plan", "WeightLayout"]


class ReconstructError(ValueError):
    """The plan cannot be rebuilt as a program; the message names the node and the fix."""


@dataclasses.dataclass(frozen=True)
class NodeSharding:
    """A hand-written sharding of one GraphNode, with the fields of
    ``tapas.sharding.patterns.ShardingPattern`` that reconstruction reads (docs/sharding.md).

    ``tensors`` may omit op outputs whose placement follows from their local shape;
    it must name the output of every shape-carrying op (``Reshape``, ...) that is split.
    """

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    weights: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    tensors: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    comms: tuple[placements.Comm, ...] = ()
    rewrites: Mapping[str, str] = dataclasses.field(default_factory=dict)


def replicated(node: ir.GraphNode) -> NodeSharding:
    """The all-``R`` sharding of ``node``: every device computes the whole node."""
    r = Replica()
    return NodeSharding("replicate", tuple(r for _ in node.inputs),
                        tuple(r for _ in node.outputs), {w.path: r for w in node.weights})


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sharding of every GraphNode on ``num_devices`` devices.

    ``patterns`` maps a GraphNode id to its ShardingPattern (or :class:`NodeSharding`);
    nodes left out are replicated.
    """

    num_devices: int
    patterns: Mapping[int, Any]

    @staticmethod
    def replicated(graph: ir.Graph, num_devices: int = 1) -> Plan:
        return Plan(num_devices, {n.id: replicated(n) for n in graph.nodes})

    @staticmethod
    def from_strategy(strategy: Any, graph: ir.Graph) -> Plan:
        """The plan of a ``tapas.search`` Strategy: ``strategy.pattern(node_id)`` per node."""
        if hasattr(strategy, "check"):  # names both graphs when the strategy is for another
            strategy.check(graph)
        if getattr(strategy, "_graph", graph) is None and hasattr(strategy, "bind"):
            strategy = strategy.bind(graph)
        n = int(getattr(strategy, "num_devices"))
        return Plan(n, {node.id: strategy.pattern(node.id) for node in graph.nodes})

    def pattern(self, node: ir.GraphNode) -> Any:
        p = self.patterns.get(node.id)
        return p if p is not None else replicated(node)


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How one model weight is stored across the devices."""

    path: str
    global_shape: tuple[int, ...]
    dtype: str
    placement: Placement
    local_shape: tuple[int, ...]
    trainable: bool
