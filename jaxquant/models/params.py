"""The decoder's parameters and their transforms: random initialization, fusing
and splitting the q/k/v and gate/up matrices, stacking and unstacking the layers,
quantization, kernel layouts (prepack) and the 8-bit activations opt-in.

Parameters are a dict pytree. Per-layer weights are stacked on a leading layer
axis (or, after `unstack_layers`, one dict per layer: separate buffers). A
matrix is a float array [N, K], a `QuantizedArray` [N, K] or a `PermutedMatrix`
(act-order GPTQ); y = x @ W.T any way (`linear`), so the same code runs bf16
and every quantized mode.
Keys (per layer, stacked under "layers"):

  attn_norm, mlp_norm [D]; wqkv [(Hq+2Hkv)*hd, D] (q rows, then k, then v),
  wo [D, Hq*hd]; bqkv, bo (attention_bias); q_norm/k_norm [hd] (qk_norm);
  sinks [Hq] (gpt_oss)
  dense:  w_gate_up [2I, D] (gate rows, then up rows), w_down [D, I]
  MoE:    router [E, D] (+ router_bias [E], gpt_oss); e_gate_up [E, 2I, D]
          (gate rows, then up rows), e_down [E, D, I]; e_gate_up_bias [E, 2I],
          e_down_bias [E, D] (gpt_oss)

and embed [V, D], final_norm [D], lm_head [V, D] (absent when tied).

The fused matrices are the separate ones' rows one after the other ("halves":
gate rows first, then up rows; q, k, v). Quantization groups run along K, so a
fused matrix quantizes to exactly the codes and scales of its parts (nvfp4's
one global scale excepted). The separate keys (wq/wk/wv + bq/bk/bv, w_gate/w_up,
e_gate/e_up + e_gate_bias/e_up_bias) run too: `fuse_params` and
`unfuse_params` convert (the sharded model uses the separate ones on a mesh
that splits them, parallel.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant.formats import PRESETS
from jaxquant.models.config import Config
from jaxquant.models.layers import PermutedMatrix
from jaxquant.models.layerwise import build_layers, release_on_failure
from jaxquant.quantized_array import QuantizedArray


EXPERT_STACKS = ("e_gate_up", "e_gate", "e_up", "e_down")
# flattened with them under experts_by_layer (indexed by the same expert rows)
EXPERT_BIASES = tuple(k + "_bias" for k in EXPERT_STACKS)


def is_per_layer(params_or_layers) -> bool:
    """Whether the layers are separate buffers (a tuple of per-layer dicts) rather
    than stacked [L, ...] arrays."""
    layers = params_or_layers
    if isinstance(layers, dict) and "layers" in layers:
        layers = layers["layers"]
    return isinstance(layers, (list, tuple))


def default_per_layer() -> bool:
    """The layer form that runs fastest on the default device: separate per-layer
    buffers on a GPU, stacked arrays (one compiled layer body) elsewhere.

    Measured on an H100 (Llama-3-8B dimensions, bf16, batch 1): lax.scan over
    stacked weights 62 tok/s (XLA copies each layer's slice before cuBLAS and
    Pallas calls), a Python loop over static slices of the stacks 40 tok/s,
    a Python loop over per-layer buffers 150 tok/s (docs/models.md)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def init_params(cfg: Config, key, dtype=None, *, per_layer: bool | None = None):
    """Random parameters (normal, 1/sqrt(fan_in) scaled), float, in the layout above
    (fused wqkv / w_gate_up / e_gate_up). per_layer: the layers as separate buffers
    drawn one at a time (None: default_per_layer()); either form holds the same
    values for the same key."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    per_layer = default_per_layer() if per_layer is None else per_layer
    k_layers, k_embed, k_head = jax.random.split(key, 3)
    layer_keys = jax.random.split(k_layers, cfg.num_layers)
    one = functools.partial(init_layer, cfg, dtype)
    layers = tuple(one(k) for k in layer_keys) if per_layer else jax.vmap(one)(layer_keys)
    d = cfg.hidden_size
    params = {"embed": normal_init(k_embed, (cfg.vocab_size, d), dtype, fan_in=1), "layers": layers,
              "final_norm": jnp.ones((d,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = normal_init(k_head, (cfg.vocab_size, d), dtype)
    return params


def normal_init(key, shape, dtype, fan_in=None):
    """Random normal weights scaled by fan_in ** -0.5 (default: the last dim)."""
    # drawn in `dtype` itself: no float32 copy of a 20B-parameter model
    fan_in = fan_in or shape[-1]
    return jax.random.normal(key, shape, dtype) * jnp.asarray(fan_in ** -0.5, dtype)


def init_layer(cfg: Config, dtype, key):
    """One layer's random weights."""
    D, hd = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    keys = iter(jax.random.split(key, 16))

    def w(*shape, fan_in=None):
        return normal_init(next(keys), shape, dtype, fan_in)

    p = {"attn_norm": jnp.ones((D,), dtype), "mlp_norm": jnp.ones((D,), dtype),
         "wqkv": w((hq + 2 * hkv) * hd, D), "wo": w(D, hq * hd)}
    if cfg.attention_bias:
        p["bqkv"] = w((hq + 2 * hkv) * hd, fan_in=16)
        p["bo"] = w(D, fan_in=16)
    if cfg.qk_norm:
        p["q_norm"] = jnp.ones((hd,), dtype)
        p["k_norm"] = jnp.ones((hd,), dtype)
    if cfg.moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        p["router"] = w(E, D)
        p["e_gate_up"] = w(E, 2 * I, D)
        p["e_down"] = w(E, D, I)
    else:
        I = cfg.intermediate_size
        p.update(w_gate_up=w(2 * I, D), w_down=w(D, I))
    # drawn after the MLP's weights, the sinks, then the biases: a key keeps its weights
    if cfg.attention_sinks:
        p["sinks"] = w(hq, fan_in=1)
    if cfg.moe and cfg.moe_bias:
        p["router_bias"] = w(cfg.num_experts, fan_in=16)
        p["e_gate_up_bias"] = w(cfg.num_experts, 2 * I, fan_in=16)
        p["e_down_bias"] = w(cfg.num_experts, D, fan_in=16)
    return p


