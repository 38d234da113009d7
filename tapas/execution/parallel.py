"""``tapas.parallelize``: a Keras model becomes a :class:`ParallelModel` trained under
``tf.distribute`` with a tensor-parallel strategy.

In:  a Keras model, its input specs (static ``tf.TensorSpec`` s), a ``tapas.planning.search.Strategy``
     (an object or a JSON path; searched here when ``None``), the devices (``devices=N`` for
     a ``MirroredStrategy`` over N local devices, or ``distribute_strategy=`` any
     ``tf.distribute`` strategy, e.g. ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``),
     an optimizer ("sgd", "adam") and a loss.
Out: :class:`ParallelModel` with ``train_step(x, y)``, ``predict(x)``, ``gradients(x, y)``,
     ``save(path)``, ``restore(path)``, ``to_keras()``, ``audit()`` (the collectives of the
     reconstructed program against the strategy's prediction) and ``verify(...)`` (the
     single-device Keras model side by side).

Pipeline: capture (``tapas.capturing.trace``) -> strategy (given, or ``tapas.search`` on a
cluster of N devices) -> checks (the strategy fits this graph and this device count; every
split divides) -> ``tapas.execution.reconstruct.Program`` -> ``tapas.execution.runtime.Runtime``.

Logical CPU devices must be configured before TensorFlow runs any op, so call
``tapas.execution.runtime.setup_devices(N)`` before building the Keras model (the ``tapas train``
command does)::

    tapas.execution.runtime.setup_devices(4)
    model = build_model()
    pm = tapas.parallelize(model, spec, devices=4, optimizer="adam", loss=loss)
    pm.train_step(x, y)
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas import capturing
from tapas.execution import runtime
from tapas.planning.cost import Cluster
from tapas.sharding.placements import Collective

__all__ = ["parallelize", "ParallelModel", "AuditReport", "predicted_comms", "predicted_comm_list",
           "plan_reshards",
           "grad_tensors",
           "random_plan", "compare"]

RTOL = 1e-5
ATOL_FACTOR = 1e-5   # absolute tolerance, times the largest reference magnitude


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Collectives of the reconstructed training step against the strategy's prediction.

    ``measured``/``predicted`` map ``(kind, phase)`` to a count; ``loss`` lists what the
    runtime added to compute the loss (an all-gather of class-split logits).
    """

    measured: Mapping[tuple[str, str], int]
    predicted: Mapping[tuple[str, str], int]
    measured_bytes: Mapping[tuple[str, str], int]
    predicted_bytes: Mapping[tuple[str, str], int]
    loss: tuple[tuple[str, int], ...]
    differences: tuple[str, ...] = ()   # "+" in the program only, "-" predicted only

    @property
    def matches(self) -> bool:
        return dict(self.measured) == dict(self.predicted) and \
            dict(self.measured_bytes) == dict(self.predicted_bytes)

    def table(self) -> str:
        keys = sorted(set(self.measured) | set(self.predicted))
        lines = [f"{'collective':<10} {'phase':<5} {'program':>8} {'predicted':>10} "
                 f"{'bytes (program)':>16} {'bytes (predicted)':>18}"]
        for k in keys:
            lines.append(f"{k[0]:<10} {k[1]:<5} {self.measured.get(k, 0):>8} "
                         f"{self.predicted.get(k, 0):>10} {self.measured_bytes.get(k, 0):>16,} "
                         f"{self.predicted_bytes.get(k, 0):>18,}")
        if not keys:
            lines.append("(no collectives)")
        for kind, nbytes in self.loss:
            lines.append(f"{kind:<10} {'loss':<5} {1:>8} {'-':>10} {nbytes:>16,}")
        lines.append("audit " + ("matches the strategy's prediction" if self.matches else
                                 "DIFFERS from the strategy's prediction"))
        lines += [f"  {d}" for d in self.differences[:12]]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        key = lambda k: f"{k[0]} {k[1]}"  # noqa: E731
        return {"measured": {key(k): v for k, v in self.measured.items()},
                "predicted": {key(k): v for k, v in self.predicted.items()},
                "measured_bytes": {key(k): v for k, v in self.measured_bytes.items()},
                "predicted_bytes": {key(k): v for k, v in self.predicted_bytes.items()},
                "loss": [list(x) for x in self.loss], "matches": self.matches,
                "differences": list(self.differences)}


