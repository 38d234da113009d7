"""Re-run a representative subset of the bad-input and fault cases of the reliability
review (the ``tapas`` command as a user runs it) and print a table of verdicts.

    python scripts/reliability_cases.py [--only=ID,ID] [--slow] [--json_out=cases.json]

In:  the case list below (each: a ``tapas`` command line, the files it needs, the exit code
     and the words of the clear message expected); ``--only`` a subset by id; ``--slow``
     adds the cases that train (a diverging loss, the documented random-plan ``--verify``, a
     damaged checkpoint resumed with ``--learning_rate``).
Out: one row per case: ``clear`` (the expected exit code and message, no traceback),
     ``works`` (a case expected to succeed did), ``unclear`` (the exit code is right but
     the message lacks the words), ``crash`` (a traceback), ``silent`` (exit 0 where an
     error was expected), ``hang`` (past the time limit); the counts; exit code 0 when
     every case is clear or works, else 1. ``--json_out`` writes the rows as JSON.
Raises: nothing of its own; every case runs in its own process, killed at its time limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5 = ("--model=t5-tiny", "--devices=2")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    what: str
    args: tuple[str, ...]          # after `tapas`; "{d}" is the case's own directory
    says: tuple[str, ...]          # words the output must hold
    rc: int = 1                    # the exit code expected
    setup: Callable[[str], None] | None = None
    not_says: tuple[str, ...] = ()
    slow: bool = False
    timeout: float = 180.0


def _ids(n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 512, (n, 16)).astype("int32")


def _npz(**change: Any) -> Callable[[str], None]:
    """Setup: ``{d}/d.npz``, t5-tiny's arrays with ``change`` applied (a value of None
    drops the array)."""
    def make(d: str) -> None:
        ids = _ids()
        arrays = {"encoder_input_ids": ids, "decoder_input_ids": ids, "y": ids}
        for k, v in change.items():
            if v is None:
                arrays.pop(k)
            else:
                arrays[k] = v(ids) if callable(v) else v
        np.savez(os.path.join(d, "d.npz"), **arrays)
    return make


def _text(name: str, text: str) -> Callable[[str], None]:
    def make(d: str) -> None:
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    return make


def _damaged_checkpoint(d: str) -> None:
    """Setup: 2 steps of t5-tiny checkpointed every step, then ckpt-2's layout truncated."""
    _tapas(["train", *T5, "--strategy=random:0", "--steps=2", f"--checkpoint_dir={d}/ck",
            "--checkpoint_every=1"], 300.0)
    with open(os.path.join(d, "ck", "ckpt-00000002", "tapas-checkpoint.json"), "r+") as f:
        f.truncate(40)


