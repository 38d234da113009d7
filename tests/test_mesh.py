"""2-D meshes (tapas.planning.mesh): shapes, where rows and columns lie on S(m, n), the
data-parallel gradient all-reduce priced by hand, the mesh search against the 1-D search,
and `tapas search --meshes`."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import pytest
from command import run_tapas, run_tapas_each  # tests/command.py

from tapas.ir import Graph
from tapas.planning import mesh as M
from tapas.planning.cost import Cluster, CostOptions, collective_cost
from tapas.planning.devicemesh import DATA, MODEL
from tapas.sharding.placements import Split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shapes_parse_and_positions() -> None:
    assert [str(m) for m in M.mesh_shapes(12)] == ["1x12", "2x6", "3x4", "4x3", "6x2",
                                                   "12x1"]
    assert M.Mesh.parse("2x8") == M.Mesh(2, 8) and M.Mesh(2, 8).num_devices == 16
    assert M.Mesh(2, 4).position(5) == (1, 1)
    for bad in ("2*8", "x8", "2x", "ax4"):
        with pytest.raises(ValueError, match="ROWSxCOLS"):
            M.Mesh.parse(bad)
    with pytest.raises(ValueError, match="positive int"):
        M.Mesh(0, 4)
    with pytest.raises(ValueError, match="not in a 2x4 mesh"):
        M.Mesh(2, 4).position(8)


def test_rows_stay_inside_a_node_and_columns_span_the_nodes() -> None:
    c = Cluster.v100_ethernet(2, 8)
    assert c.mesh(2, 8).row_cluster.num_nodes == 1
    assert c.mesh(4, 4).row_cluster.num_devices == 4
    assert c.mesh(1, 16).row_cluster.num_nodes == 2 and c.mesh() == M.Mesh(1, 16)
    assert [m.on(c).axis(DATA).nodes for m in M.mesh_shapes(16)] == [1, 2, 2, 2, 2]
    assert Cluster.v100_ethernet(1, 8).mesh(4, 2).axis(DATA).nodes == 1
    with pytest.raises(ValueError, match="straddle nodes of 6"):
        Cluster.v100_ethernet(2, 6).mesh(3, 4)
    with pytest.raises(ValueError, match="2x4 mesh has 8 devices"):
        M.Mesh(2, 4).on(c)
    with pytest.raises(ValueError, match="2x4 mesh has no cluster, so its 'data' axis"):
        M.Mesh(2, 4).axis(DATA)


def test_each_mesh_axis_carries_its_own_link() -> None:
    """A row inside a node: its model axis pays NVLink, its column (over 2 nodes) Ethernet;
    rows of whole nodes swap them; the 1-D mesh's model axis is the cluster's group."""
    c = Cluster.v100_ethernet(2, 4)
    m = c.mesh(2, 4)
    data, model = m.axis(DATA), m.axis(MODEL)
    assert (data.size, data.nodes, data.link, model.size, model.nodes, model.link) == \
        (2, 2, c.inter, 4, 1, c.intra)
    assert (data.alpha, data.beta) == (c.inter.latency, 1 / c.inter.bandwidth)
    wide = c.mesh(1, 8)
    assert wide.axis(MODEL) == c.axis(8, name=MODEL) and wide.axis(MODEL).link == c.inter
    assert wide.axis(DATA).size == 1
    one_node = Cluster.v100_ethernet(1, 8).mesh(4, 2)
    assert one_node.axis(DATA).link == one_node.axis(MODEL).link == one_node.cluster.intra
    with pytest.raises(ValueError, match="mesh axis 'batch' is unknown"):
        m.axis("batch")
    # pricing on an axis is pricing on its group of the cluster
    opts = CostOptions.for_cluster(c)
    assert collective_cost("AR", 1 << 20, data, opts) == \
        collective_cost("AR", 1 << 20, c.axis(2, 2, name=DATA), opts)
    with pytest.raises(TypeError, match="must be a MeshAxis"):
        collective_cost("AR", 1 << 20, 2, opts)   # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mlp() -> Any:
    """An MLP captured at batch 8 and (for two rows) at batch 4."""
    import keras
    import tensorflow as tf

    from tapas import capturing
    inputs = keras.Input((16,), name="x")
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16, name="down")(h), name="mlp")
    return lambda batch: capturing.capture(model, tf.TensorSpec((batch, 16), tf.float32),
                                           name=f"mlp{batch}")


def test_runtime_takes_the_mesh_and_still_reads_mesh_rows() -> None:
    """Runtime(mesh=...) takes the Mesh (or "RxC"); mesh_rows=R, the keyword before it,
    reads as an R x cols mesh; the two must agree with the program's devices per row."""
    from tapas.execution.runtime.core import _runtime_mesh
    assert _runtime_mesh(None, None, 4) == M.Mesh(1, 4)
    assert _runtime_mesh(None, 2, 4) == M.Mesh(2, 4)
    c = Cluster.loopback_cpu(8)
    assert _runtime_mesh(c.mesh(2, 4), None, 4).cluster is c
    assert _runtime_mesh("2x4:experts", 2, 4) == M.Mesh(2, 4, True)
    with pytest.raises(ValueError, match="mesh 2x4 does not match mesh_rows=4"):
        _runtime_mesh("2x4", 4, 4)
    with pytest.raises(ValueError, match="with cols = 2"):
        _runtime_mesh(M.Mesh(2, 4), None, 2)


