"""Pallas (Triton lowering) flash-decoding kernel for decode_attention.

Entry points: `lower_decode_attention` and `supports`, registered by
`jaxquant.pallas`; `decode_attention` for direct use. Block configs and the
`auto` rule: `jaxquant.pallas.configs` (ATTENTION_CONFIGS, auto_decode_attention).

Semantics are the reference's (jaxquant/ops/attention.py, docs/ops.md): scores,
softmax and the weighted sum of values in float32; output in q's dtype.

Layout. q [B, T, Hq, hd], the caches [B, S, Hkv, hd] (or a stack of every layer's,
[L, B, S, Hkv, hd], with the layer's index) and the output are read and written where
they are: no slice, transpose or copy in XLA (positions become int32, window and layer
1-element arrays, all tiny). A program owns one (batch, kv head) pair,
a tile of `bt` query positions and one split of the keys. Its query rows are the
bt positions x the kv head's G query heads (padded to `gp`, masked), so GQA
reads each cache block once for all the heads that share it; rows = bt * gp >= 16
(the tensor-core dot's minimum). Per loop step it loads a [block_s, hd] block of
keys and of values (rows of the cache, strided by Hkv * hd) and runs the online
softmax: scores = q @ k^T * scale on the tensor cores (16-bit q and k: exact
products, float32 sums), masked by position and window, running max / sum /
accumulator in float32, and p @ v with p split into a 16-bit high and low part
(two dots: float32-like weights at the cost of tensor-core work that a
memory-bound kernel has to spare). Float32 operands use float32 dots (IEEE with
precision "highest").

Only the blocks that hold visible keys are read: the loop runs from the lowest
position - window + 1 to the highest position of the program's rows, so a
decode step at position p reads p + 1 keys (window w: w keys), whatever S.

Splits (flash-decoding). With few (batch, kv head) programs the keys are split
over a third grid axis (configs: enough programs for every SM, at least
`min_split_keys` keys each); each split stores its running max, sum and
accumulator (float32, only the real rows) and a second kernel combines them
per row and applies the sinks: out = sum_j e^(m_j - M) acc_j /
(sum_j e^(m_j - M) l_j + e^(sink - M)), M = max(max_j m_j, sink). With one split
the same kernel finishes the rows itself (one launch). A row with no visible key
ends with l = 0: 0 / 0 = NaN without sinks, 0 with them, as the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxquant.pallas.common import X_DTYPES, cdiv, dot_precision, index, iota, pow2_ceil
from jaxquant.pallas.configs import ATTENTION_CONFIGS, AttentionConfig

_F32 = jnp.float32
MIN_DOT = 16         # Triton's smallest tensor-core dot dimension
MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static tiling of one call."""
    batch: int
    t: int           # query positions
    hkv: int
    group: int       # query heads per kv head (G)
    s: int           # cache length
    hd: int
    bt: int          # query positions per program
    gp: int          # query-head rows per position (G padded)
    hd_p: int        # hd padded to a power of two >= 16
    block_s: int     # keys per loop step
    chunk: int       # keys per split (a multiple of block_s)
    splits: int
    num_warps: int
    num_stages: int

    @property
    def rows(self):
        return self.bt * self.gp

    @property
    def row_tiles(self):
        return cdiv(self.t, self.bt)

    @property
    def grid(self):
        return (self.batch * self.hkv, self.row_tiles, self.splits)


