"""The ffi backend's kernels: jnp-traceable functions that call the compiled
handlers through `jax.ffi.ffi_call`.

Each function registered with `jaxquant.dispatch` (jaxquant/ffi/__init__.py:
KERNELS) takes the op's arguments and params plus `platform`, as the
dispatcher passes them; the same functions serve direct calls (tests,
benchmarks), where `platform` may be left out: the handler that runs is the
library of the platform being lowered for. What runs where: qmm with few rows
of x per weight matrix (configs.FFI_GEMV_MAX_M) and every gather_qmm slot with
x @ W.T run the fused dequantize-GEMV; the rest is the op's reference
(jaxquant/ops/qmm.py) with the ffi dequantize in place of the jnp one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import formats
from jaxquant.ffi import configs
from jaxquant.ops.qmm import gather_qmm_reference, qmm_reference, ragged_qmm_reference
from jaxquant.quantized_array import CANONICAL, QuantizedArray

# mode -> format id, as the loaded libraries describe themselves (jq_format_name:
# the order of include/jq/codec.h's format list); filled in when the package loads
# them (jaxquant/ffi/__init__.py). Empty when no library loaded.
FORMAT_IDS: dict[str, int] = {}
# platform -> the FFI targets its loaded library serves (jq_ffi_targets), filled in
# likewise: a library built before a target existed lacks it (the op then takes the
# path it took before, instead of failing on a missing handler).
TARGETS: dict[str, tuple[str, ...]] = {}

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# The calls of the FFI targets (the dequantize and the norms with their op's
# signature: registered as they are).


def _empty():
    return jnp.zeros((0,), jnp.float32)


def qw_operands(qw: QuantizedArray):
    biases = qw.biases if qw.biases is not None else _empty()
    gs = (jnp.asarray(qw.global_scale, jnp.float32).reshape(-1) if qw.global_scale is not None
          else _empty())
    return qw.data, qw.scales, biases, gs


def format_attrs(qw: QuantizedArray):
    return dict(fmt=np.int64(FORMAT_IDS[qw.mode]), bits=np.int64(qw.bits),
                group_size=np.int64(qw.group_size))


def dequantize_call(qw: QuantizedArray, dtype, *, platform=None):
    """The ffi dequantize: [..., N, K] in `dtype`, bit for bit the reference's."""
    out = jax.ShapeDtypeStruct(qw.shape, jnp.dtype(dtype))
    return jax.ffi.ffi_call("jaxquant_dequantize", out, vmap_method="broadcast_all")(
        *qw_operands(qw), **format_attrs(qw))


def _slots_call(target, x3, qw3: QuantizedArray, indices, num_slots):
    e, n, _ = qw3.shape
    s = (indices.shape[0] if indices is not None else e) if num_slots is None else num_slots
    out = jax.ShapeDtypeStruct((s, x3.shape[1], n), x3.dtype)
    idx = indices if indices is not None else jnp.zeros((0,), jnp.int32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x3, *qw_operands(qw3), idx, **format_attrs(qw3))


def qmv_call(x3, qw3: QuantizedArray, indices=None, num_slots=None):
    """The fused dequantize-GEMV over slots: x3 [Sx, M, K], qw3 [E, N, K],
    indices int32 [S] (slot s uses expert indices[s]; out of [0, E): NaN row) or
    None (S = E, slot s uses expert s). Slot s reads x3[s // (S // Sx)].
    Returns [S, M, N] in x3's dtype."""
    return _slots_call("jaxquant_qmv", x3, qw3, indices, num_slots)


def gemm_call(x3, qw3: QuantizedArray, indices=None, num_slots=None):
    """qmv_call's product as the CPU library's blocked dequantize-GEMM (target
    jaxquant_gemm, CPU only): each block of weight rows decoded once into float32
    and reused over all M rows of x (cpu_src/kernels_impl.inc, gemm)."""
    return _slots_call("jaxquant_gemm", x3, qw3, indices, num_slots)


def rms_norm_call(x, weight, eps, weight_offset, *, platform=None):
    w = weight if weight is not None else _empty()
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call("jaxquant_rms_norm", out, vmap_method="broadcast_all")(
        x, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset))


def add_rms_norm_call(x, residual, weight, eps, weight_offset, *, platform=None):
    w = weight if weight is not None else _empty()
    out = (jax.ShapeDtypeStruct(x.shape, residual.dtype),
           jax.ShapeDtypeStruct(x.shape, residual.dtype))
    y, h = jax.ffi.ffi_call("jaxquant_add_rms_norm", out, vmap_method="broadcast_all")(
        x, residual, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset))
    return y, h


