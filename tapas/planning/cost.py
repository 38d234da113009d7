"""Costs: collective primitives and their overlap-aware alpha-beta time, compute and memory.

In:  a ``MeshAxis`` (the axis of a ``tapas.planning.devicemesh.Mesh`` a collective runs
     over: its size ``W``, the nodes it spans, its link's alpha and beta), a collective
     kind (``Collective``), a message size ``N`` in bytes and ``CostOptions`` (which terms
     of the model are on); at plan level, a pattern's
     ``Comm``s, forward FLOPs per device and bytes per device.
Out: a ``CostTerm`` (one collective's latency and transmission time, in seconds),
     ``CostBreakdown`` (a sum of terms, by kind and by direction), compute seconds, a
     ``MemoryEstimate`` and a whole plan's ``PlanCost``. The search calls
     ``collective_cost`` once per collective on the critical path and adds the terms.

The model is TAPAS's (paper section 4.6), per collective c of kind k over W workers:

    T_latency(c) = alpha' * W                              (eq. 2; 0 if options.latency is off)
    T_trans(c)   = beta * f_k(W) * N * g * epsilon_k       (eq. 3)
    Cost         = sum_c (T_latency(c) + T_trans(c))       (eq. 4)

with alpha' the link's per-hop latency (s), beta = 1 / bandwidth (s/byte), g = gamma for a
backward-pass collective (gradient overlap; 1 in the forward pass or with
``gradient_overlap`` off), epsilon_k the efficiency of primitive k (1 with
``collective_efficiency`` off) and f_k the ring-algorithm factor:

    all-reduce      AR   f = 2 (W - 1) / W    N = the tensor each worker holds
    all-gather      AG   f =   (W - 1) / W    N = the gathered (output) tensor
    reduce-scatter  RS   f =   (W - 1) / W    N = the tensor reduced (input, before scatter)
    all-to-all      A2A  f =   (W - 1) / W    N = each worker's buffer (input = output size)

N is the largest per-worker tensor the collective touches. An axis spanning nodes pays the
inter-node link (a ring is as slow as its slowest hop), one inside a node the intra-node
link; W = 1 costs 0. The search prices on the mesh's ``model`` axis, the data-parallel
gradient all-reduce and the expert all-to-alls on its ``data`` axis. Latency is charged per collective (twice for one in each direction),
not scaled by gamma or epsilon (eq. 3 scales only the transmission term).

Example (a made-up 1 GB/s, 1 us link; 4 workers all-reduce 1 MB in the forward pass):

>>> link = Link(bandwidth=1e9, latency=1e-6)
>>> c = Cluster("toy", num_nodes=1, devices_per_node=4, intra=link, inter=link,
...             device_memory=2**30, device_peak_flops=1e12)
>>> t = collective_cost("AR", 1_000_000, c.mesh().axis("model"),
...                     CostOptions(collective_efficiency=False))
>>> round(t.latency * 1e6, 3), round(t.transmission * 1e3, 3)   # 4 * 1 us; 1.5 MB / 1 GB/s
(4.0, 1.5)
>>> collective_time("AR", 1_000_000, c.axis(1))                   # one worker: no communication
0.0

Plan level (used by ``tapas.planning.table`` and ``tapas.planning.explore``; docs/search.md):
``comm_cost`` prices one ``tapas.sharding.placements.Comm`` (an all-to-all's N is the global
size over W), ``compute_time`` a pattern's forward FLOPs per device as seconds of a training
step, ``weight_memory`` / ``MemoryEstimate`` count bytes per device (weights, gradients,
optimizer state, activations), ``PlanCost`` adds them up for a plan. ``Cluster``, ``Link``,
``MeshAxis`` and the presets (``tapas.planning.cluster``) are re-exported here.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Union

from tapas.planning.cluster import (CLUSTER_PRESETS, SOURCE_KEYS, Cluster, Link, MeshAxis,
                                    check_count)
from tapas.planning.kernel_times import KernelTimes, priced
from tapas.planning.precision import check_precision, comm_bytes, dense_factor
from tapas.planning.widths import effective_flops
from tapas.sharding.losses import LossSpec
from tapas.sharding.placements import Collective

__all__ = [
    "Collective", "Link", "Cluster", "MeshAxis", "CostOptions", "CostTerm", "CostBreakdown",
    "collective_cost", "collective_time", "ring_factor", "DEFAULT_EPSILON", "DEFAULT_GAMMA",
    "CLUSTER_PRESETS", "SOURCE_KEYS", "OPTIMIZER_SLOTS", "comm_cost", "compute_time",
    "MemoryEstimate", "weight_memory", "PlanCost",
]


KindLike = Union[Collective, str]

# optimizer state per trainable weight, in copies of the weight (Adam: first and second
# moments; momentum SGD: one velocity; plain SGD: none)
OPTIMIZER_SLOTS: Mapping[str, int] = types.MappingProxyType({"adam": 2, "momentum": 1,
                                                              "sgd": 0})

# gamma and epsilon defaults; docs/cost.md says where they come from. They are priors to be
# replaced by profiled values, not measurements.
DEFAULT_GAMMA = 0.5
DEFAULT_EPSILON: Mapping[str, float] = types.MappingProxyType(
    {"AR": 1.0, "AG": 0.8, "RS": 0.8, "A2A": 1.0})


def ring_factor(kind: KindLike, group_size: int) -> float:
    """Bytes each worker sends per byte of message N, for the ring algorithm (see module doc)."""
    kind = Collective.parse(kind)
    check_count("group_size", group_size, "a collective runs over at least one worker")
    w = group_size
    if kind is Collective.ALL_REDUCE:
        return 2.0 * (w - 1) / w
    return (w - 1) / w


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """Which terms of the cost model are on; switch one off for the paper's ablation
    (``docs/cost.md``, "Options and the ablation")."""

    # the alpha' * W latency term (eq. 2); off: only transmission time counts
    latency: bool = True
    # filter constant tensors (the paper's "CF"): GraphNodes computed only from
    # graph inputs and constants (masks, position ids, rotary tables) run replicated and
    # their placements are not searched (tapas.planning.table.constant_nodes); off: searched
    constant_filter: bool = True
    # discount backward-pass transmission by gamma (eq. 3, "GO"); off: gamma = 1
    gradient_overlap: bool = True
    # the discount: how much of a backward collective's transmission is not hidden, in (0, 1]
    gamma: float = DEFAULT_GAMMA
    # scale transmission by epsilon of its primitive (eq. 3, "EC"); off: epsilon = 1
    collective_efficiency: bool = True
    # epsilon per primitive, keyed by short name ("AR", "AG", "RS", "A2A"), each > 0; the
    # priors are in (0, 1] as in the paper, a profiled value (tapas profile: the primitive's
    # measured time per ring byte over the all-reduce's) may exceed 1 where the runtime moves
    # more than the ring bytes (its reduce-scatter is an all-reduce + slice); a primitive
    # left out gets 1
    epsilon: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_EPSILON), hash=False)
    # plan level (beyond the paper): price the reshard of a weight that GraphNodes read in
    # different placements (a tied embedding: stored as its first reader wants it, moved for
    # the others, as the runtime does); off by default (the search's numbers so far)
    weight_reshards: bool = False
    # price the training loss (beyond the paper): the collectives the runtime's loss plan
    # runs on the model's output as each pattern places it (an all-gather and an all-reduce
    # of per-row statistics for vocabulary-split logits under a cross-entropy; the whole
    # output gathered for a loss it cannot split; tapas.sharding.losses). None: not priced
    # (the search's numbers before this option; an inference plan). A LossSpec, or a
    # keras.losses.Loss object (read with LossSpec.of)
    loss: LossSpec | None = None
    # plan level (beyond the paper): add compute time, FLOPs per device / device peak; off:
    # only communication ranks plans, as in the paper's eq. 4
    compute: bool = True
    # backward FLOPs per forward FLOP (input and weight gradients: 2, Kaplan et al. 2020's
    # "6N per token" = 2N forward + 4N backward)
    backward_flops_factor: float = 2.0
    # plan level (beyond the paper, "MB"): price memory-bound ops (elementwise, reductions,
    # transposes, concats, gathers, depthwise convolutions) by the elements they touch at
    # the cluster's elementwise rate (``Cluster.device_elementwise_rate``, measured by
    # ``tapas profile``) and only contractions and dense convolutions at the FLOP rate;
    # off, or on a cluster without that rate (every preset): every op's FLOPs at
    # ``device_peak_flops``, as the paper
    memory_bound: bool = True
    # plan level (beyond the paper, "W"; with memory_bound): price each matrix multiply at
    # the FLOP rate of its width on one device (``Cluster.flop_rate``: thin operands, and
    # operands a split on a channel or hidden axis thins, run below the peak), on a cluster
    # that has ``device_width_efficiency`` (measured by ``tapas profile``); off, or on a
    # cluster without it: every width at ``device_peak_flops``
    gemm_width: bool = True
    # plan level (beyond the paper, "MC"): every plan's compute time times this factor,
    # measured for one model by ``tapas.execution.calibration.compute_scale.
    # calibrate_compute`` (its own step at two batch sizes against what this model prices
    # for them: what its ops cost beyond the profiled rates); 1.0: the rates as profiled
    compute_scale: float = 1.0
    # plan level (beyond the paper, "E"; with memory_bound): the memory-bound ops' time (their
    # elements at ``Cluster.device_elementwise_rate``) times this factor, measured for one
    # model from its replicated step at two batch sizes (``calibrate_compute``): what the
    # difference takes beyond the priced difference of its contractions and convolutions,
    # per second of its memory-bound ops' priced difference (``scripts/table2_cost_model.py``,
    # ``elementwise_factor``): the profile's rate is one long streaming kernel's, a model's
    # memory-bound ops are many short ones; 1.0: the rate as profiled
    elementwise_scale: float = 1.0
    # plan level (beyond the paper, "K"; with memory_bound): the measured training-step time
    # of each kernel a pattern's contractions and convolutions run on one device
    # (``tapas.execution.calibration.kernels.measure_kernels`` for one model: its ops at
    # their local shapes under every pattern), in place of their FLOPs (or elements) at the rates; a
    # kernel not measured keeps the rates. None: the rates for every op
    kernel_times: KernelTimes | None = None
    # plan level (beyond the paper, "CS"): every collective's cost (latency and
    # transmission) times this factor, measured for one model by
    # ``tapas.execution.calibration.communication_scale.calibrate_communication`` (that
    # model's data-parallel step with and without its collectives against what this model prices
    # for them: the profile's alpha and beta are measured on chains of collectives that wait
    # on each other, a step's collectives are not); 1.0: the constants as profiled
    communication_scale: float = 1.0
    # plan level (beyond the paper, "CA"): the factor for the collectives that do not reduce
    # a weight's gradient (activations, their gradients, the loss's statistics, experts'
    # all-to-alls) in place of ``communication_scale``, measured by the same calibration on
    # a plan whose priced communication is mostly such collectives (a gradient's all-reduce
    # runs beside the backward pass, an activation's collective is waited on by the next
    # op). None: ``communication_scale`` for every collective
    activation_communication_scale: float | None = None
    # price a backward collective only on a tensor whose gradient the training step
    # computes (``tapas.sharding.gradients.gradient_flow``: on a path from a trainable
    # weight to the loss, through ops with a gradient), as the runtime runs them: the
    # gradient of a slice of a padding mask, of an integer input or of a router's indices
    # is never computed, so its all-gather never runs. Off: every backward collective the
    # patterns and reshards name
    gradient_flow: bool = True
    # the optimizer state the memory estimate counts, in copies of each trainable weight:
    # ``optimizer_slots`` when known (the compiled optimizer's, counted by
    # tapas.parallelize), else OPTIMIZER_SLOTS[optimizer] ("adam" 2, "momentum" 1, "sgd" 0)
    optimizer: str = "adam"
    optimizer_slots: int | None = None
    # price as if the model ran under this Keras dtype policy (tapas.planning.precision.
    # PRECISIONS: contractions and activations in its dtype); None: the graph's own dtypes
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.loss is not None and not isinstance(self.loss, LossSpec):
            object.__setattr__(self, "loss", LossSpec.of(self.loss))
        for name in ("latency", "constant_filter", "gradient_overlap", "collective_efficiency",
                     "compute", "memory_bound", "gemm_width", "gradient_flow"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: must be True or False")
        if isinstance(self.backward_flops_factor, bool) or \
                not isinstance(self.backward_flops_factor, (int, float)) or \
                not math.isfinite(self.backward_flops_factor) or self.backward_flops_factor < 0:
            raise ValueError(f"backward_flops_factor={self.backward_flops_factor!r}: must be a "
                             "finite number >= 0 (2.0: backward costs twice the forward pass)")
        _check_scale("compute_scale", self.compute_scale,
                     "1.0: compute at the cluster's profiled rates; "
                     "tapas.execution.calibration.compute_scale.calibrate_compute measures it")
        _check_scale("elementwise_scale", self.elementwise_scale,
                     "1.0: memory-bound ops at the cluster's profiled elementwise rate; "
                     "ComputeCalibration.elementwise_scale measures it")
        _check_scale("communication_scale", self.communication_scale,
                     "1.0: collectives at the cluster's profiled alpha and beta; "
                     "tapas.execution.calibration.communication_scale.calibrate_communication "
                     "measures it")
        if self.activation_communication_scale is not None and (
                isinstance(self.activation_communication_scale, bool) or
                not isinstance(self.activation_communication_scale, (int, float)) or
                not math.isfinite(self.activation_communication_scale) or
                self.activation_communication_scale <= 0):
            raise ValueError(f"activation_communication_scale="
                             f"{self.activation_communication_scale!r}: must be a finite "
                             "number > 0, or None (communication_scale for every collective; "
                             "tapas.execution.calibration.communication_scale.calibrate_communication "
                             "measures it)")
        if self.kernel_times is not None and not isinstance(self.kernel_times, KernelTimes):
            raise TypeError(f"kernel_times={self.kernel_times!r}: must be a "
                            "tapas.planning.kernel_times.KernelTimes (measured by "
                            "tapas.execution.calibration.kernels.measure_kernels) or None")
        check_precision(self.precision)
        if self.optimizer not in OPTIMIZER_SLOTS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown: use one of "
                             f"{sorted(OPTIMIZER_SLOTS)}")
        if (slots := self.optimizer_slots) is not None and not (isinstance(slots, int)
                                                               and slots >= 0):
            raise ValueError(f"optimizer_slots={slots!r}: an int >= 0, or None")
        _check_fraction("gamma", self.gamma, "use gradient_overlap=False for no discount")
        eps: dict[str, float] = {}
        for key, value in dict(self.epsilon).items():
            kind = Collective.parse(key)
            _check_factor(f"epsilon[{kind.value!r}]", value,
                          "use collective_efficiency=False for no discount")
            eps[kind.value] = float(value)
        object.__setattr__(self, "epsilon", types.MappingProxyType(eps))

    def communication_scale_for(self, gradient: bool) -> float:
        """The factor on a collective's cost: ``communication_scale`` for one that reduces
        a weight's gradient (``gradient``), ``activation_communication_scale`` (when set)
        for any other."""
        if gradient or self.activation_communication_scale is None:
            return self.communication_scale
        return self.activation_communication_scale

    def gamma_for(self, backward: bool) -> float:
        """The factor on transmission for a collective in the given direction."""
        return self.gamma if backward and self.gradient_overlap else 1.0

    def epsilon_for(self, kind: KindLike) -> float:
        """The factor on transmission for primitive ``kind``."""
        if not self.collective_efficiency:
            return 1.0
        return self.epsilon.get(Collective.parse(kind).value, 1.0)

    @classmethod
    def vanilla(cls) -> CostOptions:
        """The plain alpha-beta model: latency on, no overlap discounts, every op's FLOPs at
        the peak rate (the ablation baseline)."""
        return cls(gradient_overlap=False, collective_efficiency=False, memory_bound=False)

    @classmethod
    def for_cluster(cls, cluster: Cluster, **changes: object) -> CostOptions:
        """The options with ``cluster``'s profiled ``epsilon`` and ``gamma`` in place of the
        priors (a cluster without them, e.g. a preset, keeps the priors), then ``changes``
        (e.g. ``gradient_overlap=False`` for an ablation row). The search's default."""
        measured: dict[str, object] = {}
        if cluster.epsilon is not None:
            measured["epsilon"] = dict(cluster.epsilon)
        if cluster.gamma is not None:
            measured["gamma"] = cluster.gamma
        measured.update(changes)
        return cls(**measured)


