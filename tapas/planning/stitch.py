"""Stitching (gp mode): the whole graph as a sequence of units, one step per template instance.

In:  a :class:`tapas.ir.Graph`, its :class:`tapas.mining.FoldedGraph`, the per-template
     results of the template enumeration (their candidates), the
     :class:`tapas.planning.table.PatternTable` and the
     :class:`tapas.planning.table.EdgeCoster`.
Out: the :class:`tapas.planning.frontier.Step` list that :func:`tapas.planning.frontier.run`
     enumerates, and each template's candidates as the stitch sees them (``TieOptions``).

Units. Every instance of a template is *one* step whose options are the template's
candidates: it reads the tensors that enter the instance and writes the ones read outside
it, so the frontier holds only the tensors between units (never the tensors inside a
layer) and the number of steps is the number of instances plus the GraphNodes no template
covers. Every instance takes the candidate its template chose at its first instance (a
*tie* kept in the frontier until the template's last instance). A candidate's internal
edges are valid by construction; their resharding, if any, is costed per instance.

Repeated runs. Deep stacks are long runs of identical instances (T0 T0 T0 ..., or T1 T2 T1
T2 ... in a decoder). :func:`repeated_runs` finds the runs whose periods are the same steps
with renamed keys (:class:`tapas.planning.frontier.Run`); the enumeration jumps over the
middle periods once one period maps its frontier onto itself, so the stitch's work stops
growing with depth.

Units are ordered topologically on the graph where each instance is contracted to one
vertex. An instance that cannot be contracted (a path leaves it and comes back into it
through another unit, so it cannot run as one step) has its template's GraphNodes
stitched one by one, still tied to one candidate.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tapas.ir import Graph, TensorInfo
from tapas.planning.frontier import Allowed, Run, Step, TieOptions
from tapas.planning.kept import kept_penalties
from tapas.planning.steps import producers, step_options
from tapas.planning.table import EdgeCoster, PatternTable
from tapas.sharding.placements import Placement

if TYPE_CHECKING:
    from tapas.mining import FoldedGraph, Template
    from tapas.planning.explore import TemplateResult

__all__ = ["UnitOption", "Unit", "units", "stitch_steps", "repeated_runs"]

# the longest period of template instances looked for (T5's decoder repeats every 2)
MAX_PERIOD = 4
# a run is used from this many periods on (shorter ones gain nothing from a jump)
MIN_PERIODS = 4


@dataclasses.dataclass(frozen=True)
class UnitOption:
    """One candidate of a template seen from outside one instance: the placement it wants
    on each tensor the instance reads from outside, the placement it leaves on each tensor
    read outside the instance, and the seconds of resharding on its internal edges."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    internal: float = 0.0


@dataclasses.dataclass(frozen=True)
class Unit:
    """A step of the stitch: one template instance (``template`` set, ``members`` in the
    template's position order) or one GraphNode (``members`` of length 1; ``template`` set
    when it belongs to an instance that is stitched node by node)."""

    members: tuple[int, ...]
    template: int | None = None
    position: int = 0           # a single GraphNode's position in its template
    whole: bool = False         # an instance taken as one step

    @property
    def first(self) -> int:
        return min(self.members)


def units(graph: Graph, folded: FoldedGraph) -> list[Unit]:
    """The stitch's units in a topological order (each instance contracted to one vertex;
    ties broken by the smallest GraphNode id). Templates with an instance that cannot be
    contracted are split into single GraphNodes."""
    split: set[int] = set()
    while True:
        found = _contracted(graph, folded, split)
        order = _topological(graph, found)
        if isinstance(order, list):
            return order
        split |= order            # templates of the units left on a cycle


def _contracted(graph: Graph, folded: FoldedGraph, split: set[int]) -> list[Unit]:
    """Every instance of the templates not in ``split`` as one unit; the rest single."""
    out: list[Unit] = []
    covered: set[int] = set()
    for t in folded.templates:
        for inst in t.instances:
            covered.update(inst)
            if t.id in split:
                out.extend(Unit((v,), t.id, p) for p, v in enumerate(inst))
            else:
                out.append(Unit(tuple(inst), t.id, 0, True))
    out.extend(Unit((n.id,)) for n in graph.nodes if n.id not in covered)
    return out


