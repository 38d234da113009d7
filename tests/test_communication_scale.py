"""A model's collectives measured inside its own training step (``CostOptions.
communication_scale``, the row ``+CS``): the option's pricing (every collective's latency
and transmission times the factor), the factor from paired step times
(tapas.execution.calibration.communication_scale.scale_from_pairs), the measurement itself on a zoo
model's data-parallel plan on 2 logical CPU devices (in a subprocess: devices are set once
per process), and ``tapas search --communication_scale``."""

from __future__ import annotations

import doctest
import json
import math
import os
import subprocess
import sys

import pytest

import tapas
from tapas import models
from tapas.execution.calibration import communication_scale as cs
from tapas.planning import cost, explore
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.table import EdgeCoster, pattern_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPYC = os.path.join(ROOT, "benchmarks", "results", "cluster_cpu4_2026-11-26_epyc.json")


@pytest.mark.parametrize("bad", [0, -0.5, math.nan, math.inf, True, "0.5"])
def test_the_factor_must_be_a_positive_number(bad) -> None:
    with pytest.raises((ValueError, TypeError), match="communication_scale"):
        CostOptions(communication_scale=bad)


def test_the_factor_scales_every_collectives_latency_and_transmission() -> None:
    c = Cluster.loopback_cpu(4)
    one = cost.collective_cost("AR", 1 << 20, c.axis(4), CostOptions.for_cluster(c))
    half = cost.collective_cost("AR", 1 << 20, c.axis(4),
                                CostOptions.for_cluster(c, communication_scale=0.5))
    assert one.latency > 0 and one.transmission > 0
    assert half.latency == pytest.approx(0.5 * one.latency)
    assert half.transmission == pytest.approx(0.5 * one.transmission)
    # a group of one device runs no collective, whatever the factor
    assert cost.collective_time("AR", 1 << 20, c.axis(1),
                                CostOptions(communication_scale=3.0)) == 0.0


def test_a_plans_communication_scales_and_its_compute_does_not() -> None:
    """Whole plans: every pattern's collectives, every resharded edge and the loss's
    collectives move by the factor; compute is untouched; the data-parallel reference's
    patterns split the batch."""
    entry = models.get("t5-tiny")
    graph = tapas.capture(entry.build(fast_init=True), entry.input_spec(8))
    c = Cluster.load(EPYC)
    pats = cs.data_parallel_patterns(graph, c, loss=entry.keras_loss())
    assert len(pats) == len(graph.nodes) and "batch" in pats
    totals = []
    for s in (1.0, 0.25):
        opts = CostOptions.for_cluster(c, loss=entry.keras_loss(), communication_scale=s)
        table = pattern_table(graph, 4, c, opts)
        idx = [table.index(v, p) for v, p in enumerate(pats)]
        totals.append(explore.plan_cost(graph, table, idx, EdgeCoster(4, c, opts))[0])
    assert totals[0].communication > 0
    assert totals[1].communication == pytest.approx(0.25 * totals[0].communication)
    assert totals[1].compute == pytest.approx(totals[0].compute)
    predicted, count = cs.predicted_communication(
        graph, pats, c, CostOptions.for_cluster(c, loss=entry.keras_loss(),
                                                communication_scale=0.25))
    # the calibration prices the plan at the profiled constants, whatever the options' factor
    assert predicted == pytest.approx(totals[0].communication)
    assert count == len(totals[0].comms)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, True, "0.5"])
def test_the_activation_factor_must_be_a_positive_number_or_none(bad) -> None:
    with pytest.raises((ValueError, TypeError), match="activation_communication_scale"):
        CostOptions(activation_communication_scale=bad)
    opts = CostOptions(communication_scale=0.5)
    assert opts.communication_scale_for(True) == opts.communication_scale_for(False) == 0.5
    opts = CostOptions(communication_scale=0.5, activation_communication_scale=0.8)
    assert opts.communication_scale_for(True) == 0.5
    assert opts.communication_scale_for(False) == 0.8


