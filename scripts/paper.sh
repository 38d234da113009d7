#!/usr/bin/env bash
# Reproduce the paper's evaluation: every figure and table that fits this machine, in about
# an hour on 2 cores (scripts/paper.py says which steps and at which sizes; docs/paper.md
# holds the paper's numbers beside ours). Sets up .venv, and .venv-xla for Figure 6's
# baseline unless --noxla is given (when the baseline cannot be installed, Figure 6 runs
# without it and says so). Extra flags go to scripts/paper.py, e.g. --only=figure6,table1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
case " $* " in
  *" --noxla "*) ;;
  *) bash scripts/baselines/setup.sh \
       || echo "tapas: the XLA baseline could not be set up; Figure 6 runs without it" >&2 ;;
esac
python scripts/paper.py "$@"
