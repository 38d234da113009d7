"""Keras's ``evaluate`` and ``predict`` on a :class:`tapas.execution.api.parallel.ParallelModel`,
batch by batch, with Keras's callbacks and progress bar.

In:  a ParallelModel; the data as :mod:`tapas.execution.api.fit` takes it (arrays in any
     input form with targets, a ``tf.data.Dataset``, a ``keras.utils.PyDataset`` or a
     generator of global batches); ``steps``, ``sample_weight``, ``verbose`` and
     ``callbacks`` as Keras's.
Out: :func:`evaluate` the mean loss over the examples (with compiled metrics ``[loss,
     metric...]`` in Keras's order, or a dict); :func:`predict` the outputs of every
     example, concatenated, in the structure the model returns them (a dict, a list...);
     :func:`validate` the logs of one pass, which ``fit`` calls with its own callbacks.

Both run in inference mode, as Keras's (``pm.for_inference()``: dropout off, batch norm's
moving statistics, the same weights). The callbacks see Keras's hooks in Keras's order:
``on_test_begin``, ``on_test_batch_begin``/``end`` (the running logs), ``on_test_end`` (the
final logs); ``on_predict_begin``, ``on_predict_batch_begin``/``end`` (``{"outputs": the
batch's outputs}``), ``on_predict_end``. A callback stops a pass early by setting
``self.model.stop_evaluating`` or ``stop_predicting``, as in Keras. ``verbose`` 0 is silent,
1 or "auto" (the default, as Keras's) a progress bar, 2 one line at the end; on the chief
worker only. A model class overriding ``test_step``, ``compute_loss``, ``compute_metrics``
or ``predict_step`` is refused (:mod:`.overrides`).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tapas.execution.runtime import inputs
from tapas.execution.training import metrics
from tapas.execution.api.callbacks import CallbackModel, check_callbacks
from tapas.execution.api.fit_data import (_Data, _global_batch, exact_tail, rows_combined,
                                          tail_values)
from tapas.execution.api.overrides import check_steps

__all__ = ["evaluate", "predict", "validate"]


def _callback_list(pm: Any, callbacks: Sequence[Any] | None, verbose: Any,
                   steps: int | None) -> tuple[Any, CallbackModel]:
    """Keras's CallbackList over the user's callbacks (checked as fit checks them), with a
    progress bar on the chief when ``verbose``, and the model the callbacks see."""
    view = CallbackModel(pm)
    verbose = verbose if view.is_chief else 0
    cbs = keras.callbacks.CallbackList(check_callbacks(callbacks), add_progbar=verbose != 0,
                                       verbose=verbose, epochs=1, steps=steps, model=view)
    return cbs, view


def _capped(num_batches: int | None, steps: int | None) -> int | None:
    if num_batches is None:
        return steps
    return num_batches if steps is None else min(num_batches, steps)


def evaluate(pm: Any, x: Any, y: Any = None, *, batch_size: int | None = None,
             verbose: Any = "auto", steps: int | None = None, sample_weight: Any = None,
             callbacks: Sequence[Any] | None = None, return_dict: bool = False) -> Any:
    """The mean loss over the global batches of ``x``/``y`` (or of a dataset of (x, y[,
    sample_weight]) batches; at most ``steps``), weighted by ``sample_weight`` as Keras
    weighs it, forward only: nothing is updated (``Runtime.forward_loss``). With compiled
    metrics, as Keras: ``[loss, metric...]`` in Keras's order, or a dict of every log with
    ``return_dict=True`` (also without metrics)."""
    check_steps(pm.model, "evaluate")
    ev = pm.for_inference()
    scores = metrics.Scores.of(pm.model)
    data = _Data(ev, x, y, batch_size, shuffle=False, seed=0, what="evaluate data",
                 sample_weight=sample_weight, pad_last=exact_tail(ev.runtime))
    cbs, view = _callback_list(pm, callbacks, verbose, _capped(data.num_batches, steps))
    logs = validate(ev, data, steps, scores, cbs, view)
    return logs if return_dict else metrics.keras_order(logs, scores)


def validate(pm: Any, val: _Data, steps: int | None, scores: metrics.Scores | None,
             cbs: Any, view: Any) -> dict[str, float]:
    """The logs of a pass over ``val``: the loss averaged over the examples (each batch's
    weighted by its examples, as Keras's loss tracker), and the metrics of ``scores``
    updated with every global batch (Keras's ``test_step``; a filled-up last batch, its
    own rows: ``fit_data.tail_values``), with the ``on_test_*`` hooks of ``cbs`` (``fit``
    passes its own, as Keras's ``fit`` does for validation)."""
    rt = pm.runtime
    rt.refresh()   # an inference program's own copies of weights: current values
    rt.set_step_values(scores is not None)
    view.stop_evaluating = False
    cbs.on_test_begin()
    total, count, seen, logs = 0.0, 0, 0, {}
    for xs, yb, wb, rows in val.batches(0, 0):
        cbs.on_test_batch_begin(count)
        loss = rt.forward_loss(xs, yb, worker_share=val.cut, sample_weight=wb)
        if scores is not None:   # a filled-up last batch: as Keras's step sees its rows
            scores.update(rt.step_values if rows == val.batch else tail_values(
                rt, rt.step_values, rows, val.batch, val.had_weights))
        total, count, seen = total + loss * rows, count + 1, seen + rows
        logs = {"loss": total / seen, **(scores.results() if scores is not None else {})}
        cbs.on_test_batch_end(count - 1, dict(logs))
        if (steps is not None and count >= steps) or view.stop_evaluating:
            break
    if not count:
        raise ValueError(f"{val.what}: no batch to evaluate (no examples, or no full "
                         f"global batch of {val.batch})")
    cbs.on_test_end(dict(logs))
    return logs


def _predict_batches(pm: Any, x: Any) -> Iterator[list[np.ndarray]]:
    """The inputs of ``x`` (a dataset of x or (x, y[, w]) elements, or arrays) in chunks
    of at most the global batch, one array per input in the program's order."""
    signature = pm.inputs
    names = list(signature.names)
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, types.GeneratorType)):
        for element in _elements(x):
            if isinstance(element, tuple) and 1 <= len(element) <= 3:
                element = element[0]   # (x, y[, sample_weight]) as Keras unpacks it
            yield [np.asarray(v) for v in
                   inputs._match(element, signature.structure, names, "batch",
                                 signature.describe())]
        return
    leaves = [np.asarray(v) for v in inputs._match(x, signature.structure, names, "data",
                                                   signature.describe())]
    n, b = len(leaves[0]), int(signature.specs[0].shape[0])
    for name, v in zip(names, leaves):
        if len(v) != n:
            raise ValueError(f"predict data: input '{name}' has {len(v)} rows, input "
                             f"'{names[0]}' {n}; give every input the same number")
    for start in range(0, n, b):
        yield [v[start:start + b] for v in leaves]


