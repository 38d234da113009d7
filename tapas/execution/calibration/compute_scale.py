"""One model's compute, measured against what the cost model prices for it (``"MC"``, ``"E"``).

In:  a Keras model and its input spec (the global batch B), the profiled cluster the search
     prices compute with, N devices (any ``tf.distribute`` strategy), the training loss.
Out: a :class:`ComputeCalibration`: the replicated training step timed in pairs at B and at
     B / N on all N devices at once, beside the compute the cost model prices for both;
     ``scale`` = (t(B) - t(B/N)) / (c(B) - c(B/N)) (``CostOptions.compute_scale``; the
     difference cancels each op's launch cost, which no split saves), and
     ``elementwise_scale``: the same measured difference less the priced difference of the
     contractions and convolutions, over the memory-bound ops' priced difference
     (``CostOptions.elementwise_scale``). A difference within the noise of the pairs gives
     None: the search keeps the profiled rates.
Raises: ValueError for bad ``steps``/``repeats``, fewer than 2 devices, or a factor that is
neither a number nor ``"measure"`` (:func:`parse_scale`). Why and what it measured:
``docs/cost.md``, "A model's own compute factor" and "The memory-bound ops' factor".
"""


from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ComputeCalibration", "calibrate_compute", "predicted_replicated_compute",
           "memory_bound_compute", "replicated_compute_parts",
           "check_elementwise_scale", "resolve_elementwise_scale",
           "scale_from_pairs", "check_compute_scale", "resolve_compute_scale",
           "check_measured_factor", "resolve_measured_factor", "time_pairs",
           "paired_difference", "median_standard_error"]


@dataclasses.dataclass(frozen=True)
class ComputeCalibration:
    """The measurement behind one model's ``CostOptions.compute_scale``."""

    num_devices: int
    batches: tuple[int, int]               # the global batch B and B / N
    measured_s: tuple[float, float]        # median step time of the replicated program at each
    predicted_s: tuple[float, float]       # the cost model's compute of the same programs
    difference_s: float                    # median over the pairs of t(B) - t(B/N)
    difference_se_s: float                 # its standard error (0.93 x IQR / sqrt(pairs))
    pairs: int
    scale: float | None                    # None: the difference is within the noise
    reason: str = ""                       # why scale is None
    # the memory-bound ops' part of predicted_s (their elements at the cluster's elementwise
    # rate; memory_bound_compute), None where the pricing has no such part
    memory_bound_s: tuple[float, float] | None = None

    @property
    def elementwise_scale(self) -> float:
        """The factor for ``CostOptions.elementwise_scale``: the measured difference less
        the priced difference of everything but the memory-bound ops (contractions and
        convolutions: measured kernels or the FLOP rates), over the priced difference of
        the memory-bound ops: what their batch split saves per second the model prices it
        at. 1.0 (the profiled rate) when ``scale`` is None, the pricing has no memory-bound
        part, or the rest's priced difference leaves nothing to explain."""
        if self.scale is None or self.memory_bound_s is None:
            return 1.0
        elements = self.memory_bound_s[0] - self.memory_bound_s[1]
        rest = ((self.predicted_s[0] - self.memory_bound_s[0])
                - (self.predicted_s[1] - self.memory_bound_s[1]))
        left = self.difference_s - rest
        return left / elements if elements > 0 and left > 0 else 1.0

    @property
    def compute_scale(self) -> float:
        """The factor for ``CostOptions.compute_scale``: ``scale``, or 1.0 (the profiled
        rates) when it could not be measured."""
        return 1.0 if self.scale is None else self.scale

    def describe(self) -> str:
        b, s = self.batches
        head = (f"replicated step on {self.num_devices} devices: batch {b} "
                f"{self.measured_s[0] * 1e3:.1f} ms, batch {s} {self.measured_s[1] * 1e3:.1f} "
                f"ms (difference {self.difference_s * 1e3:.1f} +- "
                f"{self.difference_se_s * 1e3:.1f} ms over {self.pairs} pairs); the cost model's "
                f"compute {self.predicted_s[0] * 1e3:.1f} and {self.predicted_s[1] * 1e3:.1f} ms")
        if self.scale is None:
            return f"{head}: {self.reason}; compute kept at the profiled rates (scale 1.0)"
        if self.memory_bound_s is None:
            return f"{head}: compute scale {self.scale:.2f}"
        return (f"{head} (memory-bound ops {self.memory_bound_s[0] * 1e3:.1f} and "
                f"{self.memory_bound_s[1] * 1e3:.1f} ms of them): compute scale "
                f"{self.scale:.2f}, memory-bound ops' scale {self.elementwise_scale:.2f}")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "compute_scale": self.compute_scale,
                "elementwise_scale": self.elementwise_scale}


