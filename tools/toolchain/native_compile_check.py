#!/usr/bin/env python3
"""Compile checks of gpu_src/ for the GPU targets this machine cannot run.

  python tools/toolchain/native_compile_check.py rocm [--arch gfx942 ...]
  python tools/toolchain/native_compile_check.py cuda [--arch 80 90] [--ptxas-opt 3]

rocm: clang (clang++-19 from tools/toolchain/install_hip_toolchain.sh, or $JQ_HIP_CLANG)
  compiles every gpu_src/common and gpu_src/rocm source once per architecture, device code only
  (-nogpulib: no ROCm device libraries; jq_hip.h supplies the few helpers the
  HIP 5.2 headers call), plus the host side of the handlers once. Default
  architectures: gfx90a gfx942 gfx950 gfx1100 gfx1201; one the compiler does
  not know (gfx950 before clang 20) is reported as skipped, with the reason.
  gfx942 (wave64) and gfx1100 (wave32) go through the whole AMDGPU backend;
  gfx90a and gfx1201, the same source for the same wave size, stop at
  LLVM's IR (-S -emit-llvm at -O0: clang's code generation for the target,
  its builtins and features, without the optimizer and instruction selection:
  about a fifth of the backend's time); --backend-archs picks the first kind.
  The GEMV files build their default kernel variants only
  (-DJQ_QMV_DEFAULT_CONFIGS_ONLY), except for --all-qmv-configs (default
  gfx942), which builds every variant launch_qmv can launch, as the real build
  does; the summary lists the qmv_kernel variants found in each object
  ("qmv_kernels") and those gpu_src/common/gemv_impl.h launches ("qmv_launch_variants").
cuda: nvcc compiles every source of gpu_src/common and gpu_src/cuda for sm_80 and sm_90 and
  qmm_wgmma.hip for sm_90a (the architectures of JAXQUANT_CUDA_ARCHS=all), with
  ptxas at -O0 by default on the sources of PTXAS_FILES (every form of inline PTX;
  the others stop at PTX): ptxas still assembles every instruction, inline PTX
  included, for each target, without the register allocation and scheduling
  work that makes the release build (-O3, --ptxas-opt 3) about 10x slower
  (docs/building.md has the times). By default the kernels' covering set
  (-DJQ_MMA_COVERING_SET, gpu_src/cuda/gemv_mma.h: every codec in one variant of each
  kernel, affine 4-bit in every variant, float16/float32 x with affine 4-bit and MXFP4
  alone, float16 x in one variant; -DJQ_QMV_DEFAULT_CONFIGS_ONLY), at about a fifth of
  the time;
  --every-variant compiles all that the library build does, every source through
  ptxas.

Jobs run in parallel (one per core). Exit status 0 when everything that was
attempted compiled. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIP_FILES = ["gpu_ffi.hip", "dequant.hip", "gemv_affine.hip", "gemv_float.hip", "norms.hip"]
# ROCm only (CMakeLists.txt): the gfx950 scaled-MFMA qmm, an empty kernel on the other
# archs; its gfx950 code is checked by tools/toolchain/cdna4_compile_check.py (clang >= 20).
ROCM_ONLY_FILES = ["cdna4_qmm.hip"]
# The tensor-core decode GEMV (mma.sync, cp.async): CUDA only, as in CMakeLists.txt.
CUDA_ONLY_FILES = sorted(p.name for p in (ROOT / "gpu_src/cuda").glob("gemv_mma*.hip"))
# The Hopper prefill GEMM (wgmma): sm_90a only, as in CMakeLists.txt.
SM90A_FILES = ["qmm_wgmma.hip"]
# The folder of each source: gpu_src/common (HIP spellings, nvcc and clang), gpu_src/cuda,
# gpu_src/rocm.
SOURCE_DIR = {**{f: "gpu_src/common" for f in HIP_FILES}, **{f: "gpu_src/rocm" for f in ROCM_ONLY_FILES},
              **{f: "gpu_src/cuda" for f in CUDA_ONLY_FILES + SM90A_FILES}}
ROCM_ARCHS = ["gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201"]
CUDA_ARCHS = ["80", "90"]
# The GEMV files are built for these ROCm archs without -DJQ_QMV_DEFAULT_CONFIGS_ONLY:
# every kernel variant that launch_qmv (gpu_src/common/gemv_impl.h) can launch for the configs
# qmv_config (gpu_src/common/gpu_ffi.hip) chooses, as the real build does; the other archs
# build the default variants only (all variants take about twice the defaults' time).
# gfx90a stops at LLVM's IR (BACKEND_ARCHS): the variants differ in their loop
# parameters, not in the builtins or instructions they ask for (those go through the
# backend on gfx942 and gfx1100 in the default variants).
ALL_QMV_CONFIG_ARCHS = ["gfx90a"]
# Through the AMDGPU backend (instruction selection, register allocation); the other
# archs stop at LLVM's IR. One arch per wave size: gpu_src/ branches on the
# wave size alone (JQ_WARP) outside cdna4_qmm.hip's gfx950 code, which
# tools/toolchain/cdna4_compile_check.py compiles to the ISA.
BACKEND_ARCHS = ["gfx942", "gfx1100"]
QMV_FILES = ("gemv_affine.hip", "gemv_float.hip")
# CUDA: ptxas assembles these for the target; the other sources stop at PTX (cicc's
# output: the C++ front end, NVVM and its PTX, the host side). Past cicc, ptxas adds a
# check of inline PTX alone (gpu_src/'s asm statements and the CUDA headers' own, such as
# __ldg's), and these sources instantiate every inline PTX form that any source's PTX
# holds in the covering set (tests/test_ffi_toolchain.py checks it on every run:
# inline_asm_forms). The others' ptxas was about a quarter of the check's CPU time.
# --every-variant runs ptxas on every source.
PTXAS_FILES = ["gemv_mma_fused_float_f16.hip", "gemv_mma_fused_float_f32.hip", "qmm_wgmma.hip"]
# Seconds of one core per job, measured on a 2-core machine (CUDA: sm_90, NVVM at the
# check's levels (cuda_jobs), ptxas -O0, the covering set; ROCm: one arch, default GEMV
# variants; a HIP source's entry is its ROCm time): the jobs start longest first, so
# that the parallel jobs finish together (qmm_wgmma.hip last would leave one core on it
# alone). Every variant (--every-variant, at the build's NVVM level) takes several times
# these.
_SECONDS = {"qmm_wgmma.hip": 26, "gemv_mma_affine_bf16.hip": 5.3, "gemv_mma_float_bf16.hip": 5.3,
            "gemv_mma_fused_affine_bf16.hip": 7.6, "gemv_float.hip": 13, "gemv_mma.hip": 10,
            "gemv_mma_fused_float_bf16.hip": 5.1, "gpu_ffi.hip": 8, "gemv_affine.hip": 7.5,
            "gemv_mma_fused_affine_f32.hip": 3.3, "gemv_mma_affine_f16.hip": 2.4,
            "gemv_mma_affine_f32.hip": 3.2, "dequant.hip": 3.7, "gemv_mma_fused_float_f32.hip": 3.9,
            "gemv_mma_float_f16.hip": 2.5, "gemv_mma_fused_affine_f16.hip": 3.5,
            "gemv_mma_float_f32.hip": 2.5, "gemv_mma_fused_float_f16.hip": 3.9, "norms.hip": 1.8,
            "cdna4_qmm.hip": 1}


def ffi_include() -> str:
    try:
        import jax.ffi  # noqa: PLC0415
        inc = jax.ffi.include_dir()
        if (pathlib.Path(inc) / "xla/ffi/api/ffi.h").is_file():
            return inc
    except Exception:  # noqa: BLE001
        pass
    return str(ROOT / "cpu_src/third_party")


def find_clang() -> str | None:
    for cand in [os.environ.get("JQ_HIP_CLANG"), "clang++-20", "clang++-19", "clang++"]:
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def hip_headers_present() -> bool:
    return pathlib.Path("/usr/include/hip/hip_runtime.h").is_file() or bool(
        os.environ.get("ROCM_PATH"))


def run(cmd, timeout=600):
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p.returncode, (p.stdout + p.stderr).strip(), time.time() - t


def rocm_jobs(clang, archs, out_dir, all_qmv_configs=(), backend_archs=BACKEND_ARCHS):
    rocm_path = os.environ.get("ROCM_PATH", "/usr")
    common = [clang, "-x", "hip", "-std=c++17", "-nogpulib", f"--rocm-path={rocm_path}",
              "-DJQ_HIP_NOGPULIB", "-Iinclude", "-Igpu_src/common",
              "-isystem", ffi_include(), "-Wno-unused-command-line-argument"]
    defaults_only = ["-DJQ_QMV_DEFAULT_CONFIGS_ONLY"]
    jobs = []
    for arch in archs:
        for f in HIP_FILES + ROCM_ONLY_FILES:
            every = arch in all_qmv_configs and f in QMV_FILES
            # the archs that stop at LLVM's IR at -O0 (what they check is the front end's:
            # about a third of -O2's time); the backend ones at -O2 (at -O0 the device
            # code keeps assert's call into the device library, which -nogpulib leaves out)
            stage = ["-O2", "-c"] if arch in backend_archs else ["-O0", "-S", "-emit-llvm"]
            jobs.append((f"{arch}:{f}", common + ([] if every else defaults_only) + [
                f"--offload-arch={arch}", "--offload-device-only", "--no-gpu-bundle-output",
                *stage, f"{SOURCE_DIR[f]}/{f}", "-o", str(out_dir / f"{arch}-{f}.o")]))
    jobs.append(("host:gpu_ffi.hip", common + defaults_only + ["-O2",
        f"--offload-arch={archs[0] if archs else 'gfx942'}", "--offload-host-only", "-c",
        "gpu_src/common/gpu_ffi.hip", "-o", str(out_dir / "host-gpu_ffi.o")]))
    return jobs


def job_seconds(job):
    """The job's expected seconds (_SECONDS; every GEMV variant: about twice the defaults;
    LLVM IR only: about half)."""
    name, cmd = job
    arch, f = name.split(":", 1)
    every = f in QMV_FILES and "-DJQ_QMV_DEFAULT_CONFIGS_ONLY" not in cmd
    ir_only = 0.5 if "-emit-llvm" in cmd else 1
    return _SECONDS.get(f, 10) * (2 if every else 1) * ir_only + (2 if arch == "host" else 0)


def qmv_launch_variants() -> list[str]:
    """The (MT, R, U) template variants of qmv_kernel that launch_qmv can launch,
    as "MT,R,U", read from gpu_src/common/gemv_impl.h's JQ_QMV(...) launches."""
    text = (ROOT / "gpu_src/common" / "gemv_impl.h").read_text()
    found = re.findall(r"\bJQ_QMV\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)", text)
    return sorted({",".join(v) for v in found})


