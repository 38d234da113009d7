"""The data of a fit job (``tapas.execution.api.fit``): arrays, a ``tf.data.Dataset`` of global
batches or a dataset function, a ``keras.utils.PyDataset`` or a Python generator of global
batches (as Keras's ``fit`` takes them), cut into this worker's shares of each global batch,
pass by pass, and the position in them.

In:  a ParallelModel, ``x``/``y``/``sample_weight`` in the forms ``fit`` takes, the batch size,
     whether to shuffle and the seed.
Out: ``_Data.batches(pass, skip)`` yields (inputs in the program's order, targets, sample
     weights or None, its number of examples) of each global batch after the first ``skip``
     of a pass, this worker's share of each (with ``pad_last``, a last partial batch filled
     up with zero-weight repeats of its rows); ``_Stream`` keeps the position (pass,
     batches into it) across epochs.
Raises: ValueError naming the value, what the program takes and the fix (a batch size
     other than the capture's, data that do not fit the model's inputs, a pass with no full
     global batch).
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tapas.execution.runtime import inputs
from tapas.execution.training import compiled_loss
from tapas.sharding.placements import Split
from tapas.sharding.rows import row_independence


# ---- the data ---------------------------------------------------------------------------------

def _global_batch(pm: Any, batch_size: int | None) -> int:
    specs = pm.inputs.specs
    b = int(specs[0].shape[0])
    if batch_size is not None and int(batch_size) != b:
        raise ValueError(f"batch_size={batch_size}: the program was built for a global batch "
                         f"of {b} ({pm.inputs.describe()}); pass batch_size={b} or leave it "
                         f"out, or parallelize again with input specs of batch {batch_size}")
    return b


class _PythonSource:
    """:class:`_Data`'s reading of a ``keras.utils.PyDataset`` or a Python generator."""

    def _init_python(self, x: Any, y: Any, sample_weight: Any) -> None:
        """A ``keras.utils.PyDataset`` (``x[i]`` the i-th batch; ``on_epoch_begin`` and
        ``on_epoch_end`` around each pass, as Keras calls them; with ``shuffle`` the batches
        in an order drawn from the seed) or a Python generator (read once, as one stream), each
        batch ``(x, y)`` or ``(x, y, sample_weight)`` as Keras's ``fit`` takes them."""
        kind = "PyDataset" if isinstance(x, keras.utils.PyDataset) else "generator"
        for value, name in ((y, "y"), (sample_weight, "sample_weight")):
            if value is not None:
                raise ValueError(f"{self.what}: {name} was given with a {kind}, which yields "
                                 f"(x, y[, sample_weight]) batches itself: leave {name} out")
        self.python, self.kind = x, kind
        if kind == "PyDataset":
            self.num_batches = x.num_batches   # None: infinite
            first = self._standard(x[0])
        else:
            self.num_batches, self._pending = None, [self._standard(next(x))]
            first = self._pending[0]
        self._set_shares(np.ndim(_first(first[1])))

    def _standard(self, element: Any) -> tuple:
        """A Python batch as ``(x, y[, sample_weight])`` (a list as a tuple), refused
        without targets."""
        element = tuple(element) if isinstance(element, list) else element
        if not isinstance(element, tuple) or len(element) not in (2, 3):
            raise ValueError(f"{self.what}: the {self.kind} yields "
                             f"{_describe_spec(element)}; fit needs (x, y) pairs or (x, y, "
                             "sample_weight) triples of global batches")
        return element

    def _python_batches(self, pass_index: int, skip: int) -> Iterator[tuple]:
        src = self.python
        if self.kind == "generator":   # one pass, read once (a resumed one skips its start)
            if pass_index > 0:
                return
            for element in itertools.islice(self._generator(), skip, None):
                batch = self._element(element)
                if batch is not None:
                    yield batch
            return
        n = self.num_batches
        if n is None:   # infinite: one stream of indices
            order: Any = itertools.count(skip)
        elif self.shuffle:   # the batches' order, from the seed as the arrays' rows
            order = np.random.default_rng([self.seed, pass_index]).permutation(n)[skip:]
        else:
            order = range(skip, n)
        if skip == 0 and hasattr(src, "on_epoch_begin"):
            src.on_epoch_begin()
        for i in order:
            batch = self._element(self._standard(src[int(i)]))
            if batch is not None:
                yield batch
        src.on_epoch_end()

    def _generator(self) -> Iterator[tuple]:
        while self._pending:
            yield self._pending.pop(0)
        for element in self.python:
            yield self._standard(element)


