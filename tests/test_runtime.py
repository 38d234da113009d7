"""tapas.execution.runtime, tapas.execution.api.parallel and tapas.execution.runtime.launch: multi-device training equals single-device
Keras.

Every multi-device check runs in a worker process (tests/runtime_worker.py: logical CPU
devices are set once per process), started through ``tapas.execution.runtime.launch`` so that it is always
ended (deadline, then kill of its own process group). One process runs many checks; the
fixtures below are module-scoped so each device set starts once.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest

from matrix import only_in_full_matrix  # tests/matrix.py
from tapas.execution.runtime import launch
from worker_main import run_worker  # tests/worker_main.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "runtime_worker.py")


def run_job(job: dict[str, Any], workers: int = 1, timeout_s: float = 300.0,
            start: list[int] | None = None) -> list[dict[str, dict[str, Any]]]:
    """Run the worker on ``workers`` processes; per worker, its results by check name."""
    return run_worker(WORKER, job, workers, timeout_s, start)


def assert_equivalent(mlp: dict[str, Any]) -> None:
    cases = [k for k in mlp if "/" in k]
    assert len(cases) == 6, mlp.get("error", mlp)
    for case in cases:
        for what in ("outputs", "loss", "gradients", "weights"):
            assert mlp[case][what]["ok"], (case, what, mlp[case][what])
        assert mlp[case]["iterations"] == 3
        assert mlp[case]["losses"][2] < mlp[case]["losses"][0]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = str(tmp_path_factory.mktemp("two"))
    (res,) = run_job({"devices": 2, "dir": d, "examples": 3,
                      "checks": ["mlp", "checkpoint", "failed_step", "bad_inputs", "property",
                                 "zoo", "logits", "empty", "map_fn"],
                      "zoo": [{"model": "t5-tiny", "strategies": ["random:3"],
                               "optimizer": "adam"},
                              {"model": "resnet-tiny", "strategies": ["best", "random:0"],
                               "optimizer": "sgd"},
                              {"model": "resnet-tiny", "strategies": ["random:0"],
                               "optimizer": "sgd", "graph_optimization": "default"}]})
    return res


@pytest.fixture(scope="module")
def four(two: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = str(tmp_path_factory.mktemp("four"))
    (res,) = run_job({"devices": 4, "dir": d, "checks": ["mlp", "checkpoint", "zoo"],
                      "restore_from": two["checkpoint"]["saved"],
                      "zoo": [{"model": "moe-tiny", "strategies": ["random:1"],
                               "optimizer": "adam"}]})
    return res


def test_hand_mlp_equals_keras_on_2_devices(two: dict[str, Any]) -> None:
    assert_equivalent(two["mlp"])


def test_hand_mlp_equals_keras_on_4_devices(four: dict[str, Any]) -> None:
    assert_equivalent(four["mlp"])


@pytest.mark.parametrize("which", ["two", "four"])
def test_each_device_calls_its_own_copy_of_the_replica_body(
        which: str, request: pytest.FixtureRequest) -> None:
    """The traced step calls its two replica bodies (forward and backward; the update,
    after every replica's gradients exist) out of line once per device each (each device
    instantiates and optimises its own copies), with the program's Grappler options."""
    from tensorflow.core.protobuf import rewriter_config_pb2
    rc = rewriter_config_pb2.RewriterConfig
    n = {"two": 2, "four": 4}[which]
    zoo = {k: v for k, v in request.getfixturevalue(which)["zoo"].items() if k != "check"}
    assert zoo
    for key, run in zoo.items():
        body = [c for c in run["replica_calls"] if c["noinline"]]
        devices = [c["device"] for c in body]
        assert len(body) == 2 * n and all(devices.count(d) == 2 for d in devices), \
            (key, body)
        lean = (rc.OFF, rc.OFF, rc.ONE)
        want = (rc.DEFAULT, rc.DEFAULT, rc.DEFAULT_NUM_ITERS) if key.endswith("/default") \
            else lean
        for c in body:
            assert c["nodes"] > 20, (key, c)
            assert (c["constant_folding"], c["function_optimization"], c["iterations"]) == \
                want, (key, c)


@pytest.mark.parametrize("which", ["two", "four"])
def test_checkpoint_round_trips(which: str, request: pytest.FixtureRequest) -> None:
    ck = request.getfixturevalue(which)["checkpoint"]
    assert "error" not in ck, ck.get("traceback")
    assert ck["megatron"]["how"] == "direct"
    assert ck["data"]["how"] == ck["vocab"]["how"] == "resharded"
    for layout in ("megatron", "data", "vocab"):
        assert ck[layout]["weights_equal"] and ck[layout]["slots_equal"], layout
        assert ck[layout]["iterations"] == 1
    assert ck["continue_equal"] and ck["to_keras_equal"]
    assert "optimizer 'sgd'" in ck["optimizer_mismatch"]
    assert "restore with optimizer='sgd'" in ck["optimizer_mismatch"]


