"""qmm, gather_qmm, ragged_qmm: quantized matmuls; gather_matmul and ragged_matmul:
gather_qmm's and ragged_qmm's routed-MoE products on float (unquantized) expert
weights (docs/ops.md).

The three quantized ops are linear in x: their JVP is the op on the tangent,
their transpose is the op with `transpose` flipped, so `jax.grad` flows to x
(and through it to adapters on top of a frozen quantized base). There is
no derivative with respect to the quantized weights. gather_matmul's and
ragged_matmul's float weights differentiate too (through their references).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from jaxquant.ops.common import (batch_size, check_group_sizes, check_x, compute_dtype,
                                 default_precision, integer_ids, jvp_through_reference,
                                 move_to_front, narrow_indices, quantized_to_front,
                                 ragged_group_ends, require_quantized, to_front_or_broadcast)
from jaxquant.primitive import Op
from jaxquant.quantize import dequantize_reference
from jaxquant.quantized_array import QuantizedArray
from jaxquant.sharding import Dims, Factors, qw_dims
from jaxquant.static_args import require_bool


# ---------------------------------------------------------------------------
# References: the definition of each op. Each takes the dequantize it uses
# (dequantize(qw, dtype) -> [..., N, K] in dtype; default the jnp reference's), so
# a backend that only replaces the dequantize reuses the rest as it is.


def contract(x, w, transpose, precision, batch=0):
    """x [*B, ..., K] . w [*B, N, K] (transpose) or [*B, K, N] -> [*B, ..., N], float32 acc."""
    w_axis = w.ndim - 1 if transpose else w.ndim - 2
    dims = (((x.ndim - 1,), (w_axis,)), (tuple(range(batch)), tuple(range(batch))))
    return lax.dot_general(x, w, dims, precision=precision,
                           preferred_element_type=compute_dtype(x.dtype))


def qmm_reference(x, qw, *, transpose, precision, dequantize=dequantize_reference):
    w = dequantize(qw, dtype=x.dtype)
    return contract(x, w, transpose, precision, batch=qw.ndim - 2).astype(x.dtype)


def gather_qmm_reference(x, qw, indices, *, transpose, precision,
                         dequantize=dequantize_reference):
    num_experts = qw.shape[0]
    valid = (indices >= 0) & (indices < num_experts)
    w = dequantize(qw[jnp.where(valid, indices, 0)], dtype=x.dtype)  # [T, k, N, K]
    xs = jnp.broadcast_to(x[:, None, :], w.shape[:2] + x.shape[-1:]) if x.ndim == 2 else x
    # Per (token, slot) exactly qmm's contraction, so gather == qmm bit for bit.
    one = lambda xi, wi: contract(xi, wi, transpose, precision)
    y = jax.vmap(jax.vmap(one))(xs, w)
    return jnp.where(valid[..., None], y, jnp.nan).astype(x.dtype)


def gather_matmul_reference(x, w, indices, *, transpose, precision):
    """gather_qmm's definition with the float weights as they are (cast to x's dtype)."""
    return gather_qmm_reference(x, w, indices, transpose=transpose, precision=precision,
                                dequantize=lambda w, dtype: w.astype(dtype))


def ragged_qmm_reference(x, qw, group_sizes, *, transpose, precision,
                         dequantize=dequantize_reference):
    w = dequantize(qw, dtype=x.dtype)
    rhs = jnp.swapaxes(w, -1, -2) if transpose else w  # [E, K, N]
    ends = ragged_group_ends(group_sizes, x.shape[0])
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype))  # >= 0, summing to <= T
    y = lax.ragged_dot(x, rhs, sizes, precision=precision,
                       preferred_element_type=compute_dtype(x.dtype))
    return y.astype(x.dtype)


def ragged_matmul_reference(x, w, group_sizes, *, transpose, precision):
    """ragged_qmm's definition with the float weights as they are (cast to x's dtype)."""
    return ragged_qmm_reference(x, w, group_sizes, transpose=transpose, precision=precision,
                                dequantize=lambda w, dtype: w.astype(dtype))


# Sharding rules (jaxquant/sharding.py): which operand and result dimensions are
# the same logical axis, and which may split.


def qmm_factors(x, qw, *, transpose, precision):
    sizes, allowed = {}, {}
    nb = qw.ndim - 2
    lead = [f"b{i}" for i in range(nb)]
    for i, f in enumerate(lead):
        sizes[f] = qw.shape[i]
    rows = [f"m{i}" for i in range(x.ndim - 1 - nb)]
    for i, f in enumerate(rows):
        sizes[f] = x.shape[nb + i]
    qdims = qw_dims(qw, lead, "r", "g", sizes, allowed)
    sizes["r"] = qw.shape[-2]
    sizes["gk"] = qw.group_size
    grouped = ("g", "gk")
    # transpose: W [N, K] (rows r = N, groups along K); else W [K, N] (groups along N).
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    xdims = Dims([(f,) for f in lead + rows] + [k_dim])
    out = Dims([(f,) for f in lead + rows] + [n_dim])
    ops = [xdims, qdims]
    return Factors(ops, [out], sizes, contracted=(contracted,),
                   replicated=("gk", "gw"), priority=(1,), allowed=allowed)


def gather_factors(x, qw, indices, *, transpose, precision):
    sizes, allowed = {"e": qw.shape[0], "t": indices.shape[0], "s": indices.shape[1],
                      "r": qw.shape[1], "gk": qw.group_size}, {}
    qdims = qw_dims(qw, ["e"], "r", "g", sizes, allowed)
    grouped = ("g", "gk")
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    xdims = Dims([("t",), k_dim] if x.ndim == 2 else [("t",), ("s",), k_dim])
    out = Dims([("t",), ("s",), n_dim])
    return Factors([xdims, qdims, Dims([("t",), ("s",)])], [out], sizes,
                   contracted=(contracted, "e"),
                   replicated=("gk", "gw", "s"), priority=(1,), allowed=allowed)


def float_experts(w, transpose, sizes):
    """A float w [E, N, K] (or [E, K, N] with transpose=False): its e, n, k added to
    `sizes`, and its Dims. Unlike a quantized w, K splits anywhere (no groups)."""
    e, a, b = w.shape
    sizes.update(e=e, n=a if transpose else b, k=b if transpose else a)
    return Dims([("e",), ("n",), ("k",)] if transpose else [("e",), ("k",), ("n",)])


def gather_matmul_factors(x, w, indices, *, transpose, precision):
    """gather_qmm's factors on a float w."""
    sizes = {"t": indices.shape[0], "s": indices.shape[1]}
    wdims = float_experts(w, transpose, sizes)
    xdims = Dims([("t",), ("k",)] if x.ndim == 2 else [("t",), ("s",), ("k",)])
    return Factors([xdims, wdims, Dims([("t",), ("s",)])], [Dims([("t",), ("s",), ("n",)])],
                   sizes, contracted=("k", "e"), replicated=("s",), priority=(1,))


