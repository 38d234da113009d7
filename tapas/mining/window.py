"""Mining on a window of a deep stack: the same folding as on the whole graph, in time that
does not grow with the number of layers.

In:  the :class:`~tapas.mining.apriori.Index` of the graph, the GraphNodes of one mining
     round and the round's support ``S``.
Out: a :class:`Window` (or None when the graph has no long enough periodic stack): the
     graph with the middle copies of every long *periodic run* removed -- the same model
     with fewer layers, which Apriori mines as usual (``index``, ``nodes``, ``support``,
     ``accept``) -- and :meth:`Window.expand`, which maps what it finds back onto the whole
     graph.

A *run* is a stretch of the GraphNodes, in topological (id) order, made of ``r`` copies of
one unit of ``p`` GraphNodes with the same signatures (:func:`find_runs`), whose wiring is
translation-symmetric (:func:`_symmetric`): inside each copy the same edges, between
consecutive copies the same edges, no edge skipping a copy, and every interior copy
wired to the same GraphNodes outside the run (masks, a shared position bias, the encoder
output; in the same direction, though possibly through another output: Llama's rotary
tables are one output per layer of one GraphNode). A deep stack of identical layers is
one run per stack.

The window keeps the first ``KEEP_LEFT`` and last ``KEEP_RIGHT`` copies of the shortest
long run and removes the ``D`` copies between them from every long run (the same ``D``
for all), wiring copy ``a - 1`` to copy ``a + D`` as consecutive copies are wired. Every
subgraph inside a run then has ``D`` fewer non-overlapping occurrences, so the support
becomes ``S - D``; a subgraph is frequent on the window when it has ``S - D`` occurrences
and either ``S`` (it does not need the removed copies) or an occurrence inside a run that
repeats in every copy (``accept``). What the window folds is expanded back by translation
(:meth:`Window.expand`): an instance starting in copy ``a - 1`` stands for the instances
starting in copies ``a - 1 ... a - 1 + D`` of the whole graph. The expansion is only
accepted when the instances around the cut repeat copy by copy (:meth:`Window.periodic`);
otherwise the caller mines the whole graph.

This module imports no TensorFlow.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tapas.mining.apriori import Index

#: Copies of a run kept before and after the cut. Two on each side are the least the
#: periodicity check needs (the rows of instances starting at copies a-2, a-1 and a).
KEEP_LEFT = 3
KEEP_RIGHT = 3
#: Cut only when at least this many copies go (below, the window saves little).
MIN_SKIP = 4

Emb = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """``copies[c][q]``: the GraphNode at offset ``q`` of copy ``c`` (topological order)."""

    copies: tuple[tuple[int, ...], ...]

    @property
    def period(self) -> int:
        return len(self.copies[0])

    @property
    def num_copies(self) -> int:
        return len(self.copies)


def find_runs(index: Index, nodes: Sequence[int], min_copies: int) -> list[Run]:
    """The disjoint translation-symmetric runs of at least ``min_copies`` copies among
    ``nodes`` (sorted ids), longest span first (ties: the shorter period). GraphNodes
    whose signature occurs fewer than ``min_copies`` times are skipped when reading the
    sequence, so a copy is contiguous in it though not necessarily in the ids."""
    # a GraphNode whose signature occurs fewer than min_copies times is in no run; left
    # in the sequence, one placed between two layers (a mask computed for the decoder,
    # scheduled in the middle of the encoder) would cut the encoder's run in two
    counts = Counter(index.lab[v] for v in nodes)
    nodes = [v for v in nodes if counts[index.lab[v]] >= min_copies]
    if min_copies < 2 or len(nodes) < 2 * min_copies:
        return []
    seq = np.array([index.lab[v] for v in nodes], dtype=np.int64)
    n = len(seq)
    found = []
    for p in range(1, n // min_copies + 1):
        eq = np.concatenate(([0], (seq[:-p] == seq[p:]).astype(np.int8), [0]))
        d = np.diff(eq)
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        lengths = ends - starts
        # a stretch of length L holds L // p + 1 copies: only those of min_copies or more
        keep = lengths >= (min_copies - 1) * p
        for s, length in zip(starts[keep], lengths[keep]):
            r = int(length) // p + 1
            if r >= min_copies:
                found.append((-r * p, p, int(s), r, int(length) % p))
    found.sort()
    taken: set[int] = set()
    runs = []
    for _, p, s, r, slack in found:
        # the periodic stretch may start a few GraphNodes before the first layer (they
        # match by chance): try each phase that still fits r copies
        best: Run | None = None
        for phase in range(s, s + slack + 1):
            run = _copies(index, nodes, phase, p, r, taken, min_copies)
            if run is not None and (best is None or run.num_copies > best.num_copies):
                best = run
            if best is not None and best.num_copies == r:
                break
        if best is not None:
            runs.append(best)
            taken.update(v for cp in best.copies for v in cp)
    return runs


def _copies(index: Index, nodes: Sequence[int], s: int, p: int, r: int, taken: set[int],
            min_copies: int) -> Run | None:
    """The longest symmetric run of at least ``min_copies`` among the ``r`` copies of
    ``p`` GraphNodes from position ``s`` of ``nodes``, avoiding GraphNodes ``taken``."""
    free = [c for c in range(r) if taken.isdisjoint(nodes[s + c * p:s + (c + 1) * p])]
    first, stop = _longest_stretch(free)
    if stop - first < min_copies:
        return None
    run = _symmetric(index, Run(tuple(tuple(nodes[s + c * p:s + (c + 1) * p])
                                      for c in range(first, stop))))
    return run if run is not None and run.num_copies >= min_copies else None


def _longest_stretch(xs: Sequence[int]) -> tuple[int, int]:
    """The longest stretch of consecutive integers in sorted ``xs``, as (first, stop)."""
    best, first = (0, 0), None
    for i, x in enumerate(xs):
        if first is None or x != xs[i - 1] + 1:
            first = x
        if x + 1 - first > best[1] - best[0]:
            best = (first, x + 1)
    return best


def _symmetric(index: Index, run: Run) -> Run | None:
    """The longest stretch of ``run``'s copies whose wiring is translation-symmetric
    (see the module docstring), or None when an edge skips a copy."""
    where = {v: (c, q) for c, cp in enumerate(run.copies) for q, v in enumerate(cp)}
    inner, forward, outer = [], [], []
    for c, cp in enumerate(run.copies):
        it, fw, hub = set(), set(), set()
        for q, v in enumerate(cp):
            for u, code in index.adj[v].items():
                cu = where.get(u)
                if cu is None:
                    # which of its outputs a shared GraphNode feeds to each copy may differ
                    # (a rotary table per layer): only the direction must match
                    f, b = index.codes[code]
                    hub.add((q, u, bool(f), bool(b)))
                elif cu[0] == c:
                    it.add((q, cu[1], code))
                elif cu[0] == c + 1:
                    fw.add((q, cu[1], code))
                elif cu[0] != c - 1:
                    return None
        inner.append(frozenset(it))
        forward.append(frozenset(fw))
        outer.append(frozenset(hub))
    r = run.num_copies
    best = (0, 0)
    for i in range(r):
        j = i
        while (j + 1 < r and inner[j + 1] == inner[i] and forward[j] == forward[i]
               and (j == i or outer[j] == outer[i + 1])):
            j += 1
        # copy j (the last) may differ in its outside wiring; so may copy i (the first)
        if j - i + 1 > best[1] - best[0]:
            best = (i, j + 1)
    return Run(run.copies[best[0]:best[1]])


@dataclasses.dataclass
class Window:
    """The graph with ``removed`` copies cut out of every run in ``runs`` (after copy
    ``KEEP_LEFT - 1``); see the module docstring."""

    full: Index
    index: Index                 # the window's wiring (same GraphNode ids)
    nodes: list[int]             # the round's GraphNodes left in the window
    support: int                 # S - D
    full_support: int            # S
    runs: list[Run]
    removed: int                 # D
    where: list[tuple[int, int, int] | None]  # GraphNode -> (run, virtual copy, offset)
    gone: frozenset[int]         # the removed GraphNodes
    _moves_cache: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # ``where`` as flat lists (-1: outside the runs) and each run's last interior
        # virtual copy: accept() looks at many embeddings
        self._run_of = [-1 if w is None else w[0] for w in self.where]
        self._copy_of = [-1 if w is None else w[1] for w in self.where]
        self._offset_of = [-1 if w is None else w[2] for w in self.where]
        self._last = [r.num_copies - self.removed - 2 for r in self.runs]

    def accept(self, embs: Sequence[Emb], count: int) -> bool:
        """Frequent on the whole graph: ``count`` on the window reaches ``S - D`` and the
        subgraph either reaches ``S`` here or repeats in every copy of a run. (Embeddings
        are looked at from the middle of the list on: those are usually in the interior.)"""
        if count < self.support:
            return False
        if count >= self.full_support:
            return True
        mid = len(embs) // 2
        return any(self._repeats(embs[i]) for i in range(mid, len(embs))) or \
            any(self._repeats(embs[i]) for i in range(mid))

    def _repeats(self, e: Emb) -> bool:
        """Whether ``e`` lies inside one run, in interior copies, within two consecutive
        copies, and is disjoint from its translate by one copy."""
        run_of, copy_of = self._run_of, self._copy_of
        run = run_of[e[0]]
        if run < 0:
            return False
        low = high = copy_of[e[0]]
        for v in e:
            if run_of[v] != run:
                return False
            c = copy_of[v]
            if c < low:
                low = c
            elif c > high:
                high = c
        if low < 1 or high > low + 1 or high > self._last[run]:
            return False
        if high == low:
            return True
        offset_of = self._offset_of
        lower = {offset_of[v] for v in e if copy_of[v] == low}
        return all(offset_of[v] not in lower for v in e if copy_of[v] != low)

    def _spots(self, e: Emb) -> tuple[int, int, int] | None:
        """(run, first virtual copy, last virtual copy) of ``e``'s run GraphNodes; None if
        it has none; (-1, 0, 0) if it touches two runs."""
        where = self.where
        spots = [where[v] for v in e if where[v] is not None]
        if not spots:
            return None
        if len({s[0] for s in spots}) > 1:
            return (-1, 0, 0)
        return (spots[0][0], min(s[1] for s in spots), max(s[1] for s in spots))

    def expand(self, embs: Sequence[Emb], strict: bool = True) -> list[Emb] | None:
        """The whole graph's embeddings for the window's ``embs``: one starting in copy
        ``KEEP_LEFT - 1`` stands for the ``D + 1`` translates starting in copies
        ``KEEP_LEFT - 1 ... KEEP_LEFT - 1 + D``. One that spans more than two copies or
        two runs cannot be translated: None when ``strict``, else it is kept as it is."""
        a = KEEP_LEFT
        out: list[Emb] = []
        for e in embs:
            sp = self._spots(e)
            if sp is not None and (sp[0] < 0 or sp[2] - sp[1] > 1):
                if strict:
                    return None
                out.append(e)
            elif sp is None or sp[1] != a - 1:
                out.append(e)
            else:
                out.extend(zip(*[self._moves(v) for v in e]))
        return out

    def _moves(self, v: int) -> tuple[int, ...]:
        """Where GraphNode ``v`` of the window (virtual copy a-1 or a, or outside the runs)
        lies in the ``D + 1`` translates: the copies 0, 1, ..., D further on."""
        moves = self._moves_cache.get(v)
        if moves is None:
            spot = self.where[v]
            if spot is None:
                moves = (v,) * (self.removed + 1)
            else:
                run, vc, q = spot
                copies = self.runs[run].copies
                moves = tuple(copies[vc + k][q] for k in range(self.removed + 1))
            self._moves_cache[v] = moves
        return moves

    def periodic(self, insts: Sequence[Emb]) -> bool:
        """Whether the instances starting at virtual copies a-2, a-1 and a of every run
        are translates of each other (position by position), so that the removed copies
        hold translates of the row at a-1."""
        a = KEEP_LEFT
        rows: dict[tuple[int, int], list[tuple]] = {}
        for e in insts:
            sp = self._spots(e)
            if sp is None:
                continue
            if sp[0] < 0:
                return False
            if a - 2 <= sp[1] <= a:
                spots = [self.where[v] for v in e]
                shape = tuple(("out", v) if w is None else (w[1] - sp[1], w[2])
                              for v, w in zip(e, spots))
                rows.setdefault((sp[0], sp[1]), []).append(shape)
        for i in range(len(self.runs)):
            got = [sorted(rows.get((i, s), [])) for s in (a - 2, a - 1, a)]
            if not got[0] == got[1] == got[2]:
                return False
        return True


def make_window(index: Index, nodes: Sequence[int], support: int) -> Window | None:
    """The window of the round's ``nodes`` (sorted ids) at ``support``, or None when no
    run is long enough (at least ``support`` copies and ``MIN_SKIP`` to remove) or the
    window's support ``S - D`` would drop below 2."""
    keep = KEEP_LEFT + KEEP_RIGHT
    runs = [r for r in find_runs(index, nodes, max(support, keep + MIN_SKIP))]
    if not runs:
        return None
    d = min(r.num_copies for r in runs) - keep
    if d < MIN_SKIP or support - d < 2:
        return None
    a = KEEP_LEFT
    gone: set[int] = set()
    where: list[tuple[int, int, int] | None] = [None] * index.n
    for i, run in enumerate(runs):
        for c, cp in enumerate(run.copies):
            if a <= c < a + d:
                gone.update(cp)
            for q, v in enumerate(cp):
                if not a <= c < a + d:
                    where[v] = (i, c if c < a else c - d, q)
    view = _rewired(index, runs, a, d, gone)
    return Window(full=index, index=view, nodes=[v for v in nodes if v not in gone],
                  support=support - d, full_support=support, runs=runs, removed=d,
                  where=where, gone=frozenset(gone))


