"""The TAPAS intermediate representation: GraphNodes and the tensors between them.

Stage 1 of the pipeline (paper section 4.2). ``tapas.capture`` turns a Keras
model or ``tf.function`` into an :class:`Graph`; every later stage (mining,
exploration, cost, reconstruction) reads it. This module imports no
TensorFlow, so the pure stages stay fast and testable.

In:  nothing (plain data, built by ``tapas.capture`` or by hand in tests).
Out: :class:`Graph` -- GraphNodes (groups of TF ops used together, e.g.
     MatMul+BiasAdd+Relu) with their ops, weights, kind and structural
     signature, and :class:`Edge`s carrying the (shape, dtype) of each tensor
     that flows between two GraphNodes.

Example::

    >>> t = TensorInfo("x:0", (4, 8), "float32")
    >>> n = GraphNode(id=0, name="x", kind=Kind.INPUT, ops=(OpInfo("x", "Placeholder", (), (t,)),),
    ...               inputs=(), outputs=(t,), weights=())
    >>> g = Graph(nodes=(n,), edges=(), inputs=(t,), outputs=(t,))
    >>> g.num_ops
    1
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx

__all__ = [
    "Kind",
    "TensorInfo",
    "OpInfo",
    "WeightInfo",
    "GraphNode",
    "Edge",
    "Graph",
    "compute_signature",
]

# A JSON-able attribute value: what OpInfo.attrs may hold.
AttrValue = Any


# bytes per element of each TF dtype name
DTYPE_BYTES: Mapping[str, int] = types.MappingProxyType({
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "complex64": 8, "complex128": 16, "string": 8, "resource": 8, "variant": 8})


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a TF dtype name such as ``"float32"``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} has no known size: use one of "
                         f"{sorted(DTYPE_BYTES)}") from None


class Kind(str, enum.Enum):
    """What a GraphNode does; decides which sharding patterns apply to it."""

    INPUT = "input"                      # a graph input (Placeholder)
    DENSE = "dense"                      # x @ W (+ bias, activation): MatMul, Tensordot, EinsumDense
    CONV = "conv"                        # convolution (+ batch norm, activation)
    EMBEDDING = "embedding"              # gather rows of a weight table
    EXPERT_EINSUM = "expert-einsum"      # einsum with a stacked weight batched over an expert dimension
    ATTENTION_SCORE = "attention-score"  # q . k^T (+ scale, bias, mask, softmax)
    ATTENTION_CONTEXT = "attention-context"  # probabilities . v
    MATMUL = "matmul"                    # other weight-less matmul/einsum (e.g. MoE dispatch/combine)
    NORM = "norm"                        # layer/RMS/batch normalization
    SOFTMAX = "softmax"                  # a softmax on its own
    ELEMENTWISE = "elementwise"          # residual adds, activations, scaling
    RESHAPE = "reshape"                  # reshape/transpose/slice/concat glue
    REDUCE = "reduce"                    # pooling and reductions
    CONSTANT = "constant"                # computed from constants only (e.g. position buckets)
    # whole layers, one GraphNode each by construction (tapas.layers)
    ATTENTION = "attention"              # multi-head attention: projections, scores, context, output
    FEED_FORWARD = "feed-forward"        # two dense layers with an activation between
    MOE = "moe"                          # gating + stacked experts + combine
    OPAQUE = "opaque"                    # ops tapas does not understand: always replicated


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor with a static shape. ``name`` is TF's tensor name, e.g. ``dense/MatMul:0``."""

    name: str
    shape: tuple[int, ...] | None  # None: unknown rank (only for opaque ops' outputs)
    dtype: str

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape or ():
            n *= d if d is not None and d >= 0 else 1
        return n

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": None if self.shape is None else list(self.shape),
                "dtype": self.dtype}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorInfo:
        shape = d["shape"]
        return TensorInfo(d["name"], None if shape is None else tuple(shape), d["dtype"])


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One TF operation: name, type, input tensor names, outputs, and the attributes that
    matter for its semantics (strides, padding, einsum equation, transposes, ...)."""

    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorInfo, ...]
    attrs: Mapping[str, AttrValue] = dataclasses.field(default_factory=dict)
    # Value of a small constant (Const ops with at most 16 elements), as a nested list.
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "type": self.type, "inputs": list(self.inputs),
                             "outputs": [t.to_json() for t in self.outputs]}
        if self.attrs:
            d["attrs"] = dict(self.attrs)
        if self.value is not None:
            d["value"] = self.value
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> OpInfo:
        return OpInfo(d["name"], d["type"], tuple(d["inputs"]),
                      tuple(TensorInfo.from_json(t) for t in d["outputs"]),
                      dict(d.get("attrs", {})), d.get("value"))


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """A model variable used by a GraphNode.

    ``path`` is the Keras variable path (``functional/dense_1/kernel``), stable across
    tracings; ``placeholder`` is the resource placeholder op inside the traced graph.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    placeholder: str

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                "trainable": self.trainable, "placeholder": self.placeholder}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> WeightInfo:
        return WeightInfo(d["path"], tuple(d["shape"]), d["dtype"], d["trainable"],
                          d["placeholder"])


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """A group of ops used together: the unit TAPAS shards (paper 4.2, "GraphNode").

    ``inputs`` are the tensors the node consumes from other nodes (in the order its ops
    first read them); ``outputs`` the tensors other nodes or the graph outputs consume.
    ``signature`` is structural: identical layers at different depths get identical
    signatures, different layers do not (see :func:`compute_signature`).
    """

    id: int
    name: str
    kind: Kind
    ops: tuple[OpInfo, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    weights: tuple[WeightInfo, ...]
    signature: str = ""
    # the sharding pattern a tapas.layers layer was pinned to (``shard=``), or None
    pin: str | None = None

    @property
    def op_types(self) -> tuple[str, ...]:
        return tuple(op.type for op in self.ops)

    @property
    def num_params(self) -> int:
        return sum(w.num_elements for w in self.weights)

    def reads(self, weight: WeightInfo) -> bool:
        """Whether an op of this node reads ``weight`` (its resource placeholder or a read
        of it). A node also lists the weights of the weight-side ops whose outputs it
        consumes (BLIP-2's layer-normed query tokens, read once, consumed by two layers):
        those reach it as inputs, not as reads, and are stored and resharded only where
        they are read."""
        handle = weight.placeholder + ":0"
        return any(op.name == weight.placeholder or handle in op.inputs for op in self.ops)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind.value,
                "signature": self.signature,
                "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs],
                "weights": [w.to_json() for w in self.weights],
                "ops": [op.to_json() for op in self.ops],
                **({"pin": self.pin} if self.pin is not None else {})}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> GraphNode:
        return GraphNode(
            id=d["id"], name=d["name"], kind=Kind(d["kind"]),
            ops=tuple(OpInfo.from_json(o) for o in d["ops"]),
            inputs=tuple(TensorInfo.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorInfo.from_json(t) for t in d["outputs"]),
            weights=tuple(WeightInfo.from_json(w) for w in d["weights"]),
            signature=d["signature"], pin=d.get("pin"))


