"""Tensor and expert parallelism for the decoder: where each parameter lives on a
("tp", "ep") mesh. jit then partitions the model through the ops' sharding
rules (jaxquant/sharding.py): attention and dense MLP Megatron-style (q/k/v and
gate/up column-parallel on "tp", o and down row-parallel: one all-reduce each),
experts split over "ep" (and within an expert over "tp" the same way), the
KV cache on heads, lm_head on the vocabulary. A weight whose split axis does
not divide evenly (or, for row-parallel quantized weights, whose group count
does not) stays replicated.

The fused matrices (wqkv, w_gate_up, e_gate_up: the parts' rows one after the
other) are split back into their parts when "tp" has several devices: a
column split of the fused rows would give one device all the q (or gate) rows
and another the rest, so the split into q, k, v (gate, up) would move
activations between devices. The parts, each split on "tp", keep every
device's heads (gate and up rows) together."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxquant.models.config import Config
from jaxquant.models.decoder import unfuse_params
from jaxquant.quantized_array import QuantizedArray

# key -> spec of the (stacked [L, ...]) logical matrix; None entries are replicated
TP, EP = "tp", "ep"
SPECS = {
    "wqkv": (None, TP, None), "wq": (None, TP, None), "wk": (None, TP, None),
    "wv": (None, TP, None), "wo": (None, None, TP),
    "bqkv": (None, TP), "bq": (None, TP), "bk": (None, TP), "bv": (None, TP),
    "w_gate_up": (None, TP, None), "w_gate": (None, TP, None), "w_up": (None, TP, None),
    "w_down": (None, None, TP),
    "e_gate_up": (None, EP, TP, None), "e_gate": (None, EP, TP, None),
    "e_up": (None, EP, TP, None), "e_down": (None, EP, None, TP),
    "e_gate_up_bias": (None, EP, TP), "e_gate_bias": (None, EP, TP), "e_up_bias": (None, EP, TP),
    "e_down_bias": (None, EP, None),
    "sinks": (None, TP),
}


def make_mesh(tp: int, ep: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tp * ep > len(devices):
        raise ValueError(f"a {tp} x {ep} (tp x ep) mesh needs {tp * ep} devices; "
                         f"{len(devices)} here")
    return Mesh(np.array(devices[:tp * ep]).reshape(tp, ep), (TP, EP))


def _fits(mesh, shape, spec, units=None):
    """spec with every axis that does not divide its dimension (or `units` of it,
    the quantization groups on K) dropped."""
    out = []
    for i, (n, ax) in enumerate(zip(shape, spec)):
        size = n if units is None or i != len(shape) - 1 else units
        out.append(ax if ax is not None and size % mesh.shape[ax] == 0 else None)
    return tuple(out)


def _place(mesh, a, spec):
    spec = tuple(spec) + (None,) * (np.ndim(a) - len(spec))
    return jax.device_put(a, NamedSharding(mesh, P(*_fits(mesh, np.shape(a), spec))))


def _place_matrix(mesh, w, spec):
    if not isinstance(w, QuantizedArray):
        return _place(mesh, w, spec)
    groups = w.shape[-1] // w.group_size
    spec = _fits(mesh, w.shape, spec, units=groups)
    lead = len(spec) - 2
    gs = w.global_scale
    return QuantizedArray(
        _place(mesh, w.data, spec), _place(mesh, w.scales, spec),
        None if w.biases is None else _place(mesh, w.biases, spec),
        None if gs is None else _place(mesh, gs, spec[:min(np.ndim(gs), lead)]),
        mode=w.mode, bits=w.bits, group_size=w.group_size, dtype=w.dtype, layout=w.layout)


def shard_params(cfg: Config, params, mesh: Mesh):
    """params placed on `mesh` (axes "tp", "ep"); fused matrices split into their
    parts where "tp" has several devices (module docstring)."""
    if mesh.shape[TP] > 1:
        params = unfuse_params(cfg, params)
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # separate per-layer buffers: no layer axis
        layers = tuple({k: _place_matrix(mesh, v, SPECS.get(k, (None,))[1:])
                        for k, v in p.items()} for p in layers)
    else:
        layers = {k: _place_matrix(mesh, v, SPECS.get(k, ())) for k, v in layers.items()}
    out = {k: _place_matrix(mesh, v, (TP, None) if k == "lm_head" else ())
           for k, v in params.items() if k != "layers"}
    out["layers"] = layers
    return out


def shard_cache(cfg: Config, cache, mesh: Mesh):
    """KV cache [L, B, S, Hkv, hd] split on heads over "tp"."""
    return tuple(_place(mesh, c, (None, None, None, TP, None)) for c in cache)
