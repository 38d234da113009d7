#!/usr/bin/env bash
# The exported-LayoutMap check end to end (scripts/layoutmap_check.py): export every model's
# layout in the TensorFlow venv, then train, compile and time it in the optional JAX venv
# (created by scripts/baselines/setup.sh; keras-hub added here): XLA's automatic sharding
# solved for a described TPU topology (scripts/layoutmap_autoshard.py, given the --models and
# --out_dir flags only), then the check on 8 logical CPU devices.
# Writes out/layoutmap/*.json and benchmarks/results/layoutmap_check.json.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TF_PY="${TF_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$TF_PY" ] || TF_PY="$(command -v python)"
XLA_VENV="${TAPAS_XLA_VENV:-$ROOT/.venv-xla}"
bash "$ROOT/scripts/baselines/setup.sh"
"$XLA_VENV/bin/python" -c "import keras_hub" 2>/dev/null || \
  "$XLA_VENV/bin/pip" install --quiet "keras-hub==0.32.0"
cd "$ROOT"
PYTHONPATH="$ROOT" TF_CPP_MIN_LOG_LEVEL=3 "$TF_PY" scripts/layoutmap_check.py export "$@"
SOLVE_ARGS=()
for a in "$@"; do case "$a" in --models=*|--out_dir=*) SOLVE_ARGS+=("$a");; esac; done
PYTHONPATH="$ROOT" TF_CPP_MIN_LOG_LEVEL=3 \
  "$XLA_VENV/bin/python" scripts/layoutmap_autoshard.py "${SOLVE_ARGS[@]}"
PYTHONPATH="$ROOT" KERAS_BACKEND=jax JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3 \
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  "$XLA_VENV/bin/python" scripts/layoutmap_check.py check "$@"
