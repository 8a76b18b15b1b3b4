#!/usr/bin/env bash
# `python -m jaxquant bench model` on one NVIDIA GPU: decode and prefill tok/s, % of the
# weight-read bound, the torch (gpt-fast style) peer and a per-step profile, for one
# config per call (each call fits a 10-minute device command):
#   CONFIG=llama3-8b bash tools/gpu/bench_model.sh     # + the torch peer, bf16 and int4
#   CONFIG=gpt-oss-20b bash tools/gpu/bench_model.sh   # MoE: no peer
# MODES (default bf16,affine4,mxfp4), BATCH (1,8), LIMIT (seconds, default 560), EXTRA
# (more bench model options, e.g. "--forward-kw experts_by_layer=True" or
# "--xla-flags=--xla_gpu_enable_command_buffer="). The log streams to
# $OUT/bench_model_$CONFIG.txt (a row's numbers on stderr as soon as measured, the tables
# and profiles on stdout at the end); the traces stay under /tmp.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
CONFIG=${CONFIG:-llama3-8b}
LIMIT=${LIMIT:-560}
log="$OUT/bench_model_$CONFIG.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee -a "$OUT/gpu.txt"
step "bench model $CONFIG"
# shellcheck disable=SC2086
timeout "$LIMIT" $PY -m jaxquant bench model --configs "$CONFIG" \
    --modes "${MODES:-bf16,affine4,mxfp4}" --batch "${BATCH:-1,8}" --profile \
    --profile-dir "/tmp/jaxquant_profile_$CONFIG" ${EXTRA:-} 2>&1 | tee "$log"
echo "exit status ${PIPESTATUS[0]}" | tee -a "$log"
