"""The GEMM kernels (more rows of x) of qmm and their ragged form, ragged_qmm's:
tensor-core kernels.

  gemm_t  transpose=True. "skinny" tiles (M <= 64): W as the A operand (y^T = W x^T,
          so a 16-row M tile still fills the MMA), one dot per slot against x
          gathered at that slot's positions. Large tiles (M > 64, 2/4/8-bit): each K
          step dequantizes the whole tile (decode, scale, cast to the dot dtype),
          interleaves the slots back into K order with nested joins and issues one
          dot with the natural x tile; Triton's pipeliner overlaps the next step's
          loads (num_stages). float32 x uses tf32 (or IEEE with precision="highest").
          With `schedule` (ragged_qmm) the row tiles are work items of a
          device-computed schedule (expert, tile, row range).
  gemm_n  transpose=False (qw logical [K, N], groups along N): the same decoders;
          per-slot outputs are strided stores into a free [M, N/epb, epb] view of y.

Shapes that are not multiples of the block sizes are masked (masked loads return
zeros that contribute nothing; stores are masked). Indexing is manual, not
BlockSpecs: the ragged schedule's tiles and experts are data-dependent, the K loop
runs inside the program over a K that is in general not the power of two Triton
requires of a block, and transpose=False stores each slot as a strided view.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxquant.pallas import codecs
from jaxquant.pallas.common import (INTERLEAVE_K, Tile, bcast, call, cdiv, dequant, for_slots,
                                    index, interleave, iota, load, pow2_ceil, pow2_floor,
                                    static_slots, unpack_refs, weight_operands)

# ---------------------------------------------------------------------------
# GEMM (tensor cores), transpose=True.


def _dot_nt(a, b, precision):
    """a [M, K] . b [N, K] -> [M, N] float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):
    """a [M, K] . b [K, N] -> [M, N] float32. For float32 operands this is done as
    (b^T a^T)^T: Hopper's tf32 tensor-core path takes K-major operands only (Triton
    fails to compile an N-major dequantized B)."""
    if a.dtype == jnp.float32:
        return lax.dot_general(b, a, (((0,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32).T
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)



def _dequant_tile(v, mul, add, cdt):
    """v [R, G, cpg] -> dequantized [R, G*cpg] in the dot dtype."""
    w = dequant(v, mul, add, cdt)
    return w.reshape(w.shape[0], -1)


def _interleave_2d(ws):
    """Slot planes ws[t] [R, G, cpg] -> [R, G*cpg*epb] in canonical element order
    ((g*cpg + c)*epb + t)."""
    w = interleave(ws)
    return w.reshape(w.shape[0], -1)



def _ragged_tile(refs, ragged, bm, m_rows, n_rows):
    """Row tile of a GEMM program: (refs, m0, row mask, first weight row, global-scale
    index, K steps). qmm: tile program_id(0). ragged=(gs_per_expert,) (ragged_qmm):
    refs[0] is the device-computed schedule int32 [4, W] (expert, tile start, first
    and end row of the tile's group rows); work item program_id(0) multiplies rows
    [lo, hi) of the tile at m0 with its expert; an empty item (lo == hi) does nothing."""
    if ragged is None:
        m0 = pl.program_id(0) * bm
        return refs, m0, (m0 + iota(bm)) < m_rows, 0, 0, None
    (gs_per_expert,) = ragged
    w = pl.program_id(0)
    sched = refs[0]
    e, m0, lo, hi = (sched[index(j), w] for j in range(4))
    rows = m0 + iota(bm)
    return (refs[1:], m0, (rows >= lo) & (rows < hi), e * n_rows, e if gs_per_expert else 0,
            hi > lo)


def _gemm_t_kernel(*refs, fmt, geo, m_rows, n_rows, n_groups, bm, bn, bg, steps, has_bias,
                   has_gs, hw, precision, permuted, swap_ab, interleave, ragged=None):
    # x_ref: [M, epb, blocks] (permuted by the wrapper), x viewed [M, blocks, epb],
    # or (interleave) x itself [M, K].
    refs, m0, mmask, w_off, gs_i, busy = _ragged_tile(refs, ragged, bm, m_rows, n_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    cdt = x_ref.dtype
    n0 = pl.program_id(1) * bn
    r0 = n0 + w_off                     # first weight row (of the tile's expert)
    rmask = (n0 + iota(bn)) < n_rows
    gs = gs_ref[gs_i] if has_gs else None
    bkw = bg * cpg

    def body(i, acc):
        g0 = i * bg
        gmask = (g0 + iota(bg)) < n_groups
        m2 = rmask[:, None] & gmask[None, :]
        tile = Tile(w_ref, (pl.ds(r0, bn), pl.ds(g0, bg), slice(None)),
                    bcast(m2[:, :, None], (bn, bg, cpg)), geo, fmt, hw)
        sc = load(s_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2)
        bi = load(b_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2) if has_bias else None
        mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
        if interleave:
            # Dequantize the whole K tile, interleave the slots back into K order,
            # one dot with the natural x tile (amortized over the M tile).
            bk = bkw * geo.epb
            w = _interleave_2d([dequant(tile.slot(t), mul, add, cdt) for t in range(geo.epb)])
            kmask = bcast(gmask[:, None], (bg, cpg * geo.epb)).reshape(bk)
            xt = load(x_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg * geo.epb, bk)],
                      mmask[:, None] & kmask[None, :])
            return acc + (_dot_nt(w, xt, precision) if swap_ab else _dot_nt(xt, w, precision))
        kmask = bcast(gmask[:, None], (bg, cpg)).reshape(bkw)
        xmask = mmask[:, None] & kmask[None, :]

        def slot(t, acc):
            w = _dequant_tile(tile.slot(t), mul, add, cdt)
            if permuted:
                xt = load(x_ref.at[pl.ds(m0, bm), index(t), pl.ds(g0 * cpg, bkw)], xmask)
            else:
                xt = load(x_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg, bkw), index(t)], xmask)
            # swap_ab: acc^T [bn, bm] = w . x^T, the dequantized weight as the
            # tensor cores' A operand (registers; M = bn fills the MMA even when M is small).
            return acc + (_dot_nt(w, xt, precision) if swap_ab else _dot_nt(xt, w, precision))

        if static_slots(geo):
            for t in range(geo.epb):
                acc = slot(t, acc)
            return acc
        return lax.fori_loop(0, geo.epb, slot, acc)

    def run():
        shape = (bn, bm) if swap_ab else (bm, bn)
        acc = lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
        if swap_ab:
            acc = acc.T
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                    mask=mmask[:, None] & rmask[None, :])

    if busy is None:
        run()
    else:
        pl.when(busy)(run)      # ragged: an empty work item does nothing


