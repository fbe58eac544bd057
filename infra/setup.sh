#!/usr/bin/env bash
# Create .venv with the harness and everything the tuning side and tests need.
# Where no GPU is present, the CPU build of torch is installed first (GPU machines bring
# their own torch: pyproject.toml leaves it unpinned).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then
    echo "setup: GPU found; install the torch build for it, then re-run" >&2
    exit 1
  fi
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
# Headless Chromium for the report test (it skips with a reason where this cannot run).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1 \
    || echo "setup: chromium not installed; the report screenshot test will skip" >&2
fi
echo "setup: ready (.venv/bin/kharness)" >&2
