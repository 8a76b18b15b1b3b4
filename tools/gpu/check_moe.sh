#!/usr/bin/env bash
# One device call for routed MoE (issue 6), under 150 s on an H100: the GPU tests of the
# Pallas gather_qmm, then the MoE benchmark (decode shapes of every layer, one prefill).
# Usage (on the GPU machine, repo root, package installed): bash tools/gpu/check_moe.sh
# Logs go to $OUT (or ./gpu_logs). BUDGET (seconds, default 140) caps the whole run.
set -u
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
PY=${PY:-python3}
BUDGET=${BUDGET:-140}
# left CAP: seconds for the next step, at most CAP and what the budget has left (>= 5).
left() { local l=$(( BUDGET - SECONDS )); (( l > $1 )) && l=$1; (( l < 5 )) && l=5; echo $l; }
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv 2>/dev/null || rocm-smi 2>/dev/null
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/moe_env.txt"
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n ${NPROC:-4}"
echo "== tests (timeout $(left 65) s)"
timeout -k 5 "$(left 65)" $PY -m pytest -q -m gpu tests/test_pallas_moe.py -p no:cacheprovider \
    $XDIST --durations=5 2>&1 | tee "$OUT/moe_gpu_tests.txt" | tail -25
echo "== bench: decode (timeout $(left 55) s)"
timeout -k 5 "$(left 55)" $PY -m jaxquant bench moe --no-prefill --iters 5 --target-ms 5 \
    2>&1 | tee "$OUT/bench_moe_decode.txt" | grep -v "^#.*failed" | tail -60
echo "== bench: prefill, gpt-oss-20b-like (timeout $(left 30) s)"
timeout -k 5 "$(left 30)" $PY -m jaxquant bench moe --layers gptoss20b --decode-t "" \
    --prefill-t 4096 --copies 2 --iters 3 --target-ms 5 \
    2>&1 | tee "$OUT/bench_moe_prefill.txt" | tail -12
echo "== done in ${SECONDS} s"
