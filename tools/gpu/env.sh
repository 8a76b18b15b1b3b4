# Sourced by tools/gpu/check_decode.sh and check_ffi.sh: the repository root as
# the working directory, $OUT (default /tmp/jq_gpu_out) made, the environment of every
# GPU run, $PY, `step TITLE` (a timed section header) and the device's line as the first
# section.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/jq_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
