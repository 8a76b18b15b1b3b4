"""quantize / dequantize in jnp, for every mode of docs/formats.md.

`dequantize_reference` is the definition of dequantization that every kernel
is tested against; `jaxquant.dequantize` (the primitive) lowers to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant import formats, layouts
from jaxquant.formats import Format
from jaxquant.layouts import prepack, unpack_layout
from jaxquant.quantized_array import CANONICAL, QuantizedArray
from jaxquant.static_args import require_static

div = formats.exact_div  # IEEE division: XLA turns x / c into x * (1/c)
_FLOATS = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)


def check_float_dtype(name: str, dtype) -> np.dtype:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a float dtype (float32, float16, bfloat16 or "
                        f"float64); got {dtype!r}") from None
    if dtype not in [jnp.dtype(d) for d in _FLOATS]:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64; got {dtype}")
    return dtype


def ldexp(x, n):
    """x * 2**n (x float32, n int32 in [-254, 254]), exact wherever the result is
    a float32 normal. XLA flushes float32 subnormals in CPU arithmetic, so
    neither the factor (E8M0's 2**-127 is subnormal) nor a subnormal x may
    enter a multiplication: the factor is split in two, and a subnormal x
    (mant * 2**-149) is rebuilt from its bits."""
    half = n // 2
    scaled = x * formats.exp2i(half) * formats.exp2i(n - half)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    m = n - 149  # only n > 0 matters: a smaller result encodes as zero anyway
    from_bits = ((bits & 0x7FFFFF).astype(jnp.float32) * formats.exp2i(m // 2)
                 * formats.exp2i(m - m // 2))
    from_bits = jnp.where(jnp.signbit(x), -from_bits, from_bits)
    return jnp.where(((bits & 0x7F800000) == 0) & (n > 0), from_bits, scaled)


# ---------------------------------------------------------------------------
# quantize


def quantize(w, mode: str = "affine", bits: int | None = None, group_size: int | None = None,
             scale_rule: str | None = None, layout: str | None = None) -> QuantizedArray:
    """Quantize `w` [..., N, K] with groups along K.

    mode: one of `jaxquant.formats.FORMATS` (or the alias "mxfp8").
    bits, group_size: default to the format's (affine: 4 bits, group 64).
    scale_rule: MX modes only: "floor" (OCP, default), "rceil" or "round" (MLX).
    layout: the bit arrangement of the result (docs/layouts.md). None: the
      default device's kernel layout, as `jq.prepack(qw)` picks it (cuda_mma on
      an NVIDIA GPU with jaxquant's CUDA library; canonical where no kernel
      reads another, e.g. on a CPU); "canonical": the exchange layout of
      docs/formats.md on every device; or a layout name. The values are the
      same in every layout (an exact permutation of the same codes).
    mode, bits, group_size, scale_rule and layout are static (Python values):
    under ``jax.jit`` close over them or name them in ``static_argnames``, e.g.
    ``jax.jit(jq.quantize, static_argnames=("mode", "bits", "group_size"))``.
    Formats, rounding and the non-finite rule: docs/formats.md.
    """
    for name, value in (("mode", mode), ("bits", bits), ("group_size", group_size),
                        ("scale_rule", scale_rule), ("layout", layout)):
        require_static(name, value, "quantize")
    if layout is not None and not isinstance(layout, str):
        raise TypeError(f"layout must be a layout name or None; got {type(layout).__name__}")
    fmt, bits, group_size = formats.resolve(mode, bits, group_size)
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        w = np.asarray(w)
    check_float_dtype("w", w.dtype)
    if w.ndim < 2:
        raise ValueError(f"w must have at least 2 dimensions [..., N, K]; got shape {w.shape}")
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"w's last axis (K={k}) must be a multiple of group_size={group_size}")
    if scale_rule is None:
        scale_rule = fmt.default_scale_rule
    elif scale_rule not in fmt.scale_rules:
        allowed = list(fmt.scale_rules) or ["None (this mode has a single rule)"]
        raise ValueError(f"scale_rule={scale_rule!r} is not allowed for mode={fmt.mode!r}; "
                         f"expected one of {allowed}")

    # the layout's name is checked before the work; whether it can hold this
    # weight (mode, K) is prepack's to say
    if layout not in (None, CANONICAL):
        layouts.get(layout)
    return prepack(_quantize(jnp.asarray(w), fmt.mode, bits, group_size, scale_rule), layout)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(w, mode, bits, group_size, scale_rule):
    fmt, dtype, k = formats.FORMATS[mode], w.dtype, w.shape[-1]
    wg = w.astype(jnp.float32).reshape(*w.shape[:-1], k // group_size, group_size)
    biases = global_scale = None
    if fmt.mode == "affine":
        codes, scales, biases = _quantize_affine(wg, bits, dtype)
    elif fmt.scale == "e8m0":
        codes, scales = _quantize_mx(wg, fmt.element, scale_rule)
    elif fmt.mode == "nvfp4":
        codes, scales, global_scale = _quantize_nvfp4(wg)
    elif fmt.mode == "fp4":
        codes, scales = _quantize_fp4(wg, dtype)
    elif fmt.element in formats.CODEBOOKS:
        codes, scales = _quantize_codebook(wg, fmt.element, dtype)
    else:  # pragma: no cover - the table and this dispatch must agree
        raise NotImplementedError(fmt.mode)
    data = formats.pack_bits(codes.reshape(w.shape), bits)
    return QuantizedArray(data, scales, biases, global_scale, mode=fmt.mode, bits=bits,
                          group_size=group_size, dtype=dtype)


def _quantize_affine(wg, bits, dtype):
    # MLX's CPU rule, step by step (docs/formats.md), in float32.
    n_bins = np.float32((1 << bits) - 1)
    w_min = jnp.min(wg, axis=-1, keepdims=True)
    w_max = jnp.max(wg, axis=-1, keepdims=True)
    edge_is_min = jnp.abs(w_min) > jnp.abs(w_max)
    s = jnp.maximum(div(w_max - w_min, n_bins), np.float32(1e-7))
    scale = jnp.where(edge_is_min, s, -s)
    edge = jnp.where(edge_is_min, w_min, w_max)
    q0 = jnp.rint(div(edge, scale))
    scale = jnp.where(q0 != 0, div(edge, q0), scale)
    bias = jnp.where(q0 != 0, edge, np.float32(0))
    q = jnp.clip(jnp.rint(div(wg - bias, scale)), 0, n_bins)
    # A group holding NaN or +-Inf dequantizes to NaN everywhere (docs/formats.md).
    # Its min/max cannot carry that: XLA's vectorized CPU min/max drop NaNs, so
    # whether a NaN reached the scale depended on the shape. The abs max taken
    # on the bits sees every NaN and Inf.
    nonfinite = ~jnp.isfinite(formats.abs_max(wg, axis=-1))[..., None]
    scale = jnp.where(nonfinite, np.float32(np.nan), scale)
    bias = jnp.where(nonfinite, np.float32(np.nan), bias)
    q = jnp.where(nonfinite | jnp.isnan(q), 0, q)
    return q.astype(jnp.uint32), scale[..., 0].astype(dtype), bias[..., 0].astype(dtype)


def _quantize_mx(wg, element, rule):
    amax = formats.abs_max(wg, axis=-1)
    scales = formats.encode_e8m0(amax, element, rule)
    exponent = scales.astype(jnp.int32) - 127
    codes = formats.encode_element(ldexp(wg, -exponent[..., None]), element)
    return codes, scales


def _quantize_nvfp4(wg):
    amax = formats.abs_max(jnp.where(jnp.isfinite(wg), wg, 0), axis=None)
    encode = jnp.where(amax > 0, div(jnp.full_like(amax, 6 * 448), amax), np.float32(1))
    global_scale = div(jnp.ones_like(encode), encode)
    block_amax = formats.abs_max(wg, axis=-1)
    scales = formats.encode_e4m3(div(block_amax, np.float32(6)) * encode)
    scales = jnp.where(jnp.isfinite(block_amax), scales, np.uint8(0x7F))
    divisor = (formats.decode_e4m3(scales) * global_scale)[..., None]
    codes = formats.encode_element(jnp.where(divisor != 0, div(wg, divisor), 0), "e2m1")
    return codes, scales, global_scale


def _quantize_fp4(wg, dtype):
    scales = div(formats.abs_max(wg, axis=-1), np.float32(6)).astype(dtype)
    divisor = scales.astype(jnp.float32)[..., None]
    codes = formats.encode_element(jnp.where(divisor != 0, div(wg, divisor), 0), "e2m1")
    return codes, scales


def _quantize_codebook(wg, element, dtype):
    # llama.cpp's first guess for IQ4_NL (quantize_row_iq4_nl_impl before its scale
    # search): the group's element of largest magnitude lands exactly on the codebook's
    # value of largest magnitude (-127), so scale = that element / -127 (its sign follows).
    table = formats.CODEBOOKS[element]
    end = np.float32(max(table, key=abs))
    bits = lax.bitcast_convert_type(wg, jnp.int32) & 0x7FFFFFFF  # |w| ordered as its bits
    peak = jnp.take_along_axis(wg, jnp.argmax(bits, axis=-1)[..., None], axis=-1)[..., 0]
    scales = div(peak, end).astype(dtype)
    divisor = scales.astype(jnp.float32)[..., None]
    codes = formats.encode_codebook(jnp.where(divisor != 0, div(wg, divisor), 0), element)
    nonfinite = ~jnp.isfinite(formats.abs_max(wg, axis=-1))
    scales = jnp.where(nonfinite, jnp.asarray(np.nan, dtype), scales)
    codes = jnp.where(nonfinite[..., None], 0, codes).astype(jnp.uint32)
    return codes, scales


# ---------------------------------------------------------------------------
# dequantize


def dequantize_reference(qw: QuantizedArray, dtype=None):
    """The definition of dequantization: [..., N, K] values in `dtype`
    (default: qw.dtype), arithmetic in float32 (float64 for float64 output)."""
    dtype = check_float_dtype("dtype", qw.dtype if dtype is None else dtype)
    if qw.layout != CANONICAL:  # a kernel layout: the definition reads the canonical bits
        qw = unpack_layout(qw)
    fmt: Format = qw.format
    *lead, n, k = qw.shape
    g = qw.group_size
    codes = formats.unpack_bits(qw.data, qw.bits).reshape(*lead, n, k // g, g)
    compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
    if fmt.mode == "affine":
        scales = qw.scales.astype(compute)[..., None]
        biases = qw.biases.astype(compute)[..., None]
        values = codes.astype(compute) * scales + biases
    elif fmt.scale == "e8m0":
        e = qw.scales.astype(jnp.int32)[..., None]
        values = formats.decode_element_scaled(codes, fmt.element, e - 127)
        values = jnp.where(e == 255, jnp.nan, values)
    else:
        # (element and scale values are exact in float32; their products are not)
        values = formats.decode_element(codes, fmt.element).astype(compute)
        values = values * formats.decode_scales(fmt, qw.scales).astype(compute)[..., None]
        if qw.global_scale is not None:
            gs = jnp.asarray(qw.global_scale, jnp.float32).astype(compute)
            values = values * gs.reshape(gs.shape + (1,) * (values.ndim - gs.ndim))
    return values.reshape(*lead, n, k).astype(dtype)
