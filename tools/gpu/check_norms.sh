#!/usr/bin/env bash
# The Pallas norm kernels on the GPU machine, in one call (< 120 s on an H100):
# GPU tests (tests/test_pallas_norms.py -m gpu) + the norm benchmark
# (jaxquant/bench_norm.py: pallas vs ffi vs jnp reference, %copy bandwidth).
# The caller has already run `pip install --no-build-isolation --no-deps -e .`.
# Run from anywhere:  bash tools/gpu/check_norms.sh [extra bench args...]
# Logs under $OUT if set (else ./gpu_logs_norms): env.txt, norms_gpu_tests.txt, bench_norm.txt.
# JQ_BUDGET_S (default 115): the whole run's wall-clock budget; the benchmark gets
# what the tests leave (its rows print as they finish, so a cut-off run keeps them).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_logs_norms}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
BUDGET=${JQ_BUDGET_S:-115}
SECONDS=0
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>/dev/null \
    || rocm-smi 2>/dev/null
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

echo "=== GPU tests ($(date +%T))"
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 4"    # parallel compiles where pytest-xdist is installed
timeout 70 $PY -m pytest -q -m gpu -p no:cacheprovider -rs $XDIST --durations=5 \
  tests/test_pallas_norms.py 2>&1 | tee "$OUT/norms_gpu_tests.txt" | tail -n 30
echo "tests rc=${PIPESTATUS[0]} after ${SECONDS}s"

LEFT=$((BUDGET - SECONDS))
if (( LEFT < 15 )); then LEFT=15; fi
echo "=== benchmark ($(date +%T), ${LEFT}s left)"
timeout "$LEFT" $PY -m jaxquant bench norm \
  --iters 7 --target-ms 5 "$@" 2>&1 | tee "$OUT/bench_norm.txt" | grep -v "^$"
echo "bench rc=${PIPESTATUS[0]}; total ${SECONDS}s"
