"""``tapas search``: capture ``--model`` and search its tensor-parallel strategy on a
cluster (``tapas.planning.search``), or on every 2-D mesh of it.

In:  the model flags, the cluster (``--cluster``, ``--nodes``, ``--devices_per_node``), the
     search's options and the cost model's factors (FLAG_NAMES).
Out: the strategy's summary (printed; the report returned as a dict); ``--out`` the
     Strategy JSON, ``--draw`` its drawing.
Raises: ``absl.app.UsageError`` naming the flag, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from absl import app, flags

from tapas import ir
from tapas.cli.common import FLAGS, LoadedModel, capture_flags_model
from tapas.planning.cost import CLUSTER_PRESETS

flags.DEFINE_integer("nodes", 1, "search: machines in the cluster (m of S(m, n)).")
flags.DEFINE_integer("devices_per_node", 8, "search: devices per machine (n of S(m, n)).")
flags.DEFINE_enum("mode", "gp", ["gp", "es"], "search: 'gp' searches each unique subgraph "
                  "once (graph-pruned), 'es' the whole graph (exhaustive).")
flags.DEFINE_boolean("meshes", False, "search: also search every 2-D mesh rows x cols of the "
                     "devices (data parallel over the rows, the searched strategy in each row: "
                     "tapas.planning.mesh) and print the best cost per mesh.")
flags.DEFINE_boolean("price_loss", True, "search: price the collectives of the training "
                     "loss on the output's placement (the zoo model's loss; a saved model's "
                     "compiled loss, else mean squared error, as tapas train uses); "
                     "--noprice_loss: leave them out (the paper's cost model).")
flags.DEFINE_integer("top_k", 5, "search: ranked whole-plan alternatives to keep.")
flags.DEFINE_float("time_limit", None, "search: seconds before the search gives up "
                   "(e.g. for --mode=es on a large model).")
flags.DEFINE_enum("precision", None, ["float32", "mixed_float16", "mixed_bfloat16"],
                  "search: price the model as if it computed in this precision (default: "
                  "the dtypes its captured graph computes in, i.e. its Keras dtype policy).")
flags.DEFINE_list("draw_references", ["megatron", "ffn-only", "mha-only"],
                  "search --draw: reference plans drawn beside the strategy (those that "
                  "apply to the model; empty: none).")

SUMMARY = 'search the tensor-parallel strategy of a model on a cluster (or its 2-D meshes)'
USAGE = ('tapas search --model=NAME --nodes=M --devices_per_node=N [--mode=gp|es] '
         '[--out=s.json] [--cluster=file.json] [--meshes | --mesh=ROWSxCOLS] '
         '[--precision=float32|mixed_float16|mixed_bfloat16] '
         '[--draw=strategy.png]')
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('model', 'batch_size', 'training', 'nodes', 'devices_per_node', 'mode',
              'cluster', 'out', 'meshes', 'mesh', 'price_loss', 'memory_budget_gib', 'top_k',
              'time_limit', 'precision', 'draw', 'draw_references', 'compute_scale',
              'elementwise_scale',
              'kernel_times', 'communication_scale', 'json_out')


class SearchProgress:
    """A ``progress`` callback for ``tapas.search``: a :class:`tapas.progress.ProgressBar`
    on stderr showing the phase, the steps done of its total, the candidates generated so
    far and an ETA for the phase (the search reports every 2 s at most, so a fast search
    shows nothing; nothing off a terminal). ``close()`` clears the line."""

    def __init__(self, start: float, stream: Any = None, enabled: bool | None = None) -> None:
        from tapas.progress import ProgressBar
        self.bar = ProgressBar("search", stream=stream, delay=0.0, enabled=enabled,
                               clock=time.perf_counter)
        self.bar.start = self.bar._phase_start = start
        self.phase = ""

    def __call__(self, phase: str, done: int, total: int, candidates: int) -> None:
        unit = "templates" if phase.endswith("enumeration") else "GraphNodes"
        if phase != self.phase:
            self.phase = phase
            self.bar.phase(f"search {phase}:", total)
        self.bar.update(done, total, f"{unit}, {candidates:,} candidates")

    def close(self) -> None:
        self.bar.close()


def _flags_cluster() -> Any:
    """The cluster of ``--cluster``, ``--nodes`` and ``--devices_per_node``, with the cost
    model's factor flags checked against it (before anything is captured)."""
    from tapas.planning.cluster import ClusterFileError
    from tapas.planning.cost import Cluster
    if FLAGS["devices"].present:
        raise app.UsageError(
            f"--devices={FLAGS.devices} is the device count of `tapas train` and `tapas "
            "profile`; a search is made for a cluster S(m, n): use --nodes=M "
            f"--devices_per_node=N (one node of {FLAGS.devices}: --nodes=1 "
            f"--devices_per_node={FLAGS.devices})")
    # a cluster file keeps its own shape unless --nodes/--devices_per_node are given
    nodes = FLAGS.nodes if FLAGS["nodes"].present or FLAGS.cluster in CLUSTER_PRESETS else None
    per_node = (FLAGS.devices_per_node if FLAGS["devices_per_node"].present
                or FLAGS.cluster in CLUSTER_PRESETS else None)
    try:
        cluster = Cluster.resolve(FLAGS.cluster, nodes, per_node)
    except ClusterFileError as e:
        raise app.UsageError(f"--cluster={FLAGS.cluster}: {e}") from None
    except (TypeError, ValueError) as e:
        raise app.UsageError(f"--cluster={FLAGS.cluster} --nodes={FLAGS.nodes} "
                             f"--devices_per_node={FLAGS.devices_per_node}: {e}") from None
    from tapas.execution.calibration.communication_scale import check_communication_scale
    from tapas.execution.calibration.compute_scale import (check_compute_scale,
                                                           check_elementwise_scale)
    for name, check in (("compute_scale", check_compute_scale),
                        ("elementwise_scale", check_elementwise_scale),
                        ("communication_scale", check_communication_scale)):
        value = FLAGS[name].value   # a factor measured on the 1-D program, or given
        if value is None:
            continue
        if FLAGS.meshes or FLAGS.mesh:
            raise app.UsageError(f"--{name}={value} with --meshes/--mesh is not supported "
                                 "(the factor is measured on the 1-D program): leave one of "
                                 "them out")
        try:
            check(value, FLAGS.cluster)
        except ValueError as e:
            raise app.UsageError(f"--{name}={value}: {e}") from None
    if FLAGS.kernel_times is not None:
        if FLAGS.meshes or FLAGS.mesh:
            raise app.UsageError(f"--kernel_times={FLAGS.kernel_times} with --meshes/--mesh "
                                 "is not supported (kernels are keyed by the 1-D patterns' "
                                 "local shapes): leave one of them out")
        from tapas.execution.calibration.kernels import check_kernel_times
        try:
            check_kernel_times(FLAGS.kernel_times, FLAGS.cluster, cluster.num_devices)
        except ValueError as e:
            raise app.UsageError(f"--kernel_times={FLAGS.kernel_times}: {e}") from None
    return cluster


