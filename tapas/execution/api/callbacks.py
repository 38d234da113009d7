"""What Keras callbacks see and keep in ``ParallelModel.fit``.

In:  a ``ParallelModel`` and the user's ``keras.callbacks.Callback`` s.
Out: :class:`CallbackModel` (``self.model`` of a callback: ``stop_training``, ``optimizer``
     with its learning rate and step counter, ``get_weights``/``set_weights``),
     :class:`TensorBoardScalars` (the step's scalars and the program's graph), the callbacks
     checked (:func:`check_callbacks`, refusing those in :data:`REFUSED_CALLBACKS` with what
     to use instead), and their state between epochs for checkpoints
     (:func:`callback_states`, :func:`restore_callback_states`).
Raises: TypeError / ValueError naming the callback and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

__all__ = ["CALLBACK_STATE", "CallbackModel", "REFUSED_CALLBACKS", "TensorBoardScalars",
           "callback_states", "check_callbacks", "restore_callback_states", "save_keras"]

#: Keras callbacks that need a Keras model's internals, and what to use instead
REFUSED_CALLBACKS: dict[str, str] = {
    "TensorBoard": "fit(..., tensorboard=LOGDIR) or tapas.execution.api.fit.TensorBoardScalars"
                   "(LOGDIR) (loss, step time, examples/s, learning rate)",
    "SwapEMAWeights": "it swaps a Keras model's variables; with use_ema the weights "
                      "become their moving averages at the end of fit, as Keras's",
}


# ---- what callbacks see ---------------------------------------------------------------------

class _OptimizerView:
    """``model.optimizer`` for callbacks: the runtime's optimizer with its learning rate
    (a variable, so setting it takes effect at the next step without tracing again)."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt

    @property
    def name(self) -> str:
        return self._rt.optimizer.name

    @property
    def learning_rate(self) -> float:   # a schedule's rate at the step counter
        return self._rt.optimizer.current_learning_rate(self._rt.iterations, self._rt.learning_rate)

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if self._rt.optimizer.has_schedule:
            raise TypeError("the optimizer's learning rate is a LearningRateSchedule, hence "
                            "not settable (as Keras): change the schedule instead")
        self._rt.learning_rate.assign(float(value))

    @property
    def iterations(self) -> int:
        return int(self._rt.iterations.numpy())


