"""Equivalence with the single-device model: a sharded program against one device.

In:  either a traced model, its :class:`tapas.ir.Graph`, a
     ``tapas.execution.program.reconstruct.Plan``
     and global input arrays (:func:`compare_with_single_device`: the plan simulated on N
     shards in one process), or a ``tapas.execution.api.parallel.ParallelModel`` and a batch
     (:func:`verify_with_keras`: the runtime on its devices against the Keras model).
Out: :class:`Comparison` (the largest difference of every output and gradient, and the
     collectives the simulated program recorded), or the ``verify`` report: per quantity
     (outputs, loss, gradients, step losses, weights after the steps) the largest
     difference and whether it is within ``|got - want| <= atol + rtol |want|``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas import ir
from tapas.capturing.tracing import states_by_path, weights_by_path
from tapas.execution.checking import keras_reference
from tapas.execution.checking.keras_reference import reference_loss, reference_sensitivity
from tapas.execution.program.collectives import Audit, CommRecord, SimulatedCollectives
from tapas.sharding.gradients import NO_GRADIENT
from tapas.sharding.placements import Placement, Split

__all__ = ["Difference", "Comparison", "compare_with_single_device", "compare",
           "verify_with_keras", "RTOL", "ATOL_FACTOR"]

RTOL = 1e-5
ATOL_FACTOR = 1e-5   # absolute tolerance, times the largest reference magnitude


# ---- a plan simulated on N shards against one device ---------------------------------------

#SINGLE
@dataclasses.dataclass(frozen=True)
class Difference:
    """The largest difference between the simulated sharded program and the reference."""

    what: str             # "output 0", "gradient of 'dense/kernel'", "gradient of input 0"
    abs_diff: float       # largest |sharded - reference|
    magnitude: float      # largest |reference| of that value

    def __str__(self) -> str:
        return f"{self.what}: |diff| {self.abs_diff:.3g} (reference magnitude {self.magnitude:.3g})"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Forward outputs and gradients of a plan, simulated on N shards, against one device."""

    differences: tuple[Difference, ...]
    audit: tuple[CommRecord, ...]

    @property
    def worst(self) -> Difference:
        return max(self.differences, key=lambda d: d.abs_diff / max(d.magnitude, 1e-30))

    def ok(self, rtol: float = 1e-5, atol: float = 1e-5) -> bool:
        """Every difference within ``rtol * magnitude + atol * scale``, where ``scale`` is
        the largest magnitude of its kind (outputs, gradients, writes), as ``verify``
        scales its absolute tolerance: a gradient that is zero but for rounding (an
        attention key bias: softmax ignores a shift of every score of a row) is rounding
        noise of the others' size, not a difference of its own size."""
        scale: dict[str, float] = {}
        for d in self.differences:
            kind = d.what.split(" ")[0]
            scale[kind] = max(scale.get(kind, 0.0), d.magnitude)
        return all(d.abs_diff <= rtol * d.magnitude + atol * max(scale[d.what.split(" ")[0]],
                                                                 1e-30)
                   for d in self.differences)


@dataclasses.dataclass(frozen=True)
class _Case:
    """What both runs of :func:`compare_with_single_device` share."""

    prog: Any                            # the sharded Program
    values: Mapping[str, np.ndarray]     # global weight values by path
    paths: tuple[str, ...]
    trainable: tuple[str, ...]           # weights whose gradients are compared
    inputs: tuple[np.ndarray, ...]
    float_inputs: tuple[int, ...]        # inputs whose gradients are compared
    coeffs: tuple[np.ndarray | None, ...]   # the loss is sum(output * coeff)


