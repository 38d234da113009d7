"""What the runtime's modules share: the failed-step error and a replica body's helpers.

In:  tensors, variables and placements inside a replica body.
Out: :class:`StepError`; ``_Replica`` (what a replica body sees besides its tensors);
     ``_read`` (variables read as tensors), ``_spec`` (their ``tf.TensorSpec``), ``_placed``
     (a tensor with a device), ``_axis`` (the split axis of a placement; raises ``ValueError``
     for P); the loss reductions and output activations the runtime reproduces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tapas.sharding.placements import Partial, Placement, Split

# Keras loss reductions the runtime reproduces (no sample weights): a sum, or a sum / count
_REDUCTIONS = frozenset({"sum", "sum_over_batch_size", "mean", "mean_with_sample_weight"})
# the output activations whose logits a program hands to the loss (tapas.execution.program.reconstruct:
# LOGIT_ACTIVATIONS), recomputed after the logits are gathered for the loss
_ACTIVATIONS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "Softmax": tf.nn.softmax, "Sigmoid": tf.math.sigmoid}


class StepError(RuntimeError):
    """A training step failed; weights, optimizer slots and the step counter are unchanged."""


def _placed(x: tf.Tensor) -> tf.Tensor:
    """``x`` with a device: a tensor created under no device scope (MultiWorkerMirrored's
    replica function opens none) is refused by its collectives ("destinations can not be
    empty"); the current device scope (``Runtime._on_device``) places the copy."""
    if getattr(x, "device", "x"):
        return x
    return tf.identity(x)


# ---- placements --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Replica:
    """What a replica program body sees besides its tensors: the program's collectives
    (``coll``), collectives for values nothing differentiates (``values``: the loss, outputs
    and gradients gathered to be read), the replica id (an int, or a tensor when the body is
    traced once for every replica) and whether this trace records the loss's collectives."""

    coll: Any
    values: Any
    rid: int | tf.Tensor
    records: bool
    dp: Any = None    # collectives over the replica's mesh column (rows > 1), else None
    notes: dict = dataclasses.field(default_factory=dict, compare=False)   # step values


def _read(args: Any) -> Any:
    """``args`` with every variable read (a replica program body takes tensors only). A
    plain resource read: ``Variable.read_value`` adds an identity and several Python layers
    per read, and the step reads every weight and slot on every replica (t5-small on 4
    devices: 1,572 reads while the first step is traced)."""
    return tf.nest.map_structure(
        lambda a: tf.raw_ops.ReadVariableOp(resource=a.handle, dtype=a.dtype)
        if isinstance(a, tf.Variable) else a, args)


def _spec(a: Any) -> Any:
    """The ``tf.TensorSpec`` of a tensor or variable (other values are kept)."""
    if isinstance(a, (tf.Tensor, tf.Variable)):
        return tf.TensorSpec(a.shape, a.dtype)
    return a


def _axis(p: Placement) -> int | None:
    if isinstance(p, Partial):
        raise ValueError("a weight, input or output cannot be placed P (partial sums): "
                         "patterns reduce their partial sums inside the node")
    return p.axis if isinstance(p, Split) else None
