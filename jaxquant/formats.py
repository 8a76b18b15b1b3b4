"""The quantization formats of docs/formats.md: one table, and the codecs.

Every backend reads `FORMATS` and `ELEMENTS`; nothing else in the code base
re-derives a bit layout. The codecs here are jnp and jittable; they are the
reference that kernels are tested against.

Packing (all modes): ``data`` is ``uint32 [..., N, K*bits/32]``, a
little-endian bit stream along K: element k occupies bits
``[k*bits, (k+1)*bits)`` of the stream. 3-, 5- and 6-bit elements straddle
words.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A small float: 1 sign bit, `ebits` exponent bits, `mbits` mantissa bits.

    `special` says which codes are not finite numbers:
      "none": every code is finite (FP4, FP6 of OCP MX);
      "fn":   only S.1111.111 is NaN, no Inf (E4M3 "fn");
      "ieee": exponent all ones is Inf (mantissa 0) or NaN (E5M2).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    special: str

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max_exponent_code(self) -> int:
        """Largest exponent field that holds finite numbers."""
        top = (1 << self.ebits) - 1
        return top - 1 if self.special == "ieee" else top

    @property
    def max_mantissa_code(self) -> int:
        top = (1 << self.mbits) - 1
        return top - 1 if self.special == "fn" else top

    @property
    def max_value(self) -> float:
        return float((1 + self.max_mantissa_code / (1 << self.mbits))
                     * 2.0 ** (self.max_exponent_code - self.bias))

    @property
    def emax(self) -> int:
        """floor(log2(max_value)): OCP MX's emax_elem."""
        return self.max_exponent_code - self.bias


ELEMENTS: dict[str, ElementFormat] = {
    e.name: e
    for e in (
        ElementFormat("e2m1", ebits=2, mbits=1, bias=1, special="none"),
        ElementFormat("e2m3", ebits=2, mbits=3, bias=1, special="none"),
        ElementFormat("e3m2", ebits=3, mbits=2, bias=3, special="none"),
        ElementFormat("e4m3", ebits=4, mbits=3, bias=7, special="fn"),
        ElementFormat("e5m2", ebits=5, mbits=2, bias=15, special="ieee"),
    )
}


#: Non-uniform elements: code -> value, small integers (exact in every float dtype).
#: An element named here is decoded by a table lookup, not from sign/exponent/mantissa
#: bits; its width is log2 of the table's length.
CODEBOOKS: dict[str, tuple[int, ...]] = {
    # llama.cpp's kvalues_iq4nl (ggml-common.h), the values of GGUF's IQ4_NL and IQ4_XS
    "iq4nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
}


def element_bits(element: str) -> int:
    """The code width of an ELEMENTS or CODEBOOKS entry."""
    if element in CODEBOOKS:
        return len(CODEBOOKS[element]).bit_length() - 1
    return ELEMENTS[element].bits


@dataclasses.dataclass(frozen=True)
class Format:
    """One row of docs/formats.md.

    element: an ELEMENTS key, a CODEBOOKS key, or None for affine (unsigned integers).
    scale:   "e8m0" | "e4m3" (stored as uint8 codes) | "float" (w's dtype).
    """

    mode: str
    element: str | None
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    default_group_size: int
    scale: str
    has_biases: bool = False
    has_global_scale: bool = False
    scale_rules: tuple[str, ...] = ()

    @property
    def default_bits(self) -> int:
        return 4 if 4 in self.bits else self.bits[0]

    @property
    def default_scale_rule(self) -> str | None:
        return self.scale_rules[0] if self.scale_rules else None


_MX_RULES = ("floor", "rceil", "round")

FORMATS: dict[str, Format] = {
    f.mode: f
    for f in (
        Format("affine", None, (2, 3, 4, 5, 6, 8), (16, 32, 64, 128), 64, "float",
               has_biases=True),
        Format("mxfp4", "e2m1", (4,), (32,), 32, "e8m0", scale_rules=_MX_RULES),
        Format("mxfp6_e2m3", "e2m3", (6,), (32,), 32, "e8m0", scale_rules=_MX_RULES),
        Format("mxfp6_e3m2", "e3m2", (6,), (32,), 32, "e8m0", scale_rules=_MX_RULES),
        Format("mxfp8_e4m3", "e4m3", (8,), (32,), 32, "e8m0", scale_rules=_MX_RULES),
        Format("mxfp8_e5m2", "e5m2", (8,), (32,), 32, "e8m0", scale_rules=_MX_RULES),
        Format("nvfp4", "e2m1", (4,), (16,), 16, "e4m3", has_global_scale=True),
        Format("fp4", "e2m1", (4,), (32, 16, 64), 32, "float"),
        Format("iq4nl", "iq4nl", (4,), (32,), 32, "float"),
    )
}

