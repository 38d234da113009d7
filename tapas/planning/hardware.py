"""The constants of the cluster presets, each with where it comes from.

In:  nothing (published datasheets, NCCL's latency model, this machine's measurements).
Out: ``GPU_PRESETS`` (name -> :class:`GpuNode`: the links inside and between nodes, one
     device's memory, its float32 peak and its peaks in other dtypes, and ``sources``, one
     line per constant under the keys ``tapas.planning.cluster.SOURCE_KEYS`` and
     ``device_peak_flops.<dtype>``), the loopback CPU constants (``LOOPBACK_*``) and
     ``PEAK_DTYPES``, the dtypes a cluster may carry a peak for besides float32, and
     :func:`peaks_by_dtype`, which checks such a table.

``tapas.planning.cluster.Cluster`` builds its presets from these. This module imports
nothing of TAPAS and no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

__all__ = ["PEAK_DTYPES", "peaks_by_dtype", "GpuNode", "GPU_PRESETS", "LOOPBACK_DATE",
           "LOOPBACK_LATENCY", "LOOPBACK_BANDWIDTH", "LOOPBACK_FLOPS", "LOOPBACK_MEMORY",
           "LOOPBACK_SOURCES"]

# the dtypes ``Cluster.device_peak_flops_by_dtype`` may name (float32 is
# ``device_peak_flops`` itself)
PEAK_DTYPES = ("float16", "bfloat16", "float64")



def peaks_by_dtype(table: object) -> dict[str, float]:
    """``{dtype: FLOP/s}`` checked: each dtype one of ``PEAK_DTYPES``, each rate a positive,
    finite number (TypeError or ValueError naming the entry otherwise)."""
    if not isinstance(table, Mapping):
        raise TypeError(f"device_peak_flops_by_dtype={table!r}: must be a mapping "
                        "{dtype: FLOP/s}, e.g. {'float16': 125e12}, or None")
    out: dict[str, float] = {}
    for dtype, rate in table.items():
        if dtype not in PEAK_DTYPES:
            fix = ("float32's peak is device_peak_flops" if dtype == "float32"
                   else f"use one of {list(PEAK_DTYPES)}")
            raise ValueError(f"device_peak_flops_by_dtype has dtype {dtype!r}: {fix}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or \
                not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"device_peak_flops_by_dtype[{dtype!r}]={rate!r}: must be a "
                             "positive, finite number of FLOP/s, e.g. 125e12 for a V100's "
                             "float16 tensor cores")
        out[dtype] = float(rate)
    return out


_NCCL_RING = "NCCL src/graph/tuning.cc hwLat, {link}, Ring/Simple protocol: {us} us per ring hop"


@dataclasses.dataclass(frozen=True)
class GpuNode:
    """One GPU preset's constants: links as ``(bandwidth bytes/s, latency s, name)``."""

    intra: tuple[float, float, str]
    inter: tuple[float, float, str]
    device_memory: float
    device_peak_flops: float
    peak_flops_by_dtype: Mapping[str, float]
    sources: Mapping[str, str]


V100 = GpuNode(
    intra=(150e9, 3.4e-6, "nvlink2"), inter=(100e9 / 8, 9.6e-6, "ethernet-100g"),
    device_memory=32 * 2**30, device_peak_flops=15.7e12,
    peak_flops_by_dtype=types.MappingProxyType({"float16": 125e12}),
    sources=types.MappingProxyType({
        "intra.bandwidth": "NVIDIA Tesla V100 datasheet: NVLink2 300 GB/s aggregate "
                           "bidirectional (6 links x 25 GB/s per direction); a ring sends "
                           "one way: 150 GB/s",
        "intra.latency": _NCCL_RING.format(link="NVLink", us=3.4),
        "inter.bandwidth": "paper section 5.1: nodes interconnected by 100 Gb/s Ethernet = "
                           "12.5 GB/s",
        "inter.latency": _NCCL_RING.format(link="network", us=9.6),
        "device_memory": "NVIDIA Tesla V100 SXM2 32 GB datasheet: 32 GB HBM2 (taken as "
                         "32 GiB)",
        "device_peak_flops": "NVIDIA Tesla V100 SXM2 datasheet: 15.7 TFLOP/s single "
                             "precision",
        "device_peak_flops.float16": "NVIDIA Tesla V100 SXM2 datasheet: 125 TFLOP/s tensor "
                                     "performance (float16 tensor cores); Volta's tensor "
                                     "cores have no bfloat16, so bfloat16 is priced at "
                                     "device_peak_flops",
    }))

