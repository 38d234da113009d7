"""The ``tapas`` command in a subprocess, as a user runs it, for the tests of the command
line: ``run_tapas("train", "--model=t5-tiny", ...)`` returns the finished process (exit
code, stdout, stderr) without checking it, so a test can assert on a failure's message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tapas(*args: str, timeout: float = 300,
              **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m tapas.cli *args`` from the repository root, TensorFlow's logs quiet and
    ``env`` added to the environment; killed after ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "tapas.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))


def run_tapas_each(*command_lines: list[str], timeout: float = 300,
                   **env: str) -> list[subprocess.CompletedProcess[str]]:
    """Each of ``command_lines`` (the arguments after ``tapas``) run as ``tapas`` runs it, one
    after another in one subprocess (tests/cli_batch.py: TensorFlow imported once, each
    line's flags reset first): for command lines refused before any work, or short runs
    on one device count, whose tests would otherwise pay a process start each (each line
    builds its own model, seeded as ``tapas`` seeds it). Logical devices are set once per
    process: lines that get as far as making devices must ask for the same count. Per line, a
    CompletedProcess as run_tapas's (its ``args`` begin with "tapas")."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        lines, results = os.path.join(d, "lines.json"), os.path.join(d, "results.json")
        with open(lines, "w") as f:
            json.dump([list(c) for c in command_lines], f)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cli_batch.py"),
                               lines, results], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))
        assert proc.returncode == 0 and os.path.exists(results), proc.stderr[-3000:]
        with open(results) as f:
            got = json.load(f)
    return [subprocess.CompletedProcess(["tapas", *c], r["returncode"], r["stdout"],
                                        r["stderr"]) for c, r in zip(command_lines, got)]


def worker_pid(parent: int, index: int) -> int | None:
    """The pid of the ``tapas train --workers`` launcher's worker ``index`` (a child of
    ``parent`` whose TF_CONFIG names that task), or None while it is not started."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        cfg = env.get(b"TF_CONFIG")
        if cfg and json.loads(cfg)["task"]["index"] == index:
            return int(entry)
    return None


def kill_worker_after_first_checkpoint(proc: subprocess.Popen, checkpoint_dir: str,
                                       wait_s: float, index: int = 1) -> float:
    """SIGKILL worker ``index`` of the launcher ``proc`` (a process the test started) once
    ``checkpoint_dir`` holds a checkpoint (or ``wait_s`` passed); the time of the kill.
    Fails when the job ended before it."""
    from tapas.execution.api import fit
    deadline = time.monotonic() + wait_s
    while not fit.list_checkpoints(str(checkpoint_dir)) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = worker_pid(proc.pid, index)
    assert victim is not None and proc.poll() is None, "the job ended before the kill"
    os.kill(victim, signal.SIGKILL)
    return time.monotonic()
