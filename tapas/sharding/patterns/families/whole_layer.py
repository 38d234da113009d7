"""Sharding seeds for the whole-layer GraphNodes of ``tapas.layers``.

In:  GraphNodes of kind ``attention`` (``tapas.layers.MultiHeadAttention``),
     ``feed-forward`` (``tapas.layers.FeedForward``) and ``moe`` (``tapas.layers.MoE``):
     these kinds come only from those layers, so their weights are recognized by the
     names the layers give them.
Out: :class:`PatternSeed` s; the op rules propagate them through the layer's ops.

| kind | pattern | weights | collectives |
|---|---|---|---|
| attention | ``heads`` | q/k/v kernels ``S1`` (heads), their biases ``S0``, output kernel ``S0`` | fwd AR of the output, bwd AR of the inputs (Megatron) |
| feed-forward | ``column-row`` | ``wi*`` kernels ``S1``, their biases ``S0``, ``wo`` kernel ``S0`` | fwd AR of the output, bwd AR of the input |
| all three | ``batch`` | replicated | bwd AR of every weight gradient (data parallel) |

``batch`` splits every input on axis 0 (an input whose axis 0 has size 1, such as T5's
position bias ``[1, heads, q, k]``, stays replicated). ``moe`` has ``batch`` only: see
:class:`tapas.layers.MoE` for why the expert split is not offered inside one GraphNode. ``heads`` also splits an additive
score bias input on its heads axis (``S1``): a replicated bias is sliced locally for free.
"""

from __future__ import annotations

from collections.abc import Iterator

from tapas.ir import GraphNode, Kind
from tapas.sharding.patterns.pattern import BATCH, COLUMN_ROW, HEADS, PatternSeed
from tapas.sharding.patterns.seeds import SeedContext, register
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["attention_seeds", "feed_forward_seeds", "moe_seeds"]


def _by_suffix(node: GraphNode) -> dict[str, str]:
    """``{weight name inside the layer: weight path}``."""
    return {w.path.rsplit("/", 1)[-1]: w.path for w in node.weights}


def _batch(node: GraphNode, ctx: SeedContext) -> PatternSeed:
    """Every input whose axis 0 is the batch (the largest axis 0 among the inputs) split
    on it; the others (a ``[1, heads, q, k]`` bias) replicated."""
    sizes = [t.shape[0] for t in node.inputs if t.shape]
    batch = max(sizes, default=1)
    return PatternSeed(BATCH, tuple(
        Split(0) if batch > 1 and t.shape and t.shape[0] == batch else Replica()
        for t in node.inputs))


@register(Kind.ATTENTION)
def attention_seeds(node: GraphNode, ctx: SeedContext) -> Iterator[PatternSeed]:
    yield _batch(node, ctx)
    w = _by_suffix(node)
    if not {"query_kernel", "key_kernel", "value_kernel", "output_kernel"} <= set(w):
        return
    weights: dict[str, Placement] = {}
    for name in ("query", "key", "value"):
        weights[w[f"{name}_kernel"]] = Split(1)
        if f"{name}_bias" in w:
            weights[w[f"{name}_bias"]] = Split(0)
    weights[w["output_kernel"]] = Split(0)
    if "output_bias" in w:
        weights[w["output_bias"]] = Replica()
    # inputs: query, value (when given) replicated; a rank-4 score bias split on heads
    inputs = tuple(Split(1) if len(t.shape or ()) == 4 and (t.shape or (0, 0))[1] > 1
                   else Replica() for t in node.inputs)
    yield PatternSeed(HEADS, inputs, weights)


@register(Kind.FEED_FORWARD)
def feed_forward_seeds(node: GraphNode, ctx: SeedContext) -> Iterator[PatternSeed]:
    yield _batch(node, ctx)
    w = _by_suffix(node)
    if "wo_kernel" not in w:
        return
    weights: dict[str, Placement] = {w["wo_kernel"]: Split(0)}
    for name, path in w.items():
        if name.startswith("wi") and name.endswith("_kernel"):
            weights[path] = Split(1)
        elif name.startswith("wi") and name.endswith("_bias"):
            weights[path] = Split(0)
        elif name == "wo_bias":
            weights[path] = Replica()
    yield PatternSeed(COLUMN_ROW, tuple(Replica() for _ in node.inputs), weights)


@register(Kind.MOE)
def moe_seeds(node: GraphNode, ctx: SeedContext) -> Iterator[PatternSeed]:
    # Only data parallelism: an expert split would need the input's gradient to be the
    # sum of a full part (through the replicated gate) and a partial part (through the
    # experts) inside one GraphNode, which the propagation rejects (see tapas.layers.MoE).
    yield _batch(node, ctx)
