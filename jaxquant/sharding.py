"""Sharding rules for the primitives: how each op partitions under `jax.jit`
with sharded operands (docs/sharding.md).

XLA cannot see inside a kernel (a custom call) nor through the bit unpacking
of the reference, so left alone it all-gathers a sharded quantized weight.
Instead, when a primitive is lowered in a multi-device `jit`, its lowering
goes through `jax.experimental.custom_partitioning`:

- the op's *factors* say which operand and result dimensions are the same
  logical axis (rows, N, the K groups, experts, tokens). They give Shardy its
  sharding rule (an einsum-like string with compound factors: x's K is
  `(g k)` = groups x group_size, the packed data's last axis `(g w)` = groups
  x words per group), and GSPMD its propagation;
- at partition time `_partition` picks, per factor, the mesh axes it is
  sharded over (weights first: the sharding the user gave the weights wins),
  drops any that do not divide the factor evenly, and returns the per-shard
  function: the same primitive bound on the local blocks (so dispatch picks
  kernels for the local shapes, on every backend), followed by the collective
  the layout needs: a `psum` over the mesh axes of a contracted factor (K in
  row-parallel `qmm`, experts in expert-parallel `gather_qmm`/`gather_matmul`/`ragged_qmm`/
  `ragged_matmul`),
  nothing for column-parallel N or for rows/tokens/batch.

Inside the per-shard program (and inside a fully manual `shard_map`) the
primitive lowers as it does on one device.

Limits, each replicated (gathered) rather than computed wrong, with a
warning naming it:
- K (the quantization groups' axis) shards only on group boundaries: the
  group count must divide evenly by the shard count. A split inside a group
  would cut a scale's block.
- Weights in a kernel layout (`jq.prepack`) shard on their leading (batch /
  expert) axes only: their scale tiles span N and K.
- The norms' hidden axis, `ragged_qmm`'s token rows, and the N axis of a
  `qmm` whose groups run along N (transpose=False) split only as the factors
  allow (N on group boundaries there too).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxquant.quantized_array import CANONICAL, QuantizedArray


class Dims(tuple):
    """One operand's dimensions, each a tuple of factor names (compound
    dimensions: major factor first). Not a pytree node, so a tree of these
    flattens like the operands."""


@dataclasses.dataclass
class Factors:
    operands: list          # Dims per operand leaf
    results: list           # Dims per result
    sizes: dict             # factor -> size
    contracted: tuple = ()  # factors summed over: sharding one needs a psum
    replicated: tuple = ()  # factors that must not be sharded
    priority: tuple = ()    # operand leaf indices whose sharding is read first


# ---------------------------------------------------------------------------
# Per-op factors.


def _qw_dims(qw: QuantizedArray, lead: list[str], r: str, g: str, sizes: dict):
    """Dims for a QuantizedArray's leaves: lead factors, rows r, then K in groups
    (g groups of `w` packed words each; scales one per group)."""
    data_shape = np.shape(qw.data)
    ngroups = qw.shape[-1] // qw.group_size
    words = data_shape[-1] // ngroups
    sizes[g] = ngroups
    sizes[f"{g}w"] = words
    lead_dims = [(f,) for f in lead]
    data = Dims(lead_dims + [(r,), (g, f"{g}w")])
    if qw.layout != CANONICAL:
        # A kernel layout tiles scales across N and K: only leading axes split.
        sdims = Dims(lead_dims + [(f"{r}s{i}",) for i in range(np.ndim(qw.scales) - len(lead))])
        for i in range(np.ndim(qw.scales) - len(lead)):
            sizes[f"{r}s{i}"] = np.shape(qw.scales)[len(lead) + i]
    else:
        sdims = Dims(lead_dims + [(r,), (g,)])
    gs = None
    if qw.global_scale is not None:
        gs = Dims(lead_dims[:np.ndim(qw.global_scale)])
    biases = sdims if qw.biases is not None else None
    return QuantizedArray.tree_unflatten(
        (qw.mode, qw.bits, qw.group_size, qw.dtype, qw.layout), (data, sdims, biases, gs))


def _layout_replicated(qw, r, g):
    return () if qw.layout == CANONICAL else (r, g, f"{g}w")


def _qmm_factors(x, qw, *, transpose, precision):
    sizes = {}
    nb = qw.ndim - 2
    lead = [f"b{i}" for i in range(nb)]
    for i, f in enumerate(lead):
        sizes[f] = qw.shape[i]
    rows = [f"m{i}" for i in range(x.ndim - 1 - nb)]
    for i, f in enumerate(rows):
        sizes[f] = x.shape[nb + i]
    qdims = _qw_dims(qw, lead, "r", "g", sizes)
    sizes["r"] = qw.shape[-2]
    sizes["gk"] = qw.group_size
    grouped = ("g", "gk")
    # transpose: W [N, K] (rows r = N, groups along K); else W [K, N] (groups along N).
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    xdims = Dims([(f,) for f in lead + rows] + [k_dim])
    out = Dims([(f,) for f in lead + rows] + [n_dim])
    ops = [xdims, qdims]
    return Factors(ops, [out], sizes, contracted=(contracted,),
                   replicated=("gk", "gw") + _layout_replicated(qw, "r", "g"), priority=(1,))


def _gather_factors(x, qw, indices, *, transpose, precision):
    sizes = {"e": qw.shape[0], "t": indices.shape[0], "s": indices.shape[1],
             "r": qw.shape[1], "gk": qw.group_size}
    qdims = _qw_dims(qw, ["e"], "r", "g", sizes)
    grouped = ("g", "gk")
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    xdims = Dims([("t",), k_dim] if x.ndim == 2 else [("t",), ("s",), k_dim])
    out = Dims([("t",), ("s",), n_dim])
    return Factors([xdims, qdims, Dims([("t",), ("s",)])], [out], sizes,
                   contracted=(contracted, "e"),
                   replicated=("gk", "gw", "s") + _layout_replicated(qw, "r", "g"), priority=(1,))


def _float_experts(w, transpose, sizes):
    """A float w [E, N, K] (or [E, K, N] with transpose=False): its e, n, k added to
    `sizes`, and its Dims. Unlike a quantized w, K splits anywhere (no groups)."""
    e, a, b = w.shape
    sizes.update(e=e, n=a if transpose else b, k=b if transpose else a)
    return Dims([("e",), ("n",), ("k",)] if transpose else [("e",), ("k",), ("n",)])


def _gather_matmul_factors(x, w, indices, *, transpose, precision):
    """gather_qmm's factors on a float w."""
    sizes = {"t": indices.shape[0], "s": indices.shape[1]}
    wdims = _float_experts(w, transpose, sizes)
    xdims = Dims([("t",), ("k",)] if x.ndim == 2 else [("t",), ("s",), ("k",)])
    return Factors([xdims, wdims, Dims([("t",), ("s",)])], [Dims([("t",), ("s",), ("n",)])],
                   sizes, contracted=("k", "e"), replicated=("s",), priority=(1,))


