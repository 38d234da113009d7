"""``tapas mine``: capture ``--model`` and mine its frequent subgraphs (templates).

In:  ``--model``, ``--batch_size``, ``--training``, ``--min_size``, ``--min_support``,
     ``--draw``, ``--folded_out``, ``--json_out``.
Out: the FoldedGraph's summary (printed; the report returned as a dict); ``--folded_out``
     the FoldedGraph as JSON, ``--draw`` the folded graph drawn.
Raises: ``absl.app.UsageError`` for an unknown model or impossible mining bounds.
"""

from __future__ import annotations

import json
from typing import Any

from absl import app, flags

from tapas.cli.common import FLAGS, capture_flags_model, write

flags.DEFINE_integer("min_size", None, "mine: fewest GraphNodes a template may hold "
                     "(default: tapas.mining.DEFAULT_MIN_SIZE).")
flags.DEFINE_integer("min_support", None, "mine: fewest non-overlapping occurrences of a "
                     "frequent subgraph (default: the number of layers detected).")
flags.DEFINE_string("folded_out", None, "mine: write the FoldedGraph as JSON to this path.")

SUMMARY = 'mine the frequent subgraphs (templates) of a model and fold its graph'
USAGE = 'tapas mine --model=NAME [--min_size=N] [--min_support=K] [--draw=folded.png]'
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('model', 'batch_size', 'training', 'min_size', 'min_support', 'draw',
              'folded_out', 'json_out')


def cmd_mine() -> dict[str, Any]:
    from absl import logging

    from tapas import mining
    graph, trace, ir_s, _ = capture_flags_model()
    capture_s = trace.seconds + ir_s
    print(f"captured '{graph.name}': {len(graph.nodes):,} GraphNodes from "
          f"{len(trace.graph.get_operations()):,} TF ops in {capture_s:.3f} s")

    from tapas.progress import ProgressBar
    bar = ProgressBar("mining")

    def progress(level: Any) -> None:
        logging.vlog(1, "mining round %d, level %d: %d candidates, %d frequent (%.3f s)",
                     level.round, level.level, level.candidates, level.frequent, level.seconds)
        bar.update(0, None, f"round {level.round}, level {level.level}: "
                                      f"{level.candidates:,} candidates, "
                                      f"{level.frequent:,} frequent")

    try:
        with bar.ticking():
            folded = mining.mine(graph, min_support=FLAGS.min_support,
                                 min_size=FLAGS.min_size or mining.DEFAULT_MIN_SIZE,
                                 progress=progress)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(folded.summary())
    report = {"model": graph.name, "capture_seconds": round(capture_s, 4),
              "folded": folded.to_json()}
    if FLAGS.folded_out:
        write(FLAGS.folded_out, json.dumps(folded.to_json(), indent=1))
        print(f"\nFoldedGraph written to {FLAGS.folded_out}")
    if FLAGS.draw:
        mining.draw_folded(folded, graph, FLAGS.draw)
        print(f"folded graph drawn to {FLAGS.draw}")
    return report