_QMV_SYMBOL = re.compile(rb"qmv_kernelI(NS_5CodecI\w*?EE)ELi(\d+)ELi(\d+)ELi(\d+)EEEv")


def qmv_kernels_in(obj: pathlib.Path) -> dict[str, list[str]]:
    """{codec (its mangled template arguments): ["MT,R,U", ...]}: the qmv_kernel variants
    whose symbols a device object defines."""
    out: dict[str, set[str]] = {}
    for m in _QMV_SYMBOL.finditer(obj.read_bytes()):
        out.setdefault(m.group(1).decode(), set()).add(b",".join(m.groups()[1:]).decode())
    return {k: sorted(v) for k, v in sorted(out.items())}


def inline_asm_forms(ptx: str) -> set[str]:
    """The inline PTX statements of a PTX file (nvcc marks them "// begin inline asm"),
    registers and numbers replaced by R and N: the forms ptxas would check."""
    forms = set()
    for block in re.findall(r"// begin inline asm\n(.*?)// end inline asm", ptx, re.S):
        for line in block.splitlines():
            line = line.strip().rstrip(";")
            if line:
                line = re.sub(r"%[a-z]+\d+", "R", line)
                forms.add(re.sub(r"\b0[xX][0-9a-fA-F]+\b|\b\d+\b", "N", line))
    return forms