def test_weight_gradients_and_activations_get_their_own_factor() -> None:
    """The data-parallel plan's collectives on its weights' gradients take
    ``communication_scale``; the loss's and resharded edges' take the activation factor;
    a Megatron plan's activation all-reduces too; compute is untouched."""
    entry = models.get("t5-tiny")
    graph = tapas.capture(entry.build(fast_init=True), entry.input_spec(8))
    c = Cluster.load(EPYC)
    loss = entry.keras_loss()
    dp = cs.data_parallel_patterns(graph, c, loss=loss)
    (g, a), count = cs.predicted_parts(graph, dp, c, CostOptions.for_cluster(c, loss=loss))
    assert g > 0 and a >= 0 and g > a and count > 0
    assert cs.predicted_communication(graph, dp, c, CostOptions.for_cluster(c, loss=loss)) \
        == (pytest.approx(g + a), count)
    name, megatron, (g2, a2) = cs.activation_plan(graph, c, CostOptions.for_cluster(
        c, loss=loss), loss)
    assert a2 > 0 and a2 >= g2 and megatron != dp and name
    for pats, (pg, pa) in ((dp, (g, a)), (megatron, (g2, a2))):
        base = CostOptions.for_cluster(c, loss=loss)
        split = CostOptions.for_cluster(c, loss=loss, communication_scale=0.5,
                                        activation_communication_scale=0.25)
        costs = []
        for opts in (base, split):
            table = pattern_table(graph, 4, c, opts)
            idx = [table.index(v, p) for v, p in enumerate(pats)]
            costs.append(explore.plan_cost(graph, table, idx, EdgeCoster(4, c, opts))[0])
        assert costs[0].comms.by_role()["gradient"] == pytest.approx(pg)
        assert costs[1].comms.by_role()["gradient"] == pytest.approx(0.5 * pg)
        assert costs[1].comms.by_role()["activation"] == pytest.approx(0.25 * pa)
        assert costs[1].compute == pytest.approx(costs[0].compute)
    # a weight's backward collective is a gradient's; the same on an activation is not
    term = cost.comm_cost(_Comm("AR", 1 << 20, "bwd", "w:0"), c.axis(4),
                          CostOptions(communication_scale=0.5,
                                      activation_communication_scale=2.0), weights={"w:0"})
    other = cost.comm_cost(_Comm("AR", 1 << 20, "bwd", "x:0"), c.axis(4),
                           CostOptions(communication_scale=0.5,
                                       activation_communication_scale=2.0), weights={"w:0"})
    assert term.gradient and not other.gradient
    assert other.total == pytest.approx(4 * term.total)


class _Comm:
    def __init__(self, kind: str, nbytes: int, phase: str, tensor: str) -> None:
        self.kind, self.bytes, self.phase, self.tensor = kind, nbytes, phase, tensor


def test_two_plans_give_a_factor_each() -> None:
    """The data-parallel plan (mostly gradients) and a second plan (mostly activations),
    each difference = gradient factor x gradient price + activation factor x activation
    price: both factors recovered; a second difference within the noise, mixes too alike
    to tell apart, or an unmeasured first factor leave one factor for every collective."""
    assert cs.solve_factors((0.010, 0.0), 0.004, (0.0, 0.010), 0.007) == \
        (pytest.approx(0.4), pytest.approx(0.7))
    assert cs.solve_factors((0.010, 0.010), 0.010, (0.010, 0.011), 0.010) is None  # alike
    assert cs.solve_factors((0.010, 0.001), 0.001, (0.001, 0.010), 0.010) is None  # g < 0
    first = cs.scale_from_pairs(4, [0.030] * 6, [0.025] * 6, 0.010, 20, parts=(0.010, 0.0))
    assert first.predicted_parts_s == (0.010, 0.0) and first.activation is None
    assert first.activation_communication_scale is None
    both = cs.with_activation(first, "megatron", ("column",), (0.0, 0.010),
                              [0.040] * 6, [0.032] * 6)
    assert both.communication_scale == pytest.approx(0.5)
    assert both.activation_communication_scale == pytest.approx(0.8)
    assert both.activation.plan == "megatron" and both.activation.patterns == ("column",)
    assert "activation communication scale 0.80" in both.describe()
    opts = both.cost_options(CostOptions())
    assert opts.communication_scale == pytest.approx(0.5)
    assert opts.activation_communication_scale == pytest.approx(0.8)
    d = json.loads(json.dumps(both.to_json()))
    assert d["activation_communication_scale"] == pytest.approx(0.8)
    assert d["activation"]["predicted_parts_s"] == [0.0, 0.010]
    noisy = cs.with_activation(first, "megatron", (), (0.0, 0.010),
                               [0.05, 0.03, 0.06, 0.02], [0.04] * 4)
    assert noisy.activation_communication_scale is None
    assert noisy.communication_scale == pytest.approx(0.5)
    assert "within the noise" in noisy.activation.reason
    assert "one factor for every collective" in noisy.describe()
    alike = cs.with_activation(first, "#2", (), (0.010, 0.0005), [0.040] * 4, [0.032] * 4)
    assert alike.activation_communication_scale is None and "too alike" in \
        alike.activation.reason
    unmeasured = cs.scale_from_pairs(4, [0.03, 0.02], [0.02, 0.03], 0.01, 5)
    later = cs.with_activation(unmeasured, "#2", (), (0.0, 0.01), [0.04] * 4, [0.03] * 4)
    assert later.activation_communication_scale is None and later.communication_scale == 1.0
    assert "was not measured" in later.activation.reason
    # the second plan is described even when the first gave no factor
    assert "kept at the profiled" in later.describe() and "second plan (#2" in later.describe()


