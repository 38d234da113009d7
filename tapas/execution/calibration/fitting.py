"""Fitting the cost model's constants to measured collective times (pure numpy, no TF).

In:  rows of measurements, one per (primitive, message size): the primitive, the message
     size N in bytes as the cost model defines it (``tapas.planning.cost``: the largest
     per-worker tensor the collective touches), the group size W and the measured seconds
     of one collective; optionally compute rates and overlap timings.
Out: a :class:`LinearFit` per primitive (``t = intercept + slope * x`` with
     ``x = ring_factor(k, W) * N``, the cost model's ring bytes), R^2 and residuals, the
     cost model's constants derived from them (:func:`fit_collectives`: alpha' per worker,
     beta, epsilon relative to all-reduce), gamma from overlap timings (:func:`fit_gamma`),
     the two compute rates from training steps of reference blocks (:func:`fit_compute`)
     and a profiled :class:`tapas.planning.cluster.Cluster` (:func:`profiled_cluster`);
     :class:`Profile`, what ``tapas profile``
     (``tapas.execution.calibration.profiling``, the TensorFlow
     side) returns: its table, the cluster file and the residual plot (matplotlib, when
     installed); :func:`parse_sizes` for ``--sizes``.

The fit minimises the *relative* error, sum(((a + b x - t) / t)^2): message sizes span
several decades, and with plain least squares the largest sizes alone would set both
constants (the intercept would be a residual of the slope). With relative weights every
size counts the same: the small sizes pin the intercept, the large ones the slope. A
negative intercept (latency below the noise) is refitted through the origin and marked
``clamped``; a non-positive slope is an error (no bandwidth can be derived).

R^2 is reported on the seconds themselves, 1 - SS_res / SS_tot, and, since the fit weighs
sizes evenly, also on the relative scale (``r2_log``: R^2 of log t against log of the fitted
t, which shows whether the small sizes fit too).

>>> x = [1e3, 1e4, 1e5, 1e6, 1e7]
>>> fit = fit_linear(x, [2e-3 + 3e-9 * v for v in x])
>>> round(fit.intercept * 1e3, 6), round(fit.slope * 1e9, 6), round(fit.r2, 6)
(2.0, 3.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tapas.planning.cluster import Cluster, Link
from tapas.planning.cost import DEFAULT_GAMMA, ring_factor
from tapas.sharding.placements import Collective

__all__ = ["LinearFit", "fit_linear", "CollectiveFit", "fit_collectives", "GammaFit",
           "fit_gamma", "ComputeFit", "fit_compute", "profiled_cluster", "FitError", "Profile",
           "parse_sizes"]

KIB, MIB = 1024, 1024 * 1024
_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": 1024 * MIB, "gb": 1024 * MIB, "gib": 1024 * MIB}


class FitError(ValueError):
    """The measurements cannot give the constant asked for (the message says why and what to
    measure instead)."""


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """``t = intercept + slope * x`` fitted to ``points`` (x, t)."""

    intercept: float
    slope: float
    r2: float                 # on seconds: 1 - SS_res / SS_tot
    r2_log: float             # on log seconds (every size weighs the same)
    points: tuple[tuple[float, float], ...]
    clamped: bool = False     # the intercept came out negative and was set to 0

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x

    @property
    def relative_residuals(self) -> tuple[float, ...]:
        """(measured - fitted) / fitted, per point."""
        return tuple((t - self.predict(x)) / self.predict(x) for x, t in self.points)

    @property
    def max_relative_residual(self) -> float:
        return max((abs(r) for r in self.relative_residuals), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"intercept_s": self.intercept, "slope_s_per_byte": self.slope, "r2": self.r2,
                "r2_log": self.r2_log, "clamped": self.clamped,
                "max_relative_residual": self.max_relative_residual,
                "points": [list(p) for p in self.points]}


def _r2(measured: np.ndarray, fitted: np.ndarray) -> float:
    ss_res = float(np.sum((measured - fitted) ** 2))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    if ss_tot == 0.0:
        return 1.0 if ss_res == 0.0 else 0.0
    return 1.0 - ss_res / ss_tot


def _relative_fit(columns: Sequence[np.ndarray], t: np.ndarray,
                  what: str) -> tuple[np.ndarray, bool]:
    """Least squares of ``t = c + sum_i k_i columns[i]`` on relative error (weights 1 / t);
    a negative ``c`` is refitted through the origin. The coefficients (``c`` first) and
    whether ``c`` was clamped to 0. Raises :class:`FitError` on a time that is not
    positive and finite (``what`` names the times)."""
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        bad = [float(v) for v in t if not (math.isfinite(v) and v > 0)]
        raise FitError(f"{what} {bad}: every measured time must be positive and finite; "
                       "measure again with more repeats (the machine may be overloaded)")
    w = 1.0 / t
    design = np.stack([np.ones_like(t), *columns], axis=1) * w[:, None]
    coef, *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if coef[0] >= 0:
        return coef, False
    rest, *_ = np.linalg.lstsq(design[:, 1:], t * w, rcond=None)
    return np.concatenate([[0.0], rest]), True


def fit_linear(xs: Sequence[float], ts: Sequence[float]) -> LinearFit:
    """Least squares of ``t = a + b x`` on relative error (module docstring).

    Needs at least two distinct x and positive, finite t; raises :class:`FitError` when the
    slope is not positive (times that do not grow with the message size).
    """
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(ts, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise FitError(f"{len(xs)} sizes but {len(ts)} times: give one time per size")
    if len(np.unique(x)) < 2:
        raise FitError(f"sizes {sorted(set(xs))}: a line needs at least two distinct message "
                       "sizes; measure more sizes")
    (a, b), clamped = _relative_fit([x], t, "times")
    if not (b > 0 and math.isfinite(b)):
        raise FitError(f"fitted slope {b:.3g} s/byte: the times do not grow with the message "
                       "size, so no bandwidth follows; measure larger messages (--sizes up to "
                       "several MiB)")
    fitted = a + b * x
    return LinearFit(float(a), float(b), _r2(t, fitted), _r2(np.log(t), np.log(fitted)),
                     tuple((float(p), float(q)) for p, q in zip(x, t)), clamped)


@dataclasses.dataclass(frozen=True)
class CollectiveFit:
    """One primitive's fit and the cost-model constants it gives over ``group_size`` W."""

    kind: Collective
    group_size: int
    fit: LinearFit
    epsilon: float            # slope / the all-reduce's slope (all-reduce: 1)

    @property
    def alpha_per_worker(self) -> float:
        """alpha' (paper eq. 2 charges alpha' * W per collective): intercept / W."""
        return self.fit.intercept / self.group_size

    @property
    def beta(self) -> float:
        """Seconds per ring byte."""
        return self.fit.slope

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "group_size": self.group_size,
                "alpha_per_worker_s": self.alpha_per_worker, "beta_s_per_byte": self.beta,
                "bandwidth_bytes_per_s": 1.0 / self.beta, "epsilon_vs_all_reduce": self.epsilon,
                "fit": self.fit.to_json()}