# fused key -> the separate keys whose rows it holds, in order (biases: the last axis)
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"),
         "e_gate_up": ("e_gate", "e_up")}
FUSED_BIASES = {"wqkv": ("bqkv", ("bq", "bk", "bv")),
                "e_gate_up": ("e_gate_up_bias", ("e_gate_bias", "e_up_bias"))}


def _concat_rows(parts):
    """The parts' rows one after the other (float arrays, or QuantizedArrays of one
    format without a global scale, or PermutedMatrix parts with one permutation),
    or None where they cannot be one matrix."""
    if any(isinstance(a, PermutedMatrix) for a in parts):
        perm = parts[0].perm if isinstance(parts[0], PermutedMatrix) else None
        if perm is None or not all(isinstance(a, PermutedMatrix)
                                   and np.array_equal(a.perm, perm) for a in parts):
            return None
        cat = _concat_rows([a.matrix for a in parts])
        return None if cat is None else PermutedMatrix(cat, perm)
    if not any(isinstance(a, QuantizedArray) for a in parts):
        return jnp.concatenate(parts, axis=-2)
    if not all(isinstance(a, QuantizedArray) for a in parts):
        return None
    first = parts[0]
    kinds = {(a.mode, a.bits, a.group_size, jnp.dtype(a.dtype), a.shape[:-2], a.shape[-1])
             for a in parts}
    if len(kinds) > 1 or any(a.global_scale is not None for a in parts):
        return None  # nvfp4: each part's global scale is its own
    canonical = [jq.unpack_layout(a) for a in parts]
    cat = lambda *c: None if c[0] is None else jnp.concatenate(c, axis=-2)
    qw = QuantizedArray(*(cat(*(getattr(a, f) for a in canonical))
                          for f in ("data", "scales", "biases")), None, mode=first.mode,
                        bits=first.bits, group_size=first.group_size, dtype=first.dtype)
    layouts = {a.layout for a in parts}
    return jq.prepack(qw, layouts.pop()) if len(layouts) == 1 else qw


