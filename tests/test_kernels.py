"""Kernels measured for the cost model (``CostOptions.kernel_times``, the row ``+K``):
the keys the pattern propagation gives each contraction and convolution at its local shapes
(tapas.sharding.patterns.kernels), the pricing that replaces their rate-based cost by the
measured time (tapas.planning.kernel_times, tapas.planning.cost.compute_time), and the
measurement itself on 2 logical CPU devices (tapas.execution.calibration.kernels, in a subprocess:
devices are set once per process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import tapas
from tapas.ir import OpInfo, TensorInfo
from tapas.planning import cost
from tapas.planning.cluster import Cluster
from tapas.planning.cost import CostOptions
from tapas.planning.kernel_times import KernelTimes, graph_kernels, priced
from tapas.sharding.patterns import patterns_for
from tapas.sharding.patterns.kernels import KernelUse, kernel_key, parse_kernel_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dense_graph():
    x = keras.Input((32,), batch_size=128)
    return tapas.capture(keras.Model(x, keras.layers.Dense(64, name="d")(x)),
                         [tf.TensorSpec((128, 32), tf.float32)])


def _pattern(graph, node, n, name):
    (p,) = [p for p in patterns_for(node, graph, n) if p.name == name]
    return p


def test_a_kernel_key_is_the_op_its_dtype_local_shapes_and_attributes() -> None:
    op = OpInfo("c", "Conv2D", ("x", "k"), (TensorInfo("y", (4, 8, 8, 16), "float32"),),
                {"T": "float32", "strides": [1, 1, 1, 1], "padding": "SAME",
                 "use_cudnn_on_gpu": True})
    key = kernel_key(op, [(4, 8, 8, 8), (3, 3, 8, 16)])
    assert parse_kernel_key(key) == {"op": "Conv2D", "dtype": "float32",
                                     "shapes": [[4, 8, 8, 8], [3, 3, 8, 16]],
                                     "attrs": {"padding": "SAME", "strides": [1, 1, 1, 1]}}
    # the name of the op is not in it: the same layer elsewhere is the same kernel
    assert kernel_key(dataclasses.replace(op, name="other"), [(4, 8, 8, 8), (3, 3, 8, 16)]) \
        == key
    assert kernel_key(op, [(4, 8, 8, 8), (3, 3, 8, 8)]) != key
    assert kernel_key(op, [None, (3, 3, 8, 16)]) is None
    assert kernel_key(op, [(-1, 8, 8, 8), (3, 3, 8, 16)]) is None
    with pytest.raises(ValueError, match="is not a kernel key"):
        parse_kernel_key('{"op": "MatMul"}')


def test_each_pattern_names_the_kernel_its_devices_run() -> None:
    """A [128, 32] x [32, 64] matmul on 4 devices: replicated every device runs it whole,
    a batch split [32, 32] x [32, 64], a column split [128, 32] x [32, 16], a row split
    [128, 8] x [8, 64]; each once, with the FLOPs the rate-based model counts for it."""
    graph = _dense_graph()
    (node,) = [n for n in graph.nodes if any(op.type == "MatMul" for op in n.ops)]
    expect = {"replicate": [[128, 32], [32, 64]], "batch": [[32, 32], [32, 64]],
              "column": [[128, 32], [32, 16]], "row": [[128, 8], [8, 64]]}
    for name, shapes in expect.items():
        p = _pattern(graph, node, 4, name)
        (use,) = p.kernels
        assert parse_kernel_key(use.key)["shapes"] == shapes, name
        assert parse_kernel_key(use.key)["op"] == "MatMul"
        assert use.count == 1 and use.dense_flops == p.dense_flops, name
        assert use.width in p.dense_by_width and use.elements == 0.0
    assert set(graph_kernels(graph, 4)) >= {u.key for name in expect
                                            for u in _pattern(graph, node, 4, name).kernels}


def test_a_depthwise_convolution_is_keyed_with_its_elements() -> None:
    x = keras.Input((8, 8, 8), batch_size=4)
    y = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(x)
    graph = tapas.capture(keras.Model(x, y), [tf.TensorSpec((4, 8, 8, 8), tf.float32)])
    (node,) = [n for n in graph.nodes
               if any(op.type == "DepthwiseConv2dNative" for op in n.ops)]
    whole = _pattern(graph, node, 2, "replicate")
    (use,) = whole.kernels
    assert parse_kernel_key(use.key)["shapes"] == [[4, 8, 8, 8], [3, 3, 8, 1]]
    assert use.dense_flops == 0.0 and use.width is None and use.elements == 4 * 8 * 8 * 8
    keys = {parse_kernel_key(u.key)["shapes"][0][-1]
            for p in patterns_for(node, graph, 2) for u in p.kernels}
    assert keys == {8, 4}          # the channel split runs the kernel on 4 channels


def test_measured_kernels_replace_their_rate_priced_work() -> None:
    """compute = (rest of the FLOPs at the width's rate + rest of the elements at the
    elementwise rate) x (1 + backward factor) + the measured kernels' seconds, all times
    compute_scale; a kernel without a time keeps the rates."""
    cluster = dataclasses.replace(Cluster.loopback_cpu(4), device_peak_flops=1e10,
                                  device_elementwise_rate=1e9,
                                  device_width_efficiency={8: 0.5, 64: 1.0})
    a = KernelUse("a", 2, 1e8, 64, 0.0)
    b = KernelUse("b", 1, 0.0, None, 1e6)           # a depthwise convolution's elements
    c = KernelUse("c", 1, 2e8, 8, 0.0)              # not measured
    times = KernelTimes({"a": 0.004, "b": 0.003}, 4)
    args = dict(dense_flops=5e8, elements=3e6, dense_by_width={64: 3e8, 8: 2e8},
                kernels=(a, b, c))
    assert priced((a, b, c), times, 5e8, {64: 3e8, 8: 2e8}, 3e6) == \
        (2 * 0.004 + 0.003, 3e8, {64: 1e8, 8: 2e8}, 2e6)
    base = cost.compute_time(6e8, cluster, CostOptions(), **args)
    rest = (1e8 / 1e10 + 2e8 / cluster.flop_rate(8) + 2e6 / 1e9) * 3
    got = cost.compute_time(6e8, cluster, CostOptions(kernel_times=times), **args)
    assert got == pytest.approx(rest + 0.011)
    assert cost.compute_time(6e8, cluster, CostOptions(kernel_times=times, compute_scale=2.0),
                             **args) == pytest.approx(2 * got)
    # no table, or a table that measured none of them: the rates
    assert cost.compute_time(6e8, cluster, CostOptions(kernel_times=KernelTimes({}, 4)),
                             **args) == pytest.approx(base)
    # the paper's pricing (no elementwise rate) does not read the table
    assert cost.compute_time(6e8, cluster, CostOptions(kernel_times=times, memory_bound=False),
                             **args) == cost.compute_time(6e8, cluster,
                                                          CostOptions(memory_bound=False),
                                                          **args)
    with pytest.raises(TypeError, match="must be a tapas.planning.kernel_times.KernelTimes"):
        CostOptions(kernel_times={"a": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernel time -1.0 of a"):
        KernelTimes({"a": -1.0}, 4)


def test_kernel_times_round_trip_through_json(tmp_path) -> None:
    times = KernelTimes({"a": 0.5}, 4, {"b": "tf.raw_ops has no op 'X'"}, "test")
    times.save(str(tmp_path / "k.json"))
    back = KernelTimes.load(str(tmp_path / "k.json"))
    assert (dict(back.seconds), back.num_devices, dict(back.failed), back.source) == \
        ({"a": 0.5}, 4, {"b": "tf.raw_ops has no op 'X'"}, "test")
    assert json.loads(json.dumps(times.to_json())) == times.to_json()


def test_the_search_prices_measured_kernels() -> None:
    """A table that says the row-split matmul costs a second makes the search leave it."""
    graph = _dense_graph()
    (node,) = [n for n in graph.nodes if any(op.type == "MatMul" for op in n.ops)]
    cluster = dataclasses.replace(Cluster.loopback_cpu(4), device_elementwise_rate=1e9)
    keys = {name: _pattern(graph, node, 4, name).kernels[0].key
            for name in ("replicate", "batch", "column", "row")}
    slow = {k: (1.0 if name != "row" else 1e-9) for name, k in keys.items()}
    pick = tapas.search(graph, cluster=cluster,
                        options=CostOptions.for_cluster(cluster,
                                                        kernel_times=KernelTimes(slow, 4)))
    assert pick.patterns[node.id] == "row"


_MEASURE = """
import json
from tapas.execution.runtime import devices
devices.setup_devices(2, "cpu")
from tapas.execution.calibration.kernels import build_kernel, measure_kernels
from tapas.ir import OpInfo, TensorInfo
from tapas.sharding.patterns.kernels import kernel_key

