"""The ffi backend's lowerings: jnp-traceable functions with each op's signature
that call the compiled handlers through `jax.ffi.ffi_call`.

Kernel choice lives here, as data (`GEMV_MAX_M`, `PRIORITY`): the fused
dequantize-GEMV for qmm with few rows of x per weight matrix and for every
gather_qmm slot; the ffi dequantize followed by XLA's dot for the rest.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.quantized_array import CANONICAL, QuantizedArray

# mode -> format id, as the loaded libraries describe themselves (jq_format_name:
# the order of include/jq/codec.h's format list); filled in when the package loads
# them (jaxquant/ffi/__init__.py). Empty when no library loaded.
FORMAT_IDS: dict[str, int] = {}

# The largest number of x rows per weight matrix that the fused GEMV takes, per
# platform; past it, qmm is ffi dequantize + XLA's dot (which wins once the
# weight's decode is amortized over enough rows).
GEMV_MAX_M = {"cpu": 16, "cuda": 16, "rocm": 16}

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# The raw calls (also used by the tests and the benchmark).


def _empty():
    return jnp.zeros((0,), jnp.float32)


def _qw_operands(qw: QuantizedArray):
    biases = qw.biases if qw.biases is not None else _empty()
    gs = (jnp.asarray(qw.global_scale, jnp.float32).reshape(-1) if qw.global_scale is not None
          else _empty())
    return qw.data, qw.scales, biases, gs


def _format_attrs(qw: QuantizedArray):
    return dict(fmt=np.int64(FORMAT_IDS[qw.mode]), bits=np.int64(qw.bits),
                group_size=np.int64(qw.group_size))


def dequantize_call(qw: QuantizedArray, dtype):
    """The ffi dequantize: [..., N, K] in `dtype`, bit for bit the reference's."""
    out = jax.ShapeDtypeStruct(qw.shape, jnp.dtype(dtype))
    return jax.ffi.ffi_call("jaxquant_dequantize", out, vmap_method="broadcast_all")(
        *_qw_operands(qw), **_format_attrs(qw))


def qmv_call(x3, qw3: QuantizedArray, indices=None, num_slots=None):
    """The fused dequantize-GEMV over slots: x3 [Sx, M, K], qw3 [E, N, K],
    indices int32 [S] (slot s uses expert indices[s]; out of [0, E): NaN row) or
    None (S = E, slot s uses expert s). Slot s reads x3[s // (S // Sx)].
    Returns [S, M, N] in x3's dtype."""
    e, n, _ = qw3.shape
    s = (indices.shape[0] if indices is not None else e) if num_slots is None else num_slots
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n), x3.dtype)
    idx = indices if indices is not None else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call("jaxquant_qmv", out, vmap_method="sequential")(
        x3, *_qw_operands(qw3), idx, **_format_attrs(qw3))


def rms_norm_call(x, weight, eps, weight_offset):
    w = weight if weight is not None else _empty()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call("jaxquant_rms_norm", out, vmap_method="broadcast_all")(
        x, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset))


def add_rms_norm_call(x, residual, weight, eps, weight_offset):
    w = weight if weight is not None else _empty()
    out = (jax.ShapeDtypeStruct(x.shape, residual.dtype),
           jax.ShapeDtypeStruct(x.shape, residual.dtype))
    y, h = jax.ffi.ffi_call("jaxquant_add_rms_norm", out, vmap_method="broadcast_all")(
        x, residual, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset))
    return y, h


def gated_rms_norm_call(x, gate, weight, eps, weight_offset, activation, norm_before_gate,
                        group_size):
    w = weight if weight is not None else _empty()
    out = jax.ShapeDtypeStruct(x.shape, gate.dtype)
    return jax.ffi.ffi_call("jaxquant_gated_rms_norm", out, vmap_method="broadcast_all")(
        x, gate, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset),
        activation=np.int64({"silu": 0, "sigmoid": 1}[activation]),
        norm_before_gate=np.int64(bool(norm_before_gate)), group_size=np.int64(group_size or 0))


# ---------------------------------------------------------------------------
# applies: which cases the kernels take (the reference serves the rest).


def _float_ok(*avals):
    return all(a is None or jnp.dtype(a.dtype) in _KERNEL_DTYPES for a in avals)


def _qw_ok(qw):
    if not isinstance(qw, QuantizedArray) or qw.layout != CANONICAL or qw.mode not in FORMAT_IDS:
        return False
    if qw.shape[-1] % 32 or qw.shape[-1] == 0:
        return False
    scale_ok = qw.scales.dtype == jnp.uint8 or jnp.dtype(qw.scales.dtype) in _KERNEL_DTYPES
    gs_ok = qw.global_scale is None or np.size(qw.global_scale) == 1
    return scale_ok and gs_ok


def dequantize_applies(qw, *, dtype):
    return _qw_ok(qw) and jnp.dtype(dtype) in _KERNEL_DTYPES


def qmm_applies(x, qw, *, transpose, precision):
    return _qw_ok(qw) and _float_ok(x)


