"""Grouping's last step: the groups become the GraphNodes of a :class:`tapas.ir.Graph`.

In:  a fully grouped state (:class:`~tapas.capturing.grouping.absorbing.Absorbing`).
Out: :class:`Grouper` -- ``build()`` runs every phase and returns the graph: GraphNodes in
     topological order with their kind, name, weights and tensors, the edges, dead ops
     and unused weights.

This module imports no TensorFlow.
"""

from __future__ import annotations


import networkx as nx

from tapas import ir
from tapas.ir import Kind, TensorInfo, WeightInfo
from tapas.capturing.op_kinds import (BATCHNORM_OPS, CONV_OPS, GATHER_OPS, HEAVY_OPS, LIGHT_OPS,
                                      REDUCE_OPS, RESHAPE_OPS, SIDE_EFFECT_OPS, SOFTMAX_OPS)
from tapas.capturing.grouping.raw import op_name
from tapas.capturing.grouping.absorbing import Absorbing


class Grouper(Absorbing):
    """The whole grouping pass (the rules: tapas.capturing.grouping)."""

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
                                for t in self.ops[c].inputs if op_name(t) == self.ops[i].name}
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
                signature=ir.compute_signature(ops, inputs, outputs, weights, pin),
                pin=pin))
        edges = []
        for node in nodes:
            for t in node.inputs:
                src = node_of[self.index[op_name(t.name)]]
                edges.append(ir.Edge(src, node.id, t))
        used = {w.path for n in nodes for w in n.weights}
        unused = tuple(w for w in self.raw.model_weights if w.path not in used)
        dead = tuple(op.name for i, op in enumerate(self.ops) if not self.live[i])
        graph_inputs = tuple(self.ops[self.index[name]].outputs[0] for name in self.raw.inputs
                             if name in self.index)
        return ir.Graph(nodes=tuple(nodes), edges=tuple(edges), inputs=graph_inputs,
                        outputs=tuple(self.raw.outputs), dead_ops=dead, unused_weights=unused,
                        name=self.raw.name, call_losses=self.raw.call_losses)

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
        op = self.index.get(op_name(name))
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
        plumbing = RESHAPE_OPS | {"Identity", "IdentityN", "Cast", "StopGradient"}
        if types <= plumbing | SIDE_EFFECT_OPS:
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