def _ragged_matmul_factors(x, w, group_sizes, *, transpose, precision):
    """ragged_qmm's factors on a float w."""
    sizes = {"t": x.shape[0], "es": w.shape[0]}
    wdims = _float_experts(w, transpose, sizes)
    # Token rows are grouped by expert in order, so they do not split (as ragged_qmm's).
    return Factors([Dims([("t",), ("k",)]), wdims, Dims([("es",)])], [Dims([("t",), ("n",)])],
                   sizes, contracted=("k", "e"), replicated=("t", "es"), priority=(1,))


def _ragged_factors(x, qw, group_sizes, *, transpose, precision):
    sizes = {"e": qw.shape[0], "t": x.shape[0], "r": qw.shape[1], "gk": qw.group_size}
    qdims = _qw_dims(qw, ["e"], "r", "g", sizes)
    grouped = ("g", "gk")
    k_dim, n_dim, contracted = (grouped, ("r",), "g") if transpose else (("r",), grouped, "r")
    # Token rows are grouped by expert in order, so they do not split; every
    # shard reads all group sizes (its rows start after the other experts').
    sizes["es"] = qw.shape[0]
    return Factors([Dims([("t",), k_dim]), qdims, Dims([("es",)])], [Dims([("t",), n_dim])],
                   sizes, contracted=(contracted, "e"),
                   replicated=("gk", "gw", "t", "es") + _layout_replicated(qw, "r", "g"),
                   priority=(1,))


def _dequantize_factors(qw, *, dtype):
    sizes = {"r": qw.shape[-2], "gk": qw.group_size}
    lead = [f"b{i}" for i in range(qw.ndim - 2)]
    for i, f in enumerate(lead):
        sizes[f] = qw.shape[i]
    qdims = _qw_dims(qw, lead, "r", "g", sizes)
    out = Dims([(f,) for f in lead] + [("r",), ("g", "gk")])
    return Factors([qdims], [out], sizes,
                   replicated=("gk", "gw") + _layout_replicated(qw, "r", "g"), priority=(0,))


