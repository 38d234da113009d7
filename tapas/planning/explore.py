"""Strategy exploration: enumerate and validate combinations of sharding patterns (paper 4.4).

In:  a :class:`tapas.ir.Graph`, optionally its :class:`tapas.mining.FoldedGraph`, the number
     of devices N, a :class:`tapas.planning.cluster.Cluster` and :class:`tapas.planning.cost.CostOptions`.
Out: :class:`ExploreResult` -- the best whole-graph plans (one ShardingPattern index per
     GraphNode), ranked by the cost model, with the counts of what was enumerated and
     how long each phase took. ``tapas.search`` turns the best plan into a Strategy.

How it works (docs/search.md has the long version):

1. **Pattern table.** ``tapas.sharding.patterns.patterns_for`` lists the ShardingPatterns of every
   GraphNode (once per signature: identical GraphNodes have identical patterns); each is
   summarised as a :class:`PatternInfo` (placements as short strings, the seconds of its
   collectives and compute, its memory).
2. **Enumeration with early stopping.** The GraphNodes of a problem are visited in a
   topological order; a prefix (patterns chosen for the first i GraphNodes) is extended by
   each pattern of GraphNode i, and each producer -> consumer pair is checked as soon as
   both ends are chosen: the producer's output placement must equal what the consumer
   expects, or, when ``allow_reshard`` is on, an explicit resharding collective
   (``tapas.sharding.placements.reshard``) is inserted and costed. An invalid extension is abandoned at
   once (*pruned early*). Prefixes that leave the same placements on the tensors still to
   be read (the *frontier*) have the same valid completions, so only the ``k`` cheapest of
   them are extended further (*dominated* prefixes are dropped: dynamic programming, exact
   for the k best). ``max_states`` caps the number of distinct frontiers (a beam; if it
   ever cuts, the result says ``exact=False``).
3. **gp mode** (graph-pruned): each template of the FoldedGraph is enumerated once, on its
   first instance, with its external inputs free (the first consumer fixes their
   placement); the k best combinations per boundary (placements of its external inputs and
   outputs) become the template's *candidates*. Then the whole graph is stitched
   breadth-first from the graph inputs: uncovered GraphNodes choose among their patterns,
   every instance of a template takes the *same* candidate (the choice is made at the
   first instance and carried until the last), and every edge between units is checked
   and costed like any other pair.
4. **es mode** (exhaustive): the same enumeration on the whole graph, every GraphNode free.
   Its result is the exact optimum of the cost model; gp's is within a small gap of it at a
   fraction of the work (``benchmarks/bench_search.py``). ``time_limit`` stops it with
   :class:`SearchTimeout`.

Costs are the plan-level model of ``tapas.planning.cost``: per pattern, its collectives (eq. 1-4)
plus compute; per edge, the resharding collectives. Memory is not part of the ranking but
a plan over ``memory_budget`` is rejected (``tapas.search`` re-ranks with a memory
penalty until one fits).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tapas.planning import cost as cost_lib
from tapas.planning.cost import Cluster, CostOptions, CostTerm, MemoryEstimate
from tapas.ir import Graph, GraphNode, TensorInfo

__all__ = [
    "explore", "explore_template", "pattern_table", "plan_cost", "plan_memory",
    "PatternInfo", "PatternTable", "EdgeCoster", "Counts", "Candidate", "TemplateResult",
    "Plan", "ExploreResult", "ExploreOptions", "SearchTimeout", "MODES",
]

MODES = ("gp", "es")

# a long enumeration reports progress this often (seconds)
_PROGRESS_SECONDS = 2.0

# PatternsFn(node, graph, num_devices) -> list of ShardingPattern-like objects
PatternsFn = Callable[[GraphNode, Graph, int], Sequence[Any]]
# ReshardFn(src placement str, dst placement str, tensor) -> tuple of Comm-like objects;
# raises ValueError when no collective turns src into dst
ReshardFn = Callable[[str, str, TensorInfo], Sequence[Any]]
# Allowed(node, pattern name) -> bool: restricts the search (reference plans)
Allowed = Callable[[GraphNode, str], bool]


class SearchTimeout(RuntimeError):
    """The search ran past its time limit (``es`` on a large graph): it did not finish."""


@dataclasses.dataclass(frozen=True)
class ExploreOptions:
    """Knobs of the enumeration; the defaults keep T5-large's gp search in seconds."""

    # insert a costed resharding collective where placements differ; off: the pair is invalid
    allow_reshard: bool = True
    # whole-graph plans kept (and the k of the k-best per frontier)
    top_k: int = 5
    # candidates kept per template (best first), at most ``per_boundary`` per boundary
    max_candidates: int = 12
    per_boundary: int = 2
    # distinct frontiers kept per step (beam); beyond it the cheapest are kept, exact=False
    max_states: int = 4096
    # seconds before SearchTimeout (None: no limit)
    time_limit: float | None = None
    # seconds of memory penalty per byte per device added to a pattern's cost (0: none);
    # tapas.search raises it when the cheapest plans do not fit the memory budget
    memory_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("top_k", "max_candidates", "per_boundary", "max_states"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit={self.time_limit!r}: must be positive seconds or None")
        if not self.memory_penalty >= 0:
            raise ValueError(f"memory_penalty={self.memory_penalty!r}: must be >= 0")


# =========================================================================================
# Pattern table
# =========================================================================================

def placement_str(p: Any) -> str:
    """The short form of a placement object (``R``, ``S1``, ``P``)."""
    return p if isinstance(p, str) else str(p)


def split_axis(p: str) -> int | None:
    """The axis of a split placement string (``"S2"`` -> 2), None for R or P."""
    return int(p[1:]) if p.startswith("S") else None


def local_bytes(shape: Sequence[int] | None, dtype: str, placement: str, n: int) -> float:
    """Bytes one device holds of a tensor of global ``shape`` under ``placement``."""
    size = 1
    for d in shape or ():
        size *= d if d is not None and d > 0 else 1
    size *= cost_lib.DTYPE_BYTES.get(dtype, 4)
    return size / n if split_axis(placement) is not None else float(size)


@dataclasses.dataclass(frozen=True)
class PatternInfo:
    """What the search needs of one ShardingPattern of one GraphNode."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[tuple[str, str], ...]      # (weight path, placement)
    comm_terms: tuple[CostTerm, ...]
    comm_time: float
    compute_time: float
    flops: float
    memory: MemoryEstimate                    # this node's weights (untied) + activations

    def cost(self, memory_penalty: float = 0.0) -> float:
        c = self.comm_time + self.compute_time
        return c + memory_penalty * self.memory.total if memory_penalty else c


def _summarize(node: GraphNode, pattern: Any, n: int, cluster: Cluster,
               options: CostOptions) -> PatternInfo:
    terms = tuple(cost_lib.comm_cost(c, n, cluster, options,
                                     label=f"{node.name} [{pattern.name}] {c.tensor}")
                  for c in pattern.comms)
    outputs = tuple(placement_str(p) for p in pattern.outputs)
    weights = tuple((w.path, placement_str(pattern.weights.get(w.path, "R")))
                    for w in node.weights)
    mem = MemoryEstimate()
    for w, (_, pl) in zip(node.weights, weights):
        mem = mem + cost_lib.weight_memory(local_bytes(w.shape, w.dtype, pl, n), w.trainable,
                                           options)
    act = math.fsum(local_bytes(t.shape, t.dtype, pl, n) for t, pl in zip(node.outputs, outputs))
    mem = mem + MemoryEstimate(activations=act)
    flops = float(getattr(pattern, "flops", 0.0) or 0.0)
    return PatternInfo(
        name=pattern.name, inputs=tuple(placement_str(p) for p in pattern.inputs),
        outputs=outputs, weights=weights, comm_terms=terms,
        comm_time=math.fsum(t.total for t in terms),
        compute_time=cost_lib.compute_time(flops, cluster, options), flops=flops, memory=mem)


@dataclasses.dataclass(frozen=True)
class PatternTable:
    """The patterns of every GraphNode: ``infos[node_id]`` lists its PatternInfos in
    ``patterns_for`` order (a pattern's index is its position there)."""

    infos: tuple[tuple[PatternInfo, ...], ...]
    num_devices: int
    signatures: int          # distinct signatures for which patterns_for was called
    seconds: float
    options: CostOptions = dataclasses.field(default_factory=CostOptions)
    generate_seconds: float = 0.0   # of ``seconds``: inside patterns_for (the rest: costing)

    def index(self, node_id: int, name: str) -> int:
        for i, p in enumerate(self.infos[node_id]):
            if p.name == name:
                return i
        names = [p.name for p in self.infos[node_id]]
        raise KeyError(f"GraphNode {node_id} has no pattern {name!r}: it has {names}")


def default_patterns_fn() -> PatternsFn:
    from tapas.sharding import patterns
    return patterns.patterns_for


def pattern_table(graph: Graph, num_devices: int, cluster: Cluster,
                  options: CostOptions | None = None,
                  patterns_fn: PatternsFn | None = None) -> PatternTable:
    """Summarise every GraphNode's patterns, calling ``patterns_fn`` once per signature."""
    start = time.perf_counter()
    options = CostOptions() if options is None else options
    patterns_fn = patterns_fn or default_patterns_fn()
    by_sig: dict[str, tuple[GraphNode, tuple[Any, ...]]] = {}
    infos: list[tuple[PatternInfo, ...]] = []
    gen = 0.0
    for node in graph.nodes:
        key = node.signature or f"#{node.id}"
        if key not in by_sig:
            t = time.perf_counter()
            pats = tuple(patterns_fn(node, graph, num_devices))
            gen += time.perf_counter() - t
            if not pats:
                raise ValueError(f"patterns_for returned no pattern for GraphNode {node.id} "
                                 f"'{node.name}' ({node.kind.value}): every kind must at least "
                                 "offer 'replicate'")
            by_sig[key] = (node, pats)
            infos.append(tuple(_summarize(node, p, num_devices, cluster, options)
                               for p in pats))
            continue
        first, pats = by_sig[key]
        base = infos[first.id]
        # same signature: same placements and costs, only weight paths differ
        infos.append(tuple(dataclasses.replace(
            info, weights=tuple((w.path, pl) for w, (_, pl) in zip(node.weights, info.weights)))
            for info in base))
    return PatternTable(tuple(infos), num_devices, len(by_sig), time.perf_counter() - start,
                        options, gen)


# =========================================================================================
# Edges: resharding collectives
# =========================================================================================

def default_reshard_fn() -> ReshardFn:
    from tapas.sharding import placements

    def reshard(a: str, b: str, tensor: TensorInfo) -> Sequence[Any]:
        return placements.reshard(placements.parse_placement(a), placements.parse_placement(b), tensor.shape or (),
                           tensor.dtype, tensor.name)
    return reshard


class EdgeCoster:
    """The resharding collectives of an edge tensor between two placements, and their cost
    (cached by shape, dtype and placements). ``cost`` returns None where no collective
    turns one placement into the other, or where resharding is not allowed."""

    def __init__(self, num_devices: int, cluster: Cluster, options: CostOptions,
                 reshard_fn: ReshardFn | None = None, allow_reshard: bool = True) -> None:
        self.n, self.cluster, self.options = num_devices, cluster, options
        self.allow = allow_reshard
        self._fn = reshard_fn
        self._cache: dict[tuple[Any, ...], float | None] = {}

    @property
    def reshard_fn(self) -> ReshardFn:
        if self._fn is None:
            self._fn = default_reshard_fn()
        return self._fn

    def comms(self, tensor: TensorInfo, src: str, dst: str) -> tuple[Any, ...]:
        """The Comms turning ``src`` into ``dst`` (ValueError if none can)."""
        if src == dst:
            return ()
        return tuple(self.reshard_fn(src, dst, tensor))

    def terms(self, tensor: TensorInfo, src: str, dst: str, label: str = "") -> tuple[CostTerm, ...]:
        return tuple(cost_lib.comm_cost(c, self.n, self.cluster, self.options, label=label)
                     for c in self.comms(tensor, src, dst))

    def cost(self, tensor: TensorInfo, src: str, dst: str) -> float | None:
        if src == dst:
            return 0.0
        if not self.allow:
            return None
        key = (tensor.shape, tensor.dtype, src, dst)
        if key not in self._cache:
            try:
                terms = self.terms(tensor, src, dst)
                self._cache[key] = math.fsum(t.total for t in terms)
            except ValueError:
                self._cache[key] = None
        return self._cache[key]


# =========================================================================================
# Counts, candidates, plans
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Counts:
    """What an enumeration did. ``generated``: prefix extensions tried (a prefix plus one
    pattern); ``pruned_early``: of those, abandoned at once because a pair was invalid;
    ``costed``: valid extensions whose cost was computed; ``dominated``: valid prefixes
    dropped because k cheaper ones left the same frontier (or cut by the beam: ``beam``);
    ``valid``: complete valid combinations reached at the end; ``resharded``: costed
    extensions that needed a resharding collective on an edge to be valid."""

    generated: int = 0
    pruned_early: int = 0
    costed: int = 0
    dominated: int = 0
    beam: int = 0
    valid: int = 0
    resharded: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                              dataclasses.astuple(other))))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One valid combination for a template: pattern index per position, its internal cost
    (patterns + edges inside the instance) and its boundary placements."""

    patterns: tuple[int, ...]
    cost: float
    inputs: tuple[tuple[str, str], ...]     # (external tensor name, placement)
    outputs: tuple[tuple[str, str], ...]    # (tensor name, placement) read outside


@dataclasses.dataclass(frozen=True)
class TemplateResult:
    template: int
    size: int
    instances: int
    candidates: tuple[Candidate, ...]
    counts: Counts
    seconds: float
    exact: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """A whole-graph plan: ``patterns[node_id]`` is the index of its pattern in the table;
    ``cost`` the ranking cost (seconds per step, plus any memory penalty)."""

    patterns: tuple[int, ...]
    cost: float
    templates: tuple[tuple[int, int], ...] = ()   # (template id, candidate index) in gp


@dataclasses.dataclass(frozen=True)
class ExploreResult:
    mode: str
    plans: tuple[Plan, ...]
    table: PatternTable
    templates: tuple[TemplateResult, ...]
    counts: Counts            # everything: templates + stitching (gp) or the whole graph (es)
    stitch_counts: Counts
    timings: Mapping[str, float]
    exact: bool

    @property
    def best(self) -> Plan:
        return self.plans[0]


# =========================================================================================
# The enumeration engine
# =========================================================================================

@dataclasses.dataclass
class _Step:
    """One GraphNode of a problem: what it reads and writes and its options."""

    node: int
    reads: list[tuple[Any, TensorInfo]]            # (tensor key, tensor) per input
    writes: list[tuple[int, Any]]                  # (output index, key) kept in the frontier
    drops: list[Any]                               # keys read for the last time here
    options: list[tuple[int, float]]               # (pattern index, cost)
    tie: int | None = None                         # template whose candidate fixes this node
    tie_pos: int = 0
    release: list[int] = dataclasses.field(default_factory=list)   # ties to forget after
    free: frozenset[Any] = frozenset()             # keys set by their first reader


def _run(steps: Sequence[_Step], table: PatternTable, edges: EdgeCoster, k: int,
         max_states: int, deadline: float | None,
         tie_options: Mapping[int, Sequence[tuple[tuple[int, ...], float]]] | None = None,
         progress: Callable[[str, int, int], None] | None = None, phase: str = "enumeration",
         ) -> tuple[list[tuple[float, tuple[tuple[Any, str], ...], Any]], Counts, bool]:
    """Enumerate the steps in order; return the final (cost, frontier, path) entries.

    ``tie_options[t]`` lists template t's candidates as (pattern index per position, cost):
    the first step of template t branches over them (paying the cost), later steps of t
    take the chosen candidate's pattern at their position for free.
    """
    generated = pruned = costed = dominated = beamed = resharded = 0
    exact = True
    frontier: dict[tuple[tuple[Any, str], ...], list[tuple[float, Any]]] = {(): [(0.0, None)]}
    infos = table.infos
    next_report = time.perf_counter() + _PROGRESS_SECONDS
    for si, step in enumerate(steps):
        now = time.perf_counter()
        if progress is not None and now > next_report:
            progress(phase, si, len(steps))
            next_report = now + _PROGRESS_SECONDS
        if deadline is not None and now > deadline:
            raise SearchTimeout(f"enumeration stopped at GraphNode {si} of {len(steps)}: "
                                "time limit reached")
        nxt: dict[tuple[tuple[Any, str], ...], list[tuple[float, Any]]] = {}
        node_infos = infos[step.node]
        for state, entries in frontier.items():
            sd = dict(state)
            if step.tie is not None:
                tkey = ("tie", step.tie)
                chosen = sd.get(tkey)
                if chosen is None:
                    opts = [(ci, c[0][step.tie_pos], c[1], ci)
                            for ci, c in enumerate(tie_options[step.tie])]
                else:
                    opts = [(chosen, tie_options[step.tie][chosen][0][step.tie_pos], 0.0, None)]
            else:
                opts = [(pi, pi, c, None) for pi, c in step.options]
            for oi, pi, base, tie_set in opts:
                generated += len(entries)
                info = node_infos[pi]
                extra = base
                sets: dict[Any, str] = {}
                ok = True
                moved = False
                for (key, tensor), want in zip(step.reads, info.inputs):
                    have = sets.get(key) or sd.get(key)
                    if have is None:
                        if key in step.free:
                            sets[key] = want
                            continue
                        raise AssertionError(f"GraphNode {step.node} reads {key!r} before "
                                             "it is produced")
                    if have == want:
                        continue
                    c = edges.cost(tensor, have, want)
                    if c is None:
                        ok = False
                        break
                    extra += c
                    moved = True
                if not ok:
                    pruned += len(entries)
                    continue
                costed += len(entries)
                if moved:
                    resharded += len(entries)
                nd = dict(sd)
                nd.update(sets)
                for out_i, key in step.writes:
                    nd[key] = info.outputs[out_i]
                for key in step.drops:
                    nd.pop(key, None)
                if tie_set is not None:
                    nd[("tie", step.tie)] = tie_set
                for t in step.release:
                    nd.pop(("tie", t), None)
                ns = tuple(sorted(nd.items(), key=_item_key))
                bucket = nxt.setdefault(ns, [])
                for c, path in entries:
                    bucket.append((c + extra, (path, oi)))
        frontier = {}
        for ns, bucket in nxt.items():
            if len(bucket) > k:
                bucket.sort(key=lambda e: e[0])
                dominated += len(bucket) - k
                del bucket[k:]
            frontier[ns] = bucket
        if len(frontier) > max_states:
            ranked = sorted(frontier.items(), key=lambda kv: min(e[0] for e in kv[1]))
            for _, b in ranked[max_states:]:
                beamed += len(b)
            frontier = dict(ranked[:max_states])
            exact = False
    final = [(c, state, path) for state, entries in frontier.items() for c, path in entries]
    final.sort(key=lambda e: e[0])
    counts = Counts(generated, pruned, costed, dominated, beamed, len(final), resharded)
    return final, counts, exact


def _item_key(item: tuple[Any, str]) -> str:
    return repr(item[0])


def _unwind(path: Any, n: int) -> list[int]:
    out: list[int] = []
    while path is not None:
        path, oi = path
        out.append(oi)
    out.reverse()
    assert len(out) == n
    return out


# =========================================================================================
# Problems
# =========================================================================================

def _producers(graph: Graph) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        for i, t in enumerate(node.outputs):
            out[t.name] = (node.id, i)
    return out


def _options(table: PatternTable, node: GraphNode, allowed: Allowed | None,
             penalty: float) -> list[tuple[int, float]]:
    infos = table.infos[node.id]
    opts = [(i, p.cost(penalty)) for i, p in enumerate(infos)
            if allowed is None or allowed(node, p.name)]
    if not opts:   # a restriction that leaves nothing falls back to replication
        opts = [(i, p.cost(penalty)) for i, p in enumerate(infos) if p.name == "replicate"]
    return opts or [(i, p.cost(penalty)) for i, p in enumerate(infos)]


def _node_steps(graph: Graph, order: Sequence[int], table: PatternTable,
                allowed: Allowed | None, penalty: float,
                keep_outputs: Callable[[int, int, TensorInfo], bool]) -> list[_Step]:
    """Steps for ``order`` (a topologically ordered subset of GraphNodes). A tensor from a
    GraphNode outside the subset is an external key, set by its first reader; a written
    tensor stays in the frontier until its last reader in the subset, or to the end when
    ``keep_outputs(node, index, tensor)`` (read outside, or a graph output)."""
    prod = _producers(graph)
    inside = set(order)
    last_read: dict[Any, int] = {}
    reads_of: list[list[tuple[Any, TensorInfo]]] = []
    free: set[Any] = set()
    for i, v in enumerate(order):
        reads = []
        for t in graph.nodes[v].inputs:
            src = prod.get(t.name)
            if src is not None and src[0] in inside:
                key: Any = src
            else:
                key = ("x", t.name)
                free.add(key)
            reads.append((key, t))
            last_read[key] = i
        reads_of.append(reads)
    kept: set[Any] = set()
    writes_of: list[list[tuple[int, Any]]] = []
    for i, v in enumerate(order):
        writes = []
        for oi, t in enumerate(graph.nodes[v].outputs):
            key = (v, oi)
            keep = keep_outputs(v, oi, t)
            if keep:
                kept.add(key)
            if keep or key in last_read:
                writes.append((oi, key))
        writes_of.append(writes)
    drops_at: dict[int, list[Any]] = {}
    for key, i in last_read.items():
        if key not in kept and key not in free:
            drops_at.setdefault(i, []).append(key)
    return [_Step(node=v, reads=reads_of[i], writes=writes_of[i], drops=drops_at.get(i, []),
                  options=_options(table, graph.nodes[v], allowed, penalty),
                  free=frozenset(free))
            for i, v in enumerate(order)]


def _consumers(graph: Graph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in graph.edges:
        out.setdefault(e.tensor.name, []).append(e.dst)
    return out


def explore_template(graph: Graph, template: Any, table: PatternTable, edges: EdgeCoster,
                     options: ExploreOptions, allowed: Allowed | None = None,
                     deadline: float | None = None) -> TemplateResult:
    """Enumerate the combinations of one template (on its first instance); keep the best
    ``options.per_boundary`` per boundary, ``options.max_candidates`` in all."""
    start = time.perf_counter()
    inst = tuple(template.instances[0])
    members = set(inst)
    consumers = _consumers(graph)
    graph_outputs = {t.name for t in graph.outputs}

    def keep(v: int, oi: int, t: TensorInfo) -> bool:
        return t.name in graph_outputs or any(c not in members for c in consumers.get(t.name, ()))

    order = sorted(inst)   # ids are topological
    steps = _node_steps(graph, order, table, allowed, options.memory_penalty, keep)
    final, counts, exact = _run(steps, table, edges, max(options.per_boundary, 1),
                                options.max_states, deadline)
    cands: list[Candidate] = []
    per: dict[tuple[Any, ...], int] = {}
    for c, state, path in final:
        if per.get(state, 0) >= options.per_boundary:
            continue
        per[state] = per.get(state, 0) + 1
        chosen = _unwind(path, len(order))
        by_node = dict(zip(order, chosen))
        pats = tuple(by_node[v] for v in inst)
        ins = tuple((k[1], pl) for k, pl in state if isinstance(k, tuple) and k[0] == "x")
        outs = tuple((graph.nodes[k[0]].outputs[k[1]].name, pl) for k, pl in state
                     if isinstance(k, tuple) and isinstance(k[0], int))
        cands.append(Candidate(pats, c, ins, outs))
        if len(cands) >= options.max_candidates:
            break
    return TemplateResult(template.id, len(inst), len(template.instances), tuple(cands),
                          counts, time.perf_counter() - start, exact)


def _whole_graph_steps(graph: Graph, table: PatternTable, allowed: Allowed | None,
                       penalty: float) -> list[_Step]:
    outputs = {t.name for t in graph.outputs}
    return _node_steps(graph, [n.id for n in graph.nodes], table, allowed, penalty,
                       lambda v, oi, t: t.name in outputs)


def explore(graph: Graph, num_devices: int, cluster: Cluster, *, mode: str = "gp",
            folded: Any = None, cost_options: CostOptions | None = None,
            options: ExploreOptions | None = None, table: PatternTable | None = None,
            patterns_fn: PatternsFn | None = None, reshard_fn: ReshardFn | None = None,
            allowed: Allowed | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> ExploreResult:
    """Find the ``options.top_k`` cheapest valid plans of ``graph`` on ``num_devices``.

    ``mode`` ``"gp"`` needs ``folded`` (``tapas.mine(graph)``; mined here if None);
    ``"es"`` enumerates the whole graph. ``allowed(node, pattern_name)`` restricts the
    patterns (a node left with none falls back to ``"replicate"``). ``progress(phase,
    done, total)`` is called as templates finish.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES} ('gp': graph-pruned on the "
                         "folded graph, 'es': exhaustive on the whole graph)")
    cost_options = CostOptions() if cost_options is None else cost_options
    options = ExploreOptions() if options is None else options
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    deadline = None if options.time_limit is None else t0 + options.time_limit
    if table is None:
        table = pattern_table(graph, num_devices, cluster, cost_options, patterns_fn)
        timings["patterns"] = table.generate_seconds
        timings["costing"] = table.seconds - table.generate_seconds
    edges = EdgeCoster(num_devices, cluster, cost_options, reshard_fn, options.allow_reshard)
    if not graph.nodes:
        raise ValueError(f"graph '{graph.name}' has no GraphNodes: nothing to search")

    if mode == "es":
        t = time.perf_counter()
        steps = _whole_graph_steps(graph, table, allowed, options.memory_penalty)
        final, counts, exact = _run(steps, table, edges, options.top_k, options.max_states,
                                    deadline, progress=progress)
        timings["enumeration"] = time.perf_counter() - t
        plans = _plans_from(final, steps, options.top_k, len(graph.nodes))
        if not plans:
            raise ValueError(_no_plan_message(graph, options))
        return ExploreResult("es", plans, table, (), counts, counts, timings, exact)

    if folded is None:
        from tapas import mining
        t = time.perf_counter()
        folded = mining.mine(graph)
        timings["mining"] = time.perf_counter() - t
    t = time.perf_counter()
    results = []
    for i, tpl in enumerate(folded.templates):
        res = explore_template(graph, tpl, table, edges, options, allowed, deadline)
        if not res.candidates:
            raise ValueError(f"template T{tpl.id} ('{tpl.name}', {tpl.size} GraphNodes) has "
                             "no valid combination of patterns; " + _no_plan_message(graph, options))
        results.append(res)
        if progress is not None:
            progress("enumeration", i + 1, len(folded.templates))
    timings["enumeration"] = time.perf_counter() - t
    t = time.perf_counter()
    steps, tie_options = _stitch_steps(graph, folded, results, table, allowed,
                                       options.memory_penalty)
    final, scounts, sexact = _run(steps, table, edges, options.top_k, options.max_states,
                                  deadline, tie_options, progress, "stitching")
    timings["stitching"] = time.perf_counter() - t
    plans = _plans_from(final, steps, options.top_k, len(graph.nodes), tie_options)
    if not plans:
        raise ValueError(_no_plan_message(graph, options))
    total = scounts
    for r in results:
        total = total + r.counts
    return ExploreResult("gp", plans, table, tuple(results), total, scounts, timings,
                         sexact and all(r.exact for r in results))


