"""The collective audit: what a plan predicts a training step runs, against what it ran.

In:  a ``tapas.execution.program.plan.Plan`` (with the resharding edges of the
     ``tapas.planning.search.Strategy`` it came from, if any; a Strategy is taken as its
     ``Plan.from_strategy``) and its :class:`tapas.ir.Graph`; the
     :class:`tapas.execution.program.collectives.CommRecord` s an ``Audit`` recorded.
Out: the predicted ``tapas.sharding.placements.Comm`` s (:func:`predicted_comm_list`), the
     same as ``CommRecord`` s for a ``Program`` (:func:`program_comms`), the differences as
     readable lines (:func:`compare_audit`) and the report of a ``ParallelModel``
     (:class:`AuditReport`); on a 2-D mesh, the collectives over the mesh columns against
     the ones ``tapas.planning.mesh.column_collectives`` prices (:func:`column_audit`,
     :func:`say_mesh_audit`).

The prediction is every GraphNode pattern's ``comms``, plus the resharding between
GraphNodes (the plan's Strategy's ``edge_comms``, else where a consumer expects another placement
than its producer gives), once per (tensor, wanted placement), plus the resharding of a
weight read in another placement than it is stored (a tied embedding and LM head).
TensorFlow never runs the backward of a value whose gradient nothing needs, and neither
does the program: such backward comms are left out (``tapas.sharding.gradients``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tapas import ir
from tapas.execution.program.collectives import Audit, CommRecord
from tapas.execution.program.plan import Plan
from tapas.sharding.gradients import NO_GRADIENT, GradientFlow, differentiable, gradient_flow
from tapas.sharding import placements
from tapas.sharding.placements import Collective

__all__ = ["AuditReport", "predicted_comm_list", "program_comms", "compare_audit"]

# a comm with the (tensor or weight path, wanted placement) of the resharding it belongs
# to, or None for a pattern's own comm
_Tagged = tuple[Any, "tuple[str, str] | None"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Collectives of the reconstructed training step against the strategy's prediction.

    ``measured``/``predicted`` map ``(kind, phase)`` to a count; ``loss`` lists the
    collectives the runtime ran to compute the loss as ``(kind, global bytes)`` (an
    all-gather of class-split logits, or the vocabulary-parallel cross-entropy's two small
    ones) and ``predicted_loss`` those its loss plan predicts
    (``tapas.execution.training.losses.plan_loss``).
    """

    measured: Mapping[tuple[str, str], int]
    predicted: Mapping[tuple[str, str], int]
    measured_bytes: Mapping[tuple[str, str], int]
    predicted_bytes: Mapping[tuple[str, str], int]
    loss: tuple[tuple[str, int], ...]
    differences: tuple[str, ...] = ()   # "+" in the program only, "-" predicted only
    predicted_loss: tuple[tuple[str, int], ...] = ()
    # (kind, phase) -> the dtypes its tensors move in ("bfloat16+float32"), both sides
    measured_dtypes: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    predicted_dtypes: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    @property
    def matches(self) -> bool:
        return dict(self.measured) == dict(self.predicted) and \
            dict(self.measured_bytes) == dict(self.predicted_bytes) and \
            dict(self.measured_dtypes) == dict(self.predicted_dtypes) and \
            sorted(self.loss) == sorted(self.predicted_loss)

    def table(self) -> str:
        keys = sorted(set(self.measured) | set(self.predicted))
        lines = [f"{'collective':<10} {'phase':<5} {'dtype':<9} {'program':>8} "
                 f"{'predicted':>10} {'bytes (program)':>16} {'bytes (predicted)':>18}"]
        for k in keys:
            got, want = self.measured_dtypes.get(k, "-"), self.predicted_dtypes.get(k, "-")
            dtype = got if got == want else f"{got} (predicted {want})"
            lines.append(f"{k[0]:<10} {k[1]:<5} {dtype:<9} {self.measured.get(k, 0):>8} "
                         f"{self.predicted.get(k, 0):>10} {self.measured_bytes.get(k, 0):>16,} "
                         f"{self.predicted_bytes.get(k, 0):>18,}")
        if not keys:
            lines.append("(no collectives)")
        for kind in sorted({k for k, _ in self.loss} | {k for k, _ in self.predicted_loss}):
            got = [b for k, b in self.loss if k == kind]
            want = [b for k, b in self.predicted_loss if k == kind]
            lines.append(f"{kind:<10} {'loss':<5} {'':<9} {len(got):>8} {len(want):>10} "
                         f"{sum(got):>16,} {sum(want):>18,}")
        lines.append("audit " + ("matches the strategy's prediction" if self.matches else
                                 "DIFFERS from the strategy's prediction"))
        lines += [f"  {d}" for d in self.differences[:12]]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        key = lambda k: f"{k[0]} {k[1]}"  # noqa: E731
        return {"measured": {key(k): v for k, v in self.measured.items()},
                "predicted": {key(k): v for k, v in self.predicted.items()},
                "measured_bytes": {key(k): v for k, v in self.measured_bytes.items()},
                "predicted_bytes": {key(k): v for k, v in self.predicted_bytes.items()},
                "loss": [list(x) for x in self.loss],
                "predicted_loss": [list(x) for x in self.predicted_loss],
                "dtypes": {key(k): v for k, v in self.measured_dtypes.items()},
                "predicted_dtypes": {key(k): v for k, v in self.predicted_dtypes.items()},
                "matches": self.matches,
                "differences": list(self.differences)}

    @staticmethod
    def of(audit: Audit, comms: Sequence[Any], loss: tuple[tuple[str, int], ...],
           predicted_loss: tuple[tuple[str, int], ...] = ()) -> AuditReport:
        """The report of what ``audit`` recorded against the predicted ``comms``, and the
        loss's collectives ``loss`` against ``predicted_loss``."""
        predicted, predicted_bytes = _tally(comms)
        got = Counter((r.kind.value, r.phase, r.tensor) for r in audit.records)
        want = Counter((Collective.parse(c.kind).value, c.phase, c.tensor) for c in comms)
        diffs = [f"+ {k} {p} {t} (in the program only)" for (k, p, t) in got - want]
        diffs += [f"- {k} {p} {t} (predicted only)" for (k, p, t) in want - got]
        if sorted(loss) != sorted(predicted_loss):
            diffs.append(f"loss collectives {sorted(loss)} != predicted {sorted(predicted_loss)}")
        return AuditReport(audit.counts(), predicted, audit.bytes(), predicted_bytes, loss,
                           tuple(sorted(diffs)), tuple(predicted_loss),
                           _dtypes((r.kind.value, r.phase, r.dtype) for r in audit.records),
                           _dtypes((Collective.parse(c.kind).value, c.phase, c.dtype)
                                   for c in comms))