def ragged_matmul_factors(x, w, group_sizes, *, transpose, precision):
    """ragged_qmm's factors on a float w."""
    sizes = {"t": x.shape[0], "es": w.shape[0]}
    wdims = float_experts(w, transpose, sizes)
    # Token rows are grouped by expert in order, so they do not split (as ragged_qmm's).
    return Factors([Dims([("t",), ("k",)]), wdims, Dims([("es",)])], [Dims([("t",), ("n",)])],
                   sizes, contracted=("k", "e"), replicated=("t", "es"), priority=(1,))


def ragged_factors(x, qw, group_sizes, *, transpose, precision):
    sizes, allowed = {"e": qw.shape[0], "t": x.shape[0], "r": qw.shape[1],
                      "gk": qw.group_size}, {}
    qdims = qw_dims(qw, ["e"], "r", "g", sizes, allowed)
    grouped = ("g", "gk")
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    # Token rows are grouped by expert in order, so they do not split; every
    # shard reads all group sizes (its rows start after the other experts').
    sizes["es"] = qw.shape[0]
    return Factors([Dims([("t",), k_dim]), qdims, Dims([("es",)])], [Dims([("t",), n_dim])],
                   sizes, contracted=(contracted, "e"),
                   replicated=("gk", "gw", "t", "es"), priority=(1,), allowed=allowed)


qmm_op = Op("qmm", qmm_reference, factors=qmm_factors)
gather_qmm_op = Op("gather_qmm", gather_qmm_reference, factors=gather_factors)
ragged_qmm_op = Op("ragged_qmm", ragged_qmm_reference, factors=ragged_factors)
gather_matmul_op = Op("gather_matmul", gather_matmul_reference, factors=gather_matmul_factors)
ragged_matmul_op = Op("ragged_matmul", ragged_matmul_reference, factors=ragged_matmul_factors)


# ---------------------------------------------------------------------------
# Public functions: validate at trace time, bind one primitive.


