"""Models written with plain Keras 3 layers, with the shapes the search found hard (issue 50).

In:  a model name: ``dlrm-8`` (a DLRM-style recommender: 8 embedding tables and a bottom
     MLP meeting at a dot interaction, two cross layers, a top MLP), ``dlrm-8-pairwise``
     (the same with one ``Dot`` layer per pair of features instead of one stacked batched
     matmul), ``inception-2`` (two Inception-style blocks: four parallel branches meeting at
     a concat) or ``t5-bias-depthN`` (a T5-large-size encoder-decoder with N layers per
     stack whose first layer of each stack computes the relative position bias that every
     later layer of the stack reads).
Out: :func:`capture` -- the captured ``tapas.ir.Graph`` and the seconds building and
     capturing took (read from ``<cache_dir>/<name>.json`` when present); :func:`build`
     the Keras model. Raises ValueError naming the known models for an unknown name.

Used by ``benchmarks/bench_search.py``. Weights are built (Keras allocates them), so the
tables are 100 K rows, not the issue's 1 M: the search sees the same structure.
"""

from __future__ import annotations

import os
import time
from typing import Any

import keras
import numpy as np
from keras import layers, ops

__all__ = ["build", "capture", "NAMES"]

NAMES = ("dlrm-8", "dlrm-8-pairwise", "inception-2", "t5-bias-depthN")


class DotInteraction(layers.Layer):
    """DLRM's interaction: every pair of features' dot product, from one stacked matmul."""

    def call(self, feats):
        x = ops.stack(feats, axis=1)
        z = ops.matmul(x, ops.transpose(x, (0, 2, 1)))
        n = len(feats)
        pairs = np.array([i * n + j for i in range(n) for j in range(i)], dtype="int32")
        return ops.take(ops.reshape(z, (-1, n * n)), pairs, axis=1)


def dlrm(tables: int = 8, rows: int = 100_000, dim: int = 128, batch: int = 256,
         dense_in: int = 13, cross: int = 2, pairwise: bool = False) -> keras.Model:
    dense = keras.Input((dense_in,), batch_size=batch, name="dense_features")
    ids = [keras.Input((1,), batch_size=batch, dtype="int32", name=f"ids{i}")
           for i in range(tables)]
    b = layers.Dense(256, activation="relu")(dense)
    b = layers.Dense(dim, activation="relu")(b)
    embs = [layers.Reshape((dim,))(layers.Embedding(rows, dim, name=f"table{i}")(x))
            for i, x in enumerate(ids)]
    feats = [b] + embs
    if pairwise:
        dots = [layers.Dot(axes=1)([feats[i], feats[j]])
                for i in range(len(feats)) for j in range(i)]
        x = layers.Concatenate()([b] + dots)
    else:
        x = layers.Concatenate()([b, DotInteraction()(feats)])
    x0 = x
    for _ in range(cross):        # DCN cross layers: x0 * (W x + b) + x
        x = layers.Add()([layers.Multiply()([x0, layers.Dense(x0.shape[-1])(x)]), x])
    t = layers.Dense(256, activation="relu")(x)
    return keras.Model([dense] + ids, layers.Dense(1)(t), name="dlrm")


