"""A decoder-only transformer in plain JAX on jaxquant's ops.

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
that splits them, parallel.py).

MoE layers use `gather_qmm` (float experts: `gather_matmul`) when few tokens run
(decode: each token reads its k experts' weights in place) and `ragged_qmm`
(float experts: `ragged_matmul`) otherwise (prefill: tokens sorted by expert,
one grouped matmul per projection).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxquant as jq
from jaxquant.models.config import Config
from jaxquant.quantized_array import QuantizedArray

# At most this many (token, expert) pairs go through gather_qmm; more through ragged_qmm.
GATHER_MAX_PAIRS = 64


# ---------------------------------------------------------------------------
# Matmuls on float or quantized weights.


class PermutedMatrix(NamedTuple):
    """A matrix stored with its input channels in the order `perm` (GPTQ act-order:
    jq.io.from_gptq): ``x @ W.T == x[..., perm] @ matrix.T``."""
    matrix: QuantizedArray
    perm: jax.Array


# A float matrix at decode goes through the Pallas float GEMV (jq.gather_matmul with the
# matrix as its one expert) on a GPU where XLA's dot was measured slower inside the
# models' decode step: N >= 5120 with K < 8192 (q/k/v, gate+up). XLA stays where it was
# as fast or faster: the o projections (N <= 4096), K >= 8192 (Llama's down), the router
# (N = 32) and the heads (N >= 128k, XLA at 96-99% of copy). benchmarks/h100/decode.json
# `float_gemv.*` (per matrix, in the model, whole model).
FLOAT_GEMV = dict(max_rows=8, min_n=5120, max_n=32768, max_k=8192)


def float_gemv_applies(x, w) -> bool:
    """Whether linear(x, w) on a float w [N, K] takes the Pallas float GEMV (FLOAT_GEMV).
    One device only: the GEMV was measured on one GPU; over a mesh, XLA partitions its
    own dot."""
    rows = int(np.prod(x.shape[:-1]))
    n, k = w.shape
    return (jax.default_backend() == "gpu" and 0 < rows <= FLOAT_GEMV["max_rows"]
            and FLOAT_GEMV["min_n"] <= n <= FLOAT_GEMV["max_n"] and k <= FLOAT_GEMV["max_k"]
            and not _on_several_devices(w))


def float_gemv(x, w):
    """x [..., K] @ w.T for a float w [N, K] as jq.gather_matmul's one-expert product: the
    same float32 sums as the einsum's definition (w cast to x's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = jq.gather_matmul(x2, w[None], jnp.zeros((x2.shape[0], 1), jnp.int32))
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear(x, w, bias=None):
    """x [..., K] @ w.T (w [N, K]: float, QuantizedArray, RowQuantizedArray or
    PermutedMatrix) (+ bias) -> [..., N]."""
    if isinstance(w, PermutedMatrix):
        x, w = jnp.take(x, w.perm, axis=-1), w.matrix
    if isinstance(w, QuantizedArray):
        y = jq.qmm(x, w)
    elif isinstance(w, jq.RowQuantizedArray):  # a8_params: the prefill opt-in
        y = jq.qmm_a8(x, w)
    elif w.ndim == 2 and float_gemv_applies(x, w):
        y = float_gemv(x, w)
    else:
        y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + bias.astype(y.dtype)


def norm_linear(x, norm_weight, w, eps, bias=None):
    """linear(rms_norm(x, norm_weight), w) (+ bias): a projection of the normalized
    residual stream: jq.rms_norm_qmm on a quantized w (one kernel where one exists,
    the two ops elsewhere)."""
    if isinstance(w, QuantizedArray):
        y = jq.rms_norm_qmm(x, norm_weight, w, eps=eps)
        return y if bias is None else y + bias.astype(y.dtype)
    return linear(jq.rms_norm(x, norm_weight, eps=eps), w, bias)


SWIGLU_KINDS = ("silu", "gpt_oss")


