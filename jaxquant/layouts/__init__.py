"""Kernel layouts: exact permutations of a QuantizedArray that a kernel reads faster.

The canonical layout (docs/formats.md: `data` uint32 [..., N, K*bits/32], a
little-endian bit stream along K; `scales` [..., N, K/group]) is the exchange
format: importers, exporters and `jq.mlx` speak only it. A backend whose
kernel reaches the bandwidth limit only on another arrangement of the same
bits registers a `Layout` here; `jq.prepack(qw)` applies it once, the
QuantizedArray records it in its static `layout` field, and
`jq.unpack_layout(qw)` gives the canonical arrays back bit for bit.

Every op accepts every layout: a kernel that reads a layout says so in its
`applies`; everywhere else (the reference, other backends) the op unpacks
first, which is correct but costs a permutation per call.

What a layout may change, so that the rest of the library need not know it:
- `data` keeps its canonical shape and dtype (uint32 [..., N, K*bits/32]);
  only the order of the bits within each [N, K] matrix changes. The logical
  shape is therefore read from `data`, and indexing leading (expert) axes
  works as for the canonical layout.
- `scales` and `biases` may change shape within each [N, K] matrix (e.g.
  padding N), keeping the leading axes.
- The permutation is within one [N, K] matrix: `qw[e]` of a prepacked stack
  is the prepacked `qw[e]`. Slicing N is refused (it would cut tiles).

Sharding (docs/sharding.md): a layout that keeps blocks of `row_block` rows in
place splits on N at those boundaries as it is (a device's contiguous rows of
the packed arrays are the packed rows). Neither shipped layout keeps K's
columns in place (a tile's K chunks follow each other within the tile), so a
K split needs the weight in the *split* layout `split_layout(name, p)`,
spelt "name/kp": K cut into p column blocks, each in `name`. Device j's
contiguous 1/p of every packed array is then block j in `name`
(`shard_layout` names what a device holds).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant.quantized_array import CANONICAL, QuantizedArray


@dataclasses.dataclass(frozen=True)
class Layout:
    """A kernel layout.

    pack(qw) -> (data, scales, biases): the arrays of canonical `qw` in this
      layout (jnp, jittable; biases None where the mode has none).
    unpack(qw) -> (data, scales, biases): the exact inverse, canonical arrays.
    unsupported(qw) -> str | None: why the canonical `qw` cannot take this
      layout (mode, sizes), or None when it can.
    platforms: where `jq.prepack(qw)` with no layout named picks this one
      (JAX platform names: "cuda", "rocm", "cpu"), first registered first.
    row_block: the permutation keeps every block of this many rows (N) in
      place, in both arrangements, and packs the rows after the last whole
      block on their own; 0 when it spans the whole matrix. `jq.prepack` then
      converts a large matrix a few blocks at a time (bounded memory).
    """

    name: str
    pack: Callable
    unpack: Callable
    unsupported: Callable
    platforms: tuple[str, ...] = ()
    doc: str = ""
    row_block: int = 0


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.name == CANONICAL or layout.name in LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is already defined")
    LAYOUTS[layout.name] = layout
    return layout


def get(name: str) -> Layout:
    base, blocks = split_of(name)
    if blocks > 1 and base in LAYOUTS and base != CANONICAL:
        if name not in _SPLIT:
            _SPLIT[name] = _split(LAYOUTS[base], blocks)
        return _SPLIT[name]
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout={name!r} is not known; expected {CANONICAL!r}, one of "
                         f"{sorted(LAYOUTS)} or one of those split on K as NAME{SPLIT}P "
                         f"(P >= 2 column blocks)") from None


# ---------------------------------------------------------------------------
# Split layouts: K in column blocks, each block in a base layout (module docstring).

SPLIT = "/k"
_SPLIT: dict[str, Layout] = {}


def split_of(name: str) -> tuple[str, int]:
    """(base layout, number of K blocks) of a layout name: ("cuda_mma", 2) for
    "cuda_mma/k2", (name, 1) for an unsplit one."""
    base, sep, count = name.rpartition(SPLIT)
    if sep and base and count.isdigit() and int(count) >= 2:
        return base, int(count)
    return name, 1


def split_layout(name: str, blocks: int) -> str:
    """The layout that holds K in `blocks` column blocks, each in the layout `name`
    (itself for blocks=1 and for the canonical layout, whose bits run along K so a
    column block already is its canonical block)."""
    base, have = split_of(name)
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1; got {blocks}")
    total = have * blocks
    return base if base == CANONICAL or total == 1 else f"{base}{SPLIT}{total}"


def shard_layout(name: str, shards: int) -> str | None:
    """The layout of one device's block when a weight in `name` has K split evenly
    over `shards` devices; None where that block is not a valid layout (an unsplit
    kernel layout, or a split one whose block count `shards` does not divide)."""
    base, blocks = split_of(name)
    if shards == 1 or base == CANONICAL:
        return name
    if blocks % shards:
        return None
    return split_layout(base, blocks // shards)


def with_layout(qw: QuantizedArray, layout: str) -> QuantizedArray:
    """qw's arrays as they are, recorded as being in `layout` (a device's block
    of a split layout: shard_layout)."""
    return QuantizedArray.tree_unflatten(
        (qw.mode, qw.bits, qw.group_size, qw.dtype, layout), qw.tree_flatten()[0])


def _blocks(qw: QuantizedArray, blocks: int):
    """The `blocks` column blocks of qw's arrays (each [..., rows, last/blocks])."""
    cut = lambda a: None if a is None else jnp.split(a, blocks, axis=-1)
    data, scales, biases = cut(qw.data), cut(qw.scales), cut(qw.biases)
    return [(data[i], scales[i], None if biases is None else biases[i]) for i in range(blocks)]


