"""The cost-model measurements ``tapas train`` runs before its search.

In:  :class:`tapas.execution.api.train.TrainOptions` (``--compute_scale``, ``--kernel_times``,
     ``--communication_scale``, ``--memory_budget_gib``), the built model, its specs and
     loss, the run's cluster and ``tf.distribute`` strategy.
Out: the options checked before anything is built (:func:`check_calibrations`), and the
     search's options with the measured constants (:func:`search_options`), with the
     calibrations made (``tapas.execution.calibration``).
Raises :class:`tapas.execution.api.train_data.TrainError` naming the flag, the value and the fix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tapas.execution.api.train_data import TrainError

if TYPE_CHECKING:
    from tapas.execution.api.train import TrainOptions

__all__ = ["check_calibrations", "search_options", "is_chief"]


def check_calibrations(opts: TrainOptions) -> None:
    """The measurement flags ``opts`` sets, checked against the other options without
    measuring anything: before ``--workers`` are launched or a model is built."""
    if opts.compute_scale is not None:
        _check_compute_scale(opts)
    if opts.kernel_times is not None:
        _check_kernel_times(opts)
    if opts.communication_scale is not None:
        _check_communication_scale(opts)


def search_options(opts: TrainOptions, model: Any, specs: Any, loss: Any, cluster: Any,
                   distribute: Any, rows: int, say: Any
                   ) -> tuple[dict[str, Any], Any, dict[str, Any], Any]:
    """(the search's options, the ``--compute_scale=measure`` calibration, the cost
    constants measured: kernel times and scales, the ``--communication_scale=measure``
    calibration): the measurements ``opts`` ask for, run before the search."""
    search_options: dict[str, Any] = ({} if opts.memory_budget_gib is None
                                      else {"memory_budget": opts.memory_budget_gib * 2**30})
    calibration = None
    changes: dict[str, Any] = {}
    if opts.kernel_times is not None:
        changes["kernel_times"] = _kernel_times(opts, model, specs, cluster, distribute, say)
    if opts.compute_scale is not None:   # measured against the kernels' prices, if any
        changes["compute_scale"], calibration = _compute_scale(opts, model, specs, loss,
                                                               cluster, distribute, rows, say,
                                                               dict(changes))
    comm = None
    if opts.communication_scale is not None:
        changes["communication_scale"], comm = _communication_scale(
            opts, model, specs, loss, cluster, distribute, changes, say)
        if comm is not None and comm.activation_communication_scale is not None:
            changes["activation_communication_scale"] = comm.activation_communication_scale
    if changes:
        from tapas.planning.cost import CostOptions
        search_options["options"] = CostOptions.for_cluster(cluster, **changes)
    return search_options, calibration, changes, comm


def _check_compute_scale(opts: TrainOptions) -> None:
    """``--compute_scale`` against the other options, without measuring anything: checked
    with the other options, before ``--workers`` are launched, so a wrong value fails once,
    at once."""
    from tapas.execution.calibration.compute_scale import check_compute_scale
    if opts.strategy:
        raise TrainError(f"--compute_scale={opts.compute_scale} prices the search, and "
                         f"--strategy={opts.strategy} skips it: leave one of them out")
    try:
        check_compute_scale(opts.compute_scale, opts.cluster)
    except ValueError as e:
        raise TrainError(f"--compute_scale={opts.compute_scale}: {e}") from None


def _compute_scale(opts: TrainOptions, model: Any, specs: Any, loss: Any, cluster: Any,
                   distribute: Any, rows: int, say: Any,
                   changes: dict[str, Any] | None = None) -> tuple[float, Any]:
    """``--compute_scale``: the factor and, for 'measure', its calibration (the model's
    replicated step timed at the batch and at batch / N on the run's devices, against the
    compute the search prices with ``changes``: the measured kernels, if any)."""
    from tapas.execution.calibration.compute_scale import calibrate_compute, resolve_compute_scale
    from tapas.planning.cost import CostOptions
    if rows > 1:
        raise TrainError(f"--compute_scale with --mesh={opts.mesh} is not supported: the "
                         "factor is measured on the 1-D program; search without it, or "
                         "run `tapas search --mesh` with --compute_scale and pass its "
                         "--out as --strategy")

    def measure() -> Any:
        say(f"measuring the model's compute scale on {distribute.num_replicas_in_sync} "
            "devices (--compute_scale=measure)")
        cal = calibrate_compute(model, specs, cluster=cluster, distribute_strategy=distribute,
                                loss=loss, training=opts.training is not False,
                                options=CostOptions.for_cluster(cluster, **(changes or {})),
                                progress=lambda msg: say(f"  {msg}"))
        say(f"  {cal.describe()}")
        return cal

    try:
        return resolve_compute_scale(opts.compute_scale, opts.cluster, measure)
    except ValueError as e:
        raise TrainError(f"--compute_scale={opts.compute_scale}: {e}") from None


def _check_one_dimensional_search(opts: TrainOptions, flag: str, why_not_mesh: str) -> None:
    """``--FLAG`` prices the search of the 1-D program: refused with ``--strategy`` (no
    search) and ``--mesh`` (``why_not_mesh``)."""
    if opts.strategy:
        raise TrainError(f"--{flag}={getattr(opts, flag)} prices the search, and "
                         f"--strategy={opts.strategy} skips it: leave one of them out")
    if opts.mesh:
        raise TrainError(f"--{flag} with --mesh={opts.mesh} is not supported: "
                         f"{why_not_mesh}; search without it")


def _check_kernel_times(opts: TrainOptions) -> None:
    """``--kernel_times`` against the other options, without measuring anything (before
    ``--workers`` are launched): it prices the search, on the 1-D program."""
    from tapas.execution.calibration.kernels import check_kernel_times
    _check_one_dimensional_search(opts, "kernel_times",
                                  "kernels are keyed by the 1-D patterns' local shapes")
    n = opts.workers * opts.devices_per_worker if opts.workers else opts.devices
    try:
        check_kernel_times(opts.kernel_times, opts.cluster, n)
    except ValueError as e:
        raise TrainError(f"--kernel_times={opts.kernel_times}: {e}") from None


def _kernel_times(opts: TrainOptions, model: Any, specs: Any, cluster: Any, distribute: Any,
                  say: Any) -> Any:
    """``--kernel_times``: the file's times, or the kernels of the model's patterns timed on
    the run's devices ('measure'; written to out/kernel_times.json by the chief)."""
    from tapas import capturing
    from tapas.execution.calibration.kernels import resolve_kernel_times
    n = distribute.num_replicas_in_sync
    if cluster.num_devices != n:   # (--mesh was refused before: one row)
        raise TrainError(f"--kernel_times: the cluster has {cluster.num_devices} devices, the "
                         f"run {n}; give a cluster file profiled on {n} devices")
    graph = (capturing.capture(model, specs, training=opts.training is not False)
             if str(opts.kernel_times).strip().lower() == "measure" else None)
    try:
        return resolve_kernel_times(opts.kernel_times, graph, cluster, opts.cluster,
                                    lambda _: distribute,
                                    os.path.join("out", "kernel_times.json")
                                    if is_chief(distribute) else None,
                                    progress=lambda msg: say(f"  {msg}"))
    except ValueError as e:
        raise TrainError(f"--kernel_times={opts.kernel_times}: {e}") from None


