"""Table 2 (cost model ranking against measured step times): the pure ranking metrics on
hand-made rankings, and scripts/table2_cost_model.py end to end on a tiny slice.

The script defines absl flags that tapas.cli also defines, so it runs in a subprocess.
"""

import json
import math
import pathlib
import statistics
import subprocess
import sys

import matrix  # tests/matrix.py
import pytest

from tapas.planning import ranking

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_measured_ties_count_for_the_model_and_predicted_ties_with_slower_plans_against_it(
) -> None:
    # plan 1 is fastest; plan 2 is within 5 % of it: both are measured-best
    medians = [10.0, 5.0, 5.2, 8.0]
    assert ranking.measured_best(medians, rel_tol=0.05) == [1, 2]
    # with no tolerance and no spread only the fastest counts
    assert ranking.measured_best(medians, rel_tol=0.0) == [1]
    # a spread wider than the gap makes plan 3 a tie too
    assert ranking.measured_best(medians, [0, 0, 0, 3.5], rel_tol=0.0) == [1, 3]
    # the model ranks plan 2 first: credited with rank 1 through the measured tie
    assert ranking.best_rank(medians, [4.0, 2.0, 1.0, 3.0]) == 1
    # ...but not without the tolerance: plan 1 is predicted second
    assert ranking.best_rank(medians, [4.0, 2.0, 1.0, 3.0], rel_tol=0.0) == 2
    # predicted ties with a slower plan go against the model: plan 1 shares the lowest
    # cost with plan 0, which measures 3x slower
    assert ranking.predicted_rank([1.0, 1.0, 2.0], 0) == 2
    assert ranking.best_rank([3.0, 1.0, 2.0], [1.0, 1.0, 2.0], rel_tol=0.0) == 2
    assert ranking.predicted_rank([1.0, 2.0, 3.0], 2) == 3
    # a tie among measured-best plans does not: plans 1 and 2 measure within 5 % and are
    # priced the same, whichever the model picks runs as fast (under strict_ties, the
    # rule before, it did: rank 2); a third plan in the tie, measured slower, still counts
    assert ranking.best_rank([3.0, 1.0, 1.02], [2.0, 1.0, 1.0]) == 1
    assert ranking.best_rank([3.0, 1.0, 1.02], [2.0, 1.0, 1.0], strict_ties=True) == 2
    assert ranking.best_rank([3.0, 1.0, 1.02], [1.0, 1.0, 1.0]) == 2
    assert ranking.best_rank([3.0, 1.0, 1.02], [1.0, 1.0, 1.0], strict_ties=True) == 3


