"""Benchmark: capture time (trace vs. IR conversion) on large zoo presets.

    python benchmarks/bench_capture.py [--models=t5-large,resnet152-1k,moe-1.3b]
                                       [--repeats=3] [--json_out=out/bench_capture.json]

Prints a table and writes JSON. The target (issue 2): IR conversion after tracing under
1 s for a T5-large-size graph (about 6,000 ops) on a 2-core machine. Models are built with
fast_init (zero weights): capture needs the structure, not the values. Building and
tracing are reported but are TensorFlow's time, not tapas's.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py, beside this script)

flags.DEFINE_list("models", ["t5-large", "resnet152-1k", "moe-1.3b"], "Zoo presets to capture.")
flags.DEFINE_integer("repeats", 3, "IR conversions per model (the median is reported).")
flags.DEFINE_string("json_out", "out/bench_capture.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS

TARGET_IR_SECONDS = 1.0


def main(argv):
    del argv
    from tapas import capturing, models
    rows = []
    for name in FLAGS.models:
        entry = models.get(name)
        t0 = time.perf_counter()
        model = entry.build(fast_init=True)
        build_s = time.perf_counter() - t0
        trace = capturing.trace(model, list(entry.input_spec()), name=name)
        tf_ops = len(trace.graph.get_operations())
        ir_times = []
        for _ in range(FLAGS.repeats):
            t0 = time.perf_counter()
            graph = capturing.to_ir(trace)
            ir_times.append(time.perf_counter() - t0)
        rows.append({"model": name, "params": graph.num_params, "tf_ops": tf_ops,
                     "graph_nodes": len(graph.nodes), "build_s": round(build_s, 3),
                     "trace_s": round(trace.seconds, 3),
                     "ir_s_median": round(statistics.median(ir_times), 3),
                     "ir_s_all": [round(t, 3) for t in ir_times],
                     "ir_ms_per_1000_ops": round(1000 * statistics.median(ir_times) / tf_ops * 1000, 2)})
        del model, trace, graph
        gc.collect()
    print(f"{'model':<16} {'params':>14} {'TF ops':>8} {'nodes':>6} {'build s':>8} "
          f"{'trace s':>8} {'IR s':>7} {'IR ms/1k ops':>13}")
    for r in rows:
        print(f"{r['model']:<16} {r['params']:>14,} {r['tf_ops']:>8,} {r['graph_nodes']:>6} "
              f"{r['build_s']:>8.2f} {r['trace_s']:>8.2f} {r['ir_s_median']:>7.3f} "
              f"{r['ir_ms_per_1000_ops']:>13.1f}")
    t5 = [r for r in rows if r["model"].startswith("t5")]
    for r in t5:
        verdict = "meets" if r["ir_s_median"] < TARGET_IR_SECONDS else "MISSES"
        print(f"{r['model']}: IR conversion {r['ir_s_median']:.3f} s for {r['tf_ops']:,} ops "
              f"{verdict} the < {TARGET_IR_SECONDS:.0f} s target")
    result = {"benchmark": "capture", "target_ir_seconds": TARGET_IR_SECONDS,
              "machine": report.machine(),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
              "rows": rows}
    report.write_json(FLAGS.json_out, result)


if __name__ == "__main__":
    app.run(main)