class CallbackModel:
    """What Keras callbacks see as ``self.model`` during :func:`fit`: ``stop_training``,
    ``optimizer`` (``learning_rate`` read and set, ``iterations``), ``get_weights()`` /
    ``set_weights()`` (the global weights in ``runtime.paths`` order, as EarlyStopping's
    ``restore_best_weights`` uses them), ``save_weights()`` / ``save()`` (Keras's files of
    the trained model, as ModelCheckpoint writes them), ``history``, ``parallel_model``,
    ``is_chief``, and ``last_step`` (the last step's global step, loss, seconds and
    examples); other attributes are the ParallelModel's."""

    def __init__(self, pm: Any) -> None:
        self.parallel_model = pm
        self.stop_training = False
        self.history: Any = None
        self.optimizer = _OptimizerView(pm.runtime)
        self.is_chief = pm.runtime.task_id == 0
        self.last_step: dict[str, float] = {}

    @property
    def name(self) -> str:
        return getattr(self.parallel_model.model, "name", "parallel_model")

    def get_weights(self) -> list[np.ndarray]:
        values = self.parallel_model.global_weights()
        return [values[p] for p in self.parallel_model.runtime.paths]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        paths = self.parallel_model.runtime.paths
        if len(weights) != len(paths):
            raise ValueError(f"set_weights got {len(weights)} arrays, the model has "
                             f"{len(paths)} weights (get_weights() order)")
        self.parallel_model.runtime.set_global_weights(dict(zip(paths, weights)))

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """ModelCheckpoint's ``save_weights_only=True``: :func:`save_keras`."""
        save_keras(self.parallel_model, filepath, weights_only=True, overwrite=overwrite,
                   **kwargs)

    def save(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """ModelCheckpoint's whole-model files: :func:`save_keras`."""
        save_keras(self.parallel_model, filepath, overwrite=overwrite, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parallel_model, name)


def save_keras(pm: Any, filepath: str, weights_only: bool = False, **kwargs: Any) -> str:
    """Keras's own file of the trained model at ``filepath``: ``save_weights`` of the
    Keras model holding the global weights (``to_keras``), or ``model.save`` with, in its
    compiled optimizer, the parallel optimizer's slots, step counter and learning rate
    (``Runtime.optimizer_to_keras``). Every worker gathers (call it on all), the chief
    writes; returns ``filepath``."""
    model = pm.to_keras()
    if not weights_only:
        pm.runtime.optimizer_to_keras(model)
    if pm.runtime.task_id == 0:
        (model.save_weights if weights_only else model.save)(filepath, **kwargs)
    return filepath


def _scalar(name: str, value: float) -> None:
    """A TensorBoard scalar summary at the default writer's step, written with TensorFlow's
    own ``tf.summary.write`` and the scalars plugin's metadata (what ``tf.summary.scalar``
    writes; that one needs the tensorboard package, which tensorflow-cpu does not
    install)."""
    from tensorflow.core.framework import summary_pb2
    meta = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(name, tf.constant(float(value), tf.float32),
                     metadata=meta.SerializeToString())


class TensorBoardScalars(keras.callbacks.Callback):
    """TensorBoard scalars of a :func:`fit` run, written by the chief worker under
    ``logdir`` with the global step, and the traced training step's graph (TensorBoard's
    graph tab; ``write_graph=False`` leaves it out): per step ``loss`` (that step's), ``step_seconds``,
    ``examples_per_second``, ``learning_rate`` and ``collective_bytes_per_step`` (the
    global bytes of the step's collectives, as the audit counts them); per epoch ``epoch_<key>`` for each key of
    the epoch's logs (``epoch_loss``, ``epoch_val_loss``...); at the step training starts
    from, ``workers`` (processes) and, after ``tapas train --elastic`` restarted the job,
    ``elastic_restarts``."""

    def __init__(self, logdir: str, write_graph: bool = True) -> None:
        super().__init__()
        self.logdir = logdir
        self.write_graph = write_graph
        self._writer: Any = None
        self._graph_written = False

    def _active(self) -> bool:
        return bool(getattr(self.model, "is_chief", True))

    def on_train_begin(self, logs: Any = None) -> None:
        if self._active():
            self._writer = tf.summary.create_file_writer(self.logdir)
            rt = getattr(getattr(self.model, "parallel_model", None), "runtime", None)
            if rt is None:
                return
            # at the step it starts from: the worker processes (an elastic restart's fewer)
            # and the restarts so far (set by tapas train --elastic's launcher)
            with self._writer.as_default(step=int(rt.iterations.numpy())):
                _scalar("workers", rt.num_replicas // max(len(rt.local_replicas), 1))
                restarts = os.environ.get("TAPAS_ELASTIC_RESTARTS")
                if restarts:
                    _scalar("elastic_restarts", float(restarts))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        info = getattr(self.model, "last_step", None)
        if self._writer is None or not info:
            return
        with self._writer.as_default(step=int(info["step"])):
            self._graph()
            _scalar("loss", info["loss"])
            _scalar("step_seconds", info["seconds"])
            _scalar("examples_per_second", info["examples"] / max(info["seconds"], 1e-9))
            _scalar("learning_rate", self.model.optimizer.learning_rate)
            comm = self._collective_bytes()
            if comm is not None:
                _scalar("collective_bytes_per_step", comm)

    def _graph(self) -> None:
        """The traced training step's graph (the parallel program: every replica's ops and
        its collectives), once, for TensorBoard's graph tab."""
        rt = getattr(getattr(self.model, "parallel_model", None), "runtime", None)
        graph = getattr(rt, "graphs", {}).get("train_step")
        if self.write_graph and not self._graph_written and graph is not None:
            tf.summary.graph(graph)
            self._graph_written = True

    def _collective_bytes(self) -> int | None:
        """The global bytes of the collectives in one training step (the traced step's
        audit, ``tapas.execution.checking.audit``, plus the loss's own), or None before a trace."""
        rt = getattr(getattr(self.model, "parallel_model", None), "runtime", None)
        if rt is None or "train_step" not in rt.audits:
            return None
        return int(sum(rt.audits["train_step"].bytes().values())) + \
            sum(b for fn, _, b in rt.loss_comms + list(getattr(rt, "regularizer_comms", []))
                if fn == "train_step")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self._writer is None:
            return
        step = int(self.model.optimizer.iterations)
        with self._writer.as_default(step=step):
            for k, v in (logs or {}).items():
                if isinstance(v, (int, float, np.floating)):
                    _scalar(f"epoch_{k}", float(v))
        self._writer.flush()

    def on_train_end(self, logs: Any = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def check_callbacks(callbacks: Any) -> list[Any]:
    """The user's callbacks, each a Keras Callback not in :data:`REFUSED_CALLBACKS`."""
    out = list(callbacks or [])
    for cb in out:
        if not isinstance(cb, keras.callbacks.Callback):
            name = type(cb).__name__
            if type(cb).__module__.startswith("tf_keras"):
                twin = (f"pass keras.callbacks.{name}(...) with the same arguments" if
                        isinstance(getattr(keras.callbacks, name, None), type) else
                        "write it as a keras.callbacks.Callback (or LambdaCallback)")
                raise TypeError(f"callback {name} is a Keras 2 (tf_keras) callback; "
                                f"ParallelModel.fit runs Keras 3's callbacks: {twin}")
            raise TypeError(f"callback {cb!r} is a {name}, not a "
                            "keras.callbacks.Callback; subclass it (or use "
                            "keras.callbacks.LambdaCallback)")
        for klass in type(cb).__mro__:
            if klass.__module__.startswith("keras") and klass.__name__ in REFUSED_CALLBACKS:
                raise ValueError(f"callback keras.callbacks.{klass.__name__} is not supported "
                                 f"by ParallelModel.fit (it needs a Keras model's internals); "
                                 f"use instead: {REFUSED_CALLBACKS[klass.__name__]}")
    return out


# ---- callbacks' own state --------------------------------------------------------------------

#: what a Keras callback keeps between epochs, by class: saved in every checkpoint and set
#: again on resume (after its ``on_train_begin`` reset it)
CALLBACK_STATE: dict[str, tuple[str, ...]] = {
    "EarlyStopping": ("wait", "stopped_epoch", "best", "best_weights", "best_epoch"),
    "ReduceLROnPlateau": ("wait", "best", "cooldown_counter"),
    "ModelCheckpoint": ("best", "_batches_seen_since_last_saving", "_last_batch_seen"),
}


def _state_of(cb: Any) -> dict[str, Any] | None:
    """A callback's state: ``state_dict()`` when it has one (a user callback opts in with
    ``state_dict``/``load_state_dict``), else :data:`CALLBACK_STATE`'s attributes of its
    Keras class, else None (nothing kept)."""
    if callable(getattr(cb, "state_dict", None)):
        return dict(cb.state_dict())
    for klass in type(cb).__mro__:
        if klass.__module__.startswith("keras") and klass.__name__ in CALLBACK_STATE:
            return {k: getattr(cb, k, None) for k in CALLBACK_STATE[klass.__name__]}
    return None


def callback_states(callbacks: Sequence[Any]) -> tuple[list[Any], dict[str, np.ndarray]]:
    """The state of every callback that keeps one (``_state_of``), in order, as (JSON
    entries ``{"class", "state"}``, arrays): a list of weights (EarlyStopping's
    ``best_weights``) is kept as arrays ``c<i>.<name>.<k>``."""
    entries: list[Any] = []
    arrays: dict[str, np.ndarray] = {}
    for cb in callbacks:
        state = _state_of(cb)
        if state is None:
            continue
        i = len(entries)
        values: dict[str, Any] = {}
        for name, v in state.items():
            if isinstance(v, (list, tuple)) and v and all(hasattr(a, "shape") for a in v):
                for k, a in enumerate(v):
                    arrays[f"c{i}.{name}.{k}"] = np.asarray(a)
                values[name] = {"arrays": len(v)}
            elif isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:
                values[name] = v.item()
            elif v is None or isinstance(v, (bool, int, float, str)):
                values[name] = v
            else:
                raise TypeError(f"callback {type(cb).__name__}: its state '{name}' is a "
                                f"{type(v).__name__}; a checkpoint keeps numbers, strings, "
                                "None and lists of arrays (return those from state_dict)")
        entries.append({"class": type(cb).__name__, "state": values})
    return entries, arrays


def restore_callback_states(callbacks: Sequence[Any], entries: Sequence[Any],
                            arrays: Any, where: str) -> None:
    """Set the saved states (``callback_states``' output) into the callbacks that keep one,
    matched in order and by class; callbacks without state may change between runs, those
    with state must be the same, in the same order (or none on one side: nothing is
    restored)."""
    stateful = [cb for cb in callbacks if _state_of(cb) is not None]
    saved, now = [e["class"] for e in entries], [type(cb).__name__ for cb in stateful]
    if not stateful or not entries:
        if saved != now:
            logging.info("%s: callbacks with state then %s, now %s: nothing restored into "
                         "them", where, saved, now)
        return
    if saved != now:
        raise ValueError(f"{where}: it was written by a fit whose callbacks keep state "
                         f"{saved}; this fit's are {now}: resume with the same ones, in the "
                         "same order (or start afresh)")
    for i, (cb, entry) in enumerate(zip(stateful, entries)):
        state = {name: ([arrays[f"c{i}.{name}.{k}"] for k in range(v["arrays"])]
                        if isinstance(v, dict) else v)
                 for name, v in entry["state"].items()}
        if callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(state)
        else:
            for name, v in state.items():
                setattr(cb, name, v)