def _k_axis(qw, transpose):
    return qw.shape[-1] if transpose else qw.shape[-2]


def _expert_args(op, x, qw, ids_name, ids, transpose):
    """The checks gather_qmm and ragged_qmm share: transpose static, qw [E, N, K]
    quantized, x an array, ids (indices, group_sizes) integer. Returns x, ids, K, transpose."""
    transpose = require_bool("transpose", transpose, op)
    require_quantized("qw", qw, ndim=3)
    x = check_x(x)
    ids = integer_ids(ids_name, ids)
    return x, ids, _k_axis(qw, transpose), transpose


def _float_expert_args(op, quantized_op, x, w, ids_name, ids, transpose):
    """_expert_args for the float ops (gather_matmul, ragged_matmul): w a float array
    [E, N, K] (or [E, K, N]). Returns x, w, ids, K, transpose."""
    transpose = require_bool("transpose", transpose, op)
    if isinstance(w, QuantizedArray):
        raise TypeError(f"w must be a float array; got a QuantizedArray (quantized experts "
                        f"go through jq.{quantized_op})")
    w = check_x(w, "w")
    if w.ndim != 3:
        raise ValueError(f"w must be [E, N, K] (or [E, K, N] with transpose=False); got "
                         f"shape {w.shape}")
    x = check_x(x)
    ids = integer_ids(ids_name, ids)
    return x, w, ids, w.shape[2] if transpose else w.shape[1], transpose


def _check_ragged_shapes(x, num_experts, group_sizes, k):
    """ragged_qmm's and ragged_matmul's: group_sizes [E], x [T, K], concrete sizes valid
    (checked in their own width, then narrowed). Returns group_sizes as a jax array."""
    if group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must be [E] = ({num_experts},); got {group_sizes.shape}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [T, K={k}]; got x.shape={x.shape}")
    check_group_sizes(group_sizes, x.shape[0])
    return jnp.asarray(group_sizes)


def _check_gather_shapes(x, w_name, w_shape, indices, k):
    """indices [T, k], x [T, K] or [T, k, K]. Returns indices as a jax array."""
    if indices.ndim != 2:
        raise ValueError(f"indices must be [T, k]; got shape {indices.shape}")
    t, slots = indices.shape
    if x.shape not in ((t, k), (t, slots, k)):
        raise ValueError(f"x must be [T, K] = {(t, k)} or [T, k, K] = {(t, slots, k)} "
                         f"(indices {indices.shape}, {w_name} {w_shape}); got x.shape={x.shape}")
    return narrow_indices(indices, w_shape[0])


def check_gather_args(op, x, qw, indices, transpose=True):
    """gather_qmm's checks (gather_qmm_swiglu's too): qw a QuantizedArray [E, N, K],
    indices integer [T, k], x [T, K] or [T, k, K]. Returns x, indices, transpose."""
    if hasattr(qw, "dtype") and not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a jaxquant.QuantizedArray (from jq.quantize); got a "
                        f"plain {type(qw).__name__} (float experts go through jq.gather_matmul)")
    x, indices, k, transpose = _expert_args(op, x, qw, "indices", indices, transpose)
    indices = _check_gather_shapes(x, "qw", qw.shape, indices, k)
    return x, indices, transpose


def qmm(x, qw, transpose: bool = True, *, backend: str | None = None):
    """y = x @ dequantize(qw).T (transpose=True, qw [N, K], x [..., K] -> [..., N])
    or x @ dequantize(qw) (transpose=False, qw [K, N]), like MLX's quantized_matmul.

    qw may carry leading batch axes [*B, N, K]; x is then [*B, M, K].
    Static (Python values, not traced under jax.jit): transpose, backend.
    """
    transpose = require_bool("transpose", transpose, "qmm")
    require_quantized("qw", qw, min_ndim=2)
    x = check_x(x)
    k = _k_axis(qw, transpose)
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x's last axis must be K={k} (qw.shape={qw.shape}, "
                         f"transpose={transpose}); got x.shape={x.shape}")
    if qw.ndim > 2 and (x.ndim != qw.ndim or x.shape[:-2] != qw.shape[:-2]):
        raise ValueError(f"with batched qw {qw.shape}, x must be [*B, M, K] with B="
                         f"{qw.shape[:-2]}; got x.shape={x.shape}")
    return qmm_op.bind(x, qw, backend=backend, transpose=bool(transpose),
                       precision=default_precision())


