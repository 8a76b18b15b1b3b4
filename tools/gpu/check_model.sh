#!/usr/bin/env bash
# GPU check of jaxquant.models (issue 15): the demo (`python -m jaxquant`) at
# gpt-oss-20b's dimensions with random weights, bf16 vs affine4 vs mxfp4:
# prefill + decode tokens/s on one GPU, then sharded over two (expert
# parallel, 1x2; then tensor parallel, 2x1, if time is left).
# Each configuration runs in its own process under a timeout, and the demo
# reports a failing mode as FAILED and goes on, so a table is printed whatever
# fails. Full logs under $OUT; the summary last.
#   CONFIG=gpt-oss-20b (a demo preset), LAYERS=24, TOKENS=32, PROMPT=64, BUDGET=230 s.
set -u
OUT=${OUT:-/tmp/jaxquant_model_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CONFIG=${CONFIG:-gpt-oss-20b}
LAYERS=${LAYERS:-24}
TOKENS=${TOKENS:-32}
PROMPT=${PROMPT:-64}
BUDGET=${BUDGET:-230}
start=$SECONDS

nvidia-smi -L 2>&1 | tee "$OUT/gpus.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/jax.txt"

demo() {  # name timeout_s [demo args...]
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($*) ==="
    timeout "$limit" python3 -m jaxquant --config "$CONFIG" --layers "$LAYERS" \
        --modes bf16,affine4,mxfp4 --tokens "$TOKENS" --prompt-len "$PROMPT" "$@" \
        > "$OUT/$name.txt" 2>&1
    echo "exit status $?" >> "$OUT/$name.txt"
    tail -8 "$OUT/$name.txt"
}

left() { echo $((BUDGET - (SECONDS - start))); }

CUDA_VISIBLE_DEVICES=0 demo 1gpu "$(( BUDGET / 2 ))"
if [ "$(left)" -gt 60 ]; then demo 2gpu_ep_1x2 "$(( $(left) - 30 ))" --mesh 1x2; fi
if [ "$(left)" -gt 25 ]; then
    echo "=== kernels inside the partitioned program (all local GPUs) ==="
    timeout "$(left)" python3 tools/gpu/sharded_kernels.py > "$OUT/sharded_kernels.txt" 2>&1
    echo "exit status $?" >> "$OUT/sharded_kernels.txt"
fi
if [ "$(left)" -gt 150 ]; then demo 2gpu_tp_2x1 "$(( $(left) - 20 ))" --mesh 2x1; fi

echo
echo "===== summary ($CONFIG dims, $LAYERS layers, batch 1, prompt $PROMPT, $TOKENS new tokens) ====="
head -1 "$OUT/gpus.txt"
for f in "$OUT"/1gpu.txt "$OUT"/2gpu_*.txt; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .txt)"
    grep -aoE "done [a-z0-9]+: .*|^mode .*|^(bf16|affine4|mxfp4) .*|FAILED.*|exit status.*" "$f" \
        || tail -3 "$f"
done
echo "--- kernels per shard"
grep -E "^(qmm|gather|ragged)|exit status" "$OUT/sharded_kernels.txt" 2>/dev/null
echo "elapsed $((SECONDS - start)) s"
