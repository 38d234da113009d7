"""What the ``tapas`` commands share: the flags more than one command reads, loading
``--model`` and capturing it, writing a report file.

In:  absl's parsed flags (``FLAGS``).
Out: :func:`load_model` (a :class:`LoadedModel`), :func:`capture_flags_model` (the IR graph,
     the trace, the IR-conversion seconds, the loaded model), :func:`write`.
Raises: ``absl.app.UsageError`` naming ``--model`` and the choices when it is neither a zoo
     model nor a saved ``.keras`` file.
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import app, flags

from tapas import ir
from tapas.planning.cost import CLUSTER_PRESETS

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Model-zoo name (see `tapas models`) or a saved .keras "
                    "file. Default: the zoo's default model.")
flags.DEFINE_integer("batch_size", None, "Batch size to trace with (default: the model's).")
flags.DEFINE_string("json_out", None, "Write the command's report as JSON to this path.")
flags.DEFINE_boolean("training", None, "Capture the training-mode graph (dropout, batch-norm "
                     "statistics updates). Default: on for train (as model.fit), off for the "
                     "other commands; --notraining trains the inference graph.")
flags.DEFINE_string("draw", None, "mine: draw the folded graph to this image (.png/.svg/.pdf); "
                    "search: draw the strategy (each template's layers: pattern, weight "
                    "splits, collectives) beside --draw_references.")
flags.DEFINE_string("cluster", "v100", f"search, train: hardware constants: a preset "
                    f"({', '.join(sorted(CLUSTER_PRESETS))}: the paper's V100 nodes, NVLink + "
                    "100 Gb/s Ethernet, or this machine's loopback CPU devices) or a cluster "
                    "file written by `tapas profile --out=cluster.json`.")
flags.DEFINE_string("out", None, "search: write the Strategy as JSON to this path; profile: "
                    "write the cluster file here (default out/cluster.json); export: write "
                    "the layout here (.json, or .py for a Python module).")
flags.DEFINE_string("mesh", None, "search: search this one mesh ROWSxCOLS (e.g. 2x8) instead "
                    "of all of them; export: the layout's DeviceMesh (the row's strategy on "
                    "COLS devices, the batch over the ROWS); train: run on this mesh (data "
                    "parallel over the rows, "
                    "--strategy made for COLS devices on one row's graph inside each row). "
                    "ROWSxCOLS:experts also splits the experts of every MoE layer over the "
                    "rows (nested expert + tensor parallelism, tapas.planning.experts).")
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
flags.DEFINE_float("memory_budget_gib", None, "search: GiB per device a plan may use "
                   "(default: the cluster's device memory).")
flags.DEFINE_integer("devices", 4, "train: devices to shard over; profile: devices to "
                     "measure (logical CPU devices, or the GPUs present).")
flags.DEFINE_integer("workers", 0, "train, profile: launch this many processes on 127.0.0.1 "
                     "under MultiWorkerMirroredStrategy (one device each; train: "
                     "--devices_per_worker each).")


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
        from tapas.execution.api import preflight
        try:
            preflight.check_model_file(name)
        except preflight.PreflightError as e:
            raise app.UsageError(str(e)) from None
        import keras
        import tensorflow as tf
        from tapas.execution.runtime.inputs import keras_structure
        from tapas.execution.api.parallel import training_loss
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


def capture_flags_model() -> tuple[ir.Graph, Any, float, LoadedModel]:
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


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path``, creating its directory."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
