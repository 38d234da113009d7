"""Measured training-step times of the kernels patterns run (``CostOptions.kernel_times``).

In:  ``{kernel key: seconds}`` as
     ``tapas.execution.calibration.kernels.measure_kernels`` measures them
     (``tapas.sharding.patterns.kernels.kernel_key``: an op's type, dtype, local operand
     shapes and attributes), or the JSON file it writes.
Out: :class:`KernelTimes` -- the lookup the cost model prices a pattern's contractions and
     convolutions with (``tapas.planning.cost.compute_time``), :func:`priced`, and
     ``save`` / ``load``.

A kernel's time is its training step on one device while every device runs its own copy
at once (the devices of a step compute together; logical CPU devices share the cores):
the forward op and the gradients of each of its floating-point operands. What the cost
model counts for such an op without a measurement (its FLOPs at the profiled rate of its
width, a depthwise convolution's elements at the elementwise rate, times
``1 + backward_flops_factor``) is replaced by that time; ops without one keep the rates.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["KernelTimes", "priced", "graph_kernels"]


@dataclasses.dataclass(frozen=True, eq=False)
class KernelTimes:
    """Seconds of each measured kernel's training step, per device (``seconds``), on
    ``num_devices`` devices at once; ``failed``: keys that could not be measured and why
    (they are priced at the rates)."""

    seconds: Mapping[str, float]
    num_devices: int
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        for key, t in self.seconds.items():
            if isinstance(t, bool) or not isinstance(t, (int, float)) or \
                    not math.isfinite(t) or t < 0:
                raise ValueError(f"kernel time {t!r} of {key}: must be a finite number of "
                                 "seconds >= 0")
        object.__setattr__(self, "seconds", types.MappingProxyType(
            {k: float(v) for k, v in self.seconds.items()}))
        object.__setattr__(self, "failed", types.MappingProxyType(dict(self.failed)))

    def __len__(self) -> int:
        return len(self.seconds)

    def get(self, key: str) -> float | None:
        return self.seconds.get(key)

    def to_json(self) -> dict[str, Any]:
        return {"num_devices": self.num_devices, "source": self.source,
                "seconds": dict(self.seconds), "failed": dict(self.failed)}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> KernelTimes:
        return KernelTimes(dict(d["seconds"]), int(d["num_devices"]), dict(d.get("failed", {})),
                           str(d.get("source", "")))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @staticmethod
    def load(path: str) -> KernelTimes:
        with open(path) as f:
            return KernelTimes.from_json(json.load(f))


def priced(uses: Sequence[Any], times: KernelTimes | None, dense_flops: float,
           dense_by_width: Mapping[int, float] | None, elements: float
           ) -> tuple[float, float, dict[int, float], float]:
    """Split a pattern's work into what ``times`` measured and what the rates price:
    ``(measured seconds, dense_flops, dense_by_width, elements)`` with the measured kernels'
    FLOPs and elements taken out of the rate-priced counts (``uses``: the pattern's
    ``KernelUse`` s)."""
    by_width = dict(dense_by_width or {})
    if times is None or not uses:
        return 0.0, dense_flops, by_width, elements
    measured = 0.0
    for u in uses:
        t = times.get(u.key)
        if t is None:
            continue
        measured += u.count * t
        dense_flops -= u.count * u.dense_flops
        if u.width is not None and u.width in by_width:
            by_width[u.width] = max(by_width[u.width] - u.count * u.dense_flops, 0.0)
        elements -= u.count * u.elements
    return measured, max(dense_flops, 0.0), by_width, max(elements, 0.0)


def graph_kernels(graph: Any, num_devices: int, patterns_fn: Any = None) -> dict[str, int]:
    """Every kernel key the patterns of ``graph``'s GraphNodes on ``num_devices`` devices
    run, with how many (GraphNode, pattern) pairs run it: what
    ``tapas.execution.calibration.kernels.measure_kernels`` has to time for a search of this graph.
    ``patterns_fn`` as ``tapas.planning.table.pattern_table`` takes it (default: every
    valid pattern, ``tapas.sharding.patterns.patterns_for``)."""
    if patterns_fn is None:
        from tapas.sharding.patterns import patterns_for as patterns_fn
    seen: dict[str, list[Any]] = {}
    for node in graph.nodes:
        seen.setdefault(node.signature or f"#{node.id}", []).append(node)
    out: dict[str, int] = {}
    for nodes in seen.values():
        for p in patterns_fn(nodes[0], graph, num_devices):
            for u in getattr(p, "kernels", ()):
                out[u.key] = out.get(u.key, 0) + len(nodes)
    return dict(sorted(out.items()))
