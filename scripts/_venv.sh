#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install TAPAS into it.
# Sourced by scripts/main.sh and scripts/test.sh; needs only Python >= 3.10 on the machine.
# Re-installs when setup.py or requirements-corpus.txt changes (a stamp file records what
# was installed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TAPAS_VENV:-$ROOT/.venv}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "tapas: no python3 found; install Python 3.10-3.12 (3.11 recommended)" >&2
  exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)'; then
  echo "tapas: $("$PY" --version 2>&1) found; TensorFlow 2.21 needs Python 3.10-3.12 (set PYTHON=...)" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "tapas: creating virtual environment in $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.tapas-install-stamp"
WANT="$(cat "$ROOT/setup.py" "$ROOT/requirements-corpus.txt" | sha1sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "tapas: installing TAPAS and its dependencies into $VENV (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
  # the corpus test's model libraries, without their pins (see requirements-corpus.txt)
  "$VENV/bin/python" -m pip install --quiet --no-deps -r "$ROOT/requirements-corpus.txt"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
