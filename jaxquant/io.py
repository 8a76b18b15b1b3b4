"""Importers and exporters for quantized weights stored by other tools.

Every conversion is an exact bit permutation done with numpy (vectorized, no
loop over blocks): ``export(import(x))`` gives back ``x`` bit for bit, and
``import(export(qw))`` gives back qw's arrays. Importers return a
QuantizedArray whose children are numpy arrays (zero-copy views where the
layouts agree); ``jax.device_put(qw)`` moves it to a device.

jaxquant's side is docs/formats.md's exchange layout: ``data`` uint32
[..., N, K*bits/32], a little-endian bit stream along K (element k at bits
[k*bits, (k+1)*bits)), ``scales`` [..., N, K/group].

Formats:

- MLX safetensors (`from_mlx_tensors` / `to_mlx_tensors`): ``{prefix}.weight``
  (uint32, already jaxquant's packing), ``{prefix}.scales``, ``{prefix}.biases``
  (affine only). Mode names are MLX's (``"mxfp8"`` is E4M3).
- Hugging Face gpt-oss MXFP4 (`from_gpt_oss` / `to_gpt_oss`): ``*_blocks``
  uint8 [..., N, G, 16] and ``*_scales`` uint8 [..., N, G], 32 E2M1 elements
  per block, element 2j in the low nibble of byte j, element 2j+1 in the high
  nibble; the scale is OCP E8M0 (value 2**(s-127)). The last two axes of
  ``blocks`` are K in blocks of 32, so e.g. ``gate_up_proj_blocks``
  [E, 2*I, H/32, 16] is the expert weight [E, N=2*I, K=H] (transformers'
  ``convert_moe_packed_tensors`` decodes it to [E, 2*I, H] and then transposes
  to its [E, in, out] parameter), ``down_proj_blocks`` [E, H, I/32, 16] is
  [E, N=H, K=I]. A byte view of ``data`` is exactly this layout.
- ggml ``block_mxfp4`` (`from_ggml_mxfp4` / `to_ggml_mxfp4`): 17-byte blocks,
  byte 0 the scale ``e``, bytes 1..16 ``qs``; element j (0..15) in the low
  nibble of ``qs[j]``, element j+16 in the high nibble. ggml decodes
  ``kvalues_mxfp4[nibble] * GGML_E8M0_TO_FP32_HALF(e)`` where
  ``kvalues_mxfp4 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ...}`` is twice E2M1 and
  ``GGML_E8M0_TO_FP32_HALF(e) = 2**(e-128)`` (e >= 2: float bits (e-1) << 23;
  e = 1: 2**-127; e = 0: 2**-128). The product is ``e2m1 * 2**(e-127)``: the
  stored byte *is* the OCP E8M0 code (ggml's quantizer writes
  ``floor(log2(amax)) - 2 + 127``), so it is copied unchanged. Only e = 255
  differs: ggml reads it as the finite 2**128, OCP and jaxquant as NaN.
- 17-byte MXFP4 / 25-byte MXFP6 blocks (`from_mx_blocks` / `to_mx_blocks`):
  byte 0 the OCP E8M0 scale (unsigned: 2**(e-127), 255 = NaN); MXFP4: 16 bytes,
  element 2j in the *high* nibble of byte j, element 2j+1 in the low nibble;
  MXFP6 (E2M3 or E3M2): 24 bytes holding the 32 6-bit codes as a big-endian
  bit stream, most significant bit first: byte 0 = [E0 bits 5..0][E1 bits 5..4],
  byte 1 = [E1 bits 3..0][E2 bits 5..2], byte 2 = [E2 bits 1..0][E3 bits 5..0], ...
- GPTQ, AWQ and compressed-tensors (`from_gptq` / `to_gptq`, `from_awq` / `to_awq`,
  `from_compressed_tensors` / `to_compressed_tensors`): jaxquant/io_hf.py and docs/checkpoints.md.
- `load_safetensors` / `save_safetensors`: numpy dicts through the optional
  ``safetensors`` package (``pip install safetensors``, or ``jaxquant[safetensors]``).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jaxquant import formats
from jaxquant.io_hf import (from_awq, from_compressed_tensors, from_gptq, to_awq,
                             to_compressed_tensors, to_gptq, host_array as _host)
from jaxquant.quantize import check_float_dtype
from jaxquant.quantized_array import CANONICAL, QuantizedArray

__all__ = [
    "from_awq", "from_compressed_tensors", "from_ggml_mxfp4", "from_gpt_oss", "from_gptq",
    "from_mlx_tensors", "from_mx_blocks", "load_safetensors", "save_safetensors", "to_awq",
    "to_compressed_tensors", "to_ggml_mxfp4", "to_gpt_oss", "to_gptq", "to_mlx_tensors",
    "to_mx_blocks",
]

_BLOCK = 32
_GGML_BLOCK_BYTES = 17
#: mode -> bytes of one 32-element block (scale byte included) in from/to_mx_blocks.
MX_BLOCK_BYTES = {"mxfp4": 17, "mxfp6_e2m3": 25, "mxfp6_e3m2": 25}


# ---------------------------------------------------------------------------
# Helpers.


def _check_u8(x, name: str) -> np.ndarray:
    x = _host(x, name)
    if x.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8; got {x.dtype}")
    return x


def _bytes_to_words(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 4n] -> uint32 [..., n], little-endian (a view when possible)."""
    return np.ascontiguousarray(b).view("<u4").astype(np.uint32, copy=False)