def _stitch_steps(graph: Graph, folded: Any, results: Sequence[TemplateResult],
                  table: PatternTable, allowed: Allowed | None, penalty: float,
                  ) -> tuple[list[_Step], dict[int, list[tuple[tuple[int, ...], float]]]]:
    """Whole-graph steps where each template's GraphNodes follow one tied candidate."""
    steps = _whole_graph_steps(graph, table, allowed, penalty)
    prod = _producers(graph)
    cons = _consumers(graph)
    outputs = {t.name for t in graph.outputs}
    where: dict[int, tuple[int, int, int]] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t in folded.templates:
        for j, inst in enumerate(t.instances):
            for p, v in enumerate(inst):
                where[v] = (t.id, j, p)
                first[t.id] = min(first.get(t.id, v), v)
                last[t.id] = max(last.get(t.id, v), v)
    tie_options: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for r in results:
        # the candidate's patterns, costed per instance: node costs only (edges are costed
        # where the stitch meets them, inside an instance as between units)
        tie_options[r.template] = []
        tpl = next(t for t in folded.templates if t.id == r.template)
        inst0 = tpl.instances[0]
        members = set(inst0)
        ext_in = [(p, j) for p, v in enumerate(inst0) for j, t in enumerate(graph.nodes[v].inputs)
                  if prod.get(t.name, (None,))[0] not in members]
        ext_out = [(p, o) for p, v in enumerate(inst0) for o, t in enumerate(graph.nodes[v].outputs)
                   if t.name in outputs or any(c not in members for c in cons.get(t.name, ()))]
        seen: set[tuple[str, ...]] = set()
        for cand in r.candidates:   # cheapest first; the stitch only sees the boundary
            infos = [table.infos[v][cand.patterns[p]] for p, v in enumerate(inst0)]
            boundary = tuple(infos[p].inputs[j] for p, j in ext_in) + \
                tuple(infos[p].outputs[o] for p, o in ext_out)
            if boundary in seen:
                continue
            seen.add(boundary)
            per_instance = math.fsum(i.cost(penalty) for i in infos)
            tie_options[r.template].append((cand.patterns, per_instance * len(tpl.instances)))
    for step in steps:
        w = where.get(step.node)
        if w is None:
            continue
        tid, _, pos = w
        step.tie, step.tie_pos = tid, pos
        if step.node == last[tid]:
            step.release.append(tid)
    # a tie first met at a node other than the template's smallest id is still handled:
    # the first step of the template (in order) branches, whichever position it is
    return steps, tie_options