def _topological(graph: Graph, found: Sequence[Unit]) -> list[Unit] | set[int]:
    """``found`` in a topological order of the contracted graph, or, if contracting made a
    cycle, the templates of the whole-instance units that could not be ordered."""
    unit_of = {v: ui for ui, u in enumerate(found) for v in u.members}
    succ: list[set[int]] = [set() for _ in found]
    indegree = [0] * len(found)
    for e in graph.edges:
        a, b = unit_of[e.src], unit_of[e.dst]
        if a != b and b not in succ[a]:
            succ[a].add(b)
            indegree[b] += 1
    ready = [(u.first, ui) for ui, u in enumerate(found) if indegree[ui] == 0]
    heapq.heapify(ready)
    order: list[Unit] = []
    while ready:
        _, ui = heapq.heappop(ready)
        order.append(found[ui])
        for w in succ[ui]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(ready, (found[w].first, w))
    if len(order) == len(found):
        return order
    left = {ui for ui in range(len(found)) if indegree[ui] > 0}
    stuck = {found[ui].template for ui in left if found[ui].whole}
    if not stuck:   # cannot happen: without whole instances the contracted graph is the graph
        raise AssertionError(f"graph '{graph.name}' has a cycle through GraphNodes "
                             f"{sorted(v for ui in left for v in found[ui].members)[:10]}")
    return {t for t in stuck if t is not None}


# =========================================================================================
# Steps
# =========================================================================================

def _tie_options(graph: Graph, template: Template, result: TemplateResult, table: PatternTable,
                 penalty: float, readers: Mapping[str, set[int]]
                 ) -> list[tuple[tuple[int, ...], float]]:
    """A template's candidates as the stitch sees them: one per distinct boundary (cheapest
    first), costed by the patterns of its GraphNodes times the number of instances (edges
    are costed where the stitch meets them, per instance). ``readers``: tensor name -> the
    GraphNodes reading it."""
    prod = producers(graph)
    outputs = {t.name for t in graph.outputs}
    inst0 = template.instances[0]
    members = set(inst0)
    ext_in = [(p, j) for p, v in enumerate(inst0) for j, t in enumerate(graph.nodes[v].inputs)
              if prod.get(t.name, (None,))[0] not in members]
    ext_out = [(p, o) for p, v in enumerate(inst0) for o, t in enumerate(graph.nodes[v].outputs)
               if t.name in outputs or readers.get(t.name, set()) - members]
    seen: set[tuple[Placement, ...]] = set()
    out: list[tuple[tuple[int, ...], float]] = []
    for cand in result.candidates:
        infos = [table.infos[v][cand.patterns[p]] for p, v in enumerate(inst0)]
        boundary = tuple(infos[p].inputs[j] for p, j in ext_in) + \
            tuple(infos[p].outputs[o] for p, o in ext_out)
        if boundary in seen:
            continue
        seen.add(boundary)
        per_instance = math.fsum(i.cost(penalty) for i in infos)
        out.append((cand.patterns, per_instance * len(template.instances)))
    return out


@dataclasses.dataclass
class _Io:
    """What one unit reads from and writes for the other units."""

    reads: list[tuple[Any, TensorInfo, int, int]]     # (key, tensor, position, input index)
    writes: list[tuple[Any, int, int]]                # (key, position, output index)
    internal: list[tuple[TensorInfo, int, int, int, int]]  # (tensor, src pos, out, dst pos, in)


def _unit_io(graph: Graph, unit: Unit, prod: Mapping[str, tuple[int, int]]) -> _Io:
    pos = {v: p for p, v in enumerate(unit.members)}
    io = _Io([], [], [])
    for p, v in enumerate(unit.members):
        for j, t in enumerate(graph.nodes[v].inputs):
            src = prod.get(t.name)
            if src is not None and src[0] in pos:
                io.internal.append((t, pos[src[0]], src[1], p, j))
            else:
                io.reads.append((src if src is not None else ("x", t.name), t, p, j))
        for o in range(len(graph.nodes[v].outputs)):
            io.writes.append(((v, o), p, o))
    return io


