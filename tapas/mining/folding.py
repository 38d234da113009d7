"""The mining driver: fold a GraphNode graph into its unique repeated subgraphs (paper 4.3).

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

import contextlib
import dataclasses
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from absl import logging

from tapas.ir import Graph, Kind
from tapas.mining.apriori import Accept, Index, Pattern, apriori, count_nonoverlapping
from tapas.mining.folded import FoldedGraph, LevelStats, MiningStats, RoundStats, Subgraph
from tapas.mining.selection import layer_parts, make_template, merge_isomorphic, select
from tapas.mining.window import Window, make_window

#: Default ``min_size``: a template holds at least this many GraphNodes. Smaller repeated
#: pieces (a lone residual add, a norm feeding one dense) are cheap to search on their own
#: and would only multiply the templates; Figure 10 (scripts/figure10_minsize.py) shows
#: the result is the same for every value from 2 up to the size of the smallest layer.
DEFAULT_MIN_SIZE = 3

# Progress is logged at INFO (absl) once mining has run this long, at DEBUG before.
_LOG_SECONDS = 5.0


# =========================================================================================
# Entry points
# =========================================================================================

def mine(graph: Graph, min_support: int | None = None, min_size: int = DEFAULT_MIN_SIZE, *,
         max_rounds: int | None = None, match_ports: bool = True, closure: bool = True,
         tiling_guard: bool = True, split_layers: bool = True, window: bool = True,
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
        and a MoE layer) into one template per layer (see ``layer_parts``).
      window: mine a deep stack of identical layers on a window of a few of its layers and
        expand what is found onto the whole stack (:mod:`tapas.mining.window`): the same
        folding, in time that does not grow with depth. False: Apriori on every layer.
      progress: called with each level's :class:`LevelStats` as soon as it is done.

    Returns:
      a :class:`FoldedGraph`.
    """
    _check_args(min_support, min_size, max_rounds)
    with _without_cycle_collection():
        return _mine(graph, min_support, min_size, max_rounds, match_ports, window,
                     _Options(min_size, closure, tiling_guard, split_layers, progress,
                              time.perf_counter()))


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Pause the garbage collector's automatic passes (``gc.disable``) while mining.

    Mining allocates many small objects (embeddings, frontiers, patterns) that reference
    counting frees (they form no cycles), and each automatic pass scans every tracked
    object, the graph's index included: on T5 at 48 layers per stack those passes cost
    as much as mining the window itself. The previous state is restored afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _mine(graph: Graph, min_support: int | None, min_size: int, max_rounds: int | None,
          match_ports: bool, window: bool, opts: _Options) -> FoldedGraph:
    """:func:`mine` with its arguments checked."""
    start = opts.start
    n = len(graph.nodes)
    index = Index(graph, match_ports)
    layers = detect_layers(graph)
    active = [graph.nodes[v].kind != Kind.INPUT for v in range(n)]
    chosen: list[_Chosen] = []
    levels: list[LevelStats] = []
    rounds: list[RoundStats] = []
    r = 0
    while max_rounds is None or r < max_rounds:
        r += 1
        nodes = [v for v in range(n) if active[v]]
        if min_support is not None:
            support, source = min_support, "given"
        else:
            support = layers if r == 1 else detect_layers(graph, nodes)
            source = "detected layers"
        if support < 2 or len(nodes) < max(min_size, 2) or min_size > len(nodes):
            break
        t0 = time.perf_counter()
        found = None
        if window:
            win = make_window(index, nodes, support)
            if win is not None:
                found = _round(graph, win.index, win.nodes, support, r, opts, active, win)
        if found is None:
            found = _round(graph, index, nodes, support, r, opts, active, None)
        frequent, entries, round_levels, skipped = found
        levels.extend(round_levels)
        covered = 0
        for entry in entries:
            for inst in entry[1]:
                for v in inst:
                    active[v] = False
                covered += len(inst)
        chosen.extend(entries)
        rounds.append(RoundStats(round=r, min_support=support, min_support_source=source,
                                 nodes=len(nodes), frequent=frequent, templates=len(entries),
                                 covered=covered, seconds=time.perf_counter() - t0,
                                 copies_skipped=skipped))
        logging.log(logging.INFO if rounds[-1].seconds > _LOG_SECONDS else logging.DEBUG,
                    "mine %s round %d: min_support %d, %d nodes (%d copies skipped), %d "
                    "frequent subgraphs, %d templates covering %d nodes, %.3f s", graph.name,
                    r, support, len(nodes), skipped, frequent, len(entries), covered,
                    rounds[-1].seconds)
        if not entries:
            break
    stats = MiningStats(levels=tuple(levels), rounds=tuple(rounds), layers_detected=layers,
                        seconds=time.perf_counter() - start)
    first_support = min_support if min_support is not None else max(layers, 1)
    return _folded(graph, index, chosen, first_support, min_size, stats)


@dataclasses.dataclass(frozen=True)
class _Options:
    """mine()'s arguments that every round uses."""

    min_size: int
    closure: bool
    tiling_guard: bool
    split_layers: bool
    progress: Callable[[LevelStats], None] | None
    start: float