def test_pick_regret_is_how_much_slower_the_predicted_best_runs() -> None:
    assert ranking.pick_regret([10.0, 5.0, 6.0], [3.0, 1.0, 2.0]) == 0.0
    assert ranking.pick_regret([10.0, 5.0, 6.0], [3.0, 2.0, 1.0]) == pytest.approx(0.2)
    # predicted ties: the worst measured of the picks counts
    assert ranking.pick_regret([10.0, 5.0, 6.0], [1.0, 1.0, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one prediction per measured plan"):
        ranking.pick_regret([1.0], [1.0, 2.0])


def test_kendall_tau_scores_the_whole_order() -> None:
    assert ranking.kendall_tau([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    assert ranking.kendall_tau([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    # 3 pairs, one swapped: (2 - 1) / 3
    assert ranking.kendall_tau([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(1 / 3)
    # a tie on either side orders no pair: the tied pair counts as neither
    assert ranking.kendall_tau([1.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    assert ranking.kendall_tau([1.0, 2.0], [5.0, 5.0]) is None
    assert ranking.kendall_tau([1.0], [1.0]) is None
    with pytest.raises(ValueError, match="one prediction per measured plan"):
        ranking.kendall_tau([1.0, 2.0], [1.0])

def test_table_metrics_average_over_models() -> None:
    t = ranking.table_metrics({"a": 1, "b": 2, "c": 6, "d": 1}, k=5)
    assert t["acc@1"] == 0.5
    assert t["acc@5"] == 0.75
    assert t["mrr"] == pytest.approx((1 + 0.5 + 1 / 6 + 1) / 4)
    assert t["models"] == 4


@pytest.mark.parametrize("call, words", [
    (lambda: ranking.best_rank([1.0, 2.0], [1.0]), "one prediction per measured plan"),
    (lambda: ranking.measured_best([]), "medians is empty"),
    (lambda: ranking.measured_best([1.0, float("nan")]), "medians[1]=nan"),
    (lambda: ranking.table_metrics({"a": 0}), "ranks['a']=0"),
    (lambda: ranking.predicted_rank([1.0], 3), "plan index 3"),
])
def test_bad_inputs_name_the_value(call, words) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_ranking_module_imports_no_tensorflow() -> None:
    code = ("import sys; import tapas.planning.ranking; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


#: Table 2's script end to end: a zoo preset in CI; with TAPAS_FULL_MATRIX=1 also a
#: keras.applications model (tapas.models.corpus) whose kernels are convolutions
TABLE2_MODELS = matrix.pick(("t5-tiny",), ("t5-tiny", "keras-mobilenet"))


def test_table2_script_on_a_tiny_slice(tmp_path: pathlib.Path) -> None:
    """TABLE2_MODELS, each model's plans built first and timed round-robin (a plan far
    slower than the fastest dropped after --drop_after rounds; the first plan built twice);
    then --recost reproduces the table."""
    out = tmp_path / "t2"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"),
         "--models=" + ",".join(TABLE2_MODELS), "--top_k=1", "--steps=2", "--repeats=1",
         "--batch_size=8", "--rounds=3", "--drop_after=2",
         f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f"[{model} 1/" in proc.stdout for model in TABLE2_MODELS)
    d = json.loads((out / "table2.json").read_text())
    assert set(d["table"]) == {"baseline", "+CF", "+CF+GO", "+CF+GO+EC", "+CF+GO+EC+WR",
                               "+CF+GO+EC+WR+L", "+CF+GO+EC+WR+L+MB",
                               "+CF+GO+EC+WR+L+MB+W", "+CF+GO+EC+WR+L+MB+W+MC",
                               "+CF+GO+EC+WR+L+MB+W+K", "+CF+GO+EC+WR+L+MB+W+K+CS",
                               "+CF+GO+EC+WR+L+MB+W+K+CS+CA",
                               "+CF+GO+EC+WR+L+MB+W+K+CS+CA+U",
                               "+CF+GO+EC+WR+L+MB+W+K+CS+CA+E"}
    assert d["interleave"] is True and d["rounds"] == 3
    # the first plan of each model built twice and timed in the same rounds
    assert set(d["twins"]) == set(TABLE2_MODELS)
    assert "one plan built twice, per model: median gap" in proc.stdout
    # each model's kernels were timed first: every contraction and convolution of its
    # patterns at their local shapes, and the search pricing them adds its top plans (K#1)
    assert set(d["kernel_times"]) == set(TABLE2_MODELS)
    for model, k in d["kernel_times"].items():
        assert k["num_devices"] == 4 and len(k["seconds"]) >= 4 and not k["failed"]
        assert {json.loads(key)["op"] for key in k["seconds"]} >= (
            {"Conv2D", "DepthwiseConv2dNative"} if model == "keras-mobilenet" else
            {"MatMul"})
        assert f"[{model}] kernels: {len(k['seconds'])} of {len(k['seconds'])} timed" \
            in proc.stdout
        assert any(name.startswith("K#") for r in d["runs"] if r["model"] == model
                   for name in r["plan"].split("/"))
    # each model's compute factor was measured first (the replicated step at 8 and 2)
    assert set(d["calibrations"]) == set(TABLE2_MODELS)
    for model, cal in d["calibrations"].items():
        assert cal["batches"] == [8, 2] and cal["pairs"] == 2 and min(cal["measured_s"]) > 0
        assert f"[{model}] replicated step on 4 devices: batch 8" in proc.stdout
        for r in (r for r in d["runs"] if r["model"] == model):
            # the calibrated row is the row before it with the compute scaled: it moves the
            # prediction the way the factor says
            w, mc = r["predicted_s"]["+CF+GO+EC+WR+L+MB+W"], r["predicted_s"][
                "+CF+GO+EC+WR+L+MB+W+MC"]
            if cal["compute_scale"] == 1.0:
                assert mc == pytest.approx(w)
            else:
                assert (mc > w) == (cal["compute_scale"] > 1.0)
    # ... and its communication factor (its data-parallel plan with and without its
    # collectives), which scales every collective of the row +CS
    assert set(d["communication_calibrations"]) == set(TABLE2_MODELS)
    for model, cal in d["communication_calibrations"].items():
        assert cal["plan"] == "data-parallel" and cal["pairs"] == 2 and cal["collectives"] > 0
        assert "batch" in cal["patterns"] and min(cal["measured_s"]) > 0
        assert f"[{model}] data-parallel plan on 4 devices: step" in proc.stdout
        pairs = [(r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K"],
                  r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS"])
                 for r in d["runs"] if r["model"] == model]
        # +CS: one factor, the data-parallel plan's difference over its price (with two
        # factors solved, ``communication_scale`` is the weight gradients' factor of +CA)
        s = 1.0 if cal["scale"] is None else cal["difference_s"] / cal["predicted_s"]
        if s == 1.0:
            assert all(c == pytest.approx(k) for k, c in pairs)
        else:   # plans with collectives move the way the factor says, the others stay
            assert all(c <= k * (1 + 1e-9) if s < 1 else c >= k * (1 - 1e-9)
                       for k, c in pairs)
            assert any(c != pytest.approx(k) for k, c in pairs)
        # the second plan (mostly activation collectives) timed in the same calibration:
        # with its factor, +CA prices the plans with two factors and its search adds A#...
        runs = [r for r in d["runs"] if r["model"] == model]
        one_two = [(r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS"],
                    r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA"]) for r in runs]
        if cal["activation"] is not None:
            assert f"  second plan ({cal['activation']['plan']}, mostly" in proc.stdout
        if cal["activation_communication_scale"] is None:
            assert all(ca == pytest.approx(cs) for cs, ca in one_two)
        else:
            assert any(ca != pytest.approx(cs) for cs, ca in one_two)
            assert any(name.startswith("A#") for r in runs for name in r["plan"].split("/"))
        # the data-parallel step without its collectives (all compute) over what +K prices
        # for its compute scales every plan's compute in +CA+U, whose search adds U#...
        f = cal["collective_free_factor"]
        assert f > 0 and f != 1.0
        ca_u = [(r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA"],
                 r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA+U"]) for r in runs]
        assert all((u > ca) == (f > 1) and u != pytest.approx(ca) for ca, u in ca_u)
        # on the calibrated plan itself: compute = its collective-free step / f, so +U adds
        # (f - 1) times that
        dp = [r for r in runs if tuple(r["patterns"]) == tuple(cal["patterns"])]
        assert len(dp) == 1
        assert (dp[0]["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA+U"]
                - dp[0]["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA"]) == pytest.approx(
                    (f - 1) * cal["measured_s"][1] / f)
        assert any(name.startswith("U#") for r in runs for name in r["plan"].split("/"))
        # ... or only its memory-bound ops' part, by the compute calibration's difference
        # of two batch sizes beyond the +K price of the rest's difference, over the price of
        # those ops' difference (+CA+E, whose search adds E#...)
        parts = d["calibrations"][model]["elementwise"]
        e = parts["factor"]
        assert e > 0
        ca_e = [(r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA"],
                 r["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA+E"]) for r in runs]
        if parts["elements_s"] is None or e == 1.0:   # nothing measured: the row is +CA
            assert all(pe == pytest.approx(ca) for ca, pe in ca_e)
            continue
        (rest_b, rest_s), (el_b, el_s) = parts["rest_s"], parts["elements_s"]
        # (the rest's prices come from kernels timed on this machine: noise may order the
        # two batch sizes either way, so only their signs are the code's to check)
        assert el_b > el_s > 0 and rest_b >= 0 and rest_s >= 0
        assert e == pytest.approx((d["calibrations"][model]["difference_s"]
                                   - (rest_b - rest_s)) / (el_b - el_s))
        assert all((pe > ca) == (e > 1) and pe != pytest.approx(ca) for ca, pe in ca_e)
        # the replicated plan: +E adds (e - 1) times its memory-bound ops' price
        rep = [r for r in runs if "replicate" in r["plan"].split("/")]
        assert len(rep) == 1
        assert (rep[0]["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA+E"]
                - rep[0]["predicted_s"]["+CF+GO+EC+WR+L+MB+W+K+CS+CA"]) == pytest.approx(
                    (e - 1) * el_b)
        assert any(name.startswith("E#") for r in runs for name in r["plan"].split("/"))
    for model in TABLE2_MODELS:
        runs = [r for r in d["runs"] if r["model"] == model]
        assert not [r for r in runs if "error" in r], runs
        assert len(runs) >= 2      # the top plan and data parallel / replicate, merged
        assert len({r["plan"] for r in runs}) == len(runs)
        assert len({tuple(r["patterns"]) for r in runs}) == len(runs)
        assert f"[{model}] {len(runs)} plans built; timing 3 rounds" in proc.stdout
        assert max(r["rounds"] for r in runs) == 3
        assert runs[0]["twin"]["paired_s"] > 0
        # every round, or the first two for a plan over 1.5x the fastest then (the first
        # plan's second build among them), each step relative to its round (the geometric
        # mean of that round's steps), as the timer compares them
        first = [x["times_s"][:2] for x in runs] + [runs[0]["twin"]["times_s"][:2]]
        g = [math.exp(statistics.fmean(math.log(ts[k]) for ts in first)) for k in range(2)]
        relative = [statistics.median(ts[k] / g[k] for k in range(2)) for ts in first]
        for r, rel in zip(runs, relative):
            assert len(r["times_s"]) == r["rounds"] in (2, 3)
            assert r["rounds"] == 3 or rel > 1.5 * min(relative)
            assert r["round_s"] == pytest.approx(r["paired_s"] / r["ratio"])
            assert r["median_s"] > 0 and r["iqr_s"] >= 0
            assert r["ratio"] > 0 and r["paired_s"] > 0 and r["paired_se_s"] >= 0
            assert set(r["predicted_s"]) == set(d["table"])
            assert len(r["patterns"]) == len(runs[0]["patterns"]) > 0
        # the metrics are those of the ranking functions on the paired numbers
        medians = [r["paired_s"] for r in runs]
        spreads = [r["paired_se_s"] for r in runs]
        for row, t in d["table"].items():
            rank = ranking.best_rank(medians, [r["predicted_s"][row] for r in runs], spreads,
                                     d["tie_tol"])
            assert t["ranks"][model] == rank
    # the t5-tiny search pricing its loss adds its own top plans (L#1...)
    assert any(name.startswith("L#") for r in d["runs"] if r["model"] == "t5-tiny"
               for name in r["plan"].split("/"))
    for row, t in d["table"].items():
        ranks = list(t["ranks"].values())
        taus = [x for x in t["taus"].values() if x is not None]
        assert t["tau"] == (pytest.approx(sum(taus) / len(taus)) if taus else None)
        assert t["acc@1"] == pytest.approx(sum(r == 1 for r in ranks) / len(TABLE2_MODELS))
        assert t["mrr"] == pytest.approx(sum(1 / r for r in ranks) / len(TABLE2_MODELS))
        assert (out / f"table2_scatter_{row.strip('+').replace('+', '_')}.png").stat().st_size \
            > 1000
    # --recost: the same runs re-costed without measuring again give the same table
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"),
         f"--recost={out / 'table2.json'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    r2 = json.loads((out / "table2_recost.json").read_text())
    assert r2["recosted_from"].endswith("table2.json") and "not measured again" in again.stdout
    assert r2["table"] == d["table"] and r2["calibrations"] == d["calibrations"]
    assert r2["kernel_times"] == d["kernel_times"]
    assert r2["communication_calibrations"] == d["communication_calibrations"]
    assert [r["paired_s"] for r in r2["runs"]] == [r["paired_s"] for r in d["runs"]]
    # an older file without the factors or the kernels is re-costed without their rows
    del d["calibrations"], d["kernel_times"], d["communication_calibrations"]
    (out / "old.json").write_text(json.dumps(d))
    older = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"),
         f"--recost={out / 'old.json'}", f"--out={out / 'old'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert older.returncode == 0, older.stdout[-3000:] + older.stderr[-3000:]
    assert "no row +CF+GO+EC+WR+L+MB+W+MC" in older.stdout
    assert "no row +CF+GO+EC+WR+L+MB+W+K:" in older.stdout
    assert "no row +CF+GO+EC+WR+L+MB+W+K+CS:" in older.stdout
    assert "no row +CF+GO+EC+WR+L+MB+W+K+CS+CA:" in older.stdout
    assert "no row +CF+GO+EC+WR+L+MB+W+K+CS+CA+U:" in older.stdout
    assert "no row +CF+GO+EC+WR+L+MB+W+K+CS+CA+E:" in older.stdout
    r3 = json.loads((out / "old" / "table2_recost.json").read_text())
    assert set(r3["table"]) == set(d["table"]) - {"+CF+GO+EC+WR+L+MB+W+MC",
                                                  "+CF+GO+EC+WR+L+MB+W+K",
                                                  "+CF+GO+EC+WR+L+MB+W+K+CS",
                                                  "+CF+GO+EC+WR+L+MB+W+K+CS+CA",
                                                  "+CF+GO+EC+WR+L+MB+W+K+CS+CA+U",
                                                  "+CF+GO+EC+WR+L+MB+W+K+CS+CA+E"}
    assert r3["table"]["+CF+GO+EC+WR+L+MB+W"] == d["table"]["+CF+GO+EC+WR+L+MB+W"]


@matrix.only_in_full_matrix   # the interleaved timing above runs the same script
def test_table2_script_one_plan_after_another(tmp_path: pathlib.Path) -> None:
    """--nointerleave: each plan built and timed in turn, every step paired with a step of
    the replicated plan kept built beside it (the earlier runs' method)."""
    out = tmp_path / "t2p"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"), "--models=t5-tiny",
         "--top_k=1", "--steps=2", "--repeats=1", "--batch_size=8", "--nointerleave",
         "--nokernels", "--nocalibrate", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plans built; timing" not in proc.stdout
    d = json.loads((out / "table2.json").read_text())
    assert d["interleave"] is False and d["paired"] is True and d["twins"] == {}
    runs = d["runs"]
    assert len(runs) >= 2 and not [r for r in runs if "error" in r], runs
    for r in runs:
        assert len(r["times_s"]) == len(r["anchor_times_s"]) == 2 and "rounds" not in r
        assert r["paired_s"] > 0 and r["paired_se_s"] >= 0
    medians = [r["paired_s"] for r in runs]
    spreads = [r["paired_se_s"] for r in runs]
    row = d["table"]["+CF+GO+EC"]
    assert row["ranks"]["t5-tiny"] == ranking.best_rank(
        medians, [r["predicted_s"]["+CF+GO+EC"] for r in runs], spreads, d["tie_tol"])
    # the strict rule's rank is kept beside, and never better
    assert row["strict_ties"]["ranks"]["t5-tiny"] == ranking.best_rank(
        medians, [r["predicted_s"]["+CF+GO+EC"] for r in runs], spreads, d["tie_tol"],
        strict_ties=True) >= row["ranks"]["t5-tiny"]


def test_table2_script_refuses_a_cluster_of_another_size(tmp_path: pathlib.Path) -> None:
    """--workers=2 with a cluster file of 4 devices is refused naming the command that makes
    the right one."""
    wrong = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"), "--workers=2",
         "--cluster=benchmarks/results/cluster_cpu4.json", "--models=moe-tiny",
         f"--out={tmp_path / 'x'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert wrong.returncode != 0
    assert "has 4 devices but the run has 2" in wrong.stdout + wrong.stderr
    assert "tapas profile --workers=2" in wrong.stdout + wrong.stderr


@matrix.only_in_full_matrix   # worker processes train and verify in tests/test_runtime.py
def test_table2_script_on_worker_processes(tmp_path: pathlib.Path) -> None:
    """--workers=2: the second cluster, two MultiWorkerMirroredStrategy processes on
    127.0.0.1 costed with a `tapas profile --workers=2` file; worker 0 writes the table."""
    out = tmp_path / "t2w"
    cluster = ROOT / "benchmarks" / "results" / "cluster_workers2.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"), "--workers=2",
         f"--cluster={cluster}", "--models=moe-tiny", "--top_k=1", "--steps=2", "--repeats=1",
         "--batch_size=8", "--rounds=2", "--drop_after=1",
         f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launching 2 workers" in proc.stdout and "[moe-tiny 1/" in proc.stdout
    d = json.loads((out / "table2.json").read_text())
    assert d["devices"] == 2 and d["workers"] == 2
    # the compute factor measured on the workers too (batch 8 and 4)
    assert d["calibrations"]["moe-tiny"]["batches"] == [8, 4]
    runs = d["runs"]
    assert not [r for r in runs if "error" in r], runs
    assert {"expert", "data-parallel"} <= {n for r in runs for n in r["plan"].split("/")}
    # timed round-robin; no plan dropped (each worker would decide on its own timings)
    assert all(r["rounds"] == len(r["times_s"]) == 2 and r["paired_s"] > 0 for r in runs)
    assert set(d["table"]["+CF+GO+EC"]["ranks"]) == {"moe-tiny"}


_REFUSED = [
    (["--workers=1"], "--workers=1: a cluster of processes needs at least 2"),
    (["--workers=3", "--batch_size=8"], "--batch_size=8 is not divisible by --workers=3"),
    (["--workers=2", "--decompose"], "run it on --devices, without --workers"),
    (["--ceiling=no/such/table2.json"], "--ceiling=no/such/table2.json: no such file"),
    (["--kernel_times=k.json"], "--kernel_times=k.json prices the plans of --recost"),
    (["--recost=x.json", "--kernel_times=no/such/k.json"],
     "--kernel_times=no/such/k.json: no such file"),
    (["--communication=c.json"], "--communication=c.json prices the plans of --recost"),
    (["--recost=x.json", "--communication=no/such/c.json"],
     "--communication=no/such/c.json: no such file"),
    (["--workers=2", "--communication_only"], "run it on --devices, without --workers"),
    (["--rounds=0"], "--rounds=0: time each plan in at least 1 round"),
    (["--drop_ratio=0.5"], "--drop_ratio=0.5: give 0"),
    (["--refine_ratio=0.5"], "--refine_ratio=0.5: give 0"),
    (["--refine_after=-2"], "--refine_after=-2: give 0"),
]


def test_table2_flags_are_checked_before_any_work() -> None:
    """Each refused flag line stops the script's ``main`` with a usage error before any
    work (every line in one process: TensorFlow imported once)."""
    proc = subprocess.run([sys.executable, "-c", _FLAG_LINES, json.dumps(
        [flags for flags, _ in _REFUSED])], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert len(got) == len(_REFUSED)
    for (flags, words), (refused, out) in zip(_REFUSED, got):
        assert words in refused, (flags, refused, out)
        assert "launching" not in out, (flags, out)


_FLAG_LINES = """
import contextlib, io, json, sys
lines = json.loads(sys.argv[1])
sys.argv = ["table2_cost_model.py"]
sys.path.insert(0, "scripts")
import table2_cost_model as t2
from absl import app
results = []
for flags in lines:
    t2.FLAGS.unparse_flags()
    t2.FLAGS(["table2_cost_model.py", *flags])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            t2.main([])
            refused = "not refused"
        except app.UsageError as e:
            refused = str(e)
    results.append((refused, out.getvalue()))
print(json.dumps(results))
"""


_INSTRUMENT = """
import sys
sys.path.insert(0, "benchmarks")
from tapas.execution.runtime import devices
devices.setup_devices(2, "cpu")
import report
from tapas import capturing, models
from tapas.execution.program import collectives
from tapas.sharding.patterns import patterns_for

def collective_ops(pm):
    library = pm.runtime.graphs["train_step"]._functions.values()
    ops = [n.op for f in library for n in f.cached_definition.node_def]
    return sum("Collective" in op for op in ops)

entry = models.get("t5-tiny")
model = entry.build(seed=0)
graph = capturing.capture(model, entry.input_spec(8), training=False)
strategy = devices.make_strategy(2)
plan = ["batch" if "batch" in [p.name for p in patterns_for(node, graph, 2)] else "replicate"
        for node in graph.nodes]
real = report.plan_program(model, entry, graph, plan, strategy, 8)
with report.without_communication():
    local = report.plan_program(model, entry, graph, plan, strategy, 8)
assert collectives.KeyedCollectives._sum.__name__ == "_sum"     # restored on exit
xs, y = entry.synthetic_batch(8)
print("collectives", collective_ops(real[0]), collective_ops(local[0]))
print("losses", real[0].train_step(list(xs), y), local[0].train_step(list(xs), y))
"""


def test_without_communication_takes_the_collectives_out_of_the_step() -> None:
    """The timing instrument of --decompose: a data-parallel t5-tiny built inside it has
    no collective op in its step (the same plan built outside has its gradient
    all-reduces), still steps, and the context puts the collectives back when it ends."""
    proc = subprocess.run([sys.executable, "-c", _INSTRUMENT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = next(ln for ln in proc.stdout.splitlines() if ln.startswith("collectives"))
    real, local = (int(x) for x in counts.split()[1:])
    assert real > 10 and local == 0, counts
    losses = next(ln for ln in proc.stdout.splitlines() if ln.startswith("losses"))
    assert all(float(x) > 0 for x in losses.split()[1:]), losses


@matrix.only_in_full_matrix   # its collective-free step: test_without_communication_...
def test_table2_decompose_sets_measured_parts_beside_the_model(tmp_path: pathlib.Path) -> None:
    """--decompose: every plan also timed without its collectives; its measured compute
    and communication beside the model's, the summary and the two-panel PNG; --recost
    keeps them, and --ceiling scores a run's measurements as the predictor. (Without the
    kernels' row: the plans are the search's and the reference plans, as before it; the
    tiny slice above runs the kernels.)"""
    out = tmp_path / "t2d"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"), "--models=resnet-tiny",
         "--top_k=1", "--steps=2", "--repeats=1", "--batch_size=8", "--decompose",
         "--nokernels", "--rounds=4", "--drop_ratio=0", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decomposition (" in proc.stdout and "communication" in proc.stdout
    d = json.loads((out / "table2.json").read_text())
    runs = {r["plan"]: r for r in d["runs"]}
    assert not [r for r in runs.values() if "error" in r], runs
    for r in runs.values():
        assert len(r["local_times_s"]) == 4 and r["local_ratio"] > 0
        assert r["measured_compute_s"] == pytest.approx(r["local_ratio"] * r["paired_s"]
                                                        / r["ratio"])
        assert r["measured_communication_s"] == pytest.approx(r["paired_s"]
                                                              - r["measured_compute_s"])
        assert r["predicted_parts"]["compute_s"] > 0
    replicated = next(r for p, r in runs.items() if "replicate" in p.split("/"))
    assert replicated["predicted_parts"]["communication_s"] == 0
    assert runs["data-parallel"]["predicted_parts"]["communication_s"] > 0
    summary = d["decomposition"]
    assert summary["plans"] == len(runs)
    # each plan with priced collectives: its measured communication over the price (the
    # value itself is a measurement: at batch 8 under two test workers the local copy can
    # time slower than the plan, so only the arithmetic is checked, not its sign)
    with_comm = [r for r in d["runs"] if r["predicted_parts"]["communication_s"] > 0]
    expected = [r["measured_communication_s"] / r["predicted_parts"]["communication_s"]
                for r in with_comm]
    assert len(expected) >= 1 and summary["communication_ratios"] == pytest.approx(expected)
    assert summary["communication_ratio_median"] == pytest.approx(statistics.median(expected))
    assert set(summary["compute_slopes"]) == {"resnet-tiny"}
    # one half of the model replaced by its measurement: scored like the table's rows
    assert "measured compute + model communication: Acc@1" in proc.stdout
    oracles = summary["oracles"]
    assert set(oracles) == {"measured compute + model communication",
                            "model compute + measured communication"}
    for o in oracles.values():
        assert o["models"] == 1 and 0 <= o["acc@1"] <= o["acc@5"] <= 1
        assert o["ranks"]["resnet-tiny"] >= 1 and o["mrr"] == 1 / o["ranks"]["resnet-tiny"]
    assert (out / "table2_decomposition.png").stat().st_size > 1000
    # --recost keeps the decomposition; --ceiling scores another run's measurements as
    # the predictor (here the run itself: every measured-best plan ranked first)
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "table2_cost_model.py"),
         f"--recost={out / 'table2.json'}", f"--ceiling={out / 'table2.json'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    r2 = json.loads((out / "table2_recost.json").read_text())
    assert r2["decomposition"]["compute_slopes"] == pytest.approx(summary["compute_slopes"])
    assert "ceiling:" in again.stdout
    assert r2["ceiling"]["models"] == 1 and r2["ceiling"]["acc@1"] == 1.0
    assert r2["ceiling"]["mrr"] == 1.0 and r2["ceiling"]["ranks"] == {"resnet-tiny": 1}


def test_table2_from_log_scores_the_printed_lines(tmp_path: pathlib.Path) -> None:
    """scripts/table2_from_log.py reads a run's printed plan lines back (paired time, its
    standard error, the printed rows' predictions) and its compute factors, and scores them
    as the table does (run as a command: its absl flags are its own process's)."""
    log = tmp_path / "run.log"
    log.write_text(
        "[m 1/2] #1/L#1: measured 50.0 ms (+-1.0; alone 51.0), predicted 10.00 ms (+CF+GO+EC), "
        "11.00 ms (+WR+L), 20.00 ms (+MB), 21.00 ms (+MB+W), 40.00 ms (+MC)\n"
        "[m 2/2] replicate: measured 80.0 ms (+-2.0; alone 79.0), predicted 9.00 ms "
        "(+CF+GO+EC), 9.00 ms (+WR+L), 25.00 ms (+MB), 26.00 ms (+MB+W), 80.00 ms (+MC)\n"
        "[m] replicated step on 4 devices: batch 64 80.0 ms, batch 16 30.0 ms (difference "
        "50.0 +- 1.0 ms over 10 pairs); the cost model's compute 26.0 and 6.5 ms: compute "
        "scale 2.56\n"
        "unrelated line\n")
    out = tmp_path / "scored.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "table2_from_log.py"),
                           str(log), f"--out={out}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 plans of 1 models" in proc.stdout
    d = json.loads(out.read_text())
    assert d["compute_scales"] == {"m": 2.56}
    runs = d["runs"]
    assert [r["plan"] for r in runs] == ["#1/L#1", "replicate"]
    assert runs[0]["paired_s"] == pytest.approx(0.05)
    assert runs[0]["paired_se_s"] == pytest.approx(0.001)
    assert runs[1]["predicted_s"]["+CF+GO+EC+WR+L+MB+W+MC"] == pytest.approx(0.08)
    # the paper's row ranks replication first (9 < 10 ms), the measured-best second
    assert d["table"]["+CF+GO+EC"]["ranks"] == {"m": 2}
    assert d["table"]["+CF+GO+EC"]["pick_regret"]["m"] == pytest.approx(0.6)
    assert d["table"]["+CF+GO+EC+WR+L+MB+W+MC"]["acc@1"] == 1.0
    empty = subprocess.run([sys.executable, str(ROOT / "scripts" / "table2_from_log.py"),
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert empty.returncode != 0 and "no '[model i/n] plan: measured" in (
        empty.stdout + empty.stderr)


def _report():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return report


def test_round_robin_summary_cancels_the_machine_drifting_between_rounds() -> None:
    """Plan b always takes 1.1x plan a's step, but the machine slows 3x halfway: the plain
    medians mix the two speeds, the ratio to each round's steps is exact and has no
    spread; a plan left out of later rounds is compared with the rounds it ran in."""
    report = _report()
    speed = [1.0, 1.0, 1.0, 3.0, 3.0, 3.0]
    a = [0.1 * s for s in speed]
    b = [0.11 * s for s in speed]
    c = [0.5 * s for s in speed[:2]] + [None] * 4    # dropped after two rounds
    ra, rb, rc = report.round_robin_summary([a, b, c])
    assert rb["paired_s"] / ra["paired_s"] == pytest.approx(1.1)
    assert rc["paired_s"] / ra["paired_s"] == pytest.approx(5.0)
    assert ra["paired_se_s"] == pytest.approx(0) and rb["ratio_iqr"] == pytest.approx(0)
    assert (ra["rounds"], rc["rounds"]) == (6, 2) and rc["times_s"] == [0.5, 0.5]
    assert ra["round_s"] == pytest.approx(ra["paired_s"] / ra["ratio"])
    # the copies without collectives are put on the same rounds' scale
    (ra,) = report.round_robin_summary([a], [[t / 2 for t in a]])
    assert ra["local_ratio"] == pytest.approx(0.5) and len(ra["local_times_s"]) == 6
    with pytest.raises(ValueError, match="no plan was timed in every round"):
        report.round_robin_summary([c])


class _FakeProgram:
    def __init__(self, name: str, seconds: float, fail_at: int | None = None) -> None:
        self.name, self.seconds, self.fail_at, self.steps = name, seconds, fail_at, 0


def test_timed_round_robin_drops_slow_plans_and_reports_failures() -> None:
    """Every plan once per round in a shuffled order (the same for the same seed); after
    drop_after rounds a plan over drop_ratio times the fastest stops, after refine_after
    those over refine_ratio (0: none does, as across worker processes); a plan whose step
    raises is reported, the others go on; bad arguments name the value."""
    report = _report()
    calls: list[str] = []

    def step(p: _FakeProgram) -> float:
        calls.append(p.name)
        p.steps += 1
        if p.fail_at is not None and p.steps >= p.fail_at:
            raise RuntimeError(f"{p.name} ran out of memory")
        return p.seconds

    def programs() -> list[_FakeProgram]:
        return [_FakeProgram("fast", 0.10), _FakeProgram("close", 0.12),
                _FakeProgram("slow", 0.40), _FakeProgram("broken", 0.10, fail_at=3)]

    out = report.timed_round_robin(programs(), 6, drop_after=2, drop_ratio=1.5, step=step)
    fast, close, slow, broken = out
    assert (fast["rounds"], close["rounds"], slow["rounds"]) == (6, 6, 2)
    assert close["paired_s"] / fast["paired_s"] == pytest.approx(1.2)
    assert slow["paired_s"] / fast["paired_s"] == pytest.approx(4.0)
    assert broken == {"error": "RuntimeError: broken ran out of memory"}
    first_order = list(calls)
    assert len(set(tuple(first_order[i:i + 4]) for i in (0, 4))) == 2   # shuffled per round
    calls.clear()
    report.timed_round_robin(programs(), 6, drop_after=2, drop_ratio=1.5, step=step)
    assert calls == first_order                                          # same seed
    kept = report.timed_round_robin(programs()[:3], 4, drop_after=1, drop_ratio=0, step=step)
    assert [r["rounds"] for r in kept] == [4, 4, 4]
    # the second cut: after refine_after rounds only the plans within refine_ratio of the
    # fastest go on (the close ones), the 30 % slower one stops with its 4 steps kept
    close_call = [_FakeProgram("fast", 0.10), _FakeProgram("close", 0.105),
                  _FakeProgram("mid", 0.13), _FakeProgram("slow", 0.40)]
    refined = report.timed_round_robin(close_call, 8, drop_after=2, drop_ratio=1.5, step=step,
                                       refine_after=4, refine_ratio=1.1)
    assert [r["rounds"] for r in refined] == [8, 8, 4, 2]
    assert refined[2]["paired_s"] / refined[0]["paired_s"] == pytest.approx(1.3)
    assert [r["rounds"] for r in report.timed_round_robin(
        programs()[:3], 5, drop_ratio=0, refine_after=2, refine_ratio=0, step=step)] == [5] * 3
    # a plan in keep is never cut (a plan built twice: both builds get every round)
    kept_slow = report.timed_round_robin(programs()[:3], 6, drop_after=2, drop_ratio=1.5,
                                         step=step, keep=(2,))
    assert [r["rounds"] for r in kept_slow] == [6, 6, 6]
    local = report.timed_round_robin(programs()[:2], 3, step=step,
                                     local_programs=[_FakeProgram("l", 0.05), None])
    assert local[0]["local_ratio"] > 0 and "local_ratio" not in local[1]
    for kwargs, words in ((dict(rounds=0), "rounds=0: must be an int >= 1"),
                          (dict(rounds=2, drop_ratio=0.5), "drop_ratio=0.5: must be 0"),
                          (dict(rounds=2, refine_ratio=0.9), "refine_ratio=0.9: must be 0"),
                          (dict(rounds=2, refine_after=-1), "refine_after=-1: must be an int"),
                          (dict(rounds=2, local_programs=[None]), "local_programs has 1")):
        with pytest.raises(ValueError, match=words):
            report.timed_round_robin(programs()[:2], step=step, **kwargs)
