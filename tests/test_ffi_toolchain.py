"""Compile checks of gpu_src/ for the GPUs CI has no device for (docs/design.md §5):
ROCm (gfx90a, gfx942, gfx950 where the compiler knows it, gfx1100, gfx1201)
with clang + the HIP headers (tools/toolchain/install_hip_toolchain.sh), and CUDA
(sm_80, sm_90, sm_90a) with nvcc. Each skips, with the reason, where its compiler
is absent."""

from __future__ import annotations

import ctypes
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

import jaxquant.ffi as jf

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "toolchain" / "native_compile_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import native_compile_check as ncc  # noqa: E402

pytestmark = pytest.mark.toolchain


def _run(target, *args):
    p = subprocess.run([sys.executable, str(SCRIPT), target, *args], capture_output=True,
                       text=True, cwd=ROOT, timeout=900)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    return p.returncode, summary, p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.full  # ~45 s of CPU: CI's full matrix, after it installs the toolchain
@pytest.mark.skipif(ncc.find_clang() is None or not ncc.hip_headers_present(),
                    reason="no clang++ with the HIP headers: run tools/toolchain/install_hip_toolchain.sh "
                           "(clang-19, lld-19, libamdhip64-dev)")
def test_rocm_compile():
    rc, summary, log = _run("rocm")
    assert rc == 0 and not summary["failed"], log[-6000:]
    archs = {name.split(":")[0] for name in summary["ok"]}
    assert {"gfx90a", "gfx942", "gfx1100", "gfx1201", "host"} <= archs, summary
    # one arch of each wave size through the AMDGPU backend (wave64, wave32)
    assert {"gfx942", "gfx1100"} <= set(summary["backend_archs"]), summary
    # gfx950 compiles where the compiler knows it (clang >= 20), else is skipped with the reason
    assert "gfx950" in archs or "does not know gfx950" in summary["skipped"].get("gfx950", "")
    _check_qmv_variants(summary)


def _check_qmv_variants(summary):
    """Every GEMV kernel variant that qmv_config (gpu_src/common/gpu_ffi.hip) can choose is
    compiled for gfx90a (to LLVM's IR): M > 1 -> (MT, R) = (8, 1); M = 1 -> R = 4, R = 2 (N < 4096) and,
    through $JAXQUANT_FFI_GPU_QMV, R = 1. The other archs build the defaults only."""
    assert "gfx90a" in summary["all_qmv_configs"], summary.get("all_qmv_configs")
    launched = set(summary["qmv_launch_variants"])
    assert {(1, 4), (1, 2), (1, 1), (8, 1)} <= {tuple(map(int, v.split(",")[:2]))
                                                for v in launched}, launched
    defaults = {v for v in launched if v.startswith(("1,4,", "8,1,"))}
    assert len(defaults) == 2, launched
    kernels = summary["qmv_kernels"]
    assert set(kernels) == {name.split(":")[0] for name in summary["ok"]} - {"host"}, kernels
    for arch, codecs in kernels.items():
        # one codec per mode: affine 2, 3, 4, 5, 6, 8 bits and the 7 small-float formats
        assert len(codecs) == 13, (arch, sorted(codecs))
        for codec, variants in codecs.items():
            want = launched if arch in summary["all_qmv_configs"] else defaults
            assert set(variants) == want, (arch, codec, variants)


NVCC = shutil.which("nvcc") or (shutil.which("/usr/local/bin/nvcc"))
# Every CUDA source, longest compile first (one test each: pytest-xdist spreads them
# over the cores, and no single test holds a worker for minutes).
CUDA_SOURCES = sorted(ncc.HIP_FILES + ncc.CUDA_ONLY_FILES + ncc.SM90A_FILES,
                      key=lambda f: -ncc.job_seconds((f"cuda:{f}", [])))
# The default run compiles three quick sources (two MMA GEMVs, one of them fused and
# through ptxas, and the norms: the shared headers with them); every source (about 130 s
# of one core, one of the longest pieces of the suite) is the full matrix, CI's
# (tests/conftest.py).
QUICK_CUDA_SOURCES = {"gemv_mma_float_f32.hip", "gemv_mma_fused_float_f16.hip", "norms.hip"}


