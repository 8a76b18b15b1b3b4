"""Helpers shared by the importers of jaxquant.io: argument checks and byte <-> word views."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxquant.layouts import unpack_layout
from jaxquant.quantize import check_float_dtype
from jaxquant.quantized_array import QuantizedArray

#: Elements per MX / ggml MXFP4 block.
BLOCK = 32


class CheckpointError(ValueError):
    """A checkpoint file is malformed, inconsistent or out of bounds. The message starts
    with the file's path and names the field or tensor (docs/checkpoints.md,
    "Validation"); the command line prints it as one line."""


def host_array(x, name: str) -> np.ndarray:
    """numpy view of an array argument (jax arrays are copied to the host)."""
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (numpy or jax); got {type(x).__name__}")
    return np.asarray(x)


def check_u8(x, name: str) -> np.ndarray:
    x = host_array(x, name)
    if x.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8; got {x.dtype}")
    return x


def bytes_to_words(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 4n] -> uint32 [..., n], little-endian (a view when possible)."""
    return np.ascontiguousarray(b).view("<u4").astype(np.uint32, copy=False)


def words_to_bytes(w: np.ndarray) -> np.ndarray:
    """uint32 [..., n] -> uint8 [..., 4n], little-endian."""
    return np.ascontiguousarray(w.astype("<u4", copy=False)).view(np.uint8)


def logical_dtype(dtype):
    return check_float_dtype("dtype", jnp.bfloat16 if dtype is None else dtype)


def canonical(qw) -> QuantizedArray:
    """qw in the canonical layout, what files hold: a kernel layout (what jq.quantize
    gives on a GPU) is a permutation of the exchange layout's bits, unpacked here;
    TypeError if qw is not a QuantizedArray."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    return unpack_layout(qw)


def check_qw(qw, modes, fn: str) -> QuantizedArray:
    """qw, canonical, for exporter `fn` of `modes`."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    if qw.mode not in modes:
        raise ValueError(f"{fn} exports mode {' or '.join(map(repr, modes))}; got qw.mode="
                         f"{qw.mode!r}")
    return canonical(qw)


def split_rows(raw: np.ndarray, k, block_bytes: int, name: str) -> np.ndarray:
    """raw uint8 [..., N, row_bytes] (or 1-D: rows of k back to back)
    -> [..., N, nblocks, block_bytes]."""
    if k is None:
        if raw.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions [..., N, nblocks*"
                             f"{block_bytes}] when k is not given; got shape {raw.shape}")
        if raw.shape[-1] % block_bytes or raw.shape[-1] == 0:
            raise ValueError(f"{name}'s last axis ({raw.shape[-1]} bytes) must be a positive "
                             f"multiple of the {block_bytes}-byte block")
        nb = raw.shape[-1] // block_bytes
    else:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0 or k % BLOCK:
            raise ValueError(f"k={k!r} (elements per row) must be a positive multiple of "
                             f"{BLOCK}")
        nb = int(k) // BLOCK
        row = nb * block_bytes
        if raw.ndim == 1:
            if raw.size % row:
                raise ValueError(f"{name} has {raw.size} bytes, not a whole number of rows "
                                 f"of {row} bytes (k={k})")
            raw = raw.reshape(-1, row)
        elif raw.shape[-1] != row:
            raise ValueError(f"{name}'s last axis must be {row} bytes ({nb} blocks of "
                             f"{block_bytes} for k={k}); got shape {raw.shape}")
    return raw.reshape(*raw.shape[:-1], nb, block_bytes)