def predicted_comms(strategy: Any, graph: Any) -> tuple[dict, dict]:
    """``({(kind, phase): count}, {(kind, phase): bytes})`` predicted for a
    ``tapas.planning.search.Strategy`` (every chosen pattern's comms plus its resharding edges) or a
    ``tapas.execution.reconstruct.Plan`` (pattern comms plus :func:`plan_reshards`)."""
    return _tally(predicted_comm_list(strategy, graph))


def predicted_comm_list(strategy: Any, graph: Any) -> list:
    """The ``tapas.sharding.placements.Comm`` s behind :func:`predicted_comms`.

    TensorFlow never runs the backward of a value whose gradient nothing needs (the input
    images, attention masks, a copy of the router probabilities read only by ``ArgMax``),
    and neither does the program: such backward comms are left out (:func:`grad_tensors`).
    """
    from tapas.execution import reconstruct
    plan = strategy if isinstance(strategy, reconstruct.Plan) else None
    if plan is None:
        plan = reconstruct.Plan(strategy.num_devices,
                                {node.id: strategy.pattern(node.id) for node in graph.nodes})
    tagged = [(c, None) for node in graph.nodes for c in plan.pattern(node).comms]
    if hasattr(strategy, "edge_comms"):
        for e in strategy.edge_comms:
            tensor = graph.nodes[e.dst].inputs[e.input_index].name
            tagged += [(c, (tensor, e.dst_placement)) for c in e.comms]
        # a weight read in two placements (a tied embedding and LM head) is stored as its
        # first reader wants it and resharded for the others: not an edge of the graph
        weights = {w.path for w in graph.weights}
        tagged += [(c, key) for c, key in _plan_reshards(plan, graph) if key[0] in weights]
    else:
        tagged += _plan_reshards(plan, graph)
    ops = [op for node in graph.nodes for op in node.ops]
    forward, backward = _forward_from_weights(graph, ops), _backward_from_outputs(graph, ops)
    needed = grad_tensors(graph)
    readers = _readers(plan, graph)

    def runs(comm: Any, key: tuple[str, str] | None) -> bool:
        if comm.phase != "bwd":
            return True
        if key is None:
            return comm.tensor in needed
        tensor = _weight_tensor(graph, key[0])
        return tensor in forward and any(
            op.type not in _NO_GRADIENT and any(o.name in backward for o in op.outputs)
            for op in readers.get((tensor, key[1]), ()))

    return [c for c, key in tagged if runs(c, key)]


def _weight_tensor(graph: Any, name: str) -> str:
    """The tensor a weight path stands for in op inputs (its resource placeholder)."""
    for w in graph.weights:
        if w.path == name:
            return w.placeholder + ":0"
    return name


def _readers(plan: Any, graph: Any) -> dict[tuple[str, str], list]:
    """(tensor, placement wanted) -> the ops that read the tensor in that placement."""
    from tapas.sharding import placements
    out: dict[tuple[str, str], list] = {}
    for node in graph.nodes:
        pat = plan.pattern(node)
        wants = {t.name: str(placements.parse_placement(p)) for t, p in zip(node.inputs, pat.inputs)}
        wants.update({w.placeholder + ":0": str(placements.parse_placement(pat.weights[w.path]))
                      for w in node.weights})
        for op in node.ops:
            for name in op.inputs:
                if name in wants:
                    out.setdefault((name, wants[name]), []).append(op)
    return out


def _backward_from_outputs(graph: Any, ops: Sequence[Any]) -> set[str]:
    backward = {t.name for t in graph.outputs}
    for op in reversed(_topological(ops)):
        if op.type not in _NO_GRADIENT and any(t.name in backward for t in op.outputs):
            backward |= set(op.inputs)
    return backward


