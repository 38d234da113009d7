"""Which models keep the examples of a batch apart: the row census of the corpus.

    python scripts/row_census.py [--models=name,...] [--json_out=out/row_census.json]

For every model of ``tapas.models.corpus`` (models written by other libraries; or the ones
``--models`` names), captured in training and in inference mode, prints what
``tapas.sharding.rows.row_independence`` says: "rows apart" when each example's outputs
depend on its own row only (then ``ParallelModel.fit``, ``evaluate`` and ``predict`` fill
up a last, smaller batch with copies of its rows), else the op that combines the rows
(batch norm's moments, a mean over the batch, an op without a sharding rule...), the reason
a last batch is dropped (``tapas.execution.api.fit_data.tail_refusal``). Prints a count per
kind of reason and writes every model's answers as JSON, rewritten after each model; models
already in the file are skipped, so a long run can be stopped and continued. A model that
fails to build or capture is listed with its error (exit 1).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
from typing import Any

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

flags.DEFINE_list("models", None, "Corpus entries (default: all of tapas.models.corpus).")
flags.DEFINE_string("json_out", "out/row_census.json", "Where to write the answers.")
FLAGS = flags.FLAGS

MODES = ("training", "inference")


def kind(why: str | None) -> str:
    """The kind of a row_independence answer, for the counts."""
    if why is None:
        return "rows apart"
    if "moments" in why or "FusedBatchNorm" in why or "_bn" in why:
        return "batch norm"
    if "no placement rule" in why or "cannot read its attributes" in why:
        return "an op without a rule"
    return "other ops combining rows"


def census(name: str) -> dict[str, Any]:
    """One corpus model's answers in training and inference mode."""
    import keras

    import tapas
    from tapas.models import corpus
    from tapas.sharding.rows import row_independence
    keras.backend.clear_session()
    model, specs = corpus.get(name).build()
    return {mode: row_independence(tapas.capture(model, specs, name=name,
                                                 training=mode == "training"))
            for mode in MODES}


def main(argv: list[str]) -> None:
    del argv
    from tapas.models import corpus
    names = FLAGS.models or [e.name for e in corpus.entries()]
    done: dict[str, Any] = {}
    if os.path.exists(FLAGS.json_out):
        with open(FLAGS.json_out) as f:
            done = json.load(f)
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    for name in names:
        if name not in done:
            try:
                done[name] = census(name)
            except Exception as e:  # listed in the table and the JSON, exit 1
                done[name] = {"error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-2000:]}
            with open(FLAGS.json_out, "w") as f:
                json.dump(done, f, indent=1)
        row = done[name]
        text = row["error"][:150] if "error" in row else " | ".join(
            f"{mode}: {(row[mode] or 'rows apart')[:70]}" for mode in MODES)
        print(f"{name:<24} {text}", flush=True)
    for mode in MODES:
        counts = collections.Counter(kind(done[n][mode]) for n in names if mode in done[n])
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in
                                     sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))))
    print(f"wrote {FLAGS.json_out}")
    sys.exit(1 if any("error" in done[n] for n in names) else 0)


if __name__ == "__main__":
    app.run(main)
