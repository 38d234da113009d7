"""The results of mining: frequent subgraphs, templates, statistics and the folded graph.

In:  what the Apriori search (:mod:`tapas.mining.apriori`) and the template selection
     (:mod:`tapas.mining.selection`) found.
Out: :class:`Subgraph` (a frequent subgraph), :class:`Template` (a unique repeated
     subgraph with its instances), :class:`LevelStats` / :class:`RoundStats` /
     :class:`MiningStats`, and :class:`FoldedGraph` (templates, instances, uncovered
     GraphNodes; summary, JSON).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import networkx as nx


FORMAT = "tapas.mine.FoldedGraph/1"   # file format id (kept across module moves)



# =========================================================================================
# Public results
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Subgraph:
    """A frequent subgraph found by :func:`frequent_subgraphs` (one entry of Algorithm 1's F).

    Position ``i`` of the pattern has signature ``signatures[i]``; ``edges`` are
    ``(src_pos, dst_pos)`` pairs; ``embeddings`` lists every occurrence as a tuple of
    GraphNode ids (``embedding[i]`` fills position ``i``), overlapping ones included;
    ``support`` is the number of non-overlapping occurrences.
    """

    signatures: tuple[str, ...]
    edges: tuple[tuple[int, int], ...]
    embeddings: tuple[tuple[int, ...], ...]
    support: int

    @property
    def size(self) -> int:
        return len(self.signatures)


@dataclasses.dataclass(frozen=True)
class Template:
    """One unique subgraph and its instances.

    ``instances[j][i]`` is the id of the GraphNode that fills position ``i`` of instance
    ``j``; positions are numbered in the topological order of the first instance.
    Every instance induces the same labelled subgraph: the same signatures at the same
    positions, and the edges ``edges`` (``(src_pos, dst_pos, ports)``, ports being the
    ``(output index, input index)`` pairs of the tensors between them) and no others.
    """

    id: int
    name: str                                   # common name scope of the first instance
    signatures: tuple[str, ...]
    kinds: tuple[str, ...]
    edges: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    instances: tuple[tuple[int, ...], ...]
    support: int                                # non-overlapping occurrences in the graph
    round: int                                  # mining round that found it (1 = first)
    min_support: int                            # min_support of that round

    @property
    def size(self) -> int:
        return len(self.signatures)

    @property
    def num_instances(self) -> int:
        return len(self.instances)

    @property
    def num_covered(self) -> int:
        return self.size * self.num_instances

    def kind_counts(self) -> dict[str, int]:
        counts = Counter(self.kinds)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "size": self.size,
                "signatures": list(self.signatures), "kinds": list(self.kinds),
                "edges": [[s, d, [list(p) for p in ports]] for s, d, ports in self.edges],
                "instances": [list(i) for i in self.instances], "support": self.support,
                "round": self.round, "min_support": self.min_support}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Template:
        return Template(
            id=d["id"], name=d["name"], signatures=tuple(d["signatures"]),
            kinds=tuple(d["kinds"]),
            edges=tuple((s, t, tuple(tuple(p) for p in ports)) for s, t, ports in d["edges"]),
            instances=tuple(tuple(i) for i in d["instances"]), support=d["support"],
            round=d["round"], min_support=d["min_support"])


@dataclasses.dataclass(frozen=True)
class LevelStats:
    """One level k of Algorithm 1 in one round."""

    round: int
    level: int            # k: the size of the subgraphs of this level
    candidates: int       # candidate subgraphs counted at this level
    frequent: int         # of which frequent (kept as F_k)
    embeddings: int       # embeddings held by the frequent subgraphs
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """One mining round: Algorithm 1 on the GraphNodes earlier rounds left uncovered."""

    round: int
    min_support: int
    min_support_source: str   # "given" or "detected layers"
    nodes: int                # GraphNodes mined in this round
    frequent: int             # frequent subgraphs found (all levels)
    templates: int            # templates chosen
    covered: int              # GraphNodes those templates cover
    seconds: float
    copies_skipped: int = 0   # layers of a deep stack mined through a window only

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MiningStats:
    """What mining did, for the CLI and the benchmarks."""

    levels: tuple[LevelStats, ...]
    rounds: tuple[RoundStats, ...]
    layers_detected: int      # detect_layers() on the whole graph
    seconds: float            # total wall time of mine()

    @property
    def candidates(self) -> int:
        return sum(s.candidates for s in self.levels)

    @property
    def frequent(self) -> int:
        return sum(s.frequent for s in self.levels)

    def to_json(self) -> dict[str, Any]:
        return {"levels": [s.to_json() for s in self.levels],
                "rounds": [r.to_json() for r in self.rounds],
                "layers_detected": self.layers_detected, "seconds": self.seconds,
                "candidates": self.candidates, "frequent": self.frequent}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> MiningStats:
        return MiningStats(levels=tuple(LevelStats(**s) for s in d["levels"]),
                           rounds=tuple(RoundStats(**r) for r in d["rounds"]),
                           layers_detected=d["layers_detected"], seconds=d["seconds"])


@dataclasses.dataclass(frozen=True)
class FoldedGraph:
    """A graph folded into templates (unique subgraphs) and uncovered GraphNodes.

    Every GraphNode is in at most one instance of one template. ``uncovered`` are the
    GraphNodes in none; the exploration stage searches each of them on its own, so the
    number of things it searches is :attr:`num_unique` = templates + uncovered nodes (a
    graph without repetition: every GraphNode is its own unique subgraph).
    ``edges`` are the connected ``(src, dst)`` GraphNode pairs of the original graph, kept
    so that :meth:`to_networkx` needs no Graph.
    """

    graph_name: str
    num_nodes: int
    templates: tuple[Template, ...]
    uncovered: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    node_kinds: tuple[str, ...]
    min_support: int          # of the first round (detected or given)
    min_size: int
    stats: MiningStats

    # ---- queries ---------------------------------------------------------------------
    @property
    def num_covered(self) -> int:
        return self.num_nodes - len(self.uncovered)

    @property
    def coverage(self) -> float:
        """Fraction of GraphNodes inside a template instance (0.0 for an empty graph)."""
        return self.num_covered / self.num_nodes if self.num_nodes else 0.0

    @property
    def num_templates(self) -> int:
        return len(self.templates)

    @property
    def num_unique(self) -> int:
        """What exploration must search: each template once plus each uncovered GraphNode."""
        return len(self.templates) + len(self.uncovered)

    def node_assignment(self) -> list[tuple[int, int, int] | None]:
        """For each GraphNode: ``(template id, instance index, position)`` or None."""
        out: list[tuple[int, int, int] | None] = [None] * self.num_nodes
        for t in self.templates:
            for j, inst in enumerate(t.instances):
                for i, v in enumerate(inst):
                    out[v] = (t.id, j, i)
        return out

    # ---- reports ---------------------------------------------------------------------
    def summary(self) -> str:
        """A human-readable report: templates (size, instances, kinds), coverage, timing."""
        lines = [f"FoldedGraph '{self.graph_name}': {self.num_nodes} GraphNodes -> "
                 f"{self.num_templates} unique subgraphs (templates) covering "
                 f"{self.num_covered} GraphNodes ({100 * self.coverage:.1f}%), "
                 f"{len(self.uncovered)} uncovered"]
        srcs = {r.min_support_source for r in self.stats.rounds[:1]}
        lines.append(f"mined in {self.stats.seconds:.3f} s: {len(self.stats.rounds)} round(s), "
                     f"min_support {self.min_support} ({', '.join(srcs) or 'n/a'}; "
                     f"layers detected {self.stats.layers_detected}), min_size {self.min_size}, "
                     f"{self.stats.candidates} candidates counted, "
                     f"{self.stats.frequent} frequent subgraphs")
        if not self.templates:
            if self.num_nodes:
                lines.append("no repeated subgraph of at least min_size GraphNodes: every "
                             "GraphNode is its own unique subgraph")
            return "\n".join(lines)
        lines.append(f"{'template':<9}{'size':>5}{'instances':>10}{'covered':>8}  "
                     f"{'round':>5}  kinds / name")
        for t in self.templates:
            kinds = ", ".join(f"{k} x{n}" for k, n in t.kind_counts().items())
            lines.append(f"T{t.id:<8}{t.size:>5}{t.num_instances:>10}{t.num_covered:>8}  "
                         f"{t.round:>5}  {kinds}")
            if t.name:
                lines.append(f"{'':<40}{t.name}")
        if self.uncovered:
            kinds = Counter(self.node_kinds[v] for v in self.uncovered)
            lines.append("uncovered: " + ", ".join(
                f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))))
        for r in self.stats.rounds:
            per_level = " ".join(f"{s.candidates}/{s.frequent}" for s in self.stats.levels
                                 if s.round == r.round)
            window = (f" (window: {r.copies_skipped} copies of each deep stack's unit not mined)"
                      if r.copies_skipped else "")
            lines.append(f"round {r.round}: min_support {r.min_support} ({r.min_support_source}),"
                         f" {r.nodes} nodes{window}, {r.templates} templates, {r.seconds:.3f} s;"
                         f" candidates/frequent per level: {per_level}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "graph_name": self.graph_name, "num_nodes": self.num_nodes,
                "num_templates": self.num_templates, "coverage": self.coverage,
                "min_support": self.min_support, "min_size": self.min_size,
                "templates": [t.to_json() for t in self.templates],
                "uncovered": list(self.uncovered), "edges": [list(e) for e in self.edges],
                "node_kinds": list(self.node_kinds), "stats": self.stats.to_json()}

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> FoldedGraph:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a FoldedGraph: 'format' is {d.get('format')!r}, expected "
                             f"{FORMAT!r} (write one with FoldedGraph.to_json)")
        return FoldedGraph(
            graph_name=d["graph_name"], num_nodes=d["num_nodes"],
            templates=tuple(Template.from_json(t) for t in d["templates"]),
            uncovered=tuple(d["uncovered"]), edges=tuple(tuple(e) for e in d["edges"]),
            node_kinds=tuple(d["node_kinds"]), min_support=d["min_support"],
            min_size=d["min_size"], stats=MiningStats.from_json(d["stats"]))

    @staticmethod
    def loads(text: str) -> FoldedGraph:
        return FoldedGraph.from_json(json.loads(text))

    def to_networkx(self) -> nx.DiGraph:
        """The folded graph: one vertex per template instance (``"T<t>.<j>"``) and per
        uncovered GraphNode (``"n<id>"``); an edge where any GraphNode edge joins two of
        them (attr ``count``: how many GraphNode edges). Vertex attrs: ``template`` (id or
        None), ``instance``, ``nodes`` (GraphNode ids), ``size``, ``label``, ``first`` (the
        smallest GraphNode id, a topological key)."""
        g = nx.DiGraph(name=self.graph_name)
        unit_of: dict[int, str] = {}
        for t in self.templates:
            for j, inst in enumerate(t.instances):
                u = f"T{t.id}.{j}"
                g.add_node(u, template=t.id, instance=j, nodes=list(inst), size=len(inst),
                           label=f"T{t.id}", first=min(inst))
                for v in inst:
                    unit_of[v] = u
        for v in self.uncovered:
            u = f"n{v}"
            g.add_node(u, template=None, instance=None, nodes=[v], size=1,
                       label=self.node_kinds[v] if v < len(self.node_kinds) else "", first=v)
            unit_of[v] = u
        for s, d in self.edges:
            a, b = unit_of.get(s), unit_of.get(d)
            if a is None or b is None or a == b:
                continue
            if g.has_edge(a, b):
                g.edges[a, b]["count"] += 1
            else:
                g.add_edge(a, b, count=1)
        return g