def _split(base: Layout, blocks: int) -> Layout:
    def convert(fn, qw):
        out = [fn(QuantizedArray(d, s, b, None, mode=qw.mode, bits=qw.bits,
                                 group_size=qw.group_size, dtype=qw.dtype, layout=qw.layout))
               for d, s, b in _blocks(qw, blocks)]
        return tuple(None if out[0][i] is None else jnp.concatenate([o[i] for o in out], -1)
                     for i in range(3))

    def unsupported(qw):
        k = qw.shape[-1]
        groups = k // qw.group_size
        if groups % blocks:
            return (f"K={k} has {groups} quantization groups, which do not split into "
                    f"{blocks} blocks")
        shape = lambda a: None if a is None else jax.ShapeDtypeStruct(
            a.shape[:-1] + (a.shape[-1] // blocks,), a.dtype)
        block = QuantizedArray.tree_unflatten(
            (qw.mode, qw.bits, qw.group_size, qw.dtype, CANONICAL),
            (shape(qw.data), shape(qw.scales), shape(qw.biases), None))
        why = base.unsupported(block)
        return None if why is None else f"a block of K={k // blocks}: {why}"

    return Layout(f"{base.name}{SPLIT}{blocks}", lambda qw: convert(base.pack, qw),
                  lambda qw: convert(base.unpack, qw), unsupported, platforms=(),
                  doc=f"K in {blocks} column blocks, each in {base.name!r}",
                  row_block=base.row_block)


def _with_arrays(qw: QuantizedArray, arrays, layout: str) -> QuantizedArray:
    data, scales, biases = arrays
    return qw.replace(data=data, scales=scales, biases=biases, layout=layout)


def default_platform() -> str:
    """The JAX platform ("cuda", "rocm", "cpu", ...) of the default device: where
    `default_layout` looks for a kernel layout."""
    device = jax.devices()[0]
    if device.platform == "gpu":  # older jaxlibs name the client "gpu"
        return "rocm" if "rocm" in getattr(device.client, "platform_version", "").lower() else "cuda"
    return device.platform


def default_layout(qw: QuantizedArray, platform: str | None = None) -> str:
    """The layout `jq.prepack(qw)` picks on `platform` (default: that of the
    default device): the first registered for it that takes `qw`, else canonical."""
    platform = platform or default_platform()
    # `unsupported` reads shapes and the mode: the canonical arrays' shapes will do
    canonical = qw if qw.layout == CANONICAL else jax.eval_shape(unpack_layout, qw)
    for layout in LAYOUTS.values():
        if platform in layout.platforms and layout.unsupported(canonical) is None:
            return layout.name
    return CANONICAL


def prepack(qw: QuantizedArray, layout: str | None = None) -> QuantizedArray:
    """`qw` in a kernel layout, an exact permutation of its bits.

    layout=None picks the fastest layout for the default device (the
    canonical one where no kernel there reads another, in which case `qw`
    comes back as it is); a name picks that layout, raising ValueError where
    it cannot hold `qw`. A QuantizedArray already in another layout is
    unpacked first. Jittable with `layout` static
    (`jax.jit(jq.prepack, static_argnames="layout")`).

    Memory: a stack [..., N, K] is converted a piece at a time (whole matrices,
    or blocks of rows of one matrix where the layout allows), so the device
    needs the result plus at most about a quarter of the weight's bytes on
    top of `qw` itself, not the several-fold expansion of converting all of
    it at once.
    """
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a jaxquant.QuantizedArray; got {type(qw).__name__}")
    if layout is None:
        layout = default_layout(qw)
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a layout name or None; got {type(layout).__name__}")
    if layout == qw.layout:
        return qw
    qw = unpack_layout(qw)
    if layout == CANONICAL:
        return qw
    target = get(layout)
    why = target.unsupported(qw)
    if why is not None:
        raise ValueError(f"layout={layout!r} cannot hold this QuantizedArray ({qw!r}): {why}")
    return _with_arrays(qw, _convert(qw, target.name, True), layout)


def unpack_layout(qw: QuantizedArray) -> QuantizedArray:
    """`qw` in the canonical layout (itself if it already is), bit for bit the
    QuantizedArray that `jq.prepack` was given."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a jaxquant.QuantizedArray; got {type(qw).__name__}")
    if qw.layout == CANONICAL:
        return qw
    return _with_arrays(qw, _convert(qw, get(qw.layout).name, False), CANONICAL)


# ---------------------------------------------------------------------------
# Converting in bounded memory. A layout's pack/unpack expands the codes of
# what it converts (4-bit codes unpacked to uint32: 8x, plus the permuted
# copy), so all of a stacked [L, E, N, K] weight at once would need many times
# its own size. Instead each piece of at most 1/PIECES of the weight's bytes
# is converted in a loop and written in place into the result (unfused, a
# piece expands about 23x: tests/test_layouts.py measures it).

PIECES = 128


def _convert(qw: QuantizedArray, name: str, pack: bool):
    """(data, scales, biases) of `qw` converted by layout `name`'s pack (or
    unpack), piece by piece (see above)."""
    return _convert_jit(qw, name, pack)


def _children(qw):
    return (qw.data, qw.scales, qw.biases)


def _nbytes(arrays):
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _convert_jit(qw, name, pack):
    layout = get(name)
    fn = layout.pack if pack else layout.unpack
    lead, n = qw.data.shape[:-2], qw.data.shape[-2]
    b = math.prod(lead)
    flat = [None if c is None else c.reshape(b, *c.shape[len(lead):]) for c in _children(qw)]

    def convert(children):  # a piece [m, rows, ...] (or [rows, ...]) of every child
        data, scales, biases = children
        return fn(QuantizedArray(data, scales, biases, None, mode=qw.mode, bits=qw.bits,
                                 group_size=qw.group_size, dtype=qw.dtype, layout=qw.layout))

    total = _nbytes(flat)
    budget = max(total // PIECES, 1)
    matrix = total // b if b else 0
    rows = n
    if layout.row_block and matrix > budget and n > layout.row_block:
        rows = max(budget * n // matrix // layout.row_block, 1) * layout.row_block
    if rows >= n:  # whole matrices: the most that fit the budget, a divisor of b
        m = max([d for d in range(1, b + 1) if b % d == 0 and d * matrix <= budget] or [1])
        outs = _loop(convert, flat, b // m, lambda i: ((i * m, m),), rows_axis=None)
    else:  # blocks of `rows` rows of one matrix, then the rows after the last block
        per = n // rows
        main = rows * per
        outs = _loop(convert, flat, b * per, lambda i: ((i // per, 1), ((i % per) * rows, rows)),
                     rows_axis=1, tail=main)
    return tuple(None if o is None else o.reshape(*lead, *o.shape[1:]) for o in outs)


def _loop(convert, flat, count, where, rows_axis, tail=None):
    """Convert `count` pieces of the [B, rows, ...] children (piece i at the
    (start, size) pairs where(i) on axes 0 and, given rows_axis, 1) into fresh
    arrays in place; with `tail`, then each matrix's rows from `tail` on."""
    def take(arrays, i, tail_rows=False):
        out = []
        for a in arrays:
            if a is None:
                out.append(None)
                continue
            if tail_rows:  # matrix i, rows tail..end (whatever a layout pads there)
                piece = lax.dynamic_slice_in_dim(a, i, 1, 0)[0, tail:]
            else:
                (s0, n0), *rest = where(i)
                piece = lax.dynamic_slice_in_dim(a, s0, n0, 0)
                if rest:
                    (s1, n1), = rest
                    piece = lax.dynamic_slice_in_dim(piece[0], s1, n1, 0)
            out.append(piece)
        return tuple(out)

    if tail is not None and tail == flat[0].shape[1]:
        tail = None  # the blocks cover every row
    piece0 = jax.eval_shape(lambda f: convert(take(f, 0)), flat)
    tail0 = jax.eval_shape(lambda f: convert(take(f, 0, True)), flat) if tail is not None else None
    b = flat[0].shape[0]

    def out_shape(k):
        p = piece0[k]
        if p is None:
            return None
        if rows_axis is None:  # whole matrices: [m, ...] pieces of [B, ...]
            return (b, *p.shape[1:]), p.dtype
        if tail is None:  # blocks of rows: [rows, ...] pieces of [B, N, ...]
            return (b, flat[k].shape[1], *p.shape[1:]), p.dtype
        return (b, tail + tail0[k].shape[0], *p.shape[1:]), p.dtype

    shapes = [out_shape(k) for k in range(3)]
    outs = tuple(None if s is None else jnp.zeros(*s) for s in shapes)

    def put(outs, piece, starts):
        return tuple(None if o is None else lax.dynamic_update_slice(o, p, starts(o))
                     for o, p in zip(outs, piece))

    def body(i, outs):
        piece = convert(take(flat, i))
        (s0, _), *rest = where(i)
        if not rest:
            return put(outs, piece, lambda o: (s0,) + (0,) * (o.ndim - 1))
        (s1, _), = rest
        return put(outs, tuple(None if p is None else p[None] for p in piece),
                   lambda o: (s0, s1) + (0,) * (o.ndim - 2))

    outs = body(0, outs) if count == 1 else lax.fori_loop(0, count, body, outs)
    if tail is not None:
        def tail_body(i, outs):
            piece = convert(take(flat, i, True))
            return put(outs, tuple(None if p is None else p[None] for p in piece),
                       lambda o: (i, tail) + (0,) * (o.ndim - 2))
        outs = lax.fori_loop(0, b, tail_body, outs)
    return outs


# The layouts the library ships register themselves on import (after the registry exists).
from jaxquant.layouts import cdna4  # noqa: E402,F401
