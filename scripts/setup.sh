#!/usr/bin/env bash
# Create .venv and install torch, then autopar (editable) with the extras named in
# AUTOPAR_EXTRAS: none for `make demo` (what autopar and its demo import), "dev" for
# `make test` and `make lint` (pytest, ruff, the notebook runner and triton, about 1 GB).
#
# torch comes first, on its own, so that the build is chosen here rather than by whatever
# pip resolves for autopar's range:
#   AUTOPAR_TORCH        the torch requirement (default torch==2.13.0, the tested release)
#   AUTOPAR_TORCH_INDEX  a package index to take torch from (pip's --index-url); unset: the
#                        indexes pip is configured with
# Which build a plain `pip install torch==2.13.0` takes depends on those indexes: on the
# development machines and in CI it is the CPU wheel (it lies on local disk); from PyPI on
# Linux it is the CUDA build (several GB). For the CPU-only build elsewhere:
#   AUTOPAR_TORCH_INDEX=https://download.pytorch.org/whl/cpu make test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${AUTOPAR_TORCH:-torch==2.13.0}
EXTRAS=${AUTOPAR_EXTRAS:-}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ -n "${AUTOPAR_TORCH_INDEX:-}" ]; then
  "${PIP[@]}" --index-url "$AUTOPAR_TORCH_INDEX" "$TORCH"
else
  "${PIP[@]}" "$TORCH"
fi
# The torch requirement again, so that resolving autopar's own dependencies cannot swap it.
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}" "$TORCH"
# The native stream interpreter (a C++ extension, 40-60 s once per torch version, cached in
# torch's extension directory; milliseconds when built). Built here so that a first short
# run does not spend its steps waiting for the background build; autopar builds it in the
# background otherwise, and without a compiler it runs the Python programs.
.venv/bin/python -c "import autopar.runtime.native as n; n.load()" \
  || echo "setup: the native interpreter was not built (see above); autopar runs without it"
