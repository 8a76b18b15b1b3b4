"""dequantize as a primitive; its reference is `quantize.dequantize_reference`."""

from __future__ import annotations

import jax
from jax.interpreters import ad

from jaxquant.ops.common import batch_size, quantized_to_front, require_quantized
from jaxquant.primitive import Op
from jaxquant.quantize import check_float_dtype, dequantize_reference
from jaxquant.sharding import Dims, Factors, qw_dims


def _reference(qw, *, dtype):
    return dequantize_reference(qw, dtype=dtype)


# Sharding rules (jaxquant/sharding.py): which operand and result dimensions are
# the same logical axis, and which may split.


def dequantize_factors(qw, *, dtype):
    sizes, allowed = {"r": qw.shape[-2], "gk": qw.group_size}, {}
    lead = [f"b{i}" for i in range(qw.ndim - 2)]
    for i, f in enumerate(lead):
        sizes[f] = qw.shape[i]
    qdims = qw_dims(qw, lead, "r", "g", sizes, allowed)
    out = Dims([(f,) for f in lead] + [("r",), ("g", "gk")])
    return Factors([qdims], [out], sizes,
                   replicated=("gk", "gw"), priority=(0,), allowed=allowed)


dequantize_op = Op("dequantize", _reference, factors=dequantize_factors)


def dequantize(qw, dtype=None, *, backend: str | None = None):
    """The float values [..., N, K] of `qw`, in `dtype` (default: qw.dtype).

    Static (Python values, not traced under jax.jit): dtype, backend. Values per
    format: docs/formats.md."""
    require_quantized("qw", qw, min_ndim=1)
    dtype = check_float_dtype("dtype", qw.dtype if dtype is None else dtype)
    return dequantize_op.bind(qw, backend=backend, dtype=dtype)


def _batch(args, dims, *, backend, dtype):
    (qw,), (qw_dims,) = args, dims
    qw = quantized_to_front(qw, qw_dims, batch_size(args, dims))
    return dequantize_op.bind(qw, backend=backend, dtype=dtype), 0


def _jvp(primals, tangents, *, tree, backend, dtype):
    if any(type(t) is not ad.Zero for t in tangents):
        raise ValueError("jaxquant.dequantize has no derivative with respect to the quantized "
                         "arrays; quantized weights are constants")
    y = dequantize_op.primitive.bind(*primals, tree=tree, backend=backend, dtype=dtype)
    return y, ad.Zero(jax.core.get_aval(y).to_tangent_aval())


dequantize_op.batch_rule = _batch
ad.primitive_jvps[dequantize_op.primitive] = _jvp
