"""tapas.execution.calibration.compute_scale: one model's compute measured against the cost model's price
(``CostOptions.compute_scale``), the decision from paired timings (synthetic numbers), the
measurement itself on 2 logical CPU devices (in a subprocess: devices are set once per
process) and ``tapas search --compute_scale``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import command  # tests/command.py
import pytest

from tapas.execution.calibration.compute_scale import ComputeCalibration, scale_from_pairs
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.search import search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scale_is_the_median_pair_difference_over_the_predicted_difference() -> None:
    big = [0.100, 0.104, 0.098, 0.101, 0.103]
    small = [0.040, 0.041, 0.039, 0.040, 0.042]
    cal = scale_from_pairs(4, (64, 16), big, small, (0.020, 0.005))
    assert cal.difference_s == pytest.approx(0.061)
    assert cal.scale == pytest.approx(0.061 / 0.015)
    assert cal.compute_scale == cal.scale and cal.reason == ""
    assert cal.measured_s == (pytest.approx(0.101), pytest.approx(0.040))
    assert cal.pairs == 5 and cal.difference_se_s > 0
    assert "compute scale 4.07" in cal.describe()
    assert json.loads(json.dumps(cal.to_json()))["compute_scale"] == pytest.approx(cal.scale)


def test_elementwise_scale_is_what_the_difference_leaves_over_the_rest_per_memory_bound_second(
) -> None:
    """With the memory-bound ops' part of each price known, the measured difference less
    the rest's priced difference, over the memory-bound ops' priced difference; 1.0 where
    it cannot be told (no part priced, no scale, nothing left to explain)."""
    big = [0.100, 0.104, 0.098, 0.101, 0.103]
    small = [0.040, 0.041, 0.039, 0.040, 0.042]
    cal = scale_from_pairs(4, (64, 16), big, small, (0.020, 0.005), (0.008, 0.002))
    # rest: 0.012 - 0.003 = 0.009 of the 0.061 measured; memory-bound ops: 0.006 priced
    assert cal.elementwise_scale == pytest.approx((0.061 - 0.009) / 0.006)
    assert cal.compute_scale == pytest.approx(0.061 / 0.015)     # unchanged by the parts
    assert "memory-bound ops' scale 8.67" in cal.describe()
    assert json.loads(json.dumps(cal.to_json()))["elementwise_scale"] == pytest.approx(
        cal.elementwise_scale)
    assert scale_from_pairs(4, (64, 16), big, small, (0.020, 0.005)).elementwise_scale == 1.0
    # the contractions alone price more than the measured difference: nothing left
    assert scale_from_pairs(4, (64, 16), big, small, (0.090, 0.010),
                            (0.002, 0.001)).elementwise_scale == 1.0
    noisy = scale_from_pairs(2, (8, 4), [0.010, 0.030, 0.011, 0.029],
                             [0.020, 0.012, 0.021, 0.013], (0.002, 0.001), (0.001, 0.0005))
    assert noisy.scale is None and noisy.elementwise_scale == 1.0


def test_memory_bound_compute_is_the_elementwise_part_of_the_replicated_price() -> None:
    """``memory_bound_compute``: the part of ``predicted_replicated_compute`` that
    ``elementwise_scale`` multiplies (None without a rate or with memory_bound off); the
    replicated price itself ignores the options' factors."""
    import dataclasses

    from tapas import capturing, models
    from tapas.execution.calibration.compute_scale import (memory_bound_compute,
                                                           predicted_replicated_compute,
                                                           replicated_compute_parts)
    entry = models.get("t5-tiny")
    graph = capturing.capture(entry.build(fast_init=True), entry.input_spec(8),
                              training=False)
    cluster = dataclasses.replace(Cluster.loopback_cpu(4), device_elementwise_rate=1e9)
    options = CostOptions.for_cluster(cluster)
    part = memory_bound_compute(graph, 4, cluster, options)
    whole = predicted_replicated_compute(graph, 4, cluster, options)
    assert 0 < part < whole
    tripled = dataclasses.replace(options, elementwise_scale=3.0, compute_scale=5.0)
    assert predicted_replicated_compute(graph, 4, cluster, tripled) == pytest.approx(whole)
    from tapas.planning.table import pattern_table
    table = pattern_table(graph, 4, cluster, tripled)
    priced = sum(table.infos[n.id][table.index(n.id, "replicate")].compute_time
                 for n in graph.nodes)
    assert priced == pytest.approx(5.0 * (whole + 2 * part))
    assert replicated_compute_parts(graph, 4, cluster, options) == (
        pytest.approx(whole), pytest.approx(part))
    assert memory_bound_compute(graph, 4, Cluster.loopback_cpu(4)) is None
    assert memory_bound_compute(graph, 4, cluster,
                                CostOptions.for_cluster(cluster, memory_bound=False)) is None


