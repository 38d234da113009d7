"""The backward pass: the collectives that make every gradient full.

In:  a :class:`~tapas.sharding.patterns.propagation.trial.Trial`, its finished
     :class:`~tapas.sharding.patterns.propagation.forward.Forward` and the weights the seed
     placed itself.
Out: the backward comms, and the free weights to split instead (``{path: axis}``).

In reverse op order, the gradient of every replicated, differentiable tensor is *full*
(``"ok"``), *partial* (each device holds an addend: a consumer split on a dimension the
tensor lacks, or one multiplying it with a partial sum) or *sliced* on axis a
(``("slice", a)``: a consumer read only a local slice). Partial and sliced gradients pass
lazily backward through replicated ops; where they reach a node input, a weight, a forward
comm or a mix with full gradients, a backward comm makes them full: ``AR`` (partial) or
``AG(a)`` (sliced). A weight the seed leaves free whose gradient is sliced on one axis is
split on that axis instead (a bias follows its kernel), and the driver runs the passes
again.

A node output also gets the gradient of its consumers outside the node, which arrives full
(the consumer's node makes the gradient of each of its inputs full): a node output read
inside the node by an op that leaves its gradient partial or sliced would mix the two, which
no comm on the tensor can fix (a backward ``AR`` there sums the outside gradient N times, an
``AG`` slices the output itself), so such a pattern is Invalid. keras-hub DeBERTa-v3 applies
the query and key projections to the layer-normed relative embeddings that the next layers
read too: its ``column`` patterns had summed their gradient N times and ``row`` sliced the
node's output.

A sliced gradient that travelled back through replicated ops and is not absorbed by a weight
split is all-gathered where it *started*: at the tensor the split consumer reads (its
*origin*), not where the lazy pass stopped. Reconstruction lowers a backward ``AG(a)`` on a
tensor as a local slice of that tensor in the forward pass (``C_AG`` is the conjugate of
slicing), so an ``AG`` placed upstream would slice the forward values of every op in
between, which the pattern records as replicated: a replicated ``SelectV2`` between an
attention softmax and the context matmul split on the key axis read a sliced softmax
against its whole mask (keras-hub Mixtral and Qwen3-MoE, pattern ``split-R-R-S2``).
Likewise a slice that would turn partial (through an op that does not carry it, such as
the ``Sum`` making MoE gates, or mixed with partial sums) is gathered at its origins when
one of them is a contraction's operand: only an elementwise consumer slices a replicated
operand locally, so only there is a partial gradient the right account of the slice.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping

from tapas.sharding.patterns.propagation.forward import Contribution, Forward
from tapas.sharding.patterns.propagation.trial import Invalid, Trial
from tapas.sharding.placements import Collective, Comm, Partial, Placement, Replica, Split

__all__ = ["backward_comms"]

_R = Replica()
_P = Partial()

# where a sliced gradient started: (tensor, axis, hard); hard when the consumer reading the
# tensor sliced is no elementwise op (reconstruction slices a replicated operand locally
# only for elementwise ops, so a contraction's operand must be sliced by the backward AG)
_Origin = tuple[str, int, bool]


def backward_comms(trial: Trial, fw: Forward,
                   fixed: Mapping[str, Placement]) -> tuple[list[Comm], dict[str, int]]:
    """Backward comms, and weight upgrades {path: axis} for free weights whose gradient
    is sliced on one axis."""
    return _Backward(trial, fw, fixed).run()


class _Backward:
    def __init__(self, trial: Trial, fw: Forward, fixed: Mapping[str, Placement]) -> None:
        self.trial, self.fw, self.fixed = trial, fw, fixed
        self.state: dict[str, Contribution] = {}
        # tensor in a lazy sliced state -> where the slices started, see _Origin
        self.origins: dict[str, frozenset[_Origin]] = {}
        self.gathered: set[str] = set()
        self.via_origins: dict[tuple[int, int], frozenset[_Origin]] = {}
        self.comms: list[Comm] = []
        self.upgrades: dict[str, int] = {}
        self.reduced = {c.tensor for c in fw.fwd_comms}
        self.boundary = {t.name for t in trial.node.inputs} | set(trial.weight_tensors)
        self.outputs = {t.name for t in trial.node.outputs}
        # which lazy (partial or sliced) gradients each lazy state or comm derives from:
        # the lazy tensors an operand's contribution came through (per consumer (k, i)),
        # those behind each tensor's lazy state, and those some placed comm or weight
        # upgrade relied on; making one of those full afterwards is a conflict (see _late)
        self.via_sources: dict[tuple[int, int], frozenset[str]] = {}
        self.derived: dict[str, frozenset[str]] = {}
        self.committed: set[str] = set()

    def run(self) -> tuple[list[Comm], dict[str, int]]:
        fw = self.fw
        order = [o.name for k in range(len(fw.recs) - 1, -1, -1)
                 for o in fw.recs[k].op.outputs if o.name not in self.boundary]
        order += [t.name for t in self.trial.node.inputs] + list(self.trial.weight_tensors)
        done: set[str] = set()
        for t in order:
            if t not in done and t in fw.needs_grad and isinstance(fw.place.get(t), Replica):
                done.add(t)
                self._resolve(t)
        return self.comms, self.upgrades

    def _materialize(self, t: str, s: Contribution) -> None:
        """A backward comm that makes the gradient of ``t`` full (a sliced one: an ``AG`` at
        each of its origins, see the module docstring)."""
        w = self.trial.weight_tensors.get(t)
        if w is not None and not w.trainable:
            self.state[t] = "ok"   # no gradient: nothing to reduce
            return
        self._late(t, by=t)
        if s == "partial":
            shape = self.fw.shapes.get(t) or ()
            dtype = self.fw.dtypes.get(t, "float32")
            self.comms.append(Comm(Collective.ALL_REDUCE, t, shape, dtype, _P, _R, "bwd"))
        else:
            for o, a, _ in sorted(self.origins.get(t, frozenset({(t, s[1], True)}))):
                self._gather(o, a, by=t)
        self.state[t] = "ok"
        self.committed |= self.derived.get(t, frozenset())

    def _gather(self, t: str, a: int, by: str | None = None) -> None:
        """The backward ``AG(a)`` of tensor ``t``, once (``by``: the tensor whose
        materialization gathers its origin ``t``)."""
        if t in self.gathered:
            return
        self._late(t, by)
        self.gathered.add(t)
        shape = self.fw.shapes.get(t) or ()
        if any(d < 0 for d in shape):
            # a slice of a tensor whose length the traced graph leaves unknown (Hugging
            # Face MobileViT): its gradient could not be gathered
            raise Invalid(f"'{t}' has shape {tuple(shape)}, dynamic in the traced graph: the "
                          "gradient of a slice of it cannot be gathered")
        dtype = self.fw.dtypes.get(t, "float32")
        self.comms.append(Comm(Collective.ALL_GATHER, t, shape, dtype, Split(a), _R, "bwd", a))
        self.state[t] = "ok"

    def _late(self, t: str, by: str | None = None) -> None:
        """Invalid when the gradient of ``t`` is made full after something upstream relied
        on its lazy state: a comm or weight upgrade already placed (it would reduce a full
        gradient a second time), or another tensor's lazy state still pending (it would
        reach a comm later). ``by``: the tensor being made full, whose own state derives
        from ``t`` (a slice gathered at its origin): it and the tensors its lazy state came
        through are made full with it. It happens when a later tensor mixes full and lazy
        contributions and gathers the slices at their origin (keras-hub DeBERTa-v3: the
        query kernel's gradient all-reduced, then the projection's output gathered because
        the layer-normed embeddings it reads are a node output too)."""
        covered = self.derived.get(by, frozenset()) if by is not None else frozenset()
        pending = [r for r, src in self.derived.items()
                   if r != by and r not in covered and t in src
                   and self.state.get(r, "ok") != "ok"]
        if t in self.committed or pending:
            raise Invalid(f"the gradient of '{t}' would be made full after an operand "
                          "upstream already reduced its partial or sliced state")

    def _through(self, k: int, i: int) -> Contribution:
        """The gradient replicated op ``k`` hands its operand ``i``: its outputs' state,
        mapped onto the operand's axes (a slice keeps its origins, ``self.via_origins``)."""
        rec = self.fw.recs[k]
        outs = [t.name for t in rec.op.outputs if t.name in self.fw.needs_grad]
        bad = [(t, self.state.get(t, "ok")) for t in outs if self.state.get(t, "ok") != "ok"]
        if not bad:
            return "ok"
        if len(bad) > 1 or len(bad) < len(outs):
            # several lazy outputs, or a lazy one beside full ones (a Split whose other
            # pieces are node outputs, with full gradients from outside: the operand's
            # gradient would be part partial, part full, which no comm makes full)
            for t, s in bad:
                self._materialize(t, s)
            return "ok"
        t, s = bad[0]
        self.via_sources[(k, i)] = self.derived.get(t, frozenset()) | {t}
        if s == "partial":
            return "partial"
        passed = self._pass_slice(k, i, t, s)
        if passed is not None:
            self.via_origins[(k, i)] = self.origins.get(t, frozenset({(t, s[1], True)}))
            return passed
        if any(hard for _, _, hard in self.origins.get(t, ())):
            self._materialize(t, s)    # a contraction reads t sliced: gather it there
            return "ok"
        return "partial"

    def _pass_slice(self, k: int, i: int, t: str, s: Contribution) -> Contribution | None:
        """The sliced state ``s`` of output ``t`` of replicated op ``k`` on its operand
        ``i``, or None when the op does not carry it (not elementwise, or the operand lacks
        the axis): then the operand's gradient is partial."""
        spec = self.fw.recs[k].spec
        if spec is None or spec.flops not in ("elementwise", "none"):
            return None
        j = [x.name for x in self.fw.recs[k].op.outputs].index(t)
        olabs = spec.outputs[j]
        ilabs = spec.inputs[i]
        if olabs is None or ilabs is None:
            return None
        lab = olabs[s[1]]
        if lab in spec.no_split or lab not in ilabs:
            return None
        return ("slice", ilabs.index(lab))

    def _kinds(self, t: str) -> list[Contribution]:
        """The contribution of every consumer of ``t`` to its gradient, as it stands (a
        direct slice of ``t`` is full once ``t`` is gathered), in the order of
        ``fw.contrib``; a node output's consumers outside the node add a last, full one."""
        kinds: list[Contribution] = [
            self._through(k, i) if kind == "via"
            else "ok" if isinstance(kind, tuple) and t in self.gathered else kind
            for kind, k, i in self.fw.contrib.get(t, [])]
        return kinds + ["ok"] if t in self.outputs else kinds

    def _slice_origins(self, t: str, kinds: list[Contribution]) -> frozenset[_Origin]:
        """Where the sliced contributions ``kinds`` to the gradient of ``t`` started: ``t``
        itself for a consumer that reads it sliced, the origins of the op's output for one
        passed through a replicated op."""
        out: set[_Origin] = set()
        for (kind, k, i), now in zip(self.fw.contrib.get(t, []), kinds):
            if not isinstance(now, tuple):
                continue
            if kind == "via":
                out |= self.via_origins[(k, i)]
            else:
                spec = self.fw.recs[k].spec
                out.add((t, now[1], spec is None or spec.flops != "elementwise"))
        return frozenset(out)

    def _gather_hard_slices(self, t: str, kinds: list[Contribution]) -> list[Contribution]:
        """Slices of ``t`` that would turn partial (mixed with partial sums, or on two
        axes): when one started at a contraction's operand, gather every one at its
        origin (see the module docstring); the contributions as they then stand."""
        slices = [x for x in kinds if isinstance(x, tuple)]
        if not slices or not any(h for _, _, h in self._slice_origins(t, kinds)):
            return kinds
        for (kind, k, i), now in zip(self.fw.contrib.get(t, []), kinds):
            if not isinstance(now, tuple):
                continue
            if kind == "via":
                for o in self.fw.recs[k].op.outputs:
                    if self.state.get(o.name, "ok") != "ok":
                        self._materialize(o.name, self.state[o.name])
            else:
                self._gather(t, now[1])
        kinds = self._kinds(t)
        if any(x == "ok" for x in kinds) and any(x != "ok" for x in kinds):
            raise Invalid(f"the gradient of '{t}' would mix full and partial "
                          "contributions inside the node")
        return kinds

    def _settle_mixed(self, t: str, kinds: list[Contribution]) -> list[Contribution]:
        """Full and lazy contributions (``kinds``) meet at ``t``: reduce the lazy ones where
        they come from; Invalid if that leaves a mix."""
        for (kind, k, i), s in zip(self.fw.contrib.get(t, []), kinds):
            if kind == "via" and s != "ok":
                for o in self.fw.recs[k].op.outputs:
                    if self.state.get(o.name, "ok") != "ok":
                        self._materialize(o.name, self.state[o.name])
        kinds = self._kinds(t)
        if any(x == "ok" for x in kinds) and any(x != "ok" for x in kinds):
            raise Invalid(f"the gradient of '{t}' would mix full and partial "
                          "contributions inside the node")
        return kinds

    def _resolve(self, t: str) -> None:
        """The state of the gradient of ``t`` from its consumers' contributions."""
        kinds = self._kinds(t)
        if any(x == "ok" for x in kinds) and not all(x == "ok" for x in kinds):
            kinds = self._settle_mixed(t, kinds)
        if all(x == "ok" for x in kinds):
            self.state[t] = "ok"
            return
        slices = {x for x in kinds if x != "partial"}
        if slices and (len(slices) > 1 or "partial" in kinds):
            kinds = self._gather_hard_slices(t, kinds)
            if all(x == "ok" for x in kinds):
                self.state[t] = "ok"
                return
            slices = {x for x in kinds if x != "partial"}
        s: Contribution = next(iter(slices)) if len(slices) == 1 and "partial" not in kinds \
            else "partial"
        self.derived[t] = frozenset().union(*(
            self.via_sources.get((k, i), frozenset())
            for (kind, k, i), now in zip(self.fw.contrib.get(t, []), kinds)
            if kind == "via" and now != "ok"))
        w = self.trial.weight_tensors.get(t)
        if w is not None and w.path not in self.fixed and s != "partial":
            self.upgrades[w.path] = s[1]
            self.state[t] = "ok"
            self.committed |= self.derived[t]
            return
        if s != "partial":
            self.origins[t] = self._slice_origins(t, kinds)
        k = self.fw.producer.get(t)
        if t in self.boundary or t in self.reduced or k is None or not self.fw.recs[k].replicated:
            self._materialize(t, s)
        else:
            self.state[t] = s