def predicted_replicated_compute(graph: Any, num_devices: int, cluster: Any,
                                 options: Any = None) -> float:
    """Seconds of compute the cost model prices for ``graph`` replicated on every one of
    ``num_devices`` devices (every GraphNode's ``replicate`` pattern), at ``options``'s
    pricing with ``compute_scale`` and ``elementwise_scale`` 1."""
    from tapas.planning.cost import CostOptions
    options = CostOptions.for_cluster(cluster) if options is None else options
    return _replicated(graph, num_devices, cluster, options, 1.0)


def _replicated(graph: Any, num_devices: int, cluster: Any, options: Any,
                elementwise_scale: float) -> float:
    """The replicated program's priced compute with ``compute_scale`` 1 and the memory-bound
    ops' time times ``elementwise_scale``."""
    from tapas.planning.table import pattern_table
    from tapas.sharding.patterns.pattern import REPLICATE
    options = dataclasses.replace(options, compute_scale=1.0,
                                  elementwise_scale=elementwise_scale)
    table = pattern_table(graph, num_devices, cluster, options)
    return math.fsum(table.infos[n.id][table.index(n.id, REPLICATE)].compute_time
                     for n in graph.nodes)


def replicated_compute_parts(graph: Any, num_devices: int, cluster: Any,
                             options: Any = None) -> tuple[float, float | None]:
    """``(predicted_replicated_compute, memory_bound_compute)`` of ``graph``, pricing its
    pattern table twice, not three times."""
    from tapas.planning.cost import CostOptions
    options = CostOptions.for_cluster(cluster) if options is None else options
    whole = _replicated(graph, num_devices, cluster, options, 1.0)
    if not options.memory_bound or not cluster.device_elementwise_rate:
        return whole, None
    # elementwise_scale 2 doubles exactly the memory-bound part
    return whole, _replicated(graph, num_devices, cluster, options, 2.0) - whole


def memory_bound_compute(graph: Any, num_devices: int, cluster: Any,
                         options: Any = None) -> float | None:
    """The part of :func:`predicted_replicated_compute` that prices the memory-bound ops
    (their elements at ``Cluster.device_elementwise_rate``: ``CostOptions.memory_bound``);
    None where the pricing has no such part (memory_bound off, or a cluster without the
    rate)."""
    return replicated_compute_parts(graph, num_devices, cluster, options)[1]


