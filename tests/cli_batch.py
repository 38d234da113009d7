"""Several ``tapas`` command lines in one process, for the tests of refusals: TensorFlow is
imported once instead of once per command line. Each runs as ``tapas`` runs it
(``tapas.cli.run``), its flags reset to their defaults first, its stdout and stderr captured.

In:  argv[1], a JSON file holding a list of argument lists; argv[2], where to write results.
Out: that file: per command line, ``{"returncode", "stdout", "stderr"}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def run_one(args: list[str]) -> dict:
    from tapas import cli
    cli.FLAGS.unparse_flags()
    sys.argv = ["tapas", *args]
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.run()
        except SystemExit as e:
            code = e.code
        except Exception as e:   # noqa: BLE001 -- a crash is a result the test reads
            import traceback
            traceback.print_exc()
            code = f"crashed: {type(e).__name__}"
    rc = code if isinstance(code, int) else (0 if code is None else 1)
    return {"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    lines, out_file = sys.argv[1], sys.argv[2]
    with open(lines) as f:
        argvs = json.load(f)
    results = [run_one(a) for a in argvs]
    with open(out_file, "w") as f:
        json.dump(results, f)
