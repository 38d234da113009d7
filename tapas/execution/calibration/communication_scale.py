"""One model's collectives, measured inside its own training step (``"CS"``, ``"CA"``).

In:  a Keras model and its input spec (the global batch), the profiled cluster the search
     prices collectives with, N devices of one process (any single-process
     ``tf.distribute`` strategy), the training loss and the search's ``CostOptions``.
Out: a :class:`CommunicationCalibration`. The model's data-parallel plan is built twice, as
     it runs and with every collective replaced by a local op of the same shape
     (:func:`without_communication`), and the two steps are timed in pairs; ``scale`` is the
     median difference over what the cost model prices for those collectives
     (``CostOptions.communication_scale``). With ``activation`` a second plan, mostly
     activation collectives (:func:`activation_plan`), is timed the same way and
     :func:`solve_factors` splits the two into a weight-gradient factor and an activation
     factor (``CostOptions.activation_communication_scale``).
     A factor within the noise of its pairs (under 2 standard errors), or a plan without
     collectives, gives None: the search keeps the profiled constants.
Raises: ValueError for bad ``steps``/``repeats``, a strategy across worker processes (the
     local copy cannot run there), fewer than 2 devices, or a cluster of another device
     count. Why and what it measured: ``docs/cost.md``, "A model's own communication factor".
"""


from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tapas.execution.calibration.compute_scale import (check_measured_factor, paired_difference,
                                                       resolve_measured_factor, time_pairs)
from tapas.planning.references import DATA_PARALLEL, REPLICATED

__all__ = ["CommunicationCalibration", "ActivationCalibration", "calibrate_communication",
           "without_communication", "scale_from_pairs", "with_activation", "solve_factors",
           "activation_plan", "predicted_parts", "check_communication_scale",
           "resolve_communication_scale"]


@dataclasses.dataclass(frozen=True)
class CommunicationCalibration:
    """The measurement behind one model's ``CostOptions.communication_scale``."""

    num_devices: int
    plan: str                              # the plan measured (the data-parallel reference)
    collectives: int                       # how many the cost model prices for it
    measured_s: tuple[float, float]        # median step time: as it runs, without collectives
    predicted_s: float                     # the cost model's communication of the plan
    difference_s: float                    # median over the pairs of the two steps' difference
    difference_se_s: float                 # its standard error (0.93 x IQR / sqrt(pairs))
    pairs: int
    scale: float | None                    # None: not measurable (``reason``)
    reason: str = ""
    patterns: tuple[str, ...] = ()         # the plan's pattern name per GraphNode
    # of ``predicted_s``: the weight gradients' collectives and the others (activations)
    predicted_parts_s: tuple[float, float] = (0.0, 0.0)
    # the second plan (``CostOptions.activation_communication_scale``); None: not measured
    activation: ActivationCalibration | None = None

    @property
    def communication_scale(self) -> float:
        """The factor for ``CostOptions.communication_scale``: ``scale``, or 1.0 (the
        profiled constants) when it could not be measured."""
        return 1.0 if self.scale is None else self.scale

    @property
    def activation_communication_scale(self) -> float | None:
        """The factor for ``CostOptions.activation_communication_scale``: the second
        plan's, or None (``communication_scale`` for every collective)."""
        return None if self.activation is None else self.activation.scale

    def cost_options(self, options: Any) -> Any:
        """``options`` (a ``CostOptions``) with this calibration's factors."""
        return dataclasses.replace(
            options, communication_scale=self.communication_scale,
            activation_communication_scale=self.activation_communication_scale)

    def describe(self) -> str:
        head = (f"{self.plan} plan on {self.num_devices} devices: step "
                f"{self.measured_s[0] * 1e3:.1f} ms, without its collectives "
                f"{self.measured_s[1] * 1e3:.1f} ms (difference {self.difference_s * 1e3:.1f} "
                f"+- {self.difference_se_s * 1e3:.1f} ms over {self.pairs} pairs); the cost "
                f"model's {self.collectives} collectives {self.predicted_s * 1e3:.1f} ms")
        if self.scale is None:
            text = f"{head}: {self.reason}; collectives kept at the profiled constants (1.0)"
        else:
            text = f"{head}: communication scale {self.scale:.2f}"
        if self.activation_communication_scale is not None:
            text += " (weight gradients' collectives; solved with the second plan)"
        if self.activation is not None:
            text += f"\n{self.activation.describe()}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "communication_scale": self.communication_scale,
                "activation_communication_scale": self.activation_communication_scale}


