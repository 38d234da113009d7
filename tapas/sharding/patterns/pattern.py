"""What the pattern stage produces: sharding patterns and the seeds they grow from.

In:  nothing (definitions).
Out: :class:`ShardingPattern` (one parallel implementation of one GraphNode, see
     docs/sharding.md), :class:`PatternSeed` (which input/weight splits a family wants
     tried), :class:`Rewrite` (a local program an op needs instead of its own),
     :class:`Family` (what kind of parallelism a pattern is) and :class:`PatternId` (a
     pattern's typed id: its family and variant, written as its name), with the ids the
     families name their patterns by (``REPLICATE``, ``BATCH``, ``ROW``, ...).
     :meth:`PatternId.parse` raises ValueError for a name no family uses.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from tapas.sharding.patterns.kernels import KernelUse
from tapas.sharding.placements import Comm, Placement, Replica, Split

__all__ = ["Family", "Rewrite", "ShardingPattern", "PatternSeed", "PatternId", "REPLICATE",
           "BATCH", "FOLLOW", "SPLIT", "ROW", "COLUMN", "IN_CHANNEL", "OUT_CHANNEL", "VOCAB",
           "HIDDEN", "HEADS", "COLUMN_ROW", "EXPERT"]


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
    COLUMN = "column"            # a weight's output axis split, no forward collective
                                 # (dense column, conv out-channel)
    ROW = "row"                  # a weight's contraction axis split, forward all-reduce
                                 # (dense row, conv in-channel, embedding vocab)
    HIDDEN = "hidden"            # an embedding table split on its hidden axis
    HEADS = "heads"              # attention split on heads
    COLUMN_ROW = "column-row"    # a whole feed-forward layer: column then row (Megatron)
    EXPERT = "expert"            # MoE experts split on the expert axis

    def __str__(self) -> str:
        return self.value


class PatternId(str):
    """A pattern's id: its :class:`Family` and its variant within the family, written as
    the pattern's name (``row``, ``in-channel``, ``follow-S1``, ``row-2``).

    The name is the variant: a family's patterns on one GraphNode differ by it (``vocab``
    and ``row`` are both :attr:`Family.ROW` on an embedding). It is a ``str`` the way
    :class:`Family` is, so it compares, hashes and is written to JSON as the name; code
    asks :attr:`family` instead of comparing names. :meth:`parse` reads a name at the
    JSON and command-line boundary."""

    family: Family

    def __new__(cls, name: str, family: Family) -> PatternId:
        self = super().__new__(cls, name)
        self.family = Family(family)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return PatternId, (str(self), self.family)

    @property
    def variant(self) -> str:
        return str(self)

    def numbered(self, suffix: Any) -> PatternId:
        """Another variant of this id's family: ``follow`` -> ``follow-S1``, ``row`` ->
        ``row-2``."""
        return PatternId(f"{self}-{suffix}", self.family)

    @staticmethod
    def parse(name: str | PatternId) -> PatternId:
        """The id written ``name``: one of the bases below, or one followed by ``-suffix``
        (the longest base that fits); ValueError naming the bases when none does."""
        if isinstance(name, PatternId):
            return name
        for base in _BY_LENGTH:
            if name == base or name.startswith(base + "-"):
                return PatternId(name, base.family)
        raise ValueError(f"pattern name {name!r} belongs to no pattern family: a name is "
                         f"one of {', '.join(_NAMED)}, optionally followed by "
                         "'-<variant>' (e.g. 'follow-S1', 'row-2')")


def _named_as(family: Family) -> PatternId:
    return PatternId(family.value, family)


# The names the families give their patterns (tapas.sharding.patterns.families): most are
# their family's; a row or column split has its layer's own name on some kinds.
REPLICATE = _named_as(Family.REPLICATE)
BATCH = _named_as(Family.BATCH)
FOLLOW = _named_as(Family.FOLLOW)                    # written follow-S<axis>
SPLIT = _named_as(Family.SPLIT)                      # written split-<input placements>
ROW = _named_as(Family.ROW)
IN_CHANNEL = PatternId("in-channel", Family.ROW)     # a convolution's row
VOCAB = PatternId("vocab", Family.ROW)               # an embedding table's row
COLUMN = _named_as(Family.COLUMN)
OUT_CHANNEL = PatternId("out-channel", Family.COLUMN)
HIDDEN = _named_as(Family.HIDDEN)
HEADS = _named_as(Family.HEADS)
COLUMN_ROW = _named_as(Family.COLUMN_ROW)
EXPERT = _named_as(Family.EXPERT)
_NAMED = (REPLICATE, BATCH, FOLLOW, SPLIT, ROW, IN_CHANNEL, VOCAB, COLUMN, OUT_CHANNEL, HIDDEN,
          HEADS, COLUMN_ROW, EXPERT)
_BY_LENGTH = sorted(_NAMED, key=len, reverse=True)     # column-row before column


@dataclasses.dataclass(frozen=True)
class ShardingPattern:
    """One parallel implementation of one GraphNode on N devices (docs/sharding.md).

    ``tensors`` maps the output of every op inside the node to the placement the op leaves
    it in; a forward comm on that tensor (``comms``) then turns it into ``comm.dst`` before
    any consumer reads it. A weight's gradient comm names the weight's resource placeholder
    tensor (``WeightInfo.placeholder + ':0'``). In ``expr`` the leaves ``X``/``X0``,
    ``X1``... are ``node.inputs`` and ``W``/``W0``, ``W1``... ``node.weights``.
    """

    name: PatternId            # a plain str only for a probe (family None)
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    weights: Mapping[str, Placement]
    tensors: Mapping[str, Placement]
    comms: tuple[Comm, ...]
    rewrites: Mapping[str, Rewrite]
    expr: str
    flops: float              # forward FLOPs per device, every op at one rate (the paper's)
    family: Family | None     # None only for a probe (see PatternSeed)
    note: str = ""            # why a pattern of this node could not be built (then replicated)
    dense_flops: float = 0.0  # of ``flops``: contractions and convolutions
    elements: float = 0.0     # elements its memory-bound ops touch per device (forward)
    # of ``dense_flops``: per width bucket, the power of two at or below the width of the
    # matrix multiply on one device (propagation.flops.gemm_width); what is not here (a
    # contraction of three operands) is priced at the peak rate
    dense_by_width: Mapping[int, float] = dataclasses.field(default_factory=dict)
    # of ``dense_flops``: per compute dtype (the dtype each contraction's output has in the
    # captured graph: bfloat16 under a mixed_bfloat16 policy), priced at that dtype's rate
    # (``Cluster.peak_flops``)
    dense_by_dtype: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # the kernels of its contractions and convolutions on one device, each with how often
    # it runs (propagation.kernels): what ``CostOptions.kernel_times`` prices by their
    # measured time
    kernels: tuple[KernelUse, ...] = ()

    def __post_init__(self) -> None:
        if self.family is not None:
            object.__setattr__(self, "family", Family(self.family))
            if not isinstance(self.name, PatternId) or self.name.family is not self.family:
                object.__setattr__(self, "name", PatternId(self.name, self.family))
        object.__setattr__(self, "rewrites",
                           {k: Rewrite(v) for k, v in self.rewrites.items()})

    @property
    def data_parallel(self) -> bool:
        """What data parallelism does: the batch split, or a follow/split pattern with every
        input split on axis 0 (the batch axis)."""
        if self.family is Family.BATCH:
            return True
        return (self.family in (Family.FOLLOW, Family.SPLIT) and bool(self.inputs)
                and all(p == Split(0) for p in self.inputs))

    @property
    def fwd_comms(self) -> tuple[Comm, ...]:
        return tuple(c for c in self.comms if c.phase == "fwd")

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
    split on one axis) and, for source nodes (graph inputs), of the outputs.

    ``family`` is the kind of parallelism the seed function proposes (by default the
    family of ``name``, a :class:`PatternId`); it is carried into the pattern. Only a
    *probe* -- a seed a family tries to learn what a split does, and never returns
    (``tapas.sharding.patterns.families.shared_seeds.weight_seeds``) -- has none."""

    name: PatternId | str
    inputs: tuple[Placement, ...]
    weights: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    outputs: tuple[Placement, ...] | None = None
    family: Family | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.family is None and isinstance(self.name, PatternId):
            object.__setattr__(self, "family", self.name.family)
