"""Grouping phases 1-3: input and opaque GraphNodes, ``tapas.layers`` layers, and seeds.

In:  a classified :class:`~tapas.capturing.grouping.state.GroupingState`.
Out: :class:`Seeding` -- ``make_seeds``: every op reading a weight seeds its layer's
     GraphNode (one per application of the layer, at most one weight-reading matmul or
     convolution each), every weight-less heavy op its own.

This module imports no TensorFlow.
"""

from __future__ import annotations



from tapas.ir import Kind
from tapas.capturing.op_kinds import GATHER_OPS, HEAVY_OPS, SIDE_EFFECT_OPS
from tapas.capturing.grouping.raw import common_prefix, tapas_marker
from tapas.capturing.grouping.state import MAX_SEED_HOPS
from tapas.capturing.grouping.state import GroupingState


class Seeding(GroupingState):
    """Seeds of GraphNodes (module docstring)."""

    def make_seeds(self) -> None:
        for i in sorted(self.input_ops):
            self.assign(i, self.new_group(self.scopes[i], locked=True))
        self.mark_tapas_layers()
        for i in range(len(self.ops)):
            if self.live[i] and self.opaque[i] and self.group[i] < 0:
                self.assign(i, self.new_group(self.scopes[i], locked=True))
        # weight seeds, keyed by layer (parent of the weight path)
        by_layer: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            if not self.live[i] or self.group[i] >= 0 or self.is_wside[i] or self.is_const[i]:
                continue
            if op.type in SIDE_EFFECT_OPS:
                continue
            ws = set()
            for p in self.producers[i]:
                if p >= 0 and self.is_wside[p]:
                    ws |= self.wside[p]
            if not ws:
                continue
            paths = sorted(self.raw.weights[self.ops[w].name].path for w in ws)
            layer = paths[0].rpartition("/")[0] or paths[0]
            by_layer.setdefault(layer, []).append(i)
        # a weight-reading op belongs to its own layer's GraphNode: another layer's fill
        # (an op on a path between that layer's seeds, e.g. RWKV-7's token-shift mix read by
        # the receptance projection) must not take it
        every_seed = {s for seeds in by_layer.values() for s in seeds}
        for layer, seeds in by_layer.items():
            for cluster in (part for c in self._cluster_seeds(seeds)
                            for part in self._split_heavy(c)):
                scope = self._lcp([self.scopes[s] for s in cluster]
                                  + [self.scopes[p] for s in cluster for p in self.producers[s]
                                     if p >= 0 and self.is_wside[p]])
                g = self.new_group(scope)
                for s in cluster:
                    self.assign(s, g)
                self._fill_between(g, cluster, every_seed)
        # weight-less heavy ops seed their own GraphNodes
        for i, op in enumerate(self.ops):
            if self.live[i] and self.group[i] < 0 and op.type in HEAVY_OPS and \
                    not self.is_const[i] and not self.is_wside[i]:
                self.assign(i, self.new_group(self.scopes[i]))

    def mark_tapas_layers(self) -> None:
        """Every op of one call of a ``tapas.layers`` layer (its ops share a scope prefix
        ending in a ``tapas.<kind>`` component) is one locked GraphNode of that kind."""
        self.marked_kind: list[Kind | None] = [None] * len(self.ops)
        by_call: dict[tuple[str, ...], int] = {}
        self.marked_groups: set[int] = set()
        for i in range(len(self.ops)):
            if not self.live[i] or self.group[i] >= 0 or self.is_wside[i] or self.is_const[i]:
                continue
            found = tapas_marker(self.scopes[i])
            if found is None:
                continue
            scope, kind = found
            g = by_call.get(scope)
            if g is None:
                g = by_call[scope] = self.new_group(scope, locked=True)
                self.marked_groups.add(g)
            self.assign(i, g)
            self.marked_kind[i] = kind

    @staticmethod
    def _lcp(scopes: list[tuple[str, ...]]) -> tuple[str, ...]:
        if not scopes:
            return ()
        first = scopes[0]
        n = len(first)
        for s in scopes[1:]:
            n = min(n, common_prefix(first, s))
        return first[:n]

    def _downstream(self, start: int, limit: int) -> dict[int, int]:
        """Ops reachable from ``start`` within ``limit`` data hops, with their distance."""
        dist = {start: 0}
        frontier = [start]
        for d in range(1, limit + 1):
            nxt = []
            for i in frontier:
                for c in self.consumers[i]:
                    if c not in dist and self.live[c]:
                        dist[c] = d
                        nxt.append(c)
            frontier = nxt
        return dist

    def _cluster_seeds(self, seeds: list[int]) -> list[list[int]]:
        """Split one layer's seeds into applications: seeds a few hops apart belong to one
        call of the layer; a layer applied twice (shared weights) gives two clusters. A
        lookup (gather) and a matmul of the same table are never one application: that is
        a tied embedding and LM head, however close a shallow model puts them."""
        parent = {s: s for s in seeds}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        seed_set = set(seeds)
        lookup = {s: self.ops[s].type in GATHER_OPS for s in seeds}
        for s in seeds:
            for t in self._downstream(s, MAX_SEED_HOPS):
                if t in seed_set and t != s and lookup[t] == lookup[s]:
                    parent[find(t)] = find(s)
        clusters: dict[int, list[int]] = {}
        for s in seeds:
            clusters.setdefault(find(s), []).append(s)
        return [sorted(c) for c in clusters.values()]

    def _split_heavy(self, cluster: list[int]) -> list[list[int]]:
        """At most one weight-reading matmul/conv per GraphNode: a layer holding several
        (an FFN's wi and wo, fused q/k/v projections, MoE experts' wi and wo) gives one
        GraphNode per projection. Other seeds (bias adds, scales) go with the nearest
        projection upstream of them, else the nearest downstream."""
        heavy = [s for s in cluster if self.ops[s].type in HEAVY_OPS]
        if len(heavy) <= 1:
            return [cluster]
        parts: dict[int, list[int]] = {h: [h] for h in heavy}
        rest: list[int] = []
        reach = {h: self._downstream(h, MAX_SEED_HOPS) for h in heavy}
        for s in cluster:
            if s in parts:
                continue
            up = [(reach[h][s], h) for h in heavy if s in reach[h]]
            if up:
                parts[min(up)[1]].append(s)
                continue
            mine = self._downstream(s, MAX_SEED_HOPS)
            down = [(mine[h], h) for h in heavy if h in mine]
            if down:
                parts[min(down)[1]].append(s)
            else:
                rest.append(s)
        out = [sorted(p) for p in parts.values()]
        return out + ([rest] if rest else [])

    def _fill_between(self, g: int, cluster: list[int], seeds: set[int]) -> None:
        """Ops on a short path from one seed of the cluster to another join the group,
        except ``seeds`` (other layers' weight-reading ops, which seed their own)."""
        if len(cluster) < 2:
            return
        targets = set(cluster)
        for s in cluster:
            dist = self._downstream(s, MAX_SEED_HOPS)
            # walk back from reached targets through ops in `dist`
            stack = [t for t in dist if t in targets and t != s]
            seen = set(stack)
            while stack:
                t = stack.pop()
                for p in self.producers[t]:
                    if p in dist and p not in seen and p != s:
                        seen.add(p)
                        stack.append(p)
            for op in sorted(seen):
                if self.group[op] < 0 and not self.is_const[op] and not self.is_wside[op] \
                        and not self.opaque[op] and op not in seeds:
                    self.assign(op, g)

    # ---- absorption --------------------------------------------------------------------
