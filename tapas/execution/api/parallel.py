"""``tapas.parallelize``: a Keras model becomes a :class:`ParallelModel` trained under
``tf.distribute`` with a tensor-parallel strategy.

In:  a Keras model, its input specs (static ``tf.TensorSpec`` s: one, a list, a dict keyed by
     input name, or the model's nested structure), a ``tapas.planning.search.Strategy``
     (an object or a JSON path; searched here when ``None``), the devices (``devices=N`` for
     a ``MirroredStrategy`` over N local devices, or ``distribute_strategy=`` any
     ``tf.distribute`` strategy, e.g. ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``),
     the model's Keras optimizer (default: the compiled one, else SGD; or an instance,
     name or config dict, ``learning_rate`` replacing its rate; the user's object is never
     built or changed: ``tapas.execution.training.keras_optimizer``) and a loss.
Out: :class:`ParallelModel` with ``train_step(x, y)``, ``fit(...)`` (Keras-style, with
     callbacks, checkpoints and resume: ``tapas.execution.api.fit``), ``predict(x)``,
     ``evaluate(x, y)``, ``gradients(x, y)``, ``save(path)``, ``save_weights(path)``,
     ``restore(path)``, ``to_keras()``, ``audit()`` (the collectives of the reconstructed
     program against the strategy's prediction) and ``verify(...)`` (the
     single-device Keras model side by side). A batch ``x`` takes every form Keras
     accepts for the model (``tapas.execution.runtime.inputs``: one array, a list in
     ``model.inputs`` order, a dict keyed by input name, the model's own structure).

Pipeline: capture (``tapas.capturing.trace``) -> strategy (given, or ``tapas.search`` on a
cluster of N devices) -> checks (the strategy fits this graph and this device count; every
split divides) -> ``tapas.execution.program.reconstruct.Program`` -> ``tapas.execution.runtime.Runtime``.

Logical CPU devices must be configured before TensorFlow runs any op, so call
``tapas.execution.runtime.devices.setup_devices(N)`` before building the Keras model (the ``tapas train``
command does)::

    tapas.execution.runtime.devices.setup_devices(4)
    model = build_model()
    pm = tapas.parallelize(model, spec, devices=4)   # the compiled optimizer and loss
    pm.train_step(x, y)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from tapas import capturing
from tapas.execution.runtime import inputs, materialize
from tapas.execution import runtime
from tapas.execution.training import keras_optimizer, regularizers
from tapas.execution.checking import verify
from tapas.execution.training.compiled_loss import output_losses
from tapas.execution.training.keras_optimizer import check_supported, resolve_optimizer
from tapas.execution.runtime.devices import make_strategy
from tapas.execution.checking.audit import AuditReport, predicted_comm_list
from tapas.execution.api.callbacks import save_keras
from tapas.planning.cost import Cluster

__all__ = ["parallelize", "ParallelModel", "random_plan", "loss_object"]

def matching_plan(graph: Any, num_devices: int, program: Any,
                  names: Mapping[str, str] | None = None) -> Any:
    """A plan of ``graph`` (another graph of the same model, e.g. its inference mode) that
    keeps every weight where ``program`` keeps it: per GraphNode, among the patterns of
    ``tapas.sharding.patterns.patterns_for`` that place each of its weights as
    ``program.weight_layouts`` does, the one named as the GraphNode of the same name in
    ``names`` (the other plan's choice), else the first such; a GraphNode without weights
    takes that same-named pattern when it has one, else it is replicated, as is one none of
    whose patterns keeps its weights (e.g. Dense and batch norm fused into one GraphNode
    in inference mode: ``Runtime.sharing`` then keeps a copy of those weights).
    Reconstruction reshards between any two choices, so the plan is valid."""
    from tapas.execution.program import reconstruct
    from tapas.planning.strategy import graph_digest
    from tapas.sharding import patterns
    names = dict(names or {})
    layouts = program.weight_layouts
    chosen = {}
    for node in graph.nodes:
        pats = patterns.patterns_for(node, graph, num_devices)
        fits = [p for p in pats
                if all(w.path not in layouts or p.weights[w.path] == layouts[w.path].placement
                       for w in node.weights)]
        same = [p for p in fits if p.name == names.get(node.name)]
        replicate = [p for p in pats if p.family is patterns.Family.REPLICATE]
        rest = fits if node.weights and fits else replicate or fits or pats
        chosen[node.id] = (same or rest)[0]
    return reconstruct.Plan(num_devices, chosen, graph_digest=graph_digest(graph))


def random_plan(graph: Any, num_devices: int, seed: int, p_shard: float = 0.7,
                patterns_fn: Any = None) -> Any:
    """A random valid plan: per GraphNode, one of ``tapas.sharding.patterns.patterns_for``
    (or of ``patterns_fn(node, graph, num_devices)``, e.g.
    ``tapas.planning.experts.nested_patterns``) (a non-replicating one with probability
    ``p_shard`` when there is one). Reconstruction reshards between any two choices, so
    every such plan is valid."""
    import random

    from tapas.sharding import patterns
    from tapas.execution.program import reconstruct
    from tapas.planning.strategy import graph_digest
    rng = random.Random(seed)
    chosen = {}
    patterns_fn = patterns.patterns_for if patterns_fn is None else patterns_fn
    for node in graph.nodes:
        pats = patterns_fn(node, graph, num_devices)
        sharded = [p for p in pats if p.name != patterns.REPLICATE]
        pool = sharded if sharded and rng.random() < p_shard else pats
        chosen[node.id] = rng.choice(pool)
    return reconstruct.Plan(num_devices, chosen, graph_digest=graph_digest(graph))


class ParallelModel:
    """A Keras model reconstructed under a strategy and running on N devices."""

    def __init__(self, model: Any, trace: Any, graph: Any, plan: Any, program: Any,
                 rt: runtime.Runtime, timings: Mapping[str, float], training: bool,
                 signature: inputs.InputSignature | None = None,
                 compiled_loss: bool = False) -> None:
        self.model, self.trace, self.graph = model, trace, graph
        self.inputs = signature or inputs.InputSignature.of(model, trace.input_specs)
        # what a program of one mesh row is captured with (the global inputs in 1-D)
        self.row_inputs = self.inputs.per_row(rt.rows)
        # the plan the program was rebuilt from (``tapas.execution.program.plan.Plan``)
        self.plan, self.program, self.runtime = plan, program, rt
        self.timings, self.training = dict(timings), training
        self._inference: ParallelModel | None = None   # for_inference(), built on demand
        self.compiled_loss = compiled_loss   # it trains the loss the model is compiled with

    @property
    def num_devices(self) -> int:
        return self.runtime.num_devices

    @property
    def strategy(self) -> Any:
        """The ``tapas.planning.search.Strategy`` the plan came from (searched or given),
        bound to :attr:`graph`; None for a plan chosen otherwise (``random_plan``, ...)."""
        return self.plan.strategy

    def for_inference(self) -> ParallelModel:
        """The ParallelModel that evaluates as Keras's ``evaluate`` and ``val_loss`` do: in
        inference mode (dropout off, batch norm on its moving statistics). This one when it
        already runs the inference graph, or when its training graph has neither dropout
        nor batch statistics (the two graphs compute the same); otherwise the model's
        inference-mode graph, planned to keep every weight where this program keeps it
        (:func:`matching_plan`) and run on the *same* weight shards
        (``Runtime.sharing``; a weight it must place otherwise is re-cut from this
        program's values by ``runtime.refresh()`` before each evaluation), built once."""
        if not self.training or not (getattr(self.program, "has_writes", False)
                                     or getattr(self.program, "states", None)):
            return self
        if self._inference is None:
            from tapas.execution.program import reconstruct
            start = time.perf_counter()
            timings: dict[str, float] = {}
            trace, graph = _capture(self.model, self.row_inputs, False, timings)
            plan = matching_plan(graph, self.num_devices, self.program, self.plan_patterns())
            program = reconstruct.Program(trace, graph, plan,
                                          expert_rows=getattr(self.program, "expert_rows", 1))
            rt = self.runtime.sharing(program, trace.input_specs)
            timings["inference_program"] = time.perf_counter() - start
            self._inference = ParallelModel(self.model, trace, graph, plan, program, rt,
                                            timings, False, self.inputs)
        return self._inference

    def plan_patterns(self) -> dict[str, str]:
        """The chosen pattern's name per GraphNode name."""
        plan = self.program.plan
        return {n.name: plan.pattern(n).name for n in self.graph.nodes}

    # the runtime's operations
    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> float:
        """One optimizer step on the global batch; returns the loss (see Runtime.train_step).
        ``x`` in any form Keras accepts for the model (module docstring); ``sample_weight``
        weighs the loss as Keras's ``train_on_batch`` does."""
        return self.runtime.train_step(self.inputs.flatten(x), y, sample_weight=sample_weight)

    def predict(self, x: Any, *, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None) -> Any:
        """The model's outputs for every example of ``x`` (arrays, a ``tf.data.Dataset``, a
        PyDataset or a generator) in its output structure (e.g. a dict of arrays), one
        global batch at a time, as Keras's ``predict``: in inference mode (dropout off,
        batch norm on its moving statistics, nothing updated) on this program's weights,
        with Keras's progress bar and ``on_predict_*`` hooks
        (``tapas.execution.api.evaluation``). The training-mode forward pass is
        ``runtime.predict``."""
        from tapas.execution.api import evaluation
        return evaluation.predict(self, x, batch_size=batch_size, verbose=verbose,
                                  steps=steps, callbacks=callbacks)

    def evaluate(self, x: Any, y: Any = None, *, batch_size: int | None = None,
                 verbose: Any = "auto", steps: int | None = None, sample_weight: Any = None,
                 callbacks: Any = None, return_dict: bool = False) -> Any:
        """The loss (with compiled metrics: ``[loss, metric...]``, or a dict with
        ``return_dict=True``), as Keras's ``evaluate``: the mean over every example of
        arrays or a dataset of (x, y[, sample_weight]) (at most ``steps`` batches),
        weighted by ``sample_weight``; forward only, in inference mode on this program's
        weights, with Keras's progress bar and ``on_test_*`` hooks
        (``tapas.execution.api.evaluation``). ``verify`` and ``runtime.evaluate`` check the
        program's own mode."""
        from tapas.execution.api import evaluation
        return evaluation.evaluate(self, x, y, batch_size=batch_size, verbose=verbose,
                                   steps=steps, sample_weight=sample_weight,
                                   callbacks=callbacks, return_dict=return_dict)

    def fit(self, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
        """Train as Keras's ``Model.fit`` does, over arrays (any input form of the module
        docstring) with targets ``y`` or a ``tf.data.Dataset`` of (x, y) global batches,
        with Keras callbacks, periodic atomic checkpoints and resume; returns a
        ``keras.callbacks.History``. Keyword arguments: Keras's ``fit``'s (``batch_size``
        is the captured global batch), and ``seed``, ``checkpoint_dir``,
        ``checkpoint_every``, ``keep``, ``resume``, ``resume_from``, ``tensorboard``
        (``tapas.execution.api.fit.fit``)."""
        from tapas.execution.api import fit as fit_mod
        return fit_mod.fit(self, x, y, **kwargs)

    def gradients(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        """(global loss, {weight path: global gradient}) on the batch, without an optimizer
        step (training mode: the forward pass advances seeds and moving statistics)."""
        return self.runtime.gradients(self.inputs.flatten(x), y)

    def save(self, path: str) -> str:   # a .keras path: Keras's file (callbacks.save_keras)
        return save_keras(self, path) if str(path).endswith(".keras") else self.runtime.save(path)

    def save_weights(self, path: str) -> str:   # Keras's .weights.h5 of the global weights
        return save_keras(self, path, weights_only=True)

    def restore(self, path: str) -> str:
        return self.runtime.restore(path)

    def global_weights(self) -> dict[str, np.ndarray]:
        return self.runtime.global_weights()

    def global_states(self) -> dict[str, np.ndarray]:
        """The seed-generator states of the training-mode program, by Keras path."""
        return self.runtime.states.values()

    def to_keras(self, model: Any = None) -> Any:
        """The global weights written into ``model`` (default: the model parallelized)."""
        return self.runtime.to_keras(self.model if model is None else model)

    def memory_report(self) -> Any:
        """The plan's predicted memory per device beside each worker's measured peak
        (``tapas.execution.runtime.memory``; every worker must call it: it all-reduces)."""
        from tapas.execution.runtime import memory
        return memory.memory_report(self)

    def audit(self) -> AuditReport:
        """Collectives of the traced training step (trace it first: one ``train_step``)
        against the strategy's prediction."""
        if "train_step" not in self.runtime.audits:
            raise RuntimeError("no training step has been traced yet: run train_step once "
                               "before asking for the audit")
        rt = self.runtime
        # the loss's collectives: each output's, and the weight regularizers' on the shards
        loss = tuple((kind, nbytes) for fn, kind, nbytes in
                     rt.loss_comms + list(getattr(rt, "regularizer_comms", []))
                     if fn == "train_step")
        predicted = tuple(c for plan in rt._plans() for c in plan.collectives) + \
            regularizers.predicted_comms(rt.regularization, rt.specs) + \
            regularizers.predicted_call_loss_comms(rt)
        return AuditReport.of(rt.audits["train_step"],
                              predicted_comm_list(self.plan, self.graph), loss, predicted)

    def verify(self, x: Any, y: Any, steps: int = 3,
               on_step: Any = None) -> dict[str, Any]:
        """Run the single-device Keras model side by side from the same weights, called with
        ``training=self.training`` (in training mode from the same seed-generator states,
        so dropout draws the same masks): outputs,
        gradients, then ``steps`` optimizer steps (Keras optimizer with the same
        hyper-parameters) and the weights and losses after them. Trains ``self.model`` as
        the reference; needs a fresh ParallelModel (no step taken yet). ``on_step(step,
        loss, keras_loss, seconds of the parallel step)`` is called after each step
        (``tapas.execution.checking.verify.verify_with_keras``). A model class with its own
        ``train_step`` or ``compute_loss`` is refused (``tapas.execution.api.overrides``)."""
        from tapas.execution.api.overrides import check_steps
        check_steps(self.model, "verify")
        return verify.verify_with_keras(self, self.inputs.flatten(x), y, steps, on_step)


def loss_object(loss: Any) -> Any:
    """``loss`` as a ``keras.losses.Loss`` (what the runtime reduces itself): a Loss as it
    is, a name or function Keras knows ("mse", ``keras.losses.mean_squared_error``) as the
    Loss class of the same name (``MeanSquaredError``); ``None`` stays ``None``."""
    import keras

    from tapas.execution.training import keras2
    loss = keras2.loss(loss)   # a Keras 2 (tf_keras) loss object: its Keras 3 twin
    if loss is None or isinstance(loss, keras.losses.Loss):
        return loss
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    name = getattr(fn, "__name__", "")
    cls = getattr(keras.losses, "".join(w.capitalize() for w in name.split("_")), None)
    if isinstance(cls, type) and issubclass(cls, keras.losses.Loss):
        return cls()
    raise ValueError(f"loss {loss!r}: the runtime needs a keras.losses.Loss object (it "
                     "reduces the per-example values itself), e.g. "
                     "keras.losses.MeanSquaredError(); pass loss=<that object>")


def training_loss(model: Any) -> Any:
    """The loss ``tapas train`` trains a saved model with: the one it was compiled with,
    mean squared error when it was saved uncompiled (a ``keras.losses.Loss``)."""
    return loss_object(getattr(model, "loss", None) or "mean_squared_error")


def _model_losses(rt: runtime.Runtime, model: Any, trace: Any, per_output: list,
                  loss_weights: list, output_names: list) -> None:
    """Give ``rt`` the model's own losses: the compiled loss of each output and its loss
    weight (``compiled_loss``), its weight regularizers on the shards (``model.losses``;
    ``regularizers``)."""
    rt.regularization = regularizers.plan_regularizers(model, rt.specs,
                                                       capturing.weights_by_path(model))
    rt.output_losses = per_output if len(per_output) > 1 else None
    rt.loss_weights = loss_weights if any(w is not None for w in loss_weights) else None
    rt.output_names = output_names


def _refuse_call_losses(trace: Any, per_output: list, rows: int) -> None:
    """The losses the model's call adds (activity regularizers, ``add_loss``: outputs of
    the program, ``ir.Graph.call_losses``) refused on a mesh of several rows, before the
    search (``regularizers.with_call_losses`` says why)."""
    if rows > 1 and trace.call_losses and any(loss is not None for loss in per_output):
        raise ValueError(
            f"the model's call adds {len(trace.call_losses)} loss(es) (activity "
            f"regularizers or add_loss: {', '.join(trace.call_losses)}), and a mesh of "
            f"{rows} rows splits the batch over the rows, where a loss that is not a sum "
            "over examples would be counted once per row: use a one-dimensional plan "
            "(no mesh) for this model, or drop the call losses")


def _capture(model: Any, signature: Any, training: bool,
             timings: dict[str, float]) -> tuple[Any, Any]:
    """(trace, IR graph) of ``model`` in the given mode, timed as "capture"."""
    start = time.perf_counter()
    trace = capturing.trace(model, signature.spec_structure(), training=training)
    if [s.name for s in trace.input_specs] != list(signature.names):
        raise RuntimeError(f"capture listed the inputs as {[s.name for s in trace.input_specs]}"
                           f", Keras as {list(signature.names)}: the flattening orders differ")
    graph = capturing.to_ir(trace)
    timings["capture"] = timings.get("capture", 0.0) + time.perf_counter() - start
    return trace, graph


def _bind(strategy: Any, graph: Any, n: int) -> Any:
    """The Plan of ``strategy`` (a path, a Strategy or a Plan) on ``graph``; ValueError or
    ReconstructError when it was made for another graph or device count."""
    from tapas.execution.program import reconstruct
    from tapas.planning import search as search_mod
    if isinstance(strategy, str):
        strategy = search_mod.Strategy.load(strategy, graph, num_devices=n)
    if isinstance(strategy, reconstruct.Plan):
        if strategy.num_devices != n:
            raise ValueError(f"the plan shards over {strategy.num_devices} devices but "
                             f"{n} were given")
        return strategy.for_graph(graph)
    strategy.check(graph, num_devices=n)
    return reconstruct.Plan.from_strategy(strategy, graph)


def _fitting_mode(model: Any, signature: Any, strategy: Any, n: int, training: bool | None,
                  timings: dict[str, float]) -> tuple[bool, Any, Any, Any]:
    """(training, trace, graph, plan): the given mode, or with ``training=None``
    training mode if the strategy fits its graph, else inference mode if it fits that one
    (a strategy searched on ``tapas.capture``'s default graph), with a warning."""
    from tapas.execution.program import reconstruct
    modes = [training] if training is not None else [True, False]
    if isinstance(strategy, str):   # unreadable in either mode: said once, naming the file
        from tapas.planning import search as search_mod
        search_mod.Strategy.load(strategy)
    first: Exception | None = None
    for mode in modes:
        trace, graph = _capture(model, signature, mode, timings)
        try:
            bound = _bind(strategy, graph, n)
        except (ValueError, reconstruct.ReconstructError) as err:
            first = first or err
            continue
        if training is None and not mode:
            logging.warning(
                "tapas.parallelize: the strategy was made on the inference-mode graph, which "
                "differs from the training-mode graph (dropout or batch norm): the program "
                "runs in inference mode (dropout off, moving statistics not updated). For "
                "training mode, search or plan on tapas.capture(model, spec, training=True) "
                "(tapas search --training), or pass training=False to say so.")
        return mode, trace, graph, bound
    assert first is not None
    if training is None:   # a ValueError, whatever ``first``'s class takes to construct
        raise ValueError(f"{first} (tried the training-mode and the inference-mode "
                         "graph)") from first
    raise first


def _resolved_optimizer(model: Any, optimizer: Any, learning_rate: float | None) -> Any:
    """The Keras optimizer to train with: ``optimizer`` (an instance, name or config), else
    the compiled model's, else SGD; refused before any work if it cannot run on shards."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    optimizer = resolve_optimizer(optimizer, learning_rate)
    check_supported(optimizer)
    return optimizer


def _search(graph: Any, n: int, cluster: Cluster | None, search_options: Any,
            expert_rows: int, per_output: list, optimizer: Any = None) -> Any:
    """``tapas.search`` of ``graph`` on ``cluster`` (default ``Cluster.loopback_cpu(n)``),
    pricing the loss the program will train with (one output's: the losses of several are
    not priced) and counting ``optimizer``'s slots in the memory estimate, unless
    ``search_options`` say otherwise; the Strategy."""
    from tapas.planning import search as search_mod
    cluster = cluster or Cluster.loopback_cpu(n)
    if cluster.num_devices != n:
        raise ValueError(f"cluster {cluster.name} has {cluster.num_devices} devices but the "
                         f"program runs on {n}")
    kwargs = dict(search_options or {})
    if expert_rows > 1 and "patterns_fn" not in kwargs:
        from tapas.planning import experts
        kwargs["patterns_fn"] = experts.nested_patterns(graph, expert_rows)
    given = kwargs.get("options")
    if given is None and optimizer is not None:
        from tapas.planning.cost import CostOptions
        given = kwargs["options"] = CostOptions.for_cluster(
            cluster, optimizer_slots=keras_optimizer.slot_count(optimizer))
    if "loss" not in kwargs and (given is None or given.loss is None):
        kwargs["loss"] = per_output[0] if len(per_output) == 1 else None
    return search_mod.search(graph, cluster=cluster, **kwargs)


def _weight_source(model: Any, program: Any, weights_from: str | None) -> Any:
    """Where the runtime's shards come from: the model's values, computed one weight at a
    time (``materialize.weight_values``), or the slices of checkpoint ``weights_from``
    (``reshard.CheckpointWeights``: no weight initialized, none held whole unless its
    layout holds it whole); a directory of checkpoints gives its newest whole one."""
    if weights_from is None:
        return materialize.weight_values(model, program.weight_layouts)
    from tapas.execution.runtime import checkpoints, reshard
    from tapas.execution.api import fit_checkpoints
    path = weights_from
    if not os.path.exists(os.path.join(path, checkpoints.CHECKPOINT_META)):
        path, _ = fit_checkpoints.usable_checkpoint(weights_from)
        if path is None:
            raise FileNotFoundError(f"weights_from={weights_from}: neither a checkpoint "
                                    f"({checkpoints.CHECKPOINT_META}) nor a directory with "
                                    "a whole one; give a checkpoint written by save or fit")
    return reshard.CheckpointWeights(path)


def parallelize(model: Any, input_spec: Any = None, strategy: Any = None, *,
                devices: int | None = None,
                distribute_strategy: tf.distribute.Strategy | None = None,
                optimizer: Any = None, learning_rate: float | None = None,
                loss: Any = None, training: bool | None = None, cluster: Cluster | None = None,
                search_options: Mapping[str, Any] | None = None,
                mesh: Any = None, graph_optimization: str = "lean",
                weights_from: str | None = None) -> ParallelModel:
    """Capture ``model``, choose or check the strategy, reconstruct and place it on devices.

    ``strategy``: a ``tapas.planning.search.Strategy``, the path of one saved as JSON, a
    ``tapas.execution.program.plan.Plan`` (patterns by hand), or ``None`` to search on
    ``cluster`` (default ``Cluster.loopback_cpu(N)``; ``search_options`` go to
    ``tapas.search``, which prices ``loss``'s collectives unless they say otherwise).
    ``devices``/``distribute_strategy``: module docstring. ``loss``: a Keras loss (or compiled).
    ``mesh``: ``"ROWSxCOLS"`` (or a ``tapas.planning.devicemesh.Mesh``; one made by
    ``cluster.mesh(rows, cols)`` searches on its row's cluster) with rows x cols = N
    runs a 2-D mesh: data parallel over the rows (each row takes its share of axis 0 of the
    batch; gradients all-reduced over the columns) and ``strategy`` (made for ``cols``
    devices on the graph of one row, at batch / rows: ``tapas search --mesh=RxC`` writes
    it) inside each row. ``"ROWSxCOLS:experts"`` also splits the experts of every MoE
    layer over the rows (nested expert + tensor parallelism, ``tapas.planning.experts``:
    the dispatched tokens exchanged over the mesh column by all-to-alls, each row running
    its experts tensor parallel; the row's strategy must split neither the experts nor the
    groups inside the expert region: a search here or ``tapas search --mesh=RxC:experts``
    makes such a strategy). Batch norm's batch statistics are then per row (as Keras's
    unsynchronised batch norm under ``tf.distribute``) and dropout draws per row, so
    ``verify`` is exact only for a graph without them (``training=False``).
    ``graph_optimization``: Grappler's options when the step functions are first called:
    ``"lean"`` (one round of passes; on CPU-only devices without the layout and memory
    optimizers, which change nothing there; the first step about a third faster on T5) or
    ``"default"`` (TensorFlow's configuration); ``tapas.execution.program.replay.graph_optimization``.
    ``training``: which graph the program runs, as ``model(x, training=...)`` would. True
    (the default, as ``model.fit``): the training-mode graph, with dropout drawing the
    single-device mask and batch norm normalising with the global batch's statistics and
    updating its moving statistics (``tapas.execution.program.stateful``); the ParallelModel's
    ``train_step``, ``predict`` and ``verify`` then run in training mode and advance the
    dropout seeds and moving statistics, as a Keras call with ``training=True`` does
    (``evaluate`` and fit's validation run in inference mode, as Keras's do:
    ``for_inference``). False: the inference graph (dropout off, moving statistics read
    and never updated). A plan (``Plan``, ``random_plan``) must be made on the graph of the
    same mode: ``tapas.capture(model, spec, training=training)``. None (the default):
    training mode, unless ``strategy`` was made on the inference graph (``tapas.capture``'s
    and ``tapas search``'s default) and does not fit the training graph (dropout or batch
    norm make them differ): then the inference graph, with a warning saying so.
    ``weights_from``: a checkpoint (or a directory of them: the newest whole one) the shards
    are created from, slice by slice (``_weight_source``), for a ``restore``/``fit(resume=
    True)`` of it that follows; by default the model's values, one weight at a time.
    """
    from tapas.execution.program.replay import check_graph_optimization
    check_graph_optimization(graph_optimization)   # before any work
    optimizer = _resolved_optimizer(model, optimizer, learning_rate)
    compiled_loss = loss is None and getattr(model, "loss", None) is not None
    timings: dict[str, float] = {}
    distribute_strategy, mesh, rows = _distribution(devices, distribute_strategy, mesh)
    if cluster is None and mesh is not None and mesh.cluster is not None:
        cluster = mesh.row_cluster   # a mesh on a cluster: its row's, as the search sees it
    n = int(distribute_strategy.num_replicas_in_sync) // rows   # one row's devices (1-D: all)
    expert_rows = rows if mesh is not None and mesh.experts else 1
    global_signature = inputs.InputSignature.of(model, input_spec)
    signature = global_signature.per_row(rows)
    # the compiled loss: a Loss per output and Keras's loss weights (or ``loss`` given)
    losses = output_losses(model, loss, to_object=loss_object)
    training, trace, graph, plan = _plan_and_mode(
        model, signature, strategy, n, training, cluster, search_options, expert_rows,
        losses[0], optimizer, rows, timings)
    program = _program(trace, graph, plan, expert_rows, mesh, timings)
    rt = _runtime(model, program, distribute_strategy, trace, optimizer, losses, mesh,
                  graph_optimization, weights_from, timings)
    return ParallelModel(model, trace, graph, plan, program, rt, timings, training,
                         global_signature, compiled_loss=compiled_loss)


def _distribution(devices: int | None, distribute_strategy: tf.distribute.Strategy | None,
                  mesh: Any) -> tuple[tf.distribute.Strategy, Any, int]:
    """(``distribute_strategy``, or a MirroredStrategy over ``devices`` local devices;
    ``mesh`` parsed into a ``tapas.planning.mesh.Mesh``, or None; its rows, 1 without
    one), refused with the fix when neither is given or the device counts disagree."""
    if distribute_strategy is None:
        if devices is None:
            raise ValueError("give devices=N (a MirroredStrategy over N local devices) or "
                             "distribute_strategy=<tf.distribute strategy>")
        distribute_strategy = make_strategy(devices)
    replicas = int(distribute_strategy.num_replicas_in_sync)
    if devices is not None and devices != replicas:
        raise ValueError(f"devices={devices} but distribute_strategy has {replicas} replicas; "
                         "give one of them or make them agree")
    if mesh is None:
        return distribute_strategy, None, 1
    from tapas.planning.mesh import Mesh
    mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
    if mesh.num_devices != replicas:
        raise ValueError(f"mesh {mesh} has {mesh.num_devices} devices but the program runs "
                         f"on {replicas}: choose rows x cols = {replicas}")
    return distribute_strategy, mesh, mesh.rows


def _plan_and_mode(model: Any, signature: Any, strategy: Any, n: int,
                   training: bool | None, cluster: Cluster | None, search_options: Any,
                   expert_rows: int, per_output: list, optimizer: Any, rows: int,
                   timings: dict[str, float]) -> tuple[bool, Any, Any, Any]:
    """(training, trace, graph, plan): without ``strategy``, a search (timed as "search")
    on the graph captured in ``training`` mode (default: training), as a Plan; else the
    given strategy's Plan in the mode its graph fits (:func:`_fitting_mode`). Call losses
    a mesh cannot count are refused before the search."""
    if strategy is None:
        training = True if training is None else training
        trace, graph = _capture(model, signature, training, timings)
        _refuse_call_losses(trace, per_output, rows)   # before the search
        start = time.perf_counter()
        strategy = _search(graph, n, cluster, search_options, expert_rows, per_output, optimizer)
        timings["search"] = time.perf_counter() - start
        from tapas.execution.program import reconstruct
        return training, trace, graph, reconstruct.Plan.from_strategy(strategy, graph)
    training, trace, graph, plan = _fitting_mode(model, signature, strategy, n, training,
                                                 timings)
    _refuse_call_losses(trace, per_output, rows)
    return training, trace, graph, plan


def _program(trace: Any, graph: Any, plan: Any, expert_rows: int, mesh: Any,
             timings: dict[str, float]) -> Any:
    """The per-replica program of ``plan``, timed as "reconstruct"; on a mesh with rows, a
    warning when dropout or batch norm make each row differ from the single-device
    model."""
    from tapas.execution.program import reconstruct
    start = time.perf_counter()
    program = reconstruct.Program(trace, graph, plan, expert_rows=expert_rows)
    timings["reconstruct"] = time.perf_counter() - start
    rows = 1 if mesh is None else mesh.rows
    if rows > 1 and (getattr(program, "states", None) or getattr(program, "has_writes", False)):
        logging.warning(
            "tapas.parallelize: on a %s mesh each row draws its own dropout masks and batch "
            "norm normalises with its row's statistics (as Keras's unsynchronised batch norm "
            "under tf.distribute); the program is then not the single-device model's, and "
            "verify reports the difference. For exact equivalence run training=False.", mesh)
    return program


def _runtime(model: Any, program: Any, distribute_strategy: tf.distribute.Strategy,
             trace: Any, optimizer: Any, losses: tuple, mesh: Any, graph_optimization: str,
             weights_from: str | None, timings: dict[str, float]) -> runtime.Runtime:
    """The runtime of ``program`` on :func:`_weight_source`'s shards with the model's
    ``losses`` (a Loss per output, the loss weights, the output names), timed as "shard"."""
    per_output, loss_weights, output_names = losses
    start = time.perf_counter()
    rt = runtime.Runtime(program, distribute_strategy, _weight_source(model, program,
                                                                      weights_from),
                         trace.input_specs, optimizer=optimizer, loss=per_output[0],
                         keras_variables=capturing.weights_by_path(model), mesh=mesh,
                         graph_optimization=graph_optimization)
    _model_losses(rt, model, trace, per_output, loss_weights, output_names)
    timings["shard"] = time.perf_counter() - start
    return rt
