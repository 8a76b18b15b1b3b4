"""Kernel choice of the ffi backend, as data: the one place it lives.

Every rule takes the op's arguments (ShapedArrays) and `platform`, as
`jaxquant.dispatch` passes them, and is registered for every platform a
library was loaded for (jaxquant/ffi/__init__.py: KERNELS). Each threshold is
where two kernels measured in one process cross; the numbers are data under
benchmarks/ (benchmarks/README.md), named by key below.

- FFI_GEMV_MAX_M: the most rows of x per weight matrix that qmm runs as the native
  fused dequantize-GEMV (target jaxquant_qmv; jaxquant/ffi/kernels.py: qmm); past it qmm is the ffi
  dequantize + XLA's dot, which wins once the weight's decode is amortized over
  enough rows.
- FFI_GEMM_MAX_M: on the CPU, the most rows of x per weight matrix that qmm (x @ W.T) runs
  as the CPU library's blocked dequantize-GEMM (target jaxquant_gemm; past
  FFI_GEMV_MAX_M): every M. In the model (cpu-xeon-2core/model.json: prefill of 128
  tokens, Llama-3.2-1B dims) the GEMM replaces the reference's dequantize, which XLA
  ran as one slow fusion per weight inside the layer scan (1.47 s of 1.75 s); the op
  alone (cpu-xeon-2core/qmm.json, `qmm: M, K, N=<M>, 2048, 8192`, bfloat16 x) is
  0.91-2.95x the reference from M = 64 to 512, the largest measured (under 1.0x in two
  of twelve cases, within the shared machine's spread).
- MMA_GEMM_MAX_M: the most rows of x per weight matrix for which automatic choice
  runs qmm on a `cuda_mma` weight as the mma.sync tensor-core GEMM
  (gpu_src/cuda/qmm_gemm.h; above MMA_GEMV_MAX_M); past it the layout's dequantize
  kernel, then XLA's dot (cuBLAS), is faster (h100/prefill.json
  `qmm.mma_sync_vs_dequant.*`: the GEMM wins at 64 rows, loses 2x at 512).
  MMA_GEMM_MAX_M_SM90: the same for the wgmma GEMM (gpu_src/cuda/qmm_wgmma.h; compute
  capability 9.0, scales 4-byte aligned per tile: plan_gemm in qmm_gemm.h). Before
  its producer warpgroup it tied dequantize + cuBLAS at about 1024 rows (h100
  `qmm.wgmma_vs_dequant.*`); with it, at 4096 -> 14336 on an H200 (h200/prefill.json
  `prefill.producer_ab.warpgroup.producer.*`, one process), it took 0.89x / 0.97x the
  time of dequantize + cuBLAS at 2048 rows (affine4 / mxfp4) and 0.94x / 1.02x at
  4096. Past 4096, not measured: the dequantize's cost spreads over more rows there.
- RAGGED_GATHER_MAX_T: ragged_qmm on a `cuda_mma` weight with at most this many
  rows runs as gather_qmm on the decode GEMV (each row a slot; up to
  ragged_gather_dedupe rows of one expert share a read); more rows take the GEMM.
  256: the most slots the GEMV shares an expert's read over (gpu_src/cuda/gemv_mma.hip;
  past it every row would read its expert alone), and up to there the GEMV path
  beats the GEMM (h100/moe.json `ragged_qmm.gather_vs_gemm.*`).
- GATHER_MAX_PAIRS: the most (token, expert) pairs for which a mixture-of-experts
  layer (jaxquant/models/moe.py) runs its experts as gather_qmm; more run as
  ragged_qmm. gather_qmm runs one GEMV per pair, reading each chosen expert's weight
  in place, which is the least weight traffic while pairs rarely share an expert
  (decode); with more pairs experts repeat, and ragged_qmm, the pairs sorted by
  expert with one grouped matmul per projection, reads each expert once per group.
  The same choice, made inside ragged_qmm for a `cuda_mma` weight, is
  RAGGED_GATHER_MAX_T.
- ragged_gather_dedupe: how many consecutive rows (sorted by expert) a GEMV block
  takes together in that path. Fewer means more blocks; more means fewer reads of an
  expert split over blocks: 8 is faster up to 128 rows, 16 above
  (`ragged_qmm.gather_dedupe.*`; 2 and 4 within a few % of 8, 1 up to 4x slower).
- auto_*: where automatic choice takes the ffi kernel (an explicit
  backend="ffi" gets every case the kernel supports). qmm: the fused GEMV, and on
  the CPU the blocked GEMM up to FFI_GEMM_MAX_M rows (elsewhere, above FFI_GEMV_MAX_M
  rows, the ffi dequantize + XLA's dot is slower than the reference, which XLA fuses). gather_qmm with x @ W.T: the fused GEMV per slot,
  faster than the reference on the CPU and the GPU. CPU only: dequantize (faster
  for every format), norms from NORM_MIN_ELEMENTS elements (smaller rows are a few
  µs either way and XLA fuses them with their neighbours). Never: ragged_qmm
  (dequantize + ragged_dot is slower than the reference on the CPU), the GPU norms
  (h100/norm.json: a fraction of XLA's fused reference's speed).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

FFI_GEMV_MAX_M = {"cpu": 16, "cuda": 16, "rocm": 16}
FFI_GEMM_MAX_M = {"cpu": 1 << 30}

NORM_MIN_ELEMENTS = 1 << 16

MMA_GEMM_MAX_M = 64
MMA_GEMM_MAX_M_SM90 = 4096
RAGGED_GATHER_MAX_T = 256
# The most rows of x per weight matrix the tensor-core decode GEMV (gpu_src/cuda/gemv_mma.h,
# jaxquant/ffi/mma.py) takes: the MMA's N (8 or 16). More rows take the GEMM.
MMA_GEMV_MAX_M = 16
# The most rows of x per weight matrix for which automatic choice takes the gfx950 MXFP4
# qmm (jaxquant/ffi/cdna4.py; backend="ffi" still takes every M). Reasoned, not measured
# (no gfx950 was available): the kernel reads the weight once per 16-row tile of x, so up
# to 4 tiles it stays near one pass over the weight, while the reference unpacks and
# dequantizes the whole weight to x's dtype (4x its bytes) every call; past that the
# reference's tuned dot wins on compute.
CDNA4_AUTO_MAX_M = 64
GATHER_MAX_PAIRS = 64


def ragged_gather_dedupe(rows: int) -> int:
    """Rows per GEMV block in ragged_qmm's gather path (see above)."""
    return min(rows, 8 if rows <= 128 else 16)