def _unit_options(unit: Unit, io: _Io, writes: Sequence[tuple[Any, int, int]],
                  cands: Sequence[tuple[tuple[int, ...], float]], table: PatternTable,
                  edges: EdgeCoster, kept: Sequence[float]) -> tuple[UnitOption, ...]:
    """Each tie option of ``unit``'s template as a :class:`UnitOption` of this instance
    (``kept``: per internal edge, the memory penalty per byte a resharding grows it, or
    empty)."""
    out = []
    for patterns, _ in cands:
        infos = [table.infos[v][patterns[p]] for p, v in enumerate(unit.members)]
        internal = 0.0
        for e, (tensor, sp, so, dp, dj) in enumerate(io.internal):
            have, want = infos[sp].outputs[so], infos[dp].inputs[dj]
            if have != want:
                c = edges.cost(tensor, have, want)
                internal += math.inf if c is None else c
                if kept and kept[e]:
                    internal += kept[e] * edges.grown_bytes(tensor, have, want)
        out.append(UnitOption(tuple(infos[p].inputs[j] for _, _, p, j in io.reads),
                              tuple(infos[p].outputs[o] for _, p, o in writes), internal))
    return tuple(out)


def _options_key(unit: Unit, io: _Io, writes: Sequence[tuple[Any, int, int]],
                 table: PatternTable, kept: Sequence[float]) -> tuple[Any, ...]:
    """What :func:`_unit_options` reads of an instance: two instances of a template with
    the same key have the same options (the instances of a deep stack, but its first and
    last, which read or write other tensors). Positions hold GraphNodes of the same
    signature, whose pattern rows are equal unless constant filtering cut one (its length
    differs then)."""
    return (unit.template, tuple((p, j) for _, _, p, j in io.reads),
            tuple((p, o) for _, p, o in writes),
            tuple((t.shape, t.dtype, sp, so, dp, dj) for t, sp, so, dp, dj in io.internal),
            tuple(len(table.infos[v]) for v in unit.members), tuple(kept))


def stitch_steps(graph: Graph, folded: FoldedGraph, results: Sequence[TemplateResult],
                 table: PatternTable, edges: EdgeCoster, allowed: Allowed | None,
                 penalty: float) -> tuple[list[Step], TieOptions, list[Run]]:
    """The steps of the whole-graph stitch, the templates' tie options and the repeated
    runs of steps the enumeration may jump over."""
    by_id = {t.id: t for t in folded.templates}
    readers: dict[str, set[int]] = {}
    for e in graph.edges:
        readers.setdefault(e.tensor.name, set()).add(e.dst)
    tie_options = {r.template: _tie_options(graph, by_id[r.template], r, table, penalty,
                                            readers)
                   for r in results}
    order = units(graph, folded)
    prod = producers(graph)
    outputs = {t.name for t in graph.outputs}
    ios = [_unit_io(graph, u, prod) for u in order]
    last_read: dict[Any, int] = {}
    for ui, io in enumerate(ios):
        for key, *_ in io.reads:
            last_read[key] = ui
    last_unit = {u.template: ui for ui, u in enumerate(order) if u.template is not None}
    free = frozenset(k for k in last_read if k[0] == "x")
    drops_at: dict[int, list[Any]] = {}
    for key, ui in last_read.items():
        if not (isinstance(key[0], int) and graph.nodes[key[0]].outputs[key[1]].name in outputs):
            drops_at.setdefault(ui, []).append(key)
    steps = []
    options_of: dict[Any, tuple[UnitOption, ...]] = {}   # see _options_key
    penalties: dict[int, tuple[float, ...]] = {}

    def kept(v: int, j: int) -> float:      # the penalty on node v's input j, if kept
        if v not in penalties:
            penalties[v] = kept_penalties(graph.nodes[v], table.gradients, penalty)
        return penalties[v][j] if penalties[v] else 0.0
    for ui, (unit, io) in enumerate(zip(order, ios)):
        writes = [w for w in io.writes
                  if w[0] in last_read or graph.nodes[w[0][0]].outputs[w[0][1]].name in outputs]
        release = (unit.template,) if unit.template is not None and \
            last_unit[unit.template] == ui else ()
        common = dict(node=unit.members[0], reads=tuple((k, t) for k, t, _, _ in io.reads),
                      drops=tuple(drops_at.get(ui, ())), release=release, free=free,
                      kept=tuple(kept(unit.members[p], j) for _, _, p, j in io.reads)
                      if penalty else ())
        if unit.whole:
            assert unit.template is not None
            inner = tuple(kept(unit.members[dp], dj) for _, _, _, dp, dj in io.internal) \
                if penalty else ()
            key = _options_key(unit, io, writes, table, inner)
            infos = options_of.get(key)
            if infos is None:
                infos = options_of[key] = _unit_options(
                    unit, io, writes, tie_options[unit.template], table, edges, inner)
            steps.append(Step(**common, writes=tuple((i, w[0]) for i, w in enumerate(writes)),
                              options=(), tie=unit.template, members=unit.members,
                              infos=infos))
        else:
            v = unit.members[0]
            steps.append(Step(**common, writes=tuple((o, k) for k, _, o in writes),
                              options=step_options(table, graph.nodes[v], allowed, penalty),
                              tie=unit.template, tie_pos=unit.position))
    return steps, tie_options, repeated_runs(order, steps)