def _split_rows(w, sizes):
    """w [..., sum(sizes), K] (float or QuantizedArray) -> its row blocks."""
    cuts = np.cumsum(sizes)[:-1].tolist()
    if isinstance(w, PermutedMatrix):
        return [PermutedMatrix(m, w.perm) for m in _split_rows(w.matrix, sizes)]
    if not isinstance(w, QuantizedArray):
        return jnp.split(w, cuts, axis=-2)
    canonical = jq.unpack_layout(w)
    pieces = [None if c is None else jnp.split(c, cuts, axis=-2)
              for c in (canonical.data, canonical.scales, canonical.biases)]
    return [jq.prepack(QuantizedArray(pieces[0][i], pieces[1][i],
                                      None if pieces[2] is None else pieces[2][i],
                                      w.global_scale, mode=w.mode, bits=w.bits,
                                      group_size=w.group_size, dtype=w.dtype), w.layout)
            for i in range(len(sizes))]


def _map_layers(fn, params):
    """params with fn applied to the layer dict (each one, when unstacked)."""
    layers = params["layers"]
    return dict(params, layers=tuple(fn(dict(p)) for p in layers) if is_per_layer(layers)
                else fn(dict(layers)))


def fuse_layer(p: dict) -> dict:
    """One layer's dict (stacked or not) with its separate matrices fused (fuse_params)."""
    p = dict(p)
    for key, names in FUSED.items():
        if key in p or not all(n in p for n in names):
            continue
        cat = _concat_rows([p[n] for n in names])
        if cat is None:
            continue
        p[key] = cat
        for n in names:
            del p[n]
        bias_key, bias_names = FUSED_BIASES.get(key, (None, ()))
        if bias_names and all(n in p for n in bias_names):
            p[bias_key] = jnp.concatenate([p.pop(n) for n in bias_names], axis=-1)
    return p


def fuse_params(params):
    """The separate wq/wk/wv, w_gate/w_up, e_gate/e_up (and their biases) as the
    fused wqkv, w_gate_up, e_gate_up: rows concatenated, exact. Parts that cannot
    be one matrix (QuantizedArrays of different formats, nvfp4 global scales)
    stay separate."""
    return _map_layers(fuse_layer, params)


def unfuse_params(cfg: Config, params):
    """fuse_params undone: wqkv -> wq, wk, wv (+ biases), w_gate_up -> w_gate, w_up,
    e_gate_up -> e_gate, e_up (+ biases); exact."""
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def unfuse(p):
        for key, names in FUSED.items():
            if key not in p:
                continue
            w = p.pop(key)
            n = w.shape[-2]
            sizes = [hq * hd, hkv * hd, hkv * hd] if key == "wqkv" else [n // 2, n // 2]
            p.update(zip(names, _split_rows(w, sizes)))
            bias_key, bias_names = FUSED_BIASES.get(key, (None, ()))
            if bias_key in p:
                p.update(zip(bias_names, jnp.split(p.pop(bias_key),
                                                   np.cumsum(sizes)[:-1].tolist(), axis=-1)))
        return p
    return _map_layers(unfuse, params)


def unstack_layers(params):
    """params with the stacked layers as one dict per layer (separate buffers)."""
    layers = params["layers"]
    if is_per_layer(layers):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return dict(params, layers=tuple(jax.tree_util.tree_map(lambda a: a[i], layers)
                                     for i in range(n)))


def _format_of(w):
    if isinstance(w, PermutedMatrix):
        return ("permuted",) + _format_of(w.matrix)
    if isinstance(w, QuantizedArray):
        return (w.mode, w.bits, w.group_size, w.layout)
    return ("float",)


def mixed_formats(layers) -> dict:
    """Per-layer dicts -> {key: its formats} for each key whose layers differ in
    format (e.g. MLX's mixed-bit recipes: 4 and 6 bits per layer); {} when every
    matrix has one format across layers (stackable)."""
    out = {}
    for key in layers[0] if layers else ():
        kinds = {_format_of(lay[key]) for lay in layers}
        if len(kinds) > 1:
            out[key] = sorted(map(str, kinds))
    return out


def stack_layers(params):
    """params with per-layer dicts stacked into [L, ...] arrays (for lax.scan). Every
    layer's matrix must have one format (ValueError naming it otherwise)."""
    layers = params["layers"]
    if not is_per_layer(layers):
        return params
    for key, kinds in mixed_formats(layers).items():
        raise ValueError(f"{key}: layers are quantized differently ({kinds}); stacked layers "
                         f"(lax.scan) need one format per matrix across layers (per-layer "
                         f"buffers, per_layer=True, take any)")
    out = {key: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *(lay[key] for lay in layers))
           for key in layers[0]}
    return dict(params, layers=out)