# ops through which no gradient flows back to any input
_NO_GRADIENT = frozenset({
    "ArgMax", "ArgMin", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "StopGradient", "PreventGradient", "Shape", "ShapeN", "Size", "Rank", "ZerosLike",
    "OnesLike", "Floor", "Ceil", "Round", "Rint", "Sign", "IsFinite", "IsNan", "IsInf",
    "LogicalAnd", "LogicalOr", "LogicalNot"})


def _differentiable(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "half", "complex")) or dtype == "resource"


def grad_tensors(graph: Any) -> set[str]:
    """Names of the tensors whose gradient training needs (TensorFlow computes no other):
    tensors computed, op by op, from a trainable weight (forward) that also reach a graph
    output through ops with a gradient (backward), with a floating-point or resource dtype;
    plus the trainable weights' paths."""
    ops = [op for node in graph.nodes for op in node.ops]
    forward = _forward_from_weights(graph, ops)
    backward = _backward_from_outputs(graph, ops)
    needed = {name for name in forward if name in backward}
    return needed | {w.path for w in graph.weights if w.trainable
                     and w.placeholder + ":0" in needed}


def _topological(ops: Sequence[Any]) -> list[Any]:
    producer = {t.name: k for k, op in enumerate(ops) for t in op.outputs}
    consumers: dict[int, list[int]] = {k: [] for k in range(len(ops))}
    indegree = [0] * len(ops)
    for k, op in enumerate(ops):
        for name in set(op.inputs):
            if name in producer:
                consumers[producer[name]].append(k)
                indegree[k] += 1
    ready = [k for k, d in enumerate(indegree) if d == 0]
    order = []
    while ready:
        k = ready.pop()
        order.append(ops[k])
        for j in consumers[k]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    return order


def _forward_from_weights(graph: Any, ops: Sequence[Any]) -> set[str]:
    needed = {w.placeholder + ":0" for w in graph.weights if w.trainable}
    for op in _topological(ops):
        if op.type not in _NO_GRADIENT and any(name in needed for name in op.inputs):
            needed |= {t.name for t in op.outputs if _differentiable(t.dtype)}
    return needed


def plan_reshards(plan: Any, graph: Any) -> list:
    """The resharding comms a plan needs between GraphNodes: where a consumer expects
    another placement than its producer gives (a graph input is placed as its first
    consumer wants it; a weight is stored as its first reader wants it), once per
    (tensor, wanted placement)."""
    return [c for c, _ in _plan_reshards(plan, graph)]


def _plan_reshards(plan: Any, graph: Any) -> list[tuple[Any, tuple[str, str]]]:
    """:func:`plan_reshards`, each comm with its (tensor or weight path, wanted placement)."""
    from tapas.sharding import placements
    place: dict[str, Any] = {}
    for node in graph.nodes:
        for t, p in zip(node.outputs, plan.pattern(node).outputs):
            place[t.name] = placements.parse_placement(p)
    stored: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    comms: list = []
    for node in graph.nodes:
        pat = plan.pattern(node)
        wanted = [(t.name, t.shape, t.dtype, placements.parse_placement(p))
                  for t, p in zip(node.inputs, pat.inputs)]
        for w in node.weights:
            p = placements.parse_placement(pat.weights[w.path])
            stored.setdefault(w.path, p)
            wanted.append((w.path, w.shape, w.dtype, p))
        for name, shape, dtype, want in wanted:
            have = stored.get(name, place.setdefault(name, want))
            if have != want and (name, str(want)) not in seen:
                seen.add((name, str(want)))
                comms += [(c, (name, str(want)))
                          for c in placements.reshard(have, want, tuple(shape or ()), dtype, name)]
    return comms


def random_plan(graph: Any, num_devices: int, seed: int, p_shard: float = 0.7) -> Any:
    """A random valid plan: per GraphNode, one of ``tapas.sharding.patterns.patterns_for`` (a
    non-replicating one with probability ``p_shard`` when there is one). Reconstruction
    reshards between any two choices, so every such plan is valid."""
    import random

    from tapas.sharding import patterns
    from tapas.execution import reconstruct
    rng = random.Random(seed)
    chosen = {}
    for node in graph.nodes:
        pats = patterns.patterns_for(node, graph, num_devices)
        sharded = [p for p in pats if p.name != "replicate"]
        pool = sharded if sharded and rng.random() < p_shard else pats
        chosen[node.id] = rng.choice(pool)
    return reconstruct.Plan(num_devices, chosen)