def cuda_jobs(nvcc, archs, out_dir, ptxas_opt=0, every_variant=False, keep_dir=None):
    """[(name, command)]; keep_dir: nvcc keeps its intermediate files there (the PTX)."""
    # -O0: the host compiler's level (nvcc's -O is host code only; the device code is
    # the same PTX at any -O, checked: the host side compiles 10% faster)
    base = [nvcc, "-x", "cu", "-std=c++17", "-O0", f"-Xptxas=-O{ptxas_opt}",
            "--expt-relaxed-constexpr", "-Iinclude", "-Igpu_src/common", "-Igpu_src/cuda", "-isystem", ffi_include()]
    if not every_variant:  # the covering set (gpu_src/cuda/gemv_mma.h: kEveryVariant)
        base += ["-DJQ_MMA_COVERING_SET", "-DJQ_QMV_DEFAULT_CONFIGS_ONLY"]

    def gencode(f, arch):  # code=sm_X: through ptxas; code=compute_X: PTX only
        code = "sm" if every_variant or f in PTXAS_FILES else "compute"
        return f"-gencode=arch=compute_{arch},code={code}_{arch}"

    def cicc_opt(f):
        # NVVM's level. What the check asks (the source compiles; the ptxas files' inline
        # PTX assembles) holds at any level, and -O0's PTX holds every inline PTX form
        # that -O3's does (it removes none), in a seventh of the time
        # (gemv_mma_fused_affine_bf16.hip 48 -> 6.7 s). nvcc crashed (segmentation
        # fault) on qmm_wgmma.hip at -O0 through ptxas, so the ptxas files take -O1
        # (89 -> 37 s). --every-variant, the build's own check, keeps the build's -O3.
        if every_variant:
            return []
        return ["-Xcicc", "-O1" if f in PTXAS_FILES else "-O0"]

    def job(f, arch_list):
        keep = [] if keep_dir is None else ["--keep", f"--keep-dir={keep_dir}"]
        return (f"cuda:{f}", base + keep + cicc_opt(f) + [gencode(f, a) for a in arch_list] + [
            "-c", f"{SOURCE_DIR[f]}/{f}", "-o", str(out_dir / f"cuda-{f}.o")])

    return ([job(f, archs) for f in HIP_FILES + CUDA_ONLY_FILES] +
            [job(f, ["90a"]) for f in SM90A_FILES])