def key(op_type, shapes, out_dtype="float32", **attrs):
    return kernel_key(OpInfo("k", op_type, (), (TensorInfo("y", None, out_dtype),), attrs),
                      shapes)

small = key("MatMul", [(64, 64), (64, 64)], transpose_a=False, transpose_b=False)
big = key("MatMul", [(512, 256), (256, 256)], transpose_a=False, transpose_b=False)
conv = key("Conv2D", [(4, 8, 8, 8), (3, 3, 8, 16)], strides=[1, 1, 1, 1], padding="SAME",
           data_format="NHWC", dilations=[1, 1, 1, 1], explicit_paddings=[])
einsum = key("Einsum", [(4, 8, 16), (16, 32)], equation="bsd,df->bsf")
bogus = key("NoSuchOp", [(4, 4)])
ints = key("MatMul", [(4, 4), (4, 4)], "int32")
run, shapes, dtype = build_kernel(einsum)
assert shapes == [[4, 8, 16], [16, 32]] and dtype.name == "float32"
strategy = devices.make_strategy(2)
times = measure_kernels([small, big, conv, einsum, bogus, ints], strategy, repeats=3,
                        progress=print)
print("RESULT", json.dumps({"seconds": dict(times.seconds),
                            "small": times.seconds[small], "big": times.seconds[big],
                            "failed": list(times.failed.values()),
                            "n": times.num_devices}))
