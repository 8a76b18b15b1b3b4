"""The GEMV kernels (few rows of x, decode) of qmm and their expert-indexed form,
gather_qmm's: CUDA-core kernels, one pass over the weights, float32 FMA.

  gemv_t  transpose=True, y[m, n] = sum_k x[m, k] W[n, k]: a grid over N (and
          optionally split K). Per K step it loads a [rows, groups, cpg] tile of
          packed words (16-byte loads), prefetching the next step's words and
          scales into registers (double buffering). Every *slot* (the t-th
          element of each block, see `codecs`) is decoded with shifts/masks/bit
          casts; the slot planes are joined back along an innermost axis
          (register moves) and multiplied with x's natural [groups, cpg, epb]
          tile; the per-group scale multiplies the in-group partial sums (affine
          biases go through x's group sums). Straddling 3/5/6-bit formats loop
          over their 32 slots instead (strided x loads, dynamic shifts).
  gemv_n  transpose=False (qw logical [K, N], groups along N): the same decoders;
          per-slot outputs are strided stores into a free [M, N/epb, epb] view of y.

With `ids` (int32 [S], qw [E, ...]) both run gather_qmm: a third grid axis over the
S slots; each program reads its slot's expert id from the device array (Pallas
Triton has no scalar prefetch, so the id is one scalar load in the kernel) and
offsets its weight, scale and bias rows by id * rows. The body is qmm's, so each
output element goes through the same float ops as qmm(x[s], qw[ids[s]]).

`gather_gemv_float` is gather_matmul's: the expert-indexed GEMV on float
(unquantized) weights [E, N, K], reading the chosen experts' rows in place.

Indexing is manual (pl.ds with masks), not BlockSpecs: the gather form's expert
offset is data-dependent, and a block would span the whole K (or N) loop, which is
in general not the power of two Triton requires of a block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxquant.pallas import codecs, configs
from jaxquant.pallas.common import (Tile, add_or_first, bcast, call, cdiv, finish_split,
                                    for_slots, index, interleave, iota, load, over_slots,
                                    pow2_block, split_loop, static_slots, unpack_refs,
                                    weight_operands)


def _slots(refs, gather, rows):
    """Program setup shared by qmm's GEMV kernels and their gather_qmm (expert-indexed)
    form: (refs, first weight row, global-scale index, x row of mi, output row of mi).
    gather=None: qmm. gather=(num_experts, x_div, gs_per_expert): refs[0] holds one
    expert id per slot (program_id(2)); an id outside [0, E) addresses expert 0 (the
    wrapper turns its rows into NaN: nothing is read out of bounds); the expert's rows
    start at id * rows in the [E*rows, ...] operands; slot s reads x row s // x_div and
    writes output row s."""
    if gather is None:
        return refs, 0, 0, index, index
    num_experts, x_div, gs_per_expert = gather
    s = pl.program_id(2)
    e = _expert_id(refs[0], s, num_experts)
    return (refs[1:], e * rows, e if gs_per_expert else 0, (lambda mi: s // x_div + mi),
            (lambda mi: s + mi))


def _expert_id(ids_ref, s, num_experts):
    """Slot s's expert id, read from the device array; an id outside [0, E) addresses
    expert 0 (in bounds; the wrappers turn its rows into NaN)."""
    raw = ids_ref[s]
    # (A select, not jnp.clip: with a provable range the AMD backend switches to buffer
    # loads, which pip Triton 3.9's LLVM crashes on for gfx1100 in this kernel.)
    return jnp.where((raw >= 0) & (raw < num_experts), raw, 0)


# ---------------------------------------------------------------------------
# GEMV, transpose=True: y[m, n] = sum_k x[m, k] W[n, k].


def _gemv_t_kernel(*refs, fmt, geo, m_rows, n_rows, n_groups, bn, bg, steps, has_bias, has_gs,
                   hw, split, x_join, gather=None):
    # x_ref: x viewed [M, G, cpg, epb] (a free reshape). Each step loads x's
    # [bg, cpg, epb] tile contiguously and splits it into slots in registers.
    refs, w_off, gs_i, xrow, orow = _slots(refs, gather, n_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = unpack_refs(refs, False, has_bias, has_gs)
    cpg, epb = geo.cpg, geo.epb
    n0 = pl.program_id(0) * bn
    r0 = n0 + w_off                     # first weight row (of the slot's expert)
    rmask = (n0 + iota(bn)) < n_rows
    gbase = pl.program_id(1) * (steps * bg)
    gs = gs_ref[gs_i] if has_gs else None
    prefetch = static_slots(geo)

    def masks(i):
        g0 = gbase + i * bg
        gmask = (g0 + iota(bg)) < n_groups
        m2 = rmask[:, None] & gmask[None, :]
        return g0, gmask, m2, bcast(m2[:, :, None], (bn, bg, cpg))

    def load_weights(i):
        """Words (one-word blocks only), scales and biases of step i."""
        g0, _, m2, m3 = masks(i)
        planes = ([load(w_ref.at[pl.ds(r0, bn), pl.ds(g0, bg), slice(None)], m3)]
                  if prefetch else None)
        sc = load(s_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2)
        bi = load(b_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2) if has_bias else None
        return planes, sc, bi

    def body(i, carry):
        acc, loaded = carry
        if prefetch:
            # Register double buffering: issue step i+1's loads before using step i's.
            planes, sc, bi = loaded
            nxt = load_weights(i + 1)
        else:
            planes, sc, bi = load_weights(i)
            nxt = loaded
        g0, gmask, _, m3 = masks(i)
        tile = Tile(w_ref, (pl.ds(r0, bn), pl.ds(g0, bg), slice(None)), m3, geo, fmt, hw,
                    planes)
        mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
        xmask = bcast(gmask[:, None, None], (bg, cpg, epb))
        xmask2 = bcast(gmask[:, None], (bg, cpg))
        need_tile = (static_slots(geo) and x_join) or add is not None
        xs = [load(x_ref.at[xrow(mi), pl.ds(g0, bg), slice(None), slice(None)],
                   xmask).astype(jnp.float32) if need_tile else None for mi in range(m_rows)]
        if static_slots(geo) and x_join:
            # Join the slot planes back into element order along a new innermost
            # axis (register moves) and contract with x's natural [bg, cpg, epb] tile.
            w4 = interleave([tile.slot(t) for t in range(epb)])
            tots = [jnp.sum(w4 * xm[None], axis=3) for xm in xs]
        else:
            # Slot by slot against x gathered at the slot's positions (strided loads).
            def slot(t, tots):
                v = tile.slot(t)
                return tuple(
                    add_or_first(None if tots is None else tots[mi],
                         v * load(x_ref.at[xrow(mi), pl.ds(g0, bg), slice(None), index(t)],
                                  xmask2).astype(jnp.float32)[None])
                    for mi in range(m_rows))

            tots = over_slots(geo, slot, (jnp.zeros((bn, bg, cpg), jnp.float32),) * m_rows)
        # Scale per (row, group) on the [bn, bg, cpg] partial sums; no reduction
        # (no cross-thread traffic) inside the loop.
        new = []
        for mi in range(m_rows):
            part = tots[mi] * mul[:, :, None]
            if add is not None:
                part = part + add[:, :, None] * (jnp.sum(jnp.sum(xs[mi], axis=2), axis=1)
                                                 / np.float32(cpg))[None, :, None]
            new.append(acc[mi] + part)
        return tuple(new), nxt

    acc = tuple(jnp.zeros((bn, bg, cpg), jnp.float32) for _ in range(m_rows))
    first = load_weights(0) if prefetch else 0
    acc, _ = lax.fori_loop(0, steps, body, (acc, first))
    for mi in range(m_rows):
        out = jnp.sum(jnp.sum(acc[mi], axis=2), axis=1).astype(o_ref.dtype)
        pre = (pl.program_id(1), orow(mi)) if split > 1 else (orow(mi),)
        plgpu.store(o_ref.at[pre + (pl.ds(n0, bn),)], out, mask=rmask)


def gemv_t(x2, qw, config, *, interpret, hw, precision, ids=None, x_div=1):
    """qmm's GEMV; with `ids` (int32 [S], qw [E, N, K]) its gather_qmm form: slot s
    multiplies x2[s // x_div] with expert ids[s] -> [S, N], with the same per-output
    float ops as qmm(x2[s // x_div], qw[ids[s]])."""
    del precision  # float32 FMA throughout
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[-2]
    n_groups = k // qw.group_size
    xv = x2.reshape(m, n_groups, geo.cpg, geo.epb)
    ops, has_bias, has_gs = weight_operands(qw, geo)
    bn = pow2_block(config.block_n, n)
    bg = pow2_block(config.k_words // geo.words_per_group, n_groups)
    split, steps = split_loop(cdiv(n_groups, bg), config.split_k)
    kernel = functools.partial(
        _gemv_t_kernel, fmt=fmt, geo=geo, n_rows=n, n_groups=n_groups, bn=bn, bg=bg, steps=steps,
        has_bias=has_bias, has_gs=has_gs, hw=hw, split=split, x_join=config.x_join)
    out, _ = _launch(kernel, (cdiv(n, bn), split), [xv, *ops], (n,), qw=qw, ids=ids,
                     x_div=x_div, m=m, split=split, config=config, interpret=interpret,
                     kind="gemv_t", dtype=x2.dtype)
    return out


# ---------------------------------------------------------------------------
# GEMV, transpose=False: y[m, n] = sum_k x[m, k] W[k, n], groups along n.


def _gemv_n_kernel(*refs, fmt, geo, m_rows, k_rows, n_groups, bk, bg, steps, has_bias, has_gs,
                   hw, split, gather=None):
    # o_ref: y viewed [(split,) M, G, cpg, epb]; slot t is a strided store.
    refs, w_off, gs_i, xrow, orow = _slots(refs, gather, k_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    g0 = pl.program_id(0) * bg
    gmask = (g0 + iota(bg)) < n_groups
    kbase = pl.program_id(1) * (steps * bk)
    gs = gs_ref[gs_i] if has_gs else None
    omask = bcast(gmask[:, None], (bg, cpg))

    def run(slots):
        """The K loop for the slots in `slots`; stores their output columns."""
        def body(i, carry):
            acc, accb = carry
            k0 = kbase + i * bk
            kmask = (k0 + iota(bk)) < k_rows
            m2 = kmask[:, None] & gmask[None, :]
            r0 = k0 + w_off             # first weight row (of the slot's expert)
            tile = Tile(w_ref, (pl.ds(r0, bk), pl.ds(g0, bg), slice(None)),
                        bcast(m2[:, :, None], (bk, bg, cpg)), geo, fmt, hw)
            sc = load(s_ref.at[pl.ds(r0, bk), pl.ds(g0, bg)], m2)
            bi = load(b_ref.at[pl.ds(r0, bk), pl.ds(g0, bg)], m2) if has_bias else None
            mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
            vs = [tile.slot(t) for t in slots]
            new_acc, new_accb = [], []
            for mi in range(m_rows):
                xk = load(x_ref.at[xrow(mi), pl.ds(k0, bk)], kmask).astype(jnp.float32)
                xm = (xk[:, None] * mul)[:, :, None]
                new_acc.append(tuple(a + v * xm for a, v in zip(acc[mi], vs)))
                if add is not None:
                    new_accb.append(accb[mi] + xk[:, None] * add)
            return tuple(new_acc), tuple(new_accb)

        acc = tuple(tuple(jnp.zeros((bk, bg, cpg), jnp.float32) for _ in slots)
                    for _ in range(m_rows))
        accb = tuple(jnp.zeros((bk, bg), jnp.float32) for _ in range(m_rows)) if has_bias else ()
        acc, accb = lax.fori_loop(0, steps, body, (acc, accb))
        for mi in range(m_rows):
            bsum = jnp.sum(accb[mi], axis=0)[:, None] if has_bias else None
            pre = (pl.program_id(1), orow(mi)) if split > 1 else (orow(mi),)
            for t, a in zip(slots, acc[mi]):
                out = jnp.sum(a, axis=0)
                if bsum is not None:
                    out = out + bsum
                plgpu.store(o_ref.at[pre + (pl.ds(g0, bg), slice(None), index(t))],
                            out.astype(o_ref.dtype), mask=omask)

    for_slots(geo, run)


def gemv_n(x2, qw, config, *, interpret, hw, precision, ids=None, x_div=1):
    """transpose=False GEMV; with `ids` its gather_qmm form (see `gemv_t`)."""
    del precision
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[-1]
    n_groups = n // qw.group_size
    ops, has_bias, has_gs = weight_operands(qw, geo)
    bk = pow2_block(config.block_k, k)
    bg = pow2_block(config.n_words // geo.words_per_group, n_groups)
    split, steps = split_loop(cdiv(k, bk), config.split_k)
    kernel = functools.partial(
        _gemv_n_kernel, fmt=fmt, geo=geo, k_rows=k, n_groups=n_groups, bk=bk, bg=bg, steps=steps,
        has_bias=has_bias, has_gs=has_gs, hw=hw, split=split)
    # The output viewed [M, G, cpg, epb] (free): slot t is a strided store.
    out, m = _launch(kernel, (cdiv(n_groups, bg), split), [x2, *ops],
                     (n_groups, geo.cpg, geo.epb), qw=qw, ids=ids, x_div=x_div, m=m, split=split,
                     config=config, interpret=interpret, kind="gemv_n", dtype=x2.dtype)
    return out.reshape(m, n)


def _launch(kernel, grid, operands, out_tail, *, qw, ids, x_div, m, split, config, interpret,
            kind, dtype):
    """Run a GEMV kernel as qmm's (ids None: M rows of x) or gather_qmm's (a third grid
    axis over the S slots, the ids first among the operands, one output row per slot).
    Returns (output [rows, *out_tail] in dtype, rows)."""
    gather, name = None, "qmm"
    if ids is not None:
        gs_per_expert = qw.global_scale is not None and operands[-1].shape[0] > 1
        grid, gather, name = grid + (ids.shape[0],), (qw.shape[0], x_div, gs_per_expert), \
            "gather_qmm"
        operands, m = [ids, *operands], ids.shape[0]
    shape = (m, *out_tail)
    out_shape = (jax.ShapeDtypeStruct((split, *shape), jnp.float32) if split > 1
                 else jax.ShapeDtypeStruct(shape, dtype))
    kernel = functools.partial(kernel, m_rows=1 if gather else m, gather=gather)
    out = call(kernel, grid, out_shape, operands, config, interpret,
               f"jq_{name}_{kind}_{qw.format.mode}{qw.bits}")
    return finish_split(out, split, dtype), m


# ---------------------------------------------------------------------------
# Float expert GEMV (gather_matmul): y[s, n] = sum_k x[s // x_div, k] W[ids[s], n, k],
# W unquantized [E, N, K]. Grid (slots, N blocks), slots fastest: the programs in flight
# at a time are every slot's same row block, so slots whose tokens chose the same expert
# read the same rows together (L2 hits, not a second pass over DRAM). Each program
# streams its expert's [bn, K] rows in place (an [E*N, K] view offset by id * N rows), bk
# elements of K per step, the next step's tile loaded before this one's FMAs (register
# double buffering).


def _gather_gemv_float_kernel(ids_ref, x_ref, w_ref, o_ref, *, num_experts, n, k, bn, bk,
                              steps, x_div):
    s = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    r0 = _expert_id(ids_ref, s, num_experts) * n + n0     # first weight row, [E*N, K] view
    rmask = (n0 + iota(bn)) < n
    xrow = s // x_div

    def tile(i):
        k0 = i * bk
        kmask = (k0 + iota(bk)) < k                         # K's tail (any K) is masked
        w = load(w_ref.at[pl.ds(r0, bn), pl.ds(k0, bk)], rmask[:, None] & kmask[None, :])
        return w, load(x_ref.at[xrow, pl.ds(k0, bk)], kmask)

    def body(i, carry):
        acc, (w, xv) = carry
        nxt = tile(i + 1)               # past the last step: every lane masked, no traffic
        # w in x's dtype first, as the reference casts it (a no-op when they agree)
        w = w.astype(xv.dtype).astype(jnp.float32)
        return acc + w * xv.astype(jnp.float32)[None, :], nxt

    acc, _ = lax.fori_loop(0, steps, body, (jnp.zeros((bn, bk), jnp.float32), tile(0)))
    plgpu.store(o_ref.at[s, pl.ds(n0, bn)], jnp.sum(acc, axis=1).astype(o_ref.dtype),
                mask=rmask)


def gather_gemv_float(x2, w, ids, config, *, interpret, x_div=1):
    """x2 [Sx, K], w float [E, N, K], ids int32 [S] (S = Sx * x_div) -> [S, N] in x2's
    dtype: slot s is x2[s // x_div] @ w[ids[s]].T with float32 accumulation; ids outside
    [0, E) read expert 0. config: a `configs.FloatGemvConfig`."""
    e, n, k = w.shape
    bn = pow2_block(max(config.block_n, configs.FLOAT_GEMV_MIN_BLOCK_N), n)
    bk = pow2_block(config.block_k, k)
    kernel = functools.partial(_gather_gemv_float_kernel, num_experts=e, n=n, k=k, bn=bn, bk=bk,
                               steps=cdiv(k, bk), x_div=x_div)
    out_shape = jax.ShapeDtypeStruct((ids.shape[0], n), x2.dtype)
    return call(kernel, (ids.shape[0], cdiv(n, bn)), out_shape, [ids, x2, w.reshape(e * n, k)],
                config, interpret, f"jq_gather_matmul_{jnp.dtype(w.dtype).name}")
