"""Apriori frequent-subgraph search over the GraphNode graph (paper Algorithm 1, lines 1-10).

In:  a :class:`tapas.ir.Graph` as an :class:`Index` (signatures interned as ints, labelled
     adjacency), the GraphNodes to mine and the minimum support.
Out: the frequent subgraphs level by level (:func:`apriori`): each a :class:`Pattern` with
     its canonical form and its embeddings, plus the per-level statistics.

How it stays fast (docs/mining.md): embeddings are grown, never searched for; closure;
the tiling guard; at most ``MAX_SHARED`` embeddings may share a GraphNode.

This module imports no TensorFlow.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


from tapas.ir import Graph
from tapas.mining.folded import LevelStats

# At most this many embeddings of one subgraph may share a GraphNode. Embeddings that
# share a node count once at most (occurrences may not overlap), so more of them add
# nothing to any support; without the cap a hub (T5's encoder output feeds the
# cross-attention of every decoder layer) makes the embeddings of "norm -> 3 denses"
# grow as C(48, 3).
MAX_SHARED = 16

# accept(embeddings, count): whether a subgraph with these embeddings is frequent
Accept = Callable[[Sequence[tuple[int, ...]], int], bool]



# =========================================================================================
# The graph as integer labels and labelled adjacency
# =========================================================================================

class Index:
    """Signatures interned as ints; edges between two GraphNodes as an int code.

    ``adj[v][u]`` is the code of the (possibly multiple) edges between v and u, seen from
    v: the sorted (output index, input index) pairs of the tensors v -> u and u -> v.
    ``rev[c]`` is the same code seen from the other end.
    """

    def __init__(self, graph: Graph, match_ports: bool) -> None:
        n = len(graph.nodes)
        self.n = n
        label_ids: dict[str, int] = {}
        self.sigs: list[str] = []
        self.lab: list[int] = []
        for nd in graph.nodes:
            s = nd.signature or f"<{nd.kind.value}:{','.join(nd.op_types)}>"
            lid = label_ids.get(s)
            if lid is None:
                lid = label_ids[s] = len(self.sigs)
                self.sigs.append(s)
            self.lab.append(lid)
        out_pos = [{t.name: i for i, t in enumerate(nd.outputs)} for nd in graph.nodes]
        in_pos = [{t.name: i for i, t in enumerate(nd.inputs)} for nd in graph.nodes]
        real: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        self.in_tensors: list[set[tuple[int, str]]] = [set() for _ in range(n)]
        self.out_tensors: list[set[tuple[int, str]]] = [set() for _ in range(n)]
        for e in graph.edges:
            src, dst, name = e.src, e.dst, e.tensor.name
            if src == dst:
                continue
            real[(src, dst)].add((out_pos[src].get(name, -1), in_pos[dst].get(name, -1)))
            self.in_tensors[dst].add((src, name))
            self.out_tensors[src].add((dst, name))
        # (src, dst) -> the (output index, input index) pairs of the tensors src -> dst
        self.ports = {sd: tuple(sorted(p)) for sd, p in real.items()}
        # the edge codes' pairs: the ports, or (0, 0) when ports are not matched
        fwd = self.ports if match_ports else {sd: ((0, 0),) for sd in real}
        self.codes: list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = []
        code_ids: dict[Any, int] = {}
        self.rev: list[int] = []

        def intern(key: Any) -> int:
            c = code_ids.get(key)
            if c is None:
                c = code_ids[key] = len(self.codes)
                self.codes.append(key)
                self.rev.append(-1)
            return c

        self.adj: list[dict[int, int]] = [{} for _ in range(n)]
        for (s, d) in sorted({(s, d) if s < d else (d, s) for s, d in fwd}):
            f = fwd.get((s, d), ())
            b = fwd.get((d, s), ())
            c_sd, c_ds = intern((f, b)), intern((b, f))
            self.rev[c_sd], self.rev[c_ds] = c_ds, c_sd
            self.adj[s][d] = c_sd
            self.adj[d][s] = c_ds

    def edge_pair(self, a: int, b: int, c: int) -> tuple[int, int]:
        """(src_pos, dst_pos) of the pattern edge (a, b, code c seen from a)."""
        f, _ = self.codes[c]
        return (a, b) if f else (b, a)


# =========================================================================================
# Patterns, canonical forms, counting
# =========================================================================================

class Pattern:
    """A connected labelled subgraph: labels per position, edges ``(a, b, code)`` with
    a < b and the code seen from a, and its embeddings (tuples of GraphNode ids, one per
    position, distinct node sets). ``count``: non-overlapping embeddings.

    ``fronts[i]`` is the frontier of embedding i, kept up to date as embeddings grow so
    that growing costs O(frontier) rather than O(size x degree): for each GraphNode u
    adjacent to the embedding and outside it, the ``(inside node, code seen from it)``
    pairs that connect them."""

    __slots__ = ("labels", "edges", "embs", "fronts", "count", "colors", "key")

    def __init__(self, labels: tuple[int, ...], edges: tuple[tuple[int, int, int], ...],
                 embs: list[tuple[int, ...]], count: int, colors: tuple[int, ...] = (),
                 key: Any = None,
                 fronts: list[dict[int, tuple[tuple[int, int], ...]]] | None = None) -> None:
        self.labels, self.edges, self.embs, self.count = labels, edges, embs, count
        self.colors, self.key = colors, key
        self.fronts = fronts if fronts is not None else []

    @property
    def size(self) -> int:
        return len(self.labels)


def count_nonoverlapping(embs: Sequence[tuple[int, ...]],
                          blocked: set[int] | None = None) -> int:
    """Greedy maximum set of pairwise disjoint embeddings (earliest-ending first, which is
    optimal on chains); embeddings touching ``blocked`` are skipped."""
    used: set[int] = set(blocked) if blocked else set()
    c = 0
    for e in sorted(embs, key=max):
        if used.isdisjoint(e):
            used.update(e)
            c += 1
    return c


def _cap_shared(items: list[Any], key: Callable[[Any], tuple[int, ...]] | None = None
                ) -> list[Any]:
    """Keep, in order, the embeddings that leave no GraphNode in more than MAX_SHARED."""
    if len(items) <= MAX_SHARED:
        return items
    embs = items if key is None else [key(x) for x in items]
    counts = Counter(itertools.chain.from_iterable(embs))
    if max(counts.values()) <= MAX_SHARED:
        return items
    hot = {v for v, n in counts.items() if n > MAX_SHARED}
    shared: Counter[int] = Counter()
    out = []
    for x, e in zip(items, embs):
        if hot.isdisjoint(e):
            out.append(x)
            continue
        mine_hot = [v for v in e if v in hot]
        if all(shared[v] < MAX_SHARED for v in mine_hot):
            shared.update(mine_hot)
            out.append(x)
    return out


def pick_nonoverlapping(embs: Sequence[tuple[int, ...]],
                         blocked: set[int]) -> list[tuple[int, ...]]:
    used = set(blocked)
    out = []
    for e in sorted(embs, key=max):
        if used.isdisjoint(e):
            used.update(e)
            out.append(e)
    return out


def canonical(labels: Sequence[int], edges: Sequence[tuple[int, int, int]],
               rev: Sequence[int]) -> tuple[Any, list[int], bool, tuple[int, ...]]:
    """Canonical form of a small labelled graph by colour refinement.

    Colours start as labels and are refined by the multiset of (edge code, neighbour
    colour) until stable; colour ids are ranks of sorted invariant tuples, so isomorphic
    graphs get the same colours. If every vertex ends with its own colour (the usual case:
    signatures plus wiring tell positions apart), ordering vertices by colour is canonical
    and the returned key identifies the graph up to isomorphism. Otherwise the key is an
    isomorphism invariant only (``discrete`` is False) and the caller confirms with
    :func:`find_isomorphism`.

    Returns (key, order, discrete, colours in the new order); ``order[i]`` is the old
    position that becomes position i.
    """
    k = len(labels)
    nbrs: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for a, b, c in edges:
        nbrs[a].append((c, b))
        nbrs[b].append((rev[c], a))
    col = list(labels)
    ncls = len(set(col))
    while ncls < k:
        sigs = [(col[p], tuple(sorted([(c, col[q]) for c, q in nbrs[p]]))) for p in range(k)]
        uniq = sorted(set(sigs))
        if len(uniq) == ncls:
            break
        rank = {s: i for i, s in enumerate(uniq)}
        col = [rank[s] for s in sigs]
        ncls = len(uniq)
    order = sorted(range(k), key=lambda p: (col[p], p))
    inv = [0] * k
    for i, p in enumerate(order):
        inv[p] = i
    new_labels = tuple(labels[p] for p in order)
    colors = tuple(col[p] for p in order)
    discrete = ncls == k
    if discrete:
        can = []
        for a, b, c in edges:
            x, y = inv[a], inv[b]
            can.append((x, y, c) if x < y else (y, x, rev[c]))
        can.sort()
        return (new_labels, tuple(can)), order, True, colors
    inv_edges = []
    for a, b, c in edges:
        x, y = col[a], col[b]
        inv_edges.append(min((x, y, c), (y, x, rev[c])))
    inv_edges.sort()
    return ("~", new_labels, colors, tuple(inv_edges)), order, False, colors


def permute(embs: Sequence[tuple[int, ...]], f: Sequence[int]) -> list[tuple[int, ...]]:
    """Embeddings re-ordered by an isomorphism ``f`` (position p goes to position f[p])."""
    moved = []
    for e in embs:
        t = [0] * len(f)
        for p, q in enumerate(f):
            t[q] = e[p]
        moved.append(tuple(t))
    return moved


def find_isomorphism(a: Pattern, b: Pattern, rev: Sequence[int]) -> list[int] | None:
    """A colour-, label- and edge-preserving bijection from a's positions to b's (induced:
    non-edges map to non-edges), or None. Both patterns are in refined-colour order."""
    k = a.size
    ea: dict[tuple[int, int], int] = {}
    for x, y, c in a.edges:
        ea[(x, y)], ea[(y, x)] = c, rev[c]
    eb: dict[tuple[int, int], int] = {}
    for x, y, c in b.edges:
        eb[(x, y)], eb[(y, x)] = c, rev[c]
    by_color: dict[int, list[int]] = defaultdict(list)
    for q in range(k):
        by_color[b.colors[q]].append(q)
    order = sorted(range(k), key=lambda p: (len(by_color[a.colors[p]]), p))
    f = [-1] * k
    used = [False] * k

    def extend(i: int) -> bool:
        if i == k:
            return True
        p = order[i]
        for q in by_color[a.colors[p]]:
            if used[q] or a.labels[p] != b.labels[q]:
                continue
            if all(ea.get((p, order[j])) == eb.get((q, f[order[j]])) for j in range(i)):
                f[p], used[q] = q, True
                if extend(i + 1):
                    return True
                f[p], used[q] = -1, False
        return False

    return f if extend(0) else None


class _Registry:
    """The candidates of one level, deduplicated by canonical form."""

    def __init__(self, rev: Sequence[int]) -> None:
        self.rev = rev
        self.exact: dict[Any, Pattern] = {}
        self.fuzzy: dict[Any, list[Pattern]] = defaultdict(list)
        self.members: list[Pattern] = []
        self.merged: set[int] = set()    # ids of patterns that received embeddings twice

    def add(self, labels: tuple[int, ...], edges: tuple[tuple[int, int, int], ...],
            embs: list[tuple[int, ...]], count: int,
            fronts: list[dict[int, tuple[tuple[int, int], ...]]]) -> None:
        key, order, discrete, colors = canonical(labels, edges, self.rev)
        inv = [0] * len(order)
        for i, p in enumerate(order):
            inv[p] = i
        new_edges = []
        for a, b, c in edges:
            x, y = inv[a], inv[b]
            new_edges.append((x, y, c) if x < y else (y, x, self.rev[c]))
        new_embs = [tuple(e[p] for p in order) for e in embs]
        cand = Pattern(tuple(labels[p] for p in order), tuple(sorted(new_edges)), new_embs,
                        count, colors, key, fronts)
        if discrete:
            old = self.exact.get(key)
            if old is None:
                self.exact[key] = cand
                self.members.append(cand)
            else:
                self._merge(old, new_embs, fronts)
            return
        for old in self.fuzzy[key]:
            f = find_isomorphism(cand, old, self.rev)
            if f is not None:
                self._merge(old, permute(new_embs, f), fronts)
                return
        self.fuzzy[key].append(cand)
        self.members.append(cand)

    def _merge(self, old: Pattern, embs: list[tuple[int, ...]],
               fronts: list[dict[int, tuple[tuple[int, int], ...]]]) -> None:
        seen = {tuple(sorted(e)) for e in old.embs}
        added = False
        for e, f in zip(embs, fronts):
            s = tuple(sorted(e))
            if s not in seen:
                seen.add(s)
                old.embs.append(e)
                old.fronts.append(f)
                added = True
        if added:
            pairs = _cap_shared(list(zip(old.embs, old.fronts)), key=lambda x: x[0])
            old.embs = [e for e, _ in pairs]
            old.fronts = [f for _, f in pairs]
            self.merged.add(id(old))


# =========================================================================================
# Algorithm 1
# =========================================================================================

def apriori(index: Index, nodes: list[int], support: int, *, closure: bool,
             tiling_guard: bool, round_no: int, accept: Accept | None = None
             ) -> Iterator[tuple[LevelStats, list[Pattern]]]:
    """Yield (stats, F_k) for k = 1, 2, ... on the subgraph induced by ``nodes``.

    A subgraph is frequent when ``accept(embeddings, count)`` holds, by default when its
    count (non-overlapping embeddings) reaches ``support``; a window of a deep stack
    (:mod:`tapas.mining.window`) adds a condition. Fewer than ``support`` embeddings are
    never frequent.
    """
    if accept is None:
        def accept(embs: Sequence[tuple[int, ...]], count: int) -> bool:
            return count >= support
    t0 = time.perf_counter()
    lab = index.lab
    active = [False] * index.n
    for v in nodes:
        active[v] = True
    adj = [{u: c for u, c in index.adj[v].items() if active[u]} if active[v] else {}
           for v in range(index.n)]

    # ---- level 1: group by signature -----------------------------------------------
    by_label: dict[int, list[int]] = defaultdict(list)
    for v in nodes:
        by_label[lab[v]].append(v)
    freq_label = {l for l, vs in by_label.items()
                  if len(vs) >= support and accept([(v,) for v in vs], len(vs))}
    adjf = [[(u, c) for u, c in adj[v].items() if lab[u] in freq_label] for v in range(index.n)]
    level = [Pattern((l,), (), [(v,) for v in vs], len(vs), (l,), ((l,), ()),
                      [{u: ((v, c),) for u, c in adjf[v]} for v in vs])
             for l, vs in sorted(by_label.items()) if l in freq_label]

    # Apriori on edges: an edge type (label, code, label) occurring fewer than `support`
    # times without overlap cannot be part of a frequent subgraph.
    pairs: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for v in nodes:
        if lab[v] not in freq_label:
            continue
        for u, c in adj[v].items():
            if v < u and lab[u] in freq_label:
                pairs[(lab[v], c, lab[u])].append((v, u))
    edge_ok: set[tuple[int, int, int]] = set()
    for (la, c, lb), ps in pairs.items():
        if len(ps) >= support and accept(ps, count_nonoverlapping(ps)):
            edge_ok.add((la, c, lb))
            edge_ok.add((lb, index.rev[c], la))
    yield (LevelStats(round_no, 1, len(by_label), len(level),
                      sum(len(p.embs) for p in level), time.perf_counter() - t0), level)

    k = 1
    while level and k < len(nodes):
        k += 1
        t0 = time.perf_counter()
        reg = _Registry(index.rev)
        counted = 0
        for pat in level:
            counted += _extend(pat, reg, adjf, lab, edge_ok, support, accept,
                               closure=closure, tiling_guard=tiling_guard)
        nxt = []
        for p in reg.members:
            if id(p) in reg.merged:
                p.count = count_nonoverlapping(p.embs)
            if accept(p.embs, p.count):
                nxt.append(p)
        level = nxt
        yield (LevelStats(round_no, k, counted, len(level), sum(len(p.embs) for p in level),
                          time.perf_counter() - t0), level)


def _extend(pat: Pattern, reg: _Registry, adj: list[list[tuple[int, int]]], lab: list[int],
            edge_ok: set[tuple[int, int, int]], support: int, accept: Accept, *,
            closure: bool, tiling_guard: bool) -> int:
    """Grow every embedding of ``pat`` by one adjacent GraphNode; register the frequent
    children. Returns the number of candidates counted."""
    # GraphNode -> the embeddings holding it
    owner: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(pat.embs):
        for v in e:
            owner[v].append(i)
    groups = _extension_groups(pat, owner, lab, edge_ok, tiling_guard)
    counted, scored = _frequent_extensions(pat, groups, owner, support, accept)
    if closure:
        # Absorbing extensions keep every embedding and the support: the subgraph is not
        # maximal, and the maximal ones containing it contain them too. Grow only one (the
        # smallest descriptor, a deterministic choice); the others follow at later levels.
        absorbing = [x for x in scored if x[2] == len(pat.embs) and x[3] >= pat.count]
        if absorbing:
            scored = [min(absorbing, key=lambda x: x[0])]
    for desc, kept, _, cnt in scored:
        _register_child(pat, reg, adj, desc, kept, cnt)
    return counted


# descriptor of an extension: (label of the new node, ((position, edge code), ...))
_Desc = tuple[int, tuple[tuple[int, int], ...]]


def _extension_groups(pat: Pattern, owner: Mapping[int, list[int]], lab: list[int],
                      edge_ok: set[tuple[int, int, int]], tiling_guard: bool
                      ) -> dict[_Desc, list[tuple[int, int]]]:
    """Every one-node extension of every embedding, grouped by descriptor:
    descriptor -> [(embedding index, new node)]."""
    embs, labels, k = pat.embs, pat.labels, len(pat.labels)
    groups: dict[_Desc, list[tuple[int, int]]] = defaultdict(list)
    for i, e in enumerate(embs):
        pos_of = dict(zip(e, range(k)))
        eset = None
        for u, conns in pat.fronts[i].items():
            lu = lab[u]
            if len(conns) == 1:
                v, c = conns[0]
                lst: tuple[tuple[int, int], ...] = ((pos_of[v], c),)
            else:
                lst = tuple(sorted([(pos_of[v], c) for v, c in conns]))
            if any((labels[pos], c, lu) not in edge_ok for pos, c in lst):
                continue
            if tiling_guard and u in owner:
                if eset is None:
                    eset = set(e)
                if any(j != i and eset.isdisjoint(embs[j]) for j in owner[u]):
                    continue  # u belongs to another, disjoint occurrence of this pattern
            groups[(lu, lst)].append((i, u))
    return groups


def _frequent_extensions(pat: Pattern, groups: Mapping[_Desc, list[tuple[int, int]]],
                         owner: Mapping[int, list[int]], support: int, accept: Accept
                         ) -> tuple[int, list[tuple[_Desc, list[Any], int, int]]]:
    """The groups with enough distinct, non-overlapping children: (candidates counted,
    [(descriptor, kept children, parent embeddings, support)])."""
    embs = pat.embs
    counted = 0
    scored = []
    for desc, members in groups.items():
        if len(members) < support:
            continue
        counted += 1
        # Two members give the same node set only if the new node of one lies in the
        # parent embedding of the other; only then is the (sorted) node set compared.
        # Likewise the shared-node cap can only bite when a parent embedding has several
        # members, a new node is shared, or a new node lies in a parent embedding.
        children: list[tuple[tuple[int, ...], int, int]] = []
        seen: set[tuple[int, ...]] = set()
        risky = len({i for i, _ in members}) < len(members) or \
            len({u for _, u in members}) < len(members)
        for i, u in members:
            e = embs[i] + (u,)
            if u in owner:
                risky = True
                s = tuple(sorted(e))
                if s in seen:
                    continue
                seen.add(s)
            children.append((e, i, u))
        kept = _cap_shared(children, key=lambda x: x[0]) if risky else children
        if len(kept) < support:
            continue
        embs_kept = [e for e, _, _ in kept]
        cnt = count_nonoverlapping(embs_kept)
        if accept(embs_kept, cnt):
            scored.append((desc, kept, len({i for _, i, _ in kept}), cnt))
    return counted, scored


def _register_child(pat: Pattern, reg: _Registry, adj: list[list[tuple[int, int]]],
                    desc: _Desc, kept: list[tuple[tuple[int, ...], int, int]], cnt: int) -> None:
    """Register the child subgraph ``pat`` + the new node of ``desc``, with the frontier of
    each of its embeddings."""
    k = len(pat.labels)
    lu, conns = desc
    labels = pat.labels + (lu,)
    edges = pat.edges + tuple((pos, k, c) for pos, c in conns)
    ch = []
    ch_fronts = []
    for e, i, u in kept:
        front = dict(pat.fronts[i])
        del front[u]
        for w, c in adj[u]:
            if w in front:
                front[w] = front[w] + ((u, c),)
            elif w not in e:
                front[w] = ((u, c),)
        ch.append(e)
        ch_fronts.append(front)
    reg.add(labels, edges, ch, cnt, ch_fronts)
