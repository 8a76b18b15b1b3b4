"""`load_safetensors` / `save_safetensors`: numpy dicts through the optional
``safetensors`` package (``pip install safetensors``, or ``jaxquant[safetensors]``)."""

from __future__ import annotations

import os

import numpy as np

from jaxquant.io._common import host_array

__all__ = ["load_safetensors", "save_safetensors"]


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
    arrays = {str(k): np.ascontiguousarray(host_array(v, f"tensors[{k!r}]")) for k, v in tensors.items()}
    stn.save_file(arrays, os.fspath(path), metadata=metadata)
