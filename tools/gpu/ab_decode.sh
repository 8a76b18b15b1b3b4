#!/usr/bin/env bash
# Kernel-level A/B of the decode GEMV (gpu_src/cuda/gemv_mma.h) against another revision's,
# in one process (tools/cuda/ab_mma_driver.hip; no JAX, no library build): every shape
# old / new / old / new, the best of each, as % of the same process's copy bandwidth,
# outputs compared bit for bit. Needs an NVIDIA GPU (sm_90 here) and nvcc.
#
#   bash tools/gpu/ab_decode.sh [REV]     # REV: a git revision, default HEAD
#
# The other revision's gemv_mma.h is compiled next to this tree's with its namespace
# renamed (mma -> mma_old); the headers it includes are this tree's, so REV must share
# them (and the launcher's interface: Problem with the fused variants' aux / aux_dt / eps,
# launch_formats, GemvLaunch, FusedGemvLaunch). Revisions before the sources moved to
# gpu_src/ hold the header as hip_src/qmv_mma.h.
set -euo pipefail
cd "$(dirname "$0")/../.."
REV=${1:-HEAD}
DIR=${OUT:-build}/ab_decode
mkdir -p "$DIR"
{ git show "$REV:gpu_src/cuda/gemv_mma.h" 2>/dev/null || git show "$REV:hip_src/qmv_mma.h"; } | sed 's/^namespace mma {/namespace mma_old {/' > "$DIR/gemv_mma_old.h"
nvcc -x cu -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 \
  -Iinclude -Igpu_src/common -Igpu_src/cuda -Itools/cuda -I"$DIR" tools/cuda/ab_mma_driver.hip -o "$DIR/ab_mma_driver"
echo "# old: $REV ($(git rev-parse --short "$REV")); new: the working tree"
"$DIR/ab_mma_driver"