# Matrices that `quantize_params` quantizes (routers and norms stay float).
MATRICES = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down",
            "e_gate_up", "e_gate", "e_up", "e_down")

# demo / CLI names -> jq.quantize arguments
MODES = {name: PRESETS[name] for name in ("affine4", "affine8", "mxfp4", "mxfp8", "nvfp4")}


def quantize_args(mode):
    """jq.quantize arguments for a MODES name (or a dict of them, passed through)."""
    if isinstance(mode, dict):
        return dict(mode)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; expected one of {list(MODES)} "
                         f"(or a dict of jq.quantize arguments)")
    return MODES[mode]


def quantize_params(params, mode: str, *, lm_head: bool = True, layout: str | None = None,
                    fuse: bool = True, per_layer: bool | None = None):
    """Quantize every float weight matrix (and lm_head) to `mode` (a MODES name or
    a dict of jq.quantize arguments); QuantizedArrays already there keep their
    format (gpt-oss's MXFP4 experts). Each layer's matrix quantizes on its own.

    Kernel-ready by default:
    layout: every quantized matrix comes back in this kernel layout (None: the
      fastest for the default device, `jq.prepack`'s choice: cuda_mma on an
      NVIDIA GPU with jaxquant's CUDA library, canonical elsewhere; "canonical"
      opts out).
    fuse: first concatenate q/k/v and gate/up into one matrix each (fuse_params).
    per_layer: the layers as separate buffers (None: default_per_layer(), the
      fastest layer loop on the default device); stacked input is quantized a
      layer at a time straight into that form.

    Memory: a layer at a time (sliced, fused, quantized and put in `layout`, then
    written into the result), so the device holds `params`, the result and one
    layer's temporaries; if it fails (out of memory), none of what it made is left
    held (models.layerwise.build_layers; docs/models.md, "Memory while quantizing")."""
    kw = dict(quantize_args(mode), layout=layout)  # straight into the layout: no repack
    quantize_fn = _jitted(jq.quantize, **kw)
    per_layer = default_per_layer() if per_layer is None else per_layer
    layers = params["layers"]
    n = len(layers) if is_per_layer(layers) else jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = dict(params, layers=build_layers(
        n, lambda i, p: quantize_layer(p, quantize_fn, layout, fuse), per_layer, layers))
    head = out.get("lm_head")
    if lm_head and head is not None and not isinstance(head, (QuantizedArray, PermutedMatrix)):
        try:
            out["lm_head"] = prepack_matrix(quantize_fn(head), layout)
        except BaseException as e:
            release_on_failure(e, out, keep=params)
            out = None
            raise
    elif head is not None:
        out["lm_head"] = prepack_matrix(head, layout)
    return out


