"""Flax NNX models on jaxquant (docs/nnx.md): quantize a module's linear layers in place.

    import jaxquant.nnx as jqnnx
    jqnnx.quantize(model, mode="mxfp4")          # every nnx.Linear / LinearGeneral / Einsum
    jqnnx.quantize(model, mode="affine", bits=4, filter=lambda path, m: "mlp" in path)

Each selected layer is replaced, in its parent, by a `QuantizedEinsum`: its kernel
becomes a `QuantizedArray` [*B, N, K] (an `nnx.Param`) and its call runs `jq.qmm`.
One class serves the three layer kinds because each is an einsum of x with the
kernel: `nnx.Linear` is "...k,kn->...n", `nnx.LinearGeneral` contracts its `axis`
with the kernel's leading axes, `nnx.Einsum` has its own string. The kernel's
letters split into batch (in x, kernel and output: e.g. heads), contracted (K:
in x and kernel) and output (N: in kernel and output) letters; the weight is
stored as [batch, N, K] (groups along K, as `jq.quantize` wants) and x is moved
to [batch, rows, K] around one `jq.qmm`.

Biases stay float and are added after the matmul, as the float layers do. A
kernel sharded over a mesh keeps its sharding: the quantized arrays are placed
with the kernel's partition moved to the [N, K] order (K split only where whole
quantization groups fall on each shard).
"""

from __future__ import annotations

import math
import string
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant.quantized_array import QuantizedArray

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("jaxquant.nnx needs Flax (pip install flax)") from e

__all__ = ["QuantizedEinsum", "quantize"]

_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


class QuantizedEinsum(nnx.Module):
    """out = einsum(x, dequantize(qweight) as the original kernel) (+ bias), through jq.qmm.

    qweight: nnx.Param holding a QuantizedArray [*batch, N, K] (batch, N and K each
    the product of the kernel axes of that role); spec: the einsum "x,kernel->out"
    of the layer it replaced ("..." allowed in x and out); kernel_shape: the
    original kernel's shape; dtype: the computation dtype (None: x's)."""

    def __init__(self, spec: str, kernel_shape, qweight: QuantizedArray, bias=None,
                 dtype=None, kernel_metadata=None):
        self.spec = spec
        self.kernel_shape = tuple(kernel_shape)
        self.dtype = dtype
        self.qweight = nnx.Param(qweight, **(kernel_metadata or {}))
        self.bias = None if bias is None else nnx.Param(bias)

    def __call__(self, x, out_sharding=None):
        plan = _Plan(self.spec, self.kernel_shape)
        dtype = self.dtype or jnp.result_type(x)
        x = jnp.asarray(x, dtype)
        qw = self.qweight.get_value()
        xt = jnp.einsum(f"{plan.x_in}->{plan.x_mid}", x)  # [*batch, *rows, *K]
        nb = len(plan.batch)
        rows = xt.shape[nb:xt.ndim - len(plan.contract)]
        bsz = xt.shape[:nb]
        x3 = xt.reshape(*bsz, math.prod(rows), plan.k)
        y = jq.qmm(x3, qw)  # [*batch, M, N]
        y = y.reshape(*bsz, *rows, *plan.out_sizes)
        y = jnp.einsum(f"{plan.y_mid}->{plan.y_out}", y)
        if self.bias is not None:  # as nnx.Einsum adds it (Linear's is its special case)
            y = y + jnp.reshape(self.bias[...].astype(y.dtype), plan.bias_shape(y.ndim))
        if out_sharding is not None:  # as the float layers take it (nnx.MultiHeadAttention)
            y = jax.lax.with_sharding_constraint(y, out_sharding)
        return y


    def dequantized_kernel(self, dtype=None):
        """The float kernel this layer multiplies by, in the replaced layer's shape."""
        plan = _Plan(self.spec, self.kernel_shape)
        return plan.kernel(jq.dequantize(self.qweight.get_value(), dtype=dtype))


