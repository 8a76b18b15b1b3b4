"""Pallas (Triton lowering) kernels for qmm: y = x @ dequantize(qw).T (or x @ W).

Entry points: `qmm(x, qw, *, transpose=True, precision=None, interpret=False)`
and `supports(x_shape, x_dtype, qw, transpose)`. Block sizes and the kernel
choice per platform and shape class: `jaxquant.pallas.configs`.

Kernels. None writes the dequantized weight to memory; all accumulate in f32.
  gemv  (M <= 4, decode). CUDA-core kernel, grid over N (and optionally split
        K). Per K step it loads a [rows, groups, cpg] tile of packed words
        (16-byte loads), prefetching the next step's words and scales into
        registers (double buffering). Every *slot* (the t-th element of each
        block, see `codecs`) is decoded with shifts/masks/bit casts; the slot
        planes are joined back along an innermost axis (register moves) and
        multiplied with x's natural [groups, cpg, epb] tile; the per-group
        scale multiplies the in-group partial sums (affine biases go through
        x's group sums). Straddling 3/5/6-bit formats loop over their 32 slots
        instead (strided x loads, dynamic shifts): the shared slow path.
  gemm  (M > 4). Tensor-core kernel. "skinny" tiles (M <= 64): W as the A
        operand (y^T = W x^T, so a 16-row M tile still fills the MMA), one dot
        per slot against x gathered at that slot's positions. Large tiles
        (M > 64, 2/4/8-bit): each K step dequantizes the whole tile (decode,
        scale, cast to the dot dtype), interleaves the slots back into K order
        with nested joins and issues one dot with the natural x tile; Triton's
        pipeliner overlaps the next step's loads (num_stages). float32 x uses
        tf32 (or IEEE with precision="highest").
transpose=False (qw logical [K, N], groups along N) uses the same decoders;
per-slot outputs are strided stores into a free [M, N/epb, epb] view of y.

Shapes that are not multiples of the block sizes are masked (masked loads
return zeros that contribute nothing; stores are masked).
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
from jaxquant.quantized_array import CANONICAL, QuantizedArray

_INTERLEAVE_K = 128   # elements of K (N for transpose=False) per interleaved GEMM step

_X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# Small helpers.


def _cdiv(a, b):
    return -(-a // b)


def _pow2_floor(v: int) -> int:
    v = max(1, int(v))
    return 1 << (v.bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    v = max(1, int(v))
    return 1 << (v - 1).bit_length()


def _iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _i(v):
    """A static integer index as a 0-d int32 array (interpret mode's load/store
    discharge takes arrays or slices, not Python ints)."""
    return jnp.asarray(v, jnp.int32)


def _load(ref, mask, other=0):
    return plgpu.load(ref, mask=mask, other=other)


def _bcast(mask, shape):
    return jnp.broadcast_to(mask, shape)


def detect_platform() -> str:
    """'cuda' or 'rocm' for the default device (ROCm GPUs report platform 'gpu'
    with 'rocm' in the client's platform_version); 'cuda' when there is no GPU."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return "cuda"
    if dev.platform in ("cuda", "rocm"):
        return dev.platform
    if dev.platform == "gpu":
        version = str(getattr(dev.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    return "cuda"


def _dot_precision(precision, x_dtype):
    """lax precision pair for the in-kernel dot: IEEE float32 for 'highest'."""
    if jnp.dtype(x_dtype) != jnp.float32:
        return None
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, (tuple, list)):
        precision = precision[0]
    name = getattr(precision, "name", precision)
    if isinstance(name, str) and name.lower() in ("highest", "float32", "f32_f32_f32"):
        return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    return (lax.Precision.DEFAULT, lax.Precision.DEFAULT)


# ---------------------------------------------------------------------------
# Public API.


def supports(x, qw, *, transpose=True, **params) -> bool:
    """Whether `qmm` has a kernel for these arguments (x: anything with a shape and
    dtype, e.g. a ShapedArray; the op's params, `platform` included, are ignored)."""
    try:
        if jnp.dtype(x.dtype) not in _X_DTYPES:
            return False
        if qw.layout != CANONICAL:
            return False
        if len(qw.shape) != 2 or len(x.shape) < 1:
            return False
        k = qw.shape[1] if transpose else qw.shape[0]
        if x.shape[-1] != k:
            return False
        codecs.geometry(qw.bits, qw.group_size)
        if qw.data.dtype != jnp.uint32:
            return False
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False
    return True


def qmm(x, qw: QuantizedArray, *, transpose: bool = True, precision=None,
        interpret: bool = False, platform: str | None = None,
        config: configs.KernelConfig | None = None):
    """y = x @ dequantize(qw).T (transpose=True; qw logical [N, K]) or
    y = x @ dequantize(qw) (transpose=False; qw logical [K, N], groups along N).

    x: [..., K] float32/float16/bfloat16 -> [..., N] in x.dtype, float32
    accumulation. `platform` ("cuda" | "rocm") picks the block-config table
    (default: the default device's); `config` overrides the table entry.
    """
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    x = jnp.asarray(x)
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16 for the pallas qmm; got {x.dtype}")
    if qw.layout != CANONICAL:
        raise ValueError(f"the pallas qmm takes the canonical layout (DESIGN.md §3); got "
                         f"layout={qw.layout!r}")
    if len(qw.shape) != 2:
        raise ValueError(f"qw must be 2-D for qmm; got shape {qw.shape}")
    rows, cols = qw.shape
    k, n = (cols, rows) if transpose else (rows, cols)
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x's last axis must be K={k} (qw shape {qw.shape}, "
                         f"transpose={transpose}); got x shape {x.shape}")
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    if m == 0 or n == 0:
        return jnp.zeros((*lead, n), x.dtype)
    if k == 0:
        return jnp.zeros((*lead, n), x.dtype)
    x2 = x.reshape(m, k)
    if platform is None:
        platform = "interpret" if interpret else detect_platform()
    elif interpret:
        platform = "interpret"
    if config is None:
        config = configs.select(platform, transpose, m, n, k, qw.bits, qw.group_size, x.dtype)
    hw = not interpret
    prec = _dot_precision(precision, x.dtype)
    if transpose:
        fn = _gemv_t if config.kernel == "gemv" else _gemm_t
    else:
        fn = _gemv_n if config.kernel == "gemv" else _gemm_n
    y = fn(x2, qw, config, interpret=interpret, hw=hw, precision=prec)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------
# Operands shared by the kernels.


def _weight_operands(qw: QuantizedArray, geo: codecs.Geometry):
    """[rows, groups, cpg(, wpb)] view of the words, scales, and the optional
    biases / global scale, as (arrays, flags)."""
    groups = qw.scales.shape[-1]
    rows = qw.scales.size // max(groups, 1)      # leading (expert) axes fold into rows
    shape = (rows, groups, geo.cpg) if geo.wpb == 1 else (rows, groups, geo.cpg, geo.wpb)
    ops = [qw.data.reshape(shape), qw.scales.reshape(rows, groups)]
    has_bias = qw.biases is not None
    if has_bias:
        ops.append(qw.biases.reshape(rows, groups))
    has_gs = qw.global_scale is not None
    if has_gs:
        ops.append(jnp.asarray(qw.global_scale, jnp.float32).reshape(-1))  # 1 or one per expert
    return ops, has_bias, has_gs


class _Tile:
    """One tile of packed words ([rows, groups, cpg] per word of a block), decoded slot by slot.

    Formats whose blocks are one word (2/4/8 bits) load the tile once and decode
    every slot with static shifts (the kernels unroll over slots). Formats whose
    elements straddle words (3/5/6 bits, 32-element blocks of `bits` words) are
    the shared slow path: the kernels loop over the 32 slots and each slot loads
    the (strided) word plane(s) holding it, decoding with dynamic shifts.
    """

    def __init__(self, w_ref, idx, mask, geo, fmt, hw, planes=None):
        self.w_ref, self.idx, self.mask, self.geo, self.fmt, self.hw = (
            w_ref, idx, mask, geo, fmt, hw)
        if planes is None and geo.wpb == 1:
            planes = [_load(w_ref.at[idx], mask)]
        self.planes = planes

    def slot(self, t):
        geo = self.geo
        if self.planes is not None:
            return codecs.decode_slot(self.planes, geo, t, self.fmt, self.hw)
        word, nxt = codecs.slot_word_dynamic(t, geo)
        lo = _load(self.w_ref.at[self.idx + (word,)], self.mask)
        hi = _load(self.w_ref.at[self.idx + (nxt,)], self.mask)
        return codecs.decode_code(codecs.slot_code_dynamic(lo, hi, t, geo), geo, self.fmt,
                                  self.hw)


def _static_slots(geo) -> bool:
    return geo.wpb == 1


def _over_slots(geo, body, init):
    """carry = body(t, carry) for every slot t: unrolled (static t, starting from
    None) for one-word blocks, else a loop (traced t) from `init`."""
    if _static_slots(geo):
        carry = None
        for t in range(geo.epb):
            carry = body(t, carry)
        return carry
    return lax.fori_loop(0, geo.epb, body, init)


def _acc(a, b):
    return b if a is None else a + b


def _unpack_refs(refs, has_xs, has_bias, has_gs):
    it = iter(refs)
    x_ref = next(it)
    xs_ref = next(it) if has_xs else None
    w_ref = next(it)
    s_ref = next(it)
    b_ref = next(it) if has_bias else None
    gs_ref = next(it) if has_gs else None
    o_ref = next(it)
    return x_ref, xs_ref, w_ref, s_ref, b_ref, gs_ref, o_ref


def _call(kernel, grid, out_shape, operands, config, interpret, name):
    fn = _pallas_fn(kernel.func, tuple(sorted(kernel.keywords.items())), grid, out_shape,
                    config.num_warps, config.num_stages, interpret, name)
    return fn(*operands)


@functools.lru_cache(maxsize=512)
def _pallas_fn(kernel_fn, kernel_kw, grid, out_shape, num_warps, num_stages, interpret, name):
    """One jitted pallas_call per distinct kernel: repeated calls (the layers of a
    model, the weight copies of a benchmark) trace to the same jaxpr, which JAX
    lowers (and, on newer jaxlibs, Triton-compiles) once per module."""
    call = pl.pallas_call(
        functools.partial(kernel_fn, **dict(kernel_kw)),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )
    return jax.jit(call)


def _finish_split(out, split, dtype):
    # Left to right, elementwise: the same float ops for every output shape (a qmm
    # row and a gather_qmm slot add their split-K partial sums identically).
    if split > 1:
        out = functools.reduce(lambda a, b: a + b, [out[i] for i in range(split)])
    return out.astype(dtype)


def _slots(refs, gather, rows):
    """Program setup shared by qmm's GEMV kernels and their gather_qmm (expert-indexed)
    form: (refs, first weight row, global-scale index, x row of mi, output row of mi).
    gather=None: qmm. gather=(num_experts, x_div, gs_per_expert): refs[0] holds one
    expert id per slot (program_id(2)); an id outside [0, E) addresses expert 0 (the
    wrapper turns its rows into NaN: nothing is read out of bounds); the expert's rows
    start at id * rows in the [E*rows, ...] operands; slot s reads x row s // x_div and
    writes output row s."""
    if gather is None:
        return refs, 0, 0, _i, _i
    num_experts, x_div, gs_per_expert = gather
    s = pl.program_id(2)
    raw = refs[0][s]
    # (A select, not jnp.clip: with a provable range the AMD backend switches to buffer
    # loads, which pip Triton 3.9's LLVM crashes on for gfx1100 in this kernel.)
    e = jnp.where((raw >= 0) & (raw < num_experts), raw, 0)
    return (refs[1:], e * rows, e if gs_per_expert else 0, (lambda mi: s // x_div + mi),
            (lambda mi: s + mi))


# ---------------------------------------------------------------------------
# GEMV, transpose=True: y[m, n] = sum_k x[m, k] W[n, k].


def _gemv_t_kernel(*refs, fmt, geo, m_rows, n_rows, n_groups, bn, bg, steps, has_bias, has_gs,
                   hw, split, x_join, gather=None):
    # x_ref: x viewed [M, G, cpg, epb] (a free reshape). Each step loads x's
    # [bg, cpg, epb] tile contiguously and splits it into slots in registers.
    refs, w_off, gs_i, xrow, orow = _slots(refs, gather, n_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = _unpack_refs(refs, False, has_bias, has_gs)
    cpg, epb = geo.cpg, geo.epb
    n0 = pl.program_id(0) * bn
    r0 = n0 + w_off                     # first weight row (of the slot's expert)
    rmask = (n0 + _iota(bn)) < n_rows
    gbase = pl.program_id(1) * (steps * bg)
    gs = gs_ref[gs_i] if has_gs else None
    prefetch = _static_slots(geo)

    def masks(i):
        g0 = gbase + i * bg
        gmask = (g0 + _iota(bg)) < n_groups
        m2 = rmask[:, None] & gmask[None, :]
        return g0, gmask, m2, _bcast(m2[:, :, None], (bn, bg, cpg))

    def load_weights(i):
        """Words (one-word blocks only), scales and biases of step i."""
        g0, _, m2, m3 = masks(i)
        planes = ([_load(w_ref.at[pl.ds(r0, bn), pl.ds(g0, bg), slice(None)], m3)]
                  if prefetch else None)
        sc = _load(s_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2)
        bi = _load(b_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2) if has_bias else None
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
        tile = _Tile(w_ref, (pl.ds(r0, bn), pl.ds(g0, bg), slice(None)), m3, geo, fmt, hw,
                     planes)
        mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
        xmask = _bcast(gmask[:, None, None], (bg, cpg, epb))
        xmask2 = _bcast(gmask[:, None], (bg, cpg))
        need_tile = (_static_slots(geo) and x_join) or add is not None
        xs = [_load(x_ref.at[xrow(mi), pl.ds(g0, bg), slice(None), slice(None)],
                    xmask).astype(jnp.float32) if need_tile else None for mi in range(m_rows)]
        if _static_slots(geo) and x_join:
            # Join the slot planes back into element order along a new innermost
            # axis (register moves) and contract with x's natural [bg, cpg, epb] tile.
            w4 = _interleave_nd([tile.slot(t) for t in range(epb)])
            tots = [jnp.sum(w4 * xm[None], axis=3) for xm in xs]
        else:
            # Slot by slot against x gathered at the slot's positions (strided loads).
            def slot(t, tots):
                v = tile.slot(t)
                return tuple(
                    _acc(None if tots is None else tots[mi],
                         v * _load(x_ref.at[xrow(mi), pl.ds(g0, bg), slice(None), _i(t)],
                                   xmask2).astype(jnp.float32)[None])
                    for mi in range(m_rows))

            tots = _over_slots(geo, slot, (jnp.zeros((bn, bg, cpg), jnp.float32),) * m_rows)
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


def _gemv_t(x2, qw, config, *, interpret, hw, precision, ids=None, x_div=1):
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
    ops, has_bias, has_gs = _weight_operands(qw, geo)
    bn = min(_pow2_floor(config.block_n), _pow2_ceil(n))
    bg = min(_pow2_floor(max(1, config.k_words // geo.words_per_group)), _pow2_ceil(n_groups))
    split = max(1, min(config.split_k, _cdiv(n_groups, bg)))
    steps = _cdiv(_cdiv(n_groups, bg), split)
    grid, gather, name, operands = (_cdiv(n, bn), split), None, "qmm", [xv, *ops]
    if ids is not None:
        gs_per_expert = has_gs and ops[-1].shape[0] > 1
        grid, gather = grid + (ids.shape[0],), (qw.shape[0], x_div, gs_per_expert)
        name = "gather_qmm"
        operands, m = [ids, *operands], ids.shape[0]
    kernel = functools.partial(
        _gemv_t_kernel, fmt=fmt, geo=geo, m_rows=1 if gather else m, n_rows=n,
        n_groups=n_groups, bn=bn, bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw,
        split=split, x_join=config.x_join, gather=gather)
    if split > 1:
        out_shape = jax.ShapeDtypeStruct((split, m, n), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x2.dtype)
    out = _call(kernel, grid, out_shape, operands, config,
                interpret, f"jq_{name}_gemv_t_{fmt.mode}{qw.bits}")
    return _finish_split(out, split, x2.dtype)


# ---------------------------------------------------------------------------
# GEMV, transpose=False: y[m, n] = sum_k x[m, k] W[k, n], groups along n.


def _gemv_n_kernel(*refs, fmt, geo, m_rows, k_rows, n_groups, bk, bg, steps, has_bias, has_gs,
                   hw, split, gather=None):
    # o_ref: y viewed [(split,) M, G, cpg, epb]; slot t is a strided store.
    refs, w_off, gs_i, xrow, orow = _slots(refs, gather, k_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = _unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    g0 = pl.program_id(0) * bg
    gmask = (g0 + _iota(bg)) < n_groups
    kbase = pl.program_id(1) * (steps * bk)
    gs = gs_ref[gs_i] if has_gs else None
    omask = _bcast(gmask[:, None], (bg, cpg))

    def run(slots):
        """The K loop for the slots in `slots`; stores their output columns."""
        def body(i, carry):
            acc, accb = carry
            k0 = kbase + i * bk
            kmask = (k0 + _iota(bk)) < k_rows
            m2 = kmask[:, None] & gmask[None, :]
            r0 = k0 + w_off             # first weight row (of the slot's expert)
            tile = _Tile(w_ref, (pl.ds(r0, bk), pl.ds(g0, bg), slice(None)),
                         _bcast(m2[:, :, None], (bk, bg, cpg)), geo, fmt, hw)
            sc = _load(s_ref.at[pl.ds(r0, bk), pl.ds(g0, bg)], m2)
            bi = _load(b_ref.at[pl.ds(r0, bk), pl.ds(g0, bg)], m2) if has_bias else None
            mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
            vs = [tile.slot(t) for t in slots]
            new_acc, new_accb = [], []
            for mi in range(m_rows):
                xk = _load(x_ref.at[xrow(mi), pl.ds(k0, bk)], kmask).astype(jnp.float32)
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
                plgpu.store(o_ref.at[pre + (pl.ds(g0, bg), slice(None), _i(t))],
                            out.astype(o_ref.dtype), mask=omask)

    if _static_slots(geo):
        run(list(range(geo.epb)))
    else:
        # Shared slow path: one pass over K per slot.
        def one(t, c):
            run([t])
            return c
        lax.fori_loop(0, geo.epb, one, 0)


def _gemv_n(x2, qw, config, *, interpret, hw, precision, ids=None, x_div=1):
    """transpose=False GEMV; with `ids` its gather_qmm form (see `_gemv_t`)."""
    del precision
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[-1]
    n_groups = n // qw.group_size
    ops, has_bias, has_gs = _weight_operands(qw, geo)
    bk = min(_pow2_floor(config.block_k), _pow2_ceil(k))
    bg = min(_pow2_floor(max(1, config.n_words // geo.words_per_group)), _pow2_ceil(n_groups))
    split = max(1, min(config.split_k, _cdiv(k, bk)))
    steps = _cdiv(_cdiv(k, bk), split)
    grid, gather, name, operands = (_cdiv(n_groups, bg), split), None, "qmm", [x2, *ops]
    if ids is not None:
        gs_per_expert = has_gs and ops[-1].shape[0] > 1
        grid, gather = grid + (ids.shape[0],), (qw.shape[0], x_div, gs_per_expert)
        name = "gather_qmm"
        operands, m = [ids, *operands], ids.shape[0]
    kernel = functools.partial(
        _gemv_n_kernel, fmt=fmt, geo=geo, m_rows=1 if gather else m, k_rows=k,
        n_groups=n_groups, bk=bk, bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw,
        split=split, gather=gather)
    oshape = (m, n_groups, geo.cpg, geo.epb)   # a view of [M, N]: slot t is a strided store
    if split > 1:
        out_shape = jax.ShapeDtypeStruct((split, *oshape), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct(oshape, x2.dtype)
    out = _call(kernel, grid, out_shape, operands, config, interpret,
                f"jq_{name}_gemv_n_{fmt.mode}{qw.bits}")
    return _finish_split(out, split, x2.dtype).reshape(m, n)


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
    w = v * mul[:, :, None]
    if add is not None:
        w = w + add[:, :, None]
    r, g, c = w.shape
    return w.reshape(r, g * c).astype(cdt)


def _interleave(ws):
    """Slot planes ws[t] [R, G, cpg] -> [R, G*cpg*epb] in canonical element order
    ((g*cpg + c)*epb + t), by nested 2-way joins (the new axis is innermost, so
    the outermost join is over t's lowest bit) and one reshape."""
    def build(ts, level):
        if len(ts) == 1:
            return ws[ts[0]]
        even = [t for t in ts if not (t >> level) & 1]
        odd = [t for t in ts if (t >> level) & 1]
        return jnp.stack([build(even, level + 1), build(odd, level + 1)], axis=-1)

    out = build(list(range(len(ws))), 0)
    r = out.shape[0]
    return out.reshape(r, out.size // r)


def _interleave_nd(ws):
    """Slot planes ws[t] [..., C] -> [..., C, epb]: element t of each block innermost."""
    def build(ts, level):
        if len(ts) == 1:
            return ws[ts[0]]
        even = [t for t in ts if not (t >> level) & 1]
        odd = [t for t in ts if (t >> level) & 1]
        return jnp.stack([build(even, level + 1), build(odd, level + 1)], axis=-1)

    out = build(list(range(len(ws))), 0)
    return out.reshape(*ws[0].shape, len(ws))


def _dequant3(v, mul, add, cdt):
    w = v * mul[:, :, None]
    if add is not None:
        w = w + add[:, :, None]
    return w.astype(cdt)


def _ragged_tile(refs, ragged, bm, m_rows, n_rows):
    """Row tile of a GEMM program: (refs, m0, row mask, first weight row, global-scale
    index, K steps). qmm: tile program_id(0). ragged=(gs_per_expert,) (ragged_qmm):
    refs[0] is the device-computed schedule int32 [4, W] (expert, tile start, first
    and end row of the tile's group rows); work item program_id(0) multiplies rows
    [lo, hi) of the tile at m0 with its expert; an empty item (lo == hi) does nothing."""
    if ragged is None:
        m0 = pl.program_id(0) * bm
        return refs, m0, (m0 + _iota(bm)) < m_rows, 0, 0, None
    (gs_per_expert,) = ragged
    w = pl.program_id(0)
    sched = refs[0]
    e, m0, lo, hi = (sched[_i(j), w] for j in range(4))
    rows = m0 + _iota(bm)
    return (refs[1:], m0, (rows >= lo) & (rows < hi), e * n_rows, e if gs_per_expert else 0,
            hi > lo)


def _gemm_t_kernel(*refs, fmt, geo, m_rows, n_rows, n_groups, bm, bn, bg, steps, has_bias,
                   has_gs, hw, precision, permuted, swap_ab, interleave, ragged=None):
    # x_ref: [M, epb, blocks] (permuted by the wrapper), x viewed [M, blocks, epb],
    # or (interleave) x itself [M, K].
    refs, m0, mmask, w_off, gs_i, busy = _ragged_tile(refs, ragged, bm, m_rows, n_rows)
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = _unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    cdt = x_ref.dtype
    n0 = pl.program_id(1) * bn
    r0 = n0 + w_off                     # first weight row (of the tile's expert)
    rmask = (n0 + _iota(bn)) < n_rows
    gs = gs_ref[gs_i] if has_gs else None
    bkw = bg * cpg

    def body(i, acc):
        g0 = i * bg
        gmask = (g0 + _iota(bg)) < n_groups
        m2 = rmask[:, None] & gmask[None, :]
        tile = _Tile(w_ref, (pl.ds(r0, bn), pl.ds(g0, bg), slice(None)),
                     _bcast(m2[:, :, None], (bn, bg, cpg)), geo, fmt, hw)
        sc = _load(s_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2)
        bi = _load(b_ref.at[pl.ds(r0, bn), pl.ds(g0, bg)], m2) if has_bias else None
        mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
        if interleave:
            # Dequantize the whole K tile, interleave the slots back into K order,
            # one dot with the natural x tile (amortized over the M tile).
            bk = bkw * geo.epb
            w = _interleave([_dequant3(tile.slot(t), mul, add, cdt) for t in range(geo.epb)])
            kmask = _bcast(gmask[:, None], (bg, cpg * geo.epb)).reshape(bk)
            xt = _load(x_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg * geo.epb, bk)],
                       mmask[:, None] & kmask[None, :])
            return acc + (_dot_nt(w, xt, precision) if swap_ab else _dot_nt(xt, w, precision))
        kmask = _bcast(gmask[:, None], (bg, cpg)).reshape(bkw)
        xmask = mmask[:, None] & kmask[None, :]

        def slot(t, acc):
            w = _dequant_tile(tile.slot(t), mul, add, cdt)
            if permuted:
                xt = _load(x_ref.at[pl.ds(m0, bm), _i(t), pl.ds(g0 * cpg, bkw)], xmask)
            else:
                xt = _load(x_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg, bkw), _i(t)], xmask)
            # swap_ab: acc^T [bn, bm] = w . x^T, the dequantized weight as the
            # tensor cores' A operand (registers; M = bn fills the MMA even when M is small).
            return acc + (_dot_nt(w, xt, precision) if swap_ab else _dot_nt(xt, w, precision))

        if _static_slots(geo):
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


def _gemm_t(x2, qw, config, *, interpret, hw, precision, schedule=None):
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
    interleave = config.interleave and _static_slots(geo)
    xv = x2.reshape(m, nblk, geo.epb)
    xp = x2 if interleave else (xv.transpose(0, 2, 1) if config.permute_x else xv)
    ops, has_bias, has_gs = _weight_operands(qw, geo)
    bm = max(16, _pow2_floor(config.block_m))
    bn = max(16, min(_pow2_floor(config.block_n), _pow2_ceil(n)))
    bg = _pow2_floor(max(1, config.k_words // geo.words_per_group))
    bg = max(bg, _pow2_ceil(_cdiv(16, geo.cpg)))          # dot K >= 16
    if interleave:
        # The whole dequantized K tile is staged on chip: at most _INTERLEAVE_K
        # elements of K per step, whatever the bit width (2-bit would double it).
        bg = max(1, min(bg, _INTERLEAVE_K // qw.group_size))
    steps = _cdiv(n_groups, bg)
    grid, ragged, name, operands = (_cdiv(m, bm), _cdiv(n, bn)), None, "qmm", [xp, *ops]
    if schedule is not None:
        ragged = (has_gs and ops[-1].shape[0] > 1,)
        grid, name = (schedule.shape[1], _cdiv(n, bn)), "ragged_qmm"
        operands = [schedule, *operands]
    kernel = functools.partial(
        _gemm_t_kernel, fmt=fmt, geo=geo, m_rows=m, n_rows=n, n_groups=n_groups, bm=bm, bn=bn,
        bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw, precision=precision,
        permuted=config.permute_x, swap_ab=config.swap_ab, interleave=interleave, ragged=ragged)
    return _call(kernel, grid, jax.ShapeDtypeStruct((m, n), x2.dtype),
                 operands, config, interpret, f"jq_{name}_gemm_t_{fmt.mode}{qw.bits}")


def gemm_block_m(x_dtype, config) -> int:
    """The M tile `_gemm_t` uses for `config` (ragged_qmm schedules its tiles with it)."""
    del x_dtype
    return max(16, _pow2_floor(config.block_m))


# ---------------------------------------------------------------------------
# GEMM (tensor cores), transpose=False.


def _gemm_n_kernel(*refs, fmt, geo, m_rows, k_rows, n_groups, bm, bk, bg, steps, has_bias,
                   has_gs, hw, precision, interleave):
    # o_ref: y viewed [M, blocks, epb] (slot t is a strided store), or (interleave)
    # y itself [M, N].
    x_ref, _, w_ref, s_ref, b_ref, gs_ref, o_ref = _unpack_refs(refs, False, has_bias, has_gs)
    cpg = geo.cpg
    cdt = x_ref.dtype
    m0 = pl.program_id(0) * bm
    g0 = pl.program_id(1) * bg
    mmask = (m0 + _iota(bm)) < m_rows
    gmask = (g0 + _iota(bg)) < n_groups
    gs = gs_ref[0] if has_gs else None
    bnw = bg * cpg
    nmask = _bcast(gmask[:, None], (bg, cpg)).reshape(bnw)

    def run(slots):
        def body(i, acc):
            k0 = i * bk
            kmask = (k0 + _iota(bk)) < k_rows
            m2 = kmask[:, None] & gmask[None, :]
            tile = _Tile(w_ref, (pl.ds(k0, bk), pl.ds(g0, bg), slice(None)),
                         _bcast(m2[:, :, None], (bk, bg, cpg)), geo, fmt, hw)
            sc = _load(s_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2)
            bi = _load(b_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2) if has_bias else None
            mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
            xk = _load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mmask[:, None] & kmask[None, :])
            return tuple(a + _dot_nn(xk, _dequant_tile(tile.slot(t), mul, add, cdt), precision)
                         for a, t in zip(acc, slots))

        acc = tuple(jnp.zeros((bm, bnw), jnp.float32) for _ in slots)
        acc = lax.fori_loop(0, steps, body, acc)
        for t, a in zip(slots, acc):
            plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg, bnw), _i(t)],
                        a.astype(o_ref.dtype), mask=mmask[:, None] & nmask[None, :])

    def run_interleaved():
        bn = bnw * geo.epb

        def body(i, acc):
            k0 = i * bk
            kmask = (k0 + _iota(bk)) < k_rows
            m2 = kmask[:, None] & gmask[None, :]
            tile = _Tile(w_ref, (pl.ds(k0, bk), pl.ds(g0, bg), slice(None)),
                         _bcast(m2[:, :, None], (bk, bg, cpg)), geo, fmt, hw)
            sc = _load(s_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2)
            bi = _load(b_ref.at[pl.ds(k0, bk), pl.ds(g0, bg)], m2) if has_bias else None
            mul, add = codecs.group_multipliers(fmt, geo.bits, sc, bi, gs, hw)
            xk = _load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mmask[:, None] & kmask[None, :])
            w = _interleave([_dequant3(tile.slot(t), mul, add, cdt) for t in range(geo.epb)])
            return acc + _dot_nn(xk, w, precision)

        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        cmask = _bcast(gmask[:, None], (bg, cpg * geo.epb)).reshape(bn)
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(g0 * cpg * geo.epb, bn)],
                    acc.astype(o_ref.dtype), mask=mmask[:, None] & cmask[None, :])

    if interleave:
        run_interleaved()
    elif _static_slots(geo):
        run(list(range(geo.epb)))
    else:
        def one(t, c):
            run([t])
            return c
        lax.fori_loop(0, geo.epb, one, 0)


def _gemm_n(x2, qw, config, *, interpret, hw, precision):
    fmt = qw.format
    geo = codecs.geometry(qw.bits, qw.group_size)
    m, k = x2.shape
    n = qw.shape[1]
    n_groups = n // qw.group_size
    nblk = n_groups * geo.cpg
    ops, has_bias, has_gs = _weight_operands(qw, geo)
    bm = max(16, _pow2_floor(config.block_m))
    bk = max(16, min(_pow2_floor(config.block_k), _pow2_ceil(k)))
    bg = _pow2_floor(max(1, config.n_words // geo.words_per_group))
    bg = max(bg, _pow2_ceil(_cdiv(16, geo.cpg)))          # dot N >= 16
    steps = _cdiv(k, bk)
    interleave = config.interleave and _static_slots(geo)
    if interleave:
        bg = max(1, min(bg, _INTERLEAVE_K // qw.group_size))   # at most 128 output columns
    kernel = functools.partial(
        _gemm_n_kernel, fmt=fmt, geo=geo, m_rows=m, k_rows=k, n_groups=n_groups, bm=bm, bk=bk,
        bg=bg, steps=steps, has_bias=has_bias, has_gs=has_gs, hw=hw, precision=precision,
        interleave=interleave)
    # out[m, j, t] is column j*epb + t: [M, blocks, epb] is a free view of [M, N].
    oshape = (m, n) if interleave else (m, nblk, geo.epb)
    out = _call(kernel, (_cdiv(m, bm), _cdiv(n_groups, bg)),
                jax.ShapeDtypeStruct(oshape, x2.dtype), [x2, *ops], config,
                interpret, f"jq_qmm_gemm_n_{fmt.mode}{qw.bits}")
    return out.reshape(m, n)