def _round(graph: Graph, index: Index, nodes: list[int], support: int, r: int,
           opts: _Options, active: list[bool], win: Window | None
           ) -> tuple[int, list[_Chosen], list[LevelStats], int] | None:
    """One mining round over ``nodes``: Apriori, selection, layer splitting. On a window
    (``win``: ``index`` and ``nodes`` are the window's) the templates are expanded onto the
    whole graph, or None is returned when that is not possible (the caller then mines the
    whole graph). Returns (frequent subgraphs, chosen templates with their instances on the
    whole graph, level statistics, copies skipped)."""
    levels: list[LevelStats] = []
    support_here = support if win is None else win.support
    frequent = _search_round(graph, index, nodes, support_here, r, opts.closure,
                             opts.tiling_guard, levels, opts.progress, opts.start,
                             None if win is None else win.accept)
    in_window = active if win is None else [a and v not in win.gone
                                            for v, a in enumerate(active)]
    whole = None if win is None else (lambda embs: win.expand(embs, strict=False))
    picked = select(index, frequent, support, opts.min_size, in_window, whole)
    entries = _templates(graph, index, picked, support, r, opts.min_size, opts.split_layers,
                         win)
    if entries is None or (win is not None and not _disjoint(entries, active)):
        return None
    return len(frequent), entries, levels, 0 if win is None else win.removed


# (labels, instances, min_support, round, support) of one chosen template
# (labels, instances, min_support, round, support) of one chosen template
_Chosen = tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]


def _check_args(min_support: int | None, min_size: int, max_rounds: int | None) -> None:
    if min_support is not None and (not isinstance(min_support, int) or min_support < 2):
        raise ValueError(f"min_support={min_support!r}: must be an integer >= 2 (a subgraph "
                         "that occurs once folds nothing); pass None to use the number of "
                         "layers detected in the model")
    if not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size={min_size!r}: must be an integer >= 1 (the fewest "
                         f"GraphNodes a template may hold; default {DEFAULT_MIN_SIZE})")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r}: must be >= 1 or None (until done)")


def _search_round(graph: Graph, index: Index, nodes: list[int], support: int, r: int,
                  closure: bool, tiling_guard: bool, levels: list[LevelStats],
                  progress: Callable[[LevelStats], None] | None,
                  start: float, accept: Accept | None = None) -> list[Pattern]:
    """One round of Apriori over ``nodes``: its frequent subgraphs; each level's statistics
    are appended to ``levels``, logged and passed to ``progress``."""
    frequent: list[Pattern] = []
    for stats, level in apriori(index, nodes, support, closure=closure,
                                tiling_guard=tiling_guard, round_no=r, accept=accept):
        levels.append(stats)
        frequent.extend(level)
        logging.log(logging.INFO if time.perf_counter() - start > _LOG_SECONDS
                    else logging.DEBUG,
                    "mine %s round %d level %d: %d candidates, %d frequent, %.3f s",
                    graph.name, r, stats.level, stats.candidates, stats.frequent,
                    stats.seconds)
        if progress is not None:
            progress(stats)
    return frequent


def _templates(graph: Graph, index: Index, picked: list[tuple[Pattern, list[tuple[int, ...]]]],
               support: int, r: int, min_size: int, split_layers: bool, win: Window | None
               ) -> list[_Chosen] | None:
    """The round's templates (cut into layers when ``split_layers``) with their instances
    and support; on a window, expanded onto the whole graph (None if the instances do not
    repeat copy by copy around the cut)."""
    out: list[_Chosen] = []
    for pat, insts in picked:
        parts = (layer_parts(graph, index, pat, insts, min_size) if split_layers
                 else [list(range(pat.size))])
        for part in parts:
            sub: list[tuple[int, ...]] | None = [tuple(e[p] for p in part) for e in insts]
            embs = pat.embs if len(parts) == 1 else [tuple(e[p] for p in part)
                                                     for e in pat.embs]
            if win is not None:
                if not win.periodic(sub):
                    return None
                sub = win.expand(sub)
                if sub is None:
                    return None
                embs = win.expand(embs, strict=False)
            out.append((tuple(pat.labels[p] for p in part), sub, support, r,
                        count_nonoverlapping(embs)))
    return out


def _disjoint(entries: list[_Chosen], active: list[bool]) -> bool:
    """Whether the instances are pairwise disjoint and cover only active GraphNodes."""
    seen: set[int] = set()
    for entry in entries:
        for inst in entry[1]:
            for v in inst:
                if v in seen or not active[v]:
                    return False
                seen.add(v)
    return True


def _folded(graph: Graph, index: Index, chosen: list[_Chosen], first_support: int,
            min_size: int, stats: MiningStats) -> FoldedGraph:
    """The FoldedGraph of the chosen templates (isomorphic ones merged)."""
    chosen = merge_isomorphic(index, chosen)
    templates = tuple(make_template(i, graph, index, labels, insts, support, rnd, sup)
                      for i, (labels, insts, support, rnd, sup) in enumerate(chosen))
    in_template = {v for t in templates for inst in t.instances for v in inst}
    n = len(graph.nodes)
    uncovered = tuple(v for v in range(n) if v not in in_template)
    edges = tuple(sorted({(e.src, e.dst) for e in graph.edges if e.src != e.dst}))
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
    index = Index(graph, match_ports)
    if nodes is None:
        nodes = [v for v, nd in enumerate(graph.nodes) if nd.kind != Kind.INPUT]
    for _, level in apriori(index, list(nodes), min_support, closure=closure,
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
        # a run of at most eq.sum() matches spans at most eq.sum() + p: when that is short
        # of the best span, this period cannot win (a stack's many periods that are not
        # its layer's end here)
        if int(np.count_nonzero(eq)) + p < best[0]:
            continue
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
