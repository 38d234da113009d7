"""The enumeration engine: dynamic programming over frontiers of placements (paper 4.4).

In:  a problem as a list of :class:`Step` (one GraphNode each, in topological order: the
     tensors it reads and writes, the patterns it may take and their costs), the
     :class:`tapas.planning.table.PatternTable` and :class:`tapas.planning.table.EdgeCoster`,
     the k best to keep per frontier and the most frontiers to keep (a beam).
Out: the final ``(cost, frontier, path)`` entries, cheapest first, with :class:`Counts` of
     what was generated, pruned, costed and dominated, and whether the result is exact;
     :func:`unwind` turns a path into the option chosen at every step.

A prefix (options chosen for the first i steps) is extended by each option of step i; each
producer -> consumer pair is checked as soon as both ends are chosen: equal placements, or
a costed resharding, or the extension is abandoned (*pruned early*). Prefixes that leave
the same placements on the tensors still to be read (the *frontier*) have the same valid
completions, so only the k cheapest of them go on (the others are *dominated*). A step that
belongs to a template instance (``tie``) takes the candidate its template chose at its first
step, so that every instance follows one candidate.

The steps of a subset of the graph's GraphNodes are built by
:func:`tapas.planning.steps.node_steps`.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from tapas.ir import GraphNode, TensorInfo
from tapas.planning.table import EdgeCoster, PatternInfo, PatternTable
from tapas.sharding.placements import Placement

__all__ = ["Step", "Run", "Counts", "SearchTimeout", "Allowed", "TieOptions", "Progress", "run",
           "unwind", "State", "lower_bound", "settle"]

# a long enumeration reports progress this often (seconds)
_PROGRESS_SECONDS = 2.0

# Allowed(node, pattern) -> bool: restricts the search (reference plans)
Allowed = Callable[[GraphNode, PatternInfo], bool]
# template id -> its candidates as (pattern index per position, cost), cheapest first
TieOptions = Mapping[int, Sequence[tuple[tuple[int, ...], float]]]
# progress(phase, done, total, candidates): steps done of total in this phase, and the
# candidates (prefix extensions) generated so far in it
Progress = Callable[[str, int, int, int], None]


class State:
    """A frontier: tensor key -> placement (``("tie", t)`` keys hold a template's choice).

    Iterates as ``(key, placement)`` pairs sorted by the keys' reprs. Hashed incrementally
    (the XOR of its items' hashes, each computed once when the item enters a state): a
    prefix extension changes a few items of a frontier that may hold dozens of live tensors
    (keras-hub RWKV-7: about 48), and hashing and sorting whole frontiers for every
    extension was most of such a search's time."""

    __slots__ = ("items", "hashes", "_hash")

    def __init__(self, items: dict[Any, Any], hashes: dict[Any, int], value: int) -> None:
        self.items, self.hashes, self._hash = items, hashes, value

    @staticmethod
    def of(pairs: Iterable[tuple[Any, Any]]) -> State:
        items = dict(pairs)
        hashes = {k: hash((k, v)) for k, v in items.items()}
        value = 0
        for h in hashes.values():
            value ^= h
        return State(items, hashes, value)

    def changed(self, puts: Iterable[tuple[Any, Any]], drops: Iterable[Any]) -> State:
        """This frontier with ``puts`` set (in order) and then ``drops`` removed."""
        items, hashes, value = dict(self.items), dict(self.hashes), self._hash
        for k, v in puts:
            old = hashes.get(k)
            if old is not None:
                if items[k] is v:
                    continue
                value ^= old
            h = hash((k, v))
            items[k], hashes[k] = v, h
            value ^= h
        for k in drops:
            old = hashes.pop(k, None)
            if old is not None:
                value ^= old
                del items[k]
        return State(items, hashes, value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, State) and self._hash == other._hash and \
            self.items == other.items

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return iter(sorted(self.items.items(), key=_item_key))

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"State({list(self)!r})"


_EMPTY = State({}, {}, 0)


class SearchTimeout(RuntimeError):
    """The search ran past its time limit (``es`` on a large graph): it did not finish."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """What an enumeration did. ``generated``: prefix extensions tried (a prefix plus one
    pattern); ``pruned_early``: of those, abandoned at once because a pair was invalid;
    ``costed``: valid extensions whose cost was computed; ``dominated``: valid prefixes
    dropped because k cheaper ones left the same frontier (or cut by the beam: ``beam``);
    ``valid``: complete valid combinations reached at the end; ``resharded``: costed
    extensions that needed a resharding collective on an edge to be valid; ``jumped``:
    steps of repeated periods taken at once (:class:`Run`)."""

    generated: int = 0
    pruned_early: int = 0
    costed: int = 0
    dominated: int = 0
    beam: int = 0
    valid: int = 0
    resharded: int = 0
    jumped: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                              dataclasses.astuple(other))))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Step:
    """One GraphNode of a problem: what it reads and writes and its options."""

    node: int
    reads: tuple[tuple[Any, TensorInfo], ...]      # (tensor key, tensor) per input
    writes: tuple[tuple[int, Any], ...]            # (output index, key) kept in the frontier
    drops: tuple[Any, ...]                         # keys read for the last time here
    options: tuple[tuple[int, float], ...]         # (pattern index, cost)
    tie: int | None = None                         # template whose candidate fixes this node
    tie_pos: int = 0                               # this node's position in the template
    release: tuple[int, ...] = ()                  # ties to forget after this step
    free: frozenset[Any] = frozenset()             # keys set by their first reader
    # external keys with a known placement: outputs of constant-filtered GraphNodes (R)
    fixed: Mapping[Any, Placement] = dataclasses.field(default_factory=dict)
    # per read, seconds per byte charged on what a resharding makes of it when the reader
    # keeps it for its backward (the memory penalty, tapas.planning.kept); (): none
    kept: tuple[float, ...] = ()
    # a whole template instance taken as one step (tapas.planning.stitch): its GraphNodes
    # in position order, and per tie option what it reads and writes (``.inputs`` aligned
    # with ``reads``, ``.outputs`` indexed by ``writes``, ``.internal`` seconds)
    members: tuple[int, ...] = ()
    infos: tuple[Any, ...] | None = None
    # branches folded into this step (tapas.planning.branches): per placement of the
    # ``entries`` (tensors the branches read, at the end of ``reads``), the options and per
    # option the patterns of the folded GraphNodes as (node, pattern index); the path then
    # holds (those placements, option index)
    entries: tuple[Any, ...] = ()
    folded: Mapping[tuple[Any, ...], tuple[tuple[tuple[int, float], ...],
                                           tuple[tuple[tuple[int, int], ...], ...]]] | None = None


@dataclasses.dataclass(frozen=True)
class Run:
    """Steps ``start .. start + period * count - 1`` are ``count`` repetitions of one period
    of ``period`` steps, each the previous one with its keys renamed: ``shift(key, j)`` is
    ``key`` as the period ``j`` periods later sees it (keys from outside the run are
    unchanged). Built by ``tapas.planning.stitch`` for runs of identical template
    instances; :func:`run` may jump over periods whose frontier maps onto itself."""

    start: int
    period: int
    count: int
    shift: Callable[[Any, int], Any]


@dataclasses.dataclass(frozen=True)
class _Jump:
    """A path link standing for several steps taken at once (a jump over periods)."""

    options: tuple[int, ...]


@dataclasses.dataclass
class _Tally:
    """The running counts of :func:`run` (see :class:`Counts`)."""

    generated: int = 0
    pruned: int = 0
    costed: int = 0
    dominated: int = 0
    beamed: int = 0
    resharded: int = 0
    exact: bool = True
    jumped: int = 0          # steps jumped over (periods whose frontier maps onto itself)
    cut_below: float = math.inf   # the cheapest prefix the beam dropped (see run)


def _branches(step: Step, state: Mapping[Any, Any], tie_options: TieOptions | None
              ) -> list[tuple[int, int, float, int | None]]:
    """The options of ``step`` from ``state``: (option index, pattern index, cost, the tie
    choice to record or None). A tied step follows its template's choice, or makes it."""
    if step.tie is None:
        if step.folded is not None:     # a join: its options follow its entries' placements
            placed = tuple(state.get(e) for e in step.entries)
            tables = [(placed, step.folded.get(placed, ((), ()))[0])] if None not in placed \
                else [(p, t[0]) for p, t in step.folded.items()   # unset: set here
                      if all(a is None or a == b for a, b in zip(placed, p))]
            return [((p, oi), pi, c, None) for p, options in tables
                    for oi, (pi, c) in enumerate(options)]
        return [(pi, pi, c, None) for pi, c in step.options]
    assert tie_options is not None
    cands = tie_options[step.tie]
    chosen = state.get(("tie", step.tie))
    if step.infos is not None:      # a whole instance: the option is the candidate itself
        if chosen is None:
            return [(ci, ci, c[1] + step.infos[ci].internal, ci) for ci, c in enumerate(cands)
                    if step.infos[ci].internal < math.inf]
        internal = step.infos[chosen].internal
        return [(chosen, chosen, internal, None)] if internal < math.inf else []
    if chosen is None:
        return [(ci, c[0][step.tie_pos], c[1], ci) for ci, c in enumerate(cands)]
    return [(chosen, cands[chosen][0][step.tie_pos], 0.0, None)]


def _match_inputs(step: Step, info: PatternInfo, state: Mapping[Any, Any], edges: EdgeCoster,
                  base: float) -> tuple[float, dict[Any, Placement], bool] | None:
    """Check every input of ``step`` under pattern ``info`` against ``state``: ``base``
    plus the seconds of the resharding needed (and the memory penalty on the inputs it
    grows that the reader keeps, ``step.kept``), the free keys this reader sets, and
    whether any edge reshards; None when some edge cannot be made to match."""
    sets: dict[Any, Placement] = {}
    extra = base
    moved = False
    for i, ((key, tensor), want) in enumerate(zip(step.reads, info.inputs)):
        have = sets.get(key) or state.get(key) or step.fixed.get(key)
        if have is None:
            if key in step.free:
                sets[key] = want
                continue
            raise AssertionError(f"GraphNode {step.node} reads {key!r} before it is produced")
        if have is want:      # placements are interned (tapas.sharding.placements)
            continue
        c = edges.cost(tensor, have, want)   # 0.0 where equal by value
        if c is None:
            return None
        if step.kept and step.kept[i]:
            c += step.kept[i] * edges.grown_bytes(tensor, have, want)
        if c:
            extra += c
            moved = True
        elif have != want:   # a free resharding still reshards
            moved = True
    return extra, sets, moved


def _next_state(step: Step, info: PatternInfo, state: State,
                sets: Mapping[Any, Placement], tie_set: int | None) -> State:
    """The frontier after ``step`` takes pattern ``info``."""
    puts = list(sets.items())
    puts += [(key, info.outputs[out_i]) for out_i, key in step.writes]
    drops = list(step.drops)
    if tie_set is not None:
        puts.append((("tie", step.tie), tie_set))
    drops += [("tie", t) for t in step.release]
    # a key both written and dropped here (a tie set and released at once) ends dropped
    return state.changed(puts, drops)


def _advance(step: Step, frontier: Mapping[State, list[tuple[float, Any]]],
             infos: Sequence[PatternInfo], edges: EdgeCoster, tie_options: TieOptions | None,
             tally: _Tally) -> dict[State, list[tuple[float, Any]]]:
    """Extend every prefix of ``frontier`` by every option of ``step``."""
    nxt: dict[State, list[tuple[float, Any]]] = {}
    # frontiers that place the tensors this step reads alike match an option alike: one
    # check per (their placements, option). The placements by identity (interned; a copy
    # equal by value only misses the memo), alive in the frontier while the memo lives.
    keys = [key for key, _ in step.reads]
    memo: dict[tuple[Any, ...], tuple[float, dict[Any, Placement], bool] | None] = {}
    for state, entries in frontier.items():
        sd = state.items
        sig = tuple([id(sd.get(key)) for key in keys])
        for oi, pi, base, tie_set in _branches(step, sd, tie_options):
            tally.generated += len(entries)
            info = infos[pi]
            mk = (sig, pi, base)
            if mk in memo:
                matched = memo[mk]
            else:
                matched = memo[mk] = _match_inputs(step, info, sd, edges, base)
            if matched is None:
                tally.pruned += len(entries)
                continue
            extra, sets, moved = matched
            if step.folded is not None and not all(e in sd for e in step.entries):
                sets = {**sets, **{e: p for e, p in zip(step.entries, oi[0]) if e not in sd}}
            tally.costed += len(entries)
            if moved:
                tally.resharded += len(entries)
            bucket = nxt.setdefault(_next_state(step, info, state, sets, tie_set), [])
            for c, path in entries:
                bucket.append((c + extra, (path, oi)))
    return nxt


def _keep_best(nxt: dict[State, list[tuple[float, Any]]], k: int, max_states: int,
               tally: _Tally) -> dict[State, list[tuple[float, Any]]]:
    """The k cheapest prefixes per frontier, and at most ``max_states`` frontiers."""
    for bucket in nxt.values():
        if len(bucket) > k:
            bucket.sort(key=lambda e: e[0])
            tally.dominated += len(bucket) - k
            del bucket[k:]
    if len(nxt) <= max_states:
        return nxt
    ranked = sorted(nxt.items(), key=lambda kv: min(e[0] for e in kv[1]))
    for _, b in ranked[max_states:]:
        tally.beamed += len(b)
    tally.exact = False
    tally.cut_below = min(tally.cut_below, min(e[0] for e in ranked[max_states][1]))
    return dict(ranked[:max_states])


def run(steps: Sequence[Step], table: PatternTable, edges: EdgeCoster, k: int,
        max_states: int, deadline: float | None, tie_options: TieOptions | None = None,
        progress: Progress | None = None, phase: str = "enumeration",
        runs: Sequence[Run] = (),
        ) -> tuple[list[tuple[float, State, Any]], Counts, bool, float]:
    """Enumerate the steps in order; return the final (cost, frontier, path) entries, the
    counts, whether no frontier was cut by the beam, and the cost of the cheapest prefix
    the beam cut (inf when none was): costs only grow along a prefix, so no plan through a
    cut prefix is cheaper than that, and the optimum is at least the smaller of it and the
    best final cost (:func:`lower_bound`).

    ``tie_options[t]`` lists template t's candidates as (pattern index per position, cost):
    the first step of template t branches over them (paying the cost), later steps of t
    take the chosen candidate's pattern at their position for free. ``runs`` mark
    repeated periods of steps (:class:`Run`): once a whole period maps every frontier
    state onto its renamed self, the remaining periods but the last are jumped over.
    """
    tally = _Tally()
    steps = settle(steps, table)
    frontier: dict[State, list[tuple[float, Any]]] = {_EMPTY: [(0.0, None)]}
    next_report = time.perf_counter() + _PROGRESS_SECONDS
    by_start = {r.start + j * r.period: (r, j) for r in runs for j in range(r.count - 1)}
    before: tuple[Run, int, dict[State, list[tuple[float, Any]]]] | None = None
    si = 0
    while si < len(steps):
        if si in by_start:
            r, j = by_start[si]
            if j >= 1 and before is not None and before[0] is r and before[1] == j - 1:
                jump = _jump(r, j, before[2], frontier, steps, si, tie_options)
                if jump is not None:
                    frontier, done = jump
                    tally.jumped += done
                    si += done
                    before = None
                    continue
            before = (r, j, frontier)
        step = steps[si]
        now = time.perf_counter()
        if progress is not None and now > next_report:
            progress(phase, si, len(steps), tally.generated)
            next_report = now + _PROGRESS_SECONDS
        if deadline is not None and now > deadline:
            raise SearchTimeout(f"enumeration stopped at GraphNode {si} of {len(steps)}: "
                                "time limit reached")
        infos = table.infos[step.node] if step.infos is None else step.infos
        nxt = _advance(step, frontier, infos, edges, tie_options, tally)
        frontier = _keep_best(nxt, k, max_states, tally)
        si += 1
    final = [(c, state, path) for state, entries in frontier.items() for c, path in entries]
    final.sort(key=lambda e: e[0])
    counts = Counts(tally.generated, tally.pruned, tally.costed, tally.dominated,
                    tally.beamed, len(final), tally.resharded, tally.jumped)
    return final, counts, tally.exact, tally.cut_below


def settle(steps: Sequence[Step], table: PatternTable) -> list[Step]:
    """``steps`` with every tensor whose placement no choice can change taken out of the
    frontier: a tensor read later in the problem (and dropped there: not a boundary
    output the result reports) whose producer's options all give it the same placement
    (a GraphNode with one pattern, or whose patterns differ only inside it; a template
    instance whose candidates all place it alike). Its readers find it in ``fixed``. The
    frontier held it with that one placement in every state, so the states correspond one
    to one, with the same entries and costs, in the same order: the result is the same,
    the frontiers smaller. A join's entries and the outputs of tied per-GraphNode steps
    (whose options follow their template) stay."""
    entries = {e for s in steps for e in s.entries}
    dropped = {k for s in steps for k in s.drops}
    settled: dict[Any, Placement] = {}
    out: list[Step] = []
    for step in steps:
        if any(k in settled for k in step.drops) or any(k in settled for k, _ in step.reads):
            step = dataclasses.replace(
                step, drops=tuple(k for k in step.drops if k not in settled),
                fixed={**step.fixed, **{k: settled[k] for k, _ in step.reads if k in settled}})
        if step.infos is not None:
            infos, picks = step.infos, range(len(step.infos))
        elif step.tie is None and step.folded is None:
            infos, picks = table.infos[step.node], [pi for pi, _ in step.options]
        else:
            out.append(step)
            continue
        new: dict[Any, Placement] = {}
        for oi, key in step.writes:
            if key in dropped and key not in entries:
                placed = {infos[pi].outputs[oi] for pi in picks}
                if len(placed) == 1:
                    new[key] = placed.pop()
        if new:
            step = dataclasses.replace(step, writes=tuple(w for w in step.writes
                                                          if w[1] not in new))
            settled.update(new)
        out.append(step)
    return out


def lower_bound(final: Sequence[tuple[float, Any, Any]], cut_below: float) -> float:
    """A lower bound on the optimum of an enumeration that returned ``final`` and whose
    beam cut no prefix cheaper than ``cut_below`` (every option, edge and tie costs >= 0):
    the best final cost when nothing cheaper was cut (the result is then the optimum)."""
    best = final[0][0] if final else math.inf
    return min(best, cut_below)


def _rename(state: State, r: Run, periods: int) -> State:
    return State.of((r.shift(key, periods), v) for key, v in state)


def _jump(r: Run, j: int, start: Mapping[State, list[tuple[float, Any]]],
          end: Mapping[State, list[tuple[float, Any]]], steps: Sequence[Step], si: int,
          tie_options: TieOptions | None) -> tuple[dict, int] | None:
    """Jump from the start of period ``j`` of ``r`` (``end``: the frontier after period
    ``j - 1``, ``start``: before it) to the start of its last period, or None.

    Valid when period ``j - 1`` took every state to its own renaming, one to one, with the
    same entries (no merge, no cut) and no choice: every step is tied to a template whose
    candidate every state has already chosen. The next periods are the same steps with
    renamed keys, so they do the same to the renamed states at the same costs: each entry
    gains, per period jumped, the cost it gained in period ``j - 1``."""
    period = steps[si - r.period:si]
    if len(start) != len(end) or not all(
            s.tie is not None and s.infos is not None for s in period):
        return None
    ties = {("tie", s.tie) for s in period}
    jumps = r.count - 1 - j            # periods to jump: j .. count - 2
    if jumps < 1:
        return None
    out: dict[State, list[tuple[float, Any]]] = {}
    for state, entries in start.items():
        if not ties <= {key for key, _ in state}:
            return None
        after = end.get(_rename(state, r, 1))
        if after is None or len(after) != len(entries):
            return None
        origin = {id(path): c for c, path in entries}
        moved = []
        for c, path in after:
            tail, back = path, []
            for _ in range(r.period):
                tail, oi = tail
                back.append(oi)
            if id(tail) not in origin:
                return None
            gain = c - origin[id(tail)]
            options = tuple(reversed(back)) * jumps
            moved.append((c + gain * jumps, (path, _Jump(options))))
        out[_rename(state, r, 1 + jumps)] = moved
    return out, jumps * r.period


def _item_key(item: tuple[Any, Any]) -> str:
    return repr(item[0])



def unwind(path: Any, n: int) -> list[int]:
    """The option chosen at each of the ``n`` steps, from a final entry's path."""
    out: list[int] = []
    while path is not None:
        path, oi = path
        if isinstance(oi, _Jump):
            out.extend(reversed(oi.options))
        else:
            out.append(oi)
    out.reverse()
    assert len(out) == n
    return out