def fit_collectives(rows: Sequence[Mapping[str, Any]],
                    group_size: int) -> dict[Collective, CollectiveFit]:
    """Fit every primitive in ``rows`` (each ``{"kind", "bytes", "seconds"}``: N as the cost
    model defines it, seconds of one collective) over ``group_size`` workers.

    x is the cost model's ring bytes, ``ring_factor(kind, W) * N``, so ``beta * epsilon_k *
    x`` is the cost model's transmission term and epsilon_k = slope_k / slope_AR is what
    makes it predict this primitive. Rows of all-reduce are required (the reference).
    """
    by_kind: dict[Collective, list[tuple[float, float]]] = {}
    for row in rows:
        kind = Collective.parse(row["kind"])
        by_kind.setdefault(kind, []).append(
            (ring_factor(kind, group_size) * float(row["bytes"]), float(row["seconds"])))
    if Collective.ALL_REDUCE not in by_kind:
        raise FitError(f"rows hold {sorted(k.value for k in by_kind)} but no all-reduce: "
                       "epsilon is relative to the all-reduce, measure it too")
    fits: dict[Collective, LinearFit] = {}
    for kind, pts in by_kind.items():
        try:
            fits[kind] = fit_linear([p[0] for p in pts], [p[1] for p in pts])
        except FitError as e:
            raise FitError(f"{kind.long_name}: {e}") from None
    ref = fits[Collective.ALL_REDUCE].slope
    return {kind: CollectiveFit(kind, group_size, fit, fit.slope / ref)
            for kind, fit in fits.items()}


