"""GGUF (llama.cpp) tensors -> jaxquant, exactly (re-exported by `jaxquant.io`).

`from_gguf_tensor(raw, ggml_type, shape)` turns one tensor's block bytes into a
QuantizedArray whose `jq.dequantize(qw, float32)` equals, number for number,
what ggml (and the `gguf` package's numpy dequantizers) compute, or into a
float numpy array where no jaxquant mode holds the type:

| ggml type | block | value (ggml, float32)            | jaxquant                                |
|-----------|-------|----------------------------------|-----------------------------------------|
| Q4_0      | 32    | d * (q - 8)                      | affine 4-bit g32, scale d, bias -8d     |
| Q4_1      | 32    | d * q + m                        | affine 4-bit g32, scale d, bias m       |
| Q5_0      | 32    | d * (q - 16)                     | affine 5-bit g32, scale d, bias -16d    |
| Q5_1      | 32    | d * q + m                        | affine 5-bit g32, scale d, bias m       |
| Q8_0      | 32    | d * q (q int8)                   | affine 8-bit g32, code q+128, bias -128d|
| MXFP4     | 32    | e2m1 * 2**(e-127)                | mxfp4 (`io.from_ggml_mxfp4`)            |
| Q4_K      | 256   | (d*sc) * q - (dmin*m), 8 x 32    | affine 4-bit g32, float32 scale d*sc, bias -(dmin*m) |
| Q5_K      | 256   | as Q4_K with 5-bit q             | affine 5-bit g32, float32 scale and bias|
| Q3_K      | 256   | d*(sc-32) * q, q in [-4, 3], 16 x 16 | fp4 g16 (each q is an E2M1 value), float32 scale d*(sc-32) |
| Q2_K      | 256   | (d*sc) * q - (dmin*m), 16 x 16   | affine 2-bit g16, float32 scale d*sc, bias -(dmin*m) |
| Q6_K      | 256   | (d*sc) * (q - 32), 16 x 16       | affine 6-bit g16, code q, float32 scale d*sc, bias -32*d*sc |
| IQ4_NL    | 32    | d * kvalues_iq4nl[q]             | iq4nl (codebook) g32, code q, float16 scale d |
| IQ4_XS    | 256   | d*(ls-32) * kvalues_iq4nl[q], 8 x 32 | iq4nl g32, code q, float32 scale d*(ls-32) |
| F32/F16/BF16 | 1  | as stored                        | float numpy array of that dtype         |

Why these are exact: ggml computes in float32, and every product above is exact
in float32 (d is float16: 11 significant bits; d*sc with a 6-bit sc has 17,
times a 4/5-bit q at most 22 < 24), so ggml's result is one rounding of the
exact value, and jaxquant's affine `scale * q + bias` (float32, the product
exact) rounds the same sum once. Q2_K likewise (d*sc: 15 bits, times a 2-bit q).
Q6_K's d*sc (an int8 sc: 18 bits) times q - 32 (6 bits) is exact, and so are
jaxquant's scale * q (q in [0, 63]) and its bias -32*d*sc (a power of two
times d*sc): the sum is the exact value, which float32 holds. Q4_0/Q5_0/Q8_0's
-8d/-16d/-128d and Q4_1's d*q + m are exact or the same single rounding
likewise. The scales and biases of the 32-block types are float16 where that
holds them (d, m, and -8d etc. when they do not overflow float16), else
float32; the K-quants' are float32 (d*sc needs 17 bits). IQ4_NL's d (11
significant bits) times a codebook value (an integer of at most 7) and IQ4_XS's
d*(ls-32) (at most 11 + 5 bits; ls a 6-bit field) times one (at most 23 bits) are
exact in float32 as well, so jaxquant's `scale * value` is ggml's number, its
non-finite ones included (no codebook value is 0: a d of Inf gives +-Inf, as in
ggml).

Differences from ggml, all at non-finite or zero values: a block whose d (or
m, dmin) is Inf or NaN dequantizes to NaN in every element (jaxquant's rule
for non-finite groups; ggml gives Inf*q); ggml's d*0 with a negative d is -0,
jaxquant's +0. The IQ types other than IQ4_NL and IQ4_XS (lattice codebooks of
2 and 3 bits) and the ternary TQ types are refused by name (ValueError).

Block layouts (ggml-common.h; element j of a 32-block, 0-based):
- Q4_0: fp16 d, qs[16]: element j in the low nibble of qs[j], j+16 in the high.
- Q4_1: fp16 d, fp16 m, qs[16] as Q4_0.
- Q5_0: fp16 d, qh (uint32 LE: bit j is element j's 5th bit), qs[16] as Q4_0.
- Q5_1: fp16 d, fp16 m, qh, qs[16].
- Q8_0: fp16 d, int8 qs[32].
- Q4_K: fp16 d, fp16 dmin, scales[12] (eight 6-bit sc and m, packed as
  `get_scale_min_k4`), qs[128]: sub-block 2i in the low nibbles of
  qs[32i:32i+32], 2i+1 in the high nibbles.
- Q5_K: as Q4_K, then qh[32] before qs: bit i of qh[l] is the 5th bit of
  element l of sub-block i.
- Q2_K, Q3_K, Q6_K: see `_q2_k_parts`, `_q3_k_parts`, `_q6_k_parts`.
- IQ4_NL: fp16 d, qs[16] as Q4_0 (codes index kvalues_iq4nl).
- IQ4_XS: fp16 d, uint16 scales_h, scales_l[4], qs[128]: sub-block i's 6-bit ls is
  the nibble i%2 of scales_l[i//2] with bits 2i..2i+1 of scales_h on top; its 32
  codes are qs[16i:16i+16] as Q4_0's.

`to_gguf_tensor(qw, ggml_type)` is the inverse for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL and MXFP4 (an array the importer made, or any whose scales and biases have
that type's form; else ValueError). K-quants have none: a float32 scale d*sc does not
say which (fp16 d, 6-bit sc) pair it came from.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from jaxquant.io._common import CheckpointError, check_qw, logical_dtype
from jaxquant.io.gguf_file import GGUFReader
from jaxquant.io.mx_blocks import from_ggml_mxfp4, to_ggml_mxfp4
from jaxquant.quantized_array import QuantizedArray

__all__ = ["GGML_TYPES", "from_gguf", "from_gguf_tensor", "open_reader", "pack_codes", "to_gguf_tensor",
           "type_name", "unpack_codes"]

#: ggml type name -> (number, elements per block, bytes per block) (ggml.h / gguf's constants).
GGML_TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74),
    "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50), "IQ4_NL": (20, 32, 18),
    "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136),
    "IQ1_M": (29, 256, 56), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17),
}
_BY_NUMBER = {num: name for name, (num, _, _) in GGML_TYPES.items()}
_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
#: ggml type -> affine bits, for the types imported as affine group-32 arrays.
_AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
_SUPPORTED = (tuple(_FLOATS) + tuple(_AFFINE_BITS)
              + ("MXFP4", "Q3_K", "Q2_K", "Q6_K", "IQ4_NL", "IQ4_XS"))


def type_name(ggml_type) -> str:
    """A ggml type given as a name ("Q4_K"), a number (12) or an enum with .name."""
    if isinstance(ggml_type, (int, np.integer)) and not isinstance(ggml_type, bool):
        if int(ggml_type) not in _BY_NUMBER:
            raise ValueError(f"ggml_type={int(ggml_type)} is not a ggml type jaxquant knows; "
                             f"expected one of {sorted(_BY_NUMBER)}")
        return _BY_NUMBER[int(ggml_type)]
    name = getattr(ggml_type, "name", ggml_type)
    if not isinstance(name, str):
        raise TypeError(f"ggml_type must be a ggml type name (e.g. 'Q4_K') or number; got "
                        f"{type(ggml_type).__name__}")
    if name not in GGML_TYPES:
        raise ValueError(f"ggml_type={name!r} is not a ggml type jaxquant knows; expected one "
                         f"of {sorted(GGML_TYPES)}")
    return name


# ---------------------------------------------------------------------------
# Field readers on [..., nblocks, block_bytes] uint8.


def _f16(b: np.ndarray) -> np.ndarray:
    """2-byte little-endian float16 fields [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [..., 16] -> codes [..., 32]: element j low nibble of qs[j], j+16 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _qh_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Little-endian bit field bytes [..., n/8] -> bits [..., n] (bit j of the field)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :n]


