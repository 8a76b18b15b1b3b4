"""Sharding rules for the primitives: how each op partitions under `jax.jit`
with sharded operands (docs/sharding.md).

XLA cannot see inside a kernel (a custom call) nor through the bit unpacking
of the reference, so left alone it all-gathers a sharded quantized weight.
Instead, when a primitive is lowered in a multi-device `jit`, its lowering
goes through `jax.experimental.custom_partitioning`:

- the op's *factors* (declared beside the op: `Op(..., factors=)`) say which operand and result dimensions are the same
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
- Weights in a kernel layout (`jq.prepack`) split on their leading (batch /
  expert) axes, on N in whole row tiles of the layout (`Layout.row_block`),
  and on K only in a split layout ("cuda_mma/k2": K in column blocks, each in
  the layout) over a shard count that divides its blocks; the per-shard
  program records each device's block in its own layout (`_local_tree`).
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

from jaxquant import layouts
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
    allowed: dict = dataclasses.field(default_factory=dict)  # factor -> shards -> why not


# ---------------------------------------------------------------------------
# The weights' factors (each op's module declares its own: Op(..., factors=)).


def qw_dims(qw: QuantizedArray, lead: list[str], r: str, g: str, sizes: dict,
             allowed: dict):
    """Dims for a QuantizedArray's leaves: lead factors, rows r, then K in groups
    (g groups of `w` packed words each; scales one per group). A kernel layout's
    rows split on its row blocks and its K only as its split layout allows
    (jaxquant/layouts: the local block must itself be a valid layout): the rules
    go into `allowed` (factor -> shard count -> why not, or None)."""
    data_shape = np.shape(qw.data)
    ngroups = qw.shape[-1] // qw.group_size
    words = data_shape[-1] // ngroups
    sizes[g] = ngroups
    sizes[f"{g}w"] = words
    lead_dims = [(f,) for f in lead]
    data = Dims(lead_dims + [(r,), (g, f"{g}w")])
    sdims = Dims(lead_dims + [(r,), (g,)])
    if qw.layout != CANONICAL:
        _kernel_layout_rules(qw, r, g, allowed)
        if np.shape(qw.scales)[-2:] != (qw.shape[-2], ngroups):
            # scales padded past N (cdna4's 32-row blocks): their rows are a factor of
            # their own, and neither rows nor K split
            sizes[f"{r}s"], sizes[f"{g}s"] = np.shape(qw.scales)[-2:]
            sdims = Dims(lead_dims + [(f"{r}s",), (f"{g}s",)])
            for f in (r, g, f"{r}s", f"{g}s"):
                allowed[f] = lambda shards: "this layout's scales are padded past N"
    gs = None
    if qw.global_scale is not None:
        gs = Dims(lead_dims[:np.ndim(qw.global_scale)])
    biases = sdims if qw.biases is not None else None
    return QuantizedArray.tree_unflatten(
        (qw.mode, qw.bits, qw.group_size, qw.dtype, qw.layout), (data, sdims, biases, gs))


def _kernel_layout_rules(qw: QuantizedArray, r: str, g: str, allowed: dict):
    block = layouts.get(qw.layout).row_block
    rows = qw.shape[-2]

    def rows_split(shards):
        if block == 0:
            return f"the {qw.layout} layout's permutation spans all rows"
        if rows % (shards * block):
            return (f"{rows} rows do not split into {shards} shards of whole "
                    f"{block}-row tiles of the {qw.layout} layout")
        return None

    def k_split(shards):
        if layouts.shard_layout(qw.layout, shards) is None:
            return (f"K in the {qw.layout} layout splits only as its column blocks do: "
                    f"place it in {layouts.split_layout(qw.layout, shards)!r} "
                    f"(models.parallel places weights so)")
        return None
    allowed[r], allowed[g] = rows_split, k_split


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
    factors = op.factors(*args, **params)
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
            elif f in factors.allowed:
                why = factors.allowed[f](size)
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
    tree = _local_tree(tree, math.prod(mesh.shape[a] for a in chosen.get("g", ())))

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


def _local_tree(tree, k_shards: int):
    """The operands' tree with each QuantizedArray's layout that of one device's
    block when K is split over `k_shards` devices (a split kernel layout's block
    is its base layout: jaxquant/layouts)."""
    if k_shards == 1:
        return tree
    is_q = lambda a: isinstance(a, QuantizedArray)
    args = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    args = jax.tree_util.tree_map(
        lambda a: layouts.with_layout(a, layouts.shard_layout(a.layout, k_shards))
        if is_q(a) else a, args, is_leaf=is_q)
    return jax.tree_util.tree_structure(args)


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
