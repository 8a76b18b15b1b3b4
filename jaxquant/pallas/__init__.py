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
        reg("qmm", "pallas", (platform,), functools.partial(_impl, platform=platform), _applies)
    return True


try:
    _REGISTERED = register()
except Exception:  # noqa: BLE001 - a broken dispatch module must not break import
    _REGISTERED = False