def calibrate_compute(model: Any, input_spec: Any = None, *, cluster: Any,
                      devices: int | None = None, distribute_strategy: Any = None,
                      loss: Any = None, training: bool = True, options: Any = None,
                      steps: int = 5, repeats: int = 2,
                      progress: Callable[[str], None] | None = None) -> ComputeCalibration:
    """Measure ``model``'s ``CostOptions.compute_scale`` on these devices (module
    docstring). ``input_spec``: the global batch's specs (as ``tapas.parallelize``; default
    the model's own input shapes), its batch divisible by N. ``devices`` /
    ``distribute_strategy``: as ``tapas.parallelize``. ``loss``: the training loss (default
    the compiled model's, or mean squared error). ``training``: the graph the plans will
    run (``tapas.parallelize``'s ``training``). ``options``: the pricing the search will use
    (default ``CostOptions.for_cluster(cluster)``)."""
    from tapas.execution.runtime import inputs
    from tapas.execution.api import parallel
    from tapas.execution.runtime.devices import make_strategy
    from tapas.execution.program.plan import Plan
    from tapas.execution.calibration.timing import check_pairs
    check_pairs(steps, repeats)
    say = progress or (lambda _msg: None)
    strategy = distribute_strategy or make_strategy(devices)
    n = int(strategy.num_replicas_in_sync)
    if n < 2:
        raise ValueError("calibrate_compute needs at least 2 devices: it compares the "
                         "replicated step at the global batch and at batch / N")
    signature = inputs.InputSignature.of(model, input_spec)
    small = signature.per_row(n, f"the model is timed at the global batch and at batch / {n}")
    batches = (int(signature.specs[0].shape[0]), int(small.specs[0].shape[0]))
    loss = parallel.training_loss(model) if loss is None else parallel.loss_object(loss)
    programs, predicted, memory_bound = [], [], []
    for sig, batch in ((signature, batches[0]), (small, batches[1])):
        say(f"building the replicated program at batch {batch} on {n} devices")
        pm = parallel.parallelize(model, sig.spec_structure(), Plan(n, {}),
                                  distribute_strategy=strategy, loss=loss, training=training)
        whole, part = replicated_compute_parts(pm.graph, n, cluster, options)
        predicted.append(whole)
        memory_bound.append(part)
        xs, y = inputs.synthetic_batch(model, pm.inputs, loss,
                                       output_shape=pm.graph.outputs[0].shape)
        pm.train_step(xs, y)                      # tracing and the graph's first run
        programs.append((pm, xs, y))
    say(f"timing {steps * repeats} pairs of steps")
    times = time_pairs(programs, steps, repeats)
    return scale_from_pairs(n, batches, times[0], times[1], (predicted[0], predicted[1]),
                            None if None in memory_bound else
                            (memory_bound[0], memory_bound[1]))


def time_pairs(programs: list[tuple[Any, Any, Any]], steps: int,
               repeats: int) -> list[list[float]]:
    """The step times of each ``(ParallelModel, xs, y)`` of ``programs``, one step of each
    in turn, ``steps`` x ``repeats`` times (each program warmed up before): load that
    drifts over the measurement moves them alike."""
    times: list[list[float]] = [[] for _ in programs]
    for _ in range(repeats):
        for _ in range(steps):
            for i, (pm, xs, y) in enumerate(programs):
                start = time.perf_counter()
                pm.train_step(xs, y)
                times[i].append(time.perf_counter() - start)
    return times


