"""Strategy search: the best tensor-parallel plan for a model on a cluster (paper 4.4, 4.6).

In:  a :class:`tapas.ir.Graph` (or a Keras model and its input spec, captured here with
     ``tapas.capture``), a :class:`tapas.planning.cluster.Cluster` S(m, n) whose m * n
     devices form the 1-D mesh, a mode (``"gp"`` graph-pruned or ``"es"`` exhaustive) and
     :class:`tapas.planning.cost.CostOptions`.
Out: :class:`tapas.planning.strategy.Strategy` -- the chosen ShardingPattern name per
     GraphNode, the resharding collectives on edges, the placements of the graph inputs and
     outputs, the cost breakdown (per collective kind, forward/backward, per template), the
     memory per device, the ranked top-k alternatives, the named reference plans
     (Megatron, FFN-only, MHA-only, data parallel, replicate) with their costs, the counts
     of the enumeration and the time of each phase.

Pipeline (``search``): capture (a model only) -> mine (gp) -> pattern table (generation and
costing of every GraphNode's patterns, :mod:`tapas.planning.table`) -> enumeration
(:mod:`tapas.planning.explore`) -> validation (the exact cost and memory of the top plans;
plans over the memory budget are dropped, and if none fits the search is repeated with a
memory penalty) -> reference plans (:mod:`tapas.planning.references`) -> the Strategy.

Example (a hand-built graph; the patterns come from ``tapas.sharding.patterns``)::

    strategy = search(graph, cluster=Cluster.v100_ethernet(1, 8))
    print(strategy.summary())
    strategy.save("strategy.json")
    again = Strategy.load("strategy.json", graph)

``Strategy`` and the reference-plan helpers are re-exported here (``tapas.Strategy`` is
``tapas.planning.search.Strategy``).

This module imports no TensorFlow (capturing a Keras model imports it, lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tapas.ir import Graph, GraphNode, TensorInfo
from tapas.planning import explore as ex
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions, PlanCost
from tapas.planning.frontier import Allowed, Progress
from tapas.planning.precision import check_precision, graph_precision, resolve
from tapas.planning.references import (DATA_PARALLEL, REFERENCE_PLANS, applicable_references,
                                       node_roles, reference_filter)
from tapas.planning.steps import producers
from tapas.planning.strategy import Alternative, EdgeReshard, Strategy, graph_digest
from tapas.planning.table import (EdgeCoster, PatternsFn, PatternTable, ReshardFn, pattern_table,
                                  placed_weights)
from tapas.sharding.losses import LossSpec
from tapas.sharding.patterns.pattern import Family, PatternId
from tapas.sharding.placements import Placement, Replica

if TYPE_CHECKING:
    from tapas.mining import FoldedGraph

__all__ = ["search", "plan_with_weights", "GivenWeightsPlan", "Strategy", "EdgeReshard",
           "Alternative", "MemoryBudgetError",
           "graph_digest", "REFERENCE_PLANS", "reference_filter", "node_roles"]

# a plan whose every pattern is of these families splits no weight
_UNSPLIT_FAMILIES = (Family.REPLICATE, Family.BATCH, Family.FOLLOW)

# a plan, its exact cost and its resharded edges
Evaluated = tuple[ex.Plan, PlanCost, list[ex.Resharded]]


class MemoryBudgetError(ValueError):
    """No plan fits the per-device memory budget."""


def search(model_or_graph: Any, input_spec: Any = None, *, cluster: Cluster | None = None,
           mode: str = "gp", top_k: int = 5, options: CostOptions | None = None,
           memory_budget: float | None = None, explore_options: ex.ExploreOptions | None = None,
           references: Sequence[str] | None = None, folded: FoldedGraph | None = None,
           progress: Progress | None = None, patterns_fn: PatternsFn | None = None,
           reshard_fn: ReshardFn | None = None, loss: Any = None,
           precision: str | None = None) -> Strategy:
    """Find the best tensor-parallel strategy of a model (or captured graph) on ``cluster``.

    ``cluster`` defaults to one node of 8 V100 (``Cluster.v100_ethernet()``); its
    ``num_devices`` is the mesh size. ``mode`` is ``"gp"`` (mine, search each unique
    subgraph once) or ``"es"`` (the whole graph). ``memory_budget`` (bytes per device)
    defaults to the cluster's device memory. ``references`` names the reference plans to
    cost (default: all of REFERENCE_PLANS that apply to the graph). ``progress(phase,
    done, total, candidates)`` is called during long phases (every 2 s at most): steps
    done of the phase's total (templates while enumerating, units while stitching:
    instances and uncovered GraphNodes) and the candidates generated so far. ``loss`` (a
    ``keras.losses.Loss`` or a ``tapas.sharding.losses.LossSpec``) is the training loss
    whose collectives are priced on the output's placement (``CostOptions.loss``; default:
    ``options.loss``, which is None: not priced). ``precision`` (``"float32"``,
    ``"mixed_float16"``, ``"mixed_bfloat16"``; default ``options.precision``, None: the
    policy the model was captured under, read from its dtypes) prices the plans as if the
    model ran under that Keras dtype policy (``tapas.planning.precision``); the Strategy
    records the precision it was priced in.
    """
    timings: dict[str, float] = {}
    cluster = Cluster.v100_ethernet() if cluster is None else cluster
    budget, xopts = _checked_arguments(cluster, mode, top_k, memory_budget, explore_options)
    options = CostOptions.for_cluster(cluster) if options is None else options
    if loss is not None:
        options = dataclasses.replace(options, loss=LossSpec.of(loss))
    if precision is not None:
        options = dataclasses.replace(options, precision=check_precision(precision))
    graph = _graph_of(model_or_graph, input_spec, timings)
    options, _ = resolve(options, graph)
    with _gc_frozen():
        return _search_graph(graph, cluster, mode, budget, xopts, options, references, folded,
                             progress, patterns_fn, reshard_fn, timings)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Leave the objects alive when the search starts (the graph, whose size grows with the
    model's depth) out of the garbage collector's passes while it runs (``gc.freeze``).
    Each full pass scans every tracked object, which on deep stacks doubled the enumeration's
    time (``docs/search.md``); what the search allocates is still collected
    (the search freezes again once its per-GraphNode tables are built), and
    ``gc.unfreeze`` hands the frozen objects back to the collector afterwards."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _search_graph(graph: Graph, cluster: Cluster, mode: str, budget: float,
                  xopts: ex.ExploreOptions, options: CostOptions,
                  references: Sequence[str] | None, folded: FoldedGraph | None,
                  progress: Progress | None, patterns_fn: PatternsFn | None,
                  reshard_fn: ReshardFn | None, timings: dict[str, float]) -> Strategy:
    """:func:`search` on a captured graph, its arguments checked."""
    if mode == "gp" and folded is None:
        from tapas import mining
        t = time.perf_counter()
        folded = mining.mine(graph)
        timings["mining"] = time.perf_counter() - t
    n = cluster.num_devices
    table = pattern_table(graph, n, cluster, options, patterns_fn)
    gc.freeze()     # the folding and the table, also one entry per GraphNode (see _gc_frozen)
    timings["patterns"] = table.generate_seconds
    timings["costing"] = table.seconds - table.generate_seconds
    runner = _Runner(graph, cluster, mode, folded, options, table,
                     EdgeCoster(n, cluster, options, reshard_fn, xopts.allow_reshard,
                                table.gradients), progress)
    result = runner.explore(None, xopts)
    timings["enumeration"] = result.timings.get("enumeration", 0.0)
    if "stitching" in result.timings:
        timings["stitching"] = result.timings["stitching"]
    t = time.perf_counter()
    result, evaluated, fitting, rounds = _validate(runner, result, xopts, budget)
    timings["validation"] = time.perf_counter() - t
    best = min(fitting, key=lambda e: e[1].total)
    t = time.perf_counter()
    names = applicable_references(node_roles(graph)) if references is None else references
    refs = [_reference(runner, name, xopts, best[0], budget) for name in names]
    timings["references"] = time.perf_counter() - t
    return _strategy(runner, result, best, evaluated, refs, budget, rounds, timings)


def _checked_arguments(cluster: Any, mode: str, top_k: Any, memory_budget: float | None,
                       explore_options: ex.ExploreOptions | None
                       ) -> tuple[float, ex.ExploreOptions]:
    """The memory budget and explore options of a search, after checking its arguments."""
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster={cluster!r}: must be a tapas.planning.cost.Cluster, e.g. "
                        "Cluster.v100_ethernet(num_nodes=1, devices_per_node=8)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r}: must be an integer >= 1")
    if mode not in ex.MODES:
        raise ValueError(f"mode={mode!r}: use one of {ex.MODES} ('gp': graph-pruned on the "
                         "folded graph, 'es': exhaustive on the whole graph)")
    budget = float(cluster.device_memory if memory_budget is None else memory_budget)
    if not budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r}: must be a positive number of "
                         "bytes per device (default: the cluster's device memory)")
    xopts = explore_options or ex.ExploreOptions(top_k=top_k)
    if xopts.top_k != top_k:
        xopts = dataclasses.replace(xopts, top_k=top_k)
    return budget, xopts


def _graph_of(model_or_graph: Any, input_spec: Any, timings: dict[str, float]) -> Graph:
    """The graph to search: ``model_or_graph`` itself, or the capture of a Keras model."""
    graph = model_or_graph
    if not isinstance(graph, Graph):
        from tapas import capturing
        t = time.perf_counter()
        graph = capturing.capture(model_or_graph, input_spec)
        timings["capture"] = time.perf_counter() - t
    if not graph.nodes:
        raise ValueError(f"graph '{graph.name}' has no GraphNodes: nothing to search")
    return graph


@dataclasses.dataclass(frozen=True)
class _Runner:
    """One search's fixed inputs: explores with a restriction and evaluates plans."""

    graph: Graph
    cluster: Cluster
    mode: str
    folded: FoldedGraph | None
    options: CostOptions
    table: PatternTable
    edges: EdgeCoster
    progress: Progress | None

    def explore(self, allowed: Allowed | None, xo: ex.ExploreOptions) -> ex.ExploreResult:
        return ex.explore(self.graph, self.cluster.num_devices, self.cluster, mode=self.mode,
                          folded=self.folded, cost_options=self.options, options=xo,
                          table=self.table, reshard_fn=self.edges.reshard_fn,
                          allowed=allowed, progress=self.progress)

    def evaluate(self, plan: ex.Plan) -> Evaluated:
        return self.evaluate_all([plan])[0]

    def evaluate_all(self, plans: Sequence[ex.Plan]) -> list[Evaluated]:
        """The exact cost of each of ``plans`` (the later ones from the first's terms,
        ``tapas.planning.plancost.plan_costs``: the top plans differ in few GraphNodes)."""
        costed = ex.plan_costs(self.graph, self.table, [p.patterns for p in plans], self.edges)
        return [(p, pc, resh) for p, (pc, resh) in zip(plans, costed)]


