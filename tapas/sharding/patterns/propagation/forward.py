"""The forward pass: placements op by op, forward all-reduces, rewrites, flops.

In:  a :class:`~tapas.sharding.patterns.propagation.trial.Trial`, the placement of every
     weight and the tensors already known to need a forward all-reduce.
Out: :class:`Forward` -- the placement every op leaves on its outputs and the one its
     consumers see, the forward comms, the rewrites, the flops per device and, for the
     backward pass, what each op does to the gradient of each of its inputs -- or
     :class:`NeedReduce` (a partial sum that must be all-reduced first: the driver adds it
     and starts over) or :class:`~tapas.sharding.patterns.propagation.trial.Invalid`.

Per op, with its rule from :mod:`tapas.sharding.rules`: an op may split at most one label;
an input split on a label the op forbids (``no_split``) or a non-divisible dimension makes
the pattern invalid; a partial-sum input the op is not linear in is all-reduced right
after the op that produced it -- this is how row-parallel gets its ``C_AR`` before a bias
add; a partial node output is all-reduced too (a node boundary never carries ``P``).

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tapas.ir import OpInfo, TensorInfo
from tapas.sharding import rules
from tapas.sharding.gradients import NO_GRADIENT
from tapas.sharding.patterns.pattern import Rewrite
from tapas.sharding.patterns.propagation.flops import (DENSE_KINDS, gemm_width, op_elements,
                                                        op_flops, volume, width_bucket)
from tapas.sharding.patterns.kernels import KERNEL_KINDS, KernelUse, kernel_key
from tapas.sharding.patterns.propagation.trial import FLOAT_DTYPES, Invalid, Trial
from tapas.sharding.placements import Collective, Comm, Partial, Placement, Replica, Split

__all__ = ["Forward", "OpRecord", "NeedReduce", "Contribution", "run_forward"]

_R = Replica()
_P = Partial()

# What an op does to the gradient of one of its inputs: "ok" (a full gradient), "partial"
# (each device holds an addend), ("slice", a) (a local slice on axis a) or "via" (the op
# is replicated: the input's gradient is whatever the op's outputs' gradients are).
Contribution = str | tuple[str, int]


class NeedReduce(Exception):
    """Partial sums that must be all-reduced where they are produced; the pass restarts."""

    def __init__(self, tensors: set[str]) -> None:
        super().__init__(", ".join(sorted(tensors)))
        self.tensors = tensors


@dataclasses.dataclass
class OpRecord:
    op: OpInfo
    spec: rules.OpSpec | None
    data_inputs: list[tuple[int, str]]        # (operand index, tensor) with labels
    split_label: str | None
    replicated: bool                            # no split label and no partial input


@dataclasses.dataclass
class Forward:
    """The state of the forward pass, then its result."""

    place: dict[str, Placement] = dataclasses.field(default_factory=dict)     # after fwd comms
    produced: dict[str, Placement] = dataclasses.field(default_factory=dict)  # as the op leaves it
    shapes: dict[str, tuple[int, ...] | None] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    producer: dict[str, int] = dataclasses.field(default_factory=dict)        # tensor -> op index
    recs: list[OpRecord] = dataclasses.field(default_factory=list)
    rewrites: dict[str, Rewrite] = dataclasses.field(default_factory=dict)
    fwd_comms: list[Comm] = dataclasses.field(default_factory=list)
    # tensor -> [(contribution, op index, operand index)]
    contrib: dict[str, list[tuple[Contribution, int, int]]] = dataclasses.field(
        default_factory=dict)
    needs_grad: set[str] = dataclasses.field(default_factory=set)
    flops: float = 0.0
    dense_flops: float = 0.0    # of ``flops``: contractions and convolutions
    # of ``dense_flops``: per width bucket (flops.width_bucket of flops.gemm_width)
    dense_by_width: dict[int, float] = dataclasses.field(default_factory=dict)
    # of ``dense_flops``: per compute dtype (the dtype of the op's output)
    dense_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    elements: float = 0.0       # elements the memory-bound ops touch (flops.op_elements)
    # the kernels of contractions and (depthwise) convolutions, by key (kernels.kernel_key)
    kernels: dict[str, KernelUse] = dataclasses.field(default_factory=dict)

    def describe(self, t: TensorInfo) -> None:
        self.shapes[t.name], self.dtypes[t.name] = t.shape, t.dtype

    def produce(self, t: TensorInfo, k: int, p: Placement) -> None:
        """Op ``k`` leaves its output ``t`` placed as ``p``."""
        self.produced[t.name] = p
        self.describe(t)
        self.producer[t.name] = k

    def reduce_point(self, t: str) -> str:
        """Where to all-reduce partial tensor ``t``: walk back through ops that only carry
        a partial sum along (Neg, Reshape, StopGradient, a broadcasting Mul) to the
        smallest tensor on the way, so a layer norm reduces its mean, not its output."""
        best = t
        size = volume(self.shapes.get(t) or ())
        while t in self.producer:
            rec = self.recs[self.producer[t]]
            ps = [x for _, x in rec.data_inputs if isinstance(self.place.get(x), Partial)]
            if len(ps) != 1 or rec.split_label is not None:
                break
            t = ps[0]
            s = volume(self.shapes.get(t) or ())
            if s <= size:
                best, size = t, s
        return best


@dataclasses.dataclass(frozen=True)
class _OpSplit:
    """How one op's operands are split: the split label and where, the data operands and
    the partial ones."""

    label: str | None
    where: Mapping[str, tuple[int, int]]        # label -> (operand index, axis)
    data: list[tuple[int, str]]
    partial: list[int]

    @property
    def replicated(self) -> bool:
        return self.label is None and not self.partial


def run_forward(trial: Trial, weights: Mapping[str, Placement], reduce: set[str]) -> Forward:
    """The forward pass with ``weights`` placed so and ``reduce`` all-reduced."""
    fw = _seeded(trial, weights)
    out_pl: dict[str, Placement] = {}
    if trial.seed.outputs is not None:
        out_pl = {t.name: p for t, p in zip(trial.node.outputs, trial.seed.outputs)}
    for k, op in enumerate(trial.node.ops):
        _forward_op(trial, fw, k, op, reduce, out_pl)
    for t in trial.node.outputs:
        if isinstance(fw.place.get(t.name), Partial):
            raise NeedReduce({fw.reduce_point(t.name)})
    return fw


def _seeded(trial: Trial, weights: Mapping[str, Placement]) -> Forward:
    """The state before the first op: node inputs and weights placed."""
    fw = Forward()
    for t, p in zip(trial.node.inputs, trial.seed.inputs):
        trial.check_divisible(f"input '{t.name}'", t.shape, p)
        fw.place[t.name] = p
        fw.describe(t)
        if t.dtype in FLOAT_DTYPES:
            fw.needs_grad.add(t.name)
    for w in trial.node.weights:
        p = weights[w.path]
        trial.check_divisible(f"'{w.path}'", w.shape, p)
        t = f"{w.placeholder}:0"
        fw.place[t] = fw.produced[t] = p
        fw.shapes[t], fw.dtypes[t] = w.shape, w.dtype
        if w.dtype in FLOAT_DTYPES:   # non-trainable too: their uses decide their split
            fw.needs_grad.add(t)
    return fw


def _forward_op(trial: Trial, fw: Forward, k: int, op: OpInfo, reduce: set[str],
                out_pl: Mapping[str, Placement]) -> None:
    if op.type == "Placeholder":
        _placeholder(trial, fw, k, op, out_pl)
        return
    names = [x for x in op.inputs if not x.startswith("^")]
    in_pl = [_operand(trial, fw, x) for x in names]
    ctx = rules.OpContext(tuple(fw.shapes.get(x) for x in names),
                          tuple(t.shape for t in op.outputs),
                          lambda i: trial.index.const_value(names[i]) if i < len(names)
                          else None)
    spec = rules.spec_for(op, ctx)
    if isinstance(spec, str):
        _without_rule(trial, fw, k, op, in_pl, spec)
        return
    if len(spec.inputs) != len(names):
        raise Invalid(f"op '{op.name}' ({op.type}) has {len(names)} operands, its rule "
                      f"describes {len(spec.inputs)}")
    split = _split_of(op, spec, names, in_pl)
    _check_partial_inputs(fw, spec, names, split)
    for j, t in enumerate(op.outputs):
        p = _output_placement(fw, op, spec, j, names, split)
        trial.check_divisible(f"'{t.name}'", t.shape, p)
        fw.produce(t, k, p)
        if t.name in reduce and isinstance(p, Partial):
            fw.fwd_comms.append(Comm(Collective.ALL_REDUCE, t.name, t.shape or (), t.dtype,
                                     _P, _R, "fwd"))
            p = _R
        fw.place[t.name] = p
    if spec.global_shape and any(not isinstance(q, Replica) for q in in_pl):
        fw.rewrites[op.name] = Rewrite.GLOBAL_SHAPE
    _record_gradients(fw, k, op, spec, in_pl, split)
    fw.recs.append(OpRecord(op, spec, split.data, split.label, split.replicated))
    f = op_flops(trial.n, op, spec, names, in_pl, split.label, fw.shapes, fw.produced)
    fw.flops += f
    b = None
    if spec.flops in DENSE_KINDS:
        fw.dense_flops += f
        if f > 0:       # (an op without outputs counts no FLOPs)
            dtype = op.outputs[0].dtype
            fw.dense_by_dtype[dtype] = fw.dense_by_dtype.get(dtype, 0.0) + f
        w = gemm_width(trial.n, op, spec, names, split.label, fw.shapes, fw.produced)
        if w is not None and f > 0:
            b = width_bucket(w)
            fw.dense_by_width[b] = fw.dense_by_width.get(b, 0.0) + f
    e = op_elements(trial.n, op, spec, names, in_pl, fw.shapes, fw.produced)
    fw.elements += e
    if spec.flops in KERNEL_KINDS:
        _record_kernel(trial, fw, op, spec, names, in_pl, split.label,
                       f if spec.flops in DENSE_KINDS else 0.0, b, e)


def _record_kernel(trial: Trial, fw: Forward, op: OpInfo, spec: rules.OpSpec,
                   names: Sequence[str], in_pl: Sequence[Placement], label: str | None,
                   dense: float, bucket: int | None, elements: float) -> None:
    """Count one run of the kernel ``op`` runs on its local operands (kernels.kernel_key):
    every operand axis with the op's split label divided by N (a replicated operand is
    sliced locally to match the split one, as the runtime does), the rest whole."""
    shapes: list[tuple[int, ...] | None] = []
    for x, p, labs in zip(names, in_pl, spec.inputs):
        shape = fw.shapes.get(x)
        if shape is None or labs is None or len(labs) != len(shape):
            shapes.append(None if shape is None else p.local_shape(shape, trial.n))
        else:
            shapes.append(tuple(d // trial.n if lab == label else d
                                for lab, d in zip(labs, shape)))
    key = kernel_key(op, shapes)
    if key is None:
        return
    use = fw.kernels.get(key)
    fw.kernels[key] = (KernelUse(key, 1, dense, bucket, elements) if use is None
                       else use.times(use.count + 1))


def _placeholder(trial: Trial, fw: Forward, k: int, op: OpInfo,
                 out_pl: Mapping[str, Placement]) -> None:
    """A weight's resource (placed up front) or a graph input (placed by the seed)."""
    if op.name not in trial.weight_ops:
        for t in op.outputs:
            p = out_pl.get(t.name, _R)
            trial.check_divisible(f"input '{t.name}'", t.shape, p)
            fw.place[t.name] = p
            fw.produce(t, k, p)
            if t.dtype in FLOAT_DTYPES:
                fw.needs_grad.add(t.name)
    fw.recs.append(OpRecord(op, None, [], None, True))