class _Data(_PythonSource):
    """Global batches of the data, pass by pass: ``batches(p, skip)`` yields the batches of
    pass ``p`` after the first ``skip``, each as (inputs in the program's order, targets,
    sample weights or None, the examples in it), this worker's shares of them (``cut``).
    With ``pad_last`` (evaluation: Keras's ``evaluate`` counts every example) a last batch
    of fewer examples is filled up to the global batch by repeating its rows, with sample
    weights 0 on the repeats (1 on its own rows when none were given), instead of being
    dropped."""

    def __init__(self, pm: Any, x: Any, y: Any, batch_size: int | None, shuffle: bool,
                 seed: int, what: str = "the data", sample_weight: Any = None,
                 pad_last: bool = False) -> None:
        self.pad_last = pad_last
        self.had_weights = sample_weight is not None   # (a dataset's: its last element's)
        self.signature: inputs.InputSignature = pm.inputs
        self.batch = _global_batch(pm, batch_size)
        self.what, self.shuffle, self.seed = what, shuffle, seed
        self.dataset: tf.data.Dataset | None = None
        self.noted = False
        self.runtime = pm.runtime
        self.shares: list[Any] = []            # this worker's share of each input (None:
        self.y_place: Any = None               # whole) and the targets' placement
        self.rows = self.batch                 # rows of a batch as the source yields it
        self.worker_pipelines = False          # the dataset yields this worker's rows only
        self.w: np.ndarray | None = None       # the arrays' sample weights
        if sample_weight is not None and (callable(x) or isinstance(x, tf.data.Dataset)):
            raise ValueError(f"{self.what}: sample_weight was given with a dataset; the "
                             "dataset yields (x, y, sample_weight) triples, so leave it out")
        self.python: Any = None                # a PyDataset or a generator
        self.kind: str | None = None           # which of the two
        if is_python_data(x):
            self._init_python(x, y, sample_weight)
        elif callable(x) and not isinstance(x, tf.data.Dataset):
            self._init_dataset_fn(x, y)
        elif isinstance(x, tf.data.Dataset):
            self._init_dataset(x, y)
        else:
            self._init_arrays(x, y, sample_weight)

    def _why_dropped(self) -> str:
        """Why a smaller last batch is not filled up, for the note that drops it."""
        why = tail_refusal(self.runtime)
        return f"; filling it up with copies of its rows would not be exact: {why}" if why \
            else ""

    def _set_shares(self, y_ndim: int) -> None:
        """Each input's and the targets' share for this worker (``Runtime.worker_share``):
        under MultiWorkerMirroredStrategy a batch-split tensor is read only in the rows of
        this worker's replicas; a replicated one (a tensor-parallel input) whole."""
        rt = self.runtime
        self.shares = [rt.worker_share(p, s.shape.as_list())
                       for p, s in zip(rt.input_placements, rt.input_specs)]
        self.y_place = rt.target_placement(y_ndim)
        self.y_ndim = y_ndim

    def y_share(self, shape: Sequence[int]) -> Any:
        """This worker's share of targets of the global ``shape``."""
        return self.runtime.worker_share(self.y_place, shape)

    def w_share(self, shape: Sequence[int]) -> Any:
        """This worker's share of sample weights of the global ``shape``."""
        return self.runtime.worker_share(
            self.runtime.sample_weight_placement(self.y_ndim, len(shape)), shape)

    def share_shapes(self) -> list[list[int]]:
        """The shape of each input as this worker reads it."""
        out = []
        for spec, share in zip(self.signature.specs, self.shares):
            shape = spec.shape.as_list()
            if share is not None:
                shape[share[0]] = share[2] - share[1]
            out.append(shape)
        return out

    @property
    def cut(self) -> bool:
        """Whether this worker reads shares (not whole global batches)."""
        return not self.runtime._all_local() and (
            any(s is not None for s in self.shares) or isinstance(self.y_place, Split))

    def _batch_split(self) -> bool:
        """Every input and the targets split on the batch axis over the workers: a worker's
        input pipeline can read just its rows (``num_input_pipelines`` = workers)."""
        return (self.cut and self.y_place == Split(0)
                and all(s is not None and s[0] == 0 for s in self.shares))

    def _init_dataset_fn(self, fn: Any, y: Any) -> None:
        """``x`` is a dataset function, as ``strategy.distribute_datasets_from_function``
        takes one: called with this worker's ``tf.distribute.InputContext``, it returns the
        worker's dataset. With a batch-split program (``num_input_pipelines`` = workers)
        each element holds this worker's rows of a global batch
        (``input_context.get_per_replica_batch_size(B) * replicas in this worker``); else
        (``num_input_pipelines`` = 1) whole global batches, cut here."""
        rt = self.runtime
        ds0 = fn(tf.distribute.InputContext(1, 0, rt.num_devices))
        if not isinstance(ds0, tf.data.Dataset):
            raise TypeError(f"{self.what}: the dataset function returned "
                            f"{type(ds0).__name__}, not a tf.data.Dataset")
        self._init_dataset(ds0, y)
        if self._batch_split():
            workers = rt.num_devices // len(rt.local_replicas)
            ctx = tf.distribute.InputContext(workers, rt.task_id, rt.num_devices)
            self.dataset = fn(ctx)
            self.rows = self.batch // workers
            self.worker_pipelines = True
            card = int(self.dataset.cardinality().numpy())
            self.num_batches = card if card >= 0 and self.num_batches is not None else None

    def _init_dataset(self, ds: tf.data.Dataset, y: Any) -> None:
        if y is not None:
            raise ValueError(f"{self.what}: y={type(y).__name__} was given with a "
                             "tf.data.Dataset; the dataset yields (x, y) pairs, so leave y out")
        spec = ds.element_spec
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise ValueError(f"{self.what}: the dataset yields {_describe_spec(spec)}; "
                             "fit needs (x, y) pairs or (x, y, sample_weight) triples of "
                             "global batches, e.g. tf.data.Dataset.from_tensor_slices((x, "
                             "y)).batch(B, drop_remainder=True)")
        self.dataset = ds
        card = int(ds.cardinality().numpy())
        first = tf.nest.flatten(spec[1])[0].shape
        static = first.rank and first[0] is not None and int(first[0]) == self.batch
        self.num_batches = card if card >= 0 and static else None
        self._set_shares(first.rank or 1)

    def _init_arrays(self, x: Any, y: Any, sample_weight: Any) -> None:
        if y is None:
            raise ValueError(f"{self.what}: no targets; pass y=<array> with x, or a "
                             "tf.data.Dataset of (x, y) pairs")
        names = list(self.signature.names)
        leaves = inputs._match(x, self.signature.structure, names, "data",
                               self.signature.describe())
        self.xs = [np.asarray(v) for v in leaves]
        names = self.runtime.output_names
        several = self.runtime.output_losses is not None   # a list of targets per output
        self.y = compiled_loss.output_targets(y, names) if several else np.asarray(y)
        first = _first(self.y)
        n = len(first)
        for name, v in zip(names, self.xs):
            if v.ndim == 0 or len(v) != n:
                raise ValueError(f"{self.what}: input '{name}' has "
                                 f"{len(v) if v.ndim else 0} rows but y has {n}; give every "
                                 "input and y the same number of examples")
        if n < self.batch and not self.pad_last:
            raise ValueError(f"{self.what}: {n} examples, fewer than one global batch of "
                             f"{self.batch}; give at least {self.batch}, or parallelize with "
                             "input specs of a smaller batch")
        self.num_batches = n // self.batch
        self._set_shares(first.ndim)
        if sample_weight is not None and several:   # checked per output by the runtime
            self.w = compiled_loss.output_weights(sample_weight, names)
        elif sample_weight is not None:
            self.w = np.asarray(sample_weight, dtype=np.float32)
            if self.w.ndim == 0 or self.w.shape != self.y.shape[:self.w.ndim]:
                raise ValueError(f"{self.what}: sample_weight has shape "
                                 f"{list(self.w.shape)}, y {list(self.y.shape)}: give one "
                                 f"weight per example (shape [{n}]) or per target element")
        dropped = n - self.num_batches * self.batch
        if dropped and self.pad_last:   # the last examples: one more, filled-up batch
            self.num_batches += 1
        elif dropped:
            logging.warning("%s: %d examples make %d global batches of %d; the last %d "
                            "examples of each epoch's order are dropped (the program's "
                            "batch is fixed%s)", self.what, n, self.num_batches, self.batch,
                            dropped, self._why_dropped())

    def batches(self, pass_index: int, skip: int) -> Iterator[tuple[list, np.ndarray]]:
        if self.python is not None:
            yield from self._python_batches(pass_index, skip)
            return
        if self.dataset is not None:
            yield from self._dataset_batches(skip)
            return
        n = len(_first(self.y))
        order = (np.random.default_rng([self.seed, pass_index]).permutation(n)
                 if self.shuffle else np.arange(n))
        b = self.batch
        for k in range(skip, self.num_batches):
            idx = order[k * b:(k + 1) * b]
            rows = len(idx)
            if rows < b:   # the last examples, their rows repeated up to the batch
                idx = idx[np.arange(b) % rows]
            w = None if self.w is None else tf.nest.map_structure(lambda a: a[idx], self.w)
            if rows < b:
                w = _tail_weights(w, rows, b, self.y, tail_factors(self.runtime, rows, b))
            yield (self.signature.flatten([_take(v, idx, share) for v, share in
                                           zip(self.xs, self.shares)], self.share_shapes()),
                   _take_all(self.y, idx, self.y_share),
                   None if w is None else tf.nest.map_structure(
                       lambda a: _cut(a, self.w_share(a.shape)), w), rows)

    def _dataset_batches(self, skip: int) -> Iterator[tuple[list, np.ndarray]]:
        ds = self.dataset.skip(skip) if skip else self.dataset
        for element in ds.as_numpy_iterator():
            batch = self._element(element)
            if batch is not None:
                yield batch

    def _element(self, element: tuple) -> tuple | None:
        """A batch ``(x, y[, w])`` of a dataset or Python source as this worker's (inputs,
        targets, weights); None for a smaller (last) batch, which is dropped with a note."""
        whole = "global batch" if self.rows == self.batch else "worker's share of a batch"
        source = "dataset" if self.python is None else self.kind
        x, y, w = element if len(element) == 3 else (*element, None)
        rows = len(_first(y))
        self.had_weights = w is not None
        if rows < self.rows and self.pad_last and not self.worker_pipelines:
            x, y, w = _repeated(self.signature, x, y, w, rows, self.batch,
                                tail_factors(self.runtime, rows, self.batch))
        elif rows < self.rows:
            if not self.noted:
                logging.warning("%s: a batch of %d rows, smaller than the %s (%d rows), is "
                                "dropped (batch the %s with full batches to say so%s)",
                                self.what, rows, whole, self.rows, source,
                                self._why_dropped())
                self.noted = True
            return None
        if rows > self.rows:
            raise ValueError(f"{self.what}: the {source} yields batches of {rows} rows but "
                             f"the program was built for a {whole} of {self.rows}: "
                             f"batch it by {self.rows}, or parallelize again "
                             f"with input specs of batch {rows}")
        y = tf.nest.map_structure(np.asarray, y)
        if self.worker_pipelines:   # already this worker's rows (of a whole global batch)
            return self.signature.flatten(x, self.share_shapes()), y, w, self.batch
        xs = self.signature.flatten(x)
        return ([_cut(v, share) for v, share in zip(xs, self.shares)],
                tf.nest.map_structure(lambda v: _cut(v, self.y_share(v.shape)), y),
                None if w is None else tf.nest.map_structure(
                    lambda v: _cut(v, self.w_share(np.shape(v))), w), min(rows, self.batch))


