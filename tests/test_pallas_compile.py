"""ROCm (and CUDA) compile checks of the Pallas qmm kernels, on a CPU-only machine.

Each kernel is lowered with `lowering_platforms=("rocm",)` (resp. "cuda"); the
Triton module is taken from the `__gpu$xla.gpu.triton` custom call, printed as
text with jaxlib's MLIR context and compiled with the pip `triton` package for
gfx90a / gfx942 / gfx950 / gfx1100 (resp. sm_90, sm_80); a code object must
come out. Needs `pip install triton` (see jaxquant/pallas/compile_check.py).
"""

import os

import jax
import jax.numpy as jnp
import pytest

import jaxquant as jq
from jaxquant.pallas import compile_check as cc
from jaxquant.pallas.qmm import qmm

triton = pytest.importorskip(
    "triton", reason="the ROCm/CUDA compile checks need the pip `triton` package "
                     "(pip install triton)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
pytestmark = pytest.mark.toolchain

ALL_FORMATS = [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 4, 64), ("affine", 5, 32),
    ("affine", 6, 64), ("affine", 8, 128),
    ("mxfp4", 4, 32), ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32),
    ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
]
# kernel kind -> (M, transpose)
KINDS = {"gemv_t": (1, True), "skinny_t": (16, True), "gemm_t": (256, True),
         "gemv_n": (1, False), "gemm_n": (256, False)}
ROCM = [t for t in cc.ROCM_TARGETS]
CUDA = [cc.CUDA_TARGETS[0]]


def _kernels(fmt, kind, platform, dtype=jnp.bfloat16):
    mode, bits, group = fmt
    m, transpose = KINDS[kind]
    n, k = 1000, 2048                       # N not a multiple of any block
    shape = (n, k) if transpose else (k, n - n % group)
    qw = jax.eval_shape(
        lambda w: jq.quantize(w, mode=mode, bits=bits, group_size=group),
        jax.ShapeDtypeStruct(shape, dtype))
    x = jax.ShapeDtypeStruct((m, k), dtype)
    kernels = cc.triton_kernels(
        lambda x, qw: qmm(x, qw, transpose=transpose, platform=platform), x, qw,
        platform=platform)
    assert len(kernels) == 1, kernels
    return kernels


def _compile_all(kernels, targets):
    for kernel in kernels:
        for backend, arch, warp in targets:
            compiled = cc.compile_kernel(kernel, backend, arch, warp)
            assert len(cc.code_object(compiled)) > 0, (backend, arch)


def _fid(f):
    return "-".join(map(str, f))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_fid)
def test_rocm_gemv_every_format(fmt):
    _compile_all(_kernels(fmt, "gemv_t", "rocm"), [("hip", "gfx942", 64)])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("mxfp6_e3m2", 6, 32),
                                 ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16)], ids=_fid)
def test_rocm_every_kernel_every_target(fmt, kind):
    _compile_all(_kernels(fmt, kind, "rocm"), ROCM)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
def test_rocm_activation_dtypes(dtype, kind):
    _compile_all(_kernels(("affine", 4, 64), kind, "rocm", dtype), ROCM)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("affine", 3, 64)],
                         ids=_fid)
def test_cuda_every_kernel(fmt, kind):
    _compile_all(_kernels(fmt, kind, "cuda"), CUDA)


def test_text_route_module_is_triton():
    (kernel,) = _kernels(("mxfp4", 4, 32), "gemv_t", "rocm")
    text = kernel.text()
    assert "tt.func" in text and "tt.load" in text