def _validate(runner: _Runner, result: ex.ExploreResult, xopts: ex.ExploreOptions,
              budget: float
              ) -> tuple[ex.ExploreResult, list[Evaluated], list[Evaluated], int]:
    """The exact cost and memory of the top plans and those that fit ``budget``; when none
    does, explore again with a growing memory penalty. Returns the last result, its
    evaluated plans, the fitting ones and the number of penalty rounds."""
    evaluated = runner.evaluate_all(result.plans)
    fitting = [e for e in evaluated if e[1].memory.total <= budget]
    rounds = 0
    if fitting:
        return result, evaluated, fitting, rounds
    best_pc = evaluated[0][1]
    scale = best_pc.total / max(best_pc.memory.total, 1.0)

    def penalised(factor: float) -> tuple[ex.ExploreResult, list[Evaluated], list[Evaluated]]:
        xo = dataclasses.replace(xopts, memory_penalty=max(scale, 1e-15) * factor)
        res = runner.explore(None, xo)
        ev = runner.evaluate_all(res.plans)
        return res, ev, [e for e in ev if e[1].memory.total <= budget]
    # a budget under what no plan goes below is refused after one exploration (memory all
    # but minimised, for the error's smallest plan) instead of six (keras-hub Qwen3.5-MoE:
    # 220 s); otherwise the growing penalties, the first plan that fits wins
    if ex.memory_lower_bound(runner.graph, runner.table) > budget:
        last = penalised(1e6)
        if not last[2]:
            raise _memory_budget_error(runner, last[1], budget)
    for factor in (1.0, 10.0, 100.0, 1e3, 1e4, 1e6):
        rounds += 1
        result, evaluated, fitting = penalised(factor)
        if fitting:
            return result, evaluated, fitting, rounds
    raise _memory_budget_error(runner, evaluated, budget)


