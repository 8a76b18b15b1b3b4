#!/usr/bin/env bash
# Installs the compilers the ROCm compile checks (tests/test_ffi_toolchain.py) use:
# Debian's clang-19 + lld-19 (AMDGPU backend, HIP language) and the HIP 5.2 headers.
# Safe to re-run; a machine without apt (or without root) skips with a message.
set -uo pipefail
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_hip_toolchain: no apt-get here; ROCm compile checks will skip"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_hip_toolchain: not root; ROCm compile checks will skip"; exit 0
fi
if command -v clang++-19 >/dev/null 2>&1 && command -v ld.lld-19 >/dev/null 2>&1 \
    && [ -f /usr/include/hip/hip_runtime.h ]; then
  echo "install_hip_toolchain: already installed"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { echo "install_hip_toolchain: apt-get update failed"; exit 0; }
apt-get install -y -qq --no-install-recommends clang-19 lld-19 libamdhip64-dev >/dev/null \
  || { echo "install_hip_toolchain: apt-get install failed; ROCm compile checks will skip"; exit 0; }
echo "install_hip_toolchain: $(clang++-19 --version | head -1)"
