"""Strategy exploration: the best whole-graph combinations of sharding patterns (paper 4.4).

In:  a :class:`tapas.ir.Graph`, optionally its :class:`tapas.mining.FoldedGraph`, the number
     of devices N, a :class:`tapas.planning.cluster.Cluster` and
     :class:`tapas.planning.cost.CostOptions`.
Out: :class:`ExploreResult` -- the best whole-graph plans (one ShardingPattern index per
     GraphNode), ranked by the cost model, with the counts of what was enumerated and
     how long each phase took; :func:`plan_cost` and :func:`plan_memory`, the exact cost
     and memory of one plan (:mod:`tapas.planning.plancost`, re-exported here).
     ``tapas.search`` turns the best plan into a Strategy.

How it works (docs/search.md has the long version):

1. **Pattern table** (:mod:`tapas.planning.table`). ``tapas.sharding.patterns.patterns_for``
   lists the ShardingPatterns of every GraphNode (once per signature: identical GraphNodes
   have identical patterns); each is summarised as a ``PatternInfo`` (typed placements,
   family, the seconds of its collectives and compute, its memory).
2. **Enumeration with early stopping** (:mod:`tapas.planning.frontier`). The GraphNodes of
   a problem are visited in a topological order; a prefix (patterns chosen for the first i
   GraphNodes) is extended by each pattern of GraphNode i, and each producer -> consumer
   pair is checked as soon as both ends are chosen: the producer's output placement must
   equal what the consumer expects, or, when ``allow_reshard`` is on, an explicit
   resharding collective (``tapas.sharding.placements.reshard``) is inserted and costed.
   An invalid extension is abandoned at once (*pruned early*). Prefixes that leave the same
   placements on the tensors still to be read (the *frontier*) have the same valid
   completions, so only the ``k`` cheapest of them are extended further (*dominated*
   prefixes are dropped: dynamic programming, exact for the k best). ``max_states`` caps
   the number of distinct frontiers (a beam; if it ever cuts, the result says
   ``exact=False`` and ``lower`` bounds the optimum from the cheapest prefix it cut).
   Where the frontier could outgrow the beam, independent branches are searched alone and
   folded into their join (:mod:`tapas.planning.branches`); a prefix their own beams cut
   bounds the optimum with what the rest of the problem costs at least
   (``Folded.cut_below``).
3. **gp mode** (graph-pruned): each template of the FoldedGraph is enumerated once, on its
   first instance, with its external inputs free (the first consumer fixes their
   placement); the k best combinations per boundary (placements of its external inputs and
   outputs) become the template's *candidates*. Then the whole graph is stitched
   (:mod:`tapas.planning.stitch`): each template instance is one step whose options are
   the template's candidates, every instance of a template takes the *same* candidate (the
   choice is made at the first instance and carried until the last), uncovered GraphNodes
   choose among their patterns, and every edge between units is checked and costed like
   any other pair.
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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tapas.ir import Graph, TensorInfo
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.branches import Folded, chosen, fold_branches
from tapas.planning.frontier import (Allowed, Counts, Progress, SearchTimeout, Step, TieOptions,
                                     Run, lower_bound, run, unwind)
from tapas.planning.plancost import (Resharded, memory_lower_bound, node_memory, plan_cost,
                                     plan_costs, plan_memory, weight_reshard_terms)
from tapas.planning.steps import consumers, good_order, node_steps, producers
from tapas.planning.stitch import stitch_steps
from tapas.planning.table import (EdgeCoster, PatternInfo, PatternsFn, PatternTable, ReshardFn,
                                  pattern_table)
from tapas.sharding.placements import Placement

if TYPE_CHECKING:
    from tapas.mining import FoldedGraph, Template

__all__ = [
    "explore", "explore_template", "pattern_table", "plan_cost", "plan_costs", "plan_memory",
    "node_memory", "memory_lower_bound", "weight_reshard_terms",
    "PatternInfo", "PatternTable", "EdgeCoster", "Counts", "Candidate", "TemplateResult",
    "Plan", "ExploreResult", "ExploreOptions", "SearchTimeout", "MODES", "WIDEN", "Allowed",
    "PatternsFn", "ReshardFn", "Resharded",
]

MODES = ("gp", "es")



# how much wider the beam of a search again is (ExploreOptions.widen_below)
WIDEN = 4


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
    # search independent branches per branch and combine them at their join
    # (tapas.planning.branches); off: every branch's tensors in the frontier
    fold_branches: bool = True
    # an enumeration whose beam cut a prefix cheaper than its best plan after fewer than
    # this many prefix extensions is run once more with a beam WIDEN times as wide
    # (0: never)
    widen_below: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("top_k", "max_candidates", "per_boundary", "max_states", "widen_below"):
            v, least = getattr(self, name), 0 if name == "widen_below" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name}={v!r}: must be an integer >= {least}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit={self.time_limit!r}: must be positive seconds or None")
        if not self.memory_penalty >= 0:
            raise ValueError(f"memory_penalty={self.memory_penalty!r}: must be >= 0")


# =========================================================================================


# =========================================================================================
# Candidates, plans, results
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Candidate:
    """One valid combination for a template: pattern index per position, its internal cost
    (patterns + edges inside the instance) and its boundary placements."""

    patterns: tuple[int, ...]
    cost: float
    inputs: tuple[tuple[str, Placement], ...]     # (external tensor name, placement)
    outputs: tuple[tuple[str, Placement], ...]    # (tensor name, placement) read outside


@dataclasses.dataclass(frozen=True)
class TemplateResult:
    """The enumeration of one template: its candidates, best first, and what it did."""

    template: int
    size: int
    instances: int
    candidates: tuple[Candidate, ...]
    counts: Counts
    seconds: float
    exact: bool
    cut_below: float = math.inf   # the cheapest prefix (one instance) the beam cut


@dataclasses.dataclass(frozen=True)
class Plan:
    """A whole-graph plan: ``patterns[node_id]`` is the index of its pattern in the table;
    ``cost`` the ranking cost (seconds per step, plus any memory penalty)."""

    patterns: tuple[int, ...]
    cost: float
    templates: tuple[tuple[int, int], ...] = ()   # (template id, candidate index) in gp


@dataclasses.dataclass(frozen=True)
class ExploreResult:
    """The plans found, cheapest first, with the table, per-template results and counts."""

    mode: str
    plans: tuple[Plan, ...]
    table: PatternTable
    templates: tuple[TemplateResult, ...]
    counts: Counts            # everything: templates + stitching (gp) or the whole graph (es)
    timings: Mapping[str, float]
    exact: bool
    # no plan is cheaper than this (the best plan's cost when exact; when a beam cut, the
    # cheapest prefix it cut, if cheaper: per instance times the instances in a template,
    # plus what the rest costs at least in a folded branch, Folded.cut_below)
    lower: float | None = None
    folded: Folded = Folded()   # branches folded into their joins (tapas.planning.branches)
    widened_from: int | None = None   # the beam first tried, when searched again wider

    @property
    def proven(self) -> bool:
        """Whether the best plan is the optimum: nothing cut, or nothing cheaper cut."""
        return self.exact or (self.lower is not None and self.lower >= self.best.cost)

    @property
    def best(self) -> Plan:
        return self.plans[0]


# =========================================================================================
# Templates
# =========================================================================================

def explore_template(graph: Graph, template: Template, table: PatternTable, edges: EdgeCoster,
                     options: ExploreOptions, allowed: Allowed | None = None,
                     deadline: float | None = None) -> TemplateResult:
    """Enumerate the combinations of one template (on its first instance); keep the best
    ``options.per_boundary`` per boundary, ``options.max_candidates`` in all."""
    start = time.perf_counter()
    inst = tuple(template.instances[0])
    members = set(inst)
    readers = consumers(graph)
    graph_outputs = {t.name for t in graph.outputs}

    def keep(v: int, oi: int, t: TensorInfo) -> bool:
        return t.name in graph_outputs or any(c not in members for c in readers.get(t.name, ()))

    order = good_order(graph, inst)
    steps = node_steps(graph, order, table, allowed, options.memory_penalty, keep)
    k = max(options.per_boundary, 1)
    if options.fold_branches:
        steps, _, branches = fold_branches(graph, steps, table, edges, k, options.max_states,
                                           deadline, allowed, options.memory_penalty)
    else:
        branches = Folded()
    final, counts, exact, cut = run(steps, table, edges, k, options.max_states, deadline)
    counts, exact = counts + branches.counts, exact and branches.exact
    cut = min(cut, branches.cut_below)
    cands: list[Candidate] = []
    per: dict[tuple[Any, ...], int] = {}
    for c, state, path in final:
        if per.get(state, 0) >= options.per_boundary:
            continue
        per[state] = per.get(state, 0) + 1
        by_node = dict(p for step, oi in zip(steps, unwind(path, len(steps)))
                       for p in chosen(step, oi))
        pats = tuple(by_node[v] for v in inst)
        ins = tuple((k[1], pl) for k, pl in state if isinstance(k, tuple) and k[0] == "x")
        outs = tuple((graph.nodes[k[0]].outputs[k[1]].name, pl) for k, pl in state
                     if isinstance(k, tuple) and isinstance(k[0], int))
        cands.append(Candidate(pats, c, ins, outs))
        if len(cands) >= options.max_candidates:
            break
    return TemplateResult(template.id, len(inst), len(template.instances), tuple(cands),
                          counts, time.perf_counter() - start, exact, cut)


def _whole_graph_steps(graph: Graph, table: PatternTable, allowed: Allowed | None,
                       penalty: float) -> list[Step]:
    outputs = {t.name for t in graph.outputs}
    return node_steps(graph, good_order(graph, [n.id for n in graph.nodes]), table, allowed,
                      penalty, lambda v, oi, t: t.name in outputs)


def _plans_from(final: Sequence[tuple[float, Any, Any]], steps: Sequence[Step], top_k: int,
                num_nodes: int, tie_options: TieOptions | None = None) -> tuple[Plan, ...]:
    """The distinct whole-graph plans of the final entries, cheapest first, at most top_k."""
    plans = []
    seen = set()
    for c, _, path in final:
        pats = [0] * num_nodes
        ties: dict[int, int] = {}
        for step, oi in zip(steps, unwind(path, len(steps))):
            if step.tie is not None:
                assert tie_options is not None
                ties.setdefault(step.tie, oi)
                picked = tie_options[step.tie][oi][0]
                if step.members:        # a whole instance: one pattern per position
                    for v, pi in zip(step.members, picked):
                        pats[v] = pi
                else:
                    pats[step.node] = picked[step.tie_pos]
            else:
                for v, pi in chosen(step, oi):    # with a join's folded branches
                    pats[v] = pi
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
# explore
# =========================================================================================

def explore(graph: Graph, num_devices: int, cluster: Cluster, *, mode: str = "gp",
            folded: FoldedGraph | None = None, cost_options: CostOptions | None = None,
            options: ExploreOptions | None = None, table: PatternTable | None = None,
            patterns_fn: PatternsFn | None = None, reshard_fn: ReshardFn | None = None,
            allowed: Allowed | None = None, progress: Progress | None = None) -> ExploreResult:
    """Find the ``options.top_k`` cheapest valid plans of ``graph`` on ``num_devices``.

    ``mode`` ``"gp"`` needs ``folded`` (``tapas.mine(graph)``; mined here if None);
    ``"es"`` enumerates the whole graph. ``allowed(node, pattern_info)`` restricts the
    patterns (a node left with none falls back to its replicate pattern). ``progress(phase,
    done, total)`` is called as templates finish.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES} ('gp': graph-pruned on the "
                         "folded graph, 'es': exhaustive on the whole graph)")
    cost_options = CostOptions.for_cluster(cluster) if cost_options is None else cost_options
    options = ExploreOptions() if options is None else options
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    deadline = None if options.time_limit is None else t0 + options.time_limit
    if table is None:
        table = pattern_table(graph, num_devices, cluster, cost_options, patterns_fn)
        timings["patterns"] = table.generate_seconds
        timings["costing"] = table.seconds - table.generate_seconds
    edges = EdgeCoster(num_devices, cluster, cost_options, reshard_fn, options.allow_reshard,
                       table.gradients)
    if not graph.nodes:
        raise ValueError(f"graph '{graph.name}' has no GraphNodes: nothing to search")
    problem = _Problem(graph, table, edges, options, allowed, deadline, progress, timings)
    if mode == "es":
        result = _explore_es(problem)
    else:
        if folded is None:
            from tapas import mining
            t = time.perf_counter()
            folded = mining.mine(graph)
            timings["mining"] = time.perf_counter() - t
        result = _explore_gp(problem, folded)
    if result.proven or result.counts.generated >= options.widen_below:
        return result
    left = None if deadline is None else deadline - time.perf_counter()
    if left is not None and left <= 0:
        return result
    try:
        wide = explore(graph, num_devices, cluster, mode=mode, folded=folded,
                       cost_options=cost_options, table=table, reshard_fn=reshard_fn,
                       allowed=allowed, progress=progress,
                       options=dataclasses.replace(options,
                                                   max_states=options.max_states * WIDEN,
                                                   widen_below=0, time_limit=left))
    except SearchTimeout:       # the time limit ends the second run: the first stands
        return result
    return _widened(result, wide, options.max_states)


