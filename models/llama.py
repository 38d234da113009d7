"""GPT/Llama-style decoder (Touvron et al., 2023; Llama 3.2 sizes), in Keras 3.

What it brings to the zoo: pre-norm residual blocks with RMSNorm, rotary position
embeddings (one ``(cos, sin)`` table computed once and read by every layer), grouped-query
attention (fewer key/value heads than query heads, each key/value head shared by
``num_heads / num_kv_heads`` query heads), q/k/v projections either separate (``q``, ``k``,
``v``) or fused into one matrix (``qkv``, as GPT-2 and many checkpoints store them), a
SwiGLU feed-forward (``gate``, ``up``, ``down``), and a causal + padding attention bias
built once from a padding-mask input and read by every layer.

Only ``keras.ops`` is used, so the model builds under any Keras backend.

Family API used by the registry: :class:`LlamaConfig`, :func:`build_model`,
:func:`input_spec`, :func:`synthetic_batch` and :func:`param_count`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from ._common import (Initializers, TiedLMHead, causal_mask_bias, padding_bias, require_positive_int)
from .t5 import RMSNorm

__all__ = ["LlamaConfig", "LlamaBlock", "RotaryTables", "build_model", "input_spec", "synthetic_batch",
           "param_count"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-style decoder (names follow the Llama configs).

    Attributes:
        num_layers: decoder blocks.
        hidden_size: width of the residual stream.
        num_heads: query heads.
        num_kv_heads: key/value heads; must divide ``num_heads`` (equal: plain multi-head
            attention; fewer: grouped-query attention).
        intermediate_size: SwiGLU inner size.
        vocab_size: token vocabulary.
        seq_len: static sequence length.
        fused_qkv: one ``qkv`` projection instead of separate ``q``, ``k``, ``v``.
        tie_embeddings: the LM head reuses the token embedding (Llama 3.2 1B does).
        rope_theta: base of the rotary frequencies.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int = 128
    fused_qkv: bool = False
    tie_embeddings: bool = True
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                      "vocab_size", "seq_len"):
            require_positive_int("LlamaConfig", field, getattr(self, field))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"LlamaConfig.hidden_size={self.hidden_size} must split into num_heads="
                             f"{self.num_heads} heads of an even size (rotary pairs); e.g. 2048 / 32.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide num_heads="
                             f"{self.num_heads} (each key/value head serves a group of query heads).")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


class RotaryTables(keras.layers.Layer):
    """``call(hidden_states)`` -> ``(cos, sin)``, each ``[seq, head_size]``: the rotary
    angles of every position, computed once per model and read by every block."""

    def __init__(self, head_size: int, theta: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head_size, self.theta = head_size, float(theta)

    def call(self, hidden_states: Any) -> tuple[Any, Any]:
        seq = hidden_states.shape[1]
        inv_freq = 1.0 / (self.theta ** (ops.arange(0, self.head_size, 2, dtype="float32") / self.head_size))
        angles = ops.einsum("s,f->sf", ops.arange(seq, dtype="float32"), inv_freq)
        angles = ops.concatenate([angles, angles], axis=-1)
        return ops.cos(angles), ops.sin(angles)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        shape = (input_shape[1], self.head_size)
        return shape, shape


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Apply the rotary embedding to ``x`` ``[batch, seq, heads, head_size]``."""
    half = x.shape[-1] // 2
    rotated = ops.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class LlamaBlock(keras.layers.Layer):
    """One pre-norm block: ``h = x + Attn(RMSNorm(x))``, ``out = h + SwiGLU(RMSNorm(h))``.

    ``call(x, attention_bias, cos, sin)``: the ``[batch, 1, seq, seq]`` causal + padding bias
    and the rotary tables, all shared by every block.
    """

    def __init__(self, config: LlamaConfig, initializers: Initializers, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config
        d, hd = config.hidden_size, config.head_size

        def dense(units: int, name: str) -> keras.layers.Dense:
            return keras.layers.Dense(units, use_bias=False, name=name,
                                      kernel_initializer=initializers.normal(0.02))

        if config.fused_qkv:
            self.qkv = dense((config.num_heads + 2 * config.num_kv_heads) * hd, "qkv")
        else:
            self.q = dense(config.num_heads * hd, "q")
            self.k, self.v = dense(config.num_kv_heads * hd, "k"), dense(config.num_kv_heads * hd, "v")
        self.o = dense(d, "o")
        self.gate, self.up = dense(config.intermediate_size, "gate"), dense(config.intermediate_size, "up")
        self.down = dense(d, "down")
        self.attention_norm = RMSNorm(epsilon=1e-5, scale_initializer=initializers.ones(), name="attention_norm")
        self.ffn_norm = RMSNorm(epsilon=1e-5, scale_initializer=initializers.ones(), name="ffn_norm")

    def build(self, input_shape: tuple) -> None:
        c = self.config
        projections = (self.qkv,) if c.fused_qkv else (self.q, self.k, self.v)
        for layer in (*projections, self.gate, self.up):
            layer.build(input_shape)
        self.o.build(tuple(input_shape[:-1]) + (c.num_heads * c.head_size,))
        self.down.build(tuple(input_shape[:-1]) + (c.intermediate_size,))
        self.attention_norm.build(input_shape)
        self.ffn_norm.build(input_shape)

    def _project(self, x: Any) -> tuple[Any, Any, Any]:
        c, seq = self.config, x.shape[1]
        if c.fused_qkv:
            qkv = self.qkv(x)
            q_width, kv_width = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
            q, k, v = (qkv[..., :q_width], qkv[..., q_width:q_width + kv_width],
                       qkv[..., q_width + kv_width:])
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return (ops.reshape(q, (-1, seq, c.num_heads, c.head_size)),
                ops.reshape(k, (-1, seq, c.num_kv_heads, c.head_size)),
                ops.reshape(v, (-1, seq, c.num_kv_heads, c.head_size)))

    def _attention(self, x: Any, bias: Any, cos: Any, sin: Any) -> Any:
        c, seq = self.config, x.shape[1]
        q, k, v = self._project(x)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = c.num_heads // c.num_kv_heads
        if group > 1:
            k, v = ops.repeat(k, group, axis=2), ops.repeat(v, group, axis=2)
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k) * (c.head_size ** -0.5) + bias
        context = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)
        return self.o(ops.reshape(context, (-1, seq, c.num_heads * c.head_size)))

    def call(self, x: Any, attention_bias: Any, cos: Any, sin: Any) -> Any:
        h = x + self._attention(self.attention_norm(x), attention_bias, cos, sin)
        g = self.ffn_norm(h)
        return h + self.down(ops.silu(self.gate(g)) * self.up(g))

    def compute_output_shape(self, x_shape: tuple, attention_bias_shape: tuple, cos_shape: tuple,
                             sin_shape: tuple) -> tuple:
        return tuple(x_shape)


