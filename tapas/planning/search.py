"""Strategy search: the best tensor-parallel plan for a model on a cluster (paper 4.4, 4.6).

In:  a :class:`tapas.ir.Graph` (or a Keras model and its input spec, captured here with
     ``tapas.capture``), a :class:`tapas.planning.cluster.Cluster` S(m, n) whose m * n devices form the
     1-D mesh, a mode (``"gp"`` graph-pruned or ``"es"`` exhaustive) and
     :class:`tapas.planning.cost.CostOptions`.
Out: :class:`Strategy` -- the chosen ShardingPattern name per GraphNode, the resharding
     collectives on edges, the placements of the graph inputs and outputs, the cost
     breakdown (per collective kind, forward/backward, per template), the memory per device,
     the ranked top-k alternatives, the named reference plans (Megatron, FFN-only, MHA-only,
     data parallel, replicate) with their costs, the counts of the enumeration and the time
     of each phase. It saves to and loads from JSON; reconstruction asks it for
     ``pattern(node_id)`` (the full ShardingPattern) and ``edge_comms``.

Pipeline (``search``): capture (a model only) -> mine (gp) -> pattern table (generation and
costing of every GraphNode's patterns) -> enumeration (``tapas.planning.explore``) -> validation (the
exact cost and memory of the top plans; plans over the memory budget are dropped, and if none
fits the search is repeated with a memory penalty) -> reference plans.

Example (a hand-built graph; the patterns come from ``tapas.sharding.patterns``)::

    strategy = search(graph, cluster=Cluster.v100_ethernet(1, 8))
    print(strategy.summary())
    strategy.save("strategy.json")
    again = Strategy.load("strategy.json", graph)

This module imports no TensorFlow (capturing a Keras model imports it, lazily).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tapas.ir import Graph, GraphNode, Kind
from tapas.planning import explore as ex
from tapas.planning.cost import Cluster, CostOptions, Link, MemoryEstimate, PlanCost
from tapas.planning.table import PatternInfo
from tapas.sharding.patterns.base import Family
from tapas.sharding.placements import Replica

__all__ = ["search", "Strategy", "EdgeReshard", "Alternative", "MemoryBudgetError",
           "graph_digest", "REFERENCE_PLANS", "reference_filter", "node_roles"]

_FORMAT = "tapas.search.Strategy/1"   # file format id (kept across module moves)

Progress = Callable[[str, int, int], None]


class MemoryBudgetError(ValueError):
    """No plan fits the per-device memory budget."""


# =========================================================================================
# Graph identity
# =========================================================================================

def graph_digest(graph: Graph) -> str:
    """A short hash of the graph's structure: node signatures and kinds, edges with their
    shapes, input and output shapes (not names: the same model captured twice matches)."""
    parts = [[n.signature, n.kind.value, [list(t.shape or ()) for t in n.outputs]]
             for n in graph.nodes]
    parts.append([[e.src, e.dst, list(e.tensor.shape or ())] for e in graph.edges])
    parts.append([[list(t.shape or ()), t.dtype] for t in graph.inputs])
    parts.append([[list(t.shape or ()), t.dtype] for t in graph.outputs])
    blob = json.dumps(parts, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


# =========================================================================================
# Reference plans: the search constrained to pattern-name families
# =========================================================================================

_ATTENTION_KINDS = (Kind.ATTENTION_SCORE, Kind.ATTENTION_CONTEXT)
_TP_NAMES = ("column", "row", "heads")


def node_roles(graph: Graph) -> list[str]:
    """The role of every GraphNode for the reference plans: ``"attention"`` (a dense
    feeding an attention score/context, or fed by a context: Q, K, V, O),
    ``"attention-core"`` (score, context, and a softmax between them), ``"ffn"`` (a dense
    next to another dense that is not attention: the two matrices of a feed-forward
    block), whole ``tapas.layers`` attention and feed-forward GraphNodes as ``"attention"``
    and ``"ffn"``, ``"expert"`` (an MoE expert einsum) or ``"other"``."""
    preds: list[set[int]] = [set() for _ in graph.nodes]
    succs: list[set[int]] = [set() for _ in graph.nodes]
    for e in graph.edges:
        preds[e.dst].add(e.src)
        succs[e.src].add(e.dst)
    kinds = [n.kind for n in graph.nodes]
    roles = ["other"] * len(graph.nodes)
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.ATTENTION:          # a whole tapas.layers.MultiHeadAttention
            roles[v] = "attention"
        elif n.kind is Kind.FEED_FORWARD:     # a whole tapas.layers.FeedForward
            roles[v] = "ffn"
        elif n.kind in _ATTENTION_KINDS:
            roles[v] = "attention-core"
        elif n.kind is Kind.SOFTMAX and any(kinds[s] in _ATTENTION_KINDS for s in succs[v]) \
                and any(kinds[p] in _ATTENTION_KINDS for p in preds[v]):
            roles[v] = "attention-core"
        elif n.kind is Kind.EXPERT_EINSUM:
            roles[v] = "expert"
        elif n.kind is Kind.DENSE:
            if any(kinds[s] in _ATTENTION_KINDS for s in succs[v]) or \
                    any(kinds[p] is Kind.ATTENTION_CONTEXT for p in preds[v]):
                roles[v] = "attention"
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.DENSE and roles[v] == "other":
            near = preds[v] | succs[v]
            if any(kinds[u] is Kind.DENSE and roles[u] == "other" for u in near):
                roles[v] = "ffn"
    # a dense two steps from another FFN dense through an elementwise (gated FFN: wi_0 * wi_1)
    for n in graph.nodes:
        v = n.id
        if n.kind is Kind.DENSE and roles[v] == "other":
            for u in succs[v]:
                if kinds[u] is Kind.ELEMENTWISE and any(roles[w] == "ffn" for w in succs[u]):
                    roles[v] = "ffn"
    return roles


# the roles each tensor-parallel reference plan shards
_SHARDED_ROLES: Mapping[str, tuple[str, ...]] = {
    "megatron": ("attention", "attention-core", "ffn"), "ffn-only": ("ffn",),
    "mha-only": ("attention", "attention-core"), "expert": ("expert",)}
# the pattern families a sharded role may take
_ROLE_FAMILIES: Mapping[str, tuple[Family, ...]] = {
    "attention": (Family.HEADS, Family.COLUMN, Family.ROW),
    "ffn": (Family.COLUMN, Family.ROW, Family.COLUMN_ROW),
    "expert": (Family.EXPERT,),
    "attention-core": (Family.HEADS, Family.FOLLOW)}

# a plan whose every pattern is of these families splits no weight
_UNSPLIT_FAMILIES = (Family.REPLICATE, Family.BATCH, Family.FOLLOW)

# plan name -> description; the predicate is built by reference_filter
REFERENCE_PLANS: Mapping[str, str] = {
    "megatron": "Megatron-style: attention split on heads (Q/K/V column, O row), FFN "
                "column then row",
    "ffn-only": "FFN column then row, attention replicated (the paper's T5 finding)",
    "mha-only": "attention split on heads, FFN replicated",
    "expert": "MoE experts split on the expert dimension, attention and FFN replicated",
    "data-parallel": "every GraphNode split on the batch dimension (weights replicated, "
                     "gradient all-reduce)",
    "replicate": "every GraphNode replicated (no communication, no saving)",
}


def reference_filter(plan: str, graph: Graph) -> ex.Allowed:
    """``allowed(node, pattern_name)`` for the reference plan ``plan`` (REFERENCE_PLANS)."""
    if plan not in REFERENCE_PLANS:
        raise ValueError(f"reference plan {plan!r} is unknown: use one of "
                         f"{list(REFERENCE_PLANS)}")
    roles = node_roles(graph)

    def allowed(node: GraphNode, pattern: PatternInfo) -> bool:
        role = roles[node.id]
        family = pattern.family
        if plan == "replicate":
            return family is Family.REPLICATE
        if plan == "data-parallel":
            return pattern.data_parallel
        if pattern.data_parallel:
            return False
        if role in _SHARDED_ROLES[plan]:
            return family in _ROLE_FAMILIES[role]
        if role in _ROLE_FAMILIES:
            return family is Family.REPLICATE      # a role this plan leaves whole
        return True                                # the rest (embeddings, head, glue): searched
    return allowed


# =========================================================================================
# Strategy
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class EdgeReshard:
    """A resharding between two GraphNodes: input ``input_index`` of GraphNode ``dst`` reads
    ``tensor`` from GraphNode ``src`` in placement ``src_placement`` and needs
    ``dst_placement``. ``comms`` are the ``tapas.sharding.placements.Comm``s (recomputed from the graph)."""

    src: int
    dst: int
    input_index: int
    tensor: str
    src_placement: str
    dst_placement: str
    kinds: tuple[str, ...] = ()      # e.g. ("AG fwd",) for display
    comms: tuple[Any, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "input_index": self.input_index,
                "tensor": self.tensor, "from": self.src_placement, "to": self.dst_placement,
                "collectives": list(self.kinds)}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> EdgeReshard:
        return EdgeReshard(d["src"], d["dst"], d["input_index"], d["tensor"], d["from"],
                           d["to"], tuple(d.get("collectives", ())))


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A ranked alternative or a reference plan: its name, cost (seconds per step),
    memory per device, whether it fits the budget, and the GraphNodes whose pattern differs
    from the chosen strategy (``{node id: pattern name}``)."""

    name: str
    cost: float
    communication: float
    compute: float
    memory: float
    fits: bool
    changes: Mapping[int, str]
    description: str = ""
    error: str = ""           # a reference plan that could not be built: why

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "cost": self.cost, "communication": self.communication,
                "compute": self.compute, "memory": self.memory, "fits": self.fits,
                "changes": {str(k): v for k, v in self.changes.items()},
                "description": self.description, "error": self.error}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Alternative:
        return Alternative(d["name"], d["cost"], d["communication"], d["compute"], d["memory"],
                           d["fits"], {int(k): v for k, v in d["changes"].items()},
                           d.get("description", ""), d.get("error", ""))


