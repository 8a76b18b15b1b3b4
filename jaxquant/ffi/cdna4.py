"""qmm on CDNA4 (gfx950) for MXFP4 weights in the `cdna4` layout: the lowering
that calls gpu_src/rocm/cdna4_qmm.hip (target `jaxquant_cdna4_qmm`), and the split
of x into the instruction's operand type (docs/cdna4.md).

The scaled MFMA takes E4M3/E5M2/E3M2/E2M3/E2M1 operands, not bfloat16/float16.
x is split per 32-element block of K into T E4M3 terms sharing one E8M0
scale: x = 2^s * (t_0 + t_1 + ... + t_{T-1}), with s = floor(log2 amax) - 7
(so the block's values are < 256 in the scaled domain, below E4M3's 448), t_0
= e4m3(x / 2^s) rounded to nearest even and each next term the E4M3 rounding
of what is left. Each term carries 4 significant bits, so T = 2 reproduces a
bfloat16 element exactly and T = 3 a float16 one, for every element within
2^9 of its block's amax (bfloat16; 2^5 for float16); smaller elements are off
by at most 2^-10 * 2^s, i.e. 2^-17 of the block's amax. The kernel then adds
the T products in its float32 accumulator: the result matches the reference
(x @ dequantize(w).T, float32 accumulation) to float32 rounding of the sum,
not bit for bit (the instruction's summation order is its own).

Edges: x elements below float32's normal range count as zero (XLA flushes
them); a block of x with Inf/NaN anywhere makes the whole call fall back to
the reference (lax.cond), so non-finite x gives the reference's result; an
E8M0 weight scale of 0xFF gives a NaN column, as in the reference (the
kernel checks the scales itself).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant import dispatch
from jaxquant.ffi import configs
from jaxquant.ops.qmm import qmm_reference
from jaxquant.quantized_array import QuantizedArray

TARGET = "jaxquant_cdna4_qmm"
LAYOUT = "cdna4"
# E4M3 terms per x dtype: enough significant bits (4 each) for the dtype's own.
TERMS = {jnp.dtype(jnp.bfloat16): 2, jnp.dtype(jnp.float16): 3}
_M_TILE = 16
_BLOCK = 32


def split_x(x, terms: int):
    """x [B, M, K] (bfloat16/float16/float32) -> (xq uint8 [B, T, Mp, K] E4M3
    terms, xs uint8 [B, Mp, K/32] E8M0 scales), Mp = M rounded up to 16 (zero
    rows). Non-finite elements are replaced by 0 (the caller falls back)."""
    b, m, k = x.shape
    mp = -(-m // _M_TILE) * _M_TILE
    xf = x.astype(jnp.float32)
    xf = jnp.where(jnp.isfinite(xf), xf, 0.0)
    if mp != m:
        xf = jnp.pad(xf, ((0, 0), (0, mp - m), (0, 0)))
    blocks = xf.reshape(b, mp, k // _BLOCK, _BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    # floor(log2 amax) from the exponent field (amax == 0 or subnormal: -127).
    biased = (lax.bitcast_convert_type(amax, jnp.uint32) >> 23).astype(jnp.int32)
    s = jnp.clip(biased - 127 - 7, -127, 126)
    v = blocks * lax.bitcast_convert_type(((127 - s) << 23).astype(jnp.uint32),
                                          jnp.float32)[..., None]  # exact: 2^-s
    out = []
    for _ in range(terms):
        t = v.astype(jnp.float8_e4m3fn)
        out.append(lax.bitcast_convert_type(t, jnp.uint8))
        v = v - t.astype(jnp.float32)
    xq = jnp.stack(out, axis=1).reshape(b, terms, mp, k)
    xs = (s + 127).astype(jnp.uint8)
    return xq, xs


def join_x(xq, xs, m: int):
    """The values that split_x's terms and scales stand for, float64 [B, m, K]
    (numpy; the test oracle of the split)."""
    import ml_dtypes  # noqa: PLC0415 - jax's own dependency
    import numpy as np  # noqa: PLC0415
    xq, xs = np.asarray(xq), np.asarray(xs)
    b, t, mp, k = xq.shape
    vals = xq.view(ml_dtypes.float8_e4m3fn).astype(np.float64).sum(axis=1)
    blocks = vals.reshape(b, mp, k // _BLOCK, _BLOCK)
    return np.ldexp(blocks, xs.astype(np.int32)[..., None] - 127).reshape(b, mp, k)[:, :m]


def qmm_call(x3, qw3: QuantizedArray):
    """The raw kernel call: x3 [B, M, K] bfloat16/float16, qw3 [B, N, K] mxfp4
    in the cdna4 layout -> [B, M, N] in x's dtype."""
    xq, xs = split_x(x3, TERMS[jnp.dtype(x3.dtype)])
    out = jax.ShapeDtypeStruct(x3.shape[:2] + (qw3.shape[-2],), x3.dtype)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(xq, xs, qw3.data, qw3.scales)


def _is_gfx950() -> bool:
    """Whether JAX's default device is a gfx950 (best effort, from the device's
    compute capability or kind: "gfx950", "MI350", "MI355"). Elsewhere the
    reference runs; the handler checks the device again and refuses others."""
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    text = f"{getattr(d, 'compute_capability', '')} {getattr(d, 'device_kind', '')}".lower()
    return "gfx950" in text or "mi350" in text or "mi355" in text


def qmm_applies(x, qw, *, platform, transpose, precision):
    return (isinstance(qw, QuantizedArray) and qw.layout == LAYOUT and qw.mode == "mxfp4"
            and transpose and jnp.dtype(x.dtype) in TERMS and _is_gfx950())


def qmm_auto(x, qw, *, platform, transpose, precision):
    return 0 < math.prod(x.shape[qw.ndim - 2:-1]) <= configs.CDNA4_AUTO_MAX_M


def qmm_impl(x, qw, *, platform, transpose, precision):
    nb = qw.ndim - 2
    k = x.shape[-1]
    n = qw.shape[-2]
    b, m = math.prod(qw.shape[:nb]), math.prod(x.shape[nb:-1])
    x3 = x.reshape(b, m, k)
    qw3 = qw.flatten_leading(nb)

    def kernel(x3):
        return qmm_call(x3, qw3).reshape(*x.shape[:-1], n)

    def reference(x3):
        return qmm_reference(x, qw, transpose=transpose, precision=precision)

    return lax.cond(jnp.all(jnp.isfinite(x3)), kernel, reference, x3)


def register():
    """Register the kernel as the ffi backend's qmm on ROCm (jaxquant.ffi does,
    when the ROCm library lists the jaxquant_cdna4_qmm target)."""
    dispatch.register("qmm", "ffi", ("rocm",), qmm_impl, qmm_applies, priority=dispatch.PRIORITY["ffi_layout"],
                      auto=qmm_auto)
