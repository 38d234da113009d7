"""Nested expert + tensor parallelism (tapas.planning.experts): the expert region of a
captured MoE model, the row view of its shapes, the patterns a nested row may use, the
column all-to-alls and memory priced by hand, and the mesh search trying every
``RxC:experts`` mesh; keras-hub's MoE backbones trained on a 2x2:experts mesh of logical
devices against Keras (moe-tiny's is in test_mesh.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import matrix  # tests/matrix.py
from command import run_tapas  # tests/command.py

from tapas.ir import Kind
from tapas.planning import experts as X
from tapas.planning import mesh as M
from tapas.planning.cost import Cluster, CostOptions, MemoryEstimate, collective_cost, \
    weight_memory
from tapas.sharding.patterns import patterns_for
from tapas.sharding.placements import parse_placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def moe() -> Any:
    """moe-tiny (1 dense + 1 MoE block, 4 experts, seq 16) captured per row batch."""
    from tapas import capturing, models
    entry = models.get("moe-tiny")
    model = entry.build(seed=0)
    graphs: dict[int, Any] = {}

    def graph_for(rows: int) -> Any:
        if rows not in graphs:
            graphs[rows] = capturing.capture(model, list(entry.input_spec(4 // rows)),
                                             name=f"moe-tiny/batch{4 // rows}")
        return graphs[rows]
    return graph_for


def test_region_of_moe_tiny(moe: Any) -> None:
    graph = moe(1)
    region = X.ExpertRegion.of(graph, 2)
    expert_nodes = {n.id for n in graph.nodes if n.kind is Kind.EXPERT_EINSUM}
    assert region.nodes == expert_nodes and len(expert_nodes) == 2
    assert region.experts == 4
    assert [t.shape for t in region.entries] == [(4, 4, 8, 32)]   # [E, G, C, M] dispatched
    assert [t.shape for t in region.exits] == [(4, 4, 8, 32)]
    assert [w.split("/")[-1] for w in region.weights] == ["wi", "wo"]
    # every token tensor inside leads with the experts; the weights' reads are no tokens
    assert all(region.view_shape(a, (4, 4, 8, 64), 2)[:2] == (2, 8)
               for a in region.activations)


def test_row_view_shapes(moe: Any) -> None:
    graph = moe(1)
    view = X.row_view(graph, 2)
    region = X.ExpertRegion.of(graph, 2)
    for before, after in zip(graph.nodes, view.nodes):
        if before.id not in region.nodes:
            assert after is before
            continue
        for t in after.inputs + after.outputs:   # [E / 2, G * 2, C, *]
            assert t.shape[:2] == (2, 8), t
        for w, w0 in zip(after.weights, before.weights):
            assert w.shape == (2,) + w0.shape[1:]


def test_nested_patterns_keep_experts_and_groups_whole(moe: Any) -> None:
    graph = moe(1)
    fn = X.nested_patterns(graph, 2)
    region = X.ExpertRegion.of(graph, 2)
    for node in graph.nodes:
        every = patterns_for(node, graph, 2)
        kept = fn(node, graph, 2)
        if node.id not in region.nodes:
            assert [p.name for p in kept] == [p.name for p in every]
            continue
        names = {p.name for p in kept}
        assert {"replicate", "column", "row"} <= names and "expert" not in names
        assert "batch" not in names       # splits the groups (axis 1) of the tokens
        refused = [p for p in every if p.name not in names]
        assert refused and all(X.allowed_pattern(p, node, region) for p in refused)
        expert = next(p for p in every if p.name == "expert")
        assert "axis 0" in X.allowed_pattern(expert, node, region)


def test_errors_name_the_constraint(moe: Any, tmp_path: Any) -> None:
    import keras
    import tensorflow as tf

    from tapas import capturing
    x = keras.Input((8,))
    mlp = keras.Model(x, keras.layers.Dense(4)(x))
    with pytest.raises(X.NestingError, match="no expert einsum"):
        X.ExpertRegion.of(capturing.capture(mlp, tf.TensorSpec((2, 8), tf.float32)))
    with pytest.raises(X.NestingError, match="4 experts do not split into 3 mesh rows"):
        X.ExpertRegion.of(moe(1), 3)
    assert str(M.Mesh.parse("2x4:experts")) == "2x4:experts"
    assert M.Mesh.parse("2x4:experts") == M.Mesh(2, 4, True) and M.Mesh(2, 4).plan == "DP x TP"
    with pytest.raises(ValueError, match="at least 2 rows"):
        M.Mesh(1, 4, True)
    with pytest.raises(ValueError, match="the only suffix is ':experts'"):
        M.Mesh.parse("2x4:heads")


def test_column_collectives_priced_by_hand(moe: Any) -> None:
    """On a 2x2:experts mesh of S(2, 2): the entry and exit tokens each cross the column
    by an all-to-all forward and one backward (N: the row's local part, as the region's
    pattern places it); no column all-reduce for the expert weights; their memory
    halved."""
    from tapas.planning.search import search
    graph = moe(2)
    cluster = Cluster.v100_ethernet(2, 2)
    options = CostOptions.for_cluster(cluster)
    mesh = cluster.mesh(2, 2, experts=True)
    row = search(graph, cluster=mesh.row_cluster, options=options,
                 patterns_fn=X.nested_patterns(graph, 2))
    region = X.ExpertRegion.of(graph, 2)
    terms = X.column_all_to_all(graph, row.pattern, mesh, options).terms
    want = []
    for t, side in ((region.entries[0], "inputs"), (region.exits[0], "outputs")):
        node = next(n for n in graph.nodes if n.id in region.nodes
                    and any(u.name == t.name for u in getattr(n, side)))
        k = [u.name for u in getattr(node, side)].index(t.name)
        placement = parse_placement(getattr(row.pattern(node.id), side)[k])
        nbytes = int(placement.local_bytes(t.shape, t.dtype, 2))
        want += [collective_cost("A2A", nbytes, cluster.axis(2, 2, name="data"), options,
                                 backward=b,
                                 label=f"ep {t.name}") for b in (False, True)]
    assert list(terms) == want
    placements = dict(row.weight_placements)
    dp = M.gradient_all_reduce(graph, placements, mesh, options)
    plain = M.gradient_all_reduce(graph, placements, cluster.mesh(2, 2), options)
    assert {t.label for t in plain.terms} - {t.label for t in dp.terms} == \
        {f"dp {w}" for w in region.weights}
    both = M.column_collectives(graph, placements, mesh, row.pattern, options)
    assert len(both.terms) == len(dp.terms) + 4
    saved = X.expert_memory_saving(graph, placements, 2, 2, options)
    by_hand = sum((weight_memory(parse_placement(placements.get(w.path, "R") or "R")
                                 .local_bytes(w.shape, w.dtype, 2) / 2, True, options)
                   for w in graph.weights if w.path in region.weights),
                  start=MemoryEstimate())
    assert saved == by_hand and saved.total > 0


def test_mesh_search_tries_nested_experts(moe: Any) -> None:
    from tapas.planning.search import search
    cluster = Cluster.v100_ethernet(2, 2)
    result = M.search_meshes(moe, 4, cluster, search=search)
    by = {str(r.mesh): r for r in result.results}
    assert list(by) == ["1x4", "2x2", "2x2:experts", "4x1", "4x1:experts"]
    nested, plain = by["2x2:experts"], by["2x2"]
    assert nested.ok and nested.ep_cost > 0 and plain.ep_cost == 0
    assert nested.dp_cost < plain.dp_cost      # no all-reduce of the expert weights
    assert nested.total == pytest.approx(nested.row_cost + nested.dp_cost + nested.ep_cost)
    assert "EP x TP" in result.summary() and "2 experts per row" in nested.note
    assert result.to_json()["results"][2]["experts"] is True
    off = M.search_meshes(moe, 4, cluster, search=search, experts=False)
    assert [str(r.mesh) for r in off.results] == ["1x4", "2x2", "4x1"]


def test_cli_train_nested_experts_verified(tmp_path: Any) -> None:
    """`tapas train --mesh=2x2:experts` on 4 logical devices: a random row plan drawn from
    the nested patterns, verified against Keras; the columns' collectives (gradient
    all-reduces of the non-expert weights, four expert all-to-alls) equal the cost
    model's."""
    import json
    out = tmp_path / "train.json"
    proc = run_tapas("train", "--model=moe-tiny", "--devices=4", "--mesh=2x2:experts",
                     "--strategy=random:1", "--steps=2", "--verify", "--training=false",
                     f"--json_out={out}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verify: PASSED" in proc.stdout and "the experts split over the rows" in proc.stdout
    report = json.loads(out.read_text())
    assert report["audit"]["matches"]   # the rows' collectives: as the row strategy predicts
    mesh = report["mesh"]               # the columns': as column_collectives prices them
    assert mesh["matches"] and mesh["ep_all_to_alls"] == 4 and mesh["dp_all_reduces"] > 0


# each backbone once in the suite: Qwen3-MoE simulated here, Mixtral trained for real below
# (both, both ways, under TAPAS_FULL_MATRIX=1)
@pytest.mark.parametrize("name", matrix.pick(["hub-qwen3-moe"], ["hub-mixtral", "hub-qwen3-moe"]))
def test_keras_hub_moe_nested_matches_one_device(name: str) -> None:
    """MoE backbones we did not write (keras-hub Mixtral and Qwen3-MoE, built from small
    configs): their expert einsums form the region ([E, tokens, ...] activations), a random
    nested plan of the whole model on a 2x2:experts mesh, simulated, equals the
    single-device graph on each row's share, and the 2-D pattern checker passes every
    pattern the nested search may give their expert GraphNodes."""
    import numpy as np
    import tensorflow as tf

    from models import corpus
    from tapas import capturing
    from tapas.execution.api import parallel
    from tapas.execution.checking import checker, nested, verify
    model, specs = corpus.get(name).build(batch=4)
    row = tf.nest.map_structure(lambda s: tf.TensorSpec([s.shape[0] // 2] + s.shape[1:],
                                                        s.dtype, name=s.name), specs)
    trace = capturing.trace(model, row)
    graph = capturing.to_ir(trace)
    region = X.ExpertRegion.of(graph, 2)
    assert len(region.nodes) >= 2 and region.experts == 4
    plan = parallel.random_plan(graph, 2, 0, patterns_fn=X.nested_patterns(graph, 2))
    inputs = [np.concatenate([a, b]) for a, b in zip(checker.synthetic_inputs(graph, seed=1),
                                                    checker.synthetic_inputs(graph, seed=2))]
    cmp = nested.compare_nested(trace, graph, plan, inputs, rows=2)
    assert cmp.ok(), cmp.worst
    names = [i.name for n in graph.nodes for i in n.inputs]
    values = verify.intermediate_values(trace, graph, checker.synthetic_inputs(graph), names)
    checked, failures = checker.check_nested_patterns(trace, graph, values, 2, 2)
    assert checked >= 3 and not failures, failures[:3]


def test_plans_that_cannot_nest_are_refused_with_the_reason(moe: Any) -> None:
    """A row plan that splits the experts inside the region (the `expert` pattern) is refused
    when the program is built for a :experts mesh, naming the GraphNode and why; a model
    without expert einsums on a :experts mesh is refused by `tapas train` with the fix."""
    import keras

    from tapas import capturing, models
    from tapas.execution.program.plan import Plan, ReconstructError
    from tapas.execution.program.reconstruct import Program
    entry = models.get("moe-tiny")
    keras.utils.set_random_seed(0)
    model = entry.build(seed=0)
    trace = capturing.trace(model, list(entry.input_spec(2)))
    graph = capturing.to_ir(trace)
    node = next(n for n in graph.nodes if n.kind is Kind.EXPERT_EINSUM)
    expert = next(p for p in patterns_for(node, graph, 2) if p.name == "expert")
    plan = Plan(2, {node.id: expert})
    Program(trace, graph, plan)                       # a 1-D program takes it
    with pytest.raises(ReconstructError, match=f"GraphNode {node.id} .*'expert'.* cannot run "
                       "with its experts split over the mesh rows: it splits"):
        Program(trace, graph, plan, expert_rows=2)
    proc = run_tapas("train", "--model=t5-tiny", "--devices=4", "--mesh=2x2:experts",
                     "--steps=1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "has no expert einsum" in proc.stderr and "use a plain ROWSxCOLS mesh" in proc.stderr


_HUB_NESTED = """
import sys
from tapas.execution.runtime import devices
devices.setup_devices(4, "cpu")
import tensorflow as tf
from models import corpus
from tapas import capturing
from tapas.execution.api import parallel, train
from tapas.planning import experts as X
from tapas.planning.mesh import Mesh
entry = corpus.get(sys.argv[1])
model, specs = entry.build(batch=8)
row = tf.nest.map_structure(lambda s: tf.TensorSpec([s.shape[0] // 2] + s.shape[1:], s.dtype,
                                                    name=s.name), specs)
graph = capturing.capture(model, row, training=False)
plan = parallel.random_plan(graph, 2, 1, patterns_fn=X.nested_patterns(graph, 2))
pm = parallel.parallelize(model, specs, plan, devices=4, mesh="2x2:experts",
                          loss=entry.loss(), training=False)
xs, y = entry.synthetic_batch(model, specs)
result = pm.verify(xs, y)
ran, priced = train.column_audit(pm, Mesh.parse("2x2:experts"))
print("verify", result["ok"], result["gradients"]["max_abs_diff"], result["weights"]["count"])
print("audit", pm.audit().matches, ran == priced,
      sum(k[0] == "A2A" for k in ran), sum(k[0] == "AR" for k in ran))
"""


@pytest.mark.parametrize("name", matrix.pick(["hub-mixtral"], ["hub-mixtral", "hub-qwen3-moe"]))
def test_keras_hub_moe_trains_on_a_2x2_experts_mesh_equal_to_keras(name: str) -> None:
    """keras-hub's Mixtral and Qwen3-MoE backbones (dict inputs, their own router and
    expert layers) on 4 logical devices as a 2x2:experts mesh, a random nested row plan:
    outputs, loss, gradients and weights after the verify steps equal Keras's; the rows'
    collectives are the row strategy's, the columns' (expert all-to-alls, gradient
    all-reduces of the other weights) are what the cost model prices."""
    proc = subprocess.run([sys.executable, "-c", _HUB_NESTED, name], capture_output=True,
                          text=True, timeout=400, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verified = next(ln for ln in proc.stdout.splitlines() if ln.startswith("verify"))
    ok, _, weights = verified.split()[1:]
    assert ok == "True" and int(weights) > 10, verified
    audit = next(ln for ln in proc.stdout.splitlines() if ln.startswith("audit"))
    rows_match, columns_match, all_to_alls, all_reduces = audit.split()[1:]
    assert rows_match == "True" and columns_match == "True", audit
    assert int(all_to_alls) >= 4 and int(all_reduces) > 0, audit
