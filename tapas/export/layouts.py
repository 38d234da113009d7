"""A TAPAS plan as a Keras 3 distribution layout: the data, its JSON and Python forms, and
the ``keras.distribution.LayoutMap`` built from it.

In:  a :class:`LayoutExport` (built by :func:`tapas.export.exporter.export_layout` from a
     Strategy, or read back with :func:`load_layout` from the JSON or Python file it wrote).
Out: ``to_json``/``from_json`` (format ``tapas.export.LayoutMap/1``), ``to_python`` (a
     module that builds the ``DeviceMesh``, ``LayoutMap`` and ``ModelParallel`` with Keras
     alone, no TAPAS), ``to_keras`` (the ``LayoutMap`` itself), :func:`key_matches` (which
     keys match which weight paths, with Keras's own lookup rule) and
     :func:`placements_from_layouts` (weight path -> TAPAS placement, the way back for a
     hand-edited layout).
Raises: ``ValueError`` naming the file, the key or the weight, the constraint and the fix
     (a layout key matching no weight or two keys matching one weight, an axis that is not
     a mesh axis, a weight split over the batch axis or over two axes, a file that is not
     an exported layout).

Keys are the weights' Keras paths (``variable.path``) escaped as regexes (``re.escape``;
a path without regex metacharacters is its own key): Keras looks a key up exactly first,
then by ``re.fullmatch`` of every key, so an escaped path matches that weight and no other.
Keras is imported only by ``to_keras``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["LayoutExport", "Unexpressed", "FORMAT", "BATCH_AXIS", "MODEL_AXIS", "axes_for",
           "key_matches", "placements_from_layouts", "load_layout"]

FORMAT = "tapas.export.LayoutMap/1"
BATCH_AXIS, MODEL_AXIS = "batch", "model"
Axes = tuple[Any, ...]        # one mesh axis name or None per tensor axis


def axes_for(placement: str, rank: int) -> Axes | None:
    """The ``TensorLayout`` axes of a weight of ``rank`` axes placed ``placement`` (TAPAS
    short form): ``"S1"`` on a matrix -> ``(None, "model")``; None for ``"R"``."""
    text = str(placement).strip()
    if text in ("R", ""):
        return None
    m = re.fullmatch(r"S(\d+)", text)
    if m is None or int(m.group(1)) >= rank:
        raise ValueError(f"weight placement {placement!r} on a rank-{rank} weight has no "
                         f"LayoutMap form: only 'R' and 'S0'..'S{rank - 1}' do")
    axes: list[Any] = [None] * rank
    axes[int(m.group(1))] = MODEL_AXIS
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Unexpressed:
    """GraphNodes whose chosen pattern the LayoutMap does not pin: ``nodes`` (ids and
    names), the pattern TAPAS chose, the one propagation may take instead (``emitted``:
    the cheapest plan's with only the weight layouts, ``kind="weights"``; the cheapest
    remaining pattern, ``kind="activations"``), why, and for ``"activations"`` every
    pattern left open with the cost of taking it (``alternatives``: (pattern, seconds per
    step against the strategy, the cost model's), cheapest first)."""

    nodes: tuple[tuple[int, str], ...]
    chosen: str
    emitted: str
    why: str
    kind: str = "weights"
    alternatives: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [list(n) for n in self.nodes], "chosen": self.chosen,
                "emitted": self.emitted, "why": self.why, "kind": self.kind,
                "alternatives": [list(a) for a in self.alternatives]}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Unexpressed:
        return Unexpressed(tuple((int(i), str(n)) for i, n in d["nodes"]), d["chosen"],
                           d["emitted"], d["why"], d.get("kind", "weights"),
                           tuple((str(a), float(c)) for a, c in d.get("alternatives", ())))


@dataclasses.dataclass(frozen=True)
class LayoutExport:
    """One exported plan: the mesh (``mesh_shape`` rows x cols over ``axis_names``, the
    data split over ``batch_dim_name``), ``layouts`` (key -> axes, weights the plan splits
    only), ``weights`` (the Keras path each key stands for -> TAPAS placement),
    ``replicated`` (paths left out: Keras replicates them), what the layouts cannot pin
    (``unexpressed``), the costs (``cost``: ``strategy``, ``layout_map`` and their
    ``difference``, seconds per step) and the collectives the plan predicts
    (``predicted``: kind, phase, tensor, bytes, seconds, count), and the layer outputs
    it pins (``outputs``: ``"<layer path>/output"`` key -> axes)."""

    model: str
    graph_digest: str
    cluster: str
    mesh_shape: tuple[int, int]
    layouts: Mapping[str, Axes]
    weights: Mapping[str, str]
    replicated: tuple[str, ...] = ()
    unexpressed: tuple[Unexpressed, ...] = ()
    cost: Mapping[str, float] = dataclasses.field(default_factory=dict)
    predicted: tuple[Mapping[str, Any], ...] = ()
    axis_names: tuple[str, str] = (BATCH_AXIS, MODEL_AXIS)
    batch_dim_name: str = BATCH_AXIS
    # layer-output layouts: "<layer path>/output" key -> axes (tapas.export.outputs)
    outputs: Mapping[str, Axes] = dataclasses.field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    # ---- Keras --------------------------------------------------------------------------
    def to_keras(self, devices: Sequence[Any] | None = None) -> Any:
        """The ``keras.distribution.LayoutMap`` (its ``DeviceMesh`` over ``devices``,
        default Keras's ``list_devices()``, which must hold ``num_devices``)."""
        import keras
        mesh = keras.distribution.DeviceMesh(tuple(self.mesh_shape), list(self.axis_names),
                                             devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in {**self.layouts, **self.outputs}.items():
            layout_map[key] = tuple(axes)
        return layout_map

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.model, "graph_digest": self.graph_digest,
                "cluster": self.cluster,
                "mesh": {"shape": list(self.mesh_shape), "axis_names": list(self.axis_names)},
                "batch_dim_name": self.batch_dim_name,
                "layouts": {k: list(v) for k, v in self.layouts.items()},
                "outputs": {k: list(v) for k, v in self.outputs.items()},
                "weights": dict(self.weights), "replicated": list(self.replicated),
                "unexpressed": [u.to_json() for u in self.unexpressed],
                "cost": dict(self.cost), "predicted_collectives": [dict(p) for p in
                                                                    self.predicted]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @staticmethod
    def from_json(d: Mapping[str, Any], where: str = "layout") -> LayoutExport:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"{where}: 'format' is {got!r}, not {FORMAT!r}: give a file "
                             "written by `tapas export --format=keras-layoutmap`")
        mesh = d["mesh"]
        return LayoutExport(
            d["model"], d["graph_digest"], d["cluster"], _shape(mesh["shape"], where),
            {k: tuple(v) for k, v in d["layouts"].items()}, dict(d.get("weights", {})),
            tuple(d.get("replicated", ())),
            tuple(Unexpressed.from_json(u) for u in d.get("unexpressed", ())),
            dict(d.get("cost", {})), tuple(d.get("predicted_collectives", ())),
            tuple(mesh["axis_names"]), d.get("batch_dim_name", BATCH_AXIS),
            {k: tuple(v) for k, v in d.get("outputs", {}).items()})

    # ---- Python source ------------------------------------------------------------------
    def to_python(self) -> str:
        """A Python module that builds this layout with Keras alone: ``MESH_SHAPE``,
        ``AXIS_NAMES``, ``LAYOUTS`` (literals: read back by :func:`load_layout` without
        running the file) and ``device_mesh``/``layout_map``/``distribution(devices=None)``."""
        rows = "\n".join(f"    {k!r}: {tuple(v)!r}," for k, v in self.layouts.items())
        outs = "\n".join(f"    {k!r}: {tuple(v)!r}," for k, v in self.outputs.items())
        gaps = "".join(f"#   {_gap_text(u)}\n" for u in self.unexpressed)
        return f'''"""Keras 3 distribution layout of '{self.model}' exported by TAPAS ({FORMAT}).

Weights TAPAS splits over the '{MODEL_AXIS}' mesh axis; every other weight is replicated.
OUTPUT_LAYOUTS: the layer outputs the plan pins (keys "<layer path>/output").
Use: keras.distribution.set_distribution(distribution()) before building the model
(KERAS_BACKEND=jax). Cost model ({self.cluster}): {_cost_text(self.cost)}.
"""
# What the layouts cannot pin ({len(self.unexpressed)}):
{gaps or "#   nothing"}
import keras

MESH_SHAPE = {tuple(self.mesh_shape)!r}
AXIS_NAMES = {tuple(self.axis_names)!r}
BATCH_DIM_NAME = {self.batch_dim_name!r}
LAYOUTS = {{
{rows}
}}
OUTPUT_LAYOUTS = {{
{outs}
}}


def device_mesh(devices=None):
    return keras.distribution.DeviceMesh(MESH_SHAPE, list(AXIS_NAMES), devices)


def layout_map(devices=None):
    layouts = keras.distribution.LayoutMap(device_mesh(devices))
    for key, axes in {{**LAYOUTS, **OUTPUT_LAYOUTS}}.items():
        layouts[key] = axes
    return layouts


def distribution(devices=None):
    return keras.distribution.ModelParallel(layout_map=layout_map(devices),
                                            batch_dim_name=BATCH_DIM_NAME)
'''

    def save(self, path: str) -> None:
        """Write the JSON (``.json``) or the Python module (``.py``)."""
        text = self.to_python() if str(path).endswith(".py") else self.dumps()
        with open(path, "w") as f:
            f.write(text)


def _gap_text(u: Unexpressed) -> str:
    nodes = ", ".join(str(i) for i, _ in u.nodes)
    if u.kind != "activations":
        return f"GraphNodes {nodes}: TAPAS chose {u.chosen}, the layouts give {u.emitted}"
    alts = ", ".join(f"{a} {c * 1e3:+.4f} ms" for a, c in u.alternatives[:3])
    return (f"GraphNodes {nodes}: TAPAS chose {u.chosen}, activations left open: "
            f"propagation may take {alts}")


def _cost_text(cost: Mapping[str, float]) -> str:
    if not cost:
        return "not priced"
    return (f"strategy {cost['strategy'] * 1e3:.4f} ms per step, the layouts' plan "
            f"{cost['layout_map'] * 1e3:.4f} ms")


def _shape(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v >= 1 for v in value)):
        raise ValueError(f"{where}: mesh shape {value!r} must be [rows, cols] of positive "
                         "ints (rows over the batch axis, cols over the model axis)")
    return int(value[0]), int(value[1])


