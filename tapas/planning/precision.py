"""Mixed precision in the cost model: the dtype each FLOP and each byte is priced in.

In:  a captured :class:`tapas.ir.Graph` (its tensors' and weights' dtypes), a precision
     name (``PRECISIONS``: ``"float32"``, ``"mixed_float16"``, ``"mixed_bfloat16"``, as
     Keras names its dtype policies; None: the graph's own dtypes), a
     :class:`tapas.planning.cluster.Cluster` (its peak per dtype, ``Cluster.peak_flops``).
Out: :func:`graph_precision` (the policy a graph was captured under, read from its
     dtypes), :func:`resolve` (the override a search prices with), :func:`check_precision`
     (ValueError naming a precision that is not one of ``PRECISIONS``),
     :func:`compute_dtype`, :func:`priced_dtype` (the dtype a tensor is priced in under an
     override), :func:`comm_bytes` (a collective's message in that dtype) and
     :func:`dense_factor` (seconds of a pattern's contractions relative to all of them at
     ``device_peak_flops``).

A contraction is priced at the peak of the dtype its output carries in the captured graph
(``ShardingPattern.dense_by_dtype``): under ``mixed_bfloat16`` Keras computes in bfloat16
and keeps the variables in float32, so the matmuls run at the bfloat16 peak, the
activations' collectives move 2 bytes per element and the weights' gradients 4. An
override re-prices as if the model computed in the given policy: every floating-point
contraction at the policy's compute dtype, every floating-point activation (collectives,
memory) in it, weights and their gradients in float32 (the variables of all three
policies). Memory-bound ops keep their pricing (their elements, or FLOPs at
``device_peak_flops``). docs/search.md, "Mixed precision", says what it changes.

This module imports no TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from tapas.ir import Graph, Kind, dtype_bytes
from tapas.planning.cluster import Cluster

__all__ = ["PRECISIONS", "check_precision", "compute_dtype", "graph_precision", "resolve",
           "priced_dtype", "comm_bytes", "dense_factor"]

# the policies an override may name (Keras's names): variables float32, compute in the dtype
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
# the floating-point dtypes an override re-prices (float64 and integers keep their dtype)
_FLOATS = frozenset({"float16", "bfloat16", "float32"})
_HALF = ("float16", "bfloat16")
Options = TypeVar("Options", bound=Any)     # tapas.planning.cost.CostOptions (it imports this)


def check_precision(value: object) -> str | None:
    """``value`` if it is None or one of ``PRECISIONS``; ValueError naming it otherwise."""
    if value is None or value in PRECISIONS:
        return value    # type: ignore[return-value]
    raise ValueError(f"precision={value!r}: must be one of {list(PRECISIONS)} (a Keras dtype "
                     "policy: float32 compute, or float16 / bfloat16 compute with float32 "
                     "variables), or None to price the dtypes the model was captured in")


def compute_dtype(precision: str) -> str:
    """The dtype the contractions of ``precision`` compute in: ``"mixed_bfloat16"`` ->
    ``"bfloat16"``, ``"float32"`` -> ``"float32"``."""
    check_precision(precision)
    return precision[len("mixed_"):] if precision.startswith("mixed_") else precision


def graph_precision(graph: Graph) -> str:
    """The dtype policy ``graph`` was captured under: ``"mixed_<dtype>"`` when most of its
    floating-point GraphNode outputs are float16 or bfloat16 while its trainable weights
    are float32, else the dtype most of those outputs have (``"float32"``; ``"float16"``
    for a model whose variables are float16 too); ``"float32"`` when it has none."""
    outputs = collections.Counter(
        t.dtype for node in graph.nodes if node.kind is not Kind.INPUT
        for t in node.outputs if t.dtype in _FLOATS or t.dtype == "float64")
    if not outputs:
        return "float32"
    compute = max(sorted(outputs), key=lambda d: outputs[d])
    weights = collections.Counter(w.dtype for w in graph.weights if w.trainable)
    variables = max(sorted(weights), key=lambda d: weights[d]) if weights else compute
    if compute in _HALF and variables == "float32":
        return f"mixed_{compute}"
    return compute


def resolve(options: Options, graph: Graph) -> tuple[Options, str]:
    """``options`` for ``graph`` and the precision its plans are priced in: an override
    (``options.precision``) that names the policy ``graph`` was captured under is dropped
    (its own dtypes are exact, float32 outputs of a mixed model included), any other is
    kept; without one, the graph's own policy (:func:`graph_precision`)."""
    own = graph_precision(graph)
    if options.precision is None:
        return options, own
    if options.precision == own:
        return dataclasses.replace(options, precision=None), own
    return options, options.precision


def priced_dtype(dtype: str, precision: str | None, weight: bool = False) -> str:
    """The dtype a tensor of ``dtype`` is priced in under the override ``precision``: itself
    without one (None) or when not floating point; float32 for a weight (or its gradient);
    the policy's compute dtype for any other floating-point tensor."""
    if precision is None or dtype not in _FLOATS:
        return dtype
    return "float32" if weight else compute_dtype(precision)


def comm_bytes(comm: object, precision: str | None, weight: bool = False) -> int:
    """The message size of a ``Comm`` (``bytes`` of its ``dtype``) in its
    :func:`priced_dtype` (``weight``: the collective is on a weight or its gradient); a
    comm without a dtype (the loss's statistics) keeps its bytes."""
    nbytes = int(getattr(comm, "bytes"))
    dtype = getattr(comm, "dtype", None)
    if precision is None or dtype is None:
        return nbytes
    priced = priced_dtype(dtype, precision, weight)
    return nbytes if priced == dtype else nbytes // dtype_bytes(dtype) * dtype_bytes(priced)


def dense_factor(cluster: Cluster, dense_by_dtype: Mapping[str, float] | None,
                 precision: str | None = None) -> float:
    """Seconds of a pattern's contractions over what they take all at
    ``device_peak_flops``: each dtype's share of the FLOPs (``dense_by_dtype``) at
    ``Cluster.peak_flops`` of its :func:`priced_dtype`. 1.0 without dtypes and override;
    with an override and no dtypes, every FLOP in the policy's compute dtype.

    >>> c = Cluster.v100_ethernet()
    >>> round(dense_factor(c, {"float16": 3.0, "float32": 1.0}), 4)   # 3/4 at 125 TFLOP/s
    0.3442
    >>> round(dense_factor(c, {"float32": 1.0}, "mixed_float16"), 4)  # all at 125, not 15.7
    0.1256
    """
    if not dense_by_dtype:
        if precision is None:
            return 1.0
        return cluster.device_peak_flops / cluster.peak_flops(compute_dtype(precision))
    total = math.fsum(dense_by_dtype.values())
    if total <= 0:
        return 1.0
    return math.fsum(f / total * cluster.device_peak_flops
                     / cluster.peak_flops(priced_dtype(d, precision))
                     for d, f in dense_by_dtype.items())
