"""The training loss of a placed output: how it is computed and what it moves (pure, no TF).

The runtime (``tapas.execution.training.losses``) computes the loss where the model's output lies,
and the search prices the collectives that costs (``CostOptions.loss``): both read the plan
from here, so the audit's prediction for the loss and the search's price are one number.

In:  a :class:`LossSpec` (what of a Keras loss decides the plan: its class name and the
     keyword arguments ``from_logits``, ``axis``, ``ignore_class``; :meth:`LossSpec.of`
     reads them off a ``keras.losses.Loss`` without importing Keras), the placement of the
     output (``R`` or ``S(a)``), its global shape and dtype, the targets' rank, the number of
     devices and the output's softmax/sigmoid (when a Keras cross-entropy reads its logits).
Out: a :class:`LossPlan`: the method, where the targets go, and each collective's kind and
     global bytes.

Methods (``LossPlan.method``):

* ``local``: the per-example loss of the local slice. Right when the output is replicated,
  when it is split on an axis the per-example loss keeps (Keras losses reduce the last
  axis only: batch or sequence splits), and when it is split on the last axis and the loss
  is a mean over that axis of per-element terms (MSE, MAE, binary cross-entropy, Huber,
  log-cosh, MSLE); the targets are split alike.
* ``vocab-parallel``: logits split on the class axis (an LM head split by vocabulary) under
  ``(Sparse)CategoricalCrossentropy(from_logits=True)``. Megatron's vocabulary-parallel
  cross-entropy: each replica takes the max and the sum of exponentials of its slice, and
  the logit of the target class where it holds it; an all-gather of the per-row maxima
  ``[..., N]`` and one all-reduce of the packed per-row sums ``[..., 2]`` (``[..., 3]`` for
  dense targets) give every replica the full per-example loss. Nothing grows with the
  vocabulary. The gradient of the local logits is local: ``softmax(z)_slice - y_slice``.
* ``gather``: any other loss of an output split on its last axis: the output (or the
  logits of a softmax/sigmoid output) is all-gathered first (a collective as large as the
  output).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

from tapas.ir import dtype_bytes
from tapas.sharding.placements import Placement, Split

__all__ = ["LossSpec", "LossPlan", "plan_loss", "output_activation", "MEAN_OVER_LAST_AXIS",
           "ACTIVATIONS"]

# Keras losses whose per-example value is a mean over the last axis of per-element terms:
# the mean of the local slice's means is the global mean
MEAN_OVER_LAST_AXIS = frozenset({
    "MeanSquaredError", "MeanAbsoluteError", "MeanSquaredLogarithmicError",
    "BinaryCrossentropy", "Huber", "LogCosh"})
# class name -> whether its targets are class ids (sparse)
_CROSSENTROPY = {"CategoricalCrossentropy": False, "SparseCategoricalCrossentropy": True}
# op types whose input a Keras cross-entropy reads instead of the output (``_keras_logits``)
ACTIVATIONS = frozenset({"Softmax", "Sigmoid"})


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What of a Keras loss decides how a placed output's loss is computed.

    ``name`` is the ``keras.losses.Loss`` class name (``"SparseCategoricalCrossentropy"``);
    the other fields are its keyword arguments of the same names.
    """

    name: str
    from_logits: bool = False
    axis: int = -1
    ignore_class: int | None = None

    @staticmethod
    def of(loss: Any) -> LossSpec:
        """The spec of ``loss``: a LossSpec as it is, or a ``keras.losses.Loss`` object (its
        class name and ``_fn_kwargs``; read without importing Keras)."""
        if isinstance(loss, LossSpec):
            return loss
        if loss is None or isinstance(loss, (str, bytes, types.FunctionType)):
            raise TypeError(f"loss {loss!r}: give a keras.losses.Loss object (e.g. "
                            "keras.losses.SparseCategoricalCrossentropy(from_logits=True)) "
                            "or a tapas LossSpec")
        kw = dict(getattr(loss, "_fn_kwargs", None) or {})
        axis = kw.get("axis", -1)
        return LossSpec(type(loss).__name__, bool(kw.get("from_logits", False)),
                        int(axis) if isinstance(axis, int) else -1, kw.get("ignore_class"))

    @property
    def sparse(self) -> bool:
        """Whether the targets are class ids (one rank fewer than the output)."""
        return _CROSSENTROPY.get(self.name, False)

    def target_ndim(self, out_ndim: int) -> int:
        """The targets' usual rank for an output of rank ``out_ndim``: one fewer for a
        sparse cross-entropy (class ids), the same otherwise."""
        return out_ndim - 1 if self.sparse else out_ndim

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> LossSpec:
        return LossSpec(str(d["name"]), bool(d.get("from_logits", False)),
                        int(d.get("axis", -1)), d.get("ignore_class"))


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """How the runtime computes the loss of a placed output (see the module docstring)."""

    method: str                            # "local", "vocab-parallel" or "gather"
    axis: int | None                       # the output's split axis (None: replicated)
    target_axis: int | None                # targets split on this axis (None: replicated)
    collectives: tuple[tuple[str, int], ...]   # (kind, global bytes) per loss collective
    why: str = ""

    @property
    def partial(self) -> bool:
        """Whether each replica's loss is a share that the replicas sum (local per-example
        losses of split targets), rather than the full loss on every replica."""
        return self.method == "local" and self.target_axis is not None


