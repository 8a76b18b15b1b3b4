#!/usr/bin/env bash
# Kernel-level timing of the decode GEMV's variants (tools/cuda/tune_mma_driver.hip, no
# JAX, no library build): stages, x staged early or late, warps per block, x from
# shared memory or L1, programmatic dependent launch, time against K, and the
# references at the same sizes (empty kernel, read-only kernel, D2D copy).
#   bash tools/gpu/tune_decode.sh        (log under $OUT, default /tmp/jq_gpu_out)
# A driver built elsewhere (e.g. on a machine without a GPU) is used as is when
# $JQ_TUNE_DRIVER names it.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DRIVER=${JQ_TUNE_DRIVER:-$OUT/tune_mma_driver}
if [ ! -x "$DRIVER" ]; then
  step "build the driver (sm_90)"
  nvcc -x cu -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 \
    -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/tune_mma_driver.hip -o "$DRIVER" || exit 1
fi
step "variants at the issue's shapes"
"$DRIVER" | tee "$OUT/tune_variants.txt"
step "references, time against K, programmatic dependent launch"
"$DRIVER" pdl | tee "$OUT/tune_pdl.txt"
step "done"
