"""tapas.planning.explore: enumeration with early stopping, template candidates, stitching, counts.

The patterns here are small hand-made ShardingPattern-like objects for dense layers (so the
enumeration is tested on its own); tests/test_search.py runs the real tapas.sharding.patterns.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tapas.planning import explore
from tapas import mining
from tapas.planning.cost import Cluster, CostOptions, collective_cost
from tapas.planning.explore import EdgeCoster, ExploreOptions, SearchTimeout
from tapas.planning.table import placed_weights
from tapas.sharding.patterns.pattern import Family
from tapas.sharding.placements import Placement, Replica, Split
from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo

B, H, F = 8, 16, 64          # batch, hidden, FFN width
N = 4                        # devices
FP32 = 4


@dataclasses.dataclass(frozen=True)
class FakeComm:
    kind: str
    tensor: str
    shape: tuple[int, ...]
    phase: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * FP32


# the family of each fake pattern, as the pattern stage sets it
FAMILY = {"replicate": Family.REPLICATE, "batch": Family.BATCH, "column": Family.COLUMN,
          "row": Family.ROW}


@dataclasses.dataclass(frozen=True)
class FakePattern:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: dict
    comms: tuple[FakeComm, ...] = ()
    flops: float = 0.0

    @property
    def family(self) -> Family:
        return FAMILY[self.name]

    @property
    def data_parallel(self) -> bool:
        return self.name == "batch"


def fake_patterns(node: GraphNode, graph: Graph, n: int) -> list[FakePattern]:
    """replicate / batch / column / row for a dense [*, K] @ [K, M]; replicate / batch for
    an input or an elementwise node."""
    out = node.outputs[0]
    if node.kind is not Kind.DENSE:
        ins = node.inputs
        pats = [FakePattern("replicate", ("R",) * len(ins), ("R",), {})]
        if out.shape[0] % n == 0:
            pats.append(FakePattern("batch", ("S0",) * len(ins), ("S0",), {}))
        return pats
    x, w = node.inputs[0], node.weights[0]
    k, m = w.shape
    flops = 2.0 * x.shape[0] * k * m
    wb = FakeComm("AR", w.path, w.shape, "bwd")
    pats = [FakePattern("replicate", ("R",), ("R",), {w.path: "R"}, (), flops),
            FakePattern("batch", ("S0",), ("S0",), {w.path: "R"}, (wb,), flops / n),
            # Megatron's column: the input gradient is partial -> all-reduce it backward (f)
            FakePattern("column", ("R",), ("S1",), {w.path: "S1"},
                        (FakeComm("AR", x.name, x.shape, "bwd"),), flops / n),
            # row: the output is partial -> all-reduce it forward (g)
            FakePattern("row", ("S1",), ("R",), {w.path: "S0"},
                        (FakeComm("AR", out.name, out.shape, "fwd"),), flops / n)]
    return pats


def fake_reshard(src: Placement, dst: Placement, t: TensorInfo) -> tuple[FakeComm, ...]:
    a, b = str(src), str(dst)
    if b == "P" or a == "P":
        raise ValueError(f"cannot reshard {a} -> {b}")
    if a.startswith("S") and b == "R":
        return (FakeComm("AG", t.name, t.shape, "fwd"),)
    if a == "R" and b.startswith("S"):
        return (FakeComm("AG", t.name, t.shape, "bwd"),)
    return (FakeComm("A2A", t.name, t.shape, "fwd"), FakeComm("A2A", t.name, t.shape, "bwd"))


def dense(name: str, x: TensorInfo, k: int, m: int, sig: str) -> GraphNode:
    y = TensorInfo(f"{name}/MatMul:0", (x.shape[0], m), "float32")
    w = WeightInfo(f"{name}/kernel", (k, m), "float32", True, f"{name}/ReadVariableOp")
    op = OpInfo(f"{name}/MatMul", "MatMul", (x.name,), (y,))
    return GraphNode(0, name, Kind.DENSE, (op,), (x,), (y,), (w,), sig)


def input_node(name: str = "x") -> GraphNode:
    t = TensorInfo(f"{name}:0", (B, H), "float32")
    return GraphNode(0, name, Kind.INPUT, (OpInfo(name, "Placeholder", (), (t,)),), (), (t,),
                     (), "in")


def add(name: str, a: TensorInfo, b: TensorInfo) -> GraphNode:
    y = TensorInfo(f"{name}:0", a.shape, "float32")
    return GraphNode(0, name, Kind.ELEMENTWISE, (OpInfo(name, "AddV2", (a.name, b.name), (y,)),),
                     (a, b), (y,), (), "add")


def mlp(layers: int = 1, residual: bool = False) -> Graph:
    nodes = [input_node()]
    x = nodes[0].outputs[0]
    for i in range(layers):
        up = dense(f"l{i}/up", x, H, F, "up")
        down = dense(f"l{i}/down", up.outputs[0], F, H, "down")
        nodes += [up, down]
        if residual:
            nodes.append(add(f"l{i}/add", x, down.outputs[0]))
        x = nodes[-1].outputs[0]
    return Graph.build(nodes, inputs=(nodes[0].outputs[0],), outputs=(x,), name=f"mlp{layers}")


@pytest.fixture
def cluster() -> Cluster:
    return Cluster.v100_ethernet(1, N)


def run(graph, cluster, mode="es", opts=None, cost_options=None, **kw):
    return explore.explore(graph, N, cluster, mode=mode, options=opts or ExploreOptions(),
                           cost_options=cost_options, patterns_fn=fake_patterns,
                           reshard_fn=fake_reshard, **kw)


def names(result, graph, plan):
    return tuple(result.table.infos[v][plan.patterns[v]].name for v in range(len(graph.nodes)))


# ---- the two-layer MLP --------------------------------------------------------------------

def all_valid_combinations(graph, allow_reshard):
    """Brute force: every combination, valid if every pair matches (or reshards)."""
    pats = [fake_patterns(n, graph, N) for n in graph.nodes]
    valid = []
    for combo in itertools.product(*pats):
        ok = True
        for e in graph.edges:
            j = graph.nodes[e.dst].inputs.index(e.tensor)
            have = combo[e.src].outputs[0]
            want = combo[e.dst].inputs[j]
            if have != want and not allow_reshard:
                ok = False
        if ok:
            valid.append(tuple(p.name for p in combo))
    return valid


def test_strict_validation_keeps_megatron_and_rejects_row_then_row(cluster):
    g = mlp(1)
    opts = ExploreOptions(allow_reshard=False, top_k=64)
    res = run(g, cluster, opts=opts)
    found = {names(res, g, p) for p in res.plans}
    brute = set(all_valid_combinations(g, allow_reshard=False))
    assert found == brute
    assert ("replicate", "column", "row") in found             # Megatron
    assert ("batch", "batch", "batch") in found                # data parallel
    assert ("replicate", "row", "row") not in found            # R -> S1 without a collective
    assert ("replicate", "column", "column") not in found      # S1 -> R without a collective
    c = res.counts
    # every extension is either pruned early or costed; complete plans are what is left
    assert c.generated == c.pruned_early + c.costed
    assert c.valid == len(brute) and c.pruned_early > 0
    total = math.prod(len(fake_patterns(n, g, N)) for n in g.nodes)
    assert c.generated < sum(math.prod(len(fake_patterns(n, g, N)) for n in g.nodes[:i + 1])
                             for i in range(len(g.nodes)))   # early stopping saved work
    assert len(brute) < total


def test_megatron_mlp_cost_is_one_forward_and_one_backward_all_reduce(cluster):
    g = mlp(1)
    opts = CostOptions(compute=False)
    res = run(g, cluster, opts=ExploreOptions(top_k=64), cost_options=opts)
    megatron = next(p for p in res.plans if names(res, g, p) == ("replicate", "column", "row"))
    act = B * H * FP32
    expected = (collective_cost("AR", act, cluster.axis(N), opts, backward=False).total
                + collective_cost("AR", act, cluster.axis(N), opts, backward=True).total)
    # by hand: alpha' W + beta 2(W-1)/W N eps, twice, the backward one with gamma
    lat, beta = cluster.intra.latency * N, cluster.intra.beta
    by_hand = 2 * lat + beta * 2 * (N - 1) / N * act * (1 + opts.gamma) * opts.epsilon["AR"]
    assert math.isclose(megatron.cost, expected, rel_tol=1e-12)
    assert math.isclose(megatron.cost, by_hand, rel_tol=1e-12)
    pc, resharded = explore.plan_cost(g, res.table, megatron.patterns,
                                      EdgeCoster(N, cluster, opts, fake_reshard))
    assert resharded == [] and math.isclose(pc.total, by_hand, rel_tol=1e-12)


def test_reshard_allowed_makes_row_then_row_valid_at_a_cost(cluster):
    g = mlp(1)
    opts = CostOptions(compute=False)
    res = run(g, cluster, opts=ExploreOptions(top_k=64), cost_options=opts)
    rr = next(p for p in res.plans if names(res, g, p) == ("replicate", "row", "row"))
    pc, resharded = explore.plan_cost(g, res.table, rr.patterns,
                                      EdgeCoster(N, cluster, opts, fake_reshard))
    # x (R) -> row wants S1: free slice forward, all-gather of the gradient backward
    x = B * H * FP32
    ag_bwd = collective_cost("AG", x, cluster.axis(N), opts, backward=True).total
    assert [(s, d, have, want) for s, d, _, have, want in resharded] == [
        (0, 1, Replica(), Split(1)), (1, 2, Replica(), Split(1))]
    assert math.isclose(pc.total, rr.cost, rel_tol=1e-12)
    ar_fwd = lambda nbytes: collective_cost("AR", nbytes, cluster.axis(N), opts).total  # noqa: E731
    assert math.isclose(rr.cost, ar_fwd(B * F * FP32) + ar_fwd(B * H * FP32)
                        + ag_bwd + collective_cost("AG", B * F * FP32, cluster.axis(N), opts,
                                                   backward=True).total, rel_tol=1e-12)


def test_data_parallel_layer_cost_is_the_weight_gradient_all_reduce(cluster):
    g = mlp(1)
    opts = CostOptions(compute=False)
    res = run(g, cluster, opts=ExploreOptions(top_k=64), cost_options=opts)
    dp = next(p for p in res.plans if names(res, g, p) == ("batch", "batch", "batch"))
    w = H * F * FP32
    one = collective_cost("AR", w, cluster.axis(N), opts, backward=True).total
    assert math.isclose(dp.cost, 2 * one, rel_tol=1e-12)


def test_column_then_gather_costs_an_all_gather(cluster):
    """A column-parallel layer whose output feeds a replicated consumer: all-gather it."""
    g = mlp(1)
    opts = CostOptions(compute=False)
    res = run(g, cluster, opts=ExploreOptions(top_k=64), cost_options=opts)
    plan = next(p for p in res.plans if names(res, g, p) == ("replicate", "column", "replicate"))
    y = B * F * FP32
    expected = (collective_cost("AR", B * H * FP32, cluster.axis(N), opts, backward=True).total
                + collective_cost("AG", y, cluster.axis(N), opts).total)
    assert math.isclose(plan.cost, expected, rel_tol=1e-12)


def test_es_matches_brute_force_best(cluster):
    g = mlp(2, residual=True)
    res = run(g, cluster, opts=ExploreOptions(top_k=3))
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard)
    pats = [fake_patterns(n, g, N) for n in g.nodes]
    best = min(explore.plan_cost(g, res.table, combo, edges)[0].total
               for combo in itertools.product(*(range(len(p)) for p in pats)))
    assert math.isclose(res.best.cost, best, rel_tol=1e-9)
    costs = [p.cost for p in res.plans]
    assert costs == sorted(costs) and len(set(p.patterns for p in res.plans)) == len(costs)
    for p in res.plans:   # the ranking cost is the exact plan cost
        assert math.isclose(explore.plan_cost(g, res.table, p.patterns, edges)[0].total,
                            p.cost, rel_tol=1e-9)


def test_pattern_infos_carry_typed_placements_family_and_memory(cluster):
    g = mlp(1)
    res = run(g, cluster)
    col = res.table.infos[1][res.table.index(1, "column")]
    assert col.inputs == (Replica(),) and col.outputs == (Split(1),)
    assert col.family is Family.COLUMN and not col.data_parallel
    assert dict(placed_weights(g.nodes[1], col)) == {"l0/up/kernel": Split(1)}
    assert col.weight_placements == (Split(1),) and str(col.outputs[0]) == "S1"
    batch = res.table.infos[1][res.table.index(1, "batch")]
    assert batch.family is Family.BATCH and batch.data_parallel
    assert dict(placed_weights(g.nodes[1], batch)) == {"l0/up/kernel": Replica()}
    # the kernel split over N devices, its gradient and Adam's two slots; the output split
    w = H * F * FP32 / N
    assert (col.memory.weights, col.memory.gradients, col.memory.optimizer) == (w, w, 2 * w)
    assert col.memory.activations == B * F * FP32 / N
    assert batch.memory.weights == H * F * FP32


def test_graphnodes_of_one_signature_share_a_row_and_name_their_own_weights(cluster):
    g = mlp(3)
    table = run(g, cluster).table
    ups = [v for v, node in enumerate(g.nodes) if node.name.endswith("/up")]
    assert len(ups) == 3 and len({g.nodes[v].signature for v in ups}) == 1
    assert all(table.infos[v] is table.infos[ups[0]] for v in ups)
    for layer, v in enumerate(ups):
        col = table.infos[v][table.index(v, "column")]
        assert dict(placed_weights(g.nodes[v], col)) == {f"l{layer}/up/kernel": Split(1)}


# ---- gp: templates, ties, stitching -------------------------------------------------------

def test_gp_ties_instances_and_matches_es_on_a_repeated_stack(cluster):
    g = mlp(4, residual=True)
    folded = mining.mine(g, min_support=4)
    assert folded.templates and folded.templates[0].num_instances == 4
    gp = run(g, cluster, mode="gp", folded=folded)
    es = run(g, cluster, mode="es")
    assert gp.best.cost >= es.best.cost * (1 - 1e-12)
    assert gp.best.cost <= es.best.cost * 1.015
    t = folded.templates[0]
    pats = [tuple(gp.best.patterns[v] for v in inst) for inst in t.instances]
    assert len(set(pats)) == 1                           # one choice for every instance
    tr = gp.templates[0]
    assert tr.candidates and tr.counts.valid >= len(tr.candidates)
    assert gp.counts.generated < es.counts.generated     # folding did less work
    assert set(gp.timings) >= {"patterns", "enumeration", "stitching"}


def test_allowed_restricts_and_falls_back_to_replicate(cluster):
    g = mlp(2)
    res = run(g, cluster, allowed=lambda node, p: p.name in ("column", "row"))
    assert names(res, g, res.best) == ("replicate", "column", "row", "column", "row")
    res = run(g, cluster, allowed=lambda node, p: p.family is Family.REPLICATE)
    assert set(names(res, g, res.best)) == {"replicate"}


def test_time_limit_raises(cluster):
    g = mlp(3, residual=True)
    with pytest.raises(SearchTimeout, match="time limit"):
        run(g, cluster, opts=ExploreOptions(time_limit=1e-9))


def test_beam_marks_inexact(cluster):
    g = mlp(2, residual=True)
    res = run(g, cluster, opts=ExploreOptions(max_states=1))
    assert not res.exact and res.counts.beam > 0


def test_bad_options():
    with pytest.raises(ValueError, match="top_k=0: must be an integer >= 1"):
        ExploreOptions(top_k=0)
    with pytest.raises(ValueError, match="mode='xx'"):
        explore.explore(mlp(1), N, Cluster.v100_ethernet(1, N), mode="xx",
                        patterns_fn=fake_patterns)


# ---- the order of the enumeration ---------------------------------------------------------

def branches(width: int = 3) -> Graph:
    """``width`` parallel two-dense branches from one input, summed; ids interleave the
    branches (a1 b1 c1 a2 b2 c2 ...), as a capture of a wide cell may."""
    x = input_node()
    firsts = [dense(f"b{i}/up", x.outputs[0], H, F, "up") for i in range(width)]
    seconds = [dense(f"b{i}/down", f.outputs[0], F, H, "down") for i, f in enumerate(firsts)]
    nodes = [x, *firsts, *seconds]
    acc = seconds[0].outputs[0]
    for i, s in enumerate(seconds[1:]):
        nodes.append(add(f"sum{i}", acc, s.outputs[0]))
        acc = nodes[-1].outputs[0]
    return Graph.build(nodes, inputs=(x.outputs[0],), outputs=(acc,), name=f"branches{width}")


def test_a_narrow_order_carries_fewer_tensors_and_finds_the_same_plans(cluster, monkeypatch):
    from tapas.planning import steps
    g = branches(3)
    ids = [n.id for n in g.nodes]
    narrow = steps.narrow_order(g, ids)
    pos = {v: i for i, v in enumerate(narrow)}
    assert all(pos[e.src] < pos[e.dst] for e in g.edges)            # topological
    assert steps.live_width(g, narrow) < steps.live_width(g, ids)
    assert steps.good_order(g, ids) == narrow
    chosen = run(g, cluster, opts=ExploreOptions(top_k=5))
    monkeypatch.setattr(explore, "good_order", lambda graph, nodes: sorted(nodes))
    plain = run(g, cluster, opts=ExploreOptions(top_k=5))
    assert [p.cost for p in chosen.plans] == pytest.approx([p.cost for p in plain.plans],
                                                           rel=1e-12)
    assert chosen.counts.generated < plain.counts.generated


def test_a_frontier_state_hashes_and_compares_as_its_items():
    """frontier.State is hashed incrementally (items XORed in and out as a prefix extension
    sets and drops them); it must hash, compare and iterate exactly as a state built from
    its items at once, whatever the order of the changes."""
    import random

    from tapas.planning.frontier import State
    from tapas.sharding.placements import Replica, Split
    rng = random.Random(0)
    values = [Replica(), Split(0), Split(1), 0, 1]
    keys = [(i, 0) for i in range(6)] + [("x", "in:0"), ("tie", 2)]
    state = State.of([])
    for _ in range(300):
        puts = [(rng.choice(keys), rng.choice(values)) for _ in range(rng.randint(0, 3))]
        drops = rng.sample(keys, rng.randint(0, 2))
        state = state.changed(puts, drops)
        whole = State.of(list(state))
        assert hash(state) == hash(whole) and state == whole
        assert list(state) == sorted(whole.items.items(), key=lambda kv: repr(kv[0]))
        assert {k for k, _ in state}.isdisjoint(drops)
    assert State.of([((0, 0), Split(0))]) != State.of([((0, 0), Split(1))])
