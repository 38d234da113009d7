"""Two-dimensional device meshes: data parallel over one mesh axis, the searched
tensor-parallel strategy over the other (DP x TP).

In:  a ``Cluster`` S(m, n) of N = m * n devices, the global batch B, and
     ``graph_for(rows)``: the captured graph of one mesh row, i.e. the model at batch
     B / rows (the caller captures it: this module imports no TensorFlow); a search mode,
     cost options and memory budget as for ``tapas.search``.
Out: :class:`MeshSearch`: for every mesh shape ``rows x cols`` with rows * cols = N (rows
     dividing B, and a row either inside one node or made of whole nodes), the row's
     ``Strategy`` searched on ``cols`` devices (its collectives priced on the link a row
     spans), the data-parallel gradient all-reduce of every trainable weight's local shard
     over the ``rows`` devices of a column (priced on the link a column spans; a backward
     collective, so gamma applies), their sum per training step, the memory per device,
     and the cheapest mesh. A graph with MoE expert einsums is also searched on every
     ``rows x cols:experts`` mesh (rows > 1): nested expert + tensor parallelism
     (``tapas.planning.experts``), the row searched with patterns that keep the expert
     region's expert and group axes whole, the all-to-alls of the dispatched tokens over
     the column priced on the column's link (``ep_cost``), no column all-reduce for the
     expert weights, and their memory divided by the rows.

The mesh type is ``tapas.planning.devicemesh.Mesh`` (re-exported here): device r = i * cols
+ j sits in row i, column j, and devices fill a node before the next; a row (its ``model``
axis) of cols <= n devices stays inside a node (NVLink), and a column (its ``data`` axis)
spans min(rows, m) nodes (Ethernet when m > 1). ``1 x N`` is the 1-D search (its data- and
tensor-parallel patterns over all N devices, the collectives of the whole group); ``N x 1``
is pure data parallelism (each device holds the whole model). A mesh prices what the
runtime runs: the row's program on its own group and one all-reduce per trainable weight
over the column (no gradient bucketing).

>>> [str(s) for s in mesh_shapes(8)]
['1x8', '2x4', '4x2', '8x1']
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tapas.ir import Graph, dtype_bytes
from tapas.planning.cluster import Cluster
from tapas.planning.devicemesh import DATA, Mesh
from tapas.planning.cost import CostBreakdown, CostOptions, collective_cost
from tapas.planning.experts import ExpertRegion, NestingError, column_all_to_all, \
    expert_memory_saving, nested_patterns
from tapas.planning.precision import priced_dtype
from tapas.sharding.placements import Placement, Replica

__all__ = ["Mesh", "MeshResult", "MeshSearch", "mesh_shapes", "gradient_all_reduce",
           "column_collectives", "search_meshes"]


_R = Replica()


def mesh_shapes(num_devices: int) -> list[Mesh]:
    """Every factorisation rows x cols of ``num_devices``, by increasing rows."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r}: must be a positive int")
    return [Mesh(r, num_devices // r) for r in range(1, num_devices + 1)
            if num_devices % r == 0]


def gradient_all_reduce(graph: Graph, weight_placements: Mapping[str, Placement], mesh: Mesh,
                        options: CostOptions | None = None) -> CostBreakdown:
    """The data-parallel all-reduce of every trainable weight's local gradient over the
    data axis of ``mesh`` (a ``Mesh`` on its cluster: the ``rows`` devices of a column): the
    local shard (the weight over ``cols`` when the row's strategy splits it, whole when it
    is replicated), a backward collective."""
    options = CostOptions.for_cluster(mesh.cluster) if options is None else options
    terms = []
    if mesh.rows == 1:
        return CostBreakdown(())
    axis = mesh.axis(DATA)
    # nested experts: each row holds other experts, so their gradients are not summed
    split = set(ExpertRegion.of(graph, mesh.rows).weights) if mesh.experts else set()
    for w in graph.weights:
        if not w.trainable or w.path in split:
            continue
        nbytes = w.num_elements * dtype_bytes(priced_dtype(w.dtype, options.precision, True))
        if not isinstance(weight_placements.get(w.path, _R), Replica):
            nbytes = -(-nbytes // mesh.cols)
        terms.append(collective_cost("AR", int(nbytes), axis, options, backward=True,
                                     label=f"dp {w.path}"))
    return CostBreakdown(tuple(terms))


def column_collectives(graph: Graph, weight_placements: Mapping[str, Placement], mesh: Mesh,
                       pattern_of: Callable[[int], Any] | None = None,
                       options: CostOptions | None = None) -> CostBreakdown:
    """Every collective over a column of ``mesh`` (on its cluster; its data axis):
    :func:`gradient_all_reduce` and, on a mesh with nested experts, the expert all-to-alls
    (``tapas.planning.experts.column_all_to_all``; ``pattern_of(node_id)`` is the row
    strategy's pattern). Terms are labelled ``dp <weight path>`` and ``ep <tensor name>``."""
    terms = gradient_all_reduce(graph, weight_placements, mesh, options).terms
    if mesh.experts:
        if pattern_of is None:
            raise ValueError(f"a {mesh} mesh prices its expert all-to-alls on the row "
                             "strategy's patterns: give pattern_of")
        terms += column_all_to_all(graph, pattern_of, mesh, options).terms
    return CostBreakdown(tuple(terms))


@dataclasses.dataclass(frozen=True)
class MeshResult:
    """One mesh shape: the row's strategy (None when the shape does not apply, with
    ``note`` saying why), its cost, the gradient all-reduce over the columns, the expert
    all-to-alls over the columns (nested experts), the total."""

    mesh: Mesh
    strategy: Any = None            # tapas.planning.strategy.Strategy of one row
    row_cost: float = math.inf      # seconds per step of the row's strategy
    dp_cost: float = 0.0            # seconds per step of the column all-reduces
    ep_cost: float = 0.0            # seconds per step of the column all-to-alls (experts)
    memory: float = math.inf        # bytes per device
    capture_seconds: float = 0.0    # capturing the row's graph (graph_for)
    search_seconds: float = 0.0     # searching it and pricing the column all-reduces
    note: str = ""

    @property
    def seconds(self) -> float:
        return self.capture_seconds + self.search_seconds

    @property
    def total(self) -> float:
        return self.row_cost + self.dp_cost + self.ep_cost

    @property
    def ok(self) -> bool:
        return self.strategy is not None

    def to_json(self) -> dict[str, Any]:
        return {"mesh": str(self.mesh), "rows": self.mesh.rows, "cols": self.mesh.cols,
                "plan": self.mesh.plan, "experts": self.mesh.experts,
                "row_cost": self.row_cost if self.ok else None,
                "dp_cost": self.dp_cost if self.ok else None,
                "ep_cost": self.ep_cost if self.ok else None,
                "total": self.total if self.ok else None,
                "memory": self.memory if self.ok else None,
                "capture_seconds": round(self.capture_seconds, 3),
                "search_seconds": round(self.search_seconds, 3),
                "note": self.note,
                "strategy": self.strategy.to_json() if self.ok else None}


@dataclasses.dataclass(frozen=True)
class MeshSearch:
    """Every mesh shape's result and the best one."""

    cluster: Cluster
    batch: int
    results: tuple[MeshResult, ...]

    @property
    def best(self) -> MeshResult:
        ok = [r for r in self.results if r.ok]
        if not ok:
            raise ValueError("no mesh shape applies: " + "; ".join(
                f"{r.mesh}: {r.note}" for r in self.results))
        return min(ok, key=lambda r: (r.total, r.mesh.rows))

    def summary(self) -> str:
        """The table `tapas search --meshes` prints."""
        lines = [f"meshes of {self.cluster.name} ({self.cluster.num_devices} devices), global "
                 f"batch {self.batch}: rows data parallel"
                 + (" (EP x TP: the experts split over the rows)"
                    if any(r.mesh.experts for r in self.results) else "")
                 + ", the searched strategy in each row",
                 f"{'mesh':>12} {'plan':>7} {'row batch':>9} {'row cost ms':>12} "
                 f"{'dp grad ms':>11} {'ep a2a ms':>10} {'total ms':>10} {'memory GiB':>11} "
                 f"{'capture s':>9} {'search s':>8}  note"]
        best = self.best.mesh if any(r.ok for r in self.results) else None
        for r in self.results:
            if not r.ok:
                lines.append(f"{str(r.mesh):>12} {r.mesh.plan:>7} {'-':>9} {'-':>12} {'-':>11} "
                             f"{'-':>10} {'-':>10} {'-':>11} {'-':>9} {'-':>8}  {r.note}")
                continue
            mark = "  <- best" if r.mesh == best else ""
            lines.append(f"{str(r.mesh):>12} {r.mesh.plan:>7} {self.batch // r.mesh.rows:>9} "
                         f"{r.row_cost * 1e3:>12.3f} {r.dp_cost * 1e3:>11.3f} "
                         f"{r.ep_cost * 1e3:>10.3f} "
                         f"{r.total * 1e3:>10.3f} {r.memory / 2**30:>11.2f} "
                         f"{r.capture_seconds:>9.2f} {r.search_seconds:>8.2f}  {r.note}{mark}")
        return "\n".join(lines)

    @property
    def search_seconds(self) -> float:
        """Search time over every mesh (capture excluded)."""
        return math.fsum(r.search_seconds for r in self.results)

    def to_json(self) -> dict[str, Any]:
        best = self.best.mesh if any(r.ok for r in self.results) else None
        return {"cluster": self.cluster.name, "devices": self.cluster.num_devices,
                "batch": self.batch, "best": str(best) if best else None,
                "search_seconds": round(self.search_seconds, 3),
                "results": [r.to_json() for r in self.results]}


def _same_structure(graph: Graph, folded: Any) -> bool:
    """Whether ``folded`` (mined on another batch of the same model) fits ``graph``: the
    same GraphNodes, kinds and edges (mining reads structure, not the batch size)."""
    return (folded.num_nodes == len(graph.nodes)
            and folded.node_kinds == tuple(n.kind.value for n in graph.nodes)
            and folded.edges == tuple(sorted({(e.src, e.dst) for e in graph.edges
                                              if e.src != e.dst})))


def search_meshes(graph_for: Callable[[int], Graph], batch: int, cluster: Cluster, *,
                  search: Callable[..., Any], meshes: Sequence[Mesh] | None = None,
                  options: CostOptions | None = None,
                  on_result: Callable[[MeshResult], None] | None = None,
                  experts: bool | None = None, **search_kwargs: Any) -> MeshSearch:
    """Search every mesh shape of ``cluster`` (module docstring).

    ``graph_for(rows)`` returns the graph of one row (the model at batch ``batch // rows``);
    in gp mode the graph is mined once and the templates reused for every row graph of the
    same structure (only the batch differs);
    ``search(graph, cluster=..., options=..., **search_kwargs)`` is ``tapas.search`` (passed
    in so that this module stays free of the capture stage). ``on_result`` is called after
    each shape (progress). ``experts``: also search each ``rows x cols:experts`` mesh
    (nested expert + tensor parallelism) after ``rows x cols``: None (the default) when
    the graph has MoE expert einsums, True always (a graph without them gets a note),
    False never; ``meshes`` given are searched as given."""
    options = CostOptions.for_cluster(cluster) if options is None else options
    results = []
    state: dict[str, Any] = {"folded": None, "graphs": {}}
    given = meshes is not None
    for mesh in (list(meshes) if given else mesh_shapes(cluster.num_devices)):
        variants = [mesh]
        if not given and mesh.rows > 1 and experts is not False and not batch % mesh.rows:
            has = experts or any(n.kind.value == "expert-einsum"   # (the 1-D graph's)
                                 for n in _row_graph(graph_for, 1, state).nodes)
            if has:
                variants.append(Mesh(mesh.rows, mesh.cols, True))
        for m in variants:
            result = _search_mesh(m, graph_for, batch, cluster, search, options, state,
                                  search_kwargs)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return MeshSearch(cluster, batch, tuple(results))


def _row_graph(graph_for: Callable[[int], Graph], rows: int, state: dict[str, Any]) -> Graph:
    """One row's graph, captured once per row count (``state["graphs"]``)."""
    if rows not in state["graphs"]:
        start = time.perf_counter()
        state["graphs"][rows] = (graph_for(rows), time.perf_counter() - start)
    return state["graphs"][rows][0]


def _search_mesh(mesh: Mesh, graph_for: Callable[[int], Graph], batch: int, cluster: Cluster,
                 search: Callable[..., Any], options: CostOptions, state: dict[str, Any],
                 search_kwargs: dict[str, Any]) -> MeshResult:
    """One mesh shape of :func:`search_meshes`."""
    if batch % mesh.rows:
        return MeshResult(mesh, note=f"the batch {batch} does not split into {mesh.rows} rows")
    try:
        mesh = mesh.on(cluster)
    except ValueError as e:
        return MeshResult(mesh, note=str(e))
    sub = mesh.row_cluster
    graph = _row_graph(graph_for, mesh.rows, state)
    # the capture is reported with the first mesh of this row count that uses it
    reported = state.setdefault("reported", set())
    capture_seconds = 0.0 if mesh.rows in reported else state["graphs"][mesh.rows][1]
    reported.add(mesh.rows)
    start = time.perf_counter()
    kwargs = dict(search_kwargs)
    if mesh.experts:
        try:
            kwargs["patterns_fn"] = nested_patterns(graph, mesh.rows,
                                                    kwargs.get("patterns_fn"))
        except NestingError as e:
            return MeshResult(mesh, note=str(e))
    if kwargs.get("mode", "gp") == "gp" and "folded" not in kwargs:
        if state["folded"] is None or not _same_structure(graph, state["folded"]):
            from tapas import mining
            state["folded"] = mining.mine(graph)
        kwargs["folded"] = state["folded"]
    strategy = search(graph, cluster=sub, options=options, **kwargs)
    placements = dict(strategy.weight_placements)
    dp = gradient_all_reduce(graph, placements, mesh, options)
    memory = float(strategy.memory.total)
    ep = 0.0
    where = ("one node" if sub.num_nodes == 1 else f"{sub.num_nodes} nodes")
    note = (f"rows on {where}, columns on {mesh.axis(DATA).nodes} node(s)"
            if mesh.rows > 1 else f"1-D over {where}")
    if mesh.experts:
        ep = column_all_to_all(graph, strategy.pattern, mesh, options).total
        memory -= expert_memory_saving(graph, placements, mesh.rows, mesh.cols,
                                       options).total
        note += f"; {ExpertRegion.of(graph).experts // mesh.rows} experts per row"
    return MeshResult(mesh, strategy, row_cost=strategy.total_cost, dp_cost=dp.total,
                      ep_cost=ep, memory=memory, capture_seconds=capture_seconds,
                      search_seconds=time.perf_counter() - start, note=note)
