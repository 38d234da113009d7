"""tapas.search: Strategy, reference plans, memory budget, JSON, and the real patterns.

The first half uses test_explore's hand-made dense patterns (the search logic on its own);
the second half runs the real tapas.sharding.patterns on a captured two-layer MLP and on t5-tiny.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
from test_explore import B, F, FP32, H, fake_patterns, fake_reshard, mlp

from tapas.planning import explore, search
from tapas.planning.table import pattern_table, placed_weights
from tapas.planning.cost import Cluster, CostOptions, collective_cost
from tapas.ir import Graph
from tapas.planning.search import MemoryBudgetError, Strategy

N = 4


def fake_search(graph: Graph, **kw) -> Strategy:
    kw.setdefault("cluster", Cluster.v100_ethernet(1, N))
    return search.search(graph, patterns_fn=fake_patterns, reshard_fn=fake_reshard, **kw)


# ---- Strategy: JSON, binding, errors ------------------------------------------------------

def test_json_round_trip_and_save_load(tmp_path):
    g = mlp(3, residual=True)
    s = fake_search(g)
    again = Strategy.from_json(json.loads(s.dumps()), g)
    assert again == s
    path = tmp_path / "s.json"
    s.save(str(path))
    loaded = Strategy.load(str(path), g, num_devices=N)
    assert loaded.patterns == s.patterns and loaded.total_cost == s.total_cost
    assert loaded.references == s.references and loaded.alternatives == s.alternatives
    assert loaded.cluster == s.cluster and loaded.memory == s.memory
    assert len(s.patterns) == len(g.nodes) and s.num_devices == N


def test_loading_against_another_model_or_device_count_fails_clearly(tmp_path):
    s = fake_search(mlp(2))
    path = tmp_path / "s.json"
    s.save(str(path))
    other = mlp(3)
    with pytest.raises(ValueError) as e:
        Strategy.load(str(path), other)
    msg = str(e.value)
    assert "'mlp2'" in msg and "'mlp3'" in msg and s.graph_digest in msg and str(path) in msg
    assert "run tapas search on this model" in msg
    with pytest.raises(ValueError, match=r"shards over 4 devices .* but 8 were given"):
        Strategy.load(str(path), mlp(2), num_devices=8)
    with pytest.raises(ValueError, match="not a TAPAS strategy"):
        Strategy.from_json({"format": "x"})
    unbound = Strategy.load(str(path))
    with pytest.raises(ValueError, match="not bound to a graph"):
        unbound.pattern(0)


def test_strategy_reports_costs_counts_timings_and_references():
    g = mlp(3, residual=True)
    s = fake_search(g, options=CostOptions(compute=False))
    c = s.cost
    assert math.isclose(c["total"], c["communication"] + c["compute"])
    assert math.isclose(c["forward"] + c["backward"], c["communication"])
    assert math.isclose(sum(c["per_template"].values()), c["total"], rel_tol=1e-9)
    assert set(s.timings) >= {"mining", "patterns", "costing", "enumeration", "stitching",
                              "validation", "references"}
    cnt = s.counts
    assert cnt["generated"] == cnt["pruned_early"] + cnt["costed"] and cnt["templates"] == 1
    names = [r.name for r in s.references]
    assert names == ["ffn-only", "data-parallel", "replicate"]
    # references cost what their patterns say, by hand:
    dp = next(r for r in s.references if r.name == "data-parallel")
    w_ar = collective_cost("AR", H * F * FP32, s.cluster.axis(N), CostOptions(compute=False),
                           backward=True).total
    assert math.isclose(dp.cost, 6 * w_ar, rel_tol=1e-12)
    rep = next(r for r in s.references if r.name == "replicate")
    assert rep.cost == 0.0 and rep.communication == 0.0
    ranked = [a.cost for a in s.alternatives]
    assert ranked == sorted(ranked) and math.isclose(ranked[0], s.total_cost)
    text = s.summary()
    for line in ("ranked alternatives", "reference plans:", "phase timings:", "counts:",
                 "ffn-only", "data-parallel"):
        assert line in text


def test_memory_budget_rejects_and_re_searches_with_a_penalty():
    g = mlp(2)
    base = fake_search(g, options=CostOptions(compute=False))
    assert set(base.patterns) <= {"replicate"}                    # cheapest: no comms
    # a budget under the replicated plan's memory forces a sharded one
    budget = base.memory.total * 0.6
    s = fake_search(g, options=CostOptions(compute=False), memory_budget=budget)
    assert s.memory.total <= budget < base.memory.total
    assert s.total_cost > base.total_cost and s.counts["penalty_rounds"] >= 1
    assert any("memory penalty" in n for n in s.notes)
    with pytest.raises(MemoryBudgetError) as e:
        fake_search(g, memory_budget=1000.0)
    msg = str(e.value)
    assert "smallest found needs" in msg and "largest share is GraphNode" in msg
    assert "use more devices" in msg


def test_a_budget_under_the_memory_bound_is_refused_after_one_penalty_round(monkeypatch):
    """A budget under what no plan goes below (every GraphNode's and weight's smallest
    share, ``explore.memory_lower_bound``) is refused after one penalised exploration (for
    the error's smallest plan), not six (keras-hub Qwen3.5-MoE: 220 s); the bound is below
    every plan's memory, and a budget that can be met takes the first penalty that fits."""
    penalties = []
    original = search._Runner.explore

    def counting(self, allowed, xo):
        penalties.append(xo.memory_penalty)
        return original(self, allowed, xo)
    monkeypatch.setattr(search._Runner, "explore", counting)
    g = mlp(2)
    with pytest.raises(MemoryBudgetError, match="smallest found needs"):
        fake_search(g, memory_budget=1000.0)
    assert len([p for p in penalties if p > 0]) == 1, penalties
    penalties.clear()
    base = fake_search(g, options=CostOptions(compute=False))
    s = fake_search(g, options=CostOptions(compute=False), memory_budget=base.memory.total * 0.6)
    assert s.memory.total <= base.memory.total * 0.6
    assert 1 <= s.counts["penalty_rounds"] == len([p for p in penalties if p > 0])
    table = pattern_table(g, N, Cluster.v100_ethernet(1, N), CostOptions(compute=False),
                          fake_patterns)
    bound = explore.memory_lower_bound(g, table)
    assert 0 < bound <= s.memory.total and bound <= base.memory.total


def test_bad_inputs():
    g = mlp(1)
    with pytest.raises(ValueError, match="devices_per_node=0: a cluster with no devices"):
        Cluster.v100_ethernet(1, 0)
    with pytest.raises(ValueError, match="num_nodes=-1"):
        Cluster.v100_ethernet(-1, 8)
    with pytest.raises(ValueError, match="top_k=0"):
        fake_search(g, top_k=0)
    with pytest.raises(ValueError, match="mode='xx'"):
        fake_search(g, mode="xx")
    with pytest.raises(ValueError, match="memory_budget=-1"):
        fake_search(g, memory_budget=-1)
    with pytest.raises(TypeError, match="must be a tapas.planning.cost.Cluster"):
        fake_search(g, cluster="v100")


def test_graph_digest_ignores_names_but_not_structure():
    a, b = mlp(2), dataclasses.replace(mlp(2), name="renamed")
    assert search.graph_digest(a) == search.graph_digest(b)
    assert search.graph_digest(a) != search.graph_digest(mlp(3))
    # the edges in another order (a dict of inputs traced in another key order lists the
    # ops, hence the edges, differently): the same graph
    c = dataclasses.replace(a, edges=tuple(reversed(a.edges)))
    assert search.graph_digest(c) == search.graph_digest(a)


def test_search_imports_no_tensorflow():
    code = ("import sys; import tapas.planning.search, tapas.planning.explore, "
            "tapas.planning.cost, tapas.planning.cluster, tapas.planning.table, "
            "tapas.planning.frontier, tapas.planning.references, tapas.planning.strategy, "
            "tapas.planning.report; "
            "print(any(m.startswith('tensorflow') for m in sys.modules))")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


# ---- the real patterns ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_graph() -> Graph:
    import keras
    import tensorflow as tf

    from tapas import capturing
    inputs = keras.Input((16,), batch_size=8, name="x")
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    out = keras.layers.Dense(16, name="down")(h)
    model = keras.Model(inputs, out, name="mlp")
    return capturing.capture(model, tf.TensorSpec((8, 16), tf.float32))


def _dense_ids(graph: Graph) -> list[int]:
    return [n.id for n in graph.nodes if n.kind.value == "dense"]


def test_two_layer_mlp_valid_set_has_megatron_and_rejects_row_then_row(mlp_graph):
    import itertools

    from tapas.sharding import patterns
    g = mlp_graph
    up, down = _dense_ids(g)
    cluster = Cluster.v100_ethernet(1, N)
    res = explore.explore(g, N, cluster, mode="es",
                          options=explore.ExploreOptions(allow_reshard=False, top_k=1000))
    found = {tuple(res.table.infos[v][p.patterns[v]].name for v in range(len(g.nodes)))
             for p in res.plans}
    # brute force over every combination of the real patterns: valid iff every pair matches
    pats = [patterns.patterns_for(n, g, N) for n in g.nodes]
    prod = {t.name: (n.id, i) for n in g.nodes for i, t in enumerate(n.outputs)}
    valid = set()
    for combo in itertools.product(*pats):
        if all(str(combo[prod[t.name][0]].outputs[prod[t.name][1]]) == str(combo[n.id].inputs[j])
               for n in g.nodes for j, t in enumerate(n.inputs) if t.name in prod):
            valid.add(tuple(p.name for p in combo))
    assert found == valid
    pairs = {(c[up], c[down]) for c in found}
    assert ("column", "row") in pairs                     # Megatron
    assert ("row", "row") not in pairs                     # R output into a row split
    assert ("column", "column") not in pairs               # S output into a replicated read
    assert res.counts.pruned_early > 0 and res.counts.valid == len(valid)
    assert res.counts.generated == res.counts.pruned_early + res.counts.costed


def test_megatron_mlp_cost_from_the_real_patterns(mlp_graph):
    """column then row: one forward AR of the [8, 16] output and one backward AR of the
    [8, 16] input gradient, nothing else (compute off); the input is the model's, whose
    gradient a training step never computes, so with gradient_flow (the default) only the
    forward AR is priced."""
    g = mlp_graph
    up, down = _dense_ids(g)
    cluster = Cluster.v100_ethernet(1, N)
    opts = CostOptions(compute=False)
    s = search.search(g, cluster=cluster, options=opts, top_k=50,
                      explore_options=explore.ExploreOptions(top_k=50))
    table = s._table
    megatron = [table.index(v, "replicate") for v in range(len(g.nodes))]
    megatron[up], megatron[down] = table.index(up, "column"), table.index(down, "row")
    pc, resharded = explore.plan_cost(g, table, megatron,
                                      explore.EdgeCoster(N, cluster, opts))
    act = 8 * 16 * FP32
    lat, beta, w = cluster.intra.latency * N, cluster.intra.beta, N
    forward = lat + beta * 2 * (w - 1) / w * act * opts.epsilon["AR"]
    backward = lat + beta * 2 * (w - 1) / w * act * opts.gamma * opts.epsilon["AR"]
    assert resharded == [] and len(pc.comms) == 1 and not pc.comms.terms[0].backward
    assert math.isclose(pc.total, forward, rel_tol=1e-12)
    every = dataclasses.replace(opts, gradient_flow=False)
    table_all = pattern_table(g, N, cluster, every)
    assert table_all.gradients is None
    pc_all, _ = explore.plan_cost(g, table_all, megatron, explore.EdgeCoster(N, cluster, every))
    assert len(pc_all.comms) == 2
    assert math.isclose(pc_all.total, forward + backward, rel_tol=1e-12)
    # the chosen strategy binds to the graph and returns the full ShardingPatterns
    for v in range(len(g.nodes)):
        assert s.pattern(v).name == s.patterns[v]
    assert all(e.comms for e in s.edge_comms)


def test_strategy_holds_typed_ids_and_placements_and_writes_them_as_text(mlp_graph):
    """Inside the program a Strategy holds PatternIds (family + variant) and placement
    objects; its JSON holds their names and short forms, parsed back to equal typed values;
    a name of no family is refused at load, naming the file's pattern."""
    from tapas.sharding.patterns import Family, PatternId
    from tapas.sharding.placements import Replica, Split
    g = mlp_graph
    s = search.search(g, cluster=Cluster.v100_ethernet(1, N), mode="es",
                      options=CostOptions(compute=False))
    # (the cheapest plan of so small an MLP splits no weight: place one as Megatron would)
    s = dataclasses.replace(s, weight_placements={"up/kernel": Split(1)})
    d = json.loads(s.dumps())
    for v, pid in enumerate(s.patterns):
        assert isinstance(pid, PatternId) and s.pattern(v).family is pid.family
        assert d["patterns"][v] == pid.variant and type(d["patterns"][v]) is str
    assert d["weight_placements"] == {k: str(p) for k, p in s.weight_placements.items()}
    assert all(isinstance(p, (Split, Replica)) for p in
               (*s.input_placements.values(), *s.output_placements.values()))
    again = Strategy.from_json(d, g)
    assert again.patterns == s.patterns and again.weight_placements == s.weight_placements
    assert [p.family for p in again.patterns] == [p.family for p in s.patterns]
    written = json.loads(again.dumps())
    for key in ("patterns", "edges", "input_placements", "output_placements",
                "weight_placements", "alternatives", "references"):
        assert written[key] == d[key], key
    d["patterns"][0] = "diagonal"
    with pytest.raises(ValueError, match="'diagonal' belongs to no pattern family"):
        Strategy.from_json(d, g)
    assert {p.family for p in s.patterns} <= set(Family)


def test_search_accepts_a_keras_model():
    import keras
    import tensorflow as tf
    inputs = keras.Input((16,), batch_size=8)
    model = keras.Model(inputs, keras.layers.Dense(32)(inputs))
    s = search.search(model, tf.TensorSpec((8, 16), tf.float32),
                      cluster=Cluster.v100_ethernet(1, 2), references=())
    assert "capture" in s.timings and len(s.patterns) == s.num_nodes


@pytest.fixture(scope="module")
def t5_tiny() -> Graph:
    from tapas import capturing, models
    entry = models.get("t5-tiny")
    return capturing.capture(entry.build(fast_init=True), list(entry.input_spec()))


def test_t5_tiny_ranked_list_shows_reference_plans(t5_tiny):
    s = search.search(t5_tiny, cluster=Cluster.v100_ethernet(1, 2))
    refs = {r.name: r for r in s.references}
    assert list(refs) == ["megatron", "ffn-only", "mha-only", "data-parallel", "replicate"]
    for r in refs.values():
        assert not r.error and math.isfinite(r.cost) and r.cost >= s.total_cost * (1 - 1e-12)
    roles = search.node_roles(t5_tiny)
    # each reference plan splits what it names and nothing of the families it leaves whole
    for name, split, whole in (("megatron", ("ffn", "attention"), ()),
                               ("ffn-only", ("ffn",), ("attention",)),
                               ("mha-only", ("attention",), ("ffn",))):
        pats = dict(enumerate(s.patterns))
        pats.update(refs[name].changes)
        for v, role in enumerate(roles):
            if role in split:
                assert pats[v] in ("column", "row", "heads"), (name, v, pats[v])
            if role in whole:
                assert pats[v] == "replicate", (name, v, pats[v])
    text = s.summary()
    for name in refs:
        assert name in text
    assert "weights split" in text and "reference plans:" in text


@pytest.mark.parametrize("preset,devices", [("t5-tiny", 2), ("moe-tiny", 2), ("resnet-tiny", 4)])
def test_gp_is_within_1_5_percent_of_es_on_tiny_presets(preset, devices):
    from tapas import capturing, models
    entry = models.get(preset)
    g = capturing.capture(entry.build(fast_init=True), list(entry.input_spec()))
    cluster = Cluster.v100_ethernet(1, devices)
    gp = search.search(g, cluster=cluster, mode="gp", references=())
    es = search.search(g, cluster=cluster, mode="es", references=())
    assert es.total_cost <= gp.total_cost * (1 + 1e-9)
    assert gp.total_cost <= es.total_cost * 1.015
    assert es.counts["templates"] == 0 and es.counts["units"] == len(g.nodes)
    assert gp.counts["units"] <= len(g.nodes)


def test_a_node_whose_patterns_fail_is_noted_not_fatal(mlp_graph, monkeypatch):
    """Issue 10: a GraphNode whose patterns cannot be built keeps replicate, and the
    strategy says so."""
    from tapas.sharding import patterns
    g = mlp_graph
    dense = g.nodes[_dense_ids(g)[0]]
    real_trial = patterns.SeedContext.trial

    def trial(self, seed):
        if self.node.id == dense.id:
            raise ValueError("an op this stage has not met")
        return real_trial(self, seed)

    monkeypatch.setattr(patterns.SeedContext, "trial", trial)
    patterns.clear_cache()
    try:
        s = search.search(g, cluster=Cluster.v100_ethernet(1, 2))
    finally:
        patterns.clear_cache()
    assert s.patterns[dense.id] == "replicate"
    (note,) = [n for n in s.notes if n.startswith(f"GraphNode {dense.id} ")]
    assert "ValueError: an op this stage has not met" in note and "left out" in note
    assert note in s.summary()


def test_progress_reports_steps_and_candidates(monkeypatch):
    """Issue 10: a slow search shows units done / total and a running candidate count."""
    import io

    from tapas.cli import SearchProgress
    from tapas.planning import frontier
    monkeypatch.setattr(frontier, "_PROGRESS_SECONDS", 0.0)   # report at every step
    g = mlp(4, residual=True)
    calls = []
    search.search(g, cluster=Cluster.v100_ethernet(1, 4), mode="gp", patterns_fn=fake_patterns,
                  reshard_fn=fake_reshard, progress=lambda *a: calls.append(a))
    phases = {c[0] for c in calls}
    assert {"enumeration", "stitching"} <= phases
    assert any(p.startswith("reference ") for p in phases)
    stitched = [c for c in calls if c[0] == "stitching"]
    assert all(0 <= done <= total and cand >= 0 for _, done, total, cand in stitched)
    assert stitched[-1][3] > stitched[0][3] >= 0          # candidates keep counting
    out = io.StringIO()
    show = SearchProgress(0.0, out, enabled=True)
    show("stitching", 3, 10, 12345)
    drawn = out.getvalue()
    show.close()
    assert "search stitching: [" in drawn and "3/10 GraphNodes, 12,345 candidates" in drawn
    assert "ETA" in drawn and out.getvalue().endswith("\r")   # the line cleared
    quiet = io.StringIO()   # not a terminal: nothing
    SearchProgress(0.0, quiet)("stitching", 3, 10, 12345)
    assert quiet.getvalue() == ""


def test_constant_filter_keeps_masks_replicated_and_the_frontier_small():
    """Issue 10: tensors every layer reads but that come only from inputs and constants
    (padding-mask biases) are computed replicated instead of searched; the optimum is the
    same, gp and es agree, and far fewer candidates are generated."""
    import tapas
    from tapas import models
    from tapas.planning.table import constant_nodes
    entry = models.get("t5-tiny-masked")
    g = tapas.capture(entry.build(fast_init=True), list(entry.input_spec()))
    const = constant_nodes(g)
    assert const and all(not g.nodes[v].weights for v in const)
    assert all(g.nodes[v].kind.value != "input" for v in const)
    cluster = Cluster.v100_ethernet(1, 4)
    on = search.search(g, cluster=cluster)
    off = search.search(g, cluster=cluster, options=CostOptions(constant_filter=False))
    assert on.counts["constant_nodes"] == len(const) and off.counts["constant_nodes"] == 0
    assert all(on.patterns[v] == "replicate" for v in const)
    assert on.total_cost == pytest.approx(off.total_cost, rel=1e-9)
    assert on.counts["generated"] < off.counts["generated"]
    es = search.search(g, cluster=cluster, mode="es")
    assert es.total_cost == pytest.approx(on.total_cost, rel=1e-9)


def test_a_weight_read_in_two_placements_is_priced_when_asked() -> None:
    """t5-tiny's tied embedding: the lookups read it replicated (stored so: first reader),
    the LM head split on the vocabulary; with CostOptions(weight_reshards=True) the plan's
    cost adds exactly the reshard's collectives (the gradient's all-gather, as the runtime's
    audit predicts), once per other placement; off, nothing changes."""
    import tapas
    from tapas import models
    from tapas.planning.table import EdgeCoster, pattern_table
    entry = models.get("t5-tiny")
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec(8)))
    cluster = Cluster.v100_ethernet(1, 2)
    costs = {}
    for flag in (False, True):
        opts = CostOptions.for_cluster(cluster, weight_reshards=flag)
        table = pattern_table(graph, 2, cluster, opts)
        edges = EdgeCoster(2, cluster, opts)
        idx = [[i.name for i in table.infos[v]].index("replicate") for v in range(len(graph.nodes))]
        head = [n.id for n in graph.nodes if n.kind.value == "dense"
                and any("shared_embedding" in w.path for w in n.weights)][-1]
        split = [k for k, i in enumerate(table.infos[head])
                 if any("shared_embedding" in p and str(pl).startswith("S")
                         for p, pl in placed_weights(graph.nodes[head], i))]
        assert split, [i.name for i in table.infos[head]]
        idx[head] = split[0]
        costs[flag] = explore.plan_cost(graph, table, idx, edges)[0].total
        terms = explore.weight_reshard_terms(graph, table, idx, edges)
        assert terms and all("shared_embedding" in t.label for t in terms)
        assert any(t.kind.value == "AG" and t.backward for t in terms)
        everything_replicated = [[i.name for i in table.infos[v]].index("replicate")
                                 for v in range(len(graph.nodes))]
        assert explore.weight_reshard_terms(graph, table, everything_replicated, edges) == []
    assert math.isclose(costs[True] - costs[False], sum(t.total for t in terms), rel_tol=1e-9)