def _elements(x: Any) -> Iterator[Any]:
    """The elements of a dataset, a ``keras.utils.PyDataset`` (its batches in order, with
    its epoch hooks) or a generator; a list element as a tuple, as Keras takes it."""
    if isinstance(x, tf.data.Dataset):
        yield from x.as_numpy_iterator()
        return
    if isinstance(x, keras.utils.PyDataset):
        x.on_epoch_begin()
        indices = itertools.count() if x.num_batches is None else range(x.num_batches)
        elements: Iterator[Any] = (x[i] for i in indices)
    else:
        elements = x
    for element in elements:
        yield tuple(element) if isinstance(element, list) else element
    if isinstance(x, keras.utils.PyDataset):
        x.on_epoch_end()


def _num_predict_batches(x: Any, b: int) -> int | None:
    """How many batches :func:`_predict_batches` yields, when known beforehand."""
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    if isinstance(x, types.GeneratorType):
        return None
    if isinstance(x, tf.data.Dataset):
        card = int(x.cardinality().numpy())
        return card if card >= 0 else None
    leaves = tf.nest.flatten(x)
    return -(-len(leaves[0]) // b) if leaves and np.ndim(leaves[0]) else None


def predict(pm: Any, x: Any, *, batch_size: int | None = None, verbose: Any = "auto",
            steps: int | None = None, callbacks: Sequence[Any] | None = None) -> Any:
    """The model's outputs for every example of ``x`` (arrays in any input form, or a
    dataset of global batches; at most ``steps`` batches), run one global batch at a time
    and concatenated; a list when the model has several outputs (``Runtime.predict`` of
    the inference graph on the same weights). A last batch with fewer rows is padded with
    zeros and the padding's outputs cut off, when the rows cannot affect each other
    (:func:`_last_batch`); otherwise it is refused with the fix."""
    check_steps(pm.model, "predict")
    b = _global_batch(pm, batch_size)
    cbs, view = _callback_list(pm, callbacks, verbose,
                               _capped(_num_predict_batches(x, b), steps))
    ev = pm.for_inference()
    ev.runtime.refresh()
    outs: list[list[np.ndarray]] = []
    view.stop_predicting = False
    cbs.on_predict_begin()
    for count, chunk in enumerate(_predict_batches(ev, x)):
        if steps is not None and count >= steps:
            break
        cbs.on_predict_batch_begin(count)
        rows = len(chunk[0])
        if rows > b:
            raise ValueError(f"predict data: a batch of {rows} rows, the program's global "
                             f"batch is {b}: batch the dataset with .batch({b})")
        outs.append(_last_batch(ev, chunk, rows, b) if rows < b else _run(ev, chunk, rows))
        cbs.on_predict_batch_end(count, {"outputs": _structured(pm, outs[-1])})
        if view.stop_predicting:
            break
    if not outs:
        raise ValueError("predict data: no examples")
    cbs.on_predict_end()
    return _structured(pm, [np.concatenate([o[k] for o in outs]) for k in range(len(outs[0]))])


def _run(ev: Any, chunk: list[np.ndarray], rows: int) -> list[np.ndarray]:
    """The inference program's outputs for the first ``rows`` examples of a global batch."""
    result = ev.runtime.predict(ev.inputs.flatten(chunk))
    return [r[:rows] for r in (result if isinstance(result, list) else [result])]


def _last_batch(ev: Any, chunk: list[np.ndarray], rows: int, b: int) -> list[np.ndarray]:
    """The outputs of a last batch of ``rows`` < ``b`` examples, run zero-padded. Where the
    graph is not known to keep the rows apart (``fit_data.rows_combined``: an op without a
    rule, or one that may combine rows), it is run again padded with copies of its own
    rows: equal outputs for its rows show the padding does not reach them; otherwise it is
    refused with the reason and the fix."""
    padded = _run(ev, [np.concatenate([v, np.zeros((b - rows,) + v.shape[1:], v.dtype)])
                       for v in chunk], rows)
    why = rows_combined(ev.program)
    if why is None:
        return padded
    copies = _run(ev, [np.take(v, np.arange(b) % rows, axis=0) for v in chunk], rows)
    if all(np.allclose(p, c, rtol=1e-6, atol=1e-7 * max(1.0, float(np.max(np.abs(p)))))
           for p, c in zip(padded, copies)):
        logging.info("predict: a last batch of %d rows was padded to %d; %s, but its rows' "
                     "outputs are the same padded with zeros or with copies of them", rows,
                     b, why)
        return padded
    raise ValueError(f"predict data: a last batch of {rows} rows, the global batch is {b}, "
                     f"and the outputs of a row depend on the others ({why}; padded with "
                     "zeros or with copies of its rows, they differ), so padding would "
                     f"change them: give a multiple of {b} examples, or parallelize with "
                     f"input specs of batch {rows} for them")


def _structured(pm: Any, arrays: list[np.ndarray]) -> Any:
    """The outputs in the structure the model's call returns them (a dict for a model
    with a dict of outputs, as Keras's ``predict``), one array for a single output."""
    structure = getattr(getattr(pm.trace, "concrete_function", None), "structured_outputs",
                        None)
    if structure is not None and len(tf.nest.flatten(structure)) == len(arrays):
        packed = tf.nest.pack_sequence_as(structure, arrays)
    else:
        packed = arrays
    if isinstance(packed, (list, tuple)) and len(packed) == 1:
        return packed[0]
    return packed