def _operand(trial: Trial, fw: Forward, name: str) -> Placement:
    """The placement of operand ``name``; a tensor from outside the node is replicated."""
    if name in fw.place:
        return fw.place[name]
    base = name.rsplit(":", 1)[0]
    if base in trial.weight_ops:
        raise AssertionError(f"weight {trial.weight_ops[base].path} resource seen before "
                             "its placement")
    ti = trial.index.tensor.get(name)
    fw.place[name] = _R
    fw.shapes[name] = ti.shape if ti else None
    fw.dtypes[name] = ti.dtype if ti else "unknown"
    return _R


def _without_rule(trial: Trial, fw: Forward, k: int, op: OpInfo, in_pl: Sequence[Placement],
                  reason: str) -> None:
    """An op with no rule: computed whole when everything is replicated, else invalid."""
    if not (trial.replicate_unknown and all(isinstance(p, Replica) for p in in_pl)):
        raise Invalid(reason)
    for t in op.outputs:
        fw.place[t.name] = _R
        fw.produce(t, k, _R)
    fw.recs.append(OpRecord(op, None, [], None, True))


def _split_of(op: OpInfo, spec: rules.OpSpec, names: Sequence[str],
              in_pl: Sequence[Placement]) -> _OpSplit:
    """The one label the operands split, or Invalid (meta operand split, two labels split,
    a label the op needs whole)."""
    where: dict[str, tuple[int, int]] = {}
    data: list[tuple[int, str]] = []
    partial: list[int] = []
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
            where.setdefault(labs[p.axis], (i, p.axis))
        elif isinstance(p, Partial):
            partial.append(i)
    if len(where) > 1:
        desc = ", ".join(f"operand {i} on axis {a}" for i, a in where.values())
        raise Invalid(f"op '{op.name}' ({op.type}) reads operands split on different "
                      f"dimensions ({desc}): a 1-D mesh splits an op along one dimension")
    label = next(iter(where), None)
    if label is not None and label in spec.no_split:
        i, a = where[label]
        raise Invalid(f"op '{op.name}' ({op.type}) cannot split axis {a} of operand {i} "
                      f"('{names[i]}'): the op needs that dimension whole")
    return _OpSplit(label, where, data, partial)