def _plans_from(final: Sequence[tuple[float, Any, Any]], steps: Sequence[_Step], top_k: int,
                num_nodes: int,
                tie_options: Mapping[int, Sequence[tuple[tuple[int, ...], float]]] | None = None,
                ) -> tuple[Plan, ...]:
    plans = []
    seen = set()
    for c, _, path in final:
        chosen = _unwind(path, len(steps))
        pats = [0] * num_nodes
        ties: dict[int, int] = {}
        for step, oi in zip(steps, chosen):
            if step.tie is not None:
                ties.setdefault(step.tie, oi)
                pats[step.node] = tie_options[step.tie][oi][0][step.tie_pos]
            else:
                pats[step.node] = oi
        key = tuple(pats)
        if key in seen:
            continue
        seen.add(key)
        plans.append(Plan(key, c, tuple(sorted(ties.items()))))
        if len(plans) >= top_k:
            break
    return tuple(plans)


def _no_plan_message(graph: Graph, options: ExploreOptions) -> str:
    fix = ("allow resharding (allow_reshard=True)" if not options.allow_reshard
           else "check the patterns of its GraphNodes (tapas.sharding.patterns.explain)")
    return (f"no valid plan for graph '{graph.name}': every combination of patterns has a "
            f"producer/consumer pair whose placements cannot meet; {fix}")


