#!/usr/bin/env bash
# ncu of the decode GEMV at M=1 on both (K, N) shapes, affine4 and mxfp4, plus a
# warps-per-block sweep: the profile behind benchmarks/RESULTS.md "Decode, second pass".
#   bash scripts/decode_profile.sh   (after a build; logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jq_gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
for shape in "4096 14336" "14336 4096"; do
  set -- $shape
  for mode in affine4 mxfp4; do
    f="$OUT/ncu_${mode}_k$1_n$2.txt"
    timeout 150 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      -k regex:qmv_mma_kernel -c 1 $PY - "$1" "$2" "$mode" > "$f" 2>&1 <<'PYEOF'
import os, sys, jax, jax.numpy as jnp, jaxquant as jq
k, n, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
w = 0.05 * jax.random.normal(jax.random.key(0), (n, k), jnp.float32)
kw = dict(mode="affine", bits=4, group_size=64) if mode == "affine4" else dict(mode="mxfp4")
q = jq.prepack(jq.quantize(w.astype(jnp.bfloat16), **kw), "cuda_mma")
x = jnp.ones((1, k), jnp.bfloat16)
jax.block_until_ready(jax.jit(jq.qmm)(x, q)); os._exit(0)
PYEOF
    echo "--- ncu $mode K=$1 N=$2 rc=$?"
    grep -E "^\s+(Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Block Limit [A-Z]|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Grid Size|Block Size|Dynamic Shared|Static Shared|Waves Per SM|Eligible Warps)" "$f" | sed 's/  */ /g'
  done
done
