"""jaxquant: low-bit quantized weights for JAX (docs/README.md)."""

from jaxquant import formats, io, layouts, mlx
from jaxquant.dispatch import available_backends, backend
from jaxquant.formats import FORMATS
from jaxquant.layouts import prepack, unpack_layout
from jaxquant.ops import (RowQuantizedArray, add_rms_norm, decode_attention, dequantize,
                          gated_rms_norm, gather_matmul, gather_qmm, gather_qmm_swiglu, qmm,
                          qmm_a8, qmm_add, qmm_swiglu, quantize_rows, ragged_matmul, ragged_qmm,
                          rms_norm, rms_norm_qmm, rms_norm_qmm_swiglu)
from jaxquant.quantize import quantize
from jaxquant.quantized_array import QuantizedArray

__all__ = [
    "FORMATS", "QuantizedArray", "RowQuantizedArray", "add_rms_norm", "available_backends", "backend",
    "decode_attention", "dequantize", "formats", "gated_rms_norm", "io", "layouts", "mlx",
    "gather_matmul", "gather_qmm", "gather_qmm_swiglu", "prepack", "qmm", "qmm_a8", "qmm_add", "qmm_swiglu", "quantize",
    "quantize_rows", "ragged_matmul", "ragged_qmm", "rms_norm", "rms_norm_qmm", "rms_norm_qmm_swiglu", "unpack_layout",
]
__version__ = "0.2.0"


def _load_backends():
    """Import the backend packages: each registers its kernels with
    jaxquant.dispatch. One that cannot load only removes that backend;
    `available_backends()` and `python -m jaxquant` say why."""
    import importlib
    import importlib.util
    import warnings

    from jaxquant import dispatch

    for name in dispatch.BACKENDS:
        if name == "reference" or importlib.util.find_spec(f"jaxquant.{name}") is None:
            continue  # the reference is jaxquant.ops; a package absent from this build
        try:
            importlib.import_module(f"jaxquant.{name}")
        except Exception as e:  # noqa: BLE001 - a broken backend must not break import
            reason = f"import of jaxquant.{name} failed: {type(e).__name__}: {e}"
            dispatch.register_backend(name, lambda reason=reason: reason)
            warnings.warn(f"jaxquant: the {name!r} backend is unavailable ({reason})",
                          RuntimeWarning, stacklevel=2)


_load_backends()