A100 = GpuNode(
    intra=(300e9, 3.4e-6, "nvlink3"), inter=(200e9 / 8, 9.6e-6, "infiniband-hdr-200g"),
    device_memory=80e9, device_peak_flops=19.5e12,
    peak_flops_by_dtype=types.MappingProxyType({"float16": 312e12, "bfloat16": 312e12}),
    sources=types.MappingProxyType({
        "intra.bandwidth": "NVIDIA A100 datasheet (SXM): NVLink 600 GB/s aggregate "
                           "bidirectional (12 third-generation links); a ring sends one "
                           "way: 300 GB/s",
        "intra.latency": _NCCL_RING.format(link="NVLink", us=3.4) + " (as the v100 preset: "
                         "NCCL's table is per link type, not per GPU)",
        "inter.bandwidth": "NVIDIA DGX A100 datasheet: one 200 Gb/s HDR InfiniBand "
                           "ConnectX-6 port per GPU = 25 GB/s for one ring (NCCL may run "
                           "one ring per port, 8 per node; not modelled)",
        "inter.latency": _NCCL_RING.format(link="network", us=9.6) + " (as the v100 preset)",
        "device_memory": "NVIDIA A100 80GB SXM datasheet: 80 GB HBM2e (taken as 80e9 bytes)",
        "device_peak_flops": "NVIDIA A100 datasheet (SXM): 19.5 TFLOP/s FP32 without tensor "
                             "cores (TensorFlow runs float32 matmuls as TF32 on Ampere by "
                             "default, 156 TFLOP/s dense; not priced here)",
        "device_peak_flops.float16": "NVIDIA A100 datasheet (SXM): 312 TFLOP/s FP16 tensor "
                                     "cores, dense (624 with sparsity)",
        "device_peak_flops.bfloat16": "NVIDIA A100 datasheet (SXM): 312 TFLOP/s BF16 tensor "
                                      "cores, dense (624 with sparsity)",
    }))

H100 = GpuNode(
    intra=(450e9, 3.4e-6, "nvlink4"), inter=(400e9 / 8, 9.6e-6, "infiniband-ndr-400g"),
    device_memory=80e9, device_peak_flops=67e12,
    peak_flops_by_dtype=types.MappingProxyType({"float16": 989e12, "bfloat16": 989e12}),
    sources=types.MappingProxyType({
        "intra.bandwidth": "NVIDIA H100 datasheet (SXM): NVLink 900 GB/s aggregate "
                           "bidirectional (18 fourth-generation links); a ring sends one "
                           "way: 450 GB/s",
        "intra.latency": _NCCL_RING.format(link="NVLink", us=3.4) + " (as the v100 preset: "
                         "NCCL's table is per link type, not per GPU)",
        "inter.bandwidth": "NVIDIA DGX H100 datasheet: one 400 Gb/s ConnectX-7 port per "
                           "GPU = 50 GB/s for one ring (NCCL may run one ring per port, 8 "
                           "per node; not modelled)",
        "inter.latency": _NCCL_RING.format(link="network", us=9.6) + " (as the v100 preset)",
        "device_memory": "NVIDIA H100 datasheet (SXM): 80 GB HBM3 (taken as 80e9 bytes)",
        "device_peak_flops": "NVIDIA H100 datasheet (SXM): 67 TFLOP/s FP32 without tensor "
                             "cores (TensorFlow runs float32 matmuls as TF32 by default, "
                             "495 TFLOP/s dense; not priced here)",
        "device_peak_flops.float16": "NVIDIA H100 datasheet (SXM): 1979 TFLOP/s FP16 tensor "
                                     "cores with sparsity, 989 dense",
        "device_peak_flops.bfloat16": "NVIDIA H100 datasheet (SXM): 1979 TFLOP/s BF16 tensor "
                                      "cores with sparsity, 989 dense",
    }))

# preset name -> its constants (the shape comes from Cluster.preset)
GPU_PRESETS: Mapping[str, GpuNode] = types.MappingProxyType(
    {"v100": V100, "a100": A100, "h100": H100})

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
