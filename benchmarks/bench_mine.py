"""Benchmark: subgraph-mining time (tapas.mine) on the paper's models.

    python benchmarks/bench_mine.py [--models=t5-large,resnet152-100k,moe-1.3b]
        [--depths=6,12,24,48] [--masked_depths=6,12,24,48] [--repeats=3] [--min_size=3]
        [--graph_cache=out/graphs] [--json_out=out/bench_mine.json]

Each model is captured once (capture time is reported but is not mining time), then
``tapas.mine`` is timed ``--repeats`` times on the captured graph; the median is reported.
Targets (paper section 5.5, scaled to a 2-core machine): T5-large under 3 s (paper: under
12 s), the 152-layer 100K-class ResNet under 1 s, MoE-1.3B under 5 s (paper: 30 s). The
depth scans mine T5-large with 6/12/24/48 layers per stack, without and with padding-mask
inputs (presets ``t5-large-depth{N}``, ``t5-large-masked-depth{N}``): mining a deep stack
through a window of its layers (docs/mining.md), the time should not grow with depth, so
the tables print each depth's CPU time and node count against the first depth's.

``--graph_cache`` keeps the captured IR (JSON) so later runs skip TensorFlow entirely.
Prints tables and writes every number as JSON.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from absl import app, flags  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py, beside this script)

flags.DEFINE_list("models", ["t5-large", "resnet152-100k", "moe-1.3b"], "Zoo presets to mine.")
flags.DEFINE_list("depths", ["6", "12", "24", "48"],
                  "T5-large layers per stack for the depth scan (presets t5-large-depthN); "
                  "empty to skip.")
flags.DEFINE_list("masked_depths", ["6", "12", "24", "48"],
                  "Layers per stack of the masked T5-large depth scan (presets "
                  "t5-large-masked-depthN); empty to skip.")
flags.DEFINE_integer("repeats", 3, "mine() runs per model (the median is reported).")
flags.DEFINE_integer("min_size", None, "min_size for mine() (default: tapas.mine's default).")
flags.DEFINE_string("graph_cache", None, "Directory for captured IR graphs (JSON): reused "
                    "when present, written otherwise.")
flags.DEFINE_string("json_out", "out/bench_mine.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS

# seconds on this 2-core machine (the paper's numbers in the comments)
TARGETS = {"t5-large": 3.0,          # paper: < 12 s
           "resnet152-100k": 1.0,    # paper: < 1 s
           "moe-1.3b": 5.0}          # paper: 30 s


def bench(name: str) -> dict:
    from tapas.mining import DEFAULT_MIN_SIZE, mine
    from tapas import models
    graph, capture_s = models.capture_preset(name, FLAGS.graph_cache)
    min_size = FLAGS.min_size or DEFAULT_MIN_SIZE
    times, cpu = [], []
    folded = None
    for _ in range(FLAGS.repeats):
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        folded = mine(graph, min_size=min_size)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert folded is not None
    row = {"model": name, "graph_nodes": len(graph.nodes), "ir_ops": graph.num_ops,
           "capture_s": round(capture_s, 2), "min_size": min_size,
           "layers_detected": folded.stats.layers_detected,
           "min_support": folded.min_support, "rounds": len(folded.stats.rounds),
           "templates": folded.num_templates,
           "template_shapes": [[t.size, t.num_instances] for t in folded.templates],
           "coverage": round(folded.coverage, 4), "uncovered": len(folded.uncovered),
           "candidates": folded.stats.candidates, "frequent": folded.stats.frequent,
           "mine_s_median": round(statistics.median(times), 4),
           "mine_s_min": round(min(times), 4), "mine_s_all": [round(t, 4) for t in times],
           "mine_cpu_s_min": round(min(cpu), 4)}
    if name in TARGETS:
        row["target_s"] = TARGETS[name]
        row["within_target"] = row["mine_s_median"] < TARGETS[name]
    print(f"  {name}: {row['graph_nodes']} nodes, mined in {row['mine_s_median']:.3f} s",
          flush=True)
    del graph
    gc.collect()
    return row


def main(argv):
    del argv
    print("capturing and mining (capture is not part of mining time) ...", flush=True)
    rows = [bench(name) for name in FLAGS.models]
    depth_rows = []
    for d in FLAGS.depths:
        row = bench(f"t5-large-depth{int(d)}")
        row["depth"] = int(d)
        depth_rows.append(row)
    masked_rows = []
    for d in FLAGS.masked_depths:
        row = bench(f"t5-large-masked-depth{int(d)}")
        row["depth"] = int(d)
        masked_rows.append(row)

    print()
    print(f"{'model':<18}{'nodes':>6}{'IR ops':>8}{'capt s':>8}{'layers':>7}{'templ':>6}"
          f"{'cover':>7}{'cand':>7}{'freq':>6}{'mine s':>8}{'target':>8}  ok")
    for r in rows + depth_rows + masked_rows:
        target = f"{r['target_s']:.1f}" if "target_s" in r else "-"
        ok = ("yes" if r["within_target"] else "NO") if "target_s" in r else ""
        print(f"{r['model']:<18}{r['graph_nodes']:>6}{r['ir_ops']:>8}{r['capture_s']:>8.1f}"
              f"{r['layers_detected']:>7}{r['templates']:>6}{100 * r['coverage']:>6.1f}%"
              f"{r['candidates']:>7}{r['frequent']:>6}{r['mine_s_median']:>8.3f}{target:>8}  {ok}")
    for r in rows + depth_rows + masked_rows:
        print(f"  {r['model']}: templates (size x instances) "
              + ", ".join(f"{s}x{n}" for s, n in r["template_shapes"]))

    scaling = _scan("T5-large widths", depth_rows)
    masked_scaling = _scan("T5-large widths, padding masks", masked_rows)

    out = {"benchmark": "tapas.mine", "machine": report.machine(),
           "repeats": FLAGS.repeats, "models": rows, "depth_scan": depth_rows,
           "scaling": scaling, "masked_depth_scan": masked_rows,
           "masked_scaling": masked_scaling}
    if FLAGS.json_out:
        report.write_json(FLAGS.json_out, out)


def _scan(title: str, depth_rows: list[dict]) -> list[dict]:
    """Print a depth scan (each step's CPU time against the first depth's) and return it."""
    if not depth_rows:
        return []
    print()
    print(f"depth scan ({title}): mining time should not grow with depth (window over the "
          "stack, docs/mining.md)")
    print("(ratios use the fastest CPU time of the repeats: the least noisy number)")
    print(f"{'layers/stack':>12}{'nodes':>7}{'mine s':>8}{'cpu s':>7}{'ms/1k nodes':>12}"
          f"{'x nodes':>9}{'x cpu':>7}")
    first = depth_rows[0]
    scaling = []
    for r in depth_rows:
        per_k = 1000 * r["mine_cpu_s_min"] / r["graph_nodes"] * 1000
        step = {"depth": r["depth"], "graph_nodes": r["graph_nodes"],
                "mine_s": r["mine_s_median"], "mine_cpu_s": r["mine_cpu_s_min"],
                "cpu_ms_per_1000_nodes": round(per_k, 1),
                "node_ratio": round(r["graph_nodes"] / first["graph_nodes"], 2),
                "cpu_ratio": round(r["mine_cpu_s_min"] / first["mine_cpu_s_min"], 2)}
        scaling.append(step)
        print(f"{r['depth']:>12}{r['graph_nodes']:>7}{r['mine_s_median']:>8.3f}"
              f"{r['mine_cpu_s_min']:>7.3f}{per_k:>12.1f}{step['node_ratio']:>9.2f}"
              f"{step['cpu_ratio']:>7.2f}")
    return scaling


if __name__ == "__main__":
    app.run(main)
