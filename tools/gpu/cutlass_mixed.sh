#!/usr/bin/env bash
# CUTLASS's Hopper mixed-input GEMM (4-bit affine weights, bf16 x) against cuBLAS's bf16
# GEMM at kernel level, the peer of issue 49 (tools/cuda/cutlass_mixed_driver.cu, no JAX,
# no library build; docs/prefill.md "CUTLASS's mixed-input GEMM, for comparison"): the
# dense product at K = 4096, N = 14336, M = 64 / 512 / 4096 in each configuration, then
# gpt-oss-20b's experts as a grouped product, each checked against cuBLAS first.
# The GPU machine has no CUTLASS and no network: carry the nvidia-cutlass wheel (its
# headers are all the driver needs) and name it in $CUTLASS_WHEEL, e.g. copied into the
# repository's ignored .gpulib/:
#   CUTLASS_WHEEL=.gpulib/nvidia_cutlass-4.2.0.0-py3-none-any.whl bash tools/gpu/cutlass_mixed.sh [driver options]
# Driver options (--m=..., --configs=..., --mode=dense|grouped|all; default --mode=all) go
# to the driver as they are. Output: $OUT/cutlass_mixed.txt (default OUT /tmp/jq_gpu_out),
# the build log $OUT/cutlass_build.log. A driver built elsewhere (nvcc takes minutes on two
# cores) is used as is when $JQ_CUTLASS_DRIVER names it; then no wheel is needed.
set -uo pipefail
source "$(dirname "$0")/env.sh"

# The folder holding file $1 (a header or a library): the CUDA toolkit's, else one of the
# nvidia-* pip wheels' (nvidia/<name>/include, nvidia/<name>/lib), which is where the
# image's cuBLAS and cuRAND may be.
find_cuda_file() {
  local d nvcc_root
  nvcc_root=$(dirname "$(dirname "$(command -v nvcc)")")
  for d in "$nvcc_root/include" "$nvcc_root/lib64" "$nvcc_root/targets/x86_64-linux/include" \
           "$nvcc_root/targets/x86_64-linux/lib" /usr/local/cuda/include /usr/local/cuda/lib64; do
    if compgen -G "$d/$1" > /dev/null; then echo "$d"; return 0; fi
  done
  $PY - "$1" <<'PY'
import glob, os, sys
for p in sys.path:
    hits = sorted(glob.glob(os.path.join(p, "nvidia", "*", "*", sys.argv[1])))
    if hits:
        print(os.path.dirname(hits[-1]))
        break
PY
}

CUBLAS_LIB=$(find_cuda_file 'libcublas.so*')
if [ -z "$CUBLAS_LIB" ]; then echo "no libcublas found (toolkit or nvidia-cublas wheel)"; exit 1; fi
export LD_LIBRARY_PATH="$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

DRIVER=${JQ_CUTLASS_DRIVER:-}
if [ -z "$DRIVER" ]; then
  step "build the driver (sm_90a)"
  if [ ! -f "${CUTLASS_WHEEL:-}" ]; then
    echo "CUTLASS_WHEEL must name the nvidia-cutlass wheel (got '${CUTLASS_WHEEL:-}')"; exit 1
  fi
  src=$(mktemp -d)
  $PY -m zipfile -e "$CUTLASS_WHEEL" "$src" || exit 1
  cutlass="$src/cutlass_library/source"
  cublas_inc=$(find_cuda_file cublas_v2.h)
  # cutlass/util/mixed_dtype_utils.hpp (the weight reorder) includes cuRAND's device header.
  curand_inc=$(find_cuda_file curand_kernel.h)
  if [ -z "$cublas_inc" ] || [ -z "$curand_inc" ]; then
    echo "cublas_v2.h: '${cublas_inc}', curand_kernel.h: '${curand_inc}': one is missing"; exit 1
  fi
  # The toolkit's libcublas.so, or a wheel's libcublas.so.NN (wheels have no unversioned link).
  if [ -e "$CUBLAS_LIB/libcublas.so" ]; then cublas_link=-lcublas
  else cublas_link="-l:$(basename "$(ls "$CUBLAS_LIB"/libcublas.so.* | sort | head -1)")"; fi
  DRIVER="$OUT/cutlass_mixed_driver"
  nvcc --version | tail -2
  SECONDS=0
  nvcc -x cu -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a \
    --expt-relaxed-constexpr -I"$cutlass/include" -I"$cutlass/tools/util/include" \
    -I"$cublas_inc" -I"$curand_inc" tools/cuda/cutlass_mixed_driver.cu \
    -L"$CUBLAS_LIB" $cublas_link -Xlinker -rpath="$CUBLAS_LIB" -o "$DRIVER" \
    > "$OUT/cutlass_build.log" 2>&1
  rc=$?
  echo "nvcc rc=$rc in ${SECONDS}s"
  grep -E "error" "$OUT/cutlass_build.log" | head -20
  rm -rf "$src"
  [ $rc -eq 0 ] || exit 1
fi

step "the CUTLASS kernels' registers, stack, shared and local memory (cuobjdump)"
cuobjdump --dump-resource-usage "$DRIVER" 2>&1 | grep -A1 "Function _ZN7cutlass13device_kernel" \
  | grep -oE "REG:[0-9]+ STACK:[0-9]+ SHARED:[0-9]+ LOCAL:[0-9]+"

step "CUTLASS mixed-input vs cuBLAS bf16"
{
  echo "# command: $DRIVER --mode=all $*"
  "$DRIVER" --mode=all "$@"
  echo "# driver rc=$?"
} 2>&1 | tee "$OUT/cutlass_mixed.txt"
step "done"