def test_no_scale_when_the_difference_is_noise_or_not_priced() -> None:
    """A difference under 2 standard errors, or a prediction that does not change with the
    batch, gives no scale: the search keeps the profiled rates (1.0) and says why."""
    noisy = scale_from_pairs(2, (8, 4), [0.010, 0.030, 0.011, 0.029], [0.020, 0.012, 0.021,
                                                                        0.013],
                             (0.002, 0.001))
    assert noisy.scale is None and noisy.compute_scale == 1.0
    assert "within the noise" in noisy.reason and "scale 1.0" in noisy.describe()
    flat = scale_from_pairs(2, (8, 4), [0.02, 0.02], [0.01, 0.01], (0.001, 0.001))
    assert flat.scale is None and "prices the two batch sizes alike" in flat.reason
    with pytest.raises(ValueError, match="timed in pairs"):
        scale_from_pairs(2, (8, 4), [0.02], [0.01, 0.01], (0.002, 0.001))


def test_a_larger_compute_scale_never_picks_a_plan_that_computes_more() -> None:
    """The search minimises communication + scale x compute: as the scale grows, the chosen
    plan's compute can only fall (and its communication rise)."""
    from tapas import capturing, models
    entry = models.get("t5-tiny")
    graph = capturing.capture(entry.build(fast_init=True), entry.input_spec(16),
                              training=False)
    cluster = Cluster.loopback_cpu(4)
    picks = []
    for scale in (0.01, 1.0, 100.0):
        s = search(graph, cluster=cluster,
                   options=CostOptions.for_cluster(cluster, compute_scale=scale))
        # the pick's compute at the profiled rates (the cost's is scaled) and communication
        picks.append((s.cost["compute"] / scale, s.cost["communication"]))
    rel = 1 + 1e-9    # the same plan's compute, summed in another order
    assert picks[0][0] * rel >= picks[1][0] and picks[1][0] * rel >= picks[2][0]
    assert picks[0][1] <= picks[1][1] * rel and picks[1][1] <= picks[2][1] * rel
    assert picks[0][0] > 1.1 * picks[2][0]     # the factor moves the pick on this model


_MEASURE = r"""
import json, sys
from tapas.execution.runtime import devices
strategy = devices.make_strategy(2)
import keras
import tensorflow as tf
from tapas.execution.calibration.compute_scale import calibrate_compute, predicted_replicated_compute
from tapas.planning.cluster import Cluster
keras.utils.set_random_seed(0)
x = keras.Input((64,), name="features")
h = keras.layers.Dense(256, activation="relu")(x)
h = keras.layers.Dense(256, activation="relu")(h)
model = keras.Model(x, keras.layers.Dense(8)(h))
cluster = Cluster.loopback_cpu(2)
out = {}
cal = calibrate_compute(model, tf.TensorSpec([64, 64], tf.float32), cluster=cluster,
                        distribute_strategy=strategy, loss=keras.losses.MeanSquaredError(),
                        steps=3, repeats=2, progress=lambda m: print(m, flush=True))
out["cal"] = cal.to_json()
from tapas import capturing
g = capturing.capture(model, tf.TensorSpec([32, 64], tf.float32), training=False)
out["small"] = predicted_replicated_compute(g, 2, cluster)
for spec, kw in ((tf.TensorSpec([63, 64], tf.float32), {}),
                 (tf.TensorSpec([64, 64], tf.float32), {"steps": 0})):
    try:
        calibrate_compute(model, spec, cluster=cluster, distribute_strategy=strategy, **kw)
    except ValueError as e:
        out.setdefault("errors", []).append(str(e))
print("RESULT " + json.dumps(out))
"""


