#!/usr/bin/env bash
# Set up from scratch (if needed) and run the test suite: everything (CI), or with --fast the fast
# lane, pytest -m "not slow" (every package's unit tests; no processes of the project, no browser:
# the rule is in tests/conftest.py). Other arguments go to pytest; without a path pytest runs
# tests/ (testpaths in pyproject.toml), e.g. scripts/test.sh --fast tests/moemesh -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
. "${MOEMESH_VENV:-.venv}/bin/activate"
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then
    args+=(-m "not slow")
  else
    args+=("$a")
  fi
done
exec python -m pytest -q ${args[@]+"${args[@]}"}
