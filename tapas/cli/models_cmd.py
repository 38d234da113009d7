"""``tapas models``: list the model zoo.

In:  nothing (``--json_out``).
Out: one line per zoo model (name, family, parameters, description); the list as a dict.
Raises: nothing of its own.
"""

from __future__ import annotations

from typing import Any

SUMMARY = 'list the model zoo (names for --model)'
USAGE = 'tapas models'
#: the flags this command reads, in the order its help lists them
FLAG_NAMES = ('json_out',)


def cmd_models() -> dict[str, Any]:
    from tapas import models
    rows = []
    for name in models.names():
        e = models.get(name)
        rows.append({"name": name, "family": e.family, "params": e.param_count(),
                     "description": e.description})
    print(f"{'name':<24} {'family':<8} {'params':>15}  description")
    for r in rows:
        print(f"{r['name']:<24} {r['family']:<8} {r['params']:>15,}  {r['description']}")
    return {"models": rows}
