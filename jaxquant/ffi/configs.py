"""Kernel choice of the ffi backend, as data: the one place it lives.

Every rule takes the op's arguments (ShapedArrays) and `platform`, as
`jaxquant.dispatch` passes them, and is registered for every platform a
library was loaded for (jaxquant/ffi/__init__.py: KERNELS). The numbers come
from same-run measurements (benchmarks/RESULTS.md).

- PRIORITY: the ffi kernels' rank against other backends under automatic
  choice. CPU: no other backend serves it, so ffi ranks first there. GPU: below
  the Pallas kernels (priority 0), which were faster in every same-run
  comparison on an H100: the fused GEMV is 3-6x faster than the jnp reference
  but 1.2-1.5x slower than Pallas (33-37% of the copy bandwidth).
- GEMV_MAX_M: the most rows of x per weight matrix that qmm runs as the fused
  dequantize-GEMV (jaxquant/ffi/_ops.py: qmm); past it qmm is the ffi
  dequantize + XLA's dot, which wins once the weight's decode is amortized over
  enough rows.
- MMA_GEMM_MAX_M: the most rows of x per weight matrix for which automatic choice
  runs qmm on a `cuda_mma` weight as the tensor-core GEMM (gpu_src/cuda/qmm_gemm.h;
  above MMA_MAX_M); past it the layout's dequantize kernel, then XLA's dot
  (cuBLAS), is faster. mma.sync GEMM (GPUs other than compute capability 9.0),
  H100, (4096 -> 14336), affine4: M = 64 GEMM 76 us vs the reference (XLA's
  dequantize fusion + cuBLAS) 155 us; M = 512 454 vs 211; M = 4096 3356 vs 891.
  MMA_GEMM_MAX_M_SM90: the same for the wgmma GEMM (gpu_src/cuda/qmm_wgmma.h; compute
  capability 9.0, scales 4-byte aligned per tile: plan_gemm in qmm_gemm.h). H100,
  affine4 / mxfp4, GEMM vs dequantize + cuBLAS: M = 64 46-48 / 51-53 vs 67-84 us;
  M = 512 117 / 127 vs 168-171; M = 1024 238 / 250 vs ~240 (cuBLAS at 1024 rows
  interpolated); M = 4096 858 / 895 vs 862 / 806 (benchmarks/RESULTS.md, "Prefill").
- RAGGED_GATHER_MAX_T: ragged_qmm on a `cuda_mma` weight with at most this many
  rows runs as gather_qmm on the decode GEMV (each row a slot; up to
  ragged_gather_dedupe rows of one expert share a read); more rows take the GEMM.
  256: the most slots the GEMV shares an expert's read over (gpu_src/cuda/gemv_mma.hip;
  past it every row would read its expert alone). H100, gpt-oss-20b experts (E = 32,
  top-4, mxfp4), 16 / 32 / 64 / 128 / 256 rows, GEMV vs wgmma GEMM, µs (2026-11-26,
  benchmarks/RESULTS.md "fifth session"): 2880 -> 5760 72 / 126 / 166 / 202 / 250 vs
  152 / 269 / 346 / 367 / 365; 2880 -> 2880 42 / 70 / 93 / 110 / 135 vs 84 / 146 /
  188 / 201 / 197 (measured with 16 rows per block throughout).
- ragged_gather_dedupe: how many consecutive rows (sorted by expert) a GEMV block
  takes together in that path. Fewer means more blocks; more means fewer reads of an
  expert split over blocks. Same experts, µs at dedupe 8 vs 16 (2026-11-26): gate_up
  16 / 32 / 64 / 128 / 256 rows 68 / 108 / 147 / 186 / 288 vs 71 / 124 / 164 / 199 /
  247; down 40 / 64 / 84 / 104 / 154 vs 43 / 70 / 89 / 109 / 133 (2 and 4 within a few
  % of 8; 1 up to 4x slower past 64 rows).
- auto_*: where automatic choice takes the ffi kernel (an explicit
  backend="ffi" gets every case the kernel supports). qmm: the fused GEMV only
  (above GEMV_MAX_M rows the ffi dequantize + XLA's dot is 0.5-0.7x the
  reference, which XLA fuses). gather_qmm with x @ W.T: the fused GEMV per slot
  (CPU 13-25x, H100 2-8x). CPU only: dequantize (0.9-6.4x: even to 1.3x for the
  4-bit formats, the MX6 unpack 6x), norms from NORM_MIN_ELEMENTS elements
  (1.1-4.2x; smaller rows are a few µs either way and XLA fuses them with their
  neighbours). Never: ragged_qmm (dequantize + ragged_dot, 0.85x on the CPU),
  the GPU norms (20-30% of the copy bandwidth, 0.2-0.5x XLA's fused reference
  on an H100).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

PRIORITY = {"cpu": 10, "cuda": -1, "rocm": -1}

GEMV_MAX_M = {"cpu": 16, "cuda": 16, "rocm": 16}

NORM_MIN_ELEMENTS = 1 << 16

MMA_GEMM_MAX_M = 64
MMA_GEMM_MAX_M_SM90 = 1024
RAGGED_GATHER_MAX_T = 256


def ragged_gather_dedupe(rows: int) -> int:
    """Rows per GEMV block in ragged_qmm's gather path (see above)."""
    return min(rows, 8 if rows <= 128 else 16)