def quantize_layer(p: dict, quantize_fn, layout: str | None = None, fuse: bool = True) -> dict:
    """One layer's dict as quantize_params makes it: fused (fuse_layer), its float
    matrices quantized by quantize_fn and every quantized matrix in `layout`, each
    matrix's canonical form dropped as soon as its layout's is made."""
    if fuse:
        p = fuse_layer(p)
    out = {}
    for k, w in p.items():
        if k in MATRICES and not isinstance(w, (QuantizedArray, PermutedMatrix)):
            w = quantize_fn(w)
        out[k] = prepack_matrix(w, layout)
    return out


def prepack_matrix(v, layout: str | None = None):
    """A quantized weight matrix (or PermutedMatrix) in `layout` (jq.prepack); any
    other value as it is."""
    if isinstance(v, PermutedMatrix):
        return PermutedMatrix(jq.prepack(v.matrix, layout), v.perm)
    return jq.prepack(v, layout) if isinstance(v, QuantizedArray) else v


def prepack_params(params, layout: str | None = None):
    """Every quantized weight matrix (not a quantized embedding, whose rows are
    gathered) in `layout` (jq.prepack: None picks the default device's fastest,
    "canonical" unpacks). A stacked weight converts a piece at a time."""
    out = _map_layers(lambda p: {k: prepack_matrix(v, layout) for k, v in p.items()}, params)
    if "lm_head" in out:
        out["lm_head"] = prepack_matrix(out["lm_head"], layout)
    return out


def a8_params(params, dtype: str = "float8_e4m3fn", *, lm_head: bool = True):
    """The prefill opt-in of docs/a8.md: every dense weight matrix (float or quantized:
    q/k/v, o, the MLP's, and lm_head unless lm_head=False) as a jq.RowQuantizedArray of
    `dtype`, so `linear` runs jq.qmm_a8 (x quantized per token). The experts, the
    router and the embedding stay as they are. Prefill with the result and decode with
    the original params (8-bit rows are 2x the bytes of 4-bit ones, and decode is
    read-bound). A stacked [L, ...] matrix converts a layer at a time."""
    dense = tuple(k for k in MATRICES if k not in EXPERT_STACKS)

    def rows(w):
        if isinstance(w, PermutedMatrix):
            return PermutedMatrix(rows(w.matrix), w.perm)
        return _layer_by_layer(_jitted(jq.quantize_rows, dtype=dtype), w)

    out = _map_layers(lambda p: {k: rows(v) if k in dense else v for k, v in p.items()},
                      params)
    if lm_head and "lm_head" in out:
        out["lm_head"] = rows(out["lm_head"])
    return out


def quantize_matrix(w, kw):
    """jq.quantize; a stack [L, ...] layer by layer, so every leaf (an NVFP4 global
    scale too) has the layer axis that lax.scan slices."""
    return _layer_by_layer(_jitted(jq.quantize, **kw), w)


def _layer_by_layer(fn, w):
    """fn(w) of a matrix [N, K]; of a stack [L, N, K], fn of each layer, its results'
    leaves stacked (one layer's float32 temporaries at a time, not the stack's)."""
    if w.ndim == 2:
        return fn(w)
    return jax.tree_util.tree_map(lambda *c: jnp.stack(c), *[fn(w[i]) for i in range(w.shape[0])])


def _jitted(fn, **kw):
    """jax.jit of fn with the static keyword arguments kw, one compiled function per kw."""
    return _jitted_items(fn, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _jitted_items(fn, kw):
    return jax.jit(functools.partial(fn, **dict(kw)))


def weight_bytes(params) -> int:
    """Bytes of all parameters (packed data, scales, biases of quantized ones)."""
    return sum(int(np.prod(np.shape(a))) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(params))


def device_bytes(tree, shared=()) -> int:
    """Bytes of the distinct device arrays of `tree` (an array two leaves share counted
    once) that are not among `shared`'s: what a result holds beyond its input (e.g.
    quantize_params' output, the norms and embedding it passes through left out)."""
    seen = {id(a) for a in jax.tree_util.tree_leaves(shared)}
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        if isinstance(a, jax.Array) and id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total
