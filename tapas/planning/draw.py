"""Drawing a strategy: what each layer of each unique subgraph does (`tapas search --draw`).

In:  a ``Strategy`` bound to its graph (``tapas.search``'s result, which carries its pattern
     table), a PNG path and optionally names of its reference plans to draw beside it.
Out: the PNG (:func:`draw_strategy`) and the rows it draws (:func:`strategy_rows`): one row
     per GraphNode of the first instance of every template (every instance has the same
     plan) and per GraphNode outside the templates that has weights or collectives, each
     with its kind, pattern, pattern family, the weights it splits (axis and device count)
     and its collectives (kind and direction). One panel per plan, titled with its cost.

matplotlib is imported when drawing (an Agg canvas: no global backend change). This module
imports no TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tapas.ir import Graph
from tapas.planning.table import placed_weights
from tapas.sharding.patterns.pattern import Family
from tapas.sharding.placements import Replica

__all__ = ["strategy_rows", "draw_strategy"]

# a colour per pattern family; others from _SPARE
_COLOURS = {f.value: c for f, c in (
    (Family.REPLICATE, "#cfcfcf"), (Family.BATCH, "#8fbc8f"), (Family.FOLLOW, "#aec7e8"),
    (Family.SPLIT, "#c49c94"), (Family.COLUMN, "#1f77b4"), (Family.ROW, "#9467bd"),
    (Family.HEADS, "#ff7f0e"), (Family.HIDDEN, "#2ca02c"), (Family.EXPERT, "#d62728"))}
_SPARE = ["#17becf", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f"]


def strategy_rows(strategy: Any, graph: Graph, patterns: Sequence[str] | None = None
                  ) -> list[dict[str, Any]]:
    """The rows :func:`draw_strategy` draws for ``patterns`` (default: the strategy's own;
    a reference plan's are the strategy's with its ``changes``). A row is a template header
    (``{"template": id, "instances": k}``) or a GraphNode (``id``, ``kind``, ``pattern``,
    ``family``, ``weights``: ["path S1/8", ...], ``collectives``: ["AR bwd", ...])."""
    table = getattr(strategy, "_table", None)
    if table is None:
        raise ValueError("this Strategy carries no pattern table (it was loaded from JSON): "
                         "draw the result of tapas.search, or search again")
    patterns = list(strategy.patterns if patterns is None else patterns)
    n = strategy.num_devices

    def row(v: int) -> dict[str, Any]:
        node = graph.nodes[v]
        info = next((p for p in table.infos[v] if p.name == patterns[v]), None)
        if info is None:
            raise ValueError(f"GraphNode {v} '{node.name}' has no pattern {patterns[v]!r}")
        splits = [f"{'/'.join(path.split('/')[-2:])} {placement}/{n}"
                  for path, placement in placed_weights(node, info)
                  if not isinstance(placement, Replica)]
        colls = [f"{t.kind.value} {'bwd' if t.backward else 'fwd'}" for t in info.comm_terms]
        family = info.family.value if info.family is not None else "other"
        return {"id": v, "kind": node.kind.value, "pattern": patterns[v], "family": family,
                "weights": splits, "collectives": colls}

    rows: list[dict[str, Any]] = []
    covered = set()
    for tid, _name, instances in strategy.templates:
        covered.update(v for inst in instances for v in inst)
        rows.append({"template": tid, "instances": len(instances)})
        rows.extend(row(v) for v in sorted(instances[0]))
    loose = [row(v) for v in range(len(graph.nodes)) if v not in covered]
    loose = [r for r in loose if graph.nodes[r["id"]].weights or r["collectives"]]
    if loose:
        rows.append({"template": None, "instances": len(loose)})
        rows.extend(loose)
    return rows


def draw_strategy(strategy: Any, graph: Graph, path: str, *,
                  references: Sequence[str] = (), title: str | None = None) -> str:
    """Draw the strategy (and the named reference plans beside it) to a PNG at ``path``.
    A reference plan that does not apply to the graph, or could not be built, is skipped
    with its reason in the panel's place. Returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(f"TAPAS ({strategy.total_cost * 1e3:.2f} ms)", list(strategy.patterns), "")]
    by_name = {a.name: a for a in strategy.references}
    for name in references:
        alt = by_name.get(name)
        if alt is None:
            panels.append((name, None, "does not apply to this model"))
        elif alt.error:
            panels.append((name, None, alt.error))
        else:
            pats = [alt.changes.get(v, p) for v, p in enumerate(strategy.patterns)]
            panels.append((f"{name} ({alt.cost * 1e3:.2f} ms)", pats, ""))
    drawn = [(label, strategy_rows(strategy, graph, pats) if pats else [], why)
             for label, pats, why in panels]
    families = sorted({r["family"] for _, rows, _ in drawn for r in rows if "family" in r})
    spare = iter(_SPARE * 4)
    colour = {f: _COLOURS.get(f) or next(spare) for f in families}
    height = max((len(rows) for _, rows, _ in drawn), default=1)
    fig = Figure(figsize=(5.2 * len(drawn), 0.24 * height + 1.6), dpi=110)
    FigureCanvasAgg(fig)
    for k, (label, rows, why) in enumerate(drawn):
        ax = fig.add_subplot(1, len(drawn), k + 1)
        for y, r in enumerate(rows):
            if "template" in r:
                head = (f"T{r['template']}  x{r['instances']}" if r["template"] is not None
                        else "outside the templates")
                ax.text(0.0, -y, head, fontsize=7, weight="bold", va="center")
                continue
            ax.barh(-y, 1.0, left=0.02, height=0.8, color=colour[r["family"]])
            extra = "; ".join(r["weights"] + r["collectives"])
            text = f"{r['kind']}: {r['pattern']}" + (f"  [{extra}]" if extra else "")
            ax.text(0.04, -y, text if len(text) <= 96 else text[:93] + "...", fontsize=5.5,
                    va="center")
        if why:
            ax.text(0.02, 0, f"not drawn: {why}", fontsize=7, va="top", wrap=True)
        ax.set_xlim(0, 1.1)
        ax.set_ylim(-max(len(rows), 1), 1)
        ax.axis("off")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title or f"{graph.name} on {strategy.cluster.name} "
                 f"({strategy.num_devices} devices; predicted costs)", fontsize=10)
    if families:
        fig.legend([Patch(color=colour[f]) for f in families], families, loc="lower center",
                   ncol=min(len(families), 8), fontsize=7)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    return path
