#!/usr/bin/env bash
# The Pallas decode-attention kernel (jq.decode_attention) on the GPU machine, in one
# call (about 6 min on an H100): GPU tests, compute-sanitizer memcheck of one split case
# and one window/sinks case (the masked loads at the cache's and the heads' edges), then
# tools/gpu/attention_bench.py (reference vs Pallas vs cuDNN; full and half-full caches).
# The caller has already run `pip install --no-build-isolation --no-deps -e .`.
#   bash tools/gpu/check_attention.sh        (logs under $OUT, default /tmp/jq_gpu_out)
# JQ_SKIP_TESTS=1, JQ_SKIP_SANITIZER=1, JQ_SKIP_BENCH=1; JQ_SWEEP=1 adds the config sweep
# at B=1, S=8192 for both models.
set -uo pipefail
source "$(dirname "$0")/env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "${JQ_SKIP_TESTS:-0}" != 1 ]; then
  step "GPU tests (tests/test_pallas_attention.py -m gpu)"
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs --durations=5 \
    tests/test_pallas_attention.py 2>&1 | tee "$OUT/attention_gpu_tests.log" | tail -n 20
fi

if [ "${JQ_SKIP_SANITIZER:-0}" != 1 ] && command -v compute-sanitizer > /dev/null; then
  step "compute-sanitizer memcheck (one process per test)"
  PY=$PY bash tools/gpu/memcheck_tests.sh "$OUT" \
    "tests/test_pallas_attention.py::test_kernel_matches_oracle_and_reference[gptoss_b1_t8_window]" \
    tests/test_pallas_attention.py::test_no_visible_key_and_positions_past_the_cache
fi

if [ "${JQ_SKIP_BENCH:-0}" != 1 ]; then
  step "benchmark: full caches"
  OUT=$OUT timeout 300 $PY tools/gpu/attention_bench.py 2>&1 | tee "$OUT/attention_bench.log" \
    | grep -v "^\[bench\]"
  step "benchmark: half-full caches (the kernel reads the visible half only)"
  mkdir -p "$OUT/half"
  OUT=$OUT/half timeout 200 $PY tools/gpu/attention_bench.py --fill 0.5 --lengths 2048,8192 \
    2>&1 | grep -E "^\||^# [a-z]" | grep -v "^\[bench\]"
  step "benchmark: a layer scan over stacked caches (layer= read in place vs cache[i] sliced)"
  mkdir -p "$OUT/stacked"
  OUT=$OUT/stacked timeout 200 $PY tools/gpu/attention_bench.py --stacked --lengths 2048 \
    2>&1 | grep -E "^\||^# [a-z]"
  if [ "${JQ_SWEEP:-0}" = 1 ]; then
    step "config sweep (B=1, S=8192)"
    mkdir -p "$OUT/sweep"
    OUT=$OUT/sweep timeout 300 $PY tools/gpu/attention_bench.py --sweep \
      --cases llama3-8b:1:8192,gpt-oss-20b:1:8192,llama3-8b:8:2048 2>&1 | grep -E "^\||^# [a-z]"
  fi
fi
