"""An independent float64 numpy oracle for the formats of docs/formats.md.

Written from the text of docs/formats.md only: it does not import jaxquant and does
not share its algorithms. Element values are built from the bit definitions,
encoding searches the table of finite values, packing walks the bit stream
one bit at a time, and the quantize rules are modelled step by step in the
arithmetic the contract names (float32 where it says float32, exact float64
elsewhere).
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

# name: (exponent bits, mantissa bits, bias, specials)
#   "none": every code is a finite number (OCP FP4 / FP6)
#   "fn":   S.1111.111 is NaN, no Inf (OCP E4M3)
#   "ieee": exponent all ones is Inf (mantissa 0) or NaN (OCP E5M2)
ELEMENT_SPECS = {
    "e2m1": (2, 1, 1, "none"),
    "e2m3": (2, 3, 1, "none"),
    "e3m2": (3, 2, 3, "none"),
    "e4m3": (4, 3, 7, "fn"),
    "e5m2": (5, 2, 15, "ieee"),
}

# Non-uniform 4-bit codebooks, code -> value: llama.cpp's kvalues_iq4nl (ggml-common.h),
# the values of GGUF's IQ4_NL and IQ4_XS.
CODEBOOKS = {
    "iq4nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
}

# mode: (element or None for affine, allowed bits, allowed groups, default group, scale kind)
MODES = {
    "affine": (None, (2, 3, 4, 5, 6, 8), (16, 32, 64, 128), 64, "float"),
    "mxfp4": ("e2m1", (4,), (32,), 32, "e8m0"),
    "mxfp6_e2m3": ("e2m3", (6,), (32,), 32, "e8m0"),
    "mxfp6_e3m2": ("e3m2", (6,), (32,), 32, "e8m0"),
    "mxfp8_e4m3": ("e4m3", (8,), (32,), 32, "e8m0"),
    "mxfp8_e5m2": ("e5m2", (8,), (32,), 32, "e8m0"),
    "nvfp4": ("e2m1", (4,), (16,), 16, "e4m3"),
    "fp4": ("e2m1", (4,), (32, 16, 64), 32, "float"),
    "iq4nl": ("iq4nl", (4,), (32,), 32, "float"),
}
MODE_ALIASES = {"mxfp8": "mxfp8_e4m3"}
MX_RULES = ("floor", "rceil", "round")


def canonical_mode(mode: str) -> str:
    return MODE_ALIASES.get(mode, mode)


def element_bits(name: str) -> int:
    if name in CODEBOOKS:
        return int(math.log2(len(CODEBOOKS[name])))
    ebits, mbits, _, _ = ELEMENT_SPECS[name]
    return 1 + ebits + mbits


# ---------------------------------------------------------------------------
# Element tables, from the bit definition.


@functools.lru_cache(maxsize=None)
def _element_table(name: str) -> tuple:
    ebits, mbits, bias, special = ELEMENT_SPECS[name]
    nbits = 1 + ebits + mbits
    e_all = (1 << ebits) - 1
    m_all = (1 << mbits) - 1
    values = []
    for code in range(1 << nbits):
        sign = (code >> (ebits + mbits)) & 1
        e = (code >> mbits) & e_all
        m = code & m_all
        if special == "fn" and e == e_all and m == m_all:
            v = math.nan
        elif special == "ieee" and e == e_all:
            v = math.inf if m == 0 else math.nan
        elif e == 0:  # subnormal: 0.m * 2**(1 - bias)
            v = math.ldexp(m, 1 - bias - mbits)
        else:  # normal: 1.m * 2**(e - bias)
            v = math.ldexp((1 << mbits) + m, e - bias - mbits)
        values.append(-v if sign else v)
    return tuple(values)


def element_table(name: str) -> np.ndarray:
    """All 2**bits values of element format `name`, indexed by code (float64)."""
    if name in CODEBOOKS:
        return np.array(CODEBOOKS[name], dtype=np.float64)
    return np.array(_element_table(name), dtype=np.float64)


def max_finite(name: str) -> float:
    t = element_table(name)
    return float(np.max(t[np.isfinite(t)]))


def emax_elem(name: str) -> int:
    """floor(log2(largest finite value)), exactly."""
    _, e = math.frexp(max_finite(name))
    return e - 1


def nan_code(name: str):
    """A code that decodes to NaN, or None if the format has no NaN."""
    t = element_table(name)
    codes = np.nonzero(np.isnan(t))[0]
    return int(codes[0]) if codes.size else None


def decode_element(codes, name: str) -> np.ndarray:
    return element_table(name)[np.asarray(codes).astype(np.int64)]


def decode_e4m3(codes) -> np.ndarray:
    return decode_element(codes, "e4m3")


def decode_e8m0(codes) -> np.ndarray:
    """E8M0: 2**(e-127) for e in 0..254 (e=0 is 2**-127, exact); 255 is NaN."""
    e = np.asarray(codes).astype(np.int64)
    out = np.ldexp(np.ones(e.shape, np.float64), e - 127)
    return np.where(e == 255, np.nan, out)


# ---------------------------------------------------------------------------
# Element encoding: nearest finite value by search; ties to the even code;
# saturate to the largest finite value; the sign bit follows x's sign bit.


@functools.lru_cache(maxsize=None)
def _positive_grid(name: str):
    ebits, mbits, _, _ = ELEMENT_SPECS[name]
    half = 1 << (ebits + mbits)
    t = element_table(name)[:half]
    codes = np.nonzero(np.isfinite(t))[0]
    mags = t[codes]
    assert np.all(np.diff(mags) > 0), "finite magnitudes must increase with the code"
    return codes, mags


def encode_element(x, name: str) -> np.ndarray:
    """float64 values -> uint32 codes (round to nearest, ties to even code,
    saturating). NaN -> the format's NaN code, or 0 where it has none."""
    ebits, mbits, _, _ = ELEMENT_SPECS[name]
    codes, mags = _positive_grid(name)
    x = np.asarray(x, dtype=np.float64)
    nan = np.isnan(x)
    a = np.minimum(np.abs(np.where(nan, 0.0, x)), mags[-1])  # +-inf saturates
    hi = np.clip(np.searchsorted(mags, a, side="left"), 0, len(mags) - 1)
    lo = np.maximum(hi - 1, 0)
    # mags[lo] < a <= mags[hi] (or both 0). The midpoint of two element values is exact.
    mid = (mags[lo] + mags[hi]) / 2
    c_lo, c_hi = codes[lo], codes[hi]
    tie_pick = np.where(c_lo % 2 == 0, c_lo, c_hi)
    pick = np.where(a < mid, c_lo, np.where(a > mid, c_hi, tie_pick))
    pick = np.where(a == mags[hi], c_hi, pick)
    sign = np.signbit(x) & ~nan
    out = pick | (sign.astype(np.int64) << (ebits + mbits))
    nc = nan_code(name)
    out = np.where(nan, 0 if nc is None else nc, out)
    return out.astype(np.uint32)


