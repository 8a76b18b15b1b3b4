"""MLX safetensors (`from_mlx_tensors` / `to_mlx_tensors`): ``{prefix}.weight``
(uint32, already jaxquant's packing), ``{prefix}.scales``, ``{prefix}.biases``
(affine only). Mode names are MLX's (``"mxfp8"`` is E4M3)."""

from __future__ import annotations

import numpy as np

from jaxquant import formats
from jaxquant.io._common import check_qw, host_array
from jaxquant.quantized_array import QuantizedArray

__all__ = ["from_mlx_tensors", "to_mlx_tensors"]


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
    w = host_array(tensors[f"{prefix}.weight"], f"tensors[{prefix + '.weight'!r}]")
    if w.dtype != np.uint32:
        raise TypeError(f"tensors[{prefix + '.weight'!r}] must be uint32 (MLX's packed weight); "
                        f"got {w.dtype}")
    s = host_array(tensors[f"{prefix}.scales"], f"tensors[{prefix + '.scales'!r}]")
    b = None if biases is None else host_array(biases, f"tensors[{prefix + '.biases'!r}]")
    return from_mlx(w, s, b, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


def to_mlx_tensors(qw: QuantizedArray, prefix: str) -> dict[str, np.ndarray]:
    """QuantizedArray -> ``{prefix}.weight``, ``{prefix}.scales`` (and ``.biases``
    for affine) as numpy arrays, as MLX saves them.

    MLX's layers have no nvfp4 global scale: an nvfp4 array with one other than
    1.0 is refused (ValueError).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    qw = check_qw(qw, tuple(formats.FORMATS), "to_mlx_tensors")
    if qw.global_scale is not None and not np.all(np.asarray(qw.global_scale) == 1):
        raise ValueError(
            f"qw.global_scale={np.asarray(qw.global_scale)!r}: MLX's quantized layers store "
            f"no nvfp4 global scale, so this array cannot be saved for MLX")
    out = {f"{prefix}.weight": np.asarray(qw.data), f"{prefix}.scales": np.asarray(qw.scales)}
    if qw.biases is not None:
        out[f"{prefix}.biases"] = np.asarray(qw.biases)
    return out