# =========================================================================================
# Exact cost of a whole plan
# =========================================================================================

def plan_cost(graph: Graph, table: PatternTable, patterns: Sequence[int], edges: EdgeCoster,
              ) -> tuple[cost_lib.PlanCost, list[tuple[int, int, int, str, str]]]:
    """The exact cost of one whole-graph plan and its resharded edges.

    Returns the PlanCost (every pattern's collectives, every edge's resharding collectives,
    compute, memory) and the edges that reshard as ``(src, dst, input index, from, to)``.
    Raises ValueError if an edge cannot be resharded.
    """
    prod = _producers(graph)
    terms: list[CostTerm] = []
    compute = 0.0
    resharded = []
    for node in graph.nodes:
        info = table.infos[node.id][patterns[node.id]]
        terms.extend(info.comm_terms)
        compute += info.compute_time
        for j, (t, want) in enumerate(zip(node.inputs, info.inputs)):
            src = prod.get(t.name)
            if src is None:
                continue
            have = table.infos[src[0]][patterns[src[0]]].outputs[src[1]]
            if have == want:
                continue
            if not edges.allow:
                raise ValueError(f"edge {src[0]} -> {node.id} ({t.name}): {have} != {want} "
                                 "and resharding is off")
            terms.extend(edges.terms(t, have, want,
                                     label=f"reshard {t.name} {have}->{want} for {node.name}"))
            resharded.append((src[0], node.id, j, have, want))
    mem = plan_memory(graph, table, patterns)
    return cost_lib.PlanCost(cost_lib.CostBreakdown(terms), compute, mem), resharded


