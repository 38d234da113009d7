"""tapas.execution.program.collectives: forward values, conjugate gradients and audit records of every
collective, simulated in one process and under MirroredStrategy on logical CPU devices."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tapas.execution.program.collectives import Audit, SimulatedCollectives, _on_axis, local_slice

N = 4


def _parts(shape, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype("float32") for _ in range(N)]


def _run(op, xs, coeffs):
    """Forward values and d(sum_i <y_i, c_i>)/dx_i of a collective on N simulated replicas."""
    audit = Audit()
    coll = SimulatedCollectives(N, audit)
    xs = [tf.constant(x) for x in xs]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        ys = op(coll, xs)
        loss = tf.add_n([tf.reduce_sum(y * c) for y, c in zip(ys, coeffs)])
    grads = tape.gradient(loss, xs)
    return [y.numpy() for y in ys], [g.numpy() for g in grads], audit


def test_all_reduce_forward_sums_backward_is_identity():
    xs, cs = _parts((2, 3), 0), _parts((2, 3), 1)
    ys, gs, audit = _run(lambda c, x: c.all_reduce(x, "t", (2, 3), "float32"), xs, cs)
    for y in ys:
        np.testing.assert_allclose(y, sum(xs), rtol=1e-6)
    for g, c in zip(gs, cs):
        np.testing.assert_array_equal(g, c)
    assert audit.counts() == {("AR", "fwd"): 1}
    assert audit.records[0].bytes == 2 * 3 * 4


def test_all_reduce_grad_is_identity_forward_and_sums_the_gradient():
    xs, cs = _parts((3,), 2), _parts((3,), 3)
    ys, gs, audit = _run(lambda c, x: c.all_reduce_grad(x, "t", (3,), "float32"), xs, cs)
    for y, x in zip(ys, xs):
        np.testing.assert_array_equal(y, x)
    for g in gs:
        np.testing.assert_allclose(g, sum(cs), rtol=1e-6)
    assert audit.counts() == {("AR", "bwd"): 1}


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_forward_concats_backward_slices(axis):
    shape = (4, 8)
    local = [4 // N, 8] if axis == 0 else [4, 8 // N]
    xs, cs = _parts(local, 4), _parts(shape, 5)
    ys, gs, audit = _run(lambda c, x: c.all_gather(x, axis, "t", shape, "float32"), xs, cs)
    for y in ys:
        np.testing.assert_array_equal(y, np.concatenate(xs, axis=axis))
    for i, g in enumerate(gs):
        np.testing.assert_array_equal(g, np.split(cs[i], N, axis=axis)[i])
    assert audit.counts() == {("AG", "fwd"): 1}


def test_all_gather_with_partial_gradient_reduce_scatters_it():
    xs, cs = _parts((1, 8), 6), _parts((4, 8), 7)
    ys, gs, audit = _run(lambda c, x: c.all_gather(x, 0, "t", (4, 8), "float32",
                                                     partial_grad=True), xs, cs)
    for i, g in enumerate(gs):
        np.testing.assert_allclose(g, np.split(sum(cs), N, axis=0)[i], rtol=1e-6)
    assert audit.counts() == {("AG", "fwd"): 1, ("RS", "bwd"): 1}


@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_scatter_forward_and_all_gather_backward(axis):
    shape = (4, 8)
    local = [4 // N, 8] if axis == 0 else [4, 8 // N]
    xs, cs = _parts(shape, 8), _parts(local, 9)
    ys, gs, audit = _run(lambda c, x: c.reduce_scatter(x, axis, "t", shape, "float32"), xs, cs)
    for i, y in enumerate(ys):
        np.testing.assert_allclose(y, np.split(sum(xs), N, axis=axis)[i], rtol=1e-5)
    for g in gs:
        np.testing.assert_array_equal(g, np.concatenate(cs, axis=axis))
    assert audit.counts() == {("RS", "fwd"): 1, ("AG", "bwd"): 1}


def test_all_to_all_moves_the_split_and_back():
    full = np.arange(4 * 8 * 2, dtype="float32").reshape(4, 8, 2)
    xs = np.split(full, N, axis=0)
    cs = _parts((4, 2, 2), 10)
    ys, gs, audit = _run(lambda c, x: c.all_to_all(x, 0, 1, "t", full.shape, "float32"), xs, cs)
    for i, y in enumerate(ys):
        np.testing.assert_array_equal(y, np.split(full, N, axis=1)[i])
    grad_full = np.concatenate(cs, axis=1)
    for i, g in enumerate(gs):
        np.testing.assert_array_equal(g, np.split(grad_full, N, axis=0)[i])
    assert audit.counts() == {("A2A", "fwd"): 1, ("A2A", "bwd"): 1}


def test_scatter_slices_and_gathers_the_gradient():
    x = _parts((4, 6), 11)[0]
    cs = _parts((1, 6), 12)
    ys, gs, audit = _run(lambda c, xs: c.scatter(xs, 0, "t", (4, 6), "float32"), [x] * N, cs)
    for i, y in enumerate(ys):
        np.testing.assert_array_equal(y, x[i:i + 1])
    for g in gs:
        np.testing.assert_array_equal(g, np.concatenate(cs, axis=0))
    assert audit.counts() == {("AG", "bwd"): 1}


@pytest.mark.parametrize("axis", [1, 2, 3])
@pytest.mark.parametrize("static", [True, False])
def test_gather_along_a_later_axis_concatenates_the_devices_pieces_in_order(axis, static):
    # a stand-in for the all-gather along dimension 0 over 3 devices, where device i holds
    # x + 100 i: whatever the gather is given is made of x's elements, so the pieces of the
    # other devices are the same arrangement of theirs
    def gather0(v):
        return tf.concat([v + 100.0 * i for i in range(3)], 0)
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    spec = tf.TensorSpec(x.shape if static else (None, 3, None, 5), tf.float32)
    fn = tf.function(lambda v: _on_axis(gather0, v, axis, 3), input_signature=[spec])
    np.testing.assert_array_equal(fn(x), np.concatenate([x + 100.0 * i for i in range(3)],
                                                        axis=axis))


def test_local_slice_rejects_indivisible_sizes():
    with pytest.raises(ValueError, match="multiple of the device count"):
        local_slice(tf.zeros([5, 2]), 0, 2, 0)


def test_wrong_number_of_parts_is_reported():
    with pytest.raises(ValueError, match="pass one per replica"):
        SimulatedCollectives(4).all_reduce([tf.zeros([2])] * 3, "t", (2,), "float32")


_MIRRORED = textwrap.dedent("""
    import numpy as np, tensorflow as tf
    N = 2
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * N)
    from tapas.execution.program.collectives import Audit, ReplicaContextCollectives, SimulatedCollectives
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 6)).astype("float32") for _ in range(N)]
    cs = [rng.standard_normal((8, 12)).astype("float32") for _ in range(N)]
    ops = {
        "ar": lambda c, x: c.all_reduce(x, "t", (4, 6), "float32"),
        "f": lambda c, x: c.all_reduce_grad(x, "t", (4, 6), "float32"),
        "ag": lambda c, x: c.all_gather(x, 1, "t", (4, 12), "float32"),
        # along the last and a middle axis of a rank-4 tensor (NHWC channels, rows)
        "ag_last": lambda c, x: [tf.reshape(y, (4, 12)) for y in c.all_gather(
            [tf.reshape(v, (2, 2, 3, 2)) for v in x], 3, "t", (2, 2, 3, 4), "float32")],
        "ag_middle": lambda c, x: [tf.reshape(y, (4, 12)) for y in c.all_gather(
            [tf.reshape(v, (2, 2, 3, 2)) for v in x], 1, "t", (2, 4, 3, 2), "float32")],
        "rs": lambda c, x: c.reduce_scatter(x, 0, "t", (4, 6), "float32"),
        "a2a": lambda c, x: c.all_to_all(x, 0, 1, "t", (8, 6), "float32"),
        "sc": lambda c, x: c.scatter(x, 1, "t", (4, 6), "float32"),
    }
    def coeff(op, i, y_shape):
        return cs[i][: y_shape[0], : y_shape[1]]
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)])
    for name, op in ops.items():
        audit = Audit()
        @tf.function
        def step():
            def replica():
                ctx = tf.distribute.get_replica_context()
                i = ctx.replica_id_in_sync_group
                x = tf.gather(tf.constant(np.stack(xs)), i)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    (y,) = op(ReplicaContextCollectives(N, audit), [x])
                    c = tf.gather(tf.constant(np.stack(cs)), i)[: y.shape[0], : y.shape[1]]
                    loss = tf.reduce_sum(y * c)
                return y, tape.gradient(loss, x)
            return strategy.run(replica)
        ys, gs = step()
        ys = [t.numpy() for t in strategy.experimental_local_results(ys)]
        gs = [t.numpy() for t in strategy.experimental_local_results(gs)]
        sim = SimulatedCollectives(N)
        xt = [tf.constant(x) for x in xs]
        with tf.GradientTape() as tape:
            tape.watch(xt)
            sy = op(sim, xt)
            loss = tf.add_n([tf.reduce_sum(y * cs[i][: y.shape[0], : y.shape[1]])
                             for i, y in enumerate(sy)])
        sg = tape.gradient(loss, xt)
        for a, b in zip(ys + gs, [t.numpy() for t in sy] + [t.numpy() for t in sg]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
        kinds = sorted(audit.counts())
        graph = step.get_concrete_function().graph
        launched = sorted(op.type for op in graph.get_operations() if op.type.startswith("Coll"))
        print(name, "ok", kinds, "launched", launched)
    print("ALL OK")
""")


# the same collectives on complex values (FNet's Fourier mixing: Model Garden's FNet split
# its complex activations, and the runtime's collectives carried them as int32, dropping
# every imaginary part and the fractions of the real one)
_MIRRORED_COMPLEX = _MIRRORED.replace(
    'xs = [rng.standard_normal((4, 6)).astype("float32") for _ in range(N)]',
    'xs = [(rng.standard_normal((4, 6)) + 1j * rng.standard_normal((4, 6))).astype("complex64")'
    ' for _ in range(N)]').replace(
    'cs = [rng.standard_normal((8, 12)).astype("float32") for _ in range(N)]',
    'cs = [(rng.standard_normal((8, 12)) - 1j * rng.standard_normal((8, 12))).astype('
    '"complex64") for _ in range(N)]').replace(
    "loss = tf.reduce_sum(y * c)", "loss = tf.reduce_sum(tf.math.real(y * c))").replace(
    "loss = tf.add_n([tf.reduce_sum(y * cs[i]", "loss = tf.add_n([tf.reduce_sum(tf.math.real("
    "y * cs[i]").replace("for i, y in enumerate(sy)])", ") for i, y in enumerate(sy)])")


def test_collectives_carry_complex_values():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    assert "complex64" in _MIRRORED_COMPLEX and "tf.math.real(y * c)" in _MIRRORED_COMPLEX
    proc = subprocess.run([sys.executable, "-c", _MIRRORED_COMPLEX], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_replica_context_collectives_match_the_simulation_under_mirrored_strategy():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    # replica 0 alone writes the audit: one record per collective and phase
    assert "ar ok [('AR', 'fwd')]" in proc.stdout
    assert "rs ok [('AG', 'bwd'), ('RS', 'fwd')]" in proc.stdout
    # launched on each replica's launcher: one collective per replica and use, no merge_call
    # protocol (ReplicaContext.all_gather also all-gathers the shapes, to pad uneven ones)
    assert "ag ok [('AG', 'fwd')] launched ['CollectiveGatherV2', 'CollectiveGatherV2']" \
        in proc.stdout, proc.stdout
    assert "ar ok [('AR', 'fwd')] launched ['CollectiveReduceV2', 'CollectiveReduceV2']" \
        in proc.stdout, proc.stdout
