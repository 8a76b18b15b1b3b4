"""The `ffi` backend: compiled kernels behind `jax.ffi` (DESIGN.md §5).

Importing this package loads the libraries that were built (cpu_src/ always;
hip_src/ for CUDA when nvcc was found, for ROCm when a HIP compiler was),
registers their handlers as FFI targets for the platforms cpu, CUDA and
ROCM, and registers the lowerings with `jaxquant.dispatch` as backend "ffi".
A library that is missing only removes its platform; `unavailable_reason()`
says why.

Targets (one name for every platform; operands validated by the handler,
which returns an error instead of touching bad memory):
  jaxquant_dequantize      data, scales, biases|[0], global_scale|[0] -> [..., N, K]
  jaxquant_qmv             x [Sx,M,K], data, scales, biases, global_scale, indices|[0] -> [S,M,N]
  jaxquant_rms_norm        x, weight|[0] -> y
  jaxquant_add_rms_norm    x, residual, weight|[0] -> y, h
  jaxquant_gated_rms_norm  x, gate, weight|[0] -> y

Numerics (DESIGN.md §4):
- dequantize is bit for bit the reference (float32 arithmetic, affine as
  fma(q, scale, bias) like XLA, E8M0 as an exact power of two).
- qmm with transpose=True and at most GEMV_MAX_M rows of x per weight matrix,
  and every gather_qmm slot, run the fused dequantize-GEMV: it never
  materializes the weight; each group's float32 partial sum is scaled once
  (exactly, for E8M0), accumulation is float32 and the output is x's dtype.
  The weight values are used at float32 precision (the reference first
  rounds them to x's dtype), so the kernel is at least as close to the exact
  product as the reference. One output element's float ops depend only on K
  and the format, so gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]])
  bit for bit on this backend.
- qmm otherwise (transpose=False, more rows), ragged_qmm and gather_qmm with
  transpose=False: the ffi dequantize into x's dtype, then the reference's
  own XLA contraction (so the precision setting is honoured).
- float64 anywhere, non-canonical layouts, K not a multiple of 32: `applies`
  says no and the reference runs.
"""

from __future__ import annotations

import math

import jax

from jaxquant import dispatch
from jaxquant.ffi import _loader, _ops
from jaxquant.layouts import cuda_mma
from jaxquant.ffi._ops import (FORMAT_IDS, GEMV_MAX_M, add_rms_norm_call, dequantize_call,
                               gated_rms_norm_call, qmv_call, rms_norm_call)

__all__ = ["FORMAT_IDS", "GEMV_MAX_M", "PRIORITY", "add_rms_norm_call", "dequantize_call",
           "gated_rms_norm_call", "libraries", "loaded_platforms", "qmv_call", "rms_norm_call",
           "unavailable_reason"]

# Priority against other backends' kernels under automatic choice (dispatch.select).
# CPU: no other backend serves it, so ffi ranks first there; `auto` (below) narrows
# it to the cases measured faster than the reference. GPU: below the Pallas kernels
# (priority 0), which were faster in every same-run comparison on an H100: the fused
# GEMV is 3-6x faster than the jnp reference but 1.2-1.5x slower than Pallas (33-37%
# of the copy bandwidth; benchmarks/RESULTS.md).
PRIORITY = {"cpu": 10, "cuda": -1, "rocm": -1}

_LIBS: dict[str, _loader.Library] = {}


def _load_all():
    for platform in _loader.PLATFORMS:
        lib = _loader.load(platform)
        _loader.register(lib)
        _LIBS[platform] = lib


def libraries() -> dict[str, _loader.Library]:
    """platform -> Library (path, handle, error)."""
    return dict(_LIBS)


def loaded_platforms() -> list[str]:
    return [p for p, lib in _LIBS.items() if lib.handle is not None]


def unavailable_reason(platform: str | None = None) -> str | None:
    """Why the ffi backend cannot run on `platform` (default: JAX's default
    backend), or None if it can."""
    if platform is None:
        try:
            platform = jax.default_backend()
        except Exception:  # noqa: BLE001
            platform = "cpu"
    platform = {"gpu": "cuda"}.get(platform, platform)
    lib = _LIBS.get(platform)
    if lib is None:
        return f"the ffi backend has no library for platform {platform!r}"
    return lib.error if lib.handle is None else None


def _never(*args, **params):
    return False


def _transposed(*args, transpose, **params):
    return transpose


def _norm_of_64k_elements(x, *args, **params):
    return math.prod(x.shape) >= 1 << 16


# Where `auto` takes the ffi kernels (absent: never), from same-run measurements
# (benchmarks/RESULTS.md). qmm: the fused GEMV only (`_ops.make_qmm_gemv_case`);
# above GEMV_MAX_M rows the ffi dequantize + XLA's dot is 0.5-0.7x the reference,
# which XLA fuses. gather_qmm with x @ W.T: the fused GEMV per slot (CPU 13-25x,
# H100 2-8x). CPU only: dequantize (0.9-6.4x: even to 1.3x for the 4-bit formats,
# the MX6 unpack 6x), norms from 64 Ki elements (1.1-4.2x; smaller rows are a few
# µs either way and XLA fuses them with their neighbours). Never: ragged_qmm
# (dequantize + ragged_dot, 0.85x on the CPU), the GPU norms (20-30% of the copy
# bandwidth, 0.2-0.5x XLA's fused reference on an H100).
_AUTO = {
    "cpu": {"gather_qmm": _transposed, "dequantize": None, "rms_norm": _norm_of_64k_elements,
            "add_rms_norm": _norm_of_64k_elements, "gated_rms_norm": _norm_of_64k_elements},
    "gpu": {"gather_qmm": _transposed},
}


def _register_kernels():
    entries = [
        ("dequantize", _ops.dequantize_impl, _ops.dequantize_applies),
        ("gather_qmm", _ops.gather_qmm_impl, _ops.gather_qmm_applies),
        ("ragged_qmm", _ops.ragged_qmm_impl, _ops.ragged_qmm_applies),
        ("rms_norm", _ops.rms_norm_impl, _ops.rms_norm_applies),
        ("add_rms_norm", _ops.add_rms_norm_impl, _ops.add_rms_norm_applies),
        ("gated_rms_norm", _ops.gated_rms_norm_impl, _ops.gated_rms_norm_applies),
    ]
    for platform in loaded_platforms():
        prio = PRIORITY[platform]
        auto = _AUTO["cpu" if platform == "cpu" else "gpu"]
        for name, impl, applies in entries:
            dispatch.register(name, "ffi", (platform,), impl, applies, priority=prio,
                              auto=auto.get(name, _never))
        dispatch.register("qmm", "ffi", (platform,), _ops.make_qmm_impl(platform),
                          _ops.qmm_applies, priority=prio, auto=_ops.make_qmm_gemv_case(platform))
    if "cuda" in loaded_platforms():
        # the tensor-core decode GEMV on the cuda_mma layout (jq.prepack's default on CUDA)
        from jaxquant.ffi import _mma
        dispatch.register("qmm", "ffi", ("cuda",), _mma.qmm_impl, _mma.qmm_applies,
                          priority=_mma.PRIORITY)
        dispatch.register("gather_qmm", "ffi", ("cuda",), _mma.gather_qmm_impl,
                          _mma.gather_qmm_applies, priority=_mma.PRIORITY)
        cuda_mma.make_default_on("cuda")


_load_all()
_register_kernels()
dispatch.register_backend("ffi", unavailable_reason)