# ---------------------------------------------------------------------------
# The little-endian bit stream of docs/formats.md, bit by bit.


def pack_bits(codes, bits: int) -> np.ndarray:
    """codes [..., K] (each < 2**bits) -> uint32 words [..., K*bits/32]:
    element k occupies stream bits [k*bits, (k+1)*bits); stream bit i is bit
    i % 32 of word i // 32."""
    codes = np.asarray(codes).astype(np.uint64)
    *lead, k = codes.shape
    if (k * bits) % 32:
        raise ValueError(f"K*bits must be a multiple of 32; got K={k}, bits={bits}")
    if np.any(codes >> np.uint64(bits)):
        raise ValueError(f"codes must be < 2**{bits}")
    # stream[..., k*bits + b] = bit b of element k
    stream = (codes[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)
    stream = stream.reshape(*lead, k * bits // 32, 32)
    words = (stream << np.arange(32, dtype=np.uint64)).sum(axis=-1, dtype=np.uint64)
    return words.astype(np.uint32)


def unpack_bits(words, bits: int) -> np.ndarray:
    """uint32 words [..., W] -> codes [..., W*32/bits] (uint32)."""
    words = np.asarray(words)
    if words.dtype != np.uint32:
        raise TypeError(f"words must be uint32, got {words.dtype}")
    *lead, w = words.shape
    if (w * 32) % bits:
        raise ValueError(f"W*32 must be a multiple of bits={bits}")
    stream = (words.astype(np.uint64)[..., None] >> np.arange(32, dtype=np.uint64)) & np.uint64(1)
    stream = stream.reshape(*lead, w * 32 // bits, bits)
    codes = (stream << np.arange(bits, dtype=np.uint64)).sum(axis=-1, dtype=np.uint64)
    return codes.astype(np.uint32)


# ---------------------------------------------------------------------------
# quantize


def _resolve(mode, bits, group_size, scale_rule):
    mode = canonical_mode(mode)
    element, allowed_bits, allowed_groups, default_group, scale_kind = MODES[mode]
    if bits is None:
        bits = 4 if 4 in allowed_bits else allowed_bits[0]
    if group_size is None:
        group_size = default_group
    assert bits in allowed_bits and group_size in allowed_groups, (mode, bits, group_size)
    if scale_kind == "e8m0":
        scale_rule = scale_rule or "floor"
        assert scale_rule in MX_RULES
    else:
        assert scale_rule is None
    return mode, element, bits, group_size, scale_kind, scale_rule


def _floor_log2(a):
    """floor(log2(a)) for finite a > 0 (float64), exact."""
    _, e = np.frexp(a)
    return e.astype(np.int64) - 1


def mx_shared_exponent(amax, element: str, rule: str) -> np.ndarray:
    """Shared exponent (int64, in [-127, 127]) of blocks with largest
    magnitude `amax` (finite, float32 values), per scale rule."""
    amax32 = np.asarray(amax, dtype=np.float32)
    amax = amax32.astype(np.float64)
    maxv = max_finite(element)
    safe = np.where(amax > 0, amax, 1.0)
    with np.errstate(all="ignore"):
        if rule == "floor":
            e = _floor_log2(safe) - emax_elem(element)
        elif rule == "rceil":
            # smallest e with amax <= maxv * 2**e; the products are exact in float64
            cand = np.arange(-127, 128)
            ok = safe[..., None] <= maxv * np.ldexp(1.0, cand)
            e = np.where(ok.any(-1), cand[np.argmax(ok, axis=-1)], 127)
        elif rule == "round":
            # r = amax / max_elem in float32 (IEEE, subnormals kept), then exact
            r = np.where(amax32 > 0, amax32, np.float32(1)) / np.float32(maxv)
            lg = np.log2(r.astype(np.float64))  # r > 0 or 0 -> -inf
            e = np.clip(np.round(lg), -1000, 1000).astype(np.int64)
        else:
            raise ValueError(rule)
    e = np.clip(e, -127, 127)
    return np.where(amax > 0, e, -127).astype(np.int64)


def quantize(w, mode="affine", bits=None, group_size=None, scale_rule=None) -> dict:
    """Oracle quantization of w [..., N, K] (numpy float32/float16/bfloat16).

    Returns dict(data, scales, biases, global_scale) in the library's storage
    conventions. Element codes of blocks whose scale marks them NaN (E8M0 0xFF,
    E4M3 NaN) are unspecified by the contract; this oracle fills them with
    something, tests must not compare them.
    """
    mode, element, bits, g, scale_kind, rule = _resolve(mode, bits, group_size, scale_rule)
    w = np.asarray(w)
    dtype = w.dtype
    *lead, n, k = w.shape
    assert k % g == 0
    w32 = w.astype(np.float32)
    wg = w32.reshape(*lead, n, k // g, g)
    biases = global_scale = None
    with np.errstate(all="ignore"):
        if mode == "affine":
            codes, scales, biases = _affine(wg, bits, dtype)
        elif scale_kind == "e8m0":
            amax = np.max(np.abs(wg), axis=-1)  # NaN propagates
            finite = np.isfinite(amax)
            e = mx_shared_exponent(np.where(finite, amax, 0), element, rule)
            scales = np.where(finite, e + 127, 255).astype(np.uint8)
            x = np.ldexp(wg.astype(np.float64), -np.where(finite, e, 0)[..., None])
            codes = encode_element(x, element)
        elif mode == "nvfp4":
            codes, scales, global_scale = _nvfp4(wg)
        elif mode == "fp4":
            amax = np.max(np.abs(wg), axis=-1)
            scales = (amax / np.float32(6)).astype(dtype)
            div = scales.astype(np.float32)[..., None]
            x = np.where(div != 0, wg / np.where(div != 0, div, np.float32(1)), np.float32(0))
            codes = encode_element(x.astype(np.float64), "e2m1")
        elif element in CODEBOOKS:
            codes, scales = _codebook(wg, element, dtype)
        else:
            raise AssertionError(mode)
    data = pack_bits(np.asarray(codes).reshape(w.shape), bits)
    return dict(data=data, scales=scales, biases=biases, global_scale=global_scale)


def _affine(wg, bits, dtype):
    f32 = np.float32
    n = f32((1 << bits) - 1)
    mn = np.min(wg, axis=-1)
    mx = np.max(wg, axis=-1)
    s = np.maximum((mx - mn) / n, f32(1e-7))
    edge_is_min = np.abs(mn) > np.abs(mx)
    scale = np.where(edge_is_min, s, -s)
    edge = np.where(edge_is_min, mn, mx)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, f32(1)), scale)
    bias = np.where(nz, edge, f32(0))
    assert scale.dtype == bias.dtype == np.float32
    q = np.rint((wg - bias[..., None]) / scale[..., None])
    q = np.clip(q, f32(0), n)
    # A group holding NaN or +-Inf: NaN scale and bias (the whole group dequantizes
    # to NaN), codes 0.
    bad = ~np.isfinite(wg).all(axis=-1)
    scale = np.where(bad, f32(np.nan), scale)
    bias = np.where(bad, f32(np.nan), bias)
    q = np.where(np.isnan(q) | bad[..., None], f32(0), q)
    assert q.dtype == np.float32
    return q.astype(np.uint32), scale.astype(dtype), bias.astype(dtype)


def _codebook(wg, element, dtype):
    """docs/formats.md's codebook rule: scale = (the group's element of largest
    magnitude, the first if several) / (the codebook value of largest magnitude), in
    float32, stored in w's dtype; each code the nearest value to w / scale (float32),
    ties to the larger value; a non-finite group: NaN scale, codes 0."""
    f32 = np.float32
    table = element_table(element)
    end = f32(table[np.argmax(np.abs(table))])
    idx = np.argmax(np.abs(wg), axis=-1)
    peak = np.take_along_axis(wg, idx[..., None], axis=-1)[..., 0]
    scales = (peak / end).astype(dtype)
    div = scales.astype(f32)[..., None]
    x = np.where(div != 0, wg / np.where(div != 0, div, f32(1)), f32(0))
    assert x.dtype == np.float32
    # nearest by distance (float64, exact for float32 x and integer values); on a tie
    # the larger value, which is the later code (the table increases)
    dist = np.abs(x.astype(np.float64)[..., None] - table)
    best = dist.min(axis=-1, keepdims=True)
    codes = (table.size - 1 - np.argmax((dist == best)[..., ::-1], axis=-1)).astype(np.uint32)
    codes = np.where(x.astype(np.float64) >= table[-1], table.size - 1, codes)
    codes = np.where(x.astype(np.float64) <= table[0], 0, codes)
    bad = ~np.isfinite(wg).all(axis=-1)
    scales = np.where(bad, np.nan, scales.astype(np.float64)).astype(dtype)
    codes = np.where(bad[..., None], 0, codes).astype(np.uint32)
    return codes, scales


def _nvfp4(wg):
    f32 = np.float32
    a = np.abs(wg)
    fin = np.isfinite(a)
    amax = f32(np.max(np.where(fin, a, f32(0)))) if a.size else f32(0)
    encode = f32(2688) / amax if amax > 0 else f32(1)
    global_scale = f32(1) / f32(encode)
    block_amax = np.max(a, axis=-1)
    v = (block_amax / f32(6)) * f32(encode)
    assert v.dtype == np.float32
    scales = encode_element(v.astype(np.float64), "e4m3").astype(np.uint8)
    scales = np.where(np.isfinite(block_amax), scales, np.uint8(0x7F)).astype(np.uint8)
    div = (decode_e4m3(scales).astype(f32) * global_scale)[..., None]
    assert div.dtype == np.float32
    x = np.where(div != 0, wg / np.where(div != 0, div, f32(1)), f32(0))
    codes = encode_element(x.astype(np.float64), "e2m1")
    return codes, scales, np.float32(global_scale)


# ---------------------------------------------------------------------------
# dequantize


def dequantize(mode, bits, group_size, data, scales, biases=None, global_scale=None):
    """Exact float64 values [..., N, K] of stored quantized data."""
    mode = canonical_mode(mode)
    element, _, _, _, scale_kind = MODES[mode]
    data = np.asarray(data)
    scales = np.asarray(scales)
    codes = unpack_bits(data, bits)
    *lead, n, k = codes.shape
    g = group_size
    codes = codes.reshape(*lead, n, k // g, g)
    if mode == "affine":
        s = scales.astype(np.float64)[..., None]
        b = np.asarray(biases).astype(np.float64)[..., None]
        values = s * codes.astype(np.float64) + b
    elif scale_kind == "e8m0":
        e = scales.astype(np.int64)[..., None]
        values = np.ldexp(decode_element(codes, element), np.where(e == 255, 0, e - 127))
        values = np.where(e == 255, np.nan, values)
    elif mode == "nvfp4":
        values = decode_element(codes, element) * decode_e4m3(scales)[..., None]
        if global_scale is not None:  # a scalar, or one per leading index
            gs = np.asarray(global_scale, np.float32).astype(np.float64)
            values = values * gs.reshape(gs.shape + (1,) * (values.ndim - gs.ndim))
    else:  # fp4, codebooks
        values = decode_element(codes, element) * scales.astype(np.float64)[..., None]
    return values.reshape(*lead, n, k)


# ---------------------------------------------------------------------------
# Helpers for tests.

FLOAT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

# (significand precision p including the implicit bit, min normal exponent)
_PRECISION = {"float32": (24, -126), "float16": (11, -14), "bfloat16": (8, -126),
              "float64": (53, -1022)}


def ulp(x, dtype) -> np.ndarray:
    """Spacing of `dtype`'s grid at |x| (float64; subnormal range included)."""
    p, emin = _PRECISION[np.dtype(dtype).name]
    a = np.abs(np.asarray(x, np.float64))
    safe = np.where((a > 0) & np.isfinite(a), a, 2.0 ** emin)
    e = np.maximum(_floor_log2(safe), emin)
    return np.ldexp(1.0, e - (p - 1))