@dataclasses.dataclass(frozen=True)
class ActivationCalibration:
    """The second plan of a :class:`CommunicationCalibration`: one whose priced
    communication is mostly collectives that do not reduce a weight's gradient, timed with
    and without its collectives in the same rounds as the data-parallel plan. With ``d``
    each plan's measured difference and ``(g, a)`` its priced gradient and activation
    collectives, the two factors solve ``d = scale_g * g + scale_a * a`` for both plans."""

    plan: str                              # which plan: "best", "#2", "megatron", ...
    patterns: tuple[str, ...]
    measured_s: tuple[float, float]        # median step: as it runs, without collectives
    predicted_parts_s: tuple[float, float]  # priced: gradient collectives, activation ones
    difference_s: float
    difference_se_s: float
    scale: float | None                    # None: not measurable (``reason``)
    reason: str = ""

    def describe(self) -> str:
        head = (f"  second plan ({self.plan}, mostly activation collectives): step "
                f"{self.measured_s[0] * 1e3:.1f} ms, without its collectives "
                f"{self.measured_s[1] * 1e3:.1f} ms (difference {self.difference_s * 1e3:.1f}"
                f" +- {self.difference_se_s * 1e3:.1f} ms); priced: gradient collectives "
                f"{self.predicted_parts_s[0] * 1e3:.1f} ms, others "
                f"{self.predicted_parts_s[1] * 1e3:.1f} ms")
        if self.scale is None:
            return f"{head}: {self.reason}; one factor for every collective"
        return f"{head}: activation communication scale {self.scale:.2f}"


@contextlib.contextmanager
def without_communication() -> Iterator[None]:
    """A timing instrument, not a program: while active, a program traced for the first
    time runs every collective as a local op of the same output shape (an all-reduce as
    ``x + 0``, an all-gather as ``x`` concatenated N times), so its step costs the plan's
    compute, data movement and dispatch without any communication. The step's *numbers are
    wrong*: time it, never read it. The plan's step less this one's is what its collectives
    cost inside the step. Logical devices or GPUs of one process: under several worker
    processes the workers' steps would no longer meet."""
    import tensorflow as tf

    from tapas.execution.program import collectives as c

    def local_sum(self: Any, xs: list) -> list:
        return [x + tf.zeros([], x.dtype) if x.dtype != tf.bool else tf.identity(x)
                for x in xs]

    def local_gather(self: Any, xs: list, axis: int) -> list:
        return [tf.concat([x] * self.num_devices, axis=axis) for x in xs]

    saved = {cls: (cls._sum, cls._gather) for cls in (c.KeyedCollectives,
                                                      c.ReplicaContextCollectives)}
    for cls in saved:
        cls._sum, cls._gather = local_sum, local_gather
    try:
        yield
    finally:
        for cls, (s_, g_) in saved.items():
            cls._sum, cls._gather = s_, g_


def data_parallel_patterns(graph: Any, cluster: Any, options: Any = None,
                           loss: Any = None, strategy: Any = None) -> tuple[str, ...]:
    """The pattern name of every GraphNode under the search's ``data-parallel`` reference
    plan on ``graph`` (``tapas.planning.references``); ``strategy``: that search's result,
    when the caller has it (else searched here)."""
    from tapas.planning.search import search
    s = strategy or search(graph, cluster=cluster, top_k=1, loss=loss, options=options)
    for alt in s.references:
        if alt.name == DATA_PARALLEL and not alt.error:
            return tuple(alt.changes.get(v, p) for v, p in enumerate(s.patterns))
    raise ValueError(f"the graph {graph.name!r} has no data-parallel plan (no GraphNode "
                     "splits on the batch): its collectives cannot be calibrated this way; "
                     "keep communication_scale at 1.0")


def predicted_communication(graph: Any, patterns: Sequence[str], cluster: Any,
                            options: Any = None) -> tuple[float, int]:
    """(seconds, count) of the collectives the cost model prices for the plan ``patterns``
    (one pattern name per GraphNode) on ``graph``, at ``options`` with
    ``communication_scale`` 1."""
    (gradient, activation), count = predicted_parts(graph, patterns, cluster, options)
    return gradient + activation, count