def _size(nbytes: float) -> str:
    """``nbytes`` in GiB from 0.1 GiB up, in MiB below (a budget of a few MiB read as
    "0.002 GiB" beside a plan of "0.002 GiB" that does not fit it)."""
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 0.1 * 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _memory_budget_error(runner: _Runner, evaluated: Sequence[Evaluated],
                         budget: float) -> MemoryBudgetError:
    graph, table = runner.graph, runner.table
    plan, pc, _ = min(evaluated, key=lambda e: e[1].memory.total)
    per_node = ex.node_memory(graph, table, plan.patterns)
    worst = max(range(len(per_node)), key=lambda v: per_node[v])
    return MemoryBudgetError(
        f"no strategy fits the memory budget of {_size(budget)} per device on "
        f"{runner.cluster.num_devices} devices: the smallest found needs "
        f"{_size(pc.memory.total)} ({pc.memory}); the largest share is GraphNode "
        f"{worst} '{graph.nodes[worst].name}' ({graph.nodes[worst].kind.value}, "
        f"{_size(per_node[worst])} with pattern "
        f"'{table.infos[worst][plan.patterns[worst]].name}'); use more "
        "devices, a smaller batch, or a larger memory_budget")


def _reference(runner: _Runner, name: str, xopts: ex.ExploreOptions, best: ex.Plan,
               budget: float) -> Alternative:
    """The reference plan ``name`` searched and costed, or why it cannot be built."""
    def unavailable(why: str) -> Alternative:
        return Alternative(name, math.inf, math.inf, math.inf, math.inf, False, {},
                           REFERENCE_PLANS[name], why)

    allowed = reference_filter(name, runner.graph)
    if runner.progress is not None:
        outer = runner.progress
        runner = dataclasses.replace(
            runner, progress=lambda phase, *counts: outer(f"reference {name}: {phase}", *counts))
    try:
        r = runner.explore(allowed, dataclasses.replace(xopts, top_k=1, memory_penalty=0.0))
    except ValueError as e:
        return unavailable(str(e))
    plan, pc, _ = runner.evaluate(r.best)
    infos = runner.table.infos
    if name == DATA_PARALLEL and not any(infos[v][p].data_parallel
                                         for v, p in enumerate(plan.patterns)):
        return unavailable(f"no GraphNode splits its batch over {runner.cluster.num_devices} "
                           "devices (batch size not divisible?)")
    return _alternative(name, runner.table, plan, pc, best, budget, REFERENCE_PLANS[name])