def test_checkpoint_from_another_device_count(two: dict[str, Any], four: dict[str, Any]) -> None:
    other = four["checkpoint"]["other_count"]
    assert other["how"] == "resharded" and other["iterations"] == 1
    saved = two["checkpoint"]["weights"]
    for path, value in saved.items():
        np.testing.assert_array_equal(np.asarray(other["weights"][path]), np.asarray(value))


def test_failed_step_changes_nothing(two: dict[str, Any]) -> None:
    r = two["failed_step"]
    assert "loss is not finite" in r["error"] and "weights unchanged" in r["error"]
    assert r["unchanged"] and r["iterations"] == 1 and r["next_loss_finite"]


def test_bad_inputs_are_named(two: dict[str, Any]) -> None:
    r = two["bad_inputs"]
    assert "built for 3 devices but the strategy has 2" in r["device_count"]
    assert "size 9" in r["indivisible"] and "2 devices" in r["indivisible"]
    assert "shape [3, 8]" in r["input_shape"] and "[8, 8]" in r["input_shape"]
    assert "fixed once per process" in r["too_many_devices"]
    assert "Adafactor cannot run on weight shards" in r["optimizer"]
    assert "factored" in r["optimizer"]
    assert "shards over 4 devices" in r["strategy_devices"] and "2 were given" in \
        r["strategy_devices"]
    assert "searched for graph 'wide'" in r["strategy_model"] and "'mlp'" in r["strategy_model"]


def assert_zoo_equivalent(zoo: dict[str, Any], expected: int) -> None:
    runs = {k: v for k, v in zoo.items() if k != "check"}
    assert len(runs) == expected, zoo
    for key, run in runs.items():
        assert "error" not in run, (key, run.get("error"), run.get("traceback"))
        for what in ("outputs", "loss", "gradients", "weights"):
            assert run[what]["ok"], (key, what, run[what])
        assert run["audit"]["matches"], (key, run["audit"])
        if "random" in key:
            assert run["sharded_nodes"] > 0, key


def test_zoo_models_equal_keras_on_2_devices(two: dict[str, Any]) -> None:
    """t5-tiny (random plan, Adam), resnet-tiny (searched and random plan, SGD; the random
    plan also under TensorFlow's own Grappler options, the others under the runtime's lean
    ones); the full matrix (5 random plans per family, 2 and 4 devices) is
    scripts/equivalence.py."""
    assert_zoo_equivalent(two["zoo"], 4)
    assert {k: v["graph_optimization"] for k, v in two["zoo"].items() if k != "check"} == {
        "t5-tiny/random:3/adam": "lean", "resnet-tiny/best/sgd": "lean",
        "resnet-tiny/random:0/sgd": "lean", "resnet-tiny/random:0/sgd/default": "default"}


def test_collectives_of_empty_tensors_are_not_launched(two: dict[str, Any]) -> None:
    """A concat GraphNode with an empty operand, split while its producers are replicated:
    its empty gradient is gathered without a collective (TensorFlow's CPU all-gather of an
    empty tensor crashes the process) and every pattern equals Keras."""
    _assert_each_pattern_equal(two["empty"], {"batch", "follow-S2"})


def test_a_map_fn_on_the_gradient_path_trains_in_two_programs(two: dict[str, Any]) -> None:
    """tf.map_fn (a While loop) between two Dense layers, its gradient needed: trained under
    two plans in one process, each equal to Keras."""
    _assert_each_pattern_equal(two["map_fn"], {"column", "row"})


def _assert_each_pattern_equal(result: dict[str, Any], patterns: set[str]) -> None:
    res = {k: v for k, v in result.items() if k != "check"}
    assert "error" not in res, res
    assert set(res) == patterns, res
    for pattern, report in res.items():
        for what, cmp in report.items():
            assert cmp["ok"], (pattern, what, cmp)


def test_unknown_graph_optimization_is_refused_before_any_work() -> None:
    from tapas.execution.api import parallel
    with pytest.raises(ValueError, match=r"graph_optimization='fast': use one of \['lean', "
                                         r"'default'\]"):
        parallel.parallelize(object(), None, devices=2, graph_optimization="fast")


def test_zoo_model_equals_keras_on_4_devices(four: dict[str, Any]) -> None:
    assert_zoo_equivalent(four["zoo"], 1)


# the loss collectives of each case of runtime_worker.LOGIT_CASES (none: computed locally)
LOSS_COMMS = {"sigmoid-scce-column": ["AG"], "none-scce_logits-column": ["AG", "AR"],
              "none-cce_logits-column": ["AG", "AR"], "none-cce_smooth_sum-column": ["AG", "AR"]}


