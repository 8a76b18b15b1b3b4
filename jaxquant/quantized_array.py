"""QuantizedArray: a quantized weight as a JAX pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import formats

CANONICAL = "canonical"


@jax.tree_util.register_pytree_node_class
class QuantizedArray:
    """A quantized array of logical shape [..., N, K] (docs/formats.md).

    Children (arrays): `data` uint32 [..., N, K*bits/32]; `scales` [..., N, K/group];
    `biases` like scales (affine only) or None; `global_scale` (nvfp4 only) float32,
    a scalar or one per leading index (its shape a prefix of the leading axes, as
    `vmap` of `quantize` makes), or None.
    Static: `mode`, `bits`, `group_size`, `dtype` (the logical dtype, that of the
    array that was quantized) and `layout` ("canonical" is docs/formats.md's bit
    layout; others: docs/layouts.md).

    It is not an array: ``np.asarray(qw)``, ``jnp.asarray(qw)`` and ``iter(qw)``
    raise TypeError pointing at ``jq.dequantize``; ``len(qw)`` and ``qw[i]`` work
    on the leading axes.

    The logical shape is derived from `scales` (from `data` in a kernel layout,
    which keeps data's shape: jaxquant/layouts), so the same object is right
    inside `vmap` (where children lose their batch axis) and after indexing.
    """

    __slots__ = ("data", "scales", "biases", "global_scale", "mode", "bits", "group_size",
                 "dtype", "layout")

    def __init__(self, data, scales, biases=None, global_scale=None, *, mode, bits,
                 group_size, dtype, layout=CANONICAL):
        self.data = data
        self.scales = scales
        self.biases = biases
        self.global_scale = global_scale
        self.mode = formats.get_format(mode).mode
        self.bits = bits
        self.group_size = group_size
        self.dtype = _logical_dtype(dtype)
        self.layout = layout
        validate(self)

    # -- pytree ------------------------------------------------------------
    def tree_flatten(self):
        children = (self.data, self.scales, self.biases, self.global_scale)
        aux = (self.mode, self.bits, self.group_size, self.dtype, self.layout)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.data, obj.scales, obj.biases, obj.global_scale = children
        obj.mode, obj.bits, obj.group_size, obj.dtype, obj.layout = aux
        return obj

    def replace(self, **fields) -> "QuantizedArray":
        """This array with some of its fields (data, scales, biases, global_scale, mode,
        bits, group_size, dtype, layout) replaced: a new QuantizedArray, validated."""
        unknown = sorted(set(fields) - set(self.__slots__))
        if unknown:
            raise TypeError(f"QuantizedArray.replace: unknown field(s) {unknown}; expected "
                            f"some of {self.__slots__}")
        kw = {name: getattr(self, name) for name in self.__slots__}
        kw.update(fields)
        return QuantizedArray(**kw)

    def flatten_leading(self, n: int | None = None) -> "QuantizedArray":
        """[*B, N, K] -> [prod(B), N, K], B the first n axes (default: every axis before
        the matrix; none gives a leading axis of 1): each child reshaped (no copy), a
        global scale given per leading index broadcast over B and flattened with it
        (a scalar one stays), the format and layout kept."""
        n = self.ndim - 2 if n is None else n
        if not 0 <= n <= self.ndim - 2:
            raise ValueError(f"n={n} must be in [0, {self.ndim - 2}] for shape {self.shape}")
        lead = self.shape[:n]
        b = int(np.prod(lead))
        flat = lambda c: None if c is None else c.reshape(b, *c.shape[n:])
        gs = self.global_scale
        if gs is not None and jnp.ndim(gs) > n:  # per index of B and of later axes
            gs = gs.reshape(b, *jnp.shape(gs)[n:])
        elif gs is not None and jnp.ndim(gs) > 0:
            gs = jnp.broadcast_to(jnp.reshape(gs, jnp.shape(gs) + (1,) * (n - jnp.ndim(gs))),
                                  lead).reshape(-1)
        return self.replace(data=flat(self.data), scales=flat(self.scales),
                            biases=flat(self.biases), global_scale=gs)

    # -- array-like --------------------------------------------------------
    @property
    def format(self) -> formats.Format:
        return formats.FORMATS[self.mode]

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout != CANONICAL:
            d = tuple(np.shape(self.data))
            return d[:-1] + (d[-1] * 32 // self.bits,)
        s = tuple(np.shape(self.scales))
        return s[:-1] + (s[-1] * self.group_size,)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes held by the children (packed data, scales, biases, global scale)."""
        return sum(int(np.prod(np.shape(c))) * jnp.dtype(c.dtype).itemsize
                   for c in (self.data, self.scales, self.biases, self.global_scale)
                   if c is not None)

    def __len__(self):
        return self.shape[0]

    # -- not an array -----------------------------------------------------
    # Without these, numpy and jnp would read the object as a sequence of its
    # leading-axis slices (or as an empty array), silently.
    def _not_an_array(self, what):
        return TypeError(
            f"{what} a QuantizedArray: it holds packed codes and scales, not values. "
            f"Use jq.dequantize(qw) (optionally dtype=...) for its values, or pass it to a "
            f"jaxquant op such as jq.qmm; qw[i] indexes its leading axes")

    def __array__(self, dtype=None, copy=None):
        raise self._not_an_array("numpy cannot convert")

    def __jax_array__(self):
        raise self._not_an_array("jax.numpy cannot convert")

    def __iter__(self):
        raise self._not_an_array("cannot iterate over")

    def __getitem__(self, index):
        """Index the leading axes (all but K): `qw[e]`, `qw[idx]`, `qw[:, 3:5]`."""
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is None or i is Ellipsis for i in idx):
            raise IndexError("QuantizedArray indexing takes no None or Ellipsis; "
                             "index the leading axes explicitly")
        if len(idx) > self.ndim - 1:
            raise IndexError(f"QuantizedArray of shape {self.shape} can be indexed on its "
                             f"{self.ndim - 1} leading axes (not K); got {len(idx)} indices")
        if len(idx) == self.ndim - 1 and not isinstance(idx[-1], slice) and np.ndim(idx[-1]) == 0:
            raise IndexError(f"an integer index on the N axis would leave a QuantizedArray "
                             f"without its [N, K] matrix (shape {self.shape}); slice it instead")
        if self.layout != CANONICAL and len(idx) == self.ndim - 1:
            raise IndexError(f"a QuantizedArray in layout {self.layout!r} can be indexed on "
                             f"its {self.ndim - 2} axes before N only (its tiles span N); "
                             f"jq.unpack_layout it first")
        for axis, i in enumerate(idx):  # jnp would clamp an integer past the end silently
            if isinstance(i, (int, np.integer)) and not -self.shape[axis] <= i < self.shape[axis]:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size "
                                 f"{self.shape[axis]} (QuantizedArray of shape {self.shape})")
        pick = lambda c: None if c is None else c[idx]
        gs = self.global_scale
        if gs is not None and np.ndim(gs):
            gs = gs[idx[:np.ndim(gs)]]
        return self.replace(data=pick(self.data), scales=pick(self.scales),
                            biases=pick(self.biases), global_scale=gs)

    def __repr__(self):
        return (f"QuantizedArray(shape={self.shape}, dtype={self.dtype.name}, mode={self.mode!r}, "
                f"bits={self.bits}, group_size={self.group_size}, layout={self.layout!r})")