def test_plan_with_weights_places_them_as_given_and_says_what_it_cannot(t5_tiny):
    """Another system's parameter placements costed by the cost model: Megatron's weights
    of the first encoder layer given (es: every GraphNode on its own), the rest searched; a
    placement no pattern offers is left free and named."""
    from tapas.sharding.placements import Replica, Split
    cluster = Cluster.v100_ethernet(1, 2)
    given = {"encoder_block_0/self_attention/q/kernel": "S1",
             "encoder_block_0/self_attention/o/kernel": "S0",
             "encoder_block_0/ffn/wi/kernel": "S1", "encoder_block_0/ffn/wo/kernel": "S0",
             "encoder_block_1/ffn/wi/kernel": "S5"}          # no such axis
    r = search.plan_with_weights(t5_tiny, given, cluster=cluster, mode="es")
    assert set(r.unmapped) == {"encoder_block_1/ffn/wi/kernel"}
    assert "has no pattern placing it S5" in r.unmapped["encoder_block_1/ffn/wi/kernel"]
    table = explore.pattern_table(t5_tiny, 2, cluster, CostOptions.for_cluster(cluster))
    placed = {path: pl for v, name in enumerate(r.patterns)
              for path, pl in placed_weights(t5_tiny.nodes[v], table.infos[v][table.index(v, name)])}
    for path, want in given.items():
        if path not in r.unmapped:
            assert placed[path] == Split(int(want[1])), path
    best = search.search(t5_tiny, cluster=cluster, mode="es")
    assert r.cost.total >= best.total_cost * (1 - 1e-9)
    # every weight given replicated: the replicated plan's cost
    everything = {path: Replica() for path in placed}
    assert search.plan_with_weights(t5_tiny, everything, cluster=cluster).cost.total == \
        pytest.approx({a.name: a for a in best.references}["replicate"].cost)