def _rewired(index: Index, runs: Sequence[Run], a: int, d: int, gone: set[int]) -> Index:
    """A copy of ``index`` without the GraphNodes ``gone``, copy ``a - 1`` of each run
    wired to copy ``a + d`` as it was to copy ``a`` (edges and tensors)."""
    view = copy.copy(index)
    view.adj = list(index.adj)
    view.in_tensors = list(index.in_tensors)
    view.out_tensors = list(index.out_tensors)
    for run in runs:
        up = {u: w for u, w in zip(run.copies[a], run.copies[a + d])}      # copy a -> a+d
        down = {u: w for u, w in zip(run.copies[a + d - 1], run.copies[a - 1])}
        for v in run.copies[a - 1]:
            view.adj[v] = {up.get(u, u): c for u, c in index.adj[v].items()}
            view.out_tensors[v] = {(up.get(u, u), t) for u, t in index.out_tensors[v]}
        for v, v0 in zip(run.copies[a + d], run.copies[a]):
            view.adj[v] = {down.get(u, u): c for u, c in index.adj[v].items()}
            view.in_tensors[v] = ({(u, t) for u, t in index.in_tensors[v] if u not in down}
                                  | {(u, t) for u, t in index.in_tensors[v0]
                                     if u in run.copies[a - 1]})
    for v in range(index.n):
        if v in gone:
            continue
        nb = view.adj[v]
        if not gone.isdisjoint(nb):
            view.adj[v] = {u: c for u, c in nb.items() if u not in gone}
    return view

