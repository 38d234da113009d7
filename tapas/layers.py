"""Keras layers that are GraphNodes by construction (the paper's ``tapas.DenseLayer()``).

In:  ordinary Keras 3 use: Sequential, functional or subclassed models, ``model.fit`` on
     one device, ``get_config``/``from_config`` serialization.
Out: layers whose ops all run inside one ``tapas.<kind>`` name scope. ``tapas.capture``
     turns each call of such a layer into exactly one GraphNode of that kind, whatever the
     surrounding model, and records the layer's ``shard=`` pin on it, which ``tapas.search``
     honours.

| layer | GraphNode kind | ``shard=`` pins |
|---|---|---|
| :class:`DenseLayer` | ``dense`` | ``replicate``, ``batch``, ``column``, ``row`` |
| :class:`Embedding` | ``embedding`` | ``replicate``, ``batch``, ``vocab``, ``hidden`` |
| :class:`MultiHeadAttention` | ``attention`` | ``replicate``, ``batch``, ``heads`` |
| :class:`FeedForward` | ``feed-forward`` | ``replicate``, ``batch``, ``column-row`` |
| :class:`LayerNorm` | ``norm`` | ``replicate``, ``batch`` |
| :class:`Conv2D` | ``conv`` | ``replicate``, ``batch``, ``out-channel``, ``in-channel`` |
| :class:`MoE` | ``moe`` | ``replicate``, ``batch`` |

A pin is a pattern name from the table or an SRC expression (``docs/sharding.md``), e.g.
``tapas.DenseLayer(4096, activation="relu", shard="column")``. ``None`` (the default)
lets the search decide. A pin that cannot be honoured on the device count searched for
(``column`` for 1000 units on 8 devices) is refused by ``tapas.search`` with a message
naming the layer.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from tapas.capturing.grouping.raw import MARKER
from tapas.sharding.patterns.pattern import (BATCH, COLUMN, COLUMN_ROW, HEADS, HIDDEN, IN_CHANNEL,
                                             OUT_CHANNEL, REPLICATE, ROW, VOCAB)

__all__ = ["DenseLayer", "Embedding", "MultiHeadAttention", "FeedForward", "LayerNorm",
           "Conv2D", "MoE", "MARKER", "PIN_NAMES", "TapasLayer"]

# The patterns each kind may be pinned to by name (an SRC expression is accepted as well).
PIN_NAMES: dict[str, tuple[str, ...]] = {
    "dense": (REPLICATE, BATCH, COLUMN, ROW),
    "embedding": (REPLICATE, BATCH, VOCAB, HIDDEN),
    "attention": (REPLICATE, BATCH, HEADS),
    "feed-forward": (REPLICATE, BATCH, COLUMN_ROW),
    "norm": (REPLICATE, BATCH),
    "conv": (REPLICATE, BATCH, OUT_CHANNEL, IN_CHANNEL),
    "moe": (REPLICATE, BATCH),
}


def _check_pin(layer: str, kind: str, shard: Any) -> str | None:
    if shard is None:
        return None
    names = PIN_NAMES[kind]
    if not isinstance(shard, str):
        raise TypeError(f"{layer}(shard={shard!r}): a pin is a string, one of "
                        f"{', '.join(names)} or an SRC expression, or None to let tapas search")
    if shard in names:
        return shard
    if "(" in shard:
        from tapas.sharding import expressions
        try:
            expressions.parse(shard)
        except ValueError as e:
            raise ValueError(f"{layer}(shard={shard!r}) is not a valid SRC expression: {e}") \
                from None
        return shard
    raise ValueError(f"{layer}(shard={shard!r}): unknown pattern for a {kind} layer; use one "
                     f"of {', '.join(names)}, an SRC expression such as "
                     "'C_AR(MatMul(S1(X), S0(W)))', or None to let tapas search")


class TapasLayer(keras.layers.Layer):
    """Base class: runs :meth:`compute` inside the ``tapas.<kind>`` marker scope.

    Subclasses set ``kind``, implement ``build`` and ``compute``, and give ``call`` the
    exact signature of ``compute`` (Keras reads it to build the layer), running ``compute``
    inside :meth:`_marked`.
    """

    kind: str = ""

    def __init__(self, shard: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shard = _check_pin(type(self).__name__, self.kind, shard)

    @property
    def tapas_pin(self) -> str | None:
        """The ``shard=`` pin capture records on this layer's GraphNode (None: searched);
        capture reads it by this name (``tapas.capturing.tracing.PIN_ATTRIBUTE``)."""
        return self.shard

    def _marked(self) -> Any:
        """The name scope every op of a call runs in (what capture recognizes)."""
        return keras.name_scope(MARKER + self.kind)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "shard": self.shard}

    def _kernel_and_bias(self, prefix: str, kernel_shape: tuple, width: int) -> tuple[Any, Any]:
        """A kernel and (with ``use_bias``) a bias of ``width``, named ``{prefix}kernel`` and
        ``{prefix}bias``, from the layer's initializers."""
        kernel = self.add_weight(name=f"{prefix}kernel", shape=kernel_shape,
                                 initializer=self.kernel_initializer)
        bias = (self.add_weight(name=f"{prefix}bias", shape=(width,),
                                initializer=self.bias_initializer)
                if self.use_bias else None)
        return kernel, bias


