"""The ``tapas`` command line (an absl app).

    tapas inspect --model=NAME [--batch_size=N] [--graph_out=ir.json] [--top=10]
    tapas mine    --model=NAME [--min_size=N] [--min_support=K] [--draw=folded.png]
    tapas models
    tapas profile --devices=N [--sizes=1KiB:16MiB] [--repeats=7] --out=cluster.json
                  [--plot=residuals.png] [--nogamma]
    tapas search  --model=NAME --nodes=M --devices_per_node=N [--mode=gp|es] [--out=s.json]
                  [--cluster=file.json [--compute_scale=measure] [--kernel_times=measure]
                  [--communication_scale=measure] [--elementwise_scale=measure]]
                  [--meshes | --mesh=ROWSxCOLS]
                  [--draw=strategy.png]
    tapas train   --model=NAME --devices=N --steps=K [--strategy=s.json|random:SEED] [--verify]
                  [--workers=K [--devices_per_worker=D]] [--optimizer=NAME|config.json] [--learning_rate=LR]
                  [--data=file.npz|file.tfrecord] [--epochs=E] [--checkpoint_dir=DIR]
                  [--checkpoint_every=K] [--resume] [--tensorboard=LOGDIR] [--mesh=ROWSxCOLS]

``--model`` takes a model-zoo name (``tapas models`` lists them) or the path of a saved
Keras model (``.keras``). Each command prints a report to stdout; ``--json_out`` writes the
same numbers as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from tapas import ir
from tapas.planning.cost import CLUSTER_PRESETS

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Model-zoo name (see `tapas models`) or a saved .keras "
                    "file. Default: the zoo's default model.")
flags.DEFINE_integer("batch_size", None, "Batch size to trace with (default: the model's).")
flags.DEFINE_string("graph_out", None, "inspect: write the captured IR as JSON to this path.")
flags.DEFINE_string("json_out", None, "Write the command's report as JSON to this path.")
flags.DEFINE_integer("top", 10, "inspect: how many of the largest GraphNodes to list.")
flags.DEFINE_boolean("training", None, "Capture the training-mode graph (dropout, batch-norm "
                     "statistics updates). Default: on for train (as model.fit), off for the "
                     "other commands; --notraining trains the inference graph.")
flags.DEFINE_integer("min_size", None, "mine: fewest GraphNodes a template may hold "
                     "(default: tapas.mining.DEFAULT_MIN_SIZE).")
flags.DEFINE_integer("min_support", None, "mine: fewest non-overlapping occurrences of a "
                     "frequent subgraph (default: the number of layers detected).")
flags.DEFINE_string("draw", None, "mine: draw the folded graph to this image (.png/.svg/.pdf); "
                    "search: draw the strategy (each template's layers: pattern, weight "
                    "splits, collectives) beside --draw_references.")
flags.DEFINE_list("draw_references", ["megatron", "ffn-only", "mha-only"],
                  "search --draw: reference plans drawn beside the strategy (those that "
                  "apply to the model; empty: none).")
flags.DEFINE_string("folded_out", None, "mine: write the FoldedGraph as JSON to this path.")
flags.DEFINE_integer("nodes", 1, "search: machines in the cluster (m of S(m, n)).")
flags.DEFINE_integer("devices_per_node", 8, "search: devices per machine (n of S(m, n)).")
flags.DEFINE_enum("mode", "gp", ["gp", "es"], "search: 'gp' searches each unique subgraph "
                  "once (graph-pruned), 'es' the whole graph (exhaustive).")
flags.DEFINE_string("cluster", "v100", f"search, train: hardware constants: a preset "
                    f"({', '.join(sorted(CLUSTER_PRESETS))}: the paper's V100 nodes, NVLink + "
                    "100 Gb/s Ethernet, or this machine's loopback CPU devices) or a cluster "
                    "file written by `tapas profile --out=cluster.json`.")
flags.DEFINE_string("out", None, "search: write the Strategy as JSON to this path; profile: "
                    "write the cluster file here (default out/cluster.json).")
flags.DEFINE_boolean("meshes", False, "search: also search every 2-D mesh rows x cols of the "
                     "devices (data parallel over the rows, the searched strategy in each row: "
                     "tapas.planning.mesh) and print the best cost per mesh.")
flags.DEFINE_string("mesh", None, "search: search this one mesh ROWSxCOLS (e.g. 2x8) instead "
                    "of all of them; train: run on this mesh (data parallel over the rows, "
                    "--strategy made for COLS devices on one row's graph inside each row). "
                    "ROWSxCOLS:experts also splits the experts of every MoE layer over the "
                    "rows (nested expert + tensor parallelism, tapas.planning.experts).")
flags.DEFINE_boolean("price_loss", True, "search: price the collectives of the training "
                     "loss on the output's placement (the zoo model's loss; a saved model's "
                     "compiled loss, else mean squared error, as tapas train uses); "
                     "--noprice_loss: leave them out (the paper's cost model).")
flags.DEFINE_string("compute_scale", None, "search, train: multiply every plan's compute by "
                    "this factor (CostOptions.compute_scale), or 'measure': first time the model's "
                    "replicated training step at the batch and at batch / N on N devices here "
                    "(the cluster file's N, profiled on this machine) against what the cost "
                    "model prices for them (with --kernel_times, its measured kernels), and "
                    "use that factor.")
flags.DEFINE_string("elementwise_scale", None, "search: multiply the memory-bound ops' time "
                    "(their elements at the cluster's elementwise rate) by this factor "
                    "(CostOptions.elementwise_scale), or 'measure': time the model's "
                    "replicated step at the batch and at batch / N as --compute_scale does "
                    "(one calibration serves both) and take what the difference leaves "
                    "beyond the priced contractions and convolutions (with --kernel_times, "
                    "their measured kernels) per second of the memory-bound ops' price.")
flags.DEFINE_string("kernel_times", None, "search, train: price every contraction and "
                    "convolution "
                    "by the measured training-step time of its kernel at its local shapes "
                    "(CostOptions.kernel_times): 'measure' times them first on the cluster "
                    "file's N devices here (and writes them beside --out, NAME_kernels.json, "
                    "or to out/kernel_times.json), or the path of such a file.")
flags.DEFINE_string("communication_scale", None, "search, train: multiply every collective's "
                    "cost by this factor (CostOptions.communication_scale), or 'measure': "
                    "first time the model's data-parallel plan on N devices here (the cluster "
                    "file's N, profiled on this machine; one process) with and without its "
                    "collectives against what the cost model prices for them, and use that "
                    "factor; and a second plan whose collectives are mostly activations' "
                    "the same way, for a factor of collectives that do not reduce a weight's "
                    "gradient (CostOptions.activation_communication_scale).")
flags.DEFINE_integer("top_k", 5, "search: ranked whole-plan alternatives to keep.")
flags.DEFINE_float("time_limit", None, "search: seconds before the search gives up "
                   "(e.g. for --mode=es on a large model).")
flags.DEFINE_float("memory_budget_gib", None, "search: GiB per device a plan may use "
                   "(default: the cluster's device memory).")
flags.DEFINE_string("sizes", None, "profile: message sizes, 'SMALLEST:LARGEST' (by factors "
                    "of 4) or a list '4KiB,1MiB,...' (default 1KiB:16MiB).")
flags.DEFINE_integer("repeats", 7, "profile: timed calls per point (the fastest is used).")
flags.DEFINE_string("plot", None, "profile: the residual plot PNG (default: beside --out, "
                    "NAME_residuals.png; '' for none).")
flags.DEFINE_boolean("gamma", True, "profile: measure the overlap factor gamma (--nogamma "
                     "keeps the prior).")
flags.DEFINE_boolean("elementwise", True, "profile: fit the FLOP rate and the elementwise "
                     "rate (at which the cost model prices memory-bound ops) to training "
                     "steps of reference blocks (--noelementwise: the FLOP rate of a matmul, "
                     "every op priced by its FLOPs at it, as the paper).")
flags.DEFINE_boolean("widths", True, "profile: measure the FLOP rate of matrix multiplies "
                     "by their width (8 to 256), at which the cost model prices thin layers "
                     "(--nowidths: every width at one rate).")

flags.DEFINE_integer("devices", 4, "train: devices to shard over; profile: devices to "
                     "measure (logical CPU devices, or the GPUs present).")
flags.DEFINE_integer("steps", 3, "train: optimizer steps.")
flags.DEFINE_string("strategy", None, "train: a Strategy JSON (`tapas search --out`), or "
                    "'random:SEED' for a random valid plan; default: search on --cluster.")
flags.DEFINE_boolean("verify", False, "train: run the single-device Keras model side by side "
                     "and report the largest differences.")
flags.DEFINE_integer("workers", 0, "train, profile: launch this many processes on 127.0.0.1 "
                     "under MultiWorkerMirroredStrategy (one device each; train: "
                     "--devices_per_worker each).")
flags.DEFINE_integer("devices_per_worker", 1, "train --workers: local devices of each worker "
                     "(logical CPU devices on a host without GPUs; with GPUs, the number "
                     "each worker sees), e.g. --workers=2 --devices_per_worker=2 "
                     "--mesh=2x2 puts one mesh row in each process.", lower_bound=1)
flags.DEFINE_string("optimizer", None, "train: Keras optimizer name or config JSON file (default: compiled).")
flags.DEFINE_enum("graph_optimization", "lean", ["lean", "default"], "train: Grappler's "
                  "options for the step functions: lean (one round of passes; on CPUs without "
                  "the layout and memory optimizers: a faster first step) or TensorFlow's "
                  "default.")
flags.DEFINE_float("learning_rate", None, "train: learning rate (default: Keras's).")
flags.DEFINE_string("data", None, "train: an .npz of training data: one array per model "
                    "input, named by input name (x for a one-input model), and the targets "
                    "y, the first axis counting examples; or .tfrecord file(s) (a glob or a "
                    "comma-separated list) of tf.train.Example records with the same "
                    "features, each flattened (tapas.execution.train.save_tfrecord writes "
                    "them); trained with ParallelModel.fit in global batches of "
                    "--batch_size (default: the model's synthetic batch).")
flags.DEFINE_integer("epochs", None, "train: epochs (passes over --data; with the synthetic "
                     "batch, --steps steps each). Default 1 when a training job is asked for.")
flags.DEFINE_string("checkpoint_dir", None, "train: write checkpoints here (ckpt-<step>, "
                    "atomic, the newest 3 kept) at each epoch end and every "
                    "--checkpoint_every steps.")
flags.DEFINE_integer("checkpoint_every", None, "train: also checkpoint after every K steps.")
flags.DEFINE_boolean("resume", False, "train: continue from the newest checkpoint in "
                     "--checkpoint_dir (start afresh when there is none): run the same "
                     "command again after a failure.")
flags.DEFINE_string("tensorboard", None, "train: write TensorBoard scalars (loss, step time, "
                    "examples/s, learning rate) to this log directory.")

COMMANDS = ("inspect", "mine", "models", "search", "train", "profile")


# ---- loading models ------------------------------------------------------------------------

class LoadedModel:
    """A model ready to capture: the Keras model, its input specs, a display name and the
    loss it trains with (``keras.losses.Loss``)."""

    def __init__(self, name: str, model: Any, specs: Any, build_seconds: float,
                 loss: Any = None) -> None:
        self.name, self.model, self.specs, self.build_seconds = name, model, specs, build_seconds
        self.loss = loss


def load_model(name: str | None, batch_size: int | None = None,
               fast_init: bool = True) -> LoadedModel:
    """Build a zoo model by name, or load a saved ``.keras`` file."""
    from tapas import models
    name = name or models.DEFAULT_MODEL
    start = time.perf_counter()
    if name.endswith(".keras") or os.path.sep in name:
        if not os.path.exists(name):
            raise app.UsageError(f"--model={name}: no such file; give a zoo name "
                                 f"({', '.join(models.names()[:4])}, ...) or a saved .keras path")
        import keras
        import tensorflow as tf
        from tapas.execution.inputs import keras_structure
        from tapas.execution.parallel import training_loss
        try:   # compiled: its loss is the one tapas train uses
            model = keras.saving.load_model(name)
        except Exception:  # noqa: BLE001  (a compile config Keras cannot rebuild here)
            model = keras.saving.load_model(name, compile=False)
        try:
            loss = training_loss(model)
        except ValueError:
            loss = None
        # in the model's own input structure (a dict for keras-hub models), batch filled in
        specs = keras.tree.map_structure(
            lambda t: tf.TensorSpec((batch_size or 8,) + tuple(t.shape[1:]), t.dtype,
                                    name=t.name), keras_structure(model))
        return LoadedModel(os.path.basename(name), model, specs, time.perf_counter() - start,
                           loss)
    try:
        entry = models.get(name)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    model = entry.build(fast_init=fast_init)
    return LoadedModel(name, model, list(entry.input_spec(batch_size)),
                       time.perf_counter() - start, entry.keras_loss())


# ---- inspect ---------------------------------------------------------------------------------

def inspect_report(graph: ir.Graph, trace_s: float, ir_s: float, tf_ops: int,
                   top: int = 10) -> dict[str, Any]:
    """The numbers `tapas inspect` prints, as a dict."""
    biggest = sorted(graph.nodes, key=lambda n: -n.num_params)[:top]
    return {
        "model": graph.name,
        "tf_ops": tf_ops,
        "ir_ops": graph.num_ops,
        "dead_ops": len(graph.dead_ops),
        "graph_nodes": len(graph.nodes),
        "edges": len(graph.edges),
        "kinds": graph.kind_counts(),
        "unique_signatures": len({n.signature for n in graph.nodes}),
        "params": graph.num_params,
        "weights": len(graph.weights),
        "unused_weights": [w.path for w in graph.unused_weights],
        "trace_seconds": round(trace_s, 4),
        "ir_seconds": round(ir_s, 4),
        "top_nodes": [{"id": n.id, "name": n.name, "kind": n.kind.value, "params": n.num_params,
                       "weights": [f"{w.path} {list(w.shape)}" for w in n.weights]}
                      for n in biggest if n.num_params > 0],
    }


def format_inspect(r: dict[str, Any]) -> str:
    lines = [f"model            {r['model']}",
             f"TF ops           {r['tf_ops']:,}  ({r['dead_ops']} dead, in no GraphNode)",
             f"GraphNodes       {r['graph_nodes']:,}  ({r['unique_signatures']} distinct "
             f"signatures, {r['edges']:,} edges)",
             f"parameters       {r['params']:,}  in {r['weights']} weights",
             f"capture time     {r['trace_seconds'] + r['ir_seconds']:.3f} s  (trace "
             f"{r['trace_seconds']:.3f} s, IR conversion {r['ir_seconds']:.3f} s)",
             "", "GraphNodes by kind:"]
    for kind, count in r["kinds"].items():
        lines.append(f"  {kind:<18} {count:>6}")
    if r["unused_weights"]:
        lines.append(f"\nweights the traced graph never reads: {', '.join(r['unused_weights'])}")
    lines += ["", f"largest GraphNodes by weight size (top {len(r['top_nodes'])}):",
              f"  {'id':>5}  {'kind':<16} {'params':>14}  name"]
    for n in r["top_nodes"]:
        lines.append(f"  {n['id']:>5}  {n['kind']:<16} {n['params']:>14,}  {n['name']}")
    return "\n".join(lines)


def _capture_flags_model() -> tuple[ir.Graph, Any, float, LoadedModel]:
    """Load --model and capture it: (IR graph, the Trace, IR-conversion seconds, the loaded
    model)."""
    from tapas import capturing
    from tapas.progress import ProgressBar
    loaded = load_model(FLAGS.model, FLAGS.batch_size)
    with ProgressBar(f"tracing '{loaded.name}'").ticking():
        trace = capturing.trace(loaded.model, loaded.specs, training=bool(FLAGS.training),
                                name=loaded.name)
    start = time.perf_counter()
    with ProgressBar("reading the graph: ops").ticking() as bar:
        graph = capturing.to_ir(trace, progress=bar.update)
    return graph, trace, time.perf_counter() - start, loaded


def cmd_inspect() -> dict[str, Any]:
    graph, trace, ir_s, _ = _capture_flags_model()
    report = inspect_report(graph, trace.seconds, ir_s, len(trace.graph.get_operations()),
                            FLAGS.top)
    print(format_inspect(report))
    if FLAGS.graph_out:
        _write(FLAGS.graph_out, graph.dumps())
        print(f"\nIR written to {FLAGS.graph_out}")
    return report


# ---- mine ------------------------------------------------------------------------------------

def cmd_mine() -> dict[str, Any]:
    from absl import logging

    from tapas import mining
    graph, trace, ir_s, _ = _capture_flags_model()
    capture_s = trace.seconds + ir_s
    print(f"captured '{graph.name}': {len(graph.nodes):,} GraphNodes from "
          f"{len(trace.graph.get_operations()):,} TF ops in {capture_s:.3f} s")

    from tapas.progress import ProgressBar
    bar = ProgressBar("mining")

    def progress(level: Any) -> None:
        logging.vlog(1, "mining round %d, level %d: %d candidates, %d frequent (%.3f s)",
                     level.round, level.level, level.candidates, level.frequent, level.seconds)
        bar.update(0, None, f"round {level.round}, level {level.level}: "
                                      f"{level.candidates:,} candidates, "
                                      f"{level.frequent:,} frequent")

    try:
        with bar.ticking():
            folded = mining.mine(graph, min_support=FLAGS.min_support,
                                 min_size=FLAGS.min_size or mining.DEFAULT_MIN_SIZE,
                                 progress=progress)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(folded.summary())
    report = {"model": graph.name, "capture_seconds": round(capture_s, 4),
              "folded": folded.to_json()}
    if FLAGS.folded_out:
        _write(FLAGS.folded_out, json.dumps(folded.to_json(), indent=1))
        print(f"\nFoldedGraph written to {FLAGS.folded_out}")
    if FLAGS.draw:
        mining.draw_folded(folded, graph, FLAGS.draw)
        print(f"folded graph drawn to {FLAGS.draw}")
    return report


# ---- search ----------------------------------------------------------------------------------

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


def cmd_search() -> dict[str, Any]:
    from tapas.planning import explore
    from tapas.planning import search as search_lib
    from tapas.planning.cost import Cluster
    from tapas.planning.cluster import ClusterFileError
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
    from tapas.execution.communication_scale import check_communication_scale
    from tapas.execution.compute_scale import check_compute_scale, check_elementwise_scale
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
        from tapas.execution.kernels import check_kernel_times
        try:
            check_kernel_times(FLAGS.kernel_times, FLAGS.cluster, cluster.num_devices)
        except ValueError as e:
            raise app.UsageError(f"--kernel_times={FLAGS.kernel_times}: {e}") from None
    measures = [str(FLAGS.compute_scale).strip().lower() == "measure",
                str(FLAGS.elementwise_scale).strip().lower() == "measure",
                str(FLAGS.kernel_times).strip().lower() == "measure",
                str(FLAGS.communication_scale).strip().lower() == "measure"]
    if any(measures) and FLAGS.cluster not in CLUSTER_PRESETS:
        # the cluster's devices, before the capture runs any TensorFlow op (logical CPU
        # devices are set once per process)
        from tapas.execution.devices import setup_devices
        setup_devices(cluster.num_devices)
    graph, trace, ir_s, loaded = _capture_flags_model()
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
            progress=progress, loss=loss, options=options)
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
    from tapas.execution.compute_scale import (calibrate_compute, resolve_compute_scale,
                                               resolve_elementwise_scale)
    from tapas.planning.cost import CostOptions
    if FLAGS.compute_scale is None and FLAGS.kernel_times is None and \
            FLAGS.elementwise_scale is None:
        return None, None
    changes: dict[str, Any] = {}
    if FLAGS.kernel_times is not None:
        from tapas.execution.devices import make_strategy
        from tapas.execution.kernels import resolve_kernel_times
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
        from tapas.execution.devices import make_strategy
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
    from tapas.execution.communication_scale import (calibrate_communication,
                                                     resolve_communication_scale)
    from tapas.planning.cost import CostOptions
    base = CostOptions.for_cluster(cluster) if options is None else options

    def measure() -> Any:
        from tapas.execution.devices import make_strategy
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
    from tapas.execution.inputs import InputSignature
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


def cmd_train() -> dict[str, Any]:
    from tapas.execution import train
    if FLAGS.elementwise_scale is not None:
        raise app.UsageError(f"--elementwise_scale={FLAGS.elementwise_scale} prices `tapas "
                             "search` only: search with it (--out=s.json) and train that "
                             "plan with --strategy=s.json")
    opts = train.TrainOptions(model=FLAGS.model, devices=FLAGS.devices, steps=FLAGS.steps,
                              strategy=FLAGS.strategy, verify=FLAGS.verify,
                              workers=FLAGS.workers, optimizer=FLAGS.optimizer,
                              devices_per_worker=FLAGS.devices_per_worker,
                              learning_rate=FLAGS.learning_rate, batch_size=FLAGS.batch_size,
                              cluster=FLAGS.cluster, json_out=FLAGS.json_out,
                              memory_budget_gib=FLAGS.memory_budget_gib,
                              training=FLAGS.training, data=FLAGS.data,
                              epochs=FLAGS.epochs, checkpoint_dir=FLAGS.checkpoint_dir,
                              checkpoint_every=FLAGS.checkpoint_every, resume=FLAGS.resume,
                              tensorboard=FLAGS.tensorboard, mesh=FLAGS.mesh,
                              graph_optimization=FLAGS.graph_optimization,
                              compute_scale=FLAGS.compute_scale,
                              kernel_times=FLAGS.kernel_times,
                              communication_scale=FLAGS.communication_scale)
    from absl import logging
    logging.set_verbosity(logging.WARNING)   # tf.distribute logs every collective at INFO
    try:
        return train.train(opts)
    except train.TrainError as e:
        # a failed run (a worker lost, verify failed), not a usage mistake: no flag listing
        print(f"tapas train: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def cmd_profile() -> dict[str, Any]:
    """Measure the collectives and compute of --devices devices, fit the cost model, write
    the cluster file (tapas.execution.profiling)."""
    from absl import logging
    # tf.distribute logs every collective at INFO, tf.function each new point's trace at
    # WARNING (every size is a new function, on purpose)
    logging.set_verbosity(logging.ERROR)
    from tapas.execution import profiling
    try:
        sizes = None if FLAGS.sizes is None else profiling.parse_sizes(FLAGS.sizes)
    except ValueError as e:
        raise app.UsageError(f"--sizes={FLAGS.sizes}: {e}") from None
    if FLAGS.devices < 2:
        raise app.UsageError(f"--devices={FLAGS.devices}: a collective needs at least 2 "
                             "devices; use --devices=2 or more")
    if FLAGS.repeats < 3:
        raise app.UsageError(f"--repeats={FLAGS.repeats}: at least 3 timed calls per "
                             "point are needed; use --repeats=3 or more")
    out = FLAGS.out or os.path.join("out", "cluster.json")
    plot = FLAGS.plot if FLAGS.plot is not None else os.path.splitext(out)[0] + "_residuals.png"
    if FLAGS.workers:
        return _profile_workers(out, plot)
    from tapas.execution import devices
    chief = devices.is_chief_process()
    result = profiling.profile(FLAGS.devices, sizes=sizes, repeats=FLAGS.repeats,
                               gamma=FLAGS.gamma, elementwise=FLAGS.elementwise,
                               widths=FLAGS.widths,
                               progress=(lambda line: print(line, flush=True)) if chief else None)
    if not chief:   # every worker measured (the collectives need them all); one writes
        print(f"worker {devices.tf_config()['task'].get('index')}: done; worker 0 writes "
              "the cluster file")
        return {}
    print()
    print(result.table())
    result.save(out)
    print(f"\ncluster file written to {out} ({result.seconds:.1f} s); use it with "
          f"`tapas search --cluster={out}`")
    if plot:
        why_not = result.plot(plot)
        print(f"residual plot: {why_not}" if why_not else f"residual plot written to {plot}")
    return {"cluster": result.cluster.to_json(), "profile": result.to_json()}


def _profile_workers(out: str, plot: str) -> dict[str, Any]:
    """``tapas profile --workers=K``: the same command in K processes on 127.0.0.1 under
    MultiWorkerMirroredStrategy (one device each); worker 0 writes the cluster file, the
    plot and the JSON report; its output is printed; every worker is stopped on failure."""
    from tapas.execution import launch
    k = FLAGS.workers
    if k < 2:
        raise app.UsageError(f"--workers={k}: a collective needs at least 2 workers; use "
                             "--workers=2 or more, or --workers=0 for logical devices")
    if FLAGS["devices"].present and FLAGS.devices != k:
        raise app.UsageError(f"--devices={FLAGS.devices} with --workers={k}: each worker "
                             f"has one device, so the profile spans {k}; leave --devices "
                             f"out or set it to {k}")
    argv = [sys.executable, "-m", "tapas.cli", "profile", f"--devices={k}", "--workers=0",
            f"--repeats={FLAGS.repeats}", f"--gamma={str(FLAGS.gamma).lower()}",
            f"--elementwise={str(FLAGS.elementwise).lower()}",
            f"--widths={str(FLAGS.widths).lower()}",
            f"--out={os.path.abspath(out)}",
            f"--plot={os.path.abspath(plot) if plot else ''}"]
    if FLAGS.sizes is not None:
        argv.append(f"--sizes={FLAGS.sizes}")
    fd, report_path = tempfile.mkstemp(suffix=".json", prefix="tapas-profile-")
    os.close(fd)
    print(f"launching {k} workers on 127.0.0.1 (MultiWorkerMirroredStrategy)", flush=True)
    try:
        results = launch.launch(lambda i: argv + ([f"--json_out={report_path}"] if i == 0
                                                  else []), k, timeout_s=1800.0)
        print(results[0].output, end="")
        with open(report_path) as f:
            report = json.load(f)
    except launch.LaunchError as e:
        # a failed run (a worker lost or timed out), not a usage mistake: no flag listing
        print(f"tapas profile: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        os.unlink(report_path)
    report["worker_seconds"] = [round(r.seconds, 2) for r in results]
    return report


def cmd_models() -> dict[str, Any]:
    from tapas import models
    rows = []
    for name in models.names():
        e = models.get(name)
        rows.append({"name": name, "family": e.family, "params": e.param_count(),
                     "description": e.description})
    print(f"{'name':<24} {'family':<8} {'params':>15}  description")
    for r in rows:
        print(f"{r['name']:<24} {r['family']:<8} {r['params']:>15,}  {r['description']}")
    return {"models": rows}


def _write(path: str, text: str) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# ---- entry point -----------------------------------------------------------------------------

def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[1] not in COMMANDS:
        got = f" (got {argv[1]!r})" if len(argv) >= 2 else ""
        raise app.UsageError(f"usage: tapas {{{'|'.join(COMMANDS)}}} [--flags]{got}; "
                             "`tapas inspect --help` lists the flags")
    if len(argv) > 2:
        raise app.UsageError(f"unexpected arguments {list(argv[2:])}: flags are written "
                             "--name=value")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report = _HANDLERS[argv[1]]()
    # `train` writes its own report (worker 0 only, when it runs as several workers: the
    # others' audits record nothing and must not overwrite it)
    if FLAGS.json_out and argv[1] not in _WRITES_OWN_JSON:
        _write(FLAGS.json_out, json.dumps(report, indent=2, default=str))


_WRITES_OWN_JSON = frozenset({"train"})


_HANDLERS = {"inspect": cmd_inspect, "mine": cmd_mine, "models": cmd_models,
             "search": cmd_search, "train": cmd_train, "profile": cmd_profile}


def run() -> None:
    """Console entry point (``tapas``)."""
    app.run(main)


if __name__ == "__main__":
    run()
