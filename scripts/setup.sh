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
# The native stream interpreter (a C++ extension, 40-60 s once per torch version, cached in
# torch's extension directory; milliseconds when built). Built here so that a first short
# run does not spend its steps waiting for the background build; autopar builds it in the
# background otherwise, and without a compiler it runs the Python programs.
.venv/bin/python -c "import autopar.runtime.native as n; n.load()" \
  || echo "setup: the native interpreter was not built (see above); autopar runs without it"
