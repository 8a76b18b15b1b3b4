#!/usr/bin/env bash
# Tensor and expert parallel on the GPUs of one host, everything in one call (one
# 10-minute device command per machine kind; about 9 minutes with compilation):
#   bash tools/gpu/scaleout.sh      # on nvidia-h100-x2 or nvidia-h100-x4
# In the GPU's default kernel layout (cuda_mma), with --init sharded (weights drawn
# straight into their placed, quantized form: parallel.init_params):
#   1. Llama-3-70B dims affine4: 1 GPU, TP=2 (and TP=4 on 4 GPUs); decode batch 1,
#      prefill 2048 (targets: TP=2 >= 1.6x, TP=4 >= 2.5x, prefill TP=2 >= 1.8x)
#   2. Llama-3-70B dims bf16: the same meshes, % of the bound of the weights each GPU
#      reads (target >= 70%)
#   3. gpt-oss (120b dims on 2 GPUs, 20b dims on 4): mxfp4, EP (1x2 / 1x2,1x4) and
#      TP=2, batch 1 and 32, prefill 512 (targets: 120b EP=2 >= 1.4x at batch 1,
#      >= 1.6x at 32; 20b never below 1.0x)
#   4. two processes of one GPU each against one process with two (tools/gpu/two_process.sh)
#   5. pytest tests/test_sharding_gpu.py (the sharded default-layout model on 2 GPUs)
# Each part has its own time limit (LIMIT_LLAMA, LIMIT_BF16, LIMIT_OSS, LIMIT_MP,
# LIMIT_PYTEST, seconds); LAYERS (default 8: the scaling is per layer; the depth keeps
# each part's compiles within its limit). The table of every part is printed last
# ("vs best 1 device": against the best one-GPU run of the config and batch, any
# mode, in this process). Logs: $OUT/scaleout_*.txt.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
GPUS=$(nvidia-smi -L | wc -l)
LAYERS=${LAYERS:-8}
if [ "$GPUS" -ge 4 ]; then
  TP_MESH=2x1,4x1; OSS=gpt-oss-20b; OSS_MESH=1x2,1x4,2x1
else
  TP_MESH=2x1; OSS=gpt-oss-120b; OSS_MESH=1x2,2x1
fi
bench() {  # name limit args...
  local name=$1 limit=$2; shift 2
  step "$name (limit ${limit}s)"
  # shellcheck disable=SC2086
  timeout "$limit" $PY -m jaxquant bench model "$@" --layers "$LAYERS" --init sharded \
      --peer none --iters 3 ${EXTRA:-} 2>&1 | tee "$OUT/scaleout_$name.txt"
  echo "exit status ${PIPESTATUS[0]}" | tee -a "$OUT/scaleout_$name.txt"
}
bench llama70b_affine4 "${LIMIT_LLAMA:-150}" --configs llama3-70b --modes affine4 --batch 1 \
    --prefill 2048 --mesh "$TP_MESH"
bench llama70b_bf16 "${LIMIT_BF16:-90}" --configs llama3-70b --modes bf16 --batch 1 \
    --prefill 0 --mesh "$TP_MESH"
bench oss "${LIMIT_OSS:-140}" --configs "$OSS" --modes mxfp4 --batch 1,32 --prefill 512 \
    --mesh "$OSS_MESH"
step "two processes (limit ${LIMIT_MP:-45}s each launch)"
LIMIT=${LIMIT_MP:-45} bash tools/gpu/two_process.sh 2>&1 | tail -4
step "pytest tests/test_sharding_gpu.py"
timeout "${LIMIT_PYTEST:-45}" $PY -m pytest -q -x -p no:cacheprovider tests/test_sharding_gpu.py \
    -k "not two_processes" 2>&1 | tail -3
step "tables"
for f in "$OUT"/scaleout_llama70b_affine4.txt "$OUT"/scaleout_llama70b_bf16.txt \
         "$OUT"/scaleout_oss.txt; do
  grep -E '^\|' "$f" | grep -vE '^\|---' ; grep -E '^exit status|failed' "$f" | tail -2
done
cat "$OUT/two_process.txt" 2>/dev/null