def plan(platform: str, b: int, t: int, hq: int, hkv: int, s: int, hd: int,
         config: AttentionConfig | None = None) -> Plan:
    cfg = config or ATTENTION_CONFIGS[platform]
    g = hq // hkv
    gp0 = pow2_ceil(g)
    bt = min(pow2_ceil(t), max(1, cfg.max_rows // gp0))
    gp = max(gp0, MIN_DOT // bt)
    hd_p = max(MIN_DOT, pow2_ceil(hd))
    n_blocks = cdiv(s, cfg.block_s)
    programs = b * hkv * cdiv(t, bt)
    splits = min(cdiv(cfg.target_programs, programs), cfg.max_splits,
                 max(1, s // cfg.min_split_keys))
    blocks_per_split = cdiv(n_blocks, max(1, splits))
    splits = cdiv(n_blocks, blocks_per_split)
    return Plan(b, t, hkv, g, s, hd, bt, gp, hd_p, cfg.block_s, blocks_per_split * cfg.block_s,
                splits, cfg.num_warps, cfg.num_stages)


# ---------------------------------------------------------------------------
# Which cases the kernel takes.


MAX_T = 16  # query rows per sequence the kernel takes: decode (and speculative) steps


def supports(q, k_cache, v_cache, positions, window, sinks, layer=None, *, platform="cuda",
             config=None, **params) -> bool:
    """Whether the kernel takes these arguments (anything with a shape and dtype, e.g.
    ShapedArrays). float64 anywhere, empty shapes, heads wider than 256, more query
    heads per kv head than a program's rows, or more than MAX_T query rows (prefill,
    which the reference serves) -> no (the reference runs). Within MAX_T the kernel
    stayed within 1 bf16 ulp of the float64 oracle on an H100 except at 16 gpt-oss
    rows from position 0 (2.0 ulps: P is rounded to bf16 for the tensor-core P @ V,
    and a query seeing few keys does not average that out); the test allows 3."""
    try:
        if any(a is not None and jnp.dtype(a.dtype) not in X_DTYPES
               for a in (q, k_cache, v_cache, sinks)):
            return False
        b, t, hq, hd = q.shape
        s, hkv = k_cache.shape[-3], k_cache.shape[-2]
        if (min(b, t, hq, hd, s, hkv, k_cache.shape[0]) == 0 or hd > 256 or hq % hkv
                or t > MAX_T):
            return False
        cfg = config or ATTENTION_CONFIGS[platform]
        p = plan(platform, b, t, hq, hkv, s, hd, cfg)
        return (pow2_ceil(hq // hkv) <= cfg.max_rows and p.row_tiles <= MAX_GRID_YZ
                and p.splits <= MAX_GRID_YZ)
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False


# ---------------------------------------------------------------------------
# Kernel bodies.


def _row_masks(p: Plan):
    """This program's (batch, kv head, first query position) and row masks: t_ok [bt],
    g_ok [gp], row_ok [rows]."""
    bh = pl.program_id(0)
    b, g = bh // p.hkv, bh % p.hkv
    t0 = pl.program_id(1) * p.bt
    t_ok = t0 + iota(p.bt) < p.t
    g_ok = iota(p.gp) < p.group
    row_ok = (t_ok[:, None] & g_ok[None, :]).reshape(p.rows)
    return b, g, t0, t_ok, g_ok, row_ok


def _heads_at(p: Plan, b, g, t0, t_ok, g_ok):
    """Indexer and mask of the [bt, gp, hd_p] tile of q / the output."""
    d_ok = iota(p.hd_p) < p.hd
    idx = (b, pl.ds(t0, p.bt), pl.ds(g * p.group, p.gp), pl.ds(0, p.hd_p))
    mask = t_ok[:, None, None] & g_ok[None, :, None] & d_ok[None, None, :]
    return idx, mask


def _dot_nt(a, b, precision):
    """a [m, d] @ b[n, d]^T in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=_F32)


def _dot(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=_F32)


def _scores(q, k, precision):
    """q [rows, hd] . k [block_s, hd] in float32: 16-bit operands of one dtype go to
    the tensor cores as they are (exact products); anything else as float32."""
    if q.dtype == k.dtype and q.dtype != _F32:
        return _dot_nt(q, k, None)
    return _dot_nt(q.astype(_F32), k.astype(_F32), dot_precision(precision, _F32))


def _weighted(pr, v, precision):
    """pr [rows, block_s] float32 @ v [block_s, hd]: 16-bit v against pr split into a
    high and a low 16-bit part (two exact-product dots), float32 v as float32."""
    if v.dtype == _F32:
        return _dot(pr, v, dot_precision(precision, _F32))
    hi = pr.astype(v.dtype)
    lo = (pr - hi.astype(_F32)).astype(v.dtype)
    return _dot(hi, v, None) + _dot(lo, v, None)


def _finish(m, l, acc, sink):
    """Normalized rows from the running max m, sum l and accumulator acc; sink
    [rows] or None joins the denominator."""
    if sink is None:
        return acc / l[:, None]
    top = jnp.maximum(m, sink)
    w = jnp.exp(m - top)                      # m = -inf (no visible key): 0
    return acc * w[:, None] / (l * w + jnp.exp(sink - top))[:, None]


def _load_sinks(p: Plan, s_ref, g, g_ok):
    sink = plgpu.load(s_ref.at[pl.ds(g * p.group, p.gp)], mask=g_ok, other=0).astype(_F32)
    return jnp.broadcast_to(sink[None, :], (p.bt, p.gp)).reshape(p.rows)


def _store_heads(p: Plan, o_ref, out, b, g, t0, t_ok, g_ok):
    idx, mask = _heads_at(p, b, g, t0, t_ok, g_ok)
    plgpu.store(o_ref.at[idx], out.reshape(p.bt, p.gp, p.hd_p).astype(o_ref.dtype), mask=mask)


def _attention_kernel(*refs, p: Plan, scale, has_sinks, layers, precision):
    q_ref, k_ref, v_ref, pos_ref, w_ref = refs[:5]
    s_ref = refs[5] if has_sinks else None
    outs = refs[5 + has_sinks + bool(layers):]
    stack = ()
    if layers:  # a stack of every layer's cache: lax.dynamic_index_in_dim's index rule
        lyr = refs[5 + has_sinks][index(0)]
        stack = (jnp.clip(jnp.where(lyr < 0, lyr + layers, lyr), 0, layers - 1),)
    b, g, t0, t_ok, g_ok, row_ok = _row_masks(p)
    idx, mask = _heads_at(p, b, g, t0, t_ok, g_ok)
    q = plgpu.load(q_ref.at[idx], mask=mask, other=0).reshape(p.rows, p.hd_p)
    pos_t = plgpu.load(pos_ref.at[b, pl.ds(t0, p.bt)], mask=t_ok, other=0)
    pos = jnp.broadcast_to(pos_t[:, None], (p.bt, p.gp)).reshape(p.rows)
    window = w_ref[index(0)]

    # The keys any row can see: [lo, hi] (the mask below is exact; this only skips blocks).
    first = jnp.where(window == 0, 0, pos_t - window + 1)
    lo = jnp.maximum(jnp.min(jnp.where(t_ok, first, p.s)), 0)
    hi = jnp.minimum(jnp.max(jnp.where(t_ok, pos_t, -1)), p.s - 1)
    split0 = pl.program_id(2) * p.chunk
    blk_lo = jnp.maximum(split0, lo) // p.block_s
    blk_hi = cdiv(jnp.minimum(split0 + p.chunk, hi + 1), p.block_s)

    d_ok = iota(p.hd_p) < p.hd

    def step(i, carry):
        m, l, acc = carry
        s0 = pl.multiple_of(i * p.block_s, p.block_s)
        key_pos = s0 + iota(p.block_s)
        kv_mask = (key_pos < p.s)[:, None] & d_ok[None, :]
        kv_idx = stack + (b, pl.ds(s0, p.block_s), g, pl.ds(0, p.hd_p))
        k = plgpu.load(k_ref.at[kv_idx], mask=kv_mask, other=0)
        scores = _scores(q, k, precision) * scale
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos < p.s)[None, :]
        visible &= (window == 0) | (pos[:, None] - key_pos[None, :] < window)
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no visible key yet: no NaN
        alpha = jnp.exp(m - base)
        pr = jnp.exp(scores - base[:, None])
        v = plgpu.load(v_ref.at[kv_idx], mask=kv_mask, other=0)
        acc = acc * alpha[:, None] + _weighted(pr, v, precision)
        return m_new, l * alpha + jnp.sum(pr, axis=1), acc

    init = (jnp.full((p.rows,), -jnp.inf, _F32), jnp.zeros((p.rows,), _F32),
            jnp.zeros((p.rows, p.hd_p), _F32))
    m, l, acc = lax.fori_loop(blk_lo, blk_hi, step, init)

    if p.splits == 1:
        sink = _load_sinks(p, s_ref, g, g_ok) if has_sinks else None
        _store_heads(p, outs[0], _finish(m, l, acc, sink), b, g, t0, t_ok, g_ok)
        return
    m_ref, l_ref, acc_ref = outs
    at = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    plgpu.store(m_ref.at[at + (slice(None),)], m, mask=row_ok)
    plgpu.store(l_ref.at[at + (slice(None),)], l, mask=row_ok)
    plgpu.store(acc_ref.at[at + (slice(None), slice(None))], acc, mask=row_ok[:, None])


def _combine_kernel(*refs, p: Plan, has_sinks):
    m_ref, l_ref, acc_ref = refs[:3]
    s_ref = refs[3] if has_sinks else None
    o_ref = refs[3 + has_sinks]
    b, g, t0, t_ok, g_ok, row_ok = _row_masks(p)
    at = (pl.program_id(0), pl.program_id(1))

    def merge(j, carry):
        m, l, acc = carry
        mj = plgpu.load(m_ref.at[at + (j, slice(None))], mask=row_ok, other=-jnp.inf)
        lj = plgpu.load(l_ref.at[at + (j, slice(None))], mask=row_ok, other=0)
        aj = plgpu.load(acc_ref.at[at + (j, slice(None), slice(None))], mask=row_ok[:, None],
                        other=0)
        top = jnp.maximum(m, mj)
        base = jnp.where(top == -jnp.inf, 0.0, top)
        wa, wj = jnp.exp(m - base), jnp.exp(mj - base)
        return top, l * wa + lj * wj, acc * wa[:, None] + aj * wj[:, None]

    init = (jnp.full((p.rows,), -jnp.inf, _F32), jnp.zeros((p.rows,), _F32),
            jnp.zeros((p.rows, p.hd_p), _F32))
    m, l, acc = lax.fori_loop(0, p.splits, merge, init)
    sink = _load_sinks(p, s_ref, g, g_ok) if has_sinks else None
    _store_heads(p, o_ref, _finish(m, l, acc, sink), b, g, t0, t_ok, g_ok)


@functools.lru_cache(maxsize=256)
def _pallas_fns(p: Plan, out_dtype, scale, has_sinks, layers, precision, interpret):
    """The jitted pallas_calls of one static configuration: (attention, combine or None)."""
    params = plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages)
    heads = jax.ShapeDtypeStruct((p.batch, p.t, p.hkv * p.group, p.hd), out_dtype)
    if p.splits == 1:
        out_shape = heads
    else:
        lead = (p.batch * p.hkv, p.row_tiles, p.splits)
        out_shape = (jax.ShapeDtypeStruct(lead + (p.rows,), _F32),
                     jax.ShapeDtypeStruct(lead + (p.rows,), _F32),
                     jax.ShapeDtypeStruct(lead + (p.rows, p.hd_p), _F32))
    attend = pl.pallas_call(
        functools.partial(_attention_kernel, p=p, scale=scale, has_sinks=has_sinks,
                          layers=layers, precision=precision),
        grid=p.grid, out_shape=out_shape, compiler_params=params, interpret=interpret,
        name="jq_decode_attention")
    if p.splits == 1:
        return jax.jit(attend), None
    combine = pl.pallas_call(
        functools.partial(_combine_kernel, p=p, has_sinks=has_sinks),
        grid=p.grid[:2], out_shape=heads,
        compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=1),
        interpret=interpret, name="jq_decode_attention_combine")
    return jax.jit(attend), jax.jit(combine)


# ---------------------------------------------------------------------------
# Entry points.


def lower_decode_attention(q, k_cache, v_cache, positions, window, sinks, layer=None, *, scale,
                           precision, platform, interpret=False, config=None):
    """decode_attention on the kernel for a case `supports` accepted (no checks):
    q [B, T, Hq, hd], caches [B, S, Hkv, hd] (or [L, B, S, Hkv, hd] and an int scalar
    layer), positions int [B, T], window int scalar, sinks [Hq] or None ->
    [B, T, Hq, hd] in q.dtype."""
    b, t, hq, hd = q.shape
    s, hkv = k_cache.shape[-3], k_cache.shape[-2]
    p = plan("interpret" if interpret else platform, b, t, hq, hkv, s, hd, config)
    layers = 0 if layer is None else k_cache.shape[0]
    attend, combine = _pallas_fns(p, jnp.dtype(q.dtype), float(scale), sinks is not None,
                                  layers, precision, bool(interpret))
    extra = () if sinks is None else (sinks,)
    lyr = () if layer is None else (jnp.reshape(layer, (1,)).astype(jnp.int32),)
    out = attend(q, k_cache, v_cache, positions.astype(jnp.int32),
                 jnp.reshape(window, (1,)).astype(jnp.int32), *extra, *lyr)
    if combine is None:
        return out
    return combine(*out, *extra)


def decode_attention(q, k_cache, v_cache, positions, *, sinks=None, window=0, scale=None,
                     layer=None, precision=None, platform="cuda", interpret=False, config=None):
    """`lower_decode_attention` for direct use (the op's defaults; a ValueError where
    the kernel does not apply)."""
    window = jnp.asarray(window, jnp.int32)
    if not supports(q, k_cache, v_cache, positions, window, sinks, layer,
                    platform="interpret" if interpret else platform, config=config):
        raise ValueError(f"the pallas decode_attention does not take q {q.shape} {q.dtype}, "
                         f"caches {k_cache.shape} {k_cache.dtype}/{v_cache.dtype}, sinks "
                         f"{None if sinks is None else (sinks.shape, sinks.dtype)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return lower_decode_attention(q, k_cache, v_cache, positions, window, sinks, layer,
                                  scale=scale, precision=precision, platform=platform,
                                  interpret=interpret, config=config)