@dataclasses.dataclass(frozen=True)
class GivenWeightsPlan:
    """:func:`plan_with_weights`'s answer: the cheapest plan with the weights placed as
    given, its cost, the pattern name per GraphNode, and the weights whose given placement
    no pattern of theirs offers (left free, with why)."""

    cost: PlanCost
    patterns: tuple[PatternId, ...]
    unmapped: Mapping[str, str]


def plan_with_weights(graph: Graph, weights: Mapping[str, Any], *,
                      cluster: Cluster | None = None, options: CostOptions | None = None,
                      mode: str = "gp", folded: FoldedGraph | None = None
                      ) -> GivenWeightsPlan:
    """The cheapest plan of ``graph`` in which every weight named in ``weights`` (path ->
    ``Split(axis)``, ``Replica()`` or their text) is placed as given, the other GraphNodes'
    patterns chosen by the search: another system's plan (XLA's automatic sharding gives
    a placement per parameter) costed by this cost model. A weight whose given placement no
    pattern of a GraphNode reading it offers (a convolution kernel split on a spatial axis)
    is left free and listed in ``unmapped``; so are weights of one GraphNode given in a
    combination none of its patterns has (a convolution's kernel split on its output
    channels with the batch norm's scale of the same GraphNode replicated) and, in
    ``mode="gp"``, a weight of a repeated layer placed unlike the template's first instance
    (gp plans a template once)."""
    from tapas.sharding.placements import parse_placement
    cluster = Cluster.v100_ethernet() if cluster is None else cluster
    options = CostOptions.for_cluster(cluster) if options is None else options
    want = {path: parse_placement(p) for path, p in weights.items()}
    if mode == "gp" and folded is None:
        from tapas import mining
        folded = mining.mine(graph)
    n = cluster.num_devices
    table = pattern_table(graph, n, cluster, options)
    unmapped: dict[str, str] = {}
    for node in graph.nodes:
        for w in node.weights:
            if w.path in want and not any(dict(placed_weights(node, i)).get(w.path)
                                          == want[w.path] for i in table.infos[node.id]):
                offered = sorted({str(dict(placed_weights(node, i))[w.path])
                                  for i in table.infos[node.id]})
                unmapped[w.path] = (f"GraphNode '{node.name}' has no pattern placing it "
                                    f"{want[w.path]} (its patterns place it {offered})")
    fixed = {p: pl for p, pl in want.items() if p not in unmapped}

    def allowed(node: GraphNode, info: Any) -> bool:
        return all(fixed.get(path, pl) == pl for path, pl in placed_weights(node, info))

    runner = _Runner(graph, cluster, mode, folded, options, table,
                     EdgeCoster(n, cluster, options, gradients=table.gradients), None)
    result = runner.explore(allowed, ex.ExploreOptions(top_k=1))
    plan, pc, _ = runner.evaluate(result.best)
    names = tuple(table.infos[v][p].name for v, p in enumerate(plan.patterns))
    for v, p in enumerate(plan.patterns):
        for path, got in placed_weights(graph.nodes[v], table.infos[v][p]):
            if path in fixed and got != fixed[path] and path not in unmapped:
                unmapped[path] = (
                    f"placed {got}, not {fixed[path]}: no pattern of GraphNode "
                    f"'{graph.nodes[v].name}' places all of its weights as given together"
                    + (" (or it repeats a template whose first instance was placed "
                       "otherwise: mode='es' plans each GraphNode on its own)"
                       if mode == "gp" else ""))
    return GivenWeightsPlan(pc, names, unmapped)


