"""Subgraph mining: fold a GraphNode graph into its unique repeated subgraphs (paper 4.3).

In:  :class:`tapas.ir.Graph` (from ``tapas.capture``).
Out: :class:`FoldedGraph` -- the unique subgraphs (*templates*), every *instance* of each
     (which GraphNodes, and which template position each one fills), the GraphNodes no
     template covers, and the mining statistics (candidates and frequent subgraphs per
     level, time). Later stages search one parallel strategy per template and copy it to
     every instance.

The algorithm is the paper's Algorithm 1 (Apriori frequent-subgraph search) on the
GraphNode graph, with vertices labelled by ``GraphNode.signature`` and edges by their
wiring (which output of the producer feeds which input of the consumer):

1. Level 1: every GraphNode signature is a candidate; its count is its number of
   GraphNodes. Keep the frequent ones (count >= ``min_support``).
2. Level k = 2, 3, ...: merge each frequent subgraph of size k-1 with a frequent edge
   that touches it (the "merge subgraphs that share an edge" of line 8), i.e. grow every
   embedding of it by one adjacent GraphNode. Candidates are deduplicated by a canonical
   form, counted as the number of non-overlapping embeddings, and kept when frequent.
   Stop at the first empty level.
3. Fold: the frequent subgraphs with at least ``min_size`` GraphNodes become templates,
   largest first; each takes the non-overlapping embeddings that no larger template took.
   A template spanning two layers that start alike (GShard's dense + MoE layer pair) is
   cut into one template per layer; isomorphic templates are merged.

What keeps this fast on real models (see ``docs/mining.md``): embeddings are grown (each
keeps its frontier), never searched for; a subgraph whose every embedding extends the
same way without losing support is only grown that way (*closure*); a subgraph never
grows into another, disjoint occurrence of itself (*tiling guard*), so a stack of
identical layers yields one layer-sized template instead of every window of the stack;
and at most 16 embeddings of a subgraph may share a GraphNode (hubs such as T5's encoder
output, read by every decoder layer, would otherwise multiply them combinatorially).

``min_support`` defaults to the number of layers detected in the model
(:func:`detect_layers`), as in the paper; GraphNodes left uncovered are mined again, with
the number of layers detected among them, until a round finds nothing (so ResNet's four
stages, which repeat 35, 7, 2 and 2 times, all fold).

Example::

    >>> from tapas.ir import Graph, GraphNode, Kind, TensorInfo
    >>> def node(name, sig, inputs):
    ...     out = TensorInfo(name + ":0", (4,), "float32")
    ...     ins = tuple(TensorInfo(i + ":0", (4,), "float32") for i in inputs)
    ...     return GraphNode(0, name, Kind.DENSE, (), ins, (out,), (), sig)
    >>> nodes, prev = [node("x", "in", [])], "x"
    >>> for i in range(4):
    ...     nodes += [node(f"a{i}", "A", [prev]), node(f"b{i}", "B", [f"a{i}"])]
    ...     prev = f"b{i}"
    >>> folded = mine(Graph.build(nodes), min_size=2)
    >>> [(t.size, t.num_instances) for t in folded.templates], folded.uncovered
    ([(2, 4)], (0,))
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import networkx as nx
import numpy as np
from absl import logging

from tapas.ir import Graph, Kind

__all__ = [
    "mine",
    "frequent_subgraphs",
    "detect_layers",
    "draw_folded",
    "FoldedGraph",
    "Template",
    "Subgraph",
    "LevelStats",
    "RoundStats",
    "MiningStats",
    "DEFAULT_MIN_SIZE",
]

#: Default ``min_size``: a template holds at least this many GraphNodes. Smaller repeated
#: pieces (a lone residual add, a norm feeding one dense) are cheap to search on their own
#: and would only multiply the templates; Figure 10 (scripts/figure10_minsize.py) shows
#: the result is the same for every value from 2 up to the size of the smallest layer.
DEFAULT_MIN_SIZE = 3

_FORMAT = "tapas.mine.FoldedGraph/1"   # file format id (kept across module moves)

# At most this many embeddings of one subgraph may share a GraphNode. Embeddings that
# share a node count once at most (occurrences may not overlap), so more of them add
# nothing to any support; without the cap a hub (T5's encoder output feeds the
# cross-attention of every decoder layer) makes the embeddings of "norm -> 3 denses"
# grow as C(48, 3).
_MAX_SHARED = 16

# Progress is logged at INFO (absl) once mining has run this long, at DEBUG before.
_LOG_SECONDS = 5.0


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
            lines.append(f"round {r.round}: min_support {r.min_support} ({r.min_support_source}),"
                         f" {r.nodes} nodes, {r.templates} templates, {r.seconds:.3f} s; "
                         f"candidates/frequent per level: {per_level}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "graph_name": self.graph_name, "num_nodes": self.num_nodes,
                "num_templates": self.num_templates, "coverage": self.coverage,
                "min_support": self.min_support, "min_size": self.min_size,
                "templates": [t.to_json() for t in self.templates],
                "uncovered": list(self.uncovered), "edges": [list(e) for e in self.edges],
                "node_kinds": list(self.node_kinds), "stats": self.stats.to_json()}

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> FoldedGraph:
        if d.get("format") != _FORMAT:
            raise ValueError(f"not a FoldedGraph: 'format' is {d.get('format')!r}, expected "
                             f"{_FORMAT!r} (write one with FoldedGraph.to_json)")
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


# =========================================================================================
# Entry points
# =========================================================================================

def mine(graph: Graph, min_support: int | None = None, min_size: int = DEFAULT_MIN_SIZE, *,
         max_rounds: int | None = None, match_ports: bool = True, closure: bool = True,
         tiling_guard: bool = True, split_layers: bool = True,
         progress: Callable[[LevelStats], None] | None = None) -> FoldedGraph:
    """Fold ``graph`` into its unique repeated subgraphs (Algorithm 1, then selection).

    Args:
      graph: the GraphNode graph (``tapas.capture``'s output or hand-built).
      min_support: a subgraph is frequent when it has at least this many non-overlapping
        occurrences. Default (None): the number of layers detected (:func:`detect_layers`),
        re-detected on the GraphNodes each round leaves uncovered. Must be >= 2: a
        subgraph that occurs once folds nothing.
      min_size: templates have at least this many GraphNodes. Larger than any repeated
        subgraph (or than the graph): no template, every GraphNode uncovered -- an empty
        result, not an error.
      max_rounds: stop after this many rounds (1: Algorithm 1 once). Default: until a round
        adds no template. With an explicit ``min_support`` every round uses it.
      match_ports: edges match only when they connect the same output index to the same
        input index (False: any edge matches any edge of the same direction).
      closure: grow a subgraph whose embeddings all extend the same way (without losing
        support) only that way. False: exhaustive Apriori (exponential; small graphs only).
      tiling_guard: never grow a subgraph into a disjoint occurrence of itself.
      split_layers: cut a chosen template that spans two layers starting alike (a dense
        and a MoE layer) into one template per layer (see ``_layer_parts``).
      progress: called with each level's :class:`LevelStats` as soon as it is done.

    Returns:
      a :class:`FoldedGraph`.
    """
    if min_support is not None and (not isinstance(min_support, int) or min_support < 2):
        raise ValueError(f"min_support={min_support!r}: must be an integer >= 2 (a subgraph "
                         "that occurs once folds nothing); pass None to use the number of "
                         "layers detected in the model")
    if not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size={min_size!r}: must be an integer >= 1 (the fewest "
                         f"GraphNodes a template may hold; default {DEFAULT_MIN_SIZE})")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r}: must be >= 1 or None (until done)")
    start = time.perf_counter()
    n = len(graph.nodes)
    index = _Index(graph, match_ports)
    layers = detect_layers(graph)
    active = [graph.nodes[v].kind != Kind.INPUT for v in range(n)]
    # (labels, instances, min_support, round, support) per template
    chosen: list[tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]] = []
    levels: list[LevelStats] = []
    rounds: list[RoundStats] = []
    first_support = min_support if min_support is not None else max(layers, 1)
    r = 0
    while max_rounds is None or r < max_rounds:
        r += 1
        nodes = [v for v in range(n) if active[v]]
        if min_support is not None:
            support, source = min_support, "given"
        else:
            support, source = (layers if r == 1 else detect_layers(graph, nodes)), \
                "detected layers"
        if support < 2 or len(nodes) < max(min_size, 2) or min_size > len(nodes):
            break
        t0 = time.perf_counter()
        frequent: list[_Pattern] = []
        for stats, level in _apriori(index, nodes, support, closure=closure,
                                     tiling_guard=tiling_guard, round_no=r):
            levels.append(stats)
            frequent.extend(level)
            logging.log(logging.INFO if time.perf_counter() - start > _LOG_SECONDS
                        else logging.DEBUG,
                        "mine %s round %d level %d: %d candidates, %d frequent, %.3f s",
                        graph.name, r, stats.level, stats.candidates, stats.frequent,
                        stats.seconds)
            if progress is not None:
                progress(stats)
        picked = _select(index, frequent, support, min_size, active)
        covered = 0
        before = len(chosen)
        for pat, insts in picked:
            parts = (_layer_parts(graph, index, pat, insts, min_size) if split_layers
                     else [list(range(pat.size))])
            for part in parts:
                sub = [tuple(e[p] for p in part) for e in insts]
                total = (_count_nonoverlapping(pat.embs) if len(parts) == 1 else
                         _count_nonoverlapping([tuple(e[p] for p in part) for e in pat.embs]))
                chosen.append((tuple(pat.labels[p] for p in part), sub, support, r, total))
            for inst in insts:
                for v in inst:
                    active[v] = False
                covered += len(inst)
        rounds.append(RoundStats(round=r, min_support=support, min_support_source=source,
                                 nodes=len(nodes), frequent=len(frequent),
                                 templates=len(chosen) - before, covered=covered,
                                 seconds=time.perf_counter() - t0))
        logging.log(logging.INFO if rounds[-1].seconds > _LOG_SECONDS else logging.DEBUG,
                    "mine %s round %d: min_support %d, %d nodes, %d frequent subgraphs, "
                    "%d templates covering %d nodes, %.3f s", graph.name, r, support,
                    len(nodes), len(frequent), rounds[-1].templates, covered,
                    rounds[-1].seconds)
        if not picked:
            break
    chosen = _merge_isomorphic(index, chosen)
    templates = tuple(_make_template(i, graph, index, labels, insts, support, rnd, sup)
                      for i, (labels, insts, support, rnd, sup) in enumerate(chosen))
    in_template = {v for t in templates for inst in t.instances for v in inst}
    uncovered = tuple(v for v in range(n) if v not in in_template)
    edges = tuple(sorted({(e.src, e.dst) for e in graph.edges if e.src != e.dst}))
    stats = MiningStats(levels=tuple(levels), rounds=tuple(rounds), layers_detected=layers,
                        seconds=time.perf_counter() - start)
    return FoldedGraph(graph_name=graph.name, num_nodes=n, templates=templates,
                       uncovered=uncovered, edges=edges,
                       node_kinds=tuple(nd.kind.value for nd in graph.nodes),
                       min_support=first_support, min_size=min_size, stats=stats)


def frequent_subgraphs(graph: Graph, min_support: int, *, nodes: Sequence[int] | None = None,
                       match_ports: bool = True, closure: bool = True,
                       tiling_guard: bool = True) -> Iterator[list[Subgraph]]:
    """Algorithm 1 itself: yield F_1, F_2, ... (the frequent subgraphs of each size).

    ``nodes`` restricts the search to those GraphNodes (default: all but graph inputs).
    See :func:`mine` for the other arguments.
    """
    if min_support < 1:
        raise ValueError(f"min_support={min_support}: must be >= 1")
    index = _Index(graph, match_ports)
    if nodes is None:
        nodes = [v for v, nd in enumerate(graph.nodes) if nd.kind != Kind.INPUT]
    for _, level in _apriori(index, list(nodes), min_support, closure=closure,
                             tiling_guard=tiling_guard, round_no=1):
        yield [Subgraph(signatures=tuple(index.sigs[l] for l in p.labels),
                        edges=tuple(index.edge_pair(a, b, c) for a, b, c in p.edges),
                        embeddings=tuple(p.embs), support=p.count) for p in level]


def detect_layers(graph: Graph, nodes: Sequence[int] | None = None) -> int:
    """The number of layers (repetitions) in ``graph``: the paper's default min_support.

    Take the signatures of the weight-bearing GraphNodes (those with weights; if fewer
    than two, all non-input GraphNodes) in topological order -- a sequence like
    ``emb [norm q k v o norm wi wo] [norm q k v o norm wi wo] ... final_norm``. The number
    of layers is the number of back-to-back repetitions ``r`` of the tandem repeat that
    spans the most of that sequence: ``seq[i : i + r*p]`` is ``r`` copies of
    ``seq[i : i + p]``, and ``r * p`` is maximal over ``i`` and the period ``p`` (ties: more
    repetitions, i.e. the shortest unit). So the q, k, v projections of one attention, equal
    but only 3 long, do not count as layers; the 24 layers of a stack do. A stack of L identical
    layers gives L (L-1 if the first or last layer differs, e.g. T5's first layer computes
    the position bias); ResNet gives the longest stage (35 identity blocks in ResNet-152);
    a model alternating two layer types (GShard MoE) gives the number of pairs.

    If no unit repeats back to back but some signature occurs twice or more, the answer is
    2 (the smallest useful support); with no repeated signature at all it is 1: there is
    nothing to fold. ``nodes`` restricts the count to those GraphNodes.
    """
    ids = range(len(graph.nodes)) if nodes is None else sorted(nodes)
    cand = [v for v in ids if graph.nodes[v].kind != Kind.INPUT]
    seq = [graph.nodes[v].signature for v in cand if graph.nodes[v].weights]
    if len(seq) < 2:
        seq = [graph.nodes[v].signature for v in cand]
    if len(set(seq)) == len(seq):
        # no weight-bearing repetition: fall back on any repeated signature
        all_sigs = Counter(graph.nodes[v].signature for v in cand)
        return 2 if all_sigs and max(all_sigs.values()) >= 2 else 1
    codes: dict[str, int] = {}
    a = np.array([codes.setdefault(s, len(codes)) for s in seq], dtype=np.int64)
    w = len(a)
    best = (0, 1)          # (span = repetitions x period, repetitions)
    for p in range(1, w // 2 + 1):
        eq = a[:-p] == a[p:]
        if not eq.any():
            continue
        # longest run of True in eq: seq[i:i+run+p] is periodic with period p
        padded = np.concatenate(([0], eq.view(np.int8), [0]))
        d = np.diff(padded)
        run = int((np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).max())
        reps = run // p + 1
        if reps >= 2:
            best = max(best, (reps * p, reps))
    best = best[1]
    return max(best, 2)


# =========================================================================================
# The graph as integer labels and labelled adjacency
# =========================================================================================

class _Index:
    """Signatures interned as ints; edges between two GraphNodes as an int code.

    ``adj[v][u]`` is the code of the (possibly multiple) edges between v and u, seen from
    v: the sorted (output index, input index) pairs of the tensors v -> u and u -> v.
    ``rev[c]`` is the same code seen from the other end.
    """

    def __init__(self, graph: Graph, match_ports: bool) -> None:
        n = len(graph.nodes)
        self.n = n
        label_ids: dict[str, int] = {}
        self.sigs: list[str] = []
        self.lab: list[int] = []
        for nd in graph.nodes:
            s = nd.signature or f"<{nd.kind.value}:{','.join(nd.op_types)}>"
            lid = label_ids.get(s)
            if lid is None:
                lid = label_ids[s] = len(self.sigs)
                self.sigs.append(s)
            self.lab.append(lid)
        out_pos = [{t.name: i for i, t in enumerate(nd.outputs)} for nd in graph.nodes]
        in_pos = [{t.name: i for i, t in enumerate(nd.inputs)} for nd in graph.nodes]
        fwd: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        real: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        self.in_tensors: list[set[tuple[int, str]]] = [set() for _ in range(n)]
        self.out_tensors: list[set[tuple[int, str]]] = [set() for _ in range(n)]
        for e in graph.edges:
            if e.src == e.dst:
                continue
            port = (out_pos[e.src].get(e.tensor.name, -1), in_pos[e.dst].get(e.tensor.name, -1))
            real[(e.src, e.dst)].add(port)
            fwd[(e.src, e.dst)].add(port if match_ports else (0, 0))
            self.in_tensors[e.dst].add((e.src, e.tensor.name))
            self.out_tensors[e.src].add((e.dst, e.tensor.name))
        # (src, dst) -> the (output index, input index) pairs of the tensors src -> dst
        self.ports = {sd: tuple(sorted(p)) for sd, p in real.items()}
        self.codes: list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = []
        code_ids: dict[Any, int] = {}
        self.rev: list[int] = []

        def intern(key: Any) -> int:
            c = code_ids.get(key)
            if c is None:
                c = code_ids[key] = len(self.codes)
                self.codes.append(key)
                self.rev.append(-1)
            return c

        self.adj: list[dict[int, int]] = [{} for _ in range(n)]
        for (s, d) in sorted(set(fwd) | {(d, s) for s, d in fwd}):
            if s > d:
                continue
            f = tuple(sorted(fwd.get((s, d), ())))
            b = tuple(sorted(fwd.get((d, s), ())))
            c_sd, c_ds = intern((f, b)), intern((b, f))
            self.rev[c_sd], self.rev[c_ds] = c_ds, c_sd
            self.adj[s][d] = c_sd
            self.adj[d][s] = c_ds

    def edge_pair(self, a: int, b: int, c: int) -> tuple[int, int]:
        """(src_pos, dst_pos) of the pattern edge (a, b, code c seen from a)."""
        f, _ = self.codes[c]
        return (a, b) if f else (b, a)


# =========================================================================================
# Patterns, canonical forms, counting
# =========================================================================================

class _Pattern:
    """A connected labelled subgraph: labels per position, edges ``(a, b, code)`` with
    a < b and the code seen from a, and its embeddings (tuples of GraphNode ids, one per
    position, distinct node sets). ``count``: non-overlapping embeddings.

    ``fronts[i]`` is the frontier of embedding i, kept up to date as embeddings grow so
    that growing costs O(frontier) rather than O(size x degree): for each GraphNode u
    adjacent to the embedding and outside it, the ``(inside node, code seen from it)``
    pairs that connect them."""

    __slots__ = ("labels", "edges", "embs", "fronts", "count", "colors", "key")

    def __init__(self, labels: tuple[int, ...], edges: tuple[tuple[int, int, int], ...],
                 embs: list[tuple[int, ...]], count: int, colors: tuple[int, ...] = (),
                 key: Any = None, fronts: list[dict[int, tuple[tuple[int, int], ...]]] | None = None
                 ) -> None:
        self.labels, self.edges, self.embs, self.count = labels, edges, embs, count
        self.colors, self.key = colors, key
        self.fronts = fronts if fronts is not None else []

    @property
    def size(self) -> int:
        return len(self.labels)


def _count_nonoverlapping(embs: Sequence[tuple[int, ...]],
                          blocked: set[int] | None = None) -> int:
    """Greedy maximum set of pairwise disjoint embeddings (earliest-ending first, which is
    optimal on chains); embeddings touching ``blocked`` are skipped."""
    used: set[int] = set(blocked) if blocked else set()
    c = 0
    for e in sorted(embs, key=max):
        if used.isdisjoint(e):
            used.update(e)
            c += 1
    return c


def _cap_shared(items: list[Any], key: Callable[[Any], tuple[int, ...]] | None = None
                ) -> list[Any]:
    """Keep, in order, the embeddings that leave no GraphNode in more than _MAX_SHARED."""
    if len(items) <= _MAX_SHARED:
        return items
    embs = items if key is None else [key(x) for x in items]
    counts = Counter(itertools.chain.from_iterable(embs))
    if max(counts.values()) <= _MAX_SHARED:
        return items
    hot = {v for v, n in counts.items() if n > _MAX_SHARED}
    shared: Counter[int] = Counter()
    out = []
    for x, e in zip(items, embs):
        if hot.isdisjoint(e):
            out.append(x)
            continue
        mine_hot = [v for v in e if v in hot]
        if all(shared[v] < _MAX_SHARED for v in mine_hot):
            shared.update(mine_hot)
            out.append(x)
    return out


def _pick_nonoverlapping(embs: Sequence[tuple[int, ...]],
                         blocked: set[int]) -> list[tuple[int, ...]]:
    used = set(blocked)
    out = []
    for e in sorted(embs, key=max):
        if used.isdisjoint(e):
            used.update(e)
            out.append(e)
    return out


def _canonical(labels: Sequence[int], edges: Sequence[tuple[int, int, int]],
               rev: Sequence[int]) -> tuple[Any, list[int], bool, tuple[int, ...]]:
    """Canonical form of a small labelled graph by colour refinement.

    Colours start as labels and are refined by the multiset of (edge code, neighbour
    colour) until stable; colour ids are ranks of sorted invariant tuples, so isomorphic
    graphs get the same colours. If every vertex ends with its own colour (the usual case:
    signatures plus wiring tell positions apart), ordering vertices by colour is canonical
    and the returned key identifies the graph up to isomorphism. Otherwise the key is an
    isomorphism invariant only (``discrete`` is False) and the caller confirms with
    :func:`_find_isomorphism`.

    Returns (key, order, discrete, colours in the new order); ``order[i]`` is the old
    position that becomes position i.
    """
    k = len(labels)
    nbrs: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for a, b, c in edges:
        nbrs[a].append((c, b))
        nbrs[b].append((rev[c], a))
    col = list(labels)
    ncls = len(set(col))
    while ncls < k:
        sigs = [(col[p], tuple(sorted([(c, col[q]) for c, q in nbrs[p]]))) for p in range(k)]
        uniq = sorted(set(sigs))
        if len(uniq) == ncls:
            break
        rank = {s: i for i, s in enumerate(uniq)}
        col = [rank[s] for s in sigs]
        ncls = len(uniq)
    order = sorted(range(k), key=lambda p: (col[p], p))
    inv = [0] * k
    for i, p in enumerate(order):
        inv[p] = i
    new_labels = tuple(labels[p] for p in order)
    colors = tuple(col[p] for p in order)
    discrete = ncls == k
    if discrete:
        can = []
        for a, b, c in edges:
            x, y = inv[a], inv[b]
            can.append((x, y, c) if x < y else (y, x, rev[c]))
        can.sort()
        return (new_labels, tuple(can)), order, True, colors
    inv_edges = []
    for a, b, c in edges:
        x, y = col[a], col[b]
        inv_edges.append(min((x, y, c), (y, x, rev[c])))
    inv_edges.sort()
    return ("~", new_labels, colors, tuple(inv_edges)), order, False, colors


def _find_isomorphism(a: _Pattern, b: _Pattern, rev: Sequence[int]) -> list[int] | None:
    """A colour-, label- and edge-preserving bijection from a's positions to b's (induced:
    non-edges map to non-edges), or None. Both patterns are in refined-colour order."""
    k = a.size
    ea: dict[tuple[int, int], int] = {}
    for x, y, c in a.edges:
        ea[(x, y)], ea[(y, x)] = c, rev[c]
    eb: dict[tuple[int, int], int] = {}
    for x, y, c in b.edges:
        eb[(x, y)], eb[(y, x)] = c, rev[c]
    by_color: dict[int, list[int]] = defaultdict(list)
    for q in range(k):
        by_color[b.colors[q]].append(q)
    order = sorted(range(k), key=lambda p: (len(by_color[a.colors[p]]), p))
    f = [-1] * k
    used = [False] * k

    def extend(i: int) -> bool:
        if i == k:
            return True
        p = order[i]
        for q in by_color[a.colors[p]]:
            if used[q] or a.labels[p] != b.labels[q]:
                continue
            if all(ea.get((p, order[j])) == eb.get((q, f[order[j]])) for j in range(i)):
                f[p], used[q] = q, True
                if extend(i + 1):
                    return True
                f[p], used[q] = -1, False
        return False

    return f if extend(0) else None


class _Registry:
    """The candidates of one level, deduplicated by canonical form."""

    def __init__(self, rev: Sequence[int]) -> None:
        self.rev = rev
        self.exact: dict[Any, _Pattern] = {}
        self.fuzzy: dict[Any, list[_Pattern]] = defaultdict(list)
        self.members: list[_Pattern] = []
        self.merged: set[int] = set()    # ids of patterns that received embeddings twice

    def add(self, labels: tuple[int, ...], edges: tuple[tuple[int, int, int], ...],
            embs: list[tuple[int, ...]], count: int,
            fronts: list[dict[int, tuple[tuple[int, int], ...]]]) -> None:
        key, order, discrete, colors = _canonical(labels, edges, self.rev)
        inv = [0] * len(order)
        for i, p in enumerate(order):
            inv[p] = i
        new_edges = []
        for a, b, c in edges:
            x, y = inv[a], inv[b]
            new_edges.append((x, y, c) if x < y else (y, x, self.rev[c]))
        new_embs = [tuple(e[p] for p in order) for e in embs]
        cand = _Pattern(tuple(labels[p] for p in order), tuple(sorted(new_edges)), new_embs,
                        count, colors, key, fronts)
        if discrete:
            old = self.exact.get(key)
            if old is None:
                self.exact[key] = cand
                self.members.append(cand)
            else:
                self._merge(old, new_embs, fronts)
            return
        for old in self.fuzzy[key]:
            f = _find_isomorphism(cand, old, self.rev)
            if f is not None:
                moved = []
                for e in new_embs:
                    t = [0] * len(f)
                    for p, q in enumerate(f):
                        t[q] = e[p]
                    moved.append(tuple(t))
                self._merge(old, moved, fronts)
                return
        self.fuzzy[key].append(cand)
        self.members.append(cand)

    def _merge(self, old: _Pattern, embs: list[tuple[int, ...]],
               fronts: list[dict[int, tuple[tuple[int, int], ...]]]) -> None:
        seen = {tuple(sorted(e)) for e in old.embs}
        added = False
        for e, f in zip(embs, fronts):
            s = tuple(sorted(e))
            if s not in seen:
                seen.add(s)
                old.embs.append(e)
                old.fronts.append(f)
                added = True
        if added:
            pairs = _cap_shared(list(zip(old.embs, old.fronts)), key=lambda x: x[0])
            old.embs = [e for e, _ in pairs]
            old.fronts = [f for _, f in pairs]
            self.merged.add(id(old))


# =========================================================================================
# Algorithm 1
# =========================================================================================

def _apriori(index: _Index, nodes: list[int], support: int, *, closure: bool,
             tiling_guard: bool, round_no: int) -> Iterator[tuple[LevelStats, list[_Pattern]]]:
    """Yield (stats, F_k) for k = 1, 2, ... on the subgraph induced by ``nodes``."""
    t0 = time.perf_counter()
    lab = index.lab
    active = [False] * index.n
    for v in nodes:
        active[v] = True
    adj = [{u: c for u, c in index.adj[v].items() if active[u]} if active[v] else {}
           for v in range(index.n)]

    # ---- level 1: group by signature -----------------------------------------------
    by_label: dict[int, list[int]] = defaultdict(list)
    for v in nodes:
        by_label[lab[v]].append(v)
    freq_label = {l for l, vs in by_label.items() if len(vs) >= support}
    adjf = [[(u, c) for u, c in adj[v].items() if lab[u] in freq_label] for v in range(index.n)]
    level = [_Pattern((l,), (), [(v,) for v in vs], len(vs), (l,), ((l,), ()),
                      [{u: ((v, c),) for u, c in adjf[v]} for v in vs])
             for l, vs in sorted(by_label.items()) if len(vs) >= support]

    # Apriori on edges: an edge type (label, code, label) occurring fewer than `support`
    # times without overlap cannot be part of a frequent subgraph.
    pairs: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for v in nodes:
        if lab[v] not in freq_label:
            continue
        for u, c in adj[v].items():
            if v < u and lab[u] in freq_label:
                pairs[(lab[v], c, lab[u])].append((v, u))
    edge_ok: set[tuple[int, int, int]] = set()
    for (la, c, lb), ps in pairs.items():
        if len(ps) >= support and _count_nonoverlapping(ps) >= support:
            edge_ok.add((la, c, lb))
            edge_ok.add((lb, index.rev[c], la))
    yield (LevelStats(round_no, 1, len(by_label), len(level),
                      sum(len(p.embs) for p in level), time.perf_counter() - t0), level)

    k = 1
    while level and k < len(nodes):
        k += 1
        t0 = time.perf_counter()
        reg = _Registry(index.rev)
        counted = 0
        for pat in level:
            counted += _extend(pat, reg, adjf, lab, edge_ok, support,
                               closure=closure, tiling_guard=tiling_guard)
        nxt = []
        for p in reg.members:
            if id(p) in reg.merged:
                p.count = _count_nonoverlapping(p.embs)
            if p.count >= support:
                nxt.append(p)
        level = nxt
        yield (LevelStats(round_no, k, counted, len(level), sum(len(p.embs) for p in level),
                          time.perf_counter() - t0), level)


def _extend(pat: _Pattern, reg: _Registry, adj: list[list[tuple[int, int]]], lab: list[int],
            edge_ok: set[tuple[int, int, int]], support: int, *,
            closure: bool, tiling_guard: bool) -> int:
    """Grow every embedding of ``pat`` by one adjacent GraphNode; register the frequent
    children. Returns the number of candidates counted."""
    embs = pat.embs
    k = len(pat.labels)
    # GraphNode -> the embeddings holding it
    owner: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(embs):
        for v in e:
            owner[v].append(i)
    # descriptor (label of new node, ((position, code), ...)) -> [(embedding idx, node)]
    groups: dict[tuple[int, tuple[tuple[int, int], ...]], list[tuple[int, int]]] = \
        defaultdict(list)
    labels = pat.labels
    fronts = pat.fronts
    for i, e in enumerate(embs):
        pos_of = dict(zip(e, range(k)))
        eset = None
        for u, conns in fronts[i].items():
            lu = lab[u]
            if len(conns) == 1:
                v, c = conns[0]
                lst: tuple[tuple[int, int], ...] = ((pos_of[v], c),)
            else:
                lst = tuple(sorted([(pos_of[v], c) for v, c in conns]))
            ok = True
            for pos, c in lst:
                if (labels[pos], c, lu) not in edge_ok:
                    ok = False
                    break
            if not ok:
                continue
            if tiling_guard and u in owner:
                if eset is None:
                    eset = set(e)
                if any(j != i and eset.isdisjoint(embs[j]) for j in owner[u]):
                    continue  # u belongs to another, disjoint occurrence of this pattern
            groups[(lu, lst)].append((i, u))

    counted = 0
    scored = []
    for desc, members in groups.items():
        if len(members) < support:
            continue
        counted += 1
        # Two members give the same node set only if the new node of one lies in the
        # parent embedding of the other; only then is the (sorted) node set compared.
        # Likewise the shared-node cap can only bite when a parent embedding has several
        # members, a new node is shared, or a new node lies in a parent embedding.
        children: list[tuple[tuple[int, ...], int, int]] = []
        seen: set[tuple[int, ...]] = set()
        risky = len({i for i, _ in members}) < len(members) or \
            len({u for _, u in members}) < len(members)
        for i, u in members:
            e = embs[i] + (u,)
            if u in owner:
                risky = True
                s = tuple(sorted(e))
                if s in seen:
                    continue
                seen.add(s)
            children.append((e, i, u))
        kept = _cap_shared(children, key=lambda x: x[0]) if risky else children
        parents = {i for _, i, _ in kept}
        if len(kept) < support:
            continue
        ch = [e for e, _, _ in kept]
        cnt = _count_nonoverlapping(ch)
        if cnt >= support:
            scored.append((desc, kept, len(parents), cnt))
    if closure:
        # Absorbing extensions keep every embedding and the support: the subgraph is not
        # maximal, and the maximal ones containing it contain them too. Grow only one (the
        # smallest descriptor, a deterministic choice); the others follow at later levels.
        absorbing = [x for x in scored if x[2] == len(embs) and x[3] >= pat.count]
        if absorbing:
            scored = [min(absorbing, key=lambda x: x[0])]
    for desc, kept, _, cnt in scored:
        lu, conns = desc
        labels = pat.labels + (lu,)
        edges = pat.edges + tuple((pos, k, c) for pos, c in conns)
        ch = []
        ch_fronts = []
        for e, i, u in kept:
            front = dict(fronts[i])
            del front[u]
            for w, c in adj[u]:
                if w in front:
                    front[w] = front[w] + ((u, c),)
                elif w not in e:
                    front[w] = ((u, c),)
            ch.append(e)
            ch_fronts.append(front)
        reg.add(labels, edges, ch, cnt, ch_fronts)
    return counted


# =========================================================================================
# Folding: choose templates, largest first
# =========================================================================================

def _boundary(index: _Index, emb: tuple[int, ...]) -> int:
    """Distinct tensors entering or leaving one instance (fewer: a cleaner cut)."""
    inside = set(emb)
    ins, outs = set(), set()
    for v in emb:
        for src, t in index.in_tensors[v]:
            if src not in inside:
                ins.add(t)
        for dst, t in index.out_tensors[v]:
            if dst not in inside:
                outs.add(t)
    return len(ins) + len(outs)


def _select(index: _Index, frequent: list[_Pattern], support: int, min_size: int,
            active: list[bool]) -> list[tuple[_Pattern, list[tuple[int, ...]]]]:
    """Choose templates among the frequent subgraphs with at least ``min_size`` GraphNodes.

    This is a set-packing problem (instances may not overlap). Greedy: go through the
    subgraphs in a priority order; each takes the non-overlapping embeddings still free
    and becomes a template if it gets at least ``support`` of them. Greedy is run with
    two orders and the packing that covers the most GraphNodes wins (ties: fewer
    templates, then the first order):

    1. largest first (then fewest boundary tensors, most occurrences) -- the default
       preference: block-sized templates rather than many small ones;
    2. cleanest cut first (fewest boundary tensors per GraphNode, then largest) -- saves
       small graphs where a large subgraph that straddles layers occurs twice by chance.
    """
    eligible = [p for p in frequent if p.size >= min_size]
    if not eligible:
        return []
    info = []
    for p in eligible:
        first = min(p.embs, key=min)
        info.append((p, _boundary(index, first), min(first)))
    orders = [
        sorted(info, key=lambda x: (-x[0].size, x[1], -x[0].count, x[2])),
        sorted(info, key=lambda x: (x[1] / x[0].size, -x[0].size, -x[0].count, x[2])),
    ]
    blocked0 = {v for v in range(index.n) if not active[v]}
    best: tuple[tuple[int, int, int], list] | None = None
    for rank, order in enumerate(orders):
        blocked = set(blocked0)
        picked = []
        covered = 0
        for p, _, _ in order:
            if all(not blocked.isdisjoint(e) for e in p.embs):
                continue
            insts = _pick_nonoverlapping(p.embs, blocked)
            if len(insts) >= support:
                picked.append((p, insts))
                for e in insts:
                    blocked.update(e)
                covered += p.size * len(insts)
        score = (-covered, len(picked), rank)
        if best is None or score < best[0]:
            best = (score, picked)
    assert best is not None
    return best[1]


def _layer_parts(graph: Graph, index: _Index, pat: _Pattern, insts: list[tuple[int, ...]],
                 min_size: int) -> list[list[int]]:
    """Split a template that spans two layers starting alike (layer splitting).

    Number the positions in the topological order of the first instance. If the induced
    subgraph grown from the first position re-occurs, disjointly, from a later position b
    of the same template (a greedy rooted match, checked edge by edge) and that repeated
    head is substantial -- at least 3 GraphNodes, two of them with weights
    when the graph has weights -- the template is two layers that start the same way
    (e.g. a dense layer and a MoE layer, both opening with self-attention): cut it before
    b, if both parts stay connected and hold at least ``min_size`` GraphNodes, and split the
    parts again. Returns lists of pattern positions, one per part (topological order).
    """
    first = insts[0]
    order = sorted(range(pat.size), key=lambda p: first[p])
    topo = {p: i for i, p in enumerate(order)}
    nb: list[dict[int, int]] = [{} for _ in range(pat.size)]   # code seen from the key
    for a, b, c in pat.edges:
        nb[a][b] = c
        nb[b][a] = index.rev[c]
    weighted = [bool(graph.nodes[first[p]].weights) for p in range(pat.size)]
    any_weights = any(weighted)
    need = 3

    def head(a: int, b: int, allowed: set[int]) -> dict[int, int]:
        m, dom, img = {a: b}, {a}, {b}
        queue = [(a, b)]
        while queue:
            x, y = queue.pop(0)
            for x2 in sorted(nb[x], key=topo.__getitem__):
                if x2 not in allowed or x2 in dom or x2 in img:
                    continue
                for y2 in sorted(nb[y], key=topo.__getitem__):
                    if (y2 not in allowed or y2 in dom or y2 in img or y2 == x2
                            or nb[y][y2] != nb[x][x2] or pat.labels[y2] != pat.labels[x2]):
                        continue
                    if all(nb[x2].get(xx) == nb[y2].get(m[xx]) for xx in dom):
                        m[x2] = y2
                        dom.add(x2)
                        img.add(y2)
                        queue.append((x2, y2))
                        break
        return m

    def connected(part: list[int]) -> bool:
        inside = set(part)
        seen, stack = {part[0]}, [part[0]]
        while stack:
            x = stack.pop()
            for y in nb[x]:
                if y in inside and y not in seen:
                    seen.add(y)
                    stack.append(y)
        return len(seen) == len(inside)

    def split(part: list[int]) -> list[list[int]]:
        if len(part) < 2 * min_size:
            return [part]
        allowed = set(part)
        a = part[0]
        best: tuple[int, int] | None = None
        for b in part[1:]:
            if pat.labels[b] != pat.labels[a]:
                continue
            m = head(a, b, allowed)
            if len(m) < need or (any_weights and sum(weighted[x] for x in m) < 2):
                continue
            if best is None or len(m) > best[0]:
                best = (len(m), b)
        if best is None:
            return [part]
        cut = topo[best[1]]
        left = [p for p in part if topo[p] < cut]
        right = [p for p in part if topo[p] >= cut]
        if (len(left) < min_size or len(right) < min_size or not connected(left)
                or not connected(right)):
            return [part]
        return split(left) + split(right)

    return split(order)


def _merge_isomorphic(index: _Index, chosen: list[tuple[tuple[int, ...], list[tuple[int, ...]],
                                                        int, int, int]]
                      ) -> list[tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]]:
    """One template per isomorphism class: layer splitting can cut a template into
    identical parts, and a later round can find a subgraph an earlier one chose."""
    out: list[tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]] = []
    exact: dict[Any, int] = {}
    fuzzy: dict[Any, list[tuple[int, _Pattern]]] = defaultdict(list)
    for labels, insts, support, rnd, total in chosen:
        first = insts[0]
        where = {v: i for i, v in enumerate(first)}
        edges = [(where[v], where[u], c) for v in first for u, c in index.adj[v].items()
                 if u in where and where[v] < where[u]]
        key, order, discrete, colors = _canonical(labels, edges, index.rev)
        inv = [0] * len(order)
        for i, p in enumerate(order):
            inv[p] = i
        can_labels = tuple(labels[p] for p in order)
        can_insts = [tuple(e[p] for p in order) for e in insts]
        target = exact.get(key) if discrete else None
        if not discrete:
            can_edges = []
            for a, b, c in edges:
                x, y = inv[a], inv[b]
                can_edges.append((x, y, c) if x < y else (y, x, index.rev[c]))
            pat = _Pattern(can_labels, tuple(sorted(can_edges)), [], 0, colors, key)
            for j, other in fuzzy[key]:
                f = _find_isomorphism(pat, other, index.rev)
                if f is not None:
                    moved = []
                    for e in can_insts:
                        t = [0] * len(f)
                        for p, q in enumerate(f):
                            t[q] = e[p]
                        moved.append(tuple(t))
                    can_insts, target = moved, j
                    break
            else:
                fuzzy[key].append((len(out), pat))
        if target is None:
            if discrete:
                exact[key] = len(out)
            out.append((can_labels, can_insts, support, rnd, total))
        else:
            lab0, insts0, sup0, rnd0, total0 = out[target]
            out[target] = (lab0, insts0 + can_insts, sup0, rnd0, max(total0, total))
    return out


def _make_template(tid: int, graph: Graph, index: _Index, labels: Sequence[int],
                   insts: list[tuple[int, ...]], support: int, round_no: int,
                   total: int) -> Template:
    insts = sorted(insts, key=min)
    # number positions in the topological order of the first instance
    perm = sorted(range(len(labels)), key=lambda p: insts[0][p])
    instances = tuple(tuple(e[p] for p in perm) for e in insts)
    first = instances[0]
    where = {v: i for i, v in enumerate(first)}
    edges = sorted((where[v], where[u], index.ports[(v, u)]) for v in first for u in index.adj[v]
                   if u in where and (v, u) in index.ports)
    return Template(id=tid, name=_common_scope([graph.nodes[v].name for v in first]),
                    signatures=tuple(index.sigs[labels[p]] for p in perm),
                    kinds=tuple(graph.nodes[v].kind.value for v in first),
                    edges=tuple(edges), instances=instances, support=total,
                    round=round_no, min_support=support)


def _common_scope(names: Sequence[str]) -> str:
    """The name scope the GraphNodes share; when that is only the model's (an instance
    that straddles two layers), the scope one level deeper that most of them share."""
    parts = [n.split("/") for n in names]
    if not parts:
        return ""
    out = []
    for seg in zip(*parts):
        if all(s == seg[0] for s in seg):
            out.append(seg[0])
        else:
            break
    if len(out) <= 1:
        deeper = Counter("/".join(p[:len(out) + 1]) for p in parts if len(p) > len(out) + 1)
        if deeper:
            scope, n = deeper.most_common(1)[0]
            if n * 2 > len(parts):
                return f"{scope} (mostly)"
    return "/".join(out)


# =========================================================================================
# Drawing
# =========================================================================================

def draw_folded(folded: FoldedGraph, graph: Graph | None, path: str, *,
                title: str | None = None) -> str:
    """Draw the folded graph to a PNG at ``path`` (swimlanes): one disc per template
    instance, on the lane of its template (coloured, labelled ``T<id>``), and one small grey
    disc per uncovered GraphNode on the bottom lane; x is the topological order (smallest
    GraphNode id) of each, lines are the tensors between them. ``graph`` (optional) must be
    the graph that was folded; it names the picture. Returns ``path``.

    matplotlib is imported here (an Agg canvas: no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if graph is not None and len(graph.nodes) != folded.num_nodes:
        raise ValueError(f"draw_folded: the graph has {len(graph.nodes)} GraphNodes but the "
                         f"FoldedGraph was mined from {folded.num_nodes}; pass the graph "
                         "given to mine()")
    g = folded.to_networkx()
    units = sorted(g.nodes, key=lambda u: g.nodes[u]["first"])
    lanes = len(folded.templates) + (1 if folded.uncovered else 0)
    pos = {}
    for x, u in enumerate(units):
        t = g.nodes[u]["template"]
        pos[u] = (x, -(t if t is not None else len(folded.templates)))
    width = min(40.0, 3.0 + 0.3 * max(len(units), 10))
    fig = Figure(figsize=(width, 1.4 + 0.9 * max(lanes, 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for a, b in g.edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.plot([x0, x1], [y0, y1], color="#999999", linewidth=0.5, alpha=0.6, zorder=1)
    colors = _palette(len(folded.templates))
    max_size = max((t.size for t in folded.templates), default=1)
    for u in units:
        d = g.nodes[u]
        x, y = pos[u]
        if d["template"] is None:
            ax.scatter([x], [y], s=14, color="#888888", zorder=2)
        else:
            ax.scatter([x], [y], s=60 + 240 * d["size"] / max_size,
                       color=colors[d["template"]], edgecolors="black", linewidths=0.4,
                       zorder=2)
            ax.text(x, y, d["label"], ha="center", va="center", fontsize=5, zorder=3)
    ticks = [-t.id for t in folded.templates]
    labels = [f"T{t.id}: {t.size} nodes x {t.num_instances}" for t in folded.templates]
    if folded.uncovered:
        ticks.append(-len(folded.templates))
        labels.append(f"uncovered: {len(folded.uncovered)}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(-lanes + 0.5, 0.5)
    ax.set_xlim(-1, max(len(units), 1))
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("topological order", fontsize=8)
    name = graph.name if graph is not None else folded.graph_name
    ax.set_title(title or f"{name}: {folded.num_nodes} GraphNodes folded into "
                 f"{folded.num_templates} templates ({100 * folded.coverage:.1f}% covered)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _palette(n: int) -> list[Any]:
    from matplotlib import colormaps
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]