def build_model(config: LlamaConfig, *, fast_init: bool = False, seed: int = 0) -> keras.Model:
    """The decoder with its LM head: ``(token_ids, padding_mask)`` -> ``[batch, seq, vocab]`` logits."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"build_model expects a LlamaConfig, got {type(config).__name__}.")
    inits = Initializers(seed, fast_init)
    token_ids = keras.Input(shape=(config.seq_len,), dtype="int32", name="token_ids")
    padding_mask = keras.Input(shape=(config.seq_len,), dtype="int32", name="padding_mask")
    embedding = keras.layers.Embedding(config.vocab_size, config.hidden_size, name="token_embedding",
                                       embeddings_initializer=inits.normal(0.02))
    h = embedding(token_ids)
    cos, sin = RotaryTables(config.head_size, config.rope_theta, name="rotary")(h)
    bias = padding_bias(padding_mask) + causal_mask_bias(config.seq_len)
    for i in range(config.num_layers):
        h = LlamaBlock(config, inits, name=f"decoder_layer_{i}")(h, bias, cos, sin)
    h = RMSNorm(epsilon=1e-5, scale_initializer=inits.ones(), name="final_norm")(h)
    if config.tie_embeddings:
        logits = TiedLMHead(embedding, name="lm_head")(h)
    else:
        logits = keras.layers.Dense(config.vocab_size, use_bias=False, name="lm_head",
                                    kernel_initializer=inits.normal(0.02))(h)
    return keras.Model([token_ids, padding_mask], logits, name="llama")


def param_count(config: LlamaConfig) -> int:
    """Exact number of weights of ``build_model(config)``, from the config alone."""
    d, hd, ff = config.hidden_size, config.head_size, config.intermediate_size
    attention = d * (config.num_heads + 2 * config.num_kv_heads) * hd + config.num_heads * hd * d
    block = attention + 3 * d * ff + 2 * d
    head = 0 if config.tie_embeddings else d * config.vocab_size
    return config.vocab_size * d + config.num_layers * block + d + head


def input_spec(config: LlamaConfig, batch_size: int) -> tuple[tf.TensorSpec, ...]:
    """Static ``(token_ids, padding_mask)`` specs for ``batch_size``."""
    require_positive_int("Llama input batch", "batch_size", batch_size)
    shape = (batch_size, config.seq_len)
    return (tf.TensorSpec(shape, tf.int32, name="token_ids"),
            tf.TensorSpec(shape, tf.int32, name="padding_mask"))


def synthetic_batch(config: LlamaConfig, batch_size: int, seed: int = 0
                    ) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random tokens with a padding mask that left-pads every other sequence by a quarter of
    its length (as batched generation does); the targets are the next tokens. Deterministic
    per ``seed``."""
    require_positive_int("Llama input batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    padding_mask = np.ones((batch_size, config.seq_len), np.int32)
    padding_mask[1::2, :max(1, config.seq_len // 4)] = 0
    return (tokens[:, :-1], padding_mask), tokens[:, 1:]
