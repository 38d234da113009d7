"""Group the ops of a traced graph into GraphNodes (paper 4.2: "ops used together").

Pure Python, no TensorFlow: ``tapas.capture`` extracts a :class:`RawGraph` (plain op
records) from the ``tf.Graph`` and hands it here.

In:  :class:`RawGraph` -- ops in topological order, control inputs, graph inputs and
     outputs, and the model weights each resource placeholder stands for.
Out: :class:`tapas.ir.Graph`.

How ops are grouped
-------------------
1. *Dead* ops (nothing the outputs depend on, through data or control edges) are set
   aside. Graph-input placeholders become ``input`` GraphNodes. Ops we do not understand
   (function calls, control flow, unknown types) become ``opaque`` GraphNodes of their own.
2. *Weight-side* ops (variable reads and ops computing only from weights and constants,
   e.g. ``Reshape(kernel)``) and *constant* ops (consts, shape queries, ops on constants
   only) are attached later to the GraphNode that consumes them.
3. *Seeds*: every op that consumes a weight seeds the GraphNode of its layer (a layer is
   the parent of the weight's Keras path, ``.../dense_3`` for ``.../dense_3/kernel``);
   seeds of one layer that lie a few ops apart are one GraphNode (MatMul and BiasAdd),
   and the ops between them join it. Every weight-less matmul/einsum/convolution
   (attention scores and contexts, MoE dispatch) seeds a GraphNode of its own.
4. *Absorption*, repeated until nothing changes: an ungrouped op joins a neighbouring
   GraphNode G when
   - (forward) it is a light op (elementwise, activation, softmax, reshape) whose inputs
     all come from G, or from G and tensors G already reads (not for ``Add``: a residual
     add of a layer's output and its input is a GraphNode of its own); or
   - (backward) all its consumers are in G and at most one other GraphNode feeds it
     (the moments of a LayerNorm, the index arithmetic before an embedding lookup).
   When an op could join several GraphNodes, or could join one but its name scope points
   at a layer that has not reached it yet, the name scope decides. Scopes are used only
   as this tie-break, never as layer identity (Keras renumbers them).
5. Ops still left form GraphNodes of their own (residual adds, glue), growing forward.
6. A batch norm whose input is produced only for it by a convolution or dense layer is
   merged into that layer (Conv + BatchNorm + ReLU is one GraphNode).
Every live op ends in exactly one GraphNode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import networkx as nx

from tapas import ir
from tapas.ir import Kind, OpInfo, TensorInfo, WeightInfo

__all__ = ["RawGraph", "group_ops", "HEAVY_OPS", "LIGHT_OPS", "KNOWN_OPS"]

# ---- op tables -------------------------------------------------------------------------

MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
CONV_OPS = frozenset({"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
                      "Conv3DBackpropInputV2", "Conv"})
HEAVY_OPS = MATMUL_OPS | CONV_OPS
GATHER_OPS = frozenset({"GatherV2", "Gather", "ResourceGather", "GatherNd", "ResourceGatherNd"})
BATCHNORM_OPS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
UNARY_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Gelu", "Erf", "Erfc", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Neg",
    "Abs", "Sign", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Rint", "Cast", "Identity",
    "StopGradient", "PreventGradient", "Snapshot", "Sin", "Cos", "IsNan", "IsInf", "IsFinite",
    "LogicalNot", "ZerosLike", "OnesLike", "CheckNumerics", "EnsureShape", "Swish",
    "ClipByValue"})
BINARY_OPS = frozenset({
    "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv",
    "FloorMod", "TruncateDiv", "Maximum", "Minimum", "Pow", "SquaredDifference", "BiasAdd",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
    "LogicalOr", "SelectV2", "Select", "Xdivy", "Xlogy"})
RESHAPE_OPS = frozenset({
    "Reshape", "Transpose", "ConjugateTranspose", "ExpandDims", "Squeeze", "StridedSlice",
    "Slice", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV", "Tile", "Pad", "PadV2",
    "MirrorPad", "BroadcastTo", "ReverseV2", "Roll", "OneHot", "MatrixBandPart",
    "DepthToSpace", "SpaceToDepth", "ResizeBilinear", "ResizeNearestNeighbor"})
REDUCE_OPS = frozenset({
    "Mean", "Sum", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin", "MaxPool",
    "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "TopKV2", "Cumsum", "Cumprod",
    "EuclideanNorm", "L2Loss", "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits"})
META_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastArgs",
                      "BroadcastGradientArgs"})
SOURCE_OPS = frozenset({"Const", "Range", "Fill", "LinSpace", "Placeholder",
                        "PlaceholderWithDefault"})
SIDE_EFFECT_OPS = frozenset({"NoOp", "Assert", "AssignVariableOp", "AssignAddVariableOp",
                             "AssignSubVariableOp", "PrintV2", "Print", "StringFormat"})
SCATTER_OPS = frozenset({"ScatterNd", "TensorScatterUpdate", "TensorScatterAdd", "Where",
                         "Unique", "DynamicPartition", "DynamicStitch", "InTopKV2",
                         "RandomUniform", "RandomStandardNormal", "StatelessRandomUniformV2",
                         "StatelessRandomNormalV2", "StatelessRandomGetKeyCounter"})
READ_OPS = frozenset({"ReadVariableOp"})

LIGHT_OPS = UNARY_OPS | BINARY_OPS | RESHAPE_OPS | SOFTMAX_OPS | frozenset({"IdentityN"})
KNOWN_OPS = (HEAVY_OPS | GATHER_OPS | BATCHNORM_OPS | LIGHT_OPS | REDUCE_OPS | META_OPS
             | SOURCE_OPS | SIDE_EFFECT_OPS | SCATTER_OPS | READ_OPS)
# Residual-style adds: never absorbed forward into a layer whose input they also read.
_ADD_LIKE = frozenset({"Add", "AddV2", "AddN"})
_MAX_SEED_HOPS = 8


@dataclasses.dataclass(frozen=True)
class RawGraph:
    """Plain records of a traced graph, in topological order.

    ``weights`` maps the name of each resource placeholder that stands for a model
    variable to that variable; ``model_weights`` lists every weight the model owns (to
    report the ones the trace never reads).
    """

    ops: Sequence[OpInfo]
    control_inputs: Mapping[str, Sequence[str]]
    inputs: Sequence[str]                 # names of graph-input placeholder ops, in order
    outputs: Sequence[TensorInfo]
    weights: Mapping[str, WeightInfo]
    model_weights: Sequence[WeightInfo] = ()
    name: str = "graph"
    pins: Mapping[str, str] = dataclasses.field(default_factory=dict)  # weight path -> pin


def _op_name(tensor_name: str) -> str:
    return tensor_name.rpartition(":")[0] if ":" in tensor_name else tensor_name


def _scope(name: str) -> tuple[str, ...]:
    parts = name.split("/")
    return tuple(parts[:-1])


class _ScopeTrie:
    """Longest match of an op scope against the scopes of GraphNodes (for tie-breaks)."""

    def __init__(self) -> None:
        self.root: dict = {}

    def add(self, scope: tuple[str, ...]) -> None:
        node = self.root
        for part in scope:
            node = node.setdefault(part, {})

    def depth(self, scope: tuple[str, ...]) -> int:
        node, d = self.root, 0
        for part in scope:
            if part not in node:
                break
            node, d = node[part], d + 1
        return d


# The name-scope component tapas.layers puts around a layer's ops ("tapas.dense"; TF may
# append "_1" when one scope holds two calls).
_MARKER = "tapas."


def _tapas_marker(scope: tuple[str, ...]) -> tuple[tuple[str, ...], Kind] | None:
    """``(scope prefix through the marker, kind)`` for an op inside a tapas layer."""
    for k, part in enumerate(scope):
        if part.startswith(_MARKER):
            name = part[len(_MARKER):]
            base, _, suffix = name.rpartition("_")
            if base and suffix.isdigit():
                name = base
            try:
                return scope[:k + 1], Kind(name)
            except ValueError:
                return None
    return None


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Grouper:
    """The grouping pass; see the module docstring for the rules."""

    def __init__(self, raw: RawGraph) -> None:
        self.raw = raw
        self.ops = list(raw.ops)
        self.index = {op.name: i for i, op in enumerate(self.ops)}
        n = len(self.ops)
        # data producers (op index per input, -1 for unknown) and consumers
        self.producers: list[list[int]] = [[self.index.get(_op_name(t), -1) for t in op.inputs]
                                           for op in self.ops]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for i, prods in enumerate(self.producers):
            for p in prods:
                if p >= 0 and i not in self.consumers[p]:
                    self.consumers[p].append(i)
        self.ctrl_in: list[list[int]] = [[self.index[c] for c in raw.control_inputs.get(op.name, ())
                                          if c in self.index] for op in self.ops]
        self.ctrl_out: list[list[int]] = [[] for _ in range(n)]
        for i, cs in enumerate(self.ctrl_in):
            for c in cs:
                self.ctrl_out[c].append(i)
        self.scopes = [_scope(op.name) for op in self.ops]
        self.group: list[int] = [-1] * n
        self.members: list[list[int]] = []
        self.locked: list[bool] = []
        self.gscope: list[tuple[str, ...]] = []
        self.reads: list[set[int]] = []     # ops outside the group whose outputs it reads
        self.leftover: list[bool] = []

    # ---- classification ----------------------------------------------------------------
    def classify(self) -> None:
        ops, n = self.ops, len(self.ops)
        out_ops = {self.index[_op_name(t.name)] for t in self.raw.outputs
                   if _op_name(t.name) in self.index}
        # live = ancestors of the outputs through data and control edges
        live = [False] * n
        stack = list(out_ops)
        for s in stack:
            live[s] = True
        while stack:
            i = stack.pop()
            for p in self.producers[i] + self.ctrl_in[i]:
                if p >= 0 and not live[p]:
                    live[p] = True
                    stack.append(p)
        self.live = live
        self.input_ops = {self.index[name] for name in self.raw.inputs if name in self.index}
        weight_ph = {self.index[name] for name in self.raw.weights if name in self.index}
        self.weight_ph = weight_ph
        # weights each op derives from (only for weight-side ops)
        self.wside: list[frozenset[int]] = [frozenset()] * n   # placeholder indices
        self.is_wside = [False] * n
        self.is_const = [False] * n
        self.opaque = [False] * n
        for i, op in enumerate(ops):
            t = op.type
            prods = [p for p in self.producers[i] if p >= 0]
            if i in weight_ph:
                self.is_wside[i] = True
                self.wside[i] = frozenset({i})
                continue
            if i in self.input_ops:
                continue
            if t == "Placeholder":  # a captured non-variable tensor: a constant to us
                self.is_const[i] = True
                continue
            if t not in KNOWN_OPS or t.endswith("Call") or "Function" in t:
                self.opaque[i] = True
                continue
            if t in SIDE_EFFECT_OPS:
                continue
            if t in META_OPS or (t in SOURCE_OPS and all(self.is_const[p] for p in prods)):
                self.is_const[i] = True
                continue
            if not prods:
                continue
            if all(self.is_const[p] or self.is_wside[p] for p in prods) and \
                    any(self.is_wside[p] for p in prods) and t not in HEAVY_OPS | GATHER_OPS:
                self.is_wside[i] = True
                self.wside[i] = frozenset().union(*(self.wside[p] for p in prods))
                continue
            if all(self.is_const[p] for p in prods) and t not in HEAVY_OPS:
                self.is_const[i] = True

    def data_producers(self, i: int) -> list[int]:
        """Producers that carry activations (not constants, not weights)."""
        return [p for p in self.producers[i]
                if p >= 0 and not self.is_const[p] and not self.is_wside[p]]

    # ---- groups ------------------------------------------------------------------------
    def new_group(self, scope: tuple[str, ...], locked: bool = False,
                  leftover: bool = False) -> int:
        self.members.append([])
        self.locked.append(locked)
        self.gscope.append(scope)
        self.reads.append(set())
        self.leftover.append(leftover)
        return len(self.members) - 1

    def assign(self, i: int, g: int) -> None:
        assert self.group[i] == -1, self.ops[i].name
        self.group[i] = g
        self.members[g].append(i)
        self.reads[g].discard(i)
        for p in self.producers[i]:
            if p >= 0 and self.group[p] != g:
                self.reads[g].add(p)

    def make_seeds(self) -> None:
        for i in sorted(self.input_ops):
            self.assign(i, self.new_group(self.scopes[i], locked=True))
        self.mark_tapas_layers()
        for i in range(len(self.ops)):
            if self.live[i] and self.opaque[i] and self.group[i] < 0:
                self.assign(i, self.new_group(self.scopes[i], locked=True))
        # weight seeds, keyed by layer (parent of the weight path)
        by_layer: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            if not self.live[i] or self.group[i] >= 0 or self.is_wside[i] or self.is_const[i]:
                continue
            if op.type in SIDE_EFFECT_OPS:
                continue
            ws = set()
            for p in self.producers[i]:
                if p >= 0 and self.is_wside[p]:
                    ws |= self.wside[p]
            if not ws:
                continue
            paths = sorted(self.raw.weights[self.ops[w].name].path for w in ws)
            layer = paths[0].rpartition("/")[0] or paths[0]
            by_layer.setdefault(layer, []).append(i)
        for layer, seeds in by_layer.items():
            for cluster in (part for c in self._cluster_seeds(seeds)
                            for part in self._split_heavy(c)):
                scope = self._lcp([self.scopes[s] for s in cluster]
                                  + [self.scopes[p] for s in cluster for p in self.producers[s]
                                     if p >= 0 and self.is_wside[p]])
                g = self.new_group(scope)
                for s in cluster:
                    self.assign(s, g)
                self._fill_between(g, cluster)
        # weight-less heavy ops seed their own GraphNodes
        for i, op in enumerate(self.ops):
            if self.live[i] and self.group[i] < 0 and op.type in HEAVY_OPS and \
                    not self.is_const[i] and not self.is_wside[i]:
                self.assign(i, self.new_group(self.scopes[i]))

    def mark_tapas_layers(self) -> None:
        """Every op of one call of a ``tapas.layers`` layer (its ops share a scope prefix
        ending in a ``tapas.<kind>`` component) is one locked GraphNode of that kind."""
        self.marked_kind: list[Kind | None] = [None] * len(self.ops)
        by_call: dict[tuple[str, ...], int] = {}
        self.marked_groups: set[int] = set()
        for i in range(len(self.ops)):
            if not self.live[i] or self.group[i] >= 0 or self.is_wside[i] or self.is_const[i]:
                continue
            found = _tapas_marker(self.scopes[i])
            if found is None:
                continue
            scope, kind = found
            g = by_call.get(scope)
            if g is None:
                g = by_call[scope] = self.new_group(scope, locked=True)
                self.marked_groups.add(g)
            self.assign(i, g)
            self.marked_kind[i] = kind

    @staticmethod
    def _lcp(scopes: list[tuple[str, ...]]) -> tuple[str, ...]:
        if not scopes:
            return ()
        first = scopes[0]
        n = len(first)
        for s in scopes[1:]:
            n = min(n, _common_prefix(first, s))
        return first[:n]

    def _downstream(self, start: int, limit: int) -> dict[int, int]:
        """Ops reachable from ``start`` within ``limit`` data hops, with their distance."""
        dist = {start: 0}
        frontier = [start]
        for d in range(1, limit + 1):
            nxt = []
            for i in frontier:
                for c in self.consumers[i]:
                    if c not in dist and self.live[c]:
                        dist[c] = d
                        nxt.append(c)
            frontier = nxt
        return dist

    def _cluster_seeds(self, seeds: list[int]) -> list[list[int]]:
        """Split one layer's seeds into applications: seeds a few hops apart belong to one
        call of the layer; a layer applied twice (shared weights) gives two clusters."""
        parent = {s: s for s in seeds}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        seed_set = set(seeds)
        for s in seeds:
            for t in self._downstream(s, _MAX_SEED_HOPS):
                if t in seed_set and t != s:
                    parent[find(t)] = find(s)
        clusters: dict[int, list[int]] = {}
        for s in seeds:
            clusters.setdefault(find(s), []).append(s)
        return [sorted(c) for c in clusters.values()]

    def _split_heavy(self, cluster: list[int]) -> list[list[int]]:
        """At most one weight-reading matmul/conv per GraphNode: a layer holding several
        (an FFN's wi and wo, fused q/k/v projections, MoE experts' wi and wo) gives one
        GraphNode per projection. Other seeds (bias adds, scales) go with the nearest
        projection upstream of them, else the nearest downstream."""
        heavy = [s for s in cluster if self.ops[s].type in HEAVY_OPS]
        if len(heavy) <= 1:
            return [cluster]
        parts: dict[int, list[int]] = {h: [h] for h in heavy}
        rest: list[int] = []
        reach = {h: self._downstream(h, _MAX_SEED_HOPS) for h in heavy}
        for s in cluster:
            if s in parts:
                continue
            up = [(reach[h][s], h) for h in heavy if s in reach[h]]
            if up:
                parts[min(up)[1]].append(s)
                continue
            mine = self._downstream(s, _MAX_SEED_HOPS)
            down = [(mine[h], h) for h in heavy if h in mine]
            if down:
                parts[min(down)[1]].append(s)
            else:
                rest.append(s)
        out = [sorted(p) for p in parts.values()]
        return out + ([rest] if rest else [])

    def _fill_between(self, g: int, cluster: list[int]) -> None:
        """Ops on a short path from one seed of the cluster to another join the group."""
        if len(cluster) < 2:
            return
        targets = set(cluster)
        for s in cluster:
            dist = self._downstream(s, _MAX_SEED_HOPS)
            # walk back from reached targets through ops in `dist`
            stack = [t for t in dist if t in targets and t != s]
            seen = set(stack)
            while stack:
                t = stack.pop()
                for p in self.producers[t]:
                    if p in dist and p not in seen and p != s:
                        seen.add(p)
                        stack.append(p)
            for op in sorted(seen):
                if self.group[op] < 0 and not self.is_const[op] and not self.is_wside[op] \
                        and not self.opaque[op]:
                    self.assign(op, g)

    # ---- absorption --------------------------------------------------------------------
    def _candidates(self, i: int) -> set[int]:
        op = self.ops[i]
        cands: set[int] = set()
        prods = self.data_producers(i)
        pgroups = {self.group[p] for p in prods}
        # forward: light ops fed by one GraphNode (or by it and tensors it already reads)
        # (a producer not yet grouped is fine when the GraphNode already reads its output,
        # e.g. a norm's scale-multiply of a residual stream that is still ungrouped)
        if op.type in LIGHT_OPS and prods:
            unlocked = [g for g in pgroups - {-1} if not self.locked[g]]
            if len(pgroups) == 1 and unlocked:
                cands.add(unlocked[0])
            elif op.type not in _ADD_LIKE:
                for g in unlocked:
                    if all(self.group[p] == g or p in self.reads[g] for p in prods):
                        cands.add(g)
        # backward: every consumer in one GraphNode, at most one other GraphNode feeding it;
        # never an add of two activation streams (a residual add is a GraphNode of its own)
        merges_streams = op.type in _ADD_LIKE and len(set(prods)) >= 2
        if op.type not in SOFTMAX_OPS and op.type not in SIDE_EFFECT_OPS and not merges_streams:
            cons = [c for c in self.consumers[i] if self.live[c]]
            cgroups = {self.group[c] for c in cons}
            if cons and len(cgroups) == 1:
                (g,) = cgroups
                if g >= 0 and not self.locked[g] and len(pgroups - {g, -1}) <= 1:
                    cands.add(g)
        return cands

    def absorb(self) -> None:
        order = [i for i in range(len(self.ops)) if self.live[i] and self._free(i)]
        while order:
            trie = _ScopeTrie()
            for s in self.gscope:
                trie.add(s)
            progress = False
            deferred: list[tuple[int, int]] = []
            for i in order:
                if self.group[i] >= 0:
                    continue
                cands = self._candidates(i)
                if not cands:
                    continue
                best = max(cands, key=lambda g: (_common_prefix(self.scopes[i], self.gscope[g]), -g))
                if _common_prefix(self.scopes[i], self.gscope[best]) < trie.depth(self.scopes[i]):
                    deferred.append((i, best))  # its own layer may still reach it
                    continue
                self.assign(i, best)
                progress = True
            if not progress:
                if not deferred:
                    break
                for i, g in deferred:
                    if self.group[i] < 0:
                        self.assign(i, g)
            order = [i for i in order if self.group[i] < 0]

    def _free(self, i: int) -> bool:
        return (self.group[i] < 0 and not self.is_const[i] and not self.is_wside[i]
                and self.ops[i].type not in SIDE_EFFECT_OPS)

    def leftovers(self) -> None:
        for i in range(len(self.ops)):
            if not self.live[i] or not self._free(i):
                continue
            pgroups = {self.group[p] for p in self.data_producers(i)}
            if len(pgroups) == 1:
                (g,) = pgroups
                if g >= 0 and self.leftover[g] and self.ops[i].type not in _ADD_LIKE:
                    self.assign(i, g)
                    continue
            self.assign(i, self.new_group(self.scopes[i], leftover=True))

    def attach_rest(self) -> None:
        """Constants, weight reads and side-effect ops join a GraphNode they touch."""
        n = len(self.ops)
        # consumers first (reverse order, so chains of constants follow their consumer)
        for i in reversed(range(n)):
            if not self.live[i] or self.group[i] >= 0:
                continue
            if self.is_const[i] or self.is_wside[i]:
                g = next((self.group[c] for c in self.consumers[i] + self.ctrl_out[i]
                          if self.group[c] >= 0 and self._open(self.group[c])), -1)
                if g < 0:
                    g = next((self.group[c] for c in self.consumers[i] + self.ctrl_out[i]
                              if self.group[c] >= 0), -1)
                if g >= 0:
                    self.assign(i, g)
        # weight reads with no data consumer (e.g. a read only for a shape): the GraphNode
        # that holds another read of the same weight
        holder: dict[int, int] = {}
        for i in range(n):
            if self.group[i] >= 0 and self.is_wside[i]:
                for w in self.wside[i]:
                    holder.setdefault(w, self.group[i])
        for i in range(n):
            if self.live[i] and self.group[i] < 0 and self.is_wside[i]:
                g = next((holder[w] for w in sorted(self.wside[i]) if w in holder), -1)
                if g >= 0:
                    self.assign(i, g)
        # side effects and anything else: producer's GraphNode, else a control neighbour's
        for i in range(n):
            if not self.live[i] or self.group[i] >= 0:
                continue
            near = ([self.group[p] for p in self.producers[i] if p >= 0]
                    + [self.group[c] for c in self.consumers[i] + self.ctrl_out[i]]
                    + [self.group[c] for c in self.ctrl_in[i]])
            g = next((x for x in near if x >= 0 and not self.locked[x]), -1)
            if g < 0:
                g = next((x for x in near if x >= 0), -1)
            if g < 0:
                g = self.new_group(self.scopes[i], leftover=True)
            self.assign(i, g)

    def _open(self, g: int) -> bool:
        """A GraphNode constants and weight reads may join: not an input or opaque one."""
        return not self.locked[g] or g in self.marked_groups

    # ---- post passes -------------------------------------------------------------------
    def merge_batchnorm(self) -> None:
        """Conv/Dense followed by a batch norm that only it feeds: one GraphNode."""
        for g in range(len(self.members)):
            if not self.members[g] or not self._is_batchnorm(g):
                continue
            prods = {p for i in self.members[g] for p in self.data_producers(i)
                     if self.group[p] != g}
            if len(prods) != 1:
                continue
            (p,) = prods
            src = self.group[p]
            if self.locked[src] or not any(self.ops[i].type in HEAVY_OPS for i in self.members[src]):
                continue
            if any(self.group[c] != g for c in self.consumers[p] if self.live[c]):
                continue
            for i in list(self.members[g]):
                self.group[i] = src
                self.members[src].append(i)
            self.members[g] = []

    def _is_batchnorm(self, g: int) -> bool:
        ms = self.members[g]
        if any(self.ops[i].type in BATCHNORM_OPS for i in ms):
            return True
        weights = self._group_weights(g)
        return bool(weights) and any(not w.trainable for w in weights) and \
            not any(self.ops[i].type in HEAVY_OPS | GATHER_OPS for i in ms)

    def _group_weights(self, g: int) -> list[WeightInfo]:
        seen: dict[str, WeightInfo] = {}
        for i in self.members[g]:
            phs = set(self.wside[i]) if self.is_wside[i] else set()
            for p in self.producers[i]:
                if p >= 0 and self.is_wside[p]:
                    phs |= self.wside[p]
            for w in sorted(phs):
                info = self.raw.weights[self.ops[w].name]
                seen.setdefault(info.path, info)
        return list(seen.values())

    # ---- output --------------------------------------------------------------------------
    def build(self) -> ir.Graph:
        self.classify()
        self.make_seeds()
        self.absorb()
        self.leftovers()
        self.attach_rest()
        self.merge_batchnorm()
        groups = [sorted(m) for m in self.members if m]
        groups.sort(key=lambda m: max(m))   # topological by last op: inputs come first
        groups = self._toposort(groups)
        node_of: dict[int, int] = {}
        for gid, m in enumerate(groups):
            for i in m:
                node_of[i] = gid
        out_names = {t.name for t in self.raw.outputs}
        specs: list[tuple[list[int], list[TensorInfo], list[TensorInfo], list[WeightInfo]]] = []
        for gid, m in enumerate(groups):
            inputs: list[TensorInfo] = []
            seen_in: set[str] = set()
            for i in m:
                for t, p in zip(self.ops[i].inputs, self.producers[i]):
                    if p < 0 or node_of.get(p) == gid or t in seen_in:
                        continue
                    info = self._tensor(t)
                    if info is None or info.dtype == "resource":
                        continue
                    seen_in.add(t)
                    inputs.append(info)
            outputs = []
            for i in m:
                used_outside = {t for c in self.consumers[i] if node_of.get(c, gid) != gid
                                for t in self.ops[c].inputs if _op_name(t) == self.ops[i].name}
                for t in self.ops[i].outputs:
                    if (t.name in used_outside or t.name in out_names) and t.dtype != "resource":
                        outputs.append(t)
            weights = self._weights_of(m)
            specs.append((m, inputs, outputs, weights))
        kinds = self._kinds(specs, node_of)
        nodes = []
        for gid, (m, inputs, outputs, weights) in enumerate(specs):
            ops = tuple(self.ops[i] for i in m)
            pin = next((self.raw.pins[w.path] for w in weights if w.path in self.raw.pins),
                       None)
            nodes.append(ir.GraphNode(
                id=gid, name=self._name(m, kinds[gid]), kind=kinds[gid], ops=ops,
                inputs=tuple(inputs), outputs=tuple(outputs), weights=tuple(weights),
                signature=ir.compute_signature(ops, inputs, weights, pin), pin=pin))
        edges = []
        for node in nodes:
            for t in node.inputs:
                src = node_of[self.index[_op_name(t.name)]]
                edges.append(ir.Edge(src, node.id, t))
        used = {w.path for n in nodes for w in n.weights}
        unused = tuple(w for w in self.raw.model_weights if w.path not in used)
        dead = tuple(op.name for i, op in enumerate(self.ops) if not self.live[i])
        graph_inputs = tuple(self.ops[self.index[name]].outputs[0] for name in self.raw.inputs
                             if name in self.index)
        return ir.Graph(nodes=tuple(nodes), edges=tuple(edges), inputs=graph_inputs,
                        outputs=tuple(self.raw.outputs), dead_ops=dead, unused_weights=unused,
                        name=self.raw.name)

    def _toposort(self, groups: list[list[int]]) -> list[list[int]]:
        """Order GraphNodes so every edge goes forward. Groups caught in a cycle (possible
        when absorption pulls ops both ways around a layer) are merged into one."""
        gid = {}
        for k, m in enumerate(groups):
            for i in m:
                gid[i] = k
        dag = nx.DiGraph()
        dag.add_nodes_from(range(len(groups)))
        for k, m in enumerate(groups):
            for i in m:
                for p in self.producers[i]:   # data edges only: control edges (to the
                    if p >= 0 and p in gid and gid[p] != k:   # final NoOp) do not order layers
                        dag.add_edge(gid[p], k)
        cond = nx.condensation(dag)
        merged = {c: sorted(i for k in cond.nodes[c]["members"] for i in groups[k])
                  for c in cond.nodes}
        order = nx.lexicographical_topological_sort(cond, key=lambda c: merged[c][0])
        return [merged[c] for c in order]

    def _tensor(self, name: str) -> TensorInfo | None:
        op = self.index.get(_op_name(name))
        if op is None:
            return None
        idx = int(name.rpartition(":")[2] or 0)
        outs = self.ops[op].outputs
        return outs[idx] if idx < len(outs) else None

    def _weights_of(self, members: list[int]) -> list[WeightInfo]:
        phs: set[int] = set()
        for i in members:
            if self.is_wside[i]:
                phs |= self.wside[i]
            for p in self.producers[i]:
                if p >= 0 and self.is_wside[p]:
                    phs |= self.wside[p]
            if self.opaque[i]:
                phs |= {p for p in self.producers[i] if p in self.weight_ph}
        out: dict[str, WeightInfo] = {}
        for w in sorted(phs, key=lambda p: self.raw.weights[self.ops[p].name].path):
            info = self.raw.weights[self.ops[w].name]
            out.setdefault(info.path, info)
        return list(out.values())

    def _name(self, members: list[int], kind: Kind) -> str:
        core = [i for i in members if not self.is_const[i] and not self.is_wside[i]] or members
        # graph-output Identity ops live at the root scope: they do not name a layer
        scope = self._lcp([self.scopes[i] for i in core if self.scopes[i]])
        if scope and len(core) > 1:
            return "/".join(scope)
        return self.ops[core[0]].name

    def _kinds(self, specs, node_of: dict[int, int]) -> list[Kind]:
        kinds: list[Kind] = []
        for gid, (m, _inputs, _outputs, weights) in enumerate(specs):
            kinds.append(self._kind(gid, m, weights, node_of, kinds))
        return kinds

    def _kind(self, gid: int, m: list[int], weights: list[WeightInfo],
              node_of: dict[int, int], earlier: list[Kind]) -> Kind:
        ops = self.ops
        core = [i for i in m if not self.is_const[i] and not self.is_wside[i]]
        types = {ops[i].type for i in core}
        if any(i in self.input_ops for i in m):
            return Kind.INPUT
        marked = next((self.marked_kind[i] for i in m if self.marked_kind[i] is not None), None)
        if marked is not None:
            return marked
        if any(self.opaque[i] for i in m):
            return Kind.OPAQUE

        def reads_weight(i: int) -> bool:
            return any(p >= 0 and self.is_wside[p] for p in self.producers[i])

        heavy_w = [i for i in core if ops[i].type in HEAVY_OPS and reads_weight(i)]
        if any(ops[i].type in CONV_OPS for i in heavy_w):
            return Kind.CONV
        if heavy_w:
            if any(self._batched_over_weight(i) for i in heavy_w):
                return Kind.EXPERT_EINSUM
            return Kind.DENSE
        if any(ops[i].type in GATHER_OPS and reads_weight(i) for i in core):
            return Kind.EMBEDDING
        heavy = [i for i in core if ops[i].type in HEAVY_OPS]
        if types & BATCHNORM_OPS or (weights and types & {"Mean", "Rsqrt", "Sqrt"}):
            return Kind.NORM
        if heavy:
            if types & SOFTMAX_OPS or self._feeds_softmax(heavy, node_of):
                return Kind.ATTENTION_SCORE
            for i in heavy:
                for p in self.data_producers(i):
                    src = node_of.get(p)
                    if src is not None and src < gid and earlier[src] in (Kind.ATTENTION_SCORE,
                                                                          Kind.SOFTMAX):
                        return Kind.ATTENTION_CONTEXT
            return Kind.MATMUL
        if types & SOFTMAX_OPS:
            return Kind.SOFTMAX
        if not core:
            return Kind.CONSTANT
        if types & REDUCE_OPS:
            return Kind.REDUCE
        if types <= RESHAPE_OPS | {"Identity", "IdentityN", "Cast", "StopGradient"} | SIDE_EFFECT_OPS:
            return Kind.RESHAPE
        return Kind.ELEMENTWISE

    def _feeds_softmax(self, heavy: list[int], node_of: dict[int, int]) -> bool:
        """A score matmul whose softmax sits in the next GraphNode (behind a bias or mask
        add from another GraphNode, as in T5's relative position bias)."""
        for i in heavy:
            frontier, seen = [i], {i}
            for _ in range(3):   # a few light ops: add bias, add mask, scale
                nxt = []
                for j in frontier:
                    for c in self.consumers[j]:
                        if c in seen or not self.live[c]:
                            continue
                        if self.ops[c].type in SOFTMAX_OPS:
                            return True
                        if self.ops[c].type in LIGHT_OPS:
                            seen.add(c)
                            nxt.append(c)
                frontier = nxt
        return False

    def _batched_over_weight(self, i: int) -> bool:
        """True when a matmul/einsum keeps a weight dimension as a batch dimension: the
        stacked expert weights of a mixture of experts (``egcm,emh->egch``)."""
        op = self.ops[i]
        if op.type == "Einsum":
            eq = str(op.attrs.get("equation", ""))
            if "->" not in eq or "," not in eq:
                return False
            lhs, out = eq.replace(" ", "").split("->")
            terms = lhs.split(",")
            if len(terms) != 2:
                return False
            for k, p in enumerate(self.producers[i][:2]):
                if p >= 0 and self.is_wside[p]:
                    other = terms[1 - k]
                    return any(ch in other and ch in out for ch in terms[k])
            return False
        if op.type.startswith("BatchMatMul"):
            for k, p in enumerate(self.producers[i][:2]):
                if p >= 0 and self.is_wside[p]:
                    shape = self.ops[p].outputs[0].shape or ()
                    return len(shape) >= 3
        return False


def group_ops(raw: RawGraph) -> ir.Graph:
    """Group a traced graph's ops into GraphNodes; see the module docstring."""
    return _Grouper(raw).build()
