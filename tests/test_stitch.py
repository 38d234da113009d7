"""tapas.planning.stitch: gp's whole-graph stitch, one step per template instance.

Uses the hand-made dense patterns of tests/test_explore.py; tests/test_search.py and the
benchmarks run the stitch on the real patterns.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tapas import mining
from tapas.ir import Graph
from tapas.planning import explore, stitch
from tapas.planning.cost import CostOptions
from tapas.planning.explore import EdgeCoster, ExploreOptions

from test_explore import (F, H, N, add, cluster, dense, fake_reshard, input_node,  # noqa: F401
                          mlp, run)


def _position(order):
    return {v: i for i, u in enumerate(order) for v in u.members}


def _assert_topological(graph, order):
    at = _position(order)
    assert sorted(at) == [n.id for n in graph.nodes]          # every GraphNode once
    for e in graph.edges:
        assert at[e.src] <= at[e.dst], f"edge {e.src} -> {e.dst} goes backwards"


def test_each_instance_is_one_unit_in_topological_order():
    g = mlp(4, residual=True)
    folded = mining.mine(g, min_support=4)
    (t,) = folded.templates
    order = stitch.units(g, folded)
    whole = [u for u in order if u.whole]
    assert [u.members for u in whole] == [tuple(i) for i in t.instances]
    assert all(u.template == t.id for u in whole)
    uncovered = len(g.nodes) - t.num_covered
    assert len(order) == t.num_instances + uncovered
    _assert_topological(g, order)


def _non_convex(graph, folded):
    """The mined template replaced by one whose instances are {up, add} of each layer: the
    path up -> down -> add leaves the instance through `down` and comes back."""
    (t,) = folded.templates
    layer = [n.id for n in graph.nodes if n.name.startswith("l0/")]
    per_layer = len(layer)
    instances = tuple((layer[0] + i * per_layer, layer[2] + i * per_layer)
                      for i in range(t.num_instances))
    bad = dataclasses.replace(t, instances=instances, signatures=t.signatures[::2][:2],
                              kinds=t.kinds[::2][:2], edges=())
    return dataclasses.replace(folded, templates=(bad,))


def test_an_instance_that_cannot_be_contracted_is_stitched_node_by_node(cluster):
    g = mlp(4, residual=True)
    folded = _non_convex(g, mining.mine(g, min_support=4))
    order = stitch.units(g, folded)
    assert not any(u.whole for u in order)
    tied = [u for u in order if u.template is not None]
    assert sorted(v for u in tied for v in u.members) == \
        sorted(v for inst in folded.templates[0].instances for v in inst)
    assert {u.position for u in tied} == {0, 1}
    _assert_topological(g, order)
    gp = run(g, cluster, mode="gp", folded=folded)
    pats = {tuple(gp.best.patterns[v] for v in inst) for inst in folded.templates[0].instances}
    assert len(pats) == 1                                    # still one choice per template
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard)
    assert math.isclose(explore.plan_cost(g, gp.table, gp.best.patterns, edges)[0].total,
                        gp.best.cost, rel_tol=1e-9)


@pytest.mark.parametrize("reshard", [True, False])
def test_stitched_costs_are_exact_plan_costs(cluster, reshard):
    """The ranking cost of every gp plan is the exact cost of the plan: the patterns of
    every instance, the edges between units and the resharding inside instances."""
    g = mlp(4, residual=True)
    folded = mining.mine(g, min_support=4)
    opts = ExploreOptions(top_k=10, allow_reshard=reshard)
    gp = run(g, cluster, mode="gp", folded=folded, opts=opts)
    es = run(g, cluster, mode="es", opts=opts)
    assert math.isclose(gp.best.cost, es.best.cost, rel_tol=1e-9)
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard, reshard)
    for plan in gp.plans:
        assert math.isclose(explore.plan_cost(g, gp.table, plan.patterns, edges)[0].total,
                            plan.cost, rel_tol=1e-9)


def test_stitch_steps_are_units_and_read_only_between_units(cluster):
    g = mlp(6, residual=True)
    folded = mining.mine(g, min_support=6)
    gp = run(g, cluster, mode="gp", folded=folded)
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard)
    steps, ties, _ = stitch.stitch_steps(g, folded, gp.templates, gp.table, edges, None, 0.0)
    assert len(steps) == len(stitch.units(g, folded))
    (t,) = folded.templates
    for step in steps:
        if step.members:
            inside = set(step.members)
            assert step.tie == t.id and len(step.infos) == len(ties[t.id])
            # only tensors produced outside the instance are read, and those are in the
            # frontier (never a tensor between two GraphNodes of the same instance)
            assert all(k[0] == "x" or k[0] not in inside for k, _ in step.reads)
            assert all(len(o.inputs) == len(step.reads) for o in step.infos)
    assert sum(1 for s in steps if s.release) == 1          # the tie is forgotten once


# ---- repeated runs: jumping over identical periods -----------------------------------------

def _no_runs(monkeypatch):
    monkeypatch.setattr(stitch, "repeated_runs", lambda order, steps: [])


def _same_plans(a, b):
    assert [p.patterns for p in a.plans] == [p.patterns for p in b.plans]
    for x, y in zip(a.plans, b.plans):
        assert math.isclose(x.cost, y.cost, rel_tol=1e-12)


def test_a_stack_of_identical_instances_is_one_run_and_jumping_keeps_the_plans(
        cluster, monkeypatch):
    g = mlp(10, residual=True)
    folded = mining.mine(g, min_support=10)
    gp = run(g, cluster, mode="gp", folded=folded)
    order = stitch.units(g, folded)
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard)
    steps, _, runs = stitch.stitch_steps(g, folded, gp.templates, gp.table, edges, None, 0.0)
    (r,) = runs
    assert r.period == 1 and r.count >= stitch.MIN_PERIODS
    assert all(order[r.start + j].whole for j in range(r.count))
    assert gp.counts.jumped > 0
    _no_runs(monkeypatch)
    plain = run(g, cluster, mode="gp", folded=folded)
    assert plain.counts.jumped == 0 and plain.counts.generated > gp.counts.generated
    _same_plans(gp, plain)


def _alternating(folded):
    """The mined two-layer template of ``alt`` split into one template per layer: instances
    alternate T0 T1 T0 T1 ... (a decoder's self-attention and cross-attention blocks)."""
    (t,) = folded.templates
    half = t.size // 2
    even = dataclasses.replace(t, id=0, signatures=t.signatures[:half], kinds=t.kinds[:half],
                               edges=(), instances=tuple(i[:half] for i in t.instances))
    odd = dataclasses.replace(t, id=1, signatures=t.signatures[half:], kinds=t.kinds[half:],
                              edges=(), instances=tuple(i[half:] for i in t.instances))
    return dataclasses.replace(folded, templates=(even, odd))


def alt(layers):
    """Residual dense blocks whose FFN width alternates F, 2F, F, ..."""
    nodes = [input_node()]
    x = nodes[0].outputs[0]
    for i in range(layers):
        f = F if i % 2 == 0 else 2 * F
        up = dense(f"l{i}/up", x, H, f, f"up{f}")
        down = dense(f"l{i}/down", up.outputs[0], f, H, f"down{f}")
        nodes += [up, down, add(f"l{i}/add", x, down.outputs[0])]
        x = nodes[-1].outputs[0]
    return Graph.build(nodes, inputs=(nodes[0].outputs[0],), outputs=(x,), name=f"alt{layers}")


@pytest.mark.parametrize("reshard", [True, False])
def test_alternating_templates_are_a_run_of_period_two(cluster, monkeypatch, reshard):
    g = alt(12)
    folded = _alternating(mining.mine(g, min_support=6))
    opts = ExploreOptions(allow_reshard=reshard)
    gp = run(g, cluster, mode="gp", folded=folded, opts=opts)
    edges = EdgeCoster(N, cluster, CostOptions(), fake_reshard, reshard)
    _, _, runs = stitch.stitch_steps(g, folded, gp.templates, gp.table, edges, None, 0.0)
    assert [r.period for r in runs] == [2]
    assert gp.counts.jumped > 0
    for plan in gp.plans:        # jumped costs are the exact plan costs
        assert math.isclose(explore.plan_cost(g, gp.table, plan.patterns, edges)[0].total,
                            plan.cost, rel_tol=1e-9)
    _no_runs(monkeypatch)
    _same_plans(gp, run(g, cluster, mode="gp", folded=folded, opts=opts))
