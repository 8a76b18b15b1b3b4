"""Fused decode ops: rms_norm_qmm, qmm_swiglu, rms_norm_qmm_swiglu, qmm_add and
gather_qmm_swiglu (docs/fused.md).

Each is a primitive whose reference is the composition of the unfused
references (docs/ops.md: a fused op equals that composition to rounding):

- rms_norm_qmm(x, norm_weight, qw) == qmm(rms_norm(x, norm_weight), qw): the
  normalized x is rounded to x's dtype before the product, as the unfused ops
  do;
- qmm_swiglu(x, qw, bias) splits y = qmm(x, qw) (+ bias, in float32) into
  gate and up halves along N and returns act(gate, up) in x's dtype;
- rms_norm_qmm_swiglu(x, norm_weight, qw, bias) == qmm_swiglu(rms_norm(x,
  norm_weight), qw, bias): a pre-norm MLP's norm and gate+up projection;
- qmm_add(x, qw, addend) == qmm(x, qw) + addend, the product rounded to x's dtype
  before the add as the two ops apart round it (a projection into the residual
  stream);
- gather_qmm_swiglu(x, qw, indices, bias) is the same epilogue on
  y = gather_qmm(x, qw, indices) with each slot's expert's bias row, bias[indices]
  (a routed MoE's gate+up projection at decode).

A backend with a fused kernel for the case runs it (the CUDA GEMV on the
`cuda_mma` layout: jaxquant/ffi/mma.py); any other case runs the unfused
primitives, each on its own best kernel for the backend asked for
(`Op(..., composition=...)`), and `backend="reference"` the reference.
Differentiation goes through the reference, like the norms'.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.ops.common import (check_x, compute_dtype, default_precision,
                                 jvp_through_reference, move_to_front, require_quantized,
                                 to_front_or_broadcast)
from jaxquant.ops.norms import check_norm_args, rms_norm_op, rms_norm_reference
from jaxquant.ops.qmm import (check_gather_args, gather_batch, gather_factors, gather_qmm_op,
                              gather_qmm_reference, qmm_factors, qmm_op, qmm_reference)
from jaxquant.primitive import Op
from jaxquant.sharding import Dims, Factors
from jaxquant.static_args import require_static

SWIGLU_ACTIVATIONS = ("silu", "gpt_oss")


def swiglu(gate, up, *, activation, limit, alpha):
    """The gated activation of gate and up (same dtype, the compute dtype).

    silu: silu(gate) * up. gpt_oss (gpt-oss's clamped SwiGLU): gate clamped above
    at limit, up to [-limit, limit] (limit None: no clamp), then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def rms_norm_qmm_reference(x, norm_weight, qw, *, eps, weight_offset, precision):
    h = rms_norm_reference(x, norm_weight, eps=eps, weight_offset=weight_offset)
    return qmm_reference(h, qw, transpose=True, precision=precision)


def _swiglu_epilogue(y, bias, *, activation, limit, alpha, dtype):
    """y [..., 2I] (qmm's output, in x's dtype) -> [..., I] in `dtype`."""
    acc = compute_dtype(dtype)
    y = y.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    gate, up = jnp.split(y, 2, axis=-1)
    return swiglu(gate, up, activation=activation, limit=limit, alpha=alpha).astype(dtype)


def qmm_swiglu_reference(x, qw, bias, *, activation, limit, alpha, precision):
    y = qmm_reference(x, qw, transpose=True, precision=precision)
    return _swiglu_epilogue(y, bias, activation=activation, limit=limit, alpha=alpha,
                            dtype=x.dtype)


def rms_norm_qmm_swiglu_reference(x, norm_weight, qw, bias, *, eps, weight_offset, activation,
                                  limit, alpha, precision):
    h = rms_norm_reference(x, norm_weight, eps=eps, weight_offset=weight_offset)
    return qmm_swiglu_reference(h, qw, bias, activation=activation, limit=limit, alpha=alpha,
                                precision=precision)


def _add(y, addend):
    """y + addend in the compute dtype, rounded to y's dtype (a jnp add of the two)."""
    acc = compute_dtype(y.dtype)
    return (y.astype(acc) + addend.astype(acc)).astype(y.dtype)


def qmm_add_reference(x, qw, addend, *, precision):
    return _add(qmm_reference(x, qw, transpose=True, precision=precision), addend)


def _expert_bias(bias, qw, indices):
    """Each slot's bias row: bias [E, N] at indices [T, k] -> [T, k, N] (an id outside
    [0, E) reads row 0; gather_qmm's row is NaN there anyway)."""
    if bias is None:
        return None
    valid = (indices >= 0) & (indices < qw.shape[0])
    return bias[jnp.where(valid, indices, 0)]


def gather_qmm_swiglu_reference(x, qw, indices, bias, *, activation, limit, alpha, precision):
    y = gather_qmm_reference(x, qw, indices, transpose=True, precision=precision)
    return _swiglu_epilogue(y, _expert_bias(bias, qw, indices), activation=activation,
                            limit=limit, alpha=alpha, dtype=x.dtype)


def _rms_norm_qmm_unfused(x, norm_weight, qw, *, backend, eps, weight_offset, precision):
    h = rms_norm_op.bind(x, norm_weight, backend=backend, eps=eps, weight_offset=weight_offset)
    return qmm_op.bind(h, qw, backend=backend, transpose=True, precision=precision)


def _qmm_swiglu_unfused(x, qw, bias, *, backend, activation, limit, alpha, precision):
    y = qmm_op.bind(x, qw, backend=backend, transpose=True, precision=precision)
    return _swiglu_epilogue(y, bias, activation=activation, limit=limit, alpha=alpha,
                            dtype=x.dtype)


def _rms_norm_qmm_swiglu_unfused(x, norm_weight, qw, bias, *, backend, eps, weight_offset,
                                 activation, limit, alpha, precision):
    h = rms_norm_op.bind(x, norm_weight, backend=backend, eps=eps, weight_offset=weight_offset)
    return qmm_swiglu_op.bind(h, qw, bias, backend=backend, activation=activation, limit=limit,
                              alpha=alpha, precision=precision)


def _qmm_add_unfused(x, qw, addend, *, backend, precision):
    return _add(qmm_op.bind(x, qw, backend=backend, transpose=True, precision=precision), addend)


def gather_qmm_swiglu_unfused(x, qw, indices, bias, *, backend, activation, limit, alpha,
                               precision):
    y = gather_qmm_op.bind(x, qw, indices, backend=backend, transpose=True, precision=precision)
    return _swiglu_epilogue(y, _expert_bias(bias, qw, indices), activation=activation,
                            limit=limit, alpha=alpha, dtype=x.dtype)


# Sharding rules (jaxquant/sharding.py): which operand and result dimensions are
# the same logical axis, and which may split.


def rms_norm_qmm_factors(x, norm_weight, qw, *, eps, weight_offset, precision):
    """Column-parallel like qmm over N; K does not split (the norm reduces over it
    before the product)."""
    f = qmm_factors(x, qw, transpose=True, precision=precision)
    xdims, qdims = f.operands
    wdims = None if norm_weight is None else Dims([xdims[-1]])
    return Factors([xdims, wdims, qdims], f.results, f.sizes,
                   replicated=f.replicated + ("g",), allowed=f.allowed,
                   priority=(1,) if norm_weight is None else (2,))  # qw's data leaf


def qmm_swiglu_factors(x, qw, bias, *, activation, limit, alpha, precision):
    """Rows split; N does not (a shard of the rows [0, 2I) is not a gate half and an
    up half), nor K (the activation follows the sum)."""
    f = qmm_factors(x, qw, transpose=True, precision=precision)
    xdims, qdims = f.operands
    f.sizes["i"] = qw.shape[0] // 2
    out = Dims(list(f.results[0][:-1]) + [("i",)])
    bdims = None if bias is None else Dims([("r",)])
    return Factors([xdims, qdims, bdims], [out], f.sizes,
                   replicated=f.replicated + ("g", "r", "i"), priority=(1,), allowed=f.allowed)


def rms_norm_qmm_swiglu_factors(x, norm_weight, qw, bias, *, eps, weight_offset, activation,
                                limit, alpha, precision):
    """qmm_swiglu's (rows split, N and K not), with the norm weight along K."""
    f = qmm_swiglu_factors(x, qw, bias, activation=activation, limit=limit, alpha=alpha,
                           precision=precision)
    xdims, qdims, bdims = f.operands
    wdims = None if norm_weight is None else Dims([xdims[-1]])
    return Factors([xdims, wdims, qdims, bdims], f.results, f.sizes, replicated=f.replicated,
                   priority=(1,) if norm_weight is None else (2,), allowed=f.allowed)


def qmm_add_factors(x, qw, addend, *, precision):
    """qmm's, the addend as the output; K does not split (each shard's partial product
    would be added to the addend, which is to be added once)."""
    f = qmm_factors(x, qw, transpose=True, precision=precision)
    xdims, qdims = f.operands
    return Factors([xdims, qdims, f.results[0]], f.results, f.sizes,
                   replicated=f.replicated + ("g",), priority=(1,), allowed=f.allowed)


def gather_qmm_swiglu_factors(x, qw, indices, bias, *, activation, limit, alpha, precision):
    """Tokens split; experts do not (each shard's activation needs its slots' whole
    sums: an expert-parallel partial sum would be summed after the activation), nor
    N or K (as qmm_swiglu's)."""
    f = gather_factors(x, qw, indices, transpose=True, precision=precision)
    xdims, qdims, idims = f.operands
    f.sizes["i"] = qw.shape[1] // 2
    out = Dims(list(f.results[0][:-1]) + [("i",)])
    bdims = None if bias is None else Dims([("e",), ("r",)])
    return Factors([xdims, qdims, idims, bdims], [out], f.sizes,
                   replicated=f.replicated + ("e", "g", "r", "i"), priority=(1,),
                   allowed=f.allowed)


rms_norm_qmm_op = Op("rms_norm_qmm", rms_norm_qmm_reference, composition=_rms_norm_qmm_unfused,
                     factors=rms_norm_qmm_factors)
qmm_swiglu_op = Op("qmm_swiglu", qmm_swiglu_reference, composition=_qmm_swiglu_unfused,
                   factors=qmm_swiglu_factors)
rms_norm_qmm_swiglu_op = Op("rms_norm_qmm_swiglu", rms_norm_qmm_swiglu_reference,
                            composition=_rms_norm_qmm_swiglu_unfused,
                            factors=rms_norm_qmm_swiglu_factors)
qmm_add_op = Op("qmm_add", qmm_add_reference, composition=_qmm_add_unfused,
                factors=qmm_add_factors)
gather_qmm_swiglu_op = Op("gather_qmm_swiglu", gather_qmm_swiglu_reference,
                          composition=gather_qmm_swiglu_unfused, factors=gather_qmm_swiglu_factors)


# ---------------------------------------------------------------------------
# Public functions.


def _check_qw(x, qw):
    require_quantized("qw", qw, ndim=2)
    if x.ndim < 1 or x.shape[-1] != qw.shape[-1]:
        raise ValueError(f"x's last axis must be K={qw.shape[-1]} (qw.shape={qw.shape}); "
                         f"got x.shape={x.shape}")


def rms_norm_qmm(x, norm_weight, qw, *, eps: float = 1e-6, weight_offset: float = 0.0,
                 backend: str | None = None):
    """qmm(rms_norm(x, norm_weight, eps, weight_offset), qw): x [..., K], norm_weight
    [K] or None, qw [N, K] -> [..., N] in x's dtype. The normalized x is rounded to
    x's dtype before the product, as the two ops apart round it.

    Static (Python values, not traced under jax.jit): eps, weight_offset, backend."""
    x, norm_weight = check_norm_args(x, norm_weight, eps, weight_offset, "rms_norm_qmm",
                                   weight_name="norm_weight")
    _check_qw(x, qw)
    return rms_norm_qmm_op.bind(x, norm_weight, qw, backend=backend, eps=float(eps),
                                weight_offset=float(weight_offset),
                                precision=default_precision())


def qmm_swiglu(x, qw, *, activation: str = "silu", limit: float | None = None,
               alpha: float = 1.702, bias=None, backend: str | None = None):
    """Gate and up as one product with its activation: x [..., K], qw [2I, K] (gate
    rows [0, I), then up rows [I, 2I)), bias [2I] or None -> [..., I] in x's dtype.

    y = qmm(x, qw) (+ bias, in float32); gate, up = its two halves;
    "silu": silu(gate) * up; "gpt_oss": gate = min(gate, limit),
    up = clip(up, -limit, limit) (limit None: no clamp),
    (up + 1) * gate * sigmoid(alpha * gate). float32 math (float64 for float64 x).

    Static (Python values, not traced under jax.jit): activation, limit, alpha,
    backend."""
    x = check_x(x)
    _check_qw(x, qw)
    params = _swiglu_params("qmm_swiglu", activation, limit, alpha, qw.shape[0], qw.shape)
    bias = _check_bias(bias, qw.shape[:1], "qw's rows")
    return qmm_swiglu_op.bind(x, qw, bias, backend=backend, **params)


def rms_norm_qmm_swiglu(x, norm_weight, qw, *, eps: float = 1e-6, weight_offset: float = 0.0,
                        activation: str = "silu", limit: float | None = None,
                        alpha: float = 1.702, bias=None, backend: str | None = None):
    """qmm_swiglu(rms_norm(x, norm_weight, eps, weight_offset), qw, ...): a pre-norm MLP's
    norm, gate and up projections and activation in one op. x [..., K], norm_weight [K]
    or None, qw [2I, K] (gate rows, then up rows), bias [2I] or None -> [..., I] in x's
    dtype. The normalized x is rounded to x's dtype before the product, as the two ops
    apart round it; the rest is qmm_swiglu's.

    Static (Python values, not traced under jax.jit): eps, weight_offset, activation,
    limit, alpha, backend."""
    x, norm_weight = check_norm_args(x, norm_weight, eps, weight_offset, "rms_norm_qmm_swiglu",
                                   weight_name="norm_weight")
    _check_qw(x, qw)
    params = _swiglu_params("rms_norm_qmm_swiglu", activation, limit, alpha, qw.shape[0],
                            qw.shape)
    bias = _check_bias(bias, qw.shape[:1], "qw's rows")
    return rms_norm_qmm_swiglu_op.bind(x, norm_weight, qw, bias, backend=backend,
                                       eps=float(eps), weight_offset=float(weight_offset),
                                       **params)


def qmm_add(x, qw, addend, *, backend: str | None = None):
    """qmm(x, qw) + addend: x [..., K], qw [N, K], addend [..., N] in x's dtype ->
    [..., N] in x's dtype. The product is rounded to x's dtype before the add, as the two
    ops apart round it (for float64 x, float64 throughout). A projection into a
    residual stream (the attention's output projection, an MLP's down projection) in
    one kernel where one exists.

    Static (Python values, not traced under jax.jit): backend."""
    x = check_x(x)
    _check_qw(x, qw)
    addend = check_x(addend, "addend")
    out = (*x.shape[:-1], qw.shape[0])
    if addend.shape != out or addend.dtype != x.dtype:
        raise ValueError(f"addend must have the product's shape {out} and x's dtype "
                         f"{x.dtype}; got {addend.dtype} {addend.shape}")
    return qmm_add_op.bind(x, qw, addend, backend=backend, precision=default_precision())


def gather_qmm_swiglu(x, qw, indices, *, activation: str = "silu", limit: float | None = None,
                      alpha: float = 1.702, bias=None, backend: str | None = None):
    """A routed MoE's gate and up projections with their activation, at decode:
    qw [E, 2I, K] (each expert's gate rows [0, I), then up rows [I, 2I)), indices
    int [T, k], x [T, K] or [T, k, K], bias [E, 2I] or None -> [T, k, I] in x's dtype.

    y = gather_qmm(x, qw, indices) (+ bias[indices], in float32), then qmm_swiglu's
    activation of its two halves. An index outside [0, E) gives a NaN row (as
    gather_qmm) and reads nothing out of bounds.

    Static (Python values, not traced under jax.jit): activation, limit, alpha,
    backend."""
    x, indices, _ = check_gather_args("gather_qmm_swiglu", x, qw, indices)
    params = _swiglu_params("gather_qmm_swiglu", activation, limit, alpha, qw.shape[1],
                            qw.shape)
    bias = _check_bias(bias, qw.shape[:2], "qw's experts and rows")
    return gather_qmm_swiglu_op.bind(x, qw, indices, bias, backend=backend, **params)


def _swiglu_params(op, activation, limit, alpha, n, qw_shape):
    """The SwiGLU's static arguments checked (n: qw's rows, gate then up) -> the params."""
    for name, v in (("activation", activation), ("limit", limit), ("alpha", alpha)):
        require_static(name, v, op)
    if activation not in SWIGLU_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not known; expected one of "
                         f"{list(SWIGLU_ACTIVATIONS)}")
    if n % 2:
        raise ValueError(f"qw must have an even number of rows N=2I (gate rows, then up "
                         f"rows); got qw.shape={qw_shape}")
    _check_real("alpha", alpha)
    if limit is not None:
        _check_real("limit", limit)
        if activation != "gpt_oss":
            raise ValueError(f"limit={limit!r} applies to activation='gpt_oss' only; got "
                             f"activation={activation!r}")
        if not limit > 0:
            raise ValueError(f"limit must be > 0; got {limit}")
    return dict(activation=activation, limit=None if limit is None else float(limit),
                alpha=float(alpha), precision=default_precision())