def _tally(comms: Sequence[Any]) -> tuple[dict, dict]:
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for c in comms:
        key = (Collective.parse(c.kind).value, c.phase)
        counts[key] += 1
        sizes[key] += int(c.bytes)
    return dict(counts), dict(sizes)


def compare(got: Any, want: Any, rtol: float = RTOL, atol_factor: float = ATOL_FACTOR,
            scale: float | None = None) -> dict[str, float | bool]:
    """Largest difference of two arrays and whether ``|got - want| <= atol + rtol |want|``
    with ``atol = atol_factor * scale``; ``scale`` defaults to ``max |want|`` (``verify``
    passes the largest magnitude over all weights, or all gradients)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs reference {want.shape}")
    if scale is None:
        scale = float(np.abs(want).max()) if want.size else 0.0
    diff = np.abs(got - want)
    ok = bool(np.all(diff <= atol_factor * scale + rtol * np.abs(want)))
    return {"max_abs_diff": float(diff.max()) if diff.size else 0.0, "scale": scale, "ok": ok}


def _worst_ill(results: Mapping[str, Mapping[str, Any]]) -> int:
    return sum(int(r.get("ill_conditioned", 0)) for r in results.values())


def _worst(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    if not results:
        return {"max_abs_diff": 0.0, "ok": True, "worst": None, "count": 0}
    name = max(results, key=lambda k: results[k]["max_abs_diff"])
    out = {"max_abs_diff": results[name]["max_abs_diff"], "scale": results[name]["scale"],
           "ok": all(r["ok"] for r in results.values()), "worst": name,
           "count": len(results)}
    ill = _worst_ill(results)
    if ill:
        out["ill_conditioned"] = ill
        out["max_abs_diff_all"] = max(r.get("max_abs_diff_all", r["max_abs_diff"])
                                      for r in results.values())
    return out


class ParallelModel:
    """A Keras model reconstructed under a strategy and running on N devices."""

    def __init__(self, model: Any, trace: Any, graph: Any, strategy: Any, program: Any,
                 rt: runtime.Runtime, timings: Mapping[str, float], training: bool) -> None:
        self.model, self.trace, self.graph = model, trace, graph
        self.strategy, self.program, self.runtime = strategy, program, rt
        self.timings = dict(timings)
        self.training = training

    @property
    def num_devices(self) -> int:
        return self.runtime.num_devices

    # the runtime's operations
    def train_step(self, x: Any, y: Any) -> float:
        """One optimizer step on the global batch; returns the loss (see Runtime.train_step)."""
        return self.runtime.train_step(_as_list(x), y)

    def predict(self, x: Any) -> Any:
        return self.runtime.predict(_as_list(x))

    def gradients(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        return self.runtime.gradients(_as_list(x), y)

    def save(self, path: str) -> str:
        return self.runtime.save(path)

    def restore(self, path: str) -> str:
        return self.runtime.restore(path)

    def global_weights(self) -> dict[str, np.ndarray]:
        return self.runtime.global_weights()

    def to_keras(self, model: Any = None) -> Any:
        """The global weights written into ``model`` (default: the model parallelized)."""
        return self.runtime.to_keras(self.model if model is None else model)

    def audit(self) -> AuditReport:
        """Collectives of the traced training step (trace it first: one ``train_step``)
        against the strategy's prediction."""
        if "train_step" not in self.runtime.audits:
            raise RuntimeError("no training step has been traced yet: run train_step once "
                               "before asking for the audit")
        audit = self.runtime.audits["train_step"]
        comms = predicted_comm_list(self.strategy, self.graph)
        predicted, predicted_bytes = _tally(comms)
        loss = tuple((kind, nbytes) for fn, kind, nbytes in self.runtime.loss_comms
                     if fn == "train_step")
        got = Counter((r.kind.value, r.phase, r.tensor) for r in audit.records)
        want = Counter((Collective.parse(c.kind).value, c.phase, c.tensor) for c in comms)
        diffs = [f"+ {k} {p} {t} (in the program only)" for (k, p, t) in got - want]
        diffs += [f"- {k} {p} {t} (predicted only)" for (k, p, t) in want - got]
        return AuditReport(audit.counts(), predicted, audit.bytes(), predicted_bytes, loss,
                           tuple(sorted(diffs)))

    def _compare_weight(self, got: np.ndarray, want: np.ndarray, grad: np.ndarray | None,
                        noise: float, scale: float) -> dict[str, Any]:
        if isinstance(self.runtime.optimizer, runtime.Adam):
            return _adam_compare(got, want, grad, noise, scale)
        return compare(got, want, scale=scale)

    def verify(self, x: Any, y: Any, steps: int = 3,
               on_step: Any = None) -> dict[str, Any]:
        """Run the single-device Keras model side by side from the same weights: outputs,
        gradients, then ``steps`` optimizer steps (Keras optimizer with the same
        hyper-parameters) and the weights and losses after them. Trains ``self.model`` as
        the reference; needs a fresh ParallelModel (no step taken yet). ``on_step(step,
        loss, keras_loss, seconds of the parallel step)`` is called after each step."""
        rt = self.runtime
        if int(rt.iterations.numpy()) != 0:
            raise RuntimeError("verify() compares from the initial state: call it before any "
                               "train_step, on a freshly parallelized model")
        xs = _as_list(x)
        model, loss_fn = self.model, rt.loss
        call = (lambda: model(xs if len(xs) > 1 else xs[0], training=self.training))
        report: dict[str, Any] = {}
        ref_out = np.asarray(call())
        outs, loss, grads = rt.evaluate(xs, y)
        report["outputs"] = compare(outs[0], ref_out)   # scale: the largest output
        trainable = [w for w in model.trainable_weights if w.path in grads]
        with tf.GradientTape() as tape:
            ref_loss = loss_fn(y, call())
        ref_grads = tape.gradient(ref_loss, trainable)
        report["loss"] = compare(loss, float(ref_loss))
        ref_g = {w.path: tf.convert_to_tensor(g).numpy() for w, g in zip(trainable, ref_grads)}
        g_scale = max((float(np.abs(g).max()) for g in ref_g.values() if g.size), default=0.0)
        report["gradients"] = _worst({p: compare(grads[p], g, scale=g_scale)
                                      for p, g in ref_g.items()})
        optimizer = rt.optimizer.keras()
        losses = []
        for step in range(steps):
            start = time.perf_counter()
            got = self.train_step(xs, y)
            seconds = time.perf_counter() - start
            with tf.GradientTape() as tape:
                ref = loss_fn(y, call())
            g = tape.gradient(ref, model.trainable_weights)
            optimizer.apply_gradients([(gi, w) for gi, w in zip(g, model.trainable_weights)
                                       if gi is not None])
            losses.append((got, float(ref)))
            if on_step is not None:
                on_step(step, got, float(ref), seconds)
        report["losses"] = losses
        report["step_losses"] = _worst({f"step {i + 1}": compare(a, b)
                                        for i, (a, b) in enumerate(losses)})
        weights = self.global_weights()
        by_path = {w.path: w for w in model.weights}
        refs = {p: by_path[p].numpy() for p in weights}
        w_scale = max((float(np.abs(v).max()) for v in refs.values() if v.size), default=0.0)
        noise = report["gradients"]["max_abs_diff"]
        report["weights"] = _worst({p: self._compare_weight(v, refs[p], ref_g.get(p), noise,
                                                            w_scale)
                                    for p, v in weights.items()})
        report["ok"] = all(report[k]["ok"] for k in
                           ("outputs", "loss", "gradients", "weights", "step_losses"))
        return report