class _Plan:
    """The roles of an einsum's letters, and the transposes around jq.qmm."""

    def __init__(self, spec: str, kernel_shape):
        spec = spec.replace(" ", "")
        try:
            ins, y_spec = spec.split("->")
            x_spec, w_spec = ins.split(",")
        except ValueError:
            raise ValueError(f"einsum {spec!r}: expected 'x,kernel->out'") from None
        if "." in w_spec or len(w_spec) != len(kernel_shape):
            raise ValueError(f"einsum {spec!r}: the kernel term must name each of its "
                             f"{len(kernel_shape)} axes (no '...')")
        size = dict(zip(w_spec, kernel_shape))
        x_letters = x_spec.replace("...", "")
        y_letters = y_spec.replace("...", "")
        self.batch = [c for c in w_spec if c in x_letters and c in y_letters]
        self.contract = [c for c in w_spec if c in x_letters and c not in y_letters]
        self.out = [c for c in w_spec if c in y_letters and c not in x_letters]
        only_w = [c for c in w_spec if c not in x_letters and c not in y_letters]
        if only_w or not self.contract or not self.out:
            raise ValueError(f"einsum {spec!r}: the kernel needs contracted and output axes "
                             f"and no axis summed on its own")
        rows = [c for c in x_letters if c not in w_spec]
        ell = "..." if "..." in x_spec else ""
        if ("..." in y_spec) != bool(ell):
            raise ValueError(f"einsum {spec!r}: '...' must appear in both x and out or in neither")
        b, r, k, n = "".join(self.batch), "".join(rows), "".join(self.contract), "".join(self.out)
        self.x_in, self.x_mid = x_spec, f"{b}{ell}{r}{k}"
        self.y_mid, self.y_out = f"{b}{ell}{r}{n}", y_spec
        self.w_spec, self.w_mid = w_spec, f"{b}{n}{k}"
        self.k = math.prod(size[c] for c in self.contract)
        self.n = math.prod(size[c] for c in self.out)
        self.batch_sizes = [size[c] for c in self.batch]
        self.out_sizes = [size[c] for c in self.out]
        self.y_spec = y_spec
        self.size = size

    def weight(self, kernel):
        """The kernel as [*batch, N, K]."""
        w = jnp.einsum(f"{self.w_spec}->{self.w_mid}", kernel)
        return w.reshape(*self.batch_sizes, self.n, self.k)

    def kernel(self, w):
        """[*batch, N, K] back to the kernel's own shape and axis order."""
        size = self.size
        mid = [size[c] for c in self.w_mid]
        return jnp.einsum(f"{self.w_mid}->{self.w_spec}", w.reshape(mid))

    def bias_shape(self, ndim):
        """The bias broadcast against the output: the kernel's size on each output
        axis that comes from the kernel, 1 elsewhere ("..." included)."""
        shape = []
        for part in self.y_spec.split("..."):
            shape.append([self.size.get(c, 1) for c in part])
        if len(shape) == 1:
            return tuple(shape[0])
        return (*shape[0], *(1,) * (ndim - len(shape[0]) - len(shape[1])), *shape[1])


def _layer_spec(layer) -> str:
    """The einsum "x,kernel->out" a float layer computes (its bias added as
    nnx.Einsum adds one)."""
    if isinstance(layer, nnx.Einsum):
        return layer.einsum_str
    ndim = layer.kernel[...].ndim
    if isinstance(layer, nnx.LinearGeneral):
        if layer.batch_axis:
            raise ValueError("nnx.LinearGeneral with batch_axis is not supported "
                             "(exclude it with filter=)")
        n_in = len(layer.in_features)
        if tuple(layer.axis) != tuple(range(-n_in, 0)):
            raise ValueError(f"nnx.LinearGeneral with axis={layer.axis} is not supported: "
                             f"only the last {n_in} axes of x (exclude it with filter=)")
    else:
        n_in = 1
    letters = string.ascii_letters
    k, n = letters[:n_in], letters[n_in:ndim]
    return f"...{k},{k}{n}->...{n}"


def _sharding_of(a):
    s = getattr(a, "sharding", None)
    return s if isinstance(s, NamedSharding) else None


