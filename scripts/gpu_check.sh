#!/usr/bin/env bash
# One device call: environment, GPU tests of the Pallas kernels, qmm benchmark.
# Usage (on the GPU machine, repo root): bash scripts/gpu_check.sh [tests|bench|all] [bench args...]
# Logs go to $OUT (or ./gpu_logs).
set -u
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv 2>/dev/null || rocm-smi 2>/dev/null
  $PY -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 300 $PY -m pytest tests/test_pallas_gpu.py -q -x -p no:cacheprovider -n ${NPROC:-8} \
     --durations=5 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  $PY -m jaxquant bench qmm "$@" 2>&1 | tee "$OUT/bench.txt" | grep -v "^#.*failed" | tail -80
fi
