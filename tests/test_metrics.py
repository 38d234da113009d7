"""tapas.execution.training.metrics: the compiled metrics of a model, on the host, equal
what Keras logs. A Keras 2 (tf_keras) model's metric objects become their Keras 3 twins
(Keras 3 would call a tf_keras object as a function and average its running results);
the runtime's end-to-end metrics are in tests/test_model_losses.py."""

import numpy as np
import pytest

from tapas.execution.training.metrics import Scores


def _keras2_classifier(metrics, weighted=None):
    import tf_keras as k
    inp = k.Input((4,))
    model = k.Model(inp, k.layers.Dense(5)(inp))
    model.compile(optimizer="sgd",
                  loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics, weighted_metrics=weighted)
    return model


def test_keras2_metric_objects_score_as_tf_keras_scores_them():
    import tf_keras as k
    top2 = k.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")
    wacc = k.metrics.SparseCategoricalAccuracy(name="wacc")
    model = _keras2_classifier([top2, "accuracy"], [wacc])
    scores = Scores(model)
    rng = np.random.default_rng(0)
    want_top2 = k.metrics.SparseTopKCategoricalAccuracy(k=2)
    want_wacc = k.metrics.SparseCategoricalAccuracy()
    for _ in range(3):   # three batches: the state accumulates across them
        y = rng.integers(0, 5, (8,))
        logits = rng.standard_normal((8, 5)).astype("float32")
        w = rng.uniform(0.5, 1.5, (8,)).astype("float32")
        scores.update(((logits,), (y,), (w,), ()))
        want_top2.update_state(y, logits)
        want_wacc.update_state(y, logits, sample_weight=w)
    got = scores.results()
    assert got["top2"] == pytest.approx(float(want_top2.result()), abs=1e-7)
    assert got["wacc"] == pytest.approx(float(want_wacc.result()), rel=1e-6)
    assert 0.0 < got["top2"] < 1.0 and {"top2", "accuracy", "wacc"} <= set(got)
    assert float(top2.result()) == 0.0 and float(wacc.result()) == 0.0   # the user's untouched


def test_a_keras2_metric_without_a_keras3_twin_is_refused_by_name():
    import tf_keras as k

    class Custom(k.metrics.Mean):
        pass
    with pytest.raises(ValueError, match="Keras 2 metric Custom \\('mine'\\).*as a string"):
        Scores(_keras2_classifier([Custom(name="mine")]))


@pytest.mark.parametrize("library", ["keras", "tf_keras"])
def test_each_outputs_loss_is_averaged_over_batches_as_its_library_does(library):
    """21 examples in batches of 8, 8 and 5: each output's logged loss is what the
    library's own ``evaluate`` logs (Keras 3's traced step counts each batch once, as its
    ``tf.function`` does not know the batch's size; tf_keras weighs them by their
    examples), given the same per-batch losses."""
    k = pytest.importorskip(library)
    k.utils.set_random_seed(0)
    inp = k.Input((6,), name="x")
    h = k.layers.Dense(16, activation="relu")(inp)
    model = k.Model(inp, [k.layers.Dense(3, name="value")(h),
                          k.layers.Dense(4, name="label")(h)])
    losses = [k.losses.MeanSquaredError(),
              k.losses.SparseCategoricalCrossentropy(from_logits=True)]
    model.compile(optimizer="sgd", loss=losses)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((21, 6)).astype("float32")
    y = [rng.standard_normal((21, 3)).astype("float32"), rng.integers(0, 4, (21,))]
    want = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    scores = Scores(model)
    for start in (0, 8, 16):
        rows = slice(start, start + 8)
        outs = [np.asarray(o) for o in model(x[rows])]
        ys = [v[rows] for v in y]
        scores.update((outs, ys, None, [float(fn(t, o)) for fn, t, o in
                                        zip(losses, ys, outs)]))
    got = scores.results()
    for name in ("value_loss", "label_loss"):
        assert got[name] == pytest.approx(want[name], rel=1e-5), (name, got, want)
