"""tapas.execution.training.weight_updates: the update of each kind of weight traced once
(``Updates``) gives every weight exactly what ``apply_one`` gives it alone (clipping's
sums and loss scaling's flag decided over every weight first and passed in), keeps the
update out of the caller's graph, and leaves to ``apply_one`` the weights whose update is
their own (constraints, sparse gradients). End to end against Keras's ``fit``:
tests/test_keras_optimizer.py."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tapas.execution.training import weight_updates
from tapas.execution.training.keras_optimizer import ShardedOptimizer, WeightInfo

O = keras.optimizers
SHAPES = [(6, 4), (4,), (6, 4), (4,), (4, 6), (6, 4), (4,)]
CASES = {
    "adam": lambda: O.Adam(1e-2),
    "adamw_excluding_bias": lambda: _excluding_bias(O.AdamW(1e-2, weight_decay=0.1)),
    "sgd_nesterov": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "nadam": lambda: O.Nadam(),   # an optimizer state beside the slots (u_product)
    "ema": lambda: O.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=2),
    "accumulation": lambda: O.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
    "cosine": lambda: O.Adam(O.schedules.CosineDecay(1e-2, 10)),
    # decided over every weight first (weight_updates.decisions), then passed in
    "clipnorm": lambda: O.Adam(1e-2, clipnorm=0.5),
    "global_clipnorm": lambda: O.AdamW(1e-2, global_clipnorm=0.7),
    "loss_scale": lambda: O.LossScaleOptimizer(O.Adam(1e-2), initial_scale=4.0,
                                               dynamic_growth_steps=2),
}


def _excluding_bias(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


def _weights():
    names = ["a/kernel", "a/bias", "b/kernel", "b/bias", "c/kernel", "d/kernel", "e/gamma"]
    variables = {n: keras.Variable(np.zeros(s, "float32"), name=n.replace("/", "_"))
                 for n, s in zip(names, SHAPES)}
    return [WeightInfo(n, s, "float32", False, variables[n]) for n, s in zip(names, SHAPES)]


def _run(make, shared: bool, steps: int = 3):
    """Three steps of every weight, one at a time inside a tf.function, through
    ``Updates`` (shared) or ``apply_one``; the final values and slots, and the graph."""
    infos = _weights()
    opt = ShardedOptimizer(make(), infos)
    updates = weight_updates.Updates(opt)
    rs = np.random.RandomState(0)
    values = {w.path: tf.Variable(rs.randn(*w.local_shape).astype("float32")) for w in infos}
    slots = {w.path: {k: tf.Variable(v) for k, v in opt.initial_slots(w.path).items()}
             for w in infos}
    state = {k: tf.Variable(v) for k, v in opt.initial_state().items()}
    it = tf.Variable(0, dtype=tf.int64)

    @tf.function(autograph=False)
    def step(seed):
        new_state = {}
        read = {s: v.read_value() for s, v in state.items()}
        lr = tf.constant(opt.learning_rate, tf.float32)
        grads = {w.path: tf.random.stateless_normal(w.local_shape, tf.stack([seed, k]))
                 for k, w in enumerate(infos)}
        decided = weight_updates.decisions(   # one replica: its sums are the whole ones
            opt, {p: v.read_value() for p, v in values.items()}, grads,
            {p: {s: v.read_value() for s, v in d.items()} for p, d in slots.items()},
            read, it.read_value(), lr, lambda sums: sums, lambda ok: ok)
        for w in infos:
            args = (w.path, values[w.path].read_value(), grads[w.path],
                    {s: v.read_value() for s, v in slots[w.path].items()}, read,
                    it.read_value(), lr, decided)
            new, new_slots, new_state = (updates(*args) if shared
                                         else weight_updates.apply_one(opt, *args))
            if new is not None:
                values[w.path].assign(new)
            for s, v in new_slots.items():
                slots[w.path][s].assign(v)
        for s, v in new_state.items():
            if s in state:
                state[s].assign(v)
        it.assign_add(1)
        return tf.constant(0)

    for i in range(steps):
        step(tf.constant(i + 1, tf.int32))
    graph = step.get_concrete_function(tf.TensorSpec([], tf.int32)).graph
    got = {p: v.numpy() for p, v in values.items()}
    got.update({f"{p}/{s}": v.numpy() for p, d in slots.items() for s, v in d.items()})
    return got, graph, updates


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_updates_equal_each_weights_own(case):
    want, own_graph, _ = _run(CASES[case], shared=False)
    got, graph, updates = _run(CASES[case], shared=True)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{case} {k}")
    # three shapes; under AdamW's exclusion the biases' (4,) apart from e/gamma's
    assert updates.kinds == (4 if case == "adamw_excluding_bias" else 3), updates.kinds
    calls = [op for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert len(calls) == len(SHAPES)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    assert all(library[op.get_attr("f").name].attr["_noinline"].b for op in calls)
    # the step's own graph holds one call per weight instead of each weight's update
    assert len(graph.get_operations()) < len(own_graph.get_operations()) - 5 * len(SHAPES)


def test_a_weights_own_update_stays_inline():
    """A constraint or a sparse gradient makes a weight's update its own: no kind,
    ``apply_one`` inline; what is decided over every weight is part of the kind."""
    infos = _weights()
    layer = keras.layers.Dense(4, kernel_constraint=keras.constraints.NonNeg())
    layer.build((None, 6))
    infos[0] = WeightInfo(infos[0].path, infos[0].local_shape, "float32", False,
                          layer.kernel)
    updates = weight_updates.Updates(ShardedOptimizer(O.Adam(), infos))
    dense = tf.zeros(SHAPES[1])
    assert updates.kind(infos[0].path, tf.zeros(SHAPES[0]), {}) is None
    sparse = tf.IndexedSlices(tf.zeros([1, 4]), tf.constant([0]), tf.constant([6, 4]))
    assert updates.kind(infos[2].path, sparse, {}) is None
    assert updates.kind(infos[1].path, None, {}) is None
    assert updates.kind(infos[1].path, dense, {}) == ((4,), "float32", False, ())
    assert updates.kind(infos[2].path, dense, {}) == updates.kind(infos[5].path, dense, {})
    assert updates.kind(infos[1].path, dense, {"sums": {}}) == \
        ((4,), "float32", False, ("sums",))


DECIDING = {
    "clipnorm": lambda: O.Adam(1e-2, clipnorm=0.5),
    "global_clipnorm": lambda: O.AdamW(1e-2, global_clipnorm=0.7),
    "clipnorm_accumulation": lambda: O.SGD(0.1, momentum=0.9, clipnorm=0.3,
                                           gradient_accumulation_steps=2),
    "global_clipnorm_factor": lambda: O.Adam(1e-2, global_clipnorm=0.7,
                                             loss_scale_factor=4.0),
    "loss_scale": lambda: O.LossScaleOptimizer(O.Adam(1e-2), initial_scale=4.0),
    "loss_scale_clipnorm": lambda: O.LossScaleOptimizer(O.Adam(1e-2, clipnorm=0.5),
                                                        initial_scale=8.0),
}


@pytest.mark.parametrize("case", sorted(DECIDING))
@pytest.mark.parametrize("overflow", [False, True])
def test_decisions_are_what_the_update_itself_reads(case, overflow):
    """``decisions`` computes clipping's sums and loss scaling's flag without tracing the
    update: the same values the callbacks of ``ShardedOptimizer.apply`` receive (a
    sparse gradient, a weight without gradient and accumulated gradients included)."""
    infos = _weights()
    opt = ShardedOptimizer(DECIDING[case](), infos)
    rs = np.random.RandomState(1)
    values = {w.path: tf.constant(rs.randn(*w.local_shape).astype("float32")) for w in infos}
    slots = {w.path: {k: tf.constant(rs.rand(*w.local_shape).astype("float32"))
                      for k in opt.slot_names} for w in infos}
    grads = {w.path: tf.constant(rs.randn(*w.local_shape).astype("float32")) for w in infos}
    grads["a/kernel"] = tf.IndexedSlices(tf.constant(rs.randn(2, 4).astype("float32")),
                                         tf.constant([1, 4]), tf.constant([6, 4]))
    grads["e/gamma"] = None
    if overflow:
        grads["b/bias"] = tf.constant([1.0, np.inf, 0.0, 2.0])
    state = {k: tf.constant(v) for k, v in opt.initial_state().items()}
    args = (values, grads, slots, state, tf.constant(3, tf.int64),
            tf.constant(opt.learning_rate, tf.float32))
    captured = {}

    def sums(local):
        captured["sums"] = {p: v * 1.0 for p, v in local.items()}
        return captured["sums"]

    def finite(ok):
        captured["finite"] = ok
        return ok
    opt.apply(*args, sums, finite)
    got = weight_updates.decisions(opt, *args, lambda local: local, lambda ok: ok)
    assert sorted(got) == sorted(captured) and got, (got, captured)
    if "finite" in got:
        assert bool(got["finite"]) == bool(captured["finite"]) == (not overflow)
    for p, v in captured.get("sums", {}).items():
        np.testing.assert_array_equal(got["sums"][p].numpy(), v.numpy(), err_msg=p)
