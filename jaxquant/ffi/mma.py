"""The CUDA library's tensor-core kernels on the `cuda_mma` layout
(`jq.prepack(qw)` on an NVIDIA GPU; jaxquant/layouts/cuda_mma.py) as lowerings
of qmm, gather_qmm and ragged_qmm (x @ W.T).

- The decode GEMV (gpu_src/cuda/gemv_mma.h): qmm with at most configs.MMA_GEMV_MAX_M rows of x per
  weight matrix and every gather_qmm slot; the weight is read once for all of
  them (M = 1..16 cost about the same).
- The prefill GEMM (gpu_src/cuda/qmm_gemm.h): qmm with more rows (16-bit x) and
  ragged_qmm, whose row blocks skip empty groups on the device. ragged_qmm with
  few rows (configs.RAGGED_GATHER_MAX_T) runs as gather_qmm on the GEMV instead.
- The fused GEMVs (gpu_src/cuda/gemv_mma.h, FUSE): rms_norm_qmm (the norm applied to x
  as the block stages it), qmm_swiglu (a block owns a gate tile and its up tile
  and writes the activation), rms_norm_qmm_swiglu (both, without a bias) and qmm_add
  (the plain GEMV adding the addend as it writes y), with at most
  configs.MMA_GEMV_MAX_M rows of x, and gather_qmm_swiglu (the same epilogue on
  gather_qmm's slots, each with its expert's bias row); other cases of those ops run
  the unfused ops (jaxquant/ops/fused.py).
- The float experts' grouped GEMM (gpu_src/cuda/ragged_matmul_wgmma.h):
  ragged_matmul on 16-bit experts w [E, N, K] in x's dtype, on compute capability 9.0
  (no layout: the experts as they are).
- The layout's dequantize (gpu_src/cuda/qmm_gemm.h) for `jq.dequantize` into a 16-bit
  dtype and, under automatic choice, for qmm with more than
  configs.mma_gemm_max_m rows: the dequantized weight, then XLA's dot (cuBLAS).

Other cases on a `cuda_mma` weight go to the other kernels or the reference,
which unpack the layout first (correct, slower).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import dispatch
from jaxquant.ffi import configs
from jaxquant.ffi.kernels import FORMAT_IDS, format_attrs, qw_operands
from jaxquant.layouts import cuda_mma
from jaxquant.ops.common import ragged_group_ends, sorted_search
from jaxquant.ops.qmm import qmm_reference
from jaxquant.quantized_array import QuantizedArray

TARGET = "jaxquant_qmv_mma"
GEMM_TARGET = "jaxquant_qmm_gemm"
DEQUANT_TARGET = "jaxquant_dequant_mma"
FUSED_TARGET = "jaxquant_gemv_mma_fused"
RAGGED_MATMUL_TARGET = "jaxquant_ragged_matmul"
# The fused GEMV (gemv_mma.h; the handler's `fuse`, gemv_mma.hip): its kinds,
# activations, and the most bytes of x the norm's block stages in shared memory (M x
# (K x bytes + 16)): kMaxNormXSharedBytes in rms_norm_qmm's kernel, kMaxXSharedBytes in
# the SwiGLU's.
FUSE_NORM, FUSE_SWIGLU, FUSE_NORM_SWIGLU, FUSE_ADD = 1, 2, 3, 4
SWIGLU_ACTIVATION_IDS = {"silu": 0, "gpt_oss": 1}
NORM_MAX_X_SHARED_BYTES = 96 * 1024
SWIGLU_MAX_X_SHARED_BYTES = 36 * 1024
PRIORITY = dispatch.PRIORITY["ffi_layout"]  # the cuBLAS path registers one below

_X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_GEMM_X_DTYPES = _X_DTYPES[1:]


def _operands(qw: QuantizedArray, dtype):
    """The weight's operands for a kernel whose x (or output) is `dtype`: float scales
    and biases go as float32 unless they are `dtype` (16-bit) already, the two dtypes
    the kernels are built for (gpu_src/cuda/gemv_mma.h, launch_p). The conversion is exact;
    it is an extra small op per call, only for weights quantized in the other 16-bit
    dtype (or 16-bit ones with float32 x)."""
    data, scales, biases, gs = qw_operands(qw)
    sdt = jnp.dtype(scales.dtype)
    if sdt not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32), jnp.dtype(dtype)):
        scales, biases = scales.astype(jnp.float32), biases.astype(jnp.float32)
    return data, scales, biases, gs


def qmv_mma_call(x3, qw3: QuantizedArray, indices=None, dedupe: int = 0):
    """x3 [Sx, M, K] with qw3 [E, N, K] in the cuda_mma layout -> [S, M, N].

    indices int32 [S] (slot s uses expert indices[s]; outside [0, E): a NaN
    row) or None (S = E). `dedupe` > 0: up to that many slots that pick the
    same expert share one read of its weights (M must be 1)."""
    e, n, _ = qw3.shape
    s = indices.shape[0] if indices is not None else e
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n), x3.dtype)
    idx = indices if indices is not None else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x3, *_operands(qw3, x3.dtype), idx, **format_attrs(qw3), dedupe=np.int64(dedupe))


def gemv_mma_fused_call(x3, qw3: QuantizedArray, aux, *, fuse, eps=0.0, weight_offset=0.0,
                       activation="silu", limit=None, alpha=0.0, indices=None, dedupe=0):
    """The fused GEMV: x3 [Sx, M, K] with qw3 [E, N, K] in the cuda_mma layout.
    FUSE_NORM: rms_norm_qmm, aux the norm weight [K] or None -> [E, M, N];
    FUSE_SWIGLU: qmm_swiglu, aux the bias [N] or None -> [E, M, N / 2]; with
    `indices` int32 [S] (gather_qmm_swiglu: slot s uses expert indices[s], M = 1,
    `dedupe` as qmv_mma_call's) aux the bias [E, N] or None -> [S, 1, N / 2];
    FUSE_NORM_SWIGLU: rms_norm_qmm_swiglu without a bias, aux the norm weight [K] or
    None -> [E, M, N / 2]; FUSE_ADD: qmm_add, aux the addend [E, M, N] -> [E, M, N]."""
    e, n, _ = qw3.shape
    s = indices.shape[0] if indices is not None else e
    half = fuse in (FUSE_SWIGLU, FUSE_NORM_SWIGLU)
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n // 2 if half else n), x3.dtype)
    aux = aux if aux is not None else jnp.zeros((0,), jnp.float32)
    idx = indices if indices is not None else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(FUSED_TARGET, out, vmap_method="sequential")(
        x3, *_operands(qw3, x3.dtype), idx, aux, **format_attrs(qw3), fuse=np.int64(fuse),
        eps=np.float32(eps), weight_offset=np.float32(weight_offset),
        activation=np.int64(SWIGLU_ACTIVATION_IDS[activation]),
        limit=np.float32(np.inf if limit is None else limit), alpha=np.float32(alpha),
        dedupe=np.int64(dedupe))


def qmm_gemm_call(x3, qw3: QuantizedArray, group_sizes=None):
    """qmm: x3 [Sx, M, K] with qw3 [E, N, K] -> [E, M, N]; ragged_qmm (group_sizes
    int32 [E]): x3 [1, T, K] -> [1, T, N], rows past sum(group_sizes) zero.
    x3 float16 or bfloat16; qw3 in the cuda_mma layout."""
    e, n, _ = qw3.shape
    s = 1 if group_sizes is not None else e
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n), x3.dtype)
    gs = group_sizes if group_sizes is not None else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(GEMM_TARGET, out, vmap_method="sequential")(
        x3, *_operands(qw3, x3.dtype), gs, **format_attrs(qw3))


def dequantize_mma_call(qw: QuantizedArray, dtype, *, platform=None):
    """qw [..., N, K] in the cuda_mma layout -> [..., N, K] in `dtype` (float16 or
    bfloat16), canonical order: the values the GEMM multiplies."""
    out = jax.ShapeDtypeStruct(qw.shape, jnp.dtype(dtype))
    return jax.ffi.ffi_call(DEQUANT_TARGET, out, vmap_method="broadcast_all")(
        *_operands(qw, dtype), **format_attrs(qw))


def _qw_ok(qw):
    if not isinstance(qw, QuantizedArray) or qw.layout != cuda_mma.NAME:
        return False
    if qw.mode not in FORMAT_IDS or qw.shape[-1] % cuda_mma.CHUNK_K or qw.shape[-1] == 0:
        return False
    scale_ok = qw.scales.dtype == jnp.uint8 or jnp.dtype(qw.scales.dtype) in _X_DTYPES
    return scale_ok and (qw.global_scale is None or np.size(qw.global_scale) == 1)


def _rows_per_matrix(x, qw):
    return math.prod(x.shape[qw.ndim - 2:-1])


def qmm_applies(x, qw, *, transpose, precision, platform):
    return (_qw_ok(qw) and transpose and jnp.dtype(x.dtype) in _X_DTYPES
            and 0 < _rows_per_matrix(x, qw) <= configs.MMA_GEMV_MAX_M and qw.shape[-2] > 0)


def gemm_qmm_applies(x, qw, *, transpose, precision, platform):
    return (_qw_ok(qw) and transpose and jnp.dtype(x.dtype) in _GEMM_X_DTYPES
            and _rows_per_matrix(x, qw) > configs.MMA_GEMV_MAX_M and qw.shape[-2] > 0)


def gemm_qmm_auto(x, qw, *, transpose, precision, platform):
    return _rows_per_matrix(x, qw) <= configs.mma_gemm_max_m(qw)


def dequantize_applies(qw, *, dtype, platform):
    return _qw_ok(qw) and jnp.dtype(dtype) in _GEMM_X_DTYPES


def cublas_qmm_auto(x, qw, *, transpose, precision, platform):
    return _rows_per_matrix(x, qw) > configs.mma_gemm_max_m(qw)


def cublas_qmm_impl(x, qw, *, transpose, precision, platform):
    """The weight dequantized by the layout's kernel, then XLA's dot (cuBLAS)."""
    return qmm_reference(x, qw, transpose=transpose, precision=precision,
                         dequantize=dequantize_mma_call)


def _qmm_on(call):
    """qmm's impl on `call(x3 [B, M, K], qw3 [B, N, K]) -> [B, M, N]`."""
    def impl(x, qw, *, transpose, precision, platform):
        qw3 = qw.flatten_leading()
        m, k, n = _rows_per_matrix(x, qw), x.shape[-1], qw.shape[-2]
        return call(x.reshape(qw3.shape[0], m, k), qw3).reshape(*x.shape[:-1], n)
    return impl


qmm_impl = _qmm_on(qmv_mma_call)
gemm_qmm_impl = _qmm_on(qmm_gemm_call)


def _fused_ok(x, qw, aux):
    """The cases both fused GEMVs take: x [..., K] (at most configs.MMA_GEMV_MAX_M rows) with a 2-D
    qw in the layout, the norm weight / bias (aux) None or a kernel dtype."""
    return (_qw_ok(qw) and qw.ndim == 2 and jnp.dtype(x.dtype) in _X_DTYPES
            and 0 < _rows_per_matrix(x, qw) <= configs.MMA_GEMV_MAX_M and qw.shape[0] > 0
            and (aux is None or jnp.dtype(aux.dtype) in _X_DTYPES))


def rms_norm_qmm_applies(x, norm_weight, qw, *, eps, weight_offset, precision, platform):
    x_bytes = _rows_per_matrix(x, qw) * (x.shape[-1] * jnp.dtype(x.dtype).itemsize + 16)
    return _fused_ok(x, qw, norm_weight) and x_bytes <= NORM_MAX_X_SHARED_BYTES


def rms_norm_qmm_impl(x, norm_weight, qw, *, eps, weight_offset, precision, platform):
    m, n = _rows_per_matrix(x, qw), qw.shape[0]
    y = gemv_mma_fused_call(x.reshape(1, m, x.shape[-1]), qw.flatten_leading(), norm_weight,
                           fuse=FUSE_NORM, eps=eps, weight_offset=weight_offset)
    return y.reshape(*x.shape[:-1], n)


def qmm_swiglu_applies(x, qw, bias, *, activation, limit, alpha, precision, platform):
    # a block owns gate tile j and up tile j + I / 16: whole tiles, I % 16 == 0
    return _fused_ok(x, qw, bias) and qw.shape[0] % (2 * cuda_mma.TILE_ROWS) == 0


def rms_norm_qmm_swiglu_applies(x, norm_weight, qw, bias, *, eps, weight_offset, activation,
                                limit, alpha, precision, platform):
    # the SwiGLU's kernel with the norm prologue: no bias operand left for it (the norm
    # weight takes the kernel's one), at most 8 rows (its one-n-tile kernels), x staged
    # as that kernel stages it
    rows = _rows_per_matrix(x, qw)
    x_bytes = rows * (x.shape[-1] * jnp.dtype(x.dtype).itemsize + 16)
    return (bias is None and rows <= 8 and _fused_ok(x, qw, norm_weight)
            and qw.shape[0] % (2 * cuda_mma.TILE_ROWS) == 0
            and x_bytes <= SWIGLU_MAX_X_SHARED_BYTES)


def rms_norm_qmm_swiglu_impl(x, norm_weight, qw, bias, *, eps, weight_offset, activation, limit,
                             alpha, precision, platform):
    m, i = _rows_per_matrix(x, qw), qw.shape[0] // 2
    y = gemv_mma_fused_call(x.reshape(1, m, x.shape[-1]), qw.flatten_leading(), norm_weight,
                            fuse=FUSE_NORM_SWIGLU, eps=eps, weight_offset=weight_offset,
                            activation=activation, limit=limit, alpha=alpha)
    return y.reshape(*x.shape[:-1], i)


def qmm_add_applies(x, qw, addend, *, precision, platform):
    return _fused_ok(x, qw, None)


def qmm_add_impl(x, qw, addend, *, precision, platform):
    m, n = _rows_per_matrix(x, qw), qw.shape[0]
    y = gemv_mma_fused_call(x.reshape(1, m, x.shape[-1]), qw.flatten_leading(),
                            addend.reshape(1, m, n), fuse=FUSE_ADD)
    return y.reshape(*x.shape[:-1], n)


def qmm_swiglu_impl(x, qw, bias, *, activation, limit, alpha, precision, platform):
    m, i = _rows_per_matrix(x, qw), qw.shape[0] // 2
    y = gemv_mma_fused_call(x.reshape(1, m, x.shape[-1]), qw.flatten_leading(), bias, fuse=FUSE_SWIGLU,
                           activation=activation, limit=limit, alpha=alpha)
    return y.reshape(*x.shape[:-1], i)


def gather_qmm_applies(x, qw, indices, *, transpose, precision, platform):
    return (_qw_ok(qw) and transpose and jnp.dtype(x.dtype) in _X_DTYPES
            and qw.shape[1] > 0 and indices.shape[0] * indices.shape[1] <= 65535)


def _gather_slots(x, qw, indices):
    """gather_qmm's operands as the GEMV takes them: x3 [T or T*k, 1, K], the ids
    int32 [T*k] (one outside [0, E) as -1: a NaN row), and the dedupe."""
    t, slots = indices.shape
    idx = jnp.where((indices >= 0) & (indices < qw.shape[0]), indices, -1)
    x3 = x.reshape(t * slots if x.ndim == 3 else t, 1, x.shape[-1])
    # decode (T > 1): the tokens that pick one expert share one read of it (at most T
    # of them when a token's k ids are distinct; more simply start another segment)
    dedupe = min(t, configs.MMA_GEMV_MAX_M) if t > 1 else 0
    return x3, idx.astype(jnp.int32).reshape(-1), dedupe


def gather_qmm_impl(x, qw, indices, *, transpose, precision, platform):
    x3, ids, dedupe = _gather_slots(x, qw, indices)
    y = qmv_mma_call(x3, qw, ids, dedupe=dedupe)
    return y.reshape(*indices.shape, qw.shape[1])


def gather_qmm_swiglu_applies(x, qw, indices, bias, *, activation, limit, alpha, precision,
                              platform):
    return (gather_qmm_applies(x, qw, indices, transpose=True, precision=precision,
                               platform=platform)
            and qw.shape[1] % (2 * cuda_mma.TILE_ROWS) == 0
            and (bias is None or jnp.dtype(bias.dtype) in _X_DTYPES))


def gather_qmm_swiglu_impl(x, qw, indices, bias, *, activation, limit, alpha, precision,
                           platform):
    x3, ids, dedupe = _gather_slots(x, qw, indices)
    y = gemv_mma_fused_call(x3, qw, bias, fuse=FUSE_SWIGLU, activation=activation, limit=limit,
                           alpha=alpha, indices=ids, dedupe=dedupe)
    return y.reshape(*indices.shape, qw.shape[1] // 2)


def ragged_qmm_applies(x, qw, group_sizes, *, transpose, precision, platform):
    t = x.shape[0]
    dtypes = _X_DTYPES if t <= configs.RAGGED_GATHER_MAX_T else _GEMM_X_DTYPES
    return (_qw_ok(qw) and transpose and x.ndim == 2 and jnp.dtype(x.dtype) in dtypes
            and qw.shape[1] > 0 and group_sizes.shape == (qw.shape[0],))


def ragged_qmm_impl(x, qw, group_sizes, *, transpose, precision, platform):
    t = x.shape[0]
    if t > configs.RAGGED_GATHER_MAX_T:
        # the kernel clamps each size to [0, T] and cuts the groups at T itself
        return qmm_gemm_call(x[None], qw, jnp.clip(group_sizes, 0, t).astype(jnp.int32))[0]
    # few rows: each row is a gather slot of its group's expert (ids stay on the
    # device); rows past the groups get id E (a NaN row), then zero
    ends = ragged_group_ends(group_sizes, t)
    ids = sorted_search(ends, jnp.arange(t, dtype=ends.dtype))
    y = qmv_mma_call(x[:, None, :], qw, ids.astype(jnp.int32),
                     dedupe=configs.ragged_gather_dedupe(t))
    past = jnp.arange(t) >= ends[-1]
    return jnp.where(past[:, None], jnp.zeros((), y.dtype), y[:, 0, :])


def ragged_matmul_call(x, w, group_sizes):
    """x [T, K] with float experts w [E, N, K] in x's dtype (float16 or bfloat16),
    group_sizes int32 [E] -> [T, N]; rows past sum(group_sizes) zero."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return jax.ffi.ffi_call(RAGGED_MATMUL_TARGET, out, vmap_method="sequential")(
        x, w, group_sizes)


def ragged_matmul_applies(x, w, group_sizes, *, transpose, precision, platform):
    # the kernel's tensor maps: K a multiple of 8 (16-byte rows), int32 coordinates
    if not (transpose and x.ndim == 2 and w.ndim == 3 and configs.wgmma_usable()):
        return False
    e, n, k = w.shape
    return (jnp.dtype(x.dtype) in _GEMM_X_DTYPES and jnp.dtype(w.dtype) == jnp.dtype(x.dtype)
            and x.shape[1] == k and k > 0 and k % 8 == 0 and group_sizes.shape == (e,)
            and x.shape[0] < 2**31 and e * n < 2**31)


def ragged_matmul_impl(x, w, group_sizes, *, transpose, precision, platform):
    # 16-bit products are exact in the float32 accumulators: `precision` changes nothing.
    # The kernel cuts the groups at T itself; the clip keeps wide sizes from wrapping.
    t = x.shape[0]
    return ragged_matmul_call(x, w, jnp.clip(group_sizes, 0, t).astype(jnp.int32))


def register(lib) -> None:
    """Register the CUDA library's kernels on the layout and on float experts (their own
    handler symbols, jq_gpu_qmv_mma, jq_gpu_gemv_mma_fused, jq_gpu_qmm_gemm,
    jq_gpu_ragged_matmul and jq_gpu_dequant_mma, beside the targets every library
    lists) and their lowerings;
    make cuda_mma `jq.prepack`'s default on CUDA. A library without the symbol
    (built before it existed) leaves everything as it was."""
    try:
        # the handlers carry XLA's command-buffer trait (gpu_src/cuda/gemv_mma.hip);
        # $JAXQUANT_CMD_BUFFER=0 registers the GEMV without it, for measurements
        plain = os.environ.get("JAXQUANT_CMD_BUFFER") == "0"
        fn = lib.handle.jq_gpu_qmv_mma_uncaptured if plain else lib.handle.jq_gpu_qmv_mma
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(fn), platform="CUDA")
    except Exception:  # noqa: BLE001 - no kernel: the layout stays opt-in
        return
    dispatch.register("qmm", "ffi", ("cuda",), qmm_impl, qmm_applies, priority=PRIORITY)
    dispatch.register("gather_qmm", "ffi", ("cuda",), gather_qmm_impl, gather_qmm_applies,
                      priority=PRIORITY)
    # the handlers a newer library adds: symbol, target, the kernels on it
    optional = (
        ("jq_gpu_gemv_mma_fused", FUSED_TARGET,  # the fused GEMVs
         # opt-in: slower in the decode step than the norm and the GEMV apart (configs.py)
         (("rms_norm_qmm", rms_norm_qmm_impl, rms_norm_qmm_applies, PRIORITY, configs.never),
          ("qmm_swiglu", qmm_swiglu_impl, qmm_swiglu_applies, PRIORITY,
           configs.auto_fused("qmm_swiglu")),
          # opt-in: slower than the norm and qmm_swiglu's kernel apart (configs.py)
          ("rms_norm_qmm_swiglu", rms_norm_qmm_swiglu_impl, rms_norm_qmm_swiglu_applies,
           PRIORITY, configs.never),
          ("qmm_add", qmm_add_impl, qmm_add_applies, PRIORITY, configs.auto_fused("qmm_add")),
          # opt-in: slower than the unfused ops it replaces (configs.py)
          ("gather_qmm_swiglu", gather_qmm_swiglu_impl, gather_qmm_swiglu_applies, PRIORITY,
           configs.never))),
        ("jq_gpu_qmm_gemm", GEMM_TARGET,  # the prefill GEMM
         (("qmm", gemm_qmm_impl, gemm_qmm_applies, PRIORITY, gemm_qmm_auto),
          ("ragged_qmm", ragged_qmm_impl, ragged_qmm_applies, PRIORITY, None))),
        ("jq_gpu_ragged_matmul", RAGGED_MATMUL_TARGET,  # float experts' grouped GEMM
         (("ragged_matmul", ragged_matmul_impl, ragged_matmul_applies, PRIORITY, None),)),
        ("jq_gpu_dequant_mma", DEQUANT_TARGET,  # the layout's dequantize
         (("dequantize", dequantize_mma_call, dequantize_applies, PRIORITY, None),
          # many rows: below the GEMM, which an explicit backend="ffi" gets
          ("qmm", cublas_qmm_impl, gemm_qmm_applies, PRIORITY - 1, cublas_qmm_auto))),
    )
    for symbol, target, kernels in optional:
        if not hasattr(lib.handle, symbol):
            continue
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib.handle, symbol)),
                                    platform="CUDA")
        for primitive, impl, applies, priority, auto in kernels:
            dispatch.register(primitive, "ffi", ("cuda",), impl, applies, priority=priority,
                              auto=auto)
    cuda_mma.make_default_on("cuda")