def _cuda_library():
    return jf.libraries()["cuda"].path


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_cuda_library_compiled():
    """Where this install built libjaxquant_cuda.so (nvcc and an NVIDIA GPU at build
    time, or JAXQUANT_ENABLE_CUDA=ON): it has every handler. Elsewhere (CI, a machine
    without a GPU) test_cuda_source_compiles checks every source instead."""
    path = _cuda_library()
    if path is None:
        pytest.skip("this install built no libjaxquant_cuda.so (no GPU at build time): "
                    "test_cuda_source_compiles compile-checks every CUDA source instead")
    handle = ctypes.CDLL(str(path))
    assert handle.jq_abi_version() == jf._loader.ABI_VERSION
    targets, format_ids = jf._loader.describe(handle)
    assert set(jf.libraries()["cpu"].targets) <= set(targets), targets
    assert format_ids == jf.FORMAT_IDS
    for target in targets:
        assert hasattr(handle, "jq_gpu_" + target), target


# The inline PTX forms of each source compiled here (test_cuda_source_compiles), for
# test_ptxas_sees_every_inline_ptx_form: one xdist group, so one process runs them all.
_ASM_FORMS: dict[str, set[str]] = {}


@pytest.mark.slow
@pytest.mark.xdist_group("cuda_compile")
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", [s if s in QUICK_CUDA_SOURCES else
                                    pytest.param(s, marks=pytest.mark.full)
                                    for s in CUDA_SOURCES])
def test_cuda_source_compiles(source, tmp_path):
    """Without the CUDA library (CI, a machine without a GPU): `source` compiles for
    sm_90 (qmm_wgmma.hip: sm_90a), the architecture the kernels are measured on, in the
    kernels' covering set: every codec in one variant of each kernel, affine 4-bit in
    all, float16/float32 x with affine 4-bit and MXFP4 alone, float16 x in one variant
    (gpu_src/cuda/gemv_mma.h, kEveryVariant, kBuiltForX; about a fifth of the time of every
    variant, docs/building.md); through ptxas at -O0 for ncc.PTXAS_FILES (NVVM at -O1),
    to PTX for the others (NVVM at -O0). sm_80 differs by two `__CUDA_ARCH__ >= 900`
    guards; `python tools/toolchain/native_compile_check.py cuda --every-variant`
    compiles both archs and every variant through ptxas. Where the library was built, its
    build compiled every source (test_cuda_library_compiled checks it)."""
    if _cuda_library() is not None:
        pytest.skip("this install built libjaxquant_cuda.so from every CUDA source "
                    "(test_cuda_library_compiled checks its handlers)")
    (cmd,) = [cmd for name, cmd in ncc.cuda_jobs(NVCC, ["90"], tmp_path, keep_dir=tmp_path)
              if name == f"cuda:{source}"]
    code, out, _ = ncc.run(cmd, timeout=900)
    assert code == 0, out[-6000:]
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, f"nvcc kept no PTX in {tmp_path}"
    _ASM_FORMS[source] = set().union(*(ncc.inline_asm_forms(p.read_text()) for p in ptx))


@pytest.mark.slow
@pytest.mark.full  # needs every source compiled
@pytest.mark.runs_last  # after test_cuda_source_compiles, whichever order they are named in
@pytest.mark.xdist_group("cuda_compile")
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_ptxas_sees_every_inline_ptx_form():
    """The sources that stop at PTX hold no inline PTX form (gpu_src/'s asm statements,
    the CUDA headers' intrinsics) that ptxas does not assemble in ncc.PTXAS_FILES: ptxas
    checks nothing else that cicc had not (docs/building.md, "CI's compile checks")."""
    missing = [s for s in CUDA_SOURCES if s not in _ASM_FORMS]
    if missing:
        pytest.skip(f"test_cuda_source_compiles did not compile {missing} in this process")
    checked = set().union(*(_ASM_FORMS[s] for s in ncc.PTXAS_FILES))
    assert any(f.startswith("wgmma.mma_async") for f in checked), sorted(checked)[:5]
    unchecked = {s: sorted(_ASM_FORMS[s] - checked) for s in CUDA_SOURCES
                 if _ASM_FORMS[s] - checked}
    assert not unchecked, f"inline PTX that ptxas does not see: {unchecked} (add a source " \
                          f"that instantiates it to PTXAS_FILES, tools/toolchain/native_compile_check.py)"
