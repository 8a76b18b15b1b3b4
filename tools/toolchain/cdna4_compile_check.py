#!/usr/bin/env python3
"""Compile gpu_src/rocm/cdna4_qmm.hip for gfx950 and look for the scaled MFMA.

  python tools/toolchain/cdna4_compile_check.py [--keep DIR]

Uses clang >= 20 with the AMDGPU backend: $JQ_GFX950_CLANG (a clang++ that
knows gfx950, e.g. ROCm's), else the `ziglang` wheel's clang
(tools/toolchain/install_gfx950_toolchain.sh) run as `zig clang`, with its lld for the
link. Headers: the HIP headers and clang's resource headers (for the HIP
wrapper headers, which the ziglang wheel does not ship) of
tools/toolchain/install_hip_toolchain.sh (clang-19, libamdhip64-dev), device code only
(-nogpulib, gpu_src/common/jq_hip.h's JQ_HIP_NOGPULIB helpers).

Two compiles: -S (the assembly, whose v_mfma_scale_f32_16x16x128_f8f6f4 lines
are counted with their op_sel byte choices) and -c (assembled and linked into
a gfx950 code object, whose ELF e_flags name the machine). Prints one JSON
line; exit status 0 when both compiled, 3 when the toolchain is missing
(skipped, with the reason), 1 on a compile failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from native_compile_check import ffi_include  # the same XLA FFI headers

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = "gpu_src/rocm/cdna4_qmm.hip"
MNEMONIC = "v_mfma_scale_f32_16x16x128_f8f6f4"
EF_AMDGPU_MACH_GFX950 = 0x4F
_MFMA_LINE = re.compile(rf"^\s*{MNEMONIC}\s+(.*)$", re.M)


def find_toolchain() -> tuple[list[str] | None, str]:
    """(clang command, why not) for a gfx950-capable clang."""
    env_clang = os.environ.get("JQ_GFX950_CLANG")
    if env_clang:
        path = shutil.which(env_clang)
        return ([path], "") if path else (None, f"$JQ_GFX950_CLANG={env_clang} not found")
    try:
        import ziglang  # noqa: PLC0415
    except ImportError:
        return None, "no gfx950 clang: run tools/toolchain/install_gfx950_toolchain.sh (ziglang)"
    zig = pathlib.Path(ziglang.__file__).parent / "zig"
    if not zig.is_file():
        return None, f"the ziglang package has no zig binary at {zig}"
    return [str(zig), "clang"], ""


def lld_shim(clang: list[str], folder: pathlib.Path) -> dict[str, str]:
    """clang's HIP link step runs `lld -flavor gnu ...`; zig ships lld as `zig ld.lld`:
    a `lld` script in `folder`, and the PATH that finds it (zig's clang only)."""
    if len(clang) != 2:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "lld"
    shim.write_text(f'#!/bin/sh\n[ "$1" = "-flavor" ] && shift 2\nexec "{clang[0]}" ld.lld "$@"\n')
    shim.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}


def resource_dir() -> str | None:
    """clang-19's resource directory (HIP wrapper headers), if installed."""
    for cand in ("clang++-19", "clang-19"):
        exe = shutil.which(cand)
        if exe:
            out = subprocess.run([exe, "-print-resource-dir"], capture_output=True, text=True)
            d = out.stdout.strip()
            if out.returncode == 0 and (pathlib.Path(d) / "include/__clang_hip_runtime_wrapper.h").is_file():
                return d
    return None


def compile_cmd(clang: list[str], res_dir: str | None, out: pathlib.Path, mode: str) -> list[str]:
    cmd = clang + ["-x", "hip", "-std=c++17", "-O3", "-nogpulib", "--rocm-path=/usr",
                   # clang >= 21 dropped this predefined macro; HIP 5.2's headers read it.
                   "-D__AMDGCN_WAVEFRONT_SIZE=64", "-DJQ_HIP_NOGPULIB", "-Iinclude", "-Igpu_src/common",
                   "-isystem", ffi_include(), "--offload-arch=gfx950", "--offload-device-only",
                   "--no-gpu-bundle-output", "-Wno-unused-command-line-argument"]
    if res_dir and len(clang) == 2:  # the zig clang: borrow the HIP wrapper headers
        cmd += ["-resource-dir", res_dir]
    return cmd + [mode, SOURCE, "-o", str(out)]