def _widened(narrow: ExploreResult, wide: ExploreResult, beam: int) -> ExploreResult:
    """The search again with a wider beam, its counts and timings added to the first
    one's; the first one's plans where they were cheaper (a beam is not monotone), and
    the higher of the two lower bounds on the optimum (both hold)."""
    timings = {k: narrow.timings.get(k, 0.0) + wide.timings.get(k, 0.0)
               for k in {**narrow.timings, **wide.timings}}
    best = wide if wide.best.cost <= narrow.best.cost else narrow
    lowers = [r.lower for r in (narrow, wide) if r.lower is not None]
    return dataclasses.replace(best, counts=narrow.counts + wide.counts, timings=timings,
                               lower=max(lowers) if lowers else None, widened_from=beam)


@dataclasses.dataclass(frozen=True)
class _Problem:
    """What both modes of :func:`explore` share; ``timings`` is filled as phases end."""

    graph: Graph
    table: PatternTable
    edges: EdgeCoster
    options: ExploreOptions
    allowed: Allowed | None
    deadline: float | None
    progress: Progress | None
    timings: dict[str, float]


def _explore_es(pb: _Problem) -> ExploreResult:
    """es: one enumeration of the whole graph, every GraphNode free."""
    t = time.perf_counter()
    steps = _whole_graph_steps(pb.graph, pb.table, pb.allowed, pb.options.memory_penalty)
    steps, _, folded = _fold(pb, steps)
    final, counts, exact, cut = run(steps, pb.table, pb.edges, pb.options.top_k,
                                    pb.options.max_states, pb.deadline, progress=pb.progress)
    pb.timings["enumeration"] = time.perf_counter() - t
    plans = _plans_from(final, steps, pb.options.top_k, len(pb.graph.nodes))
    if not plans:
        raise ValueError(_no_plan_message(pb.graph, pb.options))
    lower = lower_bound(final, min(cut, folded.cut_below))
    return ExploreResult("es", plans, pb.table, (), counts + folded.counts, pb.timings,
                         exact and folded.exact, lower, folded)