def _quantized_placement(qw: QuantizedArray, plan: _Plan, kernel, group_size):
    """qw's arrays placed like the kernel: its axes' partition moved to [*batch, N, K]."""
    sharding = _sharding_of(kernel)
    if sharding is None:
        return qw
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    by_letter = dict(zip(plan.w_spec, spec))

    def one_axis(letters):  # one mesh axis (or None) for a merged axis
        names = [by_letter[c] for c in letters if by_letter[c] is not None]
        return names[0] if len(names) == 1 and by_letter[letters[0]] is not None else None

    lead = [by_letter[c] for c in plan.batch]
    n_ax, k_ax = one_axis(plan.out), one_axis(plan.contract)
    mesh = sharding.mesh
    groups = plan.k // group_size
    if k_ax is not None and groups % mesh.shape[k_ax]:
        k_ax = None
    if n_ax is not None and plan.n % mesh.shape[n_ax]:
        n_ax = None
    put = lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, P(*s)))
    spec2 = (*lead, n_ax, k_ax)
    gs = qw.global_scale
    return qw.replace(data=put(qw.data, spec2), scales=put(qw.scales, spec2),
                      biases=put(qw.biases, spec2), global_scale=None if gs is None else put(gs, ()))


def _quantize_layer(layer, kw, prepack):
    kernel = layer.kernel[...]
    spec = _layer_spec(layer)
    plan = _Plan(spec, kernel.shape)
    w = plan.weight(kernel)
    # canonical first: its N and K split across the kernel's mesh as they are;
    # the kernel layout is applied to the placed arrays
    qw = jq.quantize(w, **kw, layout="canonical")
    qw = _quantized_placement(qw, plan, kernel, qw.group_size)
    if prepack:
        qw = jq.prepack(qw)
    meta = {}
    names = layer.kernel.get_metadata().get("sharding_names")
    if names:  # the kernel's logical axis names moved to [*batch, N, K] order
        by_letter = dict(zip(plan.w_spec, names))
        merged = lambda ls: by_letter[ls[0]] if len(ls) == 1 else None
        meta["sharding_names"] = (*[by_letter[c] for c in plan.batch], merged(plan.out),
                                  merged(plan.contract))
    bias = None if layer.bias is None else layer.bias[...]
    return QuantizedEinsum(spec, kernel.shape, qw, bias, layer.dtype, meta)


def _default_filter(path, module) -> bool:
    return True


def quantize(model, mode: str = "affine", *, filter: Callable | None = None,
             prepack: bool = True, **quantize_kwargs):
    """Quantize `model`'s nnx.Linear / nnx.LinearGeneral / nnx.Einsum layers in place.

    filter(path, module) -> bool picks the layers (default: all); path is the tuple
    of attribute names / indices from `model` (as `nnx.iter_graph` gives it).
    Other keywords go to `jq.quantize` (bits, group_size, scale_rule). The weights
    are prepacked to the default device's kernel layout unless prepack=False.
    Returns the list of paths replaced. A selected layer that cannot be quantized
    (K not a multiple of the group size, an unsupported LinearGeneral) raises
    ValueError naming its path; exclude it with `filter`."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module; got {type(model).__name__}")
    if filter is not None and not callable(filter):
        raise TypeError(f"filter must be callable (path, module) -> bool; got {filter!r}")
    select = filter or _default_filter
    kw = dict(mode=mode, **quantize_kwargs)
    targets = [(path, node) for path, node in nnx.iter_graph(model)
               if isinstance(node, _LAYERS) and path and select(path, node)]
    if isinstance(model, _LAYERS) and select((), model):
        raise ValueError("model is itself a linear layer: quantize its parent module")
    done = []
    for path, layer in targets:
        try:
            new = _quantize_layer(layer, kw, prepack)
        except ValueError as e:
            raise ValueError(f"layer {'.'.join(map(str, path))}: {e}") from None
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) or not hasattr(parent, str(p)) else getattr(parent, p)
        last = path[-1]
        if isinstance(last, int) or not hasattr(parent, str(last)):
            parent[last] = new
        else:
            setattr(parent, last, new)
        done.append(path)
    return done
