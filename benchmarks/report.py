"""What every benchmark writes besides its table: the machine it ran on, and the JSON file.

In:  a benchmark's results (a JSON-able dict) and the path given by its ``--json_out``.
Out: :func:`machine` (python, platform, CPU count) and :func:`write_json` (the file, its
     directory created, a line saying where it went).
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

__all__ = ["machine", "write_json"]


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on: Python version, platform and CPU count."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count()}


def write_json(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` (indented JSON), creating its directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nwrote {path}")
