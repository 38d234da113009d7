#!/usr/bin/env bash
# Optional baseline environment: XLA's automatic sharding pass (the maintained successor of
# Alpa's intra-operator ILP), run compile-only against a described TPU v5e topology.
# Creates .venv-xla/ at the repository root (git-ignored). It is never a dependency of the
# tapas package and the test suite does not need it. Versions: the set measured to work
# together here (jax/jaxlib 0.6.2 with libtpu 0.0.17; docs/paper.md, Figure 6).
# Idempotent: a second run checks the pinned versions and installs only what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TAPAS_XLA_VENV:-$ROOT/.venv-xla}"
PY="${PYTHON:-python3}"
PINS=("jax==0.6.2" "jaxlib==0.6.2" "libtpu==0.0.17" "keras==3.15.1" "numpy"
      "tensorflow-cpu==2.21.0" "networkx")

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# pip check of the pins: skip the install when every pinned distribution is already present.
if "$VENV/bin/python" - "${PINS[@]}" <<'PYEOF'
import sys
from importlib import metadata
missing = []
for pin in sys.argv[1:]:
    name, _, version = pin.partition("==")
    try:
        got = metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(pin); continue
    if version and got != version:
        missing.append(f"{pin} (installed {got})")
sys.exit(1 if missing else 0)
PYEOF
then
  echo "$VENV: pinned packages already installed"
else
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "${PINS[@]}"
fi
"$VENV/bin/python" - <<'PYEOF'
import os
os.environ.setdefault("KERAS_BACKEND", "jax")
import jax, jaxlib, keras, libtpu, numpy
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, keras {keras.__version__}, "
      f"numpy {numpy.__version__}, keras backend {keras.backend.backend()}")
PYEOF
echo "baseline venv ready: $VENV (run scripts/baselines/xla_autoshard.py with $VENV/bin/python)"
