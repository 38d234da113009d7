"""Propagate a seed through a GraphNode's ops: placements, comms, rewrites, flops.

In:  a GraphNode, a :class:`tapas.sharding.patterns.base.PatternSeed` (placement of each node
     input and of some weights), the graph index and N.
Out: a :class:`tapas.sharding.patterns.base.ShardingPattern`, or :class:`Invalid` with the reason.

Forward pass, op by op in the node's (topological) order, with the rules of
``tapas.sharding.rules``:

- an op may split at most one label; an input split on a label the op forbids
  (``no_split``) or a non-divisible dimension makes the pattern invalid;
- a partial-sum input the op is not linear in is all-reduced right after the op that
  produced it (a forward ``AR`` comm on that tensor), and the pass starts over with that
  tensor reduced -- this is how row-parallel gets its ``C_AR`` before a bias add;
- a partial node output is all-reduced too (a node boundary never carries ``P``).

Backward pass, in reverse order: the gradient of every replicated, differentiable tensor
is *full* (ok), *partial* (each device holds an addend: a consumer split on a dimension
the tensor lacks, or one multiplying it with a partial sum) or *sliced* on axis a (a
consumer read only a local slice). Partial and sliced gradients pass lazily backward
through replicated ops; where they reach a node input, a weight, a forward comm or a mix
with full gradients, a backward comm makes them full: ``AR`` (partial) or ``AG(a)``
(sliced). A weight the seed leaves free whose gradient is sliced on one axis is split on
that axis instead (a bias follows its kernel), and the passes run again.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tapas.sharding.placements import Collective
from tapas.ir import GraphNode, Kind, OpInfo, WeightInfo
from tapas.sharding import rules as oprules
from tapas.sharding.patterns.base import GraphIndex, PatternSeed, ShardingPattern
from tapas.sharding.expressions import Apply, Coll, Expr, Leaf
from tapas.sharding.placements import Comm, Partial, Placement, Replica, Split

__all__ = ["Invalid", "propagate"]

_FLOAT = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                    "half", "float", "double"})
_R = Replica()
_P = Partial()
_MAX_EXPR_APPLIES = 24


class Invalid(Exception):
    """A seed that gives no valid pattern; ``str()`` says why."""


class _NeedReduce(Exception):
    def __init__(self, tensors: set[str]) -> None:
        super().__init__(", ".join(sorted(tensors)))
        self.tensors = tensors


@dataclasses.dataclass
class _OpRec:
    op: OpInfo
    spec: oprules.OpSpec | None
    data_inputs: list[tuple[int, str]]        # (operand index, tensor) with labels
    split_label: str | None
    replicated: bool                            # no split label and no partial input


@dataclasses.dataclass
class _Forward:
    place: dict[str, Placement]                 # placement consumers see (after fwd comms)
    produced: dict[str, Placement]              # placement the producing op leaves
    shapes: dict[str, tuple[int, ...] | None]
    dtypes: dict[str, str]
    producer: dict[str, int]                    # tensor -> op index
    recs: list[_OpRec]
    rewrites: dict[str, str]
    fwd_comms: list[Comm]
    contrib: dict[str, list[tuple[Any, int, int]]]  # tensor -> [(kind, op idx, operand idx)]
    needs_grad: set[str]
    flops: float


def _local(shape: Sequence[int] | None, p: Placement, n: int) -> list[int]:
    s = list(shape or ())
    if isinstance(p, Split) and p.axis < len(s):
        s[p.axis] //= n
    return s


def _prod(xs: Sequence[int]) -> float:
    out = 1.0
    for x in xs:
        out *= max(int(x), 0)
    return out


class _Engine:
    def __init__(self, node: GraphNode, index: GraphIndex, n: int, seed: PatternSeed,
                 replicate_unknown: bool) -> None:
        self.node = node
        self.index = index
        self.n = n
        self.seed = seed
        self.replicate_unknown = replicate_unknown
        self.wmap: dict[str, tuple[int, WeightInfo]] = {
            w.placeholder: (j, w) for j, w in enumerate(node.weights)}
        self.wres = {f"{w.placeholder}:0": w for w in node.weights}
        if len(seed.inputs) != len(node.inputs):
            raise Invalid(f"seed '{seed.name}' gives {len(seed.inputs)} input placements for "
                          f"{len(node.inputs)} inputs")

    # ---- checks --------------------------------------------------------------------------
    def _check_div(self, what: str, shape: Sequence[int] | None, p: Placement) -> None:
        if not isinstance(p, Split):
            return
        if shape is None or p.axis >= len(shape):
            raise Invalid(f"{what} has shape {shape}, which has no dimension {p.axis} to split")
        d = shape[p.axis]
        if d % self.n != 0 or d < self.n:
            raise Invalid(f"dimension {p.axis} of {what} has size {d}, not divisible by "
                          f"{self.n} devices")

    # ---- forward -------------------------------------------------------------------------
    def forward(self, weights: Mapping[str, Placement], reduce: set[str]) -> _Forward:
        node, n = self.node, self.n
        place: dict[str, Placement] = {}
        produced: dict[str, Placement] = {}
        shapes: dict[str, tuple[int, ...] | None] = {}
        dtypes: dict[str, str] = {}
        needs: set[str] = set()
        for t, p in zip(node.inputs, self.seed.inputs):
            self._check_div(f"input '{t.name}'", t.shape, p)
            place[t.name] = p
            shapes[t.name] = t.shape
            dtypes[t.name] = t.dtype
            if t.dtype in _FLOAT:
                needs.add(t.name)
        for w in node.weights:
            p = weights[w.path]
            self._check_div(f"'{w.path}'", w.shape, p)
            t = f"{w.placeholder}:0"
            place[t] = produced[t] = p
            shapes[t] = w.shape
            dtypes[t] = w.dtype
            if w.dtype in _FLOAT:   # non-trainable too: their uses decide their split
                needs.add(t)
        out_pl = {}
        if self.seed.outputs is not None:
            out_pl = {t.name: p for t, p in zip(node.outputs, self.seed.outputs)}
        fw = _Forward(place, produced, shapes, dtypes, {}, [], {}, [], {}, needs, 0.0)
        for k, op in enumerate(node.ops):
            self._forward_op(fw, k, op, reduce, out_pl)
        for t in node.outputs:
            if isinstance(fw.place.get(t.name), Partial):
                raise _NeedReduce({self._origin(fw, t.name)})
        return fw

    def _operand(self, fw: _Forward, name: str) -> Placement:
        if name in fw.place:
            return fw.place[name]
        base = name.rsplit(":", 1)[0]
        ti = self.index.tensor.get(name)
        if base in self.wmap:
            _, w = self.wmap[base]
            raise AssertionError(f"weight {w.path} resource seen before its placement")
        fw.place[name] = _R
        fw.shapes[name] = ti.shape if ti else None
        fw.dtypes[name] = ti.dtype if ti else "unknown"
        return _R

    def _forward_op(self, fw: _Forward, k: int, op: OpInfo, reduce: set[str],
                    out_pl: Mapping[str, Placement]) -> None:
        n = self.n
        if op.type == "Placeholder":
            if op.name in self.wmap:   # the weight's resource tensor, placed up front
                fw.recs.append(_OpRec(op, None, [], None, True))
                return
            for t in op.outputs:
                p = out_pl.get(t.name, _R)
                self._check_div(f"input '{t.name}'", t.shape, p)
                fw.place[t.name] = fw.produced[t.name] = p
                fw.shapes[t.name], fw.dtypes[t.name] = t.shape, t.dtype
                fw.producer[t.name] = k
                if t.dtype in _FLOAT:
                    fw.needs_grad.add(t.name)
            fw.recs.append(_OpRec(op, None, [], None, True))
            return
        names = [x for x in op.inputs if not x.startswith("^")]
        in_pl = [self._operand(fw, x) for x in names]
        in_shapes = tuple(fw.shapes.get(x) for x in names)
        out_shapes = tuple(t.shape for t in op.outputs)
        ctx = oprules.OpContext(in_shapes, out_shapes,
                                lambda i: self.index.const_value(names[i]) if i < len(names)
                                else None)
        spec = oprules.spec_for(op, ctx)
        if isinstance(spec, str):
            if self.replicate_unknown and all(isinstance(p, Replica) for p in in_pl):
                for t in op.outputs:
                    fw.place[t.name] = fw.produced[t.name] = _R
                    fw.shapes[t.name], fw.dtypes[t.name] = t.shape, t.dtype
                    fw.producer[t.name] = k
                fw.recs.append(_OpRec(op, None, [], None, True))
                return
            raise Invalid(spec)
        if len(spec.inputs) != len(names):
            raise Invalid(f"op '{op.name}' ({op.type}) has {len(names)} operands, its rule "
                          f"describes {len(spec.inputs)}")
        # which label is split
        split: dict[str, tuple[int, int]] = {}
        data: list[tuple[int, str]] = []
        partial_in: list[int] = []
        for i, (x, p, labs) in enumerate(zip(names, in_pl, spec.inputs)):
            if labs is None:
                if not spec.meta_any and not isinstance(p, Replica):
                    raise Invalid(f"op '{op.name}' ({op.type}) needs its operand {i} ('{x}') "
                                  f"replicated, but it is {p}")
                continue
            data.append((i, x))
            if isinstance(p, Split):
                if p.axis >= len(labs):
                    raise Invalid(f"operand {i} ('{x}') of op '{op.name}' is {p}, but it has "
                                  f"rank {len(labs)}")
                split.setdefault(labs[p.axis], (i, p.axis))
            elif isinstance(p, Partial):
                partial_in.append(i)
        if len(split) > 1:
            desc = ", ".join(f"operand {i} on axis {a}" for i, a in split.values())
            raise Invalid(f"op '{op.name}' ({op.type}) reads operands split on different "
                          f"dimensions ({desc}): a 1-D mesh splits an op along one dimension")
        label = next(iter(split), None)
        if label is not None and label in spec.no_split:
            i, a = split[label]
            raise Invalid(f"op '{op.name}' ({op.type}) cannot split axis {a} of operand {i} "
                          f"('{names[i]}'): the op needs that dimension whole")
        if partial_in:
            if label is not None:
                ok = False
            elif spec.linear == "all":
                ok = len(partial_in) == len(data)
            else:
                ok = len(partial_in) == 1 and partial_in[0] in spec.linear
            if not ok:
                raise _NeedReduce({self._origin(fw, names[i]) for i in partial_in})
        # outputs
        for j, t in enumerate(op.outputs):
            labs = spec.outputs[j] if j < len(spec.outputs) else None
            if labs is None:
                p: Placement = _R
            elif label is not None and label in labs:
                p = Split(labs.index(label))
            elif label is not None:
                if spec.reduce in ("sum", "mean", "gather"):
                    p = _P
                    if spec.reduce == "mean":
                        fw.rewrites[op.name] = "partial-mean"
                    elif spec.reduce == "gather":
                        fw.rewrites[op.name] = "vocab-gather"
                elif j > 0 and op.type.startswith("FusedBatchNorm"):
                    p = _R  # running statistics pass through untouched in inference
                else:
                    i, a = split[label]
                    raise Invalid(f"op '{op.name}' ({op.type}) would reduce over axis {a} of "
                                  f"operand {i} ('{names[i]}'), which is split; only sums "
                                  "can be left partial")
            elif partial_in:
                p = _P
            else:
                p = _R
            self._check_div(f"'{t.name}'", t.shape, p)
            fw.produced[t.name] = p
            fw.shapes[t.name], fw.dtypes[t.name] = t.shape, t.dtype
            fw.producer[t.name] = k
            if t.name in reduce and isinstance(p, Partial):
                fw.fwd_comms.append(Comm(Collective.ALL_REDUCE, t.name, t.shape or (), t.dtype,
                                         _P, _R, "fwd"))
                p = _R
            fw.place[t.name] = p
        if spec.global_shape and any(not isinstance(q, Replica) for q in in_pl):
            fw.rewrites[op.name] = "global-shape"
        # gradient bookkeeping
        grad_flows = op.type not in oprules.NO_GRAD_OPS
        if grad_flows:
            for t in op.outputs:
                if t.dtype in _FLOAT and any(x in fw.needs_grad for _, x in data):
                    fw.needs_grad.add(t.name)
        replicated = label is None and not partial_in
        for i, x in data:
            if not grad_flows or x not in fw.needs_grad:
                continue
            p = in_pl[i]
            labs = spec.inputs[i]
            assert labs is not None
            if not isinstance(p, Replica):
                kind: Any = "ok"
            elif replicated:
                kind = "via"
            elif label is None:       # a partial sum multiplies this input
                kind = "partial"
            elif label in labs:
                kind = ("slice", labs.index(label))
            else:
                kind = "partial"
            fw.contrib.setdefault(x, []).append((kind, k, i))
        fw.recs.append(_OpRec(op, spec, data, label, replicated))
        fw.flops += self._flops(op, spec, names, in_pl, label, fw)

    def _origin(self, fw: _Forward, t: str) -> str:
        """Where to all-reduce partial tensor ``t``: walk back through ops that only carry
        a partial sum along (Neg, Reshape, StopGradient, a broadcasting Mul) to the
        smallest tensor on the way, so a layer norm reduces its mean, not its output."""
        best = t
        size = _prod(fw.shapes.get(t) or ())
        while t in fw.producer:
            rec = fw.recs[fw.producer[t]]
            ps = [x for _, x in rec.data_inputs if isinstance(fw.place.get(x), Partial)]
            if len(ps) != 1 or rec.split_label is not None:
                break
            t = ps[0]
            s = _prod(fw.shapes.get(t) or ())
            if s <= size:
                best, size = t, s
        return best

    def _flops(self, op: OpInfo, spec: oprules.OpSpec, names: Sequence[str],
               in_pl: Sequence[Placement], label: str | None, fw: _Forward) -> float:
        n = self.n
        if spec.flops == "none" or not op.outputs:
            return 0.0
        if spec.flops == "contract":
            sizes: dict[str, int] = {}
            for x, labs in zip(names, spec.inputs):
                if labs is None:
                    continue
                for lab, d in zip(labs, fw.shapes.get(x) or ()):
                    sizes[lab] = max(sizes.get(lab, 1), d)
            if label is not None and label in sizes:
                sizes[label] //= n
            return 2.0 * _prod(list(sizes.values()))
        out = op.outputs[0]
        out_local = _local(out.shape, fw.produced.get(out.name, _R), n)
        if spec.flops == "conv":
            kshape = fw.shapes.get(names[1]) or ()
            kl = spec.inputs[1] or ()
            k = _prod(kshape[:-1])
            if label is not None and len(kl) >= 2 and kl[-2] == label:
                k /= n
            return 2.0 * _prod(out_local) * k
        if spec.flops == "reduce":
            return _prod(_local(fw.shapes.get(names[0]), in_pl[0], n))
        return _prod(out_local)

    # ---- backward ------------------------------------------------------------------------
    def backward(self, fw: _Forward, fixed: Mapping[str, Placement]) -> tuple[list[Comm],
                                                                              dict[str, int]]:
        """Backward comms, and weight upgrades {path: axis} for free weights whose gradient
        is sliced on one axis."""
        state: dict[str, Any] = {}
        comms: list[Comm] = []
        upgrades: dict[str, int] = {}
        reduced = {c.tensor for c in fw.fwd_comms}
        boundary = {t.name for t in self.node.inputs} | set(self.wres)

        def materialize(t: str, s: Any) -> None:
            if t in self.wres and not self.wres[t].trainable:
                state[t] = "ok"   # no gradient: nothing to reduce
                return
            shape = fw.shapes.get(t) or ()
            dtype = fw.dtypes.get(t, "float32")
            if s == "partial":
                comms.append(Comm(Collective.ALL_REDUCE, t, shape, dtype, _P, _R, "bwd"))
            else:
                a = s[1]
                comms.append(Comm(Collective.ALL_GATHER, t, shape, dtype, Split(a), _R, "bwd",
                                  a))
            state[t] = "ok"

        def via_state(k: int, i: int) -> Any:
            rec = fw.recs[k]
            outs = [t.name for t in rec.op.outputs if t.name in fw.needs_grad]
            bad = [(t, state.get(t, "ok")) for t in outs if state.get(t, "ok") != "ok"]
            if not bad:
                return "ok"
            if len(bad) > 1:
                for t, s in bad:
                    materialize(t, s)
                return "ok"
            t, s = bad[0]
            if s == "partial":
                return "partial"
            spec = rec.spec
            if spec is None or spec.flops not in ("elementwise", "none"):
                return "partial"
            j = [x.name for x in rec.op.outputs].index(t)
            olabs = spec.outputs[j]
            ilabs = spec.inputs[i]
            if olabs is None or ilabs is None:
                return "partial"
            lab = olabs[s[1]]
            if lab in spec.no_split or lab not in ilabs:
                return "partial"
            return ("slice", ilabs.index(lab))

        def resolve(t: str) -> None:
            cs = fw.contrib.get(t, [])
            kinds = [via_state(k, i) if kind == "via" else kind for kind, k, i in cs]
            if not kinds or all(x == "ok" for x in kinds):
                state[t] = "ok"
                return
            if any(x == "ok" for x in kinds):
                # mixed: reduce the lazy contributions where they come from
                for (kind, k, i), s in zip(cs, kinds):
                    if kind == "via" and s != "ok":
                        for o in fw.recs[k].op.outputs:
                            if state.get(o.name, "ok") != "ok":
                                materialize(o.name, state[o.name])
                kinds = [via_state(k, i) if kind == "via" else kind for kind, k, i in cs]
                if any(x == "ok" for x in kinds) and any(x != "ok" for x in kinds):
                    raise Invalid(f"the gradient of '{t}' would mix full and partial "
                                  "contributions inside the node")
                if all(x == "ok" for x in kinds):
                    state[t] = "ok"
                    return
            slices = {x for x in kinds if x != "partial"}
            s: Any = next(iter(slices)) if len(slices) == 1 and "partial" not in kinds \
                else "partial"
            if t in self.wres:
                w = self.wres[t]
                if w.path not in fixed and s != "partial":
                    upgrades[w.path] = s[1]
                    state[t] = "ok"
                    return
            k = fw.producer.get(t)
            if t in boundary or t in reduced or k is None or not fw.recs[k].replicated:
                materialize(t, s)
            else:
                state[t] = s

        order = [o.name for k in range(len(fw.recs) - 1, -1, -1)
                 for o in fw.recs[k].op.outputs if o.name not in boundary]
        order += [t.name for t in self.node.inputs] + list(self.wres)
        done: set[str] = set()
        for t in order:
            if t not in done and t in fw.needs_grad and isinstance(fw.place.get(t), Replica):
                done.add(t)
                resolve(t)
        return comms, upgrades

    # ---- driver --------------------------------------------------------------------------
    def run(self) -> ShardingPattern:
        node = self.node
        fixed = dict(self.seed.weights)
        known = {w.path for w in node.weights}
        for path in fixed:
            if path not in known:
                raise Invalid(f"seed '{self.seed.name}' places weight '{path}', which node "
                              f"'{node.name}' does not read")
        weights: dict[str, Placement] = {w.path: fixed.get(w.path, _R) for w in node.weights}
        reduce: set[str] = set()
        for _ in range(4 * (len(node.ops) + len(node.weights)) + 4):
            try:
                fw = self.forward(weights, reduce)
            except _NeedReduce as e:
                if e.tensors <= reduce:
                    raise Invalid(f"cannot reduce partial sums {sorted(e.tensors)}") from None
                reduce |= e.tensors
                continue
            bwd, upgrades = self.backward(fw, fixed)
            if upgrades:
                for path, a in upgrades.items():
                    weights[path] = Split(a)
                continue
            return self._pattern(fw, weights, bwd)
        raise Invalid("propagation did not settle")

    def _pattern(self, fw: _Forward, weights: Mapping[str, Placement],
                 bwd: list[Comm]) -> ShardingPattern:
        node = self.node
        tensors: dict[str, Placement] = {}
        for op in node.ops:
            for t in op.outputs:
                tensors[t.name] = fw.produced.get(t.name, _R)
        outputs = tuple(fw.place.get(t.name, _R) for t in node.outputs)
        comms = tuple(fw.fwd_comms) + tuple(bwd)
        expr = self._expr(fw, weights)
        return ShardingPattern(self.seed.name, tuple(self.seed.inputs), outputs,
                               dict(weights), tensors, comms, dict(fw.rewrites), expr,
                               float(fw.flops))

    # ---- SRC expression ------------------------------------------------------------------
    def _expr(self, fw: _Forward, weights: Mapping[str, Placement]) -> str:
        node = self.node
        leaves: dict[str, Leaf] = {}
        one_in = len(node.inputs) == 1
        for i, t in enumerate(node.inputs):
            leaves[t.name] = Leaf(fw.place[t.name], "X" if one_in else f"X{i}")
        one_w = len(node.weights) == 1
        for j, w in enumerate(node.weights):
            leaves[f"{w.placeholder}:0"] = Leaf(weights[w.path], "W" if one_w else f"W{j}")
        reduced = {c.tensor for c in fw.fwd_comms}
        memo: dict[str, Expr | None] = {}
        count = [0]

        def build(t: str) -> Expr | None:
            if t in memo:
                return memo[t]
            memo[t] = None  # cycle guard
            e: Expr | None
            if t in leaves:
                e = leaves[t]
            elif t not in fw.producer:
                e = None
            else:
                rec = fw.recs[fw.producer[t]]
                args = [a for a in (build(x) for _, x in rec.data_inputs) if a is not None]
                spec = rec.spec
                if not args:
                    e = None
                elif spec is not None and spec.flops == "none" and len(args) == 1:
                    e = args[0]
                elif rec.op.type in ("Identity", "Cast", "StopGradient", "Snapshot") \
                        and len(args) == 1:
                    e = args[0]
                else:
                    count[0] += 1
                    e = Apply(_op_token(rec.op.type), tuple(args))
            if e is not None and t in reduced:
                e = Coll(Collective.ALL_REDUCE, (), e)
            memo[t] = e
            return e

        outs = [build(t.name) for t in node.outputs]
        exprs: list[Expr] = [e if e is not None else Leaf(fw.place.get(t.name, _R), "const")
                             for e, t in zip(outs, node.outputs)]
        if count[0] > _MAX_EXPR_APPLIES:
            # too large to read: the node as one computation over its leaves
            args = tuple(leaves.values()) or (Leaf(_R, "const"),)
            body: Expr = Apply(_op_token(_kind_name(node.kind)), args)
            if any(t.name in reduced for t in node.outputs):
                body = Coll(Collective.ALL_REDUCE, (), body)
            return str(body)
        if len(exprs) == 1:
            return str(exprs[0])
        return str(Apply("Outputs", tuple(exprs)))


def _op_token(name: str) -> str:
    tok = re.sub(r"[^A-Za-z0-9_./:\-]", "_", name)
    if re.fullmatch(r"R|P|S\d+|C_.*", tok):
        tok = "Op_" + tok
    return tok


def _kind_name(kind: Kind) -> str:
    return "".join(part.capitalize() for part in kind.value.split("-"))


def propagate(node: GraphNode, index: GraphIndex, num_devices: int, seed: PatternSeed,
              replicate_unknown: bool = False) -> ShardingPattern:
    """The pattern ``seed`` gives on ``node``, or :class:`Invalid` saying why there is none.
    ``replicate_unknown``: ops without a rule are allowed when all their inputs are
    replicated (only for the all-replicated pattern)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices}: must be at least 1")
    return _Engine(node, index, num_devices, seed, replicate_unknown).run()