def _cluster_json(c: Cluster) -> dict[str, Any]:
    return {"name": c.name, "num_nodes": c.num_nodes, "devices_per_node": c.devices_per_node,
            "intra": [c.intra.bandwidth, c.intra.latency, c.intra.name],
            "inter": [c.inter.bandwidth, c.inter.latency, c.inter.name],
            "device_memory": c.device_memory, "device_peak_flops": c.device_peak_flops,
            "sources": dict(c.sources)}


def _cluster_from_json(d: Mapping[str, Any]) -> Cluster:
    return Cluster(d["name"], d["num_nodes"], d["devices_per_node"], Link(*d["intra"]),
                   Link(*d["inter"]), d["device_memory"], d["device_peak_flops"],
                   d.get("sources", {}))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The result of :func:`search` (see the module docstring). ``patterns[node_id]`` is the
    name of the chosen ShardingPattern of each GraphNode."""

    graph_name: str
    graph_digest: str
    num_nodes: int
    num_devices: int
    cluster: Cluster
    mode: str
    patterns: tuple[str, ...]
    edges: tuple[EdgeReshard, ...]
    input_placements: Mapping[str, str]
    output_placements: Mapping[str, str]
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
    weight_placements: Mapping[str, str] = dataclasses.field(default_factory=dict)  # splits
    _graph: Graph | None = dataclasses.field(default=None, compare=False, repr=False)
    _table: ex.PatternTable | None = dataclasses.field(default=None, compare=False, repr=False)

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
                    "strategy only fits the model it was searched for; run tapas search on "
                    "this model")
        if num_devices is not None and num_devices != self.num_devices:
            raise ValueError(f"this strategy shards over {self.num_devices} devices "
                             f"({self.cluster.name}) but {num_devices} were given: search "
                             f"again with {num_devices} devices, or run on {self.num_devices}")

    def pattern(self, node_id: int) -> Any:
        """The full ShardingPattern chosen for GraphNode ``node_id`` (from tapas.sharding.patterns)."""
        from tapas.sharding import patterns
        graph = self._bound()
        if not 0 <= node_id < len(graph.nodes):
            raise IndexError(f"node_id={node_id}: the graph has GraphNodes 0.."
                             f"{len(graph.nodes) - 1}")
        node = graph.nodes[node_id]
        for p in patterns.patterns_for(node, graph, self.num_devices):
            if p.name == self.patterns[node_id]:
                return p
        raise ValueError(f"GraphNode {node_id} '{node.name}' has no pattern "
                         f"{self.patterns[node_id]!r} on {self.num_devices} devices any more "
                         "(tapas.sharding.patterns changed?): search again")

    @property
    def edge_comms(self) -> tuple[EdgeReshard, ...]:
        """The resharding edges with their ``tapas.sharding.placements.Comm``s (needs a bound graph)."""
        from tapas.sharding import placements
        graph = self._bound()
        out = []
        for e in self.edges:
            t = graph.nodes[e.dst].inputs[e.input_index]
            comms = tuple(placements.reshard(placements.parse_placement(e.src_placement),
                                      placements.parse_placement(e.dst_placement), t.shape or (),
                                      t.dtype, t.name))
            out.append(dataclasses.replace(e, comms=comms))
        return tuple(out)

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT, "graph_name": self.graph_name, "graph_digest": self.graph_digest,
            "num_nodes": self.num_nodes, "num_devices": self.num_devices,
            "cluster": _cluster_json(self.cluster), "mode": self.mode,
            "patterns": list(self.patterns), "edges": [e.to_json() for e in self.edges],
            "input_placements": dict(self.input_placements),
            "output_placements": dict(self.output_placements),
            "cost": dict(self.cost), "memory": self.memory.to_json(),
            "memory_budget": self.memory_budget,
            "alternatives": [a.to_json() for a in self.alternatives],
            "references": [a.to_json() for a in self.references],
            "timings": dict(self.timings), "counts": dict(self.counts),
            "templates": [[t, name, [list(i) for i in insts]] for t, name, insts in
                          self.templates],
            "exact": self.exact, "notes": list(self.notes),
            "weight_placements": dict(self.weight_placements)}

    def dumps(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @staticmethod
    def from_json(d: Mapping[str, Any], graph: Graph | None = None,
                  num_devices: int | None = None) -> Strategy:
        if d.get("format") != _FORMAT:
            raise ValueError(f"not a TAPAS strategy: 'format' is {d.get('format')!r}, "
                             f"expected {_FORMAT!r} (write one with Strategy.save)")
        s = Strategy(
            graph_name=d["graph_name"], graph_digest=d["graph_digest"],
            num_nodes=d["num_nodes"], num_devices=d["num_devices"],
            cluster=_cluster_from_json(d["cluster"]), mode=d["mode"],
            patterns=tuple(d["patterns"]),
            edges=tuple(EdgeReshard.from_json(e) for e in d["edges"]),
            input_placements=dict(d["input_placements"]),
            output_placements=dict(d["output_placements"]), cost=dict(d["cost"]),
            memory=MemoryEstimate.from_json(d["memory"]), memory_budget=d["memory_budget"],
            alternatives=tuple(Alternative.from_json(a) for a in d["alternatives"]),
            references=tuple(Alternative.from_json(a) for a in d["references"]),
            timings=dict(d["timings"]), counts=dict(d["counts"]),
            templates=tuple((t, name, tuple(tuple(i) for i in insts))
                            for t, name, insts in d.get("templates", ())),
            exact=d.get("exact", True), notes=tuple(d.get("notes", ())),
            weight_placements=dict(d.get("weight_placements", {})))
        s.check(graph, num_devices)
        return s if graph is None else dataclasses.replace(s, _graph=graph)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    @staticmethod
    def load(path: str, graph: Graph | None = None, num_devices: int | None = None) -> Strategy:
        """Read a strategy; with ``graph`` / ``num_devices`` check that it is theirs."""
        with open(path) as f:
            d = json.load(f)
        try:
            return Strategy.from_json(d, graph, num_devices)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    # ---- reports -------------------------------------------------------------------------
    def summary(self, graph: Graph | None = None, table: ex.PatternTable | None = None,
                max_rows: int = 60) -> str:
        """A readable report: cost, memory, per-layer table, alternatives, references."""
        c = self.cost
        gib = 2.0 ** 30
        lines = [f"strategy for '{self.graph_name}' on {self.cluster.name} "
                 f"({self.num_devices} devices), mode {self.mode}"
                 f"{'' if self.exact else ' (beam-limited)'}",
                 f"cost      {_t(c['total'])} per step = communication "
                 f"{_t(c['communication'])} (forward {_t(c['forward'])}, "
                 f"backward {_t(c['backward'])}) + compute {_t(c['compute'])}",
                 "by kind   " + (", ".join(f"{k} {_t(v)}"
                                           for k, v in c["by_kind"].items()) or "none"),
                 f"memory    {self.memory} (budget {self.memory_budget / gib:.2f} GiB)"]
        per_t = c.get("per_template", {})
        if per_t:
            lines.append("per unit  " + ", ".join(f"{k} {_t(v)}"
                                                  for k, v in per_t.items()))
        graph = graph or self._graph
        if graph is not None:
            lines += ["", _layer_table(self, graph, table or self._table, max_rows)]
        if self.alternatives:
            lines += ["", "ranked alternatives (whole plan):",
                      f"  {'rank':<5}{'cost':>12}{'comm':>12}{'compute':>12}{'mem GiB':>9}  fits  "
                      "differs from #1"]
            for i, a in enumerate(self.alternatives):
                diff = ", ".join(f"{k}:{v}" for k, v in list(a.changes.items())[:4])
                more = len(a.changes) - 4
                lines.append(f"  {i + 1:<5}{_t(a.cost):>12}{_t(a.communication):>12}"
                             f"{_t(a.compute):>12}"
                             f"{a.memory / gib:>9.3f}  {'yes' if a.fits else 'NO ':<4}  "
                             f"{diff or '(chosen)'}{f' +{more} more' if more > 0 else ''}")
        if self.references:
            lines += ["", "reference plans:",
                      f"  {'plan':<15}{'cost':>12}{'comm':>12}{'compute':>12}{'mem GiB':>9}  fits  "
                      f"{'vs chosen':>9}"]
            for a in self.references:
                if a.error:
                    lines.append(f"  {a.name:<15}  (not available: {a.error})")
                    continue
                ratio = a.cost / self.total_cost if self.total_cost > 0 else float("nan")
                lines.append(f"  {a.name:<15}{_t(a.cost):>12}{_t(a.communication):>12}"
                             f"{_t(a.compute):>12}"
                             f"{a.memory / gib:>9.3f}  {'yes' if a.fits else 'NO ':<4}  "
                             f"{ratio:>8.3f}x")
        if self.timings:
            lines += ["", "phase timings: " + ", ".join(f"{k} {v:.3f} s"
                                                        for k, v in self.timings.items())]
        cnt = self.counts
        if cnt:
            lines.append(f"counts: {cnt.get('generated', 0):,} candidates generated, "
                         f"{cnt.get('pruned_early', 0):,} pruned early (invalid), "
                         f"{cnt.get('resharded', 0):,} valid with a resharding, "
                         f"{cnt.get('costed', 0):,} costed, {cnt.get('dominated', 0):,} "
                         f"dominated, {cnt.get('valid', 0):,} valid at the end; "
                         f"{cnt.get('units', 0)} units searched "
                         f"({cnt.get('templates', 0)} templates)")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _t(seconds: float) -> str:
    """Seconds in a readable unit (us, ms or s)."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) >= 1.0:
        return f"{seconds:.3f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"