def gemm_t(x2, qw, config, *, interpret, hw, precision, schedule=None):
    """qmm's GEMM; with `schedule` (int32 [4, W], see `_ragged_tile`; qw [E, N, K]) its
    ragged_qmm form: work item w multiplies its rows of x2 with its expert."""
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[-2]
    n_groups = k // qw.group_size
    nblk = n_groups * geo.cpg
    # Slot-major activations: xp[m, t, j] = x[m, j*epb + t]: one XLA transpose (large M),
    # or strided loads from the free view [M, blocks, epb] (small M).
    interleave = config.interleave and static_slots(geo)
    xv = x2.reshape(m, nblk, geo.epb)
    xp = x2 if interleave else (xv.transpose(0, 2, 1) if config.permute_x else xv)
    ops, has_bias, has_gs = weight_operands(qw, geo)
    bm = max(16, pow2_floor(config.block_m))
    bn = max(16, min(pow2_floor(config.block_n), pow2_ceil(n)))
    bg = pow2_floor(max(1, config.k_words // geo.words_per_group))
    bg = max(bg, pow2_ceil(cdiv(16, geo.cpg)))          # dot K >= 16
    if interleave:
        # The whole dequantized K tile is staged on chip: at most INTERLEAVE_K
        # elements of K per step, whatever the bit width (2-bit would double it).
        bg = max(1, min(bg, INTERLEAVE_K // qw.group_size))
    steps = cdiv(n_groups, bg)
    grid, ragged, name, operands = (cdiv(m, bm), cdiv(n, bn)), None, "qmm", [xp, *ops]
    if schedule is not None:
        ragged = (has_gs and ops[-1].shape[0] > 1,)
        grid, name = (schedule.shape[1], cdiv(n, bn)), "ragged_qmm"
        operands = [schedule, *operands]
    kernel = functools.partial(
        _gemm_t_kernel, fmt=fmt, geo=geo, m_rows=m, n_rows=n, n_groups=n_groups, bm=bm, bn=bn,
        bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw, precision=precision,
        permuted=config.permute_x, swap_ab=config.swap_ab, interleave=interleave, ragged=ragged)
    return call(kernel, grid, jax.ShapeDtypeStruct((m, n), x2.dtype),
                operands, config, interpret, f"jq_{name}_gemm_t_{fmt.mode}{qw.bits}")


def gemm_block_m(x_dtype, config) -> int:
    """The M tile `gemm_t` uses for `config` (ragged_qmm schedules its tiles with it)."""
    del x_dtype
    return max(16, pow2_floor(config.block_m))


# ---------------------------------------------------------------------------
# Float ragged GEMM (ragged_matmul): x's rows sorted by expert against float experts w
# [E, N, K], over ragged_qmm's device-computed schedule. Each program multiplies its
# work item's rows (one expert's rows of a bm-row tile) with bn rows of that expert,
# read in place from an [E*N, K] view (no transpose, no copy of the experts), and
# stores only those rows: a tile that straddles groups is written by one item per group.


def _ragged_gemm_float_kernel(*refs, m_rows, n_rows, k, bm, bn, bk, steps, precision):
    (x_ref, w_ref, o_ref), m0, mmask, w_off, _, busy = _ragged_tile(
        refs, (False,), bm, m_rows, n_rows)
    n0 = pl.program_id(1) * bn
    r0 = n0 + w_off
    rmask = (n0 + iota(bn)) < n_rows

    def body(i, acc):
        k0 = i * bk
        kmask = (k0 + iota(bk)) < k                         # K's tail (any K) is masked
        xt = load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mmask[:, None] & kmask[None, :])
        w = load(w_ref.at[pl.ds(r0, bn), pl.ds(k0, bk)], rmask[:, None] & kmask[None, :])
        # w in x's dtype first, as the reference casts it (a no-op when they agree)
        return acc + _dot_nt(xt, w.astype(xt.dtype), precision)

    def run():
        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                    mask=mmask[:, None] & rmask[None, :])

    pl.when(busy)(run)          # an empty work item does nothing


def ragged_gemm_float(x2, w, schedule, config, *, interpret, precision):
    """x2 [T, K] (rows sorted by expert), w float [E, N, K], schedule int32 [4, W] (see
    `_ragged_tile`, built with block_m = config.block_m) -> [T, N] in x2's dtype, float32
    accumulation. Rows no work item covers are left unwritten (the caller zeroes them).
    config: a `configs.FloatGemmConfig`."""
    e, n, k = w.shape
    m = x2.shape[0]
    bm = config.block_m
    bn = max(16, min(config.block_n, pow2_ceil(n)))     # dot operands: at least 16
    bk = max(16, min(config.block_k, pow2_ceil(k)))
    kernel = functools.partial(_ragged_gemm_float_kernel, m_rows=m, n_rows=n, k=k, bm=bm, bn=bn,
                               bk=bk, steps=cdiv(k, bk), precision=precision)
    return call(kernel, (schedule.shape[1], cdiv(n, bn)), jax.ShapeDtypeStruct((m, n), x2.dtype),
                [schedule, x2, w.reshape(e * n, k)], config, interpret,
                f"jq_ragged_matmul_{jnp.dtype(w.dtype).name}")


# ---------------------------------------------------------------------------
# GEMM (tensor cores), transpose=False.


def _gemm_n_kernel(*refs, fmt, geo, m_rows, k_rows, n_groups, bm, bk, bg, steps, has_bias,
                   has_gs, hw, precision, interleave):
    # o_ref: y viewed [M, blocks, epb] (slot t is a strided store), or (interleave)
    # y itself [M, N].
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    cdt = x_ref.dtype
    m0 = pl.program_id(0) * bm
    g0 = pl.program_id(1) * bg
    mmask = (m0 + iota(bm)) < m_rows
    gmask = (g0 + iota(bg)) < n_groups
    gs = gs_ref[0] if has_gs else None
    bnw = bg * cpg
    nmask = bcast(gmask[:, None], (bg, cpg)).reshape(bnw)

    def step(i):
        """K step i: the weight tile, its group multipliers and x's [bm, bk] tile."""
        k0 = i * bk
        kmask = (k0 + iota(bk)) < k_rows
        m2 = kmask[:, None] & gmask[None, :]
        tile = Tile(w_ref, (pl.ds(k0, bk), pl.ds(g0, bg), slice(None)),
                    bcast(m2[:, :, None], (bk, bg, cpg)), geo, fmt, hw)
        sc = load(s_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2)
        bi = load(b_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2) if has_bias else None
        mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
        xk = load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mmask[:, None] & kmask[None, :])
        return tile, mul, add, xk

    def run(slots):
        def body(i, acc):
            tile, mul, add, xk = step(i)
            return tuple(a + _dot_nn(xk, _dequant_tile(tile.slot(t), mul, add, cdt), precision)
                         for a, t in zip(acc, slots))

        acc = tuple(jnp.zeros((bm, bnw), jnp.float32) for _ in slots)
        acc = lax.fori_loop(0, steps, body, acc)
        for t, a in zip(slots, acc):
            plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg, bnw), index(t)],
                        a.astype(o_ref.dtype), mask=mmask[:, None] & nmask[None, :])

    def run_interleaved():
        bn = bnw * geo.epb

        def body(i, acc):
            tile, mul, add, xk = step(i)
            w = _interleave_2d([dequant(tile.slot(t), mul, add, cdt) for t in range(geo.epb)])
            return acc + _dot_nn(xk, w, precision)

        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        cmask = bcast(gmask[:, None], (bg, cpg * geo.epb)).reshape(bn)
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg * geo.epb, bn)],
                    acc.astype(o_ref.dtype), mask=mmask[:, None] & cmask[None, :])

    if interleave:
        run_interleaved()
    else:
        for_slots(geo, run)


