"""The ops: one primitive each (docs/ops.md)."""

from jaxquant.ops.a8 import RowQuantizedArray, qmm_a8, quantize_rows
from jaxquant.ops.attention import decode_attention
from jaxquant.ops.dequantize import dequantize
from jaxquant.ops.fused import (gather_qmm_swiglu, qmm_add, qmm_swiglu, rms_norm_qmm,
                                rms_norm_qmm_swiglu)
from jaxquant.ops.norms import add_rms_norm, gated_rms_norm, rms_norm
from jaxquant.ops.qmm import gather_matmul, gather_qmm, qmm, ragged_matmul, ragged_qmm

__all__ = ["RowQuantizedArray", "add_rms_norm", "decode_attention", "dequantize", "gated_rms_norm", "gather_matmul",
           "gather_qmm", "gather_qmm_swiglu", "qmm", "qmm_a8", "qmm_add", "qmm_swiglu", "quantize_rows", "ragged_matmul",
           "ragged_qmm", "rms_norm", "rms_norm_qmm", "rms_norm_qmm_swiglu"]
