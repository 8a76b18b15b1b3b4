"""The metal backend's lowerings: the op signatures, calling the bridge's FFI targets.

Served (the reference serves the rest, see `applies`): formats affine 4-bit, mxfp4 and
fp4 in the canonical layout, K a multiple of 32, float scales in x's dtype; x, norms in
float32/float16/bfloat16. qmm with x @ W.T: the GEMV up to configs.METAL_GEMV_MAX_M rows
of x per weight matrix, the GEMM above; gather_qmm with x @ W.T: the GEMV per slot, expert ids
read on the GPU (ids outside [0, E) give NaN rows). dequantize. The three norms, the
weight in the output's dtype.

Every function takes the dispatcher's `platform`, always "cpu" here: the bridge's
handlers are registered on JAX's CPU platform (the GPU work happens inside them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import dispatch
from jaxquant.metal import configs
from jaxquant.quantized_array import CANONICAL, QuantizedArray

FORMAT_IDS = {"affine4": 0, "mxfp4": 1, "fp4": 2}  # metal_src/jq_metal.h Format
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _format(qw: QuantizedArray) -> str | None:
    if qw.mode == "affine" and qw.bits == 4:
        return "affine4"
    return qw.mode if qw.mode in ("mxfp4", "fp4") else None


def _empty(dtype=jnp.float32):
    return jnp.zeros((0,), dtype)


def _attrs(qw):
    return dict(fmt=np.int64(FORMAT_IDS[_format(qw)]), group_size=np.int64(qw.group_size))


def _biases(qw):
    return qw.biases if qw.biases is not None else _empty(qw.scales.dtype)


def dequantize_call(qw: QuantizedArray, dtype):
    out = jax.ShapeDtypeStruct(qw.shape, jnp.dtype(dtype))
    return jax.ffi.ffi_call("jaxquant_metal_dequantize", out, vmap_method="broadcast_all")(
        qw.data, qw.scales, _biases(qw), **_attrs(qw))


def qmv_call(x3, qw3: QuantizedArray, indices=None):
    """x3 [Sx, M, K], qw3 [E, N, K], indices int32 [S] or None (S = E) -> [S, M, N];
    slot s reads x3[s // (S // Sx)]."""
    e, n, _ = qw3.shape
    s = indices.shape[0] if indices is not None else e
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n), x3.dtype)
    idx = indices if indices is not None else _empty(jnp.int32)
    return jax.ffi.ffi_call("jaxquant_metal_qmv", out, vmap_method="sequential")(
        x3, qw3.data, qw3.scales, _biases(qw3), idx, **_attrs(qw3))


def qmm_call(x3, qw3: QuantizedArray):
    """The GEMM: x3 [B, M, K] @ qw3[b].T -> [B, M, N]."""
    b, n, _ = qw3.shape
    out = jax.ShapeDtypeStruct((b, x3.shape[1], n), x3.dtype)
    return jax.ffi.ffi_call("jaxquant_metal_qmm", out, vmap_method="sequential")(
        x3, qw3.data, qw3.scales, _biases(qw3), **_attrs(qw3))


def _norm_attrs(eps, weight_offset):
    return dict(eps=np.float32(eps), weight_offset=np.float32(weight_offset))


def rms_norm_impl(x, weight, *, eps, weight_offset, platform="cpu"):
    w = weight if weight is not None else _empty(x.dtype)
    return jax.ffi.ffi_call("jaxquant_metal_rms_norm", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            vmap_method="broadcast_all")(x, w, **_norm_attrs(eps, weight_offset))


def add_rms_norm_impl(x, residual, weight, *, eps, weight_offset, platform="cpu"):
    w = weight if weight is not None else _empty(residual.dtype)
    out = jax.ShapeDtypeStruct(x.shape, residual.dtype)
    y, h = jax.ffi.ffi_call("jaxquant_metal_add_rms_norm", (out, out),
                            vmap_method="broadcast_all")(x, residual, w,
                                                         **_norm_attrs(eps, weight_offset))
    return [y, h]


def gated_rms_norm_impl(x, gate, weight, *, eps, weight_offset, activation, norm_before_gate,
                        group_size, platform="cpu"):
    w = weight if weight is not None else _empty(gate.dtype)
    return jax.ffi.ffi_call("jaxquant_metal_gated_rms_norm",
                            jax.ShapeDtypeStruct(x.shape, gate.dtype),
                            vmap_method="broadcast_all")(
        x, gate, w, **_norm_attrs(eps, weight_offset),
        activation=np.int64({"silu": 0, "sigmoid": 1}[activation]),
        norm_before_gate=np.int64(bool(norm_before_gate)), group_size=np.int64(group_size or 0))


