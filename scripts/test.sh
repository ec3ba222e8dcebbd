#!/usr/bin/env bash
# Set up from scratch (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
. "${MOEMESH_VENV:-.venv}/bin/activate"
exec python -m pytest tests -q "$@"
