#!/usr/bin/env bash
# Run the whole test suite (sets up .venv on first use). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
set +e
python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tapas: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
