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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

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
    """

    name: str
    pack: Callable
    unpack: Callable
    unsupported: Callable
    platforms: tuple[str, ...] = ()
    doc: str = ""


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.name == CANONICAL or layout.name in LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is already defined")
    LAYOUTS[layout.name] = layout
    return layout


def get(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout={name!r} is not known; expected {CANONICAL!r} or one of "
                         f"{sorted(LAYOUTS)}") from None


def _with_arrays(qw: QuantizedArray, arrays, layout: str) -> QuantizedArray:
    data, scales, biases = arrays
    return QuantizedArray(data, scales, biases, qw.global_scale, mode=qw.mode, bits=qw.bits,
                          group_size=qw.group_size, dtype=qw.dtype, layout=layout)


def _default_platform() -> str:
    device = jax.devices()[0]
    if device.platform == "gpu":  # older jaxlibs name the client "gpu"
        return "rocm" if "rocm" in getattr(device.client, "platform_version", "").lower() else "cuda"
    return device.platform


def default_layout(qw: QuantizedArray, platform: str | None = None) -> str:
    """The layout `jq.prepack(qw)` picks on `platform` (default: that of the
    default device): the first registered for it that takes `qw`, else canonical."""
    platform = platform or _default_platform()
    for layout in LAYOUTS.values():
        if platform in layout.platforms and layout.unsupported(unpack_layout(qw)) is None:
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
    return _with_arrays(qw, target.pack(qw), layout)


def unpack_layout(qw: QuantizedArray) -> QuantizedArray:
    """`qw` in the canonical layout (itself if it already is), bit for bit the
    QuantizedArray that `jq.prepack` was given."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a jaxquant.QuantizedArray; got {type(qw).__name__}")
    if qw.layout == CANONICAL:
        return qw
    return _with_arrays(qw, get(qw.layout).unpack(qw), CANONICAL)


# The layouts the library ships register themselves on import (after the registry exists).
from jaxquant.layouts import cdna4  # noqa: E402,F401