@dataclasses.dataclass(frozen=True)
class GammaFit:
    """Gradient overlap measured: per trial, an all-reduce alone, compute alone, both
    launched together with no dependency between them, and an empty call (the fixed
    cost of a call, taken out of each), the fastest of repeated calls each. ``gamma`` is
    the median over trials of the visible fraction ``(both - compute) / all_reduce``,
    clipped to [``floor``, 1]."""

    trials: tuple[Mapping[str, float], ...]
    gamma: float
    clipped: bool
    floor: float = 0.05

    def to_json(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "clipped": self.clipped, "floor": self.floor,
                "trials": [dict(t) for t in self.trials]}


def fit_gamma(trials: Sequence[Mapping[str, float]], floor: float = 0.05) -> GammaFit | None:
    """gamma from overlap trials, each ``{"empty", "comm", "compute", "both"}`` in seconds
    (the fastest call of each). Visible communication = both - compute; its fraction of the
    communication alone (comm - empty) is the share of a backward collective that compute
    launched beside it does not hide: 1 = no overlap, near 0 = fully hidden. A fraction above
    1 (contention: the two slow each other down) is clipped to 1, one below ``floor`` to
    ``floor`` (gamma must be > 0). A trial whose all-reduce or compute took no longer than
    the empty call (noise larger than the signal) is kept in the record but not used; None
    when no trial is usable (the prior stays)."""
    out, fractions = [], []
    for t in trials:
        comm = t["comm"] - t["empty"]
        compute = t["compute"] - t["empty"]
        if comm <= 0 or compute <= 0:
            out.append({**t, "visible_fraction": None})
            continue
        fraction = (t["both"] - t["compute"]) / comm
        fractions.append(fraction)
        out.append({**t, "visible_fraction": fraction})
    if not fractions:
        return None
    raw = float(np.median(fractions))
    gamma = min(1.0, max(floor, raw))
    return GammaFit(tuple(out), gamma, gamma != raw, floor)


@dataclasses.dataclass(frozen=True)
class ComputeFit:
    """``t = intercept + F * (1 + k) / dense_rate + E * (1 + k) / elementwise_rate`` fitted to
    training steps: per point the forward FLOPs ``F`` of the matmuls and convolutions and
    the elements ``E`` of the memory-bound ops that the cost model counts, and the measured
    step (k, the backward factor, as ``CostOptions.backward_flops_factor``). The two rates
    are the cost model's ``device_peak_flops`` and ``device_elementwise_rate``."""

    dense_rate: float          # FLOP/s per device
    elementwise_rate: float    # elements/s per device
    intercept: float           # seconds every step pays (dispatch, per-op work)
    r2: float
    relative_residuals: tuple[float, ...]
    clamped: bool = False      # the intercept came out negative and was set to 0

    @property
    def max_relative_residual(self) -> float:
        return max((abs(r) for r in self.relative_residuals), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"dense_rate": self.dense_rate, "elementwise_rate": self.elementwise_rate,
                "intercept_s": self.intercept, "r2": self.r2, "clamped": self.clamped,
                "relative_residuals": list(self.relative_residuals),
                "max_relative_residual": self.max_relative_residual}


