"""The SRC expression of a pattern (``C_AR(MatMul(S1(X), S0(W)))``).

In:  a :class:`~tapas.sharding.patterns.propagation.trial.Trial`, its finished
     :class:`~tapas.sharding.patterns.propagation.forward.Forward` and the weight placements.
Out: the expression text: the node's outputs as a tree over its inputs (``X``/``X0``,
     ``X1``...) and weights (``W``/``W0``, ``W1``...) with their placements, one ``Apply``
     per computing op (data movement and identities are skipped) and a ``C_AR`` where a
     forward all-reduce sits; a node of more than 24 ops is shown as one computation named
     after its kind.

This module imports no TensorFlow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tapas.ir import Kind
from tapas.sharding.expressions import Apply, Coll, Expr, Leaf
from tapas.sharding.patterns.propagation.forward import Forward
from tapas.sharding.patterns.propagation.trial import Trial
from tapas.sharding.placements import Collective, Placement, Replica

__all__ = ["node_expression"]

_MAX_EXPR_APPLIES = 24
_PASS_THROUGH = ("Identity", "Cast", "StopGradient", "Snapshot")


def node_expression(trial: Trial, fw: Forward, weights: Mapping[str, Placement]) -> str:
    node = trial.node
    leaves: dict[str, Leaf] = {}
    one_in = len(node.inputs) == 1
    for i, t in enumerate(node.inputs):
        leaves[t.name] = Leaf(fw.place[t.name], "X" if one_in else f"X{i}")
    one_w = len(node.weights) == 1
    for j, w in enumerate(node.weights):
        leaves[f"{w.placeholder}:0"] = Leaf(weights[w.path], "W" if one_w else f"W{j}")
    if not node.outputs:
        # a node whose results nobody reads (a dead branch that still reads its weights)
        return str(Apply("Unread", tuple(leaves.values()) or (Leaf(Replica(), "const"),)))
    builder = _Builder(fw, leaves)
    outs = [builder.build(t.name) for t in node.outputs]
    if builder.applies > _MAX_EXPR_APPLIES:
        # too large to read: the node as one computation over its leaves
        args = tuple(leaves.values()) or (Leaf(Replica(), "const"),)
        body: Expr = Apply(_op_token(_kind_name(node.kind)), args)
        if any(t.name in builder.reduced for t in node.outputs):
            body = Coll(Collective.ALL_REDUCE, (), body)
        return str(body)
    exprs: list[Expr] = [e if e is not None else Leaf(fw.place.get(t.name, Replica()), "const")
                         for e, t in zip(outs, node.outputs)]
    if len(exprs) == 1:
        return str(exprs[0])
    return str(Apply("Outputs", tuple(exprs)))


class _Builder:
    """Expressions of the node's tensors, memoised, counting the ``Apply`` nodes made."""

    def __init__(self, fw: Forward, leaves: Mapping[str, Leaf]) -> None:
        self.fw = fw
        self.leaves = leaves
        self.reduced = {c.tensor for c in fw.fwd_comms}
        self.memo: dict[str, Expr | None] = {}
        self.applies = 0

    def build(self, t: str) -> Expr | None:
        if t in self.memo:
            return self.memo[t]
        self.memo[t] = None  # cycle guard
        e = self._compute(t)
        if e is not None and t in self.reduced:
            e = Coll(Collective.ALL_REDUCE, (), e)
        self.memo[t] = e
        return e

    def _compute(self, t: str) -> Expr | None:
        if t in self.leaves:
            return self.leaves[t]
        if t not in self.fw.producer:
            return None
        rec = self.fw.recs[self.fw.producer[t]]
        args = [a for a in (self.build(x) for _, x in rec.data_inputs) if a is not None]
        if not args:
            return None
        if len(args) == 1 and ((rec.spec is not None and rec.spec.flops == "none")
                               or rec.op.type in _PASS_THROUGH):
            return args[0]
        self.applies += 1
        return Apply(_op_token(rec.op.type), tuple(args))


def _op_token(name: str) -> str:
    tok = re.sub(r"[^A-Za-z0-9_./:\-]", "_", name)
    if re.fullmatch(r"R|P|S\d+|C_.*", tok):
        tok = "Op_" + tok
    return tok


def _kind_name(kind: Kind) -> str:
    return "".join(part.capitalize() for part in kind.value.split("-"))
