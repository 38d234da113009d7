"""Propagate a seed through a GraphNode's ops: placements, comms, rewrites, flops.

In:  a GraphNode, a :class:`~tapas.sharding.patterns.pattern.PatternSeed` (placement of each
     node input and of some weights), the graph index and N.
Out: :func:`propagate` -- a :class:`~tapas.sharding.patterns.pattern.ShardingPattern`, or
     :class:`Invalid` with the reason.

The passes, one module each:

* :mod:`~.forward` -- op by op in the node's (topological) order, with the rules of
  :mod:`tapas.sharding.rules`: the placement of every tensor, forward all-reduces where a
  partial sum meets an op that is not linear in it, rewrites, flops;
* :mod:`~.backward` -- in reverse order: the backward comms that make every gradient full,
  and the free weights whose gradient says they should be split;
* :mod:`~.expression` -- the pattern's SRC expression;
* :mod:`~.flops`, :mod:`~.trial` (the problem and :class:`Invalid`), :mod:`~.index`
  (graph-wide lookups).

:func:`propagate` runs forward and backward until nothing changes: a :class:`NeedReduce`
adds a forward all-reduce, a weight upgrade splits a free weight, and both start over.

This package imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping

from tapas.ir import GraphNode
from tapas.sharding.patterns.pattern import PatternSeed, ShardingPattern
from tapas.sharding.patterns.propagation.backward import backward_comms
from tapas.sharding.patterns.propagation.expression import node_expression
from tapas.sharding.patterns.propagation.forward import Forward, NeedReduce, run_forward
from tapas.sharding.patterns.propagation.index import GraphIndex
from tapas.sharding.patterns.propagation.trial import Invalid, Trial
from tapas.sharding.placements import Comm, Placement, Replica, Split

__all__ = ["Invalid", "propagate", "GraphIndex"]


def propagate(node: GraphNode, index: GraphIndex, num_devices: int, seed: PatternSeed,
              replicate_unknown: bool = False) -> ShardingPattern:
    """The pattern ``seed`` gives on ``node``, or :class:`Invalid` saying why there is none.
    ``replicate_unknown``: ops without a rule are allowed when all their inputs are
    replicated (only for the all-replicated pattern)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices}: must be at least 1")
    if len(seed.inputs) != len(node.inputs):
        raise Invalid(f"seed '{seed.name}' gives {len(seed.inputs)} input placements for "
                      f"{len(node.inputs)} inputs")
    return _settle(Trial(node, index, num_devices, seed, replicate_unknown))


def _settle(trial: Trial) -> ShardingPattern:
    """Forward and backward passes until no reduce is added and no weight upgraded."""
    node, seed = trial.node, trial.seed
    fixed = dict(seed.weights)
    known = {w.path for w in node.weights}
    for path in fixed:
        if path not in known:
            raise Invalid(f"seed '{seed.name}' places weight '{path}', which node "
                          f"'{node.name}' does not read")
    weights: dict[str, Placement] = {w.path: fixed.get(w.path, Replica()) for w in node.weights}
    reduce: set[str] = set()
    for _ in range(4 * (len(node.ops) + len(node.weights)) + 4):
        try:
            fw = run_forward(trial, weights, reduce)
        except NeedReduce as e:
            if e.tensors <= reduce:
                raise Invalid(f"cannot reduce partial sums {sorted(e.tensors)}") from None
            reduce |= e.tensors
            continue
        bwd, upgrades = backward_comms(trial, fw, fixed)
        if upgrades:
            for path, a in upgrades.items():
                weights[path] = Split(a)
            continue
        return _pattern(trial, fw, weights, bwd)
    raise Invalid("propagation did not settle")


def _pattern(trial: Trial, fw: Forward, weights: Mapping[str, Placement],
             bwd: list[Comm]) -> ShardingPattern:
    node, seed = trial.node, trial.seed
    tensors = {t.name: fw.produced.get(t.name, Replica()) for op in node.ops for t in op.outputs}
    outputs = tuple(fw.place.get(t.name, Replica()) for t in node.outputs)
    return ShardingPattern(seed.name, tuple(seed.inputs), outputs, dict(weights), tensors,
                           tuple(fw.fwd_comms) + tuple(bwd), dict(fw.rewrites),
                           node_expression(trial, fw, weights), float(fw.flops), seed.family,
                           dense_flops=float(fw.dense_flops), elements=float(fw.elements),
                           dense_by_width=dict(sorted(fw.dense_by_width.items())),
                           dense_by_dtype=dict(sorted(fw.dense_by_dtype.items())),
                           kernels=tuple(fw.kernels[k] for k in sorted(fw.kernels)))
