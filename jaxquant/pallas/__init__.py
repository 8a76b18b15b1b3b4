"""Pallas backend: Triton-lowered kernels for CUDA and ROCm (DESIGN.md §5).

`jaxquant.pallas.qmm.qmm` / `supports` are the entry points; block configs live
in `jaxquant.pallas.configs`. Importing this package registers the kernels with
`jaxquant.dispatch` when that module exists; import never fails because of it.
"""

from __future__ import annotations

import functools

from jaxquant.pallas.qmm import qmm, supports

__all__ = ["qmm", "supports", "register"]

PLATFORMS = ("cuda", "rocm")


def _impl(x, qw, *, transpose=True, precision=None, platform):
    return qmm(x, qw, transpose=transpose, precision=precision, platform=platform)


def _applies(x_aval, qw, *, transpose=True, precision=None):
    del precision
    return supports(x_aval.shape, x_aval.dtype, qw, transpose)


# Automatic choice: the GEMV/skinny cases (M <= 16, x @ W.T), where the kernels
# beat the jnp reference 2-7x on an H100; at M >= 512 the tiled GEMM is slower
# than the reference (benchmarks/RESULTS.md), so `auto` leaves it to XLA.
AUTO_MAX_M = 16


def _auto(x_aval, qw, *, transpose=True, precision=None):
    del precision
    m = 1
    for d in x_aval.shape[:-1]:
        m *= d
    return transpose and m <= AUTO_MAX_M


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


def register() -> bool:
    """Register qmm's Pallas lowering per platform with jaxquant.dispatch.
    Returns False (and does nothing) where the dispatch module is missing."""
    try:
        from jaxquant import dispatch
    except ImportError:
        return False
    reg = getattr(dispatch, "register", None)
    if reg is None:
        return False
    register_backend = getattr(dispatch, "register_backend", None)
    if register_backend is not None:
        register_backend("pallas", unavailable_reason)
    for platform in PLATFORMS:
        reg("qmm", "pallas", (platform,), functools.partial(_impl, platform=platform), _applies,
            auto=_auto)
    from jaxquant.pallas import moe  # gather_qmm (routed MoE decode)
    moe.register(reg, PLATFORMS)
    from jaxquant.pallas import norms  # rms_norm, add_rms_norm, gated_rms_norm
    norms.register(reg, PLATFORMS)
    return True


try:
    _REGISTERED = register()
except Exception:  # noqa: BLE001 - a broken dispatch module must not break import
    _REGISTERED = False
