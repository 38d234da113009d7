"""Reproduce the paper's Figure 6: strategy search time against model size, TAPAS vs the ILP.

    python scripts/figure6_search_time.py [--models=resnet50-1k,...,t5-large-depth48,moe-1.3b]
        [--quick] [--systems=gp,es,xla] [--devices=8] [--es_limit=120]
        [--xla_python=.venv-xla/bin/python] [--xla_timeout=900] [--xla_solver_timeout=60]
        [--graph_cache=out/graphs] [--json_out=out/figure6_search_time.json]
        [--png_out=out/figure6_search_time.png] [--from_json=a.json,b.json]

Series (the default ``--models``): ResNet-50 width (1K, 10K, 100K, 250K, 400K classes:
``resnet50-{1k,10k,100k,250k,400k}``), T5-Large depth (6, 12, 24, 48 layers per stack:
``t5-large-depth{6,12,24,48}``) and the MoE presets (``moe-380m``, ``moe-1.3b``).
``--quick`` is a slice that runs in a few minutes: ``t5-tiny,resnet-tiny,moe-tiny``.

Systems, all on one node of ``--devices`` devices, in this process's run, one model at a time:

* **TAPAS-GP** and **TAPAS-ES**: ``tapas.search`` (mining + patterns + enumeration +
  stitching + validation, reference plans off) on the captured graph; capture is framework
  initialisation and is not counted (``--graph_cache`` keeps it). ES stops after
  ``--es_limit`` seconds and is then reported as a lower bound (">= limit").
* **XLA**: XLA's automatic sharding pass (the maintained successor of Alpa's intra-op ILP),
  compile-only for a TPU v5e topology with a 1-D mesh of ``--devices`` chips, via
  ``scripts/baselines/xla_autoshard.py`` in the optional ``.venv-xla`` (made by
  ``scripts/baselines/setup.sh``). The time is the pass alone (libtpu log), forward +
  backward. Without the venv the XLA column says so; a preset that fails to build or
  compile under JAX is listed with its error, never dropped.

Prints the table with the ratio XLA pass / TAPAS-GP next to the paper's (TAPAS vs Alpa:
103-162x on ResNet width, 21-67x on T5 depth), writes every number as JSON and a PNG
(matplotlib, Agg canvas): one panel per series, search time on a log axis, each XLA point
labelled with its ratio to TAPAS-GP.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))   # report.timed_search

from absl import app, flags  # noqa: E402

WIDTH = ["resnet50-1k", "resnet50-10k", "resnet50-100k", "resnet50-250k", "resnet50-400k"]
DEPTH = ["t5-large-depth6", "t5-large-depth12", "t5-large-depth24", "t5-large-depth48"]
MOE = ["moe-380m", "moe-1.3b"]
QUICK = ["t5-tiny", "resnet-tiny", "moe-tiny"]
SYSTEMS = ("gp", "es", "xla")
# The paper's Figure 6 claims (TAPAS vs Alpa on 8 V100s), per series.
PAPER_RATIOS = {"width": (103, 162), "depth": (21, 67)}
SERIES_TITLES = {"width": "ResNet-50 width (classes)", "depth": "T5-Large depth (layers per stack)",
                 "moe": "MoE presets", "other": "other presets"}

flags.DEFINE_list("models", WIDTH + DEPTH + MOE, "Zoo presets, in the order run.")
flags.DEFINE_boolean("quick", False, f"Run the small slice {','.join(QUICK)} instead of --models.")
flags.DEFINE_list("systems", list(SYSTEMS), "Which of gp, es, xla to run.")
flags.DEFINE_integer("devices", 8, "Devices (one node).")
flags.DEFINE_float("es_limit", 120.0, "Seconds before TAPAS-ES is stopped (then a lower bound).")
flags.DEFINE_string("xla_python", os.path.join(ROOT, ".venv-xla", "bin", "python"),
                    "Python of the baseline venv (scripts/baselines/setup.sh).")
flags.DEFINE_float("xla_timeout", 900.0, "Wall seconds per XLA compile (outer timeout).")
flags.DEFINE_integer("xla_solver_timeout", 60, "xla_tpu_auto_spmd_partitioning_solver_timeout_"
                     "seconds (CP-SAT deterministic time).")
flags.DEFINE_list("from_json", [], "Measure nothing: read the rows of these earlier JSON "
                  "outputs (each row keeps the ratio measured in its own run), print the table "
                  "and write the PNG (and --json_out with the rows merged).")
flags.DEFINE_string("graph_cache", None, "Directory for captured IR graphs (JSON).")
flags.DEFINE_string("json_out", "out/figure6_search_time.json", "Where to write the JSON.")
flags.DEFINE_string("png_out", "out/figure6_search_time.png", "Where to write the plot.")
FLAGS = flags.FLAGS


def series_of(name: str) -> tuple[str, float | None]:
    """(series, x value) of a preset: width -> classes, depth -> layers per stack."""
    if (m := re.fullmatch(r"resnet50-(\d+)k", name)):
        from models import registry
        return "width", float(registry.get(name).config.num_classes)
    if (m := re.fullmatch(r"t5-large-depth(\d+)", name)):
        return "depth", float(m.group(1))
    if name.startswith("moe-"):
        return "moe", None
    return "other", None


def tapas_search(graph, mode: str, limit: float | None) -> dict:
    """A timed search (``benchmarks/report.py``, as ``benchmarks/bench_search.py`` times it);
    a search stopped at ``limit`` is a lower bound on the time."""
    import report   # benchmarks/report.py
    row = report.timed_search(graph, mode, limit, FLAGS.devices)
    return dict(row, lower_bound=not row["finished"])


def xla_autoshard(name: str) -> dict:
    """One compile in the baseline venv; a dict with ``ok`` and either ``pass_s`` or ``error``."""
    if not os.path.exists(FLAGS.xla_python):
        return {"ok": False, "error": f"no baseline venv: {FLAGS.xla_python} does not exist; "
                "run `bash scripts/baselines/setup.sh` (or pass --xla_python, or drop xla "
                "from --systems)"}
    script = os.path.join(ROOT, "scripts", "baselines", "xla_autoshard.py")
    with tempfile.TemporaryDirectory(prefix="fig6_xla_") as tmp:
        out = os.path.join(tmp, "xla.json")
        cmd = [FLAGS.xla_python, script, f"--models={name}", f"--devices={FLAGS.devices}",
               f"--solver_timeout={FLAGS.xla_solver_timeout}", f"--timeout={FLAGS.xla_timeout}",
               f"--json_out={out}", f"--log_dir={os.path.join(os.path.dirname(FLAGS.json_out) or '.', 'xla_logs')}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if not os.path.exists(out):
            return {"ok": False, "error": f"xla_autoshard.py exited {proc.returncode} without "
                    f"JSON: {proc.stderr.strip()[-800:]}"}
        with open(out) as f:
            row = json.load(f)["results"][0]
    keep = ("ok", "error", "pass_s", "status", "ilp_variables", "ilp_nodes", "solver_ms",
            "memory_budget", "memory_budget_bytes", "memory_lower_bound_bytes", "options",
            "compile_s", "lower_s", "build_s", "wall_s", "split_variables",
            "trainable_variables", "collectives", "solver_timeout", "topology", "log")
    return {k: row[k] for k in keep if k in row}


def measure(name: str) -> dict:
    from tapas import models
    series, x = series_of(name)
    row = {"model": name, "series": series, "x": x}
    if "gp" in FLAGS.systems or "es" in FLAGS.systems:
        graph, capture_s = models.capture_preset(name, FLAGS.graph_cache)
        row.update(graph_nodes=len(graph.nodes), ir_ops=graph.num_ops,
                   capture_s=round(capture_s, 2))
        if "gp" in FLAGS.systems:
            row["gp"] = tapas_search(graph, "gp", None)
        if "es" in FLAGS.systems:
            row["es"] = tapas_search(graph, "es", FLAGS.es_limit)
        del graph
        gc.collect()
    if "xla" in FLAGS.systems:
        row["xla"] = xla_autoshard(name)
        if row["xla"]["ok"] and "gp" in row:
            row["ratio_xla_over_gp"] = round(row["xla"]["pass_s"] / row["gp"]["seconds"], 2)
    parts = [f"{s} {_t(row[s])}" for s in ("gp", "es") if s in row]
    if "xla" in row:
        parts.append("xla " + (f"{row['xla']['pass_s']:.2f} s ({row['xla']['status']})"
                               if row["xla"]["ok"] else "FAILED"))
    print(f"  {name}: " + ", ".join(parts), flush=True)
    return row


def _t(r: dict) -> str:
    return (">=" if r["lower_bound"] else "") + f"{r['seconds']:.2f} s"


def print_table(rows: list[dict]) -> None:
    print(f"\nsearch time on {FLAGS.devices} devices (TAPAS: after capture; XLA: the "
          "auto-sharding pass)")
    print(f"{'model':<18}{'series':>7}{'nodes':>7}{'GP s':>9}{'ES s':>11}{'XLA s':>9}"
          f"{'XLA status':>18}{'ILP vars':>9}{'XLA/GP':>8}{'paper':>10}")
    for r in rows:
        gp = f"{r['gp']['seconds']:.2f}" if "gp" in r else "-"
        es = _t(r["es"]).replace(" s", "") if "es" in r else "-"
        x = r.get("xla")
        xs = f"{x['pass_s']:.2f}" if x and x["ok"] else ("FAILED" if x else "-")
        st = (x.get("status") or "-")[len("MPSOLVER_"):] if x and x["ok"] else "-"
        vars_ = str(x["ilp_variables"][-1]) if x and x.get("ilp_variables") else "-"
        ratio = f"{r['ratio_xla_over_gp']:.0f}x" if "ratio_xla_over_gp" in r else "-"
        paper = ("{}-{}x".format(*PAPER_RATIOS[r["series"]])
                 if r["series"] in PAPER_RATIOS else "-")
        print(f"{r['model']:<18}{r['series']:>7}{r.get('graph_nodes', '-'):>7}{gp:>9}{es:>11}"
              f"{xs:>9}{st:>18}{vars_:>9}{ratio:>8}{paper:>10}")
    for r in rows:
        if r.get("xla") and not r["xla"]["ok"]:
            print(f"  {r['model']}: XLA auto-sharding failed: {r['xla']['error']}")
        if r.get("es", {}).get("lower_bound"):
            print(f"  {r['model']}: TAPAS-ES hit --es_limit={FLAGS.es_limit:.0f} s "
                  "(its time is a lower bound)")
    for series, (lo, hi) in PAPER_RATIOS.items():
        ratios = [r["ratio_xla_over_gp"] for r in rows
                  if r["series"] == series and "ratio_xla_over_gp" in r]
        if ratios:
            print(f"{SERIES_TITLES[series]}: XLA pass / TAPAS-GP = {min(ratios):.0f}-"
                  f"{max(ratios):.0f}x here; paper (Alpa / TAPAS) {lo}-{hi}x")
    gp_wins = [r["ratio_xla_over_gp"] > 1 for r in rows if "ratio_xla_over_gp" in r]
    if gp_wins:
        print(f"TAPAS-GP faster than XLA auto-sharding on {sum(gp_wins)} of {len(gp_wins)} "
              "presets measured by both")


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [s for s in ("width", "depth", "moe", "other") if any(r["series"] == s for r in rows)]
    fig = Figure(figsize=(5 * len(present), 4.2), dpi=120)
    FigureCanvasAgg(fig)
    styles = {"gp": ("TAPAS-GP", "o", "tab:blue"), "es": ("TAPAS-ES", "s", "tab:green"),
              "xla": ("XLA auto-sharding (ILP)", "^", "tab:red")}
    for i, series in enumerate(present, 1):
        ax = fig.add_subplot(1, len(present), i)
        sub = [r for r in rows if r["series"] == series]
        numeric = all(r["x"] is not None for r in sub)
        if numeric:
            sub.sort(key=lambda r: r["x"])
        xs = [r["x"] if numeric else j for j, r in enumerate(sub)]
        for system, (label, marker, color) in styles.items():
            pts = [(x, _seconds(r, system), r) for x, r in zip(xs, sub) if _seconds(r, system)]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                    label=label)
            for x, y, r in pts:
                if system == "es" and r["es"]["lower_bound"]:
                    ax.annotate("time limit", (x, y), textcoords="offset points",
                                xytext=(0, 6), ha="center", fontsize=7, color=color)
        for x, r in zip(xs, sub):
            if "ratio_xla_over_gp" in r:
                ax.annotate(f"{r['ratio_xla_over_gp']:.0f}x", (x, r["xla"]["pass_s"]),
                            textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=7, color="tab:red")
            if r.get("xla") and not r["xla"]["ok"]:
                ax.annotate("XLA failed", (x, 1), xycoords=("data", "axes fraction"),
                            textcoords="offset points", xytext=(0, -12), ha="center",
                            fontsize=7, color="tab:red")
        if numeric:
            ax.set_xscale("log")
            ax.set_xticks(xs)
            # classes are multiples of 1024 (1K = 1024, ..., 400K = 409600), as the presets say
            ax.set_xticklabels([f"{round(x / 1024)}K" if series == "width" else str(int(x))
                                for x in xs], fontsize=8)
            ax.minorticks_off()
        else:
            ax.set_xticks(xs)
            ax.set_xticklabels([r["model"] for r in sub], fontsize=8, rotation=20)
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 2)          # room for the ratio labels above the XLA points
        ax.set_xlabel(SERIES_TITLES[series])
        ax.set_ylabel("search time (s)")
        if series in PAPER_RATIOS:
            lo, hi = PAPER_RATIOS[series]
            ax.set_title(f"{SERIES_TITLES[series].split(' (')[0]} (paper: {lo}-{hi}x)", fontsize=10)
        else:
            ax.set_title(SERIES_TITLES[series], fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"TAPAS Figure 6 (reproduced): search time, {FLAGS.devices} devices")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def _seconds(r: dict, system: str) -> float | None:
    if system == "xla":
        return r["xla"]["pass_s"] if r.get("xla") and r["xla"]["ok"] else None
    return r[system]["seconds"] if system in r else None


def replot(paths: list[str]) -> None:
    runs, rows = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("figure") != "TAPAS Figure 6":
            raise app.UsageError(f"--from_json={path}: not a Figure 6 output (its 'figure' is "
                                 f"{data.get('figure')!r}); pass files written by this script")
        runs.append({k: data.get(k) for k in ("date_utc", "machine", "total_s", "systems")}
                    | {"path": path})
        rows += [dict(r, run=path) for r in data["results"]]
    print_table(rows)
    out = {"figure": "TAPAS Figure 6", "devices": FLAGS.devices, "merged_runs": runs,
           "paper_ratios": PAPER_RATIOS, "results": rows}
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(out, f, indent=2)
    plot(rows, FLAGS.png_out)
    print(f"\nwrote {FLAGS.json_out} and {FLAGS.png_out}")


def main(argv):
    del argv
    bad = [s for s in FLAGS.systems if s not in SYSTEMS]
    if bad:
        raise app.UsageError(f"--systems={','.join(FLAGS.systems)}: unknown {bad}; "
                             f"choose from {','.join(SYSTEMS)}")
    if FLAGS.from_json:
        return replot(FLAGS.from_json)
    names = QUICK if FLAGS.quick else list(FLAGS.models)
    from models import registry
    for n in names:
        registry.get(n)          # ValueError naming the close matches, before any work
    # Imported before any timing, so the first preset's search time holds no module loading.
    import importlib
    for module in ("tapas.planning.search", "tapas.planning.explore", "tapas.planning.cluster"):
        importlib.import_module(module)
    import platform
    load = os.getloadavg()
    print(f"Figure 6: {len(names)} presets, systems {','.join(FLAGS.systems)}, "
          f"{FLAGS.devices} devices, load {load[0]:.1f}")
    t0 = time.perf_counter()
    rows = [measure(n) for n in names]
    print_table(rows)
    out = {"figure": "TAPAS Figure 6", "devices": FLAGS.devices, "systems": list(FLAGS.systems),
           "es_limit_s": FLAGS.es_limit, "xla_solver_timeout": FLAGS.xla_solver_timeout,
           "xla_timeout_s": FLAGS.xla_timeout, "paper_ratios": PAPER_RATIOS,
           "machine": {"python": platform.python_version(), "platform": platform.platform(),
                       "cpus": os.cpu_count(), "load_at_start": [round(v, 2) for v in load],
                       "load_at_end": [round(v, 2) for v in os.getloadavg()]},
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "total_s": round(time.perf_counter() - t0, 1), "results": rows}
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
        json.dump(out, f, indent=2)
    plot(rows, FLAGS.png_out)
    print(f"\nwrote {FLAGS.json_out} and {FLAGS.png_out}")


if __name__ == "__main__":
    app.run(main)
