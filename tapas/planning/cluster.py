"""The cluster S(m, n): its devices, the links between them and the named presets.

In:  a shape (``num_nodes`` nodes of ``devices_per_node`` devices), two ``Link``s (inside a
     node and between nodes, bandwidth in bytes/s and latency in s per hop), the memory and
     peak FLOP/s of one device, and where each constant comes from.
Out: a frozen ``Cluster``: its ``num_devices`` (the 1-D mesh the search shards over), the
     ``Group`` a collective of W workers runs on (and so the link its ring pays), and the
     presets ``Cluster.v100_ethernet`` (the paper's cluster), ``Cluster.loopback_cpu`` (this
     machine's logical CPU devices, measured) and ``Cluster.preset(name, m, n)`` by name
     (``CLUSTER_PRESETS``, the ``--cluster`` flag).

A group inside one node pays the intra-node link; one that spans nodes pays the inter-node
link (a ring is as slow as its slowest hop). ``tapas.planning.cost`` prices collectives on it.

>>> c = Cluster.v100_ethernet(num_nodes=2, devices_per_node=4)
>>> c.name, c.num_devices, c.group(4).link.name, c.group(8).link.name
('v100-ethernet/2x4', 8, 'nvlink2', 'ethernet-100g')

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping

__all__ = ["Link", "Group", "Cluster", "SOURCE_KEYS", "CLUSTER_PRESETS", "check_count",
           "check_positive"]


def check_count(name: str, value: object, why: str) -> None:
    """Raise unless ``value`` is an int >= 1 (``why``: what the count is for)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int ({why})")
    if value < 1:
        raise ValueError(f"{name}={value}: must be at least 1 ({why})")