def _logical_dtype(dtype):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64):
        raise TypeError(f"dtype (the logical dtype) must be float32, float16, bfloat16 or "
                        f"float64; got {dtype!r}")
    return dtype


def validate(qw: QuantizedArray) -> None:
    """Check the children against the format; ValueError/TypeError naming the field.
    The constructor runs it; every op runs it again on its QuantizedArray arguments,
    because one rebuilt through `jax.tree_util.tree_unflatten` (or with a child
    reassigned) skips the constructor, and every backend must refuse the same
    arrays (docs/ops.md)."""
    fmt, qw.bits, qw.group_size = formats.resolve(qw.mode, qw.bits, qw.group_size)
    if qw.layout != CANONICAL:
        return  # a backend's layout is checked by that backend
    data, scales = qw.data, qw.scales
    for name, c in (("data", data), ("scales", scales)):
        if not (hasattr(c, "shape") and hasattr(c, "dtype")):
            raise TypeError(f"{name} must be an array; got {type(c).__name__}")
    if data.dtype != jnp.uint32:
        raise TypeError(f"data must be uint32; got {data.dtype}")
    want_scale = "uint8" if fmt.scale in ("e8m0", "e4m3") else "a float dtype"
    if (scales.dtype == jnp.uint8) != (fmt.scale != "float") or (
            fmt.scale == "float" and not jnp.issubdtype(scales.dtype, jnp.floating)):
        raise TypeError(f"scales for mode={fmt.mode!r} must be {want_scale}; got {scales.dtype}")
    if data.ndim < 2 or scales.ndim != data.ndim:
        raise ValueError(f"data and scales must have the same rank >= 2 ([..., N, K]); got data "
                         f"{data.shape} and scales {scales.shape}")
    if data.shape[:-1] != scales.shape[:-1] or \
            data.shape[-1] * 32 != scales.shape[-1] * qw.group_size * qw.bits:
        k = scales.shape[-1] * qw.group_size
        raise ValueError(
            f"scales shape {scales.shape} does not match data shape {data.shape}: for "
            f"bits={qw.bits}, group_size={qw.group_size} expected data "
            f"{scales.shape[:-1] + (k * qw.bits // 32,)} (K={k})")
    if fmt.has_biases:
        b = qw.biases
        if b is None or not hasattr(b, "shape"):
            raise ValueError(f"mode={fmt.mode!r} needs biases of shape {scales.shape}")
        if b.shape != scales.shape or b.dtype != scales.dtype:
            raise ValueError(f"biases must match scales ({scales.shape}, {scales.dtype}); "
                             f"got {b.shape}, {b.dtype}")
    elif qw.biases is not None:
        raise ValueError(f"mode={fmt.mode!r} has no biases; got biases={qw.biases!r}")
    if qw.global_scale is not None:
        if not fmt.has_global_scale:
            raise ValueError(f"mode={fmt.mode!r} has no global_scale")
        if not hasattr(qw.global_scale, "dtype") or qw.global_scale.dtype != jnp.float32:
            raise TypeError(f"global_scale must be a float32 array; got "
                            f"{getattr(qw.global_scale, 'dtype', type(qw.global_scale).__name__)}")
        gs = np.shape(qw.global_scale)
        if len(gs) > scales.ndim - 2 or gs != scales.shape[:len(gs)]:
            raise ValueError(f"global_scale must be a float32 scalar, or one per leading index "
                             f"(shape a prefix of {scales.shape[:-2]}); got shape {gs}")
