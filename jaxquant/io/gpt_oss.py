"""Hugging Face gpt-oss MXFP4 (`from_gpt_oss` / `to_gpt_oss`); the layout is in
`jaxquant.io`'s docstring."""

from __future__ import annotations

import numpy as np

from jaxquant.io._common import BLOCK, bytes_to_words, check_qw, check_u8, logical_dtype, words_to_bytes
from jaxquant.quantized_array import QuantizedArray

__all__ = ["from_gpt_oss", "to_gpt_oss"]


def from_gpt_oss(blocks, scales, *, dtype=None) -> QuantizedArray:
    """gpt-oss ``*_blocks`` uint8 [..., N, G, 16] and ``*_scales`` uint8 [..., N, G]
    -> mxfp4 QuantizedArray of logical shape [..., N, G*32] (dtype: bfloat16 default)."""
    blocks = check_u8(blocks, "blocks")
    scales = check_u8(scales, "scales")
    if blocks.ndim < 3 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks must have shape [..., N, G, 16] (16 bytes = 32 fp4 values "
                         f"per block, at least 3 dimensions); got {blocks.shape}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales must have shape blocks.shape[:-1] = {blocks.shape[:-1]}; "
                         f"got {scales.shape}")
    *lead, n, g, _ = blocks.shape
    data = bytes_to_words(blocks.reshape(*lead, n, g * 16))
    return QuantizedArray(data, scales, mode="mxfp4", bits=4, group_size=BLOCK,
                          dtype=logical_dtype(dtype))


def to_gpt_oss(qw: QuantizedArray) -> tuple[np.ndarray, np.ndarray]:
    """mxfp4 QuantizedArray [..., N, K] -> (blocks uint8 [..., N, K/32, 16],
    scales uint8 [..., N, K/32])."""
    qw = check_qw(qw, ("mxfp4",), "to_gpt_oss")
    data = words_to_bytes(np.asarray(qw.data))
    scales = np.asarray(qw.scales)
    return data.reshape(*scales.shape, 16), scales