ALIASES = {"mxfp8": "mxfp8_e4m3"}

# Named quantization settings (jq.quantize arguments) that the demo, the models and the
# benchmarks take by name: "affine<bits>" at the default group of 64 for each affine
# width, every other format (and alias) at its defaults. Each user picks its subset.
PRESETS: dict[str, dict] = {
    **{f"affine{b}": dict(mode="affine", bits=b, group_size=FORMATS["affine"].default_group_size)
       for b in FORMATS["affine"].bits},
    **{m: dict(mode=m) for m in FORMATS if m != "affine"},
    **{alias: dict(mode=mode) for alias, mode in ALIASES.items()},
}


def get_format(mode) -> Format:
    """The table row for `mode` (aliases resolved); ValueError if unknown."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {sorted(FORMATS)}; got {mode!r}")
    fmt = FORMATS.get(ALIASES.get(mode, mode))
    if fmt is None:
        raise ValueError(
            f"mode={mode!r} is not a known format; expected one of "
            f"{sorted(FORMATS) + sorted(ALIASES)}")
    return fmt


def resolve(mode, bits=None, group_size=None) -> tuple[Format, int, int]:
    """Validate (mode, bits, group_size); fill in the format's defaults."""
    fmt = get_format(mode)
    if bits is None:
        bits = fmt.default_bits
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in fmt.bits:
        raise ValueError(f"bits={bits!r} is not allowed for mode={fmt.mode!r}; "
                         f"expected one of {list(fmt.bits)}")
    if group_size is None:
        group_size = fmt.default_group_size
    if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
            or group_size not in fmt.group_sizes):
        raise ValueError(f"group_size={group_size!r} is not allowed for mode={fmt.mode!r}; "
                         f"expected one of {list(fmt.group_sizes)}")
    return fmt, int(bits), int(group_size)


# ---------------------------------------------------------------------------
# Bit-stream packing.


def _stream_geometry(bits: int):
    """For 32 elements (= `bits` words): per element, its word, shift, spill."""
    start = np.arange(32) * bits
    word = start // 32
    shift = start % 32
    spill = shift + bits > 32
    return word, shift, spill


def _check_stream_length(k: int, bits: int):
    per_word = 32 // bits if 32 % bits == 0 else 32
    if k % per_word:
        raise ValueError(f"a {bits}-bit stream needs the element count to be a multiple of "
                         f"{per_word}; got {k}")


