#!/usr/bin/env bash
# Every GPU check in one device call (repo root, GPU machine):
#   bash tools/gpu/check.sh [stage ...]
# stages (default: all but pallas-qmm-tests and qmm-full, which take ~10 min more):
#   ffi              build (CUDA sm_90 only), ffi GPU tests, compute-sanitizer
#   norms            Pallas norm GPU tests + python -m jaxquant bench norm
#   moe              Pallas gather_qmm GPU tests + python -m jaxquant bench moe
#   sanitizer-moe    compute-sanitizer memcheck over the bad-expert-id tests (Pallas and ffi
#                    gather_qmm), XLA allocating each buffer on its own so overruns show
#   qmm              python -m jaxquant bench qmm at the decode shapes (pallas and ffi)
#   pallas-qmm-tests tests/test_pallas_qmm.py -m gpu (every mode x path at realistic shapes)
#   qmm-full         python -m jaxquant bench qmm at all seven shapes of issue 4
#   attention        tools/gpu/check_attention.sh (decode attention: tests, memcheck, bench)
# Logs under $OUT (default ./gpu_logs), one folder per stage.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
PY=${PY:-python3}
stages=${*:-ffi norms moe sanitizer-moe qmm}
has() { [[ " $stages " == *" $1 "* ]]; }
SECONDS=0
if has ffi; then
  OUT=$OUT/ffi JQ_SKIP_BENCH=1 bash tools/gpu/check_ffi.sh
else  # the other stages still need the package (and its CUDA library) installed
  CMAKE_ARGS="-DJAXQUANT_CUDA_ARCHS=90-real -DJAXQUANT_ENABLE_ROCM=OFF" \
    $PY -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1
fi
echo "== after ffi/build: ${SECONDS}s"
has norms && OUT=$OUT/norms bash tools/gpu/check_norms.sh
has moe && OUT=$OUT/moe bash tools/gpu/check_moe.sh
has attention && OUT=$OUT/attention bash tools/gpu/check_attention.sh
if has sanitizer-moe; then
  PY=$PY JQ_SANITIZER_TIMEOUT=200 bash tools/gpu/memcheck_tests.sh "$OUT/sanitizer" \
    tests/test_pallas_moe.py::test_bad_ids_are_nan_rows \
    "tests/test_ffi.py::test_gpu_mode_sweep[mxfp4-4]"
fi
echo "== after norms/moe: ${SECONDS}s"
if has qmm; then
  mkdir -p "$OUT/qmm"
  timeout 150 $PY -m jaxquant bench qmm --shapes "1,4096,14336;1,2880,5760;1,14336,4096" \
    --iters 9 2>&1 | tee "$OUT/qmm/bench.txt" | grep -v "^#.*failed" | tail -40
fi
if has pallas-qmm-tests; then
  mkdir -p "$OUT/qmm"
  XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n ${NPROC:-8}"
  timeout 300 $PY -m pytest tests/test_pallas_qmm.py -m gpu -q -p no:cacheprovider $XDIST \
    --durations=5 2>&1 | tee "$OUT/qmm/gpu_tests.txt" | tail -25
fi
if has qmm-full; then
  mkdir -p "$OUT/qmm"
  $PY -m jaxquant bench qmm 2>&1 | tee "$OUT/qmm/bench_full.txt" | grep -v "^#.*failed" | tail -80
fi
echo "== all done in ${SECONDS}s"
