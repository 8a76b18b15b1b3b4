#!/usr/bin/env bash
# Installs what the arm64 check of the CPU kernels (tests/test_cpu_kernels_isa.py) uses:
# Debian's aarch64 cross compiler (g++-aarch64-linux-gnu: GCC and the arm64 libstdc++
# to link statically) and qemu-user (qemu-user-static) to run the arm64 driver here.
# About 25 s and 60 MB of downloads on the CI machine kind. Safe to re-run; a machine
# without apt (or without root) skips with a message.
set -uo pipefail
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_aarch64_toolchain: no apt-get here; the arm64 kernel check will skip"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_aarch64_toolchain: not root; the arm64 kernel check will skip"; exit 0
fi
if command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64-static >/dev/null 2>&1; then
  echo "install_aarch64_toolchain: already installed"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { echo "install_aarch64_toolchain: apt-get update failed"; exit 0; }
apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu qemu-user-static >/dev/null \
  || { echo "install_aarch64_toolchain: apt-get install failed; the arm64 kernel check will skip"; exit 0; }
echo "install_aarch64_toolchain: $(aarch64-linux-gnu-g++ --version | head -1); $(qemu-aarch64-static --version | head -1)"
