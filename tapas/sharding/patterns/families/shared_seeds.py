"""Seed helpers shared by the pattern families.

In:  a :class:`tapas.sharding.patterns.seeds.SeedContext`.
Out: :class:`tapas.sharding.patterns.pattern.PatternSeed` lists: the batch split, the
     follow-your-input splits, the splits of a weight along each of its axes (named by
     what the split does to the node's contraction: partial sums, i.e.
     ``row``/``in-channel``/``vocab``, or not, i.e. ``column``/``out-channel``/``hidden``),
     and the per-label splits of a weight-less contraction (attention, MoE
     dispatch/combine).

A role is found by propagating the seed on one device (N = 1), where every split is
divisible: the structure of the result (a forward all-reduce, a ``vocab-gather``
rewrite) says what the split means, independently of N, so a name always means the same
implementation and ``explain`` can say why it is invalid for a given N.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from tapas.ir import GraphNode, OpInfo, TensorInfo, WeightInfo
from tapas.sharding import rules
from tapas.sharding.patterns.pattern import (BATCH, FOLLOW, HEADS, SPLIT, PatternId, PatternSeed,
                                             ShardingPattern)
from tapas.sharding.patterns.seeds import SeedContext
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["batch_seed", "follow_seeds", "weight_seeds", "label_seeds", "unit", "dedupe_names"]

_R = Replica()


def unit(ctx: SeedContext) -> SeedContext:
    """The same node on one device (memoised in ``ctx``)."""
    key = ("__unit__",)
    if key not in ctx.memo:
        ctx.memo[key] = SeedContext(ctx.node, ctx.index, 1)
    return ctx.memo[key]


def batch_seed(ctx: SeedContext) -> list[PatternSeed]:
    ins = ctx.split_all(0)
    if not any(isinstance(p, Split) for p in ins):
        return []
    return [PatternSeed(BATCH, ins)]


def follow_seeds(ctx: SeedContext) -> list[PatternSeed]:
    """``follow-S{a}``: every input split on axis a (a >= 1), weights inferred."""
    ins = ctx.node.inputs
    if not ins:
        return []
    rank = max(len(t.shape or ()) for t in ins)
    seeds = []
    for a in range(1, rank):
        pl = ctx.split_all(a)
        if any(isinstance(p, Split) for p in pl):
            seeds.append(PatternSeed(FOLLOW.numbered(f"S{a}"), pl))
    return seeds


def _input_choices(node: GraphNode) -> Iterator[tuple[Placement, ...]]:
    """All inputs R, then the first float input split on each of its axes."""
    yield tuple(_R for _ in node.inputs)
    for i, t in enumerate(node.inputs):
        if not t.dtype.startswith(("float", "bfloat", "half")):
            continue
        for b in range(len(t.shape or ())):
            yield tuple(Split(b) if j == i else _R for j in range(len(node.inputs)))
        break


Role = Callable[[WeightInfo, int, ShardingPattern], PatternId]


def weight_seeds(ctx: SeedContext, role_of: Role, min_rank: int = 2) -> list[PatternSeed]:
    """For every trainable weight of rank >= ``min_rank`` and each of its axes: the input
    placement (all replicated, or the first float input split on one axis) whose pattern on
    one device is valid with the fewest collectives, named and given a family by
    ``role_of(weight, axis, pattern on one device)`` (a :class:`PatternId`)."""
    one = unit(ctx)
    seeds: list[PatternSeed] = []
    for w in ctx.node.weights:
        if not w.trainable or len(w.shape) < min_rank:
            continue
        for a in range(len(w.shape)):
            if w.shape[a] == 1:
                continue
            best: tuple[int, tuple[Placement, ...], ShardingPattern] | None = None
            for ins in _input_choices(ctx.node):
                pat = one.trial(PatternSeed("?", ins, {w.path: Split(a)}))
                if pat is not None and (best is None or len(pat.comms) < best[0]):
                    best = (len(pat.comms), ins, pat)
            if best is not None:
                _, ins, pat = best
                seeds.append(PatternSeed(role_of(w, a, pat), ins, {w.path: Split(a)}))
    return dedupe_names(seeds)


def label_seeds(ctx: SeedContext, heads: bool) -> list[PatternSeed]:
    """One seed per label of the node's first contraction op: its operands split where
    they carry the label, other node inputs split where their shape matches the output's.
    Named ``batch`` (the leading label of every operand and the output), ``heads`` (another
    such label, when ``heads``) or ``split-<placements>``."""
    found = _first_contraction(ctx)
    if found is None:
        return []
    op, names, spec = found
    labels: list[str] = []
    for labs in spec.inputs:
        for lab in labs or ():
            if lab not in labels:
                labels.append(lab)
    seeds: list[PatternSeed] = []
    for lab in labels:
        pl = tuple(_label_placement(t, lab, op, names, spec) for t in ctx.node.inputs)
        if not any(isinstance(p, Split) for p in pl):
            continue
        in_all = (all(lab in (labs or ()) for labs in spec.inputs)
                  and lab in (spec.outputs[0] or ()))
        first = spec.inputs[0] or ()
        if in_all and first and first[0] == lab:
            name = BATCH
        elif in_all and heads:
            name = HEADS
        else:
            name = SPLIT.numbered("-".join(str(p) for p in pl))
        seeds.append(PatternSeed(name, pl))
    return dedupe_names(seeds)


def _first_contraction(ctx: SeedContext) -> tuple[OpInfo, list[str], rules.OpSpec] | None:
    """The node's first contraction op, its operand names and its spec (None without one)."""
    node = ctx.node
    op = next((o for o in node.ops if o.type in rules.CONTRACTION_OPS), None)
    if op is None or not node.inputs:
        return None
    names = [x for x in op.inputs if not x.startswith("^")]
    shapes = tuple(ctx.index.tensor[x].shape if x in ctx.index.tensor else None for x in names)
    spec = rules.spec_for(op, rules.OpContext(
        shapes, tuple(t.shape for t in op.outputs),
        lambda i: ctx.index.const_value(names[i])))
    return None if isinstance(spec, str) else (op, names, spec)


def _label_placement(t: TensorInfo, lab: str, op: OpInfo, names: list[str],
                     spec: rules.OpSpec) -> Placement:
    """Node input ``t`` split where it carries label ``lab``: as an operand of the
    contraction, by the operand's labels; otherwise where its shape matches the output's
    (right-aligned); else replicated."""
    if t.name in names:
        labs = spec.inputs[names.index(t.name)] or ()
        return Split(labs.index(lab)) if lab in labs else _R
    out_labels = spec.outputs[0] or ()
    if lab not in out_labels:
        return _R
    out_shape = op.outputs[0].shape or ()
    a = out_labels.index(lab)
    s = t.shape or ()
    off = len(out_shape) - len(s)
    ok = 0 <= a - off < len(s) and s[a - off] == out_shape[a] and s[a - off] != 1
    return Split(a - off) if ok else _R


def dedupe_names(seeds: list[PatternSeed]) -> list[PatternSeed]:
    """Keep names unique: a repeated name gets ``-2``, ``-3``, ... in order."""
    seen: dict[str, int] = {}
    out = []
    for s in seeds:
        k = seen.get(s.name, 0) + 1
        seen[s.name] = k
        out.append(s if k == 1 else dataclasses.replace(s, name=PatternId(f"{s.name}-{k}",
                                                                           s.family)))
    return out