def _check_scale(name: str, value: object, meaning: str) -> None:
    """A measured factor of ``CostOptions``: a finite number > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number > 0 ({meaning})")


def _check_fraction(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a number in (0, 1]")
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name}={value}: must be in (0, 1]; {fix}")


def _check_factor(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a positive number")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name}={value}: must be a positive, finite factor (1: the "
                         f"link's ring rate; a profiled one may exceed 1); {fix}")


@dataclasses.dataclass(frozen=True)
class CostTerm:
    """One collective's cost: ``latency + transmission`` seconds."""

    kind: Collective
    nbytes: int
    group_size: int
    nodes: int
    backward: bool
    latency: float
    transmission: float
    label: str = ""
    gradient: bool = False      # reduces a weight's gradient (else: an activation's)

    @property
    def total(self) -> float:
        return self.latency + self.transmission

    @property
    def direction(self) -> str:
        return "backward" if self.backward else "forward"

    def __str__(self) -> str:
        where = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        label = f" [{self.label}]" if self.label else ""
        return (f"{self.kind.value:<3} {self.direction:<8} {self.nbytes:>14,} B  "
                f"W={self.group_size}{where}: latency {self.latency * 1e6:.1f} us + transmission "
                f"{self.transmission * 1e6:.1f} us = {self.total * 1e6:.1f} us{label}")


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """A sum of ``CostTerm``s; ``total`` is eq. 4 over them."""

    terms: tuple[CostTerm, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "terms", tuple(self.terms))

    @functools.cached_property
    def total(self) -> float:   # read for every ranking and report: summed once
        return math.fsum(t.total for t in self.terms)

    @property
    def latency(self) -> float:
        return math.fsum(t.latency for t in self.terms)

    @property
    def transmission(self) -> float:
        return math.fsum(t.transmission for t in self.terms)

    def by_kind(self) -> dict[Collective, float]:
        """Total seconds per primitive (only primitives present)."""
        out: dict[Collective, float] = {}
        for t in self.terms:
            out[t.kind] = out.get(t.kind, 0.0) + t.total
        return out

    def by_direction(self) -> dict[str, float]:
        """Total seconds in the forward and the backward pass."""
        return {"forward": math.fsum(t.total for t in self.terms if not t.backward),
                "backward": math.fsum(t.total for t in self.terms if t.backward)}

    def by_role(self) -> dict[str, float]:
        """Total seconds of the collectives that reduce weights' gradients (``"gradient"``)
        and of the others (``"activation"``)."""
        return {"gradient": math.fsum(t.total for t in self.terms if t.gradient),
                "activation": math.fsum(t.total for t in self.terms if not t.gradient)}

    def __add__(self, other: Union[CostBreakdown, CostTerm, Iterable[CostTerm]]) -> CostBreakdown:
        if isinstance(other, CostTerm):
            return CostBreakdown(self.terms + (other,))
        if isinstance(other, CostBreakdown):
            return CostBreakdown(self.terms + other.terms)
        return CostBreakdown(self.terms + tuple(other))

    def __iter__(self) -> Iterator[CostTerm]:
        return iter(self.terms)

    def __len__(self) -> int:
        return len(self.terms)

    def __str__(self) -> str:
        lines = [str(t) for t in self.terms]
        d = self.by_direction()
        lines.append(f"total {self.total * 1e6:.1f} us (forward {d['forward'] * 1e6:.1f} us, "
                     f"backward {d['backward'] * 1e6:.1f} us)")
        return "\n".join(lines)