def _k_scales(scales: np.ndarray):
    """The 12 packed bytes of Q4_K/Q5_K -> (sc, m) [..., 8] uint8 (get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [..., 128] -> codes [..., 8, 32]: sub-block 2i low, 2i+1 high nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _scale_pair(scale: np.ndarray, bias: np.ndarray):
    """float16 scales and biases where float16 holds both exactly, else float32."""
    s16, b16 = scale.astype(np.float16), bias.astype(np.float16)
    with np.errstate(invalid="ignore"):
        exact = (np.array_equal(s16.astype(np.float32), scale, equal_nan=True)
                 and np.array_equal(b16.astype(np.float32), bias, equal_nan=True))
    return (s16, b16) if exact else (scale.astype(np.float32), bias.astype(np.float32))


def _decode_affine(name: str, blocks: np.ndarray):
    """[..., nb, block_bytes] -> (codes [..., nb*G, 32] uint8, scales, biases [..., nb*G])
    with G = 32-element groups per block."""
    lead = blocks.shape[:-1]
    with np.errstate(over="ignore", invalid="ignore"):
        if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            has_m = name.endswith("_1")
            d = _f16(blocks[..., 0:2])
            off = 4 if has_m else 2
            if name.startswith("Q5"):
                qh = _qh_bits(blocks[..., off:off + 4], 32)
                off += 4
            codes = _nibbles(blocks[..., off:off + 16])
            if name.startswith("Q5"):
                codes = codes | (qh << 4)
            bias = _f16(blocks[..., 2:4]) if has_m else d * np.float32(-(1 << (_AFFINE_BITS[name] - 1)))
            scale, bias = _scale_pair(d, bias)
        elif name == "Q8_0":
            d = _f16(blocks[..., 0:2])
            codes = blocks[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128
            scale, bias = _scale_pair(d, d * np.float32(-128))
        else:  # Q4_K, Q5_K
            d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
            sc, mn = _k_scales(blocks[..., 4:16])
            if name == "Q4_K":
                codes = _k_low_nibbles(blocks[..., 16:144])
            else:
                qh = _qh_bits(blocks[..., 16:48], 256).reshape(*lead, 32, 8)  # [l, i]
                codes = _k_low_nibbles(blocks[..., 48:176]) | (np.swapaxes(qh, -1, -2) << 4)
            scale = d[..., None] * sc.astype(np.float32)
            bias = -(dmin[..., None] * mn.astype(np.float32))
            return (codes.reshape(*lead[:-1], -1, 32), scale.reshape(*lead[:-1], -1),
                    bias.reshape(*lead[:-1], -1))
    return codes.reshape(*lead[:-1], -1, 32), scale, bias


def _q6_k_parts(blocks: np.ndarray):
    """Q6_K [..., nb, 210] -> (codes uint8 [..., nb*16, 16] in [0, 63], float32 scale
    d*sc [..., nb*16]), as ggml's dequantize_row_q6_K: element 32g + l (g in 0..7) has
    low nibble ql[64*(g//4) + 32*(g%2) + l] >> 4*((g//2)%2) and high bits
    qh[32*(g//4) + l] >> 2*(g%4); the int8 scale of its 16-element sub-block times d
    multiplies q - 32."""
    lead = blocks.shape[:-1]
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    low = ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(*lead, 8, 32)
    high = qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (high & 0x03).reshape(*lead, 8, 32)
    codes = (low | (high << 4)).reshape(*lead[:-1], -1, 16)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = d[..., None] * sc
    return codes, scale.reshape(*lead[:-1], -1)


#: Q3_K's q in [-4, 3] (index q + 4) -> its E2M1 code: every such integer is an E2M1 value.
_E2M1_OF_INT = np.array([0b1110, 0b1101, 0b1100, 0b1010, 0b0000, 0b0010, 0b0100, 0b0101],
                        np.uint8)


def _q3_k_parts(blocks: np.ndarray):
    """Q3_K [..., nb, 110] -> (q int8 [..., nb*16, 16] in [-4, 3], float32 scale
    d * (sc - 32) [..., nb*16]), as ggml's dequantize_row_q3_K: element 32i + l has
    low bits qs[32*(i//4) + l] >> 2*(i%4), and subtracts 4 where bit i of hmask[l] is
    0; sub-block j's 6-bit sc is the nibble j%8 of scales[j%8] (high for j >= 8) with
    bits 2*(j//4)..+1 of scales[8 + j%4] on top."""
    lead = blocks.shape[:-1]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])
    low = packed[..., 0:8].reshape(*lead, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)
    high = packed[..., 8:12].reshape(*lead, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    sc = ((low & 0x0F).reshape(*lead, 16) | ((high & 0x03).reshape(*lead, 16) << 4))
    ql = (qs.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    hbit = (hmask.reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = ql.reshape(*lead, 256).astype(np.int8) - 4 * (1 - hbit.reshape(*lead, 256)).astype(np.int8)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = d[..., None] * (sc.astype(np.int8) - 32).astype(np.float32)
    return q.reshape(*lead[:-1], -1, 16), scale.reshape(*lead[:-1], -1)


def _q2_k_parts(blocks: np.ndarray):
    """Q2_K [..., nb, 84] -> (codes uint8 [..., nb*16, 16] in [0, 3], float32 scale d*sc
    and bias -(dmin*m) [..., nb*16]), as ggml's dequantize_row_q2_K: scales[16] (low
    nibble sc, high nibble m, per 16 elements), qs[64] (element 32i + l in bits
    2*(i%4) of qs[32*(i//4) + l]), fp16 d, dmin; value = (d*sc) * q - (dmin*m)."""
    lead = blocks.shape[:-1]
    scales, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    q = (qs.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    with np.errstate(over="ignore", invalid="ignore"):
        scale = d[..., None] * (scales & 0x0F).astype(np.float32)
        bias = -(dmin[..., None] * (scales >> 4).astype(np.float32))
    return (q.reshape(*lead[:-1], -1, 16), scale.reshape(*lead[:-1], -1),
            bias.reshape(*lead[:-1], -1))


def _iq4_parts(name: str, blocks: np.ndarray):
    """IQ4_NL [..., nb, 18] / IQ4_XS [..., nb, 136] -> (codes uint8 [..., nb*G, 32]
    indexing kvalues_iq4nl, scales [..., nb*G]: IQ4_NL's fp16 d as float16, IQ4_XS's
    d * (ls - 32) as float32), as ggml's dequantize_row_iq4_nl / _iq4_xs."""
    lead = blocks.shape[:-1]
    if name == "IQ4_NL":
        d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float16)
        return _nibbles(blocks[..., 2:18]).reshape(*lead[:-1], -1, 32), d.reshape(*lead[:-1], -1)
    d = _f16(blocks[..., 0:2])
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2").astype(np.uint16)  # [..., 1]
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3                       # [..., 8]
    low = blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)
    ls = (low & 0x0F).reshape(*lead, 8) | (high.astype(np.uint8) << 4)
    codes = _nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))
    with np.errstate(over="ignore", invalid="ignore"):
        scale = d[..., None] * (ls.astype(np.float32) - np.float32(32))
    return codes.reshape(*lead[:-1], -1, 32), scale.reshape(*lead[:-1], -1)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., K] (each < 2**bits) -> docs/formats.md's uint32 stream [..., K*bits/32]."""
    if bits == 8:
        packed = codes
    elif bits == 4:
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    else:
        stream = np.unpackbits(codes[..., None], axis=-1, bitorder="little")[..., :bits]
        packed = np.packbits(stream.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed.astype(np.uint8)).view("<u4").astype(np.uint32, copy=False)


def unpack_codes(data: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of pack_codes: uint32 [..., W] -> uint8 codes [..., W*32/bits]."""
    b = np.ascontiguousarray(data.astype("<u4", copy=False)).view(np.uint8)
    if bits == 8:
        return b
    if bits == 4:
        return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    stream = np.unpackbits(b, axis=-1, bitorder="little")
    stream = stream.reshape(*b.shape[:-1], -1, bits)
    return np.packbits(stream, axis=-1, bitorder="little")[..., 0]


# ---------------------------------------------------------------------------
# Import.


def _check_shape(shape, name: str):
    if (not isinstance(shape, (tuple, list)) or not shape
            or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0
                   for s in shape)):
        raise ValueError(f"shape must be the tensor's logical shape (..., N, K) as positive "
                         f"ints; got {shape!r}")
    shape = tuple(int(s) for s in shape)
    _, block, _ = GGML_TYPES[name]
    if name not in _FLOATS and (len(shape) < 2 or shape[-1] % block):
        raise ValueError(f"shape={shape} does not fit {name}: it needs (..., N, K) with K a "
                         f"multiple of its {block}-element block")
    return shape


def from_gguf_tensor(raw, ggml_type, shape, *, dtype=None):
    """One GGUF tensor's data -> QuantizedArray (numpy children) or float numpy array.

    raw: the tensor's bytes as uint8 [..., bytes per row] (what `gguf.GGUFReader`
    gives for quantized types; any shape with the right byte count is read as
    rows), or, for F32/F16/BF16, the float array itself. ggml_type: a name
    ("Q4_K"), its number, or gguf's enum. shape: the logical shape (..., N, K)
    (GGUF's dims reversed). dtype: the QuantizedArray's logical dtype (default
    bfloat16); float tensors keep their own dtype. See the module docstring for
    what each type becomes.
    """
    name = type_name(ggml_type)
    if name not in _SUPPORTED:
        # the IQ types' codebooks (non-uniform 4-bit values, lattice codebooks) and the
        # ternary TQ types have no jaxquant mode
        raise ValueError(f"ggml_type={name!r} has no jaxquant import (no mode holds its "
                         f"codes); supported: {list(_SUPPORTED)}")
    shape = _check_shape(shape, name)
    if not hasattr(raw, "shape") or not hasattr(raw, "dtype"):
        raise TypeError(f"raw must be an array (numpy or jax); got {type(raw).__name__}")
    raw = np.asarray(raw)
    _, block, nbytes = GGML_TYPES[name]
    if name in _FLOATS:
        want = np.dtype(_FLOATS[name])
        if raw.dtype == np.uint8:
            raw = np.ascontiguousarray(raw).view(want.newbyteorder("<")).astype(want, copy=False)
        if raw.dtype != want or raw.size != int(np.prod(shape)):
            raise ValueError(f"raw for {name} must be {want.name} (or its bytes) with "
                             f"{int(np.prod(shape))} elements for shape={shape}; got "
                             f"{raw.dtype} {raw.shape}")
        return raw.reshape(shape)
    if raw.dtype != np.uint8:
        raise TypeError(f"raw must be uint8 (the tensor's block bytes) for {name}; got "
                        f"{raw.dtype}")
    row = shape[-1] // block * nbytes
    if raw.size != int(np.prod(shape[:-1])) * row:
        raise ValueError(f"raw has {raw.size} bytes; shape={shape} in {name} needs "
                         f"{int(np.prod(shape[:-1]))} rows of {row} bytes")
    blocks = raw.reshape(*shape[:-1], shape[-1] // block, nbytes)
    if name == "MXFP4":
        return from_ggml_mxfp4(blocks.reshape(*shape[:-1], row), shape[-1], dtype=dtype)
    if name == "Q6_K":
        codes, scales = _q6_k_parts(blocks)
        with np.errstate(over="ignore", invalid="ignore"):
            biases = scales * np.float32(-32)
        return QuantizedArray(pack_codes(codes.reshape(*shape), 6), scales, biases,
                              mode="affine", bits=6, group_size=16, dtype=logical_dtype(dtype))
    if name == "Q2_K":
        codes, scales, biases = _q2_k_parts(blocks)
        return QuantizedArray(pack_codes(codes.reshape(*shape), 2), scales, biases,
                              mode="affine", bits=2, group_size=16, dtype=logical_dtype(dtype))
    if name == "Q3_K":
        q, scales = _q3_k_parts(blocks)
        data = pack_codes(_E2M1_OF_INT[q + 4].reshape(*shape), 4)
        return QuantizedArray(data, scales, mode="fp4", bits=4, group_size=16,
                              dtype=logical_dtype(dtype))
    if name in ("IQ4_NL", "IQ4_XS"):
        codes, scales = _iq4_parts(name, blocks)
        return QuantizedArray(pack_codes(codes.reshape(*shape), 4), scales, mode="iq4nl",
                              bits=4, group_size=32, dtype=logical_dtype(dtype))
    bits = _AFFINE_BITS[name]
    codes, scales, biases = _decode_affine(name, blocks)
    data = pack_codes(codes.reshape(*shape), bits)
    return QuantizedArray(data, scales, biases, mode="affine", bits=bits, group_size=32,
                          dtype=logical_dtype(dtype))


def open_reader(reader_or_path):
    """A path -> `jaxquant.io.gguf_file.GGUFReader` (bounded and checked: any malformed
    structure is a ValueError naming the file); a reader (ours, or `gguf.GGUFReader`)
    is returned as it is."""
    if isinstance(reader_or_path, (str, os.PathLike)):
        return GGUFReader(reader_or_path, GGML_TYPES)
    if not hasattr(reader_or_path, "tensors"):
        raise TypeError(f"reader_or_path must be a path or a GGUF reader; got "
                        f"{type(reader_or_path).__name__}")
    return reader_or_path


def from_gguf(reader_or_path, name: str, *, dtype=None):
    """The tensor `name` of a GGUF file (a path, a `jaxquant.io.gguf_file.GGUFReader` or a
    `gguf.GGUFReader`) through `from_gguf_tensor`; its logical shape is GGUF's dims
    reversed. A tensor that cannot be imported raises ValueError naming the file and it."""
    reader = open_reader(reader_or_path)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}")
    path = getattr(reader, "path", "the GGUF file")
    for t in reader.tensors:
        if t.name == name:
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            try:
                return from_gguf_tensor(t.data, int(t.tensor_type), shape, dtype=dtype)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"{path}: tensor {name!r}: {e}") from None
    near = sorted(t.name for t in reader.tensors if name.split(".")[0] in t.name)[:8]
    raise KeyError(f"{path} has no tensor {name!r} (similar: {near})")


# ---------------------------------------------------------------------------
# Export.


def _as_f16_bytes(x: np.ndarray, what: str) -> np.ndarray:
    x32 = np.asarray(x, np.float32)
    x16 = x32.astype(np.float16)
    if not np.array_equal(x16.astype(np.float32), x32, equal_nan=True):
        raise ValueError(f"{what} is not float16-representable, so it is no GGUF d/m field")
    return np.ascontiguousarray(x16[..., None]).view(np.uint8)


def to_gguf_tensor(qw: QuantizedArray, ggml_type) -> np.ndarray:
    """QuantizedArray [..., N, K] -> the GGUF block bytes uint8 [..., N, bytes per row]
    of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL or MXFP4; ValueError unless qw has that
    type's form (affine g32 of its bits, fp16 scales, and bias -2**(bits-1)*scale for
    Q4_0/Q5_0/Q8_0, fp16 biases for Q4_1/Q5_1; iq4nl with fp16 scales for IQ4_NL)."""
    name = type_name(ggml_type)
    if name == "MXFP4":
        return to_ggml_mxfp4(qw)
    if name == "IQ4_NL":
        qw = check_qw(qw, ("iq4nl",), "to_gguf_tensor")
        scales = np.asarray(qw.scales)
        codes = unpack_codes(np.asarray(qw.data), 4).reshape(*scales.shape, 32)
        d = (np.ascontiguousarray(scales[..., None]).view(np.uint8)
             if scales.dtype == np.float16 else _as_f16_bytes(scales, "qw.scales"))
        out = np.concatenate([d, codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
        return out.reshape(*scales.shape[:-1], -1)
    if name not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        raise ValueError(f"to_gguf_tensor writes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL or "
                         f"MXFP4; got ggml_type={name!r}")
    qw = check_qw(qw, ("affine",), "to_gguf_tensor")
    bits = _AFFINE_BITS[name]
    if (qw.bits, qw.group_size) != (bits, 32):
        raise ValueError(f"{name} is affine bits={bits}, group_size=32; got bits={qw.bits}, "
                         f"group_size={qw.group_size}")
    scales = np.asarray(qw.scales, np.float32)
    biases = np.asarray(qw.biases, np.float32)
    d = _as_f16_bytes(scales, "qw.scales")
    if name.endswith("_1"):
        head = [d, _as_f16_bytes(biases, "qw.biases")]
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            want = scales * np.float32(-(1 << (bits - 1)))
        if not np.array_equal(want, biases, equal_nan=True):
            raise ValueError(f"{name} needs biases = -{1 << (bits - 1)} * scales (a symmetric "
                             f"block); qw's biases differ")
        head = [d]
    codes = unpack_codes(np.asarray(qw.data), bits).reshape(*scales.shape, 32)
    if name == "Q8_0":
        payload = [codes ^ np.uint8(0x80)]
    else:
        low = codes & 0x0F
        payload = [low[..., :16] | (low[..., 16:] << 4)]
        if bits == 5:
            qh = np.packbits(codes >> 4, axis=-1, bitorder="little")
            payload.insert(0, qh)
    out = np.concatenate(head + payload, axis=-1)
    return out.reshape(*scales.shape[:-1], -1)
