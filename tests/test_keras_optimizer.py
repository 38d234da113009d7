"""tapas.execution.training.keras_optimizer: the model's Keras optimizer on weight shards equals
Keras's own ``apply_gradients`` on the whole weights (shards simulated here: a weight cut
in two on axis 0, each half updated on its own, the norms given whole; the runtime's
collectives are tested end to end in tests/test_runtime.py and tests/test_fit.py)."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tapas.execution.training.keras_optimizer import ShardedOptimizer, WeightInfo, resolve_optimizer

O = keras.optimizers
SHAPES = {"dense/kernel": (4, 3), "dense/bias": (6,), "other/kernel": (2, 2)}
STEPS = 4


def _schedule():
    return O.schedules.CosineDecay(1e-3, 10, warmup_target=3e-3, warmup_steps=2)


def _adamw_excluding_bias():
    opt = O.AdamW(_schedule(), weight_decay=0.1, clipnorm=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


CASES = {
    "sgd_nesterov": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(1e-2),
    "adamw_cosine_clipnorm": _adamw_excluding_bias,
    "adamax": lambda: O.Adamax(),
    "nadam": lambda: O.Nadam(),
    "rmsprop": lambda: O.RMSprop(momentum=0.5, centered=True),
    "adagrad": lambda: O.Adagrad(),
    "adadelta": lambda: O.Adadelta(1.0),
    "lion": lambda: O.Lion(),
    "ftrl": lambda: O.Ftrl(l1_regularization_strength=0.01),
    "global_clipnorm": lambda: O.Adam(1e-2, global_clipnorm=0.3),
    "clipvalue": lambda: O.SGD(0.1, clipvalue=0.2),
    "ema": lambda: O.Adam(1e-2, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "accumulation": lambda: O.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
    "loss_scale_factor": lambda: O.SGD(0.1, loss_scale_factor=8.0),
    # dynamic loss scaling; step 2's gradients overflow: skipped on every shard
    "loss_scale_optimizer": lambda: O.LossScaleOptimizer(O.Adam(1e-2), initial_scale=64.0,
                                                         dynamic_growth_steps=2),
}
OVERFLOW_AT = {"loss_scale_optimizer": 2}


def _grads(step, case=None):
    rs = np.random.RandomState(100 + step)
    g = {p: (rs.randn(*s) * (3.0 if step % 2 else 0.2)).astype("float32")
         for p, s in SHAPES.items()}
    g["other/kernel"] = None   # no gradient: no update, as Keras
    if OVERFLOW_AT.get(case) == step:
        g["dense/kernel"][3, 1] = np.inf   # in the second shard only
    return g


def _keras_reference(make, case=None):
    rs = np.random.RandomState(0)
    init = {p: rs.randn(*s).astype("float32") for p, s in SHAPES.items()}
    with keras.name_scope("ref"):
        variables = {p: keras.Variable(v, name=p.replace("/", "_")) for p, v in init.items()}
    opt = make()
    for step in range(STEPS):
        g = _grads(step, case)
        opt.apply_gradients([(tf.constant(g[p]), variables[p]) for p in SHAPES
                             if g[p] is not None])
    return init, {p: v.numpy() for p, v in variables.items()}, variables


def _sharded_run(make, init, variables, case=None):
    """Each split weight cut in two on axis 0; shard k updated by its own apply."""
    split = {"dense/kernel": True, "dense/bias": True, "other/kernel": False}
    halves = {p: (np.split(v, 2) if split[p] else [v, v]) for p, v in init.items()}
    infos = [WeightInfo(p, halves[p][0].shape, "float32", split[p], variables[p])
             for p in SHAPES]
    sharded = ShardedOptimizer(make(), infos)
    slots = [{p: {k: tf.constant(v) for k, v in sharded.initial_slots(p).items()}
              for p in SHAPES} for _ in range(2)]
    state = {k: tf.constant(v) for k, v in sharded.initial_state().items()}
    values = [{p: tf.constant(halves[p][k]) for p in SHAPES} for k in range(2)]
    taken = 0
    for step in range(STEPS):
        g = _grads(step, case)
        whole = {p: float(np.sum(np.square(g[p].astype(np.float32))))
                 for p in SHAPES if g[p] is not None}
        finite = all(np.isfinite(v).all() for v in g.values() if v is not None)
        states = []
        for k in range(2):
            local = {p: None if g[p] is None else
                     tf.constant(np.split(g[p], 2)[k] if split[p] else g[p]) for p in SHAPES}
            new_v, new_s, new_state = sharded.apply(
                values[k], local, slots[k], state, tf.constant(taken, tf.int64),
                tf.constant(sharded.learning_rate, tf.float32),
                lambda sums: {p: tf.constant(whole[p], tf.float32) for p in sums},
                lambda ok: tf.constant(finite))
            values[k] = {**values[k], **new_v}
            slots[k] = {p: {**slots[k][p], **new_s.get(p, {})} for p in SHAPES}
            states.append(new_state)
        taken += int(states[0].pop("step_taken"))
        state = states[0]
    _sharded_run.last = (state, taken)   # for the loss-scale test
    return {p: (np.concatenate([values[0][p].numpy(), values[1][p].numpy()]) if split[p]
                else values[0][p].numpy()) for p in SHAPES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_update_equals_keras(case):
    init, want, variables = _keras_reference(CASES[case], case)
    got = _sharded_run(CASES[case], init, variables, case)
    for p in SHAPES:
        np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-6, err_msg=f"{case} {p}")
    moved = max(float(np.abs(want[p] - init[p]).max()) for p in SHAPES)
    assert moved > 1e-4, "the reference did not train: the comparison would prove nothing"


def test_loss_scale_state_after_an_overflow():
    """The scale, its counter and the step count as Keras's LossScaleOptimizer leaves them:
    steps 0 and 1 finite (the scale doubles after 2), step 2 overflows on one shard only
    (skipped everywhere, the scale halves), step 3 finite."""
    make = CASES["loss_scale_optimizer"]
    init, _, variables = _keras_reference(make, "loss_scale_optimizer")
    ref = make()
    kv = {p: keras.Variable(v) for p, v in init.items()}
    for step in range(STEPS):
        g = _grads(step, "loss_scale_optimizer")
        ref.apply_gradients([(tf.constant(g[p]), kv[p]) for p in SHAPES if g[p] is not None])
    _sharded_run(make, init, variables, "loss_scale_optimizer")
    state, taken = _sharded_run.last
    assert float(state["loss_scale"]) == float(ref.dynamic_scale.numpy()) == 64.0
    assert int(state["scale_steps"]) == int(ref.step_counter.numpy()) == 1
    assert taken == int(ref.iterations.numpy()) == 3


def test_no_gradient_no_update():
    init, want, _ = _keras_reference(CASES["adam"])
    np.testing.assert_array_equal(want["other/kernel"], init["other/kernel"])


@pytest.mark.parametrize("make, word", [
    (lambda: O.Adafactor(), "factored"),
    (lambda: O.Lamb(), "trust ratio"),
    (lambda: O.LossScaleOptimizer(O.Lamb()), "trust ratio"),
])
def test_refuses_non_elementwise(make, word):
    with pytest.raises(ValueError, match=word):
        ShardedOptimizer(make(), [WeightInfo("w", (2,), "float32")])


def test_refuses_norm_constraint_on_split_weight():
    layer = keras.layers.Dense(2, kernel_constraint=keras.constraints.MaxNorm(1.0))
    layer.build((None, 4))
    v = layer.kernel
    with pytest.raises(ValueError, match="MaxNorm.*splits it"):
        ShardedOptimizer("sgd", [WeightInfo("k", (2, 2), "float32", True, v)])
    ShardedOptimizer("sgd", [WeightInfo("k", (4, 2), "float32", False, v)])   # replicated: fine


def test_resolve_names_configs_and_learning_rate():
    assert type(resolve_optimizer("adamw")).__name__ == "AdamW"
    cfg = keras.optimizers.serialize(O.RMSprop(0.3))
    opt = resolve_optimizer(cfg)
    assert type(opt).__name__ == "RMSprop" and np.isclose(float(opt.learning_rate), 0.3)
    user = O.Adam(0.1)
    assert np.isclose(float(resolve_optimizer(user, 0.5).learning_rate), 0.5)
    assert np.isclose(float(user.learning_rate), 0.1)   # the user's instance unchanged
    with pytest.raises(ValueError, match="not a Keras optimizer"):
        resolve_optimizer("nosuch")
    with pytest.raises(ValueError, match="not a Keras 3 optimizer"):
        resolve_optimizer(3.0)


def test_templates_are_never_allocated():
    sharded = ShardedOptimizer(O.Adam(), [WeightInfo("w", (1000, 1000), "float32")])
    assert all(t._value is None for t in sharded.templates.values())
    assert all(v._value is None for s in sharded.slots.values() for v in s.values())
    assert sharded.slot_names == ("momentum", "velocity")


# ---- end to end: ParallelModel.fit against Keras's model.fit ------------------------------

import os  # noqa: E402

from worker_main import run_worker  # noqa: E402  (tests/worker_main.py)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optimizer_worker.py")
ALL_CASES = ["sgd_nesterov", "adam", "adamw_cosine_warmup", "rmsprop", "lion", "clipnorm",
             "global_clipnorm", "ema", "accumulation", "mixed_float16",
             "mixed_float16_overflow", "mixed_bfloat16", "keras2_adam_embedding_l2",
             "keras2_adamw_clipvalue", "keras2_mixed_float16_overflow"]


def _check_fit(r):
    assert "error" not in r, (r.get("error"), r.get("traceback"))
    assert r["moved"] > 1e-3, "Keras's fit did not move the weights: nothing compared"
    np.testing.assert_allclose(r["loss_ours"], r["loss_keras"], rtol=r["rtol"],
                               err_msg=f"{r['check']}: History losses differ")
    if "loss_scale" in r:   # dynamic loss scaling: the same steps skipped, the same scale
        assert r["loss_scale"][0] == r["loss_scale"][1], r["loss_scale"]
        assert r["iterations"][0] == r["iterations"][1], r["iterations"]
    assert r["weights_ok"], (r["check"], r["weights_max_abs_diff"])


@pytest.fixture(scope="module")
def two_devices():
    (res,) = run_worker(WORKER, {"devices": 2, "cases": ALL_CASES}, 1, 900.0)
    return res


@pytest.mark.parametrize("case", ALL_CASES)
def test_fit_with_compiled_optimizer_equals_keras_fit_on_2_devices(two_devices, case):
    r = two_devices[case]
    _check_fit(r)
    if case == "mixed_float16_overflow":   # some steps were skipped, and some taken
        assert r["iterations"][1] < 12 and r["loss_scale"][1] < 2.0 ** 22
    if case == "keras2_mixed_float16_overflow":   # tf_keras counts the skipped steps
        assert r["iterations"] == [12, 12] and r["loss_scale"][1] < 2.0 ** 22
        assert r["loss_keras"][0] != r["loss_keras"][-1], "no step was taken"
    if case.startswith("mixed_float16"):
        assert "loss_scale" in r, "mixed_float16 trained without loss scaling"
    if case.startswith("keras2"):   # tf_keras's fit added the kernel's L2 term
        assert r["regularized"] == 1 and r["verified"] is not False, r
        assert r["verified"] or "float16" in case, r   # verify() passes against tf_keras
    if r["plan"] == "random":
        assert r["split"], "the random plan split no weight: the shards were not exercised"


def test_fit_with_compiled_optimizer_equals_keras_fit_on_4_devices():
    cases = ["adamw_cosine_warmup", "clipnorm", "global_clipnorm"]
    (res,) = run_worker(WORKER, {"devices": 4, "cases": cases}, 1, 900.0)
    for case in cases:
        _check_fit(res[case])
    assert any(res[c]["split"] for c in cases)


def test_keras2_optimizers_and_losses_become_their_keras3_twins():
    import tf_keras
    from tapas.execution.training import keras2
    from tapas.execution.api.parallel import loss_object
    opt = resolve_optimizer(tf_keras.optimizers.Adam(3e-3, clipnorm=0.5, amsgrad=True))
    assert type(opt) is O.Adam and opt.clipnorm == 0.5 and opt.amsgrad
    assert np.isclose(float(opt.learning_rate), 3e-3)
    sched = tf_keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    opt = resolve_optimizer(tf_keras.optimizers.SGD(sched, momentum=0.9))
    assert opt._learning_rate.decay_steps == 10 and np.isclose(float(opt.learning_rate), 0.1)
    loss = loss_object(tf_keras.losses.MeanSquaredError())
    assert type(loss) is keras.losses.MeanSquaredError and loss.reduction == "sum_over_batch_size"
    assert keras2.loss(keras.losses.MeanAbsoluteError()).__class__ is keras.losses.MeanAbsoluteError
    with pytest.raises(ValueError, match="decay=0.5.*keras.optimizers.Adam"):
        resolve_optimizer(tf_keras.optimizers.legacy.Adam(1e-3, decay=0.5))
    # mixed_float16's LossScaleOptimizer: Keras 3's around the translated inner optimizer
    lso = resolve_optimizer(tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(1e-3), initial_scale=256.0, dynamic_growth_steps=7))
    assert type(lso) is O.LossScaleOptimizer and type(lso.inner_optimizer) is O.Adam
    assert (float(lso.initial_scale), lso.dynamic_growth_steps) == (256.0, 7)
    assert getattr(lso, keras2.FROM_TF_KERAS)
    assert getattr(resolve_optimizer(lso, learning_rate=0.1), keras2.FROM_TF_KERAS)
    with pytest.raises(ValueError, match="fixed loss scale.*dynamic=True"):
        resolve_optimizer(tf_keras.mixed_precision.LossScaleOptimizer(
            tf_keras.optimizers.Adam(), dynamic=False, initial_scale=128.0))
    # exclude_from_weight_decay, by name and by variable (get_config carries neither)
    layer = tf_keras.layers.Dense(2, name="dense")
    layer.build((None, 3))
    k2 = tf_keras.optimizers.AdamW(1e-3, weight_decay=0.1)
    k2.exclude_from_weight_decay(var_list=[layer.kernel], var_names=["bias"])
    assert not k2._use_weight_decay(layer.kernel) and not k2._use_weight_decay(layer.bias)
    twin = resolve_optimizer(k2)
    assert not twin._use_weight_decay(layer.kernel) and not twin._use_weight_decay(layer.bias)
    other = tf_keras.layers.Dense(2, name="other")
    other.build((None, 3))
    assert twin._use_weight_decay(other.kernel)
    sharded = ShardedOptimizer(twin, [
        WeightInfo(path, tuple(w.shape), "float32", False, w) for path, w in
        (("dense/kernel", layer.kernel), ("dense/bias", layer.bias),
         ("other/kernel", other.kernel))])
    assert sharded.decays == {"dense/kernel": False, "dense/bias": False, "other/kernel": True}
    # verify's reference: a fresh tf_keras optimizer like the user's (at a new rate too)
    for rate, want in ((None, 1e-3), (0.25, 0.25)):
        ref = ShardedOptimizer(k2, [WeightInfo("dense/kernel", (3, 2), "float32")],
                               learning_rate=rate).keras()
        assert type(ref) is tf_keras.optimizers.AdamW and ref is not k2
        assert float(ref.learning_rate) == pytest.approx(want)
        assert not ref._use_weight_decay(layer.kernel) and not ref._use_weight_decay(layer.bias)
        assert ref._use_weight_decay(other.kernel)
    ref = ShardedOptimizer(tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(1e-3), initial_scale=256.0, dynamic_growth_steps=7),
        [WeightInfo("w", (2,), "float32")]).keras()
    assert type(ref).__module__.startswith("tf_keras") and float(ref.initial_scale) == 256.0


def test_a_keras2_optimizer_sums_a_sparse_gradients_duplicate_indices_as_tf_keras_does():
    """tf_keras sums the slices of a repeated index (a token twice in a batch) before its
    update; Keras 3 updates with the slices as they are, and Adam squares each one: the
    twin of a tf_keras optimizer is marked, and the runtime's update of it deduplicates."""
    import tf_keras
    from tapas.execution.training import keras2
    opt = resolve_optimizer(tf_keras.optimizers.Adam(0.1))
    assert getattr(opt, keras2.FROM_TF_KERAS)
    assert getattr(resolve_optimizer(opt, learning_rate=0.5), keras2.FROM_TF_KERAS)
    assert not getattr(resolve_optimizer(O.Adam(0.1)), keras2.FROM_TF_KERAS, False)
    grad = tf.IndexedSlices(tf.constant([[1., 2.], [3., 4.], [5., 6.]]), tf.constant([2, 0, 2]),
                            tf.constant([4, 2]))
    got = keras2.deduplicated(grad)
    assert got.indices.numpy().tolist() == [2, 0]
    assert got.values.numpy().tolist() == [[6., 8.], [3., 4.]]
    dense = tf.constant([[1., 2.]])
    assert keras2.deduplicated(dense) is dense
    # on one weight: the sharded update equals tf_keras's apply_gradients, not Keras 3's
    start = np.ones((4, 2), "float32")
    theirs, ref = tf.Variable(start), tf_keras.optimizers.Adam(0.1)
    keras3, ref3 = keras.Variable(start), O.Adam(0.1)
    sharded = ShardedOptimizer(tf_keras.optimizers.Adam(0.1),
                               [WeightInfo("emb", (4, 2), "float32")])
    slots = {"emb": {k: tf.constant(v) for k, v in sharded.initial_slots("emb").items()}}
    state = {k: tf.constant(v) for k, v in sharded.initial_state().items()}
    value = tf.constant(start)
    for step in range(2):
        ref.apply_gradients([(grad, theirs)])
        ref3.apply_gradients([(grad, keras3)])
        new, new_slots, _ = sharded.apply(
            {"emb": value}, {"emb": grad}, slots, state, tf.constant(step, tf.int64),
            tf.constant(0.1, tf.float32), lambda sums: sums)
        value, slots = new["emb"], {"emb": {**slots["emb"], **new_slots["emb"]}}
    np.testing.assert_allclose(value.numpy(), theirs.numpy(), rtol=1e-6)
    assert not np.allclose(theirs.numpy(), keras3.numpy(), rtol=1e-3)   # they do differ


