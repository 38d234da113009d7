"""tapas.sharding.rows: whether each example's outputs depend on its own row only, read off
graphs captured from Keras models (what decides whether fit fills up a last, smaller batch;
tests/test_fit.py checks the training against Keras's fit)."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tapas import capturing
from tapas.sharding.rows import row_independence

B = 8


def _graph(body, training: bool = True, width: int = 6):
    keras.utils.set_random_seed(0)
    inp = keras.Input((width,), batch_size=B, name="x")
    model = keras.Model(inp, keras.layers.Dense(3, name="o")(body(inp)))
    return capturing.capture(model, tf.TensorSpec([B, width], name="x"), training=training)


def _dense(x):
    return keras.layers.Dense(8, activation="relu", name="h")(x)


class _Checked(keras.layers.Layer):
    """Asserts on its whole input (a reduction over every row) that only an Assert reads."""

    def call(self, x):
        check = tf.debugging.assert_less(x, 1e9)
        with tf.control_dependencies([check]):
            return tf.identity(x)


class _Remember(keras.layers.Layer):
    """Writes the batch's rows into a variable."""

    def build(self, shape):
        self.last = self.add_weight(shape=(B, shape[-1]), initializer="zeros",
                                    trainable=False, name="last")

    def call(self, x):
        self.last.assign(x)
        return x


def test_rows_kept_apart_by_dense_layers_dropout_and_checks() -> None:
    assert row_independence(_graph(_dense)) is None
    assert row_independence(_graph(lambda x: keras.layers.Dropout(0.3)(_dense(x)))) is None
    # a reduction over every row that only an Assert reads changes no output
    assert row_independence(_graph(lambda x: _Checked()(_dense(x)))) is None


def test_a_mean_over_the_batch_combines_rows() -> None:
    centre = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True),
                                 name="centre")
    why = row_independence(_graph(lambda x: centre(_dense(x))))
    assert why is not None and "centre" in why and "(Mean) combines the examples" in why


def test_batch_norm_combines_rows_in_training_only() -> None:
    def body(x):
        return keras.layers.BatchNormalization(name="bn")(_dense(x))
    why = row_independence(_graph(body))
    assert why is not None and "bn" in why and "combines the examples" in why
    assert row_independence(_graph(body, training=False)) is None


def test_every_example_against_every_other_combines_rows() -> None:
    # a similarity of each example with every other (contrastive logits): the batch is
    # two labels of one MatMul
    logits = keras.layers.Lambda(lambda t: keras.ops.matmul(t, keras.ops.transpose(t)),
                                 name="logits")
    why = row_independence(_graph(lambda x: logits(_dense(x)), width=6))
    assert why is not None and "logits" in why and "(MatMul) combines" in why


def test_a_random_draw_with_the_batch_elsewhere_than_axis_0_is_refused() -> None:
    def body(x):
        h = keras.layers.Reshape((2, 4))(_dense(x))
        h = keras.layers.Permute((2, 1))(h)       # (B, 4, 2): the batch still leads
        h = keras.layers.Lambda(lambda t: keras.ops.transpose(t, (1, 0, 2)))(h)
        h = keras.layers.Dropout(0.3, name="drop")(h)      # drawn as (4, B, 2)
        h = keras.layers.Lambda(lambda t: keras.ops.transpose(t, (1, 0, 2)))(h)
        return keras.layers.Flatten()(h)
    why = row_independence(_graph(body))
    assert why is not None and "draws random numbers of shape [4, 8, 2]" in why
    assert "not with the batch on axis 0" in why


@pytest.mark.parametrize("training", [True, False])
def test_writing_the_rows_into_a_variable_is_refused(training: bool) -> None:
    why = row_independence(_graph(lambda x: _Remember(name="remember")(_dense(x)),
                                  training=training))
    assert why is not None and "remember" in why
    assert "writes a value computed from the examples into a variable" in why


@pytest.mark.parametrize("draw", [tf.random.stateless_uniform, tf.random.stateless_normal,
                                  tf.random.stateless_truncated_normal])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.float64])
def test_a_stateless_draws_first_rows_do_not_depend_on_how_many_follow(draw, dtype) -> None:
    """What following a draw like an input rests on (TensorFlow's Philox draws, as Keras's
    dropout makes them): the filled-up batch's own rows get the smaller batch's numbers."""
    whole = draw((B, 5, 3), seed=(3, 7), dtype=dtype).numpy()
    assert (whole[:3] == draw((3, 5, 3), seed=(3, 7), dtype=dtype).numpy()).all()
