"""The resharded inputs that a training step keeps for its backward pass.

In:  a :class:`tapas.ir.Graph`, one GraphNode of it and one of its inputs (by index), and
     the tensors whose gradient the step computes (``PatternTable.gradients``; None: not
     known, every gradient counts as computed).
Out: :func:`kept_for_backward`: whether the GraphNode's backward reads that input's value,
     so that the step holds it from the forward pass until then; :func:`kept_penalties`:
     per input, the search's memory penalty where it is kept (what a resharding edge into
     it is charged per byte it grows). :func:`node_resharded_bytes`:
     per device, the bytes of the resharded inputs a GraphNode keeps that are larger
     where the reader has them than where their producer made them (an all-gather's
     output beside the producer's shard), for ``tapas.planning.plancost.plan_memory``.

An input is kept when an op of the GraphNode reads it (or a view of it: ``Reshape``,
``Squeeze``, ``ExpandDims``, ``Identity``..., which share its buffer) and that op's
gradient reads it (``tapas.sharding.rules``' ``linear``): an op linear in all its data
inputs together (``Add``, ``Transpose``, ``Sum``, a one-input ``Reshape``) reads none; an
op linear in the input but not jointly (``Mul``, ``MatMul``, a division's numerator)
reads it for another input's gradient, so only when another data input gets one; an op
not linear in it (``Square``, ``Rsqrt``, ``Softmax``, a division's denominator) reads it
for its own gradient, so when one of the op's outputs gets one. An op without a rule is
taken to read it. This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tapas.ir import Graph, GraphNode, OpInfo
from tapas.planning.precision import priced_dtype
from tapas.sharding import rules
from tapas.sharding.rules import shape as shape_rules

__all__ = ["kept_for_backward", "kept_penalties", "grown_bytes", "input_kept_bytes",
           "node_resharded_bytes", "VIEW_OPS"]

# ops whose output is a view of their first input's buffer (no copy): what reads the view
# keeps the input
VIEW_OPS = frozenset({"Reshape", *shape_rules.SQUEEZE, "Identity", "Snapshot",
                      "EnsureShape", "StopGradient", "PreventGradient"})


def _needed(name: str, gradients: Collection[str] | None) -> bool:
    return gradients is None or name in gradients


def _reads_for_gradient(op: OpInfo, name: str, shapes: Mapping[str, Any],
                        gradients: Collection[str] | None) -> bool:
    """Whether ``op``'s gradient reads its input ``name`` (see the module docstring)."""
    inputs = [x for x in op.inputs if not x.startswith("^")]
    spec = rules.spec_for(op, rules.OpContext(
        tuple(shapes.get(x) for x in inputs), tuple(t.shape for t in op.outputs),
        lambda i: None))
    if isinstance(spec, str) or len(spec.inputs) != len(inputs):
        return True     # no rule, or operands the rule does not describe: taken as read
    data = [i for i, labels in enumerate(spec.inputs) if labels is not None]
    if spec.linear == "all":
        return False
    for i in data:
        if inputs[i] != name:
            continue
        if i in spec.linear:
            if any(_needed(inputs[j], gradients) for j in data if j != i):
                return True
        elif any(_needed(t.name, gradients) for t in op.outputs):
            return True
    return False


def kept_for_backward(node: GraphNode, index: int, gradients: Collection[str] | None) -> bool:
    """Whether ``node``'s backward reads the value of its input ``index``."""
    shapes = {t.name: t.shape for t in node.inputs}
    for op in node.ops:
        for t in op.outputs:
            shapes[t.name] = t.shape
    for w in node.weights:
        shapes.setdefault(f"{w.placeholder}:0", w.shape)
    views = {node.inputs[index].name}
    for op in node.ops:     # in the GraphNode's order: a view comes after what it views
        read = [x for x in op.inputs if x in views]
        if not read:
            continue
        if op.type in VIEW_OPS and op.inputs and op.inputs[0] in views:
            views.update(t.name for t in op.outputs)
            continue
        if any(_reads_for_gradient(op, x, shapes, gradients) for x in set(read)):
            return True
    return False


def kept_penalties(node: GraphNode, gradients: Collection[str] | None,
                   penalty: float) -> tuple[float, ...]:
    """Per input of ``node``: ``penalty`` (seconds per byte) where :func:`kept_for_backward`,
    else 0; empty when ``penalty`` is 0. A search prices a resharding edge into the input
    with it, on the bytes the reshard grows the tensor to (:func:`grown_bytes`)."""
    if not penalty:
        return ()
    return tuple(penalty if kept_for_backward(node, j, gradients) else 0.0
                 for j in range(len(node.inputs)))


def grown_bytes(tensor: Any, have: Any, want: Any, n: int, precision: Any) -> float:
    """``tensor``'s bytes per device at ``want`` where that is more than at ``have`` (an
    all-gather's whole tensor beside the producer's shard), else 0: the second tensor a
    reader keeping the resharded input holds (``precision``: the priced one)."""
    if tensor.shape is None or have is want or have == want:
        return 0.0
    dtype = priced_dtype(tensor.dtype, precision)
    b = want.local_bytes(tensor.shape, dtype, n)
    return b if b > have.local_bytes(tensor.shape, dtype, n) else 0.0


def input_kept_bytes(node: GraphNode, index: int, have: Any, want: Any, n: int, options: Any,
                     gradients: Collection[str] | None) -> float:
    """Bytes per device the step keeps of ``node``'s input ``index`` resharded from
    ``have`` (its producer's placement) to ``want`` (the reader's): :func:`grown_bytes`
    when :func:`kept_for_backward`, else 0."""
    b = grown_bytes(node.inputs[index], have, want, n, options.precision)
    return b if b and kept_for_backward(node, index, gradients) else 0.0


def node_resharded_bytes(node: GraphNode, table: Any, patterns: Sequence[int],
                         producers: Mapping[str, tuple[int, int]], options: Any) -> float:
    """Bytes per device of ``node``'s resharded inputs the step keeps for the backward
    pass: each input whose placement differs from its producer's output and whose local
    size there is larger than the producer's shard (an all-gather's output, the whole
    tensor on every device), at the reader's local size, when :func:`kept_for_backward`.
    The producer's output is counted by the plan already; this is the second tensor."""
    info = table.infos[node.id][patterns[node.id]]
    total = 0.0
    for j, (t, want) in enumerate(zip(node.inputs, info.inputs)):
        src = producers.get(t.name)
        if src is None:
            continue
        have = table.infos[src[0]][patterns[src[0]]].outputs[src[1]]
        total += input_kept_bytes(node, j, have, want, table.num_devices, options,
                                  table.gradients)
    return total
