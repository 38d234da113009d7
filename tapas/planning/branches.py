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
with its id input, the towers of a multi-input model. Nothing outside the branch sees its
choices but J, through the placements of the tensors J reads from it. So the branch is
enumerated alone (its k best plans per placement of those tensors), and for each pattern of
J the k cheapest combinations of its branches (each: a branch plan plus the resharding of
its tensors to what J's pattern reads) become J's options, with the branches' patterns
attached. The enumeration then never holds a branch's tensors in its frontier: a join of b
branches with p placements each costs b * p work instead of a frontier of p ** b states.
The k best whole plans are the same as without folding (the k best of a sum of
independent parts are among the sums of each part's k best).

Only joins that fold at least two branches are folded (a single branch leaves the frontier
as narrow as it was), and only when the frontier could outgrow the beam without it
(:func:`frontier_bound`: the product, over the tensors live after a step, of the
placements each may take): where the beam cannot cut, the plain enumeration is already
exact and is left as it was, ties between equally cheap alternatives included.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from tapas.ir import Graph
from tapas.planning.frontier import Counts, Step, run, unwind
from tapas.planning.steps import consumers, good_order, node_steps, producers
from tapas.planning.table import EdgeCoster, PatternTable

__all__ = ["Folded", "find_branches", "fold_branches", "frontier_bound"]

# a branch's plans kept per join option, and the combinations per join pattern
_Combo = tuple[float, tuple[tuple[int, int], ...]]


@dataclasses.dataclass(frozen=True)
class Folded:
    """What :func:`fold_branches` did: the joins folded, the GraphNodes taken out of the
    enumeration, the counts of the branches' own enumerations, and whether each of them
    kept every frontier (no beam cut)."""

    joins: int = 0
    nodes: int = 0
    counts: Counts = Counts()
    exact: bool = True


def find_branches(graph: Graph, eligible: set[int], constant: frozenset[int]
                  ) -> dict[int, list[frozenset[int]]]:
    """join GraphNode -> its foldable branches (see the module docstring), among the
    ``eligible`` GraphNodes (single untied steps); only joins with two branches or more."""
    readers = consumers(graph)
    prod = producers(graph)
    outputs = {t.name for t in graph.outputs}
    taken: set[int] = set()
    found: dict[int, list[frozenset[int]]] = {}

    def read_only_by(v: int, allowed: set[int]) -> bool:
        return all(t.name not in outputs and set(readers.get(t.name, ())) <= allowed
                   for t in graph.nodes[v].outputs)

    for join in sorted(eligible):
        branches = []
        for t in graph.nodes[join].inputs:
            src = prod.get(t.name)
            if src is None or src[0] == join or src[0] not in eligible or src[0] in taken \
                    or src[0] in constant or any(src[0] in b for b in branches):
                continue
            members = _grow(graph, src[0], join, eligible | set(), taken, constant, read_only_by)
            if members is not None:
                branches.append(members)
        if len(branches) >= 2:
            found[join] = branches
            for b in branches:
                taken |= b
    return found


def _grow(graph: Graph, start: int, join: int, eligible: set[int], taken: set[int],
          constant: frozenset[int], read_only_by: Any) -> frozenset[int] | None:
    """The branch of ``join`` ending at ``start``: ``start`` and every ancestor read only
    inside it, or None if it reads a tensor shared with the rest of the graph."""
    prod = producers(graph)
    readers = consumers(graph)
    members = {start}
    if not read_only_by(start, {join}):
        return None
    todo = [start]
    while todo:
        v = todo.pop()
        for t in graph.nodes[v].inputs:
            src = prod.get(t.name)
            if src is None:        # a graph input without an input GraphNode
                if not set(readers.get(t.name, ())) <= members | {v}:
                    return None
                continue
            q = src[0]
            if q in members or q in constant:
                continue
            if q == join or q not in eligible or q in taken \
                    or not read_only_by(q, members | {join}):
                return None
            members.add(q)
            todo.append(q)
    # every graph input a member reads must be read by members only (checked once all are in)
    for v in members:
        for t in graph.nodes[v].inputs:
            if prod.get(t.name) is None and not set(readers.get(t.name, ())) <= members:
                return None
    return frozenset(members)


def _branch_combos(graph: Graph, members: frozenset[int], join: int, table: PatternTable,
                   edges: EdgeCoster, k: int, max_states: int, deadline: float | None,
                   allowed: Any, penalty: float) -> tuple[dict[int, list[_Combo]], Counts, bool]:
    """Per pattern of ``join``: the k cheapest plans of the branch, each costed with the
    resharding of its tensors to what that pattern reads (none: the pattern is invalid)."""
    order = good_order(graph, sorted(members))
    steps = node_steps(graph, order, table, allowed, penalty,
                       lambda v, oi, t: join in consumers(graph).get(t.name, ()))
    final, counts, exact, _ = run(steps, table, edges, k, max_states, deadline)
    reads = [(j, (src[0], src[1]), t) for j, t in enumerate(graph.nodes[join].inputs)
             if (src := producers(graph).get(t.name)) is not None and src[0] in members]
    plans = [(c, dict(state.items), tuple(zip(order, unwind(path, len(order)))))
             for c, state, path in final]
    out: dict[int, list[_Combo]] = {}
    for pi, info in enumerate(table.infos[join]):
        best: list[_Combo] = []
        for c, placed, assign in plans:
            total = c
            for j, key, tensor in reads:
                extra = edges.cost(tensor, placed[key], info.inputs[j])
                if extra is None:
                    break
                total += extra
            else:
                best.append((total, assign))
        out[pi] = heapq.nsmallest(k, best, key=lambda e: e[0])
    return out, counts, exact


def _k_best_sums(parts: Sequence[list[_Combo]], k: int) -> list[_Combo]:
    """The k cheapest ways to take one entry of every part (each part sorted)."""
    acc: list[_Combo] = [(0.0, ())]
    for part in parts:
        acc = heapq.nsmallest(k, ((a + b, x + y) for a, x in acc for b, y in part),
                              key=lambda e: e[0])
    return acc


def frontier_bound(steps: Sequence[Step], table: PatternTable,
                   tie_options: Mapping[int, Sequence[Any]] | None, cap: int) -> int:
    """An upper bound on the distinct frontiers the enumeration of ``steps`` can hold at
    once (counting stops above ``cap``): after each step, the product over the live keys
    of the placements each may take (its producer's options' distinct outputs, the
    distinct placements its readers want for a key set by its first reader, a template's
    candidates for a tie)."""
    ways: dict[Any, int] = {}
    worst = 1
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
        size = 1
        for n in ways.values():
            size *= n
            if size > cap:
                return size
        worst = max(worst, size)
    return worst


def fold_branches(graph: Graph, steps: Sequence[Step], table: PatternTable, edges: EdgeCoster,
                  k: int, max_states: int, deadline: float | None, allowed: Any,
                  penalty: float, tie_options: Mapping[int, Sequence[Any]] | None = None,
                  ) -> tuple[list[Step], list[int], Folded]:
    """``steps`` with their foldable branches folded into their joins; the indices of the
    steps kept (into ``steps``), and what was folded. Nothing is folded when the beam
    cannot cut the plain enumeration (:func:`frontier_bound` at most ``max_states``)."""
    if frontier_bound(steps, table, tie_options, max_states) <= max_states:
        return list(steps), list(range(len(steps))), Folded()
    eligible = {s.node for s in steps if s.tie is None and s.infos is None
                and s.attached is None}
    found = find_branches(graph, eligible, table.constant)
    if not found:
        return list(steps), list(range(len(steps))), Folded()
    folded_nodes = {v for bs in found.values() for b in bs for v in b}
    counts, exact = Counts(), True
    out: list[Step] = []
    kept: list[int] = []
    for i, step in enumerate(steps):
        if step.node in folded_nodes:
            continue
        kept.append(i)
        if step.node not in found:
            out.append(step)
            continue
        per_branch = []
        for members in found[step.node]:
            combos, c, e = _branch_combos(graph, members, step.node, table, edges, k,
                                          max_states, deadline, allowed, penalty)
            counts, exact = counts + c, exact and e
            per_branch.append(combos)
        out.append(_joined(step, per_branch, folded_nodes, k))
    return out, kept, Folded(len(found), len(folded_nodes), counts, exact)


def _joined(step: Step, per_branch: Sequence[Mapping[int, list[_Combo]]],
            folded_nodes: set[int], k: int) -> Step:
    """The join's step: each of its options repeated for the k cheapest combinations of
    its branches; the tensors it reads from them are set by it (free) and dropped at once."""
    options: list[tuple[int, float]] = []
    attached: list[tuple[tuple[int, int], ...]] = []
    for pi, cost in step.options:
        for extra, assign in _k_best_sums([b[pi] for b in per_branch], k):
            options.append((pi, cost + extra))
            attached.append(assign)
    branch_keys = tuple(key for key, _ in step.reads
                        if isinstance(key[0], int) and key[0] in folded_nodes)
    return dataclasses.replace(step, options=tuple(options), attached=tuple(attached),
                               free=step.free | frozenset(branch_keys),
                               drops=step.drops + tuple(k for k in dict.fromkeys(branch_keys)
                                                         if k not in step.drops))