def _init(value: Any) -> Any:
    return keras.initializers.get(value)


def _ser(value: Any) -> Any:
    return keras.initializers.serialize(value)


@keras.saving.register_keras_serializable(package="tapas")
class DenseLayer(TapasLayer):
    """``activation(x @ kernel + bias)`` over the last axis of ``x`` (any rank >= 2)."""

    kind = "dense"

    def __init__(self, units: int, activation: Any = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 shard: str | None = None, **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("DenseLayer", "units", units)
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = _init(kernel_initializer)
        self.bias_initializer = _init(bias_initializer)

    def build(self, input_shape: tuple) -> None:
        self.kernel, self.bias = self._kernel_and_bias("", (input_shape[-1], self.units),
                                                       self.units)

    def call(self, x: Any) -> Any:
        with self._marked():
            return self.compute(x)

    def compute(self, x: Any) -> Any:
        y = ops.matmul(x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias, "kernel_initializer": _ser(self.kernel_initializer),
                "bias_initializer": _ser(self.bias_initializer)}


@keras.saving.register_keras_serializable(package="tapas")
class Embedding(TapasLayer):
    """Rows of an ``[input_dim, output_dim]`` table gathered by integer ids."""

    kind = "embedding"

    def __init__(self, input_dim: int, output_dim: int,
                 embeddings_initializer: Any = "uniform", shard: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("Embedding", "input_dim", input_dim)
        _positive("Embedding", "output_dim", output_dim)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = _init(embeddings_initializer)

    def build(self, input_shape: tuple) -> None:
        self.embeddings = self.add_weight(name="embeddings",
                                          shape=(self.input_dim, self.output_dim),
                                          initializer=self.embeddings_initializer)

    def call(self, ids: Any) -> Any:
        with self._marked():
            return self.compute(ids)

    def compute(self, ids: Any) -> Any:
        if ops.dtype(ids) not in ("int32", "int64"):
            ids = ops.cast(ids, "int32")
        return ops.take(self.embeddings, ids, axis=0)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "embeddings_initializer": _ser(self.embeddings_initializer)}


@keras.saving.register_keras_serializable(package="tapas")
class MultiHeadAttention(TapasLayer):
    """Multi-head attention, one GraphNode: projections, scores, softmax, context, output.

    ``call(query, value=None, bias=None)``: self-attention when ``value`` is None; ``bias``
    (broadcastable to ``[batch, heads, query_len, value_len]``, e.g. T5's relative position
    bias or an additive mask) is added to the scores before the softmax. Weights have the
    shapes of ``keras.layers.MultiHeadAttention`` (``query/kernel`` ``[d, heads, key_dim]``,
    ``attention_output/kernel`` ``[heads, key_dim, d]``), in the same order, so weights
    copy across with ``set_weights``.
    """

    kind = "attention"

    def __init__(self, num_heads: int, key_dim: int, use_bias: bool = True,
                 scale: bool = True, causal: bool = False,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 shard: str | None = None, **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("MultiHeadAttention", "num_heads", num_heads)
        _positive("MultiHeadAttention", "key_dim", key_dim)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.use_bias, self.scale, self.causal = bool(use_bias), bool(scale), bool(causal)
        self.kernel_initializer = _init(kernel_initializer)
        self.bias_initializer = _init(bias_initializer)

    def build(self, query_shape: tuple, value_shape: tuple | None = None,
              bias_shape: tuple | None = None) -> None:
        d, v_d = query_shape[-1], (value_shape or query_shape)[-1]
        h, k = self.num_heads, self.key_dim
        shapes = {"query": (d, h, k), "key": (v_d, h, k), "value": (v_d, h, k)}
        for name, shape in shapes.items():
            setattr(self, f"{name}_kernel", self.add_weight(
                name=f"{name}_kernel", shape=shape, initializer=self.kernel_initializer))
            setattr(self, f"{name}_bias", self.add_weight(
                name=f"{name}_bias", shape=(h, k), initializer=self.bias_initializer)
                if self.use_bias else None)
        self.output_kernel = self.add_weight(name="output_kernel", shape=(h, k, d),
                                             initializer=self.kernel_initializer)
        self.output_bias = (self.add_weight(name="output_bias", shape=(d,),
                                            initializer=self.bias_initializer)
                            if self.use_bias else None)

    def _project(self, x: Any, name: str) -> Any:
        y = ops.einsum("btd,dhk->bthk", x, getattr(self, f"{name}_kernel"))
        bias = getattr(self, f"{name}_bias")
        return y if bias is None else y + bias

    def call(self, query: Any, value: Any = None, bias: Any = None) -> Any:
        with self._marked():
            return self.compute(query, value, bias)

    def compute(self, query: Any, value: Any = None, bias: Any = None) -> Any:
        value = query if value is None else value
        q = self._project(query, "query")
        k = self._project(value, "key")
        v = self._project(value, "value")
        if self.scale:
            q = q * (1.0 / math.sqrt(self.key_dim))
        scores = ops.einsum("bthk,bshk->bhts", q, k)
        if bias is not None:
            scores = scores + bias
        if self.causal:
            t, s = scores.shape[-2], scores.shape[-1]
            future = ops.triu(ops.ones((t, s), dtype=scores.dtype), k=1)
            scores = scores + future * ops.cast(-1e9, scores.dtype)
        probs = ops.softmax(scores, axis=-1)
        context = ops.einsum("bhts,bshk->bthk", probs, v)
        out = ops.einsum("bthk,hkd->btd", context, self.output_kernel)
        return out if self.output_bias is None else out + self.output_bias

    def compute_output_shape(self, query_shape: tuple, value_shape: tuple | None = None,
                             bias_shape: tuple | None = None) -> tuple:
        return tuple(query_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "use_bias": self.use_bias, "scale": self.scale, "causal": self.causal,
                "kernel_initializer": _ser(self.kernel_initializer),
                "bias_initializer": _ser(self.bias_initializer)}


@keras.saving.register_keras_serializable(package="tapas")
class FeedForward(TapasLayer):
    """Two dense layers with an activation between: ``wo(act(wi(x)))``.

    ``gated=True`` is T5 v1.1's ``wo(act(wi_0(x)) * wi_1(x))``. The output width equals
    the input width.
    """

    kind = "feed-forward"

    def __init__(self, d_ff: int, activation: Any = "relu", use_bias: bool = True,
                 gated: bool = False, kernel_initializer: Any = "glorot_uniform",
                 bias_initializer: Any = "zeros", shard: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("FeedForward", "d_ff", d_ff)
        self.d_ff = int(d_ff)
        self.activation = keras.activations.get(activation)
        self.use_bias, self.gated = bool(use_bias), bool(gated)
        self.kernel_initializer = _init(kernel_initializer)
        self.bias_initializer = _init(bias_initializer)

    def build(self, input_shape: tuple) -> None:
        d = input_shape[-1]
        names = ("wi_0", "wi_1") if self.gated else ("wi",)
        self._wi = [self._kernel_and_bias(f"{name}_", (d, self.d_ff), self.d_ff)
                    for name in names]
        self.wo_kernel, self.wo_bias = self._kernel_and_bias("wo_", (self.d_ff, d), d)

    def call(self, x: Any) -> Any:
        with self._marked():
            return self.compute(x)

    def compute(self, x: Any) -> Any:
        hs = []
        for kernel, bias in self._wi:
            h = ops.matmul(x, kernel)
            hs.append(h if bias is None else h + bias)
        h = self.activation(hs[0])
        if self.gated:
            h = h * hs[1]
        y = ops.matmul(h, self.wo_kernel)
        return y if self.wo_bias is None else y + self.wo_bias

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "d_ff": self.d_ff,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias, "gated": self.gated,
                "kernel_initializer": _ser(self.kernel_initializer),
                "bias_initializer": _ser(self.bias_initializer)}


@keras.saving.register_keras_serializable(package="tapas")
class LayerNorm(TapasLayer):
    """Normalization over the last axis: ``(x - mean) / sqrt(var + eps) * gamma + beta``.

    ``rms=True`` is T5's RMS norm: ``x / sqrt(mean(x^2) + eps) * gamma`` (no centring, no
    ``beta``).
    """

    kind = "norm"

    def __init__(self, epsilon: float = 1e-6, rms: bool = False, shard: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        if not epsilon > 0:
            raise ValueError(f"LayerNorm(epsilon={epsilon!r}): must be > 0 (e.g. 1e-6)")
        self.epsilon, self.rms = float(epsilon), bool(rms)

    def build(self, input_shape: tuple) -> None:
        d = input_shape[-1]
        self.gamma = self.add_weight(name="gamma", shape=(d,), initializer="ones")
        self.beta = None if self.rms else self.add_weight(name="beta", shape=(d,),
                                                          initializer="zeros")

    def call(self, x: Any) -> Any:
        with self._marked():
            return self.compute(x)

    def compute(self, x: Any) -> Any:
        if self.rms:
            var = ops.mean(ops.square(x), axis=-1, keepdims=True)
            return x * ops.rsqrt(var + self.epsilon) * self.gamma
        mean = ops.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        var = ops.mean(ops.square(centred), axis=-1, keepdims=True)
        return centred * ops.rsqrt(var + self.epsilon) * self.gamma + self.beta

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "epsilon": self.epsilon, "rms": self.rms}


@keras.saving.register_keras_serializable(package="tapas")
class Conv2D(TapasLayer):
    """2-D convolution on NHWC input (+ bias, activation)."""

    kind = "conv"

    def __init__(self, filters: int, kernel_size: int | tuple[int, int], strides: int = 1,
                 padding: str = "same", activation: Any = None, use_bias: bool = True,
                 kernel_initializer: Any = "glorot_uniform", bias_initializer: Any = "zeros",
                 shard: str | None = None, **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("Conv2D", "filters", filters)
        self.filters = int(filters)
        ks = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        if len(ks) != 2 or any(not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"Conv2D(kernel_size={kernel_size!r}): give an int or a pair of "
                             "positive ints")
        self.kernel_size = ks
        self.strides = int(strides)
        if padding not in ("same", "valid"):
            raise ValueError(f"Conv2D(padding={padding!r}): use 'same' or 'valid'")
        self.padding = padding
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = _init(kernel_initializer)
        self.bias_initializer = _init(bias_initializer)

    def build(self, input_shape: tuple) -> None:
        self.kernel, self.bias = self._kernel_and_bias(
            "", self.kernel_size + (input_shape[-1], self.filters), self.filters)

    def call(self, x: Any) -> Any:
        with self._marked():
            return self.compute(x)

    def compute(self, x: Any) -> Any:
        y = ops.conv(x, self.kernel, strides=self.strides, padding=self.padding)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        b, h, w, _ = input_shape
        if self.padding == "valid":
            h = None if h is None else h - self.kernel_size[0] + 1
            w = None if w is None else w - self.kernel_size[1] + 1
        s = self.strides
        return (b, None if h is None else -(-h // s), None if w is None else -(-w // s),
                self.filters)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters,
                "kernel_size": self.kernel_size, "strides": self.strides,
                "padding": self.padding,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias, "kernel_initializer": _ser(self.kernel_initializer),
                "bias_initializer": _ser(self.bias_initializer)}


@keras.saving.register_keras_serializable(package="tapas")
class MoE(TapasLayer):
    """Mixture of experts with top-k gating over ``[batch, tokens, d]`` input.

    Each token goes to its ``top_k`` experts by gate probability; their outputs are
    combined with the renormalized top-k probabilities. The experts are stacked weights
    with a leading expert dimension (``wi [experts, d, d_ff]``, ``wo [experts, d_ff, d]``),
    and every expert is evaluated densely on every token (no capacity limit, so no token
    is ever dropped and the layer is exactly differentiable; the zoo's GShard model has the
    capacity-limited dispatch).

    Expert parallelism: not as a pin of this layer. Its input feeds both the replicated
    gate and the experts, so under an expert split its gradient would sum a full and a
    partial part inside one GraphNode, which the pattern engine rejects; the zoo's GShard
    MoE (``moe-*`` presets), whose dispatch and experts are separate GraphNodes, gets the
    ``expert`` pattern.
    """

    kind = "moe"

    def __init__(self, num_experts: int, d_ff: int, top_k: int = 2, activation: Any = "relu",
                 kernel_initializer: Any = "glorot_uniform", shard: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(shard=shard, **kwargs)
        _positive("MoE", "num_experts", num_experts)
        _positive("MoE", "d_ff", d_ff)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE(top_k={top_k!r}): must be between 1 and num_experts="
                             f"{num_experts}")
        self.num_experts, self.d_ff, self.top_k = int(num_experts), int(d_ff), int(top_k)
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = _init(kernel_initializer)

    def build(self, input_shape: tuple) -> None:
        d, e = input_shape[-1], self.num_experts
        self.gate = self.add_weight(name="gate_kernel", shape=(d, e),
                                    initializer=self.kernel_initializer)
        self.wi = self.add_weight(name="wi", shape=(e, d, self.d_ff),
                                  initializer=self.kernel_initializer)
        self.wo = self.add_weight(name="wo", shape=(e, self.d_ff, d),
                                  initializer=self.kernel_initializer)

    def call(self, x: Any) -> Any:
        with self._marked():
            return self.compute(x)

    def compute(self, x: Any) -> Any:
        probs = ops.softmax(ops.einsum("btd,de->bte", x, self.gate), axis=-1)
        # the k-th largest probability of each token (top_k sorts descending)
        kth = ops.min(ops.top_k(probs, self.top_k)[0], axis=-1, keepdims=True)
        chosen = ops.where(probs >= kth, probs, ops.zeros_like(probs))
        combine = chosen / ops.sum(chosen, axis=-1, keepdims=True)
        h = self.activation(ops.einsum("btd,edf->ebtf", x, self.wi))
        y = ops.einsum("ebtf,efd->ebtd", h, self.wo)
        return ops.einsum("ebtd,bte->btd", y, combine)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_experts": self.num_experts, "d_ff": self.d_ff,
                "top_k": self.top_k, "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": _ser(self.kernel_initializer)}


def _positive(layer: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{layer}({name}={value!r}): must be a positive integer")