def _words_to_bytes(w: np.ndarray) -> np.ndarray:
    """uint32 [..., n] -> uint8 [..., 4n], little-endian."""
    return np.ascontiguousarray(w.astype("<u4", copy=False)).view(np.uint8)


def _logical_dtype(dtype):
    return check_float_dtype("dtype", jnp.bfloat16 if dtype is None else dtype)


def _check_qw(qw, modes, fn: str) -> QuantizedArray:
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    if qw.layout != CANONICAL:
        raise ValueError(f"qw must be in the canonical layout; got layout={qw.layout!r}: "
                         f"undo it with jq.unpack_layout before {fn}")
    if qw.mode not in modes:
        raise ValueError(f"{fn} exports mode {' or '.join(map(repr, modes))}; got qw.mode="
                         f"{qw.mode!r}")
    return qw


def _split_rows(raw: np.ndarray, k, block_bytes: int, name: str) -> np.ndarray:
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
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0 or k % _BLOCK:
            raise ValueError(f"k={k!r} (elements per row) must be a positive multiple of "
                             f"{_BLOCK}")
        nb = int(k) // _BLOCK
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


# ---------------------------------------------------------------------------
# safetensors


def _safetensors_numpy():
    try:
        import safetensors.numpy as stn
    except ImportError as e:
        raise ImportError(
            "reading or writing .safetensors files needs the optional 'safetensors' "
            "package: pip install safetensors (or pip install 'jaxquant[safetensors]')") from e
    return stn


def load_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bfloat16 via ml_dtypes)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    stn = _safetensors_numpy()
    return dict(stn.load_file(os.fspath(path)))


def save_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write a dict of arrays (numpy or jax) to a .safetensors file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> array; got {type(tensors).__name__}")
    stn = _safetensors_numpy()
    arrays = {str(k): np.ascontiguousarray(_host(v, f"tensors[{k!r}]")) for k, v in tensors.items()}
    stn.save_file(arrays, os.fspath(path), metadata=metadata)


# ---------------------------------------------------------------------------
# MLX


