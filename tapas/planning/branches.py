"""Branch folding: independent branches searched alone and combined at their join.

In:  the steps of an enumeration (:class:`tapas.planning.frontier.Step`, one GraphNode
     each, from :func:`tapas.planning.steps.node_steps` or the stitch), the graph, the
     :class:`tapas.planning.table.PatternTable`, the
     :class:`tapas.planning.table.EdgeCoster` and the k best to keep.
Out: :func:`fold_branches`: the same problem with every foldable branch taken out of the
     step list and folded into the options of the GraphNode that joins it, and a
     :class:`Folded` summary (how many GraphNodes were folded, what the branches'
     enumerations counted and whether they were exact).

A *branch* of a join J is a set of GraphNodes whose outputs are read only inside the set or
by J, whose own inputs are graph inputs read only inside the set or constant-filtered
tensors (fixed replicated), and which holds no graph output: DLRM's embedding tables each
with its id input, the towers of a multi-input model. It may also read up to
:data:`MAX_ENTRIES` tensors that other GraphNodes read too, its *entries* (the block input
all four Inception branches read). Nothing outside the branch sees its choices but J,
through the placements of the tensors J reads from it. So the branch is enumerated alone,
once per placement of its entries (fixed), keeping its k best plans per pattern of J, and
for each placement of the entries and each pattern of J the k cheapest combinations of its
branches (each: a branch plan plus the resharding of its tensors to what J's pattern reads)
become J's options, with the branches' patterns attached (:attr:`Step.folded`); J reads
the entries, and its options follow the placements its frontier holds (or, for an entry no
step has set yet, J sets it). The enumeration then never holds a branch's tensors in its frontier: a join of b
branches with p placements each costs b * p work instead of a frontier of p ** b states.
The k best whole plans are the same as without folding (the k best of a sum of
independent parts are among the sums of each part's k best).

Joins that fold at least two branches are folded; a join with a single branch only when,
without the fold, the branch's tensors could outgrow the beam beside tensors from outside
it (:func:`_mixes`: the MoE block beside the block input and the residual its last add
reads). Nothing is folded when the frontier could not outgrow the beam without it
(:func:`frontier_bound`: the product, over the tensors live after a step, of the
placements each may take): where the beam cannot cut, the plain enumeration is already
exact and is left as it was, ties between equally cheap alternatives included.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tapas.ir import Graph, TensorInfo
from tapas.planning.frontier import Counts, Step, run, unwind
from tapas.planning.kept import kept_penalties
from tapas.planning.steps import consumers, good_order, node_steps, producers
from tapas.planning.table import EdgeCoster, PatternTable

__all__ = ["Folded", "Branch", "find_branches", "fold_branches", "frontier_bound", "chosen"]

# a branch's plans kept per join option, and the combinations per join pattern
_Combo = tuple[float, tuple[tuple[int, int], ...]]


@dataclasses.dataclass(frozen=True)
class Folded:
    """What :func:`fold_branches` did: the joins folded, the GraphNodes taken out of the
    enumeration, the counts of the branches' own enumerations, whether each of them
    kept every frontier (no beam cut), and ``cut_below``: no plan of the whole problem
    that goes through a branch prefix their beams cut costs less (inf: none was cut)."""

    joins: int = 0
    nodes: int = 0
    counts: Counts = Counts()
    exact: bool = True
    cut_below: float = math.inf


@dataclasses.dataclass(frozen=True)
class Branch:
    """GraphNodes read only among themselves or by their join; ``entries``: the tensors
    (frontier keys) they read from the rest of the graph, at most :data:`MAX_ENTRIES`."""

    members: frozenset[int]
    entries: tuple[Any, ...] = ()              # frontier keys
    tensors: tuple[TensorInfo, ...] = ()       # the tensor of each entry


# a branch may read this many tensors shared with the rest of the graph (its plans are
# enumerated once per combination of their placements)
MAX_ENTRIES = 2


def find_branches(graph: Graph, eligible: set[int], constant: frozenset[int],
                  written: frozenset[Any] = frozenset(), free: frozenset[Any] = frozenset(),
                  fixed: frozenset[Any] = frozenset(),
                  single: Callable[[int, frozenset[int], frozenset[int]], bool] | None = None
                  ) -> dict[int, list[Branch]]:
    """join GraphNode -> its foldable branches (see the module docstring), among the
    ``eligible`` GraphNodes (single untied steps); only joins with two branches or more.
    A branch may read tensors that other GraphNodes read too, as entries: keys some step
    of the problem writes (``written``) or sets as their first reader (``free``).

    With ``single``, a second pass grows each branch to a fixed point (see :func:`_grow`)
    and takes the joins with one branch that ``single(join, members, folded)`` accepts
    (:func:`_mixes`): ``members``, the branch's GraphNodes the first pass does not fold
    (``folded``) already; a first-pass join inside such a branch is folded inside it."""
    readers = consumers(graph)
    prod = producers(graph)
    outputs = {t.name for t in graph.outputs}

    def read_only_by(v: int, allowed: set[int]) -> bool:
        return all(t.name not in outputs and set(readers.get(t.name, ())) <= allowed
                   for t in graph.nodes[v].outputs)

    def search(patient: bool, folded: frozenset[int]) -> dict[int, list[Branch]]:
        # the last joins first: a join whose branches hold other joins folds them whole
        # (their own branches fold again inside the branch's enumeration)
        taken: set[int] = set()
        out: dict[int, list[Branch]] = {}
        for join in sorted(eligible, reverse=True):
            if join in taken:          # inside another join's branch: folded with it
                continue
            branches: list[Branch] = []
            for t in graph.nodes[join].inputs:
                src = prod.get(t.name)
                if src is None or src[0] == join or src[0] not in eligible \
                        or src[0] in taken or src[0] in constant \
                        or any(src[0] in b.members for b in branches):
                    continue
                branch = _grow(graph, src[0], join, eligible, taken | {join}, constant,
                               read_only_by, written | free, fixed, patient)
                if branch is not None:
                    branches.append(branch)
            if len(branches) >= 2 if not patient else \
                    len(branches) == 1 and single is not None \
                    and single(join, branches[0].members - folded, folded):
                out[join] = branches
                taken.add(join)        # a join stays a step: no later branch may take it
                for b in branches:
                    taken |= b.members
        return out

    found = search(False, frozenset())
    if single is not None:
        folded = frozenset(v for bs in found.values() for b in bs for v in b.members)
        found = _with_single(found, search(True, folded))
    return _without_lost_entries(found)


def _with_single(found: dict[int, list[Branch]], single: dict[int, list[Branch]]
                 ) -> dict[int, list[Branch]]:
    """``found`` with the one-branch joins of ``single`` added: a join of ``found`` whose
    GraphNodes all lie inside such a branch is folded inside it (dropped here); a one-branch
    join that overlaps a join of ``found`` otherwise is left out."""
    out = dict(found)
    for join, (branch,) in single.items():
        inside = [j for j, bs in found.items()
                  if {j, *(v for b in bs for v in b.members)} <= branch.members]
        rest = [j for j, bs in found.items() if j not in inside
                and {j, *(v for b in bs for v in b.members)} & (branch.members | {join})]
        if rest:
            continue
        for j in inside:
            del out[j]
        out[join] = [branch]
    return out


def _without_lost_entries(found: dict[int, list[Branch]]) -> dict[int, list[Branch]]:
    """Drop the joins one of whose branches reads a tensor that another fold removes."""
    while True:
        folded = {v for bs in found.values() for b in bs for v in b.members}
        bad = [j for j, bs in found.items()
               if any(isinstance(e[0], int) and (e[0] in folded or e[0] == j)
                      for b in bs for e in b.entries)]
        if not bad:
            return found
        for j in bad:
            del found[j]


def _grow(graph: Graph, start: int, join: int, eligible: set[int], taken: set[int],
          constant: frozenset[int], read_only_by: Any, known: frozenset[Any],
          fixed: frozenset[Any] = frozenset(), patient: bool = False) -> Branch | None:
    """The branch of ``join`` ending at ``start``: ``start`` and every ancestor read only
    inside it; a tensor it reads that others read too is an entry if it is a ``known``
    key of the problem; None if it reads a graph input shared with others, or too many
    entries. A GraphNode met while another of its readers is not yet in is an entry at
    once, or, ``patient``, taken in once every reader is (a fixed point: the gating of an
    MoE layer, whose tensors are read by several of its GraphNodes)."""
    prod = producers(graph)
    readers = consumers(graph)
    members = {start}
    entries: dict[Any, TensorInfo] = {}
    if not read_only_by(start, {join}):
        return None
    pending: dict[tuple[int, int], TensorInfo] = {}
    todo = [start]
    while todo:
        while todo:
            v = todo.pop()
            for t in graph.nodes[v].inputs:
                src = prod.get(t.name)
                if src is None:        # a graph input without an input GraphNode
                    continue           # (checked below, once every member is in)
                q = src[0]
                if q in members or q in constant or src in entries \
                        or ("x", t.name) in entries \
                        or ("x", t.name) in fixed:  # a placement fixed for the whole problem
                    continue
                if q in eligible and q not in taken and read_only_by(q, members | {join}):
                    members.add(q)
                    todo.append(q)
                elif patient:
                    pending.setdefault(src, t)
                elif not _add_entry(entries, src, t, known, taken):
                    return None
        for src in sorted(pending, reverse=True):   # now read only inside: take it in
            if src[0] not in members and src[0] in eligible and src[0] not in taken \
                    and read_only_by(src[0], members | {join}):
                members.add(src[0])
                todo.append(src[0])
    for src, t in pending.items():
        if src[0] not in members and not _add_entry(entries, src, t, known, taken):
            return None
    for v in members:
        for t in graph.nodes[v].inputs:
            if prod.get(t.name) is None and not set(readers.get(t.name, ())) <= members:
                return None
    entries = {e: t for e, t in entries.items() if e[0] not in members}
    if len(entries) > MAX_ENTRIES:
        return None
    return Branch(frozenset(members), tuple(entries), tuple(entries.values()))


def _add_entry(entries: dict[Any, TensorInfo], src: tuple[int, int], t: TensorInfo,
               known: frozenset[Any], taken: set[int]) -> bool:
    """Record the tensor ``t`` (output ``src``) a branch reads from outside as an entry;
    False when it is no key of the problem (a branch cannot read it)."""
    if src in known and src[0] not in taken:
        entries[src] = t
    elif ("x", t.name) in known:
        entries[("x", t.name)] = t
    else:
        return False
    return True


def frontier_bound(steps: Sequence[Step], table: PatternTable,
                   tie_options: Mapping[int, Sequence[Any]] | None, cap: int) -> int:
    """An upper bound on the distinct frontiers the enumeration of ``steps`` can hold at
    once (counting stops above ``cap``): after each step, the product over the live keys
    of the placements each may take (:func:`_live_ways`)."""
    worst = 1
    for _, ways in _live_ways(steps, table, tie_options):
        size = 1
        for n in ways.values():
            size *= n
            if size > cap:
                return size
        worst = max(worst, size)
    return worst


def _live_ways(steps: Sequence[Step], table: PatternTable,
               tie_options: Mapping[int, Sequence[Any]] | None
               ) -> Iterator[tuple[Step, Mapping[Any, int]]]:
    """Per step, the keys live after it, each with the placements it may take (its
    producer's options' distinct outputs, the distinct placements its readers want for a
    key set by its first reader, a template's candidates for a tie)."""
    ways: dict[Any, int] = {}
    for step in steps:
        infos = step.infos if step.infos is not None else table.infos[step.node]
        picks = [pi for pi, _ in step.options] if step.infos is None else range(len(infos))
        for j, (key, _) in enumerate(step.reads):
            if key in step.free and key not in ways:
                ways[key] = len({infos[pi].inputs[j] for pi in picks}) or 1
        for oi, key in step.writes:
            ways[key] = len({infos[pi].outputs[oi] for pi in picks}) or 1
        if step.tie is not None and ("tie", step.tie) not in ways:
            ways[("tie", step.tie)] = len(tie_options[step.tie]) if tie_options else 1
        for key in step.drops + tuple(("tie", t) for t in step.release):
            ways.pop(key, None)
        yield step, ways


def fold_branches(graph: Graph, steps: Sequence[Step], table: PatternTable, edges: EdgeCoster,
                  k: int, max_states: int, deadline: float | None, allowed: Any,
                  penalty: float, tie_options: Mapping[int, Sequence[Any]] | None = None,
                  single: bool = True, outside: float = 0.0
                  ) -> tuple[list[Step], list[int], Folded]:
    """``steps`` with their foldable branches folded into their joins; the indices of the
    steps kept (into ``steps``), and what was folded. Nothing is folded when the beam
    cannot cut the plain enumeration (:func:`frontier_bound` at most ``max_states``).
    Joins of one branch are folded only with ``single`` (not inside a branch's own
    enumeration, which already runs once per placement of its entries: nesting them
    multiplies those runs). ``outside``: the least any plan pays outside ``steps`` (a
    branch's enumeration: what the rest of the problem costs at least), for
    ``Folded.cut_below``."""
    if frontier_bound(steps, table, tie_options, max_states) <= max_states:
        return list(steps), list(range(len(steps))), Folded()
    eligible = {s.node for s in steps if s.tie is None and s.infos is None
                and s.folded is None}
    written = frozenset(key for s in steps for _, key in s.writes)
    free = frozenset(key for s in steps for key in s.free)
    fixed = frozenset(key for s in steps for key in s.fixed)
    position = {s.node: i for i, s in enumerate(steps)}
    found = find_branches(graph, eligible, table.constant, written, free, fixed,
                          (lambda join, members, folded: len(members) > 1 and _mixes(
                              steps, members, position[join], folded, table, tie_options,
                              max_states)) if single else None)
    for join in [j for j, bs in found.items() if len(_entries(bs)) > MAX_JOIN_ENTRIES]:
        del found[join]
    found = _without_lost_entries(found)
    if not found:
        return list(steps), list(range(len(steps))), Folded()
    folded_nodes = {v for bs in found.values() for b in bs for v in b.members}
    moved = _moved_drops(steps, found, position)
    counts, exact, cut = Counts(), True, math.inf
    least = _least(steps, tie_options)
    everything = outside + math.fsum(least.values())
    out: list[Step] = []
    kept: list[int] = []
    for i, step in enumerate(steps):
        if step.node in folded_nodes:
            continue
        kept.append(i)
        if moved.get(i):
            step = dataclasses.replace(step, drops=tuple(d for d in step.drops
                                                         if d not in moved[i]))
        if step.node not in found:
            out.append(step)
            continue
        entries = _entries(found[step.node])
        options = {e: _placements(graph, table, e, t) for b in found[step.node]
                   for e, t in zip(b.entries, b.tensors)}
        per_branch = []
        for branch in found[step.node]:
            rest = everything - math.fsum(least[v] for v in branch.members)
            combos, c, e, lb = _branch_combos(graph, branch, step.node, table, edges, k,
                                              max_states, deadline, allowed, penalty,
                                              options, max(rest, 0.0))
            counts, exact, cut = counts + c, exact and e, min(cut, lb)
            per_branch.append((branch, combos))
        joined = _joined(step, entries, options, per_branch, folded_nodes, k)
        late = tuple(e for e, _ in entries if _position_of_drop(steps, e) < i)
        out.append(dataclasses.replace(joined, drops=joined.drops + late))
    return out, kept, Folded(len(found), len(folded_nodes), counts, exact, cut)


def _least(steps: Sequence[Step], tie_options: Mapping[int, Sequence[Any]] | None
           ) -> dict[int, float]:
    """Per step (by its GraphNode), the least a plan pays for it: its cheapest option; for
    a template's tied steps, its cheapest candidate at the template's first step and
    nothing at the others (a candidate is paid once). Every option, edge and tie costs
    >= 0, so the sum over any steps bounds what a plan pays for them."""
    seen: set[int] = set()
    out: dict[int, float] = {}
    for s in steps:
        if s.tie is None:
            out[s.node] = min((c for _, c in s.options), default=0.0)
        elif s.tie in seen or tie_options is None:
            out[s.node] = 0.0
        else:
            seen.add(s.tie)
            out[s.node] = min((c[1] for c in tie_options[s.tie]), default=0.0)
    return out


# a join's branches may read this many shared tensors in all
MAX_JOIN_ENTRIES = 3


def _mixes(steps: Sequence[Step], members: frozenset[int], join_at: int,
           skip: frozenset[int], table: PatternTable,
           tie_options: Mapping[int, Sequence[Any]] | None, cap: int) -> bool:
    """Whether, before the step at ``join_at``, the frontier may hold more than ``cap``
    states with tensors of the branch ``members`` beside tensors from outside it (the
    block input a whole layer reads and a template keeps to its end, the residual a join
    adds back): the plain enumeration multiplies the branch's frontiers by the placements
    of those others, and its beam may cut; the branch alone, enumerated once per placement
    of its entries, does not. A branch never live beside another tensor (a chain), or
    whose frontiers stay small, is left in place. The steps of ``skip`` (folded
    already) are left out."""
    inner: set[Any] = set()
    started = False
    for step, ways in _live_ways([s for s in steps[:join_at] if s.node not in skip], table,
                                 tie_options):
        if step.node in members:
            started = True
            inner.update(key for _, key in step.writes)
        if not started:
            continue
        outer = mine = 1
        for key, n in ways.items():
            if key in inner:
                mine *= n
            else:
                outer *= n
        if outer > 1 and mine > 1 and outer * mine > cap:
            return True
    return False


def _entries(branches: Sequence[Branch]) -> tuple[tuple[Any, TensorInfo], ...]:
    return tuple(dict.fromkeys(zip((e for b in branches for e in b.entries),
                                   (t for b in branches for t in b.tensors))))


def _position_of_drop(steps: Sequence[Step], key: Any) -> float:
    """The index of the step that drops ``key`` (inf: none does)."""
    for i, s in enumerate(steps):
        if key in s.drops:
            return i
    return float("inf")


def _moved_drops(steps: Sequence[Step], found: Mapping[int, Sequence[Branch]],
                 position: Mapping[int, int]) -> dict[int, set[Any]]:
    """step index -> the entry keys it must no longer drop: their join reads them later."""
    out: dict[int, set[Any]] = {}
    for join, branches in found.items():
        for e, _ in _entries(branches):
            at = _position_of_drop(steps, e)
            if at < position[join]:
                out.setdefault(int(at), set()).add(e)
    return out


def _placements(graph: Graph, table: PatternTable, key: Any, tensor: TensorInfo) -> list[Any]:
    """The placements the entry ``key`` may have: its producer's patterns' outputs, or for
    a key its first reader sets, what its readers' patterns read."""
    if isinstance(key[0], int):
        return list(dict.fromkeys(info.outputs[key[1]] for info in table.infos[key[0]]))
    return list(dict.fromkeys(info.inputs[j] for r in consumers(graph).get(tensor.name, ())
                              for j, t in enumerate(graph.nodes[r].inputs)
                              if t.name == tensor.name for info in table.infos[r]))


def _branch_combos(graph: Graph, branch: Branch, join: int, table: PatternTable,
                   edges: EdgeCoster, k: int, max_states: int, deadline: float | None,
                   allowed: Any, penalty: float, placements: Mapping[Any, list[Any]],
                   outside: float
                   ) -> tuple[dict[tuple[Any, ...], dict[int, list[_Combo]]], Counts, bool,
                              float]:
    """Per placement of the branch's entries, per pattern of ``join``: the k cheapest plans
    of the branch, each costed with the resharding of its tensors to what that pattern
    reads (an empty list: none is valid); the counts, whether no beam cut, and the least a
    whole plan through a prefix the beam cut costs (the cut prefix plus ``outside``, what
    every plan pays outside the branch at least; inf: nothing cut). A plan whose branch
    part the beam did not cut is among the combinations (those dropped are dominated by
    ones kept for the same entries and join pattern), so this bounds the rest."""
    members = branch.members
    order = good_order(graph, sorted(members))
    steps = node_steps(graph, order, table, allowed, penalty,
                       lambda v, oi, t: join in consumers(graph).get(t.name, ()))
    prod = producers(graph)
    reads = [(j, (src[0], src[1]), t) for j, t in enumerate(graph.nodes[join].inputs)
             if (src := prod.get(t.name)) is not None and src[0] in members]
    names = [("x", t.name) for t in branch.tensors]
    kept = kept_penalties(graph.nodes[join], table.gradients, penalty)
    counts, exact, lowest = Counts(), True, math.inf
    out: dict[tuple[Any, ...], dict[int, list[_Combo]]] = {}
    for placed_entries in itertools.product(*(placements[e] for e in branch.entries)):
        fixed = dict(zip(names, placed_entries))
        these = [dataclasses.replace(s, fixed={**s.fixed, **fixed}, free=s.free - set(fixed))
                 for s in steps] if fixed else steps
        these, _, inner = fold_branches(graph, these, table, edges, k, max_states, deadline,
                                        allowed, penalty, single=False, outside=outside)
        final, c, e, cut = run(these, table, edges, k, max_states, deadline)
        c, e = c + inner.counts, e and inner.exact
        counts, exact = counts + c, exact and e
        lowest = min(lowest, cut + outside, inner.cut_below)
        plans = [(cost, dict(state.items),
                  tuple(p for st, oi in zip(these, unwind(path, len(these)))
                        for p in chosen(st, oi)))
                 for cost, state, path in final]
        per_join: dict[int, list[_Combo]] = {}
        for pi, info in enumerate(table.infos[join]):
            best: list[_Combo] = []
            for cost, placed, assign in plans:
                for j, key, tensor in reads:
                    extra = edges.cost(tensor, placed[key], info.inputs[j])
                    if extra is None:
                        break
                    if kept and kept[j]:
                        extra += kept[j] * edges.grown_bytes(tensor, placed[key],
                                                             info.inputs[j])
                    cost += extra
                else:
                    best.append((cost, assign))
            per_join[pi] = heapq.nsmallest(k, best, key=lambda x: x[0])
        out[tuple(placed_entries)] = per_join
    return out, counts, exact, lowest


def _k_best_sums(parts: Sequence[list[_Combo]], k: int) -> list[_Combo]:
    """The k cheapest ways to take one entry of every part (each part sorted)."""
    acc: list[_Combo] = [(0.0, ())]
    for part in parts:
        acc = heapq.nsmallest(k, ((a + b, x + y) for a, x in acc for b, y in part),
                              key=lambda e: e[0])
    return acc


def _joined(step: Step, entries: Sequence[tuple[Any, TensorInfo]],
            placements: Mapping[Any, list[Any]],
            per_branch: Sequence[tuple[Branch, Mapping[tuple[Any, ...], Mapping[int,
                                                                              list[_Combo]]]]],
            folded_nodes: set[int], k: int) -> Step:
    """The join's step: per placement of the entries, each of its options repeated for
    the k cheapest combinations of its branches; it reads the entries (their placements
    pick the table; an entry no step has set yet is set by the join), and the tensors it
    reads from the branches are set by it (free) and dropped at once."""
    keys = tuple(e for e, _ in entries)
    folded: dict[tuple[Any, ...], tuple[tuple[tuple[int, float], ...],
                                        tuple[tuple[tuple[int, int], ...], ...]]] = {}
    for placed in itertools.product(*(placements[e] for e in keys)):
        at = dict(zip(keys, placed))
        options: list[tuple[int, float]] = []
        attached: list[tuple[tuple[int, int], ...]] = []
        for pi, cost in step.options:
            parts = [combos[tuple(at[e] for e in b.entries)][pi] for b, combos in per_branch]
            for extra, assign in _k_best_sums(parts, k):
                options.append((pi, cost + extra))
                attached.append(assign)
        folded[tuple(placed)] = (tuple(options), tuple(attached))
    branch_keys = tuple(key for key, _ in step.reads
                        if isinstance(key[0], int) and key[0] in folded_nodes)
    return dataclasses.replace(step, reads=step.reads + tuple(entries), entries=keys,
                               folded=folded, free=step.free | frozenset(branch_keys),
                               drops=step.drops + tuple(k for k in dict.fromkeys(branch_keys)
                                                         if k not in step.drops))


def chosen(step: Step, oi: Any) -> tuple[tuple[int, int], ...]:
    """The (GraphNode, pattern index) pairs that option ``oi`` of ``step`` sets: the step's
    own GraphNode and, for a join, its folded branches' GraphNodes."""
    if step.folded is None:
        return ((step.node, oi),)
    placed, index = oi
    options, attached = step.folded[placed]
    return ((step.node, options[index][0]),) + attached[index]
