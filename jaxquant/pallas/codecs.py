"""In-kernel decoders for the Pallas kernels (elementwise jnp on uint32 words).

Everything here is derived from `jaxquant.formats` (FORMATS / ELEMENTS): the
kernels re-derive no bit layout of their own. The functions are plain jnp on
arrays, so they run inside a Pallas Triton kernel, in interpret mode, and in
plain XLA alike; they use only shifts, masks, bit casts, selects and
multiplications by powers of two (no integer->float conversion, no table in
memory: a codebook's values are constants of the code, picked by selects and shifts).

Geometry. The packed stream of docs/formats.md is cut into *blocks*: the smallest
run of whole words that holds a whole number of elements at fixed bit offsets.
  bits in {2, 4, 8}: a block is 1 word holding 32/bits elements;
  bits in {3, 5, 6}: a block is `bits` words holding 32 elements.
A group of `group_size` elements is `cpg` consecutive blocks. A kernel loads a
tile of words viewed as [rows, groups, cpg] (one such tile per word of a block)
and decodes *slot* t (the t-th element of every block) as one plane
[rows, groups, cpg]: element (r, g, c, t) is k = (g*cpg + c)*epb + t. The kernel
then contracts slot planes against activations permuted the same way, so it
never interleaves elements.

Decoded values. Elementwise decoders return float32 `v` with a per-format
affine relation to the true element value, folded into the per-group scale:
  affine:  v = 1 + q / 2**bits (exact; mantissa bit trick), so
           w = scale*q + bias = (scale * 2**bits) * v + (bias - scale * 2**bits);
  floats:  v = the element value itself (exact): the sign/exponent/mantissa bits
           are moved into a float32 as a number 2**(bias-127) times too small
           (subnormal for the element's subnormals) and multiplied by
           2**(127-bias). NaN/Inf codes decode as NaN/Inf.
  codebooks: v = the codebook's value (an integer, exact).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant import formats

U32 = np.uint32


@dataclasses.dataclass(frozen=True)
class Geometry:
    bits: int
    group_size: int
    epb: int        # elements per block
    wpb: int        # words per block
    cpg: int        # blocks per group

    @property
    def words_per_group(self) -> int:
        return self.cpg * self.wpb

    def slot(self, t: int):
        """(word, shift, spill) of slot t within a block."""
        start = t * self.bits
        word, shift = divmod(start, 32)
        return word, shift, shift + self.bits > 32


@functools.lru_cache(maxsize=None)
def geometry(bits: int, group_size: int) -> Geometry:
    if 32 % bits == 0:
        epb, wpb = 32 // bits, 1
    else:
        epb, wpb = 32, bits
    if group_size % epb:
        raise ValueError(f"group_size={group_size} is not a multiple of the {epb}-element block "
                         f"of {bits}-bit elements")
    return Geometry(bits, group_size, epb, wpb, group_size // epb)


# ---------------------------------------------------------------------------
# Bit moves.


def shl(x, s: int):
    """Logical shift of uint32 `x` left by s (right by -s); s static."""
    if s == 0:
        return x
    return x << U32(s) if s > 0 else x >> U32(-s)


def sar(x, s: int):
    """Arithmetic shift right of the uint32 bit pattern `x` by s (static)."""
    if s == 0:
        return x
    xi = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type(xi >> np.int32(s), jnp.uint32)


def slot_bits(planes, geo: Geometry, t: int, dst: int):
    """Slot t's code, moved to bits [dst, dst+bits) of a uint32, zeros elsewhere."""
    word, shift, spill = geo.slot(t)
    mask = U32(((1 << geo.bits) - 1) << dst)
    if not spill:
        return shl(planes[word], dst - shift) & mask
    lo = planes[word] >> U32(shift)
    hi = planes[word + 1] << U32(32 - shift)
    return shl(lo | hi, dst) & mask


def slot_top(planes, geo: Geometry, t: int):
    """Slot t's code in the top `bits` bits of a uint32 (lower bits: junk)."""
    word, shift, spill = geo.slot(t)
    if not spill:
        return shl(planes[word], 32 - geo.bits - shift)
    return slot_bits(planes, geo, t, 32 - geo.bits)


# ---------------------------------------------------------------------------
# Element decoders.


def f32_bits(x):
    return lax.bitcast_convert_type(x, jnp.float32)


def decode_affine_v(placed, bits: int):
    """`placed` = code at bits [23-bits, 23): v = 1 + q / 2**bits (exact float32)."""
    return f32_bits(placed | U32(0x3F800000))


def decode_float_top(top, element: str, hw_subnormals: bool = True):
    """Element code in the top bits of a uint32 (junk below) -> exact float32 value.

    hw_subnormals=True (GPU kernels): the sign/exponent/mantissa bits are moved
    into a float32 2**(bias-127) times too small (a float32 subnormal for the
    element's subnormals) and multiplied by 2**(127-bias): 3 integer ops and
    one multiply; exact where float32 subnormals are not flushed (Triton's
    CUDA and ROCm code keeps IEEE denormals; checked by the GPU tests).
    hw_subnormals=False (interpret mode: XLA on CPU flushes subnormals): the
    exponent is rebiased with an integer add and the element's subnormals are
    fixed up with a select; no float32 subnormal ever appears.
    """
    f = formats.ELEMENTS[element]
    eb, mb = f.ebits, f.mbits
    # Sign stays at bit 31, exponent lands in float32's exponent field bits
    # [23, 23+eb), mantissa right below bit 23.
    mag_mask = ((1 << (eb + mb)) - 1) << (23 - mb)
    exp_mask = ((1 << eb) - 1) << 23
    bits = sar(top, 8 - eb) & U32(0x80000000 | mag_mask)
    if hw_subnormals:
        v = f32_bits(bits) * np.float32(2.0 ** (127 - f.bias))
    else:
        rebias = U32((127 - f.bias) << 23)
        normal = f32_bits(bits + rebias)
        # e == 0: bits + rebias is sign * 2**-bias * (1 + m/2**mb) = (true + sign*2**(1-bias)) / 2.
        one = f32_bits((bits & U32(0x80000000)) | U32((128 - f.bias) << 23))
        v = jnp.where((bits & U32(exp_mask)) == U32(0), normal * np.float32(2) - one, normal)
    if f.special == "fn":
        v = jnp.where((bits & U32(mag_mask)) == U32(mag_mask), np.float32(np.nan), v)
    elif f.special == "ieee":
        v = jnp.where((bits & U32(exp_mask)) == U32(exp_mask),
                      f32_bits(bits | U32(0x7F800000)), v)
    return v


