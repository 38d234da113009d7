"""The Strategy: what the search chose, and its JSON file format.

In:  the search's result (one pattern id per GraphNode, the resharded edges, the boundary
     and weight placements, the cost, memory, alternatives, reference plans, counts and
     timings), or a JSON file written by :meth:`Strategy.save` (names and placements are
     written as text there and parsed back only here: ValueError names what is unreadable).
Out: :class:`Strategy` (frozen): ``save``/``load``/``to_json``/``from_json`` (format
     ``tapas.search.Strategy/1``), ``check``/``bind`` against a graph (``graph_digest``),
     and what reconstruction reads: ``pattern(node_id)`` (the full ShardingPattern) and
     ``edge_comms`` (the resharding Comms). :class:`EdgeReshard` is one resharded edge,
     :class:`Alternative` one ranked alternative or reference plan. ``summary()`` is the
     readable report of :mod:`tapas.planning.report`.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tapas.ir import Graph
from tapas.planning import report
from tapas.planning.cluster import Cluster
from tapas.planning.cost import MemoryEstimate
from tapas.planning.table import PatternTable
from tapas.sharding.patterns import pattern_by_id
from tapas.sharding.patterns.pattern import PatternId, ShardingPattern
from tapas.sharding.placements import Comm, Placement, parse_placement, reshard

__all__ = ["Strategy", "EdgeReshard", "Alternative", "graph_digest"]

_FORMAT = "tapas.search.Strategy/1"   # file format id (kept across module moves)


def graph_digest(graph: Graph) -> str:
    """A short hash of the graph's structure: node signatures and kinds, edges with their
    shapes (in any order), input and output shapes (not names: the same model captured
    twice matches, also when a dict of inputs is given in another key order)."""
    # the JSON text of [node..., sorted edges, inputs, outputs], each node's and shape's
    # text written once (a deep stack's layers repeat them)
    texts: dict[Any, str] = {}
    shapes: dict[Any, str] = {}
    parts = []
    for n in graph.nodes:
        key = (n.signature, n.kind.value, tuple([tuple(t.shape or ()) for t in n.outputs]))
        text = texts.get(key)
        if text is None:
            text = texts[key] = json.dumps([key[0], key[1], [list(s) for s in key[2]]],
                                           separators=(",", ":"))
        parts.append(text)
    edges = []
    for src, dst, shape in sorted([(e.src, e.dst, list(e.tensor.shape or ()))
                                   for e in graph.edges]):
        text = shapes.get(tuple(shape))
        if text is None:
            text = shapes[tuple(shape)] = json.dumps(shape, separators=(",", ":"))
        edges.append(f"[{src},{dst},{text}]")
    parts.append("[" + ",".join(edges) + "]")
    parts.append(json.dumps([[list(t.shape or ()), t.dtype] for t in graph.inputs],
                            separators=(",", ":")))
    parts.append(json.dumps([[list(t.shape or ()), t.dtype] for t in graph.outputs],
                            separators=(",", ":")))
    return hashlib.sha1(("[" + ",".join(parts) + "]").encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class EdgeReshard:
    """A resharding between two GraphNodes: input ``input_index`` of GraphNode ``dst`` reads
    ``tensor`` from GraphNode ``src`` in placement ``src_placement`` and needs
    ``dst_placement`` (written in their short forms in the JSON). ``comms`` are the
    ``tapas.sharding.placements.Comm``s (recomputed from the graph)."""

    src: int
    dst: int
    input_index: int
    tensor: str
    src_placement: Placement
    dst_placement: Placement
    kinds: tuple[str, ...] = ()      # e.g. ("AG fwd",) for display
    comms: tuple[Comm, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "input_index": self.input_index,
                "tensor": self.tensor, "from": str(self.src_placement),
                "to": str(self.dst_placement),
                "collectives": list(self.kinds)}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> EdgeReshard:
        return EdgeReshard(d["src"], d["dst"], d["input_index"], d["tensor"],
                           parse_placement(d["from"]), parse_placement(d["to"]),
                           tuple(d.get("collectives", ())))


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A ranked alternative or a reference plan: its name, cost (seconds per step),
    memory per device, whether it fits the budget, and the GraphNodes whose pattern differs
    from the chosen strategy (``{node id: pattern id}``)."""

    name: str
    cost: float
    communication: float
    compute: float
    memory: float
    fits: bool
    changes: Mapping[int, PatternId]
    description: str = ""
    error: str = ""           # a reference plan that could not be built: why

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "cost": self.cost, "communication": self.communication,
                "compute": self.compute, "memory": self.memory, "fits": self.fits,
                "changes": {str(k): str(v) for k, v in self.changes.items()},
                "description": self.description, "error": self.error}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Alternative:
        return Alternative(d["name"], d["cost"], d["communication"], d["compute"], d["memory"],
                           d["fits"], {int(k): PatternId.parse(v) for k, v in d["changes"].items()},
                           d.get("description", ""), d.get("error", ""))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The result of ``tapas.search`` (:func:`tapas.planning.search.search`).
    ``patterns[node_id]`` is the id of the chosen ShardingPattern of each GraphNode; the
    boundary and weight placements are ``tapas.sharding.placements`` placements."""

    graph_name: str
    graph_digest: str
    num_nodes: int
    num_devices: int
    cluster: Cluster
    mode: str
    patterns: tuple[PatternId, ...]
    edges: tuple[EdgeReshard, ...]
    input_placements: Mapping[str, Placement]
    output_placements: Mapping[str, Placement]
    cost: Mapping[str, Any]              # PlanCost.to_json() + "per_template"
    memory: MemoryEstimate
    memory_budget: float
    alternatives: tuple[Alternative, ...]
    references: tuple[Alternative, ...]
    timings: Mapping[str, float]
    counts: Mapping[str, Any]
    templates: tuple[tuple[int, str, tuple[tuple[int, ...], ...]], ...] = ()
    exact: bool = True
    notes: tuple[str, ...] = ()
    weight_placements: Mapping[str, Placement] = dataclasses.field(default_factory=dict)  # splits
    # the Keras dtype policy the costs were priced in (tapas.planning.precision; "" in
    # files written before it was recorded)
    precision: str = ""
    # when not exact: how far above the optimum the plan may be, as a fraction of the
    # optimum's lower bound (from the cheapest prefix the beam cut); None: exact, or no
    # bound (a template's own enumeration was cut)
    bound: float | None = None
    _graph: Graph | None = dataclasses.field(default=None, compare=False, repr=False)
    _table: PatternTable | None = dataclasses.field(default=None, compare=False, repr=False)

    # ---- what reconstruction reads -------------------------------------------------------
    @property
    def total_cost(self) -> float:
        return float(self.cost["total"])

    def _bound(self) -> Graph:
        if self._graph is None:
            raise ValueError("this Strategy is not bound to a graph: load it with "
                             "Strategy.load(path, graph) or call strategy.bind(graph)")
        return self._graph

    def bind(self, graph: Graph) -> Strategy:
        """This strategy attached to ``graph`` (checked: same structure)."""
        self.check(graph)
        return dataclasses.replace(self, _graph=graph)

    def check(self, graph: Graph | None = None, num_devices: int | None = None) -> None:
        """Raise ValueError if ``graph`` or ``num_devices`` is not what this was searched for."""
        if graph is not None:
            digest = graph_digest(graph)
            if digest != self.graph_digest or len(graph.nodes) != self.num_nodes:
                raise ValueError(
                    f"this strategy was searched for graph '{self.graph_name}' (digest "
                    f"{self.graph_digest}, {self.num_nodes} GraphNodes) but the given graph is "
                    f"'{graph.name}' (digest {digest}, {len(graph.nodes)} GraphNodes): a "
                    "strategy only fits the model it was searched for, captured in the same "
                    "mode (a training-mode capture has dropout and batch-norm updates the "
                    "inference one lacks): run tapas search on this model, with --training "
                    "for a training-mode program")
        if num_devices is not None and num_devices != self.num_devices:
            raise ValueError(f"this strategy shards over {self.num_devices} devices "
                             f"({self.cluster.name}) but {num_devices} were given: search "
                             f"again with {num_devices} devices, or run on {self.num_devices}")

    def pattern(self, node_id: int) -> ShardingPattern:
        """The full ShardingPattern chosen for GraphNode ``node_id`` (tapas.sharding.patterns)."""
        graph = self._bound()
        if not 0 <= node_id < len(graph.nodes):
            raise IndexError(f"node_id={node_id}: the graph has GraphNodes 0.."
                             f"{len(graph.nodes) - 1}")
        node = graph.nodes[node_id]
        found = pattern_by_id(node, graph, self.num_devices, self.patterns[node_id])
        if found is not None:
            return found
        raise ValueError(f"GraphNode {node_id} '{node.name}' has no pattern "
                         f"{self.patterns[node_id]!r} on {self.num_devices} devices any more "
                         "(tapas.sharding.patterns changed?): search again")

    @property
    def edge_comms(self) -> tuple[EdgeReshard, ...]:
        """The resharding edges with their ``tapas.sharding.placements.Comm``s (needs a bound
        graph)."""
        graph = self._bound()
        out = []
        for e in self.edges:
            t = graph.nodes[e.dst].inputs[e.input_index]
            comms = reshard(e.src_placement, e.dst_placement, t.shape or (), t.dtype, t.name)
            out.append(dataclasses.replace(e, comms=comms))
        return tuple(out)

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return _strategy_json(self)

    def dumps(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @staticmethod
    def from_json(d: Mapping[str, Any], graph: Graph | None = None,
                  num_devices: int | None = None) -> Strategy:
        """A strategy from its JSON; with ``graph`` / ``num_devices`` checked and bound."""
        s = _strategy_from_json(d)
        s.check(graph, num_devices)
        return s if graph is None else dataclasses.replace(s, _graph=graph)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    @staticmethod
    def load(path: str, graph: Graph | None = None, num_devices: int | None = None) -> Strategy:
        """Read a strategy; with ``graph`` / ``num_devices`` check that it is theirs."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            hint = ("; 'random:SEED' is the command line's form: in Python pass "
                    "tapas.execution.api.parallel.random_plan(graph, N, SEED)"
                    if str(path).startswith("random:") else "")
            raise ValueError(f"strategy file {path}: cannot read it ({e.strerror}): give the "
                             "path of a Strategy JSON written by `tapas search --out=...`"
                             f"{hint}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            what = "is empty" if not text.strip() else (
                f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; "
                f"{len(text)} bytes: truncated?)")
            raise ValueError(f"strategy file {path} {what}: write it again with `tapas search "
                             f"--out={path}` (or Strategy.save), or pass 'random:SEED' or no "
                             "strategy to search") from None
        try:
            return Strategy.from_json(d, graph, num_devices)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def summary(self, graph: Graph | None = None, table: PatternTable | None = None,
                max_rows: int = 60) -> str:
        """A readable report: cost, memory, per-layer table, alternatives, references."""
        return report.summary(self, graph or self._graph, table or self._table, max_rows)


