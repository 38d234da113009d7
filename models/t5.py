"""T5 encoder-decoder transformer (Raffel et al., 2020) in Keras 3.

The dense-transformer family of the TAPAS experiments (paper section 5): TAPAS
scales T5 along depth, so the repeated block structure must be real. Each
encoder/decoder block is one :class:`T5Block` Keras layer, built by the same
code path; only block 0 of each stack differs, because it owns the relative
position bias table and computes the bias that every later block of the stack
reuses (as T5 does).

Architecture (original T5, "v1.0" when ``feed_forward="relu"``; the v1.1
gated-GELU feed-forward is available too):

* one shared token embedding (``keras.layers.Embedding``) for encoder and
  decoder inputs;
* pre-norm residual blocks with T5's RMS norm (:class:`RMSNorm`: a ``scale``
  weight, no bias, no mean subtraction);
* attention projections ``q, k, v, o`` as ``Dense(use_bias=False)``; scores are
  *not* scaled by ``1/sqrt(d_kv)`` (T5 folds that into the initialisation);
* relative position bias: an embedding of shape ``[num_buckets, num_heads]``
  in block 0's self-attention, bidirectional buckets in the encoder,
  unidirectional (causal) buckets in the decoder. The bucket indices depend
  only on the static sequence lengths and are computed with NumPy at trace
  time, so they appear in the graph as constants;
* the decoder self-attention adds a causal mask (folded into the bias that
  block 0 hands on), and every decoder block has cross-attention over the
  final encoder states (no position bias there, as in T5);
* feed-forward ``wi -> relu -> wo`` or ``(gelu(wi_0) * wi_1) -> wo``;
* final RMS norms after each stack; LM head = tied embedding transpose applied
  to ``hidden * d_model**-0.5``, or a separate ``Dense`` when untied.

There is no padding mask: every token of the fixed-length inputs is attended
to (TAPAS works on synthetic fixed-shape batches).

Layer names (Keras forbids ``/`` inside one name, so the stack prefix is joined
with ``_``): ``shared_embedding``, ``encoder_block_{i}``, ``encoder_final_norm``,
``decoder_block_{i}``, ``decoder_final_norm``, ``lm_head``. Inside a block:
``self_attention_norm``, ``self_attention`` (with ``q k v o`` and, in block 0,
the weight ``relative_attention_bias``), ``cross_attention_norm``,
``cross_attention``, ``ffn_norm``, ``ffn`` (``wi`` / ``wi_0 wi_1``, ``wo``).
Variable paths and TF name scopes therefore read e.g.
``encoder_block_3/self_attention/q/kernel``.

Inputs: ``encoder_input_ids`` int32 ``[B, encoder_seq_len]`` and
``decoder_input_ids`` int32 ``[B, decoder_seq_len]``; output: logits float32
``[B, decoder_seq_len, vocab_size]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from ._common import (
    Initializers,
    TiedLMHead,
    causal_mask_bias,
    padding_bias,
    require_positive_int,
    require_probability,
)

__all__ = [
    "T5Config",
    "RMSNorm",
    "T5Attention",
    "T5FeedForward",
    "T5Block",
    "T5TapasBlock",
    "T5PositionBias",
    "relative_position_buckets",
    "build_model",
    "param_count",
    "input_spec",
    "synthetic_batch",
]

FeedForwardKind = Literal["relu", "gated-gelu"]
_FEED_FORWARD_KINDS = ("relu", "gated-gelu")
# "keras": blocks of plain Keras layers (TAPAS discovers their structure by capture);
# "tapas": the same blocks from tapas.layers (each sub-layer one GraphNode by construction).
LayerImpl = Literal["keras", "tapas"]
LAYER_IMPLS = ("keras", "tapas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5Config:
    """Hyper-parameters of a T5 model (names follow the T5 / HF T5 configs).

    Attributes:
        num_layers: encoder blocks.
        num_decoder_layers: decoder blocks.
        d_model: hidden size.
        d_ff: feed-forward inner size.
        num_heads: attention heads.
        d_kv: size of one head (``num_heads * d_kv`` need not equal ``d_model``).
        vocab_size: token vocabulary (shared by encoder, decoder and LM head).
        relative_attention_num_buckets: buckets of the relative position bias.
        relative_attention_max_distance: distance beyond which all relative
            positions share the last bucket.
        feed_forward: ``"relu"`` (T5 v1.0: ``wi``, ``wo``) or ``"gated-gelu"``
            (T5 v1.1: ``wi_0``, ``wi_1``, ``wo``).
        dropout_rate: dropout on embeddings, sub-layer outputs and the FFN
            activation; 0.0 creates no dropout layers at all.
        encoder_seq_len: static encoder input length.
        decoder_seq_len: static decoder input length.
        tie_embeddings: LM head reuses the token embedding (scaled by
            ``d_model**-0.5``); False adds a separate ``lm_head`` Dense.
        padding_mask: the model also takes ``encoder_padding_mask`` and
            ``decoder_padding_mask`` inputs (1 = token, 0 = padding), turned into
            additive attention biases once per stack and read by every attention
            layer (self-attention, and the decoder's cross-attention over the
            encoder's padding), as T5 implementations written for batched text do.
            Only with ``layer_impl="keras"``.
        layer_impl: ``"keras"`` (plain Keras layers) or ``"tapas"`` (the same
            architecture from ``tapas.layers``: RMS ``LayerNorm``,
            ``MultiHeadAttention`` fed the position bias, ``FeedForward``; same
            parameter count; one initializer per attention layer and exact
            rather than tanh-approximated GELU in the gated FFN).
    """

    num_layers: int
    num_decoder_layers: int
    d_model: int
    d_ff: int
    num_heads: int
    d_kv: int
    vocab_size: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward: FeedForwardKind = "relu"
    dropout_rate: float = 0.0
    encoder_seq_len: int = 128
    decoder_seq_len: int = 128
    tie_embeddings: bool = True
    padding_mask: bool = False
    layer_impl: LayerImpl = "keras"

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "num_decoder_layers",
            "d_model",
            "d_ff",
            "num_heads",
            "d_kv",
            "vocab_size",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
            "encoder_seq_len",
            "decoder_seq_len",
        ):
            require_positive_int("T5Config", field, getattr(self, field))
        if self.feed_forward not in _FEED_FORWARD_KINDS:
            raise ValueError(
                f"T5Config.feed_forward must be one of {_FEED_FORWARD_KINDS}, got {self.feed_forward!r}."
            )
        require_probability("T5Config", "dropout_rate", self.dropout_rate)
        if self.relative_attention_num_buckets < 4 or self.relative_attention_num_buckets % 2:
            raise ValueError(
                "T5Config.relative_attention_num_buckets must be an even int >= 4 (the encoder splits the "
                f"buckets between both directions), got {self.relative_attention_num_buckets}; T5 uses 32."
            )
        # The largest "exact" bucket range is num_buckets // 2 (decoder); the
        # log-spaced buckets need max_distance beyond it.
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
            raise ValueError(
                "T5Config.relative_attention_max_distance must exceed relative_attention_num_buckets // 2 = "
                f"{self.relative_attention_num_buckets // 2}, got {self.relative_attention_max_distance}; "
                "T5 uses 128."
            )
        if self.layer_impl not in LAYER_IMPLS:
            raise ValueError(f"T5Config.layer_impl must be one of {LAYER_IMPLS}, got {self.layer_impl!r}.")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"T5Config.tie_embeddings must be a bool, got {self.tie_embeddings!r}.")
        if not isinstance(self.padding_mask, bool):
            raise ValueError(f"T5Config.padding_mask must be a bool, got {self.padding_mask!r}.")
        if self.padding_mask and self.layer_impl != "keras":
            raise ValueError(
                "T5Config.padding_mask=True needs layer_impl='keras': the tapas.layers variant takes no "
                "padding masks; drop the masks or use the Keras layers."
            )


# --------------------------------------------------------------------------- #
# Relative position buckets (NumPy, static shapes)
# --------------------------------------------------------------------------- #


def relative_position_buckets(
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
) -> np.ndarray:
    """T5 relative-position bucket of every (query, key) pair, shape ``[query_length, key_length]``.

    Distances below ``max_exact = num_buckets // 2`` (halved first when
    ``bidirectional``) get one bucket each; larger distances share
    log-spaced buckets up to ``max_distance``, beyond which everything falls in
    the last bucket. Bidirectional buckets use the upper half of the range for
    keys *after* the query; unidirectional (decoder) buckets map every future
    key to bucket 0 (the causal mask hides those keys anyway).
    """
    query_pos = np.arange(query_length, dtype=np.int64)[:, None]
    key_pos = np.arange(key_length, dtype=np.int64)[None, :]
    relative = key_pos - query_pos  # > 0: the key lies after the query
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).astype(np.int64) * num_buckets
        distance = np.abs(relative)
    else:
        distance = np.maximum(-relative, 0)
    max_exact = num_buckets // 2
    # Computed in float32, like the reference implementation, so boundary
    # distances land in the same buckets.
    scaled = np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(max_exact)) / np.float32(
        math.log(max_distance / max_exact)
    )
    large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets.astype(np.int32)


# --------------------------------------------------------------------------- #
# Layers
# --------------------------------------------------------------------------- #


class RMSNorm(keras.layers.Layer):
    """T5 layer norm: ``x / sqrt(mean(x^2) + eps) * scale`` (no bias, no centring)."""

    def __init__(self, epsilon: float = 1e-6, scale_initializer: Any = "ones", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.scale_initializer = keras.initializers.get(scale_initializer)

    def build(self, input_shape: tuple) -> None:
        self.scale = self.add_weight(name="scale", shape=(input_shape[-1],), initializer=self.scale_initializer)

    def call(self, x: Any) -> Any:
        variance = ops.mean(ops.square(x), axis=-1, keepdims=True)
        return x * ops.rsqrt(variance + self.epsilon) * self.scale

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)


def _projection(initializers: Initializers, units: int, stddev: float, name: str) -> keras.layers.Dense:
    """A bias-free Dense with T5's normal initialiser (Mesh TF: stddev from the fan-in)."""
    return keras.layers.Dense(
        units, use_bias=False, kernel_initializer=initializers.normal(stddev), name=name
    )


