"""Tests for calibration: the fits (synthetic data), the cluster file, and `tapas profile`
followed by `tapas search --cluster=FILE` in subprocesses."""

import dataclasses
import json
import math
import sys

import command  # tests/command.py
from matrix import only_in_full_matrix  # tests/matrix.py
import numpy as np
import pytest

from tapas.execution.calibration.fitting import (FitError, fit_collectives, fit_compute, fit_gamma,
                                                 fit_linear, profiled_cluster)
from tapas.planning.cluster import Cluster, ClusterFileError, Link
from tapas.planning.cost import DEFAULT_EPSILON, DEFAULT_GAMMA, CostOptions, ring_factor
from tapas.sharding.placements import Collective

SIZES = [2 ** k for k in range(10, 25, 2)]       # 1 KiB to 16 MiB


def close(a, b, rel=1e-9):
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


# ---- fitting ---------------------------------------------------------------------------------

def test_fit_linear_recovers_exact_constants():
    x = [float(s) for s in SIZES]
    fit = fit_linear(x, [5e-4 + 2.5e-9 * v for v in x])
    assert close(fit.intercept, 5e-4, 1e-9) and close(fit.slope, 2.5e-9, 1e-9)
    assert close(fit.r2, 1.0, 1e-12) and close(fit.r2_log, 1.0, 1e-12) and not fit.clamped
    assert fit.max_relative_residual < 1e-9


def test_fit_linear_with_noise_recovers_constants_within_noise():
    rng = np.random.default_rng(0)
    x = np.repeat(np.asarray(SIZES, dtype=float), 5)
    t = (3e-4 + 1e-9 * x) * (1 + rng.normal(0, 0.02, size=x.shape))   # 2 % timing noise
    fit = fit_linear(list(x), list(t))
    assert abs(fit.intercept / 3e-4 - 1) < 0.03 and abs(fit.slope / 1e-9 - 1) < 0.03
    assert fit.r2 > 0.99 and fit.r2_log > 0.99
    assert fit.max_relative_residual < 0.1


def test_fit_linear_relative_weights_keep_the_intercept():
    # plain least squares would let the 16 MiB point's 1 % error swamp the 1 KiB latency
    x = [float(s) for s in SIZES]
    t = [1e-4 + 1e-9 * v for v in x]
    t[-1] *= 1.01
    fit = fit_linear(x, t)
    assert abs(fit.intercept / 1e-4 - 1) < 0.05


def test_fit_linear_clamps_a_negative_intercept_and_refuses_bad_data():
    x = [1e3, 1e4, 1e5, 1e6]
    fit = fit_linear(x, [1e-9 * v - 1e-7 + 1e-9 for v in x])
    assert fit.clamped and fit.intercept == 0.0 and fit.slope > 0
    with pytest.raises(FitError, match="do not grow with the message size"):
        fit_linear(x, [1e-3, 0.9e-3, 0.8e-3, 0.7e-3])
    with pytest.raises(FitError, match="at least two distinct message sizes"):
        fit_linear([1e3, 1e3], [1e-3, 2e-3])
    with pytest.raises(FitError, match=r"times \[-0.001\]: every measured time must be positive"):
        fit_linear([1e3, 1e4], [-1e-3, 2e-3])