def plan_memory(graph: Graph, table: PatternTable, patterns: Sequence[int],
                options: CostOptions | None = None) -> MemoryEstimate:
    """Per-device memory of a plan: each weight once (a tied weight at its largest local
    size), its gradient and optimizer state, and every GraphNode's outputs."""
    options = table.options if options is None else options
    n = table.num_devices
    weights: dict[str, tuple[float, bool]] = {}
    act = 0.0
    for node in graph.nodes:
        info = table.infos[node.id][patterns[node.id]]
        for w, (_, pl) in zip(node.weights, info.weights):
            b = local_bytes(w.shape, w.dtype, pl, n)
            if w.path not in weights or weights[w.path][0] < b:
                weights[w.path] = (b, w.trainable)
        act += info.memory.activations
    mem = MemoryEstimate(activations=act)
    for b, trainable in weights.values():
        mem = mem + cost_lib.weight_memory(b, trainable, options)
    return mem


def node_memory(graph: Graph, table: PatternTable, patterns: Sequence[int]) -> list[float]:
    """Bytes per device attributable to each GraphNode (its weights, untied, and outputs)."""
    return [table.infos[v][patterns[v]].memory.total for v in range(len(graph.nodes))]


def iter_plan_names(graph: Graph, table: PatternTable, patterns: Sequence[int]
                    ) -> Iterable[tuple[int, str]]:
    for node in graph.nodes:
        yield node.id, table.infos[node.id][patterns[node.id]].name