def elf_mach(path: pathlib.Path) -> int | None:
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    (e_flags,) = struct.unpack_from("<I", data, 48)
    return e_flags & 0xFF


def check(keep: str | None = None) -> tuple[int, dict]:
    summary: dict = {"source": SOURCE, "arch": "gfx950"}
    clang, why = find_toolchain()
    if clang is None:
        summary["skipped"] = why
        return 3, summary
    if not pathlib.Path("/usr/include/hip/hip_runtime.h").is_file():
        summary["skipped"] = "no HIP headers (run tools/toolchain/install_hip_toolchain.sh)"
        return 3, summary
    res_dir = resource_dir()
    if len(clang) == 2 and res_dir is None:
        summary["skipped"] = "no clang-19 resource headers (run tools/toolchain/install_hip_toolchain.sh)"
        return 3, summary
    version = subprocess.run(clang + ["--version"], capture_output=True, text=True).stdout
    summary["clang"] = version.splitlines()[0] if version else "?"
    with tempfile.TemporaryDirectory(prefix="jq_cdna4_") as tmp:
        return _compile(clang, res_dir, pathlib.Path(keep or tmp), summary)


def _compile(clang, res_dir, out_dir: pathlib.Path, summary: dict) -> tuple[int, dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **lld_shim(clang, out_dir / "bin")}
    t0 = time.time()
    for mode, name in (("-S", "cdna4_qmm.s"), ("-c", "cdna4_qmm.hsaco")):
        p = subprocess.run(compile_cmd(clang, res_dir, out_dir / name, mode), cwd=ROOT,
                           capture_output=True, text=True, env=full_env, timeout=600)
        if p.returncode != 0:
            summary["failed"] = f"{mode}: {(p.stdout + p.stderr)[-4000:]}"
            return 1, summary
    summary["seconds"] = round(time.time() - t0, 1)
    asm = (out_dir / "cdna4_qmm.s").read_text()
    lines = _MFMA_LINE.findall(asm)
    summary["mfma_scale_count"] = len(lines)
    # op_sel_b picks the weight scale's byte: (lo, hi) bits of op_sel / op_sel_hi's 2nd entry.
    bytes_used, x_bytes = set(), set()
    for operands in lines:
        a_lo = re.search(r"\bop_sel:\[(\d),\d,\d\]", operands)
        a_hi = re.search(r"\bop_sel_hi:\[(\d),\d,\d\]", operands)
        x_bytes.add(int(a_lo.group(1) if a_lo else 0) + 2 * int(a_hi.group(1) if a_hi else 0))
        lo = re.search(r"\bop_sel:\[\d,(\d),\d\]", operands)
        hi = re.search(r"\bop_sel_hi:\[\d,(\d),\d\]", operands)
        bytes_used.add(int(lo.group(1) if lo else 0) + 2 * int(hi.group(1) if hi else 0))
        if "blgp:4" not in operands or "cbsz:" in operands:
            summary.setdefault("unexpected_formats", []).append(operands)
    summary["weight_scale_bytes"] = sorted(bytes_used)
    summary["x_scale_bytes"] = sorted(x_bytes)
    summary["kernels"] = sorted(set(re.findall(r"^(_ZN\S*qmm_kernel\S*):", asm, re.M)))
    summary["code_object_mach"] = elf_mach(out_dir / "cdna4_qmm.hsaco")
    summary["code_object_is_gfx950"] = summary["code_object_mach"] == EF_AMDGPU_MACH_GFX950
    return 0, summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="write the .s and code object into this folder")
    args = ap.parse_args(argv)
    code, summary = check(args.keep)
    print(json.dumps(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