"""


def test_measure_kernels_on_two_logical_devices() -> None:
    """Each kernel's training step timed on both devices at once; the 128 x larger matmul
    takes longer; an op tf.raw_ops lacks and an integer kernel are reported, not timed."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    d = json.loads(line[len("RESULT "):])
    assert d["n"] == 2 and len(d["seconds"]) == 4
    assert all(v >= 0 for v in d["seconds"].values())
    assert d["big"] > d["small"] and d["big"] > 0
    assert any("tf.raw_ops has no op 'NoSuchOp'" in f for f in d["failed"])
    assert any("only floating-point kernels" in f for f in d["failed"])
    assert "kernels: 4 of 6 timed, 2 left to the rates" in proc.stdout


def test_search_command_takes_kernel_times(tmp_path) -> None:
    """``tapas search --kernel_times=measure`` times the model's kernels on the cluster
    file's devices, prices the search with them and writes them beside --out; the file is
    taken back by a later search and by ``tapas train``; a preset cluster, a missing file,
    a file of another device count, --mesh, and --strategy in train are refused before
    anything is measured."""
    import command  # tests/command.py
    cluster = os.path.join(ROOT, "benchmarks", "results", "cluster_cpu4_2026-11-26_epyc.json")
    out, report = tmp_path / "s.json", tmp_path / "r.json"
    saved, trained_json = tmp_path / "s_kernels.json", tmp_path / "t.json"
    again_json = tmp_path / "a.json"
    # measured, taken back by a search and by tapas train (a file: nothing measured again),
    # in one process on 4 devices
    ok, again, trained = command.run_tapas_each(
        ["search", "--model=t5-tiny", "--batch_size=8", f"--cluster={cluster}",
         "--kernel_times=measure", f"--out={out}", f"--json_out={report}"],
        ["search", "--model=t5-tiny", "--batch_size=8", f"--cluster={cluster}",
         f"--kernel_times={saved}", f"--json_out={again_json}"],
        ["train", "--model=t5-tiny", "--devices=4", "--steps=1", "--batch_size=8",
         f"--cluster={cluster}", f"--kernel_times={saved}", f"--json_out={trained_json}"],
        timeout=500)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "kernels of the model's patterns on 4 devices" in ok.stdout
    assert f"kernel times written to {saved}" in ok.stdout
    times = KernelTimes.load(str(saved))
    assert times.num_devices == 4 and len(times) > 0 and not times.failed
    r = json.loads(report.read_text())
    assert r["kernel_times"]["seconds"] == dict(times.seconds)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "timing the" not in again.stdout
    assert json.loads(again_json.read_text())["kernel_times"]["seconds"] == dict(times.seconds)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "timing the" not in trained.stdout
    assert json.loads(trained_json.read_text())["kernel_times"]["seconds"] == dict(
        times.seconds)
    two = tmp_path / "two.json"
    KernelTimes(dict(times.seconds), 2).save(str(two))
    refusals = (
            (["--cluster=v100", "--kernel_times=measure"], "is a preset, not this machine"),
            (["--cluster=v100", f"--kernel_times={saved}"], "is a preset, not this machine"),
            ([f"--cluster={cluster}", "--kernel_times=no/such.json"], "no such file"),
            ([f"--cluster={cluster}", f"--kernel_times={two}"],
             "timed on 2 devices, the cluster has 4"),
            (["--mesh=2x2", "--kernel_times=measure"],
             "with --meshes/--mesh is not supported"))
    # refused before any work: one process runs them all
    refused, *bad = command.run_tapas_each(
        ["train", "--model=t5-tiny", "--devices=2", "--steps=1", "--strategy=random:0",
         f"--kernel_times={saved}"],
        *(["search", "--model=t5-tiny", *flags] for flags, _ in refusals))
    assert refused.returncode != 0
    assert "--strategy=random:0 skips it" in refused.stdout + refused.stderr
    for (flags, words), proc in zip(refusals, bad):
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, (flags, proc.stdout)
        assert "timing the" not in proc.stdout


def test_the_pure_modules_run_their_examples_and_import_no_tensorflow() -> None:
    import doctest

    from tapas.planning import kernel_times as times_module
    from tapas.sharding.patterns import kernels as keys_module
    for module in (times_module, keys_module):
        failures, tried = doctest.testmod(module)
        assert failures == 0 and (tried > 0 or module is times_module)
    code = ("import sys; import tapas.planning.kernel_times, tapas.sharding.patterns.kernels; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