def cmd_search() -> dict[str, Any]:
    from tapas.planning import explore
    from tapas.planning import search as search_lib
    cluster = _flags_cluster()
    measures = [str(FLAGS.compute_scale).strip().lower() == "measure",
                str(FLAGS.elementwise_scale).strip().lower() == "measure",
                str(FLAGS.kernel_times).strip().lower() == "measure",
                str(FLAGS.communication_scale).strip().lower() == "measure"]
    if any(measures) and FLAGS.cluster not in CLUSTER_PRESETS:
        # the cluster's devices, before the capture runs any TensorFlow op (logical CPU
        # devices are set once per process)
        from tapas.execution.runtime.devices import setup_devices
        setup_devices(cluster.num_devices)
    graph, trace, ir_s, loaded = capture_flags_model()
    capture_s = trace.seconds + ir_s
    loss = loaded.loss if FLAGS.price_loss else None
    if FLAGS.meshes or FLAGS.mesh:
        return _search_meshes(graph, trace, cluster, loss, loaded)
    options, calibration = _search_options(cluster, loaded, graph)
    options, comm_calibration = _communication_options(cluster, loaded, graph, options, loss)
    print(f"captured '{graph.name}': {len(graph.nodes):,} GraphNodes in {capture_s:.3f} s; "
          f"searching ({FLAGS.mode}) on {cluster.name} ({cluster.num_devices} devices)"
          + (f"; pricing the loss ({_loss_text(loss)})" if loss is not None else ""))
    start = time.perf_counter()

    progress = SearchProgress(start)

    budget = None if FLAGS.memory_budget_gib is None else FLAGS.memory_budget_gib * 2**30
    try:
        strategy = search_lib.search(
            graph, cluster=cluster, mode=FLAGS.mode, top_k=FLAGS.top_k, memory_budget=budget,
            explore_options=explore.ExploreOptions(top_k=FLAGS.top_k,
                                                   time_limit=FLAGS.time_limit),
            progress=progress, loss=loss, options=options, precision=FLAGS.precision)
    except explore.SearchTimeout as e:
        raise app.UsageError(f"--mode={FLAGS.mode} did not finish within --time_limit="
                             f"{FLAGS.time_limit} s ({e}); use --mode=gp or a larger "
                             "--time_limit") from None
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    finally:
        progress.close()
    print(strategy.summary(graph))
    from tapas.sharding.losses import LossSpec
    report = {"model": graph.name, "capture_seconds": round(capture_s, 4),
              "loss_priced": LossSpec.of(loss).to_json() if loss is not None else None,
              "compute_scale": 1.0 if options is None else options.compute_scale,
              "elementwise_scale": 1.0 if options is None else options.elementwise_scale,
              "compute_calibration": None if calibration is None else calibration.to_json(),
              "communication_scale": 1.0 if options is None else options.communication_scale,
              "activation_communication_scale": None if options is None else
              options.activation_communication_scale,
              "communication_calibration": None if comm_calibration is None else
              comm_calibration.to_json(),
              "kernel_times": None if options is None or options.kernel_times is None else
              options.kernel_times.to_json(),
              "strategy": strategy.to_json()}
    if FLAGS.draw:
        from tapas.planning.draw import draw_strategy
        refs = [r for r in FLAGS.draw_references
                if any(a.name == r for a in strategy.references)]
        draw_strategy(strategy, graph, FLAGS.draw, references=refs)
        print(f"\nstrategy drawn to {FLAGS.draw}"
              + (f" beside {', '.join(refs)}" if refs else ""))
    if FLAGS.out:
        strategy.save(FLAGS.out)
        print(f"\nstrategy written to {FLAGS.out}")
    return report


