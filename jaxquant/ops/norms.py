"""rms_norm, add_rms_norm, gated_rms_norm (docs/ops.md).

Statistics in float32 (float64 for float64 inputs). The norms differentiate
through their reference definition: the primal comes from the primitive (and
so from a kernel where one is chosen), the tangent from `jax.jvp` of the
reference.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.ops.common import (check_x, compute_dtype, jvp_through_reference,
                                 to_front_or_broadcast)
from jaxquant.primitive import Op
from jaxquant.sharding import Dims, Factors
from jaxquant.static_args import require_static

ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def _normalize(xf, weight, eps, weight_offset, group_size=None):
    if group_size is not None:
        grouped = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group_size, group_size)
        ms = jnp.mean(grouped * grouped, axis=-1, keepdims=True)
        y = (grouped * jax.lax.rsqrt(ms + eps)).reshape(xf.shape)
    else:
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (weight.astype(xf.dtype) + weight_offset)
    return y


def rms_norm_reference(x, weight, *, eps, weight_offset):
    xf = x.astype(compute_dtype(x.dtype))
    return _normalize(xf, weight, eps, weight_offset).astype(x.dtype)


def add_rms_norm_reference(x, residual, weight, *, eps, weight_offset):
    h = (x + residual).astype(residual.dtype)
    hf = h.astype(compute_dtype(h.dtype))
    return _normalize(hf, weight, eps, weight_offset).astype(h.dtype), h


def gated_rms_norm_reference(x, gate, weight, *, eps, weight_offset, activation,
                             norm_before_gate, group_size):
    acc = compute_dtype(jnp.promote_types(x.dtype, gate.dtype))
    xf, g = x.astype(acc), ACTIVATIONS[activation](gate.astype(acc))
    if norm_before_gate:
        y = _normalize(xf, weight, eps, weight_offset, group_size) * g
    else:
        y = _normalize(xf * g, weight, eps, weight_offset, group_size)
    return y.astype(gate.dtype)


# Sharding rules (jaxquant/sharding.py): which operand and result dimensions are
# the same logical axis, and which may split.


def norm_factors(n_rows: int, n_results: int):
    def factors(*args, **params):
        x = args[0]
        sizes = {f"m{i}": s for i, s in enumerate(x.shape[:-1])}
        sizes["d"] = x.shape[-1]
        row = Dims([(f"m{i}",) for i in range(x.ndim - 1)] + [("d",)])
        ops = [row] * n_rows + [None if a is None else Dims([("d",)]) for a in args[n_rows:]]
        # The hidden axis is reduced over inside the op: it does not split.
        return Factors(ops, [row] * n_results, sizes, replicated=("d",),
                       priority=tuple(range(n_rows)))
    return factors


rms_norm_op = Op("rms_norm", rms_norm_reference, factors=norm_factors(1, 1))
add_rms_norm_op = Op("add_rms_norm", add_rms_norm_reference, multiple_results=True,
                     factors=norm_factors(2, 2))
gated_rms_norm_op = Op("gated_rms_norm", gated_rms_norm_reference, factors=norm_factors(2, 1))


# ---------------------------------------------------------------------------
# Public functions.


def check_norm_args(x, weight, eps, weight_offset, fn, weight_name="weight"):
    x = check_x(x)
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dimension; got shape {x.shape}")
    if weight is not None:
        weight = check_x(weight, weight_name)
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"{weight_name} must have shape {x.shape[-1:]} (x's last axis); "
                             f"got {weight.shape}")
    for name, v in (("eps", eps), ("weight_offset", weight_offset)):
        # static parameters: a Python or NumPy real scalar, never a (traced) array
        require_static(name, v, fn)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a real scalar (Python or NumPy, static); got {v!r}")
        if not np.isfinite(v):  # NaN would pass `eps < 0` and fill the output with NaN
            raise ValueError(f"{name} must be finite; got {v}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    return x, weight


def rms_norm(x, weight=None, eps: float = 1e-6, weight_offset: float = 0.0, *,
             backend: str | None = None):
    """y = x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset), in x.dtype.

    Static (Python values, not traced under jax.jit): eps, weight_offset, backend."""
    x, weight = check_norm_args(x, weight, eps, weight_offset, "rms_norm")
    return rms_norm_op.bind(x, weight, backend=backend, eps=float(eps),
                            weight_offset=float(weight_offset))


def add_rms_norm(x, residual, weight=None, eps: float = 1e-6, weight_offset: float = 0.0, *,
                 backend: str | None = None):
    """h = (x + residual) in residual.dtype; returns (rms_norm(h, weight), h).

    Static (Python values, not traced under jax.jit): eps, weight_offset, backend."""
    x, weight = check_norm_args(x, weight, eps, weight_offset, "add_rms_norm")
    residual = check_x(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {x.shape}; got {residual.shape}")
    y, h = add_rms_norm_op.bind(x, residual, weight, backend=backend, eps=float(eps),
                                weight_offset=float(weight_offset))
    return y, h


def gated_rms_norm(x, gate, weight=None, eps: float = 1e-6, weight_offset: float = 0.0,
                   activation: str = "silu", norm_before_gate: bool = True,
                   group_size: int | None = None, *, backend: str | None = None):
    """norm_before_gate: rms_norm(x, weight) * act(gate); else rms_norm(x * act(gate), weight).
    group_size normalizes within groups of the last axis. Output in gate's dtype.

    Static (Python values, not traced under jax.jit): eps, weight_offset, activation,
    norm_before_gate, group_size, backend."""
    x, weight = check_norm_args(x, weight, eps, weight_offset, "gated_rms_norm")
    require_static("norm_before_gate", norm_before_gate, "gated_rms_norm")
    require_static("group_size", group_size, "gated_rms_norm")
    gate = check_x(gate, "gate")
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {x.shape}; got {gate.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not known; expected one of "
                         f"{sorted(ACTIVATIONS)}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 \
                or x.shape[-1] % group_size:
            raise ValueError(f"group_size={group_size!r} must be a positive int dividing x's "
                             f"last axis ({x.shape[-1]})")
    return gated_rms_norm_op.bind(x, gate, weight, backend=backend, eps=float(eps),
                                  weight_offset=float(weight_offset), activation=activation,
                                  norm_before_gate=bool(norm_before_gate),
                                  group_size=group_size)


# ---------------------------------------------------------------------------
# Batching (rows fold into leading axes) and differentiation.


def _rowwise_batch(op: Op, n_rows: int):
    """The first `n_rows` args are row operands [..., D]; the rest (weight) must be
    unbatched for the batch to fold into the leading axes."""
    def rule(args, dims, *, backend, **params):
        if any(d is not None for d in dims[n_rows:]):
            return None
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        rows = [to_front_or_broadcast(a, d, size) for a, d in zip(args[:n_rows], dims[:n_rows])]
        out = op.bind(*rows, *args[n_rows:], backend=backend, **params)
        return out, ([0] * len(out) if op.multiple_results else 0)
    return rule


for _op, _rows in ((rms_norm_op, 1), (add_rms_norm_op, 2), (gated_rms_norm_op, 2)):
    _op.batch_rule = _rowwise_batch(_op, _rows)
    jvp_through_reference(_op)