def _check_partial_inputs(fw: Forward, spec: rules.OpSpec, names: Sequence[str],
                          split: _OpSplit) -> None:
    """NeedReduce when the op is not linear in its partial operands."""
    if not split.partial:
        return
    if split.label is not None:
        ok = False
    elif spec.linear == "all":
        ok = len(split.partial) == len(split.data)
    else:
        ok = len(split.partial) == 1 and split.partial[0] in spec.linear
    if not ok:
        raise NeedReduce({fw.reduce_point(names[i]) for i in split.partial})


def _output_placement(fw: Forward, op: OpInfo, spec: rules.OpSpec, j: int,
                      names: Sequence[str], split: _OpSplit) -> Placement:
    """Where output ``j`` lies: split where it has the split label, partial (maybe with a
    rewrite) where the label is reduced away, replicated otherwise."""
    labs = spec.outputs[j] if j < len(spec.outputs) else None
    label = split.label
    if labs is None:
        return _R
    if label is not None and label in labs:
        return Split(labs.index(label))
    if label is not None:
        if spec.reduce in ("sum", "mean", "gather"):
            if spec.reduce == "mean":
                fw.rewrites[op.name] = Rewrite.PARTIAL_MEAN
            elif spec.reduce == "gather":
                fw.rewrites[op.name] = Rewrite.VOCAB_GATHER
            return _P
        if j > 0 and op.type.startswith("FusedBatchNorm"):
            return _R  # running statistics pass through untouched in inference
        i, a = split.where[label]
        raise Invalid(f"op '{op.name}' ({op.type}) would reduce over axis {a} of "
                      f"operand {i} ('{names[i]}'), which is split; only sums "
                      "can be left partial")
    return _P if split.partial else _R


def _record_gradients(fw: Forward, k: int, op: OpInfo, spec: rules.OpSpec,
                      in_pl: Sequence[Placement], split: _OpSplit) -> None:
    """Which outputs carry a gradient, and what the op does to each input's gradient."""
    if op.type in NO_GRADIENT:
        return
    for t in op.outputs:
        if t.dtype in FLOAT_DTYPES and any(x in fw.needs_grad for _, x in split.data):
            fw.needs_grad.add(t.name)
    for i, x in split.data:
        if x not in fw.needs_grad:
            continue
        labs = spec.inputs[i]
        assert labs is not None
        kind: Contribution
        if not isinstance(in_pl[i], Replica):
            kind = "ok"
        elif split.replicated:
            kind = "via"
        elif split.label is None:       # a partial sum multiplies this input
            kind = "partial"
        elif split.label in labs:
            kind = ("slice", labs.index(split.label))
        else:
            kind = "partial"
        fw.contrib.setdefault(x, []).append((kind, k, i))
