"""The compiled loss of a model with one or several outputs, as Keras's ``CompileLoss``
takes it: one loss per output and its ``loss_weights``; targets and sample weights per
output.

In:  a Keras model (its ``output_names`` and compile configuration) or the ``loss`` given
     to ``tapas.parallelize``: one loss for every output, a list in output order, or a
     dict keyed by output name; ``loss_weights`` likewise (or one float for a one-output
     model); targets ``y`` and ``sample_weight`` in the forms Keras's ``fit`` takes.
Out: :func:`output_losses`: (a ``keras.losses.Loss`` per output, its weight or None, the
     output names); :func:`output_targets` / :func:`output_weights`: one array per
     output, in output order.

Keras's total loss is ``sum_k weight_k * loss_k(y_k, y_pred_k, sample_weight_k)``, each
``loss_k`` reduced by its own reduction; with several outputs Keras also logs each
output's unweighted loss as ``<output name>_loss`` (``loss_names``). An output without a
loss (``None`` in the list or dict, which Keras skips) is refused: the runtime trains
every output it computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["output_losses", "output_targets", "output_weights", "loss_names"]


def _per_output(value: Any, names: Sequence[str], what: str, fix: str) -> list[Any]:
    """``value`` (one for all, a list in output order, a dict by output name) as a list."""
    n = len(names)
    if isinstance(value, Mapping):
        missing = [k for k in names if k not in value]
        extra = [k for k in value if k not in names]
        if missing or extra:
            raise ValueError(f"{what} is a dict with keys {sorted(value)}, the model's "
                             f"outputs are {list(names)}: {fix}")
        return [value[k] for k in names]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries, the model has {n} outputs "
                             f"{list(names)}: {fix}")
        return list(value)
    return [value] * n


def output_losses(model: Any, loss: Any = None, loss_weights: Any = None,
                  to_object: Callable[[Any], Any] = lambda x: x
                  ) -> tuple[list[Any], list[float | None], list[str]]:
    """(a Loss per output, its weight or None, the output names): ``loss`` (default: the
    loss the model was compiled with) and ``loss_weights`` (default: the compiled ones),
    each loss made a ``keras.losses.Loss`` by ``to_object``."""
    names = [str(n) for n in (getattr(model, "output_names", None) or ["output"])]
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss_weights is None:
            loss_weights = config.get("loss_weights")
    fix = "give one loss per output (a list in output order or a dict keyed by name)"
    losses = _per_output(loss, names, "loss", fix)
    if len(names) > 1 and any(l is None for l in losses):
        none = [n for n, l in zip(names, losses) if l is None]
        raise ValueError(f"outputs {none} have no loss: the runtime trains every output "
                         f"of the model, so {fix} (or build a model without those outputs)")
    if isinstance(loss_weights, (int, float)) and len(names) > 1:
        raise ValueError(f"loss_weights={loss_weights}: one float is for a model with one "
                         f"output; this one has {len(names)} {names}: give a list or dict")
    weights = _per_output(loss_weights, names, "loss_weights",
                          "give one weight per output (a list in output order or a dict "
                          "keyed by output name)")
    weights = [None if w is None else float(w) for w in weights]
    return [to_object(l) for l in losses], weights, names


def loss_names(names: Sequence[str]) -> list[str]:
    """The names Keras logs each output's unweighted loss under (several outputs only)."""
    return [f"{n}_loss" for n in names] if len(names) > 1 else []


def output_targets(y: Any, names: Sequence[str]) -> list[np.ndarray]:
    """The targets of each output, in output order: ``y`` a list or tuple in output order
    or a dict keyed by output name (one array for a one-output model)."""
    if len(names) == 1 and not isinstance(y, (list, tuple, Mapping)):
        return [np.asarray(y)]
    return [np.asarray(v) for v in _per_output(
        y, names, "y", "give the targets of every output: a list in output order or a dict "
        "keyed by output name")]


def output_weights(sample_weight: Any, names: Sequence[str]) -> list[np.ndarray] | None:
    """Sample weights per output (Keras: one array weighs every output's loss alike, a
    list or dict gives each output its own), or None."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, (list, tuple, Mapping)):
        return [np.asarray(w, dtype=np.float32) for w in _per_output(
            sample_weight, names, "sample_weight", "give one array for every output, or "
            "one per output (a list in output order or a dict keyed by output name)")]
    return [np.asarray(sample_weight, dtype=np.float32)] * len(names)
