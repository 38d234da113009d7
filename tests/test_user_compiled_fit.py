"""A model from another library, compiled as its users compile it (AdamW with a warmup
schedule and decay exclusions, clipnorm, an L2 regularizer, a metric), trained through
``tapas.parallelize(model).fit`` on 2 logical devices equals Keras's own ``model.fit``, a
last batch of 5 examples included (``scripts/user_compiled_fit.py`` runs five; this runs
one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keras_hub_bert_classifier_compiled_by_its_user_fits_equal_to_keras(tmp_path):
    out = tmp_path / "fit.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "user_compiled_fit.py"),
         "--models=hub-bert-classifier", "--devices=2", "--epochs=2", "--tail=5",
         f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert r["ok"] and r["weights_split"] > 0, r
    # its dropout is on: the last 5 examples are trained, as Keras's fit trains them
    assert r["tail"] == 5 and r["tail_dropped"] is None, r
    assert set(r["history_tapas"]) == {"loss", "mae"}
    assert r["optimizer"].startswith("AdamW(learning_rate=CosineDecay, weight_decay=0.01")