@dataclasses.dataclass(frozen=True)
class Edge:
    """A tensor flowing from GraphNode ``src`` to GraphNode ``dst``."""

    src: int
    dst: int
    tensor: TensorInfo

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "tensor": self.tensor.to_json()}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Edge:
        return Edge(d["src"], d["dst"], TensorInfo.from_json(d["tensor"]))


@dataclasses.dataclass(frozen=True)
class Graph:
    """A model as GraphNodes and edges, in topological order (``nodes[i].id == i``).

    ``dead_ops`` lists ops of the traced graph that no output depends on (e.g. shape
    computations Keras leaves behind); they belong to no GraphNode.
    ``unused_weights`` lists model weights the traced function never reads (e.g. a
    dropout seed in inference mode).
    """

    nodes: tuple[GraphNode, ...]
    edges: tuple[Edge, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    dead_ops: tuple[str, ...] = ()
    unused_weights: tuple[WeightInfo, ...] = ()
    name: str = "graph"
    # the last ``call_losses`` outputs are losses the model's call added (a layer's
    # activity regularizer, ``self.add_loss``), not model outputs: the training loss adds
    # their sums, as Keras adds ``model.losses``
    call_losses: int = 0

    def __post_init__(self) -> None:
        for i, n in enumerate(self.nodes):
            if n.id != i:
                raise ValueError(f"GraphNode '{n.name}' has id {n.id} at position {i}: "
                                 "Graph.nodes must be ordered by id starting at 0")
        for e in self.edges:
            if not (0 <= e.src < len(self.nodes) and 0 <= e.dst < len(self.nodes)):
                raise ValueError(f"edge {e.src}->{e.dst} ({e.tensor.name}) names a GraphNode "
                                 f"outside 0..{len(self.nodes) - 1}")

    @property
    def model_outputs(self) -> tuple[TensorInfo, ...]:
        """The model's outputs: :attr:`outputs` without the call losses."""
        return self.outputs[:len(self.outputs) - self.call_losses]

    # ---- summaries -------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        return sum(len(n.ops) for n in self.nodes)

    @functools.cached_property
    def weights(self) -> tuple[WeightInfo, ...]:
        """Every weight the graph reads, once (a tied weight is listed by each GraphNode
        that reads it, but once here; found once per graph: a search asks several times)."""
        seen: dict[str, WeightInfo] = {}
        for n in self.nodes:
            for w in n.weights:
                seen.setdefault(w.path, w)
        return tuple(seen.values())

    @property
    def num_params(self) -> int:
        return sum(w.num_elements for w in self.weights)

    @functools.cached_property
    def readers(self) -> Mapping[str, frozenset[int]]:
        """Weight path -> the ids of the GraphNodes that read it (:meth:`GraphNode.reads`);
        a weight that no op reads (a graph built by hand, without read ops): every
        GraphNode that lists it."""
        listed: dict[str, set[int]] = {}
        reading: dict[str, set[int]] = {}
        for n in self.nodes:
            for w in n.weights:
                listed.setdefault(w.path, set()).add(n.id)
                if n.reads(w):
                    reading.setdefault(w.path, set()).add(n.id)
        return types.MappingProxyType({p: frozenset(reading.get(p) or ids)
                                       for p, ids in listed.items()})

    def reads(self, node_id: int, path: str) -> bool:
        """Whether GraphNode ``node_id`` reads weight ``path`` (:attr:`readers`)."""
        return node_id in self.readers.get(path, ())

    def kind_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.kind.value] = counts.get(n.kind.value, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def successors(self, node_id: int) -> list[int]:
        return sorted({e.dst for e in self.edges if e.src == node_id})

    def predecessors(self, node_id: int) -> list[int]:
        return sorted({e.src for e in self.edges if e.dst == node_id})

    def node_of_op(self) -> dict[str, int]:
        """Map every op name to the id of the GraphNode holding it."""
        return {op.name: n.id for n in self.nodes for op in n.ops}

    # ---- conversions -----------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph with one vertex per GraphNode (attrs: name, kind, signature, params,
        ops) and one edge per connected pair (attr ``tensors``: list of TensorInfo)."""
        g = nx.DiGraph(name=self.name)
        for n in self.nodes:
            g.add_node(n.id, name=n.name, kind=n.kind.value, signature=n.signature,
                       params=n.num_params, ops=len(n.ops))
        for e in self.edges:
            if g.has_edge(e.src, e.dst):
                g.edges[e.src, e.dst]["tensors"].append(e.tensor)
            else:
                g.add_edge(e.src, e.dst, tensors=[e.tensor])
        return g

    def to_json(self) -> dict[str, Any]:
        return {"format": "tapas.ir.Graph/1", "name": self.name,
                "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs],
                "nodes": [n.to_json() for n in self.nodes],
                "edges": [e.to_json() for e in self.edges],
                "dead_ops": list(self.dead_ops),
                "unused_weights": [w.to_json() for w in self.unused_weights]}

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Graph:
        fmt = d.get("format")
        if fmt != "tapas.ir.Graph/1":
            raise ValueError(f"not a TAPAS IR graph: 'format' is {fmt!r}, expected "
                             "'tapas.ir.Graph/1' (write one with tapas inspect --graph_out)")
        return Graph(
            nodes=tuple(GraphNode.from_json(n) for n in d["nodes"]),
            edges=tuple(Edge.from_json(e) for e in d["edges"]),
            inputs=tuple(TensorInfo.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorInfo.from_json(t) for t in d["outputs"]),
            dead_ops=tuple(d.get("dead_ops", ())),
            unused_weights=tuple(WeightInfo.from_json(w) for w in d.get("unused_weights", ())),
            name=d.get("name", "graph"))

    @staticmethod
    def loads(text: str) -> Graph:
        return Graph.from_json(json.loads(text))

    @staticmethod
    def build(nodes: Sequence[GraphNode], inputs: Sequence[TensorInfo] = (),
              outputs: Sequence[TensorInfo] = (), name: str = "graph", **extra: Any) -> Graph:
        """Build a Graph from GraphNodes alone: edges are derived by matching each node's
        input tensor names against the other nodes' outputs. Nodes are renumbered in the
        given order, which must be topological."""
        renum = [dataclasses.replace(n, id=i) for i, n in enumerate(nodes)]
        producer: dict[str, int] = {}
        for n in renum:
            for t in n.outputs:
                producer[t.name] = n.id
        edges = []
        for n in renum:
            for t in n.inputs:
                src = producer.get(t.name)
                if src is None:
                    raise ValueError(f"GraphNode '{n.name}' reads tensor '{t.name}' that no "
                                     "GraphNode produces")
                if src >= n.id:
                    raise ValueError(f"GraphNode '{n.name}' reads '{t.name}' from a later "
                                     "GraphNode: nodes must be given in topological order")
                edges.append(Edge(src, n.id, t))
        return Graph(nodes=tuple(renum), edges=tuple(edges), inputs=tuple(inputs),
                     outputs=tuple(outputs), name=name, **extra)


# ---- structural signatures -------------------------------------------------------------

# Attributes that do not change what an op computes (placement, debugging, names).
_IGNORED_ATTRS = frozenset({"_class", "device", "_XlaCompile", "_output_shapes", "shared_name",
                            "container", "_read_only_resource_inputs", "f", "config",
                            "config_proto", "executor_type", "_collective_manager_ids",
                            "_has_manual_control_dependencies"})


def compute_signature(ops: Sequence[OpInfo], inputs: Sequence[TensorInfo],
                      outputs: Sequence[TensorInfo], weights: Iterable[WeightInfo],
                      pin: str | None = None) -> str:
    """A short hash of a GraphNode's structure.

    It covers, for every op in order: its type, its semantic attributes, its output shapes
    and dtypes, small constant values, and where each of its inputs comes from (an earlier
    op of the node and which output, or the k-th external input with its shape); and which
    op outputs are the node's ``outputs`` (read outside it), in order: the same ops with
    another tensor read outside have other patterns (a pattern places every node output,
    and a node output's outside readers change its gradient). Weight shapes and dtypes are
    included; op names, scopes and weight paths are not, so the same layer at two depths
    hashes the same while a layer of another width does not. A pinned sharding pattern
    (``pin``) is part of the structure: a pinned and an unpinned copy of a layer are
    searched separately.
    """
    local = {op.name: i for i, op in enumerate(ops)}
    ext = {t.name: i for i, t in enumerate(inputs)}
    parts: list[Any] = [[list(t.shape) if t.shape is not None else None, t.dtype] for t in inputs]
    for op in ops:
        refs = []
        for name in op.inputs:
            base, _, idx = name.rpartition(":")
            if base in local:
                refs.append(("L", local[base], idx))
            elif name in ext:
                refs.append(("X", ext[name]))
            else:
                refs.append(("?",))
        attrs = {k: v for k, v in sorted(op.attrs.items())
                 if k not in _IGNORED_ATTRS and not k.startswith("_")}
        outs = [[list(t.shape) if t.shape is not None else None, t.dtype] for t in op.outputs]
        parts.append([op.type, attrs, outs, refs, op.value])
    produced = {t.name: (i, k) for i, op in enumerate(ops) for k, t in enumerate(op.outputs)}
    parts.append(["out", [produced.get(t.name, ("X", ext.get(t.name))) for t in outputs]])
    parts.append(sorted([list(w.shape), w.dtype, w.trainable] for w in weights))
    if pin is not None:
        parts.append(["pin", pin])
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]
