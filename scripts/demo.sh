#!/usr/bin/env bash
# Set up from scratch (if needed), build the demo model, bring the mesh up, stream an answer, shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. "${MOEMESH_VENV:-.venv}/bin/activate"
exec moemesh demo "$@"
