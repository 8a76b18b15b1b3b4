#!/usr/bin/env bash
# The tensor-core decode GEMV (issue 11) on the GPU machine, in one call: build
# (sm_90 only), GPU tests (the fused GEMVs included), compute-sanitizer memcheck of the kernels (bad ids
# included), benchmarks (copy bandwidth, torch peers), a short table last.
#   bash tools/gpu/check_decode.sh     (logs under $OUT, default /tmp/jq_gpu_out)
# JQ_SKIP_TESTS=1, JQ_SKIP_SANITIZER=1, JQ_SKIP_BENCH=1, JQ_BENCH_ONLY=qmm,peers,moe,step, JQ_BENCH_MODES;
# JQ_SWEEP="VAR=a VAR=b": a benchmark once per setting (JQ_SWEEP_ARGS, default qmm at M = 1, 8,
#   16: JQ_SWEEP="JAXQUANT_MMA_TILES=1 JAXQUANT_MMA_TILES=2");
# JQ_TESTS (test files) and JQ_BENCH (scenario) are set by check_prefill.sh.
set -uo pipefail
source "$(dirname "$0")/env.sh"

step "build (sm_90)"
if [ "${JQ_SKIP_BUILD:-0}" != 1 ]; then
  export CMAKE_ARGS="-DJAXQUANT_CUDA_ARCHS=90-real -DJAXQUANT_ENABLE_ROCM=OFF ${CMAKE_ARGS:-}"
  SECONDS=0
  $PY -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1
  echo "pip rc=$? in ${SECONDS}s"; grep -iE "error|warning: .*qmv_mma" "$OUT/build.log" | head -20
fi
$PY -c "import jaxquant.ffi as jf; print('loaded', jf.loaded_platforms()); [print(' ', p, l.path, l.error) for p, l in jf.libraries().items()]"
LIBDIR=$($PY -c "import jaxquant.ffi as jf; print(jf.libraries()['cuda'].path.parent)")
if command -v cuobjdump > /dev/null; then
  cuobjdump -sass "$LIBDIR/libjaxquant_cuda.so" -fun '_ZN2jq3gpu3mma14qmv_mma_kernelINS_5CodecILi0ELi4EEELi2ELi1ELi1EEEvNS1_7ProblemE' \
    > "$OUT/sass_affine4_bf16_m8.txt" 2>&1
  echo "SASS affine4/bf16/M<=8:"; grep -oE "LDG\.E\.[0-9A-Z.]+|HMMA\.[0-9A-Z.]+|LOP3\.LUT|PRMT|I2F[A-Z0-9.]*" "$OUT/sass_affine4_bf16_m8.txt" | sort | uniq -c
fi

