#!/usr/bin/env bash
# The ffi backend on the GPU machine, in one call (build + GPU tests +
# compute-sanitizer memcheck + benchmark). Run from the repository root:
#   bash tools/gpu/check_ffi.sh            (logs under $OUT, default /tmp/jq_gpu_out)
# Environment: JQ_CUDA_ARCHS (default 90-real: the H100/H200 only, to build fast),
# JQ_SKIP_SANITIZER=1, JQ_SKIP_BENCH=1, JQ_BENCH_ARGS (extra args for the benchmark).
set -uo pipefail
source "$(dirname "$0")/env.sh"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

step "build (pip install --no-build-isolation --no-deps -e .)"
export CMAKE_ARGS="-DJAXQUANT_CUDA_ARCHS=${JQ_CUDA_ARCHS:-90-real} -DJAXQUANT_ENABLE_ROCM=OFF ${CMAKE_ARGS:-}"
SECONDS=0
$PY -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1
rc=$?; echo "pip rc=$rc in ${SECONDS}s"; tail -n 30 "$OUT/build.log"
$PY -c "import jaxquant.ffi as jf; print('loaded', jf.loaded_platforms()); [print(' ', p, l.path, l.error) for p, l in jf.libraries().items()]"

step "GPU tests"
timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_ffi.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40

if [ "${JQ_SKIP_SANITIZER:-0}" != 1 ]; then
  step "compute-sanitizer on the kernels (tools/cuda/sanitize_driver.hip, no JAX)"
  LIBDIR=$($PY -c "import jaxquant.ffi as jf; print(jf.libraries()['cuda'].path.parent)")
  nvcc -x cu -std=c++17 -O2 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 \
    -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/sanitize_driver.hip -L"$LIBDIR" -ljaxquant_cuda \
    -Xlinker -rpath="$LIBDIR" -o "$OUT/sanitize_driver" && {
    "$OUT/sanitize_driver" | tail -n 8
    for tool in memcheck racecheck; do
      timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 "$OUT/sanitize_driver" \
        > "$OUT/sanitizer_$tool.log" 2>&1
      echo "compute-sanitizer --tool $tool rc=$?"; grep -E "ERROR SUMMARY|ALL OK|FAILED" "$OUT/sanitizer_$tool.log" | tail -n 3
    done
    rm -f "$OUT/sanitize_driver"
  }
fi

if [ "${JQ_SKIP_BENCH:-0}" != 1 ]; then
  step "benchmark"
  timeout 240 $PY -m jaxquant bench qmm --shapes "1,4096,14336;1,14336,4096" \
    --modes affine4,mxfp4 ${JQ_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 30
fi
step "done"
