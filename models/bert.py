"""BERT-style encoder (Devlin et al., 2019) with a masked-LM head, in Keras 3.

What it brings to the zoo that T5 does not: three named inputs (token ids, segment ids and
a padding mask, as Keras's text backbones take them), learned absolute positions, biased
q/k/v projections, post-norm residual blocks (LayerNorm after each sub-layer), GELU, and a
backbone that is itself a two-output ``keras.Model`` (sequence output and the ``[CLS]``
pooler) of which the masked-LM model reads only the sequence output: the pooler branch is
computed but read by nothing, as when a user puts their own head on a library backbone.

The padding mask becomes an additive attention bias once, in the backbone, and every
encoder layer reads that same tensor. Only ``keras.ops`` is used, so the model builds
under any Keras backend.

Family API used by the registry: :class:`BertConfig`, :func:`build_model`,
:func:`input_spec`, :func:`synthetic_batch` and :func:`param_count`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from ._common import Initializers, TiedLMHead, padding_bias, require_positive_int, require_probability

__all__ = ["BertConfig", "BertLayer", "PositionEmbedding", "build_backbone", "build_model", "input_spec", "synthetic_batch",
           "param_count"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder (names follow the BERT configs).

    Attributes:
        num_layers: encoder layers.
        hidden_size: width of the residual stream.
        num_heads: attention heads (``hidden_size`` must divide by it).
        intermediate_size: feed-forward inner size.
        vocab_size: token vocabulary (shared with the tied masked-LM decoder).
        seq_len: static sequence length (also the number of learned positions).
        type_vocab_size: segment ids (2 in BERT: sentence A / B).
        dropout_rate: dropout on embeddings, attention probabilities and sub-layer
            outputs; 0.0 creates no dropout layers.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int = 128
    type_vocab_size: int = 2
    dropout_rate: float = 0.0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size",
                      "seq_len", "type_vocab_size"):
            require_positive_int("BertConfig", field, getattr(self, field))
        require_probability("BertConfig", "dropout_rate", self.dropout_rate)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"BertConfig.hidden_size={self.hidden_size} is not divisible by num_heads="
                             f"{self.num_heads}; pick a head count that divides it (BERT-base: 768 / 12).")


class BertLayer(keras.layers.Layer):
    """One post-norm encoder layer: ``LN(x + Attn(x))`` then ``LN(h + FFN(h))``.

    ``call(x, attention_bias)``: ``attention_bias`` is the ``[batch, 1, 1, seq]`` additive
    padding bias shared by every layer.
    """

    def __init__(self, config: BertConfig, initializers: Initializers, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        d, self.num_heads = config.hidden_size, config.num_heads
        self.head_size = d // config.num_heads

        def dense(units: int, name: str, activation: str | None = None) -> keras.layers.Dense:
            return keras.layers.Dense(units, activation=activation, name=name,
                                      kernel_initializer=initializers.normal(0.02),
                                      bias_initializer=initializers.zeros())

        self.query, self.key, self.value = dense(d, "query"), dense(d, "key"), dense(d, "value")
        self.attention_output = dense(d, "attention_output")
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="attention_norm")
        self.intermediate = dense(config.intermediate_size, "intermediate", activation="gelu")
        self.output_dense = dense(d, "output")
        self.output_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="output_norm")
        rate = config.dropout_rate
        self.dropout = keras.layers.Dropout(rate, name="dropout") if rate > 0 else None

    def build(self, input_shape: tuple) -> None:
        for layer in (self.query, self.key, self.value, self.attention_output, self.intermediate):
            layer.build(input_shape)
        self.attention_norm.build(input_shape)
        self.output_dense.build(tuple(input_shape[:-1]) + (self.intermediate.units,))
        self.output_norm.build(input_shape)

    def _heads(self, x: Any) -> Any:
        seq = x.shape[1]
        return ops.transpose(ops.reshape(x, (-1, seq, self.num_heads, self.head_size)), (0, 2, 1, 3))

    def _drop(self, x: Any, training: bool | None) -> Any:
        return x if self.dropout is None else self.dropout(x, training=training)

    def call(self, x: Any, attention_bias: Any, training: bool | None = None) -> Any:
        seq = x.shape[1]
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = ops.einsum("bhqd,bhkd->bhqk", q, k) * (self.head_size ** -0.5) + attention_bias
        weights = self._drop(ops.softmax(scores, axis=-1), training)
        context = ops.einsum("bhqk,bhkd->bhqd", weights, v)
        context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, seq, self.num_heads * self.head_size))
        h = self.attention_norm(x + self._drop(self.attention_output(context), training))
        ffn = self.output_dense(self.intermediate(h))
        return self.output_norm(h + self._drop(ffn, training))

    def compute_output_shape(self, x_shape: tuple, attention_bias_shape: tuple) -> tuple:
        return tuple(x_shape)


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned ``[seq, hidden]`` table of absolute positions to its input."""

    def __init__(self, initializer: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._initializer = initializer

    def build(self, input_shape: tuple) -> None:
        self.embeddings = self.add_weight(name="embeddings", shape=tuple(input_shape[1:]),
                                          initializer=self._initializer)

    def call(self, x: Any) -> Any:
        return x + self.embeddings[None]

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)