def _check_bias(bias, shape, what):
    if bias is None:
        return None
    bias = check_x(bias, "bias")
    if bias.shape != tuple(shape):
        raise ValueError(f"bias must have shape {tuple(shape)} ({what}); got {bias.shape}")
    return bias


def _check_real(name, v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real scalar (Python or NumPy, static); got {v!r}")
    if not np.isfinite(v):
        raise ValueError(f"{name} must be finite; got {v}")


# ---------------------------------------------------------------------------
# Batching: a batch of x folds into its leading axes (the weights unbatched).


def _rows_batch(op: Op):
    def rule(args, dims, *, backend, **params):
        x, *rest = args
        x_dim, *rest_dims = dims
        if any(jax.tree_util.tree_leaves(d) for d in rest_dims):
            return None  # batched weights: vmap of the reference
        return op.bind(move_to_front(x, x_dim), *rest, backend=backend, **params), 0
    return rule


def _qmm_add_batch(args, dims, *, backend, **params):
    """A batch of x and the addend folds into their leading axes (the weight unbatched)."""
    x, qw, addend = args
    x_dim, q_dim, a_dim = dims
    if jax.tree_util.tree_leaves(q_dim):
        return None  # batched weights: vmap of the reference
    size = x.shape[x_dim] if x_dim is not None else addend.shape[a_dim]
    return qmm_add_op.bind(to_front_or_broadcast(x, x_dim, size), qw,
                           to_front_or_broadcast(addend, a_dim, size), backend=backend,
                           **params), 0


for _op in (rms_norm_qmm_op, qmm_swiglu_op, rms_norm_qmm_swiglu_op):
    _op.batch_rule = _rows_batch(_op)
qmm_add_op.batch_rule = _qmm_add_batch
gather_qmm_swiglu_op.batch_rule = functools.partial(gather_batch, gather_qmm_swiglu_op)
for _op in (rms_norm_qmm_op, qmm_swiglu_op, rms_norm_qmm_swiglu_op, qmm_add_op,
            gather_qmm_swiglu_op):
    jvp_through_reference(_op)
