#!/usr/bin/env bash
# The main job: run TAPAS on the built-in default model (sets up .venv on first use).
# Extra flags are passed on, e.g. scripts/main.sh --model=resnet50-1k
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
tapas inspect "$@"
