"""tapas.planning.stitch: gp's whole-graph stitch, one step per template instance.

Uses the hand-made dense patterns of tests/test_explore.py; tests/test_search.py and the
benchmarks run the stitch on the real patterns.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tapas import mining
from tapas.planning import explore, stitch
from tapas.planning.cost import CostOptions
from tapas.planning.explore import EdgeCoster, ExploreOptions

from test_explore import N, cluster, fake_reshard, mlp, run  # noqa: F401  (fixture)


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
    steps, ties = stitch.stitch_steps(g, folded, gp.templates, gp.table, edges, None, 0.0)
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