def _bias_from_buckets(table: Any, buckets: np.ndarray, causal: bool, query_length: int) -> Any:
    """``[1, heads, q, k]`` bias: rows of ``table [num_buckets, heads]`` (+ causal mask)."""
    values = ops.take(table, buckets, axis=0)  # [q, k, heads]
    bias = ops.expand_dims(ops.transpose(values, (2, 0, 1)), axis=0)
    if causal:
        bias = bias + causal_mask_bias(query_length)
    return bias


def _static_length(tensor: Any, what: str) -> int:
    length = tensor.shape[1]
    if length is None:
        raise ValueError(
            f"T5 needs a static sequence length for the {what}, got shape {tuple(tensor.shape)}; "
            "build the model with fixed encoder_seq_len / decoder_seq_len."
        )
    return int(length)


class T5Attention(keras.layers.Layer):
    """Multi-head attention with T5's bias-free projections.

    ``call(hidden_states, key_value_states=None, position_bias=None)`` returns
    ``(output, position_bias)``. With ``has_relative_attention_bias`` the layer
    owns ``relative_attention_bias`` ``[num_buckets, num_heads]`` and computes
    the bias itself (plus the causal mask when ``causal``), ignoring the
    ``position_bias`` argument; otherwise it adds the given bias (if any) and
    returns it unchanged.

    Args:
        d_model, num_heads, d_kv: sizes (see :class:`T5Config`).
        dropout_rate: dropout on the attention probabilities.
        initializers: the build's :class:`Initializers`.
        has_relative_attention_bias: own and compute the relative bias.
        bidirectional: bucket both directions (encoder) or only the past
            (decoder).
        causal: add the causal mask to the computed bias.
        num_buckets, max_distance: relative-position bucketing parameters.
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        d_kv: int,
        dropout_rate: float,
        initializers: Initializers,
        has_relative_attention_bias: bool = False,
        bidirectional: bool = True,
        causal: bool = False,
        num_buckets: int = 32,
        max_distance: int = 128,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.d_kv = d_kv
        self.has_relative_attention_bias = has_relative_attention_bias
        self.bidirectional = bidirectional
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        inner = num_heads * d_kv
        # T5's initialisation (Mesh TF): the missing 1/sqrt(d_kv) score scaling
        # is folded into the query initialiser.
        self.q = _projection(initializers, inner, (d_model * d_kv) ** -0.5, "q")
        self.k = _projection(initializers, inner, d_model**-0.5, "k")
        self.v = _projection(initializers, inner, d_model**-0.5, "v")
        self.o = _projection(initializers, d_model, inner**-0.5, "o")
        self.dropout = keras.layers.Dropout(dropout_rate, name="dropout") if dropout_rate > 0 else None
        self._bias_initializer = initializers.normal(1.0) if has_relative_attention_bias else None

    def build(self, input_shape: tuple) -> None:
        # Keys and values come from d_model-wide states as well (the decoder's
        # own or the encoder outputs), so one input shape builds q, k and v.
        for projection in (self.q, self.k, self.v):
            projection.build(input_shape)
        self.o.build(tuple(input_shape[:-1]) + (self.num_heads * self.d_kv,))
        if self.has_relative_attention_bias:
            self.relative_attention_bias = self.add_weight(
                name="relative_attention_bias",
                shape=(self.num_buckets, self.num_heads),
                initializer=self._bias_initializer,
            )

    def compute_position_bias(self, query_length: int, key_length: int) -> Any:
        """Relative bias (+ causal mask) as a ``[1, num_heads, query_length, key_length]`` tensor."""
        buckets = relative_position_buckets(
            query_length,
            key_length,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return _bias_from_buckets(self.relative_attention_bias, buckets, self.causal, query_length)

    def _split_heads(self, x: Any, length: int) -> Any:
        x = ops.reshape(x, (-1, length, self.num_heads, self.d_kv))
        return ops.transpose(x, (0, 2, 1, 3))  # [batch, heads, length, d_kv]

    def call(
        self,
        hidden_states: Any,
        key_value_states: Any = None,
        position_bias: Any = None,
        mask_bias: Any = None,
        training: bool | None = None,
    ) -> tuple[Any, Any]:
        kv_states = hidden_states if key_value_states is None else key_value_states
        q_len = _static_length(hidden_states, "attention queries")
        k_len = _static_length(kv_states, "attention keys")
        q = self._split_heads(self.q(hidden_states), q_len)
        k = self._split_heads(self.k(kv_states), k_len)
        v = self._split_heads(self.v(kv_states), k_len)
        scores = ops.einsum("bhqd,bhkd->bhqk", q, k)
        if self.has_relative_attention_bias:
            position_bias = self.compute_position_bias(q_len, k_len)
        if position_bias is not None:
            scores = scores + position_bias
        if mask_bias is not None:
            scores = scores + mask_bias
        weights = ops.softmax(scores, axis=-1)
        if self.dropout is not None:
            weights = self.dropout(weights, training=training)
        context = ops.einsum("bhqk,bhkd->bhqd", weights, v)
        context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, q_len, self.num_heads * self.d_kv))
        return self.o(context), position_bias


class T5FeedForward(keras.layers.Layer):
    """T5 feed-forward: ``wo(relu(wi(x)))`` or ``wo(gelu(wi_0(x)) * wi_1(x))``."""

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        kind: FeedForwardKind,
        dropout_rate: float,
        initializers: Initializers,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if kind not in _FEED_FORWARD_KINDS:
            raise ValueError(f"feed-forward kind must be one of {_FEED_FORWARD_KINDS}, got {kind!r}.")
        self.kind = kind
        if kind == "relu":
            self.wi = _projection(initializers, d_ff, d_model**-0.5, "wi")
        else:
            self.wi_0 = _projection(initializers, d_ff, d_model**-0.5, "wi_0")
            self.wi_1 = _projection(initializers, d_ff, d_model**-0.5, "wi_1")
        self.wo = _projection(initializers, d_model, d_ff**-0.5, "wo")
        self.dropout = keras.layers.Dropout(dropout_rate, name="dropout") if dropout_rate > 0 else None

    def build(self, input_shape: tuple) -> None:
        inputs = (self.wi,) if self.kind == "relu" else (self.wi_0, self.wi_1)
        for layer in inputs:
            layer.build(input_shape)
        self.wo.build(tuple(input_shape[:-1]) + (inputs[0].units,))

    def call(self, x: Any, training: bool | None = None) -> Any:
        if self.kind == "relu":
            h = ops.relu(self.wi(x))
        else:
            h = ops.gelu(self.wi_0(x), approximate=True) * self.wi_1(x)
        if self.dropout is not None:
            h = self.dropout(h, training=training)
        return self.wo(h)


class T5Block(keras.layers.Layer):
    """One pre-norm T5 block: self-attention, (decoder) cross-attention, feed-forward.

    ``call(hidden_states, position_bias=None, encoder_outputs=None)``:

    * a block with ``has_relative_attention_bias`` (block 0 of a stack)
      computes the self-attention bias and returns ``(hidden_states,
      position_bias)`` so the caller can hand the bias to later blocks;
    * every other block takes that bias and returns ``hidden_states`` only.

    Decoder blocks (``is_decoder``) require ``encoder_outputs``.
    """

    def __init__(
        self,
        config: T5Config,
        *,
        is_decoder: bool,
        has_relative_attention_bias: bool,
        initializers: Initializers,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        attention_args = dict(
            d_model=config.d_model,
            num_heads=config.num_heads,
            d_kv=config.d_kv,
            dropout_rate=config.dropout_rate,
            initializers=initializers,
            num_buckets=config.relative_attention_num_buckets,
            max_distance=config.relative_attention_max_distance,
        )
        self.self_attention_norm = RMSNorm(scale_initializer=initializers.ones(), name="self_attention_norm")
        self.self_attention = T5Attention(
            has_relative_attention_bias=has_relative_attention_bias,
            bidirectional=not is_decoder,
            causal=is_decoder,
            name="self_attention",
            **attention_args,
        )
        if is_decoder:
            self.cross_attention_norm = RMSNorm(
                scale_initializer=initializers.ones(), name="cross_attention_norm"
            )
            self.cross_attention = T5Attention(name="cross_attention", **attention_args)
        self.ffn_norm = RMSNorm(scale_initializer=initializers.ones(), name="ffn_norm")
        self.ffn = T5FeedForward(
            d_model=config.d_model,
            d_ff=config.d_ff,
            kind=config.feed_forward,
            dropout_rate=config.dropout_rate,
            initializers=initializers,
            name="ffn",
        )
        self.dropout = (
            keras.layers.Dropout(config.dropout_rate, name="dropout") if config.dropout_rate > 0 else None
        )

    def build(self, input_shape: tuple) -> None:
        # Explicit build: every sub-layer only needs the d_model-wide shape, so
        # functional construction needs no symbolic trace of call().
        self.self_attention_norm.build(input_shape)
        self.self_attention.build(input_shape)
        if self.is_decoder:
            self.cross_attention_norm.build(input_shape)
            self.cross_attention.build(input_shape)
        self.ffn_norm.build(input_shape)
        self.ffn.build(input_shape)

    def compute_output_shape(self, input_shape: tuple) -> Any:
        hidden_shape = tuple(input_shape)
        if self.has_relative_attention_bias:
            length = hidden_shape[1]
            return hidden_shape, (1, self.self_attention.num_heads, length, length)
        return hidden_shape

    def _residual(self, hidden_states: Any, update: Any, training: bool | None) -> Any:
        if self.dropout is not None:
            update = self.dropout(update, training=training)
        return hidden_states + update

    def call(
        self,
        hidden_states: Any,
        position_bias: Any = None,
        encoder_outputs: Any = None,
        self_mask_bias: Any = None,
        cross_mask_bias: Any = None,
        training: bool | None = None,
    ) -> Any:
        if not self.has_relative_attention_bias and position_bias is None:
            raise ValueError(
                f"{self.name}: blocks after block 0 need the position_bias computed by block 0; pass it as "
                "position_bias=."
            )
        if self.is_decoder and encoder_outputs is None:
            raise ValueError(f"{self.name}: decoder blocks need encoder_outputs for cross-attention.")
        attended, position_bias = self.self_attention(
            self.self_attention_norm(hidden_states),
            position_bias=position_bias,
            mask_bias=self_mask_bias,
            training=training,
        )
        hidden_states = self._residual(hidden_states, attended, training)
        if self.is_decoder:
            crossed, _ = self.cross_attention(
                self.cross_attention_norm(hidden_states),
                key_value_states=encoder_outputs,
                mask_bias=cross_mask_bias,
                training=training,
            )
            hidden_states = self._residual(hidden_states, crossed, training)
        transformed = self.ffn(self.ffn_norm(hidden_states), training=training)
        hidden_states = self._residual(hidden_states, transformed, training)
        if self.has_relative_attention_bias:
            return hidden_states, position_bias
        return hidden_states


class T5PositionBias(keras.layers.Layer):
    """Block 0's relative position bias (+ causal mask) for the ``tapas`` layer variant.

    ``call(hidden_states)`` returns ``[1, num_heads, length, length]``; it owns
    ``relative_attention_bias`` ``[num_buckets, num_heads]`` as :class:`T5Attention` does.
    """

    def __init__(self, *, num_heads: int, bidirectional: bool, causal: bool, num_buckets: int,
                 max_distance: int, initializer: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_heads, self.bidirectional, self.causal = num_heads, bidirectional, causal
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self._initializer = initializer

    def build(self, input_shape: tuple) -> None:
        self.relative_attention_bias = self.add_weight(
            name="relative_attention_bias", shape=(self.num_buckets, self.num_heads),
            initializer=self._initializer)

    def call(self, hidden_states: Any) -> Any:
        length = _static_length(hidden_states, "attention queries")
        buckets = relative_position_buckets(length, length, bidirectional=self.bidirectional,
                                            num_buckets=self.num_buckets,
                                            max_distance=self.max_distance)
        return _bias_from_buckets(self.relative_attention_bias, buckets, self.causal, length)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return (1, self.num_heads, input_shape[1], input_shape[1])


class T5TapasBlock(T5Block):
    """:class:`T5Block` built from ``tapas.layers`` (``T5Config.layer_impl="tapas"``).

    Same sub-layer names, call convention and parameter count; attention and feed-forward
    are one GraphNode each by construction, and block 0's position bias is a separate
    :class:`T5PositionBias` layer whose output every self-attention of the stack adds.
    """

    def __init__(self, config: T5Config, *, is_decoder: bool, has_relative_attention_bias: bool,
                 initializers: Initializers, **kwargs: Any) -> None:
        keras.layers.Layer.__init__(self, **kwargs)
        from tapas import layers as tl

        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        d, heads = config.d_model, config.num_heads

        def attention(name: str) -> Any:
            return tl.MultiHeadAttention(heads, config.d_kv, use_bias=False, scale=False,
                                         kernel_initializer=initializers.normal(d**-0.5),
                                         name=name)

        def norm(name: str) -> Any:
            return tl.LayerNorm(epsilon=1e-6, rms=True, name=name)

        self.self_attention_norm = norm("self_attention_norm")
        self.self_attention = attention("self_attention")
        self.relative_position = (T5PositionBias(
            num_heads=heads, bidirectional=not is_decoder, causal=is_decoder,
            num_buckets=config.relative_attention_num_buckets,
            max_distance=config.relative_attention_max_distance,
            initializer=initializers.normal(1.0), name="relative_position")
            if has_relative_attention_bias else None)
        if is_decoder:
            self.cross_attention_norm = norm("cross_attention_norm")
            self.cross_attention = attention("cross_attention")
        self.ffn_norm = norm("ffn_norm")
        gated = config.feed_forward == "gated-gelu"
        self.ffn = tl.FeedForward(config.d_ff, activation="gelu" if gated else "relu",
                                  use_bias=False, gated=gated,
                                  kernel_initializer=initializers.normal(d**-0.5), name="ffn")
        self.dropout = (keras.layers.Dropout(config.dropout_rate, name="dropout")
                        if config.dropout_rate > 0 else None)

    def build(self, input_shape: tuple) -> None:
        self.self_attention_norm.build(input_shape)
        self.self_attention.build(input_shape)
        if self.relative_position is not None:
            self.relative_position.build(input_shape)
        if self.is_decoder:
            self.cross_attention_norm.build(input_shape)
            self.cross_attention.build(input_shape, input_shape)
        self.ffn_norm.build(input_shape)
        self.ffn.build(input_shape)

    def call(self, hidden_states: Any, position_bias: Any = None, encoder_outputs: Any = None,
             training: bool | None = None) -> Any:
        if self.relative_position is None and position_bias is None:
            raise ValueError(f"{self.name}: blocks after block 0 need the position_bias computed "
                             "by block 0; pass it as position_bias=.")
        if self.is_decoder and encoder_outputs is None:
            raise ValueError(f"{self.name}: decoder blocks need encoder_outputs for "
                             "cross-attention.")
        if self.relative_position is not None:
            position_bias = self.relative_position(hidden_states)
        attended = self.self_attention(self.self_attention_norm(hidden_states),
                                       bias=position_bias)
        hidden_states = self._residual(hidden_states, attended, training)
        if self.is_decoder:
            crossed = self.cross_attention(self.cross_attention_norm(hidden_states),
                                           encoder_outputs)
            hidden_states = self._residual(hidden_states, crossed, training)
        transformed = self.ffn(self.ffn_norm(hidden_states))
        hidden_states = self._residual(hidden_states, transformed, training)
        if self.relative_position is not None:
            return hidden_states, position_bias
        return hidden_states


# --------------------------------------------------------------------------- #
# Model builder and family API (used by the registry)
# --------------------------------------------------------------------------- #


def _run_stack(
    config: T5Config,
    hidden_states: Any,
    *,
    is_decoder: bool,
    num_blocks: int,
    initializers: Initializers,
    encoder_outputs: Any = None,
    masks: dict[str, Any] | None = None,
) -> Any:
    prefix = "decoder" if is_decoder else "encoder"
    masks = masks or {}
    position_bias = None
    block_class = T5TapasBlock if config.layer_impl == "tapas" else T5Block
    for i in range(num_blocks):
        block = block_class(
            config,
            is_decoder=is_decoder,
            has_relative_attention_bias=(i == 0),
            initializers=initializers,
            name=f"{prefix}_block_{i}",
        )
        if i == 0:
            hidden_states, position_bias = block(hidden_states, encoder_outputs=encoder_outputs, **masks)
        else:
            hidden_states = block(
                hidden_states, position_bias=position_bias, encoder_outputs=encoder_outputs, **masks
            )
    if config.layer_impl == "tapas":
        from tapas import layers as tl

        final_norm = tl.LayerNorm(epsilon=1e-6, rms=True, name=f"{prefix}_final_norm")
    else:
        final_norm = RMSNorm(scale_initializer=initializers.ones(), name=f"{prefix}_final_norm")
    hidden_states = final_norm(hidden_states)
    if config.dropout_rate > 0:
        hidden_states = keras.layers.Dropout(config.dropout_rate, name=f"{prefix}_final_dropout")(hidden_states)
    return hidden_states


def build_model(config: T5Config, *, fast_init: bool = False, seed: int = 0) -> keras.Model:
    """Build the functional T5 ``keras.Model`` described by ``config``.

    Args:
        config: model hyper-parameters.
        fast_init: initialise every weight with zeros (structure-only use).
        seed: base seed of the random initialisers (ignored with ``fast_init``).
    """
    if not isinstance(config, T5Config):
        raise TypeError(f"build_model expects a T5Config, got {type(config).__name__}.")
    inits = Initializers(seed, fast_init)
    encoder_ids = keras.Input(shape=(config.encoder_seq_len,), dtype="int32", name="encoder_input_ids")
    decoder_ids = keras.Input(shape=(config.decoder_seq_len,), dtype="int32", name="decoder_input_ids")
    inputs = [encoder_ids, decoder_ids]
    encoder_masks: dict[str, Any] = {}
    decoder_masks: dict[str, Any] = {}
    if config.padding_mask:
        encoder_mask = keras.Input(shape=(config.encoder_seq_len,), dtype="int32", name="encoder_padding_mask")
        decoder_mask = keras.Input(shape=(config.decoder_seq_len,), dtype="int32", name="decoder_padding_mask")
        inputs += [encoder_mask, decoder_mask]
        encoder_bias = padding_bias(encoder_mask)  # once per stack; every layer reads it
        encoder_masks = {"self_mask_bias": encoder_bias}
        decoder_masks = {"self_mask_bias": padding_bias(decoder_mask), "cross_mask_bias": encoder_bias}

    if config.layer_impl == "tapas":
        from tapas import layers as tl

        embedding = tl.Embedding(config.vocab_size, config.d_model,
                                 embeddings_initializer=inits.normal(1.0), name="shared_embedding")
    else:
        embedding = keras.layers.Embedding(
            config.vocab_size, config.d_model, embeddings_initializer=inits.normal(1.0), name="shared_embedding"
        )

    def embed(ids: Any, prefix: str) -> Any:
        h = embedding(ids)
        if config.dropout_rate > 0:
            h = keras.layers.Dropout(config.dropout_rate, name=f"{prefix}_embedding_dropout")(h)
        return h

    encoder_outputs = _run_stack(
        config,
        embed(encoder_ids, "encoder"),
        is_decoder=False,
        num_blocks=config.num_layers,
        initializers=inits,
        masks=encoder_masks,
    )
    decoder_outputs = _run_stack(
        config,
        embed(decoder_ids, "decoder"),
        is_decoder=True,
        num_blocks=config.num_decoder_layers,
        initializers=inits,
        encoder_outputs=encoder_outputs,
        masks=decoder_masks,
    )
    if config.tie_embeddings:
        logits = TiedLMHead(embedding, scale=config.d_model**-0.5, name="lm_head")(decoder_outputs)
    else:
        logits = keras.layers.Dense(
            config.vocab_size,
            use_bias=False,
            kernel_initializer=inits.normal(config.d_model**-0.5),
            name="lm_head",
        )(decoder_outputs)
    return keras.Model(inputs=inputs, outputs=logits, name="t5")


def param_count(config: T5Config) -> int:
    """Exact number of weights of ``build_model(config)``, computed from the config alone."""
    d, heads = config.d_model, config.num_heads
    attention = 4 * d * heads * config.d_kv
    ffn = (2 if config.feed_forward == "relu" else 3) * d * config.d_ff
    bias_table = config.relative_attention_num_buckets * heads
    encoder = config.num_layers * (2 * d + attention + ffn) + bias_table + d
    decoder = config.num_decoder_layers * (3 * d + 2 * attention + ffn) + bias_table + d
    head = 0 if config.tie_embeddings else d * config.vocab_size
    return config.vocab_size * d + encoder + decoder + head


def input_spec(config: T5Config, batch_size: int) -> tuple[tf.TensorSpec, ...]:
    """Static ``(encoder_input_ids, decoder_input_ids)`` specs for ``batch_size``, followed by
    ``(encoder_padding_mask, decoder_padding_mask)`` when ``config.padding_mask``."""
    require_positive_int("T5 input batch", "batch_size", batch_size)
    enc, dec = (batch_size, config.encoder_seq_len), (batch_size, config.decoder_seq_len)
    specs = (
        tf.TensorSpec(enc, tf.int32, name="encoder_input_ids"),
        tf.TensorSpec(dec, tf.int32, name="decoder_input_ids"),
    )
    if config.padding_mask:
        specs += (
            tf.TensorSpec(enc, tf.int32, name="encoder_padding_mask"),
            tf.TensorSpec(dec, tf.int32, name="decoder_padding_mask"),
        )
    return specs


def synthetic_batch(
    config: T5Config, batch_size: int, seed: int = 0
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random token batch for teacher-forced training, deterministic per ``seed``.

    Returns ``((encoder_input_ids, decoder_input_ids), targets)``; the decoder
    inputs are the targets shifted right by one with start token 0, as in T5.
    With ``config.padding_mask`` the inputs also hold the two padding masks.
    """
    require_positive_int("T5 input batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    encoder_ids = rng.integers(0, config.vocab_size, (batch_size, config.encoder_seq_len), dtype=np.int32)
    targets = rng.integers(0, config.vocab_size, (batch_size, config.decoder_seq_len), dtype=np.int32)
    decoder_ids = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
    if not config.padding_mask:
        return (encoder_ids, decoder_ids), targets
    # every other sequence padded over its last quarter (encoder and decoder alike)
    masks = []
    for length in (config.encoder_seq_len, config.decoder_seq_len):
        mask = np.ones((batch_size, length), np.int32)
        mask[1::2, length - max(1, length // 4):] = 0
        masks.append(mask)
    return (encoder_ids, decoder_ids, *masks), targets
