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
device's heads (gate and up rows) together.

With `mesh=` (models.forward / prefill / decode / generate), the MoE blocks run
expert parallel in a shard_map (`expert_parallel_moe`), so no path gathers the
experts (float ones included). `init_params` draws a model straight into its
placed, quantized form (no host copy); models.checkpoint.load(..., mesh=)
reads each device's slices from the file. docs/sharding.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant.models.config import Config
from jaxquant import layouts
from jaxquant.models import params as model_params
from jaxquant.models.moe import experts_mlp
from jaxquant.models.params import EXPERT_BIASES, EXPERT_STACKS, unfuse_params
from jaxquant.quantized_array import CANONICAL, QuantizedArray

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


def named_spec(mesh, a, spec):
    """The PartitionSpec of `spec` for array (or shape) a on mesh: padded to a's rank,
    axes that do not divide a's dims dropped."""
    shape = tuple(a.shape) if hasattr(a, "shape") else np.shape(a)  # arrays or their shapes
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*_fits(mesh, shape, spec))


def _place(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, named_spec(mesh, a, spec)))


def matrix_specs(mesh, w, spec, name: str = "weight"):
    """The PartitionSpec (a QuantizedArray: one per array, as a QuantizedArray of
    them) each of w's arrays gets on `mesh` for the logical spec of w (SPECS).
    A kernel layout splits on N only in whole tiles and on K only as its split
    layout (mesh_layout) allows: anything else raises ValueError naming `name`."""
    if not isinstance(w, QuantizedArray):
        return named_spec(mesh, w, spec)
    groups = w.shape[-1] // w.group_size
    spec = _fits(mesh, w.shape, spec, units=groups)
    if w.layout != CANONICAL:
        _check_tiles(mesh, w, spec, name)
    lead = len(spec) - 2
    children = [None if c is None else named_spec(mesh, c, spec)
                for c in (w.data, w.scales, w.biases)]
    gs = w.global_scale
    children.append(None if gs is None else named_spec(mesh, gs, spec[:min(len(gs.shape), lead)]))
    return QuantizedArray.tree_unflatten(w.tree_flatten()[1], children)


def _check_tiles(mesh, w, spec, name):
    why = _tile_problems(mesh, w, spec)
    if why:
        raise ValueError(f"{name} {w.shape} in the {w.layout} layout on a {dict(mesh.shape)} "
                         f"mesh: {why[0][1]} (logical_specs drops such an axis, mesh_layout "
                         f"puts a K split in its split layout)")


def _tile_problems(mesh, w, spec, convertible=False):
    """[(axis index, why)] for each of w's N and K split axes in `spec` that its
    kernel layout cannot take: N not in whole tiles; K whose blocks are not
    valid layouts (convertible: those a split layout, mesh_layout's, can hold)."""
    out = []
    n_ax, k_ax = spec[-2], spec[-1]
    if n_ax is not None and mesh.shape[n_ax] > 1:
        block, rows = layouts.get(w.layout).row_block, w.shape[-2]
        if np.shape(w.scales)[-2] != rows or not block or rows % (mesh.shape[n_ax] * block):
            out.append((-2, f"N={rows} does not split over {n_ax!r} ({mesh.shape[n_ax]} "
                            f"devices) into whole {block}-row tiles of the layout"))
    if k_ax is not None and mesh.shape[k_ax] > 1:
        shards = mesh.shape[k_ax]
        if layouts.shard_layout(w.layout, shards) is None:
            target = layouts.split_layout(layouts.split_of(w.layout)[0], shards)
            why = layouts.get(target).unsupported(jax.eval_shape(jq.unpack_layout, w))
            if not convertible or why is not None:
                out.append((-1, f"K={w.shape[-1]} does not split over {k_ax!r} ({shards} "
                                f"devices) in the layout"
                                + (f": {target}: {why}" if why else f" (needs {target!r})")))
    return out