def load_layout(path: str) -> LayoutExport:
    """A layout written by ``save``: the JSON, or the Python module's ``MESH_SHAPE``,
    ``AXIS_NAMES`` and ``LAYOUTS`` literals (read with ``ast.literal_eval``; the file is
    not run). The Python form keeps only the mesh, the layouts and ``OUTPUT_LAYOUTS``."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"layout file {path}: cannot read it ({e.strerror}): give a file "
                         "written by `tapas export --out=layout.json` (or .py)") from None
    if str(path).endswith(".py"):
        return _from_python(text, path)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"layout file {path} is not valid JSON ({e.msg} at line {e.lineno}): "
                         "write it again with `tapas export --out=...`") from None
    return LayoutExport.from_json(d, f"layout file {path}")


def _from_python(text: str, path: str) -> LayoutExport:
    found: dict[str, Any] = {}
    try:
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name) and \
                    node.targets[0].id in ("MESH_SHAPE", "AXIS_NAMES", "LAYOUTS",
                                           "BATCH_DIM_NAME", "OUTPUT_LAYOUTS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"layout file {path}: cannot read its literals ({e}): MESH_SHAPE, "
                         "AXIS_NAMES and LAYOUTS must be plain literals") from None
    missing = [k for k in ("MESH_SHAPE", "AXIS_NAMES", "LAYOUTS") if k not in found]
    if missing:
        raise ValueError(f"layout file {path} has no {', '.join(missing)}: give a module "
                         "written by `tapas export --out=layout.py`")
    return LayoutExport("", "", "", _shape(list(found["MESH_SHAPE"]), path),
                        {k: tuple(v) for k, v in found["LAYOUTS"].items()}, {},
                        axis_names=tuple(found["AXIS_NAMES"]),
                        batch_dim_name=found.get("BATCH_DIM_NAME", BATCH_AXIS),
                        outputs={k: tuple(v) for k, v in
                                 found.get("OUTPUT_LAYOUTS", {}).items()})


def key_matches(keys: Iterable[str], paths: Iterable[str]) -> dict[str, list[str]]:
    """Weight path -> the layout keys Keras would match it with (``LayoutMap.__getitem__``:
    the key equal to the path, else every key that ``re.fullmatch``es it)."""
    keys = list(keys)
    out = {}
    for path in paths:
        out[path] = [path] if path in keys else [k for k in keys if re.fullmatch(k, path)]
    return out


def placements_from_layouts(layout: LayoutExport, weights: Mapping[str, int],
                            where: str = "layout") -> dict[str, str]:
    """Weight path -> TAPAS placement (``"S<axis>"`` or ``"R"``) for every weight in
    ``weights`` (path -> rank), read from ``layout``'s keys as Keras would apply them."""
    matches = key_matches(layout.layouts, weights)
    used = {k for ks in matches.values() for k in ks}
    unused = [k for k in layout.layouts if k not in used]
    if unused:
        raise ValueError(f"{where}: key(s) {unused[:3]} match no weight of the model: fix "
                         "the key (a weight's Keras path, variable.path, or a regex "
                         "matching it whole)")
    out = {}
    for path, rank in weights.items():
        keys = matches[path]
        if len(keys) > 1:
            raise ValueError(f"{where}: weight {path!r} matches keys {keys}: Keras refuses "
                             "that; make the keys match one weight each")
        if not keys:
            out[path] = "R"
            continue
        out[path] = _placement(tuple(layout.layouts[keys[0]]), rank, layout.axis_names,
                               f"{where}: key {keys[0]!r} (weight {path!r})")
    return out


def _placement(axes: Axes, rank: int, names: Sequence[str], where: str) -> str:
    if len(axes) != rank:
        raise ValueError(f"{where}: layout {axes} has {len(axes)} axes, the weight {rank}: "
                         "give one entry (a mesh axis name or None) per weight axis")
    bad = [a for a in axes if a is not None and a not in names]
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} is not a mesh axis (the mesh has "
                         f"{list(names)})")
    split = [i for i, a in enumerate(axes) if a is not None]
    if not split:
        return "R"
    if len(split) > 1 or axes[split[0]] != names[1]:
        raise ValueError(f"{where}: layout {axes}: a TAPAS plan splits a weight on one axis "
                         f"over the model axis {names[1]!r} only; write it like "
                         f"{tuple(names[1] if i == split[0] else None for i in range(rank))}")
    return f"S{split[0]}"