def collective_cost(kind: KindLike, nbytes: int, axis: MeshAxis,
                    options: CostOptions | None = None, backward: bool = False,
                    label: str = "", gradient: bool = False) -> CostTerm:
    """The cost of one collective of ``nbytes`` bytes over ``axis`` (a ``MeshAxis``:
    ``mesh.axis("model")``, ``mesh.axis("data")``, or ``cluster.axis(W)`` for a group of W).
    ``backward`` marks a backward-pass collective (gamma applies); ``gradient`` one that
    reduces a weight's gradient (``CostOptions.communication_scale_for``); N: module doc."""
    kind = Collective.parse(kind)
    options = CostOptions() if options is None else options
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes={nbytes!r}: must be an int number of bytes")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes}: a message cannot have negative size")
    if not isinstance(axis, MeshAxis):
        raise TypeError(f"axis={axis!r}: must be a MeshAxis, e.g. cluster.mesh(rows, cols)"
                        ".axis('model') or cluster.axis(W) for a group of W devices")
    if axis.size == 1:
        return CostTerm(kind, nbytes, 1, axis.nodes, bool(backward), 0.0, 0.0, label,
                        bool(gradient))
    scale = options.communication_scale_for(bool(gradient))
    latency = axis.alpha * axis.size * scale if options.latency else 0.0
    transmission = (axis.beta * ring_factor(kind, axis.size) * nbytes
                    * options.gamma_for(backward) * options.epsilon_for(kind) * scale)
    return CostTerm(kind, nbytes, axis.size, axis.nodes, bool(backward), latency, transmission,
                    label, bool(gradient))


