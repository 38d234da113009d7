"""Reproduce the paper's evaluation in one run: every figure and table that fits this machine.

    bash scripts/paper.sh                 # sets up .venv (and .venv-xla for the baseline)
    python scripts/paper.py [--only=table1,figure6,...] [--skip=table2] [--noxla] [--quick]
        [--out=out/paper] [--graph_cache=out/graphs]

Runs the scripts of ``docs/paper.md`` one after the other, each in its own process, at the
sizes that fit a 2-core CPU machine in about an hour in all (the full series of Figure 6
take hours: run ``scripts/figure6_search_time.py`` alone for them), and prints how long each
took. Every script writes its JSON and PNG under ``--out``; captured graphs are shared
through ``--graph_cache``. Which numbers are measured here and which are predicted by the
cost model is printed by each script and said in ``docs/paper.md``:

===========  ===========================================================  ========================
step         what                                                         measured / predicted
===========  ===========================================================  ========================
table1       V and E of the op, GraphNode and folded graphs; candidates   counted
figure10     unique subgraphs and mining time across minSize              measured
figure6      search time: TAPAS-GP, TAPAS-ES, XLA's auto-sharding pass    measured, same run
figure9      the strategies found (T5-large, ResNet50-100K, MoE-1.3B)     predicted (cost model)
figure8      weak scaling 8 -> 32 GPUs, GP against time-limited ES        predicted; searches timed
xla_figure7  XLA's automatic sharding of Figure 7's presets (with XLA)    compiled here
figure7      throughput on 8 V100s, XLA's placement costed too; tiny CPU  predicted; CPU measured
table2       the cost model's ranking against measured step times         measured
===========  ===========================================================  ========================

``--noxla`` (or no ``.venv-xla``: ``scripts/baselines/setup.sh`` makes it, ``paper.sh``
runs it) leaves the XLA baseline out of Figures 6 and 7. A step that fails is reported
with its exit status and the run goes on; the script exits 1 if any failed. The summary is
written to ``<out>/paper.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = ("table1", "figure10", "figure6", "figure9", "figure8", "xla_figure7", "figure7",
         "table2")
# Figure 7's presets (figure7_throughput.py's default --models), compiled by XLA for the
# XLA column
FIGURE7_MODELS = ("resnet50-1k,resnet50-10k,resnet50-100k,t5-small,t5-base,t5-large,"
                  "moe-380m,moe-1.3b")
# Figure 6 here: both ends of the ResNet width series, the two smaller T5 depths and the
# MoE presets (the rest of the series: docs/paper.md, measured run by run)
FIGURE6_MODELS = ("resnet50-1k,resnet50-100k,t5-large-depth6,t5-large-depth12,moe-tiny,"
                  "moe-380m,moe-1.3b")

flags.DEFINE_list("only", list(STEPS), f"Steps to run, of {', '.join(STEPS)}.")
flags.DEFINE_list("skip", [], "Steps to leave out.")
flags.DEFINE_boolean("quick", False, "Every step on the tiny presets (t5-tiny, resnet-tiny, "
                     "moe-tiny) with few timed steps: minutes, to check that everything "
                     "runs, not numbers to quote.")
flags.DEFINE_boolean("xla", True, "Time XLA's auto-sharding pass in Figure 6 (needs "
                     ".venv-xla from scripts/baselines/setup.sh; left out, with a note, "
                     "when it is missing).")
flags.DEFINE_string("out", "out/paper", "Directory for every JSON and PNG.")
flags.DEFINE_string("graph_cache", "out/graphs", "Captured graphs shared by the steps.")
FLAGS = flags.FLAGS


TINY = "t5-tiny,resnet-tiny,moe-tiny"
# --quick: each step's flags that replace its models and sizes (later flags win)
QUICK = {
    "table1": [f"--models={TINY}"],
    "figure10": [f"--models={TINY}", "--min_sizes=1,2,4"],
    "figure6": ["--quick"],
    "figure9": [f"--models={TINY}"],
    "figure8": ["--models=moe-tiny", "--nodes=1,2"],
    "xla_figure7": ["--models=t5-tiny"],
    "figure7": [f"--models={TINY}", "--steps=2", "--repeats=1"],
    "table2": ["--models=t5-tiny,moe-tiny", "--top_k=2", "--steps=2", "--repeats=1",
               "--batch_size=8", "--rounds=3"],
}


def commands(out: str, cache: str, xla: bool, quick: bool = False) -> dict[str, list[str]]:
    """Each step's command line (the scripts' own flags; ``quick``: on the tiny presets)."""
    def script(name: str) -> list[str]:
        return [sys.executable, os.path.join(ROOT, "scripts", name)]
    steps = {
        "table1": script("table1_complexity.py") + [
            f"--graph_cache={cache}", f"--json_out={out}/table1_complexity.json",
            f"--png_out={out}/table1_complexity.png"],
        "figure10": script("figure10_minsize.py") + [
            f"--graph_cache={cache}", f"--json_out={out}/figure10_minsize.json",
            f"--png_out={out}/figure10_minsize.png"],
        "figure6": script("figure6_search_time.py") + [
            f"--models={FIGURE6_MODELS}", "--es_limit=60", "--xla_timeout=480",
            f"--graph_cache={cache}", f"--json_out={out}/figure6_search_time.json",
            f"--png_out={out}/figure6_search_time.png"]
            + ([] if xla else ["--systems=gp,es"]),
        "figure9": script("figure9_strategies.py") + [
            f"--json_out={out}/figure9_strategies.json", f"--png_dir={out}/figure9"],
        "figure8": script("figure8_weak_scaling.py") + [
            "--nodes=1,2,4", f"--json_out={out}/figure8_weak_scaling.json",
            f"--png_out={out}/figure8_weak_scaling.png"],
        "xla_figure7": [os.path.join(ROOT, ".venv-xla", "bin", "python"),
                        os.path.join(ROOT, "scripts", "baselines", "xla_autoshard.py"),
                        f"--models={FIGURE7_MODELS}", "--devices=8", "--timeout=480",
                        f"--json_out={out}/xla_figure7.json", f"--log_dir={out}/xla_logs"],
        "figure7": script("figure7_throughput.py") + [
            f"--json_out={out}/figure7_throughput.json",
            f"--png_out={out}/figure7_throughput.png"],
        "table2": script("table2_cost_model.py") + [f"--out={out}/table2"],
    }
    return {k: v + QUICK[k] for k, v in steps.items()} if quick else steps


def main(argv: list[str]) -> None:
    del argv
    unknown = sorted(set(FLAGS.only + FLAGS.skip) - set(STEPS))
    if unknown:
        raise app.UsageError(f"--only/--skip name {unknown}: the steps are {', '.join(STEPS)}")
    xla = FLAGS.xla and os.path.exists(os.path.join(ROOT, ".venv-xla", "bin", "python"))
    if FLAGS.xla and not xla:
        print("note: .venv-xla is missing (bash scripts/baselines/setup.sh makes it): Figure 6 "
              "runs without the XLA baseline", flush=True)
    os.makedirs(FLAGS.out, exist_ok=True)
    chosen = [s for s in STEPS if s in FLAGS.only and s not in FLAGS.skip
              and (xla or s != "xla_figure7")]
    cmds = commands(FLAGS.out, FLAGS.graph_cache, xla, FLAGS.quick)
    rows = []
    start = time.perf_counter()
    for i, step in enumerate(chosen, 1):
        xla_json = os.path.join(FLAGS.out, "xla_figure7.json")
        if step == "figure7" and os.path.exists(xla_json):   # the XLA column
            cmds[step] = cmds[step] + [f"--xla_json={xla_json}"]
        print(f"\n=== [{i}/{len(chosen)}] {step}: {' '.join(cmds[step][1:])}", flush=True)
        t = time.perf_counter()
        rc = subprocess.run(cmds[step], cwd=ROOT).returncode
        seconds = time.perf_counter() - t
        rows.append({"step": step, "seconds": round(seconds, 1), "returncode": rc,
                     "command": " ".join(cmds[step][1:])})
        print(f"=== {step}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds / 60:.1f} "
              "min", flush=True)
    total = time.perf_counter() - start
    print(f"\n{'step':<10} {'minutes':>8}  result")
    for r in rows:
        print(f"{r['step']:<10} {r['seconds'] / 60:>8.1f}  "
              + ("ok" if r["returncode"] == 0 else f"FAILED (exit {r['returncode']})"))
    print(f"{'total':<10} {total / 60:>8.1f}")
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "xla": xla, "quick": FLAGS.quick, "cpus": os.cpu_count(), "steps": rows,
               "total_seconds": round(total, 1)}
    path = os.path.join(FLAGS.out, "paper.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nwritten to {path}; docs/paper.md says what each number is")
    if any(r["returncode"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