def predicted_comm_list(strategy: Any, graph: ir.Graph, *,
                        input_gradients: bool | Collection[str] = False) -> list:
    """The ``tapas.sharding.placements.Comm`` s a training step of ``strategy`` (a Plan, or
    a Strategy: its ``Plan.from_strategy``) runs on ``graph`` (see the module docstring);
    with ``input_gradients``, the gradients with respect to the float graph inputs are
    computed too (or to the inputs it names: ``tapas.sharding.gradients.gradient_flow``)."""
    plan = Plan.of(strategy, graph)
    flow = gradient_flow(graph, input_gradients=input_gradients)
    runs = [c for node in graph.nodes for c in plan.pattern(node).comms
            if _pattern_comm_runs(c, node, flow)]
    tagged: list[_Tagged] = []
    if plan.strategy is not None:   # the search's resharded edges
        for e in plan.strategy.edge_comms:
            tensor = graph.nodes[e.dst].inputs[e.input_index].name
            tagged += [(c, (tensor, e.dst_placement)) for c in e.comms]
        # a weight read in two placements is stored as its first reader wants it and
        # resharded for the others: not an edge of the graph
        weights = {w.path for w in graph.weights}
        tagged += [(c, key) for c, key in _plan_reshards(plan, graph) if key[0] in weights]
    else:
        tagged += _plan_reshards(plan, graph)
    readers = _readers(plan, graph)
    return runs + [c for c, key in tagged if _runs(c, key, flow, readers, graph)]


def program_comms(prog: Any, *,
                  input_gradients: bool | Collection[str] = False) -> list[CommRecord]:
    """:func:`predicted_comm_list` of a ``tapas.execution.program.reconstruct.Program``'s
    plan (with the resharding edges of the Strategy it came from, if any), as the
    ``CommRecord`` s its ``Audit`` records (compare them with :func:`compare_audit`)."""
    comms = predicted_comm_list(prog.plan, prog.graph, input_gradients=input_gradients)
    return [CommRecord(Collective.parse(c.kind), c.tensor, tuple(c.shape), c.dtype, c.phase,
                       c.axis) for c in comms]


