"""Small helpers shared by the model families (not part of the public API).

* :class:`Initializers` hands out weight initializers for one model build: in
  ``fast_init`` mode every weight gets zeros (cheap, for structure-only work on
  the 1B-parameter presets); otherwise each weight gets its *own* seeded random
  initializer, so two same-shaped weights never receive identical values and a
  build is reproducible for a given seed.
* :class:`TiedLMHead` projects hidden states onto a shared embedding table.
* :func:`causal_mask_bias` builds the additive causal mask as a NumPy constant.
* Validation helpers raise ``ValueError`` messages that name the bad value and
  say how to fix it.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

__all__ = [
    "Initializers",
    "require_positive_int",
    "require_probability",
    "resolve_batch_size",
    "causal_mask_bias",
    "padding_bias",
    "NEG_INF",
    "TiedLMHead",
]

# Added to attention scores that must be masked out. Large enough to make the
# softmax weight exactly zero in float32, small enough not to overflow when
# added to other biases.
NEG_INF = -1e9


class Initializers:
    """Factory of Keras initializers for one model build.

    Args:
        seed: base seed. Every random initializer handed out gets
            ``seed * 1_000_003 + k`` for the k-th request, so builds in the same
            order with the same seed give identical weights.
        fast_init: when True every initializer is ``zeros`` (no random number
            generation at all; the model is only good for structural work).
    """

    def __init__(self, seed: int = 0, fast_init: bool = False) -> None:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r} ({type(seed).__name__}); pass e.g. seed=0.")
        self.seed = int(seed)
        self.fast_init = bool(fast_init)
        self._counter = 0

    def _next_seed(self) -> int:
        self._counter += 1
        return (self.seed * 1_000_003 + self._counter) % (2**31 - 1)

    def normal(self, stddev: float) -> Any:
        """Zero-mean normal with the given standard deviation."""
        if self.fast_init:
            return keras.initializers.Zeros()
        return keras.initializers.RandomNormal(mean=0.0, stddev=float(stddev), seed=self._next_seed())

    def he_normal(self) -> Any:
        """He (fan-in scaled, truncated) normal, for ReLU convolutions."""
        if self.fast_init:
            return keras.initializers.Zeros()
        return keras.initializers.HeNormal(seed=self._next_seed())

    def glorot_uniform(self) -> Any:
        """Glorot uniform, for plain dense layers."""
        if self.fast_init:
            return keras.initializers.Zeros()
        return keras.initializers.GlorotUniform(seed=self._next_seed())

    def ones(self) -> Any:
        """Ones (norm scales, BN variances); zeros under ``fast_init``."""
        return keras.initializers.Zeros() if self.fast_init else keras.initializers.Ones()

    @staticmethod
    def zeros() -> Any:
        """Zeros (biases, BN offsets and means)."""
        return keras.initializers.Zeros()


def require_positive_int(owner: str, field: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{owner}.{field} must be a positive int, got {value!r}; pass an integer >= 1.")


def require_probability(owner: str, field: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``0 <= value < 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}.{field} must be a float in [0, 1), got {value!r}; use e.g. 0.0 or 0.1.")


def resolve_batch_size(batch_size: int | None, default: int) -> int:
    """``batch_size`` if given (validated), else ``default``."""
    if batch_size is None:
        return default
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            f"batch_size must be a positive int or None (use the preset default), got {batch_size!r}."
        )
    return int(batch_size)


def causal_mask_bias(length: int) -> np.ndarray:
    """Additive causal mask, shape ``[1, 1, length, length]``.

    Entry ``[0, 0, q, k]`` is 0 where key ``k`` may be attended from query
    ``q`` (``k <= q``) and :data:`NEG_INF` for future keys.
    """
    future = np.triu(np.ones((length, length), dtype=bool), k=1)
    return np.where(future, NEG_INF, 0.0).astype(np.float32)[None, None, :, :]


def padding_bias(padding_mask: Any) -> Any:
    """Additive attention bias ``[batch, 1, 1, seq]`` from a ``[batch, seq]`` padding mask.

    Entry ``[b, 0, 0, k]`` is 0 where key ``k`` of sequence ``b`` is a real token (mask 1)
    and :data:`NEG_INF` where it is padding (mask 0). Built with ``keras.ops``, so it runs
    on any backend; the models compute it once and every layer reads it.
    """
    keep = keras.ops.cast(padding_mask, "float32")
    return keras.ops.expand_dims(keras.ops.expand_dims((1.0 - keep) * NEG_INF, 1), 1)


class TiedLMHead(keras.layers.Layer):
    """Output projection that reuses a token embedding table: ``(x * scale) @ E^T``.

    The layer owns no weight of its own; it reads ``embedding.embeddings``
    (shape ``[vocab, d_model]``), so the table is counted once by
    ``Model.count_params()``.

    Args:
        embedding: the (already constructed) ``keras.layers.Embedding`` to share.
        scale: multiplier applied to the hidden states first (T5 uses
            ``d_model ** -0.5``); 1.0 skips the multiply.
    """

    def __init__(self, embedding: keras.layers.Embedding, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding
        self.scale = float(scale)

    def call(self, hidden_states: Any) -> Any:
        if self.scale != 1.0:
            hidden_states = hidden_states * self.scale
        table = keras.ops.convert_to_tensor(self.embedding.embeddings)
        return keras.ops.matmul(hidden_states, keras.ops.transpose(table))

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return tuple(input_shape[:-1]) + (self.embedding.input_dim,)
