"""Every plan the search may choose is buildable and equals one device (issue 11).

Plans made on one capture and applied to another are refused with the fix, or rebuilt on
the same named patterns when the graph is the same; and a CI slice of the equivalence
matrix (``scripts/equivalence.py``): random and searched plans over other libraries' models
-- keras-hub's Mixtral and Qwen3-MoE (a sparse-MoE block written as one layer) on simulated
shards, a keras.applications CNN also through ``tapas.parallelize`` on 2 devices -- each in
its own process with a timeout, equal to the single-device model.
"""

import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from matrix import pick  # tests/matrix.py
from tapas import capturing
from tapas.execution.api import parallel
from tapas.execution.program import reconstruct
from tapas.execution.checking import checker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "equivalence.py")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_pattern_checker as library  # noqa: E402  (its layers written like other libraries')


def _library_model(dropout=0.0):
    """The pattern checker's model of other libraries' layers (auto-named, so a second build
    in one process gets other weight paths), optionally with dropout before the MoE."""
    x = keras.Input((8, 16))
    mask = keras.Input((8,), dtype="int32")
    y = library.PositionAdd()(x)
    y = library.RMSNorm()(keras.layers.Add()([y, library.MaskedAttention()([y, mask])]))
    if dropout:
        y = keras.layers.Dropout(dropout)(y)
    y = library.SparseMoE()(y)
    return keras.Model([x, mask], y), [tf.TensorSpec([4, 8, 16]), tf.TensorSpec([4, 8], tf.int32)]


def _captured(model, specs, training=False):
    trace = capturing.trace(model, specs, training=training)
    return trace, capturing.to_ir(trace)


def test_a_plan_of_another_model_instance_is_refused_then_rebound():
    """The same architecture built twice in one process: Keras numbers the auto-named
    layers, so weight paths differ (what made random plans over keras-hub Mixtral and T5
    fail with "has no placement for weight"). Program refuses the plan naming the fix;
    Plan.for_graph (what tapas.parallelize does) chooses the same named patterns again, and
    the rebuilt plan equals one device."""
    keras.utils.set_random_seed(0)
    first = _captured(*_library_model())
    trace, graph = _captured(*_library_model())
    assert {w.path for w in first[0].weights.values()} != \
        {w.path for w in trace.weights.values()}
    plan = parallel.random_plan(first[1], 2, seed=3)
    with pytest.raises(reconstruct.ReconstructError,
                       match="made for another GraphNode or graph: make the plan from"):
        reconstruct.Program(trace, graph, plan)
    rebound = plan.for_graph(graph)
    assert {k: p.name for k, p in rebound.patterns.items()} == \
        {k: p.name for k, p in plan.patterns.items()}
    got = checker.check_plan(trace, graph, rebound, checker.synthetic_inputs(graph))
    assert got["ok"], got["problem"]
    assert got["sharded"] > 0


def test_a_plan_of_the_inference_graph_is_refused_on_the_training_graph():
    """Dropout adds GraphNodes in training mode and shifts the ids: the digest says so."""
    keras.utils.set_random_seed(0)
    model, specs = _library_model(dropout=0.5)
    _, inference = _captured(model, specs)
    trace, training = _captured(model, specs, training=True)
    assert len(training.nodes) != len(inference.nodes)
    plan = parallel.random_plan(inference, 2, seed=0)
    with pytest.raises(reconstruct.ReconstructError, match=r"made for a graph of digest .* "
                       r"training flag as tapas.parallelize"):
        plan.for_graph(training)


# (model, devices, plan, levels): random and searched plans over other libraries' models on
# simulated shards (two one-layer sparse MoE backbones, a CNN), and a searched plan
# through tapas.parallelize on 2 logical devices
# hub-mixtral on 4 devices under TAPAS_FULL_MATRIX=1 (tests/test_experts.py trains it, equal
# to Keras, on a 2x2 experts mesh in the suite)
SLICE = pick([], [("hub-mixtral", 4, "random:1", ["sim"])]) + [
    ("hub-qwen3-moe", 2, "random:2", ["sim"]), ("keras-mobilenet", 2, "searched",
                                                ["sim", "runtime"])]


