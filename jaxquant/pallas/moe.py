"""Pallas (Triton lowering) kernels for routed MoE: gather_qmm (decode) and
ragged_qmm (prefill) on quantized experts, gather_matmul (decode) and ragged_matmul
(prefill) on float experts.
The quantized two are qmm's kernels (`jaxquant.pallas.gemv`, `jaxquant.pallas.gemm`)
with an expert axis; neither repeats any decode code.
`lower_gather_qmm` / `lower_ragged_qmm` are what the dispatcher runs (cases the
`supports_*` functions accepted, no argument checks); `gather_qmm` / `ragged_qmm`
are the same for direct use, with a check.

gather_qmm(x, qw, indices): out[t, j] = x[t] (or x[t, j]) @ dequantize(qw[indices[t, j]]).T,
qw [E, N, K] (transpose=True) or [E, K, N] (transpose=False). qmm's GEMV
(`gemv.gemv_t` / `gemv.gemv_n`) with a third grid axis over the T*k (token, slot) pairs:
each program reads its slot's expert id from the device array (Pallas Triton has
no scalar prefetch, so the id is one scalar load in the kernel), maps ids outside
[0, E) to expert 0 and offsets its weight, scale and bias rows by id * rows in the
[E*rows, ...] views of the operands. Only that expert's packed rows are streamed;
no host sync, no gather of the weights in XLA. The block config is qmm's own for
one row of x (configs.select with M=1) and the kernel body is the same code, so
every output element goes through the same float ops as qmm(x[t], qw[indices[t, j]]):
gather == qmm bit for bit on this backend (docs/ops.md). Rows of bad ids read
expert 0 (in bounds) and are then overwritten with NaN.

gather_matmul(x, w, indices) (transpose=True): a grid over (slots, N blocks) on float
experts w [E, N, K] (`gemv.gather_gemv_float`): each program reads its slot's id, streams
that expert's
[bn, K] rows in place (an [E*N, K] view) against x's row with float32 FMA. Bad ids read
expert 0 and are overwritten with NaN, as for gather_qmm.

ragged_qmm(x, qw, group_sizes) (transpose=True): qmm's tiled GEMM (`gemm.gemm_t`) over
work items (expert, row tile, row range) computed from cumsum(group_sizes) on the
device by a small jnp prologue (`ragged_schedule`); a tile that straddles groups
is one item per group (masked rows), items past the last are empty. Rows past
sum(group_sizes) are zeroed after the kernel.

ragged_matmul(x, w, group_sizes) (transpose=True): the same schedule over a float GEMM
(`gemm.ragged_gemm_float`): each work item's rows against bn rows of its expert, read in
place from an [E*N, K] view, where XLA's `lax.ragged_dot` on a GPU transposes every
expert and multiplies every row by every expert.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxquant.ops.common import ragged_group_ends, sorted_search
from jaxquant.pallas import codecs, configs
from jaxquant.pallas.common import X_DTYPES, dot_precision
from jaxquant.pallas.gemm import gemm_block_m, gemm_t, ragged_gemm_float
from jaxquant.pallas.gemv import gather_gemv_float, gemv_n, gemv_t
from jaxquant.quantized_array import CANONICAL, QuantizedArray

# Triton grids: axis 2 (the slots) is limited to 65535 programs on CUDA.
MAX_SLOTS = 65535


def _expert_weights_ok(x, qw) -> bool:
    """What both MoE kernels need of x and the stacked experts qw [E, ., .]."""
    if jnp.dtype(x.dtype) not in X_DTYPES or qw.layout != CANONICAL:
        return False
    if len(qw.shape) != 3 or qw.data.dtype != jnp.uint32:
        return False
    codecs.geometry(qw.bits, qw.group_size)     # raises for what no kernel decodes
    # one global scale, or one per expert
    return qw.global_scale is None or math.prod(np.shape(qw.global_scale)) in (1, qw.shape[0])


def supports_gather(x, qw, indices, *, transpose=True, **params) -> bool:
    """Whether `gather_qmm` has a kernel for these arguments (x, indices: anything
    with a shape and dtype, e.g. ShapedArrays; other params are ignored)."""
    try:
        if not _expert_weights_ok(x, qw) or len(indices.shape) != 2:
            return False
        k = qw.shape[2] if transpose else qw.shape[1]
        t, slots = indices.shape
        return tuple(x.shape) in ((t, k), (t, slots, k)) and 0 < t * slots <= MAX_SLOTS
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False


def _slot_ids(indices, num_experts):
    """int32 [T*k] ids, bad ones kept bad (-1 or E; no int64 -> int32 wrap-around)."""
    info = np.iinfo(indices.dtype)
    if info.max > num_experts:
        hi = np.asarray(num_experts, indices.dtype)
        indices = jnp.minimum(indices, hi) if info.min == 0 else jnp.clip(
            indices, np.asarray(-1, indices.dtype), hi)
    return indices.astype(jnp.int32).reshape(-1)


def gather_raw(x, qw: QuantizedArray, ids, *, transpose=True, platform="cuda",
               interpret=False, config=None):
    """The kernel alone: x2 [Sx, K], ids int32 [S] (S a multiple of Sx; slot s reads
    x2[s // (S // Sx)]) -> [S, N]. Ids outside [0, E) read expert 0 (in bounds; its
    values): `gather_qmm` turns those rows into NaN."""
    e, rows, cols = qw.shape
    k, n = (cols, rows) if transpose else (rows, cols)
    platform = "interpret" if interpret else platform
    if config is None:
        # qmm's own choice for one row of x: the bit-identity invariant rests on it.
        config = configs.select(platform, transpose, 1, n, k, qw.bits, qw.group_size, x.dtype)
    if config.kernel != "gemv":
        raise ValueError(f"gather_qmm runs qmm's GEMV kernel; got config {config}")
    fn = gemv_t if transpose else gemv_n
    return fn(x, qw, config, interpret=interpret, hw=not interpret, precision=None, ids=ids,
              x_div=ids.shape[0] // x.shape[0])


def lower_gather_qmm(x, qw: QuantizedArray, indices, *, transpose: bool, precision,
                     platform: str, interpret: bool = False,
                     config: configs.KernelConfig | None = None):
    """MoE decode on the Pallas GEMV for a case `supports_gather` accepted: x [T, K] or
    [T, k, K], qw [E, N, K] (transpose) or [E, K, N], indices int [T, k] -> [T, k, N] in
    x.dtype; ids outside [0, E) give NaN rows."""
    del precision  # float32 FMA throughout, like qmm's GEMV
    e, rows, cols = qw.shape
    n, k = (rows, cols) if transpose else (cols, rows)
    t, slots = indices.shape
    valid = (indices >= 0) & (indices < e)
    if n == 0 or k == 0:
        y = jnp.zeros((t, slots, n), x.dtype)
    else:
        y = gather_raw(x.reshape(-1, k), qw, _slot_ids(indices, e), transpose=transpose,
                       interpret=interpret, platform=platform,
                       config=config).reshape(t, slots, n)
    return jnp.where(valid[..., None], y, jnp.asarray(jnp.nan, x.dtype))


def gather_qmm(x, qw: QuantizedArray, indices, *, transpose: bool = True, precision=None,
               platform: str = "cuda", interpret: bool = False,
               config: configs.KernelConfig | None = None):
    """`lower_gather_qmm` for direct use: a ValueError where it has no kernel."""
    x, indices = _checked("gather_qmm", supports_gather, x, qw, indices, transpose)
    return lower_gather_qmm(x, qw, indices, transpose=transpose, precision=precision,
                            platform=platform, interpret=interpret, config=config)


def _checked(name, supports, x, qw, third, transpose):
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    x, third = jnp.asarray(x), jnp.asarray(third)
    if not supports(x, qw, third, transpose=transpose):
        raise ValueError(f"the pallas {name} has no kernel for x {x.shape} {x.dtype}, "
                         f"qw {qw!r}, {third.shape}, transpose={transpose} "
                         f"(see supports_{name.split('_')[0]})")
    return x, third


def _checked_float(name, supports, x, w, third, third_name, transpose):
    """_checked for the float ops (gather_matmul, ragged_matmul): arrays, else a ValueError."""
    x, w, third = jnp.asarray(x), jnp.asarray(w), jnp.asarray(third)
    if not supports(x, w, third, transpose=transpose):
        raise ValueError(f"the pallas {name} has no kernel for x {x.shape} {x.dtype}, "
                         f"w {w.shape} {w.dtype}, {third_name} {third.shape}, "
                         f"transpose={transpose} (see supports_{name})")
    return x, w, third


def _zero_rows_past_groups(y, group_sizes):
    """ragged_qmm's and ragged_matmul's rows past sum(group_sizes): zero (like
    lax.ragged_dot); the kernels leave them unwritten."""
    t = y.shape[0]
    total = ragged_group_ends(group_sizes, t)[-1]
    return jnp.where((jnp.arange(t) < total)[:, None], y, jnp.zeros((), y.dtype))


# ---------------------------------------------------------------------------
# gather_matmul (decode on float expert weights): the float expert GEMV.


def _float_experts(x, w, transpose, max_n) -> bool:
    """What both float-expert kernels need of x and w: transpose=True, x and w
    float32/float16/bfloat16, w [E, N, K] non-empty with N <= max_n (the N blocks on
    Triton's second grid axis, at most MAX_SLOTS of them) and E * N within an int32 row
    index into the [E*N, K] view."""
    if not transpose or len(w.shape) != 3:
        return False
    if jnp.dtype(x.dtype) not in X_DTYPES or jnp.dtype(w.dtype) not in X_DTYPES:
        return False
    e, n, k = w.shape
    return e > 0 and 0 < n <= max_n and k > 0 and e * n < 2**31


def supports_gather_matmul(x, w, indices, *, transpose=True, **params) -> bool:
    """Whether `gather_matmul` has a kernel for these arguments (ShapedArrays or arrays;
    other params are ignored): transpose=True, x and w float32/float16/bfloat16."""
    try:
        if (len(indices.shape) != 2 or not _float_experts(
                x, w, transpose, MAX_SLOTS * configs.FLOAT_GEMV_MIN_BLOCK_N)):
            return False
        t, slots = indices.shape
        k = w.shape[2]
        return tuple(x.shape) in ((t, k), (t, slots, k)) and t * slots > 0
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False


def lower_gather_matmul(x, w, indices, *, transpose: bool, precision, platform: str,
                        interpret: bool = False,
                        config: configs.FloatGemvConfig | None = None):
    """MoE decode on float experts for a case `supports_gather_matmul` accepted: x [T, K]
    or [T, k, K], w [E, N, K], indices int [T, k] -> [T, k, N] in x.dtype; ids outside
    [0, E) give NaN rows."""
    del transpose, precision  # transpose=True only; float32 FMA throughout (IEEE)
    e, n, k = w.shape
    t, slots = indices.shape
    if config is None:
        config = configs.select_float_gemv("interpret" if interpret else platform, n, t * slots)
    ids = _slot_ids(indices, e)
    y = gather_gemv_float(x.reshape(-1, k), w, ids, config, interpret=interpret,
                          x_div=ids.shape[0] * k // x.size).reshape(t, slots, n)
    valid = (indices >= 0) & (indices < e)
    return jnp.where(valid[..., None], y, jnp.asarray(jnp.nan, x.dtype))


def gather_matmul(x, w, indices, *, transpose: bool = True, precision=None,
                  platform: str = "cuda", interpret: bool = False,
                  config: configs.FloatGemvConfig | None = None):
    """`lower_gather_matmul` for direct use: a ValueError where it has no kernel."""
    x, w, indices = _checked_float("gather_matmul", supports_gather_matmul, x, w, indices,
                                   "indices", transpose)
    return lower_gather_matmul(x, w, indices, transpose=transpose, precision=precision,
                               platform=platform, interpret=interpret, config=config)


# ---------------------------------------------------------------------------
# ragged_qmm (prefill): qmm's GEMM over a device-computed tile schedule.


def supports_ragged(x, qw, group_sizes, *, transpose=True, **params) -> bool:
    """Whether `ragged_qmm` has a kernel for these arguments (x, group_sizes: anything
    with a shape and dtype, e.g. ShapedArrays; other params are ignored)."""
    try:
        if not transpose or not _expert_weights_ok(x, qw) or len(x.shape) != 2:
            return False
        if tuple(group_sizes.shape) != (qw.shape[0],) or x.shape[1] != qw.shape[2]:
            return False
        return x.shape[0] > 0 and qw.shape[1] > 0 and qw.shape[2] > 0
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False


def ragged_schedule(group_sizes, rows, bm):
    """The GEMM work items of a ragged problem, computed on the device (no host sync):
    int32 [4, W], W = cdiv(rows, bm) + E - 1 (a static bound): per item (expert, first row
    of its bm-row tile, first and end row of the expert's rows in that tile). A tile
    straddling groups is one item per group; items past the last are empty (lo == hi)."""
    num_experts = group_sizes.shape[0]
    ends = ragged_group_ends(group_sizes, rows)           # rows past T belong to no group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // bm
    tiles = jnp.where(ends > starts, (ends - 1) // bm - first + 1, 0)
    offsets = jnp.cumsum(tiles)                           # inclusive
    w = jnp.arange(-(-rows // bm) + num_experts - 1, dtype=jnp.int32)
    e = jnp.minimum(sorted_search(offsets, w), num_experts - 1)
    used = w < offsets[-1]
    m0 = (first[e] + w - (offsets[e] - tiles[e])) * bm
    lo = jnp.where(used, jnp.maximum(starts[e], m0), 0)
    hi = jnp.where(used, jnp.minimum(ends[e], m0 + bm), 0)
    return jnp.stack([e, jnp.where(used, m0, 0), lo, hi]).astype(jnp.int32)


def _ragged_config(platform, t, n, k, qw, x_dtype):
    # The tile class from the mean group size (never the GEMV: at least PALLAS_GEMV_MAX_M + 1).
    m = max(configs.PALLAS_GEMV_MAX_M[platform] + 1, -(-t // qw.shape[0]))
    cfg = configs.select(platform, True, m, n, k, qw.bits, qw.group_size, x_dtype)
    assert cfg.kernel == "gemm", cfg
    return cfg


def lower_ragged_qmm(x, qw: QuantizedArray, group_sizes, *, transpose: bool, precision,
                     platform: str, interpret: bool = False,
                     config: configs.KernelConfig | None = None):
    """MoE prefill for a case `supports_ragged` accepted: x [T, K] rows sorted by expert,
    group_sizes int [E], qw [E, N, K] -> [T, N] in x.dtype; rows past sum(group_sizes)
    are zero (like lax.ragged_dot)."""
    t, k = x.shape
    n = qw.shape[1]
    platform = "interpret" if interpret else platform
    if config is None:
        config = _ragged_config(platform, t, n, k, qw, x.dtype)
    sched = ragged_schedule(group_sizes, t, gemm_block_m(x.dtype, config))
    y = gemm_t(x, qw, config, interpret=interpret, hw=not interpret,
               precision=dot_precision(precision, x.dtype), schedule=sched)
    return _zero_rows_past_groups(y, group_sizes)


def ragged_qmm(x, qw: QuantizedArray, group_sizes, *, transpose: bool = True, precision=None,
               platform: str = "cuda", interpret: bool = False,
               config: configs.KernelConfig | None = None):
    """`lower_ragged_qmm` for direct use: a ValueError where it has no kernel."""
    x, group_sizes = _checked("ragged_qmm", supports_ragged, x, qw, group_sizes, transpose)
    return lower_ragged_qmm(x, qw, group_sizes, transpose=transpose, precision=precision,
                            platform=platform, interpret=interpret, config=config)


# ---------------------------------------------------------------------------
# ragged_matmul (prefill on float expert weights): the float GEMM over the same schedule.


def supports_ragged_matmul(x, w, group_sizes, *, transpose=True, **params) -> bool:
    """Whether `ragged_matmul` has a kernel for these arguments (ShapedArrays or arrays;
    other params are ignored): transpose=True, x and w float32/float16/bfloat16."""
    try:
        # grid (work items, N blocks of at least 16)
        if len(x.shape) != 2 or not _float_experts(x, w, transpose, MAX_SLOTS * 16):
            return False
        e, _, k = w.shape
        return tuple(group_sizes.shape) == (e,) and x.shape[1] == k and x.shape[0] > 0
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False


def lower_ragged_matmul(x, w, group_sizes, *, transpose: bool, precision, platform: str,
                        interpret: bool = False,
                        config: configs.FloatGemmConfig | None = None):
    """MoE prefill on float experts for a case `supports_ragged_matmul` accepted: x [T, K]
    rows sorted by expert, group_sizes int [E], w [E, N, K] -> [T, N] in x.dtype; rows
    past sum(group_sizes) are zero (like lax.ragged_dot)."""
    del transpose
    t = x.shape[0]
    if config is None:
        config = configs.select_ragged_float("interpret" if interpret else platform, t,
                                             w.shape[0])
    sched = ragged_schedule(group_sizes, t, config.block_m)
    y = ragged_gemm_float(x, w, sched, config, interpret=interpret,
                          precision=dot_precision(precision, x.dtype))
    return _zero_rows_past_groups(y, group_sizes)


def ragged_matmul(x, w, group_sizes, *, transpose: bool = True, precision=None,
                  platform: str = "cuda", interpret: bool = False,
                  config: configs.FloatGemmConfig | None = None):
    """`lower_ragged_matmul` for direct use: a ValueError where it has no kernel."""
    x, w, group_sizes = _checked_float("ragged_matmul", supports_ragged_matmul, x, w,
                                       group_sizes, "group_sizes", transpose)
    return lower_ragged_matmul(x, w, group_sizes, transpose=transpose, precision=precision,
                               platform=platform, interpret=interpret, config=config)


__all__ = ["MAX_SLOTS", "gather_matmul", "gather_qmm", "gather_raw", "lower_gather_matmul",
           "lower_gather_qmm", "lower_ragged_matmul", "lower_ragged_qmm", "ragged_matmul",
           "ragged_qmm", "ragged_schedule", "supports_gather", "supports_gather_matmul",
           "supports_ragged", "supports_ragged_matmul"]
