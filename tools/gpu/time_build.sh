#!/usr/bin/env bash
# The README set-up's native build on the GPU machine, timed (docs/building.md): a clean
# copy of the tree, `pip wheel --no-build-isolation --no-deps .` (the CMake build that
# `pip install -e .` runs, installing nothing), the build's decision line, what the wheel
# holds, then the wheel installed in a throwaway venv and its CUDA library run against
# the reference. Default options only: the build must pick the GPU by itself.
#   bash tools/gpu/time_build.sh     (logs under $OUT, default /tmp/jq_gpu_out)
set -uo pipefail
source "$(dirname "$0")/env.sh"

step "build: pip wheel of a clean copy ($(nproc) cores)"
src=$(mktemp -d)
tar --exclude=./build --exclude=./gpu_logs -cf - . | tar -xf - -C "$src"
SECONDS=0
$PY -m pip wheel -v --no-build-isolation --no-deps -w "$src/dist" "$src" > "$OUT/build_time.log" 2>&1
echo "pip wheel rc=$? in ${SECONDS}s"
grep -E "jaxquant: |error" "$OUT/build_time.log" | head -20
wheel=$(ls "$src"/dist/jaxquant-*.whl)
$PY -m zipfile -l "$wheel" | grep -v "\.py "

step "the wheel, installed in a venv: its CUDA library against the reference"
venv=$(mktemp -d)
$PY -m venv --system-site-packages "$venv" && "$venv/bin/python" -m pip install -q --no-deps "$wheel"
(cd /tmp && "$venv/bin/python" - <<'PY'
import jax, jax.numpy as jnp, numpy as np
import jaxquant as jq, jaxquant.ffi as jf
print("jaxquant from", jq.__file__)
for p, lib in jf.libraries().items():
    print(" ", p, lib.path if lib.handle is not None else lib.error)
assert jf.libraries()["cuda"].handle is not None
w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)
x = jax.random.normal(jax.random.key(1), (8, 4096), jnp.bfloat16)
for mode in ("affine", "mxfp4", "nvfp4"):
    qw = jq.quantize(w, mode)
    with jq.backend("ffi"):
        y = jax.jit(jq.qmm)(x, qw)
    with jq.backend("reference"):
        r = jax.jit(jq.qmm)(x, qw)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - r.astype(jnp.float32))))
    print(f"{mode}: ffi vs reference max abs diff {err:.4g} (|ref| max {float(jnp.max(jnp.abs(r))):.4g})")
PY
) 2>&1 | tee "$OUT/wheel_check.txt"
rm -rf "$src" "$venv"
