#!/usr/bin/env bash
# Run every benchmark in sequence on a quiet machine and keep the outputs in results/.
# Usage: bash benchmarks/run_all.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
out=results/bench-$(date +%Y%m%d-%H%M)
mkdir -p "$out"
export AUTOPAR_PROFILE_DIR="$out/profiles"
echo "machine: $(nproc) cores, $(uname -m), torch $($PY -c 'import torch; print(torch.__version__)')" | tee "$out/machine.txt"
run() { local name=$1; shift; echo "== $name: $*"; ( time "$@" ) 2>&1 | tee "$out/$name.txt"; }
run training $PY benchmarks/bench_training.py --out "$out/training.json" --csv "$out/training.csv" ${1:+--no-inductor}
run lstm $PY benchmarks/bench_lstm.py
run cell_loop $PY benchmarks/bench_cell_loop.py
run gru_cell_loop $PY benchmarks/bench_cell_loop.py --gru
run omp_spin $PY benchmarks/omp_spin_probe.py
run adaptive $PY benchmarks/bench_adaptive.py
run distributed $PY benchmarks/bench_distributed.py --quick
run demo .venv/bin/autopar demo --out "$out/demo" --no-progress
echo "results in $out"