def pack_bits(codes, bits: int):
    """uint codes [..., K] (each < 2**bits) -> uint32 words [..., K*bits/32]."""
    codes = jnp.asarray(codes).astype(jnp.uint32)
    k = codes.shape[-1]
    _check_stream_length(k, bits)
    if 32 % bits == 0:  # whole elements per word
        per_word = 32 // bits
        shifts = (np.arange(per_word) * bits).astype(np.uint32)
        fields = codes.reshape(*codes.shape[:-1], k // per_word, per_word) << shifts
        # Bit fields are disjoint, so a sum is an OR.
        return jnp.sum(fields, axis=-1, dtype=jnp.uint32)
    blocks = codes.reshape(*codes.shape[:-1], k // 32, 32)
    word, shift, spill = _stream_geometry(bits)
    lo = blocks << shift.astype(np.uint32)
    # Elements straddling a word put their top bits at the next word's bottom.
    hi = blocks >> np.where(spill, 32 - shift, 0).astype(np.uint32)
    words = []
    for j in range(bits):
        (own,) = np.nonzero(word == j)
        w = jnp.sum(lo[..., own[0]:own[-1] + 1], axis=-1, dtype=jnp.uint32)
        if j > 0 and spill[own[0] - 1]:
            w = w + hi[..., own[0] - 1]
        words.append(w)
    return jnp.stack(words, axis=-1).reshape(*codes.shape[:-1], k * bits // 32)


def unpack_bits(data, bits: int):
    """uint32 words [..., W] -> uint32 codes [..., W*32/bits]."""
    data = jnp.asarray(data)
    if data.dtype != jnp.uint32:
        raise TypeError(f"data must be uint32, got {data.dtype}")
    w = data.shape[-1]
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:
        shifts = (np.arange(32 // bits) * bits).astype(np.uint32)
        codes = (data[..., None] >> shifts) & mask
        return codes.reshape(*data.shape[:-1], w * 32 // bits)
    if w % bits:
        raise ValueError(f"a {bits}-bit stream needs the word count to be a multiple of "
                         f"{bits}; got {w}")
    blocks = data.reshape(*data.shape[:-1], w // bits, bits)
    word, shift, spill = _stream_geometry(bits)
    lo = blocks[..., word] >> shift.astype(np.uint32)
    nxt = np.minimum(word + 1, bits - 1)
    hi = jnp.where(spill, blocks[..., nxt] << np.where(spill, 32 - shift, 0).astype(np.uint32), 0)
    return ((lo | hi) & mask).reshape(*data.shape[:-1], w * 32 // bits)


# ---------------------------------------------------------------------------
# Exact powers of two, built from float32 bit patterns.


def exp2i(e):
    """2.0**e as float32 for integer e in [-149, 127]; exact, subnormals included."""
    e = jnp.asarray(e, jnp.int32)
    normal = lax.bitcast_convert_type(((jnp.clip(e, -126, 127) + 127) << 23).astype(jnp.uint32),
                                      jnp.float32)
    sub = lax.bitcast_convert_type(
        (jnp.uint32(1) << jnp.clip(e + 149, 0, 22).astype(jnp.uint32)), jnp.float32)
    return jnp.where(e >= -126, normal, sub)


def exact_div(x, d):
    """x / d correctly rounded, also under jit.

    XLA rewrites a division by a constant or by a broadcast operand into a
    multiplication by the reciprocal, which is not correctly rounded (x / 15
    differs from IEEE division for most x). Adding a zero of x's shape that
    XLA cannot prove constant keeps the true division.
    """
    x = jnp.asarray(x)
    zero = jnp.where(jnp.isfinite(x), x * 0, 0).astype(x.dtype)
    return x / (jnp.asarray(d, x.dtype) + zero)


def _floor_log2(a):
    """floor(log2(a)) for finite normal a > 0 (float32), exact."""
    _, e = jnp.frexp(a)
    return e - 1


def abs_max(x, axis):
    """max |x| along `axis` as float32: NaN if any element is NaN, subnormals kept.

    Taken on the bit patterns (|x| orders like its bits, and NaN's bits are
    above inf's): XLA's vectorized CPU max can drop NaNs and treats float32
    subnormals as zero.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32) & 0x7FFFFFFF
    return lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def log2_parts(a):
    """(floor(log2 a) int32, a / 2**floor(log2 a) float32 in [1, 2)) for finite
    a > 0, exact, from the bits (so float32 subnormals work on every platform)."""
    bits = lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.int32) & 0x7FFFFFFF
    biased, mant = bits >> 23, bits & 0x7FFFFF
    top = 31 - lax.clz(mant)  # a subnormal is mant * 2**-149: its leading bit
    floor_log2 = jnp.where(biased > 0, biased - 127, top - 149)
    normal = lax.bitcast_convert_type(mant | 0x3F800000, jnp.float32)
    subnormal = mant.astype(jnp.float32) * exp2i(-jnp.clip(top, 0, 22))
    return floor_log2, jnp.where(biased > 0, normal, subnormal)


# ---------------------------------------------------------------------------
# Element codecs.


def decode_element(codes, element: str):
    """Element codes (any uint) -> float32 values, exact."""
    if element in CODEBOOKS:
        table = np.asarray(CODEBOOKS[element], np.float32)
        return jnp.asarray(table)[jnp.asarray(codes).astype(jnp.int32) & (len(table) - 1)]
    f = ELEMENTS[element]
    c = jnp.asarray(codes).astype(jnp.int32)
    e = (c >> f.mbits) & ((1 << f.ebits) - 1)
    m = c & ((1 << f.mbits) - 1)
    sign = (c >> (f.ebits + f.mbits)) & 1
    # value = significand * 2**(exponent - mbits); subnormals share emin.
    significand = jnp.where(e == 0, m, m + (1 << f.mbits)).astype(jnp.float32)
    mag = significand * exp2i(jnp.maximum(e, 1) - f.bias - f.mbits)
    if f.special == "fn":
        mag = jnp.where((e == (1 << f.ebits) - 1) & (m == (1 << f.mbits) - 1), jnp.nan, mag)
    elif f.special == "ieee":
        top = e == (1 << f.ebits) - 1
        mag = jnp.where(top, jnp.where(m == 0, jnp.inf, jnp.nan), mag)
    return jnp.where(sign == 1, -mag, mag)


def decode_element_scaled(codes, element: str, exponent):
    """decode_element(codes) * 2**exponent as float32, exact, subnormal results
    included: they are built from bits, since XLA flushes float32 subnormals
    produced by arithmetic on CPU. (Every MX value, E8M0 2**-127 included, is
    a float32 number.)"""
    f = ELEMENTS[element]
    c = jnp.asarray(codes).astype(jnp.int32)
    e = (c >> f.mbits) & ((1 << f.ebits) - 1)
    m = c & ((1 << f.mbits) - 1)
    significand = jnp.where(e == 0, m, m + (1 << f.mbits))
    power = jnp.maximum(e, 1) - f.bias - f.mbits + jnp.asarray(exponent, jnp.int32)
    half = power // 2  # two normal factors: neither operand is a flushed subnormal
    normal = significand.astype(jnp.float32) * exp2i(half) * exp2i(power - half)
    # Results under 2**-126: significand * 2**power = (significand << (power + 149)) ulps.
    tiny = power < -126
    sub_bits = significand.astype(jnp.uint32) << jnp.clip(power + 149, 0, 31).astype(jnp.uint32)
    use_bits = tiny & (power + 149 >= 0) & (sub_bits < (1 << 23))
    mag = jnp.where(use_bits, lax.bitcast_convert_type(sub_bits, jnp.float32), normal)
    mag = jnp.where(tiny & (power + 149 < 0), 0.0, mag)
    if f.special == "fn":
        mag = jnp.where((e == (1 << f.ebits) - 1) & (m == (1 << f.mbits) - 1), jnp.nan, mag)
    elif f.special == "ieee":
        top = e == (1 << f.ebits) - 1
        mag = jnp.where(top, jnp.where(m == 0, jnp.inf, jnp.nan), mag)
    sign = ((c >> (f.ebits + f.mbits)) & 1).astype(jnp.uint32) << 31
    return lax.bitcast_convert_type(lax.bitcast_convert_type(mag, jnp.uint32) | sign, jnp.float32)


def encode_element(x, element: str):
    """float32 values -> uint32 codes: round to nearest even, saturate to the
    largest finite value. NaN encodes as the format's NaN, or 0 where there is none
    (its block's scale marks it NaN)."""
    f = ELEMENTS[element]
    x = jnp.asarray(x, jnp.float32)
    a = jnp.minimum(jnp.abs(x), f.max_value)
    finite = jnp.isfinite(x)
    a = jnp.where(finite | jnp.isinf(x), a, 0.0)
    exp = jnp.maximum(_floor_log2(jnp.where(a > 0, a, 1.0)), f.emin)
    # Round to a multiple of the spacing at a's exponent (ties to even).
    q = jnp.round(a * exp2i(f.mbits - exp)) * exp2i(exp - f.mbits)
    qexp = jnp.maximum(_floor_log2(jnp.where(q > 0, q, 1.0)), f.emin)
    normal = q >= exp2i(f.emin)
    e_code = jnp.where(normal, qexp + f.bias, 0)
    m_code = (q * exp2i(f.mbits - qexp)).astype(jnp.int32) - jnp.where(normal, 1 << f.mbits, 0)
    code = (e_code << f.mbits) | m_code
    code = jnp.where(jnp.signbit(x), code | (1 << (f.ebits + f.mbits)), code)
    if f.special != "none":
        nan_code = (1 << (f.bits - 1)) - 1  # S.111..1: NaN in both fn and ieee
        code = jnp.where(jnp.isnan(x), nan_code, code)
    return code.astype(jnp.uint32)


def encode_codebook(x, element: str):
    """float32 values -> uint32 codes of CODEBOOKS[element]: the nearest value, ties to
    the larger one (llama.cpp's best_index_int8), saturating; NaN encodes as 0. The
    midpoints of the integer values are exact in float32, so one comparison per
    midpoint decides."""
    values = np.asarray(CODEBOOKS[element], np.float64)
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    x = jnp.asarray(x, jnp.float32)
    return jnp.sum(x[..., None] >= mids, axis=-1, dtype=jnp.uint32)


def round_to_element(x, element: str):
    """x rounded (RNE, saturating) onto the element grid, as float32."""
    return decode_element(encode_element(x, element), element)


# ---------------------------------------------------------------------------
# Scale codecs.


def decode_e8m0(codes):
    """E8M0 codes (uint8) -> float32: 2**(e-127); 0 is 2**-127 (exact); 255 is NaN."""
    e = jnp.asarray(codes).astype(jnp.int32)
    return jnp.where(e == 255, jnp.nan, exp2i(e - 127))


def e8m0_exponent(amax, element: str, rule: str):
    """The shared exponent (int32, clamped to [-127, 127]) of a block whose
    largest magnitude is `amax` (float32, finite), per OCP MX rule `rule`.

    Integer arithmetic on amax = 2**fl * m (m in [1, 2)) and max_value =
    2**emax * max_sig, exact for subnormal amax too (XLA flushes float32
    subnormals in CPU arithmetic).
    """
    f = ELEMENTS[element]
    if rule not in _MX_RULES:
        raise ValueError(f"scale_rule={rule!r} is not known; expected one of {list(_MX_RULES)}")
    bits = lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32) & 0x7FFFFFFF
    positive = bits > 0
    fl, m = log2_parts(lax.bitcast_convert_type(jnp.where(positive, bits, 0x3F800000),
                                                jnp.float32))
    max_sig = np.float32(f.max_value / 2.0 ** f.emax)  # in [1, 2)
    if rule == "floor":
        e = fl - f.emax
    elif rule == "rceil":  # the smallest e with amax <= max_value * 2**e
        e = fl - f.emax + (m > max_sig).astype(jnp.int32)
    else:
        e = _round_log2_quotient(fl, m, f.emax, f.max_value)
    e = jnp.where(positive, e, -127)
    return jnp.clip(e, -127, 127)


def _round_log2_quotient(fl, m, emax, max_value):
    """MLX's "round" rule: round(log2(r)) for r = amax / max_value rounded to
    float32, amax = 2**fl * m.

    Where r is a float32 normal, r = 2**(fl - emax) * q with q = m / max_sig
    rounded alike. Where r is subnormal only e in {-126, -127} survives the
    clamp: -126 iff r, rounded to a multiple of 2**-149, is >= 2**-126.5, that
    is iff amax * 2**149 >= 5931641.5 * max_value (2**22.5 = 5931641.85; a tie
    rounds to the even 5931642). That product needs 28 bits: it is compared as
    a float32 pair hi + lo.
    """
    q = exact_div(m, np.float32(max_value / 2.0 ** emax))
    q_fl, q_m = log2_parts(q)
    e = fl - emax + q_fl + (q_m * q_m >= 2.0).astype(jnp.int32)
    threshold = 5931641.5 * max_value  # exact in float64
    hi = np.float32(threshold)
    lo = np.float32(threshold - float(hi))
    scaled = m * exp2i(jnp.minimum(fl + 149, 127))  # amax * 2**149, exact where it matters
    e_sub = jnp.where(scaled - hi >= lo, -126, -127)
    return jnp.where(fl - emax + q_fl < -126, e_sub, e)


def encode_e8m0(amax, element: str, rule: str):
    """uint8 E8M0 scale code for blocks of largest magnitude `amax`; 0xFF if not finite."""
    e = e8m0_exponent(amax, element, rule)
    return jnp.where(jnp.isfinite(amax), e + 127, 255).astype(jnp.uint8)


def decode_e4m3(codes):
    return decode_element(codes, "e4m3")


def encode_e4m3(x):
    return encode_element(x, "e4m3").astype(jnp.uint8)


def decode_scales(fmt: Format, scales):
    """Stored scales -> float32 multipliers."""
    if fmt.scale == "e8m0":
        return decode_e8m0(scales)
    if fmt.scale == "e4m3":
        return decode_e4m3(scales)
    return jnp.asarray(scales).astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def element_values(element: str) -> np.ndarray:
    """All 2**bits values of an element format or codebook, as float32 numpy (for docs
    and kernels)."""
    return np.asarray(jax.jit(lambda c: decode_element(c, element))(
        np.arange(1 << element_bits(element), dtype=np.uint32)))