def _adam_compare(got: np.ndarray, want: np.ndarray, grad: np.ndarray | None,
                  noise: float, scale: float) -> dict[str, Any]:
    """Weights after Adam steps: Adam divides each gradient by its own running magnitude,
    so an element whose gradient is rounding noise (|g| within 10x the largest gradient
    difference measured between the two programs) moves by +-lr in either program. Those
    elements are counted (``ill_conditioned``), not compared; every other element must meet
    the usual tolerance."""
    strict = compare(got, want, scale=scale)
    if strict["ok"] or grad is None:
        return strict
    keep = np.abs(grad) > 10.0 * noise
    masked = compare(np.where(keep, got, want), want, scale=scale)
    return {**masked, "max_abs_diff_all": strict["max_abs_diff"], "strict_ok": False,
            "ill_conditioned": int((~keep).sum())}


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def parallelize(model: Any, input_spec: Any = None, strategy: Any = None, *,
                devices: int | None = None,
                distribute_strategy: tf.distribute.Strategy | None = None,
                optimizer: str | runtime.Optimizer = "sgd", learning_rate: float | None = None,
                loss: Any = None, training: bool = False, cluster: Cluster | None = None,
                search_options: Mapping[str, Any] | None = None) -> ParallelModel:
    """Capture ``model``, choose or check the strategy, reconstruct and place it on devices.

    ``strategy``: a ``tapas.planning.search.Strategy``, the path of one saved as JSON, a
    ``tapas.execution.reconstruct.Plan`` (patterns chosen by hand), or ``None`` to search on
    ``cluster`` (default ``Cluster.loopback_cpu(N)``; ``search_options`` go to
    ``tapas.search``). ``devices``/``distribute_strategy``: see the module docstring.
    ``loss``: a ``keras.losses.Loss`` (default: the compiled model's loss).
    ``training``: capture (and verify against) the training-mode graph.
    """
    from tapas.execution import reconstruct
    from tapas.planning import search as search_mod
    timings: dict[str, float] = {}
    if distribute_strategy is None:
        if devices is None:
            raise ValueError("give devices=N (a MirroredStrategy over N local devices) or "
                             "distribute_strategy=<tf.distribute strategy>")
        distribute_strategy = runtime.make_strategy(devices)
    n = int(distribute_strategy.num_replicas_in_sync)
    if devices is not None and devices != n:
        raise ValueError(f"devices={devices} but distribute_strategy has {n} replicas; give one "
                         "of them or make them agree")
    start = time.perf_counter()
    trace = capturing.trace(model, input_spec, training=training)
    graph = capturing.to_ir(trace)
    timings["capture"] = time.perf_counter() - start

    start = time.perf_counter()
    if strategy is None:
        cluster = cluster or Cluster.loopback_cpu(n)
        if cluster.num_devices != n:
            raise ValueError(f"cluster {cluster.name} has {cluster.num_devices} devices but the "
                             f"program runs on {n}")
        strategy = search_mod.search(graph, cluster=cluster, **dict(search_options or {}))
        strategy = strategy.bind(graph) if getattr(strategy, "_graph", None) is None else strategy
        timings["search"] = time.perf_counter() - start
    elif isinstance(strategy, str):
        strategy = search_mod.Strategy.load(strategy, graph, num_devices=n)
    elif isinstance(strategy, reconstruct.Plan):
        if strategy.num_devices != n:
            raise ValueError(f"the plan shards over {strategy.num_devices} devices but "
                             f"{n} were given")
    else:
        strategy.check(graph, num_devices=n)
        strategy = strategy.bind(graph)
    start = time.perf_counter()
    plan = strategy if isinstance(strategy, reconstruct.Plan) else \
        reconstruct.Plan.from_strategy(strategy, graph)
    program = reconstruct.Program(trace, graph, plan)
    timings["reconstruct"] = time.perf_counter() - start

    if loss is None:
        loss = getattr(model, "loss", None)
        if isinstance(loss, str):
            import keras
            loss = keras.losses.get(loss)
    values = {w.path: w.numpy() for w in model.weights if w.path in program.weight_layouts}
    start = time.perf_counter()
    rt = runtime.Runtime(program, distribute_strategy, values, trace.input_specs,
                         optimizer=runtime.make_optimizer(optimizer, learning_rate), loss=loss)
    timings["shard"] = time.perf_counter() - start
    return ParallelModel(model, trace, graph, strategy, program, rt, timings, training)
