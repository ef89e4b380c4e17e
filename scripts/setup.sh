#!/usr/bin/env bash
# Create .venv and install autopar with its test extras.
# torch is pinned to the CPU wheel for the development machines; pyproject.toml keeps a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${AUTOPAR_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" "torch==${AUTOPAR_TORCH_VERSION:-2.13.0}"