def collective_time(kind: KindLike, nbytes: int, axis: MeshAxis,
                    options: CostOptions | None = None, backward: bool = False) -> float:
    """Seconds for one collective: ``collective_cost(...).total``."""
    return collective_cost(kind, nbytes, axis, options, backward).total


# =========================================================================================
# Plan level: a sharding pattern's collectives, compute time and memory
# =========================================================================================

def comm_cost(comm: object, axis: MeshAxis, options: CostOptions | None = None,
              label: str = "", weights: Collection[str] = ()) -> CostTerm:
    """The cost of one ``tapas.sharding.placements.Comm`` (anything with ``kind``, ``bytes``
    and ``phase``; ``dtype`` and ``tensor`` if it has them) over ``axis`` (the search's:
    the mesh's ``model`` axis, ``MeshAxis``). ``comm.bytes`` is the global
    tensor's size, N for AR, AG and RS (module doc; in ``options.precision``'s dtype with
    one: ``precision.comm_bytes``); an all-to-all's N is each worker's buffer, the global
    size over the group. ``phase`` ``"bwd"``: a backward collective (gamma applies).
    ``weights``: the tensor names of the GraphNode's weights (``WeightInfo.placeholder +
    ':0'``): a backward collective on one reduces that weight's gradient."""
    kind = Collective.parse(getattr(comm, "kind"))
    options = CostOptions() if options is None else options
    on_weight = getattr(comm, "tensor", None) in weights
    nbytes = comm_bytes(comm, options.precision, on_weight)
    phase = getattr(comm, "phase")
    if phase not in ("fwd", "bwd"):
        raise ValueError(f"comm phase {phase!r}: must be 'fwd' or 'bwd'")
    if kind is Collective.ALL_TO_ALL:
        nbytes = -(-nbytes // axis.size)
    return collective_cost(kind, nbytes, axis, options, backward=phase == "bwd",
                           label=label, gradient=phase == "bwd" and on_weight)


def compute_time(flops: float, cluster: Cluster, options: CostOptions | None = None, *,
                 dense_flops: float | None = None, elements: float = 0.0,
                 dense_by_width: Mapping[int, float] | None = None,
                 kernels: Sequence[object] = (),
                 dense_by_dtype: Mapping[str, float] | None = None) -> float:
    """Seconds of one training step's compute for ``flops`` forward FLOPs per device: the
    paper's ``flops * (1 + backward_flops_factor) / device_peak_flops`` (0 with ``compute``
    off). With ``memory_bound``, the split given (``dense_flops`` of contractions and
    convolutions, ``elements`` of memory-bound ops) and a ``device_elementwise_rate``:
    ``(dense_flops / device_peak_flops + elements * elementwise_scale / rate) * (1 +
    backward_flops_factor)``, ``dense_by_width``'s FLOPs at ``Cluster.flop_rate(width)``
    (``gemm_width``), and each of ``kernels`` with a time in ``options.kernel_times`` at
    that time per run (``kernel_times.priced``). Always: ``dense_flops`` at the peak of
    their dtype (``dense_by_dtype`` or ``options.precision``; ``precision.dense_factor``)
    and everything times ``compute_scale``.
    """
    options = CostOptions() if options is None else options
    if not options.compute:
        return 0.0
    scale = (1.0 + options.backward_flops_factor) * options.compute_scale
    rate = cluster.device_elementwise_rate
    if options.memory_bound and rate and dense_flops is not None:
        measured, dense, by_width, elements = priced(kernels, options.kernel_times,
                                                     float(dense_flops), dense_by_width,
                                                     float(elements))
        return ((dense_time(cluster, options, dense, by_width, dense_by_dtype)
                 + elements * options.elementwise_scale / rate) * scale
                + measured * options.compute_scale)
    dense = 0.0 if dense_flops is None else float(dense_flops)
    dense *= 1.0 - dense_factor(cluster, dense_by_dtype, options.precision)
    return (float(flops) - dense) * scale / cluster.device_peak_flops


def dense_time(cluster: Cluster, options: CostOptions, dense_flops: float,
               dense_by_width: Mapping[int, float] | None = None,
               dense_by_dtype: Mapping[str, float] | None = None) -> float:
    """Seconds of ``dense_flops`` forward FLOPs of matrix multiplies: those in
    ``dense_by_width`` at their width's rate (``Cluster.flop_rate``, with ``gemm_width``
    on), the rest at ``device_peak_flops``; each dtype's share at its peak instead
    (``dense_by_dtype``, ``options.precision``; the width's efficiency applies to it)."""
    table = cluster.device_width_efficiency if options.gemm_width else None
    return (effective_flops(dense_flops, dense_by_width, table) / cluster.device_peak_flops
            * dense_factor(cluster, dense_by_dtype, options.precision))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device: weights, their gradients, optimizer state and saved activations."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(self.weights + other.weights, self.gradients + other.gradients,
                              self.optimizer + other.optimizer,
                              self.activations + other.activations)

    def to_json(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "total": self.total}

    @staticmethod
    def from_json(d: Mapping[str, float]) -> MemoryEstimate:
        return MemoryEstimate(d["weights"], d["gradients"], d["optimizer"], d["activations"])

    def __str__(self) -> str:
        gib = 2.0 ** 30
        return (f"{self.total / gib:.3f} GiB per device (weights {self.weights / gib:.3f}, "
                f"gradients {self.gradients / gib:.3f}, optimizer {self.optimizer / gib:.3f}, "
                f"activations {self.activations / gib:.3f})")


