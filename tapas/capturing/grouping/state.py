"""The grouping pass's state: every op classified, and the GraphNode each belongs to.

In:  a :class:`~tapas.capturing.grouping.raw.RawGraph`.
Out: :class:`GroupingState` -- per op: live, weight-side, constant, opaque, producers and
     consumers, scope; the groups made so far (``new_group``, ``assign``). The phases
     (seeding, absorbing, building) extend it, one module each.

This module imports no TensorFlow.
"""

from __future__ import annotations



from tapas.capturing.op_kinds import (GATHER_OPS, HEAVY_OPS, KNOWN_OPS, META_OPS, READ_OPS,
                                      SIDE_EFFECT_OPS, SOURCE_OPS)
from tapas.capturing.grouping.raw import RawGraph, op_name, scope_of


# Residual-style adds: never absorbed forward into a layer whose input they also read.
ADD_LIKE = frozenset({"Add", "AddV2", "AddN"})
MAX_SEED_HOPS = 8


class GroupingState:
    """The ops of a traced graph and the GraphNodes (groups) they are put in."""

    def __init__(self, raw: RawGraph) -> None:
        self.raw = raw
        self.ops = list(raw.ops)
        self.index = {op.name: i for i, op in enumerate(self.ops)}
        n = len(self.ops)
        # data producers (op index per input, -1 for unknown) and consumers
        self.producers: list[list[int]] = [[self.index.get(op_name(t), -1) for t in op.inputs]
                                           for op in self.ops]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for i, prods in enumerate(self.producers):
            for p in prods:
                if p >= 0 and i not in self.consumers[p]:
                    self.consumers[p].append(i)
        self.ctrl_in: list[list[int]] = [
            [self.index[c] for c in raw.control_inputs.get(op.name, ()) if c in self.index]
            for op in self.ops]
        self.ctrl_out: list[list[int]] = [[] for _ in range(n)]
        for i, cs in enumerate(self.ctrl_in):
            for c in cs:
                self.ctrl_out[c].append(i)
        self.scopes = [scope_of(op.name) for op in self.ops]
        self.group: list[int] = [-1] * n
        self.members: list[list[int]] = []
        self.locked: list[bool] = []
        self.gscope: list[tuple[str, ...]] = []
        self.reads: list[set[int]] = []     # ops outside the group whose outputs it reads
        self.leftover: list[bool] = []

    # ---- classification ----------------------------------------------------------------
    def classify(self) -> None:
        ops, n = self.ops, len(self.ops)
        out_ops = {self.index[op_name(t.name)] for t in self.raw.outputs
                   if op_name(t.name) in self.index}
        # live = ancestors of the outputs through data and control edges, except control
        # edges into variable reads. TF orders every stateful op before the function
        # returns, so a variable read whose value nobody uses (the pooler of a backbone
        # whose pooled output is ignored) hangs off the outputs by a control edge only:
        # that read is dead, and its weight unused.
        live = [False] * n
        stack = list(out_ops)
        for s in stack:
            live[s] = True
        while stack:
            i = stack.pop()
            effectful = [p for p in self.ctrl_in[i] if p >= 0 and self.ops[p].type not in READ_OPS]
            for p in self.producers[i] + effectful:
                if p >= 0 and not live[p]:
                    live[p] = True
                    stack.append(p)
        self.live = live
        self.input_ops = {self.index[name] for name in self.raw.inputs if name in self.index}
        weight_ph = {self.index[name] for name in self.raw.weights if name in self.index}
        self.weight_ph = weight_ph
        # weights each op derives from (only for weight-side ops)
        self.wside: list[frozenset[int]] = [frozenset()] * n   # placeholder indices
        self.is_wside = [False] * n
        self.is_const = [False] * n
        self.opaque = [False] * n
        for i, op in enumerate(ops):
            t = op.type
            prods = [p for p in self.producers[i] if p >= 0]
            if i in weight_ph:
                self.is_wside[i] = True
                self.wside[i] = frozenset({i})
                continue
            if i in self.input_ops:
                continue
            if t == "Placeholder":  # a captured non-variable tensor: a constant to us
                self.is_const[i] = True
                continue
            if t not in KNOWN_OPS or t.endswith("Call") or "Function" in t:
                self.opaque[i] = True
                continue
            if t in SIDE_EFFECT_OPS:
                continue
            if t in META_OPS or (t in SOURCE_OPS and all(self.is_const[p] for p in prods)):
                self.is_const[i] = True
                continue
            if not prods:
                continue
            if all(self.is_const[p] or self.is_wside[p] for p in prods) and \
                    any(self.is_wside[p] for p in prods) and t not in HEAVY_OPS | GATHER_OPS:
                self.is_wside[i] = True
                self.wside[i] = frozenset().union(*(self.wside[p] for p in prods))
                continue
            if all(self.is_const[p] for p in prods) and t not in HEAVY_OPS:
                self.is_const[i] = True

    def data_producers(self, i: int) -> list[int]:
        """Producers that carry activations (not constants, not weights)."""
        return [p for p in self.producers[i]
                if p >= 0 and not self.is_const[p] and not self.is_wside[p]]

    # ---- groups ------------------------------------------------------------------------
    def new_group(self, scope: tuple[str, ...], locked: bool = False,
                  leftover: bool = False) -> int:
        self.members.append([])
        self.locked.append(locked)
        self.gscope.append(scope)
        self.reads.append(set())
        self.leftover.append(leftover)
        return len(self.members) - 1

    def assign(self, i: int, g: int) -> None:
        assert self.group[i] == -1, self.ops[i].name
        self.group[i] = g
        self.members[g].append(i)
        self.reads[g].discard(i)
        for p in self.producers[i]:
            if p >= 0 and self.group[p] != g:
                self.reads[g].add(p)