CASES: list[Case] = [
    Case("train-help", "tapas train --help lists train's flags", ("train", "--help"),
         ("--devices=<int>", "--steps=<int>", "--strategy=<string>"), rc=0,
         not_says=("--top=", "--graph_out=")),
    Case("search-help", "tapas search --help lists search's flags", ("search", "--help"),
         ("--nodes=<int>", "--devices_per_node=<int>"), rc=0, not_says=("--steps=",)),
    Case("bare", "bare tapas names the commands and where help is", (),
         ("usage: tapas {inspect|", "`tapas COMMAND --help` lists a command's flags")),
    Case("model-typo", "--model=t5-tinyy", ("train", "--model=t5-tinyy"),
         ("unknown model 't5-tinyy'", "t5-tiny")),
    Case("devices-0", "--devices=0", ("train", "--model=t5-tiny", "--devices=0"),
         ("--devices=0: the device count must be at least 1", "--devices=N with N >= 1")),
    Case("devices-negative", "--devices=-1", ("train", "--model=t5-tiny", "--devices=-1"),
         ("--devices=-1: the device count must be at least 1",)),
    Case("steps-0", "--steps=0", ("train", *T5, "--steps=0"), ("--steps=0: need at least 1",)),
    Case("checkpoint-every", "--checkpoint_every=-5 with a directory",
         ("train", *T5, "--checkpoint_dir={d}/ck", "--checkpoint_every=-5"),
         ("--checkpoint_every=-5: the step count between checkpoints must be at least 1",)),
    Case("strategy-missing", "--strategy=nope.json", ("train", *T5, "--strategy={d}/nope.json"),
         ("no such file", "random:SEED")),
    Case("strategy-truncated", "a truncated strategy file",
         ("train", *T5, "--strategy={d}/t.json"),
         ("strategy file", "t.json is not valid JSON", "truncated?", "tapas search --out="),
         setup=_text("t.json", '{"format": "tapas-strategy-1", "graph_name": "t5", "pa')),
    Case("strategy-empty-training", "an empty strategy file with --training",
         ("train", *T5, "--training", "--strategy={d}/e.json"),
         ("strategy file", "e.json is empty"), setup=_text("e.json", "")),
    Case("checkpoint-dir-uncreatable", "a checkpoint directory under a file",
         ("train", *T5, "--checkpoint_dir={d}/file/ck"),
         ("--checkpoint_dir=", "cannot create it", "give --checkpoint_dir"),
         setup=_text("file", "not a directory")),
    Case("data-missing", "--data=none.npz", ("train", *T5, "--data={d}/none.npz"),
         ("no such file",)),
    Case("data-names", "an npz with a wrong key", ("train", *T5, "--data={d}/d.npz"),
         ("missing ['encoder_input_ids']", "unexpected ['foo']"),
         setup=_npz(encoder_input_ids=None, foo=_ids())),
    Case("data-shape", "an npz with sequences of 12, not 16", ("train", *T5, "--data={d}/d.npz"),
         ("holds examples of shape [12]", "the model takes [16] per example"),
         setup=_npz(encoder_input_ids=lambda ids: ids[:, :12])),
    Case("data-dtype", "an npz with float ids", ("train", *T5, "--data={d}/d.npz"),
         ("has dtype float32", "x.astype('int32')"),
         setup=_npz(decoder_input_ids=lambda ids: ids.astype("float32"))),
    Case("data-targets", "an npz whose y is [n], not [n, 16]",
         ("train", *T5, "--data={d}/d.npz"),
         ("'y' holds examples of shape []", "[16] per example"),
         setup=_npz(y=lambda ids: ids[:, 0])),
    Case("data-ids", "an npz with token ids beyond the vocabulary",
         ("train", *T5, "--data={d}/d.npz"), ("holds the id", "has 512 rows"),
         setup=_npz(encoder_input_ids=lambda ids: ids + 100000)),
    Case("data-not-npz", "a text file named .npz", ("train", *T5, "--data={d}/d.npz"),
         ("--data=", "numpy cannot read it as an .npz", "np.savez("),
         setup=_text("d.npz", "not an npz")),
    Case("model-not-keras", "a text file named .keras", ("train", "--model={d}/bad.keras"),
         ("--model=", "bad.keras: not a Keras archive", "save the model again"),
         setup=_text("bad.keras", "not a model")),
    Case("mesh-form", "--mesh=2by2", ("train", *T5, "--mesh=2by2"), ("ROWSxCOLS",)),
    Case("loss-not-finite", "resnet-tiny at --learning_rate=1e9 (the loss turns NaN)",
         ("train", "--model=resnet-tiny", "--devices=2", "--strategy=random:0", "--steps=6",
          "--learning_rate=1e9"),
         ("failed, weights unchanged", "not finite", "check --learning_rate and --data"),
         slow=True, timeout=300.0),
    Case("documented-verify", "the documented random-plan --verify example",
         ("train", "--model=resnet-tiny", "--devices=2", "--strategy=random:3",
          "--batch_size=16", "--verify"), ("verify: PASSED",), rc=0, slow=True,
         timeout=300.0),
    Case("resume-damaged", "--resume after the newest checkpoint's layout was truncated",
         ("train", *T5, "--strategy=random:0", "--steps=2", "--checkpoint_dir={d}/ck",
          "--checkpoint_every=1", "--epochs=2", "--resume", "--learning_rate=0.5"),
         ("skipping the damaged checkpoint", "tapas-checkpoint.json cannot be read",
          "resuming from", "ckpt-00000001", "--learning_rate=0.5 is not used"), rc=0,
         setup=_damaged_checkpoint, slow=True, timeout=300.0),
]


def _tapas(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tapas.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                   PYTHONPATH=ROOT + os.pathsep
                                   + os.environ.get("PYTHONPATH", "")))


def verdict(case: Case, rc: int | None, output: str) -> str:
    """The verdict of ``case`` from its exit code (None: it hung) and output."""
    if rc is None:
        return "hang"
    if "Traceback (most recent call last)" in output:
        return "crash"
    if case.rc != 0 and rc == 0:
        return "silent"
    said = all(s in output for s in case.says) and not any(s in output for s in case.not_says)
    if rc == case.rc and said:
        return "works" if case.rc == 0 else "clear"
    return "unclear"


def run_case(case: Case) -> dict[str, Any]:
    """Run ``case`` in a directory of its own; its row."""
    with tempfile.TemporaryDirectory(prefix=f"tapas-case-{case.id}-") as d:
        start = time.monotonic()
        try:
            if case.setup is not None:
                case.setup(d)
            proc = _tapas([a.replace("{d}", d) for a in case.args], case.timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, output = None, ""
        output = output.replace(d, "{d}")
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(
        ("WARNING: All log", "I0000", "W0000"))]
    return {"id": case.id, "what": case.what, "rc": rc, "verdict": verdict(case, rc, output),
            "seconds": round(time.monotonic() - start, 1),
            "message": next((ln for ln in lines if "tapas" in ln and ":" in ln),
                            lines[-1] if lines else "")[:300]}


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The verdicts, one row per case, then the counts."""
    out = [f"{'case':<27} {'verdict':<8} {'rc':>4} {'s':>6}  what"]
    for r in rows:
        out.append(f"{r['id']:<27} {r['verdict']:<8} {str(r['rc']):>4} {r['seconds']:>6.1f}  "
                   f"{r['what']}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    out.append("\n" + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case ids")
    parser.add_argument("--slow", action="store_true", help="also the cases that train")
    parser.add_argument("--json_out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - {c.id for c in CASES})
    if unknown:
        parser.error(f"--only: unknown case(s) {unknown}; the ids are "
                     f"{', '.join(c.id for c in CASES)}")
    cases = [c for c in CASES if (c.id in only if only else args.slow or not c.slow)]
    rows = []
    for case in cases:
        rows.append(run_case(case))
        print(f"{case.id}: {rows[-1]['verdict']} ({rows[-1]['seconds']} s) "
              f"{rows[-1]['message']}", flush=True)
    print()
    print(table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["verdict"] in ("clear", "works") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
