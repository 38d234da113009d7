"""What the tests' subprocess workers share (``runtime_worker.py``, ``inputs_worker.py``,
``training_worker.py``): run the checks a job names, print one line ``RESULT <json>`` per
check (``{"check": name, "error": ..., "traceback": ...}`` when it raises, which the parent
test turns into its failure), then end the process at once (TensorFlow's teardown of
logical devices and collectives can hang or crash at exit)."""

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


def finish() -> None:
    """End the worker process now, output flushed."""
    sys.stdout.flush()
    os._exit(0)