def swiglu(gate, up, kind="silu", limit=7.0, alpha=1.702):
    """The gated activation in float32: silu(gate) * up, or gpt-oss's clamped
    (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit, |up| <= limit."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if kind == "gpt_oss":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)
    if kind == "silu":
        return jax.nn.silu(gate) * up
    raise ValueError(f"kind={kind!r} is not known; expected one of {SWIGLU_KINDS}")


def swiglu_linear(x, w_gate_up, bias=None, kind="silu", limit=7.0, alpha=1.702):
    """x [..., K] -> [..., I] (x.dtype): swiglu of linear(x, w_gate_up) (+ bias, in
    float32) split in halves, w_gate_up [2I, K] holding the gate rows, then the up
    rows: jq.qmm_swiglu on a quantized w_gate_up (one kernel where one exists)."""
    if isinstance(w_gate_up, QuantizedArray):
        if kind not in SWIGLU_KINDS:
            raise ValueError(f"kind={kind!r} is not known; expected one of {SWIGLU_KINDS}")
        return jq.qmm_swiglu(x, w_gate_up, activation=kind,
                             limit=limit if kind == "gpt_oss" else None, alpha=alpha, bias=bias)
    gu = linear(x, w_gate_up).astype(jnp.float32)
    if bias is not None:
        gu = gu + bias.astype(jnp.float32)
    gate, up = jnp.split(gu, 2, axis=-1)
    return swiglu(gate, up, kind, limit, alpha).astype(x.dtype)


class ExpertsOfLayer(NamedTuple):
    """Layer `layer`'s experts inside a stack of all layers' experts flattened to
    [L*E, N, K] (see `forward`'s experts_by_layer): expert e is row layer*E + e."""
    stack: QuantizedArray | jax.Array
    layer: jax.Array
    num_experts: int


def _flatten_layers(qw):
    """[L, E, N, K] -> [L*E, N, K]: a reshape (of a QuantizedArray's children; no copy)."""
    if not isinstance(qw, QuantizedArray):
        return qw.reshape(-1, *qw.shape[2:])
    lead = qw.shape[:2]
    flat = lambda c: None if c is None else c.reshape(lead[0] * lead[1], *c.shape[2:])
    gs = qw.global_scale
    if gs is not None:
        gs = jnp.broadcast_to(gs.reshape(gs.shape + (1,) * (2 - gs.ndim)), lead).reshape(-1)
    return QuantizedArray(flat(qw.data), flat(qw.scales), flat(qw.biases), gs, mode=qw.mode,
                          bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype,
                          layout=qw.layout)


def _in_stack(w, rows):
    """(w, rows), or for an ExpertsOfLayer its whole stack and the rows moved to its
    layer's experts."""
    if isinstance(w, ExpertsOfLayer):
        return w.stack, rows + w.layer * w.num_experts
    return w, rows


def expert_gather(x, w, idx):
    """x [T, K] or [T, k, K], w [E, N, K], idx [T, k] -> [T, k, N] (decode): the chosen
    experts read in place (gather_qmm, or gather_matmul for float w; `w[idx]` in XLA
    would copy them first)."""
    w, idx = _in_stack(w, idx)
    if isinstance(w, QuantizedArray):
        return jq.gather_qmm(x, w, idx)
    return jq.gather_matmul(x, w, idx)


def expert_gather_swiglu(cfg: Config, x, w_gate_up, idx, bias):
    """x [T, K], w_gate_up [E, 2I, K] (quantized), idx [T, k], bias [E, 2I] or None
    -> [T, k, I] in x's dtype (decode): jq.gather_qmm_swiglu, the chosen experts'
    gate+up projection with its activation (its fused kernel is opt-in, so by default
    the gather GEMV and XLA's epilogue: docs/fused.md)."""
    if bias is not None:  # flattened with the weights under experts_by_layer
        bias, _ = _in_stack(bias, idx)
    w_gate_up, idx = _in_stack(w_gate_up, idx)
    kind = swiglu_kind(cfg)
    return jq.gather_qmm_swiglu(x, w_gate_up, idx, activation=kind,
                                limit=cfg.swiglu_limit if kind == "gpt_oss" else None,
                                bias=bias)


def expert_ragged(x, w, group_sizes):
    """x [R, K] rows sorted by expert, w [E, N, K] -> [R, N] (prefill): ragged_qmm, or
    ragged_matmul on float experts. A layer of a flattened stack is read in place (its
    groups; every other layer's empty), except float experts on the CPU: there XLA's
    ragged_dot (the reference) multiplies every row by every expert of the stack, so
    the layer's slice is cheaper."""
    quantized = isinstance(getattr(w, "stack", w), QuantizedArray)
    ragged = jq.ragged_qmm if quantized else jq.ragged_matmul
    if isinstance(w, ExpertsOfLayer) and not quantized and jax.default_backend() == "cpu":
        w = lax.dynamic_slice_in_dim(w.stack, w.layer * w.num_experts, w.num_experts)
    if isinstance(w, ExpertsOfLayer):
        sizes = jnp.zeros(w.stack.shape[0], jnp.int32)
        sizes = lax.dynamic_update_slice(sizes, group_sizes.astype(jnp.int32),
                                         (w.layer * w.num_experts,))
        return ragged(x, w.stack, sizes)
    return ragged(x, w, group_sizes)


# ---------------------------------------------------------------------------
# Blocks.


def rope(x, positions, inv_freq, attention_factor):
    """Rotate x [B, T, H, hd] by positions [B, T] (halves convention)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, hd/2]
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
    xf = x.astype(jnp.float32)
    a, b = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def qkv_projection(cfg: Config, p, h):
    """q [B, T, Hq, hd], k, v [B, T, Hkv, hd] of the residual stream h [B, T, D]
    (normalized by attn_norm): one product over wqkv, or three over wq, wk, wv."""
    b, t, _ = h.shape
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "wqkv" in p:
        qkv = norm_linear(h, p["attn_norm"], p["wqkv"], cfg.rms_eps, p.get("bqkv"))
        q, k, v = jnp.split(qkv, [hq * hd, (hq + hkv) * hd], axis=-1)
    else:
        x = jq.rms_norm(h, p["attn_norm"], eps=cfg.rms_eps)
        q, k, v = (linear(x, p[w], p.get(bias))
                   for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    return q.reshape(b, t, hq, hd), k.reshape(b, t, hkv, hd), v.reshape(b, t, hkv, hd)


def attention(cfg: Config, p, h, positions, cache, layer_index, window, rope_table):
    """Self-attention of the residual stream h [B, T, D] at positions [B, T]. cache:
    (k, v), each [L, B, S, Hkv, hd] for all layers, updated in place at
    (layer_index, positions). Returns (out [B, T, D], cache)."""
    b, t, _ = h.shape
    hq, hd = cfg.num_heads, cfg.head_dim
    q, k, v = qkv_projection(cfg, p, h)
    if cfg.qk_norm:
        q = jq.rms_norm(q, p["q_norm"], eps=cfg.rms_eps)
        k = jq.rms_norm(k, p["k_norm"], eps=cfg.rms_eps)
    inv_freq, factor = rope_table
    q, k = rope(q, positions, inv_freq, factor), rope(k, positions, inv_freq, factor)
    start = positions[0, 0]  # the batch moves in lockstep
    cache_k, cache_v = (lax.dynamic_update_slice(c, new.astype(c.dtype)[None],
                                                 (layer_index, 0, start, 0, 0))
                        for c, new in zip(cache, (k, v)))
    # the op reads layer `layer_index` of the stacked caches in place (no slice copy)
    o = jq.decode_attention(q, cache_k, cache_v, positions, sinks=p.get("sinks"), window=window,
                            layer=layer_index)
    return linear(o.reshape(b, t, hq * hd), p["wo"], p.get("bo")), (cache_k, cache_v)


def swiglu_kind(cfg: Config) -> str:
    return "gpt_oss" if cfg.family == "gpt_oss" else "silu"


def dense_mlp(cfg: Config, p, x):
    if "w_gate_up" in p:
        h = swiglu_linear(x, p["w_gate_up"], kind=swiglu_kind(cfg), limit=cfg.swiglu_limit)
    else:
        h = swiglu(linear(x, p["w_gate"]), linear(x, p["w_up"]), swiglu_kind(cfg),
                   cfg.swiglu_limit).astype(x.dtype)
    return linear(h, p["w_down"])


def route(cfg: Config, p, x):
    """Top-k experts and their weights per token: (idx [T, k] int32, weights [T, k] f32)."""
    logits = linear(x.astype(jnp.float32), p["router"].astype(jnp.float32),
                    p.get("router_bias"))
    k = cfg.experts_per_token
    if cfg.family == "gpt_oss":  # top-k of the logits, softmax over those k
        top, idx = lax.top_k(logits, k)
        return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)  # qwen3_moe: softmax, then top-k
    top, idx = lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, -1, keepdims=True)
    return idx.astype(jnp.int32), top


def moe_mlp(cfg: Config, p, x, mesh=None):
    """x [T, D] -> [T, D]: routed experts, weighted by the router. On a `mesh` of
    several devices, expert parallel (parallel.expert_parallel_moe): each device
    runs its own experts and the partial sums are reduced (activations move, never
    the experts)."""
    idx, weights = route(cfg, p, x)
    if mesh is not None and mesh.size > 1:
        from jaxquant.models import parallel  # noqa: PLC0415 (parallel imports this module)
        return parallel.expert_parallel_moe(cfg, p, x, idx, weights, mesh)
    return experts_mlp(cfg, p, x, idx, weights, cfg.num_experts).astype(x.dtype)


def experts_mlp(cfg: Config, p, x, idx, weights, num_experts: int):
    """x [T, D] through the experts idx [T, k] chose, weighted: -> [T, D] float32.
    p's expert weights hold `num_experts` experts; a pair whose idx is outside
    [0, num_experts) (another device's expert, parallel.expert_parallel_moe)
    contributes exactly 0 (masked, never multiplied: its row may be anything)."""
    t, d = x.shape
    k = idx.shape[1]
    mine = (idx >= 0) & (idx < num_experts)

    def product(a, matmul, name, bias_rows):  # float32, + the expert's bias rows
        y = matmul(a, p[name]).astype(jnp.float32)
        if name + "_bias" not in p:
            return y
        bias, rows = _in_stack(p[name + "_bias"], bias_rows)
        return y + bias[rows].astype(jnp.float32)

    def experts(a, matmul, bias_rows):
        """The experts' SwiGLU MLP of a through matmul(a, expert weights), float32 out;
        bias_rows: each output row's expert (for the biases)."""
        if "e_gate_up" in p:
            gate, up = jnp.split(product(a, matmul, "e_gate_up", bias_rows), 2, axis=-1)
        else:
            gate, up = (product(a, matmul, n, bias_rows) for n in ("e_gate", "e_up"))
        h = swiglu(gate, up, swiglu_kind(cfg), cfg.swiglu_limit).astype(x.dtype)
        return product(h, matmul, "e_down", bias_rows)

    if t * k <= GATHER_MAX_PAIRS:  # decode: read only the chosen experts, in place
        local = jnp.where(mine, idx, 0)
        gather = lambda a, w: expert_gather(a, w, local)
        w_gate_up = p.get("e_gate_up")
        if isinstance(_in_stack(w_gate_up, local)[0], QuantizedArray):
            h = expert_gather_swiglu(cfg, x, w_gate_up, local, p.get("e_gate_up_bias"))
            y = product(h, gather, "e_down", local)  # [T, k, D]
        else:
            y = experts(x, gather, local)
    else:  # prefill: sort (token, slot) pairs by expert, one ragged matmul each;
        # other devices' pairs sort last, past every group
        flat = jnp.where(mine, idx, num_experts).reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        ys = experts(x[order // k], lambda a, w: expert_ragged(a, w, sizes),
                     jnp.minimum(flat[order], num_experts - 1))
        y = jnp.zeros((t * k, d), jnp.float32).at[order].set(ys).reshape(t, k, d)
    y = jnp.where(mine[..., None], y, 0.0)
    return jnp.einsum("tkd,tk->td", y, weights)


def layer(cfg: Config, p, h, positions, cache, layer_index, window, rope_table, mesh=None):
    """One pre-norm block. h [B, T, D] is the residual stream; cache (k, v) of all
    layers, this one's updated in place; mesh: moe_mlp's. Returns (h, cache)."""
    b, t, d = h.shape
    a, cache = attention(cfg, p, h, positions, cache, layer_index, window, rope_table)
    x, h = jq.add_rms_norm(a, h, p["mlp_norm"], eps=cfg.rms_eps)
    if cfg.moe:
        m = moe_mlp(cfg, p, x.reshape(b * t, d), mesh).reshape(b, t, d)
    else:
        m = dense_mlp(cfg, p, x)
    return h + m, cache


# ---------------------------------------------------------------------------
# The model.


def init_cache(cfg: Config, batch: int, max_len: int, dtype=None):
    """KV cache: (k, v), each [L, B, max_len, Hkv, hd]."""
    dtype = dtype or jnp.dtype(cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def embed(params, tokens):
    """Rows of the embedding; a token id outside [0, vocab) gives a NaN row (so NaN
    logits), never another token's row (jnp indexing would clamp or wrap it)."""
    e = params["embed"]
    vocab = e.shape[0]
    valid = (tokens >= 0) & (tokens < vocab)
    ids = jnp.where(valid, tokens, 0)
    if isinstance(e, QuantizedArray):  # MLX quantizes embeddings: gather rows, dequantize
        rows = jq.dequantize(e[ids.reshape(-1)]).reshape(*tokens.shape, e.shape[-1])
    else:
        rows = e[ids]
    return jnp.where(valid[..., None], rows, jnp.full((), jnp.nan, rows.dtype))


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


def _on_several_devices(a) -> bool:
    """Whether a (an array, or a tracer under jit) lives on a mesh of several devices."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        return mesh.size > 1
    sharding = getattr(a, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def resolve_experts_by_layer(cfg: Config, layers, experts_by_layer, mesh=None) -> bool:
    """Whether `forward` indexes the stacked experts of all layers at once.
    None (automatic): on when the experts are stacked (quantized or float) on one device
    (on a mesh that splits E, the flattened [L*E] axis would not be split in
    blocks). Per-layer buffers need none of it: each layer's experts are their own.
    Always off with a `mesh` of several devices (expert parallel runs per layer)."""
    if is_per_layer(layers) or not cfg.moe or (mesh is not None and mesh.size > 1):
        return False
    if experts_by_layer is not None:
        return bool(experts_by_layer)
    stacks = [layers[k] for k in EXPERT_STACKS if k in layers]
    return bool(stacks) and not any(_on_several_devices(leaf) for w in stacks
                                    for leaf in jax.tree_util.tree_leaves(w))


def forward(cfg: Config, params, tokens, positions, cache, experts_by_layer=None, mesh=None):
    """tokens [B, T] at positions [B, T] -> (logits [B, T, V] float32, cache).

    The layer loop follows the parameters' form: per-layer buffers (a tuple of
    per-layer dicts) run in a Python loop, each layer reading its own buffers;
    stacked [L, ...] arrays run in lax.scan (one compiled layer body).

    experts_by_layer (stacked form only): keep the expert stacks out of the scan
    and index all layers' experts at once ([L*E, N, K], expert layer*E + e), so
    no decode step copies its layer's expert stack before the kernel (a custom
    call's operand is materialized: ~400 MB per layer for gpt-oss-20b in MXFP4,
    ~1 GB in bf16). Float experts in prefill are read in place too (ragged_matmul),
    except on the CPU (see expert_ragged). None (default): automatic, on for
    expert stacks on one device; True / False force it. Single-device only: with experts split over
    a mesh axis, the flattened [L*E] axis would no longer be split in blocks.

    mesh: the ("tp", "ep") mesh the parameters are placed on
    (parallel.shard_params / parallel.init_params), or None. With a mesh, the MoE
    blocks run expert parallel in a shard_map (parallel.expert_parallel_moe:
    every device its own experts, one all-reduce of the [T, D] partial sums);
    everything else is partitioned by jit from the weights' shardings either way."""
    inv_freq, factor = cfg.rope_inv_freq()
    rope_table = (jnp.asarray(inv_freq, jnp.float32), factor)
    h = embed(params, tokens).astype(jnp.dtype(cfg.dtype))
    layers = params["layers"]
    cache = tuple(cache)
    if is_per_layer(layers):
        if len(layers) != cfg.num_layers:
            raise ValueError(f"params has {len(layers)} layers; the config {cfg.num_layers}")
        for i, (p, window) in enumerate(zip(layers, cfg.windows().tolist())):
            h, cache = layer(cfg, p, h, positions, cache, i, window, rope_table, mesh)
    else:
        stacks = {}
        if resolve_experts_by_layer(cfg, layers, experts_by_layer, mesh):
            stacks = {k: _flatten_layers(v) for k, v in layers.items()
                      if k in EXPERT_STACKS + EXPERT_BIASES}
            layers = {k: v for k, v in layers.items() if k not in stacks}

        def step(carry, xs):
            h, cache = carry
            p, window, i = xs
            p = dict(p, **{k: ExpertsOfLayer(v, i, cfg.num_experts) for k, v in stacks.items()})
            return layer(cfg, p, h, positions, cache, i, window, rope_table, mesh), None

        (h, cache), _ = lax.scan(step, (h, cache), (layers, jnp.asarray(cfg.windows()),
                                                    jnp.arange(cfg.num_layers)))
    h = jq.rms_norm(h, params["final_norm"], eps=cfg.rms_eps)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    logits = linear(h, head).astype(jnp.float32)
    return logits, cache


def prefill(cfg: Config, params, prompt, max_len: int, experts_by_layer=None, mesh=None):
    """prompt [B, S] -> (logits [B, S, V], cache, next token [B]); mesh: forward's."""
    b, s = prompt.shape
    if s > max_len:
        raise ValueError(f"max_len={max_len} must be >= the prompt's length {s} (the cache "
                         f"holds prompt and generated tokens)")
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, cache = forward(cfg, params, prompt, positions, init_cache(cfg, b, max_len),
                            experts_by_layer, mesh)
    return logits, cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)


def decode(cfg: Config, params, cache, token, start, steps: int, experts_by_layer=None,
           mesh=None):
    """Greedy decoding of `steps` tokens in one loop from token [B] at position
    `start`: -> (tokens [B, steps], last logits [B, V], cache). start + steps must fit
    the cache (checked where start is a Python int; a traced start past it would have
    its cache writes clamped). mesh: forward's."""
    b = token.shape[0]
    max_len = cache[0].shape[2]
    if isinstance(start, (int, np.integer)) and not 0 <= start <= max_len - steps:
        raise ValueError(f"start={start} + steps={steps} must fit the cache's max_len="
                         f"{max_len}")

    def step(carry, i):
        token, cache, _ = carry
        pos = jnp.full((b, 1), start + i, jnp.int32)
        logits, cache = forward(cfg, params, token[:, None], pos, cache, experts_by_layer, mesh)
        nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        return (nxt, cache, logits[:, -1]), nxt

    logits0 = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    (_, cache, logits), tokens = lax.scan(step, (token, tuple(cache), logits0),
                                          jnp.arange(steps))
    return tokens.T, logits, cache


# ---------------------------------------------------------------------------
# Parameters.


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
        if cfg.family == "gpt_oss":
            p["sinks"] = w(hq, fan_in=1)
            p["router_bias"] = w(E, fan_in=16)
            p["e_gate_up_bias"] = w(E, 2 * I, fan_in=16)
            p["e_down_bias"] = w(E, D, fan_in=16)
    else:
        I = cfg.intermediate_size
        p.update(w_gate_up=w(2 * I, D), w_down=w(D, I))
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


def stack_layers(params):
    """params with per-layer dicts stacked into [L, ...] arrays (for lax.scan). Every
    layer's matrix must have one format (ValueError naming it otherwise)."""
    layers = params["layers"]
    if not is_per_layer(layers):
        return params
    out = {}
    for key in layers[0]:
        parts = [lay[key] for lay in layers]
        kinds = {_format_of(p) for p in parts}
        if len(kinds) > 1:
            raise ValueError(f"{key}: layers are quantized differently ({sorted(map(str, kinds))})"
                             f"; stacked layers (lax.scan) need one format per matrix across "
                             f"layers (per-layer buffers, per_layer=True, take any)")
        out[key] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *parts)
    return dict(params, layers=out)


