#!/usr/bin/env bash
# One process per GPU (docs/sharding.md's launch recipe, as written there) on a host
# with 2 GPUs: `python -m tests.multiprocess_cases ID 2 PORT gpu` twice, each process
# seeing one GPU (CUDA_VISIBLE_DEVICES), joined by jax.distributed.initialize (NCCL),
# against one process holding both GPUs: a dense float, an MXFP4 MoE and an affine4
# dense model (the GPU's default kernel layout) on a 2 x 1 mesh, greedy tokens each.
# Prints "two processes: same tokens as one process" or the difference; exit 1 then.
# LIMIT (seconds per launch, default 150).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
LIMIT=${LIMIT:-150}
port=$((20000 + RANDOM % 20000))
step "one process, GPUs 0 and 1"
CUDA_VISIBLE_DEVICES=0,1 timeout "$LIMIT" $PY -m tests.multiprocess_cases 0 1 "$port" gpu \
    > "$OUT/mp_one.json" 2> "$OUT/mp_one.err" || tail -5 "$OUT/mp_one.err"
step "two processes, one GPU each"
port=$((port + 1))
CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" $PY -m tests.multiprocess_cases 0 2 "$port" gpu \
    > "$OUT/mp_0.json" 2> "$OUT/mp_0.err" &
CUDA_VISIBLE_DEVICES=1 timeout "$LIMIT" $PY -m tests.multiprocess_cases 1 2 "$port" gpu \
    > "$OUT/mp_1.json" 2> "$OUT/mp_1.err"
wait
tail -n 3 "$OUT/mp_0.err" "$OUT/mp_1.err"
$PY - "$OUT" <<'PY' | tee "$OUT/two_process.txt"
import json, sys
load = lambda n: json.loads(open(f"{sys.argv[1]}/{n}.json").read().strip().splitlines()[-1])
try:
    one, a, b = load("mp_one"), load("mp_0"), load("mp_1")
except Exception as e:  # noqa: BLE001 - a launch failed: its stderr is above
    print(f"two processes: no result ({type(e).__name__}: {e})"); sys.exit(1)
cases = sorted(k for k in one if k.endswith("/sharded"))
bad = [c for c in cases if not one[c]["tokens"] == a[c]["tokens"] == b[c]["tokens"]]
print(f"devices {one['devices']} (1 process), {a['devices']} ({a['process_count']} processes); "
      f"layouts {one.get('layouts')}; cases {cases}")
print("two processes: same tokens as one process" if not bad else f"two processes: DIFFER {bad}")
sys.exit(1 if bad else 0)
PY