def from_mlx_tensors(tensors: dict, prefix: str, *, bits, group_size, mode="affine",
                     dtype=None) -> QuantizedArray:
    """``{prefix}.weight`` / ``.scales`` / ``.biases`` (MLX's nn.QuantizedLinear,
    QuantizedEmbedding, SwitchLinear) -> QuantizedArray.

    bits / group_size / mode: the model's quantization config (MLX's mode names).
    dtype: logical dtype (default: the scales' dtype for affine, else bfloat16).
    """
    from jaxquant.mlx import from_mlx

    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> array; got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    fmt, bits, group_size = formats.resolve(mode, bits, group_size)
    for part in ("weight", "scales"):
        if f"{prefix}.{part}" not in tensors:
            near = sorted(k for k in tensors if k.startswith(prefix))
            raise ValueError(f"tensors has no {prefix}.{part} (prefix={prefix!r}); keys "
                             f"starting with it: {near}")
    biases = tensors.get(f"{prefix}.biases")
    if fmt.has_biases and biases is None:
        raise ValueError(f"mode={mode!r} needs {prefix}.biases, which tensors lacks")
    if not fmt.has_biases and biases is not None:
        raise ValueError(f"tensors has {prefix}.biases, but mode={mode!r} has no biases "
                         f"(an affine checkpoint read with the wrong mode?)")
    w = _host(tensors[f"{prefix}.weight"], f"tensors[{prefix + '.weight'!r}]")
    if w.dtype != np.uint32:
        raise TypeError(f"tensors[{prefix + '.weight'!r}] must be uint32 (MLX's packed weight); "
                        f"got {w.dtype}")
    s = _host(tensors[f"{prefix}.scales"], f"tensors[{prefix + '.scales'!r}]")
    b = None if biases is None else _host(biases, f"tensors[{prefix + '.biases'!r}]")
    return from_mlx(w, s, b, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


def to_mlx_tensors(qw: QuantizedArray, prefix: str) -> dict[str, np.ndarray]:
    """QuantizedArray -> ``{prefix}.weight``, ``{prefix}.scales`` (and ``.biases``
    for affine) as numpy arrays, as MLX saves them.

    MLX's layers have no nvfp4 global scale: an nvfp4 array with one other than
    1.0 is refused (ValueError).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    qw = _check_qw(qw, tuple(formats.FORMATS), "to_mlx_tensors")
    if qw.global_scale is not None and not np.all(np.asarray(qw.global_scale) == 1):
        raise ValueError(
            f"qw.global_scale={np.asarray(qw.global_scale)!r}: MLX's quantized layers store "
            f"no nvfp4 global scale, so this array cannot be saved for MLX")
    out = {f"{prefix}.weight": np.asarray(qw.data), f"{prefix}.scales": np.asarray(qw.scales)}
    if qw.biases is not None:
        out[f"{prefix}.biases"] = np.asarray(qw.biases)
    return out


# ---------------------------------------------------------------------------
# Hugging Face gpt-oss


def from_gpt_oss(blocks, scales, *, dtype=None) -> QuantizedArray:
    """gpt-oss ``*_blocks`` uint8 [..., N, G, 16] and ``*_scales`` uint8 [..., N, G]
    -> mxfp4 QuantizedArray of logical shape [..., N, G*32] (dtype: bfloat16 default)."""
    blocks = _check_u8(blocks, "blocks")
    scales = _check_u8(scales, "scales")
    if blocks.ndim < 3 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks must have shape [..., N, G, 16] (16 bytes = 32 fp4 values "
                         f"per block, at least 3 dimensions); got {blocks.shape}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales must have shape blocks.shape[:-1] = {blocks.shape[:-1]}; "
                         f"got {scales.shape}")
    *lead, n, g, _ = blocks.shape
    data = _bytes_to_words(blocks.reshape(*lead, n, g * 16))
    return QuantizedArray(data, scales, mode="mxfp4", bits=4, group_size=_BLOCK,
                          dtype=_logical_dtype(dtype))


def to_gpt_oss(qw: QuantizedArray) -> tuple[np.ndarray, np.ndarray]:
    """mxfp4 QuantizedArray [..., N, K] -> (blocks uint8 [..., N, K/32, 16],
    scales uint8 [..., N, K/32])."""
    qw = _check_qw(qw, ("mxfp4",), "to_gpt_oss")
    data = _words_to_bytes(np.asarray(qw.data))
    scales = np.asarray(qw.scales)
    return data.reshape(*scales.shape, 16), scales


# ---------------------------------------------------------------------------
# ggml block_mxfp4


def from_ggml_mxfp4(raw, k, *, dtype=None) -> QuantizedArray:
    """ggml ``block_mxfp4`` rows -> mxfp4 QuantizedArray [..., N, k].

    raw: uint8 [..., N, (k/32)*17] (one row of blocks per row of the matrix), or
    1-D with all rows back to back (a GGUF tensor's bytes), read as [-1, k].
    """
    raw = _check_u8(raw, "raw")
    blocks = _split_rows(raw, k, _GGML_BLOCK_BYTES, "raw")
    scales = np.ascontiguousarray(blocks[..., 0])
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)        # element j, j+16
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # 2j low, 2j+1 high
    data = _bytes_to_words(packed.reshape(*packed.shape[:-2], -1))
    return QuantizedArray(data, scales, mode="mxfp4", bits=4, group_size=_BLOCK,
                          dtype=_logical_dtype(dtype))


def to_ggml_mxfp4(qw: QuantizedArray) -> np.ndarray:
    """mxfp4 QuantizedArray [..., N, K] -> ggml ``block_mxfp4`` bytes uint8 [..., N, (K/32)*17]."""
    qw = _check_qw(qw, ("mxfp4",), "to_ggml_mxfp4")
    scales = np.asarray(qw.scales)
    b = _words_to_bytes(np.asarray(qw.data)).reshape(*scales.shape, 16)
    codes = np.empty(b.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return out.reshape(*scales.shape[:-1], -1)


# ---------------------------------------------------------------------------
# 17-byte MXFP4 / 25-byte MXFP6 blocks


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
    raw = _check_u8(raw, "raw")
    blocks = _split_rows(raw, k, MX_BLOCK_BYTES[mode], "raw")
    scales = np.ascontiguousarray(blocks[..., 0])
    payload = blocks[..., 1:]
    if mode == "mxfp4":
        packed = ((payload << 4) | (payload >> 4)).astype(np.uint8)  # high nibble = even
    else:
        bits = np.unpackbits(payload, axis=-1, bitorder="big")       # MSB-first stream
        bits = bits.reshape(*bits.shape[:-1], _BLOCK, 6)[..., ::-1]   # element LSB first
        packed = np.packbits(bits.reshape(*bits.shape[:-2], -1), axis=-1, bitorder="little")
    data = _bytes_to_words(packed.reshape(*packed.shape[:-2], -1))
    fmt = formats.FORMATS[mode]
    return QuantizedArray(data, scales, mode=mode, bits=fmt.bits[0], group_size=_BLOCK,
                          dtype=_logical_dtype(dtype))


def to_mx_blocks(qw: QuantizedArray) -> np.ndarray:
    """mxfp4 / mxfp6 QuantizedArray [..., N, K] -> scale-first blocks uint8 [..., N, (K/32)*B]."""
    qw = _check_qw(qw, tuple(MX_BLOCK_BYTES), "to_mx_blocks")
    scales = np.asarray(qw.scales)
    b = _words_to_bytes(np.asarray(qw.data)).reshape(*scales.shape, qw.bits * 4)
    if qw.mode == "mxfp4":
        payload = ((b << 4) | (b >> 4)).astype(np.uint8)
    else:
        bits = np.unpackbits(b, axis=-1, bitorder="little")
        bits = bits.reshape(*bits.shape[:-1], _BLOCK, 6)[..., ::-1]
        payload = np.packbits(bits.reshape(*bits.shape[:-2], -1), axis=-1, bitorder="big")
    out = np.concatenate([scales[..., None], payload], axis=-1)
    return out.reshape(*scales.shape[:-1], -1)


# GGUF (llama.cpp): its own module, imported last (it builds on the helpers above).
from jaxquant.io_gguf import from_gguf, from_gguf_tensor, to_gguf_tensor  # noqa: E402

__all__ += ["from_gguf", "from_gguf_tensor", "to_gguf_tensor"]
