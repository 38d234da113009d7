"""Drawing a folded graph: templates as coloured swimlanes (PNG, matplotlib).

In:  a :class:`~tapas.mining.folded.FoldedGraph` and, optionally, its graph.
Out: a PNG file (:func:`draw_folded`).
"""

from __future__ import annotations

from typing import Any


from tapas.ir import Graph
from tapas.mining.folded import FoldedGraph



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