def weight_memory(local_bytes: float, trainable: bool,
                  options: CostOptions | None = None) -> MemoryEstimate:
    """One weight holding ``local_bytes`` per device: itself, its gradient and optimizer
    state if trainable (``options.optimizer_slots`` copies, else
    ``OPTIMIZER_SLOTS[options.optimizer]``)."""
    options = CostOptions() if options is None else options
    if not trainable:
        return MemoryEstimate(weights=float(local_bytes))
    slots = options.optimizer_slots
    slots = OPTIMIZER_SLOTS[options.optimizer] if slots is None else slots
    return MemoryEstimate(weights=float(local_bytes), gradients=float(local_bytes),
                          optimizer=float(local_bytes) * slots)


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """A whole plan's cost: collectives (eq. 4 over them), compute time and memory.

    ``total`` (seconds per training step) is the collectives' total plus ``compute``.
    """

    comms: CostBreakdown
    compute: float
    memory: MemoryEstimate

    @property
    def communication(self) -> float:
        return self.comms.total

    @property
    def total(self) -> float:
        return self.comms.total + self.compute

    def to_json(self) -> dict[str, object]:
        d = self.comms.by_direction()
        return {"total": self.total, "communication": self.communication,
                "compute": self.compute, "latency": self.comms.latency,
                "transmission": self.comms.transmission,
                "forward": d["forward"], "backward": d["backward"],
                "by_kind": {k.value: v for k, v in self.comms.by_kind().items()},
                "collectives": len(self.comms), "memory": self.memory.to_json()}

    def __str__(self) -> str:
        d = self.comms.by_direction()
        kinds = ", ".join(f"{k.value} {v * 1e3:.3f} ms" for k, v in self.comms.by_kind().items())
        return (f"{self.total * 1e3:.3f} ms per step: communication "
                f"{self.communication * 1e3:.3f} ms (forward {d['forward'] * 1e3:.3f}, "
                f"backward {d['backward'] * 1e3:.3f}; {kinds or 'none'}), compute "
                f"{self.compute * 1e3:.3f} ms; memory {self.memory}")