# Matrices that `quantize_params` quantizes (routers and norms stay float).
MATRICES = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down",
            "e_gate_up", "e_gate", "e_up", "e_down")

MODES = {  # demo / CLI names -> jq.quantize arguments
    "affine4": dict(mode="affine", bits=4, group_size=64),
    "affine8": dict(mode="affine", bits=8, group_size=64),
    "mxfp4": dict(mode="mxfp4"),
    "mxfp8": dict(mode="mxfp8_e4m3"),
    "nvfp4": dict(mode="nvfp4"),
}


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
      layer at a time straight into that form."""
    kw = quantize_args(mode)
    quantize_fn = _jitted(jq.quantize, **kw)
    per_layer = default_per_layer() if per_layer is None else per_layer
    if fuse:
        params = fuse_params(params)

    def quantize(name, w):
        return quantize_fn(w) if name in MATRICES and not isinstance(w, QuantizedArray) else w

    layers = params["layers"]
    if is_per_layer(layers):
        layers = tuple({k: quantize(k, v) for k, v in p.items()} for p in layers)
    elif per_layer:
        n = jax.tree_util.tree_leaves(layers)[0].shape[0]
        layers = tuple({k: quantize(k, v[i]) for k, v in layers.items()} for i in range(n))
    else:
        layers = {k: quantize_matrix(v, kw) if k in MATRICES and not isinstance(
            v, QuantizedArray) else v for k, v in layers.items()}
    out = dict(params, layers=layers)
    if not per_layer:
        out = stack_layers(out)
    if lm_head and "lm_head" in out and not isinstance(out["lm_head"], QuantizedArray):
        out["lm_head"] = quantize_fn(out["lm_head"])
    return prepack_params(out, layout)


def prepack_params(params, layout: str | None = None):
    """Every quantized weight matrix (not a quantized embedding, whose rows are
    gathered) in `layout` (jq.prepack: None picks the default device's fastest,
    "canonical" unpacks). A stacked weight converts a piece at a time."""
    def prepack(v):
        if isinstance(v, PermutedMatrix):
            return PermutedMatrix(jq.prepack(v.matrix, layout), v.perm)
        return jq.prepack(v, layout) if isinstance(v, QuantizedArray) else v

    out = _map_layers(lambda p: {k: prepack(v) for k, v in p.items()}, params)
    if "lm_head" in out:
        out["lm_head"] = prepack(out["lm_head"])
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