def _fit_layout(mesh, w, spec):
    """spec (padded to w's rank, non-dividing axes dropped) with each axis w's
    kernel layout cannot split on (_tile_problems, convertible) dropped too."""
    spec = tuple(spec) + (None,) * (len(w.shape) - len(spec))
    if not isinstance(w, QuantizedArray):
        return _fits(mesh, w.shape, spec)
    spec = list(_fits(mesh, w.shape, spec, units=w.shape[-1] // w.group_size))
    if w.layout != CANONICAL:
        for i, _ in _tile_problems(mesh, w, spec, convertible=True):
            spec[i] = None
    return tuple(spec)


def logical_specs(mesh, p: dict, stacked: bool = True) -> dict:
    """key -> the logical spec each weight of one layer dict (stacked: with the
    layer axis) is placed by on `mesh`: SPECS with every axis dropped that does
    not divide, or that a kernel layout cannot split in whole tiles (kept whole
    on it: docs/sharding.md); and "tp" dropped from all the experts (matrices
    and biases) where one of them cannot take it, so that expert_parallel_moe
    never gathers a placed block."""
    cut = 0 if stacked else 1
    specs = {k: _fit_layout(mesh, v, SPECS.get(k, (None,))[cut:]) for k, v in p.items()}
    experts = [k for k in EXPERT_STACKS if k in p]
    if experts and not all(TP in specs[k] for k in experts):
        for k in experts + [k for k in EXPERT_BIASES if k in p]:
            specs[k] = tuple(None if a == TP else a for a in specs[k])
    return specs


def mesh_layout(mesh, w, spec):
    """w in the layout it is placed in under the (logical_specs) spec: a kernel
    layout whose K splits over a mesh axis goes into its split layout
    (jaxquant/layouts: each device's contiguous block of the packed arrays is
    then its block of K in the base layout, which the kernels read). Float
    weights, the canonical layout and unsplit K: w as it is."""
    if not isinstance(w, QuantizedArray) or w.layout == CANONICAL:
        return w
    k_ax = tuple(spec)[-1] if len(spec) == w.ndim else None
    if k_ax is None or layouts.shard_layout(w.layout, mesh.shape[k_ax]) is not None:
        return w
    return jq.prepack(w, layouts.split_layout(layouts.split_of(w.layout)[0], mesh.shape[k_ax]))


def mesh_layouts(mesh, p: dict, stacked: bool = True) -> tuple[dict, dict]:
    """(p with each weight in its mesh_layout, the logical specs it is placed by)."""
    specs = logical_specs(mesh, p, stacked)
    return {k: mesh_layout(mesh, v, specs[k]) for k, v in p.items()}, specs


def local_blocks(mesh, p: dict, specs: dict) -> dict:
    """Inside a shard_map over `mesh`: each QuantizedArray of p (placed by `specs`,
    matrix_specs') recorded in the layout of the block a device holds (a split
    layout's block is its base layout)."""
    def local(v, spec):
        if not isinstance(v, QuantizedArray) or v.layout == CANONICAL:
            return v
        k_ax = jax.tree_util.tree_leaves(spec, is_leaf=_is_spec)[0][-1]
        return v if k_ax is None else layouts.with_layout(
            v, layouts.shard_layout(v.layout, mesh.shape[k_ax]))
    return {k: local(v, specs[k]) for k, v in p.items()}


def _is_spec(x):
    return isinstance(x, P)


def _place_matrix(mesh, w, spec, name="weight"):
    return put_sharded(mesh, w, matrix_specs(mesh, w, spec, name))


def layer_specs(p: dict, mesh: Mesh) -> dict:
    """The specs (matrix_specs) of one layer's dict of weights (no layer axis)."""
    specs = logical_specs(mesh, p, stacked=False)
    return {k: matrix_specs(mesh, v, specs[k], k) for k, v in p.items()}


def shard_params(cfg: Config, params, mesh: Mesh):
    """params placed on `mesh` (axes "tp", "ep"); fused matrices split into their
    parts where "tp" has several devices (module docstring)."""
    if mesh.shape[TP] > 1:
        params = unfuse_params(cfg, params)
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # separate per-layer buffers: no layer axis
        layers = [mesh_layouts(mesh, p, stacked=False)[0] for p in layers]
        layers = tuple(put_sharded(mesh, p, layer_specs(p, mesh)) for p in layers)
    else:
        layers, specs = mesh_layouts(mesh, layers)
        layers = {k: _place_matrix(mesh, v, specs[k], k) for k, v in layers.items()}
    out = {k: _place_matrix(mesh, v, _fit_layout(mesh, v, (TP, None) if k == "lm_head" else ()),
                            k) for k, v in params.items() if k != "layers"}
    out["layers"] = layers
    return out


def put_sharded(mesh, tree, specs):
    """tree's arrays placed by the matching specs (a pytree prefix of PartitionSpecs)."""
    return jax.tree_util.tree_map(lambda s, a: jax.device_put(a, NamedSharding(mesh, s)),
                                  specs, tree, is_leaf=_is_spec)


def shard_cache(cfg: Config, cache, mesh: Mesh):
    """KV cache [L, B, S, Hkv, hd] split on heads over "tp"."""
    return tuple(_place(mesh, c, (None, None, None, TP, None)) for c in cache)


def expert_parallel_moe(cfg: Config, p, x, idx, weights, mesh: Mesh):
    """decoder.moe_mlp on a mesh: x [T, D] (replicated: at decode a few rows, at
    prefill the [T, D] activations, small beside the experts), the router's
    idx / weights [T, k] -> [T, D].

    A shard_map over the whole mesh with each expert weight in its own placement
    (SPECS: experts split on "ep", within an expert gate/up rows and down's K on
    "tp"): each device routes the tokens to its local experts only (another
    device's expert: a masked pair, exactly 0), runs gather_qmm / ragged_qmm (or
    their float forms) on its local blocks, and one psum over ("ep", "tp") adds
    the [T, D] partial sums. The collectives move activations only; jit's own
    partitioning of `w[idx]` / ragged_dot on float experts split over E
    all-gathers the experts instead. Where E does not split over "ep" the
    experts are replicated on it and every "ep" device runs them all, so the
    psum is over "tp" only; where the experts' I does not split over "tp" the
    same for "tp"."""
    names = [k for k in EXPERT_STACKS + EXPERT_BIASES if k in p]
    logical = logical_specs(mesh, p, stacked=False)
    specs = {k: matrix_specs(mesh, p[k], logical[k], k) for k in names}
    first = lambda k: jax.tree_util.tree_leaves(specs[k], is_leaf=_is_spec)[0]
    matrices = [k for k in names if k in EXPERT_STACKS]
    ep_split = all(first(k)[0] == EP for k in matrices)
    tp_split = all(TP in first(k) for k in matrices)
    if not (ep_split and tp_split):  # one split for all of them, or none
        keep = (EP,) * ep_split + (TP,) * tp_split
        specs = {k: jax.tree_util.tree_map(
            lambda s: P(*(a if a in keep else None for a in s)), specs[k], is_leaf=_is_spec)
            for k in names}
    axes = (EP,) * ep_split + (TP,) * tp_split
    local_experts = cfg.num_experts // mesh.shape[EP] if ep_split else cfg.num_experts

    def local(x, idx, weights, pe):
        pe = local_blocks(mesh, pe, specs)
        offset = lax.axis_index(EP) * local_experts if ep_split else 0
        if tp_split and "e_down_bias" in pe:  # down's partial sums over tp: its bias once
            pe = dict(pe, e_down_bias=jnp.where(lax.axis_index(TP) == 0,
                                                pe["e_down_bias"], 0))
        y = experts_mlp(cfg, pe, x, idx - offset, weights, local_experts)
        return lax.psum(y, axes) if axes else y

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), specs), out_specs=P(),
                        check_vma=False)
    return run(x, idx, weights, {k: p[k] for k in names}).astype(x.dtype)


