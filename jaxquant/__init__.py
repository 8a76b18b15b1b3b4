"""jaxquant: low-bit quantized weights for JAX (DESIGN.md)."""

from jaxquant import formats
from jaxquant.formats import FORMATS
from jaxquant.quantize import quantize, dequantize_reference as dequantize
from jaxquant.quantized_array import QuantizedArray

__all__ = ["FORMATS", "QuantizedArray", "dequantize", "formats", "quantize"]
__version__ = "0.1.0"