def compare_audit(records: Sequence[CommRecord], predicted: Sequence[CommRecord]) -> list[str]:
    """Differences between what the program ran and what was predicted, as readable lines
    (empty: they agree on every (kind, phase, tensor, bytes), counted with multiplicity)."""
    def key(r: CommRecord) -> tuple[str, str, str, int]:
        return (r.kind.value, r.phase, r.tensor, r.bytes)
    ran, want = Counter(key(r) for r in records), Counter(key(r) for r in predicted)
    lines = []
    for k in sorted(set(ran) | set(want)):
        if ran[k] != want[k]:
            lines.append(f"{k[1]} {k[0]} on '{k[2]}' ({k[3]} bytes): ran {ran[k]}, "
                         f"predicted {want[k]}")
    return lines


def _runs(comm: Any, key: tuple[str, str] | None, flow: GradientFlow,
          readers: Mapping[tuple[str, str], list], graph: ir.Graph) -> bool:
    """Whether the program runs ``comm``: a forward comm always; a pattern's backward comm
    when its tensor gets a gradient; a resharding's backward comm when the tensor is
    computed from a gradient source and a reader in the wanted placement passes a gradient
    back from a value the outputs depend on."""
    if comm.phase != "bwd":
        return True
    if key is None:
        return comm.tensor in flow.needed
    tensor = _weight_tensor(graph, key[0])
    # (a reader passes a gradient back only through an output that can carry one: the
    # Model Garden SparseMixer's router reads its probabilities with TopKV2 and uses only
    # the integer indices, so their resharding's backward half never runs)
    return tensor in flow.forward and any(
        op.type not in NO_GRADIENT and any(o.name in flow.backward and differentiable(o.dtype)
                                           for o in op.outputs)
        for op in readers.get((tensor, key[1]), ()))


def _pattern_comm_runs(comm: Any, node: ir.GraphNode, flow: GradientFlow) -> bool:
    """Whether the program runs a pattern's ``comm`` in ``node``: a forward comm always; a
    backward one when its tensor gets a gradient and, for a tensor the node reads from
    another GraphNode, when one of the node's readers of it passes a gradient back (keras-hub
    D-FINE reads its encoder memory in one GraphNode only to select by it: that GraphNode's
    backward all-reduce of it never runs, though other readers give the tensor a gradient)."""
    if comm.phase != "bwd":
        return True
    if comm.tensor not in flow.needed:
        return False
    if comm.tensor not in {t.name for t in node.inputs}:
        return True
    return any(op.type not in NO_GRADIENT and comm.tensor in op.inputs and
               any(o.name in flow.backward and differentiable(o.dtype) for o in op.outputs)
               for op in node.ops)


def _weight_tensor(graph: ir.Graph, name: str) -> str:
    """The tensor a weight path stands for in op inputs (its resource placeholder)."""
    for w in graph.weights:
        if w.path == name:
            return w.placeholder + ":0"
    return name


def _readers(plan: Any, graph: ir.Graph) -> dict[tuple[str, str], list]:
    """(tensor, placement wanted) -> the ops that read the tensor in that placement."""
    out: dict[tuple[str, str], list] = {}
    for node in graph.nodes:
        pat = plan.pattern(node)
        wants = {t.name: str(p) for t, p in zip(node.inputs, pat.inputs)}
        wants.update({w.placeholder + ":0": str(pat.weights[w.path]) for w in node.weights})
        for op in node.ops:
            for name in op.inputs:
                if name in wants:
                    out.setdefault((name, wants[name]), []).append(op)
    return out


def _plan_reshards(plan: Any, graph: ir.Graph) -> list[_Tagged]:
    """The resharding comms a plan needs between GraphNodes, each with its (tensor or weight
    path, wanted placement): where a consumer expects another placement than its producer
    gives (a graph input is placed as its first consumer wants it; a weight is stored as its
    first reader wants it), once per (tensor, wanted placement)."""
    place: dict[str, Any] = {}
    for node in graph.nodes:
        for t, p in zip(node.outputs, plan.pattern(node).outputs):
            place[t.name] = p
    stored: dict[str, Any] = {}
    seen: set[tuple[str, str]] = set()
    comms: list[_Tagged] = []
    for node in graph.nodes:
        pat = plan.pattern(node)
        wanted = [(t.name, t.shape, t.dtype, p) for t, p in zip(node.inputs, pat.inputs)]
        for w in node.weights:
            if not graph.reads(node.id, w.path):
                continue   # a weight-side output it consumes as an input (Graph.readers)
            p = pat.weights[w.path]
            stored.setdefault(w.path, p)
            wanted.append((w.path, w.shape, w.dtype, p))
        for name, shape, dtype, want in wanted:
            have = stored.get(name, place.setdefault(name, want))
            if have != want and (name, str(want)) not in seen:
                seen.add((name, str(want)))
                comms += [(c, (name, str(want)))
                          for c in placements.reshard(have, want, tuple(shape or ()), dtype, name)]
    return comms


