"""What the tests' subprocess workers share (``runtime_worker.py``, ``inputs_worker.py``,
``training_worker.py``), both sides of the pipe. In the worker: run the checks a job names,
print one line ``RESULT <json>`` per check (``{"check": name, "error": ..., "traceback":
...}`` when it raises, which the parent test turns into its failure), then end the process
at once (TensorFlow's teardown of logical devices and collectives can hang or crash at
exit). In the test: :func:`run_worker` starts the worker process(es), always ends them, and
reads the RESULT lines back."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def run_checks(checks: Mapping[str, Callable[..., dict[str, Any]]], names: Iterable[str],
               *args: Any) -> None:
    """Each check of ``names`` called with ``args``; one RESULT line each."""
    for name in names:
        try:
            result = {"check": name, **checks[name](*args)}
        except Exception as e:  # reported to the parent, which fails the test with it
            result = {"check": name, "error": f"{type(e).__name__}: {e}"[:3000],
                      "traceback": traceback.format_exc()[-4000:]}
        print("RESULT " + json.dumps(result, default=str), flush=True)


def run_worker(script: str, job: dict[str, Any], workers: int = 1, timeout_s: float = 300.0,
               start: list[int] | None = None,
               env: dict[str, str] | None = None) -> list[dict[str, dict[str, Any]]]:
    """Run ``script`` with ``job`` on ``workers`` processes (``tapas.execution.runtime.launch``:
    killed on time-out or when one fails; ``env`` added to their environment); per worker,
    its results by check name."""
    from tapas.execution.runtime import launch
    results = launch.launch(lambda i: [sys.executable, script, json.dumps(job)], workers,
                            timeout_s=timeout_s, start=start, env=env)
    out = []
    for r in results:
        checks = {}
        for line in r.output.splitlines():
            if line.startswith("RESULT "):
                d = json.loads(line[len("RESULT "):])
                checks[d["check"]] = d
        out.append(checks)
    return out


def run_checked(script: str, job: dict[str, Any], timeout_s: float = 300.0
                ) -> dict[str, dict[str, Any]]:
    """One worker process's results by check name (:func:`run_worker`); a check that
    raised fails the caller with its name and traceback."""
    (res,) = run_worker(script, job, 1, timeout_s)
    for name, r in res.items():
        assert "error" not in r, (name, r.get("traceback"))
    return res


def finish() -> None:
    """End the worker process now, output flushed. A worker of several (``TF_CONFIG`` set)
    first waits 2 s: a peer may still be pulling the last collective's buffers from this
    worker's server (collectives between processes are received by pulling), and leaving
    at once closed that socket under it ("Collective ops is aborted by: Socket closed",
    seen on a machine loaded with other jobs)."""
    sys.stdout.flush()
    if os.environ.get("TF_CONFIG"):
        import time
        time.sleep(2.0)
    os._exit(0)