def test_fit_compute_separates_the_two_rates():
    """Steps that mix matmul FLOPs and memory-bound elements in different proportions give
    both rates at once, in the cost model's units (forward work x 3 for a training step);
    2 % noise moves them by a few per cent; a negative intercept is refitted through the
    origin; steps that do not grow with one kind of work give no rate for it."""
    dense = [1e7, 5e7, 1e8, 4e8, 1e6, 5e6, 2e7, 8e7]
    elements = [2e5, 1e6, 2e6, 8e6, 1e6, 5e6, 2e7, 8e7]
    exact = [2e-3 + 3 * f / 6e10 + 3 * e / 1.5e9 for f, e in zip(dense, elements)]
    fit = fit_compute(dense, elements, exact)
    assert close(fit.dense_rate, 6e10, 1e-9) and close(fit.elementwise_rate, 1.5e9, 1e-9)
    assert close(fit.intercept, 2e-3, 1e-9) and close(fit.r2, 1.0, 1e-12)
    assert not fit.clamped and fit.max_relative_residual < 1e-9
    noisy = [t * (1 + 0.02 * (-1) ** i) for i, t in enumerate(exact)]
    fit = fit_compute(dense, elements, noisy)
    assert abs(fit.dense_rate / 6e10 - 1) < 0.1 and abs(fit.elementwise_rate / 1.5e9 - 1) < 0.1
    assert fit.to_json()["dense_rate"] == fit.dense_rate
    below = fit_compute(dense, elements, [3 * f / 6e10 + 3 * e / 1.5e9 - 1e-6
                                          for f, e in zip(dense, elements)])
    assert below.clamped and below.intercept == 0.0 and below.dense_rate > 0
    with pytest.raises(FitError, match="time per matmul/convolution FLOPs"):
        fit_compute(dense, elements, [1e-3 + 3 * e / 1.5e9 - f * 1e-12
                                      for f, e in zip(dense, elements)])
    with pytest.raises(FitError, match="three constants need at least 3"):
        fit_compute([1.0, 2.0], [1.0, 2.0], [1e-3, 2e-3])
    with pytest.raises(FitError, match="every measured time must be positive"):
        fit_compute(dense[:3], elements[:3], [1e-3, -1e-3, 2e-3])


def synthetic_rows(w, alpha, beta, eps):
    rows = []
    for kind, e in eps.items():
        for n in SIZES:
            t = alpha * w + beta * e * ring_factor(kind, w) * n
            rows.append({"kind": kind, "bytes": n, "seconds": t})
    return rows


def test_fit_collectives_recovers_alpha_beta_epsilon_and_makes_the_cluster():
    w, alpha, beta = 4, 1.5e-4, 1.25e-9
    eps = {"AR": 1.0, "AG": 0.6, "RS": 1.4, "A2A": 4.0}
    fits = fit_collectives(synthetic_rows(w, alpha, beta, eps), w)
    assert set(fits) == set(Collective)
    for kind, f in fits.items():
        assert close(f.alpha_per_worker, alpha, 1e-6), kind
        assert close(f.beta, beta * eps[kind.value], 1e-6), kind
        assert close(f.epsilon, eps[kind.value], 1e-6) and f.fit.r2 > 0.999999
    cluster = profiled_cluster("profiled-cpu", fits, 2 ** 30, 2e10, None, "logical CPU devices",
                               "2026-01-01")
    assert cluster.num_devices == w and cluster.name == "profiled-cpu/1x4"
    assert close(cluster.intra.latency, alpha, 1e-6) and close(cluster.intra.beta, beta, 1e-6)
    assert cluster.gamma is None and "prior" in cluster.source("gamma")
    assert {k: round(v, 6) for k, v in cluster.epsilon.items()} == eps
    # the cost model on the profiled cluster predicts the synthetic times it was fitted to
    from tapas.planning.cost import collective_time
    opts = CostOptions.for_cluster(cluster)
    for kind, e in eps.items():
        n = 3 * 2 ** 20
        assert close(collective_time(kind, n, cluster.axis(w), opts),
                     alpha * w + beta * e * ring_factor(kind, w) * n, 1e-6)


def test_fit_collectives_needs_the_all_reduce():
    rows = synthetic_rows(2, 1e-4, 1e-9, {"AG": 1.0})
    with pytest.raises(FitError, match="no all-reduce: epsilon is relative to the all-reduce"):
        fit_collectives(rows, 2)