def test_keras2_weight_regularizers_are_found_and_a_callable_loss_is_refused():
    """tf_keras keeps a layer's kernel_regularizer as a zero-argument loss of the layer,
    not on the variable as Keras 3 does: the runtime finds it there. Any other
    zero-argument loss (``model.add_loss(lambda: ...)``) is refused, naming the fix,
    rather than dropped."""
    import tf_keras as k
    from tapas.execution.training import keras2
    inp = k.Input((3,))
    dense = k.layers.Dense(2, kernel_regularizer=k.regularizers.L2(0.1),
                           bias_regularizer=k.regularizers.L1(0.2), name="d")
    model = k.Model(inp, k.layers.Dense(1, name="o")(dense(inp)))
    found = keras2.weight_regularizers(model)
    assert set(found) == {id(dense.kernel), id(dense.bias)}
    assert type(found[id(dense.kernel)]).__name__ == "L2"
    assert float(found[id(dense.bias)].l1) == pytest.approx(0.2)
    assert keras2.weight_regularizers(keras.layers.Dense(2)) == {}
    model.add_loss(lambda: tf.reduce_sum(dense.kernel))
    with pytest.raises(ValueError, match="add_loss.*kernel_regularizer"):
        keras2.weight_regularizers(model)


def test_keras_twin_keeps_weight_decay_exclusions():
    """``keras()`` (verify's reference) decays exactly the weights the shards decay."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    user = O.AdamW(1e-2, weight_decay=0.5)
    user.exclude_from_weight_decay(var_names=["bias"])
    sharded = ShardedOptimizer(user, [WeightInfo("d/kernel", (3, 2), "float32", False,
                                                 layer.kernel),
                                      WeightInfo("d/bias", (2,), "float32", False, layer.bias)])
    assert sharded.decays == {"d/kernel": True, "d/bias": False}
    twin = sharded.keras()
    assert twin is not user and not twin._use_weight_decay(layer.bias)
    assert twin._use_weight_decay(layer.kernel)


def test_an_optimizer_that_has_stepped_is_said_to_start_afresh(caplog):
    v = keras.Variable(np.ones(2, "float32"))
    user = O.Adam(0.1)
    user.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    with caplog.at_level("WARNING"):
        ShardedOptimizer(user, [WeightInfo("w", (2,), "float32")])
    assert "has taken 1 steps already" in caplog.text and "afresh" in caplog.text
