"""The kernels a pattern runs on one device, named so that their time can be measured.

In:  an op with a contraction, dense-convolution or depthwise-convolution rule and the local
     shapes of its operands on one device under a pattern.
Out: :func:`kernel_key` -- one string that names the kernel a device runs for that op (its
     type, dtype, local operand shapes and attributes), or None when a shape is unknown;
     :func:`parse_kernel_key`, its parts again; :class:`KernelUse`, how often a pattern runs
     a kernel and what the rate-based cost model counts for one run of it.

Why: the cost model prices these ops by FLOPs (or elements) at a profiled rate, and the
rate of a kernel depends on its shapes far beyond what a width table captures
(``docs/cost.md``, "Measured kernels"). A key identifies exactly the computation a device does, so
``tapas.execution.calibration.kernels`` can time each one on the devices (forward and both
gradients) and ``tapas.planning.cost.compute_time`` can price it by its measured time instead
(``CostOptions.kernel_times``, ``"K"`` in ``docs/cost.md``).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tapas.ir import OpInfo

__all__ = ["KERNEL_KINDS", "KernelUse", "kernel_key", "parse_kernel_key"]

# the flops kinds of ops whose kernels are keyed (``OpSpec.flops``)
KERNEL_KINDS = frozenset({"contract", "conv", "depthwise"})
# attributes that are not part of what a kernel computes on given operands: the dtype
# attributes (the key has the dtype), a GPU hint
_SKIP = frozenset({"T", "Ta", "Tb", "N", "use_cudnn_on_gpu"})


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """A kernel a pattern runs ``count`` times per step, and what the rate-based model
    counts for one run: its forward ``dense_flops`` (in ``width``'s bucket, None when not
    bucketed) and ``elements`` (a depthwise convolution's)."""

    key: str
    count: int
    dense_flops: float
    width: int | None
    elements: float

    def times(self, count: int) -> KernelUse:
        return dataclasses.replace(self, count=count)


def kernel_key(op: OpInfo, shapes: Sequence[Sequence[int] | None]) -> str | None:
    """The key of the kernel ``op`` runs on operands of local ``shapes``; None when a shape
    or the output dtype is unknown.

    >>> from tapas.ir import OpInfo, TensorInfo
    >>> op = OpInfo("mm", "MatMul", ("x", "w"), (TensorInfo("y", (8, 4), "float32"),),
    ...             {"T": "float32", "transpose_a": False, "transpose_b": False})
    >>> key = kernel_key(op, [(8, 16), (16, 4)])
    >>> key[:50]
    '{"attrs":{"transpose_a":false,"transpose_b":false}'
    >>> parse_kernel_key(key)["shapes"]
    [[8, 16], [16, 4]]
    """
    if not op.outputs or not op.outputs[0].dtype:
        return None
    out = []
    for s in shapes:
        if s is None or any(d is None or int(d) < 0 for d in s):
            return None
        out.append([int(d) for d in s])
    attrs = {k: v for k, v in op.attrs.items() if k not in _SKIP}
    return json.dumps({"op": op.type, "dtype": op.outputs[0].dtype, "shapes": out,
                       "attrs": attrs}, sort_keys=True, separators=(",", ":"))


def parse_kernel_key(key: str) -> Mapping[str, Any]:
    """``{"op", "dtype", "shapes", "attrs"}`` of a :func:`kernel_key`."""
    d = json.loads(key)
    if not isinstance(d, dict) or {"op", "dtype", "shapes", "attrs"} - set(d):
        raise ValueError(f"{key!r} is not a kernel key (tapas.sharding.patterns."
                         "kernels.kernel_key makes them)")
    return d