def gemm_n(x2, qw, config, *, interpret, hw, precision):
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[1]
    n_groups = n // qw.group_size
    nblk = n_groups * geo.cpg
    ops, has_bias, has_gs = weight_operands(qw, geo)
    bm = max(16, pow2_floor(config.block_m))
    bk = max(16, min(pow2_floor(config.block_k), pow2_ceil(k)))
    bg = pow2_floor(max(1, config.n_words // geo.words_per_group))
    bg = max(bg, pow2_ceil(cdiv(16, geo.cpg)))          # dot N >= 16
    steps = cdiv(k, bk)
    interleave = config.interleave and static_slots(geo)
    if interleave:
        bg = max(1, min(bg, INTERLEAVE_K // qw.group_size))   # at most 128 output columns
    kernel = functools.partial(
        _gemm_n_kernel, fmt=fmt, geo=geo, m_rows=m, k_rows=k, n_groups=n_groups, bm=bm, bk=bk,
        bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw, precision=precision,
        interleave=interleave)
    # out[m, j, t] is column j*epb + t: [M, blocks, epb] is a free view of [M, N].
    oshape = (m, n) if interleave else (m, nblk, geo.epb)
    out = call(kernel, (cdiv(m, bm), cdiv(n_groups, bg)),
               jax.ShapeDtypeStruct(oshape, x2.dtype), [x2, *ops], config,
               interpret, f"jq_qmm_gemm_n_{fmt.mode}{qw.bits}")
    return out.reshape(m, n)
