"""Score a Table 2 run from its printed log, when the run ended before writing table2.json.

    python scripts/table2_from_log.py LOG [--json=other/table2.json ...] --out=table2_log.json

``scripts/table2_cost_model.py`` prints one line per timed plan, ``[model i/n] plan:
measured X ms (+-S; alone A), predicted P ms (+CF+GO+EC), ... ms (+MC)``: the paired time
and its standard error that the table ranks by, and the prediction of the rows it prints
(+CF+GO+EC, +CF+GO+EC+WR+L, +MB, +MB+W and, with ``--calibrate``, +MC; the other rows are
not printed, so they are not scored here). This reads those lines back (predictions to the
printed 0.01 ms), adds the runs of finished ``table2.json`` files (``--json``: e.g. the
models measured again after the crash), and scores each row with the table's own functions
(``tapas.planning.ranking``, ties within ``--tie_tol`` or either standard error). The
compute factors come from the log's ``[model] replicated step ...: compute scale K`` lines.
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_multi_string("json", [], "Finished table2.json files whose runs are added.")
flags.DEFINE_float("tie_tol", 0.05, "Relative tolerance under which measured times tie.")
flags.DEFINE_string("out", None, "Write the scores and the parsed runs here (JSON).")
FLAGS = flags.FLAGS

#: the printed label of each row, in the order of the line
PRINTED = {"+CF+GO+EC": "+CF+GO+EC", "+WR+L": "+CF+GO+EC+WR+L", "+MB": "+CF+GO+EC+WR+L+MB",
           "+MB+W": "+CF+GO+EC+WR+L+MB+W", "+MC": "+CF+GO+EC+WR+L+MB+W+MC"}
_PLAN = re.compile(r"^\[(?P<model>[\w.-]+) \d+/\d+\] (?P<plan>\S+): measured (?P<t>[\d.]+) ms "
                   r"\(\+-(?P<se>[\d.]+); alone (?P<alone>[\d.]+)\), predicted (?P<rest>.*)$")
_PRED = re.compile(r"([\d.]+) ms \((\+[\w+]+)\)")
_SCALE = re.compile(r"^\[(?P<model>[\w.-]+)\] replicated step .*compute scale "
                    r"(?P<k>[\d.]+)$")


def parse_log(lines: list[str]) -> tuple[list[dict], dict[str, float]]:
    """The timed plans (model, plan, paired seconds and standard error, predictions by
    row) and the measured compute factors printed in ``lines``."""
    runs, scales = [], {}
    for line in lines:
        line = line.rstrip("\n")
        m = _PLAN.match(line)
        if m:
            predicted = {PRINTED[label]: float(ms) / 1e3 for ms, label in _PRED.findall(
                m["rest"]) if label in PRINTED}
            runs.append({"model": m["model"], "plan": m["plan"],
                         "paired_s": float(m["t"]) / 1e3,
                         "paired_se_s": float(m["se"]) / 1e3,
                         "median_s": float(m["alone"]) / 1e3, "predicted_s": predicted})
            continue
        m = _SCALE.match(line)
        if m:
            scales[m["model"]] = float(m["k"])
    return runs, scales


def score(runs: list[dict], tie_tol: float) -> dict:
    """Acc@1, Acc@5, MRR, picks within 10 %, the worst pick and tau per row present in
    every run, as ``table2_cost_model.rank_table`` computes them."""
    from tapas.planning import ranking
    rows = [r for r in PRINTED.values() if all(r in run["predicted_s"] for run in runs)]
    table = {}
    for row in rows:
        ranks, regrets, taus = {}, {}, {}
        for model in dict.fromkeys(r["model"] for r in runs):
            mine = [r for r in runs if r["model"] == model]
            meds = [r["paired_s"] for r in mine]
            spreads = [r["paired_se_s"] for r in mine]
            pred = [r["predicted_s"][row] for r in mine]
            ranks[model] = ranking.best_rank(meds, pred, spreads, tie_tol)
            regrets[model] = ranking.pick_regret(meds, pred)
            taus[model] = ranking.kendall_tau(meds, pred)
        known = [t for t in taus.values() if t is not None]
        table[row] = {**ranking.table_metrics(ranks, 5), "ranks": ranks,
                      "pick_regret": regrets,
                      "picks_within_10pct": sum(v <= 0.10 for v in regrets.values()),
                      "worst_pick": max(regrets.values()),
                      "tau": sum(known) / len(known) if known else None}
    return table


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise app.UsageError("give one log file: python scripts/table2_from_log.py LOG")
    with open(argv[1]) as f:
        runs, scales = parse_log(f.readlines())
    if not runs:
        raise app.UsageError(f"{argv[1]}: no '[model i/n] plan: measured ...' lines")
    logged = set(r["model"] for r in runs)
    for path in FLAGS.json:
        with open(path) as f:
            d = json.load(f)
        for r in d["runs"]:
            if "error" in r or r["model"] in logged:
                continue
            runs.append({k: r[k] for k in ("model", "plan", "paired_s", "paired_se_s",
                                           "median_s")}
                        | {"predicted_s": {row: r["predicted_s"][row] for row in
                                           PRINTED.values() if row in r["predicted_s"]}})
        for model, cal in (d.get("calibrations") or {}).items():
            scales.setdefault(model, cal.get("compute_scale"))
    table = score(runs, FLAGS.tie_tol)
    models = list(dict.fromkeys(r["model"] for r in runs))
    print(f"{len(runs)} plans of {len(models)} models")
    print(f"{'row':<24} {'Acc@1':>6} {'Acc@5':>6} {'MRR':>6} {'pick<=10%':>10} {'worst':>6} "
          f"{'tau':>5}")
    for row, t in table.items():
        tau = "-" if t["tau"] is None else f"{t['tau']:.2f}"
        print(f"{row:<24} {t['acc@1']:>6.2f} {t['acc@5']:>6.2f} {t['mrr']:>6.2f} "
              f"{t['picks_within_10pct']:>5}/{t['models']:<4} {t['worst_pick'] * 100:>5.0f}% "
              f"{tau:>5}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "tie_tol": FLAGS.tie_tol,
                       "compute_scales": scales, "table": table, "runs": runs}, f, indent=1)
        print(f"written to {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