def _inputs(config: BertConfig) -> list[Any]:
    shape = (config.seq_len,)
    return [keras.Input(shape=shape, dtype="int32", name="token_ids"),
            keras.Input(shape=shape, dtype="int32", name="segment_ids"),
            keras.Input(shape=shape, dtype="int32", name="padding_mask")]


def build_backbone(config: BertConfig, initializers: Initializers) -> tuple[keras.Model, keras.layers.Embedding]:
    """The encoder as a two-output ``keras.Model``: ``[sequence_output, pooled_output]``, and its
    token embedding (for the tied masked-LM decoder)."""
    token_ids, segment_ids, padding_mask = _inputs(config)
    token_embedding = keras.layers.Embedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                             embeddings_initializer=initializers.normal(0.02))
    positions = PositionEmbedding(initializers.normal(0.02), name="position_embedding")
    segments = keras.layers.Embedding(config.type_vocab_size, config.hidden_size, name="segment_embedding",
                                      embeddings_initializer=initializers.normal(0.02))
    h = positions(token_embedding(token_ids)) + segments(segment_ids)
    h = keras.layers.LayerNormalization(epsilon=1e-12, name="embedding_norm")(h)
    if config.dropout_rate > 0:
        h = keras.layers.Dropout(config.dropout_rate, name="embedding_dropout")(h)
    bias = padding_bias(padding_mask)
    for i in range(config.num_layers):
        h = BertLayer(config, initializers, name=f"encoder_layer_{i}")(h, bias)
    pooled = keras.layers.Dense(config.hidden_size, activation="tanh", name="pooler",
                                kernel_initializer=initializers.normal(0.02))(h[:, 0, :])
    backbone = keras.Model([token_ids, segment_ids, padding_mask], [h, pooled], name="bert_backbone")
    return backbone, token_embedding


def build_model(config: BertConfig, *, fast_init: bool = False, seed: int = 0) -> keras.Model:
    """The masked-LM model: backbone, ``Dense(gelu)`` + LayerNorm transform, tied decoder.

    Its output is the ``[batch, seq, vocab]`` logits; the backbone's pooled output is not used.
    """
    if not isinstance(config, BertConfig):
        raise TypeError(f"build_model expects a BertConfig, got {type(config).__name__}.")
    inits = Initializers(seed, fast_init)
    backbone, token_embedding = build_backbone(config, inits)
    inputs = _inputs(config)
    sequence_output, _ = backbone(inputs)
    h = keras.layers.Dense(config.hidden_size, activation="gelu", name="mlm_transform",
                           kernel_initializer=inits.normal(0.02))(sequence_output)
    h = keras.layers.LayerNormalization(epsilon=1e-12, name="mlm_norm")(h)
    logits = TiedLMHead(token_embedding, name="mlm_decoder")(h)
    return keras.Model(inputs, logits, name="bert_mlm")


def param_count(config: BertConfig) -> int:
    """Exact number of weights of ``build_model(config)``, from the config alone."""
    d, ff = config.hidden_size, config.intermediate_size
    embeddings = (config.vocab_size + config.seq_len + config.type_vocab_size) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * (2 * d) + (d * ff + ff) + (ff * d + d)
    pooler = d * d + d
    head = (d * d + d) + 2 * d
    return embeddings + config.num_layers * layer + pooler + head


def input_spec(config: BertConfig, batch_size: int) -> tuple[tf.TensorSpec, ...]:
    """Static ``(token_ids, segment_ids, padding_mask)`` specs for ``batch_size``."""
    require_positive_int("BERT input batch", "batch_size", batch_size)
    shape = (batch_size, config.seq_len)
    return (tf.TensorSpec(shape, tf.int32, name="token_ids"),
            tf.TensorSpec(shape, tf.int32, name="segment_ids"),
            tf.TensorSpec(shape, tf.int32, name="padding_mask"))


def synthetic_batch(config: BertConfig, batch_size: int, seed: int = 0
                    ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random tokens, two segments, and a padding mask that pads the tail of every other
    sequence by a quarter of its length; targets are random token ids. Deterministic per
    ``seed``."""
    require_positive_int("BERT input batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    shape = (batch_size, config.seq_len)
    token_ids = rng.integers(0, config.vocab_size, shape, dtype=np.int32)
    segment_ids = (np.arange(config.seq_len)[None, :] >= config.seq_len // 2).astype(np.int32)
    segment_ids = np.broadcast_to(segment_ids, shape).copy()
    padding_mask = np.ones(shape, np.int32)
    padding_mask[1::2, config.seq_len - max(1, config.seq_len // 4):] = 0
    targets = rng.integers(0, config.vocab_size, shape, dtype=np.int32)
    return (token_ids, segment_ids, padding_mask), targets