def _check_communication_scale(opts: TrainOptions) -> None:
    """``--communication_scale`` against the other options, without measuring anything
    (before ``--workers`` are launched): it prices the search of the 1-D program, and
    'measure' runs the plan without its collectives, which worker processes cannot."""
    from tapas.execution.calibration.communication_scale import check_communication_scale
    _check_one_dimensional_search(opts, "communication_scale",
                                  "the factor is measured on the 1-D program")
    try:
        measure = check_communication_scale(opts.communication_scale, opts.cluster) is None
    except ValueError as e:
        raise TrainError(f"--communication_scale={opts.communication_scale}: {e}") from None
    if measure and (opts.workers or os.environ.get("TF_CONFIG")):
        raise TrainError("--communication_scale=measure runs the model's data-parallel plan "
                         "without its collectives, which worker processes cannot (their "
                         "steps would no longer meet): measure it with `tapas search "
                         "--communication_scale=measure` on one process's devices and pass "
                         "the factor it prints")


def _communication_scale(opts: TrainOptions, model: Any, specs: Any, loss: Any, cluster: Any,
                         distribute: Any, changes: dict[str, Any], say: Any
                         ) -> tuple[float, Any]:
    """``--communication_scale``: the factor and, for 'measure', its calibration (the
    model's data-parallel plan timed with and without its collectives on the run's
    devices, priced with the search's other options ``changes``)."""
    from tapas.execution.calibration.communication_scale import (calibrate_communication,
                                                                 resolve_communication_scale)
    from tapas.planning.cost import CostOptions
    n = distribute.num_replicas_in_sync

    def measure() -> Any:
        if cluster.num_devices != n:
            raise ValueError(f"the cluster has {cluster.num_devices} devices, the run {n}: "
                             f"give a cluster file profiled on {n} devices")
        say(f"measuring the model's communication scale on {n} devices "
            "(--communication_scale=measure)")
        cal = calibrate_communication(model, specs, cluster=cluster,
                                      distribute_strategy=distribute, loss=loss,
                                      training=opts.training is not False,
                                      options=CostOptions.for_cluster(cluster, loss=loss,
                                                                      **changes),
                                      progress=lambda msg: say(f"  {msg}"))
        say(f"  {cal.describe()}")
        return cal

    try:
        return resolve_communication_scale(opts.communication_scale, opts.cluster, measure)
    except ValueError as e:
        raise TrainError(f"--communication_scale={opts.communication_scale}: {e}") from None


def is_chief(distribute: Any) -> bool:
    """Whether this process is the chief (task 0, or the only process) of ``distribute``."""
    resolver = getattr(distribute, "cluster_resolver", None)
    return resolver is None or not resolver.task_type or int(resolver.task_id or 0) == 0