def compare_with_single_device(trace: Any, graph: ir.Graph, plan: Any,
                               inputs: Sequence[Any], seed: int = 0) -> Comparison:
    """Run ``plan`` on ``plan.num_devices`` simulated shards (``SimulatedCollectives``) and
    the traced function on one device, with the model's current weights and ``inputs``
    (one global array per trace input); compare outputs and gradients.

    The loss is ``sum(output * c)`` for a fixed random ``c`` per output: each replica takes
    the full loss of a replicated output and its own share of a split one, so the sharded
    gradients must equal the single-device ones exactly (up to float rounding).
    """
    from tapas.execution.program.plan import Plan
    from tapas.execution.program.reconstruct import Program
    prog = Program(trace, graph, plan)
    single = Program(trace, graph, Plan.replicated(graph, 1))
    rng = np.random.default_rng(seed)
    start = _weights_and_inputs(trace, prog, graph, inputs)
    shapes = [t.shape for t in graph.outputs]
    if any(s is None or any(d < 0 for d in s) for s in shapes):
        shapes = _output_shapes(single, start[0], start[1], start[3])  # dynamic in the trace
    case = _Case(prog, *start,
                 tuple(rng.standard_normal(shape).astype(t.dtype)
                       if t.dtype.startswith("float") else None
                       for t, shape in zip(graph.outputs, shapes)))
    audit = Audit()
    s_outs, (s_wg, s_xg), s_writes = _sharded_run(case, audit)
    r_outs, (r_wg, r_xg), r_writes = _reference_run(case, single)
    diffs = [_difference(f"output {k} '{graph.outputs[k].name}'", so, ro,
                         prog.output_placements[k])
             for k, (so, ro) in enumerate(zip(s_outs, r_outs))]
    diffs += [_difference(f"gradient of '{p}'", sg, rg, prog.weight_layouts[p].placement)
              for p, sg, rg in zip(case.trainable, s_wg, r_wg)]
    diffs += [_difference(f"gradient of input {k}", sg, rg, prog.input_placements[k])
              for k, sg, rg in zip(case.float_inputs, s_xg, r_xg)]
    # a training-mode graph's variable writes (seed states, moving statistics)
    diffs += [_difference(f"write of '{p}'", s_writes[p], r_writes[p][0],
                          prog.stored_placement(p)) for p in sorted(r_writes)]
    return Comparison(tuple(diffs), audit.records)


