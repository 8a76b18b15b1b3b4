"""Argument checks and batching helpers shared by the ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jaxquant.quantize import check_float_dtype
from jaxquant.quantized_array import QuantizedArray, validate


def require_quantized(name, qw, *, ndim=None, min_ndim=None):
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"{name} must be a jaxquant.QuantizedArray (from jq.quantize); "
                        f"got {type(qw).__name__}")
    if ndim is not None and qw.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {qw.shape}")
    if min_ndim is not None and qw.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions; got shape {qw.shape}")
    validate(qw)


def check_x(x, name="x"):
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    check_float_dtype(name, x.dtype)
    return x


def integer_ids(name, ids):
    """Expert ids (gather's `indices`, ragged's `group_sizes`) as a jax integer array,
    never cut (docs/ops.md, "Expert ids"). jax holds integers in 32 bits unless x64 is
    on, and `jnp.asarray` wraps wider values silently (int64 2**32 -> 0). A traced or
    jax array already has jax's width; a concrete one (numpy, a list) is returned as a
    numpy array of its own width, so the op range-checks (group sizes) or maps (an
    index outside [0, E) gives a NaN row) the true values before they narrow.
    TypeError naming `name` unless the values are integers."""
    if not isinstance(ids, jax.Array):
        ids = np.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array; got {ids.dtype}")
    return ids


def narrow_indices(indices, num_experts):
    """gather's concrete indices in jax's integer width: an index outside [0, E) gives a
    NaN row on every backend, so one outside the narrower type's range becomes -1 (or the
    unsigned maximum), still outside [0, E), instead of wrapping into it."""
    if isinstance(indices, jax.Array):
        return indices
    narrow = jax.dtypes.canonicalize_dtype(indices.dtype)
    if narrow != indices.dtype:
        info = np.iinfo(narrow)
        invalid = (indices < 0) | (indices >= num_experts)
        indices = np.where(invalid, -1 if info.min < 0 else info.max, indices).astype(narrow)
    return jnp.asarray(indices)


def ragged_group_ends(group_sizes, rows):
    """ragged_qmm's groups as int32 end rows [E]: group e covers rows [ends[e-1], ends[e])
    (ends[-1] = 0). A negative size counts as 0 and the groups are cut at `rows` (docs/ops.md:
    never a row of two experts, never a row past x), the same on every backend. Sizes are
    clipped to `rows` before the sum, so it stays in int32 while E * rows < 2**31."""
    sizes = jnp.clip(group_sizes, 0, rows).astype(jnp.int32)
    return jnp.minimum(jnp.cumsum(sizes), rows)


def sorted_search(sorted_ends, values):
    """jnp.searchsorted(sorted_ends, values, side="right") as one [len(values), E]
    comparison and a sum. The default method lowers to a while loop, and a while loop on
    a GPU waits for the host at every trip: ragged_qmm's row-to-expert map on the
    cuda_mma GEMV spent about 140 µs a call on it at E = 32 for products of 20-50 µs
    (benchmarks/h100/moe.json `ragged_qmm.sorted_search.*`)."""
    return jnp.searchsorted(sorted_ends, values, side="right", method="compare_all")


def check_group_sizes(group_sizes, rows):
    """Concrete (not traced) group sizes: ValueError naming `group_sizes` if one is negative
    or they sum past the rows of x. Traced ones follow `ragged_group_ends`' rule instead."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes).tolist()  # Python ints: no wrap in any integer type
    sizes = sizes if isinstance(sizes, list) else [sizes]
    if any(v < 0 for v in sizes):
        raise ValueError(f"group_sizes must be >= 0; got {sizes}")
    if sum(sizes) > rows:
        raise ValueError(f"group_sizes must sum to at most T={rows} (the rows of x); got "
                         f"{sizes} (sum {sum(sizes)})")


def compute_dtype(dtype):
    """float32 accumulation, float64 for float64 inputs (docs/ops.md)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def default_precision():
    """The matmul precision in force now (`jax.default_matmul_precision`), captured
    at bind time so the reference and the kernels see the same one."""
    return jax.config.jax_default_matmul_precision


def move_to_front(x, dim):
    return jnp.moveaxis(x, dim, 0)


def to_front_or_broadcast(x, dim, size):
    """The vmapped axis of x at the front; an unbatched x broadcast to `size`."""
    if dim is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def batch_size(args, dims):
    """The size of the vmapped axis, from the first batched (array, dim) pair."""
    pairs = zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(
        dims, is_leaf=lambda d: d is None))
    return next(a.shape[d] for a, d in pairs if d is not None)


def quantized_to_front(qw, qw_dims, size):
    """A vmapped QuantizedArray as one with a leading batch axis of `size`.
    An unbatched scalar global_scale stays scalar (it broadcasts)."""
    def front(name):
        c, d = getattr(qw, name), getattr(qw_dims, name)
        if c is None or (name == "global_scale" and d is None and jnp.ndim(c) == 0):
            return c
        return to_front_or_broadcast(c, d, size)
    return QuantizedArray(*map(front, ("data", "scales", "biases", "global_scale")),
                          mode=qw.mode, bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype,
                          layout=qw.layout)


def jvp_through_reference(op):
    """Differentiate `op` (a jaxquant.primitive.Op) through its reference definition:
    the primal from the primitive (a kernel where one is chosen), the tangent from
    `jax.jvp` of the reference."""
    def jvp(primals, tangents, *, tree, backend, **params):
        out = op.primitive.bind(*primals, tree=tree, backend=backend, **params)
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        _, t_out = jax.jvp(lambda *l: op.call_reference(l, tree, params),
                           tuple(primals), tuple(tangents))
        return out, t_out
    ad.primitive_jvps[op.primitive] = jvp