def gather_qmm(x, qw, indices, transpose: bool = True, *, backend: str | None = None):
    """MoE decode: out[t, j] = x[t] (or x[t, j]) @ dequantize(qw[indices[t, j]]).T.

    qw [E, N, K]; indices int [T, k]; x [T, K] or [T, k, K] -> [T, k, N].
    An index outside [0, E) gives a NaN row and reads nothing out of bounds.
    Static (Python values, not traced under jax.jit): transpose, backend.
    """
    x, indices, transpose = check_gather_args("gather_qmm", x, qw, indices, transpose)
    return gather_qmm_op.bind(x, qw, indices, backend=backend, transpose=bool(transpose),
                              precision=default_precision())


def gather_matmul(x, w, indices, transpose: bool = True, *, backend: str | None = None):
    """gather_qmm on float expert weights: out[t, j] = x[t] (or x[t, j]) @ w[indices[t, j]].T.

    w [E, N, K] (transpose=True) or [E, K, N], float32/float16/bfloat16 (float64 under
    x64), cast to x's dtype like `x @ w.astype(x.dtype).T`; indices int [T, k]; x [T, K]
    or [T, k, K] -> [T, k, N], float32 accumulation. An index outside [0, E) gives a NaN
    row and reads nothing out of bounds. Kernels read only the chosen experts' rows,
    where `w[indices]` in XLA copies them first (docs/ops.md).
    Static (Python values, not traced under jax.jit): transpose, backend.
    """
    x, w, indices, k, transpose = _float_expert_args("gather_matmul", "gather_qmm", x, w,
                                                     "indices", indices, transpose)
    indices = _check_gather_shapes(x, "w", w.shape, indices, k)
    return gather_matmul_op.bind(x, w, indices, backend=backend, transpose=bool(transpose),
                                 precision=default_precision())


def ragged_qmm(x, qw, group_sizes, transpose: bool = True, *, backend: str | None = None):
    """MoE prefill, like `lax.ragged_dot`: rows of x [T, K] are grouped by expert in
    order, group e has group_sizes[e] rows; rows past sum(group_sizes) are zero.
    qw [E, N, K] -> [T, N]. Concrete group sizes that are negative or sum past T raise
    ValueError; traced ones (under jit) count a negative size as 0 and are cut at T rows.
    Static (Python values, not traced under jax.jit): transpose, backend."""
    x, group_sizes, k, transpose = _expert_args("ragged_qmm", x, qw, "group_sizes",
                                                group_sizes, transpose)
    group_sizes = _check_ragged_shapes(x, qw.shape[0], group_sizes, k)
    return ragged_qmm_op.bind(x, qw, group_sizes, backend=backend, transpose=bool(transpose),
                              precision=default_precision())


def ragged_matmul(x, w, group_sizes, transpose: bool = True, *, backend: str | None = None):
    """ragged_qmm on float expert weights, like `lax.ragged_dot`: rows of x [T, K] are
    grouped by expert in order, group e has group_sizes[e] rows; rows past
    sum(group_sizes) are zero. w [E, N, K] (transpose=True) or [E, K, N],
    float32/float16/bfloat16 (float64 under x64), cast to x's dtype; float32
    accumulation -> [T, N] in x's dtype. Group sizes are checked like ragged_qmm's.
    Kernels read the experts in place, where `lax.ragged_dot` on a GPU transposes
    them and multiplies every row by every expert (docs/ops.md).
    Static (Python values, not traced under jax.jit): transpose, backend.
    """
    x, w, group_sizes, k, transpose = _float_expert_args(
        "ragged_matmul", "ragged_qmm", x, w, "group_sizes", group_sizes, transpose)
    group_sizes = _check_ragged_shapes(x, w.shape[0], group_sizes, k)
    return ragged_matmul_op.bind(x, w, group_sizes, backend=backend, transpose=bool(transpose),
                                 precision=default_precision())


# ---------------------------------------------------------------------------
# Batching: keep the primitive where the batch folds into token rows.


