#!/usr/bin/env bash
# The tensor-core prefill GEMM (issue 14) on the GPU machine, in one call: what
# check_decode.sh does (build, the GPU tests of both kernels on the cuda_mma
# layout, the sanitizer driver, which runs both) with the prefill benchmark.
#   bash tools/gpu/check_prefill.sh     (logs under $OUT, default /tmp/jq_gpu_out)
export JQ_TESTS="${JQ_TESTS:-tests/test_prefill_gpu.py tests/test_decode_gpu.py}"
export JQ_BENCH=prefill
exec bash "$(dirname "$0")/check_decode.sh"