def _layer_table(s: Strategy, graph: Graph, table: ex.PatternTable | None, max_rows: int) -> str:
    """Per-layer table: which weights split on which axis, which collectives."""
    tpl_of: dict[int, tuple[int, int, int]] = {}
    for t, _, insts in s.templates:
        for j, inst in enumerate(insts):
            for v in inst:
                tpl_of[v] = (t, j, len(insts))
    incoming: dict[int, list[EdgeReshard]] = {}
    for e in s.edges:
        incoming.setdefault(e.dst, []).append(e)
    lines = [f"  {'id':>5}  {'unit':<8}{'kind':<18}{'pattern':<14}{'weights split':<28}"
             "collectives"]
    shown = 0
    hidden = 0
    for node in graph.nodes:
        w = tpl_of.get(node.id)
        if w is not None and w[1] > 0:
            continue
        info = None if table is None else next(
            (p for p in table.infos[node.id] if p.name == s.patterns[node.id]), None)
        splits = [f"{'/'.join(w.path.split('/')[-2:])}:{s.weight_placements[w.path]}"
                  for w in node.weights if w.path in s.weight_placements]
        colls = []
        if info is not None:
            colls = [f"{t.kind.value} {'bwd' if t.backward else 'fwd'}" for t in info.comm_terms]
        colls += [f"{k} (reshard {e.src_placement}->{e.dst_placement})"
                  for e in incoming.get(node.id, []) for k in e.kinds]
        trivial = (s.patterns[node.id] == "replicate" and not node.weights and not colls)
        if trivial or shown >= max_rows:
            hidden += 1
            continue
        unit = "" if w is None else f"T{w[0]} x{w[2]}"
        weights = ", ".join(splits) or ("replicated" if node.weights else "-")
        lines.append(f"  {node.id:>5}  {unit:<8}{node.kind.value:<18}{s.patterns[node.id]:<14}"
                     f"{weights[:27]:<28}{', '.join(colls) or '-'}")
        shown += 1
    if hidden:
        lines.append(f"  ({hidden} more GraphNodes: replicated without weights or "
                     "collectives, or past the row limit)")
    return "\n".join(lines)