def test_the_factor_from_paired_steps() -> None:
    full = [0.050, 0.052, 0.049, 0.051, 0.050, 0.053]
    local = [0.030, 0.031, 0.030, 0.030, 0.031, 0.031]
    c = cs.scale_from_pairs(4, full, local, 0.040, 30, patterns=("batch",))
    assert c.pairs == 6 and c.collectives == 30 and c.patterns == ("batch",)
    assert c.difference_s == pytest.approx(0.0205)
    assert c.scale == pytest.approx(0.0205 / 0.040) == c.communication_scale
    assert "communication scale 0.51" in c.describe()
    assert json.loads(json.dumps(c.to_json()))["communication_scale"] == pytest.approx(c.scale)
    # a difference within the noise, or a plan without collectives: the constants as profiled
    noisy = cs.scale_from_pairs(4, [0.05, 0.03, 0.06, 0.02], [0.04, 0.04, 0.04, 0.04], 0.01, 5)
    assert noisy.scale is None and noisy.communication_scale == 1.0
    assert "within the noise" in noisy.reason and "kept at the profiled" in noisy.describe()
    none = cs.scale_from_pairs(4, full, local, 0.0, 0)
    assert none.scale is None and "prices no collective" in none.reason
    with pytest.raises(ValueError, match="timed in pairs"):
        cs.scale_from_pairs(4, full, local[:-1], 0.04, 30)
    assert doctest.testmod(cs).failed == 0


def test_the_flag_value_is_a_factor_or_measure() -> None:
    assert cs.check_communication_scale("0.6", EPYC) == 0.6
    assert cs.check_communication_scale("measure", EPYC) is None
    with pytest.raises(ValueError, match="is not a number"):
        cs.check_communication_scale("fast", EPYC)
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        cs.check_communication_scale("-1", EPYC)
    with pytest.raises(ValueError, match="is a preset, not this machine"):
        cs.check_communication_scale("measure", "v100")
    calls = []
    scale, cal = cs.resolve_communication_scale(
        "measure", EPYC, lambda: calls.append(1) or cs.scale_from_pairs(
            4, [0.05, 0.05], [0.03, 0.03], 0.04, 10))
    assert calls == [1] and scale == pytest.approx(0.5) and cal.scale == pytest.approx(0.5)


_MEASURE = r"""
import json
from tapas.execution.runtime import devices
devices.setup_devices(2, "cpu")
import tapas
from tapas import models
from tapas.planning.cluster import Cluster
from tapas.execution.calibration.communication_scale import calibrate_communication
entry = models.get("resnet-tiny")
model = entry.build(seed=0)
cal = calibrate_communication(model, entry.input_spec(16), cluster=Cluster.loopback_cpu(2),
                              devices=2, loss=entry.keras_loss(), training=False, steps=3,
                              repeats=2, progress=print)
print(cal.describe())
try:
    calibrate_communication(model, entry.input_spec(16), cluster=Cluster.loopback_cpu(4),
                            devices=2, loss=entry.keras_loss(), training=False)
except ValueError as e:
    print("REFUSED", e)
print("RESULT " + json.dumps(cal.to_json()))
"""