def repeated_runs(order: Sequence[Unit], steps: Sequence[Step]) -> list[Run]:
    """The runs of at least ``MIN_PERIODS`` repetitions of a period of at most
    ``MAX_PERIOD`` whole-instance steps, each period the previous one with renamed keys."""
    unit_of = {v: ui for ui, u in enumerate(order) for v in u.members}
    pos = {v: p for u in order for p, v in enumerate(u.members)}

    def kind(ui: int) -> int | None:
        u = order[ui]
        return u.template if u.whole else None

    def shifter(lo: int, hi: int, period: int) -> Any:
        def shift(key: Any, n: int) -> Any:
            if not isinstance(key[0], int):
                return key
            u = unit_of[key[0]]
            if not lo <= u < hi or not lo <= u + n * period < hi:
                return key
            return (order[u + n * period].members[pos[key[0]]], key[1])
        return shift

    runs: list[Run] = []
    i = 0
    while i < len(order):
        best: tuple[int, int, int] | None = None       # (steps covered, period, count)
        for period in range(1, MAX_PERIOD + 1):
            kinds = [kind(i + t) for t in range(period) if i + t < len(order)]
            if len(kinds) < period or None in kinds:
                break
            lo = i - period if i >= period and \
                all(kind(i - period + t) == kinds[t] for t in range(period)) else i
            count = 1
            while i + (count + 1) * period <= len(order):
                a = i + (count - 1) * period
                shift = shifter(lo, a + 2 * period, period)
                if not all(_same_step(steps[a + t], steps[a + period + t], shift)
                           for t in range(period)):
                    break
                count += 1
            if count >= MIN_PERIODS and (best is None or count * period > best[0]):
                best = (count * period, period, count)
        if best is None:
            i += 1
            continue
        _, period, count = best
        lo = i - period if i >= period and all(
            kind(i - period + t) == kind(i + t) for t in range(period)) else i
        runs.append(Run(i, period, count, shifter(lo, i + count * period, period)))
        i += count * period
    return runs


def _same_step(a: Step, b: Step, shift: Any) -> bool:
    """Whether step ``b`` is step ``a`` with its keys shifted by one period."""
    if not (a.members and b.members and a.tie == b.tie and a.infos == b.infos
            and a.release == b.release == () and a.free == b.free and a.kept == b.kept):
        return False
    if [(shift(k, 1), t.shape, t.dtype) for k, t in a.reads] != \
            [(k, t.shape, t.dtype) for k, t in b.reads]:
        return False
    if [(i, shift(k, 1)) for i, k in a.writes] != list(b.writes):
        return False
    return sorted(map(repr, (shift(k, 1) for k in a.drops))) == sorted(map(repr, b.drops))
