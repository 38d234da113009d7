"""Compute rates: how fast a matrix multiply of a given width runs against the peak.

In:  a table ``{width (a power of two): fraction of the peak FLOP rate}`` (measured by
     ``tapas profile``) and FLOPs bucketed by width (``ShardingPattern.dense_by_width``).
Out: the fraction a width reaches (:func:`width_efficiency`), FLOPs in peak-rate FLOPs
     (:func:`effective_flops`), the table checked (:func:`check_width_efficiency`), and the
     positive-number check every cluster constant uses (:func:`check_positive`).
Raises: TypeError / ValueError naming the value and the constraint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["check_positive", "check_width_efficiency", "effective_flops", "width_efficiency"]


def check_positive(name: str, value: object, unit: str, fix: str) -> None:
    """Raise unless ``value`` is a positive, finite number of ``unit`` (``fix``: an example)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a number of {unit}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value}: must be a positive, finite number of {unit}; {fix}")


def width_efficiency(table: Mapping[int, float], width: int) -> float:
    """The fraction of the peak FLOP rate that a matrix multiply in width bucket ``width``
    (the power of two at or below its width, as ``ShardingPattern.dense_by_width`` keys it)
    reaches, by ``table`` (measured width -> fraction): read at the bucket's middle
    (``width * sqrt(2)``), interpolated linearly in log2(width) between the measured widths
    and held at the nearest one outside them."""
    at = math.log2(max(width, 1)) + 0.5
    keys = sorted(table)
    if at <= math.log2(keys[0]):
        return table[keys[0]]
    for k0, k1 in zip(keys, keys[1:]):
        x0, x1 = math.log2(k0), math.log2(k1)
        if at <= x1:
            return table[k0] + (at - x0) / (x1 - x0) * (table[k1] - table[k0])
    return table[keys[-1]]


def effective_flops(dense_flops: float, dense_by_width: Mapping[int, float] | None,
                    table: Mapping[int, float] | None) -> float:
    """``dense_flops`` in peak-rate FLOPs: each width bucket's FLOPs (``dense_by_width``)
    divided by its :func:`width_efficiency` under ``table``, the rest as they are (all of
    it without a table or buckets). Seconds are this over ``device_peak_flops``.

    >>> effective_flops(300.0, {8: 100.0, 128: 100.0}, {16: 0.5, 128: 1.0})
    400.0
    """
    if not table or not dense_by_width:
        return float(dense_flops)
    bucketed = math.fsum(dense_by_width.values())
    return (math.fsum(f / width_efficiency(table, w) for w, f in dense_by_width.items())
            + max(float(dense_flops) - bucketed, 0.0))


def check_width_efficiency(table: Mapping[Any, Any]) -> dict[int, float]:
    """``{width: fraction}`` checked: each width a power of two >= 1 (an int or its string,
    as JSON keys are), each fraction a positive finite number."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"device_width_efficiency={table!r}: must be a non-empty mapping "
                         "{width (a power of two): fraction of device_peak_flops}, or None")
    out: dict[int, float] = {}
    for key, value in table.items():
        try:
            width = int(key)
        except (TypeError, ValueError):
            width = 0
        if width < 1 or width & (width - 1) or isinstance(key, bool):
            raise ValueError(f"device_width_efficiency has width {key!r}: widths are powers "
                             "of two >= 1 (1, 2, 4, ...)")
        check_positive(f"device_width_efficiency[{width}]", value, "(a fraction of "
                       "device_peak_flops)", "e.g. 0.5")
        out[width] = float(value)
    return dict(sorted(out.items()))