def gated_rms_norm_call(x, gate, weight, eps, weight_offset, activation, norm_before_gate,
                        group_size, *, platform=None):
    w = weight if weight is not None else _empty()
    out = jax.ShapeDtypeStruct(x.shape, gate.dtype)
    return jax.ffi.ffi_call("jaxquant_gated_rms_norm", out, vmap_method="broadcast_all")(
        x, gate, w, eps=np.float32(eps), weight_offset=np.float32(weight_offset),
        activation=np.int64({"silu": 0, "sigmoid": 1}[activation]),
        norm_before_gate=np.int64(bool(norm_before_gate)), group_size=np.int64(group_size or 0))


# ---------------------------------------------------------------------------
# supports: the cases the kernels take (the reference serves the rest).


def _float_ok(*avals):
    return all(a is None or jnp.dtype(a.dtype) in _KERNEL_DTYPES for a in avals)


def _qw_ok(qw, platform):
    if not isinstance(qw, QuantizedArray) or qw.layout != CANONICAL or qw.mode not in FORMAT_IDS:
        return False
    if platform != "cpu" and qw.format.element in formats.CODEBOOKS:
        # the GPU libraries build their float kernels for the minifloat elements only
        # (include/jq/codec.h: kFloatFormats); the Pallas kernels decode codebooks there
        return False
    if qw.shape[-1] % 32 or qw.shape[-1] == 0:
        return False
    scale_ok = qw.scales.dtype == jnp.uint8 or jnp.dtype(qw.scales.dtype) in _KERNEL_DTYPES
    gs_ok = qw.global_scale is None or np.size(qw.global_scale) == 1
    return scale_ok and gs_ok


def supports_dequantize(qw, *, dtype, platform):
    return _qw_ok(qw, platform) and jnp.dtype(dtype) in _KERNEL_DTYPES


def supports_matmul(x, qw, *operands, platform, **params):
    """qmm, gather_qmm, ragged_qmm."""
    return _qw_ok(qw, platform) and _float_ok(x)


def supports_norm(*arrays, platform, **params):
    """rms_norm, add_rms_norm, gated_rms_norm."""
    return _float_ok(*arrays)


# ---------------------------------------------------------------------------
# The matmuls.


def qmm(x, qw, *, transpose, precision, platform):
    """x @ W.T: the fused GEMV for at most configs.FFI_GEMV_MAX_M[platform] rows of x per
    weight matrix, the CPU's blocked GEMM for more (configs.gemm_rows); otherwise the
    reference with the ffi dequantize."""
    m = configs.gemv_rows(x, qw, transpose=transpose, platform=platform)
    call = qmv_call
    if m is None and "gemm" in TARGETS.get(platform, ()):
        m, call = configs.gemm_rows(x, qw, transpose=transpose, platform=platform), gemm_call
    if m is None:
        return qmm_reference(x, qw, transpose=transpose, precision=precision,
                             dequantize=dequantize_call)
    nb = qw.ndim - 2
    y = call(x.reshape(math.prod(qw.shape[:nb]), m, x.shape[-1]), qw.flatten_leading(nb))
    return y.reshape(*x.shape[:-1], qw.shape[-2])


def gather_qmm(x, qw, indices, *, transpose, precision, platform):
    """x @ W.T: every slot is qmm's M=1 GEMV on its expert (the same inner routine,
    so gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]]) bit for bit);
    x @ W: the reference with the ffi dequantize (== qmm's path)."""
    if not transpose:
        return gather_qmm_reference(x, qw, indices, transpose=transpose, precision=precision,
                                    dequantize=dequantize_call)
    t, slots = indices.shape
    valid = (indices >= 0) & (indices < qw.shape[0])
    idx = jnp.where(valid, indices, -1).astype(jnp.int32).reshape(-1)
    x3 = x.reshape(t * slots if x.ndim == 3 else t, 1, x.shape[-1])
    return qmv_call(x3, qw, idx).reshape(t, slots, qw.shape[1])


def ragged_qmm(x, qw, group_sizes, *, transpose, precision, platform):
    """The reference with the ffi dequantize (there is no fused ragged kernel)."""
    return ragged_qmm_reference(x, qw, group_sizes, transpose=transpose, precision=precision,
                                dequantize=dequantize_call)
