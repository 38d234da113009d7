"""Training-mode graphs: variable writes and random draws in the reconstructed program.

In:  a traced training-mode graph (``tapas.capturing.trace(..., training=True)``), whose ops
     read and write variables besides the weights: a Keras ``SeedGenerator``'s state (read
     for dropout's seed, then advanced by ``AssignVariableOp``) and batch norm's moving mean
     and variance (``AssignVariableOp`` of ``moving * momentum + batch * (1 - momentum)``).
Out: :func:`states_of` (the seed-generator states of a trace, with their current values),
     :func:`check_writes` (every write targets a state or a non-trainable weight),
     :class:`Writes` (what one replay of the program writes: the *new values*, applied by
     the caller after the step, so a failed step writes nothing) and :class:`StateStore`
     (the runtime's per-replica copies of the states).

How training mode stays equal to the single-device Keras model:

* Dropout: Keras draws the mask with a stateless random op from the seed its
  ``SeedGenerator`` holds this step. The program reads the same state, and the random op
  (whose rule, ``tapas.sharding.rules.plumbing.random``, leaves its output replicated) is
  replayed with the *global* shape: every device draws the single-device mask and the ops
  that split the activation slice it locally (``local_ops.LocalOps._slice_broadcast``). The
  mask of a split activation is therefore exactly the single-device mask's slice, with no
  communication; each device computes the whole mask (its flops and memory, N times the
  share of a split activation). The state advances by the replayed write, as in Keras.
* Dropout of Keras 2 (stateful ``RandomUniform``, no seed state to read): drawn statelessly
  from the step number instead, the same draw on every device
  (``reconstruct.STATEFUL_RANDOM``); not Keras's numbers, so ``verify`` refuses training
  mode there and says why.
* Batch norm: the batch moments are ``Mean`` s over the batch (and spatial) axes; a plan
  that splits the batch computes them with the ``partial-mean`` rewrite and a forward
  all-reduce (synchronized batch norm: the statistics of the global batch), which the
  pattern lists among its comms, so the audit predicts it. The moving statistics are
  written from these replicated values: every device stores the same new value.
* A write needs its value whole (the rule makes it ``R``); a variable stored split takes
  its local slice of it (no communication).

Reads of a seed state see the value of the last write before them in the traced program
(a SeedGenerator shared by two dropout layers, or one Dropout layer applied three times,
advances once per draw, as in Keras), whatever order the replay meets them in
(:func:`read_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tapas.execution.program.collectives import local_slice
from tapas.execution.program.plan import ReconstructError
from tapas.sharding.patterns.pattern import REPLICATE
from tapas.sharding.placements import Placement, Replica, Split

__all__ = ["RANDOM_OPS", "WRITE_OPS", "StateInfo", "states_of", "check_writes", "Writes",
           "StateStore", "read_state", "record_write", "assign_writes"]

RANDOM_OPS = frozenset({
    "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
    "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
    "StatelessRandomUniformInt", "StatelessRandomUniformFullInt"})
WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
# ops that write variables and that the program cannot replay (an optimizer's own update,
# scatters): a graph with one is refused
UNSUPPORTED_WRITES = frozenset({"ResourceApplyGradientDescent", "ResourceScatterAdd",
                                "ResourceScatterUpdate"})


@dataclasses.dataclass(frozen=True)
class StateInfo:
    """A variable the graph reads and writes that is no model weight (a seed state)."""

    path: str                 # the Keras variable's path ('dropout/seed_generator_state')
    placeholder: str          # its resource placeholder op in the traced graph
    shape: tuple[int, ...]
    dtype: str
    value: np.ndarray         # its value when the program was built


def states_of(trace: Any) -> dict[str, StateInfo]:
    """``{placeholder op name: StateInfo}`` for the trace's non-weight variables
    (``Trace.states``), each named by its unique path (``Trace.state_paths``: a repeated
    Keras path's later states get ``#k``, as weights do)."""
    out: dict[str, StateInfo] = {}
    for ph, v in getattr(trace, "states", {}).items():
        path = trace.state_paths[ph]
        value = np.asarray(tf.convert_to_tensor(v))
        out[ph] = StateInfo(path, ph, tuple(value.shape), value.dtype.name, value)
    return out


def check_writes(nodes: Sequence[Any], weight_of_ph: Mapping[str, str],
                 state_of_ph: Mapping[str, str], trainable: Callable[[str], bool]) -> None:
    """ReconstructError unless every variable write of ``nodes`` targets a seed state or a
    non-trainable weight (a trainable one belongs to the optimizer)."""
    for node in nodes:
        for op in node.ops:
            if op.type in UNSUPPORTED_WRITES:
                raise ReconstructError(
                    f"GraphNode {node.id} '{node.name}': op '{op.name}' ({op.type}) updates a "
                    "variable in a way the program cannot replay; capture the model's "
                    "forward pass only (a Keras call), not an optimizer step")
            if op.type not in WRITE_OPS:
                continue
            ph = op.inputs[0].split(":")[0]
            path = weight_of_ph.get(ph) or state_of_ph.get(ph)
            if path is None:
                raise ReconstructError(
                    f"GraphNode {node.id} '{node.name}': op '{op.name}' ({op.type}) writes "
                    f"the variable behind '{ph}', which is neither a model weight nor a "
                    "variable of the model (a SeedGenerator state): make it a variable the "
                    "Keras model tracks. A metric updated in the forward pass (Keras 2's "
                    "add_metric: the Model Garden's MoE router) is such a variable; turn "
                    "the metric off for the parallel program (the router's "
                    "export_metrics=False)")
            if ph in weight_of_ph and trainable(path):
                raise ReconstructError(
                    f"GraphNode {node.id} '{node.name}': op '{op.name}' writes the trainable "
                    f"weight '{path}' in the forward pass; only the optimizer may update a "
                    "trainable weight: make it non-trainable (as batch norm's moving "
                    "statistics are)")


class Writes:
    """The variable writes of one replay: ``{path: [new local value per local replica]}``,
    in the variable's stored placement (``stored(path)``)."""

    def __init__(self, stored: Callable[[str], Placement], num_devices: int,
                 replica_ids: Sequence[Any]) -> None:
        self._stored = stored
        self.n = num_devices
        self.rids = list(replica_ids)
        self.values: dict[str, list] = {}
        # path -> [(the write's position in the traced program, value written)], in the
        # order the replay met them (see :func:`read_state`)
        self.history: dict[str, list[tuple[int, list]]] = {}

    def as_of(self, path: str, at: int) -> tuple[int, list] | None:
        """The last write to ``path`` before program position ``at`` that the replay has
        recorded (its position and value), or None."""
        before = [(k, v) for k, v in self.history.get(path, ()) if k < at]
        return max(before, key=lambda kv: kv[0]) if before else None

    def read(self, path: str, want: Placement) -> list | None:
        """The value written to ``path`` earlier in this replay, placed ``want`` (None when
        nothing was written)."""
        if path not in self.values:
            return None
        have = self._stored(path)
        if have == want:
            return self.values[path]
        if isinstance(have, Replica) and isinstance(want, Split):
            return [local_slice(v, want.axis, self.n, r)
                    for v, r in zip(self.values[path], self.rids)]
        raise ReconstructError(f"variable '{path}' is read placed {want} after a write in "
                               f"the same step, but it is stored {have}: choose patterns "
                               "that read it replicated or as it is stored")

    def write(self, op: Any, path: str, current: list, vals: list, plc: Placement,
              label: str, at: int | None = None) -> None:
        """Record ``op`` (an ``Assign*VariableOp``) writing ``vals`` (placed ``plc``) to
        ``path``, whose value before it is ``current`` (stored placement)."""
        want = self._stored(path)
        if plc != want:
            if not (isinstance(plc, Replica) and isinstance(want, Split)):
                raise ReconstructError(
                    f"{label}: op '{op.name}' writes '{path}', stored {want} across the "
                    f"devices, with a value placed {plc}: a write needs its value whole (R) "
                    "or placed as the variable is stored; choose a pattern for this "
                    f"GraphNode that leaves the value replicated (e.g. {REPLICATE!r})")
            vals = [local_slice(v, want.axis, self.n, r) for v, r in zip(vals, self.rids)]
        if op.type == "AssignAddVariableOp":
            vals = [c + v for c, v in zip(current, vals)]
        elif op.type == "AssignSubVariableOp":
            vals = [c - v for c, v in zip(current, vals)]
        value = [tf.cast(v, c.dtype) for v, c in zip(vals, current)]
        if at is None:
            self.values[path] = value
            return
        history = self.history.setdefault(path, [])
        history.append((at, value))
        # what the step leaves in the variable: its last write in the program
        self.values[path] = max(history, key=lambda kv: kv[0])[1]


class StateStore:
    """The runtime's copies of the program's seed states: one ``tf.Variable`` per state per
    local replica (replicated: every replica advances its copy identically)."""

    def __init__(self, states: Mapping[str, StateInfo], strategy: tf.distribute.Strategy,
                 devices: Mapping[int, str]) -> None:
        self.infos = {s.path: s for s in states.values()}
        self.vars: dict[int, dict[str, tf.Variable]] = {}
        for r, device in devices.items():
            with tf.device(device):
                self.vars[r] = {p: tf.Variable(s.value, trainable=False, name=f"state{k}_r{r}")
                                for k, (p, s) in enumerate(self.infos.items())}
        self.dist = strategy.experimental_distribute_values_from_function(
            lambda ctx: self.vars[ctx.replica_id_in_sync_group])

    @property
    def paths(self) -> list[str]:
        return list(self.infos)

    def values(self) -> dict[str, np.ndarray]:
        """Every state's value (the first local replica's copy; all copies are equal)."""
        first = self.vars[min(self.vars)]
        return {p: v.numpy() for p, v in first.items()}

    def set_values(self, values: Mapping[str, Any]) -> None:
        """Assign ``values`` (by path) to every local copy."""
        for copies in self.vars.values():
            for p, v in values.items():
                copies[p].assign(v)


def read_state(run: Any, path: str, op: Any = None) -> list:
    """A seed state's local values in the replay ``run`` (a ``run.Run``) as the
    traced program's op ``op`` (a read or a write of it) sees them: the value of the last
    write before ``op`` in the program, else the caller's variable, else the traced model's
    own variable. The replay runs GraphNode by GraphNode, not in program order: keras-hub
    ESM-2 applies one Dropout layer three times per call, and the three advances of its
    seed state (read, add 1, assign: no data from the activations) are grouped into the
    first dropout's GraphNode, so a later dropout's read, replayed after all three writes,
    must still see the value after the writes that precede it in the program. A write
    before ``op`` that the replay has not met yet cannot be seen: ReconstructError.
    Without ``op``, the last value written in this replay."""
    if op is not None and path in run.p._state_writes:
        at = run.p._op_order[op.name]
        due = [k for k in run.p._state_writes[path] if k < at]
        seen = run.writes.as_of(path, at)
        if due and (seen is None or seen[0] != max(due)):
            raise ReconstructError(
                f"the replay reads seed state '{path}' at op '{op.name}' before replaying "
                "the write that precedes it in the traced program: the GraphNodes holding "
                "them are in the wrong order for it; capture the model in inference mode "
                "(training=False) to run it without drawing dropout masks")
        if seen is not None:
            return seen[1]
    else:
        written = run.writes.read(path, Replica())
        if written is not None:
            return written
    if path in run.weights:
        return [tf.convert_to_tensor(v) for v in run.weights[path]]
    ph = next(ph for ph, p in run.p._state_of_ph.items() if p == path)
    return [tf.convert_to_tensor(run.p.trace.states[ph])] * run.n_local


def record_write(run: Any, op: Any, view: dict, vplace: dict, label: str) -> None:
    """An ``Assign*VariableOp`` of the replay ``run``: record the new value in
    ``run.writes``."""
    ph, value = op.inputs[0].split(":")[0], op.inputs[1]
    if value not in view:
        raise ReconstructError(f"{label}: op '{op.name}' writes '{value}', which is "
                               "neither an input of the node nor produced inside it")
    if ph in run.p._weight_of_ph:
        path = run.p._weight_of_ph[ph]
        plc = run.p.weight_layouts[path].placement
        current = run.writes.read(path, plc) or run._read_weight(path, plc)
    else:
        path = run.p._state_of_ph[ph]
        current = read_state(run, path, op)
    run.writes.write(op, path, current, view[value], vplace[value], label,
                     run.p._op_order.get(op.name))


def assign_writes(writes: Mapping[str, Any], weights: Mapping[str, Any],
                  states: Mapping[str, Any]) -> list:
    """The assignments of a replica's ``writes`` ({path: new local value}) to its weight
    or state variables; returns the assign ops."""
    ops = []
    for path, value in writes.items():
        var = states[path] if path in states else weights[path]
        ops.append(var.assign(value))
    return ops