def mma_gemm_max_m(qw) -> int:
    """MMA_GEMM_MAX_M for the GEMM that runs `qw` on the default CUDA device: the wgmma
    one where it runs (wgmma_usable) and every tile's scales are 4-byte aligned (the
    C++ side's choice, plan_gemm), else the mma.sync one."""
    n, groups = qw.scales.shape[-2:]
    aligned = n * groups * jnp.dtype(qw.scales.dtype).itemsize % 4 == 0
    return MMA_GEMM_MAX_M_SM90 if aligned and wgmma_usable() else MMA_GEMM_MAX_M


def wgmma_usable() -> bool:
    """Whether the CUDA library's Hopper kernels run on the default CUDA device: compute
    capability 9.0, unless $JAXQUANT_GEMM_KERNEL=mma turns them off (the C++ side's
    `wgmma_usable`, gpu_src/cuda/qmm_wgmma.hip, which the handlers check again)."""
    return _cuda_capability() == "9.0" and os.environ.get("JAXQUANT_GEMM_KERNEL") != "mma"


@functools.lru_cache(maxsize=None)
def _cuda_capability() -> str | None:
    try:
        return str(getattr(jax.devices("cuda")[0], "compute_capability", None))
    except RuntimeError:  # no CUDA backend
        return None


def gemv_rows(x, qw, *, transpose, platform) -> int | None:
    """The rows of x per weight matrix when qmm runs as the fused GEMV, else None."""
    m = math.prod(x.shape[qw.ndim - 2:-1])
    return m if transpose and 0 < m <= FFI_GEMV_MAX_M[platform] else None


def gemm_rows(x, qw, *, transpose, platform) -> int | None:
    """The rows of x per weight matrix when qmm runs as the CPU library's blocked GEMM
    (more than the GEMV takes, at most FFI_GEMM_MAX_M), else None."""
    m = math.prod(x.shape[qw.ndim - 2:-1])
    most = FFI_GEMM_MAX_M.get(platform, 0)
    return m if transpose and FFI_GEMV_MAX_M[platform] < m <= most else None


def auto_qmm(x, qw, *, transpose, platform, **params) -> bool:
    return (gemv_rows(x, qw, transpose=transpose, platform=platform) is not None
            or gemm_rows(x, qw, transpose=transpose, platform=platform) is not None)


def auto_gather_qmm(x, qw, indices, *, transpose, platform, **params) -> bool:
    return transpose


def auto_dequantize(qw, *, platform, **params) -> bool:
    return platform == "cpu"


def auto_norm(x, *operands, platform, **params) -> bool:
    return platform == "cpu" and math.prod(x.shape) >= NORM_MIN_ELEMENTS


# The fused GEMVs (qmm_swiglu, qmm_add): the rows of x per call up to which the automatic
# choice takes the fused kernel, where it measured faster than the unfused ops it
# replaces (h100/decode.json `fused.*`): the SwiGLU epilogue up to four rows, the addend
# up to the GEMV's 16.
FUSED_MAX_ROWS = {"qmm_swiglu": 4, "qmm_add": 16}
# rms_norm_qmm's fused kernel is opt-in (backend="ffi"): every block normalizes x itself,
# and in the decode step on an H200 the norm apart (XLA's fusions, then the plain GEMV)
# decoded 1.2-1.4% faster (Llama-3-8B) and 0.9-1.0% (gpt-oss-20b), affine4 and mxfp4
# (h200/decode.json `decode_step.qkv_norm.*`); past one row it was slower on an H100 too.
# rms_norm_qmm_swiglu's fused kernel is opt-in (backend="ffi"): in the SwiGLU's grid (896
# blocks at Llama-3-8B's 4096 -> 2 x 14336) every block normalizing x cost 4.5-6.5 us a
# call at one row, where the norm as a kernel of its own costs about 2 (h200/decode.json
# `fused.rms_norm_qmm_swiglu.*`); the automatic choice runs rms_norm, then qmm_swiglu's
# kernel.
# gather_qmm_swiglu's fused kernel is opt-in (backend="ffi"): a block owns a gate tile and
# its up tile, which halves the gather GEMV's grid, and at gpt-oss-20b's experts that
# costs what the epilogue saves; in the whole model XLA had merged the epilogue into a
# fusion the step runs anyway, so no kernel went away (h100/moe.json
# `gather_qmm_swiglu.*`).


def auto_fused(op: str):
    """The automatic-choice predicate of the fused GEMV `op` (FUSED_MAX_ROWS)."""
    most = FUSED_MAX_ROWS[op]

    def auto(x, *operands, platform, **params) -> bool:
        return math.prod(x.shape[:-1]) <= most
    return auto


def never(*args, platform, **params) -> bool:
    return False