def test_calibrate_compute_times_the_replicated_step_at_two_batches() -> None:
    proc = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building the replicated program at batch 32 on 2 devices" in proc.stdout
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    cal = out["cal"]
    assert cal["num_devices"] == 2 and cal["batches"] == [64, 32] and cal["pairs"] == 6
    assert all(t > 0 for t in cal["measured_s"])
    # the preset prices FLOPs linearly in the batch: half the batch, half the compute
    assert cal["predicted_s"][0] == pytest.approx(2 * cal["predicted_s"][1])
    assert cal["predicted_s"][1] == pytest.approx(out["small"])
    if cal["scale"] is None:
        assert cal["compute_scale"] == 1.0 and cal["reason"]
    else:
        assert cal["compute_scale"] == pytest.approx(
            cal["difference_s"] / (cal["predicted_s"][0] - cal["predicted_s"][1]))
    bad_batch, bad_steps = out["errors"]
    assert "'features'" in bad_batch and "does not split into 2" in bad_batch
    assert "steps=0" in bad_steps and "must be an int >= 1" in bad_steps


def test_search_command_takes_a_compute_scale(tmp_path) -> None:
    """``tapas search --compute_scale``: a factor, or 'measure' (times the model on this
    machine's devices: only against a cluster file profiled here, not a preset; the
    measured run is test_search_command_takes_an_elementwise_scale's, which measures both).
    The given factor and the refusals run in one process (command.run_tapas_each)."""
    report = tmp_path / "r.json"
    cluster = os.path.join(ROOT, "benchmarks", "results", "cluster_cpu4_2026-11-26_epyc.json")
    refusals = (
        ((f"--cluster={cluster}", "--compute_scale=0"),
         "compute_scale=0.0: must be a finite number > 0"),
        ((f"--cluster={cluster}", "--compute_scale=fast"), "--compute_scale=fast"),
        (("--mesh=2x2", "--compute_scale=2"), "with --meshes/--mesh is not supported"),
        (("--cluster=v100", "--compute_scale=measure"), "is a preset, not this machine"))
    given, *bad = command.run_tapas_each(
        ["search", "--model=t5-tiny", f"--cluster={cluster}", "--compute_scale=2.5",
         f"--json_out={report}"], *(["search", "--model=t5-tiny", *a] for a, _ in refusals))
    assert given.returncode == 0, given.stdout[-3000:] + given.stderr[-3000:]
    assert "measuring" not in given.stdout
    assert json.loads(report.read_text())["compute_scale"] == 2.5
    for (args, words), proc in zip(refusals, bad):
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, args


def test_search_command_takes_an_elementwise_scale(tmp_path) -> None:
    """``tapas search --elementwise_scale``: a factor, or 'measure' (one calibration serves
    it and --compute_scale=measure, priced against the measured kernels when
    --kernel_times is given); refused with a mesh, a preset cluster, a bad value and by
    ``tapas train``."""
    report = tmp_path / "r.json"
    cluster = os.path.join(ROOT, "benchmarks", "results", "cluster_cpu4_2026-11-26_epyc.json")
    refusals = (([f"--cluster={cluster}", "--elementwise_scale=0"],
                 "elementwise_scale=0.0: must be a finite number > 0"),
                ([f"--cluster={cluster}", "--elementwise_scale=fast"],
                 "--elementwise_scale=fast"),
                (["--mesh=2x2", "--elementwise_scale=2"],
                 "with --meshes/--mesh is not supported"),
                (["--cluster=v100", "--elementwise_scale=measure"],
                 "is a preset, not this machine"))
    given_json = tmp_path / "given.json"
    # one process: the measured search on 4 devices, the others stop before any device
    ok, given, *bad, train = command.run_tapas_each(
        ["search", "--model=t5-tiny", "--batch_size=8", f"--cluster={cluster}",
         "--elementwise_scale=measure", "--compute_scale=measure", "--kernel_times=measure",
         f"--out={tmp_path / 's.json'}", f"--json_out={report}"],
        ["search", "--model=t5-tiny", f"--cluster={cluster}", "--elementwise_scale=3",
         f"--json_out={given_json}"],
        *(["search", "--model=t5-tiny", *args] for args, _ in refusals),
        ["train", "--model=t5-tiny", "--devices=2", "--steps=1", "--elementwise_scale=2"],
        timeout=500)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert ok.stdout.count("measuring the model's compute scale on 4 devices") == 1
    assert "(--compute_scale=measure and --elementwise_scale=measure)" in ok.stdout
    r = json.loads(report.read_text())
    cal = r["compute_calibration"]
    assert cal["memory_bound_s"][0] > cal["memory_bound_s"][1] > 0
    assert r["elementwise_scale"] == cal["elementwise_scale"] > 0
    assert cal["num_devices"] == 4 and r["compute_scale"] == cal["compute_scale"] > 0
    assert r["kernel_times"] is not None
    for (args, words), proc in zip(refusals, bad):
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, args
    assert train.returncode != 0
    assert "prices `tapas search` only" in train.stdout + train.stderr
    assert given.returncode == 0, given.stdout[-3000:] + given.stderr[-3000:]
    assert "measuring" not in given.stdout
    assert json.loads(given_json.read_text())["elementwise_scale"] == 3.0


