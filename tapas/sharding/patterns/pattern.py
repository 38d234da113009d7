"""What the pattern stage produces: sharding patterns and the seeds they grow from.

In:  nothing (definitions).
Out: :class:`ShardingPattern` (one parallel implementation of one GraphNode, see
     docs/sharding.md), :class:`PatternSeed` (which input/weight splits a family wants
     tried), :class:`Rewrite` (a local program an op needs instead of its own) and
     :class:`Family` (what kind of parallelism a pattern is).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from tapas.sharding.patterns.kernels import KernelUse
from tapas.sharding.placements import Comm, Placement, Replica, Split

__all__ = ["Family", "Rewrite", "ShardingPattern", "PatternSeed"]


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

    ``family`` is the kind of parallelism the seed function proposes; it is carried into
    the pattern. Only a *probe* -- a seed a family tries to learn what a split does, and
    never returns (``tapas.sharding.patterns.families.shared_seeds.weight_seeds``) -- has none."""

    name: str
    inputs: tuple[Placement, ...]
    weights: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    outputs: tuple[Placement, ...] | None = None
    family: Family | None = dataclasses.field(default=None, kw_only=True)
