"""jaxquant: low-bit quantized weights for JAX (DESIGN.md)."""

from jaxquant import formats, io, mlx
from jaxquant.dispatch import available_backends, backend
from jaxquant.formats import FORMATS
from jaxquant.ops import (add_rms_norm, dequantize, gated_rms_norm, gather_qmm, qmm, ragged_qmm,
                          rms_norm)
from jaxquant.quantize import quantize
from jaxquant.quantized_array import QuantizedArray

__all__ = [
    "FORMATS", "QuantizedArray", "add_rms_norm", "available_backends", "backend", "dequantize",
    "formats", "gated_rms_norm", "io", "mlx", "gather_qmm", "qmm", "quantize", "ragged_qmm", "rms_norm",
]
__version__ = "0.1.0"