def _norm_factors(n_rows: int, n_results: int):
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


def _rms_norm_qmm_factors(x, norm_weight, qw, *, eps, weight_offset, precision):
    """Column-parallel like qmm over N; K does not split (the norm reduces over it
    before the product)."""
    f = _qmm_factors(x, qw, transpose=True, precision=precision)
    xdims, qdims = f.operands
    wdims = None if norm_weight is None else Dims([xdims[-1]])
    return Factors([xdims, wdims, qdims], f.results, f.sizes,
                   replicated=f.replicated + ("g",),
                   priority=(1,) if norm_weight is None else (2,))  # qw's data leaf


def _qmm_swiglu_factors(x, qw, bias, *, activation, limit, alpha, precision):
    """Rows split; N does not (a shard of the rows [0, 2I) is not a gate half and an
    up half), nor K (the activation follows the sum)."""
    f = _qmm_factors(x, qw, transpose=True, precision=precision)
    xdims, qdims = f.operands
    f.sizes["i"] = qw.shape[0] // 2
    out = Dims(list(f.results[0][:-1]) + [("i",)])
    bdims = None if bias is None else Dims([("r",)])
    return Factors([xdims, qdims, bdims], [out], f.sizes,
                   replicated=f.replicated + ("g", "r", "i"), priority=(1,))


def _gather_qmm_swiglu_factors(x, qw, indices, bias, *, activation, limit, alpha, precision):
    """Tokens split; experts do not (each shard's activation needs its slots' whole
    sums: an expert-parallel partial sum would be summed after the activation), nor
    N or K (as qmm_swiglu's)."""
    f = _gather_factors(x, qw, indices, transpose=True, precision=precision)
    xdims, qdims, idims = f.operands
    f.sizes["i"] = qw.shape[1] // 2
    out = Dims(list(f.results[0][:-1]) + [("i",)])
    bdims = None if bias is None else Dims([("e",), ("r",)])
    return Factors([xdims, qdims, idims, bdims], [out], f.sizes,
                   replicated=f.replicated + ("e", "g", "r", "i"), priority=(1,))


