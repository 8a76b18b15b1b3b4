#!/usr/bin/env bash
# Issue 30's scaling targets on 2 GPUs of one host (nvidia-h100-x2 / nvidia-h200-x2):
# `python -m jaxquant bench model` on one device and on the 2-device mesh in the same
# process, the "vs 1 device" column being the scaling. Weights are drawn straight into
# their quantized, placed form (--init sharded: parallel.init_params), so 70B / 120B
# dimensions never need a float copy. One target per call (each fits a 10-minute
# device command):
#   TARGET=llama70b bash scripts/gpu_scaleout.sh   # Llama-3-70B dims, affine4, TP=2 (2x1):
#                                                  #   decode batch 1 (>= 1.6x), prefill 2048 (>= 1.8x)
#   TARGET=oss120b  bash scripts/gpu_scaleout.sh   # gpt-oss-120b dims, mxfp4, EP=2 (1x2):
#                                                  #   decode batch 1 (>= 1.4x) and 32 (>= 1.6x)
#   TARGET=oss20b   bash scripts/gpu_scaleout.sh   # gpt-oss-20b dims, every mode, EP=2 (1x2)
#                                                  #   and TP=2 (2x1): never below 1.0x
# LAYOUT=canonical: quantized weights in the canonical layout on every row. The default
# kernel layout (cuda_mma) splits on leading axes only, so on a tp mesh the ops gather
# a tp-split dense matrix (a UserWarning in the log says so): run llama70b both ways and
# compare the canonical 2x1 row with the default-layout 1-device row.
# LAYERS (a smaller depth if a full model's one-device baseline does not fit, e.g. 40 /
# 18: the scaling is per layer), LIMIT (seconds, default 570), EXTRA (more bench model
# options). Logs: $OUT/scaleout_$TARGET.txt (the tables at the end; "vs 1 device" per row).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
TARGET=${TARGET:-llama70b}
LIMIT=${LIMIT:-570}
nvidia-smi -L | tee -a "$OUT/gpu.txt"
case "$TARGET" in
  llama70b) args=(--configs llama3-70b --modes affine4 --batch 1 --prefill 2048 --mesh 2x1) ;;
  oss120b)  args=(--configs gpt-oss-120b --modes mxfp4 --batch 1,32 --prefill 512 --mesh 1x2) ;;
  oss20b)   args=(--configs gpt-oss-20b --modes bf16,affine4,affine8,mxfp4,nvfp4 --batch 1,32
                  --prefill 512 --mesh 1x2,2x1) ;;
  *) echo "TARGET must be llama70b, oss120b or oss20b; got $TARGET" >&2; exit 2 ;;
esac
[ -n "${LAYERS:-}" ] && args+=(--layers "$LAYERS")
[ -n "${LAYOUT:-}" ] && args+=(--layout "$LAYOUT")
log="$OUT/scaleout_$TARGET${LAYOUT:+_$LAYOUT}.txt"
step "bench model scale-out $TARGET"
# shellcheck disable=SC2086
timeout "$LIMIT" $PY -m jaxquant bench model "${args[@]}" --init sharded --peer none \
    --iters 3 ${EXTRA:-} 2>&1 | tee "$log"
echo "exit status ${PIPESTATUS[0]}" | tee -a "$log"
