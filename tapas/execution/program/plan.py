"""The sharding plan a program is rebuilt from, and how its weights are stored.

In:  the ShardingPattern of each GraphNode on N devices: from a ``tapas.planning.search``
     Strategy (:meth:`Plan.from_strategy`, the one place a Strategy becomes a Plan), chosen
     by a generator (``tapas.execution.api.parallel.random_plan``, ...), or hand-written
     as :class:`NodeSharding`.
Out: :class:`Plan`, the one plan type the program, the runtime and the checks consume (a
     pattern per GraphNode, nodes left out replicated; the Strategy it came from, if any,
     for what only a search knows: cost, memory estimate, resharded edges, summary),
     :class:`WeightLayout` (one weight's global shape, placement and local shape) and
     :class:`ReconstructError`, raised when a plan cannot be rebuilt as a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tapas import ir
from tapas.sharding import placements
from tapas.sharding.patterns.pattern import REPLICATE
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
    Placements may be written in their short forms (``"S1"``): they are parsed here, once.
    """

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    weights: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    tensors: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    comms: tuple[placements.Comm, ...] = ()
    rewrites: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        parse = placements.parse_placement
        for field in ("inputs", "outputs"):
            object.__setattr__(self, field, tuple(parse(p) for p in getattr(self, field)))
        for field in ("weights", "tensors"):
            object.__setattr__(self, field,
                               {k: parse(p) for k, p in getattr(self, field).items()})


def replicated(node: ir.GraphNode) -> NodeSharding:
    """The all-``R`` sharding of ``node``: every device computes the whole node."""
    r = Replica()
    return NodeSharding(REPLICATE, tuple(r for _ in node.inputs),
                        tuple(r for _ in node.outputs), {w.path: r for w in node.weights})


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sharding of every GraphNode on ``num_devices`` devices.

    ``patterns`` maps a GraphNode id to its ShardingPattern (or :class:`NodeSharding`);
    nodes left out are replicated. ``graph_digest`` (``tapas.planning.strategy.graph_digest``
    of the graph the patterns were chosen on, when known) lets :meth:`check_graph` say
    plainly that a plan is applied to another graph. ``strategy`` is the
    ``tapas.planning.strategy.Strategy`` the plan was made from (:meth:`from_strategy`),
    bound to the plan's graph, or None for a plan chosen otherwise.
    """

    num_devices: int
    patterns: Mapping[int, Any]
    graph_digest: str | None = dataclasses.field(default=None, kw_only=True)
    strategy: Any = dataclasses.field(default=None, kw_only=True, compare=False, repr=False)

    @staticmethod
    def replicated(graph: ir.Graph, num_devices: int = 1) -> Plan:
        return Plan(num_devices, {n.id: replicated(n) for n in graph.nodes})

    @staticmethod
    def from_strategy(strategy: Any, graph: ir.Graph) -> Plan:
        """The plan of a ``tapas.search`` Strategy on ``graph``: ``strategy.pattern(node_id)``
        per node, the strategy (bound to ``graph``) kept as :attr:`strategy`. ValueError
        (naming both graphs) when the strategy was searched for another graph."""
        strategy = strategy.bind(graph)   # checks the digest and the GraphNode count
        return Plan(int(strategy.num_devices),
                    {node.id: strategy.pattern(node.id) for node in graph.nodes},
                    graph_digest=strategy.graph_digest, strategy=strategy)

    @staticmethod
    def of(plan: Any, graph: ir.Graph) -> Plan:
        """``plan`` itself when it is a Plan, else the plan of a Strategy on ``graph``
        (:meth:`from_strategy`): what a function taking either works on."""
        return plan if isinstance(plan, Plan) else Plan.from_strategy(plan, graph)

    def pattern(self, node: ir.GraphNode) -> Any:
        p = self.patterns.get(node.id)
        return p if p is not None else replicated(node)

    def for_graph(self, graph: ir.Graph) -> Plan:
        """This plan on ``graph``: itself when it was made there; the same named patterns
        chosen again on ``graph`` when it was made on an identical graph under other names
        (the same architecture built twice in one process: Keras numbers auto-named layers,
        so weight paths and tensor names differ while the graph digest is the same);
        otherwise :meth:`check_graph`'s error."""
        try:
            self.check_graph(graph)
            return self
        except ReconstructError:
            from tapas.planning.strategy import graph_digest
            from tapas.sharding.patterns import pattern_by_name
            if self.graph_digest is None or self.graph_digest != graph_digest(graph) or \
                    not all(hasattr(p, "family") for p in self.patterns.values()):
                raise
        chosen = {node.id: pattern_by_name(node, graph, self.num_devices,
                                           self.patterns[node.id].name)
                  for node in graph.nodes if node.id in self.patterns}
        return Plan(self.num_devices, chosen, graph_digest=self.graph_digest,
                    strategy=None if self.strategy is None else self.strategy.bind(graph))

    def check_graph(self, graph: ir.Graph) -> None:
        """:class:`ReconstructError` when the plan was made for another graph: another
        digest, a GraphNode id the graph lacks, or a pattern naming weights or tensors its
        GraphNode does not have. Capturing the same model with another ``training`` flag
        (dropout GraphNodes), batch size or model instance shifts GraphNode ids and names,
        and a pattern of one GraphNode applied to another cannot be built (or, worse,
        builds something else)."""
        fix = ("make the plan from the graph that is rebuilt (tapas.capture with the same "
               "model, input specs and training flag as tapas.parallelize, which captures "
               "with training=True unless told training=False)")
        if self.graph_digest is not None:
            from tapas.planning.strategy import graph_digest
            digest = graph_digest(graph)
            if digest != self.graph_digest:
                raise ReconstructError(f"the plan was made for a graph of digest "
                                       f"{self.graph_digest}, this graph '{graph.name}' has "
                                       f"digest {digest} ({len(graph.nodes)} GraphNodes): {fix}")
        ids = {n.id for n in graph.nodes}
        stray = sorted(i for i in self.patterns if i not in ids)
        if stray:
            raise ReconstructError(f"the plan places GraphNode ids {stray[:5]}, which graph "
                                   f"'{graph.name}' (GraphNodes 0..{len(ids) - 1}) lacks: {fix}")
        for node in graph.nodes:
            pat = self.patterns.get(node.id)
            if pat is None:
                continue
            own = {t.name for op in node.ops for t in op.outputs}
            names = sorted(set(getattr(pat, "weights", {})) - {w.path for w in node.weights})
            names += sorted(set(getattr(pat, "tensors", {})) - own)
            if names:
                raise ReconstructError(
                    f"GraphNode {node.id} '{node.name}' (pattern "
                    f"'{getattr(pat, 'name', '?')}'): the pattern names {len(names)} weight(s) "
                    f"or tensor(s) the node does not have (first: '{names[0]}'), so it was "
                    f"made for another GraphNode or graph: {fix}")


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How one model weight is stored across the devices: ``placement`` over the devices
    of a mesh row; on a mesh with nested experts (``tapas.planning.experts``) an expert
    weight is first cut on ``row_axis`` into the ``rows`` mesh rows (row ``i`` holds part
    ``i``), and ``placement`` places that part (``row_shape``) in the row."""

    path: str
    global_shape: tuple[int, ...]
    dtype: str
    placement: Placement
    local_shape: tuple[int, ...]
    trainable: bool
    row_axis: int | None = None
    rows: int = 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of the part one mesh row holds (the global shape unless cut over rows)."""
        if self.row_axis is None:
            return tuple(self.global_shape)
        out = list(self.global_shape)
        out[self.row_axis] //= self.rows
        return tuple(out)