def test_fit_gamma_from_overlap_trials():
    none = {"empty": 1.0, "comm": 11.0, "compute": 21.0, "both": 31.0}    # no overlap
    half = {"empty": 1.0, "comm": 11.0, "compute": 21.0, "both": 26.0}
    full = {"empty": 1.0, "comm": 11.0, "compute": 21.0, "both": 21.0}
    worse = {"empty": 1.0, "comm": 11.0, "compute": 21.0, "both": 40.0}   # contention
    assert fit_gamma([none]).gamma == 1.0 and not fit_gamma([none]).clipped
    assert fit_gamma([half]).gamma == 0.5
    assert fit_gamma([full]).gamma == 0.05 and fit_gamma([full]).clipped
    assert fit_gamma([worse]).gamma == 1.0 and fit_gamma([worse]).clipped
    assert fit_gamma([none, half, full]).gamma == 0.5                     # the median
    noise = {"empty": 2.0, "comm": 1.9, "compute": 21.0, "both": 22.0}
    assert fit_gamma([noise]) is None
    assert fit_gamma([noise, half]).gamma == 0.5


# ---- the cluster file -------------------------------------------------------------------------

def profiled(**changes):
    link = Link(bandwidth=8e8, latency=1.5e-4, name="profiled")
    c = Cluster("profiled-cpu/1x4", 1, 4, link, link, device_memory=2.0 ** 34,
                device_peak_flops=1.8e10, sources={"intra.bandwidth": "measured",
                                                   "epsilon": "measured"},
                epsilon={"AR": 1.0, "all_gather": 0.6, "RS": 1.4, "A2A": 4.2}, gamma=0.93,
                device_elementwise_rate=1.5e9,
                device_width_efficiency={8: 0.3, "16": 0.55, 64: 1.0})
    return dataclasses.replace(c, **changes)


def test_cluster_json_round_trip(tmp_path):
    for cluster in (profiled(), Cluster.v100_ethernet(2, 8), Cluster.loopback_cpu(4)):
        path = str(tmp_path / "c.json")
        cluster.save(path, extra={"profile": {"rows": [1, 2]}})
        back = Cluster.load(path)
        assert back == cluster and dict(back.sources) == dict(cluster.sources)
        assert back.epsilon == cluster.epsilon and back.gamma == cluster.gamma
        assert back.device_elementwise_rate == cluster.device_elementwise_rate
        assert back.device_width_efficiency == cluster.device_width_efficiency
        d = json.loads(open(path).read())
        assert d["format"] == "tapas-cluster" and d["version"] == 1
        assert d["profile"] == {"rows": [1, 2]}
    assert dict(profiled().epsilon) == {"AR": 1.0, "AG": 0.6, "RS": 1.4, "A2A": 4.2}
    assert dict(profiled().device_width_efficiency) == {8: 0.3, 16: 0.55, 64: 1.0}
    with pytest.raises(ValueError, match="extra key 'gamma' would overwrite"):
        profiled().save(str(tmp_path / "x.json"), extra={"gamma": 1})


