#!/usr/bin/env bash
# Installs a clang that knows gfx950 (CDNA4) for the compile check of
# gpu_src/rocm/cdna4_qmm.hip (tests/test_cdna4_kernel.py): Debian 12's apt stops at
# clang 19, which has neither the gfx950 target nor the scaled-MFMA builtins
# (clang >= 20). PyPI's `ziglang` wheel bundles clang + lld 22 with the AMDGPU
# backend; the check runs it as `zig clang` with the HIP headers and clang
# resource headers of tools/toolchain/install_hip_toolchain.sh (run that first).
# About 20 s and 400 MB. Safe to re-run; failure only makes the check skip.
set -uo pipefail
ZIGLANG_VERSION=0.17.1
start=$(date +%s)
PY=${PYTHON:-python}
if "$PY" -c "import ziglang, sys; sys.exit(0)" 2>/dev/null \
    && [ "$("$PY" -m pip show ziglang 2>/dev/null | sed -n 's/^Version: //p')" = "$ZIGLANG_VERSION" ]; then
  echo "install_gfx950_toolchain: ziglang $ZIGLANG_VERSION already installed"
else
  "$PY" -m pip install -q "ziglang==$ZIGLANG_VERSION" \
    || { echo "install_gfx950_toolchain: pip install ziglang failed; the gfx950 check will skip"; exit 0; }
fi
echo "install_gfx950_toolchain: $("$PY" -m ziglang clang --version | head -1) ($(( $(date +%s) - start )) s)"