def check_positive(name: str, value: object, unit: str, fix: str) -> None:
    """Raise unless ``value`` is a positive, finite number of ``unit`` (``fix``: an example)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a number of {unit}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value}: must be a positive, finite number of {unit}; {fix}")


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
class Group:
    """A group of ``size`` workers placed on ``nodes`` nodes, and the link its ring pays."""

    size: int
    nodes: int
    link: Link

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


# the constants each Cluster documents in ``sources``
SOURCE_KEYS = ("intra.bandwidth", "intra.latency", "inter.bandwidth", "inter.latency",
               "device_memory", "device_peak_flops")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """S(m, n): ``num_nodes`` nodes of ``devices_per_node`` devices each.

    ``intra`` links devices inside a node, ``inter`` links nodes. ``device_memory`` is bytes per
    device, ``device_peak_flops`` FLOP/s per device. ``sources`` says where each constant comes
    from (keys: ``SOURCE_KEYS``; a missing one reads "unspecified").
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
        unknown = sorted(set(self.sources) - set(SOURCE_KEYS))
        if unknown:
            raise ValueError(f"sources has unknown keys {unknown}: use {list(SOURCE_KEYS)}")
        object.__setattr__(self, "sources", types.MappingProxyType(dict(self.sources)))

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def source(self, key: str) -> str:
        """Where the constant ``key`` (one of ``SOURCE_KEYS``) comes from."""
        if key not in SOURCE_KEYS:
            raise KeyError(f"{key!r} is not a cluster constant: use one of {list(SOURCE_KEYS)}")
        return self.sources.get(key, "unspecified")

    def group(self, size: int, nodes: int | None = None) -> Group:
        """The group of ``size`` workers, filling a node before the next (or over ``nodes``).

        A group inside one node pays ``intra``; one that spans nodes pays ``inter``.
        """
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
        return Group(size=size, nodes=nodes, link=self.intra if nodes == 1 else self.inter)

    def with_shape(self, num_nodes: int, devices_per_node: int) -> Cluster:
        """The same hardware with another shape."""
        return dataclasses.replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node,
                                   name=_shape_name(self.name, num_nodes, devices_per_node))

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
        return cls(
            name=_shape_name("v100-ethernet", num_nodes, devices_per_node),
            num_nodes=num_nodes, devices_per_node=devices_per_node,
            intra=Link(bandwidth=150e9, latency=3.4e-6, name="nvlink2"),
            inter=Link(bandwidth=100e9 / 8, latency=9.6e-6, name="ethernet-100g"),
            device_memory=32 * 2**30, device_peak_flops=15.7e12,
            sources=V100_SOURCES)

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
        paper's V100 nodes on 100 Gb/s Ethernet) or ``"cpu"`` (this machine's logical CPU
        devices, measured constants). The ``--cluster`` flag of ``tapas search``/``train``."""
        if name not in CLUSTER_PRESETS:
            raise ValueError(f"cluster preset {name!r} is unknown: use one of "
                             f"{sorted(CLUSTER_PRESETS)}")
        return CLUSTER_PRESETS[name]().with_shape(num_nodes, devices_per_node)


def _shape_name(base: str, num_nodes: int, devices_per_node: int) -> str:
    base = base.split("/")[0]
    return f"{base}/{num_nodes}x{devices_per_node}"


V100_SOURCES: Mapping[str, str] = types.MappingProxyType({
    "intra.bandwidth": "NVIDIA Tesla V100 datasheet: NVLink2 300 GB/s aggregate bidirectional "
                       "(6 links x 25 GB/s per direction); a ring sends one way: 150 GB/s",
    "intra.latency": "NCCL src/graph/tuning.cc hwLat, NVLink, Ring/Simple protocol: "
                     "3.4 us per ring hop",
    "inter.bandwidth": "paper section 5.1: nodes interconnected by 100 Gb/s Ethernet = 12.5 GB/s",
    "inter.latency": "NCCL src/graph/tuning.cc hwLat, network, Ring/Simple protocol: "
                     "9.6 us per ring hop",
    "device_memory": "NVIDIA Tesla V100 SXM2 32 GB datasheet: 32 GB HBM2 (taken as 32 GiB)",
    "device_peak_flops": "NVIDIA Tesla V100 SXM2 datasheet: 15.7 TFLOP/s single precision",
})

# Measured by benchmarks/measure_collectives.py --devices=4 on this development machine
# (2 cores, 24 GiB, tensorflow-cpu 2.21); JSON: benchmarks/results/collectives_cpu.json.
LOOPBACK_DATE = "2026-11-22"
LOOPBACK_LATENCY = 5.0e-4       # alpha' = all-reduce intercept / W, s per worker
LOOPBACK_BANDWIDTH = 3.75e8     # 1 / beta of the all-reduce fit, bytes/s (ring bytes)
LOOPBACK_FLOPS = 3.6e10         # float32 matmul on one logical device, FLOP/s
LOOPBACK_MEMORY = 24 * 2**30    # the machine's RAM, shared by all logical devices
_MEASURED = f"measured by benchmarks/measure_collectives.py on {LOOPBACK_DATE}"
LOOPBACK_SOURCES: Mapping[str, str] = types.MappingProxyType({
    "intra.bandwidth": f"{_MEASURED} (all-reduce slope, 4 logical CPU devices)",
    "intra.latency": f"{_MEASURED} (all-reduce intercept / W; mostly tf.function dispatch)",
    "inter.bandwidth": "no second node: same as intra",
    "inter.latency": "no second node: same as intra",
    "device_memory": "this machine's 24 GiB RAM, shared by all logical devices",
    "device_peak_flops": f"{_MEASURED} (2048^2 float32 matmul, one logical device)",
})


# preset name -> a Cluster of that hardware (its shape is set by Cluster.preset)
CLUSTER_PRESETS: Mapping[str, Callable[[], Cluster]] = types.MappingProxyType({
    "v100": lambda: Cluster.v100_ethernet(1, 8),
    "cpu": lambda: Cluster.loopback_cpu(4),
})
