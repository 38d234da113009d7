"""tapas.planning.branches: independent branches searched alone and combined at their join.

Ground truth is the exhaustive enumeration of the same graph with branch folding off and a
beam wide enough never to cut (``exact``): the folded search must find the same k best
costs. Graphs are DLRM-style recommenders written with plain Keras 3 layers (embedding
tables feeding one stacked dot interaction), small enough for that enumeration."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import keras
import pytest
from keras import layers

import tapas
from tapas.ir import Kind
from tapas.planning import explore as ex
from tapas.planning.branches import find_branches
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.search import search
from tapas.planning.table import pattern_table


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from wide_models import DotInteraction as _Interaction  # noqa: E402  (the benchmark's layer)


def _dlrm(tables: int, blocks: int = 0) -> tapas.Graph:
    dense = keras.Input((13,), batch_size=8, name="dense_features")
    ids = [keras.Input((1,), batch_size=8, dtype="int32", name=f"ids{i}")
           for i in range(tables)]
    b = layers.Dense(16, activation="relu")(layers.Dense(32, activation="relu")(dense))
    embs = [layers.Reshape((16,))(layers.Embedding(64, 16)(x)) for x in ids]
    x = layers.Concatenate()([b, _Interaction()(embs + [b])])
    x = layers.Add()([layers.Multiply()([x, layers.Dense(x.shape[-1])(x)]), x])
    if blocks:      # a stack of identical residual blocks: templates and a repeated run
        x = layers.Dense(32)(x)
        for _ in range(blocks):
            x = layers.Add()([x, layers.Dense(32)(layers.Dense(64, activation="relu")(x))])
    model = keras.Model([dense] + ids, layers.Dense(1)(x), name=f"dlrm{tables}")
    return tapas.capture(model)


# a beam narrower than the plain frontier of 5 tables (3 ** 6 = 729 states on 2-8 devices):
# the folded search must still be exact under it
NARROW = ex.ExploreOptions(max_states=256)


@pytest.fixture(scope="module")
def dlrm5() -> tapas.Graph:
    return _dlrm(5)


def test_each_table_is_a_branch_of_the_interaction(dlrm5):
    table = pattern_table(dlrm5, 4, Cluster.v100_ethernet(1, 4), CostOptions())
    found = find_branches(dlrm5, {n.id for n in dlrm5.nodes}, table.constant)
    assert len(found) == 1
    (join, branches), = found.items()
    assert len(dlrm5.nodes[join].inputs) == 6     # 5 tables and the bottom MLP
    # the bottom MLP is read by the concat too: not a branch; each table is
    kinds = sorted(sorted(dlrm5.nodes[v].kind.value for v in b.members) for b in branches)
    assert all(b.entries == () for b in branches)     # each reads only its own id input
    assert len(branches) == 5
    assert all(Kind.EMBEDDING.value in k and Kind.INPUT.value in k for k in kinds)


@pytest.mark.parametrize("devices", [2, 4])
def test_folded_search_finds_the_exhaustive_k_best(dlrm5, devices):
    cluster = Cluster.v100_ethernet(1, devices)
    truth = ex.explore(dlrm5, devices, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    assert truth.exact and truth.folded.joins == 0
    for mode in ("es", "gp"):
        got = ex.explore(dlrm5, devices, cluster, mode=mode, options=NARROW)
        assert got.exact and got.folded.joins == 1 and got.folded.nodes == 10   # id inputs and tables
        assert [p.cost for p in got.plans] == pytest.approx([p.cost for p in truth.plans],
                                                            rel=1e-12)
        assert got.lower == pytest.approx(got.best.cost)
        # far fewer prefix extensions than the product of the tables' placements
        assert got.counts.generated * 20 < truth.counts.generated
    s = search(dlrm5, cluster=cluster, references=(), explore_options=NARROW)
    assert s.exact and s.bound is None and s.counts["folded_joins"] == 1
    assert any("searched per branch" in n for n in s.notes)


def _inception() -> tapas.Graph:
    x_in = keras.Input((8, 8, 3), batch_size=4, name="image")
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(x_in)
    conv = lambda k, t: layers.Conv2D(4, k, padding="same", activation="relu")(t)
    x = layers.Concatenate()([conv(1, x), conv(3, conv(1, x)), conv(5, conv(1, x)),
                              conv(1, layers.MaxPooling2D(3, strides=1, padding="same")(x))])
    out = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return tapas.capture(keras.Model(x_in, out, name="inception"))


def test_branches_reading_one_shared_tensor_fold_with_it_as_an_entry():
    """Inception: four branches read the block input; each is enumerated once per
    placement of it, and the join's options follow the placement the frontier holds."""
    graph = _inception()
    cluster = Cluster.v100_ethernet(1, 4)
    truth = ex.explore(graph, 4, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    tiny = ex.ExploreOptions(max_states=4)
    got = ex.explore(graph, 4, cluster, mode="es", options=tiny)
    assert got.folded.joins == 1 and got.folded.nodes == 6
    assert [p.cost for p in got.plans] == pytest.approx([p.cost for p in truth.plans],
                                                        rel=1e-12)
    assert got.lower == pytest.approx(got.best.cost)     # proven optimal
    s = search(graph, cluster=cluster, mode="es", references=(), explore_options=tiny)
    assert s.exact and s.total_cost == pytest.approx(truth.best.cost, rel=1e-9)


def test_under_a_memory_budget_the_folded_search_splits_the_tables_as_exhaustive_does(dlrm5):
    cluster = Cluster.v100_ethernet(1, 4)
    free = search(dlrm5, cluster=cluster, references=())
    budget = free.memory.total * 0.6          # forces weights to be split
    truth = search(dlrm5, cluster=cluster, mode="es", references=(), memory_budget=budget,
                   explore_options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    for mode in ("es", "gp"):
        got = search(dlrm5, cluster=cluster, mode=mode, references=(), memory_budget=budget,
                     explore_options=NARROW)
        assert got.exact and got.counts["folded_joins"] == 1 and got.memory.total <= budget
        assert got.total_cost == pytest.approx(truth.total_cost, rel=1e-9)
    assert truth.weight_placements and truth.counts["penalty_rounds"] >= 1


def test_a_cut_beam_reports_a_bound_that_holds(dlrm5):
    cluster = Cluster.v100_ethernet(1, 4)
    truth = ex.explore(dlrm5, 4, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    narrow = ex.ExploreOptions(fold_branches=False, max_states=4)   # cuts
    cut = ex.explore(dlrm5, 4, cluster, mode="es", options=narrow)
    assert cut.counts.beam > 0 and cut.lower is not None
    # the bound brackets the true optimum
    assert cut.lower <= truth.best.cost * (1 + 1e-12)
    assert cut.best.cost >= truth.best.cost * (1 - 1e-12)
    s = search(dlrm5, cluster=cluster, mode="es", references=(), explore_options=narrow)
    if s.exact:     # every cut prefix cost at least the plan found: proven optimal
        assert any("none cheaper than the chosen plan" in n for n in s.notes)
        assert s.total_cost == pytest.approx(truth.best.cost, rel=1e-9)
    else:
        assert s.bound is not None and math.isfinite(s.bound)
        assert any("beam-limited" in n and "above the optimum" in n for n in s.notes)
        assert "within" in s.summary().splitlines()[0]
        gap = cut.best.cost / truth.best.cost - 1
        assert gap <= s.bound + 1e-12


@pytest.mark.parametrize("model,mode", [("dlrm5", "es"), ("dlrm5", "gp"), ("inception", "gp"),
                                        ("moe", "es")])
def test_a_beam_cut_inside_a_folded_branch_still_bounds_the_optimum(dlrm5, model, mode):
    """A beam of 2 cuts the branches' own enumerations: a plan through a branch prefix it
    cut costs at least that prefix plus the least the rest of the problem costs
    (``Folded.cut_below``), and every other plan is among the folded combinations; the
    lower bound holds against the exhaustive enumeration with a wide beam and no
    folding, and the Strategy reports a bound (or proves the plan optimal) instead of
    none."""
    graph = {"dlrm5": lambda: dlrm5, "inception": _inception, "moe": lambda: _moe(4)}[model]()
    cluster = Cluster.v100_ethernet(1, 2)
    truth = ex.explore(graph, 2, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    narrow = ex.ExploreOptions(max_states=2, widen_below=0)   # cut, not searched again
    cut = ex.explore(graph, 2, cluster, mode=mode, options=narrow)
    assert cut.folded.joins and not cut.folded.exact and not cut.exact
    assert cut.lower is not None and 0 < cut.lower <= truth.best.cost * (1 + 1e-12)
    assert cut.best.cost >= truth.best.cost * (1 - 1e-12)
    s = search(graph, cluster=cluster, mode=mode, references=(), explore_options=narrow)
    assert s.exact or s.bound is not None
    if s.exact:
        assert s.total_cost == pytest.approx(truth.best.cost, rel=1e-9)
    else:
        assert cut.best.cost / truth.best.cost - 1 <= s.bound + 1e-12
        assert any("in folded branches" in n for n in s.notes), s.notes


def test_a_cheap_search_whose_beam_cut_a_cheaper_prefix_is_searched_again_wider(monkeypatch):
    """A 4-layer MoE on 2 devices, es, a beam of 2: it cuts prefixes cheaper than the plan
    it finds (41.9 us against the optimum's 1.03); the enumeration is cheap, so it runs
    again with a beam 4x as wide, which finds the optimum and proves it; the result says
    so, counts both runs, and ``widen_below=0`` keeps the first."""
    graph = _moe(4)
    cluster = Cluster.v100_ethernet(1, 2)
    truth = ex.explore(graph, 2, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    first = ex.explore(graph, 2, cluster, mode="es",
                       options=ex.ExploreOptions(max_states=2, widen_below=0))
    assert not first.proven and first.widened_from is None
    assert first.best.cost > truth.best.cost * 2
    again = ex.explore(graph, 2, cluster, mode="es", options=ex.ExploreOptions(max_states=2))
    assert again.widened_from == 2 and again.proven
    assert again.best.cost == pytest.approx(truth.best.cost, rel=1e-9)
    assert again.counts.generated > first.counts.generated
    s = search(graph, cluster=cluster, mode="es", references=(),
               explore_options=ex.ExploreOptions(max_states=2))
    assert s.exact and any("searched again with 4x" in n for n in s.notes)
    # many extensions: not searched again
    stays = ex.explore(graph, 2, cluster, mode="es",
                       options=ex.ExploreOptions(max_states=2, widen_below=10))
    assert stays.widened_from is None and not stays.proven
    # the time limit ending the second run leaves the first's result, not a timeout
    beams, original = [], ex._explore_es

    def second_times_out(pb):
        beams.append(pb.options.max_states)
        if len(beams) > 1:
            raise ex.SearchTimeout("time limit")
        return original(pb)
    monkeypatch.setattr(ex, "_explore_es", second_times_out)
    kept = ex.explore(graph, 2, cluster, mode="es",
                      options=ex.ExploreOptions(max_states=2, time_limit=600.0))
    assert beams == [2, 8] and kept.widened_from is None
    assert kept.best.cost == pytest.approx(first.best.cost, rel=1e-12)


def test_nothing_is_folded_where_the_beam_could_not_cut(dlrm5):
    """Folding changes nothing where the plain enumeration is exact anyway: with a beam
    above the frontier's bound the search is the plain one, ties included."""
    from tapas.planning.branches import frontier_bound
    from tapas.planning.steps import good_order, node_steps
    cluster = Cluster.v100_ethernet(1, 2)
    table = pattern_table(dlrm5, 2, cluster, CostOptions.for_cluster(cluster))
    outs = {t.name for t in dlrm5.outputs}
    steps = node_steps(dlrm5, good_order(dlrm5, [n.id for n in dlrm5.nodes]), table, None,
                       0.0, lambda v, oi, t: t.name in outs)
    wide = frontier_bound(steps, table, None, 10**9)
    assert wide > NARROW.max_states     # that beam could cut: folded under it
    opts = ex.ExploreOptions(max_states=wide)
    kept = ex.explore(dlrm5, 2, cluster, mode="es", options=opts)
    plain = ex.explore(dlrm5, 2, cluster, mode="es",
                       options=dataclasses.replace(opts, fold_branches=False))
    assert kept.folded.joins == 0 and kept.plans == plain.plans and kept.exact


def test_a_beam_cut_inside_a_template_bounds_the_stitched_plan():
    """gp: a combination a template's beam cut costs at least the cut per instance, in
    every instance; the bound holds against the same search with a wide beam."""
    from models import capture_preset
    graph, _ = capture_preset("t5-tiny")
    cluster = Cluster.v100_ethernet(1, 4)
    truth = ex.explore(graph, 4, cluster, options=ex.ExploreOptions(max_states=10**6))
    cut = ex.explore(graph, 4, cluster, options=ex.ExploreOptions(max_states=3))
    assert truth.exact and not all(r.exact for r in cut.templates)
    assert cut.lower is not None and cut.lower <= truth.best.cost * (1 + 1e-12)
    assert cut.best.cost >= truth.best.cost * (1 - 1e-12)


def test_folding_in_the_stitch_keeps_the_repeated_runs_of_a_stack():
    """gp on tables folded into their interaction and a stack of 6 identical blocks after
    it: the stitch's steps are renumbered after folding and its jump over the repeated
    blocks still lands on the same plans as the plain stitch under a wide beam."""
    graph = _dlrm(5, blocks=6)
    cluster = Cluster.v100_ethernet(1, 4)
    plain = ex.explore(graph, 4, cluster,
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    got = ex.explore(graph, 4, cluster, options=NARROW)
    assert got.folded.joins == 1 and got.counts.jumped > 0 and got.exact
    assert plain.counts.jumped > 0
    assert [p.cost for p in got.plans] == pytest.approx([p.cost for p in plain.plans],
                                                        rel=1e-12)


def test_a_branch_holding_a_join_folds_it_inside_its_own_enumeration():
    """Each feature is the sum of two tables (an inner join of two branches); the stacked
    interaction joins the sums. The interaction folds each sum whole, and each sum's own
    enumeration folds its two tables, under a beam narrow enough to need both."""
    ids = [keras.Input((1,), batch_size=8, dtype="int32", name=f"ids{i}") for i in range(8)]
    embed = lambda x: layers.Reshape((16,))(layers.Embedding(64, 16)(x))
    sums = [layers.Add()([embed(ids[2 * i]), embed(ids[2 * i + 1])]) for i in range(4)]
    out = layers.Dense(1)(_Interaction()(sums))
    graph = tapas.capture(keras.Model(ids, out, name="sums"))
    cluster = Cluster.v100_ethernet(1, 4)
    truth = ex.explore(graph, 4, cluster, mode="es",
                       options=ex.ExploreOptions(fold_branches=False, max_states=10**6))
    got = ex.explore(graph, 4, cluster, mode="es", options=ex.ExploreOptions(max_states=4))
    assert got.folded.joins == 1 and got.folded.nodes == 4 * 5   # 2 ids, 2 tables, the add
    assert got.folded.counts.generated > 0
    assert [p.cost for p in got.plans] == pytest.approx([p.cost for p in truth.plans],
                                                        rel=1e-12)
    assert got.lower == pytest.approx(got.best.cost)


def test_tensors_no_choice_can_place_otherwise_never_enter_the_frontier(monkeypatch):
    """t5-tiny-masked: its padding masks turned into attention biases (constant-filtered:
    replicate only) leave their outputs fixed for their readers instead of in every
    frontier state; the enumeration finds the same k best plans as with them in the
    frontier, in es and gp, and its frontiers hold fewer tensors."""
    from models import capture_preset
    from tapas.planning import frontier
    from tapas.planning.steps import good_order, node_steps
    graph, _ = capture_preset("t5-tiny-masked")
    cluster = Cluster.v100_ethernet(1, 4)
    table = pattern_table(graph, 4, cluster, CostOptions.for_cluster(cluster))
    assert table.constant
    outs = {t.name for t in graph.outputs}
    steps = node_steps(graph, good_order(graph, [n.id for n in graph.nodes]), table, None,
                       0.0, lambda v, oi, t: t.name in outs)
    settled = frontier.settle(steps, table)
    gone = {k for s in steps for _, k in s.writes} - {k for s in settled for _, k in s.writes}
    assert gone & {(v, 0) for v in table.constant}
    assert all(len({i.outputs[k[1]] for i in table.infos[k[0]]}) == 1 for k in gone)
    assert all(k in s.fixed for s in settled for k, _ in s.reads if k in gone)
    assert all(k not in s.drops for s in settled for k in gone)
    got = {}
    real = frontier._keep_best
    for name, fn in (("settled", frontier.settle), ("plain", lambda st, t: list(st))):
        monkeypatch.setattr(frontier, "settle", fn)
        seen: list[int] = []
        monkeypatch.setattr(frontier, "_keep_best", lambda nxt, *a: (
            seen.append(max((len(s) for s in nxt), default=0)), real(nxt, *a))[1])
        plans = [[(p.patterns, p.cost) for p in ex.explore(graph, 4, cluster, mode=m).plans]
                 for m in ("es", "gp")]
        got[name] = (max(seen), plans)
    assert got["settled"][1] == got["plain"][1]
    assert got["settled"][0] < got["plain"][0]


def _moe(layers_: int) -> tapas.Graph:
    """A small GShard MoE LM (models/moe.py): with 4 layers its MoE block is a template of
    two instances, each a residual add joining the attention, the top-2 gating (a dozen
    GraphNodes of routing maths, several live at once) and the expert einsums."""
    from models import moe
    cfg = moe.MoEConfig(num_layers=layers_, d_model=32, d_ff=128, num_heads=2,
                        num_experts=4, vocab_size=256, seq_len=16)
    return tapas.capture(moe.build_model(cfg, fast_init=True), moe.input_spec(cfg, 2),
                         name=f"moe-{layers_}")


def test_an_moe_block_is_one_branch_of_its_residual_add():
    """The whole MoE block (read by nothing but the block's last add) is one branch whose
    entry is the block input, which the template keeps to its end: searched alone once per
    placement of that input, its gating's frontiers are no longer multiplied by the
    input's and the residual's placements. Both searches are exact (before the fold the
    beam cut 20184 prefixes on 2 devices, beam-limited; since the gating's rows may be
    split, StridedSlice's ellipsis read by the rules, it cuts only prefixes dearer than
    the plan, item 9 of docs/search.md) and gp finds es's optimum."""
    graph = _moe(4)
    cluster = Cluster.v100_ethernet(1, 2)
    gp = search(graph, cluster=cluster, mode="gp", references=())
    es = search(graph, cluster=cluster, mode="es", references=())
    assert gp.exact and es.exact
    assert gp.total_cost == pytest.approx(es.total_cost, rel=1e-9)


def test_the_zoo_moe_searches_exactly():
    """moe-380m (8 layers, 8 experts, d_model 768) on 2 devices: beam-limited before the
    branch fold (the gating's frontier times the block input's and the residual's
    placements outgrew the beam, bound 984 %), exact since; the gating's batch split
    (2026-11-29) made the plan 0.013 % cheaper (0.28789377 s before)."""
    from models import capture_preset
    graph, _ = capture_preset("moe-380m")
    s = search(graph, cluster=Cluster.v100_ethernet(1, 2), mode="gp", references=())
    assert s.exact
    assert s.total_cost == pytest.approx(0.2878562211905223, rel=1e-9)
