"""Building a model's layers one at a time in bounded device memory (quantize_params,
checkpoint.load): the device holds the finished layers plus one layer's temporaries,
never a second copy of the stack, and a failure part way (an out-of-memory error)
leaves none of the arrays made here alive (docs/models.md, "Memory while quantizing")."""

from __future__ import annotations

import functools
import traceback
from typing import Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnums=1)
def _stack_of(first, n: int):
    """[n, ...] buffers for leaves like `first`, layer 0 holding it (on first's devices:
    the broadcast keeps its sharding)."""
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), first)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stack, layer, i):
    """stack[i] = layer, in place: the stack's buffers are donated, so the update needs
    no second stack."""
    return jax.tree_util.tree_map(lambda s, a: s.at[i].set(a), stack, layer)


class MixedLayers(ValueError):
    """A layer's matrix is stored unlike layer 0's (another format or shape): its
    layers cannot stack."""


def _check_like(key, i, stack, layer):
    """layer i's value of key has layer 0's structure, shapes and dtypes (ValueError
    naming the key otherwise: a stack holds one format)."""
    first = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stack)
    this = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layer)
    if jax.tree_util.tree_structure(first) != jax.tree_util.tree_structure(this) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in
            zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(this))):
        raise MixedLayers(f"{key}: layer {i} is not stored like layer 0 ({layer!r} against "
                         f"{stack!r}); stacked layers (lax.scan) need one format and shape per "
                         f"matrix across layers (per-layer buffers, per_layer=True, take any)")


def _add_layer(stacks, reused, converted, layer_in, source, i, n):
    """Layer i's converted values written into stacks (made at layer 0); a value that
    is layer_in's own slice keeps source's stack (reused)."""
    for k, v in converted.items():
        if k in layer_in and v is layer_in[k]:
            reused[k] = source[k]
        elif k in stacks:
            _check_like(k, i, stacks[k], v)
            stacks[k] = _write_layer(stacks[k], v, i)
        else:
            stacks[k] = _stack_of(v, n)


def _leaves(tree):
    return [a for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)]


def build_layers(n: int, convert: Callable, per_layer: bool, source=None):
    """The layers convert(i, layer_i) for i < n, as a tuple of dicts (per_layer) or one
    dict of stacked [n, ...] values, written into their stacks a layer at a time.

    source: the layers the inputs come from, a tuple of dicts or a dict of stacked
    values (layer_i is then source[i] or that dict sliced at i), or None (layer_i is
    None: convert reads layer i itself). A value that convert returns unchanged (the
    very slice it was given) keeps source's stack rather than a copy.

    Memory: the result, plus one layer's input and output while convert runs. If
    anything raises, the arrays made here (slices, converted layers, stacks) are
    deleted and the frames below this one let go of theirs before the error goes on,
    so that the caller's arrays are all the device still holds."""
    stacked_source = isinstance(source, dict)
    out_layers, stacks, reused, order = [], {}, {}, []
    layer_in = converted = None
    try:
        for i in range(n):
            if source is None:
                layer_in = None
            elif stacked_source:
                layer_in = {k: v[i] for k, v in source.items()}
            else:
                layer_in = dict(source[i])
            converted = convert(i, layer_in)
            if per_layer:
                out_layers.append(converted)
            else:
                if i == 0:
                    order = list(converted)
                _add_layer(stacks, reused, converted, layer_in if stacked_source else {},
                           source, i, n)
            layer_in = converted = None      # this layer's temporaries go before the next
    except BaseException as e:
        release_on_failure(e, out_layers, stacks, layer_in, converted, keep=source)
        out_layers = stacks = layer_in = converted = None
        raise
    if per_layer:
        return tuple(out_layers)
    return {k: reused[k] if k in reused else stacks[k] for k in order}


def release_on_failure(error: BaseException, *trees, keep=()):
    """After `error`, delete the arrays of trees that are not among keep's (the
    caller's) and let the frames below the caller's go of their locals."""
    kept = {id(a) for a in _leaves(keep)}
    for a in _leaves(trees):
        if id(a) not in kept and not a.is_deleted():
            a.delete()
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__.tb_next)


__all__ = ["MixedLayers", "build_layers", "release_on_failure"]
