"""The ``tapas`` command in a subprocess, as a user runs it, for the tests of the command
line: ``run_tapas("train", "--model=t5-tiny", ...)`` returns the finished process (exit
code, stdout, stderr) without checking it, so a test can assert on a failure's message."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tapas(*args: str, timeout: float = 300,
              **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m tapas.cli *args`` from the repository root, TensorFlow's logs quiet and
    ``env`` added to the environment; killed after ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "tapas.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))
