"""Mixed precision in the cost model: per-dtype peaks on the cluster, FLOPs priced at the
rate of their dtype, bytes by dtype, the precision override, the presets' sources and the
cluster file (tapas.planning.cluster, tapas.planning.hardware, tapas.planning.precision)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tapas.planning import precision as prec
from tapas.planning.cluster import CLUSTER_PRESETS, SOURCE_KEYS, Cluster, ClusterFileError
from tapas.planning.cost import CostOptions, comm_cost, compute_time
from tapas.sharding.placements import Collective, Comm, Partial, Replica

V100_F32, V100_F16 = 15.7e12, 125e12
A100_F32, A100_HALF = 19.5e12, 312e12
H100_F32, H100_HALF = 67e12, 989e12


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12)


# ---- presets -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, f32, peaks, sources", [
    ("v100", V100_F32, {"float16": V100_F16}, {"float16": "125 TFLOP/s"}),
    ("a100", A100_F32, {"float16": A100_HALF, "bfloat16": A100_HALF},
     {"float16": "312 TFLOP/s", "bfloat16": "312 TFLOP/s"}),
    ("h100", H100_F32, {"float16": H100_HALF, "bfloat16": H100_HALF},
     {"float16": "989 dense", "bfloat16": "989 dense"}),
])
def test_gpu_presets_carry_their_peaks_with_sources(name, f32, peaks, sources) -> None:
    c = Cluster.preset(name, 2, 8)
    assert c.num_devices == 16 and c.device_peak_flops == f32
    assert dict(c.device_peak_flops_by_dtype) == peaks
    assert c.peak_flops("float32") == f32 and c.peak_flops() == f32
    for dtype, rate in peaks.items():
        assert c.peak_flops(dtype) == rate
        assert sources[dtype] in c.source(f"device_peak_flops.{dtype}")
        assert "datasheet" in c.source(f"device_peak_flops.{dtype}")
    for key in SOURCE_KEYS:
        assert c.sources.get(key), (name, key)
    assert name in CLUSTER_PRESETS and c.axis(16).link is c.inter


def test_v100_has_no_bfloat16_tensor_cores() -> None:
    c = Cluster.v100_ethernet(2, 8)
    assert c.name == "v100-ethernet/2x8"
    assert c.peak_flops("bfloat16") == V100_F32
    assert "no bfloat16" in c.source("device_peak_flops.float16")
    assert "priced at device_peak_flops" in c.source("device_peak_flops.bfloat16")
    assert Cluster.loopback_cpu(4).device_peak_flops_by_dtype is None
    cpu = Cluster.loopback_cpu(4)
    assert cpu.peak_flops("float16") == cpu.device_peak_flops


def test_a100_h100_interconnect() -> None:
    a, h = Cluster.gpu("a100", 2, 8), Cluster.gpu("h100", 2, 8)
    assert (a.intra.bandwidth, a.inter.bandwidth) == (300e9, 25e9)
    assert (h.intra.bandwidth, h.inter.bandwidth) == (450e9, 50e9)
    assert a.device_memory == h.device_memory == 80e9
    assert "HDR InfiniBand" in a.source("inter.bandwidth")
    assert "TF32" in a.source("device_peak_flops")
    with pytest.raises(ValueError, match="GPU preset 'b200' is unknown"):
        Cluster.gpu("b200")


def test_peaks_by_dtype_are_checked() -> None:
    base = Cluster.v100_ethernet()
    with pytest.raises(ValueError, match="float32's peak is device_peak_flops"):
        dataclasses.replace(base, device_peak_flops_by_dtype={"float32": 1e13})
    with pytest.raises(ValueError, match=r"\['float16', 'bfloat16', 'float64'\]"):
        dataclasses.replace(base, device_peak_flops_by_dtype={"int8": 1e13})
    with pytest.raises(ValueError, match="positive, finite number of FLOP/s"):
        dataclasses.replace(base, device_peak_flops_by_dtype={"float16": -1.0})
    with pytest.raises(TypeError, match="must be a mapping"):
        dataclasses.replace(base, device_peak_flops_by_dtype=125e12)
    with pytest.raises(ValueError, match="unknown keys"):
        dataclasses.replace(base, sources={"device_peak_flops.int8": "x"})


# ---- the cluster file ----------------------------------------------------------------------

def test_peaks_round_trip_through_the_cluster_file(tmp_path) -> None:
    for name in ("v100", "a100", "h100", "cpu"):
        c = Cluster.preset(name, 2, 4)
        path = str(tmp_path / f"{name}.json")
        c.save(path)
        back = Cluster.load(path)
        assert back == c and back.device_peak_flops_by_dtype == c.device_peak_flops_by_dtype
        assert dict(back.sources) == dict(c.sources)
        # the strategy file's cluster goes through the same codec
        assert Cluster.from_json(c.to_json(), older_layout=True) == c
        assert Cluster.from_json(c.to_json(), older_layout=True).device_peak_flops_by_dtype == \
            c.device_peak_flops_by_dtype


def test_old_cluster_files_load_without_the_field(tmp_path) -> None:
    d = Cluster.v100_ethernet(1, 4).to_json()
    del d["device_peak_flops_by_dtype"]
    d["sources"] = {k: v for k, v in d["sources"].items() if k in SOURCE_KEYS}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    old = Cluster.load(str(path))
    assert old.device_peak_flops_by_dtype is None
    assert old.peak_flops("float16") == V100_F32
    # an older strategy file's cluster layout: links as lists, no format
    legacy = {"name": "v100-ethernet/1x4", "num_nodes": 1, "devices_per_node": 4,
              "intra": [150e9, 3.4e-6, "nvlink2"], "inter": [12.5e9, 9.6e-6, "eth"],
              "device_memory": 32 * 2**30, "device_peak_flops": V100_F32}
    assert Cluster.from_json(legacy, older_layout=True).device_peak_flops_by_dtype is None


def test_a_bad_peak_in_a_file_names_the_field(tmp_path) -> None:
    d = Cluster.v100_ethernet().to_json()
    d["device_peak_flops_by_dtype"] = {"float32": 1e13}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ClusterFileError, match="'device_peak_flops_by_dtype'.*float32"):
        Cluster.load(str(path))


# ---- FLOPs at the rate of their dtype ------------------------------------------------------

F, E = 6e12, 1e9        # forward FLOPs of contractions, of memory-bound ops


@pytest.mark.parametrize("cluster, dtype, rate", [
    (Cluster.v100_ethernet(2, 8), "float16", V100_F16),
    (Cluster.v100_ethernet(2, 8), "bfloat16", V100_F32),
    (Cluster.v100_ethernet(2, 8), "float32", V100_F32),
    (Cluster.gpu("a100", 2, 8), "bfloat16", A100_HALF),
    (Cluster.gpu("h100", 2, 8), "float16", H100_HALF),
])
def test_a_contraction_runs_at_its_dtype_peak(cluster, dtype, rate) -> None:
    got = compute_time(F + E, cluster, CostOptions(), dense_flops=F,
                       dense_by_dtype={dtype: F})
    # the memory-bound FLOPs stay at the float32 peak (the paper's pricing on a preset)
    assert close(got, 3 * (F / rate + E / cluster.device_peak_flops))


def test_a_node_with_two_dtypes_splits_its_flops() -> None:
    c = Cluster.v100_ethernet()
    got = compute_time(F, c, dense_flops=F, dense_by_dtype={"float16": F / 4,
                                                             "float32": 3 * F / 4})
    assert close(got, 3 * (F / 4 / V100_F16 + 3 * F / 4 / V100_F32))
    # without dtypes (a hand-written pattern) every FLOP at the float32 peak, as before
    assert close(compute_time(F, c, dense_flops=F), 3 * F / V100_F32)


def test_dtype_rates_on_a_profiled_cluster() -> None:
    c = dataclasses.replace(Cluster.v100_ethernet(), device_elementwise_rate=1e11,
                            device_width_efficiency={16: 0.5, 256: 1.0})
    by_width = {16: F / 2}
    f32 = compute_time(F + E, c, dense_flops=F, elements=E, dense_by_width=by_width,
                       dense_by_dtype={"float32": F})
    f16 = compute_time(F + E, c, dense_flops=F, elements=E, dense_by_width=by_width,
                       dense_by_dtype={"float16": F})
    eff = F / 2 / c.flop_rate(16) * V100_F32 + F / 2          # width-priced peak FLOPs
    assert close(f32, 3 * (eff / V100_F32 + E / 1e11))
    assert close(f16, 3 * (eff / V100_F16 + E / 1e11))        # elements keep their rate


# ---- bytes by dtype ------------------------------------------------------------------------

def _comm(dtype: str, tensor: str = "act:0", phase: str = "fwd") -> Comm:
    return Comm(Collective.ALL_REDUCE, tensor, (64, 1024), dtype, Partial(), Replica(), phase)


def test_collective_bytes_follow_the_tensor_dtype() -> None:
    c = Cluster.v100_ethernet()
    f32, bf16 = comm_cost(_comm("float32"), c.axis(8)), comm_cost(_comm("bfloat16"), c.axis(8))
    assert (f32.nbytes, bf16.nbytes) == (64 * 1024 * 4, 64 * 1024 * 2)
    assert close(bf16.transmission * 2, f32.transmission)


def test_the_override_reprices_activations_not_weights() -> None:
    c = Cluster.v100_ethernet()
    mixed = CostOptions(precision="mixed_bfloat16")
    assert comm_cost(_comm("float32"), c.axis(8), mixed).nbytes == 64 * 1024 * 2
    w = comm_cost(_comm("float32", "w:0", "bwd"), c.axis(8), mixed, weights={"w:0"})
    assert w.nbytes == 64 * 1024 * 4 and w.gradient
    back = CostOptions(precision="float32")
    assert comm_cost(_comm("bfloat16"), c.axis(8), back).nbytes == 64 * 1024 * 4
    assert comm_cost(_comm("int32"), c.axis(8), mixed).nbytes == 64 * 1024 * 4
    assert prec.priced_dtype("float16", "mixed_bfloat16") == "bfloat16"
    assert prec.priced_dtype("float16", "mixed_bfloat16", weight=True) == "float32"
    assert prec.priced_dtype("float64", "mixed_float16") == "float64"


def test_the_override_reprices_flops() -> None:
    c = Cluster.v100_ethernet()
    as_f16 = compute_time(F, c, CostOptions(precision="mixed_float16"), dense_flops=F,
                          dense_by_dtype={"float32": F})
    assert close(as_f16, 3 * F / V100_F16)
    as_f32 = compute_time(F, c, CostOptions(precision="float32"), dense_flops=F,
                          dense_by_dtype={"float16": F})
    assert close(as_f32, 3 * F / V100_F32)
    # no dtypes known: every contraction in the override's dtype
    assert close(compute_time(F, c, CostOptions(precision="mixed_float16"), dense_flops=F),
                 3 * F / V100_F16)


def test_a_bad_precision_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"precision='fp16'.*'mixed_float16'"):
        CostOptions(precision="fp16")
    assert prec.compute_dtype("mixed_bfloat16") == "bfloat16"
    assert prec.compute_dtype("float32") == "float32"


# ---- a captured model under a mixed policy -------------------------------------------------

def _capture(policy: str):
    import keras
    import tensorflow as tf

    from tapas import capturing
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        inputs = keras.Input((64,), batch_size=16, name="x")
        h = keras.layers.Dense(256, activation="relu", name="up")(inputs)
        out = keras.layers.Dense(64, name="down")(h)
        model = keras.Model(inputs, out, name=f"mlp_{policy}")
        return capturing.capture(model, tf.TensorSpec((16, 64), tf.float32))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture(scope="module")
def graphs():
    return {p: _capture(p) for p in ("float32", "mixed_float16", "mixed_bfloat16")}


def test_the_captured_policy_is_read_from_the_graph(graphs) -> None:
    for policy, g in graphs.items():
        assert prec.graph_precision(g) == policy
        dense = [n for n in g.nodes if n.kind.value == "dense"]
        assert {w.dtype for n in dense for w in n.weights} == {"float32"}


def test_a_mixed_float16_model_is_priced_at_the_tensor_core_rate(graphs) -> None:
    from tapas.planning.table import pattern_table
    c = Cluster.v100_ethernet(1, 4)
    tables = {p: pattern_table(g, 4, c) for p, g in graphs.items()}
    g16, t16, t32 = graphs["mixed_float16"], tables["mixed_float16"], tables["float32"]
    as16 = pattern_table(graphs["float32"], 4, c, CostOptions(precision="mixed_float16"))
    checked = 0
    for node in g16.nodes:
        if node.kind.value != "dense":
            continue
        i = t16.index(node.id, "replicate")
        info16, info32 = t16.infos[node.id][i], t32.infos[node.id][i]
        over = as16.infos[node.id][i]
        k, n = next(w.shape for w in node.weights if len(w.shape) == 2)
        dense = 2.0 * 16 * k * n
        assert close(info16.compute_time, 3 * (dense / V100_F16 + (info16.flops - dense)
                                               / V100_F32))
        assert close(info32.compute_time, 3 * info32.flops / V100_F32)
        # the float32 capture re-priced as mixed_float16: its matmul on the tensor cores
        assert close(over.compute_time, 3 * (dense / V100_F16 + (info32.flops - dense)
                                             / V100_F32))
        # its activations are half the bytes, its weights are not
        assert close(info16.memory.activations * 2, info32.memory.activations)
        assert close(over.memory.activations * 2, info32.memory.activations)
        assert info16.memory.weights == info32.memory.weights == over.memory.weights
        checked += 1
    assert checked == 2
    # bfloat16 has no tensor cores on a V100: priced as float32
    tb = tables["mixed_bfloat16"]
    for row in tb.infos:
        for info in row:
            assert close(info.compute_time, 3 * info.flops / V100_F32) or info.flops == 0


def test_search_records_and_overrides_the_precision(graphs, tmp_path) -> None:
    from tapas.planning.search import Strategy, search
    c = Cluster.v100_ethernet(1, 4)
    own = search(graphs["mixed_float16"], cluster=c)
    assert own.precision == "mixed_float16"
    assert not any("precision override" in n for n in own.notes)
    # the override naming the model's own policy changes nothing
    same = search(graphs["mixed_float16"], cluster=c, precision="mixed_float16")
    assert same.total_cost == own.total_cost
    # a float32 model searched as if it were mixed_float16: priced like the mixed capture
    over = search(graphs["float32"], cluster=c, precision="mixed_float16")
    assert over.precision == "mixed_float16"
    assert any("captured under float32" in n for n in over.notes)
    over.save(str(tmp_path / "s.json"))
    again = Strategy.load(str(tmp_path / "s.json"))
    assert again.precision == "mixed_float16" and again.cluster == c
    assert again.cluster.device_peak_flops_by_dtype == c.device_peak_flops_by_dtype
    assert "priced in mixed_float16" in over.summary().splitlines()[0]
    plain = search(graphs["float32"], cluster=c)
    assert plain.precision == "float32"
    # (the mixed capture also runs its casts, memory-bound FLOPs at the float32 peak)
    assert plain.cost["compute"] > 2 * own.cost["compute"] > 2 * over.cost["compute"]
    with pytest.raises(ValueError, match="precision='half'"):
        search(graphs["float32"], cluster=c, precision="half")


def test_cli_search_precision_overrides_the_models_policy():
    """``tapas search --precision=``: the float32 zoo model priced as mixed_float16 on
    V100s (tensor cores), and a bad value refused with the allowed ones."""
    from command import run_tapas   # tests/command.py
    args = ("search", "--model=t5-tiny", "--nodes=1", "--devices_per_node=2", "--cluster=v100")
    base = run_tapas(*args)
    assert base.returncode == 0, base.stdout[-2000:] + base.stderr[-2000:]
    assert "priced in float32" in base.stdout
    half = run_tapas(*args, "--precision=mixed_float16")
    assert half.returncode == 0, half.stdout[-2000:] + half.stderr[-2000:]
    assert "priced in mixed_float16" in half.stdout
    bad = run_tapas(*args, "--precision=float8")
    assert bad.returncode != 0 and "mixed_bfloat16" in bad.stdout + bad.stderr