def inception(blocks: int = 2, batch: int = 32, size: int = 28, ch: int = 256) -> keras.Model:
    x_in = keras.Input((size, size, 3), batch_size=batch, name="image")
    x = layers.Conv2D(ch, 3, padding="same", activation="relu")(x_in)
    for _ in range(blocks):
        conv = lambda k, t: layers.Conv2D(ch // 4, k, padding="same", activation="relu")(t)
        b1 = conv(1, x)
        b2 = conv(3, conv(1, x))
        b3 = conv(5, conv(1, x))
        b4 = conv(1, layers.MaxPooling2D(3, strides=1, padding="same")(x))
        x = layers.Concatenate()([b1, b2, b3, b4])
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(x_in, layers.Dense(1000)(x), name="inception")


class T5Block(layers.Layer):
    """A T5 layer: self-attention with a relative position bias (computed here when
    ``first``, and returned for the next layers), optional cross-attention, a ReLU FFN."""

    def __init__(self, d, heads, ff, seq, first=False, causal=False, cross=False, **kw):
        super().__init__(**kw)
        self.d, self.h, self.seq = d, heads, seq
        self.first, self.causal, self.cross = first, causal, cross
        dense = lambda n: layers.Dense(n, use_bias=False)
        self.q, self.k, self.v, self.o = dense(d), dense(d), dense(d), dense(d)
        if cross:
            self.cq, self.ck, self.cv, self.co = dense(d), dense(d), dense(d), dense(d)
            self.n3 = layers.LayerNormalization()
        self.wi = layers.Dense(ff, use_bias=False, activation="relu")
        self.wo = dense(d)
        self.n1, self.n2 = layers.LayerNormalization(), layers.LayerNormalization()
        if first:
            self.rel = layers.Embedding(32, heads)

    def _bias(self):
        pos = ops.arange(self.seq)
        rel = pos[None, :] - pos[:, None]
        b = ops.transpose(self.rel(ops.clip(rel + 16, 0, 31)), (2, 0, 1))[None]
        if self.causal:
            b = b + (ops.cast(rel > 0, "float32") * -1e9)[None, None]
        return b

    def _attend(self, q, k, v, o, x, kv, bias):
        b, s, t, hd = x.shape[0], x.shape[1], kv.shape[1], self.d // self.h
        split = lambda z, n: ops.transpose(ops.reshape(z, (b, n, self.h, hd)), (0, 2, 1, 3))
        sc = ops.matmul(split(q(x), s), ops.transpose(split(k(kv), t), (0, 1, 3, 2)))
        a = ops.softmax(sc if bias is None else sc + bias, axis=-1)
        c = ops.transpose(ops.matmul(a, split(v(kv), t)), (0, 2, 1, 3))
        return o(ops.reshape(c, (b, s, self.d)))

    def call(self, x, bias=None, enc=None):
        if self.first:
            bias = self._bias()
        y = self.n1(x)
        x = x + self._attend(self.q, self.k, self.v, self.o, y, y, bias)
        if self.cross:
            x = x + self._attend(self.cq, self.ck, self.cv, self.co, self.n3(x), enc, None)
        return x + self.wo(self.wi(self.n2(x))), bias


def t5_bias(depth: int, d: int = 1024, heads: int = 16, ff: int = 4096, seq: int = 128,
            batch: int = 8, vocab: int = 32128) -> keras.Model:
    src = keras.Input((seq,), batch_size=batch, dtype="int32", name="src")
    tgt = keras.Input((seq,), batch_size=batch, dtype="int32", name="tgt")
    emb = layers.Embedding(vocab, d, name="shared")
    x, bias = emb(src), None
    for i in range(depth):
        x, bias = T5Block(d, heads, ff, seq, first=i == 0, name=f"enc{i}")(x, bias)
    enc = layers.LayerNormalization(name="enc_norm")(x)
    y, bias = emb(tgt), None
    for i in range(depth):
        y, bias = T5Block(d, heads, ff, seq, first=i == 0, causal=True, cross=True,
                          name=f"dec{i}")(y, bias, enc=enc)
    out = layers.Dense(vocab, use_bias=False, name="lm_head")(layers.LayerNormalization()(y))
    return keras.Model([src, tgt], out, name=f"t5-bias-depth{depth}")


def build(name: str) -> keras.Model:
    """The Keras model ``name`` (one of :data:`NAMES`, N a number of layers per stack)."""
    if name == "dlrm-8":
        return dlrm()
    if name == "dlrm-8-pairwise":
        return dlrm(pairwise=True)
    if name == "inception-2":
        return inception()
    if name.startswith("t5-bias-depth") and name[len("t5-bias-depth"):].isdigit():
        return t5_bias(int(name[len("t5-bias-depth"):]))
    raise ValueError(f"unknown wide model {name!r}: use one of {', '.join(NAMES)} "
                     "(N: layers per stack, e.g. t5-bias-depth24)")


def capture(name: str, cache_dir: str | None = None) -> tuple[Any, float]:
    """The captured graph of ``name`` and the seconds it took (0.0 from the cache)."""
    import tapas
    from tapas.ir import Graph
    path = os.path.join(cache_dir, f"wide-{name}.json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return Graph.loads(f.read()), 0.0
    start = time.perf_counter()
    model = build(name)
    graph = tapas.capture(model, name=name)
    seconds = time.perf_counter() - start
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(graph.dumps())
    return graph, seconds