def fit_compute(dense: Sequence[float], elements: Sequence[float], seconds: Sequence[float],
                backward_factor: float = 2.0) -> ComputeFit:
    """Least squares on relative error (as :func:`fit_linear`) of ``t = c + a F + b E`` over
    training steps that mix matmuls and memory-bound ops in different proportions; the
    rates are ``(1 + backward_factor) / a`` and ``/ b``. A negative intercept is refitted
    through the origin (``clamped``). Raises :class:`FitError` when a rate is not positive
    (the points do not separate the two kinds of work: measure blocks whose mix differs).

    >>> F, E = [1e8, 4e8, 1e8, 3e8], [1e6, 2e6, 8e6, 3e7]
    >>> t = [1e-3 + 3 * f / 5e10 + 3 * e / 2e9 for f, e in zip(F, E)]
    >>> fit = fit_compute(F, E, t)
    >>> round(fit.dense_rate / 1e9, 3), round(fit.elementwise_rate / 1e9, 3)
    (50.0, 2.0)
    """
    f = np.asarray(dense, dtype=np.float64)
    e = np.asarray(elements, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if not f.shape == e.shape == t.shape or f.ndim != 1:
        raise FitError(f"{len(dense)} FLOP counts, {len(elements)} element counts and "
                       f"{len(seconds)} times: give one of each per step")
    if len(t) < 3:
        raise FitError(f"{len(t)} steps: three constants need at least 3 (better, blocks "
                       "of different mixes at several sizes)")
    coef, clamped = _relative_fit([f, e], t, "step times")
    _, a, b = (float(v) for v in coef)
    for name, v in (("matmul/convolution FLOPs", a), ("memory-bound elements", b)):
        if not (v > 0 and math.isfinite(v)):
            raise FitError(f"the fitted time per {name} is {v:.3g} s: the steps do not grow "
                           f"with that work, so no rate follows; measure blocks whose mix of "
                           f"matmuls and memory-bound ops differs more, or larger sizes")
    fitted = coef[0] + coef[1] * f + coef[2] * e
    scale = 1.0 + backward_factor
    return ComputeFit(scale / a, scale / b, float(coef[0]), _r2(t, fitted),
                      tuple(float(v) for v in (t - fitted) / fitted), clamped)


def profiled_cluster(name: str, fits: Mapping[Collective, CollectiveFit], device_memory: float,
                     device_peak_flops: float, gamma: GammaFit | None, where: str,
                     date: str, nodes: int = 1,
                     compute: ComputeFit | None = None,
                     width_efficiency: Mapping[int, float] | None = None) -> Cluster:
    """The cluster the fits describe: the link's latency is the all-reduce's alpha' and its
    bandwidth the all-reduce's 1 / beta (the cost model's ``alpha'`` and ``beta``), epsilon
    per primitive its slope over the all-reduce's, gamma measured (or the prior when
    ``gamma`` is None). ``compute`` (the training-step fit of :func:`fit_compute`) sets the
    device's FLOP rate and its elementwise rate (elements/s per device); without it the FLOP
    rate is ``device_peak_flops`` (a matmul's) and there is no elementwise rate: the cluster
    prices every op by its FLOPs, as the paper. ``width_efficiency`` (measured width ->
    fraction of the fastest width's FLOP rate) becomes the cluster's
    ``device_width_efficiency`` (with ``compute``, fitted with it: the FLOP rate is then
    the widest matrix multiplies'). ``where``/``date`` go into ``sources``.

    ``nodes`` > 1: the W devices were ``nodes`` worker processes (W / nodes devices each)
    whose collectives crossed process boundaries: the fitted link is the one between
    workers (``inter``); a ring over all W devices is as slow as its slowest hop, so the
    link inside a worker is not separated from it and ``intra`` takes the same constants."""
    ar = fits[Collective.ALL_REDUCE]
    w = ar.group_size
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or w % nodes:
        raise ValueError(f"nodes={nodes!r}: the {w} profiled devices must split evenly into "
                         "worker processes")
    link = Link(bandwidth=1.0 / ar.beta, latency=ar.alpha_per_worker, name="profiled")
    measured = f"tapas profile on {date}, {w} {where}"
    fitted = {"bandwidth": f"{measured}: all-reduce fit slope (R^2 {ar.fit.r2:.4f})",
              "latency": f"{measured}: all-reduce fit intercept / W (includes the in-graph "
                         "launch of one collective)"}
    if nodes == 1:
        links = {f"intra.{k}": v for k, v in fitted.items()}
        links.update({"inter.bandwidth": "one node profiled: same as intra",
                      "inter.latency": "one node profiled: same as intra"})
    else:
        links = {f"inter.{k}": v for k, v in fitted.items()}
        same = ("one device per worker: no link inside a worker was used; same as inter"
                if w == nodes else "the ring crossed both links and is as slow as the "
                "slower one: not separated, same as inter")
        links.update({"intra.bandwidth": same, "intra.latency": same})
    sources = {
        **links,
        "device_memory": f"{measured}: memory of one device",
        "device_peak_flops": f"{measured}: float32 matmul FLOP/s per device, all devices "
                             "computing at once",
        "epsilon": f"{measured}: each primitive's fit slope / the all-reduce's, as the "
                   "runtime implements it (tapas/execution/program/collectives.py)",
        "gamma": (f"{measured}: visible fraction of an all-reduce launched beside independent "
                  "compute" if gamma is not None else
                  f"not measured: CostOptions' prior {DEFAULT_GAMMA}"),
    }
    elementwise_rate = None
    if compute is not None:
        device_peak_flops, elementwise_rate = compute.dense_rate, compute.elementwise_rate
        fit = (f"training steps of reference blocks (transformer, residual and inverted "
               f"residual convolution blocks), all devices at once, against the FLOPs and "
               f"elements the cost model counts for them (joint fit, R^2 {compute.r2:.3f})")
        sources["device_peak_flops"] = (f"{measured}: FLOP/s per device of the matmuls and "
                                        f"convolutions in {fit}")
        sources["device_elementwise_rate"] = (
            f"{measured}: elements/s per device of the memory-bound ops (elementwise, "
            f"reductions, copies, depthwise convolutions) in {fit}")
    if width_efficiency:
        sources["device_width_efficiency"] = (
            f"{measured}: FLOP/s of training steps of [rows, w] x [w, w] matmul stacks per "
            f"width w, all devices at once, over the fastest width's")
        if compute is not None:
            sources["device_peak_flops"] += " (each width's FLOPs over its efficiency)"
    return Cluster(name=f"{name}/{nodes}x{w // nodes}", num_nodes=nodes,
                   devices_per_node=w // nodes, intra=link, inter=link,
                   device_memory=float(device_memory),
                   device_peak_flops=float(device_peak_flops), sources=sources,
                   epsilon={k.value: f.epsilon for k, f in fits.items()},
                   gamma=None if gamma is None else gamma.gamma,
                   device_elementwise_rate=elementwise_rate,
                   device_width_efficiency=dict(width_efficiency) if width_efficiency else None)


def parse_sizes(text: str) -> list[int]:
    """Message sizes from ``"1KiB,64KiB,4MiB"`` (a list) or ``"1KiB:16MiB"`` (from the first
    to the last by factors of 4); units B, KiB, MiB, GiB (K, M, G and KB, MB, GB read as
    binary too), none for bytes."""
    def one(part: str) -> int:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", part)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"size {part!r}: write a number and an optional unit (B, KiB, "
                             "MiB, GiB), e.g. 64KiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if value < 4:
            raise ValueError(f"size {part!r} = {value} bytes: a message holds at least one "
                             "float32 (4 bytes)")
        return value

    text = text.strip()
    if ":" in text:
        lo_text, _, hi_text = text.partition(":")
        lo, hi = one(lo_text), one(hi_text)
        if hi < lo:
            raise ValueError(f"sizes {text!r}: the range ends below its start; write "
                             "SMALLEST:LARGEST, e.g. 1KiB:16MiB")
        sizes = [lo]
        while sizes[-1] * 4 <= hi:
            sizes.append(sizes[-1] * 4)
    else:
        sizes = sorted({one(p) for p in text.split(",") if p.strip()})
    if len(sizes) < 2:
        raise ValueError(f"sizes {text!r} give {len(sizes)} size(s): a line (alpha + beta N) "
                         "needs at least two, e.g. 4KiB,1MiB or 1KiB:16MiB")
    return sizes


@dataclasses.dataclass
class Profile:
    """What ``profile`` measured and fitted; ``cluster`` is the cluster file's content."""

    cluster: Cluster
    fits: dict[Collective, CollectiveFit]
    rows: list[dict[str, Any]]
    compute: dict[str, Any]
    gamma: GammaFit | None
    devices: list[str]
    seconds: float
    date: str
    notes: list[str] = dataclasses.field(default_factory=list)
    tensorflow: str = ""

    def to_json(self) -> dict[str, Any]:
        """The ``"profile"`` section of the cluster file."""
        return {"tool": "tapas profile", "date": self.date, "devices": self.devices,
                "tensorflow": self.tensorflow, "cpus": os.cpu_count(),
                "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                "seconds": self.seconds,
                "model": "t = intercept + beta * ring_factor(k, W) * N; alpha' = intercept / W"
                         " (all-reduce's for the link); epsilon_k = beta_k / beta_AR",
                "fits": {k.value: f.to_json() for k, f in self.fits.items()},
                "compute": self.compute,
                "gamma": None if self.gamma is None else self.gamma.to_json(),
                "notes": self.notes, "rows": self.rows}

    def save(self, path: str) -> None:
        """Write the cluster file: the profiled cluster, measurements under ``"profile"``."""
        self.cluster.save(path, extra={"profile": self.to_json()})

    def table(self) -> str:
        """The fitted constants, one line per primitive, then compute and gamma."""
        w = self.cluster.num_devices
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines = [f"fitted over W = {w} devices: t = intercept + beta * ring bytes "
                 f"(ring bytes = f_k(W) * N); load average {load:.1f} on {os.cpu_count()} "
                 "CPUs at the end (a busy machine makes every constant noisier)",
                 f"{'primitive':<15} {'alpha/W us':>10} {'intercept us':>12} {'beta s/B':>10} "
                 f"{'GB/s':>8} {'eps vs AR':>9} {'R^2':>7} {'R^2 log':>7} {'max |res|':>9}"]
        for kind, f in self.fits.items():
            clamp = " (intercept < 0, set to 0)" if f.fit.clamped else ""
            lines.append(f"{kind.long_name:<15} {f.alpha_per_worker * 1e6:>10.1f} "
                         f"{f.fit.intercept * 1e6:>12.1f} {f.beta:>10.3e} "
                         f"{1e-9 / f.beta:>8.3f} {f.epsilon:>9.3f} {f.fit.r2:>7.4f} "
                         f"{f.fit.r2_log:>7.4f} {f.fit.max_relative_residual:>8.1%}{clamp}")
        mm = self.compute["matmul"]
        lines.append(f"matmul {mm['n']}^2 float32: {mm['flop_per_s_per_device'] / 1e9:.2f} "
                     f"GFLOP/s per device with all {w} computing "
                     f"({mm['flop_per_s_one_device_alone'] / 1e9:.2f} GFLOP/s on one alone)")
        conv = self.compute.get("conv")
        if conv:
            lines.append(f"conv 3x3 {conv['shape']}: {conv['flop_per_s_per_device'] / 1e9:.2f} "
                         "GFLOP/s per device (for the record)")
        widths = self.compute.get("widths")
        if widths and widths.get("efficiency"):
            lines.append("matmul training steps by width w ([rows, w] x [w, w]), GFLOP/s per "
                         "device (fraction of the fastest): " + ", ".join(
                             f"{p['width']}: {p['flop_per_s_per_device'] / 1e9:.1f} "
                             f"({widths['efficiency'][str(p['width'])]:.2f})"
                             for p in widths["points"] if p["flop_per_s_per_device"]))
        elif widths:
            lines.append(f"matmul rate by width: not measured ({widths.get('error')}); every "
                         "width priced at one rate")
        steps = self.compute.get("blocks")
        if steps and steps.get("rate"):
            lines.append(f"training steps of {', '.join(steps['blocks'])} blocks "
                         f"({len(steps['points'])} sizes, all {w} working), one fit "
                         f"(R^2 {steps['r2']:.4f}, max |res| "
                         f"{steps['max_relative_residual']:.0%}): "
                         f"{steps['dense_rate'] / 1e9:.2f} GFLOP/s for matmuls and "
                         f"convolutions, {steps['rate'] / 1e9:.3f} G elements/s for "
                         "elementwise ops, reductions, copies and depthwise convolutions: "
                         "the cost model's rates")
        elif steps:
            lines.append(f"reference blocks: no fit ({steps.get('error')}); every op priced "
                         "by its FLOPs at the matmul rate")
        if self.gamma is None:
            lines.append(f"gamma: not measured, the prior {DEFAULT_GAMMA} stays in force")
        else:
            parts = ", ".join(f"{t['bytes'] / MIB:.1f} MiB: {t['visible_fraction']:.2f}"
                              for t in self.gamma.trials if t["visible_fraction"] is not None)
            clip = " (clipped)" if self.gamma.clipped else ""
            lines.append(f"gamma = {self.gamma.gamma:.3f}{clip}: visible fraction of an "
                         f"all-reduce beside compute ({parts})")
        c = self.cluster
        lines.append(f"cluster {c.name}: alpha' {c.intra.latency * 1e6:.1f} us per worker, "
                     f"{c.intra.bandwidth / 1e9:.3f} GB/s, "
                     f"{c.device_peak_flops / 1e9:.2f} GFLOP/s, "
                     f"{c.device_memory / 2**30:.1f} GiB per device; epsilon "
                     + ", ".join(f"{k} {v:.2f}" for k, v in (c.epsilon or {}).items()))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> str | None:
        """Draw the relative residual of every fit against the message size to ``path``
        (PNG). Returns None when drawn, else the reason it was not (matplotlib missing)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return "matplotlib is not installed (pip install matplotlib): no residual plot"
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
        for kind, f in self.fits.items():
            xs = [p[0] for p in f.fit.points]
            ts = [p[1] for p in f.fit.points]
            line, = top.loglog(xs, [t * 1e3 for t in ts], "o", label=kind.long_name)
            lo, hi = min(xs), max(xs)
            grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            top.loglog(grid, [f.fit.predict(x) * 1e3 for x in grid], "-",
                       color=line.get_color(), alpha=0.6)
            bottom.semilogx(xs, [r * 100 for r in f.fit.relative_residuals], "o-",
                            color=line.get_color(),
                            label=f"{kind.value}: R^2 {f.fit.r2:.4f}")
        top.set_ylabel("time of one collective (ms)")
        top.set_title(f"tapas profile, {self.cluster.num_devices} devices "
                      f"({self.devices[0].split('/')[-1].split(':')[-2]}), {self.date}")
        top.legend(fontsize=8)
        bottom.axhline(0, color="gray", lw=0.8)
        bottom.set_xlabel("ring bytes f_k(W) * N")
        bottom.set_ylabel("residual (measured - fit) / fit, %")
        bottom.legend(fontsize=8)
        fig.tight_layout()
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None