def probe_rocm_arch(clang, arch) -> str | None:
    """None if clang knows `arch`, else why not."""
    code, out, _ = _probe(clang, arch)
    if code == 0:
        return None
    return out.splitlines()[0] if out else f"exit {code}"


def _probe(clang, arch):
    with tempfile.NamedTemporaryFile("w", suffix=".hip", delete=False) as f:
        f.write("__attribute__((global)) void k() {}\n")
        name = f.name
    try:
        return run([clang, "-x", "hip", "-nogpuinc", "-nogpulib", f"--offload-arch={arch}",
                     "--offload-device-only", "-S", "-emit-llvm", "-o", os.devnull, name],
                    timeout=60)
    finally:
        os.unlink(name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=["rocm", "cuda"])
    ap.add_argument("--arch", nargs="*", default=None)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ptxas-opt", type=int, choices=range(4), default=0,
                    help="cuda: ptxas's optimization level (default %(default)s; the "
                         "library builds at 3)")
    ap.add_argument("--every-variant", action="store_true",
                    help="cuda: every kernel variant the library builds (default: the "
                         "covering set, -DJQ_MMA_COVERING_SET -DJQ_QMV_DEFAULT_CONFIGS_ONLY: "
                         "each codec in one variant of each kernel, affine 4-bit in all)")
    ap.add_argument("--backend-archs", nargs="*", default=BACKEND_ARCHS,
                    help="ROCm archs compiled through the AMDGPU backend; the others stop "
                         "at LLVM's IR (default: %(default)s)")
    ap.add_argument("--all-qmv-configs", nargs="*", default=ALL_QMV_CONFIG_ARCHS,
                    help="ROCm archs whose GEMV files build every kernel variant "
                         "(default: %(default)s)")
    args = ap.parse_args(argv)
    summary = {"target": args.target, "ok": [], "failed": {}, "skipped": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = pathlib.Path(tmp)
        if args.target == "rocm":
            clang = find_clang()
            if clang is None or not hip_headers_present():
                summary["skipped"]["all"] = ("no clang++ with HIP headers (run "
                                             "tools/toolchain/install_hip_toolchain.sh)")
                print(json.dumps(summary))
                return 0
            archs = []
            for arch in args.arch or ROCM_ARCHS:
                why = probe_rocm_arch(clang, arch)
                if why is None:
                    archs.append(arch)
                else:
                    summary["skipped"][arch] = f"{pathlib.Path(clang).name} does not know {arch}: {why}"
            every = [a for a in args.all_qmv_configs if a in archs]
            summary["all_qmv_configs"] = every
            summary["qmv_launch_variants"] = qmv_launch_variants()
            summary["backend_archs"] = [a for a in args.backend_archs if a in archs]
            jobs = rocm_jobs(clang, archs, out_dir, every, args.backend_archs)
            jobs.sort(key=job_seconds, reverse=True)
        else:
            nvcc = shutil.which(os.environ.get("JQ_NVCC", "nvcc"))
            if nvcc is None:
                summary["skipped"]["all"] = "nvcc is not on PATH"
                print(json.dumps(summary))
                return 0
            jobs = cuda_jobs(nvcc, args.arch or CUDA_ARCHS, out_dir, args.ptxas_opt,
                             args.every_variant)
            jobs.sort(key=job_seconds, reverse=True)
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
            futs = {ex.submit(run, cmd): name for name, cmd in jobs}
            for fut in concurrent.futures.as_completed(futs):
                name = futs[fut]
                code, out, dt = fut.result()
                if code == 0:
                    summary["ok"].append(name)
                    arch, f = name.split(":", 1)
                    if args.target == "rocm" and f in QMV_FILES and arch != "host":
                        kernels = qmv_kernels_in(out_dir / f"{arch}-{f}.o")
                        summary.setdefault("qmv_kernels", {}).setdefault(arch, {}).update(
                            kernels)
                    print(f"ok     {name} ({dt:.1f}s)", flush=True)
                else:
                    summary["failed"][name] = out[-4000:]
                    print(f"FAILED {name} ({dt:.1f}s)\n{out[-4000:]}", flush=True)
        summary["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