@functools.lru_cache(maxsize=None)
def codebook_words(element: str) -> tuple[int, ...]:
    """formats.CODEBOOKS[element] as uint32 words, 4 values a word: byte j of word i
    is value 4i + j plus 128 (the values are integers in [-128, 127])."""
    values = formats.CODEBOOKS[element]
    if any(not -128 <= v <= 127 for v in values) or len(values) % 4:
        raise ValueError(f"codebook {element!r} does not fit bytes, four to a word")
    return tuple(sum((values[4 * i + j] + 128) << (8 * j) for j in range(4))
                 for i in range(len(values) // 4))


def decode_codebook(code, element: str):
    """A codebook code (low bits of a uint32, zeros above) -> its float32 value: the
    word holding it chosen by selects on the code's high bits, its byte shifted out,
    and byte - 128 made a float with the mantissa trick (exact)."""
    words = [U32(w) for w in codebook_words(element)]
    pick, level = words, 0
    while len(pick) > 1:
        bit = (code & U32(4 << level)) != U32(0)
        pick = [jnp.where(bit, pick[i + 1], pick[i]) for i in range(0, len(pick), 2)]
        level += 1
    byte = (pick[0] >> ((code & U32(3)) << U32(3))) & U32(0xFF)
    return f32_bits(byte | U32(0x4B000000)) - np.float32(8388608 + 128)


def decode_slot(planes, geo: Geometry, t: int, fmt: formats.Format, hw_subnormals: bool = True):
    """Slot t of the word planes -> float32 `v` (see the module docstring)."""
    if fmt.element is None:
        return decode_affine_v(slot_bits(planes, geo, t, 23 - geo.bits), geo.bits)
    if fmt.element in formats.CODEBOOKS:
        return decode_codebook(slot_bits(planes, geo, t, 0), fmt.element)
    return decode_float_top(slot_top(planes, geo, t), fmt.element, hw_subnormals)


def slot_code_dynamic(lo, hi, t, geo: Geometry):
    """Slot t (a traced int32) of a straddling format, from the word holding its
    first bit (`lo`) and the next word (`hi`): the code in the low bits."""
    start = t * geo.bits
    shift = (start & 31).astype(jnp.uint32)
    # hi << (32 - shift) without a shift by 32 (undefined in LLVM) when shift == 0.
    spilled = (hi << (U32(31) - shift)) << U32(1)
    return ((lo >> shift) | spilled) & U32((1 << geo.bits) - 1)


def slot_word_dynamic(t, geo: Geometry):
    """(first word, next word) of slot t within its block, clamped in range."""
    word = (t * geo.bits) >> 5
    return word, jnp.minimum(word + 1, geo.wpb - 1)


def decode_code(code, geo: Geometry, fmt: formats.Format, hw_subnormals: bool = True):
    """An element code (low bits of a uint32) -> float32 `v`."""
    if fmt.element is None:
        return decode_affine_v(code << U32(23 - geo.bits), geo.bits)
    if fmt.element in formats.CODEBOOKS:
        return decode_codebook(code, fmt.element)
    return decode_float_top(code << U32(32 - geo.bits), fmt.element, hw_subnormals)


# ---------------------------------------------------------------------------
# Scales.


def decode_e8m0_u32(e):
    """E8M0 codes (uint32) -> float32 2**(e-127); e=0 is 2**-127 (a float32
    subnormal, exact on the GPU; flushed to 0 where the platform flushes, as the
    reference is there); 255 is NaN."""
    sc = f32_bits(jnp.where(e == U32(0), U32(0x00400000), e << U32(23)))
    return jnp.where(e == U32(255), np.float32(np.nan), sc)


def group_multipliers(fmt: formats.Format, bits: int, scales, biases=None, global_scale=None,
                      hw_subnormals: bool = True):
    """Per-group (mul, add) so that sum_k w_k x_k over a group = mul*sum(v x) + add*sum(x).

    `scales` / `biases` are the loaded tiles in their stored dtypes; `add` is
    None when the format has no additive part."""
    if fmt.scale == "e8m0":
        mul = decode_e8m0_u32(scales.astype(jnp.uint32))
    elif fmt.scale == "e4m3":
        mul = decode_float_top(scales.astype(jnp.uint32) << U32(24), "e4m3", hw_subnormals)
    else:
        mul = scales.astype(jnp.float32)
    if global_scale is not None:
        mul = mul * global_scale
    if fmt.element is None:  # affine: v = 1 + q/2**bits
        mul = mul * np.float32(1 << bits)
        return mul, biases.astype(jnp.float32) - mul
    return mul, None
