"""Backend registry and selection (DESIGN.md §2, §5).

A backend package registers, per primitive and platform, a kernel: a
jnp-traceable function with the reference's signature, plus a predicate
saying which cases it takes. Nothing else in the code base knows which
backends exist.

Selection, at lowering time, for a primitive bound with `backend=b`:
- b is None ("auto"): the highest-priority registered kernel for this
  platform whose `applies` accepts the case, else the reference;
- b names a backend: its kernel for this platform if `applies` accepts the
  case, else the reference (a backend serves what it supports: float64,
  for one, always runs on the reference); a backend with no kernel for this
  primitive on this platform is an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Callable

BACKENDS = ("reference", "pallas", "ffi", "metal")
ENV_VAR = "JAXQUANT_BACKEND"


@dataclasses.dataclass(frozen=True)
class Kernel:
    backend: str
    platforms: tuple[str, ...]
    impl: Callable
    applies: Callable
    priority: int


# primitive name -> list of kernels
_KERNELS: dict[str, list[Kernel]] = {}
# backend name -> () -> str | None: why the backend cannot run here (None: it can)
_AVAILABILITY: dict[str, Callable[[], str | None]] = {"reference": lambda: None}
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxquant_backend",
                                                                     default=None)


def register(primitive: str, backend: str, platforms, impl, applies=None, priority: int = 0):
    """Register `impl` as `backend`'s kernel for `primitive` on `platforms`.

    impl(*args, **params) takes the op's structured arguments (QuantizedArray
    included) like the reference; applies(*args, **params) -> bool sees
    ShapedArrays in place of arrays.
    """
    _check_name(backend)
    kernel = Kernel(backend, tuple(platforms), impl, applies or (lambda *a, **k: True), priority)
    _KERNELS.setdefault(primitive, []).append(kernel)


def register_backend(backend: str, unavailable_reason: Callable[[], str | None]):
    """Declare how to tell whether `backend` can run here (None means it can)."""
    _check_name(backend)
    _AVAILABILITY[backend] = unavailable_reason


def _check_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; expected one of {list(BACKENDS)}")


def unavailable_reason(backend: str) -> str | None:
    _check_name(backend)
    probe = _AVAILABILITY.get(backend)
    if probe is None:
        return f"the {backend!r} backend is not installed in this build of jaxquant"
    return probe()


def available_backends() -> list[str]:
    """The backends that can run here, in preference order."""
    return [b for b in BACKENDS if unavailable_reason(b) is None]


@contextlib.contextmanager
def backend(name: str | None):
    """`with jq.backend("pallas"):` makes `name` the default for ops traced inside."""
    if name is not None:
        _check_name(name)
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def resolve_backend(explicit: str | None) -> str | None:
    """The backend an op bound now should use: the argument, else `with
    jq.backend(...)`, else $JAXQUANT_BACKEND, else None (automatic).
    Raises if the chosen backend cannot run here."""
    name = explicit if explicit is not None else _CURRENT.get()
    if name is None:
        name = os.environ.get(ENV_VAR) or None
    if name is None or name == "auto":
        return None
    _check_name(name)
    why = unavailable_reason(name)
    if why is not None:
        raise RuntimeError(f"backend={name!r} cannot run here: {why}. "
                           f"Available: {available_backends()}")
    return name


def select(primitive: str, backend: str | None, platform: str, args, params):
    """The kernel impl to lower with, or None for the reference."""
    if backend == "reference":
        return None
    candidates = [k for k in _KERNELS.get(primitive, ()) if platform in k.platforms
                  and (backend is None or k.backend == backend)]
    if backend is not None and not candidates:
        raise RuntimeError(f"backend={backend!r} has no kernel for {primitive} on platform "
                           f"{platform!r}")
    for k in sorted(candidates, key=lambda k: -k.priority):
        if k.applies(*args, **params):
            return k.impl
    return None
