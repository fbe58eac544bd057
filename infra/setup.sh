#!/usr/bin/env bash
# Create .venv with the harness and everything the tuning side and the tests need, saying
# what is installed and from where. Nothing outside .venv is touched unless asked:
#
#   bash infra/setup.sh                   # .venv: torch (CPU build where no GPU), .[dev]
#   bash infra/setup.sh --with-chromium   # also the system package chromium (apt-get, root)
#
# Where no GPU is present, the CPU build of torch is installed first (GPU machines bring
# their own torch: pyproject.toml leaves it unpinned). Chromium is only used by one report
# test, which skips with a reason where it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_CHROMIUM=0
for arg in "$@"; do
  case "$arg" in
    --with-chromium) WITH_CHROMIUM=1 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "setup: $*" >&2; }
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1) ($(command -v "$PY"))"
  "$PY" -m venv .venv
else
  say "using the existing .venv ($(.venv/bin/python --version 2>&1))"
fi
say "upgrading pip inside .venv"
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then
    say "GPU found; install the torch build for it into .venv, then re-run" >&2
    exit 1
  fi
  say "installing torch==2.13.0 (CPU build, from PyPI) into .venv: no GPU here"
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
say "installing kernel-harness with its dev extra into .venv (pip install -e '.[dev]')"
.venv/bin/python -m pip install -q -e ".[dev]"

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  :
elif [ "$WITH_CHROMIUM" = 1 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "--with-chromium needs root and apt-get; install chromium yourself" >&2
    exit 1
  fi
  say "installing the system package chromium with apt-get (for the report screenshot test)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium
else
  say "chromium not found: the report screenshot test will skip" \
      "(bash infra/setup.sh --with-chromium installs it with apt-get)"
fi
say "ready: .venv/bin/kharness"