def _strategy_json(s: Strategy) -> dict[str, Any]:
    return {
        "format": _FORMAT, "graph_name": s.graph_name, "graph_digest": s.graph_digest,
        "num_nodes": s.num_nodes, "num_devices": s.num_devices,
        "cluster": s.cluster.to_json(), "mode": s.mode,
        "patterns": [str(p) for p in s.patterns], "edges": [e.to_json() for e in s.edges],
        "input_placements": _texts(s.input_placements),
        "output_placements": _texts(s.output_placements),
        "cost": dict(s.cost), "memory": s.memory.to_json(),
        "memory_budget": s.memory_budget,
        "alternatives": [a.to_json() for a in s.alternatives],
        "references": [a.to_json() for a in s.references],
        "timings": dict(s.timings), "counts": dict(s.counts),
        "templates": [[t, name, [list(i) for i in insts]] for t, name, insts in s.templates],
        "exact": s.exact, "notes": list(s.notes),
        "weight_placements": _texts(s.weight_placements), "precision": s.precision,
        **({} if s.bound is None else {"bound": s.bound})}


def _strategy_from_json(d: Mapping[str, Any]) -> Strategy:
    if d.get("format") != _FORMAT:
        raise ValueError(f"not a TAPAS strategy: 'format' is {d.get('format')!r}, "
                         f"expected {_FORMAT!r} (write one with Strategy.save)")
    return Strategy(
        graph_name=d["graph_name"], graph_digest=d["graph_digest"],
        num_nodes=d["num_nodes"], num_devices=d["num_devices"],
        cluster=Cluster.from_json(d["cluster"], "strategy's cluster", older_layout=True),
        mode=d["mode"],
        patterns=_pattern_ids(d["patterns"]),
        edges=tuple(EdgeReshard.from_json(e) for e in d["edges"]),
        input_placements=_placed(d["input_placements"]),
        output_placements=_placed(d["output_placements"]), cost=dict(d["cost"]),
        memory=MemoryEstimate.from_json(d["memory"]), memory_budget=d["memory_budget"],
        alternatives=tuple(Alternative.from_json(a) for a in d["alternatives"]),
        references=tuple(Alternative.from_json(a) for a in d["references"]),
        timings=dict(d["timings"]), counts=dict(d["counts"]),
        templates=tuple((t, name, tuple(tuple(i) for i in insts))
                        for t, name, insts in d.get("templates", ())),
        exact=d.get("exact", True), notes=tuple(d.get("notes", ())),
        weight_placements=_placed(d.get("weight_placements", {})),
        precision=d.get("precision", ""), bound=d.get("bound"))


def _texts(placed: Mapping[str, Placement]) -> dict[str, str]:
    return {k: str(p) for k, p in placed.items()}


def _placed(texts: Mapping[str, str]) -> dict[str, Placement]:
    return {k: parse_placement(p) for k, p in texts.items()}


def _pattern_ids(names: list[str]) -> tuple[PatternId, ...]:
    out = []
    for v, name in enumerate(names):
        try:
            out.append(PatternId.parse(name))
        except ValueError as e:
            raise ValueError(f"GraphNode {v}: {e}; search again to write a strategy of the "
                             "current pattern families") from None
    return tuple(out)
