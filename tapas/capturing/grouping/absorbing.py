"""Grouping phases 4-6: absorption of light and preparatory ops, leftovers, batch norms.

In:  the seeded state (:class:`~tapas.capturing.grouping.seeding.Seeding`).
Out: :class:`Absorbing` -- ``absorb``, ``leftovers``, ``attach_rest``,
     ``merge_batchnorm``: every live op in a group.

This module imports no TensorFlow.
"""

from __future__ import annotations



from tapas.ir import WeightInfo
from tapas.capturing.op_kinds import (BATCHNORM_OPS, GATHER_OPS, HEAVY_OPS, LIGHT_OPS,
                                      SIDE_EFFECT_OPS, SOFTMAX_OPS)
from tapas.capturing.grouping.raw import ScopeTrie, common_prefix
from tapas.capturing.grouping.state import ADD_LIKE
from tapas.capturing.grouping.seeding import Seeding


class Absorbing(Seeding):
    """Absorption, leftovers and batch-norm merging (module docstring)."""

    def _candidates(self, i: int) -> set[int]:
        op = self.ops[i]
        cands: set[int] = set()
        prods = self.data_producers(i)
        pgroups = {self.group[p] for p in prods}
        # forward: light ops fed by one GraphNode (or by it and tensors it already reads)
        # (a producer not yet grouped is fine when the GraphNode already reads its output,
        # e.g. a norm's scale-multiply of a residual stream that is still ungrouped)
        if op.type in LIGHT_OPS and prods:
            unlocked = [g for g in pgroups - {-1} if not self.locked[g]]
            if len(pgroups) == 1 and unlocked:
                cands.add(unlocked[0])
            elif op.type not in ADD_LIKE:
                for g in unlocked:
                    if all(self.group[p] == g or p in self.reads[g] for p in prods):
                        cands.add(g)
        # backward: every consumer in one GraphNode, at most one other GraphNode feeding it;
        # never an add of two activation streams (a residual add is a GraphNode of its own)
        merges_streams = op.type in ADD_LIKE and len(set(prods)) >= 2
        if op.type not in SOFTMAX_OPS and op.type not in SIDE_EFFECT_OPS and not merges_streams:
            cons = [c for c in self.consumers[i] if self.live[c]]
            cgroups = {self.group[c] for c in cons}
            if cons and len(cgroups) == 1:
                (g,) = cgroups
                if g >= 0 and not self.locked[g] and len(pgroups - {g, -1}) <= 1:
                    cands.add(g)
        return cands

    def absorb(self) -> None:
        order = [i for i in range(len(self.ops)) if self.live[i] and self._free(i)]
        while order:
            trie = ScopeTrie()
            for s in self.gscope:
                trie.add(s)
            progress = False
            deferred: list[tuple[int, int]] = []
            for i in order:
                if self.group[i] >= 0:
                    continue
                cands = self._candidates(i)
                if not cands:
                    continue
                best = max(cands, key=lambda g: (common_prefix(self.scopes[i], self.gscope[g]),
                                                  -g))
                if common_prefix(self.scopes[i], self.gscope[best]) < trie.depth(self.scopes[i]):
                    deferred.append((i, best))  # its own layer may still reach it
                    continue
                self.assign(i, best)
                progress = True
            if not progress:
                if not deferred:
                    break
                for i, g in deferred:
                    if self.group[i] < 0:
                        self.assign(i, g)
            order = [i for i in order if self.group[i] < 0]

    def _free(self, i: int) -> bool:
        return (self.group[i] < 0 and not self.is_const[i] and not self.is_wside[i]
                and self.ops[i].type not in SIDE_EFFECT_OPS)

    def leftovers(self) -> None:
        for i in range(len(self.ops)):
            if not self.live[i] or not self._free(i):
                continue
            pgroups = {self.group[p] for p in self.data_producers(i)}
            if len(pgroups) == 1:
                (g,) = pgroups
                if g >= 0 and self.leftover[g] and self.ops[i].type not in ADD_LIKE:
                    self.assign(i, g)
                    continue
            self.assign(i, self.new_group(self.scopes[i], leftover=True))

    def attach_rest(self) -> None:
        """Constants, weight reads and side-effect ops join a GraphNode they touch."""
        n = len(self.ops)
        # consumers first (reverse order, so chains of constants follow their consumer)
        for i in reversed(range(n)):
            if not self.live[i] or self.group[i] >= 0:
                continue
            if self.is_const[i] or self.is_wside[i]:
                g = next((self.group[c] for c in self.consumers[i] + self.ctrl_out[i]
                          if self.group[c] >= 0 and self._open(self.group[c])), -1)
                if g < 0:
                    g = next((self.group[c] for c in self.consumers[i] + self.ctrl_out[i]
                              if self.group[c] >= 0), -1)
                if g >= 0:
                    self.assign(i, g)
        # weight reads with no data consumer (e.g. a read only for a shape): the GraphNode
        # that holds another read of the same weight
        holder: dict[int, int] = {}
        for i in range(n):
            if self.group[i] >= 0 and self.is_wside[i]:
                for w in self.wside[i]:
                    holder.setdefault(w, self.group[i])
        for i in range(n):
            if self.live[i] and self.group[i] < 0 and self.is_wside[i]:
                g = next((holder[w] for w in sorted(self.wside[i]) if w in holder), -1)
                if g >= 0:
                    self.assign(i, g)
        # side effects and anything else: producer's GraphNode, else a control neighbour's
        for i in range(n):
            if not self.live[i] or self.group[i] >= 0:
                continue
            near = ([self.group[p] for p in self.producers[i] if p >= 0]
                    + [self.group[c] for c in self.consumers[i] + self.ctrl_out[i]]
                    + [self.group[c] for c in self.ctrl_in[i]])
            g = next((x for x in near if x >= 0 and not self.locked[x]), -1)
            if g < 0:
                g = next((x for x in near if x >= 0), -1)
            if g < 0:
                g = self.new_group(self.scopes[i], leftover=True)
            self.assign(i, g)

    def _open(self, g: int) -> bool:
        """A GraphNode constants and weight reads may join: not an input or opaque one."""
        return not self.locked[g] or g in self.marked_groups

    # ---- post passes -------------------------------------------------------------------
    def merge_batchnorm(self) -> None:
        """Conv/Dense followed by a batch norm that only it feeds: one GraphNode."""
        for g in range(len(self.members)):
            if not self.members[g] or not self._is_batchnorm(g):
                continue
            prods = {p for i in self.members[g] for p in self.data_producers(i)
                     if self.group[p] != g}
            if len(prods) != 1:
                continue
            (p,) = prods
            src = self.group[p]
            if self.locked[src] or not any(self.ops[i].type in HEAVY_OPS
                                           for i in self.members[src]):
                continue
            if any(self.group[c] != g for c in self.consumers[p] if self.live[c]):
                continue
            for i in list(self.members[g]):
                self.group[i] = src
                self.members[src].append(i)
            self.members[g] = []

    def _is_batchnorm(self, g: int) -> bool:
        ms = self.members[g]
        if any(self.ops[i].type in BATCHNORM_OPS for i in ms):
            return True
        weights = self._group_weights(g)
        return bool(weights) and any(not w.trainable for w in weights) and \
            not any(self.ops[i].type in HEAVY_OPS | GATHER_OPS for i in ms)

    def _group_weights(self, g: int) -> list[WeightInfo]:
        seen: dict[str, WeightInfo] = {}
        for i in self.members[g]:
            phs = set(self.wside[i]) if self.is_wside[i] else set()
            for p in self.producers[i]:
                if p >= 0 and self.is_wside[p]:
                    phs |= self.wside[p]
            for w in sorted(phs):
                info = self.raw.weights[self.ops[w].name]
                seen.setdefault(info.path, info)
        return list(seen.values())

    # ---- output --------------------------------------------------------------------------