def _run_cases(cases, timeout=600):
    """scripts/equivalence.py over ``cases`` in a process of its own: (rows, process)."""
    out = os.path.join(ROOT, "out", f"equivalence-test-{os.getpid()}.json")
    proc = subprocess.run([sys.executable, SCRIPT, f"--json_out={out}", "--timeout=300",
                           f"--cases={json.dumps(cases)}"], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        with open(out) as f:
            return json.load(f), proc
    finally:
        if os.path.exists(out):
            os.remove(out)


@pytest.mark.ci
def test_equivalence_slice_of_other_libraries_models():
    """A slice of scripts/equivalence.py's matrix: each case built and equal to the
    single-device model, sharded (not a replicated plan that proves nothing)."""
    cases = [{"model": m, "devices": n, "plan": p, "levels": lv} for m, n, p, lv in SLICE]
    rows, proc = _run_cases(cases, timeout=900)
    assert len(rows) == len(SLICE), proc.stdout + proc.stderr[-2000:]
    for row in rows:
        r = row["result"]
        assert r.get("ok"), f"{row['case']}: {r}\n{proc.stdout}"
        assert r["sharded"] > 0, f"{row['case']}: nothing sharded"
        assert r["sim"]["ok"] and r["sim"]["keras_diff"] < 1e-4, r["sim"]
    assert rows[-1]["result"]["runtime"]["status"] == "ok", rows[-1]["result"]
    assert proc.returncode == 0


def test_a_float32_plan_runs_again_in_float64_with_the_same_patterns():
    """A case given the patterns of a float32 plan and ``dtype: float64`` (what the script
    runs when a Keras 3 model's case fails in float32) rebuilds the model in float64 and
    applies exactly those patterns, GraphNode by GraphNode; the plan is equal to one device
    there too."""
    from tapas import models
    entry = models.get("resnet-tiny")
    graph = capturing.capture(entry.build(seed=0), list(entry.input_spec()))
    plan = parallel.random_plan(graph, 2, seed=0)
    names = {str(k): p.name for k, p in plan.patterns.items()}
    assert sum(v != "replicate" for v in names.values()) > 0
    rows, proc = _run_cases([{"model": "resnet-tiny", "devices": 2, "plan": "random:0",
                              "levels": ["sim"], "dtype": "float64", "patterns": names}])
    r = rows[0]["result"]
    assert r.get("ok"), (r, proc.stdout[-2000:], proc.stderr[-2000:])
    assert r["patterns"] == names and r["note"] == "the float32 case's plan"
    assert r["sim"]["ok"] and r["sim"]["keras_diff"] < 1e-12, r["sim"]   # float64 replay


def test_a_failed_case_is_float32_noise_only_when_equal_in_float64():
    """The script's classification: a failed float32 case whose float64 rerun passes is
    counted equal as float32 noise; one that differs in float64 too stays failed; a rerun
    that cannot run says why; the checker is checked again in float64; cases that did not
    run, and training mode, are not rerun. (In a process of its own: the script defines
    absl flags that tapas.cli, imported by other tests, defines too.)"""
    proc = subprocess.run([sys.executable, "-c", _CLASSIFICATION, SCRIPT], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0 and "classified" in proc.stdout, proc.stdout + proc.stderr


_CLASSIFICATION = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("equivalence_script", sys.argv[1])
eq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eq)
case = {"model": "resnet-tiny", "devices": 2, "plan": "random:0", "levels": ["sim"]}
failed = {"ok": False, "patterns": {"0": "batch"}, "sim": {"ok": False}}
asked = []
def answer(result):
    def spawn(c):
        asked.append(c)
        return result
    eq._spawn = spawn
answer({"ok": True, "sim": {"ok": True}, "patterns": {"0": "batch"}})
assert eq._float64_rerunnable(case, failed)
r = eq._with_float64_rerun(case, failed)
assert r["ok"] and r["status"] == "float32 noise (equal in float64)", r
assert asked[-1]["dtype"] == "float64" and asked[-1]["patterns"] == {"0": "batch"}
assert "patterns" not in r["float64"]
answer({"ok": False, "sim": {"ok": False}})
r = eq._with_float64_rerun(case, failed)
assert not r["ok"] and "status" not in r
assert "DIFFERS in float64 too" in eq._row(case, {**r, "seconds": 1.0})
answer({"ok": False, "error": "ValueError: GraphNode 7 has no pattern 'x'"})
r = eq._with_float64_rerun(case, failed)
assert not r["ok"]
assert "no float64 rerun: ValueError: GraphNode 7" in eq._row(case, {**r, "seconds": 1.0})
checker_case = {**case, "plan": "checker"}
wrong = {"ok": False, "checked": 12, "failures": ["GraphNode 3 ... pattern 'row' ..."]}
assert eq._float64_rerunnable(checker_case, wrong)
answer({"ok": True, "checked": 12, "failures": []})
r = eq._with_float64_rerun(checker_case, wrong)
assert r["ok"] and asked[-1]["dtype"] == "float64" and "patterns" not in asked[-1]
assert "1 wrong in float32; in float64 0 of 12 wrong: float32 noise" in eq._row(
    checker_case, r)
assert not eq._float64_rerunnable(case, {"ok": False, "error": "timeout"})
assert not eq._float64_rerunnable({**case, "mode": "training"}, failed)
print("classified")
"""


def test_a_case_process_killed_by_a_signal_is_reported_with_its_last_words():
    """A case whose process dies of a signal (TensorFlow's oneDNN corrupting the heap) is
    reported with the signal, the C library's message and the Python frame that ran, not
    with the tail of the interpreter's list of extension modules."""
    crash = ("import os, sys\n"
             "def step():\n"
             "    sys.stderr.write('free(): invalid size\\n'); sys.stderr.flush(); os.abort()\n"
             "step()\n")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", crash],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode < 0
    check = ("import json, sys; sys.path.insert(0, 'scripts'); import equivalence as eq; "
             "print(eq._killed(*json.load(sys.stdin)))")
    said = subprocess.run([sys.executable, "-c", check], input=json.dumps(
        [proc.returncode, proc.stderr]), capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert said.returncode == 0, said.stderr[-2000:]
    assert said.stdout.startswith("killed by SIGABRT: free(): invalid size; "
                                  "Fatal Python error: Aborted; in "), said.stdout
    assert "line 3 in step" in said.stdout, said.stdout