def test_calibrate_communication_on_two_logical_devices() -> None:
    """The data-parallel plan of a zoo model built twice (as it runs, and without its
    collectives), timed in pairs: the factor is the step's difference over the price of the
    plan's collectives, and the plan is the search's data-parallel reference."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    d = json.loads(line[len("RESULT "):])
    assert d["num_devices"] == 2 and d["plan"] == "data-parallel" and d["pairs"] == 6
    assert d["collectives"] > 10 and d["predicted_s"] > 0
    assert "batch" in d["patterns"] and min(d["measured_s"]) > 0
    assert sum(d["predicted_parts_s"]) == pytest.approx(d["predicted_s"])
    second = d["activation"]
    if d["scale"] is None:
        assert d["reason"] and d["communication_scale"] == 1.0
    elif second is None or second["scale"] is None:
        assert d["scale"] == pytest.approx(d["difference_s"] / d["predicted_s"])
        assert d["difference_s"] > 2 * d["difference_se_s"]
    else:   # both factors price both plans' collectives at what was measured
        for parts, diff in ((d["predicted_parts_s"], d["difference_s"]),
                            (second["predicted_parts_s"], second["difference_s"])):
            assert d["scale"] * parts[0] + second["scale"] * parts[1] == pytest.approx(diff)
    if second is not None:   # the second plan: mostly activation collectives, timed alike
        assert second["predicted_parts_s"][1] >= second["predicted_parts_s"][0]
        assert second["patterns"] != d["patterns"] and min(second["measured_s"]) > 0
        assert f"building the {second['plan']} plan on 2 devices without its collectives" \
            in proc.stdout
        assert "timing 6 rounds of 4 steps" in proc.stdout
    assert "building the data-parallel plan on 2 devices without its collectives" in proc.stdout
    assert "REFUSED the strategy has 2 devices and the cluster 4" in proc.stdout


def test_search_command_takes_a_communication_scale(tmp_path) -> None:
    """``tapas search --communication_scale=F`` prices collectives at F times the profiled
    constants (the report says it); a preset cluster, a bad value and --mesh are refused
    before anything is measured. 'measure' (timing the model's data-parallel plan on the
    cluster file's devices first) runs under TAPAS_FULL_MATRIX=1: ``tapas train``'s test
    below measures through the same calibration."""
    import command  # tests/command.py
    import matrix  # tests/matrix.py
    refusals = ((["--cluster=v100", "--communication_scale=measure"],
                 "is a preset, not this machine"),
                ([f"--cluster={EPYC}", "--communication_scale=fast"], "is not a number"),
                ([f"--cluster={EPYC}", "--communication_scale=0"], "must be a finite number"),
                (["--mesh=2x2", "--communication_scale=measure"],
                 "with --meshes/--mesh is not supported"))
    plain_json, cheap_json = tmp_path / "plain.json", tmp_path / "cheap.json"
    base = ["search", "--model=t5-tiny", "--batch_size=8", f"--cluster={EPYC}"]
    plain, cheap, *bad = command.run_tapas_each(
        [*base, f"--json_out={plain_json}"],
        [*base, f"--json_out={cheap_json}", "--communication_scale=0.01"],
        *(["search", "--model=t5-tiny", *f] for f, _ in refusals))
    for (flags, words), proc in zip(refusals, bad):
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, (flags, proc.stdout)
        assert "measuring the model's" not in proc.stdout
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert cheap.returncode == 0, cheap.stdout[-3000:] + cheap.stderr[-3000:]
    before = json.loads(plain_json.read_text())
    assert before["communication_scale"] == 1.0 and before["communication_calibration"] is None
    after = json.loads(cheap_json.read_text())
    assert after["communication_scale"] == 0.01
    # collectives at a hundredth of their price: the best plan costs no more than before
    assert after["strategy"]["cost"]["total"] <= before["strategy"]["cost"]["total"]
    if matrix.full():
        report = tmp_path / "r.json"
        measured = command.run_tapas(*base, f"--json_out={report}",
                                     "--communication_scale=measure", timeout=400)
        assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
        assert "measuring the model's communication scale on 4 devices" in measured.stdout
        r = json.loads(report.read_text())
        cal = r["communication_calibration"]
        assert cal["plan"] == "data-parallel" and cal["pairs"] == 10
        assert cal["num_devices"] == 4
        assert r["communication_scale"] == cal["communication_scale"]
        assert r["activation_communication_scale"] == cal["activation_communication_scale"]



def test_train_command_takes_a_communication_scale(tmp_path) -> None:
    """``tapas train --communication_scale=measure`` measures the factor on the run's
    devices before its search and reports it; --strategy (no search), --mesh, and 'measure'
    across worker processes (which cannot run the plan without its collectives) are refused
    before any work."""
    import command  # tests/command.py
    report = tmp_path / "r.json"
    refusals = ((["--devices=2", "--strategy=random:0", "--communication_scale=0.5"],
                 "--strategy=random:0 skips it"),
                (["--devices=4", "--mesh=2x2", "--communication_scale=0.5"],
                 "with --mesh=2x2 is not supported"),
                (["--workers=2", f"--cluster={EPYC}", "--communication_scale=measure"],
                 "which worker processes cannot"),
                (["--devices=4", "--communication_scale=measure"],
                 "is a preset, not this machine"))
    # one process: the refused lines stop before any device is made
    ok, *bad = command.run_tapas_each(
        ["train", "--model=t5-tiny", "--devices=4", "--steps=1", "--batch_size=8",
         f"--cluster={EPYC}", "--communication_scale=measure", f"--json_out={report}"],
        *(["train", "--model=t5-tiny", "--steps=1", *f] for f, _ in refusals), timeout=400)
    for (flags, words), proc in zip(refusals, bad):
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, (flags, proc.stdout)
        assert "measuring the model's" not in proc.stdout and "launching" not in proc.stdout
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "measuring the model's communication scale on 4 devices" in ok.stdout
    r = json.loads(report.read_text())
    assert r["communication_calibration"]["plan"] == "data-parallel"
    assert r["communication_scale"] == r["communication_calibration"]["communication_scale"]