def test_gradient_flow_prices_the_backward_collectives_the_runtime_runs():
    """BERT's data-parallel plan slices its replicated padding mask (a constant: the
    inputs' and the masks' gradients are never computed) for batch-split readers. With
    gradient_flow (the default) none of those slices' backward all-gathers is priced and
    the priced backward collectives are the ones the collective audit predicts the training
    step runs; without it they are priced as the reshard table names them."""
    from tapas import models
    from tapas.execution.checking import audit
    from tapas.execution.program.plan import Plan
    from tapas.sharding.patterns import pattern_by_name
    import tapas
    entry = models.get("bert-tiny")
    graph = tapas.capture(entry.build(fast_init=True), list(entry.input_spec(8)))
    cluster = Cluster.v100_ethernet(1, N)
    on = CostOptions.for_cluster(cluster)
    s = search.search(graph, cluster=cluster, options=on, top_k=1)
    dp = next(a for a in s.references if a.name == "data-parallel")
    names = [dp.changes.get(v, p) for v, p in enumerate(s.patterns)]
    costs, gradients = {}, {}
    for opts in (on, dataclasses.replace(on, gradient_flow=False)):
        table = pattern_table(graph, N, cluster, opts)
        idx = [table.index(v, name) for v, name in enumerate(names)]
        costs[opts.gradient_flow] = explore.plan_cost(graph, table, idx,
                                                      explore.EdgeCoster(N, cluster, opts))[0]
        gradients[opts.gradient_flow] = table.gradients
    assert gradients[False] is None and "token_ids:0" not in gradients[True]
    priced = [t for t in costs[True].comms if t.backward]
    phantom = [t for t in costs[False].comms if t.backward and "reshard" in t.label
               and t.label.split()[1] not in gradients[True]]
    assert phantom and all(t.kind.value == "AG" and not t.gradient for t in phantom)
    assert len(costs[False].comms) - len(costs[True].comms) == len(phantom)
    assert costs[True].communication < costs[False].communication
    plan = Plan(N, {node.id: pattern_by_name(node, graph, N, names[node.id])
                    for node in graph.nodes})
    runs = [c for c in audit.predicted_comm_list(plan, graph) if c.phase == "bwd"]
    assert len(priced) == len(runs)
