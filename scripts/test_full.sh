#!/usr/bin/env bash
# The whole suite with every case of its long matrices (TAPAS_FULL_MATRIX=1, tests/matrix.py):
# every zoo preset captured, Table 2's script on two models, ... About twice the suite's time.
# Extra arguments go to pytest, as with scripts/test.sh.
set -euo pipefail
export TAPAS_FULL_MATRIX=1
exec bash "$(dirname "${BASH_SOURCE[0]}")/test.sh" "$@"