def predicted_parts(graph: Any, patterns: Sequence[str], cluster: Any,
                    options: Any = None) -> tuple[tuple[float, float], int]:
    """``((gradient seconds, activation seconds), count)``: :func:`predicted_communication`
    split into the collectives that reduce weights' gradients and the others."""
    from tapas.planning import explore
    from tapas.planning.cost import CostOptions
    from tapas.planning.table import EdgeCoster, pattern_table
    options = CostOptions.for_cluster(cluster) if options is None else options
    options = dataclasses.replace(options, communication_scale=1.0,
                                  activation_communication_scale=None)
    n = cluster.num_devices
    table = pattern_table(graph, n, cluster, options)
    idx = [table.index(v, name) for v, name in enumerate(patterns)]
    cost, _ = explore.plan_cost(graph, table, idx, EdgeCoster(n, cluster, options))
    parts = cost.comms.by_role()
    return (parts["gradient"], parts["activation"]), len(cost.comms)


def activation_plan(graph: Any, cluster: Any, options: Any = None, loss: Any = None,
                    top_k: int = 5, strategy: Any = None
                    ) -> tuple[str, tuple[str, ...], tuple[float, float]] | None:
    """The plan the activation factor is measured on: of the search's ``top_k`` plans
    and its reference plans (not data-parallel or replicated), those whose priced
    communication is at least half collectives that do not reduce a weight's gradient, the
    one with the most such communication (the largest difference to measure). ``(name,
    pattern per GraphNode, (gradient s, activation s))``, or None when no plan has that
    much activation communication. ``strategy``: that search's result (``top_k`` plans),
    when the caller has it."""
    from tapas.planning.search import search
    s = strategy or search(graph, cluster=cluster, top_k=top_k, loss=loss, options=options)
    plans = [("best", tuple(s.patterns))]
    plans += [(f"#{i + 2}", tuple(a.changes.get(v, p) for v, p in enumerate(s.patterns)))
              for i, a in enumerate(s.alternatives[:top_k - 1])]
    plans += [(a.name, tuple(a.changes.get(v, p) for v, p in enumerate(s.patterns)))
              for a in s.references
              if not a.error and a.name not in (DATA_PARALLEL, REPLICATED)]
    chosen, seen = None, set()
    for name, patterns in plans:
        if patterns in seen:
            continue
        seen.add(patterns)
        (g, a), _ = predicted_parts(graph, patterns, cluster, options)
        if a > 0 and a >= g and (chosen is None or a > chosen[2][1]):
            chosen = (name, patterns, (g, a))
    return chosen


def solve_factors(first: tuple[float, float], first_diff: float,
                  second: tuple[float, float], second_diff: float
                  ) -> tuple[float, float] | None:
    """``(gradient factor, activation factor)`` that price both plans' collectives as
    measured: ``diff = g_factor * gradient + a_factor * activation`` for each plan's
    ``(gradient, activation)`` priced seconds; None when the two plans do not tell the
    factors apart (their mixes too alike) or a factor comes out <= 0.

    >>> g, a = solve_factors((0.010, 0.001), 0.0058, (0.001, 0.010), 0.0085)
    >>> round(g, 3), round(a, 3)
    (0.5, 0.8)
    """
    (g1, a1), (g2, a2) = first, second
    det = g1 * a2 - a1 * g2
    # the sine of the angle between the two mixes: under 0.3 the plans are too alike (and
    # the first must lean to gradients, the second to activations: det > 0)
    if det <= 0.3 * math.hypot(g1, a1) * math.hypot(g2, a2):
        return None
    g = (first_diff * a2 - a1 * second_diff) / det
    a = (g1 * second_diff - g2 * first_diff) / det
    if g <= 0 or a <= 0:
        return None
    return g, a


