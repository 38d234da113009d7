"""Types and the registry of the pattern stage.

In:  nothing (definitions).
Out: :class:`ShardingPattern` (one parallel implementation of one GraphNode, see
     docs/sharding.md), :class:`PatternSeed` (which input/weight splits a family wants
     tried), :class:`SeedContext` (what a family's seed function may read), the
     ``register`` decorator and the registry it fills.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tapas.ir import Graph, GraphNode, Kind, OpInfo, TensorInfo
from tapas.sharding.placements import Comm, Partial, Placement, Replica, Split

__all__ = ["Family", "Rewrite", "ShardingPattern", "PatternSeed", "SeedContext", "SeedFn", "register", "REGISTRY",
           "GraphIndex"]


class Rewrite(str, enum.Enum):
    """A local program an op needs in place of replaying it on its shard (docs/sharding.md).

    The pattern stage decides that an op needs one; reconstruction has one lowering per
    member (``tapas.execution``'s rewrite table)."""

    VOCAB_GATHER = "vocab-gather"    # GatherV2 from a row-split table: shifted ids, masked rows; P
    PARTIAL_MEAN = "partial-mean"    # Mean over a split axis: the local mean / N; P
    GLOBAL_SHAPE = "global-shape"    # Shape/Size/Rank of a split tensor: the global value

    def __str__(self) -> str:
        return self.value


class Family(str, enum.Enum):
    """What kind of parallelism a pattern is: the role the search and the reference plans
    (Megatron, data parallel, ...) read, instead of parsing pattern names."""

    REPLICATE = "replicate"      # every tensor whole on every device
    BATCH = "batch"              # the batch axis split, weights replicated (data parallel)
    FOLLOW = "follow"            # a weight-less node taking the split its input has
    SPLIT = "split"              # a weight-less node with inputs split some other way
    COLUMN = "column"            # a weight's output axis split (no forward collective)
    ROW = "row"                  # a weight's contraction axis split (forward all-reduce)
    HIDDEN = "hidden"            # an embedding table split on its hidden axis
    HEADS = "heads"              # attention split on heads
    COLUMN_ROW = "column-row"    # a whole feed-forward layer: column then row (Megatron)
    EXPERT = "expert"            # MoE experts split on the expert axis

    def __str__(self) -> str:
        return self.value


def _family_of(name: str) -> tuple[Family | None, bool]:
    """The family of a pattern name and whether it is data parallel (None: a name the
    families do not use, such as the placeholder of a pattern being built)."""
    head = name.split("-", 1)[0]
    if name == "column-row":
        return Family.COLUMN_ROW, False
    if name.startswith("expert"):
        return Family.EXPERT, False
    if head == "follow":
        return Family.FOLLOW, name == "follow-S0"
    if head == "split":
        return Family.SPLIT, name == "split-S0-S0"
    try:
        family = Family(name)
    except ValueError:
        return None, False
    return family, family is Family.BATCH


@dataclasses.dataclass(frozen=True)
class ShardingPattern:
    """One parallel implementation of one GraphNode on N devices (docs/sharding.md).

    ``tensors`` maps the output of every op inside the node to the placement the op leaves
    it in; a forward comm on that tensor (``comms``) then turns it into ``comm.dst`` before
    any consumer reads it. A weight's gradient comm names the weight's resource placeholder
    tensor (``WeightInfo.placeholder + ':0'``). In ``expr`` the leaves ``X``/``X0``,
    ``X1``... are ``node.inputs`` and ``W``/``W0``, ``W1``... ``node.weights``.
    """

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    weights: Mapping[str, Placement]
    tensors: Mapping[str, Placement]
    comms: tuple[Comm, ...]
    rewrites: Mapping[str, Rewrite]
    expr: str
    flops: float
    family: Family | None = None         # filled from the name when not given
    data_parallel: bool | None = None    # the batch axis split: what data parallelism does

    def __post_init__(self) -> None:
        family, dp = _family_of(self.name)
        if self.family is None:
            object.__setattr__(self, "family", family)
        if self.data_parallel is None:
            object.__setattr__(self, "data_parallel", dp)
        object.__setattr__(self, "rewrites",
                           {k: Rewrite(v) for k, v in self.rewrites.items()})

    @property
    def fwd_comms(self) -> tuple[Comm, ...]:
        return tuple(c for c in self.comms if c.phase == "fwd")

    @property
    def bwd_comms(self) -> tuple[Comm, ...]:
        return tuple(c for c in self.comms if c.phase == "bwd")

    @property
    def is_replicated(self) -> bool:
        return not self.comms and all(isinstance(p, Replica) for p in
                                      (*self.inputs, *self.outputs, *self.weights.values()))

    def summary(self) -> str:
        """One line: name, placements and comms, e.g.
        ``row: in S2 | w kernel=S0 | out R | fwd AR``."""
        ins = " ".join(str(p) for p in self.inputs) or "-"
        outs = " ".join(str(p) for p in self.outputs) or "-"
        ws = " ".join(f"{k.rsplit('/', 1)[-1]}={v}" for k, v in self.weights.items()
                      if not isinstance(v, Replica))
        cs = " ".join(f"{c.phase} {c.kind.value}" for c in self.comms)
        return (f"{self.name}: in {ins} | w {ws or 'R'} | out {outs}"
                + (f" | {cs}" if cs else ""))

    def key(self) -> tuple[Any, ...]:
        """What makes two patterns the same implementation (the name aside)."""
        return (self.inputs, self.outputs, tuple(sorted(self.weights.items(), key=str)),
                tuple(sorted(map(str, self.comms))), tuple(sorted(self.rewrites.items())))


@dataclasses.dataclass(frozen=True)
class PatternSeed:
    """Where a family wants a split: the placement of every node input, of some weights
    (by path; the others are inferred: replicated, or split where every use of them is
    split on one axis) and, for source nodes (graph inputs), of the outputs."""

    name: str
    inputs: tuple[Placement, ...]
    weights: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    outputs: tuple[Placement, ...] | None = None


class GraphIndex:
    """Graph-wide lookups: producing op and static shape of every tensor."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.op_of: dict[str, OpInfo] = {}
        self.tensor: dict[str, TensorInfo] = {}
        for n in graph.nodes:
            for op in n.ops:
                self.op_of[op.name] = op
                for t in op.outputs:
                    self.tensor[t.name] = t
        for t in graph.inputs:
            self.tensor.setdefault(t.name, t)

    def const_value(self, tensor_name: str) -> Any:
        op = self.op_of.get(tensor_name.rsplit(":", 1)[0])
        if op is None:
            return None
        if op.type == "Const":
            return op.value
        if op.type in ("Identity", "Snapshot") and op.inputs:
            return self.const_value(op.inputs[0])
        return None


@dataclasses.dataclass(frozen=True)
class SeedContext:
    """What a seed function reads: the node, the graph index and the device count."""

    node: GraphNode
    index: GraphIndex
    num_devices: int
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def trial(self, seed: PatternSeed) -> ShardingPattern | None:
        """The pattern ``seed`` gives (named after the seed), or None when invalid; memoised,
        so a family may try seeds to name them by their result."""
        from tapas.sharding.patterns.engine import Invalid, propagate
        key = _seed_key(seed)
        if key not in self.memo:
            try:
                self.memo[key] = propagate(self.node, self.index, self.num_devices, seed)
            except Invalid as e:
                self.memo[key] = e
        got = self.memo[key]
        if isinstance(got, ShardingPattern):
            return dataclasses.replace(got, name=seed.name, family=None, data_parallel=None)
        return None

    def invalid_reason(self, seed: PatternSeed) -> str | None:
        self.trial(seed)
        got = self.memo[_seed_key(seed)]
        return None if isinstance(got, ShardingPattern) else str(got)

    @property
    def graph(self) -> Graph:
        return self.index.graph

    def split_all(self, axis: int) -> tuple[Placement, ...]:
        """Every node input split on ``axis`` (inputs too small or of other size there, R):
        right-aligned like numpy broadcasting against the first input of largest rank."""
        ins = self.node.inputs
        if not ins:
            return ()
        ref = max(ins, key=lambda t: len(t.shape or ()))
        r = len(ref.shape or ())
        if not 0 <= axis < r:
            return tuple(Replica() for _ in ins)
        size = ref.shape[axis]  # type: ignore[index]
        out: list[Placement] = []
        for t in ins:
            s = t.shape or ()
            a = axis - (r - len(s))
            out.append(Split(a) if 0 <= a < len(s) and s[a] == size and size != 1
                       else Replica())
        return tuple(out)


def _seed_key(seed: PatternSeed) -> tuple[Any, ...]:
    return (seed.inputs, tuple(sorted(seed.weights.items(), key=str)), seed.outputs)


SeedFn = Callable[[GraphNode, SeedContext], Iterable[PatternSeed]]
REGISTRY: dict[Kind, list[SeedFn]] = {k: [] for k in Kind}


def register(*kinds: Kind) -> Callable[[SeedFn], SeedFn]:
    """Register a seed function for GraphNodes of the given kinds."""
    def deco(fn: SeedFn) -> SeedFn:
        for k in kinds:
            REGISTRY[Kind(k)].append(fn)
        return fn
    return deco


def is_split(p: Placement) -> bool:
    return isinstance(p, Split)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)
