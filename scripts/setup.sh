#!/usr/bin/env bash
# Set up (once) a virtual environment in .venv with te-core, its backends and test tools.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only installs what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  # system site packages: reuse an installed torch (e.g. a GPU build) instead of downloading one
  "$PY" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.7"
fi
# pip -q still relays setuptools' notices about editable installs; PYTHONWARNINGS hides those
# (warnings only: errors still print and stop the script).
pip_install() { PYTHONWARNINGS=ignore python -m pip install -q "$@"; }
stamp=.venv/.te-core-installed
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml backends plugins -name pyproject.toml -newer "$stamp" 2>/dev/null)" ]; then
  pip_install --upgrade "pip>=23" "setuptools>=64" 2>/dev/null || true
  pip_install pluggy numpy "pytest>=7"
  # triton runs the shared kernels' tests on the CPU through its interpreter
  pip_install triton || echo "setup: triton not installable here; its kernel tests will be skipped" >&2
  pip_install --no-build-isolation -e . -e plugins/template
  for pkg in backends/triton backends/cuda backends/musa; do
    if [ -f "$pkg/pyproject.toml" ]; then pip_install --no-build-isolation --no-deps -e "$pkg"; fi
  done
  touch "$stamp"
fi
# A pytest found in the system site packages has no command in .venv/bin, so a bare `pytest` would
# run the system's interpreter without te-core: give the venv its own.
if [ ! -x .venv/bin/pytest ]; then
  pip_install --ignore-installed --no-deps "pytest>=7"
fi
