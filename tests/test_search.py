"""tapas.search: Strategy, reference plans, memory budget, JSON, and the real patterns.

The first half uses test_explore's hand-made dense patterns (the search logic on its own);
the second half runs the real tapas.patterns on a captured two-layer MLP and on t5-tiny.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
from test_explore import B, F, FP32, H, fake_patterns, fake_reshard, mlp

from tapas import explore, search
from tapas.cost import Cluster, CostOptions, collective_cost
from tapas.ir import Graph
from tapas.search import MemoryBudgetError, Strategy

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
    w_ar = collective_cost("AR", H * F * FP32, N, s.cluster, CostOptions(compute=False),
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
    with pytest.raises(TypeError, match="must be a tapas.cost.Cluster"):
        fake_search(g, cluster="v100")


def test_graph_digest_ignores_names_but_not_structure():
    a, b = mlp(2), dataclasses.replace(mlp(2), name="renamed")
    assert search.graph_digest(a) == search.graph_digest(b)
    assert search.graph_digest(a) != search.graph_digest(mlp(3))


def test_search_imports_no_tensorflow():
    code = ("import sys; import tapas.search, tapas.explore, tapas.cost; "
            "print(any(m.startswith('tensorflow') for m in sys.modules))")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
