"""``tapas.parallelize``: a Keras model becomes a :class:`ParallelModel` trained under
``tf.distribute`` with a tensor-parallel strategy.

In:  a Keras model, its input specs (static ``tf.TensorSpec`` s), a ``tapas.search.Strategy``
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
split divides) -> ``tapas.reconstruct.Program`` -> ``tapas.runtime.Runtime``.

Logical CPU devices must be configured before TensorFlow runs any op, so call
``tapas.runtime.setup_devices(N)`` before building the Keras model (the ``tapas train``
command does)::

    tapas.runtime.setup_devices(4)
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

from tapas import capturing, runtime
from tapas.cost import Cluster, Collective

__all__ = ["parallelize", "ParallelModel", "AuditReport", "predicted_comms", "compare"]

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
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        key = lambda k: f"{k[0]} {k[1]}"  # noqa: E731
        return {"measured": {key(k): v for k, v in self.measured.items()},
                "predicted": {key(k): v for k, v in self.predicted.items()},
                "measured_bytes": {key(k): v for k, v in self.measured_bytes.items()},
                "predicted_bytes": {key(k): v for k, v in self.predicted_bytes.items()},
                "loss": [list(x) for x in self.loss], "matches": self.matches}


def predicted_comms(strategy: Any, graph: Any) -> tuple[dict, dict]:
    """``({(kind, phase): count}, {(kind, phase): bytes})`` the strategy predicts: every
    chosen pattern's comms plus the resharding comms on edges."""
    counts: Counter = Counter()
    sizes: Counter = Counter()
    comms = [c for node in graph.nodes for c in strategy.pattern(node.id).comms]
    comms += [c for e in strategy.edge_comms for c in e.comms]
    for c in comms:
        key = (Collective.parse(c.kind).value, c.phase)
        counts[key] += 1
        sizes[key] += int(c.bytes)
    return dict(counts), dict(sizes)


def compare(got: Any, want: Any, rtol: float = RTOL,
            atol_factor: float = ATOL_FACTOR) -> dict[str, float | bool]:
    """Largest difference of two arrays and whether ``|got - want| <= atol + rtol |want|``
    with ``atol = atol_factor * max |want|``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs reference {want.shape}")
    scale = float(np.abs(want).max()) if want.size else 0.0
    diff = np.abs(got - want)
    ok = bool(np.all(diff <= atol_factor * scale + rtol * np.abs(want)))
    return {"max_abs_diff": float(diff.max()) if diff.size else 0.0, "scale": scale, "ok": ok}


def _worst(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    if not results:
        return {"max_abs_diff": 0.0, "ok": True, "worst": None, "count": 0}
    name = max(results, key=lambda k: results[k]["max_abs_diff"])
    return {"max_abs_diff": results[name]["max_abs_diff"], "scale": results[name]["scale"],
            "ok": all(r["ok"] for r in results.values()), "worst": name,
            "count": len(results)}


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
        predicted, predicted_bytes = predicted_comms(self.strategy, self.graph)
        loss = tuple((kind, nbytes) for fn, kind, nbytes in self.runtime.loss_comms
                     if fn == "train_step")
        return AuditReport(audit.counts(), predicted, audit.bytes(), predicted_bytes, loss)

    def verify(self, x: Any, y: Any, steps: int = 3,
               on_step: Any = None) -> dict[str, Any]:
        """Run the single-device Keras model side by side from the same weights: outputs,
        gradients, then ``steps`` optimizer steps (Keras optimizer with the same
        hyper-parameters) and the weights and losses after them. Trains ``self.model`` as
        the reference; needs a fresh ParallelModel (no step taken yet)."""
        rt = self.runtime
        if int(rt.iterations.numpy()) != 0:
            raise RuntimeError("verify() compares from the initial state: call it before any "
                               "train_step, on a freshly parallelized model")
        xs = _as_list(x)
        model, loss_fn = self.model, rt.loss
        call = (lambda: model(xs if len(xs) > 1 else xs[0], training=self.training))
        report: dict[str, Any] = {}
        ref_out = np.asarray(call())
        report["outputs"] = compare(self.predict(xs), ref_out)
        loss, grads = self.gradients(xs, y)
        trainable = [w for w in model.trainable_weights if w.path in grads]
        with tf.GradientTape() as tape:
            ref_loss = loss_fn(y, call())
        ref_grads = tape.gradient(ref_loss, trainable)
        report["loss"] = compare(loss, float(ref_loss))
        report["gradients"] = _worst({w.path: compare(grads[w.path], g.numpy())
                                      for w, g in zip(trainable, ref_grads)})
        optimizer = rt.optimizer.keras()
        losses = []
        for step in range(steps):
            got = self.train_step(xs, y)
            with tf.GradientTape() as tape:
                ref = loss_fn(y, call())
            g = tape.gradient(ref, model.trainable_weights)
            optimizer.apply_gradients([(gi, w) for gi, w in zip(g, model.trainable_weights)
                                       if gi is not None])
            losses.append((got, float(ref)))
            if on_step is not None:
                on_step(step, got, float(ref))
        report["losses"] = losses
        report["step_losses"] = _worst({f"step {i + 1}": compare(a, b)
                                        for i, (a, b) in enumerate(losses)})
        weights = self.global_weights()
        by_path = {w.path: w for w in model.weights}
        report["weights"] = _worst({p: compare(v, by_path[p].numpy())
                                    for p, v in weights.items()})
        report["ok"] = all(report[k]["ok"] for k in
                           ("outputs", "loss", "gradients", "weights", "step_losses"))
        return report


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def parallelize(model: Any, input_spec: Any = None, strategy: Any = None, *,
                devices: int | None = None,
                distribute_strategy: tf.distribute.Strategy | None = None,
                optimizer: str | runtime.Optimizer = "sgd", learning_rate: float | None = None,
                loss: Any = None, training: bool = False, cluster: Cluster | None = None,
                search_options: Mapping[str, Any] | None = None) -> ParallelModel:
    """Capture ``model``, choose or check the strategy, reconstruct and place it on devices.

    ``strategy``: a ``tapas.search.Strategy``, the path of one saved as JSON, or ``None`` to
    search on ``cluster`` (default ``Cluster.loopback_cpu(N)``; ``search_options`` go to
    ``tapas.search``). ``devices``/``distribute_strategy``: see the module docstring.
    ``loss``: a ``keras.losses.Loss`` (default: the compiled model's loss).
    ``training``: capture (and verify against) the training-mode graph.
    """
    from tapas import reconstruct, search as search_mod
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
    else:
        strategy.check(graph, num_devices=n)
        strategy = strategy.bind(graph)
    strategy.check(graph, num_devices=n)

    start = time.perf_counter()
    plan = reconstruct.Plan.from_strategy(strategy, graph)
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