# ---------------------------------------------------------------------------
# applies


def _float(*avals):
    return all(a is None or jnp.dtype(a.dtype) in _DTYPES for a in avals)


def _qw_ok(qw, value_dtype):
    """A format the kernels decode, with float scales (and biases) in value_dtype."""
    if not isinstance(qw, QuantizedArray) or qw.layout != CANONICAL or _format(qw) is None:
        return False
    k = qw.shape[-1]
    if k == 0 or k % 32 or qw.global_scale is not None or math.prod(qw.shape) == 0:
        return False
    if qw.mode == "affine" and qw.group_size < 32:  # the GEMV takes affine groups >= 32
        return False
    if qw.mode == "mxfp4":
        return qw.scales.dtype == jnp.uint8
    same = lambda a: a is None or jnp.dtype(a.dtype) == jnp.dtype(value_dtype)
    return same(qw.scales) and same(qw.biases)


def dequantize_applies(qw, *, dtype, platform="cpu"):
    return jnp.dtype(dtype) in _DTYPES and _qw_ok(qw, dtype)


def qmm_applies(x, qw, *, transpose, precision, platform="cpu"):
    return transpose and _float(x) and _qw_ok(qw, x.dtype) and math.prod(x.shape) > 0


def gather_qmm_applies(x, qw, indices, *, transpose, precision, platform="cpu"):
    return transpose and _float(x) and _qw_ok(qw, x.dtype) and math.prod(x.shape) > 0


def _weight_ok(weight, dtype):
    return weight is None or jnp.dtype(weight.dtype) == jnp.dtype(dtype)


def rms_norm_applies(x, weight, *, eps, weight_offset, platform="cpu"):
    return _float(x) and _weight_ok(weight, x.dtype) and x.shape[-1] > 0


def add_rms_norm_applies(x, residual, weight, *, eps, weight_offset, platform="cpu"):
    return _float(x, residual) and _weight_ok(weight, residual.dtype) and x.shape[-1] > 0


def gated_rms_norm_applies(x, gate, weight, *, eps, weight_offset, activation, norm_before_gate,
                           group_size, platform="cpu"):
    return _float(x, gate) and _weight_ok(weight, gate.dtype) and x.shape[-1] > 0


# ---------------------------------------------------------------------------
# impls


def qmm_impl(x, qw, *, transpose, precision, platform="cpu"):
    nb = qw.ndim - 2
    k, n = x.shape[-1], qw.shape[-2]
    m = math.prod(x.shape[nb:-1])
    b = math.prod(qw.shape[:nb])
    x3, qw3 = x.reshape(b, m, k), qw.flatten_leading(nb)
    y = qmv_call(x3, qw3) if m <= configs.METAL_GEMV_MAX_M else qmm_call(x3, qw3)
    return y.reshape(*x.shape[:-1], n)


def gather_qmm_impl(x, qw, indices, *, transpose, precision, platform="cpu"):
    t, slots = indices.shape
    x3 = x.reshape(t * slots if x.ndim == 3 else t, 1, x.shape[-1])
    # ids outside [0, E) become -1 before the int32 cast (an int64 id must not wrap into
    # range); the kernel writes NaN rows for them
    valid = (indices >= 0) & (indices < qw.shape[0])
    ids = jnp.where(valid, indices, -1).astype(jnp.int32).reshape(-1)
    y = qmv_call(x3, qw, ids)
    return y.reshape(t, slots, qw.shape[1])


def dequantize_impl(qw, *, dtype, platform="cpu"):
    return dequantize_call(qw, dtype)


def _never(*args, **params):
    return False


def register_kernels():
    for name, impl, applies in [
        ("qmm", qmm_impl, qmm_applies),
        ("gather_qmm", gather_qmm_impl, gather_qmm_applies),
        ("dequantize", dequantize_impl, dequantize_applies),
        ("rms_norm", rms_norm_impl, rms_norm_applies),
        ("add_rms_norm", add_rms_norm_impl, add_rms_norm_applies),
        ("gated_rms_norm", gated_rms_norm_impl, gated_rms_norm_applies),
        ("ragged_qmm", _never, _never),  # no kernel: backend="metal" gets the reference
    ]:
        dispatch.register(name, "metal", ("cpu",), impl, applies, priority=dispatch.PRIORITY["metal"], auto=_never)
