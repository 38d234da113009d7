"""``tapas train``: train a model on its synthetic data under a tensor-parallel strategy.

In:  the model's source (``tapas.execution.api.train_model``: a zoo preset, resolved by the
     command line's ``tapas.cli.train_models``, trained on its synthetic data, or the path
     of a saved ``.keras`` model, trained on a random batch in its input structure with its
     compiled loss) and :class:`TrainOptions` (devices, steps, strategy file /
     "random:SEED" / searched, optimizer, --verify, --workers); for a training job
     (``ParallelModel.fit``, ``tapas.execution.api.fit``) the data (``--data=file.npz``:
     one array per model input, named by input name, and the targets ``y``; or
     ``--data=file.tfrecord`` (files, a glob): ``tf.train.Example`` records with those
     features, :func:`load_tfrecord`; default the synthetic batch, ``--steps`` steps per
     epoch), ``--epochs``, ``--checkpoint_dir``, ``--checkpoint_every``, ``--resume``,
     ``--tensorboard``.
Out: a report dict (printed as it goes): the strategy table, the loss of every step, step
     time and throughput, the first-step trace time, the collective audit against the
     strategy's prediction, and with ``verify`` the largest differences of outputs,
     gradients, losses and weights against the single-device Keras model.

``workers=K`` re-runs this command as K processes on 127.0.0.1 under
``MultiWorkerMirroredStrategy`` (``tapas.execution.runtime.launch``: free ports, ``TF_CONFIG``, deadline,
clean-up of every worker) and prints worker 0's report.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from tapas.execution.api import train_calibration, train_model
from tapas.execution.api.train_launch import write_json
from tapas.sharding.patterns.pattern import REPLICATE
from tapas.execution.api.train_data import (TrainError, load_npz, load_tfrecord,  # noqa: F401
                                        save_tfrecord, tf_errors)   # (save_tfrecord: re-export)

__all__ = ["TrainOptions", "train", "TrainError"]


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    model: str | None = None          # zoo name (default: the zoo's default) or .keras path
    devices: int = 4                  # N (MirroredStrategy over N local devices)
    steps: int = 3
    strategy: str | None = None       # Strategy JSON path, "random:SEED", or None (search)
    verify: bool = False
    workers: int = 0                  # >0: that many processes under MultiWorkerMirrored
    devices_per_worker: int = 1       # workers: local devices of each (logical CPUs, GPUs)
    optimizer: str | None = None   # None: the model's compiled optimizer
    learning_rate: float | None = None
    batch_size: int | None = None
    cluster: str = "v100"             # search: "v100", "cpu" or a cluster file (tapas profile)
    memory_budget_gib: float | None = None  # search: per-device budget (forces sharding)
    timeout_s: float = 600.0          # workers: deadline for the whole run
    json_out: str | None = None       # written by worker 0 when workers > 0
    # the training-mode graph (dropout, batch-norm updates); None: training mode unless the
    # --strategy file was searched on the inference graph (tapas.parallelize)
    training: bool | None = None
    # a training job (ParallelModel.fit, tapas.execution.api.fit): any of these set
    data: str | None = None           # .npz: one array per input name, plus "y"; or
                                      # .tfrecord file(s) of tf.train.Example (load_tfrecord)
    epochs: int | None = None         # default 1; synthetic data: --steps steps per epoch
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False              # continue from checkpoint_dir's newest checkpoint
    # workers: a worker lost restarts the job on the others from the newest checkpoint
    elastic: bool = False
    elastic_wait_s: float | None = None   # elastic: first wait this long for a replacement
    tensorboard: str | None = None    # log directory for the scalars
    # a 2-D mesh "ROWSxCOLS" (tapas.planning.mesh): data parallel over the rows, the strategy
    # (made for COLS devices on one row's graph) inside each row; "ROWSxCOLS:experts" also
    # splits the MoE experts over the rows (tapas.planning.experts)
    mesh: str | None = None
    # Grappler's options for the step functions (tapas.execution.program.replay.graph_optimization)
    graph_optimization: str = "lean"
    # search: a factor on every plan's compute, or "measure" (the model's own, timed on the
    # run's devices first: tapas.execution.calibration.compute_scale); None: the cluster's rates
    compute_scale: str | None = None
    # search: every contraction and convolution priced by its kernel's measured time, "measure"
    # (the model's kernels timed on the run's devices first: tapas.execution.calibration.kernels) or a
    # file an earlier measure wrote; None: the cluster's rates
    kernel_times: str | None = None
    # search: a factor on every collective's cost, or "measure" (the model's own, its
    # data-parallel plan timed with and without its collectives on the run's devices first:
    # tapas.execution.calibration.communication_scale; one process only); None: the profiled constants
    communication_scale: str | None = None

    def keras_optimizer(self) -> Any:
        """``--optimizer`` as ``tapas.parallelize`` takes it: None (the model's compiled
        one), a name, or the config read from a JSON file (ValueError if unreadable)."""
        from tapas.execution.training.keras_optimizer import optimizer_from_flag
        return optimizer_from_flag("--optimizer", self.optimizer)

    @property
    def is_job(self) -> bool:
        return bool(self.data or self.epochs or self.checkpoint_dir or self.checkpoint_every
                    or self.resume or self.tensorboard)


def train(opts: TrainOptions, source: Any = None) -> dict[str, Any]:
    """Run ``tapas train`` (see the module docstring) on the model of ``source`` (a
    ``train_model.ModelSource``: the command line's ``tapas.cli.train_models.model_source``
    resolves zoo names; default ``opts.model`` as a saved model's path); returns the
    report."""
    from tapas.execution.api import preflight
    try:   # counts, the strategy file, the checkpoint directory: before anything is built
        preflight.check_options(opts)
    except preflight.PreflightError as e:
        raise TrainError(str(e)) from None
    if source is None:
        source = train_model.saved_model_source(opts.model)
    source.check()
    train_calibration.check_calibrations(opts)   # before workers start or a model is built
    if opts.workers and not os.environ.get("TF_CONFIG"):
        from tapas.execution.api.train_launch import launch_workers
        return launch_workers(opts)
    from tapas.execution.runtime import devices
    timings: dict[str, float] = {}
    start = time.perf_counter()
    # devices first: logical CPU devices must exist before TensorFlow runs any op
    distribute = (devices.make_strategy(devices_per_worker=opts.devices_per_worker)
                  if devices.tf_config() else devices.make_strategy(opts.devices))
    timings["devices"] = time.perf_counter() - start
    chief = train_calibration.is_chief(distribute)
    say = print if chief else (lambda *a, **k: None)
    pm, name, xs, y, calibration, kernels, comm = _parallelize(opts, source, distribute,
                                                                   timings, say)
    n = distribute.num_replicas_in_sync
    workers = n // len(distribute.extended.worker_devices)
    report: dict[str, Any] = {"model": name, "devices": n, "workers": workers,
                              "optimizer": pm.runtime.optimizer.name, "batch": int(len(y)),
                              "mode": "training" if pm.training else "inference",
                              "graph_optimization": pm.runtime.graph_optimization}
    if opts.compute_scale is not None:
        report["compute_scale"] = (calibration.compute_scale if calibration is not None
                                   else float(opts.compute_scale))
        report["compute_calibration"] = (None if calibration is None
                                         else calibration.to_json())
    if opts.kernel_times is not None:
        report["kernel_times"] = None if kernels is None else kernels.to_json()
    if opts.communication_scale is not None:
        report["communication_scale"] = (comm.communication_scale if comm is not None
                                         else float(opts.communication_scale))
        report["communication_calibration"] = None if comm is None else comm.to_json()
        report["activation_communication_scale"] = (None if comm is None
                                                    else comm.activation_communication_scale)
    from tapas.execution.api import train_job
    from tapas.execution.runtime import StepError
    try:
        check = None if opts.is_job else train_job.run_steps(opts, pm, xs, y, report, say)
        if opts.is_job:
            train_job.run_job(opts, pm, xs, y, report, say)
    except StepError as e:   # a failed step, weights unchanged: its cause, not a traceback
        hint = (" (a learning rate too large for the model, or NaN/inf in the data: check "
                "--learning_rate and --data)" if "not finite" in str(e) else "")
        raise TrainError(f"{e}{hint}") from None
    timings.update({f"trace_{k}": v for k, v in pm.runtime.trace_seconds.items()})
    if "train_step" in pm.runtime.audits:   # not when a resumed job had nothing left to do
        audit = pm.audit()
        report["audit"] = audit.to_json()
        say("\ncollectives in one training step (program vs the strategy's prediction):")
        say(audit.table())
        if pm.runtime.rows > 1:
            report["mesh"] = _say_mesh_audit(pm, opts.mesh, say)
    if check is not None:
        _say_verify(check, say)
    mem = pm.memory_report()   # every worker: the measurements are all-reduced
    report["memory"] = mem.to_json()
    say("\n" + mem.table())
    report["timings"] = {k: round(v, 4) for k, v in timings.items()}
    say("\nphase timings (s): " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    if opts.json_out and chief:
        write_json(opts.json_out, report)
    if check is not None and not check["ok"]:
        raise TrainError("verify failed: the parallel program differs from the single-device "
                         "model (see the table above)")
    return report


def _say_setup(pm: Any, opts: TrainOptions, say: Any) -> None:
    """The optimizer and the graph's mode the run trains with."""
    say(f"optimizer: {pm.runtime.optimizer.summary()}"
        + (" (the model's compiled optimizer)" if opts.optimizer is None else ""))
    say("mode: " + ("training (dropout on, batch-norm moving statistics updated)" if pm.training
                    else "inference (dropout off, moving statistics fixed)"))


def _check_npz(opts: TrainOptions, model: Any, specs: Any, loss: Any) -> None:
    """``--data`` against the model (``preflight.check_data``), as a TrainError."""
    from tapas.execution.api.preflight import PreflightError, check_data
    try:
        check_data(opts.data, model, specs, loss)
    except PreflightError as e:
        raise TrainError(str(e)) from None


def _mesh(opts: TrainOptions, n: int) -> Any:
    """``--mesh`` (1 x n without it), checked against the run's ``n`` devices."""
    from tapas.planning.mesh import Mesh
    if not opts.mesh:
        return Mesh(1, n)
    try:
        mesh = Mesh.parse(opts.mesh)
    except ValueError as e:
        raise TrainError(f"--mesh={opts.mesh}: {e}") from None
    if mesh.num_devices != n:
        raise TrainError(f"--mesh={opts.mesh} has {mesh.num_devices} devices but the run "
                         f"has {n} (--devices, or --workers x the devices of each)")
    return mesh


def _parallelize(opts: TrainOptions, source: Any, distribute: Any, timings: dict[str, float],
                 say: Any) -> tuple[Any, str, Any, Any, Any, Any, Any]:
    """The model of ``source`` built and parallelized under ``distribute`` with the strategy
    of ``opts``; returns the ParallelModel, the model name, its synthetic batch (xs, y), the
    ``--compute_scale=measure`` calibration, the ``--kernel_times`` and the
    ``--communication_scale=measure`` calibration (None without them)."""
    import tapas.execution.api.parallel as parallel, tapas.execution.program.reconstruct as reconstruct
    from tapas.planning.cost import Cluster
    n = distribute.num_replicas_in_sync
    mesh = _mesh(opts, n)
    rows = mesh.rows
    built = _build_model(source, opts, timings)
    model, name, specs, xs, y, loss = (built.model, built.name, built.specs, built.xs,
                                       built.y, built.loss)
    _check_npz(opts, model, specs, loss)   # before the capture and the search

    try:   # a preset name or a cluster file; one mesh row's devices
        cluster = Cluster.resolve(opts.cluster, 1, n // rows)
    except ValueError as e:
        raise TrainError(f"--cluster={opts.cluster}: {e}") from None
    strategy: Any = opts.strategy
    search_options, calibration, changes, comm = train_calibration.search_options(
        opts, model, specs, loss, cluster, distribute, rows, say)
    if strategy and strategy.startswith("random:"):
        strategy = _random_plan(opts, model, specs, mesh, n)
    elif strategy and not os.path.exists(strategy):
        raise TrainError(f"--strategy={strategy}: no such file (give a Strategy JSON from "
                         "`tapas search --out=...`, 'random:SEED', or leave it out to search)")
    say(f"model {name}: {model.count_params():,} parameters, batch {len(y)}; {n} devices "
        f"({distribute.__class__.__name__}, {', '.join(_device_names(distribute))})"
        + (f"; mesh {opts.mesh}: data parallel over {rows} rows of {n // rows}"
           + (", the experts split over the rows" if mesh.experts else "") if rows > 1
           else ""))
    try:
        pm = parallel.parallelize(model, specs, strategy, distribute_strategy=distribute,
                                  optimizer=opts.keras_optimizer(), mesh=opts.mesh,
                                  learning_rate=opts.learning_rate, loss=loss, cluster=cluster,
                                  training=opts.training, search_options=search_options,
                                  graph_optimization=opts.graph_optimization,
                                  weights_from=_resumed(opts))
    except (ValueError, reconstruct.ReconstructError) as e:
        raise TrainError(str(e)) from None
    timings.update(pm.timings)
    _say_setup(pm, opts, say)
    if pm.strategy is not None:   # searched or given: the search's report
        say(pm.strategy.summary(pm.graph))
    sharded = {node.id: pm.plan.pattern(node).name for node in pm.graph.nodes}
    say(f"\nreconstructed: {sum(1 for v in sharded.values() if v != REPLICATE)} of "
        f"{len(sharded)} GraphNodes sharded; {len(pm.runtime.paths)} weights")
    return pm, name, xs, y, calibration, changes.get("kernel_times"), comm


def _resumed(opts: TrainOptions) -> str | None:
    """The checkpoint a ``--resume`` job restores (the newest whole one in
    ``--checkpoint_dir``), which its shards are then created from, or None."""
    if not (opts.resume and opts.checkpoint_dir) or opts.verify:
        return None
    from tapas.execution.api import fit_checkpoints
    return fit_checkpoints.usable_checkpoint(opts.checkpoint_dir)[0]


def _build_model(source: Any, opts: TrainOptions, timings: dict[str, float]) -> Any:
    """``source.build(opts)`` (a ``train_model.BuiltModel``), timed as "build"."""
    start = time.perf_counter()
    built = source.build(opts)
    timings["build"] = time.perf_counter() - start
    return built


def _random_plan(opts: TrainOptions, model: Any, specs: Any, mesh: Any, n: int) -> Any:
    """``--strategy=random:SEED``: a random plan on one mesh row's graph (the whole batch
    in 1-D) in the run's mode; under ``:experts`` one that splits neither experts nor
    groups in the expert region."""
    import tapas.execution.api.parallel as parallel
    from tapas import capturing
    from tapas.execution.runtime.inputs import InputSignature
    rows = mesh.rows
    try:   # one mesh row's graph (the whole batch in 1-D)
        row = InputSignature.of(model, specs).per_row(rows)
    except ValueError as e:
        raise TrainError(f"--mesh={opts.mesh}: {e}") from None
    graph = capturing.capture(model, row.spec_structure(), training=opts.training is not False)
    nested = None
    if mesh.experts:   # the region may split neither experts nor groups
        from tapas.planning import experts
        try:
            nested = experts.nested_patterns(graph, rows)
        except experts.NestingError as e:
            raise TrainError(f"--mesh={opts.mesh}: {e}") from None
    return parallel.random_plan(graph, n // rows, int(opts.strategy.split(":", 1)[1]),
                                patterns_fn=nested)


def _say_mesh_audit(pm: Any, mesh_text: str, say: Any) -> dict[str, Any]:
    from tapas.execution.checking import audit
    return audit.say_mesh_audit(pm, mesh_text, say)


def column_audit(pm: Any, mesh: Any, sparse: bool = False) -> tuple[dict, dict]:
    """``tapas.execution.checking.audit.column_audit`` (the mesh columns' collectives, ran and priced)."""
    from tapas.execution.checking import audit
    return audit.column_audit(pm, mesh, sparse)


def _say_verify(check: dict[str, Any], say: Any) -> None:
    """The verify table: per quantity, the largest difference and whether it is ok."""
    say("\nverify against the single-device Keras model (rtol 1e-5, atol 1e-5 x the "
        "largest reference magnitude of each quantity: outputs, all gradients, all "
        "weights):")
    say(f"  (the {check.get('mode', 'inference')}-mode graph; seed-generator states "
        f"{'equal' if check.get('states', {}).get('ok', True) else 'DIFFER'})")
    for what in ("outputs", "loss", "gradients", "step_losses", "weights", "inference"):
        if what not in check:   # inference: a training-mode model with dropout/batch norm,
            continue            # checked in inference mode on the trained weights too
        r = check[what]
        worst = f"  (worst: {r['worst']})" if r.get("worst") else ""
        if r.get("ill_conditioned"):
            worst += (f"; {r['ill_conditioned']} elements with gradient within rounding "
                      f"noise excluded (Adam moves them +-lr; max |diff| there "
                      f"{r['max_abs_diff_all']:.1e})")
        say(f"  {what:<12} max |diff| {r['max_abs_diff']:.3e}  "
            f"{'ok' if r['ok'] else 'MISMATCH'}{worst}")
    sens = check.get("sensitivity")
    if sens and (sens["exceeds"] or sens.get("outputs_exceed")):
        moved = [f"{what} move by up to {sens[key]:.1e} (tolerance {sens[tol]:.1e})"
                 for what, key, tol, flag in (
                     ("its outputs", "outputs_max_abs_diff", "outputs_tolerance",
                      "outputs_exceed"),
                     ("its gradients", "max_abs_diff", "tolerance", "exceeds"))
                 if sens.get(flag)]
        say(f"  note: the single-device model is itself this sensitive: when its weights are "
            f"perturbed by {sens['relative_perturbation']:.0e} (float32 rounding), "
            f"{' and '.join(moved)}; differences of that size are rounding in another order "
            f"of operations, not a wrong plan (a larger batch, or --notraining, is better "
            f"conditioned)")
    say("verify: " + ("PASSED" if check["ok"] else "FAILED"))


def _device_names(distribute: Any) -> list[str]:
    return [d.rsplit("/", 1)[-1] if "/device:" in d else d
            for d in distribute.extended.worker_devices]