# =========================================================================================
# search
# =========================================================================================

def search(model_or_graph: Any, input_spec: Any = None, *, cluster: Cluster | None = None,
           mode: str = "gp", top_k: int = 5, options: CostOptions | None = None,
           memory_budget: float | None = None, explore_options: ex.ExploreOptions | None = None,
           references: Sequence[str] | None = None, folded: Any = None,
           progress: Progress | None = None, patterns_fn: ex.PatternsFn | None = None,
           reshard_fn: ex.ReshardFn | None = None) -> Strategy:
    """Find the best tensor-parallel strategy of a model (or captured graph) on ``cluster``.

    ``cluster`` defaults to one node of 8 V100 (``Cluster.v100_ethernet()``); its
    ``num_devices`` is the mesh size. ``mode`` is ``"gp"`` (mine, search each unique
    subgraph once) or ``"es"`` (the whole graph). ``memory_budget`` (bytes per device)
    defaults to the cluster's device memory. ``references`` names the reference plans to
    cost (default: all of REFERENCE_PLANS that apply to the graph). ``progress(phase,
    done, total)`` is called during long phases.
    """
    timings: dict[str, float] = {}
    cluster = Cluster.v100_ethernet() if cluster is None else cluster
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r}: must be a tapas.planning.cost.Cluster, e.g. "
                        "Cluster.v100_ethernet(num_nodes=1, devices_per_node=8)")
    n = cluster.num_devices
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r}: must be an integer >= 1")
    if mode not in ex.MODES:
        raise ValueError(f"mode={mode!r}: use one of {ex.MODES} ('gp': graph-pruned on the "
                         "folded graph, 'es': exhaustive on the whole graph)")
    options = CostOptions() if options is None else options
    budget = float(cluster.device_memory if memory_budget is None else memory_budget)
    if not budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r}: must be a positive number of "
                         "bytes per device (default: the cluster's device memory)")
    xopts = explore_options or ex.ExploreOptions(top_k=top_k)
    if xopts.top_k != top_k:
        xopts = dataclasses.replace(xopts, top_k=top_k)

    graph = model_or_graph
    if not isinstance(graph, Graph):
        from tapas import capturing
        t = time.perf_counter()
        graph = capturing.capture(model_or_graph, input_spec)
        timings["capture"] = time.perf_counter() - t
    if not graph.nodes:
        raise ValueError(f"graph '{graph.name}' has no GraphNodes: nothing to search")

    if mode == "gp" and folded is None:
        from tapas import mining
        t = time.perf_counter()
        folded = mining.mine(graph)
        timings["mining"] = time.perf_counter() - t

    table = ex.pattern_table(graph, n, cluster, options, patterns_fn)
    timings["patterns"] = table.generate_seconds
    timings["costing"] = table.seconds - table.generate_seconds
    edges = ex.EdgeCoster(n, cluster, options, reshard_fn, xopts.allow_reshard)

    def run(allowed: ex.Allowed | None, xo: ex.ExploreOptions) -> ex.ExploreResult:
        return ex.explore(graph, n, cluster, mode=mode, folded=folded, cost_options=options,
                          options=xo, table=table, reshard_fn=edges.reshard_fn,
                          allowed=allowed, progress=progress)

    # enumeration; validation (exact cost + memory of the top plans); memory penalty rounds
    result = run(None, xopts)
    timings["enumeration"] = result.timings.get("enumeration", 0.0)
    if "stitching" in result.timings:
        timings["stitching"] = result.timings["stitching"]
    t = time.perf_counter()
    evaluated = [_evaluate(graph, table, p, edges) for p in result.plans]
    fitting = [e for e in evaluated if e[1].memory.total <= budget]
    penalty_rounds = 0
    if not fitting:
        best_pc = evaluated[0][1]
        scale = best_pc.total / max(best_pc.memory.total, 1.0)
        for factor in (1.0, 10.0, 100.0, 1e3, 1e4, 1e6):
            penalty_rounds += 1
            xo = dataclasses.replace(xopts, memory_penalty=max(scale, 1e-15) * factor)
            result = run(None, xo)
            evaluated = [_evaluate(graph, table, p, edges) for p in result.plans]
            fitting = [e for e in evaluated if e[1].memory.total <= budget]
            if fitting:
                break
        if not fitting:
            smallest = min(evaluated, key=lambda e: e[1].memory.total)
            per_node = ex.node_memory(graph, table, smallest[0].patterns)
            worst = max(range(len(per_node)), key=lambda v: per_node[v])
            gib = 2.0 ** 30
            raise MemoryBudgetError(
                f"no strategy fits the memory budget of {budget / gib:.3f} GiB per device on "
                f"{n} devices: the smallest found needs {smallest[1].memory.total / gib:.3f} "
                f"GiB ({smallest[1].memory}); the largest share is GraphNode {worst} "
                f"'{graph.nodes[worst].name}' ({graph.nodes[worst].kind.value}, "
                f"{per_node[worst] / gib:.3f} GiB with pattern "
                f"'{table.infos[worst][smallest[0].patterns[worst]].name}'); use more "
                "devices, a smaller batch, or a larger memory_budget")
    timings["validation"] = time.perf_counter() - t
    fitting.sort(key=lambda e: e[1].total)
    best_plan, best_pc, best_resh = fitting[0]

    # reference plans
    t = time.perf_counter()
    refs = []
    roles = node_roles(graph)
    for name in (references if references is not None else _applicable(graph, roles)):
        allowed = reference_filter(name, graph)
        try:
            r = run(allowed, dataclasses.replace(xopts, top_k=1, memory_penalty=0.0))
        except ValueError as e:
            refs.append(Alternative(name, math.inf, math.inf, math.inf, math.inf, False, {},
                                    REFERENCE_PLANS[name], str(e)))
            continue
        plan, pc, _ = _evaluate(graph, table, r.best, edges)
        if name == "data-parallel" and not any(
                table.infos[v][plan.patterns[v]].data_parallel for v in range(len(graph.nodes))):
            refs.append(Alternative(name, math.inf, math.inf, math.inf, math.inf, False, {},
                                    REFERENCE_PLANS[name],
                                    f"no GraphNode splits its batch over {n} devices (batch "
                                    "size not divisible?)"))
            continue
        refs.append(_alternative(name, graph, table, plan, pc, best_plan, budget,
                                 REFERENCE_PLANS[name]))
    timings["references"] = time.perf_counter() - t

    alts = tuple(_alternative(f"#{i + 1}", graph, table, p, pc, best_plan, budget)
                 for i, (p, pc, _) in enumerate(sorted(evaluated, key=lambda e: e[1].total)))
    resh = []
    for src, dst, j, have, want in best_resh:
        tensor = graph.nodes[dst].inputs[j]
        kinds = tuple(f"{tm.kind.value} {'bwd' if tm.backward else 'fwd'}"
                      for tm in edges.terms(tensor, have, want))
        resh.append(EdgeReshard(src, dst, j, tensor.name, str(have), str(want), kinds))
    cost_json = best_pc.to_json()
    cost_json["per_template"] = _per_unit(graph, table, best_plan.patterns, folded, best_resh,
                                          edges)
    names = tuple(table.infos[v][best_plan.patterns[v]].name for v in range(len(graph.nodes)))
    prod = {t.name: (node.id, i) for node in graph.nodes for i, t in enumerate(node.outputs)}
    ins = {}
    for tin in graph.inputs:
        p = prod.get(tin.name)
        if p is not None:
            ins[tin.name] = str(table.infos[p[0]][best_plan.patterns[p[0]]].outputs[p[1]])
    outs = {}
    for tout in graph.outputs:
        p = prod.get(tout.name)
        if p is not None:
            outs[tout.name] = str(table.infos[p[0]][best_plan.patterns[p[0]]].outputs[p[1]])
    counts = result.counts.to_json()
    counts.update(templates=len(folded.templates) if folded is not None else 0,
                  units=(folded.num_unique if folded is not None else len(graph.nodes)),
                  signatures=table.signatures, penalty_rounds=penalty_rounds,
                  per_template={f"T{r.template}": r.counts.to_json() for r in result.templates})
    notes = []
    if not any(n_.weights for n_ in graph.nodes):
        notes.append("the model has no weights to shard: only data parallelism or "
                     "replication can apply")
    elif all(table.infos[v][best_plan.patterns[v]].family in _UNSPLIT_FAMILIES
             for v in range(len(graph.nodes))):
        notes.append("no weight is split in the chosen plan: data parallelism or replication "
                     "is cheapest here")
    if penalty_rounds:
        notes.append(f"the cheapest plans did not fit {budget / 2**30:.3f} GiB per device; "
                     f"searched again with a memory penalty ({penalty_rounds} round(s))")
    wsplit: dict[str, str] = {}
    for v in range(len(graph.nodes)):
        for path, pl in table.infos[v][best_plan.patterns[v]].weights:
            if not isinstance(pl, Replica):
                wsplit[path] = str(pl)
    templates = () if folded is None else tuple(
        (t.id, t.name, tuple(tuple(i) for i in t.instances)) for t in folded.templates)
    return Strategy(
        graph_name=graph.name, graph_digest=graph_digest(graph), num_nodes=len(graph.nodes),
        num_devices=n, cluster=cluster, mode=mode, patterns=names, edges=tuple(resh),
        input_placements=ins, output_placements=outs, cost=cost_json, memory=best_pc.memory,
        memory_budget=budget, alternatives=alts, references=tuple(refs),
        timings={k: round(v, 6) for k, v in timings.items()}, counts=counts,
        templates=templates, exact=result.exact, notes=tuple(notes),
        weight_placements=wsplit, _graph=graph, _table=table)