# ---- a last batch of fewer examples ----------------------------------------------------------

#: loss reductions under which a batch filled up with zero-weight rows gives the loss of its
#: own rows when those rows' weights carry a known factor (sum_over_batch_size: the global
#: batch over the rows, as it divides by the filled-up batch; the others: 1)
_TAIL_REDUCTIONS = ("sum_over_batch_size", "mean_with_sample_weight", "sum")
#: rows_combined's answer per program
_ROWS: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def tail_refusal(rt: Any) -> str | None:
    """Why a last batch of fewer examples cannot be run exactly as Keras runs it, filled up
    with zero-weight repeats of its rows (:class:`_Data`'s ``pad_last``); None when it can:
    every output's loss reduces by one of :data:`_TAIL_REDUCTIONS`, the call adds no loss,
    and each example's outputs depend on its own row only (``tapas.sharding.rows``: no batch
    norm in training, mean over the batch or similarity of every example with every other;
    dropout's masks are drawn with the batch on axis 0, so the filled-up batch draws Keras's
    numbers for its own rows). Weight regularizers are added once per batch either way."""
    losses = rt.output_losses or [rt.loss]
    bad = [r for r in (getattr(loss, "reduction", None) for loss in losses)
           if r not in _TAIL_REDUCTIONS]
    return (f"a loss reduces by {bad[0]!r}" if bad else
            "the model's call adds a loss" if rt.call_loss_placements else
            rows_combined(rt.program))