def calibrate_communication(model: Any, input_spec: Any = None, *, cluster: Any,
                            devices: int | None = None, distribute_strategy: Any = None,
                            loss: Any = None, training: bool = True, options: Any = None,
                            graph: Any = None, steps: int = 5, repeats: int = 2,
                            progress: Callable[[str], None] | None = None,
                            activation: bool = True) -> CommunicationCalibration:
    """Measure ``model``'s ``CostOptions.communication_scale`` on these devices (module
    docstring). ``input_spec``: the global batch's specs (as ``tapas.parallelize``; default
    the model's own input shapes), its batch divisible by N. ``devices`` /
    ``distribute_strategy``: as ``tapas.parallelize`` (one process). ``loss``: the
    training loss (default the compiled model's, or mean squared error). ``training``: the
    graph the plans will run. ``options``: the pricing the search will use (default
    ``CostOptions.for_cluster(cluster, loss=loss)``: the loss's collectives run in the
    step). ``graph``: the model's graph captured in that mode, when the caller has it (else
    captured here). ``activation``: also measure the activation factor on a second plan
    (:func:`activation_plan`; its two programs are timed in the same rounds, so the
    measurement takes about twice as long); off: one factor for every collective."""
    from tapas import capturing
    from tapas.execution.runtime import inputs
    from tapas.execution.api import parallel
    from tapas.execution.runtime.devices import make_strategy, process_count
    from tapas.execution.program.plan import Plan
    from tapas.planning.strategy import graph_digest
    from tapas.sharding.patterns import pattern_by_name
    from tapas.execution.calibration.timing import check_pairs
    check_pairs(steps, repeats)
    say = progress or (lambda _msg: None)
    strategy = distribute_strategy or make_strategy(devices)
    n = _replicas(strategy, cluster, process_count())
    signature = inputs.InputSignature.of(model, input_spec)
    signature.per_row(n, "the data-parallel plan splits the batch over the devices")
    loss = parallel.training_loss(model) if loss is None else parallel.loss_object(loss)
    if graph is None:
        graph = capturing.capture(model, signature.spec_structure(), training=training)
    if options is None:   # the loss's collectives run in the step: priced too
        from tapas.planning.cost import CostOptions
        options = CostOptions.for_cluster(cluster, loss=loss)
    from tapas.planning.search import search
    found = search(graph, cluster=cluster, top_k=5 if activation else 1, loss=loss,
                   options=options)            # one search for both plans
    patterns = data_parallel_patterns(graph, cluster, options, loss, strategy=found)
    parts, count = predicted_parts(graph, patterns, cluster, options)
    second = (activation_plan(graph, cluster, options, loss, strategy=found) if activation
              else None)
    plans = [(DATA_PARALLEL, patterns)] + ([second[:2]] if second is not None else [])
    programs = []
    for name, names in plans:
        chosen = {node.id: pattern_by_name(node, graph, n, names[node.id])
                  for node in graph.nodes}
        plan = Plan(n, chosen, graph_digest=graph_digest(graph))
        for local in (False, True):
            say(f"building the {name} plan on {n} devices"
                + (" without its collectives" if local else ""))
            with (without_communication() if local else contextlib.nullcontext()):
                pm = parallel.parallelize(model, signature.spec_structure(), plan,
                                          distribute_strategy=strategy, loss=loss,
                                          training=training)
                xs, y = inputs.synthetic_batch(model, pm.inputs, loss,
                                               output_shape=pm.graph.outputs[0].shape)
                pm.train_step(xs, y)                  # tracing and the graph's first run
            programs.append((pm, xs, y))
    say(f"timing {steps * repeats} rounds of {len(programs)} steps")
    times = time_pairs(programs, steps, repeats)
    cal = scale_from_pairs(n, times[0], times[1], sum(parts), count, patterns=patterns,
                           parts=parts)
    if second is None:
        if activation:
            say("no plan of the search has mostly activation collectives: one factor for "
                "every collective")
        return cal
    return with_activation(cal, second[0], second[1], second[2], times[2], times[3])


def _replicas(strategy: Any, cluster: Any, processes: int) -> int:
    """The strategy's device count N, checked: one process, the cluster's N, at least 2."""
    if processes > 1:
        raise ValueError("calibrate_communication runs the plan without its collectives, "
                         "which worker processes cannot (their steps would no longer meet): "
                         "measure on the devices of one process")
    n = int(strategy.num_replicas_in_sync)
    if n != cluster.num_devices:
        raise ValueError(f"the strategy has {n} devices and the cluster "
                         f"{cluster.num_devices}: profile this many devices (tapas profile "
                         f"--devices={n}) or give a strategy of {cluster.num_devices}")
    if n < 2:
        raise ValueError("calibrate_communication needs at least 2 devices: one device runs "
                         "no collective")
    return n


