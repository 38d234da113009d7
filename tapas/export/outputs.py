"""Layer-output layouts: the activations a TAPAS plan pins, as Keras LayoutMap entries keyed
``"<layer.path>/output"`` (``keras.layers.Layer.__call__`` constrains a layer's output to
the layout its distribution gives that key; ``ModelParallel`` looks it up in its LayoutMap).

In:  a Strategy bound to its ``tapas.ir.Graph``, the Keras layer paths of the model
     (``layer.path`` of ``model._flatten_layers()``; :func:`layer_paths` reads them from a
     model) and which placements to emit (``"all"``: split and replicated activations;
     ``"split"``: split ones only).
Out: :func:`output_layouts` -> (key -> axes, layer path -> placement, layer path -> why it
     got no entry); :func:`pinned_outputs` (tensor name -> placement of the outputs those
     entries pin); :func:`check_keys` (which strings each key fullmatches).
Raises: ``ValueError`` for an unknown ``emit``; a layer whose output cannot be found in the
     graph, or found ambiguously, is skipped with the reason, never guessed.

How a layer is found: on the TensorFlow backend each Keras name scope is a TF name scope,
made unique by TF (``up`` entered twice is ``up_1``), so a layer call is the op-name scope
whose trailing parts are the layer path's parts, each equal or with a ``_<n>`` suffix. Where
two layer paths fit one scope, the one owning a weight read inside it (its ``<path>/...``
weight), else the longest path, else none. The layer's output is the one non-weight tensor
produced inside the scope and read outside it (or a graph output); its placement is what
its GraphNode's pattern leaves it in, after the pattern's forward collective on it. A layer
called more than once gets an entry only where every call's output is placed alike.
Partial sums, split dimensions above the tensor's rank and layers without exactly one output
get none. Keys are the escaped paths plus ``/output``: each fullmatches one string only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from tapas.ir import Graph
from tapas.planning.strategy import Strategy
from tapas.sharding.placements import Replica, Split

__all__ = ["output_layouts", "pinned_outputs", "forward_placement", "layer_paths", "check_keys", "OUTPUT_SUFFIX"]

OUTPUT_SUFFIX = "/output"
_NOT_OUTPUTS = {"ReadVariableOp", "Placeholder", "Const", "VarHandleOp", "Shape", "Size",
                "Rank", "NoOp"}


def layer_paths(model: Any) -> list[str]:
    """``layer.path`` of every layer inside ``model`` (not the model itself) whose calls
    return one tensor (a layout on a tuple or dict of outputs fails in Keras: the JAX
    backend device-puts the structure when the functional model is built), the strings of
    a list or tuple of paths, or none (anything else, e.g. a ``tf.function``)."""
    if hasattr(model, "_flatten_layers"):
        return [layer.path for layer in model._flatten_layers(include_self=False)
                if getattr(layer, "path", None) and all(
                    len(getattr(node, "outputs", ())) <= 1
                    for node in getattr(layer, "_inbound_nodes", ()))]
    return [str(p) for p in model] if isinstance(model, (list, tuple)) else []


def _part_fits(scope_part: str, name: str) -> bool:
    return scope_part == name or re.fullmatch(re.escape(name) + r"_\d+", scope_part) is not None


def _fits(scope: tuple[str, ...], parts: Sequence[str]) -> bool:
    k = len(parts)
    return len(scope) >= k and all(_part_fits(s, p) for s, p in zip(scope[-k:], parts))


def _scopes(graph: Graph) -> tuple[dict[tuple[str, ...], list[str]],
                                   dict[tuple[str, ...], set[str]], dict[str, int]]:
    """(scope -> its escaping non-weight tensors, scope -> weight paths read in it,
    tensor -> producing GraphNode)."""
    producer: dict[str, int] = {}
    op_type: dict[str, str] = {}
    scope_of: dict[str, tuple[str, ...]] = {}
    consumers: dict[str, list[tuple[str, ...]]] = {}
    placeholders = {w.placeholder: w.path for w in graph.weights}
    weights_in: dict[tuple[str, ...], set[str]] = {}
    for node in graph.nodes:
        for op in node.ops:
            parts = tuple(op.name.split("/"))
            for t in op.outputs:
                producer[t.name] = node.id
                op_type[t.name] = op.type
                scope_of[t.name] = parts[:-1]
            for name in op.inputs:
                consumers.setdefault(name.lstrip("^"), []).append(parts)
            if op.name in placeholders:
                for k in range(1, len(parts)):
                    weights_in.setdefault(parts[:k], set()).add(placeholders[op.name])
    outputs = {t.name for t in graph.outputs}
    escaping: dict[tuple[str, ...], list[str]] = {}
    for name, scope in scope_of.items():
        if op_type[name] in _NOT_OUTPUTS:
            continue
        inner = 0 if name in outputs else len(scope)
        for parts in consumers.get(name, ()):
            common = 0
            while common < min(len(scope), len(parts) - 1) and scope[common] == parts[common]:
                common += 1
            inner = min(inner, common)
        for k in range(inner + 1, len(scope) + 1):
            escaping.setdefault(scope[:k], []).append(name)
    return escaping, weights_in, producer


def _layer_of(scope: tuple[str, ...], paths: Sequence[str],
              weights: set[str]) -> tuple[str | None, str]:
    fits = [p for p in paths if _fits(scope, p.split("/"))]
    if len(fits) <= 1:
        return (fits[0] if fits else None), ""
    owners = [p for p in fits if any(w.startswith(p + "/") and "/" not in w[len(p) + 1:]
                                     for w in weights)]
    if len(owners) == 1:
        return owners[0], ""
    longest = max(len(p.split("/")) for p in fits)
    top = [p for p in fits if len(p.split("/")) == longest]
    if len(top) == 1:
        return top[0], ""
    return None, f"TF scope {'/'.join(scope)} fits layers {sorted(top)}"


def _placement(strategy: Strategy, graph: Graph, node_id: int, tensor: str) -> Any:
    return forward_placement(strategy.pattern(node_id), tensor)


def forward_placement(pattern: Any, tensor: str) -> Any:
    """The placement ``pattern`` (a ShardingPattern) leaves ``tensor`` in: its own, or the
    destination of its forward collective on it; None if it places no such tensor."""
    placed = pattern.tensors.get(tensor)
    for comm in pattern.comms:
        if comm.phase == "fwd" and comm.tensor == tensor:
            placed = comm.dst
    return placed


def _axes(placement: Any, rank: int, model_axis: str) -> tuple[Any, ...] | None:
    if isinstance(placement, Replica):
        return (None,) * rank
    if isinstance(placement, Split) and placement.axis < rank:
        return tuple(model_axis if i == placement.axis else None for i in range(rank))
    return None


def _layer_calls(strategy: Strategy, graph: Graph, paths: Sequence[str]
                 ) -> tuple[dict[str, list[tuple[Any, int, str]]], dict[str, str]]:
    """(layer path -> (placement, rank, tensor name) of each of its calls' output, layer
    path -> why it has no output entry)."""
    escaping, weights_in, producer = _scopes(graph)
    shapes = {t.name: t.shape for n in graph.nodes for op in n.ops for t in op.outputs}
    calls: dict[str, list[tuple[Any, int, str]]] = {}
    skipped: dict[str, str] = {}
    for scope, tensors in escaping.items():
        path, why = _layer_of(scope, paths, weights_in.get(scope, set()))
        if path is None:
            continue
        if len(tensors) != 1:
            skipped[path] = f"TF scope {'/'.join(scope)} has {len(tensors)} outputs"
            continue
        t = tensors[0]
        placed = _placement(strategy, graph, producer[t], t)
        calls.setdefault(path, []).append((placed, len(shapes[t] or ()), t))
    return calls, skipped


def pinned_outputs(strategy: Strategy, graph: Graph, paths: Iterable[str],
                   emit: str = "all") -> dict[str, Any]:
    """Tensor name -> placement of every layer-output tensor that :func:`output_layouts`
    pins (each call of a layer with an entry): what the exported map fixes of the
    activations."""
    strategy = strategy.bind(graph)
    paths = list(dict.fromkeys(paths))
    placements = output_layouts(strategy, graph, paths, emit)[1]
    calls = _layer_calls(strategy, graph, paths)[0]
    return {t: placed for path in placements for placed, _, t in calls[path]}


def output_layouts(strategy: Strategy, graph: Graph, paths: Iterable[str],
                   emit: str = "all", model_axis: str = "model"
                   ) -> tuple[dict[str, tuple[Any, ...]], dict[str, str], dict[str, str]]:
    """(key -> axes, layer path -> placement, layer path -> why skipped); see the module
    docstring. ``emit``: ``"split"`` or ``"all"``."""
    if emit not in ("split", "all"):
        raise ValueError(f"emit={emit!r}: use 'split' (split activations only) or 'all'")
    strategy = strategy.bind(graph)
    paths = list(dict.fromkeys(paths))
    calls, skipped = _layer_calls(strategy, graph, paths)
    layouts: dict[str, tuple[Any, ...]] = {}
    placements: dict[str, str] = {}
    for path in paths:
        got = calls.get(path)
        if not got or path in skipped:
            skipped.setdefault(path, "no call of it found in the captured graph")
            continue
        if len({(p, r) for p, r, _ in got}) > 1:
            skipped[path] = ("its calls are placed differently: "
                             f"{sorted({str(p) for p, _, _ in got})}")
            continue
        placed, rank, _ = got[0]
        axes = _axes(placed, rank, model_axis)
        if axes is None:
            skipped[path] = (f"its output is placed {placed}: no layout form"
                             if placed is not None else "no placement recorded for it")
            continue
        if emit == "split" and all(a is None for a in axes):
            continue
        layouts[re.escape(path) + OUTPUT_SUFFIX] = axes
        placements[path] = str(placed)
    return layouts, placements, skipped


def check_keys(keys: Iterable[str], paths: Iterable[str],
               weight_paths: Iterable[str]) -> dict[str, list[str]]:
    """Output key -> the strings it fullmatches among every ``"<layer path>/output"`` and
    weight path (each exported key must match exactly its own layer's)."""
    targets = [p + OUTPUT_SUFFIX for p in paths] + list(weight_paths)
    return {k: [t for t in targets if t == k or re.fullmatch(k, t)] for k in keys}
