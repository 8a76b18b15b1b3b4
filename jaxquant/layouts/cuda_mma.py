"""The `cuda_mma` kernel layout: what the tensor-core decode GEMV reads
(gpu_src/cuda/gemv_mma.h; docs/decode.md describes it exactly).

Within each [N, K] matrix, rows are cut into tiles of 16 and K into chunks of
64. Tile t, chunk c is 32 "units" of 32 codes, one per lane of a warp, each a
`bits`-word little-endian bit stream (the canonical stream's own unit), so a
lane reads its part of the chunk with 16-byte loads (4 and 8 bits). Lane
l = 4*g + q holds rows 16t+g and 16t+g+8 at k = 64c + 16s + 4q + e (k-step s
in 0..3, e in 0..3), code i = 8s + 4h + j of its unit being row 16t+g+8*(j&1),
e = 2*(j>>1) + h: exactly the A registers of mma.sync.m16n8k16 (register j,
half h) in order. Rows past the last whole tile (N % 16 of them) keep the
canonical layout after the tiles. Scales (and biases) keep their shape
[..., N, K/group]; within the tiles they are ordered [tile, group, g, row
half], so a lane's two rows' scales sit side by side.

Any bits and mode; K must be a multiple of 64.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxquant import formats
from jaxquant.layouts import LAYOUTS, Layout, register

NAME = "cuda_mma"
TILE_ROWS = 16
CHUNK_K = 64

# A tile's codes as [2 (row half), 8 (g), C, 4 (s), 4 (q), 2 (e >> 1), 2 (h)]
# (canonical order) go to the layout's [C, g, q, s, h, e >> 1, row half]:
# the canonical axes in layout order.
_LAYOUT_ORDER = (2, 1, 4, 3, 6, 5, 0)


def _split(a, n_full):
    return a[..., :n_full, :], a[..., n_full:, :]


def _codes_perm(codes, n, k, inverse):
    """codes [..., n, k] (n a multiple of 16) <-> layout order, same shape."""
    lead = codes.shape[:-2]
    t, c = n // TILE_ROWS, k // CHUNK_K
    nl = len(lead)
    if not inverse:
        a = codes.reshape(*lead, t, 2, 8, c, 4, 4, 2, 2)
        order = _LAYOUT_ORDER
    else:
        a = codes.reshape(*lead, t, c, 8, 4, 4, 2, 2, 2)
        order = tuple(_LAYOUT_ORDER.index(i) for i in range(7))
    perm = tuple(range(nl + 1)) + tuple(nl + 1 + i for i in order)
    return a.transpose(perm).reshape(*lead, n, k)


def _scales_perm(a, n, inverse):
    lead = a.shape[:-2]
    groups = a.shape[-1]
    t = n // TILE_ROWS
    if not inverse:
        b = a.reshape(*lead, t, 2, 8, groups)
        nl = len(lead)
        return jnp.moveaxis(b, (nl + 1, nl + 2, nl + 3), (nl + 3, nl + 2, nl + 1)).reshape(
            *lead, n, groups)
    b = a.reshape(*lead, t, groups, 8, 2)
    nl = len(lead)
    return jnp.moveaxis(b, (nl + 1, nl + 2, nl + 3), (nl + 3, nl + 2, nl + 1)).reshape(
        *lead, n, groups)


def _repack(qw, inverse):
    n, k = qw.shape[-2], qw.shape[-1]
    n_full = n // TILE_ROWS * TILE_ROWS
    data, tail = _split(qw.data, n_full)
    if n_full:
        codes = formats.unpack_bits(data, qw.bits)  # [..., n_full, k]
        data = formats.pack_bits(_codes_perm(codes, n_full, k, inverse), qw.bits)
    data = jnp.concatenate([data, tail], axis=-2) if n_full < n else data

    def scales(a):
        if a is None:
            return None
        main, rest = _split(a, n_full)
        main = _scales_perm(main, n_full, inverse) if n_full else main
        return jnp.concatenate([main, rest], axis=-2) if n_full < n else main

    return data, scales(qw.scales), scales(qw.biases)


def pack(qw):
    return _repack(qw, inverse=False)


def unpack(qw):
    return _repack(qw, inverse=True)


def unsupported(qw):
    k = qw.shape[-1]
    if k % CHUNK_K:
        return f"K={k} is not a multiple of {CHUNK_K}"
    if qw.ndim < 2:
        return "needs a matrix (rank >= 2)"
    if qw.mode == "affine" and qw.group_size < 32:
        # the layout's kernels (gpu_src/cuda/gemv_mma.h: launch_nt) take affine groups
        # of 32 and more; group 16 stays canonical, where the GEMV decodes it
        return f"affine group_size={qw.group_size}: the kernels take affine groups >= 32"
    if qw.format.element in formats.CODEBOOKS:
        # the layout's kernels decode integers and minifloats; a codebook weight stays
        # canonical, where the Pallas kernels decode it
        return f"mode={qw.mode!r}: the kernels decode no codebook"
    return None


# Registered for every platform (a prepacked checkpoint unpacks anywhere); it becomes
# `jq.prepack`'s default on CUDA only when the CUDA library with its kernel loaded
# (jaxquant/ffi/__init__.py calls make_default_on).
register(Layout(NAME, pack, unpack, unsupported, doc=__doc__, row_block=TILE_ROWS))


def make_default_on(platform: str) -> None:
    layout = LAYOUTS[NAME]
    if platform not in layout.platforms:
        LAYOUTS[NAME] = dataclasses.replace(layout, platforms=layout.platforms + (platform,))