def mma_gemm_max_m(qw) -> int:
    """MMA_GEMM_MAX_M for the GEMM that runs `qw` on the default CUDA device: the wgmma
    one on compute capability 9.0 where every tile's scales are 4-byte aligned (the
    C++ side's choice, plan_gemm), else the mma.sync one."""
    n, groups = qw.scales.shape[-2:]
    aligned = n * groups * jnp.dtype(qw.scales.dtype).itemsize % 4 == 0
    return MMA_GEMM_MAX_M_SM90 if aligned and _cuda_capability() == "9.0" else MMA_GEMM_MAX_M


@functools.lru_cache(maxsize=None)
def _cuda_capability() -> str | None:
    try:
        return str(getattr(jax.devices("cuda")[0], "compute_capability", None))
    except RuntimeError:  # no CUDA backend
        return None


def gemv_rows(x, qw, *, transpose, platform) -> int | None:
    """The rows of x per weight matrix when qmm runs as the fused GEMV, else None."""
    m = math.prod(x.shape[qw.ndim - 2:-1])
    return m if transpose and 0 < m <= GEMV_MAX_M[platform] else None


def auto_qmm(x, qw, *, transpose, platform, **params) -> bool:
    return gemv_rows(x, qw, transpose=transpose, platform=platform) is not None


def auto_gather_qmm(x, qw, indices, *, transpose, platform, **params) -> bool:
    return transpose


def auto_dequantize(qw, *, platform, **params) -> bool:
    return platform == "cpu"


def auto_norm(x, *operands, platform, **params) -> bool:
    return platform == "cpu" and math.prod(x.shape) >= NORM_MIN_ELEMENTS


# The fused GEMVs (rms_norm_qmm, qmm_swiglu): the rows of x per call up to which the
# automatic choice takes the fused kernel, where it measured faster than the unfused ops
# it replaces (H100, Llama-3-8B dims, benchmarks/RESULTS.md "Ninth session"). The norm
# prologue (4096 -> 6144): M = 1 19.8 / 18.1 µs against 21.2 / 20.0 (affine4 / mxfp4);
# at M = 4 slower, as every block normalizes its rows (29 µs against the plain GEMV's
# 20). The SwiGLU epilogue (4096 -> 28672): M = 1 34.3 / 35.8 µs against 36.4 / 37.6,
# M = 4 45 / 48 against 47 / 48. Whole model, batch 1: affine4 355-357 tok/s against
# 352-353 unfused, mxfp4 343-346 against 340-341.
FUSED_MAX_ROWS = {"rms_norm_qmm": 1, "qmm_swiglu": 4}
# gather_qmm_swiglu's fused kernel is opt-in (backend="ffi"): a block owns a gate tile and
# its up tile, which halves the gather GEMV's grid, and at gpt-oss-20b's experts that
# costs what the epilogue saves (H100, `bench moe`, T = 1: 34.4 µs fused against 33.9 for
# the gather GEMV + XLA's epilogue; T = 8: 209.3 / 209.0). In the whole model (one
# process, alternating) it decoded 480-484 tok/s against 490-496 unfused: XLA had merged
# the epilogue into a fusion the step runs anyway, so no kernel went away
# (benchmarks/RESULTS.md, "Twelfth session").


def auto_fused(op: str):
    """The automatic-choice predicate of the fused GEMV `op` (FUSED_MAX_ROWS)."""
    most = FUSED_MAX_ROWS[op]

    def auto(x, *operands, platform, **params) -> bool:
        return math.prod(x.shape[:-1]) <= most
    return auto


def never(*args, platform, **params) -> bool:
    return False