def test_softmax_and_sigmoid_outputs_train_from_their_logits(two: dict[str, Any]) -> None:
    """Keras's crossentropy computes from the logits of a softmax/sigmoid output (even with
    from_logits=True, keras.applications.ResNet50's case): the runtime's loss, gradients and
    3 Adam steps equal Keras's for replicated, batch-split and class-split outputs; a
    class-split sigmoid output with sparse targets gathers the logits (one loss all-gather);
    class-split logits under a softmax cross-entropy (sparse or dense targets, label
    smoothing, sum reduction) use the vocabulary-parallel cross-entropy: an all-gather of
    the per-row maxima and one all-reduce of per-row sums, never the logits. The search
    prices exactly those collectives (kind and bytes) for the same plan."""
    assert "error" not in two["logits"], two["logits"].get("traceback")
    cases = {k: v for k, v in two["logits"].items() if k not in ("check", "moved_activation")}
    assert len(cases) == 9
    for name, case in cases.items():
        act = name.split("-")[0].capitalize()
        assert case["activation"] == (None if act == "None" else act), name
        for what in ("outputs", "loss", "gradients", "weights"):
            assert case[what]["ok"], (name, what, case[what])
        assert case["audit"], (name, case["audit_table"])
        assert case["loss_comms"] == LOSS_COMMS.get(name, []), name
        # the search prices the loss collectives the runtime runs (CostOptions.loss)
        assert case["priced_loss"] == case["loss_bytes"], name


def test_logits_placed_unlike_the_output_refuse_training_not_predict(
        two: dict[str, Any]) -> None:
    """A hand plan all-gathers the softmax output while its logits stay batch-split: predict
    equals Keras; training is refused, naming the activation, the placement and the fix."""
    r = two["logits"]["moved_activation"]
    assert r["activation"] == "Softmax" and r["predict_equal"]
    assert r["train_error"] is not None
    assert "model output is a Softmax of logits that this plan places unlike the output " \
        "(placed R)" in r["train_error"]
    assert "choose a pattern for the last GraphNode" in r["train_error"]


def test_property_random_small_models_and_plans(two: dict[str, Any]) -> None:
    prop = two["property"]
    assert prop["failure"] is None, prop["failure"]
    assert len(prop["examples"]) == 3


def assert_programs_verified(programs: dict[str, Any], expected: list[str],
                             audited: bool = True) -> None:
    """Every program of the ``programs`` check ran and equals Keras; with ``audited`` (the
    process runs replica 0, which records the audit) each ran collectives."""
    runs = {k: v for k, v in programs.items() if k.startswith("seed") or "strategy" in k
            and "second" not in k}
    assert sorted(runs) == sorted(expected), programs
    for key, run in runs.items():
        assert "error" not in run, (key, run)
        assert run["ok"] and (run["collectives"] > 0 or not audited), (key, run)


def test_successive_programs_in_one_process(tmp_path: Any) -> None:
    """Regression: every tapas.parallelize(devices=N) made a new MirroredStrategy numbering
    its collectives from the same keys as the last one, so the second program with another
    plan aborted ("Collective instance 102 expected type 0 ... but got type 2", or a shape
    mismatch at instance 100) and poisoned the process. Plans, device counts (2, 4) and
    strategies differ here; each program is verified against Keras."""
    (res,) = run_job({"devices": 4, "dir": str(tmp_path), "checks": ["programs"],
                      "programs": [[0, 2], [1, 2], [2, 4]]}, timeout_s=240)
    programs = res["programs"]
    assert "error" not in programs, programs.get("traceback")
    assert_programs_verified(programs, ["seed 0 on 2", "seed 1 on 2", "seed 2 on 4",
                                        "shared strategy", "hand-made strategy"])
    refused = programs["second hand-made strategy"]
    assert refused is not None and "collectives would collide" in refused
    assert "pass that same object" in refused and "devices=N" in refused


def test_multi_worker_mirrored_two_processes(tmp_path: Any) -> None:
    """Two workers: the hand MLP, checkpoints, and successive programs on the worker's one
    MultiWorkerMirroredStrategy (make_strategy returns it again: its keys keep counting)."""
    results = run_job({"devices": 2, "dir": str(tmp_path),
                       "checks": ["mlp", "checkpoint", "programs"],
                       "programs": [[0, 2], [1, 2]]}, workers=2)
    assert len(results) == 2
    for worker, res in enumerate(results):
        assert_equivalent(res["mlp"])
        # both workers' errors: one that fails in a collective often only sees its peer go
        assert "error" not in res["programs"], (
            f"worker {worker}: {res['programs'].get('traceback')}\nevery worker's error: "
            f"{[r['programs'].get('error', 'none')[-600:] for r in results]}")
        assert_programs_verified(res["programs"], ["seed 0 on 2", "seed 1 on 2",
                                                   "shared strategy"], audited=worker == 0)
        ck = res["checkpoint"]
        assert "error" not in ck, ck.get("traceback")
        assert ck["data"]["weights_equal"] and ck["continue_equal"] and ck["to_keras_equal"]
    assert sorted(f for f in os.listdir(tmp_path / "ckpt-2") if f.endswith(".index")) == \
        ["task0.index", "task1.index"]


