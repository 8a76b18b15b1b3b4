"""dequantize as a primitive; its reference is `quantize.dequantize_reference`."""

from __future__ import annotations

import jax
from jax.interpreters import ad

from jaxquant.ops.common import require_quantized, to_front_or_broadcast
from jaxquant.primitive import Op
from jaxquant.quantize import check_float_dtype, dequantize_reference


def _reference(qw, *, dtype):
    return dequantize_reference(qw, dtype=dtype)


dequantize_op = Op("dequantize", _reference)


def dequantize(qw, dtype=None, *, backend: str | None = None):
    """The float values [..., N, K] of `qw`, in `dtype` (default: qw.dtype)."""
    require_quantized("qw", qw, min_ndim=1)
    dtype = check_float_dtype("dtype", qw.dtype if dtype is None else dtype)
    return dequantize_op.bind(qw, backend=backend, dtype=dtype)


def _batch(args, dims, *, backend, dtype):
    (qw,), (qw_dims,) = args, dims
    if qw.global_scale is not None and qw_dims.global_scale is not None:
        return None  # a batch of global scales: vmap of the reference
    pairs = [(qw.data, qw_dims.data), (qw.scales, qw_dims.scales)]
    if qw.biases is not None:
        pairs.append((qw.biases, qw_dims.biases))
    size = next(c.shape[d] for c, d in pairs if d is not None)
    fronted = [to_front_or_broadcast(c, d, size) for c, d in pairs]
    if qw.global_scale is not None:
        fronted.append(qw.global_scale)
    qw = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(qw), fronted)
    return dequantize_op.bind(qw, backend=backend, dtype=dtype), 0


def _jvp(primals, tangents, *, tree, backend, dtype):
    if any(type(t) is not ad.Zero for t in tangents):
        raise ValueError("jaxquant.dequantize has no derivative with respect to the quantized "
                         "arrays; quantized weights are constants")
    y = dequantize_op.primitive.bind(*primals, tree=tree, backend=backend, dtype=dtype)
    return y, ad.Zero(jax.core.get_aval(y).to_tangent_aval())


dequantize_op.batch_rule = _batch
ad.primitive_jvps[dequantize_op.primitive] = _jvp
