"""Pallas (Triton lowering) kernels for routed MoE: gather_qmm (decode) and
ragged_qmm (prefill). Both are qmm's kernels (`jaxquant.pallas.qmm`) with an expert
axis; neither repeats any decode code.

gather_qmm(x, qw, indices): out[t, j] = x[t] (or x[t, j]) @ dequantize(qw[indices[t, j]]).T,
qw [E, N, K] (transpose=True) or [E, K, N] (transpose=False). qmm's GEMV
(`_gemv_t` / `_gemv_n`) with a third grid axis over the T*k (token, slot) pairs:
each program reads its slot's expert id from the device array (Pallas Triton has
no scalar prefetch, so the id is one scalar load in the kernel), maps ids outside
[0, E) to expert 0 and offsets its weight, scale and bias rows by id * rows in the
[E*rows, ...] views of the operands. Only that expert's packed rows are streamed;
no host sync, no gather of the weights in XLA. The block config is qmm's own for
one row of x (configs.select with M=1) and the kernel body is the same code, so
every output element goes through the same float ops as qmm(x[t], qw[indices[t, j]]):
gather == qmm bit for bit on this backend (DESIGN.md §4). Rows of bad ids read
expert 0 (in bounds) and are then overwritten with NaN.

ragged_qmm(x, qw, group_sizes) (transpose=True): qmm's tiled GEMM (`_gemm_t`) over
work items (expert, row tile, row range) computed from cumsum(group_sizes) on the
device by a small jnp prologue (`ragged_schedule`); a tile that straddles groups
is one item per group (masked rows), items past the last are empty. Rows past
sum(group_sizes) are zeroed after the kernel.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np

from jaxquant.pallas import codecs, configs
from jaxquant.quantized_array import CANONICAL, QuantizedArray

# The module (jaxquant.pallas re-exports its `qmm` function under the same name).
_q = importlib.import_module("jaxquant.pallas.qmm")

# Triton grids: axis 2 (the slots) is limited to 65535 programs on CUDA.
MAX_SLOTS = 65535


def supports_gather(x, qw, indices, *, transpose=True, **params) -> bool:
    """Whether `gather_qmm` has a kernel for these arguments (x, indices: anything
    with a shape and dtype, e.g. ShapedArrays; other params are ignored)."""
    x_shape, x_dtype, indices_shape = x.shape, x.dtype, indices.shape
    try:
        if jnp.dtype(x_dtype) not in _q._X_DTYPES or qw.layout != CANONICAL:
            return False
        if len(qw.shape) != 3 or len(indices_shape) != 2 or qw.data.dtype != jnp.uint32:
            return False
        if qw.global_scale is not None and int(np.prod(np.shape(qw.global_scale))) not in (
                1, qw.shape[0]):
            return False            # one global scale, or one per expert
        k = qw.shape[2] if transpose else qw.shape[1]
        t, slots = indices_shape
        if tuple(x_shape) not in ((t, k), (t, slots, k)):
            return False
        if not 0 < t * slots <= MAX_SLOTS:
            return False
        codecs.geometry(qw.bits, qw.group_size)
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False
    return True


def _slot_ids(indices, num_experts):
    """int32 [T*k] ids, bad ones kept bad (-1 or E; no int64 -> int32 wrap-around)."""
    info = np.iinfo(indices.dtype)
    if info.max > num_experts:
        hi = np.asarray(num_experts, indices.dtype)
        indices = jnp.minimum(indices, hi) if info.min == 0 else jnp.clip(
            indices, np.asarray(-1, indices.dtype), hi)
    return indices.astype(jnp.int32).reshape(-1)


def gather_raw(x, qw: QuantizedArray, ids, *, transpose=True, interpret=False, platform=None,
               config=None):
    """The kernel alone: x2 [Sx, K], ids int32 [S] (S a multiple of Sx; slot s reads
    x2[s // (S // Sx)]) -> [S, N]. Ids outside [0, E) read expert 0 (in bounds; its
    values): `gather_qmm` turns those rows into NaN."""
    e, rows, cols = qw.shape
    k, n = (cols, rows) if transpose else (rows, cols)
    s = ids.shape[0]
    if platform is None:
        platform = "interpret" if interpret else _q.detect_platform()
    elif interpret:
        platform = "interpret"
    if config is None:
        # qmm's own choice for one row of x: the bit-identity invariant rests on it.
        config = configs.select(platform, transpose, 1, n, k, qw.bits, qw.group_size, x.dtype)
    if config.kernel != "gemv":
        raise ValueError(f"gather_qmm runs qmm's GEMV kernel; got config {config}")
    fn = _q._gemv_t if transpose else _q._gemv_n
    return fn(x, qw, config, interpret=interpret, hw=not interpret, precision=None, ids=ids,
              x_div=s // x.shape[0])


def gather_qmm(x, qw: QuantizedArray, indices, *, transpose: bool = True, precision=None,
               interpret: bool = False, platform: str | None = None,
               config: configs.KernelConfig | None = None):
    """MoE decode on the Pallas GEMV: x [T, K] or [T, k, K], qw [E, N, K] (transpose) or
    [E, K, N], indices int [T, k] -> [T, k, N] in x.dtype; ids outside [0, E) give NaN rows."""
    del precision  # float32 FMA throughout, like qmm's GEMV
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    x = jnp.asarray(x)
    indices = jnp.asarray(indices)
    if not supports_gather(x, qw, indices, transpose=transpose):
        raise ValueError(f"the pallas gather_qmm has no kernel for x {x.shape} {x.dtype}, "
                         f"qw {qw!r}, indices {indices.shape} (see supports_gather)")
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


# ---------------------------------------------------------------------------
# ragged_qmm (prefill): qmm's GEMM over a device-computed tile schedule.


def supports_ragged(x, qw, group_sizes, *, transpose=True, **params) -> bool:
    """Whether `ragged_qmm` has a kernel for these arguments (x, group_sizes: anything
    with a shape and dtype, e.g. ShapedArrays; other params are ignored)."""
    x_shape, x_dtype, group_sizes_shape = x.shape, x.dtype, group_sizes.shape
    try:
        if not transpose or jnp.dtype(x_dtype) not in _q._X_DTYPES or qw.layout != CANONICAL:
            return False
        if len(qw.shape) != 3 or qw.data.dtype != jnp.uint32 or len(x_shape) != 2:
            return False
        if tuple(group_sizes_shape) != (qw.shape[0],) or x_shape[1] != qw.shape[2]:
            return False
        if qw.global_scale is not None and int(np.prod(np.shape(qw.global_scale))) not in (
                1, qw.shape[0]):
            return False
        if x_shape[0] == 0 or qw.shape[1] == 0 or qw.shape[2] == 0:
            return False
        codecs.geometry(qw.bits, qw.group_size)
    except Exception:  # noqa: BLE001
        return False
    return True


def ragged_schedule(group_sizes, rows, bm):
    """The GEMM work items of a ragged problem, computed on the device (no host sync):
    int32 [4, W], W = cdiv(rows, bm) + E - 1 (a static bound): per item (expert, first row
    of its bm-row tile, first and end row of the expert's rows in that tile). A tile
    straddling groups is one item per group; items past the last are empty (lo == hi)."""
    num_experts = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)          # rows past T belong to no group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // bm
    tiles = jnp.where(ends > starts, (ends - 1) // bm - first + 1, 0)
    offsets = jnp.cumsum(tiles)                           # inclusive
    w = jnp.arange(-(-rows // bm) + num_experts - 1, dtype=jnp.int32)
    e = jnp.minimum(jnp.searchsorted(offsets, w, side="right"), num_experts - 1)
    used = w < offsets[-1]
    m0 = (first[e] + w - (offsets[e] - tiles[e])) * bm
    lo = jnp.where(used, jnp.maximum(starts[e], m0), 0)
    hi = jnp.where(used, jnp.minimum(ends[e], m0 + bm), 0)
    return jnp.stack([e, jnp.where(used, m0, 0), lo, hi]).astype(jnp.int32)


def _ragged_config(platform, t, n, k, qw, x_dtype):
    # The tile class from the mean group size (never the GEMV: at least GEMV_MAX_M + 1).
    m = max(configs.GEMV_MAX_M[platform] + 1, -(-t // qw.shape[0]))
    cfg = configs.select(platform, True, m, n, k, qw.bits, qw.group_size, x_dtype)
    assert cfg.kernel == "gemm", cfg
    return cfg


def ragged_qmm(x, qw: QuantizedArray, group_sizes, *, transpose: bool = True, precision=None,
               interpret: bool = False, platform: str | None = None,
               config: configs.KernelConfig | None = None):
    """MoE prefill: x [T, K] rows sorted by expert, group_sizes int [E], qw [E, N, K] ->
    [T, N] in x.dtype; rows past sum(group_sizes) are zero (like lax.ragged_dot)."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    x = jnp.asarray(x)
    group_sizes = jnp.asarray(group_sizes)
    if not supports_ragged(x, qw, group_sizes, transpose=transpose):
        raise ValueError(f"the pallas ragged_qmm has no kernel for x {x.shape} {x.dtype}, "
                         f"qw {qw!r}, group_sizes {group_sizes.shape}, transpose={transpose}")
    t, k = x.shape
    n = qw.shape[1]
    if platform is None:
        platform = "interpret" if interpret else _q.detect_platform()
    elif interpret:
        platform = "interpret"
    if config is None:
        config = _ragged_config(platform, t, n, k, qw, x.dtype)
    sched = ragged_schedule(group_sizes, t, _q.gemm_block_m(x.dtype, config))
    y = _q._gemm_t(x, qw, config, interpret=interpret, hw=not interpret,
                   precision=_q._dot_precision(precision, x.dtype), schedule=sched)
    total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), t)
    return jnp.where((jnp.arange(t) < total)[:, None], y, jnp.zeros((), x.dtype))


__all__ = ["gather_qmm", "gather_raw", "ragged_qmm", "ragged_schedule", "supports_gather",
           "supports_ragged", "MAX_SLOTS"]
