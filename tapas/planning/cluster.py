"""The cluster S(m, n): its devices, the links between them and the named presets.

In:  a shape (``num_nodes`` nodes of ``devices_per_node`` devices), two ``Link``s (inside a
     node and between nodes, bandwidth in bytes/s and latency in s per hop), the memory and
     peak FLOP/s of one device, and where each constant comes from.
Out: a frozen ``Cluster``: its ``num_devices``, the ``MeshAxis`` a collective of W workers
     runs on (and so the link its ring pays), its device meshes (``Cluster.mesh(rows,
     cols)``, ``tapas.planning.devicemesh``), and the
     presets ``Cluster.v100_ethernet`` (the paper's cluster), ``Cluster.gpu`` (V100, A100,
     H100 nodes, their constants in ``tapas.planning.hardware``), ``Cluster.loopback_cpu`` (this
     machine's logical CPU devices, measured) and ``Cluster.preset(name, m, n)`` by name
     (``CLUSTER_PRESETS``, the ``--cluster`` flag); ``Cluster.save``/``Cluster.load`` write
     and read a versioned JSON file (what ``tapas profile`` writes; the codec is
     ``tapas.planning.cluster_file``), and
     ``Cluster.resolve(spec, m, n)`` takes a preset name or such a file.

A cluster may carry the cost model's coefficients measured on it (``epsilon`` per primitive
and ``gamma``, from ``tapas profile``); ``CostOptions.for_cluster`` uses them in place of the
priors, and ``None`` (every preset) keeps the priors.

A group inside one node pays the intra-node link; one that spans nodes pays the inter-node
link (a ring is as slow as its slowest hop). ``tapas.planning.cost`` prices collectives on it.

>>> c = Cluster.v100_ethernet(num_nodes=2, devices_per_node=4)
>>> c.name, c.num_devices, c.axis(4).link.name, c.axis(8).link.name
('v100-ethernet/2x4', 8, 'nvlink2', 'ethernet-100g')

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

from tapas.planning.hardware import (GPU_PRESETS, LOOPBACK_BANDWIDTH, LOOPBACK_FLOPS,
                                     LOOPBACK_LATENCY, LOOPBACK_MEMORY, LOOPBACK_SOURCES,
                                     PEAK_DTYPES, peaks_by_dtype)
from tapas.planning.widths import check_positive, width_efficiency
from tapas.planning.widths import check_width_efficiency as _width_efficiency
from tapas.sharding.placements import Collective

__all__ = ["Link", "MeshAxis", "Cluster", "SOURCE_KEYS", "COEFFICIENT_SOURCE_KEYS", "PEAK_DTYPES",
           "DTYPE_SOURCE_KEYS",
           "CLUSTER_PRESETS", "CLUSTER_FORMAT", "CLUSTER_VERSION", "ClusterFileError",
           "check_count", "check_positive"]


def check_count(name: str, value: object, why: str) -> None:
    """Raise unless ``value`` is an int >= 1 (``why``: what the count is for)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int ({why})")
    if value < 1:
        raise ValueError(f"{name}={value}: must be at least 1 ({why})")


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link: ``bandwidth`` in bytes/s per direction, ``latency`` (alpha') in s per
    hop."""

    bandwidth: float
    latency: float
    name: str = ""

    def __post_init__(self) -> None:
        label = f"{self.name or 'link'}.bandwidth"
        check_positive(label, self.bandwidth, "bytes/s",
                        "e.g. 12.5e9 for 100 Gb/s Ethernet (bits / 8)")
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)):
            raise TypeError(f"{self.name or 'link'}.latency={self.latency!r}: must be seconds")
        if not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"{self.name or 'link'}.latency={self.latency}: must be a finite "
                             "number of seconds >= 0 (use 0 to ignore latency)")

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth)."""
        return 1.0 / self.bandwidth


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One axis of a device mesh (``tapas.planning.devicemesh``): a group of ``size`` devices
    along it on ``nodes`` nodes, and the link its ring pays (``alpha`` s per hop, ``beta`` s
    per byte): the intra-node link inside one node, the inter-node link across nodes."""

    name: str
    size: int
    nodes: int
    link: Link

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def alpha(self) -> float:
        """Seconds per hop (the link's latency)."""
        return self.link.latency

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / the link's bandwidth)."""
        return self.link.beta


# the constants each Cluster documents in ``sources``
SOURCE_KEYS = ("intra.bandwidth", "intra.latency", "inter.bandwidth", "inter.latency",
               "device_memory", "device_peak_flops")
# the cost-model coefficients a profiled cluster documents too (optional in ``sources``)
COEFFICIENT_SOURCE_KEYS = ("epsilon", "gamma", "device_elementwise_rate",
                           "device_width_efficiency")
# the peak of each dtype in ``device_peak_flops_by_dtype`` (optional in ``sources``)
DTYPE_SOURCE_KEYS = tuple(f"device_peak_flops.{d}" for d in PEAK_DTYPES)
ALL_SOURCE_KEYS = SOURCE_KEYS + COEFFICIENT_SOURCE_KEYS + DTYPE_SOURCE_KEYS

# the cluster file: ``format`` names it, ``version`` its layout (Cluster.save / Cluster.load)
CLUSTER_FORMAT = "tapas-cluster"
CLUSTER_VERSION = 1


class ClusterFileError(ValueError):
    """A cluster JSON file that cannot be read: the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """S(m, n): ``num_nodes`` nodes of ``devices_per_node`` devices each.

    ``intra`` links devices inside a node, ``inter`` links nodes. ``device_memory`` is bytes per
    device, ``device_peak_flops`` FLOP/s per device. ``sources`` says where each constant comes
    from (keys: ``SOURCE_KEYS``, and ``COEFFICIENT_SOURCE_KEYS`` for a profiled cluster; a
    missing one reads "unspecified").

    ``epsilon`` (per primitive, short names, each > 0) and ``gamma`` (in (0, 1]) are the cost
    model's coefficients as measured on this hardware (``tapas profile``); ``None`` leaves
    ``CostOptions``' priors in force (``CostOptions.for_cluster``).

    ``device_elementwise_rate`` is elements/s per device that memory-bound ops (elementwise,
    reductions, copies, depthwise convolutions) reach, all devices working at once (``tapas
    profile`` fits it with ``device_peak_flops`` to training steps of reference blocks);
    with it the cost model prices those ops by their elements (``CostOptions.memory_bound``),
    without it (``None``, every preset) by their FLOPs at ``device_peak_flops``, as the
    paper.

    ``device_width_efficiency`` maps the width of a matrix multiply (a power of two; see
    ``tapas.sharding.patterns.propagation.flops.gemm_width``) to the fraction of
    ``device_peak_flops`` it reaches (``tapas profile`` times stacks of matmuls of widths 8
    to 256): thin layers, and layers a split on a channel axis makes thin, run far below
    the peak on a CPU. ``None`` (every preset): every width at the peak.

    ``device_peak_flops_by_dtype`` maps a dtype of ``PEAK_DTYPES`` (``"float16"``,
    ``"bfloat16"``) to the FLOP/s of a matrix multiply in that dtype (a GPU's tensor
    cores); a dtype left out, and float32, run at ``device_peak_flops``
    (:meth:`peak_flops`).
    """

    name: str
    num_nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    device_memory: float
    device_peak_flops: float
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False,
                                                   repr=False)
    epsilon: Mapping[str, float] | None = dataclasses.field(default=None, hash=False)
    gamma: float | None = None
    device_elementwise_rate: float | None = None
    device_width_efficiency: Mapping[int, float] | None = dataclasses.field(default=None,
                                                                            hash=False)
    device_peak_flops_by_dtype: Mapping[str, float] | None = dataclasses.field(default=None,
                                                                               hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_nodes, int) and not isinstance(self.num_nodes, bool) \
                and self.num_nodes < 1:
            raise ValueError(f"num_nodes={self.num_nodes}: a cluster needs at least one node; "
                             "use Cluster.single_node(n) for one machine")
        check_count("num_nodes", self.num_nodes, "a cluster needs at least one node")
        if isinstance(self.devices_per_node, int) and not isinstance(self.devices_per_node, bool) \
                and self.devices_per_node < 1:
            raise ValueError(f"devices_per_node={self.devices_per_node}: a cluster with no "
                             "devices cannot run anything; give each node at least one device")
        check_count("devices_per_node", self.devices_per_node, "each node needs a device")
        for field, link in (("intra", self.intra), ("inter", self.inter)):
            if not isinstance(link, Link):
                raise TypeError(f"{field}={link!r}: must be a Link(bandwidth, latency)")
        check_positive("device_memory", self.device_memory, "bytes", "e.g. 32 * 2**30")
        check_positive("device_peak_flops", self.device_peak_flops, "FLOP/s", "e.g. 15.7e12")
        unknown = sorted(set(self.sources) - set(ALL_SOURCE_KEYS))
        if unknown:
            raise ValueError(f"sources has unknown keys {unknown}: use {list(ALL_SOURCE_KEYS)}")
        object.__setattr__(self, "sources", types.MappingProxyType(dict(self.sources)))
        if self.epsilon is not None:
            if not isinstance(self.epsilon, Mapping):
                raise TypeError(f"epsilon={self.epsilon!r}: must be a mapping from primitive "
                                "('AR', 'AG', 'RS', 'A2A') to a factor, or None for the priors")
            eps: dict[str, float] = {}
            for key, value in self.epsilon.items():
                kind = Collective.parse(key)
                check_positive(f"epsilon[{kind.value!r}]", value, "(a factor on the primitive's "
                               "transmission time)", "e.g. 1.0 for the all-reduce's rate")
                eps[kind.value] = float(value)
            object.__setattr__(self, "epsilon", types.MappingProxyType(eps))
        if self.gamma is not None:
            check_positive("gamma", self.gamma, "(the visible fraction of a backward "
                           "collective)", "e.g. 0.5")
            if self.gamma > 1:
                raise ValueError(f"gamma={self.gamma}: must be in (0, 1] (1: nothing of a "
                                 "backward collective is hidden); use None for the prior")
        if self.device_elementwise_rate is not None:
            check_positive("device_elementwise_rate", self.device_elementwise_rate,
                           "elements/s per device", "e.g. 1e9, or None to price every op's "
                           "FLOPs at device_peak_flops")
        if self.device_width_efficiency is not None:
            object.__setattr__(self, "device_width_efficiency", types.MappingProxyType(
                _width_efficiency(self.device_width_efficiency)))
        if self.device_peak_flops_by_dtype is not None:
            object.__setattr__(self, "device_peak_flops_by_dtype", types.MappingProxyType(
                peaks_by_dtype(self.device_peak_flops_by_dtype)))

    def peak_flops(self, dtype: str = "float32") -> float:
        """FLOP/s per device of a matrix multiply computing in ``dtype``: its entry in
        ``device_peak_flops_by_dtype``, else ``device_peak_flops``.

        >>> c = Cluster.v100_ethernet()
        >>> [c.peak_flops(d) / 1e12 for d in ("float32", "float16", "bfloat16")]
        [15.7, 125.0, 15.7]
        """
        return (self.device_peak_flops_by_dtype or {}).get(dtype, self.device_peak_flops)

    def flop_rate(self, width: int | None = None) -> float:
        """FLOP/s per device of a matrix multiply ``width`` wide: ``device_peak_flops``
        times :func:`width_efficiency` (the peak where ``width`` is None or the cluster
        has no ``device_width_efficiency``).

        >>> c = Cluster.loopback_cpu(4)
        >>> c = dataclasses.replace(c, device_peak_flops=1e10,
        ...                         device_width_efficiency={8: 0.25, 32: 0.75, 128: 1.0})
        >>> [round(c.flop_rate(w) / 1e9, 3) for w in (4, 8, 16, 64, 1024)]
        [2.5, 3.75, 6.25, 9.375, 10.0]
        """
        if width is None or not self.device_width_efficiency:
            return self.device_peak_flops
        return self.device_peak_flops * width_efficiency(self.device_width_efficiency, width)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def source(self, key: str) -> str:
        """Where the constant ``key`` (one of ``SOURCE_KEYS`` or ``COEFFICIENT_SOURCE_KEYS``)
        comes from."""
        if key == "device_elementwise_rate" and self.device_elementwise_rate is None:
            return ("not profiled: memory-bound ops priced by their FLOPs at "
                    "device_peak_flops (docs/cost.md)")
        if key == "device_width_efficiency" and self.device_width_efficiency is None:
            return "not profiled: matrix multiplies of every width at device_peak_flops"
        if key in COEFFICIENT_SOURCE_KEYS and getattr(self, key) is None:
            return "not profiled: CostOptions' prior (docs/cost.md)"
        if key in DTYPE_SOURCE_KEYS and key.split(".", 1)[1] not in \
                (self.device_peak_flops_by_dtype or {}):
            return f"no peak given: {key.split('.', 1)[1]} priced at device_peak_flops"
        if key not in ALL_SOURCE_KEYS:
            raise KeyError(f"{key!r} is not a cluster constant: use one of "
                           f"{list(ALL_SOURCE_KEYS)}")
        return self.sources.get(key, "unspecified")

    def axis(self, size: int, nodes: int | None = None, name: str = "group") -> MeshAxis:
        """The axis of ``size`` devices, filling a node before the next (or over ``nodes``):
        a 1-D mesh's, or a group of workers'. Inside one node it pays ``intra``, across
        nodes ``inter``. :meth:`mesh` names the axes of a 2-D mesh."""
        check_count("size", size, "a group has at least one worker")
        if size > self.num_devices:
            raise ValueError(f"size={size}: the cluster {self.name!r} has only "
                             f"{self.num_devices} devices ({self.num_nodes} x "
                             f"{self.devices_per_node}); use a smaller group or a bigger cluster")
        fewest = -(-size // self.devices_per_node)
        if nodes is None:
            nodes = fewest
        check_count("nodes", nodes, "a group lies on at least one node")
        most = min(size, self.num_nodes)
        if not fewest <= nodes <= most:
            raise ValueError(f"nodes={nodes}: a group of {size} on {self.name!r} lies on "
                             f"{fewest} to {most} nodes")
        return MeshAxis(name, size, nodes, self.intra if nodes == 1 else self.inter)

    def mesh(self, rows: int = 1, cols: int | None = None, experts: bool = False) -> Any:
        """The ``rows`` x ``cols`` device mesh on this cluster (``cols``: the devices / rows),
        a ``tapas.planning.devicemesh.Mesh`` with a ``data`` axis over the rows and a
        ``model`` axis in a row, each with its link; ``mesh()`` is the 1-D mesh."""
        from tapas.planning.devicemesh import Mesh
        check_count("rows", rows, "a mesh has at least one row")
        return Mesh(rows, self.num_devices // rows if cols is None else cols, experts, self)

    def with_shape(self, num_nodes: int, devices_per_node: int) -> Cluster:
        """The same hardware with another shape."""
        return dataclasses.replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node,
                                   name=_shape_name(self.name, num_nodes, devices_per_node))

    # ---- the cluster file -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The cluster as the JSON object ``save`` writes (``tapas.planning.cluster_file``)."""
        from tapas.planning import cluster_file
        return cluster_file.to_json(self)

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> None:
        """Write the cluster to ``path`` as JSON; ``extra`` adds keys that ``load`` skips
        (``tapas profile`` stores its measurements under ``"profile"``)."""
        from tapas.planning import cluster_file
        cluster_file.save(self, path, extra)

    @classmethod
    def from_json(cls, d: Any, where: str = "cluster JSON", *, older_layout: bool = False
                  ) -> Cluster:
        """A ``to_json`` object's cluster (ClusterFileError names ``where`` and the field);
        ``older_layout``: also old strategy files'."""
        from tapas.planning import cluster_file
        return cluster_file.from_json(d, where, older_layout)

    @classmethod
    def load(cls, path: str) -> Cluster:
        """Read a cluster file written by ``save`` (or ``tapas profile``)."""
        from tapas.planning import cluster_file
        return cluster_file.load(path)

    @classmethod
    def resolve(cls, spec: str, num_nodes: int | None = None,
                devices_per_node: int | None = None) -> Cluster:
        """A preset name (``CLUSTER_PRESETS``) or the path of a cluster file; shaped
        ``num_nodes`` x ``devices_per_node`` (a file keeps its own shape where one is None,
        a preset takes 1 x 8). The ``--cluster`` flag of ``tapas search`` and ``train``."""
        if spec in CLUSTER_PRESETS:
            return cls.preset(spec, 1 if num_nodes is None else num_nodes,
                              8 if devices_per_node is None else devices_per_node)
        if not (spec.endswith(".json") or os.path.exists(spec)):
            raise ValueError(f"cluster {spec!r} is neither a preset ({sorted(CLUSTER_PRESETS)}) "
                             "nor a cluster file (.json): give a preset name or the path "
                             "`tapas profile --out=...` wrote")
        cluster = cls.load(spec)
        m = cluster.num_nodes if num_nodes is None else num_nodes
        n = cluster.devices_per_node if devices_per_node is None else devices_per_node
        if (m, n) == (cluster.num_nodes, cluster.devices_per_node):
            return cluster
        return cluster.with_shape(m, n)

    # ---- presets --------------------------------------------------------------------------

    @classmethod
    def single_node(cls, devices: int, like: Cluster | None = None) -> Cluster:
        """One machine with ``devices`` devices, hardware as ``like`` (default: V100 node)."""
        check_count("devices", devices, "a machine needs at least one device")
        return (like or cls.v100_ethernet()).with_shape(1, devices)

    @classmethod
    def v100_ethernet(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """The paper's cluster (section 5.1): V100 SXM2 32 GB, NVLink2 in a node, 100 Gb/s
        Ethernet between nodes."""
        return cls.gpu("v100", num_nodes, devices_per_node, "v100-ethernet")

    @classmethod
    def gpu(cls, preset: str, num_nodes: int = 1, devices_per_node: int = 8,
            name: str | None = None) -> Cluster:
        """Nodes of the GPU ``preset`` (``tapas.planning.hardware.GPU_PRESETS``: ``"v100"``,
        ``"a100"``, ``"h100"``), every constant with its source."""
        if preset not in GPU_PRESETS:
            raise ValueError(f"GPU preset {preset!r} is unknown: use one of "
                             f"{sorted(GPU_PRESETS)}")
        hw = GPU_PRESETS[preset]
        return cls(
            name=_shape_name(name or preset, num_nodes, devices_per_node),
            num_nodes=num_nodes, devices_per_node=devices_per_node,
            intra=Link(*hw.intra), inter=Link(*hw.inter), device_memory=hw.device_memory,
            device_peak_flops=hw.device_peak_flops, sources=hw.sources,
            device_peak_flops_by_dtype=hw.peak_flops_by_dtype)

    @classmethod
    def loopback_cpu(cls, devices: int = 4) -> Cluster:
        """``devices`` logical CPU devices on one machine, as MirroredStrategy runs them here.

        Constants measured by benchmarks/measure_collectives.py (all-reduce fit, 4 devices);
        the devices share the cores, so this is for tests and ranking on this machine only.
        """
        return cls(
            name=f"loopback-cpu-{devices}",
            num_nodes=1, devices_per_node=devices,
            intra=Link(bandwidth=LOOPBACK_BANDWIDTH, latency=LOOPBACK_LATENCY, name="loopback"),
            inter=Link(bandwidth=LOOPBACK_BANDWIDTH, latency=LOOPBACK_LATENCY, name="loopback"),
            device_memory=LOOPBACK_MEMORY, device_peak_flops=LOOPBACK_FLOPS,
            sources=LOOPBACK_SOURCES)

    @classmethod
    def preset(cls, name: str, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """A named cluster of ``num_nodes`` x ``devices_per_node`` devices: ``"v100"`` (the
        paper's V100 nodes on 100 Gb/s Ethernet), ``"a100"`` / ``"h100"`` (DGX-style SXM
        nodes on InfiniBand) or ``"cpu"`` (this machine's logical CPU devices, measured
        constants). The ``--cluster`` flag of ``tapas search``/``train``."""
        if name not in CLUSTER_PRESETS:
            raise ValueError(f"cluster preset {name!r} is unknown: use one of "
                             f"{sorted(CLUSTER_PRESETS)}")
        return CLUSTER_PRESETS[name]().with_shape(num_nodes, devices_per_node)


def _shape_name(base: str, num_nodes: int, devices_per_node: int) -> str:
    base = base.split("/")[0]
    return f"{base}/{num_nodes}x{devices_per_node}"


# preset name -> a Cluster of that hardware (its shape is set by Cluster.preset)
CLUSTER_PRESETS: Mapping[str, Callable[[], Cluster]] = types.MappingProxyType({
    "v100": lambda: Cluster.v100_ethernet(1, 8),
    "a100": lambda: Cluster.gpu("a100"),
    "h100": lambda: Cluster.gpu("h100"),
    "cpu": lambda: Cluster.loopback_cpu(4),
})
