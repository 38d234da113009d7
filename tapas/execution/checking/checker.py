"""The pattern checker and the plan checker: what the search may choose, built and compared.

In:  a traced model (:func:`tapas.capturing.trace`), its :class:`tapas.ir.Graph` and global
     input arrays (one per graph input); for :func:`check_plan` also a whole-model plan.
Out: :func:`check_node_patterns` -- every ShardingPattern ``tapas.sharding.patterns`` offers
     for every GraphNode (one GraphNode per signature), rebuilt alone on N simulated shards
     and compared with the node on one device (outputs, gradients of weights and float
     inputs, collectives against the pattern's comms): the number checked and a message
     per pattern that cannot be rebuilt or differs; :func:`check_nested_patterns` -- the
     same on a 2-D mesh with the experts over its rows (every pattern the nested search
     may give an expert GraphNode); :func:`check_plan` -- the same for a
     whole-model plan; :func:`synthetic_inputs` -- valid inputs for a captured graph.

A pattern the search may choose must be buildable: one that
:mod:`tapas.execution.program.reconstruct`
refuses (``ReconstructError``, or TensorFlow refusing a replayed op) is reported as
"cannot be rebuilt", so the checker catches patterns that are valid on paper and fail at
``tapas.parallelize`` (docs/sharding.md, *the pattern checker*).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas import ir
from tapas.execution.checking import audit, nested, verify
from tapas.execution.program.plan import Plan, ReconstructError
from tapas.sharding import patterns

__all__ = ["synthetic_inputs", "check_node_patterns", "check_nested_patterns", "check_plan",
           "BUILD_ERRORS"]

# what a pattern that cannot be rebuilt raises: reconstruction's own refusal, or TensorFlow
# refusing a replayed op (shape inference, an invalid argument while running it)
BUILD_ERRORS = (ReconstructError, ValueError, tf.errors.InvalidArgumentError)

# integer inputs whose name says they are small categorical values (segment ids, masks)
_SMALL_INT_NAMES = ("mask", "segment", "type")


def synthetic_inputs(graph: ir.Graph, seed: int = 0, high: int = 16) -> list[np.ndarray]:
    """One global array per input of ``graph``: floats from a normal distribution, integer
    token ids in ``[0, high)``, and 0/1 for integer inputs named like masks or segment ids
    (a padding mask of ones but for the last position, so padding is exercised)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in graph.inputs:
        shape = tuple(t.shape or ())
        if t.dtype == "bool" or (t.dtype.startswith("int") and "mask" in t.name):
            a = np.ones(shape, dtype=t.dtype)
            if a.ndim >= 2 and shape[-1] > 1:
                a[..., -1] = 0
            out.append(a)
        elif t.dtype.startswith(("int", "uint")):
            hi = 2 if any(k in t.name for k in _SMALL_INT_NAMES) else high
            out.append(rng.integers(0, hi, size=shape).astype(t.dtype))
        else:
            out.append(rng.standard_normal(shape).astype(t.dtype))
    return out


def _describe(node: ir.GraphNode, pat: Any, num_devices: int) -> str:
    return (f"GraphNode {node.id} '{node.name}' ({node.kind.value}), pattern '{pat.name}' "
            f"{pat.expr}, N={num_devices}")


def check_node_patterns(trace: Any, graph: ir.Graph, values: Mapping[str, np.ndarray],
                        num_devices: int, rtol: float = 1e-5,
                        atol: float = 1e-5) -> tuple[int, list[str]]:
    """(number checked, failure messages) for every pattern of every GraphNode of ``graph``
    (the first GraphNode of each signature: identical nodes have identical patterns).
    ``values`` holds the value of every GraphNode input
    (:func:`tapas.execution.checking.verify.intermediate_values`). GraphNodes joined by variants (a
    TensorArray's list handle, which has no value to feed or compare) are checked together:
    each pattern of one of them with the others replicated."""
    failures: list[str] = []
    checked = 0
    seen: set[str] = set()
    units = _variant_units(graph)
    for node in graph.nodes:
        if node.kind == ir.Kind.INPUT or (node.signature and node.signature in seen):
            continue
        seen.add(node.signature)
        unit = units.get(node.id)
        sub = verify.nodes_graph(graph, unit) if unit else verify.node_graph(graph, node.id)
        local = unit.index(node.id) if unit else 0
        args = [values[i.name] for i in sub.inputs]
        for pat in patterns.patterns_for(node, graph, num_devices):
            checked += 1
            problem = _check_one(trace, sub, Plan(num_devices, {local: pat}), args, rtol, atol)
            if problem:
                failures.append(f"{_describe(node, pat, num_devices)}: {problem}")
    return checked, failures


def _variant_units(graph: ir.Graph) -> dict[int, list[int]]:
    """GraphNode id -> the ids (sorted) of the GraphNodes joined to it by variant edges,
    for every GraphNode that reads or writes a variant."""
    parent = {n.id: n.id for n in graph.nodes}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for e in graph.edges:
        if e.tensor.dtype == "variant":
            parent[root(e.src)] = root(e.dst)
    groups: dict[int, list[int]] = {}
    for e in graph.edges:
        if e.tensor.dtype == "variant":
            for i in (e.src, e.dst):
                members = groups.setdefault(root(i), [])
                if i not in members:
                    members.append(i)
    return {i: sorted(members) for members in groups.values() for i in members}