def median_standard_error(iqr: float, n: int) -> float:
    """The standard error of the median of ``n`` samples whose interquartile range is
    ``iqr``: 1.25 sigma / sqrt(n) with sigma ~ IQR / 1.35, i.e. 0.93 x IQR / sqrt(n) (0 for
    fewer than two samples).

    >>> round(median_standard_error(0.1, 4), 4)
    0.0465
    """
    return 0.93 * iqr / math.sqrt(n) if n >= 2 else 0.0


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float, int]:
    """``(median, standard error, pairs)`` of the differences ``a[i] - b[i]`` of paired
    step times; the standard error of the median is 0.93 x IQR / sqrt(pairs) (0 for one
    pair). ValueError when the lists are empty or not of one length."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{len(a)} and {len(b)} step times: the steps are timed in "
                         "pairs, one of each, at least one pair")
    diffs = [x - y for x, y in zip(a, b)]
    se = 0.0
    if len(diffs) >= 2:
        q = statistics.quantiles(diffs, n=4)
        se = median_standard_error(q[2] - q[0], len(diffs))
    return statistics.median(diffs), se, len(diffs)


def scale_from_pairs(num_devices: int, batches: tuple[int, int], big: list[float],
                     small: list[float], predicted: tuple[float, float],
                     memory_bound: tuple[float, float] | None = None) -> ComputeCalibration:
    """The calibration from paired step times (``big[i]`` at the global batch, ``small[i]``
    at batch / N, timed one after the other) and the cost model's compute of the two
    programs (``memory_bound``: the memory-bound ops' part of it, for
    ``ComputeCalibration.elementwise_scale``): the median pair difference over the
    predicted difference, or no scale when the prediction does not differ or the
    difference is not 2 standard errors above 0."""
    diff, se, pairs = paired_difference(big, small)
    saved = predicted[0] - predicted[1]
    scale, reason = None, ""
    if saved <= 0:
        reason = ("the cost model prices the two batch sizes alike (no compute that a batch "
                  "split saves)")
    elif diff <= 0 or diff <= 2 * se:
        reason = ("the measured difference is within the noise (under 2 standard errors: "
                  "time more pairs, or a larger batch)")
    else:
        scale = diff / saved
    return ComputeCalibration(num_devices, batches,
                              (statistics.median(big), statistics.median(small)),
                              predicted, diff, se, pairs, scale, reason, memory_bound)


def check_measured_factor(value: Any, cluster_name: str, option: str, example: str,
                          against: str) -> float | None:
    """A ``--OPTION`` value of a factor the search can measure (``--compute_scale``,
    ``--communication_scale``) checked without measuring anything: the factor (checked as
    ``CostOptions(OPTION=factor)`` checks it), or None for ``"measure"``, which times the
    model on this machine's devices against the cluster's ``against`` and so only makes
    sense with a cluster file profiled here (a preset ``cluster_name`` is refused).
    ValueError names the value and the fix."""
    from tapas.planning.cost import CLUSTER_PRESETS, CostOptions
    if str(value).strip().lower() != "measure":
        try:
            scale = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a number: give a factor (e.g. {example}) or "
                             "'measure'") from None
        CostOptions(**{option: scale})   # the same checks as the option's
        return scale
    if cluster_name in CLUSTER_PRESETS:
        raise ValueError(f"'measure' times the model on this machine's devices against the "
                         f"cluster's {against}, and the cluster {cluster_name!r} is a preset, "
                         "not this machine: profile it (tapas profile --devices=N "
                         "--out=cluster.json) and pass --cluster=cluster.json")
    return None


def resolve_measured_factor(value: Any, cluster_name: str, measure: Callable[[], Any],
                            option: str, example: str, against: str) -> tuple[float, Any]:
    """``(factor, calibration)`` of such a flag (:func:`check_measured_factor`): a number
    (or its text) is the factor, without a calibration; ``"measure"`` calls ``measure()``,
    whose result carries the factor as its attribute ``OPTION``."""
    scale = check_measured_factor(value, cluster_name, option, example, against)
    if scale is not None:
        return scale, None
    calibration = measure()
    return getattr(calibration, option), calibration


def check_compute_scale(value: Any, cluster_name: str) -> float | None:
    """``--compute_scale`` checked without measuring anything: the factor, or None for
    ``"measure"`` (:func:`check_measured_factor`)."""
    return check_measured_factor(value, cluster_name, "compute_scale", "2.5", "rates")


def check_elementwise_scale(value: Any, cluster_name: str) -> float | None:
    """``--elementwise_scale`` checked without measuring anything: the factor, or None for
    ``"measure"`` (:func:`check_measured_factor`)."""
    return check_measured_factor(value, cluster_name, "elementwise_scale", "3.0",
                                 "elementwise rate")


def resolve_elementwise_scale(value: Any, cluster_name: str,
                              measure: Callable[[], ComputeCalibration]
                              ) -> tuple[float, ComputeCalibration | None]:
    """``--elementwise_scale`` of ``tapas search``: ``(factor, calibration)``, as
    :func:`resolve_compute_scale` (the same calibration's ``elementwise_scale``)."""
    return resolve_measured_factor(value, cluster_name, measure, "elementwise_scale", "3.0",
                                   "elementwise rate")


def resolve_compute_scale(value: Any, cluster_name: str,
                          measure: Callable[[], ComputeCalibration]
                          ) -> tuple[float, ComputeCalibration | None]:
    """``--compute_scale`` of ``tapas search`` and ``tapas train``: ``(factor,
    calibration)``. A number (or its text) is the factor; ``"measure"`` calls ``measure()``
    (:func:`calibrate_compute` on the run's devices); see :func:`check_compute_scale`."""
    return resolve_measured_factor(value, cluster_name, measure, "compute_scale", "2.5",
                                   "rates")
