"""Backend registry and selection (docs/architecture.md, docs/backends.md).

The backends, in preference order, are `BACKENDS`: "reference" (the jnp
definitions in jaxquant.ops) and one package `jaxquant.<name>` per other
backend, which jaxquant/__init__.py imports and which registers its kernels
here. Nothing else in the code base lists the backends.

Registering a kernel (the one style every backend uses):

    dispatch.register(primitive, backend, platforms, impl, applies=None, *,
                      priority=0, auto=None)

  primitive  the op's name: "qmm", "gather_qmm", "ragged_qmm", "dequantize",
             "rms_norm", "add_rms_norm", "gated_rms_norm", "rms_norm_qmm",
             "qmm_swiglu", "rms_norm_qmm_swiglu", "qmm_add", "gather_qmm_swiglu",
             "decode_attention";
  backend    a name in BACKENDS;
  platforms  the lowering platforms it serves, e.g. ("cuda", "rocm") or ("cpu",);
  impl(*args, platform, **params)
             jnp-traceable, the reference's signature (the op's structured
             arguments, QuantizedArray included, then its params as keywords)
             plus `platform`, the platform being lowered for ("cpu", "cuda",
             "rocm"); returns what the reference returns (a sequence for ops
             with several results);
  applies(*args, platform, **params) -> bool
             the cases the kernel can compute, seen as ShapedArrays (shapes and
             dtypes, no values); default: every case;
  priority   higher wins under automatic choice;
  auto(*args, platform, **params) -> bool
             where given, narrows what automatic choice gives the kernel (the
             cases where it was measured to beat the reference); an explicit
             `backend=` still gets every case `applies` takes.

The same `impl`, `applies` and `auto` may be registered for several platforms:
the dispatcher passes the platform, so backends write no per-platform
adapters.

Selection, at lowering time, for a primitive bound with `backend=b`:
- b is None ("auto"): the highest-priority registered kernel for this
  platform whose `applies` accepts the case and whose `auto` predicate
  does too, else the reference;
- b names a backend: its kernel for this platform if `applies` accepts the
  case, else the reference (a backend serves what it supports: float64,
  for one, always runs on the reference); a backend with no kernel for this
  primitive on this platform is an error, except for a fused op, whose
  fallback is the unfused ops on that backend (`select(..., required=False)`).
  Another op whose backend comes from `with jq.backend` or $JAXQUANT_BACKEND
  and has no kernel at all for it is bound with "reference" instead
  (`resolve_backend`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Callable

# The backends, in preference order; each but "reference" is the package jaxquant.<name>.
BACKENDS = ("reference", "pallas", "ffi", "metal")

# Every backend's rank under automatic choice (the `priority=` of `register`), in one
# table so the order between backends is read in one place; higher is tried first.
#   pallas: the GPU kernels on the canonical layout.
#   ffi: on the CPU no other backend serves the ops, so first; on a GPU below Pallas,
#     faster in every same-process comparison on the canonical layout (h100/qmm.json
#     `qmm.ffi_gemv.*` against `qmm.pallas.*`).
#   ffi_layout: the ffi kernels of a kernel layout (cuda_mma, cdna4): only they read
#     that layout, so first wherever they apply.
#   metal: above ffi on the CPU platform (its automatic choice is off anyway).
PRIORITY = {"pallas": 0, "ffi": {"cpu": 10, "cuda": -1, "rocm": -1}, "ffi_layout": 10,
            "metal": 20}
ENV_VAR = "JAXQUANT_BACKEND"


@dataclasses.dataclass(frozen=True)
class Kernel:
    backend: str
    platforms: tuple[str, ...]
    impl: Callable
    applies: Callable
    priority: int
    auto: Callable | None = None


# primitive name -> list of kernels
_KERNELS: dict[str, list[Kernel]] = {}
# backend name -> () -> str | None: why the backend cannot run here (None: it can)
_AVAILABILITY: dict[str, Callable[[], str | None]] = {"reference": lambda: None}
# backend name -> why it is not part of this build at all (e.g. metal off macOS): such a
# backend is neither available nor listed as if it were (`python -m jaxquant`).
_NOT_BUILT: dict[str, str] = {}
# backend name -> () -> context manager entered while its kernels are lowered
_LOWERING_SCOPES: dict[str, Callable] = {}


def _backend_state():
    """The `with jq.backend(...)` choice as a JAX config state that is part of
    jit's cache key, so a function traced under one choice is retraced under
    another. This is a private JAX API (jax._src.config.State, stable from
    0.10 to 0.12); where it is missing, a contextvar stands in and the choice
    is fixed when a jitted function is first traced."""
    try:
        from jax._src import config as jax_config
        return jax_config.State("jaxquant_backend", None, "jaxquant's backend choice",
                                include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # noqa: BLE001
        return None


_STATE = _backend_state()
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxquant_backend",
                                                                     default=None)


def _current() -> str | None:
    return _STATE.value if _STATE is not None else _CURRENT.get()


def register(primitive: str, backend: str, platforms, impl, applies=None, *,
             priority: int = 0, auto=None):
    """Register `impl` as `backend`'s kernel for `primitive` on `platforms`
    (the module docstring gives the signatures of impl, applies and auto)."""
    _check_name(backend)
    kernel = Kernel(backend, tuple(platforms), impl, applies or _every_case, priority, auto)
    _KERNELS.setdefault(primitive, []).append(kernel)


def _every_case(*args, platform, **params):
    return True


def register_backend(backend: str, unavailable_reason: Callable[[], str | None], *,
                     lowering_scope: Callable | None = None):
    """Declare how to tell whether `backend` can run here (None means it can) and,
    optionally, a context manager factory entered while its kernels are lowered
    (e.g. to scope a warnings filter to the backend's own lowering)."""
    _check_name(backend)
    _AVAILABILITY[backend] = unavailable_reason
    if lowering_scope is not None:
        _LOWERING_SCOPES[backend] = lowering_scope


def lowering_scope(impl):
    """The context to lower `impl` (a `select` result, or None) in."""
    scope = _LOWERING_SCOPES.get(getattr(impl, "backend", None))
    return scope() if scope is not None else contextlib.nullcontext()


def declare_not_built(backend: str, why: str):
    """`backend` does not exist in this build (e.g. "metal" off macOS): an op asking
    for it gets an error saying `why`, and listings keep it apart from real backends."""
    _check_name(backend)
    _NOT_BUILT[backend] = why
    _AVAILABILITY.pop(backend, None)


def not_built_backends() -> dict[str, str]:
    """The known backends that this build of jaxquant does not have, with why."""
    return dict(_NOT_BUILT)


def _check_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; expected one of {list(BACKENDS)}")


def unavailable_reason(backend: str) -> str | None:
    _check_name(backend)
    if backend in _NOT_BUILT:
        return f"not built: {_NOT_BUILT[backend]}"
    probe = _AVAILABILITY.get(backend)
    if probe is None:
        return f"the {backend!r} backend is not installed in this build of jaxquant"
    return probe()


def available_backends() -> list[str]:
    """The backends that can run here, in preference order (never one this build does
    not have, such as metal off macOS)."""
    return [b for b in BACKENDS if unavailable_reason(b) is None]


@contextlib.contextmanager
def backend(name: str | None):
    """`with jq.backend("pallas"):` makes `name` the default for ops traced inside."""
    if name is not None:
        _check_name(name)
    if _STATE is not None:
        with _STATE(name):
            yield
        return
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def resolve_backend(explicit: str | None, primitive: str | None = None) -> str | None:
    """The backend an op bound now should use: the argument, else `with
    jq.backend(...)`, else $JAXQUANT_BACKEND, else None (automatic).
    Raises if the chosen backend cannot run here. A backend chosen by scope (not
    the argument) that has no kernel at all for `primitive` leaves it to the
    reference: a model run under `with jq.backend("ffi")` keeps working when it
    calls an op that backend does not serve (fused ops pass no `primitive`: their
    fallback is the unfused ops on the chosen backend)."""
    name = explicit if explicit is not None else _current()
    if name is None:
        name = os.environ.get(ENV_VAR) or None
    if name is None or name == "auto":
        return None
    _check_name(name)
    why = unavailable_reason(name)
    if why is not None:
        raise RuntimeError(f"backend={name!r} cannot run here: {why}. "
                           f"Available: {available_backends()}")
    if (explicit is None and primitive is not None and name != "reference"
            and not any(k.backend == name for k in _KERNELS.get(primitive, ()))):
        return "reference"
    return name


def select(primitive: str, backend: str | None, platform: str, args, params, *,
           required: bool = True):
    """The kernel to lower with, as impl(*args, **params) with `platform` bound (and
    its backend's name as `.backend`), or None for the reference. `required`: a
    backend with no kernel for the primitive here is an error."""
    if backend == "reference":
        return None
    candidates = [k for k in _KERNELS.get(primitive, ()) if platform in k.platforms
                  and (backend is None or k.backend == backend)]
    if backend is not None and not candidates and required:
        raise RuntimeError(f"backend={backend!r} has no kernel for {primitive} on platform "
                           f"{platform!r}")
    for k in sorted(candidates, key=lambda k: -k.priority):
        if not k.applies(*args, platform=platform, **params):
            continue
        if backend is None and k.auto is not None and not k.auto(*args, platform=platform,
                                                                 **params):
            continue
        bound = functools.partial(k.impl, platform=platform)
        bound.backend = k.backend
        return bound
    return None
