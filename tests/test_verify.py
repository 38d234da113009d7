"""tapas.execution.checking.verify's diagnosis of an ill-conditioned reference
(``reference_sensitivity``): on well- and ill-conditioned Keras models, the model left as
it was, the note in `tapas train`'s verify table, and ParallelModel.verify end to end on 2
logical devices (in a subprocess: logical devices are set once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sin_model(keras: Any, frequency: float) -> Any:
    """y = sin(frequency * Dense(x)): its gradient turns over every 1 / frequency, so a
    high frequency makes it as sensitive to rounding as we like."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), batch_size=4)
    h = keras.layers.Dense(4, use_bias=False)(x)
    y = keras.layers.Dense(1)(keras.layers.Lambda(lambda t: keras.ops.sin(frequency * t))(h))
    return keras.Model(x, y)


def _sensitivity(model: Any, training: bool = False) -> dict[str, Any]:
    import keras
    from tapas.execution.checking.verify import reference_sensitivity
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    y = rng.standard_normal((4, 1)).astype("float32")
    return reference_sensitivity(model, lambda: model(x, training=training),
                                 keras.losses.MeanSquaredError(), y)


def test_a_gradient_zero_but_for_rounding_is_judged_at_the_scale_of_the_others() -> None:
    """The simulated-shards comparison scales its absolute tolerance as verify does, by the
    largest magnitude of the same kind: Hugging Face BERT's attention key bias has a
    gradient that is zero but for rounding (1e-9 against 6e-10 on one device, the other
    gradients about 3), which failed a correct plan; a real difference still fails."""
    from tapas.execution.checking.verify import Comparison, Difference
    key_bias = Difference("gradient of 'key/bias'", 1.05e-9, 6.1e-10)
    kernel = Difference("gradient of 'key/kernel'", 2e-7, 3.0)
    output = Difference("output 0 'y'", 1e-7, 2.0)
    assert Comparison((output, kernel, key_bias), ()).ok()
    assert not Comparison((output, Difference("gradient of 'key/kernel'", 1e-3, 3.0),
                           key_bias), ()).ok()
    # the scale is per kind: a large output does not excuse a gradient
    assert not Comparison((Difference("output 0 'y'", 0.0, 1e6), key_bias), ()).ok()


def test_a_well_conditioned_model_is_not_flagged_and_is_left_as_it_was() -> None:
    import keras
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), batch_size=4)
    h = keras.layers.Dropout(0.3)(keras.layers.BatchNormalization()(keras.layers.Dense(8)(x)))
    model = keras.Model(x, keras.layers.Dense(1)(h))
    before = [v.numpy().copy() for v in model.variables]
    s = _sensitivity(model, training=True)
    assert not s["exceeds"] and s["max_abs_diff"] < s["tolerance"] and s["scale"] > 0
    assert not s["outputs_exceed"] and s["outputs_max_abs_diff"] < s["outputs_tolerance"]
    assert s["relative_perturbation"] == 1e-7
    # weights, moving statistics and the dropout seed generator: all restored
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.path)


def test_an_ill_conditioned_model_is_flagged() -> None:
    import keras
    calm, wild = _sensitivity(_sin_model(keras, 1.0)), _sensitivity(_sin_model(keras, 1e6))
    assert not calm["exceeds"]
    assert wild["exceeds"] and wild["max_abs_diff"] > 10 * wild["tolerance"]


def test_the_verify_table_names_the_reference_sensitivity() -> None:
    from tapas.execution.api.train import _say_verify
    ok = {"max_abs_diff": 0.0, "scale": 1.0, "ok": True}
    check = {"ok": False, "mode": "training", "outputs": ok, "loss": ok,
             "gradients": {"max_abs_diff": 2e-3, "scale": 20.0, "ok": False, "worst": "k"},
             "sensitivity": {"relative_perturbation": 1e-7, "max_abs_diff": 7e-4,
                             "scale": 20.0, "tolerance": 2e-4, "exceeds": True}}
    lines: list[str] = []
    _say_verify(check, lines.append)
    note = [line for line in lines if "note:" in line]
    assert len(note) == 1 and "7.0e-04" in note[0] and "2.0e-04" in note[0], lines
    assert "its outputs" not in note[0]
    assert lines[-1] == "verify: FAILED"
    check["sensitivity"].update(outputs_exceed=True, outputs_max_abs_diff=3e-5,
                                outputs_tolerance=1e-5)
    lines.clear()
    _say_verify(check, lines.append)
    note = [line for line in lines if "note:" in line]
    assert "its outputs move by up to 3.0e-05 (tolerance 1.0e-05) and its gradients move" \
        in note[0]
    check["sensitivity"].update(exceeds=False, outputs_exceed=False)
    lines.clear()
    _say_verify(check, lines.append)
    assert not [line for line in lines if "note:" in line]


_SCRIPT = r"""
import json
import numpy as np
from tapas.execution.runtime import devices
devices.setup_devices(2)
import keras, tensorflow as tf
import tapas
from tapas import capturing
from tapas.execution.api import parallel
keras.utils.set_random_seed(0)
x = keras.Input((6,), batch_size=4)
h = keras.layers.Dense(4, use_bias=False)(x)
y = keras.layers.Dense(1)(keras.layers.Lambda(lambda t: keras.ops.sin(1e6 * t))(h))
model = keras.Model(x, y)
rng = np.random.default_rng(0)
xb = rng.standard_normal((4, 6)).astype("float32")
yb = rng.standard_normal((4, 1)).astype("float32")
ds = devices.make_strategy(2)
graph = capturing.capture(model, tf.TensorSpec([4, 6]))
initial = model.get_weights()
out = []
for seed in range(6):
    model.set_weights(initial)
    plan = parallel.random_plan(graph, 2, seed)
    pm = tapas.parallelize(model, tf.TensorSpec([4, 6]), plan, distribute_strategy=ds,
                           loss=keras.losses.MeanSquaredError())
    rep = pm.verify(xb, yb, steps=1)
    out.append({"gradients_ok": rep["gradients"]["ok"] and rep["outputs"]["ok"],
                "sensitivity": rep.get("sensitivity")})
print("RESULT " + json.dumps(out))
"""


def test_parallel_verify_reports_the_sensitivity_when_gradients_differ(tmp_path: Any) -> None:
    path = tmp_path / "sens.py"
    path.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    runs = json.loads(line[len("RESULT "):])
    differing = [r for r in runs if not r["gradients_ok"]]
    assert differing, runs   # sin(1e6 x) turns a plan's other summation order into a mismatch
    for r in runs:
        assert (r["sensitivity"] is None) == r["gradients_ok"], r
    assert all(r["sensitivity"]["exceeds"] for r in differing), differing