def _alternative(name: str, table: PatternTable, plan: ex.Plan, pc: PlanCost, best: ex.Plan,
                 budget: float, description: str = "") -> Alternative:
    changes = {v: table.infos[v][p].name for v, p in enumerate(plan.patterns)
               if p != best.patterns[v]}
    return Alternative(name, pc.total, pc.communication, pc.compute, pc.memory.total,
                       pc.memory.total <= budget, changes, description)


# =========================================================================================
# The Strategy of the best plan
# =========================================================================================

def _strategy(runner: _Runner, result: ex.ExploreResult, best: Evaluated,
              evaluated: Sequence[Evaluated], refs: Sequence[Alternative], budget: float,
              rounds: int, timings: Mapping[str, float]) -> Strategy:
    graph, table, folded = runner.graph, runner.table, runner.folded
    best_plan, best_pc, best_resh = best
    exact, bound = _exactness(result)
    infos = [table.infos[v][p] for v, p in enumerate(best_plan.patterns)]
    alts = tuple(_alternative(f"#{i + 1}", table, p, pc, best_plan, budget)
                 for i, (p, pc, _) in enumerate(sorted(evaluated, key=lambda e: e[1].total)))
    cost_json = best_pc.to_json()
    cost_json["per_template"] = _per_unit(graph, infos, folded, best_resh, runner.edges)
    ins, outs = _boundary_placements(graph, infos)
    templates = () if folded is None else tuple(
        (t.id, t.name, tuple(tuple(i) for i in t.instances)) for t in folded.templates)
    return Strategy(
        graph_name=graph.name, graph_digest=graph_digest(graph), num_nodes=len(graph.nodes),
        num_devices=runner.cluster.num_devices, cluster=runner.cluster, mode=runner.mode,
        patterns=tuple(i.name for i in infos),
        edges=_edge_reshards(graph, runner.edges, best_resh),
        input_placements=ins, output_placements=outs, cost=cost_json, memory=best_pc.memory,
        memory_budget=budget, alternatives=alts, references=tuple(refs),
        timings={k: round(v, 6) for k, v in timings.items()},
        counts=_counts(graph, table, folded, result, rounds),
        templates=templates, exact=exact, bound=bound,
        notes=(_notes(graph, infos, budget, rounds) + _exact_notes(result, exact, bound)
               + _pattern_notes(graph, table)
               + _unruled_notes(graph)
               + _precision_notes(graph, runner.options)),
        precision=runner.options.precision or graph_precision(graph),
        weight_placements=_weight_splits(graph, infos), _graph=graph, _table=table)


