#!/usr/bin/env bash
# Run the whole test suite (sets up .venv on first use). Extra arguments go to pytest.
# The suite runs in TAPAS_TEST_WORKERS processes (pytest-xdist; default: the machine's cores,
# at most 4), one test file per process at a time, so a file's module fixtures are built once.
# TAPAS_TEST_WORKERS=0 runs it in this process (for -s, --pdb).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
set +e
CORES="$(python -c 'import os; print(len(os.sched_getaffinity(0)))')"
WORKERS="${TAPAS_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}"
if [ "$WORKERS" -gt 0 ]; then
  DIST=(-n "$WORKERS" --dist loadfile)
else
  DIST=()
fi
python -m pytest -q -p no:cacheprovider --durations=25 ${DIST[@]+"${DIST[@]}"} tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tapas: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