def _qmm_batch(args, dims, *, backend, transpose, precision):
    x, qw = args
    x_dim, qw_dims = dims
    nb = qw.ndim - 2
    bind = lambda x, qw: qmm_op.bind(x, qw, backend=backend, transpose=transpose,
                                     precision=precision)
    if not jax.tree_util.tree_leaves(qw_dims):
        if nb == 0:
            return bind(move_to_front(x, x_dim), qw), 0
        # x [*B, M, K]: the vmapped axis moves next to M and folds into it.
        x = jnp.moveaxis(x, x_dim, nb)
        v, m = x.shape[nb], x.shape[nb + 1]
        y = bind(x.reshape(*x.shape[:nb], v * m, x.shape[-1]), qw)
        return y.reshape(*y.shape[:nb], v, m, y.shape[-1]), nb
    # A batch of weights: qmm with a leading batch axis on qw and x.
    size = batch_size(args, dims)
    qw = quantized_to_front(qw, qw_dims, size)
    x = to_front_or_broadcast(x, x_dim, size)
    if nb > 0:
        return bind(x, qw), 0
    y = bind(x.reshape(size, -1, x.shape[-1]), qw)
    return y.reshape(*x.shape[:-1], y.shape[-1]), 0


def gather_batch(op, args, dims, *, backend, **params):
    """gather_qmm / gather_matmul / gather_qmm_swiglu (x, qw, indices, then operands
    per expert such as a bias) with a batch of tokens: the batch folds into the token
    axis. Batched weights (or per-expert operands): None, vmap of the reference."""
    x, qw, indices, *per_expert = args
    x_dim, qw_dims, i_dim, *per_expert_dims = dims
    if jax.tree_util.tree_leaves((qw_dims, per_expert_dims)):
        return None
    size = (x.shape[x_dim] if x_dim is not None else indices.shape[i_dim])
    x = to_front_or_broadcast(x, x_dim, size)
    indices = to_front_or_broadcast(indices, i_dim, size)
    y = op.bind(x.reshape(-1, *x.shape[2:]), qw, indices.reshape(-1, indices.shape[-1]),
                *per_expert, backend=backend, **params)
    return y.reshape(size, -1, *y.shape[1:]), 0


def _ragged_batch(op, args, dims, *, backend, transpose, precision):
    """ragged_qmm / ragged_matmul: lax.ragged_dot has no general batching rule, so map
    over the batch, on the primitive."""
    fronted = jax.tree_util.tree_map(lambda a, d: None if d is None else move_to_front(a, d),
                                     args, dims, is_leaf=lambda d: d is None)

    def one(batched):
        full = jax.tree_util.tree_map(lambda a, b: a if b is None else b, args, batched,
                                      is_leaf=lambda b: b is None)
        return op.bind(*full, backend=backend, transpose=transpose, precision=precision)
    return jax.lax.map(one, fronted), 0


qmm_op.batch_rule = _qmm_batch
gather_qmm_op.batch_rule = functools.partial(gather_batch, gather_qmm_op)
gather_matmul_op.batch_rule = functools.partial(gather_batch, gather_matmul_op)
ragged_qmm_op.batch_rule = functools.partial(_ragged_batch, ragged_qmm_op)
ragged_matmul_op.batch_rule = functools.partial(_ragged_batch, ragged_matmul_op)


# ---------------------------------------------------------------------------
# Differentiation: linear in x.


def _linear_in_x(op: Op):
    def jvp(primals, tangents, *, tree, backend, **params):
        if any(type(t) is not ad.Zero for t in tangents[1:]):
            raise ValueError(f"jaxquant.{op.name} has no derivative with respect to the "
                             "quantized weights (or indices); differentiate with respect to "
                             "x, or keep the quantized arrays out of the differentiated inputs")
        y = op.primitive.bind(*primals, tree=tree, backend=backend, **params)
        dx = tangents[0]
        if type(dx) is ad.Zero:
            return y, ad.Zero(jax.core.get_aval(y).to_tangent_aval())
        return y, op.primitive.bind(dx, *primals[1:], tree=tree, backend=backend, **params)

    def transpose(ct, x, *rest, tree, backend, transpose, precision):
        assert ad.is_undefined_primal(x) and not any(ad.is_undefined_primal(r) for r in rest)
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval)] + [None] * len(rest)
        ct_x = op.primitive.bind(ct, *rest, tree=tree, backend=backend,
                                 transpose=not transpose, precision=precision)
        if ct_x.shape != x.aval.shape:  # gather_qmm with x shared across slots
            ct_x = ct_x.sum(axis=1)
        return [ct_x.astype(x.aval.dtype)] + [None] * len(rest)

    ad.primitive_jvps[op.primitive] = jvp
    ad.primitive_transposes[op.primitive] = transpose


for _op in (qmm_op, gather_qmm_op, ragged_qmm_op):
    _linear_in_x(_op)
# Float weights have a derivative too: the float ops differentiate through their references.
jvp_through_reference(gather_matmul_op)
jvp_through_reference(ragged_matmul_op)