def rows_combined(program: Any) -> str | None:
    """What combines the examples of a batch in ``program``'s graph (None: nothing,
    ``tapas.sharding.rows.row_independence``), found once per program."""
    if program not in _ROWS:
        _ROWS[program] = row_independence(program.graph)
    return _ROWS[program]


def exact_tail(rt: Any) -> bool:
    """Whether a last batch of fewer examples is filled up (:func:`tail_refusal` is None)."""
    return tail_refusal(rt) is None


def tail_factors(rt: Any, rows: int, b: int) -> list[float]:
    """Per output, the factor its weights carry on a last batch of ``rows`` of ``b``."""
    return [b / rows if getattr(loss, "reduction", None) == "sum_over_batch_size" else 1.0
            for loss in rt.output_losses or [rt.loss]]


def tail_values(rt: Any, values: tuple, rows: int, b: int, weighted: bool) -> tuple:
    """A filled-up last batch's step values (``Runtime.step_values``) as Keras's step sees
    the batch of ``rows``: outputs and targets cut to those rows, the user's sample weights
    (None when none were given: the weights were only the fill's), each output's loss."""
    outs, ys, ws, output_losses = values
    factors = tail_factors(rt, rows, b)
    ws = [w[:rows] / f for w, f in zip(ws, factors)] if weighted and ws else None
    return [o[:rows] for o in outs], [y[:rows] for y in ys], ws, output_losses


