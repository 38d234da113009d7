"""The activations an exported LayoutMap leaves open: GraphNodes whose pattern the exported
pins do not determine, what GSPMD's propagation may do there instead, and its cost.

In:  a Strategy bound to its ``tapas.ir.Graph``, the ``PatternTable`` and ``EdgeCoster`` of
     the strategy's cluster and cost options, the weight placements the map stores (path ->
     placement, every weight: an unkeyed one is replicated) and the activations it pins
     (tensor name -> placement: the layer outputs,
     :func:`tapas.export.outputs.pinned_outputs`).
Out: :func:`open_patterns` -> ``Unexpressed`` entries (``kind="activations"``), one per
     group of GraphNodes with the same chosen pattern, reason and priced alternatives.
Raises: ``ValueError`` when the table (its cost options) lacks a pattern the strategy
     chose, naming the GraphNode.

A pin fixes a tensor's placement: a weight's (every GraphNode reading it takes it as
stored), a layer output's (``with_sharding_constraint`` on it), and a model input's
(replicated over the model axis: Keras lays the data out on the batch axis only). A pattern
*agrees* with the pins when it places every pinned tensor at its GraphNode (the weights it
reads, the tensors it reads and writes) as pinned. Propagation, as GSPMD's: a GraphNode
whose only agreeing pattern is the strategy's is pinned, and pins the tensors it writes as
that pattern leaves them and those it reads as it reads them (where the strategy's producer
leaves them so); repeated until nothing changes. Every other GraphNode
is open: more than one pattern agrees (nothing fixes the choice), or none does (the pins
around it disagree, e.g. a replicated residual beside a split layer output: a reshard is
needed whichever pattern runs, and propagation chooses where), or only another one does.
Each pattern left (the agreeing ones other than the strategy's; all others where none
agrees) is priced as the strategy's plan with that GraphNode's pattern alone changed
(``tapas.planning.plancost.plan_cost``) minus the strategy's plan: its cost under the cost
model, not GSPMD's program (which may also move several GraphNodes at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tapas.ir import Graph, Kind
from tapas.planning.explore import plan_cost
from tapas.planning.strategy import Strategy
from tapas.planning.table import EdgeCoster, PatternInfo, PatternTable, placed_weights
from tapas.sharding.placements import Placement, Replica
from tapas.sharding.patterns import patterns_for
from tapas.export.layouts import Unexpressed
from tapas.export.outputs import forward_placement

__all__ = ["open_patterns", "agreeing"]


Inner = Mapping[tuple[int, int], Sequence[tuple[str, Any]]]


def _boundary(graph: Graph, v: int, info: PatternInfo, inner: Sequence[tuple[str, Any]] = ()
              ) -> list[tuple[str, Any, str]]:
    """(tensor or weight path, placement, role) of everything at GraphNode ``v`` that
    ``info`` places: the weights it reads (``"weight"``), its input and output tensors
    (``"input"``, ``"output"``), and ``inner``: pinned tensors produced inside it (a layer
    output that is not the GraphNode's), as it leaves them (``"output"``)."""
    node = graph.nodes[v]
    out = [(path, pl, "weight") for path, pl in placed_weights(node, info)
           if graph.reads(v, path)]
    out += [(t.name, pl, "input") for t, pl in zip(node.inputs, info.inputs)]
    out += [(t.name, pl, "output") for t, pl in zip(node.outputs, info.outputs)]
    return out + [(name, pl, "output") for name, pl in inner]


def _inner(graph: Graph, table: PatternTable, tensors: Mapping[str, Placement]) -> Inner:
    """(GraphNode, pattern index) -> (tensor, placement the pattern leaves it in) of the
    pinned tensors produced inside the GraphNode, not at its boundary."""
    out: dict[tuple[int, int], list[tuple[str, Any]]] = {}
    for node in graph.nodes:
        boundary = {t.name for t in node.outputs}
        names = [t.name for op in node.ops for t in op.outputs
                 if t.name in tensors and t.name not in boundary]
        if not names:
            continue
        by_name = {str(p.name): p for p in patterns_for(node, graph, table.num_devices)}
        for i, info in enumerate(table.infos[node.id]):
            pattern = by_name.get(str(info.name))
            if pattern is not None:
                out[(node.id, i)] = [(t, forward_placement(pattern, t)) for t in names]
    return out


def _agrees(graph: Graph, v: int, info: PatternInfo, weights: Mapping[str, Placement],
            tensors: Mapping[str, Placement], inner: Sequence[tuple[str, Any]] = ()) -> bool:
    """Whether ``info`` places every pinned weight and tensor at ``v`` as pinned; it may
    read a replicated one as a slice (no collective in the forward pass: what GSPMD does
    where a split operand meets a replicated one) when it also meets a split pin as
    pinned."""
    placed = [(p, (weights if role == "weight" else tensors).get(name), role)
              for name, p, role in _boundary(graph, v, info, inner)]
    anchored = any(pin is not None and pin == p and not isinstance(pin, Replica)
                   for p, pin, _ in placed)
    return all(pin is None or pin == p or (anchored and role != "output"
                                          and isinstance(pin, Replica))
               for p, pin, role in placed)


def agreeing(graph: Graph, table: PatternTable, v: int, weights: Mapping[str, Placement],
             tensors: Mapping[str, Placement], inner: Inner | None = None) -> list[int]:
    """The indices of GraphNode ``v``'s patterns that agree with the pins (``_agrees``;
    ``inner``: :func:`_inner`'s pinned tensors inside GraphNodes)."""
    inner = inner or {}
    return [i for i, info in enumerate(table.infos[v])
            if _agrees(graph, v, info, weights, tensors, inner.get((v, i), ()))]


def _propagate(graph: Graph, table: PatternTable, chosen: Sequence[int],
               weights: Mapping[str, Placement], tensors: dict[str, Placement],
               inner: Inner) -> dict[int, list[int]]:
    """GraphNode -> its agreeing patterns, for every GraphNode the pins leave open (see the
    module docstring); ``tensors`` gains the pins propagation adds: a pinned GraphNode's
    outputs as it leaves them, and its inputs as it reads them where the strategy's
    producer leaves them so (where the strategy itself reshards, the producer decides)."""
    produced = {t.name: table.infos[u][chosen[u]].outputs[j]
                for u, node in enumerate(graph.nodes) for j, t in enumerate(node.outputs)}
    touching: dict[str, list[int]] = {}        # tensor -> the GraphNodes reading or writing it
    for node in graph.nodes:
        for t in (*node.inputs, *node.outputs):
            touching.setdefault(t.name, []).append(node.id)
    pinned: set[int] = set()
    work = list(range(len(graph.nodes)))[::-1]
    while work:
        v = work.pop()
        if v in pinned or agreeing(graph, table, v, weights, tensors, inner) != [chosen[v]]:
            continue
        pinned.add(v)
        for name, pl, role in _boundary(graph, v, table.infos[v][chosen[v]]):
            if name not in tensors and (role == "output" or (
                    role == "input" and produced.get(name) == pl)):
                tensors[name] = pl
                work.extend(u for u in touching.get(name, ()) if u not in pinned)
    return {v: agreeing(graph, table, v, weights, tensors, inner)
            for v in range(len(graph.nodes)) if v not in pinned}


def _why(graph: Graph, table: PatternTable, v: int, chosen: int, agree: Sequence[int],
         weights: Mapping[str, Placement], tensors: Mapping[str, Placement],
         inner: Inner) -> str:
    if chosen in agree:
        return (f"{len(agree)} of its patterns place every pinned tensor at it (its "
                "weights, the layer outputs and what propagation fixes next to it) alike: "
                "no key decides between them, GSPMD's propagation does")
    off = [f"{name} ({role} pinned {pin}, TAPAS's pattern {p})"
           for name, p, role in _boundary(graph, v, table.infos[v][chosen],
                                          inner.get((v, chosen), ()))
           for pin in [(weights if role == "weight" else tensors).get(name)]
           if pin is not None and pin != p][:2]
    if not agree:
        return ("the pinned tensors around it disagree (no pattern reads and writes them "
                "all as pinned; " + "; ".join(off) + "): a reshard runs whichever pattern "
                "it takes, and GSPMD's propagation chooses where")
    names = ", ".join(f"'{table.infos[v][i].name}'" for i in agree)
    return (f"the pins around it fit {names}, not TAPAS's pattern: " + "; ".join(off))


def _priced(graph: Graph, table: PatternTable, edges: EdgeCoster, chosen: Sequence[int],
            v: int, options: Sequence[int], base: float) -> tuple[tuple[str, float], ...]:
    """(pattern, plan cost with it at ``v`` minus ``base``) per option, cheapest first;
    an option whose edges cannot be resharded is left out."""
    out = []
    for i in options:
        patterns = list(chosen)
        patterns[v] = i
        try:
            total = plan_cost(graph, table, patterns, edges)[0].total
        except ValueError:
            continue
        out.append((str(table.infos[v][i].name), total - base))
    return tuple(sorted(out, key=lambda a: (a[1], a[0])))


def open_patterns(strategy: Strategy, graph: Graph, table: PatternTable, edges: EdgeCoster,
                  weights: Mapping[str, Placement], tensors: Mapping[str, Placement],
                  skip: frozenset[int] | set[int] = frozenset()) -> tuple[Unexpressed, ...]:
    """The open GraphNodes (module docstring) other than ``skip`` (those the weight
    comparison lists already), grouped by chosen pattern, reason and priced patterns."""
    strategy = strategy.bind(graph)
    try:
        chosen = [table.index(v, strategy.patterns[v]) for v in range(len(graph.nodes))]
    except KeyError as e:
        raise ValueError(f"{e.args[0]}: the pattern table of these cost options lacks the "
                         "strategy's pattern; export with the cost options the strategy "
                         "was searched with") from None
    pins = dict(tensors)
    for node in graph.nodes:
        if node.kind == Kind.INPUT:
            for t in node.outputs:
                pins.setdefault(t.name, Replica())
    inner = _inner(graph, table, pins)
    left = _propagate(graph, table, chosen, weights, pins, inner)
    base = plan_cost(graph, table, chosen, edges)[0].total
    groups: dict[tuple[Any, ...], list[int]] = {}
    prices: dict[tuple[Any, ...], tuple[tuple[str, float], ...]] = {}
    whys: dict[tuple[Any, ...], str] = {}
    for v, agree in left.items():
        if v in skip:
            continue
        options = [i for i in (agree or range(len(table.infos[v]))) if i != chosen[v]]
        priced = _priced(graph, table, edges, chosen, v, options, base)
        if not priced:
            continue
        # grouped by the kind of reason (which of _why's three), not its tensor names
        reason = (chosen[v] in agree, bool(agree))
        key = (strategy.patterns[v], reason, tuple((a, round(c, 12)) for a, c in priced))
        if key not in groups:
            prices[key] = priced
            whys[key] = _why(graph, table, v, chosen[v], agree, weights, pins, inner)
        groups.setdefault(key, []).append(v)
    out = []
    for key, nodes in sorted(groups.items(), key=lambda kv: kv[1][0]):
        name, why = key[0], whys[key]
        if len(nodes) > 1:
            why += f" (named for GraphNode {nodes[0]}; {len(nodes) - 1} other(s) alike)"
        best, cost = prices[key][0]
        out.append(Unexpressed(
            tuple((v, graph.nodes[v].name) for v in nodes), str(name), best,
            f"{why}; cheapest instead: {best!r}, {cost * 1e3:+.4f} ms per step under the "
            "cost model (the strategy's plan with this GraphNode's pattern alone changed)",
            "activations", prices[key]))
    return tuple(out)