def with_activation(cal: CommunicationCalibration, plan: str, patterns: Sequence[str],
                    parts: tuple[float, float], full: list[float], local: list[float]
                    ) -> CommunicationCalibration:
    """``cal`` with its second plan's paired step times (``full`` / ``local``, timed in the
    same rounds) and priced ``(gradient, activation)`` seconds: both factors solved
    (:func:`solve_factors`), or the second plan recorded without a factor (``reason``) when
    either difference is within the noise or the two plans do not tell the factors apart.

    >>> c = scale_from_pairs(4, [0.0300] * 4, [0.0242] * 4, 0.011, 40, parts=(0.010, 0.001))
    >>> c = with_activation(c, "megatron", (), (0.001, 0.010), [0.0300] * 4, [0.0215] * 4)
    >>> round(c.communication_scale, 3), round(c.activation_communication_scale, 3)
    (0.5, 0.8)
    """
    diff, se, _ = paired_difference(full, local)
    scale, reason = None, ""
    if cal.scale is None:
        reason = "the data-parallel plan's factor was not measured"
    elif diff <= 0 or diff <= 2 * se:
        reason = ("the measured difference is within the noise (under 2 standard errors: "
                  "time more pairs)")
    else:
        both = solve_factors(cal.predicted_parts_s, cal.difference_s, parts, diff)
        if both is None:
            reason = ("the two plans' differences give no positive pair of factors (their "
                      "mixes of collectives too alike, or the noise)")
        else:
            cal = dataclasses.replace(cal, scale=both[0])
            scale = both[1]
    second = ActivationCalibration(plan, tuple(patterns),
                                   (statistics.median(full), statistics.median(local)),
                                   tuple(parts), diff, se, scale, reason)
    return dataclasses.replace(cal, activation=second)


def scale_from_pairs(num_devices: int, full: list[float], local: list[float],
                     predicted: float, collectives: int, plan: str = DATA_PARALLEL,
                     patterns: Sequence[str] = (),
                     parts: tuple[float, float] | None = None) -> CommunicationCalibration:
    """The calibration from paired step times (``full[i]`` as the plan runs, ``local[i]``
    without its collectives, timed one after the other) and the cost model's price of the
    plan's collectives: the median pair difference over the price, or no scale when the
    plan has no priced collective or the difference is not 2 standard errors above 0.
    ``parts``: ``predicted`` split into gradient and activation collectives (default: all
    gradient).

    >>> c = scale_from_pairs(4, [0.030, 0.031, 0.032, 0.030], [0.020, 0.020, 0.021, 0.020],
    ...                      0.020, 40)
    >>> round(c.scale, 2), c.pairs
    (0.52, 4)
    >>> scale_from_pairs(4, [0.030, 0.020], [0.020, 0.030], 0.020, 40).scale is None
    True
    """
    diff, se, pairs = paired_difference(full, local)
    scale, reason = None, ""
    if predicted <= 0 or collectives == 0:
        reason = "the cost model prices no collective for the plan"
    elif diff <= 0 or diff <= 2 * se:
        reason = ("the measured difference is within the noise (under 2 standard errors: "
                  "time more pairs)")
    else:
        scale = diff / predicted
    return CommunicationCalibration(num_devices, plan, collectives,
                                    (statistics.median(full), statistics.median(local)),
                                    predicted, diff, se, pairs, scale, reason,
                                    tuple(patterns),
                                    (predicted, 0.0) if parts is None else tuple(parts))


def check_communication_scale(value: Any, cluster_name: str) -> float | None:
    """``--communication_scale`` checked without measuring anything: the factor, or None
    for ``"measure"`` (a preset ``cluster_name`` refused:
    ``tapas.execution.calibration.compute_scale.check_measured_factor``)."""
    return check_measured_factor(value, cluster_name, "communication_scale", "0.6",
                                 "alpha and beta")


def resolve_communication_scale(value: Any, cluster_name: str,
                                measure: Callable[[], CommunicationCalibration]
                                ) -> tuple[float, CommunicationCalibration | None]:
    """``--communication_scale`` of ``tapas search`` and ``tapas train``: ``(factor,
    calibration)``. A number (or its text) is the factor; ``"measure"`` calls ``measure()``
    (:func:`calibrate_communication` on the run's devices); see
    :func:`check_communication_scale`."""
    return resolve_measured_factor(value, cluster_name, measure, "communication_scale", "0.6",
                                   "alpha and beta")