def _tail_weights(w: Any, rows: int, b: int, y: Any, factors: list[float]) -> Any:
    """The sample weights of a last batch whose ``rows`` examples were repeated up to
    ``b`` rows: on its own rows the given ones (or 1) times the output's factor
    (:func:`tail_factors`; one array per output for several outputs), 0 on the repeats."""
    own = np.arange(b) < rows
    if w is None:
        masks = [own.astype(np.float32) * np.float32(f) for f in factors]
        return masks if isinstance(y, list) else masks[0]

    def weigh(a: np.ndarray, f: float) -> np.ndarray:
        keep = own.reshape((b,) + (1,) * (a.ndim - 1))
        return np.where(keep, a * np.float32(f), np.zeros_like(a)).astype(np.float32)
    if isinstance(w, list):
        return [weigh(np.asarray(a), f) for a, f in zip(w, factors)]
    if isinstance(y, list):   # one array weighing every output: one per output
        return [weigh(np.asarray(w), f) for f in factors]
    return weigh(np.asarray(w), factors[0])


def _repeated(signature: inputs.InputSignature, x: Any, y: Any, w: Any, rows: int,
              b: int, factors: list[float]) -> tuple[Any, Any, Any]:
    """A dataset's or generator's last batch of ``rows`` examples as ``b`` rows (its own
    repeated, :func:`_tail_weights`), in the program's input order."""
    idx = np.arange(b) % rows
    leaves = inputs._match(x, signature.structure, list(signature.names), "batch",
                           signature.describe())
    xs = [np.asarray(v)[idx] for v in leaves]
    y = tf.nest.map_structure(lambda a: np.asarray(a)[idx], y)
    w = None if w is None else tf.nest.map_structure(lambda a: np.asarray(a)[idx], w)
    return xs, y, _tail_weights(w, rows, b, y, factors)


