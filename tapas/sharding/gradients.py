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
from typing import Any

from tapas import ir
from tapas.sharding.rules.plumbing import RANDOM, STATEFUL_RANDOM

__all__ = ["GradientFlow", "gradient_flow", "differentiable", "topological_ops", "NO_GRADIENT",
           "NONE_GRADIENT"]

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


def topological_ops(ops: Sequence[ir.OpInfo]) -> list[ir.OpInfo]:
    """``ops`` in an order where every op comes after the ops making its inputs."""
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
    inputs it names, when it is a collection of tensor names).

    Walked GraphNode by GraphNode, each node's ops evaluated once per signature and
    boundary state (:func:`_flow_by_node`: a deep stack's layers share one evaluation);
    where some op reads a tensor of a later GraphNode, over all ops at once."""
    sources = {w.placeholder + ":0" for w in graph.weights if w.trainable}
    if input_gradients is True:
        sources |= {t.name for t in graph.inputs if t.dtype.startswith("float")}
    elif input_gradients:
        sources |= set(input_gradients)
    flows = _flow_by_node(graph, sources)
    if flows is None:
        order = topological_ops([op for node in graph.nodes for op in node.ops])
        flows = _forward(order, sources), _backward(graph, order)
    forward, backward = flows
    needed = forward & backward
    needed |= {w.path for w in graph.weights if w.trainable and w.placeholder + ":0" in needed}
    return GradientFlow(frozenset(forward), frozenset(backward), frozenset(needed))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Positions in the ops of the GraphNodes of one signature: every op output (op, k),
    the inputs read from outside the node (op, j), the ops in a topological order, the
    outputs of ops without inputs (where a weight's handle is made) and the op outputs
    that are the node's ``outputs``; the last two also as indices into the node's op
    outputs listed op by op (:func:`_output_names`)."""

    outputs: tuple[tuple[int, int], ...]
    boundary: tuple[tuple[int, int], ...]
    order: tuple[int, ...]
    roots: tuple[tuple[int, int], ...]
    declared: tuple[tuple[int, int], ...]
    flat: dict[tuple[int, int], int]
    flat_roots: tuple[int, ...]
    flat_declared: tuple[int, ...]

    @staticmethod
    def of(node: ir.GraphNode) -> _Layout:
        at = {t.name: (i, k) for i, op in enumerate(node.ops) for k, t in enumerate(op.outputs)}
        index = {id(op): i for i, op in enumerate(node.ops)}
        flat = {(i, k): x for x, (i, k) in enumerate(
            (i, k) for i, op in enumerate(node.ops) for k in range(len(op.outputs)))}
        roots = tuple((i, k) for (i, k) in at.values() if not node.ops[i].inputs)
        declared = tuple(at[t.name] for t in node.outputs if t.name in at)
        return _Layout(
            tuple(at.values()),
            tuple((i, j) for i, op in enumerate(node.ops)
                  for j, name in enumerate(op.inputs) if name not in at),
            tuple(index[id(op)] for op in topological_ops(node.ops)),
            roots, declared, flat, tuple(flat[p] for p in roots),
            tuple(flat[p] for p in declared))


def _output_names(node: ir.GraphNode) -> list[str]:
    """``node``'s op outputs, op by op (what :attr:`_Layout.flat` indexes)."""
    return [t.name for op in node.ops for t in op.outputs]


def _flow_by_node(graph: ir.Graph, sources: set[str]
                  ) -> tuple[set[str], set[str]] | None:
    """``_forward`` and ``_backward`` of ``graph``, evaluated per GraphNode in graph order:
    a node's reached tensors depend only on its structure and on which of the tensors it
    reads from outside are reached (forward), and which of its outputs are reached from
    outside (backward), so those evaluations are memoized by (signature, that state).
    None when some op reads a tensor made by a later GraphNode, or a source is made by an
    op with inputs: the whole-graph walk is then needed."""
    layouts: dict[tuple[str, int], _Layout] = {}
    keys: list[tuple[str, int]] = []
    for node in graph.nodes:
        key = (node.signature or f"#{node.id}", len(node.ops))
        if key not in layouts:
            layouts[key] = _Layout.of(node)
        keys.append(key)
    # per GraphNode: its op outputs (by _Layout.flat) and the tensors it reads from outside
    # (by _Layout.boundary), named once for both walks
    names = [_output_names(node) for node in graph.nodes]
    reads = [[node.ops[i].inputs[j] for i, j in layouts[key].boundary]
             for node, key in zip(graph.nodes, keys)]
    producer: dict[str, int] = {}
    for node, made in zip(graph.nodes, names):
        producer.update(dict.fromkeys(made, node.id))
    read_outside: dict[int, list[str]] = {}   # per GraphNode: its tensors read by others
    for node, outside in zip(graph.nodes, reads):
        for name in outside:
            made = producer.get(name, -1)
            if made >= node.id:
                return None
            read_outside.setdefault(made, []).append(name)
    for t in graph.outputs:
        read_outside.setdefault(producer.get(t.name, -1), []).append(t.name)
    forward = set(sources)
    memo: dict[tuple[Any, ...], Any] = {}
    found = 0
    for node, key, made, outside in zip(graph.nodes, keys, names, reads):
        lay = layouts[key]
        state = (key, tuple(map(forward.__contains__, outside)),
                 tuple([made[x] in sources for x in lay.flat_roots]))
        found += sum(state[2])
        if state not in memo:
            memo[state] = tuple(lay.flat[p] for p in
                                _node_forward(node, lay, state[1], state[2]))
        forward.update(map(made.__getitem__, memo[state]))
    if found != sum(1 for name in sources if name in producer):
        return None
    backward = {t.name for t in graph.outputs}
    memo = {}
    for node, key, made, outside in zip(reversed(graph.nodes), reversed(keys), reversed(names),
                                        reversed(reads)):
        lay = layouts[key]
        declared = [made[x] for x in lay.flat_declared]
        # only its outputs read by others (or graph outputs) can be reached from outside
        extra = () if set(read_outside.get(node.id, ())).issubset(declared) else \
            tuple(made[lay.flat[p]] in backward for p in lay.outputs)
        state = (key, tuple(map(backward.__contains__, declared)), extra)
        if state not in memo:
            outs, live = _node_backward(node, lay, tuple(
                made[lay.flat[p]] in backward for p in lay.outputs))
            at = {p: x for x, p in enumerate(lay.boundary)}
            memo[state] = (tuple(lay.flat[p] for p in outs), tuple(at[p] for p in live))
        outs, live = memo[state]
        backward.update(map(made.__getitem__, outs))
        backward.update(map(outside.__getitem__, live))
    return forward, backward


def _node_forward(node: ir.GraphNode, lay: _Layout, boundary: tuple[bool, ...],
                  local_sources: tuple[bool, ...]) -> tuple[tuple[int, int], ...]:
    """The positions of ``node``'s op outputs reached forward (``_forward`` on its ops;
    ``local_sources``: which of ``lay.roots`` are sources)."""
    reached = {node.ops[i].inputs[j] for (i, j), r in zip(lay.boundary, boundary) if r}
    reached |= {node.ops[i].outputs[k].name for (i, k), s in zip(lay.roots, local_sources)
                if s}
    reached = _forward([node.ops[i] for i in lay.order], reached)
    return tuple((i, k) for i, k in lay.outputs if node.ops[i].outputs[k].name in reached)


def _node_backward(node: ir.GraphNode, lay: _Layout, outside: tuple[bool, ...]
                   ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The positions of ``node``'s op outputs and outside reads reached backward
    (``_backward`` on its ops, its outputs reached from outside as ``outside`` says)."""
    reached = {node.ops[i].outputs[k].name for (i, k), r in zip(lay.outputs, outside) if r}
    live: set[int] = set()
    for i in reversed(lay.order):
        op = node.ops[i]
        if op.type not in NO_GRADIENT and any(t.name in reached and differentiable(t.dtype)
                                              for t in op.outputs):
            reached |= set(op.inputs)
            live.add(i)
    return (tuple((i, k) for i, k in lay.outputs if node.ops[i].outputs[k].name in reached),
            tuple((i, j) for i, j in lay.boundary if i in live))