def _search_options(cluster: Any, loaded: LoadedModel, graph: Any) -> tuple[Any, Any]:
    """``(CostOptions or None, ComputeCalibration or None)`` from ``--compute_scale`` and
    ``--elementwise_scale`` (given factors, or measured here by one calibration:
    'measure') and ``--kernel_times`` (a file, or the kernels of ``graph``'s patterns timed
    here: 'measure'); None for the search's defaults."""
    from tapas.execution.calibration.compute_scale import (calibrate_compute, resolve_compute_scale,
                                                           resolve_elementwise_scale)
    from tapas.planning.cost import CostOptions
    if FLAGS.compute_scale is None and FLAGS.kernel_times is None and \
            FLAGS.elementwise_scale is None:
        return None, None
    changes: dict[str, Any] = {}
    if FLAGS.kernel_times is not None:
        from tapas.execution.runtime.devices import make_strategy
        from tapas.execution.calibration.kernels import resolve_kernel_times
        save_to = (os.path.splitext(FLAGS.out)[0] + "_kernels.json" if FLAGS.out
                   else os.path.join("out", "kernel_times.json"))
        changes["kernel_times"] = resolve_kernel_times(
            FLAGS.kernel_times, graph, cluster, FLAGS.cluster, make_strategy, save_to,
            progress=lambda msg: print(f"  {msg}", flush=True))
    # the prices the factors are measured against: the search's, kernels included
    priced = CostOptions.for_cluster(cluster, **changes)
    measured: list[Any] = []     # one calibration for both factors

    def measure() -> Any:
        if measured:
            return measured[0]
        from tapas.execution.runtime.devices import make_strategy
        n = cluster.num_devices
        which = " and ".join(f"--{name}=measure" for name in ("compute_scale",
                                                               "elementwise_scale")
                             if str(FLAGS[name].value).strip().lower() == "measure")
        print(f"measuring the model's compute scale on {n} devices ({which})")
        cal = calibrate_compute(loaded.model, loaded.specs, cluster=cluster,
                                distribute_strategy=make_strategy(n), loss=loaded.loss,
                                training=bool(FLAGS.training), options=priced,
                                progress=lambda msg: print(f"  {msg}", flush=True))
        print(f"  {cal.describe()}")
        measured.append(cal)
        return cal

    calibration = None
    for name, resolve in (("compute_scale", resolve_compute_scale),
                          ("elementwise_scale", resolve_elementwise_scale)):
        value = FLAGS[name].value
        if value is None:
            continue
        try:
            changes[name], cal = resolve(value, FLAGS.cluster, measure)
        except ValueError as e:
            raise app.UsageError(f"--{name}={value}: {e}") from None
        calibration = calibration or cal
    return CostOptions.for_cluster(cluster, **changes), calibration