def check_nested_patterns(trace: Any, graph: ir.Graph, values: Mapping[str, np.ndarray],
                          num_devices: int, rows: int, rtol: float = 1e-5,
                          atol: float = 1e-5, seed: int = 0) -> tuple[int, list[str]]:
    """The 2-D pattern checker: (number checked, failure messages) for every pattern a
    ``rows x num_devices:experts`` mesh may give each GraphNode of the expert region
    (``tapas.planning.experts.nested_patterns``; the first GraphNode of each signature),
    rebuilt alone with its experts cut over the rows, the tokens exchanged over the columns
    and the pattern in each row, all ``rows * num_devices`` replicas simulated
    (``tapas.execution.checking.nested.compare_nested``), against the GraphNode on one device run on
    each row's share. ``values``: every GraphNode input's value in one row's graph
    (:func:`tapas.execution.checking.verify.intermediate_values`); the other rows get fresh random
    tokens (floats) or copies (integers), so that rows differ."""
    from tapas.planning import experts
    region = experts.ExpertRegion.of(graph, rows)
    rng = np.random.default_rng(seed)
    failures: list[str] = []
    checked = 0
    seen: set[str] = set()
    for node in graph.nodes:
        if node.id not in region.nodes or (node.signature and node.signature in seen):
            continue
        seen.add(node.signature)
        sub = verify.node_graph(graph, node.id)
        sub_region = experts.ExpertRegion.of(sub, rows)
        args = []
        for t in node.inputs:
            x = np.asarray(values[t.name])
            axis = 1 if t.name in sub_region.boundary else 0
            others = [rng.standard_normal(x.shape).astype(x.dtype) if x.dtype.kind == "f"
                      else x for _ in range(rows - 1)]
            args.append(np.concatenate([x] + others, axis=axis))
        for pat in patterns.patterns_for(node, graph, num_devices):
            if experts.allowed_pattern(pat, sub.nodes[0], sub_region):
                continue   # the nested search never offers it (the all-to-all moves the axis)
            checked += 1
            label = f"{_describe(node, pat, num_devices)} on {rows}x{num_devices}:experts"
            try:
                cmp = nested.compare_nested(trace, sub, Plan(num_devices, {0: pat}), args,
                                            rows)
            except BUILD_ERRORS as err:
                failures.append(f"{label}: cannot be rebuilt: {type(err).__name__}: {err}")
                continue
            if not cmp.ok(rtol=rtol, atol=atol):
                failures.append(f"{label}: largest difference {cmp.worst}")
    return checked, failures


def _check_one(trace: Any, graph: ir.Graph, plan: Plan, args: Sequence[Any], rtol: float,
               atol: float) -> str:
    """Why ``plan`` on ``graph`` is wrong ('' when it is right): cannot be rebuilt, a value
    differs from one device, or its collectives differ from what it declares."""
    try:
        cmp = verify.compare_with_single_device(trace, graph, plan, args)
    except BUILD_ERRORS as err:
        return f"cannot be rebuilt: {type(err).__name__}: {err}"
    if not cmp.ok(rtol=rtol, atol=atol):
        return f"largest difference {cmp.worst}"
    from tapas.execution.program.reconstruct import Program
    # the gradients the check computes: of every float input but one the model stops
    # (batch norm's StopGradient of the mean, read by the variance GraphNode)
    sources = {t.name for t in graph.inputs
               if t.dtype.startswith("float") and not verify.stopped(trace, t.name)}
    mismatch = audit.compare_audit(cmp.audit, audit.program_comms(
        Program(trace, graph, plan), input_gradients=sources))
    if mismatch:
        return "collectives differ from the pattern's comms: " + "; ".join(mismatch)
    return ""


def check_plan(trace: Any, graph: ir.Graph, plan: Plan, inputs: Sequence[Any],
               rtol: float = 1e-5, atol: float = 1e-5) -> dict[str, Any]:
    """A whole-model ``plan`` on its N simulated shards against one device: ``{"ok",
    "problem", "worst", "sharded"}`` (``problem``: '' or why it cannot be rebuilt or
    differs; ``worst``: the largest relative difference as text). Tolerance: ``atol``
    times the largest magnitude of the quantity (for gradients: of any gradient, as
    ``ParallelModel.verify``) plus ``rtol`` times its own."""
    sharded = sum(1 for p in plan.patterns.values()
                  if getattr(p, "name", "") != patterns.REPLICATE)
    try:
        cmp = verify.compare_with_single_device(trace, graph, plan, inputs)
    except BUILD_ERRORS as err:
        return {"ok": False, "problem": f"cannot be rebuilt: {type(err).__name__}: {err}",
                "worst": "", "sharded": sharded}
    bad = _beyond_tolerance(cmp.differences, rtol, atol)
    return {"ok": not bad, "problem": f"largest difference {bad[0]}" if bad else "",
            "worst": str(cmp.worst), "sharded": sharded}


def _beyond_tolerance(diffs: Sequence[verify.Difference], rtol: float,
                      atol: float) -> list[verify.Difference]:
    """The differences beyond ``atol * scale + rtol * magnitude``, worst first, where the
    scale of a gradient is the largest gradient of the model (as ``verify`` measures it): a
    gradient that is zero in exact arithmetic (an attention key bias: softmax ignores a
    shift of its scores) is rounding noise in both programs, and its own magnitude is no
    scale for it."""
    grads = [d.magnitude for d in diffs if d.what.startswith("gradient")]
    g_scale = max(grads, default=0.0)
    bad = []
    for d in diffs:
        scale = max(d.magnitude, g_scale) if d.what.startswith("gradient") else d.magnitude
        if d.abs_diff > atol * scale + rtol * d.magnitude:
            bad.append(d)
    return sorted(bad, key=lambda d: -d.abs_diff / max(d.magnitude, 1e-30))
