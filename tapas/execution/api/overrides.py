"""The step methods a user's model class overrides, refused before ``ParallelModel.fit``,
``evaluate`` or ``predict`` runs Keras's standard step in their place.

In:  a Keras 3 or Keras 2 (``tf_keras``) model, and which of ``fit``, ``evaluate``,
     ``predict``, ``verify`` (``validation``: fit with validation data) is about to run.
Out: nothing when the model's class keeps Keras's own ``train_step``, ``compute_loss``,
     ``compute_metrics``, ``test_step`` and ``predict_step`` for that run; else a
     ``TypeError`` naming the class, the method, where it is defined and what to do instead.

The parallel program runs Keras's standard step on the captured ``call``: the forward
pass, the compiled loss (with the model's ``add_loss`` terms), the compiled optimizer and
metrics. A Python override of one of those methods (a custom ``train_step`` as in Keras's
"customizing fit" guide, a ``compute_loss`` that adds a term) is code the program never
runs, so training with it silently would train something else. Known library overrides
that do what Keras's own method does are allowed (:data:`EQUIVALENT`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_steps", "overridden", "EQUIVALENT"]

#: modules whose classes define Keras's own step methods
KERAS_TRAINERS = ("keras.src.trainers.trainer", "keras.src.backend.tensorflow.trainer",
                  "tf_keras.src.engine.training", "keras.src.engine.training")

#: the methods each run calls, in the order they are reported
METHODS = {"fit": ("train_step", "compute_loss", "compute_metrics"),
           "verify": ("train_step", "compute_loss"),
           "validation": ("test_step", "compute_loss", "compute_metrics"),
           "evaluate": ("test_step", "compute_loss", "compute_metrics"),
           "predict": ("predict_step",)}

#: (module, class) of library overrides equal to Keras's method for a model compiled with
#: a loss: Hugging Face's TF models (their train_step maps dict labels to outputs and
#: otherwise calls the compiled loss and the optimizer as Keras's; tests/overrides_worker.py)
EQUIVALENT = {("transformers.modeling_tf_utils", "TFPreTrainedModel"):
              ("train_step", "test_step", "compute_loss")}

_KERAS_RUN = {"fit": "fit", "verify": "fit", "validation": "fit's validation",
              "evaluate": "evaluate", "predict": "predict"}

_WHAT_INSTEAD = {
    "train_step": "put what it adds into call() (self.add_loss(...) for an extra loss "
                  "term), the compiled loss or the optimizer",
    "compute_loss": "add the extra term with self.add_loss(...) in call() (computed on the "
                    "shards), or compile with a keras.losses.Loss subclass",
    "compute_metrics": "compile keras.metrics.Metric objects (updated as Keras's default "
                       "compute_metrics updates them)",
    "test_step": "put what it adds into call(), the compiled loss or the compiled metrics",
    "predict_step": "apply its post-processing to pm.predict(x)'s outputs",
}

_WHAT_RUNS = {
    "train_step": "runs Keras's standard training step (forward, compiled loss, optimizer)",
    "compute_loss": "computes the compiled loss and the model's add_loss terms",
    "compute_metrics": "updates the compiled metrics as Keras's default does",
    "test_step": "runs Keras's standard test step (forward, compiled loss, metrics)",
    "predict_step": "returns the outputs of the model's call",
}


def overridden(model: Any, method: str) -> type | None:
    """The class of ``model``'s MRO that defines ``method``, when it is not Keras's own
    (nor an :data:`EQUIVALENT` one); None otherwise."""
    for klass in type(model).__mro__:
        if method not in vars(klass):
            continue
        if klass.__module__ in KERAS_TRAINERS:
            return None
        if method in EQUIVALENT.get((klass.__module__, klass.__name__), ()) and \
                not getattr(model, "_using_dummy_loss", False):
            return None
        return klass
    return None


def check_steps(model: Any, run: str) -> None:
    """Refuse ``run`` (a key of :data:`METHODS`) when ``model``'s class overrides one of
    the methods it calls (module docstring)."""
    for method in METHODS[run]:
        klass = overridden(model, method)
        if klass is None:
            continue
        caller = {"validation": "ParallelModel.fit's validation"}.get(
            run, f"ParallelModel.{run}")
        raise TypeError(
            f"{type(model).__name__} overrides {method} (defined in "
            f"{klass.__module__}.{klass.__qualname__}); {caller} {_WHAT_RUNS[method]} on the "
            f"parallel program and never calls a Python {method}, so its result would differ "
            f"from the model's own {_KERAS_RUN[run]}: {_WHAT_INSTEAD[method]}")
