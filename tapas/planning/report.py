"""The readable report of a Strategy (``Strategy.summary``, what ``tapas search`` prints).

In:  a :class:`tapas.planning.strategy.Strategy`, optionally the graph it was searched for
     and its :class:`tapas.planning.table.PatternTable`, and a row limit.
Out: text: the cost per step (communication forward/backward, compute, by collective
     kind), memory against the budget, cost per unit, a per-layer table (weights split,
     collectives, resharding), the ranked alternatives, the reference plans, phase timings,
     counts and notes.

This module imports no TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tapas.ir import Graph
from tapas.planning.table import PatternTable
from tapas.sharding.patterns.pattern import Family

if TYPE_CHECKING:
    from tapas.planning.strategy import Alternative, EdgeReshard, Strategy

__all__ = ["summary"]

_GIB = 2.0 ** 30


def _bound(s: Strategy) -> str:
    return "" if s.bound is None else f": within {100 * s.bound:.3g}% of the optimum"


def summary(s: Strategy, graph: Graph | None, table: PatternTable | None,
            max_rows: int = 60) -> str:
    """The report of ``s``; the per-layer table needs ``graph``."""
    c = s.cost
    lines = [f"strategy for '{s.graph_name}' on {s.cluster.name} "
             f"({s.num_devices} devices), mode {s.mode}"
             f"{'' if s.exact else ' (beam-limited' + _bound(s) + ')'}"
             f"{f', priced in {s.precision}' if s.precision else ''}",
             f"cost      {_t(c['total'])} per step = communication "
             f"{_t(c['communication'])} (forward {_t(c['forward'])}, "
             f"backward {_t(c['backward'])}) + compute {_t(c['compute'])}",
             "by kind   " + (", ".join(f"{k} {_t(v)}"
                                       for k, v in c["by_kind"].items()) or "none"),
             f"memory    {s.memory} (budget {s.memory_budget / _GIB:.3f} GiB)"]
    per_t = c.get("per_template", {})
    if per_t:
        lines.append("per unit  " + ", ".join(f"{k} {_t(v)}" for k, v in per_t.items()))
    if graph is not None:
        lines += ["", _layer_table(s, graph, table, max_rows)]
    if s.alternatives:
        lines += ["", "ranked alternatives (whole plan):"] + _alternative_rows(s.alternatives)
    if s.references:
        lines += ["", "reference plans:"] + _reference_rows(s.references, s.total_cost)
    if s.timings:
        lines += ["", "phase timings: " + ", ".join(f"{k} {v:.3f} s"
                                                    for k, v in s.timings.items())]
    if s.counts:
        lines.append(_counts_line(s.counts))
    for note in s.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _alternative_rows(alternatives: Sequence[Alternative]) -> list[str]:
    lines = [f"  {'rank':<5}{'cost':>12}{'comm':>12}{'compute':>12}{'mem GiB':>9}  fits  "
             "differs from #1"]
    for i, a in enumerate(alternatives):
        diff = ", ".join(f"{k}:{v}" for k, v in list(a.changes.items())[:4])
        more = len(a.changes) - 4
        lines.append(f"  {i + 1:<5}{_t(a.cost):>12}{_t(a.communication):>12}"
                     f"{_t(a.compute):>12}"
                     f"{a.memory / _GIB:>9.3f}  {'yes' if a.fits else 'NO ':<4}  "
                     f"{diff or '(chosen)'}{f' +{more} more' if more > 0 else ''}")
    return lines


def _reference_rows(references: Sequence[Alternative], chosen_cost: float) -> list[str]:
    lines = [f"  {'plan':<15}{'cost':>12}{'comm':>12}{'compute':>12}{'mem GiB':>9}  fits  "
             f"{'vs chosen':>9}"]
    for a in references:
        if a.error:
            lines.append(f"  {a.name:<15}  (not available: {a.error})")
            continue
        ratio = a.cost / chosen_cost if chosen_cost > 0 else float("nan")
        lines.append(f"  {a.name:<15}{_t(a.cost):>12}{_t(a.communication):>12}"
                     f"{_t(a.compute):>12}"
                     f"{a.memory / _GIB:>9.3f}  {'yes' if a.fits else 'NO ':<4}  "
                     f"{ratio:>8.3f}x")
    return lines


def _counts_line(cnt: Mapping[str, Any]) -> str:
    return (f"counts: {cnt.get('generated', 0):,} candidates generated, "
            f"{cnt.get('pruned_early', 0):,} pruned early (invalid), "
            f"{cnt.get('resharded', 0):,} valid with a resharding, "
            f"{cnt.get('costed', 0):,} costed, {cnt.get('dominated', 0):,} "
            f"dominated, {cnt.get('valid', 0):,} valid at the end; "
            f"{cnt.get('units', 0)} units searched "
            f"({cnt.get('templates', 0)} templates)")


def _t(seconds: float) -> str:
    """Seconds in a readable unit (us, ms or s)."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) >= 1.0:
        return f"{seconds:.3f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"


def _layer_table(s: Strategy, graph: Graph, table: PatternTable | None, max_rows: int) -> str:
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
        trivial = (s.patterns[node.id].family is Family.REPLICATE and not node.weights
                   and not colls)
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