def test_cost_options_for_cluster():
    opts = CostOptions.for_cluster(profiled())
    assert opts.gamma == 0.93 and opts.epsilon_for("A2A") == 4.2
    assert CostOptions.for_cluster(profiled(), gradient_overlap=False).gamma_for(True) == 1.0
    prior = CostOptions.for_cluster(Cluster.v100_ethernet())
    assert prior.gamma == DEFAULT_GAMMA and dict(prior.epsilon) == dict(DEFAULT_EPSILON)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("device_peak_flops"), r"field 'device_peak_flops' is missing"),
    (lambda d: d["intra"].update(bandwidth="fast"),
     r"field 'intra.bandwidth' is 'fast', it must be a positive number of bytes/s"),
    (lambda d: d["inter"].update(latency=-1), r"field 'inter.latency' is -1.0"),
    (lambda d: d.update(num_nodes=0), r"field 'num_nodes' is 0, it must be an int >= 1"),
    (lambda d: d.update(devices_per_node=2.5), r"field 'devices_per_node' is 2.5"),
    (lambda d: d.update(version=2), r"field 'version' is 2; this TAPAS reads version 1"),
    (lambda d: d.update(format="tapas-strategy"), r"field 'format' is 'tapas-strategy'"),
    (lambda d: d.update(gamma=1.5), r"field 'gamma' is 1.5, it must be a number in \(0, 1\]"),
    (lambda d: d["epsilon"].update(XX=1.0), r"field 'epsilon.XX' collective 'XX' is unknown"),
    (lambda d: d["epsilon"].update(AG=0), r"field 'epsilon.AG' is 0.0, it must be a positive"),
    (lambda d: d["sources"].update(bandwith="typo"), r"field 'sources.bandwith' is not a"),
    (lambda d: d.update(device_elementwise_rate=0),
     r"field 'device_elementwise_rate' is 0.0, it must be null or a positive number"),
    (lambda d: d.update(device_elementwise_rate="fast"),
     r"field 'device_elementwise_rate' is 'fast'"),
    (lambda d: d["device_width_efficiency"].update({"12": 0.5}),
     r"field 'device_width_efficiency' .*width '12': widths are powers of two"),
    (lambda d: d["device_width_efficiency"].update({"32": -0.5}),
     r"field 'device_width_efficiency' device_width_efficiency\[32\]=-0.5"),
    (lambda d: d.update(device_width_efficiency=[0.5]),
     r"field 'device_width_efficiency' is \[0.5\], it must be null or an object"),
])
def test_malformed_cluster_file_names_the_field(tmp_path, edit, message):
    path = tmp_path / "bad.json"
    d = profiled().to_json()
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(ClusterFileError, match=message) as info:
        Cluster.load(str(path))
    assert str(path) in str(info.value) and "tapas profile --out" in str(info.value)


def test_cluster_without_an_elementwise_rate_reads_as_the_paper_model(tmp_path):
    """Cluster files written before the rate existed (and presets) have none: memory-bound
    ops stay priced by their FLOPs; the source says so."""
    path = tmp_path / "old.json"
    d = profiled().to_json()
    del d["device_elementwise_rate"]
    path.write_text(json.dumps(d))
    old = Cluster.load(str(path))
    assert old.device_elementwise_rate is None
    assert "not profiled" in old.source("device_elementwise_rate")
    assert Cluster.v100_ethernet().device_elementwise_rate is None
    with pytest.raises(ValueError, match=r"device_elementwise_rate=-1.0: must be a positive"):
        profiled(device_elementwise_rate=-1.0)
    # ... nor a FLOP rate by width: every matrix multiply at device_peak_flops
    del d["device_width_efficiency"]
    path.write_text(json.dumps(d))
    old = Cluster.load(str(path))
    assert old.device_width_efficiency is None and old.flop_rate(8) == old.device_peak_flops
    assert "not profiled" in old.source("device_width_efficiency")
    with pytest.raises(ValueError, match=r"width 3: widths are powers of two"):
        profiled(device_width_efficiency={3: 0.5})


def test_unreadable_cluster_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ClusterFileError, match=r"is not JSON"):
        Cluster.load(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ClusterFileError, match=r"must be a JSON object, got list"):
        Cluster.load(str(bad))
    with pytest.raises(ClusterFileError, match=r"cannot be read \(No such file"):
        Cluster.load(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"cluster 'tpu' is neither a preset"):
        Cluster.resolve("tpu")


def test_resolve_presets_and_files(tmp_path):
    assert Cluster.resolve("cpu", 1, 2) == Cluster.preset("cpu", 1, 2)
    path = str(tmp_path / "c.json")
    profiled().save(path)
    assert Cluster.resolve(path) == profiled()
    wide = Cluster.resolve(path, 2, 8)
    assert wide.num_devices == 16 and wide.name == "profiled-cpu/2x8"
    assert wide.epsilon == profiled().epsilon and wide.gamma == 0.93


