"""Static arguments: Python values fixed when a function is traced.

jaxquant's ops take their shape-, format- and kernel-choosing arguments as
static parameters of a primitive (``transpose``, ``mode``, ``bits``,
``group_size``, ``eps``, ...). Under ``jax.jit`` such an argument must not be a
jitted function's array argument; where it is, the op says which one and how to
mark it static, instead of JAX's generic tracer error. (A string passed to a
jitted function never reaches jaxquant: JAX itself refuses it, naming the
argument.)
"""

from __future__ import annotations

import jax
import numpy as np


def require_static(name: str, value, fn: str):
    """`value` unchanged; TypeError naming `name` if it is a traced value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} of jq.{fn} is a static argument (a Python value fixed at trace time); "
            f"got a traced value {value}. Under jax.jit, mark it static: "
            f"jax.jit(f, static_argnames=({name!r},)), or close over it "
            f"(functools.partial(jq.{fn}, {name}=...)).")
    return value


def require_bool(name: str, value, fn: str) -> bool:
    """A static flag as a bool: True/False (Python or NumPy), or 0/1; TypeError for
    anything else (a string such as "no" would otherwise count as True)."""
    require_static(name, value, fn)
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer))
                                               and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} of jq.{fn} must be a bool; got {value!r}")