if [ "${JQ_SKIP_TESTS:-0}" != 1 ]; then
  step "GPU tests"
  timeout ${JQ_TEST_TIMEOUT:-420} $PY -m pytest -q -m gpu -p no:cacheprovider -rs ${JQ_TESTS:-tests/test_decode_gpu.py tests/test_fused.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30
  if [ -z "${JQ_TESTS:-}" ]; then
    step "GPU tests, two tiles per block wherever built (JAXQUANT_MMA_TILES=2: M > 8, and 4-bit codes at M <= 8)"
    JAXQUANT_MMA_TILES=2 timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_decode_gpu.py \
      -k "every_mode or long_k or gather or scan" 2>&1 | tee "$OUT/gpu_tests_tiles2.log" | tail -n 5
  fi
  if [[ "${JQ_TESTS:-}" == *test_prefill_gpu* ]]; then
    step "GPU tests, the mma.sync GEMM where the wgmma one would run (JAXQUANT_GEMM_KERNEL=mma)"
    JAXQUANT_GEMM_KERNEL=mma timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_prefill_gpu.py \
      -k "qmm or ragged" 2>&1 | tee "$OUT/gpu_tests_mma_gemm.log" | tail -n 5
    step "GPU tests, the wgmma GEMM's warps making their own copies (JAXQUANT_WGMMA_PRODUCER=0)"
    JAXQUANT_WGMMA_PRODUCER=0 timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_prefill_gpu.py \
      -k "qmm or ragged" 2>&1 | tee "$OUT/gpu_tests_wgmma_no_producer.log" | tail -n 5
  fi
fi

if [ "${JQ_SKIP_SANITIZER:-0}" != 1 ]; then
  step "compute-sanitizer memcheck on the cuda_mma kernels (tools/cuda/sanitize_mma_driver.hip, no JAX)"
  nvcc -x cu -std=c++17 -O2 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 \
    -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/sanitize_mma_driver.hip -L"$LIBDIR" -ljaxquant_cuda \
    -Xlinker -rpath="$LIBDIR" -o "$OUT/sanitize_mma_driver" && {
    "$OUT/sanitize_mma_driver" | tail -n 4
    # defaults (the wgmma GEMM on sm_90, 64 or 128 rows of x per block at these sizes),
    # then two tiles per GEMV block wherever built with the mma.sync GEMM, then 256 rows,
    # then the wgmma GEMM without its producer warp
    for setting in ${JQ_SANITIZER_SETTINGS:-JAXQUANT_DEFAULTS=1 "JAXQUANT_MMA_TILES=2 JAXQUANT_GEMM_KERNEL=mma" JAXQUANT_WGMMA_BN=256 JAXQUANT_WGMMA_PRODUCER=0}; do
      log="$OUT/sanitizer_memcheck_${setting%%=*}.log"
      env $setting timeout ${JQ_SANITIZER_TIMEOUT:-240} compute-sanitizer --tool memcheck \
        --error-exitcode 9 "$OUT/sanitize_mma_driver" > "$log" 2>&1
      echo "compute-sanitizer --tool memcheck ($setting) rc=$?"
      grep -E "ERROR SUMMARY|ALL OK|FAILED" "$log" | tail -n 3
    done
    rm -f "$OUT/sanitize_mma_driver"
  }
fi

if [ -n "${JQ_NCU:-}" ] && command -v ncu > /dev/null; then
  step "ncu: the first qmv_mma launch at M=1 (4096 -> 14336, affine4)"
  timeout 200 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis -k regex:qmv_mma_kernel -c 1 \
    $PY -c "
import os, jax, jax.numpy as jnp, jaxquant as jq
w = 0.05 * jax.random.normal(jax.random.key(0), (14336, 4096), jnp.float32)
q = jq.prepack(jq.quantize(w.astype(jnp.bfloat16), mode='affine', bits=4, group_size=64), 'cuda_mma')
x = jnp.ones((1, 4096), jnp.bfloat16)
jax.block_until_ready(jax.jit(jq.qmm)(x, q)); os._exit(0)" > "$OUT/ncu_gemv_mma_affine4.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Issued Warp|Theoretical Occ|Waves Per SM" "$OUT/ncu_gemv_mma_affine4.txt" | head -30
fi

if [ -n "${JQ_WARPS_SWEEP:-}" ]; then
  step "sweep: warps per block (JAXQUANT_MMA_WARPS), M=1 affine4/mxfp4"
  for w in $JQ_WARPS_SWEEP; do
    echo "--- JAXQUANT_MMA_WARPS=$w"
    JAXQUANT_MMA_WARPS=$w timeout 120 $PY -m jaxquant bench decode --only qmm --modes affine4,mxfp4 --ms 1 2>&1 | grep "ffi mma"
  done
fi

if [ -n "${JQ_SWEEP:-}" ]; then
  step "sweep: $JQ_SWEEP"
  for kv in $JQ_SWEEP; do
    echo "--- $kv"
    env "$kv" timeout ${JQ_SWEEP_TIMEOUT:-150} $PY -m jaxquant bench ${JQ_SWEEP_ARGS:-decode --only qmm --modes affine4,mxfp4 --ms 1,8,16} \
      2>&1 | grep -vE "^WARNING|^\[" | tee -a "$OUT/sweep.txt"
  done
fi

[ "${JQ_SKIP_BENCH:-0}" = 1 ] && { step "done"; exit 0; }
step "benchmarks"
timeout ${JQ_BENCH_TIMEOUT:-420} $PY -m jaxquant bench ${JQ_BENCH:-decode} \
  ${JQ_BENCH_ONLY:+--only $JQ_BENCH_ONLY} ${JQ_BENCH_MODES:+--modes $JQ_BENCH_MODES} 2>&1 | tee "$OUT/bench.log" | grep -v "^WARNING" | tail -n 80
step "done"