def init_params(cfg: Config, key, mesh: Mesh, mode=None, *, per_layer: bool | None = None,
                layout: str | None = None, dtype=None):
    """Random parameters straight into their sharded (and, with `mode`, quantized
    and prepacked) form: the same values as
    ``shard_params(cfg, quantize_params(models.init_params(cfg, key), mode), mesh)``
    without ever holding a full or unsharded copy. Each layer is drawn, fused (split
    into parts where "tp" has several devices), quantized and prepacked in one jit
    whose out_shardings are the layer's placement, one layer at a time: the
    peak beyond the result is one layer. mode: a params.MODES name or jq.quantize
    arguments (None: float); layout, per_layer: quantize_params'."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    per_layer = model_params.default_per_layer() if per_layer is None else per_layer
    kw = None if mode is None else dict(model_params.quantize_args(mode), layout=layout)
    k_layers, k_embed, k_head = jax.random.split(key, 3)
    split = mesh.shape[TP] > 1

    def make_layer(k):
        p = model_params.init_layer(cfg, dtype, k)
        if split:
            p = unfuse_params(cfg, {"layers": (p,)})["layers"][0]
        if kw is not None:
            p = {n: jq.quantize(w, **kw) if n in model_params.MATRICES else w for n, w in p.items()}
        p = model_params.prepack_params({"layers": (p,)}, layout)["layers"][0]
        return mesh_layouts(mesh, p, stacked=False)[0]

    def sharded(fn, specs_of, key):
        """fn jitted with its result placed by specs_of(its shapes): one compile per fn."""
        shapes = jax.eval_shape(fn, key)
        shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs_of(shapes),
                                           is_leaf=_is_spec)
        return jax.jit(fn, out_shardings=shardings)

    layer_keys = jax.random.split(k_layers, cfg.num_layers)
    draw_layer = sharded(make_layer, lambda s: layer_specs(s, mesh), layer_keys[0])
    layers = tuple(draw_layer(k) for k in layer_keys)
    params = {"layers": layers, "final_norm": _place(mesh, jnp.ones((cfg.hidden_size,), dtype),
                                                     ())}
    d = cfg.hidden_size
    params["embed"] = sharded(lambda k: model_params.normal_init(k, (cfg.vocab_size, d), dtype, fan_in=1),
                              lambda s: P(), k_embed)(k_embed)
    if not cfg.tie_embeddings:
        def head(k):
            w = model_params.normal_init(k, (cfg.vocab_size, d), dtype)
            w = w if kw is None else jq.quantize(w, **kw)
            return model_params.prepack_params({"layers": (), "lm_head": w}, layout)["lm_head"]
        head_specs = lambda s: matrix_specs(mesh, s, _fit_layout(mesh, s, (TP, None)), "lm_head")
        params["lm_head"] = sharded(head, head_specs, k_head)(k_head)
    if not per_layer:
        params = shard_params(cfg, model_params.stack_layers(params), mesh)
    return params