def _attention_factors(q, k_cache, v_cache, positions, window, sinks, layer, **params):
    # Batch, query rows and kv heads split (q's heads are (kv head, group)); the
    # softmax's keys, the head dim and a stack's layers (one is read) do not.
    b, t, hq, hd = q.shape
    s, hkv = k_cache.shape[-3], k_cache.shape[-2]
    sizes = {"b": b, "t": t, "h": hkv, "g": hq // hkv, "s": s, "d": hd}
    if layer is not None:
        sizes["l"] = k_cache.shape[0]
    heads = Dims([("b",), ("t",), ("h", "g"), ("d",)])
    cache = Dims(([] if layer is None else [("l",)]) + [("b",), ("s",), ("h",), ("d",)])
    ops = [heads, cache, cache, Dims([("b",), ("t",)]), Dims([]),
           None if sinks is None else Dims([("h", "g")]), None if layer is None else Dims([])]
    return Factors(ops, [heads], sizes, replicated=("s", "d", "l"), priority=(1, 2))


FACTORS = {
    "decode_attention": _attention_factors,
    "qmm": _qmm_factors,
    "gather_qmm": _gather_factors,
    "gather_matmul": _gather_matmul_factors,
    "ragged_qmm": _ragged_factors,
    "ragged_matmul": _ragged_matmul_factors,
    "dequantize": _dequantize_factors,
    "rms_norm": _norm_factors(1, 1),
    "add_rms_norm": _norm_factors(2, 2),
    "gated_rms_norm": _norm_factors(2, 1),
    "rms_norm_qmm": _rms_norm_qmm_factors,
    "qmm_swiglu": _qmm_swiglu_factors,
    "gather_qmm_swiglu": _gather_qmm_swiglu_factors,
}


# ---------------------------------------------------------------------------
# Lowering: when to partition, and the custom_partitioning wrapper.


def register(primitive) -> None:
    """Ask jit to pass the device assignment to this primitive's lowering, which
    custom_partitioning needs (JAX does so for the primitives it sees in the jaxpr,
    and custom_partitioning's only appears inside ours). Private JAX API, present
    from 0.4 through 0.12; without it, multi-device lowering fails loudly."""
    from jax._src import dispatch as jax_dispatch
    jax_dispatch.prim_requires_devices_during_lowering.add(primitive)


def needs_partitioning(ctx) -> bool:
    """True when this lowering is for a multi-device program that XLA will
    partition (a `jit` over several devices, or a shard_map with auto axes)."""
    from jax._src import sharding_impls
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    return False


def lower_partitioned(op, ctx, leaves, tree, backend, params):
    """Lower op through custom_partitioning (see the module docstring)."""
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.interpreters import mlir

    args = jax.tree_util.tree_unflatten(tree, ctx.avals_in)
    factors = FACTORS[op.name](*args, **params)
    leaf_dims = _leaf_dims(factors, tree)

    def whole(*l):
        # Traced for its output shapes only (and lowered as is if XLA does not
        # partition): the primitive itself, which has no constants to close over.
        out = op.primitive.bind(*l, tree=tree, backend=backend, **params)
        return list(out) if op.multiple_results else out

    partitioned = custom_partitioning(whole)
    rule, rule_sizes = _sdy_rule(factors, leaf_dims)

    def partition(mesh, arg_shapes, result_shape):
        return _partition(op, tree, backend, params, factors, leaf_dims, mesh, arg_shapes)

    def infer(mesh, arg_shapes, result_shape):
        _, _, results, _ = _partition(op, tree, backend, params, factors, leaf_dims, mesh,
                                      arg_shapes, build=False)
        return results

    partitioned.def_partition(partition, infer_sharding_from_operands=infer,
                              sharding_rule=rule, **rule_sizes)
    out = mlir.lower_fun(partitioned, multiple_results=op.multiple_results)(ctx, *leaves)
    return out


def _leaf_dims(factors: Factors, tree):
    """Dims per operand leaf (a None operand has no leaf)."""
    dims = jax.tree_util.tree_leaves(factors.operands, is_leaf=lambda d: isinstance(d, Dims))
    assert len(dims) == tree.num_leaves, (dims, tree)
    return dims


def _sdy_rule(factors: Factors, leaf_dims):
    def squeeze(d):
        # Shardy refuses size-1 factors inside a compound dimension (one group: G=1)
        kept = tuple(f for f in d if factors.sizes[f] != 1) if len(d) > 1 else d
        return kept or d[:1]
    leaf_dims = [Dims(squeeze(d) for d in dims) for dims in leaf_dims]
    results = [Dims(squeeze(d) for d in dims) for dims in factors.results]

    def dim(d):
        return d[0] if len(d) == 1 else "(" + " ".join(d) + ")"

    def value(dims):
        return " ".join(dim(d) for d in dims) if dims else ""
    every = list(leaf_dims) + results
    simple = {d[0] for dims in every for d in dims if len(d) == 1}
    compound = {f for dims in every for d in dims if len(d) > 1 for f in d}
    # Shardy infers the size of a factor that has a dimension of its own.
    sizes = {f: int(factors.sizes[f]) for f in compound - simple}
    rule = (", ".join(value(d) for d in leaf_dims) + " -> "
            + ", ".join(value(d) for d in results))
    kwargs = dict(sizes)
    # Shardy numbers factors by first appearance and wants special ones sorted.
    order = list(dict.fromkeys(f for dims in every for d in dims for f in d))
    red = tuple(f for f in order if f in factors.contracted)
    rep = tuple(f for f in order if f in factors.replicated and f not in red)
    if red:
        kwargs["reduction_factors"] = red
    if rep:
        kwargs["need_replication_factors"] = rep
    return rule, kwargs


# ---------------------------------------------------------------------------
# Partitioning.


def _spec_axes(sharding, ndim):
    """Per dimension, the tuple of mesh axes it is split over (None: unknown)."""
    if not isinstance(sharding, NamedSharding):
        if sharding is None or sharding.is_fully_replicated:
            return [()] * ndim
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for s in spec:
        if s is None:
            out.append(())
        elif isinstance(s, str):
            out.append((s,))
        else:
            out.append(tuple(s))
    return out


def _choose(factors: Factors, leaf_dims, mesh, arg_shapes, op_name):
    """factor -> mesh axes, read from the operands' shardings, weights first."""
    order = list(factors.priority) + [i for i in range(len(leaf_dims))
                                      if i not in factors.priority]
    chosen: dict[str, tuple] = {}
    taken: set = set()
    for i in order:
        dims = leaf_dims[i]
        axes = _spec_axes(arg_shapes[i].sharding, len(dims))
        if axes is None:
            continue
        for d, ax in zip(dims, axes):
            f = d[0]
            if not ax or f in chosen:
                continue
            ax = tuple(a for a in ax if a not in taken)
            if not ax:
                continue
            size = math.prod(mesh.shape[a] for a in ax)
            why = None
            if f in factors.replicated:
                why = "this axis does not split for this operand layout"
            elif factors.sizes[f] % size:
                why = (f"its size {factors.sizes[f]} does not divide into {size} shards"
                       + (" (K splits only on quantization-group boundaries)"
                          if f in ("g", "r") and len(d) > 1 else ""))
            if why is not None:
                warnings.warn(f"jaxquant.{op_name}: an operand sharded over mesh axes {ax} on "
                              f"factor {f!r} is gathered: {why}", stacklevel=2)
                continue
            chosen[f] = ax
            taken.update(ax)
    return chosen


def _named(mesh, dims, chosen):
    spec = []
    for d in dims:
        ax = chosen.get(d[0], ())
        spec.append(None if not ax else (ax[0] if len(ax) == 1 else ax))
    return NamedSharding(mesh, PartitionSpec(*spec))


def _partition(op, tree, backend, params, factors, leaf_dims, mesh, arg_shapes, build=True):
    chosen = _choose(factors, leaf_dims, mesh, arg_shapes, op.name)
    arg_shardings = tuple(_named(mesh, d, chosen) for d in leaf_dims)
    results = [_named(mesh, d, chosen) for d in factors.results]
    result_shardings = results if op.multiple_results else results[0]
    if not build:
        return None, None, result_shardings, None
    reduce_axes = tuple(a for f in factors.contracted for a in chosen.get(f, ()))
    expert_axes = chosen.get("e", ())

    def local(*leaves):
        if expert_axes and op.name in ("gather_qmm", "gather_matmul", "ragged_qmm",
                                       "ragged_matmul"):
            out = _expert_local(op, leaves, tree, backend, params, expert_axes)
        else:
            out = op.primitive.bind(*leaves, tree=tree, backend=backend, **params)
        if reduce_axes:
            out = jax.lax.psum(out, reduce_axes)
        if op.name in ("gather_qmm", "gather_matmul") and expert_axes:
            out = _nan_for_invalid(out, leaves, tree, factors.sizes["e"])
        return list(out) if op.multiple_results else out

    return mesh, local, result_shardings, arg_shardings


def _expert_local(op, leaves, tree, backend, params, expert_axes):
    """This shard's experts' contribution (zero elsewhere), to be summed over
    the expert axes."""
    import jax.numpy as jnp
    x, qw, third = jax.tree_util.tree_unflatten(tree, leaves)
    e_local = qw.shape[0]
    first = jax.lax.axis_index(expert_axes) * e_local
    if op.name in ("gather_qmm", "gather_matmul"):
        local_idx = third - first.astype(third.dtype)
        mine = (local_idx >= 0) & (local_idx < e_local)
        y = op.bind(x, qw, jnp.where(mine, local_idx, 0), backend=backend, **params)
        return jnp.where(mine[..., None], y, jnp.zeros((), y.dtype))
    # ragged_qmm / ragged_matmul: this shard's rows are contiguous, from `start`; rotate them to
    # row 0, run the local experts' groups, rotate back (rows past them are zero).
    # The sizes as cut at T first (negative ones 0), so no group wraps round to row 0.
    from jaxquant.ops.common import ragged_group_ends
    rows = x.shape[0]
    ends = ragged_group_ends(third, rows)
    group_sizes = jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype))
    local_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, e_local)
    start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < first, group_sizes, 0))
    y = op.bind(jnp.roll(x, -start, axis=0), qw, local_sizes, backend=backend, **params)
    return jnp.roll(y, start, axis=0)


def _nan_for_invalid(out, leaves, tree, num_experts):
    """Indices outside [0, E) give NaN rows, as on one device."""
    import jax.numpy as jnp
    indices = jax.tree_util.tree_unflatten(tree, leaves)[2]
    bad = (indices < 0) | (indices >= num_experts)
    return jnp.where(bad[..., None], jnp.full((), jnp.nan, out.dtype), out)
