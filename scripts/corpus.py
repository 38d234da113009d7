"""The corpus over models built by other libraries: capture, mine and search each.

    python scripts/corpus.py [--devices=2,4,8] [--models=name,...] [--json_out=out/corpus.json]
        [--library=keras.applications|keras-hub|transformers|tf-models-official|kimm]

Every ``keras.applications`` family (smallest variant, small images) and the keras-hub
transformer backbones (``tapas.models.corpus``), each through ``tapas.capture``,
``tapas.mine`` and ``tapas.search`` on one V100 node of each device count. Prints a table
(GraphNodes, templates, coverage, seconds per phase, sharded GraphNodes, notes such as
GraphNodes the search had to replicate) and writes JSON. A model that raises is reported
with its exception and makes the script exit 1. ``tests/test_corpus.py`` runs the same
over every entry but the slow ones.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

flags.DEFINE_list("devices", ["2", "4", "8"], "Device counts (one V100 node each).")
flags.DEFINE_string("library", None, "Only this library: keras.applications, keras-hub, "
                    "transformers, tf-models-official or kimm.")
flags.DEFINE_list("models", None, "Only these corpus entries (default: all).")
flags.DEFINE_string("json_out", "out/corpus.json", "Where to write the results.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    import keras

    from tapas.models import corpus

    chosen = [e for e in corpus.entries(FLAGS.library)
              if FLAGS.models is None or e.name in FLAGS.models]
    devices = tuple(int(d) for d in FLAGS.devices)
    rows, failures = [], 0
    print(f"{'model':28s} {'nodes':>5s} {'tmpl':>4s} {'cover':>6s} {'capture':>8s} {'mine':>6s} "
          + " ".join(f"{'search@' + str(n):>9s} {'shard':>5s}" for n in devices))
    for entry in chosen:
        try:
            row = corpus.run(entry, devices)
        except Exception as e:  # reported, counted, and the run goes on
            failures += 1
            rows.append({"model": entry.name, "library": entry.library,
                         "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            print(f"{entry.name:28s} FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)
            continue
        finally:
            keras.backend.clear_session()
            gc.collect()
        rows.append(row)
        searches = row["searches"]
        print(f"{entry.name:28s} {row['graph_nodes']:5d} {row['templates']:4d} {row['coverage']:6.0%} "
              f"{row['capture_s']:7.1f}s {row['mine_s']:5.1f}s "
              + " ".join(f"{searches[n]['search_s']:8.2f}s {searches[n]['sharded']:5d}" for n in devices),
              flush=True)
        for note in {note for n in devices for note in searches[n]["notes"]}:
            print(f"{'':28s} note: {note}")
    print(f"\n{len(rows) - failures} of {len(rows)} models planned on {list(devices)} devices")
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump({"devices": list(devices), "models": rows}, f, indent=2, default=str)
    print(f"wrote {FLAGS.json_out}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