def gather_qmm_applies(x, qw, indices, *, transpose, precision):
    return _qw_ok(qw) and _float_ok(x)


def ragged_qmm_applies(x, qw, group_sizes, *, transpose, precision):
    return _qw_ok(qw) and _float_ok(x)


def rms_norm_applies(x, weight, *, eps, weight_offset):
    return _float_ok(x, weight)


def add_rms_norm_applies(x, residual, weight, *, eps, weight_offset):
    return _float_ok(x, residual, weight)


def gated_rms_norm_applies(x, gate, weight, *, eps, weight_offset, activation, norm_before_gate,
                           group_size):
    return _float_ok(x, gate, weight)


# ---------------------------------------------------------------------------
# Lowerings (impl(*args, **params) with the op's structured arguments).


def _contract(x, w, transpose, precision, batch=0):
    from jaxquant.ops.qmm import _contract as contract  # the reference's own contraction
    return contract(x, w, transpose, precision, batch)


def _flat_experts(qw: QuantizedArray, n_lead: int):
    """qw [*B, N, K] -> [prod(B), N, K] (B may be empty)."""
    b = math.prod(qw.shape[:n_lead])
    r = lambda a: None if a is None else a.reshape(b, *a.shape[n_lead:])
    return QuantizedArray(r(qw.data), r(qw.scales), r(qw.biases), qw.global_scale,
                          mode=qw.mode, bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype)


def make_qmm_gemv_case(platform: str):
    """auto predicate: the cases qmm_impl runs as the fused GEMV (the ones measured
    to beat the reference on GPUs; the rest is the ffi dequantize + XLA's dot)."""
    max_m = GEMV_MAX_M[platform]

    def is_gemv(x, qw, *, transpose, precision):
        return transpose and 0 < math.prod(x.shape[qw.ndim - 2:-1]) <= max_m

    return is_gemv


def make_qmm_impl(platform: str):
    max_m = GEMV_MAX_M[platform]

    def qmm_impl(x, qw, *, transpose, precision):
        nb = qw.ndim - 2
        k = x.shape[-1]
        n = qw.shape[-2] if transpose else qw.shape[-1]
        m = math.prod(x.shape[nb:-1])
        if transpose and 0 < m <= max_m:
            b = math.prod(qw.shape[:nb])
            y = qmv_call(x.reshape(b, m, k), _flat_experts(qw, nb))
            return y.reshape(*x.shape[:-1], n)
        w = dequantize_call(qw, x.dtype)
        return _contract(x, w, transpose, precision, batch=nb).astype(x.dtype)

    return qmm_impl


def gather_qmm_impl(x, qw, indices, *, transpose, precision):
    num_experts = qw.shape[0]
    t, slots = indices.shape
    valid = (indices >= 0) & (indices < num_experts)
    if transpose:
        # Every slot is qmm's M=1 GEMV on its expert: the same inner routine,
        # so gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]]) bit for bit.
        idx = jnp.where(valid, indices, -1).astype(jnp.int32).reshape(-1)
        x3 = x.reshape(t * slots if x.ndim == 3 else t, 1, x.shape[-1])
        y = qmv_call(x3, qw, idx)
        return y.reshape(t, slots, qw.shape[1])
    # transpose=False: like the reference, with the ffi dequantize (== qmm's path).
    w = dequantize_call(qw[jnp.where(valid, indices, 0)], x.dtype)  # [T, k, K, N]
    xs = jnp.broadcast_to(x[:, None, :], w.shape[:2] + x.shape[-1:]) if x.ndim == 2 else x
    one = lambda xi, wi: _contract(xi, wi, transpose, precision)
    y = jax.vmap(jax.vmap(one))(xs, w)
    return jnp.where(valid[..., None], y, jnp.nan).astype(x.dtype)


def ragged_qmm_impl(x, qw, group_sizes, *, transpose, precision):
    from jaxquant.ops.common import compute_dtype  # noqa: PLC0415
    w = dequantize_call(qw, x.dtype)
    rhs = jnp.swapaxes(w, -1, -2) if transpose else w
    y = lax.ragged_dot(x, rhs, group_sizes.astype(jnp.int32), precision=precision,
                       preferred_element_type=compute_dtype(x.dtype))
    return y.astype(x.dtype)


def dequantize_impl(qw, *, dtype):
    return dequantize_call(qw, dtype)


def rms_norm_impl(x, weight, *, eps, weight_offset):
    return rms_norm_call(x, weight, eps, weight_offset)


def add_rms_norm_impl(x, residual, weight, *, eps, weight_offset):
    y, h = add_rms_norm_call(x, residual, weight, eps, weight_offset)
    return [y, h]


def gated_rms_norm_impl(x, gate, weight, *, eps, weight_offset, activation, norm_before_gate,
                        group_size):
    return gated_rms_norm_call(x, gate, weight, eps, weight_offset, activation, norm_before_gate,
                               group_size)