def _edge_reshards(graph: Graph, edges: EdgeCoster, resharded: Sequence[ex.Resharded]
                   ) -> tuple[EdgeReshard, ...]:
    out = []
    for src, dst, j, have, want in resharded:
        tensor = graph.nodes[dst].inputs[j]
        kinds = tuple(f"{tm.kind.value} {'bwd' if tm.backward else 'fwd'}"
                      for tm in edges.terms(tensor, have, want))
        out.append(EdgeReshard(src, dst, j, tensor.name, have, want, kinds))
    return tuple(out)


def _boundary_placements(graph: Graph, infos: Sequence[ex.PatternInfo]
                         ) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """The placements of the graph inputs and outputs in the chosen plan."""
    prod = producers(graph)

    def placed(tensors: Sequence[TensorInfo]) -> dict[str, Placement]:
        out = {}
        for t in tensors:
            p = prod.get(t.name)
            if p is not None:
                out[t.name] = infos[p[0]].outputs[p[1]]
        return out
    return placed(graph.inputs), placed(graph.outputs)


def _counts(graph: Graph, table: PatternTable, folded: FoldedGraph | None,
            result: ex.ExploreResult, rounds: int) -> dict[str, Any]:
    counts: dict[str, Any] = result.counts.to_json()
    counts.update(templates=len(folded.templates) if folded is not None else 0,
                  units=(folded.num_unique if folded is not None else len(graph.nodes)),
                  signatures=table.signatures, penalty_rounds=rounds,
                  constant_nodes=len(table.constant),
                  per_template={f"T{r.template}": r.counts.to_json() for r in result.templates})
    if result.folded.joins:
        counts.update(folded_joins=result.folded.joins, folded_nodes=result.folded.nodes)
    return counts


def _exactness(result: ex.ExploreResult) -> tuple[bool, float | None]:
    """Whether the best plan is proven optimal, and else how far above the optimum it may
    be (a fraction of the lower bound; None: not bounded). A beam that cut only prefixes at
    least as costly as the best plan left the optimum in (costs only grow on a prefix)."""
    if result.exact:
        return True, None
    if result.lower is None:
        return False, None
    best = result.best.cost
    if result.lower >= best:
        return True, None
    return False, (best - result.lower) / result.lower if result.lower > 0 else None


def _exact_notes(result: ex.ExploreResult, exact: bool, bound: float | None
                 ) -> tuple[str, ...]:
    """Why the search is or is not exact, in words (folded branches, the beam's bound)."""
    notes = []
    if result.widened_from:
        notes.append(f"the beam of {result.widened_from} frontiers cut a prefix cheaper than "
                     "the plan it found, after fewer prefix extensions than "
                     f"ExploreOptions.widen_below: searched again with {ex.WIDEN}x as many")
    if result.folded.joins:
        notes.append(f"{result.folded.nodes} GraphNodes in independent branches were searched "
                     f"per branch and combined at their {result.folded.joins} join(s) "
                     "(tapas.planning.branches)")
    beam = result.counts.beam
    if exact and beam:
        notes.append(f"the beam cut {beam} prefixes, none cheaper than the chosen plan: it is "
                     "the optimum (the ranked alternatives after it may miss some plans)")
    elif not exact and bound is not None:
        cut = [f"T{r.template}" for r in result.templates if not r.exact]
        where = f" (in template(s) {', '.join(cut)}: per instance)" if cut else ""
        if not result.folded.exact:
            where += " (in folded branches: bounded with what the rest of the plan costs " \
                "at least)"
        notes.append(f"beam-limited: the beam (max_states) cut {beam} prefixes{where}, no "
                     f"plan through them below {result.lower * 1e3:.6g} ms, so the chosen "
                     "plan is at most "
                     f"{100 * bound:.3g}% above the optimum; raise "
                     "ExploreOptions(max_states=...) to narrow it")
    elif not exact:
        notes.append(f"beam-limited: the beam (max_states) cut {beam} prefixes and no plan "
                     "through them is proven to cost more than 0, so there is no bound on "
                     "the gap to the optimum; raise ExploreOptions(max_states=...)")
    return tuple(notes)