def plan_loss(loss: Any, placement: Placement, out_shape: Sequence[int], out_dtype: str,
              target_ndim: int, num_devices: int, activation: str | None = None) -> LossPlan:
    """The :class:`LossPlan` of ``loss`` (a LossSpec or a ``keras.losses.Loss``) on an
    output of global ``out_shape`` placed ``placement``, with targets of rank
    ``target_ndim``; ``activation`` is the output's softmax/sigmoid whose logits a Keras
    cross-entropy reads (None: the output itself)."""
    if not isinstance(placement, Split):
        return LossPlan("local", None, None, (), "replicated output")
    spec = LossSpec.of(loss)
    axis = placement.axis
    last = len(out_shape) - 1
    if axis < last:      # the per-example loss keeps this axis: split the targets alike
        target = axis if axis < target_ndim else None
        return LossPlan("local", axis, target, (), f"split on axis {axis}, kept per example")
    if spec.name in _CROSSENTROPY and activation is None and spec.from_logits and \
            spec.axis in (-1, last) and spec.ignore_class is None:
        rows = math.prod(out_shape[:-1])
        b = dtype_bytes(out_dtype)
        comms = (("AG", rows * num_devices * b), ("AR", rows * (2 if spec.sparse else 3) * b))
        return LossPlan("vocab-parallel", axis, None if spec.sparse else axis, comms,
                        "class-split logits, softmax cross-entropy")
    if spec.name in MEAN_OVER_LAST_AXIS and target_ndim == len(out_shape):
        return LossPlan("local", axis, axis, (), f"{spec.name} is a mean over the split axis")
    nbytes = math.prod(out_shape) * dtype_bytes(out_dtype)
    return LossPlan("gather", axis, None, (("AG", nbytes),),
                    f"{spec.name} of an output split on its class axis: gathered first")


_PASS_THROUGH = frozenset({"Identity", "IdentityN", "Snapshot"})


def output_activation(graph: Any, name: str) -> str | None:
    """The type of the Softmax/Sigmoid op that makes tensor ``name`` of ``graph`` (a
    ``tapas.ir.Graph``; through identities), or None: a Keras cross-entropy then reads that
    op's input (its logits) instead of the output, as the runtime does."""
    made = {t.name: op for node in graph.nodes for op in node.ops for t in op.outputs}
    op = made.get(name)
    while op is not None and op.type in _PASS_THROUGH and op.inputs:
        index = int(name.rpartition(":")[2] or 0) if op.type == "IdentityN" else 0
        name = op.inputs[min(index, len(op.inputs) - 1)]
        op = made.get(name)
    return op.type if op is not None and op.type in ACTIVATIONS else None