def _communication_options(cluster: Any, loaded: LoadedModel, graph: Any, options: Any,
                           loss: Any) -> tuple[Any, Any]:
    """``(CostOptions or None, CommunicationCalibration or None)``: ``options`` with
    ``--communication_scale`` (a given factor, or one measured here on ``graph``'s
    data-parallel plan: 'measure') when it is given."""
    if FLAGS.communication_scale is None:
        return options, None
    from tapas.execution.calibration.communication_scale import (calibrate_communication,
                                                                 resolve_communication_scale)
    from tapas.planning.cost import CostOptions
    base = CostOptions.for_cluster(cluster) if options is None else options

    def measure() -> Any:
        from tapas.execution.runtime.devices import make_strategy
        n = cluster.num_devices
        print(f"measuring the model's communication scale on {n} devices "
              "(--communication_scale=measure)")
        cal = calibrate_communication(loaded.model, loaded.specs, cluster=cluster,
                                      distribute_strategy=make_strategy(n), loss=loaded.loss,
                                      training=bool(FLAGS.training),
                                      options=dataclasses.replace(base, loss=loss),
                                      graph=graph,
                                      progress=lambda msg: print(f"  {msg}", flush=True))
        print(f"  {cal.describe()}")
        return cal

    try:
        scale, calibration = resolve_communication_scale(FLAGS.communication_scale,
                                                         FLAGS.cluster, measure)
    except ValueError as e:
        raise app.UsageError(f"--communication_scale={FLAGS.communication_scale}: "
                             f"{e}") from None
    if calibration is not None:      # measured: its factors (activations' too, if measured)
        return calibration.cost_options(base), calibration
    return dataclasses.replace(base, communication_scale=scale), calibration


def _loss_text(loss: Any) -> str:
    """``SparseCategoricalCrossentropy(from_logits=True)``: a loss as the search reads it."""
    from tapas.sharding.losses import LossSpec
    spec = LossSpec.of(loss)
    return spec.name + ("(from_logits=True)" if spec.from_logits else "")


def _search_meshes(graph: ir.Graph, trace: Any, cluster: Any, loss: Any,
                   loaded: Any) -> dict[str, Any]:
    """`tapas search --meshes`: every rows x cols mesh (tapas.planning.mesh), each row's
    graph captured again at its share of the batch (from the same model object: building
    the model again for every row count held a copy of its weights each, 5 GB for
    moe-1.3b)."""
    import tensorflow as tf

    from tapas import capturing
    from tapas.execution.runtime.inputs import InputSignature
    from tapas.planning import explore
    from tapas.planning import mesh as mesh_lib
    from tapas.planning import search as search_lib
    try:
        meshes = [mesh_lib.Mesh.parse(FLAGS.mesh)] if FLAGS.mesh else None
    except ValueError as e:
        raise app.UsageError(f"--mesh={FLAGS.mesh}: {e}") from None
    if meshes and meshes[0].num_devices != cluster.num_devices:
        raise app.UsageError(f"--mesh={FLAGS.mesh} has {meshes[0].num_devices} devices, the "
                             f"cluster {cluster.num_devices} (--nodes x --devices_per_node)")
    batch = int(tf.nest.flatten(trace.input_specs)[0].shape[0])

    def graph_for(rows: int) -> ir.Graph:
        if rows == 1:
            return graph
        specs = InputSignature.of(loaded.model, loaded.specs).per_row(rows).spec_structure()
        return capturing.capture(loaded.model, specs, training=bool(FLAGS.training),
                                 name=f"{loaded.name}/batch{batch // rows}")

    def say(r: Any) -> None:
        print(f"  {r.mesh}: " + (f"{r.total * 1e3:.3f} ms per step" if r.ok else r.note)
              + f" (capture {r.capture_seconds:.1f} s, search {r.search_seconds:.1f} s)",
              flush=True)

    budget = None if FLAGS.memory_budget_gib is None else FLAGS.memory_budget_gib * 2**30
    print(f"searching the meshes of {cluster.name} ({cluster.num_devices} devices, batch "
          f"{batch}) with --mode={FLAGS.mode}:", flush=True)
    try:
        result = mesh_lib.search_meshes(
            graph_for, batch, cluster, search=search_lib.search, meshes=meshes,
            on_result=say, mode=FLAGS.mode, top_k=FLAGS.top_k, memory_budget=budget,
            explore_options=explore.ExploreOptions(top_k=FLAGS.top_k,
                                                   time_limit=FLAGS.time_limit), loss=loss)
        best = result.best
    except (ValueError, explore.SearchTimeout) as e:
        raise app.UsageError(str(e)) from None
    print()
    print(result.summary())
    print(f"search time over the meshes {result.search_seconds:.2f} s (capture excluded)")
    print(f"\nbest mesh {best.mesh}: the strategy of one row of {best.mesh.cols} device(s):")
    print(best.strategy.summary(graph_for(best.mesh.rows)))
    if FLAGS.out:
        best.strategy.save(FLAGS.out)
        print(f"\nthe row's strategy written to {FLAGS.out} (mesh {best.mesh})")
    return {"model": graph.name, "meshes": result.to_json()}
