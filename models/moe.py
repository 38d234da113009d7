"""GShard Mixture-of-Experts transformer language model (Lepikhin et al., 2021) in Keras 3.

The sparse family of the TAPAS experiments (paper section 5): TAPAS scales it
by adding experts and layers and expects to find expert-parallel strategies,
so the expert weights are real *stacked* weights with a leading expert
dimension and the routing is GShard's dense dispatch/combine formulation.

Architecture -- a **decoder-only** (causal) language model, as the GShard-MoE
LM benchmarked by Alpa (whose sizes the presets follow):

* token embedding + learned absolute position embedding;
* ``num_layers`` pre-norm blocks (``LayerNormalization``) of causal multi-head
  self-attention (``q k v o`` as ``Dense(use_bias=False)``, scores scaled by
  ``1/sqrt(d_model/num_heads)``) followed by a feed-forward sub-layer;
* every ``moe_every``-th block (blocks ``moe_every-1, 2*moe_every-1, ...``;
  with the default 2: every other block, starting with block 1) replaces the
  dense feed-forward (``wi -> relu -> wo``) by :class:`MoEFeedForward`:

  - tokens are split into groups of ``group_size`` (default: one sequence per
    group), shape ``[G, S, M]``;
  - router ``Dense(num_experts, use_bias=False)`` -> softmax -> top-2 gating
    with a per-expert capacity ``C`` (:func:`top2_gating`: built only from
    ``top_k``/``one_hot``/``cumsum``/reductions in keras.ops, static shapes, no Python loop over
    experts) giving ``dispatch`` and ``combine`` tensors ``[G, S, E, C]``;
  - ``einsum('gsec,gsm->egcm')`` dispatches tokens to expert slots, the
    experts apply ``wi [E, M, H]`` and ``wo [E, H, M]`` with
    ``einsum('egcm,emh->egch')`` / ``einsum('egch,ehm->egcm')``, and
    ``einsum('gsec,egcm->gsm')`` combines the results;
* final ``LayerNormalization`` and an LM head tied to the token embedding
  (hidden states scaled by ``d_model**-0.5`` first, as in Mesh TF).

The capacity is ``C = min(S, ceil(expert_capacity_factor * S / E))``; with
top-2 routing each token makes two assignments, so the default factor 2.0
gives every expert exactly its even share ``2S/E`` (GShard's convention).
First choices are placed before second choices; assignments beyond an
expert's capacity are dropped (their gate becomes 0; the residual connection
carries the token on). GShard's random dropping of weak second choices is not
implemented, which keeps the model deterministic.

Auxiliary load-balancing loss: GShard's ``mean_e(f_e * p_e) * E**2`` (``f_e``
fraction of tokens whose first choice is expert ``e``, ``p_e`` mean router
probability of ``e``), scaled by ``aux_loss_weight`` and added with
``add_loss`` **only when called with training=True** (so ``fit`` optimises
it, while inference and the TAPAS capture trace contain no loss ops).
``aux_loss_weight=0`` disables it.

Layer names: ``token_embedding``, ``position_embedding``, ``block_{i}``
(inside: ``attention_norm``, ``attention`` with ``q k v o``, ``ffn_norm`` and
either ``ffn`` with ``wi wo`` or ``moe`` with ``router`` and the weights
``wi``/``wo``), ``final_norm``, ``lm_head``.

Input: ``input_ids`` int32 ``[B, seq_len]``; output: next-token logits float32
``[B, seq_len, vocab_size]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from ._common import Initializers, TiedLMHead, causal_mask_bias, require_positive_int

__all__ = [
    "MoEConfig",
    "expert_capacity",
    "top2_gating",
    "CausalSelfAttention",
    "DenseFeedForward",
    "MoEFeedForward",
    "PositionEmbedding",
    "MoETransformerBlock",
    "build_model",
    "param_count",
    "input_spec",
    "synthetic_batch",
]

_LN_EPSILON = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Hyper-parameters of a GShard-MoE decoder-only LM.

    Attributes:
        num_layers: transformer blocks.
        d_model: hidden size (must be divisible by ``num_heads``).
        d_ff: feed-forward inner size of the dense FFN and of every expert.
        num_heads: attention heads.
        num_experts: experts per MoE layer (>= 2 for top-2 routing).
        expert_capacity_factor: capacity ``C = ceil(factor * group_size / E)``
            (capped at ``group_size``); 2.0 = the even top-2 load.
        vocab_size: token vocabulary (embedding tied with the LM head).
        seq_len: static sequence length.
        moe_every: every ``moe_every``-th block is an MoE block (blocks
            ``moe_every-1, 2*moe_every-1, ...``); 1 makes every block MoE.
        group_size: tokens per routing group; ``None`` = ``seq_len`` (one
            sequence per group). ``batch * seq_len`` must be a multiple of it.
        aux_loss_weight: weight of the load-balancing loss added in training;
            0.0 omits it.
        layer_impl: ``"keras"`` (plain Keras layers, GShard's capacity-limited
            top-2 dispatch) or ``"tapas"`` (the same blocks from ``tapas.layers``:
            ``MultiHeadAttention(causal=True)``, ``LayerNorm``, ``FeedForward`` and
            ``MoE`` with top-2 gating evaluated densely: no capacity limit, no
            auxiliary loss; same parameter count).
    """

    num_layers: int
    d_model: int
    d_ff: int
    num_heads: int
    num_experts: int
    expert_capacity_factor: float = 2.0
    vocab_size: int
    seq_len: int
    moe_every: int = 2
    group_size: int | None = None
    aux_loss_weight: float = 0.01
    layer_impl: str = "keras"

    def __post_init__(self) -> None:
        positive = (
            "num_layers", "d_model", "d_ff", "num_heads", "num_experts", "vocab_size", "seq_len", "moe_every"
        )
        for field in positive:
            require_positive_int("MoEConfig", field, getattr(self, field))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"MoEConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "choose num_heads dividing d_model."
            )
        if self.layer_impl not in ("keras", "tapas"):
            raise ValueError(
                f"MoEConfig.layer_impl must be 'keras' or 'tapas', got {self.layer_impl!r}."
            )
        if self.num_experts < 2:
            raise ValueError(
                f"MoEConfig.num_experts must be >= 2 for top-2 routing, got {self.num_experts}."
            )
        if self.moe_every > self.num_layers:
            raise ValueError(
                f"MoEConfig.moe_every={self.moe_every} exceeds num_layers={self.num_layers}, so the model "
                "would have no MoE block; use moe_every <= num_layers."
            )
        factor = self.expert_capacity_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(
                f"MoEConfig.expert_capacity_factor must be a positive number, got {factor!r}; GShard uses 2.0."
            )
        if self.group_size is not None:
            require_positive_int("MoEConfig", "group_size", self.group_size)
        weight = self.aux_loss_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ValueError(
                f"MoEConfig.aux_loss_weight must be a number >= 0, got {weight!r}; use 0.0 to disable it."
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.num_heads

    @property
    def tokens_per_group(self) -> int:
        """Tokens routed together (``group_size`` or ``seq_len``)."""
        return self.seq_len if self.group_size is None else self.group_size

    @property
    def capacity(self) -> int:
        """Expert capacity ``C`` (slots per expert and group)."""
        return expert_capacity(self.tokens_per_group, self.num_experts, self.expert_capacity_factor)

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` uses the MoE feed-forward."""
        return index % self.moe_every == self.moe_every - 1

    @property
    def num_moe_blocks(self) -> int:
        """Number of MoE blocks."""
        return sum(self.is_moe_block(i) for i in range(self.num_layers))

    def check_batch_size(self, batch_size: int) -> None:
        """Raise ``ValueError`` unless ``batch_size`` splits into whole routing groups."""
        require_positive_int("MoE input batch", "batch_size", batch_size)
        tokens = batch_size * self.seq_len
        if tokens % self.tokens_per_group:
            raise ValueError(
                f"batch_size={batch_size} gives {tokens} tokens, not a multiple of group_size="
                f"{self.tokens_per_group}; use a batch size that is a multiple of "
                f"{self.tokens_per_group // math.gcd(self.tokens_per_group, self.seq_len)}."
            )


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``min(group_size, ceil(capacity_factor * group_size / num_experts))``, at least 1."""
    return max(1, min(group_size, math.ceil(capacity_factor * group_size / num_experts)))


def top2_gating(router_probs: Any, capacity: int) -> tuple[Any, Any, Any]:
    """GShard top-2 gating with expert capacity.

    Args:
        router_probs: softmax router probabilities ``[G, S, E]`` (groups,
            tokens per group, experts).
        capacity: slots per expert and group.

    Returns:
        ``(dispatch, combine, aux_loss)``: ``dispatch`` ``[G, S, E, C]`` is 1
        where token ``s`` occupies slot ``c`` of expert ``e``; ``combine`` is
        the same with the (renormalised top-2) gate value instead of 1;
        ``aux_loss`` is the scalar load-balancing loss (1.0 at perfect
        balance). Each token occupies at most one slot in each of at most two
        distinct experts; assignments past an expert's capacity are dropped,
        first choices taking precedence over second choices, earlier tokens
        over later ones.
    """
    # keras.ops only, so the model builds under every Keras backend (TAPAS captures it under
    # TensorFlow; the XLA auto-sharding baseline builds it under JAX). The two choices come
    # from one top_k (TopKV2): ties go to the lower expert index, as tf.argmax's did, and
    # keras.ops.argmax's extra NaN/-0.0 handling stays out of the captured graph.
    probs = ops.convert_to_tensor(router_probs)
    num_experts = probs.shape[-1]
    if num_experts is None or num_experts < 2:
        raise ValueError(f"top2_gating needs a static expert dimension >= 2, got shape {tuple(probs.shape)}.")
    dtype = probs.dtype

    # First and second choice (the second is the best expert other than the first).
    _, top_2 = ops.top_k(probs, k=2, sorted=True)  # [G, S, 2] int32
    mask_1 = ops.one_hot(top_2[..., 0], num_experts, dtype=dtype)  # [G, S, E]
    mask_2 = ops.one_hot(top_2[..., 1], num_experts, dtype=dtype)
    gate_1 = ops.sum(probs * mask_1, axis=-1)  # [G, S]
    gate_2 = ops.sum(probs * mask_2, axis=-1)

    # Load-balancing loss on the first choices (before capacity dropping).
    density = ops.mean(mask_1, axis=1)  # [G, E] fraction of tokens per expert
    density_proxy = ops.mean(probs, axis=1)  # [G, E] mean router probability
    aux_loss = ops.mean(density * density_proxy) * float(num_experts * num_experts)

    denominator = gate_1 + gate_2 + 1e-9
    gate_1 = gate_1 / denominator
    gate_2 = gate_2 / denominator

    # Slot of each assignment = number of earlier assignments to the same
    # expert in the group (exclusive cumulative sum over tokens = inclusive
    # cumsum minus the 0/1 mask itself, exact in floating point). Second
    # choices queue behind all surviving first choices.
    position_1 = (ops.cumsum(mask_1, axis=1) - mask_1) * mask_1
    mask_1 = mask_1 * ops.cast(position_1 < capacity, dtype)
    kept_per_expert_1 = ops.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E]
    position_2 = (ops.cumsum(mask_2, axis=1) - mask_2 + kept_per_expert_1) * mask_2
    mask_2 = mask_2 * ops.cast(position_2 < capacity, dtype)

    slot_1 = ops.one_hot(ops.cast(ops.sum(position_1 * mask_1, axis=-1), "int32"), capacity, dtype=dtype)
    slot_2 = ops.one_hot(ops.cast(ops.sum(position_2 * mask_2, axis=-1), "int32"), capacity, dtype=dtype)
    dispatch_1 = mask_1[:, :, :, None] * slot_1[:, :, None, :]  # [G, S, E, C]
    dispatch_2 = mask_2[:, :, :, None] * slot_2[:, :, None, :]
    dispatch = dispatch_1 + dispatch_2
    combine = gate_1[:, :, None, None] * dispatch_1 + gate_2[:, :, None, None] * dispatch_2
    return dispatch, combine, aux_loss


# --------------------------------------------------------------------------- #
# Layers
# --------------------------------------------------------------------------- #


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned absolute position embedding ``[max_length, d_model]``."""

    def __init__(self, max_length: int, embeddings_initializer: Any = "zeros", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_length = int(max_length)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape: tuple) -> None:
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.max_length, input_shape[-1]), initializer=self.embeddings_initializer
        )

    def call(self, x: Any) -> Any:
        length = x.shape[1]
        if length is None or length > self.max_length:
            raise ValueError(
                f"{self.name}: sequence length {length} must be static and <= {self.max_length}; "
                "raise MoEConfig.seq_len."
            )
        return x + ops.expand_dims(self.embeddings[:length], 0)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)


class CausalSelfAttention(keras.layers.Layer):
    """Causal multi-head self-attention with bias-free ``q k v o`` projections."""

    def __init__(self, *, d_model: int, num_heads: int, initializers: Initializers, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}.")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        std = d_model**-0.5
        for name in ("q", "k", "v", "o"):
            projection = keras.layers.Dense(
                d_model, use_bias=False, kernel_initializer=initializers.normal(std), name=name
            )
            setattr(self, name, projection)

    def build(self, input_shape: tuple) -> None:
        for projection in (self.q, self.k, self.v):
            projection.build(input_shape)
        self.o.build(tuple(input_shape[:-1]) + (self.num_heads * self.head_dim,))

    def _split_heads(self, x: Any, length: int) -> Any:
        return ops.transpose(ops.reshape(x, (-1, length, self.num_heads, self.head_dim)), (0, 2, 1, 3))

    def call(self, x: Any) -> Any:
        length = x.shape[1]
        if length is None:
            raise ValueError(f"{self.name}: the sequence length must be static, got shape {tuple(x.shape)}.")
        q = self._split_heads(self.q(x), length)
        k = self._split_heads(self.k(x), length)
        v = self._split_heads(self.v(x), length)
        scores = ops.einsum("bhqd,bhkd->bhqk", q, k) * (self.head_dim**-0.5)
        weights = ops.softmax(scores + causal_mask_bias(length), axis=-1)
        context = ops.einsum("bhqk,bhkd->bhqd", weights, v)
        context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, length, self.num_heads * self.head_dim))
        return self.o(context)


class DenseFeedForward(keras.layers.Layer):
    """Dense feed-forward ``wo(relu(wi(x)))`` of the non-MoE blocks."""

    def __init__(self, *, d_model: int, d_ff: int, initializers: Initializers, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wi = keras.layers.Dense(
            d_ff, use_bias=False, kernel_initializer=initializers.normal(d_model**-0.5), name="wi"
        )
        self.wo = keras.layers.Dense(
            d_model, use_bias=False, kernel_initializer=initializers.normal(d_ff**-0.5), name="wo"
        )

    def build(self, input_shape: tuple) -> None:
        self.wi.build(input_shape)
        self.wo.build(tuple(input_shape[:-1]) + (self.wi.units,))

    def call(self, x: Any) -> Any:
        return self.wo(ops.relu(self.wi(x)))


class MoEFeedForward(keras.layers.Layer):
    """GShard MoE feed-forward with stacked expert weights ``wi [E, M, H]``, ``wo [E, H, M]``.

    Input and output ``[B, S, M]``; tokens are routed in groups of
    ``group_size`` (``None``: one sequence per group). See :func:`top2_gating`.
    """

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        num_experts: int,
        capacity_factor: float,
        initializers: Initializers,
        group_size: int | None = None,
        aux_loss_weight: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.d_model = d_model
        self.d_ff = d_ff
        self.num_experts = num_experts
        self.capacity_factor = float(capacity_factor)
        self.group_size = group_size
        self.aux_loss_weight = float(aux_loss_weight)
        self.router = keras.layers.Dense(
            num_experts, use_bias=False, kernel_initializer=initializers.normal(d_model**-0.5), name="router"
        )
        self._wi_initializer = initializers.normal(d_model**-0.5)
        self._wo_initializer = initializers.normal(d_ff**-0.5)

    def build(self, input_shape: tuple) -> None:
        self.router.build(input_shape)
        self.wi = self.add_weight(
            name="wi", shape=(self.num_experts, self.d_model, self.d_ff), initializer=self._wi_initializer
        )
        self.wo = self.add_weight(
            name="wo", shape=(self.num_experts, self.d_ff, self.d_model), initializer=self._wo_initializer
        )

    def call(self, x: Any, training: bool | None = None) -> Any:
        batch, length, d_model = x.shape
        if length is None:
            raise ValueError(f"{self.name}: the sequence length must be static, got shape {tuple(x.shape)}.")
        group_size = length if self.group_size is None else self.group_size
        if batch is not None and (batch * length) % group_size:
            raise ValueError(
                f"{self.name}: {batch}x{length} tokens do not split into groups of group_size={group_size}; "
                "change the batch size or MoEConfig.group_size."
            )
        capacity = expert_capacity(group_size, self.num_experts, self.capacity_factor)
        tokens = ops.reshape(x, (-1, group_size, d_model))  # [G, S, M]
        router_probs = ops.softmax(self.router(tokens), axis=-1)  # [G, S, E]
        dispatch, combine, aux_loss = top2_gating(router_probs, capacity)
        expert_inputs = ops.einsum("gsec,gsm->egcm", dispatch, tokens)
        hidden = ops.relu(ops.einsum("egcm,emh->egch", expert_inputs, self.wi))
        expert_outputs = ops.einsum("egch,ehm->egcm", hidden, self.wo)
        outputs = ops.einsum("gsec,egcm->gsm", combine, expert_outputs)
        if training and self.aux_loss_weight > 0:
            self.add_loss(self.aux_loss_weight * aux_loss)
        return ops.reshape(outputs, (-1, length, d_model))


class MoETransformerBlock(keras.layers.Layer):
    """Pre-norm block: ``x + attention(norm(x))`` then ``x + ffn(norm(x))``, the FFN dense or MoE."""

    def __init__(self, config: MoEConfig, *, use_moe: bool, initializers: Initializers, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_moe = use_moe
        if config.layer_impl == "tapas":
            self._tapas_layers(config, initializers)
            return

        def layer_norm(name: str) -> keras.layers.LayerNormalization:
            return keras.layers.LayerNormalization(
                epsilon=_LN_EPSILON, gamma_initializer=initializers.ones(), name=name
            )

        self.attention_norm = layer_norm("attention_norm")
        self.attention = CausalSelfAttention(
            d_model=config.d_model, num_heads=config.num_heads, initializers=initializers, name="attention"
        )
        self.ffn_norm = layer_norm("ffn_norm")
        if use_moe:
            self.ffn = MoEFeedForward(
                d_model=config.d_model,
                d_ff=config.d_ff,
                num_experts=config.num_experts,
                capacity_factor=config.expert_capacity_factor,
                group_size=config.group_size,
                aux_loss_weight=config.aux_loss_weight,
                initializers=initializers,
                name="moe",
            )
        else:
            self.ffn = DenseFeedForward(
                d_model=config.d_model, d_ff=config.d_ff, initializers=initializers, name="ffn"
            )

    def _tapas_layers(self, config: MoEConfig, initializers: Initializers) -> None:
        from tapas import layers as tl

        d = config.d_model
        self.attention_norm = tl.LayerNorm(epsilon=_LN_EPSILON, name="attention_norm")
        self.attention = tl.MultiHeadAttention(
            config.num_heads, d // config.num_heads, use_bias=False, causal=True,
            kernel_initializer=initializers.normal(d**-0.5), name="attention")
        self.ffn_norm = tl.LayerNorm(epsilon=_LN_EPSILON, name="ffn_norm")
        if self.use_moe:
            self.ffn = tl.MoE(config.num_experts, config.d_ff, top_k=2,
                              kernel_initializer=initializers.normal(d**-0.5), name="moe")
        else:
            self.ffn = tl.FeedForward(config.d_ff, use_bias=False,
                                      kernel_initializer=initializers.normal(d**-0.5), name="ffn")

    def build(self, input_shape: tuple) -> None:
        for layer in (self.attention_norm, self.attention, self.ffn_norm, self.ffn):
            layer.build(input_shape)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)

    def call(self, x: Any, training: bool | None = None) -> Any:
        x = x + self.attention(self.attention_norm(x))
        normed = self.ffn_norm(x)
        update = (self.ffn(normed, training=training)
                  if isinstance(self.ffn, MoEFeedForward) else self.ffn(normed))
        return x + update


# --------------------------------------------------------------------------- #
# Model builder and family API (used by the registry)
# --------------------------------------------------------------------------- #


def build_model(config: MoEConfig, *, fast_init: bool = False, seed: int = 0) -> keras.Model:
    """Build the functional GShard-MoE LM ``keras.Model`` described by ``config``.

    Args:
        config: model hyper-parameters.
        fast_init: initialise every weight with zeros (structure-only use).
        seed: base seed of the random initialisers (ignored with ``fast_init``).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"build_model expects a MoEConfig, got {type(config).__name__}.")
    inits = Initializers(seed, fast_init)
    input_ids = keras.Input(shape=(config.seq_len,), dtype="int32", name="input_ids")
    if config.layer_impl == "tapas":
        from tapas import layers as tl

        embedding = tl.Embedding(config.vocab_size, config.d_model,
                                 embeddings_initializer=inits.normal(1.0), name="token_embedding")
        final_norm = tl.LayerNorm(epsilon=_LN_EPSILON, name="final_norm")
    else:
        embedding = keras.layers.Embedding(
            config.vocab_size, config.d_model, embeddings_initializer=inits.normal(1.0), name="token_embedding"
        )
        final_norm = keras.layers.LayerNormalization(
            epsilon=_LN_EPSILON, gamma_initializer=inits.ones(), name="final_norm"
        )
    h = embedding(input_ids)
    h = PositionEmbedding(config.seq_len, embeddings_initializer=inits.normal(0.02), name="position_embedding")(h)
    for i in range(config.num_layers):
        h = MoETransformerBlock(config, use_moe=config.is_moe_block(i), initializers=inits, name=f"block_{i}")(h)
    h = final_norm(h)
    logits = TiedLMHead(embedding, scale=config.d_model**-0.5, name="lm_head")(h)
    return keras.Model(inputs=[input_ids], outputs=logits, name="gshard_moe")


def param_count(config: MoEConfig) -> int:
    """Exact number of weights of ``build_model(config)``, computed from the config alone."""
    d = config.d_model
    attention = 4 * d * d
    norms = 2 * (2 * d)  # two LayerNorms (gamma + beta) per block
    dense_ffn = 2 * d * config.d_ff
    moe_ffn = d * config.num_experts + config.num_experts * 2 * d * config.d_ff
    num_moe = config.num_moe_blocks
    num_dense = config.num_layers - num_moe
    blocks = config.num_layers * (attention + norms) + num_moe * moe_ffn + num_dense * dense_ffn
    embeddings = config.vocab_size * d + config.seq_len * d
    return embeddings + blocks + 2 * d


def input_spec(config: MoEConfig, batch_size: int) -> tuple[tf.TensorSpec, ...]:
    """Static ``(input_ids,)`` spec for ``batch_size``."""
    config.check_batch_size(batch_size)
    return (tf.TensorSpec((batch_size, config.seq_len), tf.int32, name="input_ids"),)


def synthetic_batch(
    config: MoEConfig, batch_size: int, seed: int = 0
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random token batch for next-token prediction, deterministic per ``seed``.

    Returns ``((input_ids,), targets)`` where ``targets[:, t] = input_ids[:, t + 1]``
    (one extra random token is drawn for the last position).
    """
    config.check_batch_size(batch_size)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    return (tokens[:, :-1],), np.ascontiguousarray(tokens[:, 1:])
