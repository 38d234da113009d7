"""Whether each example's outputs depend only on its own row of the inputs.

In:  a :class:`tapas.ir.Graph` whose inputs carry the batch on axis 0.
Out: :func:`row_independence`: None when every output row is computed from the same row
     of the inputs alone, else the reason it is not (the first op that combines rows, by
     name).

The batch is followed op by op with the sharding rules (``tapas.sharding.rules``, the
labels of an einsum-style spec): it starts on axis 0 of every graph input of the batch's
size, and an op that reads it keeps the rows apart when the batch is one label of its spec,
that label is not one the op needs whole (``no_split``: batch norm's training statistics,
a softmax or slice over the batch) and every output keeps it. An op whose outputs lose the
label (a mean or sum over the batch, ``q @ k.T`` across examples, where the batch is two
labels) combines rows, and so, as far as anyone knows, does an op without a rule; what is
computed from their outputs is combined too, and matters where it reaches an output of the
model or a variable (a check of the token ids that only feeds an ``Assert`` does not).
A variable write of a value computed from the examples is refused. A random draw of the batch's
shape (dropout's mask) is followed like an input: a stateless draw's first rows are the
same whatever the size of its first axis, so the filled-up batch draws, for its own rows,
the numbers Keras draws for the smaller batch; a draw with the batch on another axis is
refused. Tensors that never met the batch (weights, constants, shapes, seeds) are the
same for every row. The model's outputs must carry the batch on axis 0.

What it is for: a last batch of fewer examples can be filled up with copies of its rows
(weighted 0) and run as one full batch only when the copies cannot change the other rows'
outputs (``tapas.execution.api.fit_data.tail_refusal``).

This module imports no TensorFlow.
"""

from __future__ import annotations

from tapas import ir
from tapas.sharding import rules
from tapas.sharding.gradients import topological_ops
from tapas.sharding.patterns.cache import graph_index
from tapas.sharding.patterns.propagation import GraphIndex
from tapas.sharding.rules.plumbing import RANDOM, STATEFUL_RANDOM, VARIABLE_WRITES

__all__ = ["row_independence"]

_BATCH_NORM = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
# the draws themselves (not StatelessRandomGetKeyCounter*, which read only the seed)
_RANDOM = frozenset(RANDOM + STATEFUL_RANDOM) - {"StatelessRandomGetKeyCounter",
                                                 "StatelessRandomGetKeyCounterAlg"}


def row_independence(graph: ir.Graph) -> str | None:
    """None when every output row of ``graph`` depends only on the same input row; else
    why not."""
    sizes = {t.shape[0] for t in graph.inputs if t.shape}
    if len(sizes) != 1 or not isinstance(next(iter(sizes)), int):
        return "the inputs do not share one static batch size on axis 0"
    batch = next(iter(sizes))
    # tensor name -> the axis that carries the batch (tensors that never met it: absent)
    axis_of = {t.name: 0 for t in graph.inputs if t.shape and t.shape[0] == batch}
    mixed: dict[str, str] = {}   # tensors computed from combined rows: why (where)
    index = graph_index(graph)
    for op in topological_ops([op for node in graph.nodes for op in node.ops]):
        names = [x for x in op.inputs if not x.startswith("^")]
        why = next((mixed[x] for x in names if x in mixed), None)
        if why is None:
            why = _drawn(op, batch, axis_of) if op.type in _RANDOM else \
                _follow(op, names, axis_of, index)
        if why is None:
            continue
        if op.type in VARIABLE_WRITES:      # kept past the step
            return why
        mixed.update(dict.fromkeys((t.name for t in op.outputs), why))
    for t in graph.outputs:
        if t.name in mixed:
            return mixed[t.name]
        if axis_of.get(t.name) != 0:
            return f"the output {t.name!r} does not carry the batch on axis 0"
    return None


def _drawn(op: ir.OpInfo, batch: int, axis_of: dict[str, int]) -> str | None:
    """A random draw: one of the batch's shape with the batch on axis 0 is followed as the
    inputs are (the filled-up batch draws the same numbers for its own rows: a stateless
    draw's first rows do not depend on how many follow); one without the batch's size is
    the same for every row."""
    for t in op.outputs:
        if t.shape and t.shape[0] == batch:
            axis_of[t.name] = 0
        elif t.shape is None or batch in t.shape:
            return (f"op '{op.name}' ({op.type}) draws random numbers of shape "
                    f"{list(t.shape) if t.shape else '?'}, not with the batch on axis 0")
    return None


def _follow(op: ir.OpInfo, names: list[str], axis_of: dict[str, int], index: GraphIndex
            ) -> str | None:
    """Record where ``op``'s outputs carry the batch; why not when ``op`` combines rows
    (or writes a value of the examples into a variable). ``names``: its data inputs."""
    carried = [(i, axis_of[x]) for i, x in enumerate(names) if x in axis_of]
    if not carried:
        return None
    if op.type == "IdentityN":            # output i is input i
        for i, a in carried:
            axis_of[op.outputs[i].name] = a
        return None
    shapes = index.tensor
    ctx = rules.OpContext(tuple(shapes[x].shape if x in shapes else None for x in names),
                          tuple(t.shape for t in op.outputs),
                          lambda i: index.const_value(names[i]) if i < len(names) else None)
    spec = rules.spec_for(op, ctx)
    if isinstance(spec, str):
        return f"{spec}: it is not known to keep the examples of a batch apart"
    labels = set()
    for i, a in carried:
        labs = spec.inputs[i] if i < len(spec.inputs) else None
        if labs is None:
            if spec.meta_any:
                continue                   # only its static shape is read
            return (f"op '{op.name}' ({op.type}) reads the batch-carrying tensor "
                    f"{names[i]!r} as a shape or index")
        labels.add(labs[a])
    if not labels:
        return None
    if op.type in VARIABLE_WRITES:
        return (f"op '{op.name}' ({op.type}) writes a value computed from the examples "
                "into a variable")
    if len(labels) > 1 or labels & spec.no_split:
        return f"op '{op.name}' ({op.type}) combines the examples of its batch"
    label = next(iter(labels))
    inference_bn = op.type in _BATCH_NORM and not op.attrs.get("is_training", False)
    for j, t in enumerate(op.outputs):
        labs = spec.outputs[j] if j < len(spec.outputs) else None
        if labs is not None and label in labs:
            axis_of[t.name] = labs.index(label)
        elif not (inference_bn and j > 0):   # (its moving statistics, passed through)
            return (f"op '{op.name}' ({op.type}) combines the examples of its batch "
                    f"(its output {t.name!r} loses the batch axis)")
    return None