def _notes(graph: Graph, infos: Sequence[ex.PatternInfo], budget: float,
           rounds: int) -> tuple[str, ...]:
    notes = []
    if not any(node.weights for node in graph.nodes):
        notes.append("the model has no weights to shard: only data parallelism or "
                     "replication can apply")
    elif all(i.family in _UNSPLIT_FAMILIES for i in infos):
        notes.append("no weight is split in the chosen plan: data parallelism or replication "
                     "is cheapest here")
    if rounds:
        notes.append(f"the cheapest plans did not fit {budget / 2**30:.3f} GiB per device; "
                     f"searched again with a memory penalty ({rounds} round(s))")
    return tuple(notes)


def _precision_notes(graph: Graph, options: CostOptions) -> tuple[str, ...]:
    """A note when the plans were priced in another precision than the model's own."""
    if options.precision is None:
        return ()
    return (f"priced as if the model ran under {options.precision} (the precision "
            f"override); it was captured under {graph_precision(graph)}",)


def _pattern_notes(graph: Graph, table: ex.PatternTable) -> tuple[str, ...]:
    """One note per GraphNode some of whose patterns could not be built (they were left
    out of the search; the node kept the others, ``replicate`` at least)."""
    return tuple(f"GraphNode {node.id} '{node.name}' ({node.kind.value}): "
                 f"{table.infos[node.id][0].note}"
                 for node in graph.nodes
                 if table.infos[node.id] and table.infos[node.id][0].note)


def _unruled_notes(graph: Graph) -> tuple[str, ...]:
    """One note per GraphNode holding ops with no sharding rule (a py_function, a while
    loop, an FFT, a linear-algebra op): it is replicated, whatever the plan."""
    from tapas.sharding.rules import RULES
    out = []
    # a signature fixes the op types (tapas.ir.compute_signature): found once per signature
    unruled: dict[tuple[str, int], list[str]] = {}
    for node in graph.nodes:
        key = (node.signature, len(node.ops))
        types = unruled.get(key) if node.signature else None
        if types is None:
            types = unruled[key] = sorted({op.type for op in node.ops
                                           if op.type not in RULES and op.type != "Placeholder"})
        if types:
            out.append(f"GraphNode {node.id} '{node.name}' ({node.kind.value}): its ops of "
                       f"type {', '.join(types)} have no sharding rule "
                       "(tapas.sharding.rules), so they run whole on replicated inputs")
    return tuple(out)


def _weight_splits(graph: Graph, infos: Sequence[ex.PatternInfo]) -> dict[str, Placement]:
    """Weight path -> placement of every weight the chosen plan (``infos``, one per
    GraphNode) does not replicate."""
    return {path: pl for node, info in zip(graph.nodes, infos)
            for path, pl in placed_weights(node, info) if not isinstance(pl, Replica)}


def _per_unit(graph: Graph, infos: Sequence[ex.PatternInfo], folded: FoldedGraph | None,
              resharded: Sequence[ex.Resharded], edges: EdgeCoster) -> dict[str, float]:
    """Seconds per step by unit: each template (all its instances) and 'uncovered'."""
    unit = ["uncovered"] * len(graph.nodes)
    if folded is not None:
        for t in folded.templates:
            for inst in t.instances:
                for v in inst:
                    unit[v] = f"T{t.id}"
    out: dict[str, float] = {}
    for v, info in enumerate(infos):
        out[unit[v]] = out.get(unit[v], 0.0) + info.comm_time + info.compute_time
    for src, dst, j, have, want in resharded:
        t = graph.nodes[dst].inputs[j]
        out[unit[dst]] = out.get(unit[dst], 0.0) + (edges.cost(t, have, want) or 0.0)
    return dict(sorted(out.items()))
