"""Template selection: frequent subgraphs -> the templates of the folded graph.

In:  the frequent :class:`~tapas.mining.apriori.Pattern` s of a round, the support and
     ``min_size``.
Out: the chosen templates, largest first, each with the non-overlapping instances no larger
     template took; a template spanning two layers that start alike is cut into one per
     layer (:func:`layer_parts`), isomorphic templates are merged, and each becomes a
     :class:`~tapas.mining.folded.Template` (:func:`make_template`).

This module imports no TensorFlow.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any


from tapas.ir import Graph
from tapas.mining.apriori import (Index, Pattern, canonical, count_nonoverlapping,
                                  find_isomorphism, permute, pick_nonoverlapping)
from tapas.mining.folded import Template

# the whole graph's embeddings for a window's (see select)
Whole = Callable[[list[tuple[int, ...]]], list[tuple[int, ...]]]


# =========================================================================================
# Folding: choose templates, largest first
# =========================================================================================

def _boundary(index: Index, emb: tuple[int, ...]) -> int:
    """Distinct tensors entering or leaving one instance (fewer: a cleaner cut)."""
    inside = set(emb)
    ins, outs = set(), set()
    for v in emb:
        for src, t in index.in_tensors[v]:
            if src not in inside:
                ins.add(t)
        for dst, t in index.out_tensors[v]:
            if dst not in inside:
                outs.add(t)
    return len(ins) + len(outs)


def select(index: Index, frequent: list[Pattern], support: int, min_size: int,
            active: list[bool], whole: Whole | None = None
            ) -> list[tuple[Pattern, list[tuple[int, ...]]]]:
    """Choose templates among the frequent subgraphs with at least ``min_size`` GraphNodes.

    This is a set-packing problem (instances may not overlap). Greedy: go through the
    subgraphs in a priority order; each takes the non-overlapping embeddings still free
    and becomes a template if it gets at least ``support`` of them. Greedy is run with
    two orders and the packing that covers the most GraphNodes wins (ties: fewer
    templates, then the first order):

    1. largest first (then fewest boundary tensors, most occurrences) -- the default
       preference: block-sized templates rather than many small ones;
    2. cleanest cut first (fewest boundary tensors per GraphNode, then largest) -- saves
       small graphs where a large subgraph that straddles layers occurs twice by chance.

    On a window of a deep stack (:mod:`tapas.mining.window`) ``whole`` maps a list of
    embeddings to the whole graph's, so that occurrences, instances and coverage are
    counted as on the whole graph (the window holds fewer copies of some subgraphs than
    of others); ``support`` is the whole graph's too.
    """
    eligible = [p for p in frequent if p.size >= min_size]
    if not eligible:
        return []
    info = []
    for p in eligible:
        first = min(p.embs, key=min)
        info.append((p, _boundary(index, first), min(first)))
    heads = [lambda x: (-x[0].size, x[1]), lambda x: (x[1] / x[0].size, -x[0].size)]
    counts = _Counts(whole)
    blocked0 = {v for v in range(index.n) if not active[v]}
    best: tuple[tuple[int, int, int], list] | None = None
    for rank, head in enumerate(heads):
        blocked = set(blocked0)
        picked = []
        covered = 0
        for p in _in_order(info, head, counts, blocked):
            if all(not blocked.isdisjoint(e) for e in p.embs):
                continue
            insts = pick_nonoverlapping(p.embs, blocked)
            n_insts = counts.instances(insts)
            if n_insts >= support:
                picked.append((p, insts))
                for e in insts:
                    blocked.update(e)
                covered += p.size * n_insts
        score = (-covered, len(picked), rank)
        if best is None or score < best[0]:
            best = (score, picked)
    assert best is not None
    return best[1]


class _Counts:
    """Occurrences and instances of a subgraph counted on the whole graph (see select)."""

    def __init__(self, whole: Whole | None) -> None:
        self.whole = whole
        self.cache: dict[int, int] = {}

    def occurrences(self, p: Pattern) -> int:
        if self.whole is None:
            return p.count
        c = self.cache.get(id(p))
        if c is None:
            c = self.cache[id(p)] = count_nonoverlapping(self.whole(p.embs))
        return c

    def instances(self, insts: list[tuple[int, ...]]) -> int:
        return len(insts) if self.whole is None else len(self.whole(insts))


def _in_order(info: list[tuple[Pattern, int, int]], head: Callable[[Any], Any],
              counts: _Counts, blocked: set[int]) -> Iterator[Pattern]:
    """The subgraphs sorted by ``head``, then most occurrences, then first GraphNode.
    Occurrences are counted only where ``head`` ties and only for subgraphs not yet
    ``blocked`` (on a window they are counted on the whole graph, which is not free)."""
    for _, group in itertools.groupby(sorted(info, key=head), key=head):
        members = list(group)
        if len(members) > 1:
            members = [x for x in members if any(blocked.isdisjoint(e) for e in x[0].embs)]
            members.sort(key=lambda x: (-counts.occurrences(x[0]), x[2]))
        for x in members:
            yield x[0]


def layer_parts(graph: Graph, index: Index, pat: Pattern, insts: list[tuple[int, ...]],
                 min_size: int) -> list[list[int]]:
    """Split a template that spans two layers starting alike (layer splitting).

    Number the positions in the topological order of the first instance. If the induced
    subgraph grown from the first position re-occurs, disjointly, from a later position b
    of the same template (a greedy rooted match, checked edge by edge) and that repeated
    head is substantial -- at least 3 GraphNodes, two of them with weights
    when the graph has weights -- the template is two layers that start the same way
    (e.g. a dense layer and a MoE layer, both opening with self-attention): cut it before
    b, if both parts stay connected and hold at least ``min_size`` GraphNodes, and split the
    parts again. Returns lists of pattern positions, one per part (topological order).
    """
    first = insts[0]
    order = sorted(range(pat.size), key=lambda p: first[p])
    topo = {p: i for i, p in enumerate(order)}
    nb: list[dict[int, int]] = [{} for _ in range(pat.size)]   # code seen from the key
    for a, b, c in pat.edges:
        nb[a][b] = c
        nb[b][a] = index.rev[c]
    weighted = [bool(graph.nodes[first[p]].weights) for p in range(pat.size)]
    any_weights = any(weighted)
    need = 3

    def head(a: int, b: int, allowed: set[int]) -> dict[int, int]:
        m, dom, img = {a: b}, {a}, {b}
        queue = [(a, b)]
        while queue:
            x, y = queue.pop(0)
            for x2 in sorted(nb[x], key=topo.__getitem__):
                if x2 not in allowed or x2 in dom or x2 in img:
                    continue
                for y2 in sorted(nb[y], key=topo.__getitem__):
                    if (y2 not in allowed or y2 in dom or y2 in img or y2 == x2
                            or nb[y][y2] != nb[x][x2] or pat.labels[y2] != pat.labels[x2]):
                        continue
                    if all(nb[x2].get(xx) == nb[y2].get(m[xx]) for xx in dom):
                        m[x2] = y2
                        dom.add(x2)
                        img.add(y2)
                        queue.append((x2, y2))
                        break
        return m

    def connected(part: list[int]) -> bool:
        inside = set(part)
        seen, stack = {part[0]}, [part[0]]
        while stack:
            x = stack.pop()
            for y in nb[x]:
                if y in inside and y not in seen:
                    seen.add(y)
                    stack.append(y)
        return len(seen) == len(inside)

    def split(part: list[int]) -> list[list[int]]:
        if len(part) < 2 * min_size:
            return [part]
        allowed = set(part)
        a = part[0]
        best: tuple[int, int] | None = None
        for b in part[1:]:
            if pat.labels[b] != pat.labels[a]:
                continue
            m = head(a, b, allowed)
            if len(m) < need or (any_weights and sum(weighted[x] for x in m) < 2):
                continue
            if best is None or len(m) > best[0]:
                best = (len(m), b)
        if best is None:
            return [part]
        cut = topo[best[1]]
        left = [p for p in part if topo[p] < cut]
        right = [p for p in part if topo[p] >= cut]
        if (len(left) < min_size or len(right) < min_size or not connected(left)
                or not connected(right)):
            return [part]
        return split(left) + split(right)

    return split(order)


def merge_isomorphic(index: Index, chosen: list[tuple[tuple[int, ...], list[tuple[int, ...]],
                                                        int, int, int]]
                      ) -> list[tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]]:
    """One template per isomorphism class: layer splitting can cut a template into
    identical parts, and a later round can find a subgraph an earlier one chose."""
    out: list[tuple[tuple[int, ...], list[tuple[int, ...]], int, int, int]] = []
    exact: dict[Any, int] = {}
    fuzzy: dict[Any, list[tuple[int, Pattern]]] = defaultdict(list)
    for labels, insts, support, rnd, total in chosen:
        first = insts[0]
        where = {v: i for i, v in enumerate(first)}
        edges = [(where[v], where[u], c) for v in first for u, c in index.adj[v].items()
                 if u in where and where[v] < where[u]]
        key, order, discrete, colors = canonical(labels, edges, index.rev)
        inv = [0] * len(order)
        for i, p in enumerate(order):
            inv[p] = i
        can_labels = tuple(labels[p] for p in order)
        can_insts = [tuple(e[p] for p in order) for e in insts]
        target = exact.get(key) if discrete else None
        if not discrete:
            can_edges = []
            for a, b, c in edges:
                x, y = inv[a], inv[b]
                can_edges.append((x, y, c) if x < y else (y, x, index.rev[c]))
            pat = Pattern(can_labels, tuple(sorted(can_edges)), [], 0, colors, key)
            for j, other in fuzzy[key]:
                f = find_isomorphism(pat, other, index.rev)
                if f is not None:
                    can_insts, target = permute(can_insts, f), j
                    break
            else:
                fuzzy[key].append((len(out), pat))
        if target is None:
            if discrete:
                exact[key] = len(out)
            out.append((can_labels, can_insts, support, rnd, total))
        else:
            lab0, insts0, sup0, rnd0, total0 = out[target]
            out[target] = (lab0, insts0 + can_insts, sup0, rnd0, max(total0, total))
    return out


def make_template(tid: int, graph: Graph, index: Index, labels: Sequence[int],
                   insts: list[tuple[int, ...]], support: int, round_no: int,
                   total: int) -> Template:
    insts = sorted(insts, key=min)
    # number positions in the topological order of the first instance
    perm = sorted(range(len(labels)), key=lambda p: insts[0][p])
    instances = tuple(tuple(e[p] for p in perm) for e in insts)
    first = instances[0]
    where = {v: i for i, v in enumerate(first)}
    edges = sorted((where[v], where[u], index.ports[(v, u)]) for v in first for u in index.adj[v]
                   if u in where and (v, u) in index.ports)
    return Template(id=tid, name=_common_scope([graph.nodes[v].name for v in first]),
                    signatures=tuple(index.sigs[labels[p]] for p in perm),
                    kinds=tuple(graph.nodes[v].kind.value for v in first),
                    edges=tuple(edges), instances=instances, support=total,
                    round=round_no, min_support=support)


def _common_scope(names: Sequence[str]) -> str:
    """The name scope the GraphNodes share; when that is only the model's (an instance
    that straddles two layers), the scope one level deeper that most of them share."""
    parts = [n.split("/") for n in names]
    if not parts:
        return ""
    out = []
    for seg in zip(*parts):
        if all(s == seg[0] for s in seg):
            out.append(seg[0])
        else:
            break
    if len(out) <= 1:
        deeper = Counter("/".join(p[:len(out) + 1]) for p in parts if len(p) > len(out) + 1)
        if deeper:
            scope, n = deeper.most_common(1)[0]
            if n * 2 > len(parts):
                return f"{scope} (mostly)"
    return "/".join(out)
