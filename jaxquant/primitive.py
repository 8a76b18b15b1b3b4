"""One JAX primitive per op (docs/backends.md).

`Op` wraps a `jax.extend.core.Primitive` around the op's jnp reference:
- operands are the flattened pytree of the op's arguments (a QuantizedArray
  becomes its arrays; None arguments vanish), the tree is a static param;
- abstract evaluation is the reference's `eval_shape`;
- every platform gets a lowering that asks `dispatch.select` for a backend
  kernel and otherwise lowers the reference (`mlir.lower_fun`); a fused op
  (`composition=`) lowers the unfused primitives instead where it has no
  kernel of its own, unless the reference backend was asked for;
- batching: an op-specific rule where one keeps the primitive (and so the
  kernels), else `vmap` of the reference;
- differentiation: op-specific rules (set by the op's module);
- sharding: in a multi-device program the lowering partitions the op by its
  sharding rule (`factors=`, declared beside the op; jaxquant/sharding.py does
  the partitioning), binding the primitive per shard.
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxquant import dispatch, sharding

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm")


class Op:
    def __init__(self, name: str, reference, *, factors, multiple_results: bool = False,
                 composition=None):
        self.name = name
        # factors(*args, **params) -> sharding.Factors: the op's sharding rule
        self.factors = factors
        self.reference = reference
        # fused ops: composition(*args, backend, **params) binds the unfused primitives
        self.composition = composition
        self.multiple_results = multiple_results
        self.primitive = p = Primitive(f"jaxquant_{name}")
        p.multiple_results = multiple_results
        p.def_impl(self._impl)
        p.def_abstract_eval(self._abstract_eval)
        mlir.register_lowering(p, self._lowering(None))
        for platform in LOWERING_PLATFORMS:
            mlir.register_lowering(p, self._lowering(platform), platform=platform)
        batching.primitive_batchers[p] = self._batch
        sharding.register(p)
        self.batch_rule = None  # op-specific: (args, dims, **params) -> (out, out_dims) | None

    # -- binding -----------------------------------------------------------
    def bind(self, *args, backend=None, **params):
        """Bind with structured args (QuantizedArray, None allowed)."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        return self.primitive.bind(*leaves, tree=tree,
                                   backend=dispatch.resolve_backend(
                                       backend, None if self.composition else self.name),
                                   **params)

    def call_reference(self, leaves, tree, params):
        return self.reference(*jax.tree_util.tree_unflatten(tree, leaves), **params)

    # -- rules -------------------------------------------------------------
    def _impl(self, *leaves, tree, backend, **params):
        # Eager calls run the lowering through jit, so backends apply there too.
        return self._jitted(tree, backend, tuple(sorted(params.items())))(*leaves)

    @functools.lru_cache(maxsize=256)
    def _jitted(self, tree, backend, params):
        return jax.jit(lambda *l: self.primitive.bind(*l, tree=tree, backend=backend,
                                                      **dict(params)))

    def _abstract_eval(self, *avals, tree, backend, **params):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        out = jax.eval_shape(lambda *l: self.call_reference(l, tree, params), *specs)
        to_aval = lambda s: jax.core.ShapedArray(s.shape, s.dtype)
        return [to_aval(o) for o in out] if self.multiple_results else to_aval(out)

    def _lowering(self, platform):
        def rule(ctx, *leaves, tree, backend, **params):
            if sharding.needs_partitioning(ctx):
                # Multi-device: partition through the op's sharding rules; each
                # shard binds this primitive again and comes back here.
                return sharding.lower_partitioned(self, ctx, leaves, tree, backend, params)
            args = jax.tree_util.tree_unflatten(tree, ctx.avals_in)
            impl = dispatch.select(self.name, backend, platform or ctx.module_context.platforms[0],
                                   args, params, required=self.composition is None)
            if impl is None and self.composition is not None and backend != "reference":
                fn = lambda *l: self.composition(*jax.tree_util.tree_unflatten(tree, l),
                                                 backend=backend, **params)
            elif impl is None:
                fn = lambda *l: self.call_reference(l, tree, params)
            else:
                fn = lambda *l: impl(*jax.tree_util.tree_unflatten(tree, l), **params)
            with dispatch.lowering_scope(impl):
                return mlir.lower_fun(fn, multiple_results=self.multiple_results)(ctx, *leaves)
        return rule

    def _batch(self, leaves, dims, *, tree, backend, **params):
        if self.batch_rule is not None:
            args = jax.tree_util.tree_unflatten(tree, leaves)
            arg_dims = jax.tree_util.tree_unflatten(tree, dims)
            out = self.batch_rule(args, arg_dims, backend=backend, **params)
            if out is not None:
                return out
        # General case: vmap of the reference (vectorized, but off the kernels).
        fn = jax.vmap(lambda *l: self.call_reference(l, tree, params), in_axes=dims)
        out = fn(*leaves)
        return out, ([0] * len(out) if self.multiple_results else 0)