def test_parse_sizes():
    from tapas.execution.calibration.fitting import parse_sizes
    assert parse_sizes("1KiB:16KiB") == [1024, 4096, 16384]
    assert parse_sizes("64KiB, 4 MiB,4096") == [4096, 65536, 4 * 2 ** 20]
    with pytest.raises(ValueError, match="at least two"):
        parse_sizes("1KiB")
    with pytest.raises(ValueError, match=r"size '3furlongs'"):
        parse_sizes("1KiB,3furlongs")
    with pytest.raises(ValueError, match="ends below its start"):
        parse_sizes("1MiB:1KiB")


# ---- the command, in subprocesses --------------------------------------------------------------

def run_tapas(*args):
    proc = command.run_tapas(*args)
    assert proc.returncode == 0, f"tapas {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_profile_writes_a_cluster_file_that_search_uses(tmp_path):
    out, png = tmp_path / "cluster.json", tmp_path / "residuals.png"
    # two sizes far apart, so that load on a shared machine cannot reverse their order
    stdout = run_tapas("profile", "--devices=2", "--sizes=16KiB,4MiB", "--repeats=3",
                       f"--out={out}", f"--plot={png}")
    # progress: one line per measured point, then the fitted constants
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert sum(line.startswith(kind) for line in stdout.splitlines()) == 3, stdout
    assert "fitted over W = 2 devices" in stdout and "cluster file written to" in stdout
    cluster = Cluster.load(str(out))
    assert cluster.num_devices == 2 and cluster.name == "profiled-cpu/1x2"
    for value in (cluster.intra.bandwidth, cluster.intra.latency, cluster.device_peak_flops,
                  cluster.device_memory, *cluster.epsilon.values()):
        assert math.isfinite(value) and value >= 0
    assert cluster.intra.bandwidth > 0 and cluster.device_peak_flops > 0
    assert set(cluster.epsilon) == {"AR", "AG", "RS", "A2A"} and cluster.epsilon["AR"] == 1.0
    assert cluster.gamma is None or 0 < cluster.gamma <= 1
    # the compute rates: training steps of three reference blocks at four sizes, one fit
    assert "training steps of 12 reference blocks:" in stdout, stdout
    assert cluster.device_elementwise_rate is not None and cluster.device_elementwise_rate > 0
    assert "memory-bound ops" in cluster.source("device_elementwise_rate")
    assert "reference blocks" in cluster.source("device_peak_flops")
    profile = json.loads(out.read_text())["profile"]
    steps = profile["compute"]["blocks"]
    assert steps["blocks"] == ["transformer", "residual", "inverted residual"]
    assert [p["shape"] for p in steps["points"][:4]] == [[8, 16, 64], [16, 32, 64],
                                                         [64, 16, 64], [32, 64, 128]]
    # the cost model's counts: every block has matmuls or convolutions and memory-bound ops
    assert all(p["dense_flops"] > 0 and p["elements"] > np.prod(p["shape"])
               for p in steps["points"])
    assert steps["rate"] == cluster.device_elementwise_rate
    assert steps["dense_rate"] == cluster.device_peak_flops and math.isfinite(steps["r2"])
    # the FLOP rate by width: matmul stacks of widths 8 to 256, each over the fastest; the
    # blocks' FLOPs fitted in peak-rate FLOPs (each width bucket's over its efficiency)
    assert "matmul FLOP rate by width" in stdout, stdout
    widths = profile["compute"]["widths"]
    assert [p["width"] for p in widths["points"]] == [8, 16, 32, 64, 128, 256]
    table = cluster.device_width_efficiency
    assert table is not None and max(table.values()) == 1.0 and set(table) <= {
        8, 16, 32, 64, 128, 256} and len(table) >= 2
    assert "matmul stacks per width" in cluster.source("device_width_efficiency")
    for p in steps["points"]:
        assert sum(p["dense_by_width"].values()) == pytest.approx(p["counted_dense_flops"])
        # no width runs above the fastest: priced FLOPs are at least the counted ones
        assert p["dense_flops"] >= p["counted_dense_flops"] * (1 - 1e-9)
    assert len(profile["rows"]) == 8 and profile["devices"][0].endswith("CPU:0")
    for fit in profile["fits"].values():
        assert math.isfinite(fit["fit"]["r2"]) and fit["beta_s_per_byte"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"

    strategy_path = tmp_path / "s.json"
    stdout = run_tapas("search", "--model=t5-tiny", f"--cluster={out}", f"--out={strategy_path}")
    assert "on profiled-cpu/1x2 (2 devices)" in stdout
    saved = json.loads(strategy_path.read_text())
    assert saved["cluster"]["name"] == "profiled-cpu/1x2"
    assert saved["cluster"]["epsilon"] == dict(cluster.epsilon)
    assert saved["cluster"]["device_elementwise_rate"] == cluster.device_elementwise_rate
    assert saved["cluster"]["device_width_efficiency"] == {str(k): v for k, v in table.items()}



@only_in_full_matrix   # test_profile_writes_a_cluster_file_that_search_uses profiles in the suite
def test_profile_across_worker_processes(tmp_path):
    """`tapas profile --workers=2`: two MultiWorkerMirroredStrategy processes on 127.0.0.1;
    worker 0 writes the cluster file (2 nodes of 1 device, the fitted link between the
    workers), the plot and the JSON report; both workers are gone afterwards."""
    out, png, report = tmp_path / "c.json", tmp_path / "r.png", tmp_path / "report.json"
    stdout = run_tapas("profile", "--workers=2", "--sizes=16KiB,4MiB", "--repeats=3",
                       "--nogamma", "--noelementwise", "--nowidths", f"--out={out}",
                       f"--plot={png}", f"--json_out={report}")
    assert "launching 2 workers" in stdout and "in 2 worker processes" in stdout
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert sum(line.startswith(kind) for line in stdout.splitlines()) == 3, stdout
    cluster = Cluster.load(str(out))
    assert (cluster.num_nodes, cluster.devices_per_node) == (2, 1)
    assert cluster.name == "profiled-cpu/2x1"
    assert cluster.inter.bandwidth > 0 and cluster.inter.latency > 0
    assert "worker processes" in cluster.source("inter.bandwidth")
    assert "same as inter" in cluster.source("intra.bandwidth")
    assert cluster.device_peak_flops > 0 and cluster.epsilon["AR"] == 1.0
    assert cluster.device_elementwise_rate is None     # --noelementwise: the paper's model
    assert cluster.device_width_efficiency is None     # --nowidths: one FLOP rate
    assert png.read_bytes()[:4] == b"\x89PNG"
    saved = json.loads(report.read_text())
    assert saved["cluster"]["name"] == "profiled-cpu/2x1" and len(saved["worker_seconds"]) == 2
    assert "task:1" not in " ".join(saved["profile"]["devices"])   # worker 0's own devices
    with pytest.raises(AssertionError, match="at least 2 workers"):
        run_tapas("profile", "--workers=1", f"--out={out}")
    with pytest.raises(AssertionError, match="each worker has one device"):
        run_tapas("profile", "--workers=2", "--devices=3", f"--out={out}")


def test_profiled_cluster_of_worker_processes():
    w, alpha, beta = 4, 100e-6, 1e-9
    fits = fit_collectives(synthetic_rows(w, alpha, beta, {"AR": 1.0}), w)
    two = profiled_cluster("profiled-gpu", fits, 2 ** 34, 1e13, None, "GPUs in 2 worker "
                           "processes", "2026-01-01", nodes=2)
    assert (two.num_nodes, two.devices_per_node, two.name) == (2, 2, "profiled-gpu/2x2")
    assert two.intra == two.inter and close(two.inter.latency, alpha, 1e-6)
    assert "not separated" in two.source("intra.latency")
    with pytest.raises(ValueError, match="split evenly"):
        profiled_cluster("p", fits, 1.0, 1.0, None, "x", "2026-01-01", nodes=3)

def test_search_refuses_a_bad_cluster_file_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    d = profiled().to_json()
    d["intra"]["latency"] = "slow"
    bad.write_text(json.dumps(d))
    proc = command.run_tapas("search", "--model=t5-tiny", f"--cluster={bad}")
    assert proc.returncode != 0
    assert f"--cluster={bad}" in proc.stderr and "field 'intra.latency' is 'slow'" in proc.stderr


def test_search_costs_with_the_clusters_profiled_coefficients(tmp_path):
    from tapas import search
    from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo, WeightInfo

    def dense(name, x, k, m):   # docs/search.md's two-layer MLP
        w = WeightInfo(f"{name}/kernel", (k, m), "float32", True, f"{name}/w")
        ops = (OpInfo(f"{name}/w", "Placeholder", (),
                      (TensorInfo(f"{name}/w:0", (), "resource"),)),
               OpInfo(f"{name}/r", "ReadVariableOp", (f"{name}/w:0",),
                      (TensorInfo(f"{name}/r:0", (k, m), "float32"),)),
               OpInfo(f"{name}/mm", "MatMul", (x.name, f"{name}/r:0"),
                      (TensorInfo(f"{name}/mm:0", (8, m), "float32"),)))
        return GraphNode(0, name, Kind.DENSE, ops, (x,), (ops[2].outputs[0],), (w,))

    x = TensorInfo("x:0", (8, 16), "float32")
    xin = GraphNode(0, "x", Kind.INPUT, (OpInfo("x", "Placeholder", (), (x,)),), (), (x,), ())
    up = dense("up", x, 16, 64)
    down = dense("down", up.outputs[0], 64, 16)
    graph = Graph.build([xin, up, down], inputs=[x], outputs=[down.outputs[0]], name="mlp")
    path = str(tmp_path / "c.json")
    no_latency = Link(bandwidth=8e8, latency=0.0, name="profiled")   # transmission only
    profiled(intra=no_latency, inter=no_latency, gamma=1.0,
             epsilon={"AR": 3.0, "AG": 3.0, "RS": 3.0, "A2A": 3.0}).save(path)
    cluster = Cluster.load(path)
    default = search(graph, cluster=cluster, mode="es")
    explicit = search(graph, cluster=cluster, mode="es",
                      options=CostOptions.for_cluster(cluster))
    priors = search(graph, cluster=cluster, mode="es", options=CostOptions())
    assert default.cost == explicit.cost and default.cluster.epsilon == cluster.epsilon
    # the ffn-only reference (column then row split): an all-reduce forward, T with the
    # priors, 3 T profiled (epsilon 3); the backward one, on the gradient of the model's
    # input x, never runs (CostOptions.gradient_flow): 3 x; priced as the patterns name it
    # (gradient_flow=False), 0.5 T with the priors and 3 T profiled (gamma 1): 4 x
    ffn = {r.name: r for r in default.references}["ffn-only"]
    prior_ffn = {r.name: r for r in priors.references}["ffn-only"]
    assert prior_ffn.communication > 0
    assert math.isclose(ffn.communication, 3 * prior_ffn.communication, rel_tol=1e-9)
    def ffn_only(options):
        s = search(graph, cluster=cluster, mode="es", options=options)
        return {r.name: r for r in s.references}["ffn-only"].communication

    every = ffn_only(CostOptions.for_cluster(cluster, gradient_flow=False))
    prior_every = ffn_only(CostOptions(gradient_flow=False))
    assert math.isclose(every, 4 * prior_every, rel_tol=1e-9)


def synthetic_profile():
    from tapas.execution.calibration.fitting import GammaFit, Profile
    eps = {"AR": 1.0, "AG": 0.7, "RS": 2.0, "A2A": 3.0}
    fits = fit_collectives(synthetic_rows(4, 1.5e-4, 1.2e-9, eps), 4)
    trial = {"empty": 1.0, "comm": 11.0, "compute": 21.0, "both": 26.0, "bytes": 2 ** 20,
             "visible_fraction": 0.5}
    gamma = GammaFit((trial,), 0.5, False)
    cluster = profiled_cluster("profiled-cpu", fits, 2 ** 34, 1.5e10, gamma, "logical CPU "
                               "devices", "2026-01-01")
    compute = {"matmul": {"n": 1024, "flop_per_s_per_device": 1.5e10,
                          "flop_per_s_one_device_alone": 6e10}}
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    return Profile(cluster, fits, [], compute, gamma, devices, 1.0, "2026-01-01")


def test_profile_table_plot_and_missing_matplotlib(tmp_path, monkeypatch):
    p = synthetic_profile()
    table = p.table()
    assert "fitted over W = 4 devices" in table and "gamma = 0.500" in table
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert name in table
    assert "epsilon AR 1.00, AG 0.70, RS 2.00, A2A 3.00" in table
    png = tmp_path / "r.png"
    assert p.plot(str(png)) is None and png.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib fails
    other = tmp_path / "s.png"
    assert "matplotlib is not installed" in p.plot(str(other)) and not other.exists()
    path = str(tmp_path / "c.json")
    p.save(path)
    assert Cluster.load(path) == p.cluster and Cluster.load(path).gamma == 0.5
    assert json.loads(open(path).read())["profile"]["fits"]["RS"]["epsilon_vs_all_reduce"] \
        == pytest.approx(2.0)


def test_search_prices_memory_bound_ops_at_the_profiled_rate(tmp_path):
    """A dense layer followed by 12 tanh activations (one GraphNode), 2 devices, a link slow
    enough that under the paper's pricing (every op's FLOPs at the matmul rate) splitting
    the node saves less compute than its all-reduce costs: the search replicates it. The
    same cluster file with a measured elementwise rate (a tanh element 200 x a matmul FLOP)
    makes the activations' work worth splitting, and with ``memory_bound=False`` the
    search is the paper's again. (The layer reads the model's input, whose gradient is never
    computed: a column split's backward all-reduce of it is priced here,
    ``gradient_flow=False``, so that splitting has a collective to pay for.)"""
    import keras
    import tensorflow as tf

    from tapas import capture, search
    x = keras.Input((64,), batch_size=8)
    h = keras.layers.Dense(64, name="up")(x)
    for i in range(12):
        h = keras.layers.Activation("tanh", name=f"act{i}")(h)
    graph = capture(keras.Model(x, h), [tf.TensorSpec((8, 64), tf.float32)])
    (node,) = [n for n in graph.nodes if any(op.type == "MatMul" for op in n.ops)]
    assert sum(op.type == "Tanh" for op in node.ops) == 12
    slow = Link(bandwidth=8e7, latency=0.0, name="profiled")
    base = profiled(intra=slow, inter=slow, gamma=1.0, device_elementwise_rate=None,
                    device_peak_flops=1.8e10, device_width_efficiency=None).with_shape(1, 2)
    paper_path, mb_path = str(tmp_path / "paper.json"), str(tmp_path / "mb.json")
    base.save(paper_path)
    dataclasses.replace(base, device_elementwise_rate=9e7).save(mb_path)
    mb = Cluster.load(mb_path)

    paper_cluster = Cluster.load(paper_path)
    paper = search(graph, cluster=paper_cluster, mode="es",
                   options=CostOptions.for_cluster(paper_cluster, gradient_flow=False))
    priced = search(graph, cluster=mb, mode="es",
                    options=CostOptions.for_cluster(mb, gradient_flow=False))
    off = search(graph, cluster=mb, mode="es",
                 options=CostOptions.for_cluster(mb, memory_bound=False, gradient_flow=False))
    assert paper.patterns[node.id] == "replicate", paper.patterns
    assert priced.patterns[node.id] != "replicate", priced.patterns
    assert off.patterns == paper.patterns and off.cost["total"] == paper.cost["total"]
    # the priced plan's compute: the matmul at the peak rate, 12 tanh + the bias add at the
    # elementwise rate, each halved by the split, times 3 (forward and backward)
    half = (2 * 8 * 64 * 64 / 1.8e10 + 13 * 8 * 64 / 9e7) / 2 * 3
    assert priced.cost["compute"] == pytest.approx(half, rel=1e-6)