def is_python_data(x: Any) -> bool:
    """Whether ``x`` is a ``keras.utils.PyDataset`` or a Python generator."""
    return isinstance(x, (keras.utils.PyDataset, types.GeneratorType))


def _cut(v: Any, share: Any) -> np.ndarray:
    """The ``(axis, start, stop)`` slab of ``v`` (all of ``v`` for None)."""
    v = np.asarray(v)
    if share is None:
        return v
    axis, lo, hi = share
    return v[(slice(None),) * axis + (slice(lo, hi),)]


def _take(v: np.ndarray, idx: np.ndarray, share: Any) -> np.ndarray:
    """Rows ``idx`` of ``v``, cut to ``share``: a batch-axis share takes only its rows."""
    if share is not None and share[0] == 0:
        return v[idx[share[1]:share[2]]]
    return _cut(v[idx], share)


def _first(y: Any) -> np.ndarray:
    """The first array of targets (one array, or one per output)."""
    return np.asarray(tf.nest.flatten(y)[0])


def _take_all(v: Any, idx: np.ndarray, share_of: Any) -> Any:
    """:func:`_take` of an array or of each array of a list (one per output), each cut to
    ``share_of(its batch shape)``."""
    return tf.nest.map_structure(
        lambda a: _take(a, idx, share_of((len(idx),) + a.shape[1:])), v)


def _describe_spec(spec: Any) -> str:
    if isinstance(spec, tuple):
        return f"tuples of {len(spec)}"
    return f"single {type(spec).__name__} elements"


class _Stream:
    """The position in the data: pass ``pass_index``, ``position`` batches into it."""

    def __init__(self, data: _Data, pass_index: int, position: int) -> None:
        self.data, self.pass_index, self.position = data, pass_index, position
        self._it: Iterator | None = None
        self.exhausted = False

    def start_pass(self, pass_index: int) -> None:
        self.pass_index, self.position, self._it = pass_index, 0, None

    def next(self, roll: bool) -> tuple[list, np.ndarray] | None:
        """The next batch; at the end of the pass, None, or with ``roll`` the first batch
        of the next pass; None when a generator, which has one pass, ran out
        (``exhausted``)."""
        while True:
            if self._it is None:
                self._it = self.data.batches(self.pass_index, self.position)
            b = next(self._it, None)
            if b is not None:
                self.position += 1
                return b
            if self.data.kind == "generator" and (roll or self.pass_index):
                self.exhausted = True   # read once: no second pass
                return None
            if not roll:
                return None
            if self.position == 0:
                raise ValueError(f"{self.data.what}: a pass over the data yields no full "
                                 f"global batch of {self.data.batch}")
            self.start_pass(self.pass_index + 1)