def test_worker_that_never_joins_is_named(tmp_path: Any) -> None:
    with pytest.raises(launch.LaunchError) as e:
        run_job({"devices": 2, "dir": str(tmp_path), "checks": [], "join_timeout_s": 4},
                workers=2, start=[0], timeout_s=90)
    text = str(e.value)
    assert "worker 1 (127.0.0.1:" in text and "never joined" in text


def test_launch_stops_every_worker_on_failure() -> None:
    script = "import os, sys, time; i = int(os.environ['TF_CONFIG'][-3]); " \
             "sys.exit(3) if i == 1 else time.sleep(60)"
    with pytest.raises(launch.LaunchError, match="worker 1 .* exited with code 3"):
        launch.launch(lambda i: [sys.executable, "-c", script], 2, timeout_s=30)
    with pytest.raises(launch.LaunchError, match=r"did not finish within 1 s"):
        launch.launch(lambda i: [sys.executable, "-c", "import time; time.sleep(60)"], 1,
                      timeout_s=1)


def test_launch_limits_glibc_arenas_unless_the_caller_sets_it(monkeypatch: Any) -> None:
    """Workers get ``MALLOC_ARENA_MAX=2`` (launch.WORKER_ENV_DEFAULTS); a value in the
    caller's environment or in ``env`` is kept."""
    script = "import os; print('arenas', os.environ.get('MALLOC_ARENA_MAX'))"
    argv = lambda i: [sys.executable, "-c", script]  # noqa: E731
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert "arenas 2" in launch.launch(argv, 1, timeout_s=30)[0].output
    assert "arenas 5" in launch.launch(argv, 1, timeout_s=30,
                                       env={"MALLOC_ARENA_MAX": "5"})[0].output
    monkeypatch.setenv("MALLOC_ARENA_MAX", "16")
    assert all("arenas 16" in r.output for r in launch.launch(argv, 2, timeout_s=30))


@only_in_full_matrix
def test_tapas_train_with_two_workers_verifies(tmp_path: Any) -> None:
    """`tapas train --workers=2`: two MultiWorkerMirroredStrategy processes, a random plan,
    SGD, verified against Keras, report as JSON; the workers are gone afterwards. In
    training mode (the default): resnet-tiny's batch norm normalises with the batch's
    statistics and updates its moving statistics, compared after the steps. The workers
    get the command's flags (here TensorFlow's own Grappler options). In the suite, plans
    split across worker processes are verified by tests/test_memory.py (4 workers) and
    test_mesh.py (2 workers, a 2x2 mesh with experts)."""
    import subprocess
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tapas.cli", "train", "--model=resnet-tiny", "--workers=2",
         "--steps=2", "--strategy=random:1", "--verify", "--optimizer=sgd",
         "--graph_optimization=default", f"--json_out={out}"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert report.get("graph_optimization") == "default", proc.stdout[-3000:] + proc.stderr[-3000:]
    check = report.get("verify", {})
    if proc.returncode != 0 and check and not check["ok"]:
        # The gradient of the first convolution (under batch norm in training mode, the
        # longest chain of sums) differs from Keras by float32 rounding at about 1.3x the
        # verify tolerance on some CPUs (AVX-512 oneDNN kernels: 2 of 1,176 elements of
        # stem_conv/kernel, relative L2 error 1.5e-5, the same with main's runtime); a
        # wrong collective differs by orders of magnitude more. Accept exactly that. (With
        # Adam, which divides each gradient by its own magnitude, that noise also moves
        # weights whose two steps' gradients nearly cancel: SGD here, Adam is verified in
        # the single-process tests.)
        bad = [k for k in ("outputs", "loss", "gradients", "step_losses", "weights",
                           "inference") if k in check and not check[k]["ok"]]
        g = check["gradients"]
        assert bad == ["gradients"] and g["max_abs_diff"] <= 5e-5 * g["scale"], \
            proc.stdout[-3000:]
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "verify: PASSED" in proc.stdout and "audit matches" in proc.stdout and check["ok"]
    assert report["audit"]["matches"]
    assert report["workers"] == 2 and report["devices"] == 2
    assert report["mode"] == "training" and check["mode"] == "training"
    assert len(report["losses"]) == 2 and ("error" in report or len(report["worker_seconds"]) == 2)