def test_compute_calibration_is_a_frozen_record() -> None:
    cal = ComputeCalibration(2, (8, 4), (0.02, 0.01), (0.002, 0.001), 0.01, 0.001, 4, 10.0)
    with pytest.raises(AttributeError):
        cal.scale = 1.0  # type: ignore[misc]


def test_train_command_measures_the_factor_before_its_search(tmp_path) -> None:
    """``tapas train --compute_scale=measure``: the factor measured on the run's devices,
    the search priced with it, both in the report; with ``--strategy`` (no search) it is
    refused, as is a factor that is not a number."""
    report = tmp_path / "train.json"
    cluster = os.path.join(ROOT, "benchmarks", "results", "cluster_cpu4_2026-11-26_epyc.json")
    # one process: the refused lines stop before any device is made
    ok, refused, nan, early, both = command.run_tapas_each(
        ["train", "--model=t5-tiny", "--devices=4", "--steps=1", "--batch_size=8",
         f"--cluster={cluster}", "--compute_scale=measure", f"--json_out={report}"],
        ["train", "--model=t5-tiny", "--devices=2", "--steps=1", "--strategy=random:0",
         "--compute_scale=2"],
        ["train", "--model=t5-tiny", "--devices=2", "--steps=1", "--compute_scale=many"],
        ["train", "--model=t5-tiny", "--workers=2", "--steps=1", "--compute_scale=measure"],
        ["train", "--model=t5-tiny", "--workers=2", "--steps=1", "--strategy=random:0",
         "--compute_scale=2"], timeout=400)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "measuring the model's compute scale on 4 devices" in ok.stdout
    r = json.loads(report.read_text())
    assert r["compute_calibration"]["batches"][0] == 4 * r["compute_calibration"]["batches"][1]
    assert r["compute_scale"] == r["compute_calibration"]["compute_scale"] > 0
    assert refused.returncode != 0
    assert "--strategy=random:0 skips it" in refused.stdout + refused.stderr
    assert nan.returncode != 0 and "'many' is not a number" in nan.stdout + nan.stderr
    # across worker processes the value is checked before any worker is launched
    assert early.returncode != 0
    assert "is a preset, not this machine" in early.stdout + early.stderr
    assert "launching 2 workers" not in early.stdout
    assert both.returncode != 0 and "--strategy=random:0 skips it" in both.stdout + both.stderr
    assert "launching 2 workers" not in both.stdout


@pytest.mark.parametrize("steps, repeats", [(0, 2), (5, True), (2.5, 1)])
def test_both_calibrations_refuse_bad_pair_counts_before_anything_runs(steps, repeats) -> None:
    """``steps``/``repeats`` that are not ints >= 1 are named, with what they count, before
    a strategy is made or the model touched (``model=None`` is never read)."""
    from tapas.execution.calibration.communication_scale import calibrate_communication
    from tapas.execution.calibration.compute_scale import calibrate_compute
    for calibrate in (calibrate_compute, calibrate_communication):
        with pytest.raises(ValueError, match=r"each must be an int >= 1 \(timed pairs"):
            calibrate(None, cluster=None, steps=steps, repeats=repeats)
