"""Byte-block MX formats: ggml ``block_mxfp4`` (`from_ggml_mxfp4` / `to_ggml_mxfp4`)
and the scale-first 17-byte MXFP4 / 25-byte MXFP6 blocks (`from_mx_blocks` /
`to_mx_blocks`); the layouts are in `jaxquant.io`'s docstring."""

from __future__ import annotations

import numpy as np

from jaxquant import formats
from jaxquant.io._common import (BLOCK, bytes_to_words, check_qw, check_u8, logical_dtype,
                                 split_rows, words_to_bytes)
from jaxquant.quantized_array import QuantizedArray

__all__ = ["MX_BLOCK_BYTES", "from_ggml_mxfp4", "from_mx_blocks", "to_ggml_mxfp4", "to_mx_blocks"]

_GGML_BLOCK_BYTES = 17
#: mode -> bytes of one 32-element block (scale byte included) in from/to_mx_blocks.
MX_BLOCK_BYTES = {"mxfp4": 17, "mxfp6_e2m3": 25, "mxfp6_e3m2": 25}


def from_ggml_mxfp4(raw, k, *, dtype=None) -> QuantizedArray:
    """ggml ``block_mxfp4`` rows -> mxfp4 QuantizedArray [..., N, k].

    raw: uint8 [..., N, (k/32)*17] (one row of blocks per row of the matrix), or
    1-D with all rows back to back (a GGUF tensor's bytes), read as [-1, k].
    """
    raw = check_u8(raw, "raw")
    blocks = split_rows(raw, k, _GGML_BLOCK_BYTES, "raw")
    scales = np.ascontiguousarray(blocks[..., 0])
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)        # element j, j+16
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # 2j low, 2j+1 high
    data = bytes_to_words(packed.reshape(*packed.shape[:-2], -1))
    return QuantizedArray(data, scales, mode="mxfp4", bits=4, group_size=BLOCK,
                          dtype=logical_dtype(dtype))


def to_ggml_mxfp4(qw: QuantizedArray) -> np.ndarray:
    """mxfp4 QuantizedArray [..., N, K] -> ggml ``block_mxfp4`` bytes uint8 [..., N, (K/32)*17]."""
    qw = check_qw(qw, ("mxfp4",), "to_ggml_mxfp4")
    scales = np.asarray(qw.scales)
    b = words_to_bytes(np.asarray(qw.data)).reshape(*scales.shape, 16)
    codes = np.empty(b.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return out.reshape(*scales.shape[:-1], -1)


def _mx_mode(mode) -> str:
    fmt = formats.get_format(mode)
    if fmt.mode not in MX_BLOCK_BYTES:
        raise ValueError(f"mode={mode!r} has no scale-first byte-block format; expected one "
                         f"of {sorted(MX_BLOCK_BYTES)}")
    return fmt.mode


def from_mx_blocks(raw, mode, k=None, *, dtype=None) -> QuantizedArray:
    """Scale-first MX blocks -> QuantizedArray.

    raw: uint8 [..., N, nblocks*B] with B = 17 (mxfp4) or 25 (mxfp6_e2m3,
    mxfp6_e3m2); logical shape [..., N, nblocks*32]. With k (elements per row)
    given, a 1-D raw is read as rows of k elements back to back.
    """
    mode = _mx_mode(mode)
    raw = check_u8(raw, "raw")
    blocks = split_rows(raw, k, MX_BLOCK_BYTES[mode], "raw")
    scales = np.ascontiguousarray(blocks[..., 0])
    payload = blocks[..., 1:]
    if mode == "mxfp4":
        packed = ((payload << 4) | (payload >> 4)).astype(np.uint8)  # high nibble = even
    else:
        bits = np.unpackbits(payload, axis=-1, bitorder="big")       # MSB-first stream
        bits = bits.reshape(*bits.shape[:-1], BLOCK, 6)[..., ::-1]   # element LSB first
        packed = np.packbits(bits.reshape(*bits.shape[:-2], -1), axis=-1, bitorder="little")
    data = bytes_to_words(packed.reshape(*packed.shape[:-2], -1))
    fmt = formats.FORMATS[mode]
    return QuantizedArray(data, scales, mode=mode, bits=fmt.bits[0], group_size=BLOCK,
                          dtype=logical_dtype(dtype))


def to_mx_blocks(qw: QuantizedArray) -> np.ndarray:
    """mxfp4 / mxfp6 QuantizedArray [..., N, K] -> scale-first blocks uint8 [..., N, (K/32)*B]."""
    qw = check_qw(qw, tuple(MX_BLOCK_BYTES), "to_mx_blocks")
    scales = np.asarray(qw.scales)
    b = words_to_bytes(np.asarray(qw.data)).reshape(*scales.shape, qw.bits * 4)
    if qw.mode == "mxfp4":
        payload = ((b << 4) | (b >> 4)).astype(np.uint8)
    else:
        bits = np.unpackbits(b, axis=-1, bitorder="little")
        bits = bits.reshape(*bits.shape[:-1], BLOCK, 6)[..., ::-1]
        payload = np.packbits(bits.reshape(*bits.shape[:-2], -1), axis=-1, bitorder="big")
    out = np.concatenate([scales[..., None], payload], axis=-1)
    return out.reshape(*scales.shape[:-1], -1)