def _applicable(graph: Graph, roles: Sequence[str]) -> list[str]:
    present = set(roles)
    names = []
    if "attention" in present and "ffn" in present:
        names += ["megatron", "ffn-only", "mha-only"]
    elif "ffn" in present:
        names += ["ffn-only"]
    elif "attention" in present:
        names += ["mha-only"]
    if "expert" in present:
        names.append("expert")
    return names + ["data-parallel", "replicate"]


def _evaluate(graph: Graph, table: ex.PatternTable, plan: ex.Plan, edges: ex.EdgeCoster
              ) -> tuple[ex.Plan, PlanCost, list[tuple[int, int, int, str, str]]]:
    pc, resh = ex.plan_cost(graph, table, plan.patterns, edges)
    return plan, pc, resh


def _alternative(name: str, graph: Graph, table: ex.PatternTable, plan: ex.Plan, pc: PlanCost,
                 best: ex.Plan, budget: float, description: str = "") -> Alternative:
    changes = {v: table.infos[v][plan.patterns[v]].name for v in range(len(graph.nodes))
               if plan.patterns[v] != best.patterns[v]}
    return Alternative(name, pc.total, pc.communication, pc.compute, pc.memory.total,
                       pc.memory.total <= budget, changes, description)


def _per_unit(graph: Graph, table: ex.PatternTable, patterns: Sequence[int], folded: Any,
              resharded: Sequence[tuple[int, int, int, str, str]], edges: ex.EdgeCoster
              ) -> dict[str, float]:
    """Seconds per step by unit: each template (all its instances) and 'uncovered'."""
    unit = ["uncovered"] * len(graph.nodes)
    if folded is not None:
        for t in folded.templates:
            for inst in t.instances:
                for v in inst:
                    unit[v] = f"T{t.id}"
    out: dict[str, float] = {}
    for v in range(len(graph.nodes)):
        info = table.infos[v][patterns[v]]
        out[unit[v]] = out.get(unit[v], 0.0) + info.comm_time + info.compute_time
    for src, dst, j, have, want in resharded:
        t = graph.nodes[dst].inputs[j]
        out[unit[dst]] = out.get(unit[dst], 0.0) + (edges.cost(t, have, want) or 0.0)
    return dict(sorted(out.items()))