def test_gradient_all_reduce_is_one_backward_all_reduce_per_local_shard(mlp: Any) -> None:
    graph: Graph = mlp(4)
    c = Cluster.v100_ethernet(2, 2)
    opts = CostOptions.for_cluster(c)
    mesh = M.Mesh(2, 2)
    replicated = M.gradient_all_reduce(graph, {}, mesh.on(c), opts)
    sizes = {"up/kernel": 16 * 64 * 4, "up/bias": 64 * 4, "down/kernel": 64 * 16 * 4,
             "down/bias": 16 * 4}
    want = math.fsum(collective_cost("AR", b, c.axis(2, 2), opts, backward=True).total
                     for b in sizes.values())
    assert len(replicated.terms) == 4 and math.isclose(replicated.total, want)
    assert all(t.backward and t.group_size == 2 for t in replicated.terms)
    split = M.gradient_all_reduce(graph, {"up/kernel": Split(1)}, mesh.on(c), opts)
    kernel = [t for t in split.terms if t.label == "dp up/kernel"][0]
    assert kernel.nbytes == sizes["up/kernel"] // 2
    assert M.gradient_all_reduce(graph, {}, c.mesh(1, 4), opts).total == 0.0


def test_mesh_search_1xN_is_the_1d_search_and_rows_add_the_column_all_reduce(mlp: Any) -> None:
    from tapas.planning.search import search
    c = Cluster.v100_ethernet(2, 2)
    seen = []
    result = M.search_meshes(lambda rows: mlp(8 // rows), 8, c, search=search,
                             on_result=seen.append)
    assert [str(r.mesh) for r in result.results] == ["1x4", "2x2", "4x1"] and len(seen) == 3
    one_d = search(mlp(8), cluster=c)
    first = result.results[0]
    assert math.isclose(first.total, one_d.total_cost) and first.dp_cost == 0.0
    two = result.results[1]
    row = search(mlp(4), cluster=c.with_shape(1, 2))
    assert math.isclose(two.row_cost, row.total_cost)
    dp = M.gradient_all_reduce(mlp(4), dict(row.weight_placements), c.mesh(2, 2))
    assert math.isclose(two.dp_cost, dp.total) and two.dp_cost > 0
    assert result.best.total == min(r.total for r in result.results)
    table = result.summary()
    assert "<- best" in table and "2x2" in table
    assert json.loads(json.dumps(result.to_json()))["best"] == str(result.best.mesh)
    # a batch that does not split into the rows leaves that mesh out, with the reason
    odd = M.search_meshes(lambda rows: mlp(2 // rows), 2, c, search=search)
    assert not odd.results[2].ok and "does not split into 4 rows" in odd.results[2].note


def test_cli_search_meshes_prints_the_table_and_writes_json(tmp_path: Any) -> None:
    """`tapas search --meshes` on moe-tiny: every mesh shape, the EP x TP ones included."""
    out = tmp_path / "meshes.json"
    proc = run_tapas("search", "--model=moe-tiny", "--nodes=2", "--devices_per_node=2",
                     "--batch_size=4", "--meshes", f"--json_out={out}", TAPAS_PROGRESS="0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "<- best" in proc.stdout and "dp grad ms" in proc.stdout
    assert "2x2:experts EP x TP" in proc.stdout and "best mesh" in proc.stdout
    report = json.loads(out.read_text())["meshes"]
    shapes = ["1x4", "2x2", "2x2:experts", "4x1", "4x1:experts"]
    assert [r["mesh"] for r in report["results"]] == shapes
    assert report["best"] in shapes
    bad = run_tapas("search", "--model=t5-tiny", "--nodes=2", "--devices_per_node=2",
                    "--mesh=2x4")
    assert bad.returncode != 0 and "--mesh=2x4 has 8 devices, the cluster 4" in bad.stderr


# ---- the runtime on a 2x2 mesh of logical CPU devices ------------------------------------------

# (moe-tiny's layers hold attention as T5's do; t5-tiny on a 2x1 mesh of two processes is
# test_tapas_train_mesh_across_two_workers's, and scripts/equivalence.py runs any model)
MESH_CASES = [{"model": "moe-tiny", "mesh": "2x2", "seed": 3, "optimizer": "adam"},
              # a model we did not write: keras.applications MobileNetV2 (32x32, 10 classes)
              {"model": "keras-mobilenet-v2", "mesh": "2x2", "seed": 0, "optimizer": "sgd"},
              # nested expert + tensor: the experts over the rows, the searched (seed -1) plan
              # of the row inside (tapas.planning.experts); a random row plan of it is
              # test_experts.test_cli_train_nested_experts_verified's. The mesh is made on a
              # cluster of 2 nodes (Cluster.mesh), so parallelize searches the row on its
              # row's cluster (one node of 2 V100s)
              {"model": "moe-tiny", "mesh": "2x2:experts", "seed": -1, "optimizer": "adam",
               "nodes": 2}]


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from worker_main import run_worker
    (res,) = run_worker(os.path.join(ROOT, "tests", "runtime_worker.py"),
                        {"devices": 4, "dir": str(tmp_path_factory.mktemp("mesh")),
                         "checks": ["mesh"], "mesh": MESH_CASES}, 1, 600.0, None)
    return res["mesh"]


@pytest.mark.parametrize("case", MESH_CASES, ids=lambda c: f"{c['model']}-{c['mesh']}")
def test_dp_x_tp_mesh_trains_equal_to_keras(case: dict[str, Any], mesh_runs: dict) -> None:
    """Data parallel over 2 rows, a random tensor-parallel plan over the 2 devices of each
    row: outputs, loss, gradients and the weights after 2 optimizer steps equal the
    single-device Keras model's (rtol 1e-5); the columns' gradient all-reduces are the ones
    the cost model prices (one per trainable weight, the local shard's bytes); the
    checkpoint restores into a 1-D program of the same model, resharded, to equal weights;
    batched predict equals Keras's and fit runs."""
    run = mesh_runs[f"{case['model']}/{case['mesh']}/{case['seed']}/{case['optimizer']}"]
    assert "error" not in run, run.get("traceback")
    # (the search may keep a tiny row replicated; its experts are still split over the rows)
    assert run["sharded_nodes"] > 0 or case["seed"] < 0
    for what in ("outputs", "loss", "gradients", "weights"):
        assert run[what]["ok"], (what, run[what])
    assert run["dp_ran"] == run["dp_priced"]
    kinds = {k.split("|")[0] for k in run["dp_ran"]}
    if case["mesh"].endswith(":experts"):
        # the expert weights live in one row each (no column all-reduce); the dispatched
        # tokens go in and out of the region by an all-to-all, forward and backward
        assert run["row_split"] == ["block_1/moe/wi", "block_1/moe/wo"], run["row_split"]
        assert kinds == {"AR", "A2A"} and sum(k.startswith("A2A") for k in run["dp_ran"]) == 4
        assert not any(k.startswith("AR|block_1/moe/w") for k in run["dp_ran"])
    else:
        assert kinds == {"AR"} and not run["row_split"]
    assert run["predict"]["ok"], run["predict"]   # batched predict, then fit, on the mesh
    assert len(run["fit_losses"]) == 1 and math.isfinite(run["fit_losses"][0])
    assert run["restore"] == "resharded" and run["restored_equal"]
    if case.get("nodes"):
        assert run["search_cluster"] == "v100-ethernet/1x2"


def test_tapas_train_mesh_across_two_workers(tmp_path: Any) -> None:
    """`tapas train --workers=2 --mesh=2x1`: each MultiWorkerMirroredStrategy worker is one
    mesh row (on CPU a worker has one device), the gradients all-reduced across the
    processes; verified against Keras, the columns' all-reduces equal to the cost model's.
    Then 2 workers of 2 logical devices each: a 2x2 mesh with a row in each process, nested
    expert + tensor (DP x TP in one process: test_dp_x_tp_mesh_trains_equal_to_keras)."""
    out = tmp_path / "train.json"
    proc = run_tapas("train", "--model=t5-tiny", "--workers=2", "--mesh=2x1", "--steps=2",
                     "--verify", "--optimizer=adam", "--training=false", f"--json_out={out}",
                     timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verify: PASSED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["workers"] == 2 and report["verify"]["ok"]
    assert report["mesh"]["matches"] and report["mesh"]["dp_all_reduces"] > 0
    # 2 workers x 2 logical devices each (--devices_per_worker), one mesh row per process:
    # nested expert + tensor of moe-tiny, a random plan inside each row (its experts split
    # between the processes, the dispatched tokens exchanged between them; the row's own
    # collectives run inside each process)
    run = run_tapas("train", "--model=moe-tiny", "--workers=2", "--devices_per_worker=2",
                    "--mesh=2x2:experts", "--strategy=random:1", "--steps=2", "--verify",
                    "--optimizer=adam", "--training=false", f"--json_out={out}", timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verify: PASSED" in run.stdout and "device:CPU:1" in run.stdout
    report = json.loads(out.read_text())
    assert report["workers"] == 2 and report["devices"] == 4
    assert report["audit"]["matches"] and report["audit"]["measured"], report["audit"]
    assert report["mesh"]["matches"] and report["mesh"]["ep_all_to_alls"] == 4
    alone, bad, rows = run_tapas_each(
        ["train", "--model=t5-tiny", "--devices=4", "--devices_per_worker=2"],
        ["train", "--model=t5-tiny", "--devices=4", "--mesh=3x2"],
        ["train", "--model=t5-tiny", "--devices=4", "--batch_size=2", "--mesh=4x1"])
    assert alone.returncode == 1 and "--devices_per_worker=2: it sets the devices of each " \
        "process of --workers=K" in alone.stderr, alone.stderr[-2000:]
    assert bad.returncode == 1 and "--mesh=3x2 has 6 devices but the run has 4" in bad.stderr
    assert rows.returncode == 1, rows.stderr[-2000:]
    assert "does not split into 4 mesh rows" in rows.stderr and "[2, 16]" in rows.stderr