def _output_shapes(single: Any, values: Mapping[str, np.ndarray], paths: Sequence[str],
                   inputs: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    """The shapes of the outputs of the one-device program ``single`` on these values (an
    output whose length the traced graph leaves unknown)."""
    @tf.function(autograph=False)
    def forward():
        return [o[0] for o in single([[tf.constant(x)] for x in inputs],
                                     {p: [tf.constant(values[p])] for p in paths},
                                     SimulatedCollectives(1), {})]
    return [tuple(o.shape) for o in forward()]


def _weights_and_inputs(trace: Any, prog: Any, graph: ir.Graph, inputs: Sequence[Any]
                        ) -> tuple:
    """What both comparisons start from: the model's weight values by path (those the
    program lays out), the paths in order, the trainable ones (gradients compared), the
    input arrays and the inputs whose gradients are compared (float, not stopped)."""
    values = {prog._weight_of_ph[ph]: np.asarray(tf.convert_to_tensor(v))
              for ph, v in trace.variables.items()
              if prog._weight_of_ph[ph] in prog.weight_layouts}
    paths = tuple(sorted(values))
    arrays = tuple(np.asarray(x) for x in inputs)
    return (values, paths, tuple(p for p in paths if prog.weight_layouts[p].trainable),
            arrays, tuple(k for k, x in enumerate(arrays) if x.dtype.kind == "f"
                          and not stopped(trace, graph.inputs[k].name)))


def _sharded_run(case: _Case, audit: Audit) -> Any:
    """Outputs and gradients of the plan on N simulated shards, recording into ``audit``."""
    prog, n = case.prog, case.prog.num_devices

    @tf.function(autograph=False)
    def sharded():
        coll = SimulatedCollectives(n, audit)
        local_w = {p: [tf.constant(prog.weight_layouts[p].placement.shard(case.values[p], n, i))
                       for i in range(n)] for p in case.paths}
        local_x = [[tf.constant(prog.input_placements[k].shard(x, n, i)) for i in range(n)]
                   for k, x in enumerate(case.inputs)]
        with tf.GradientTape() as tape:
            tape.watch([w for p in case.paths for w in local_w[p]])
            tape.watch([x for k in case.float_inputs for x in local_x[k]])
            writes: dict = {}
            outs = prog(local_x, local_w, coll, writes)
            loss = tf.constant(0.0)
            for k, c in enumerate(case.coeffs):
                if c is None:
                    continue
                plc = prog.output_placements[k]
                for i, o in enumerate(outs[k]):
                    loss += tf.cast(tf.reduce_sum(o * plc.shard(c, n, i)), tf.float32)
        grads = tape.gradient(loss, ([local_w[p] for p in case.trainable],
                                     [local_x[k] for k in case.float_inputs]),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outs, grads, writes

    return sharded()


def _reference_run(case: _Case, single: Any) -> Any:
    """Outputs and gradients of the single-device program ``single``."""

    @tf.function(autograph=False)
    def reference():
        ws = {p: tf.constant(case.values[p]) for p in case.paths}
        xs = [tf.constant(x) for x in case.inputs]
        with tf.GradientTape() as tape:
            tape.watch(list(ws.values()))
            tape.watch([xs[k] for k in case.float_inputs])
            writes: dict = {}
            outs = [o[0] for o in single([[x] for x in xs], {p: [ws[p]] for p in case.paths},
                                         SimulatedCollectives(1), writes)]
            loss = tf.constant(0.0)
            for o, c in zip(outs, case.coeffs):
                if c is not None:
                    loss += tf.cast(tf.reduce_sum(o * c), tf.float32)
        grads = tape.gradient(loss, ([ws[p] for p in case.trainable],
                                     [xs[k] for k in case.float_inputs]),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return outs, grads, writes

    return reference()


def _difference(what: str, locals_: Sequence[Any], ref: Any, plc: Placement) -> Difference:
    """The largest difference of the local values ``locals_`` (placed ``plc``) from ``ref``;
    strings (an ``Assert``'s message, Hugging Face's embeddings check their ids) are equal
    or not (0 or inf)."""
    ref = np.asarray(tf.convert_to_tensor(ref))
    if ref.dtype.kind in "SUO":
        same = all(np.array_equal(np.asarray(tf.convert_to_tensor(v)), ref) for v in locals_)
        return Difference(what, 0.0 if same else float("inf"), 1.0)
    ref = ref.astype(np.float64)
    mag = _magnitude(ref)
    if isinstance(plc, Split):
        got = np.concatenate([np.asarray(tf.convert_to_tensor(v), dtype=np.float64)
                              for v in locals_], axis=plc.axis)
        worst = float(np.max(abs_difference(got, ref))) if ref.size else 0.0
    else:  # every replica must hold the whole value
        worst = max(float(np.max(abs_difference(
            np.asarray(tf.convert_to_tensor(v), np.float64), ref))) if ref.size else 0.0
            for v in locals_)
    return Difference(what, worst, mag)


def abs_difference(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``|got - want|`` elementwise, 0 where both hold the same infinity or both NaN (a
    max-pooling's ``-inf`` padding in both programs), inf where only one is not finite."""
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    return np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))


def _magnitude(x: np.ndarray) -> float:
    """The largest finite ``|x|`` (0 for an empty or all non-finite array)."""
    finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


# ---- the runtime against the Keras model ----------------------------------------------------

def compare(got: Any, want: Any, rtol: float = RTOL, atol_factor: float = ATOL_FACTOR,
            scale: float | None = None) -> dict[str, float | bool]:
    """Largest difference of two arrays and whether ``|got - want| <= atol + rtol |want|``
    with ``atol = atol_factor * scale``; ``scale`` defaults to ``max |want|`` (``verify``
    passes the largest magnitude over all weights, or all gradients)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs reference {want.shape}")
    if scale is None:
        scale = _magnitude(want)
    diff = abs_difference(got, want)
    ok = bool(np.all(diff <= atol_factor * scale +
                     rtol * np.where(np.isfinite(want), np.abs(want), 0.0)))
    return {"max_abs_diff": float(diff.max()) if diff.size else 0.0, "scale": scale, "ok": ok}


def _worst(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The largest of several :func:`compare` results, whether all are ok, and how many
    elements Adam's comparison left out as ill-conditioned."""
    if not results:
        return {"max_abs_diff": 0.0, "ok": True, "worst": None, "count": 0}
    name = max(results, key=lambda k: results[k]["max_abs_diff"])
    out = {"max_abs_diff": results[name]["max_abs_diff"], "scale": results[name]["scale"],
           "ok": all(r["ok"] for r in results.values()), "worst": name,
           "count": len(results)}
    ill = sum(int(r.get("ill_conditioned", 0)) for r in results.values())
    if ill:
        out["ill_conditioned"] = ill
        out["max_abs_diff_all"] = max(r.get("max_abs_diff_all", r["max_abs_diff"])
                                      for r in results.values())
    return out


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


def verify_with_keras(pm: Any, xs: list, y: Any, steps: int = 3,
                      on_step: Any = None) -> dict[str, Any]:
    """``ParallelModel.verify``: the parallel model ``pm`` and its single-device Keras model
    (called with ``xs``, one array per input in the program's order, packed into the
    structure the model takes) from the same weights: outputs, loss and gradients of one
    batch, then ``steps`` optimizer steps of both (the Keras optimizer with the same
    hyper-parameters), the losses of each step and the weights after them. Trains
    ``pm.model`` as the reference. Both are called with ``training=pm.training``; in
    training mode each side runs one forward pass per batch and per step (dropout draws the
    same seeds in both), and the seed-generator states after the steps are compared too
    (``states``: equal or not; the moving statistics are among the weights). A
    training-mode model with dropout or batch norm is also checked in inference mode after
    the first batch (``inference``: ``pm.for_inference()``'s outputs and loss on the same
    weights, moving statistics updated once, against ``model(x, training=False)``), so one
    call verifies both modes."""
    rt = pm.runtime
    drawn = getattr(pm.program, "stateful_random", ())
    if pm.training and drawn:
        raise ValueError(
            f"verify cannot compare training mode with the Keras model: the graph draws "
            f"random numbers with {len(drawn)} stateful op(s) (e.g. '{drawn[0]}': Keras 2's "
            "Dropout, tf.random.* without a seed), whose draws come from states inside "
            "TensorFlow that nothing can replay. The parallel program draws them from the "
            "step number, one draw shared by every device, so it computes the same "
            "function with other random numbers. Verify with training=False (the same "
            "model, no random draws), check the plan in training mode against the graph "
            "replayed on one device with the same draws "
            "(tapas.execution.checking.verify.compare_with_single_device; scripts/equivalence.py "
            "--modes=training does so), or build the model with Keras 3 layers (their "
            "dropout draws from seed states, which verify replays)")
    if int(rt.iterations.numpy()) != 0:
        raise RuntimeError("verify() compares from the initial state: call it before any "
                           "train_step, on a freshly parallelized model")
    model = pm.model
    structure = pm.inputs.pack(xs)   # the structure the Keras model is called with
    call = (lambda: model(structure, training=pm.training))
    report, ref_g = _first_batch(rt, model, call, xs, y)
    keys = ["outputs", "loss", "gradients", "weights", "step_losses", "states"]
    inference = pm.for_inference()
    if inference is not pm:   # the inference graph on the same weights, as evaluate runs it
        report["inference"] = _inference_check(inference, model, structure, xs, y)
        keys.append("inference")
    report["losses"] = keras_reference.train_side_by_side(pm, call, xs, y, steps, on_step)
    report["step_losses"] = _worst({f"step {i + 1}": compare(a, b)
                                    for i, (a, b) in enumerate(report["losses"])})
    report["finite"] = keras_reference.finite_losses(report["losses"])
    keys.append("finite")
    report["weights"] = _weights_after(pm, ref_g, report["gradients"]["max_abs_diff"])
    report["states"] = _states_after(pm)
    report["mode"] = "training" if pm.training else "inference"
    report["ok"] = all(report[k]["ok"] for k in keys)
    if not (report["gradients"]["ok"] and report["outputs"]["ok"]):
        report["sensitivity"] = reference_sensitivity(model, call, rt.loss, y,
                                                      atol_factor=ATOL_FACTOR)
    return report


def _inference_check(inference: Any, model: Any, structure: Any, xs: list,
                     y: Any) -> dict[str, Any]:
    """The inference-mode program (``ParallelModel.for_inference``, on the training
    program's weights, before the optimizer steps: Adam's rounding noise in the weights
    would blur it) against ``model(x, training=False)``: outputs and loss."""
    rt = inference.runtime
    rt.refresh()
    outs = rt.predict(xs)
    outs = outs if isinstance(outs, list) else [outs]
    ref = model(structure, training=False)
    loss = rt.forward_loss(xs, y)
    return _worst({"outputs": compare(outs[0], np.asarray(_first(ref))),
                   "loss": compare(loss, float(reference_loss(rt, model, y, ref)))})


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (list, tuple)) else out


def _first_batch(rt: Any, model: Any, call: Any, xs: list,
                 y: Any) -> tuple[dict[str, Any], dict]:
    """Outputs, loss and gradients of one batch; also the reference gradients by path."""
    report: dict[str, Any] = {}
    outs, loss, grads = rt.evaluate(xs, y)
    trainable_ids = {id(w) for w in model.trainable_weights}
    trainable = {p: w for p, w in weights_by_path(model).items()
                 if id(w) in trainable_ids and p in grads}
    with tf.GradientTape() as tape:   # one forward pass, as rt.evaluate (training mode)
        ref_out = call()
        ref_loss = reference_loss(rt, model, y, ref_out)
    ref_grads = tape.gradient(ref_loss, list(trainable.values()))
    report["outputs"] = compare(outs[0], np.asarray(_first(ref_out)))   # scale: the largest
    report["loss"] = compare(loss, float(ref_loss))
    # (None: Keras's tape found no path to the loss, e.g. a weight used in the branch of a
    # tf.cond not taken, Hugging Face LED's global attention: a zero gradient)
    ref_g = {p: np.zeros(w.shape, np.float32) if g is None else tf.convert_to_tensor(g).numpy()
             for (p, w), g in zip(trainable.items(), ref_grads)}
    g_scale = max((float(np.abs(g).max()) for g in ref_g.values() if g.size), default=0.0)
    report["gradients"] = _worst({p: compare(grads[p], g, scale=g_scale)
                                  for p, g in ref_g.items()})
    return report, ref_g


def _states_after(pm: Any) -> dict[str, Any]:
    """The seed-generator states of ``pm`` against its Keras model's (integers: equal)."""
    by_path = states_by_path(pm.model)
    got = pm.global_states()
    bad = [p for p, v in got.items() if p not in by_path or
           not np.array_equal(v, np.asarray(by_path[p].numpy()))]
    return {"ok": not bad, "count": len(got), "differ": bad,
            "max_abs_diff": 0.0 if not bad else float("inf")}


def _weights_after(pm: Any, ref_g: Mapping[str, np.ndarray], noise: float) -> dict[str, Any]:
    """The global weights of ``pm`` against its Keras model's, after the steps; ``noise``
    is the largest gradient difference (Adam's ill-conditioned elements, see
    :func:`_adam_compare`)."""
    weights = pm.global_weights()
    by_path = weights_by_path(pm.model)
    refs = {p: by_path[p].numpy() for p in weights}
    scale = max((float(np.abs(v).max()) for v in refs.values() if v.size), default=0.0)
    adam = pm.runtime.optimizer.name != "sgd"   # adaptive: divides by a moment
    return _worst({p: _adam_compare(v, refs[p], ref_g.get(p), noise, scale) if adam
                   else compare(v, refs[p], scale=scale) for p, v in weights.items()})


# ---- the pattern checker's tools (tests/test_pattern_checker.py) ----------------------

def stopped(trace: Any, name: str) -> bool:
    """Whether tensor ``name`` of the traced graph is made by an op that passes no gradient
    back (batch norm's StopGradient of the mean): a GraphNode checked on its own gets it as
    an input whose gradient the model never computes, so it is not compared."""
    try:
        return trace.graph.get_tensor_by_name(name).op.type in NO_GRADIENT
    except (KeyError, ValueError):
        return False


def node_graph(graph: ir.Graph, node_id: int) -> ir.Graph:
    """GraphNode ``node_id`` as a graph of its own: its inputs are the graph inputs, its
    outputs the graph outputs. A Program over it replays just that node."""
    node = graph.nodes[node_id]
    return ir.Graph(nodes=(dataclasses.replace(node, id=0),), edges=(), inputs=node.inputs,
                    outputs=node.outputs, name=f"{graph.name}/{node.name}")


def nodes_graph(graph: ir.Graph, node_ids: Sequence[int]) -> ir.Graph:
    """GraphNodes ``node_ids`` as a graph of their own (renumbered in graph order, the
    edges between them kept): its inputs are the tensors they read from other GraphNodes,
    its outputs every output of theirs but the variants (a TensorList handle is no value
    to compare)."""
    ids = sorted(set(node_ids))
    new = {old: k for k, old in enumerate(ids)}
    nodes = tuple(dataclasses.replace(graph.nodes[i], id=new[i]) for i in ids)
    produced = {t.name for n in nodes for t in n.outputs}
    inputs = tuple({t.name: t for n in nodes for t in n.inputs
                    if t.name not in produced}.values())
    edges = tuple(ir.Edge(new[e.src], new[e.dst], e.tensor) for e in graph.edges
                  if e.src in new and e.dst in new)
    outputs = tuple(t for n in nodes for t in n.outputs if t.dtype != "variant")
    return ir.Graph(nodes=nodes, edges=edges, inputs=inputs, outputs=outputs,
                    name=f"{graph.name}/{nodes[0].name}+{len(nodes) - 1}")


def intermediate_values(trace: Any, graph: ir.Graph, inputs: Sequence[Any],
                        names: Sequence[str]) -> dict[str, np.ndarray]:
    """The values of the GraphNode outputs ``names`` when the traced model runs on ``inputs``
    (one array per graph input) with its current weights, on one device. Variants (a
    TensorList handle between GraphNodes: keras-hub RWKV-7's TensorArray) have no array
    value and are left out."""
    from tapas.execution.program.plan import Plan
    from tapas.execution.program.reconstruct import Program
    prog = Program(trace, graph, Plan.replicated(graph, 1))
    variants = {t.name for n in graph.nodes for t in n.outputs if t.dtype == "variant"}
    names = [n for n in dict.fromkeys(names) if n not in variants]

    @tf.function(autograph=False)
    def run():
        got = prog.values([[tf.constant(np.asarray(x))] for x in inputs], prog.trace_weights(),
                          SimulatedCollectives(1), names)
        return [got[n][0] for n in names]
    return {n: v.numpy() for n, v in zip(names, run())}
