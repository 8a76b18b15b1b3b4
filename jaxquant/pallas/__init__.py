"""Pallas backend: Triton-lowered kernels for CUDA and ROCm (docs/backends.md).

Importing this package registers its kernels with `jaxquant.dispatch` for the
platforms cuda and rocm: each `lower_*` front takes the op's arguments plus
`platform`, its `supports*` function the same arguments as ShapedArrays (the
unprefixed fronts add argument checks, `interpret` and `config`, for direct use).
Kernel choice and block sizes: `jaxquant.pallas.configs`. Modules: `common`
(shared helpers), `codecs` (decoders), `gemv` and `gemm` (the matmul kernel
families), fronts `qmm`, `moe`, `norms`, `attention`.
"""

from __future__ import annotations

from jaxquant import dispatch
from jaxquant.pallas import attention, configs, moe, norms, qmm
from jaxquant.pallas.common import quiet_lowering

__all__ = ["PLATFORMS", "unavailable_reason"]

PLATFORMS = ("cuda", "rocm")


def unavailable_reason() -> str | None:
    """None when a CUDA or ROCm GPU is visible to JAX, else why the backend cannot run."""
    try:
        import jax
        from jax.experimental.pallas import triton as _  # noqa: F401
        platforms = {d.platform for d in jax.devices()}
    except Exception as e:  # noqa: BLE001
        return f"the Pallas Triton backend is not importable ({type(e).__name__}: {e})"
    if platforms & {"gpu", "cuda", "rocm"}:
        return None
    return (f"no CUDA or ROCm GPU visible to JAX (devices: {sorted(platforms)}); the Pallas "
            f"kernels run on GPUs (their tests use interpret mode on the CPU)")


# (primitive, impl, applies, auto): `auto` is configs' rule where automatic choice was
# measured to beat the reference (None: every case `applies` takes).
KERNELS = (
    ("qmm", qmm.lower_qmm, qmm.supports, configs.auto_qmm),
    ("gather_qmm", moe.lower_gather_qmm, moe.supports_gather, None),
    ("gather_matmul", moe.lower_gather_matmul, moe.supports_gather_matmul, None),
    ("ragged_qmm", moe.lower_ragged_qmm, moe.supports_ragged, None),
    ("ragged_matmul", moe.lower_ragged_matmul, moe.supports_ragged_matmul, None),
    ("rms_norm", norms.lower_rms_norm, norms.supports, configs.auto_norm),
    ("add_rms_norm", norms.lower_add_rms_norm, norms.supports, configs.auto_norm),
    ("gated_rms_norm", norms.lower_gated_rms_norm, norms.supports, configs.auto_norm),
    ("decode_attention", attention.lower_decode_attention, attention.supports,
     configs.auto_decode_attention),
)

for _name, _impl, _applies, _auto in KERNELS:
    dispatch.register(_name, "pallas", PLATFORMS, _impl, _applies,
                      priority=dispatch.PRIORITY["pallas"], auto=_auto)
dispatch.register_backend("pallas", unavailable_reason, lowering_scope=quiet_lowering)
