"""Which tensors of a captured graph get a gradient in a training step.

In:  a :class:`tapas.ir.Graph` (its ops, trainable weights, inputs and outputs), and
     whether gradients with respect to the float graph inputs are asked for too.
Out: :class:`GradientFlow`: the tensors computed from a gradient source (``forward``), the
     tensors some graph output depends on through ops with a gradient (``backward``) and
     their intersection, the tensors whose gradient TensorFlow computes (``needed``, plus
     the paths of the trainable weights whose gradient it computes).

TensorFlow only runs the backward of a value that lies on a path from a source (a
trainable weight, or a float input when input gradients are asked for) to the loss, and
never through an op without a gradient (``ArgMax``, comparisons, ``Shape``...). The
collective audit (``tapas.execution.checking.audit``) uses this to leave out backward collectives
that the program never runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from tapas import ir
from tapas.sharding.rules.plumbing import RANDOM, STATEFUL_RANDOM

__all__ = ["GradientFlow", "gradient_flow", "differentiable", "NO_GRADIENT", "NONE_GRADIENT"]

# ops whose registered gradient returns None: TensorFlow's tape records them, so their
# outputs are watched and a collective after them runs its backward half (keras-hub
# D-FINE's sampling offsets go through Floor), but nothing flows back to their inputs
NONE_GRADIENT = frozenset({"Floor", "Ceil", "Round", "Rint"})
# ops through which no gradient flows back to any input: TensorFlow registers them
# ``NotDifferentiable`` (comparisons, shape queries, ``OneHot``, ``Range``, ``LinSpace``,
# the random ops), registers no gradient for them (``IsNan``, bool ops, the random ops'
# key-counter ops), or registers one that returns None (``ArgMax``, :data:`NONE_GRADIENT`)
# or raises (``PreventGradient``). ``Sign`` is not one: its gradient is zeros, which the
# backward computes and passes on. The one list for the whole package (the propagation's
# gradient records, the gradient flow, the runtime and the audit); tests/test_gradients.py
# checks it against TensorFlow's gradient registry.
NO_GRADIENT = frozenset({
    "ArgMax", "ArgMin", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "StopGradient", "PreventGradient", "Shape", "ShapeN", "Size", "Rank", "ZerosLike",
    "OnesLike", "IsFinite", "IsNan", "IsInf", "LogicalAnd", "LogicalOr", "LogicalNot",
    "OneHot", "Range", "LinSpace", *RANDOM, *STATEFUL_RANDOM}) | NONE_GRADIENT


@dataclasses.dataclass(frozen=True)
class GradientFlow:
    """Tensor names (and trainable weight paths) reached by the gradient of a graph."""

    forward: frozenset[str]    # computed from a gradient source through ops with a gradient
    backward: frozenset[str]   # a graph output depends on them through ops with a gradient
    needed: frozenset[str]     # forward and backward: TensorFlow computes their gradient


def differentiable(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` can carry a gradient."""
    # a variant is a TensorList handle (a loop's TensorArray: keras-hub RWKV-7's unrolled
    # recurrence writes its states into one and stacks them): TensorFlow differentiates
    # through TensorListSetItem / TensorListStack, so the values read back get gradients
    return dtype.startswith(("float", "bfloat", "half", "complex")) or \
        dtype in ("resource", "variant")


def _topological(ops: Sequence[ir.OpInfo]) -> list[ir.OpInfo]:
    producer = {t.name: k for k, op in enumerate(ops) for t in op.outputs}
    consumers: dict[int, list[int]] = {k: [] for k in range(len(ops))}
    indegree = [0] * len(ops)
    for k, op in enumerate(ops):
        for name in set(op.inputs):
            if name in producer:
                consumers[producer[name]].append(k)
                indegree[k] += 1
    ready = [k for k, d in enumerate(indegree) if d == 0]
    order = []
    while ready:
        k = ready.pop()
        order.append(ops[k])
        for j in consumers[k]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    return order


def _forward(order: Sequence[ir.OpInfo], sources: set[str]) -> set[str]:
    reached = set(sources)
    for op in order:
        if (op.type not in NO_GRADIENT or op.type in NONE_GRADIENT) and \
                any(name in reached for name in op.inputs):
            reached |= {t.name for t in op.outputs if differentiable(t.dtype)}
    return reached


def _backward(graph: ir.Graph, order: Sequence[ir.OpInfo]) -> set[str]:
    # a gradient reaches an op only through an output that can carry one: TopKV2's
    # indices, read by a gather whose values are detached (keras-hub D-FINE's query
    # selection), pass nothing back to the scores
    reached = {t.name for t in graph.outputs}
    for op in reversed(order):
        if op.type not in NO_GRADIENT and any(t.name in reached and differentiable(t.dtype)
                                              for t in op.outputs):
            reached |= set(op.inputs)
    return reached


def gradient_flow(graph: ir.Graph, *,
                  input_gradients: bool | Collection[str] = False) -> GradientFlow:
    """The gradient flow of a training step over ``graph``: sources are the trainable
    weights, and the float graph inputs too when ``input_gradients`` is True (or the graph
    inputs it names, when it is a collection of tensor names)."""
    order = _topological([op for node in graph.nodes for op in node.ops])
    sources = {w.placeholder + ":0" for w in graph.weights if w.trainable}
    if input_gradients is True:
        sources |= {t.name for t in graph.inputs if t.dtype.startswith("float")}
    elif input_gradients:
        sources |= set(input_gradients)
    forward, backward = _forward(order, sources), _backward(graph, order)
    needed = {name for name in forward if name in backward}
    needed |= {w.path for w in graph.weights if w.trainable and w.placeholder + ":0" in needed}
    return GradientFlow(frozenset(forward), frozenset(backward), frozenset(needed))
