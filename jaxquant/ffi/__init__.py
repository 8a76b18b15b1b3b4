"""The `ffi` backend: compiled kernels behind `jax.ffi` (docs/backends.md).

Importing this package loads the libraries that were built (cpu_src/ always;
gpu_src/ for CUDA when nvcc was found, for ROCm when a HIP compiler was),
registers their handlers as FFI targets for the platforms cpu, CUDA and
ROCM (each library lists its own targets and format ids: the loader reads
them), and registers the kernels with `jaxquant.dispatch` as backend "ffi"
(KERNELS below; kernel choice: `jaxquant.ffi.configs`). A library that is
missing only removes its platform; `unavailable_reason()` says why.

Targets (one name for every platform; operands validated by the handler,
which returns an error instead of touching bad memory; how to add one:
include/jq/ffi_common.h):
  jaxquant_dequantize      data, scales, biases|[0], global_scale|[0] -> [..., N, K]
  jaxquant_qmv             x [Sx,M,K], data, scales, biases, global_scale, indices|[0] -> [S,M,N]
  jaxquant_gemm            (CPU library only) jaxquant_qmv's operands and result, as the
                           blocked dequantize-GEMM for many rows of x
  jaxquant_rms_norm        x, weight|[0] -> y
  jaxquant_add_rms_norm    x, residual, weight|[0] -> y, h
  jaxquant_gated_rms_norm  x, gate, weight|[0] -> y
  jaxquant_cdna4_qmm       (ROCm library only) x terms [B,T,Mp,K], x scales, data, scales
                           -> [B,M,N]: gfx950 MXFP4 qmm on the cdna4 layout (cdna4.py)

Numerics (docs/ops.md):
- dequantize is bit for bit the reference (float32 arithmetic, affine as
  fma(q, scale, bias) like XLA at its default optimization level, E8M0 as an exact
  power of two; docs/ops.md, "Arithmetic").
- qmm with transpose=True and at most configs.FFI_GEMV_MAX_M rows of x per weight matrix,
  and every gather_qmm slot, run the fused dequantize-GEMV: it never
  materializes the weight; each group's float32 partial sum is scaled once
  (exactly, for E8M0), accumulation is float32 and the output is x's dtype.
  The weight values are used at float32 precision (the reference first
  rounds them to x's dtype), so the kernel is at least as close to the exact
  product as the reference. One output element's float ops depend only on K
  and the format, so gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]])
  bit for bit on this backend.
- qmm with transpose=True and more rows on the CPU (configs.gemm_rows) runs the
  blocked GEMM: the weight values in float32 exactly as the dequantize gives them
  (never rounded to x's dtype), one FMA per term, float32 accumulation over K in
  order, the output rounded to x's dtype; a row's bits do not depend on M or the
  threads.
- qmm otherwise (transpose=False, more rows), ragged_qmm and gather_qmm with
  transpose=False: the op's reference with the ffi dequantize into x's dtype
  (so the reference's own XLA contraction, and its precision setting).
- float64 anywhere, non-canonical layouts, K not a multiple of 32: the
  `supports_*` functions say no and the reference runs. Except: on a gfx950,
  qmm (x @ W.T) with bfloat16/float16 x on an mxfp4 weight in the `cdna4`
  layout runs the scaled-MFMA kernel of gpu_src/rocm/cdna4_qmm.hip, x split into
  E4M3 terms (jaxquant/ffi/cdna4.py; docs/cdna4.md gives its numerics).
"""

from __future__ import annotations

import jax

from jaxquant import dispatch
from jaxquant.ffi import cdna4, configs, kernels, loader
from jaxquant.layouts import cuda_mma  # noqa: F401 - the layout exists (unpacks) everywhere
from jaxquant.ffi.kernels import (FORMAT_IDS, add_rms_norm_call, dequantize_call,
                               gated_rms_norm_call, qmv_call, rms_norm_call)

__all__ = ["FORMAT_IDS", "KERNELS", "add_rms_norm_call", "configs", "cpu_kernels_isa",
           "dequantize_call",
           "gated_rms_norm_call", "libraries", "loaded_platforms", "qmv_call", "rms_norm_call",
           "unavailable_reason"]

_LIBS: dict[str, loader.Library] = {}


def _refuse_if_renumbered(lib: loader.Library) -> bool:
    """Unload `lib` if it numbers the formats unlike the libraries loaded before it
    (libraries built from different sources); True if it did."""
    if lib.handle is None or not FORMAT_IDS or lib.format_ids == FORMAT_IDS:
        return False
    lib.error = (f"{lib.path} numbers the formats {lib.format_ids}, another loaded library "
                 f"{FORMAT_IDS}: rebuild with `pip install -e .`")
    lib.handle = None
    return True


def _load_all():
    for platform in loader.PLATFORMS:
        lib = loader.load(platform)
        _refuse_if_renumbered(lib)
        loader.register(lib)
        if lib.handle is not None and not FORMAT_IDS:
            FORMAT_IDS.update(lib.format_ids)
        if lib.handle is not None:
            kernels.TARGETS[platform] = lib.targets
        _LIBS[platform] = lib


def libraries() -> dict[str, loader.Library]:
    """platform -> Library (path, handle, error, targets, format_ids)."""
    return dict(_LIBS)


def loaded_platforms() -> list[str]:
    return [p for p, lib in _LIBS.items() if lib.handle is not None]


def cpu_kernels_isa() -> str | None:
    """The ISA whose kernels the CPU library runs ("avx512f+bw+vl+dq+vbmi", "avx2+fma+f16c",
    "neon" on arm64, "baseline"; chosen once per process, JAXQUANT_FFI_CPU_ISA caps it), or
    None where the CPU library is not loaded."""
    import ctypes

    lib = libraries().get("cpu")
    if lib is None or lib.handle is None:
        return None
    fn = lib.handle.jq_cpu_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


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


# (primitive, impl, supports, auto): registered for every loaded platform, with
# dispatch.PRIORITY["ffi"][platform]; each takes `platform` from the dispatcher.
KERNELS = (
    ("qmm", kernels.qmm, kernels.supports_matmul, configs.auto_qmm),
    ("gather_qmm", kernels.gather_qmm, kernels.supports_matmul, configs.auto_gather_qmm),
    ("ragged_qmm", kernels.ragged_qmm, kernels.supports_matmul, configs.never),
    ("dequantize", dequantize_call, kernels.supports_dequantize, configs.auto_dequantize),
    ("rms_norm", rms_norm_call, kernels.supports_norm, configs.auto_norm),
    ("add_rms_norm", add_rms_norm_call, kernels.supports_norm, configs.auto_norm),
    ("gated_rms_norm", gated_rms_norm_call, kernels.supports_norm, configs.auto_norm),
)

_load_all()
for _platform in loaded_platforms():
    for _name, _impl, _supports, _auto in KERNELS:
        dispatch.register(_name, "ffi", (_platform,), _impl, _supports,
                          priority=dispatch.PRIORITY["ffi"][_platform], auto=_auto)
# The ROCm library's gfx950 qmm on cdna4-layout weights (no canonical-layout kernel
# takes that layout): its choice and priority live with it in cdna4.py.
if "rocm" in loaded_platforms() and "cdna4_qmm" in _LIBS["rocm"].targets:
    cdna4.register()
if "cuda" in loaded_platforms():
    # the tensor-core decode GEMV on the cuda_mma layout (docs/decode.md); registering
    # it makes cuda_mma jq.prepack's default on CUDA
    from jaxquant.ffi import mma
    mma.register(_LIBS["cuda"])
dispatch.register_backend("ffi", unavailable_reason)