def _fold(pb: _Problem, steps: list[Step], tie_options: TieOptions | None = None
          ) -> tuple[list[Step], list[int], Folded]:
    """``steps`` with independent branches folded into their joins
    (:mod:`tapas.planning.branches`)."""
    if not pb.options.fold_branches:
        return steps, list(range(len(steps))), Folded()
    return fold_branches(pb.graph, steps, pb.table, pb.edges, pb.options.top_k,
                         pb.options.max_states, pb.deadline, pb.allowed,
                         pb.options.memory_penalty, tie_options)


def _explore_gp(pb: _Problem, folded: FoldedGraph) -> ExploreResult:
    """gp: every template once, then the whole graph stitched with tied instances."""
    t = time.perf_counter()
    results = []
    for i, tpl in enumerate(folded.templates):
        res = explore_template(pb.graph, tpl, pb.table, pb.edges, pb.options, pb.allowed,
                               pb.deadline)
        if not res.candidates:
            raise ValueError(f"template T{tpl.id} ('{tpl.name}', {tpl.size} GraphNodes) has "
                             "no valid combination of patterns; "
                             + _no_plan_message(pb.graph, pb.options))
        results.append(res)
        if pb.progress is not None:
            pb.progress("enumeration", i + 1, len(folded.templates),
                        sum(r.counts.generated for r in results))
    pb.timings["enumeration"] = time.perf_counter() - t
    t = time.perf_counter()
    steps, tie_options, runs = stitch_steps(pb.graph, folded, results, pb.table, pb.edges,
                                            pb.allowed, pb.options.memory_penalty)
    steps, kept, branches = _fold(pb, steps, tie_options)
    if len(kept) != len(steps) or kept != list(range(len(kept))):
        runs = _renumbered(runs, kept)
    final, scounts, sexact, cut = run(steps, pb.table, pb.edges, pb.options.top_k,
                                      pb.options.max_states, pb.deadline, tie_options,
                                      pb.progress, "stitching", runs)
    pb.timings["stitching"] = time.perf_counter() - t
    plans = _plans_from(final, steps, pb.options.top_k, len(pb.graph.nodes), tie_options)
    if not plans:
        raise ValueError(_no_plan_message(pb.graph, pb.options))
    total = scounts + branches.counts
    for r in results:
        total = total + r.counts
    # a combination a template's beam cut costs at least its cut per instance, in every
    # instance: no plan using one is cheaper than that times the instances
    for r in results:
        cut = min(cut, r.cut_below * r.instances)
    exact = sexact and branches.exact and all(r.exact for r in results)
    return ExploreResult("gp", plans, pb.table, tuple(results), total, pb.timings, exact,
                         lower_bound(final, min(cut, branches.cut_below)), branches)


def _renumbered(runs: Sequence[Run], kept: Sequence[int]) -> list[Run]:
    """``runs`` over the steps left after folding (``kept``: their old indices): a run's
    steps are whole instances, never folded, so each moves down by the steps removed
    before it."""
    new_index = {old: new for new, old in enumerate(kept)}
    return [dataclasses.replace(r, start=new_index[r.start]) for r in runs]