def _dtypes(rows: Any) -> dict[tuple[str, str], str]:
    """(kind, phase) -> the dtypes of its collectives, sorted and joined by "+"."""
    found: dict[tuple[str, str], set[str]] = {}
    for kind, phase, dtype in rows:
        found.setdefault((kind, phase), set()).add(str(dtype))
    return {k: "+".join(sorted(v)) for k, v in found.items()}


def _tally(comms: Sequence[Any]) -> tuple[dict, dict]:
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for c in comms:
        key = (Collective.parse(c.kind).value, c.phase)
        counts[key] += 1
        sizes[key] += int(c.bytes)
    return dict(counts), dict(sizes)


# ---- the mesh columns (2-D meshes) ------------------------------------------------------

def say_mesh_audit(pm: Any, mesh_text: str, say: Any) -> dict[str, Any]:
    """The collectives over the mesh columns in one training step (the gradient
    all-reduces; with nested experts also the expert all-to-alls) against the ones the cost
    model prices (``tapas.planning.mesh.column_collectives``)."""
    from tapas.planning import mesh as mesh_lib
    mesh = mesh_lib.Mesh.parse(mesh_text)
    ran, priced = column_audit(pm, mesh)
    sparse_ran, sparse_priced = column_audit(pm, mesh, sparse=True)
    sparse = {k[1].split(":")[0] for k in sparse_ran}
    same = ran == priced
    n_ar = sum(1 for k in ran if k[0] == "AR")
    n_a2a = len(ran) - n_ar
    say(f"over the {mesh.rows} mesh rows ({mesh.plan}): {n_ar} gradient all-reduces"
        + (f" and {n_a2a} expert all-to-alls" if mesh.experts else "")
        + f", {sum(ran.values()):,} bytes per step over each column (the cost model prices "
        f"{len(priced)} collectives of {sum(priced.values()):,} bytes: "
        f"{'the same' if same else 'DIFFERENT'})")
    if sparse:
        say(f"  and {len(sparse)} sparse gradients exchanged as their slices: "
            f"{sum(sparse_ran.values()):,} bytes (priced as dense gradients: "
            f"{sum(sparse_priced.values()):,} bytes)")
    return {"mesh": str(mesh), "dp_all_reduces": n_ar, "ep_all_to_alls": n_a2a,
            "sparse_gradients": len(sparse), "sparse_bytes": sum(sparse_ran.values()),
            "sparse_priced_bytes": sum(sparse_priced.values()),
            "dp_bytes": sum(v for k, v in ran.items() if k[0] == "AR"),
            "column_bytes": sum(ran.values()), "priced_collectives": len(priced),
            "priced_bytes": sum(priced.values()), "matches": same}


def column_audit(pm: Any, mesh: Any, sparse: bool = False) -> tuple[dict, dict]:
    """({(kind, tensor, phase): bytes} the mesh columns ran in ``pm``'s training step, the
    same that ``tapas.planning.mesh.column_collectives`` prices). Bytes are the tensor over
    the column (an all-to-all's priced buffer is 1/rows of it). Sparse gradients (embedding
    lookups, exchanged as their slices, priced as the dense gradient) are left out, or with
    ``sparse=True`` are all that is returned."""
    from tapas.planning import mesh as mesh_lib
    from tapas.planning.cost import Cluster
    rt = pm.runtime
    ran = {(r.kind.value, r.tensor, r.phase): r.bytes
           for r in rt.dp_audits["train_step"].records} if "train_step" in rt.dp_audits else {}
    placements = {p: s.placement for p, s in rt.specs.items()}
    cluster = Cluster.v100_ethernet(mesh.rows, mesh.cols)   # shape only: bytes are priced
    patterns = {n.id: pm.program.plan.pattern(n) for n in pm.graph.nodes}
    priced = {}
    for t in mesh_lib.column_collectives(pm.graph, placements, mesh.on(cluster),
                                         patterns.__getitem__).terms:
        kind, name = t.label.split(" ", 1)
        if kind == "dp":
            priced[("AR", name, "bwd")] = t.nbytes
        else:
            priced[("A2A", name, "bwd" if t.backward else "fwd")] = t.nbytes * mesh.rows
    slices = {k[1].split(":")[0] for k in ran if k[0] == "AG"}

    def keep(key: tuple) -> bool:
        return (key[1].split(":")[0] in slices) == sparse
    return ({k: v for k, v in ran.items() if keep(k)},
            {k: v for k, v in priced.items() if keep(k)})
