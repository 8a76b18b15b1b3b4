"""A decoder-only transformer in plain JAX on jaxquant's ops.

Parameters are a dict pytree. Per-layer weights are stacked on a leading layer
axis and the layers run in `lax.scan` (each step gets one layer's slice of the
stack). A matrix is a float array [N, K], a `QuantizedArray` [N, K] or a
`PermutedMatrix` (act-order GPTQ); y = x @ W.T any way (`linear`), so the same
code runs bf16 and every quantized mode. Keys (per layer, stacked under "layers"):

  attn_norm, mlp_norm [D]; wq [Hq*hd, D], wk/wv [Hkv*hd, D], wo [D, Hq*hd];
  bq/bk/bv/bo (attention_bias); q_norm/k_norm [hd] (qk_norm); sinks [Hq] (gpt_oss)
  dense:  w_gate/w_up [I, D], w_down [D, I]
  MoE:    router [E, D] (+ router_bias [E], gpt_oss); e_gate_up [E, 2I, D] with
          gate and up interleaved on rows (gpt_oss) or e_gate/e_up [E, I, D];
          e_down [E, D, I]; e_gate_up_bias [E, 2I], e_down_bias [E, D] (gpt_oss)

and embed [V, D], final_norm [D], lm_head [V, D] (absent when tied).

MoE layers use `gather_qmm` when few tokens run (decode: each token reads its
k experts' weights) and `ragged_qmm` otherwise (prefill: tokens sorted by
expert, one grouped matmul per projection).
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


def linear(x, w, bias=None):
    """x [..., K] @ w.T (w [N, K], float, QuantizedArray or PermutedMatrix) (+ bias) -> [..., N]."""
    if isinstance(w, PermutedMatrix):
        x, w = jnp.take(x, w.perm, axis=-1), w.matrix
    if isinstance(w, QuantizedArray):
        y = jq.qmm(x, w)
    else:
        y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + bias.astype(y.dtype)


class ExpertsOfLayer(NamedTuple):
    """Layer `layer`'s experts inside a stack of all layers' experts flattened to
    [L*E, N, K] (see `forward`'s experts_by_layer): expert e is row layer*E + e."""
    stack: QuantizedArray
    layer: jax.Array
    num_experts: int


def _flatten_layers(qw: QuantizedArray) -> QuantizedArray:
    """[L, E, N, K] -> [L*E, N, K]: a reshape of the children (no copy)."""
    lead = qw.shape[:2]
    flat = lambda c: None if c is None else c.reshape(lead[0] * lead[1], *c.shape[2:])
    gs = qw.global_scale
    if gs is not None:
        gs = jnp.broadcast_to(gs.reshape(gs.shape + (1,) * (2 - gs.ndim)), lead).reshape(-1)
    return QuantizedArray(flat(qw.data), flat(qw.scales), flat(qw.biases), gs, mode=qw.mode,
                          bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype,
                          layout=qw.layout)


def expert_gather(x, w, idx):
    """x [T, K] or [T, k, K], w [E, N, K], idx [T, k] -> [T, k, N] (decode)."""
    if isinstance(w, ExpertsOfLayer):
        return jq.gather_qmm(x, w.stack, idx + w.layer * w.num_experts)
    if isinstance(w, QuantizedArray):
        return jq.gather_qmm(x, w, idx)
    ws = w[idx].astype(x.dtype)  # [T, k, N, K]
    eq = "tk,tsnk->tsn" if x.ndim == 2 else "tsk,tsnk->tsn"
    return jnp.einsum(eq, x, ws, preferred_element_type=jnp.float32).astype(x.dtype)


def expert_ragged(x, w, group_sizes):
    """x [R, K] rows sorted by expert, w [E, N, K] -> [R, N] (prefill)."""
    if isinstance(w, ExpertsOfLayer):  # this layer's groups; every other layer's empty
        sizes = jnp.zeros(w.stack.shape[0], jnp.int32)
        sizes = lax.dynamic_update_slice(sizes, group_sizes.astype(jnp.int32),
                                         (w.layer * w.num_experts,))
        return jq.ragged_qmm(x, w.stack, sizes)
    if isinstance(w, QuantizedArray):
        return jq.ragged_qmm(x, w, group_sizes)
    y = lax.ragged_dot(x, jnp.swapaxes(w, 1, 2).astype(x.dtype), group_sizes.astype(jnp.int32),
                       preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


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


def attention(cfg: Config, p, x, positions, cache_k, cache_v, window, rope_table):
    """x [B, T, D] at positions [B, T]; cache [B, S, Hkv, hd] updated at positions.
    Returns (out [B, T, D], cache_k, cache_v)."""
    b, t, _ = x.shape
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, p["wq"], p.get("bq")).reshape(b, t, hq, hd)
    k = linear(x, p["wk"], p.get("bk")).reshape(b, t, hkv, hd)
    v = linear(x, p["wv"], p.get("bv")).reshape(b, t, hkv, hd)
    if cfg.qk_norm:
        q = jq.rms_norm(q, p["q_norm"], eps=cfg.rms_eps)
        k = jq.rms_norm(k, p["k_norm"], eps=cfg.rms_eps)
    inv_freq, factor = rope_table
    q, k = rope(q, positions, inv_freq, factor), rope(k, positions, inv_freq, factor)
    start = positions[0, 0]  # the batch moves in lockstep
    cache_k = lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), start, axis=1)
    cache_v = lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), start, axis=1)
    s = cache_k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, hd).astype(jnp.float32)
    scores = jnp.einsum("btgqd,bsgd->bgqts", qg, cache_k.astype(jnp.float32)) * hd ** -0.5
    key_pos = jnp.arange(s)
    qpos = positions[:, None, None, :, None]
    visible = key_pos <= qpos
    visible &= (window == 0) | (qpos - key_pos < window)
    scores = jnp.where(visible, scores, -jnp.inf)
    if "sinks" in p:  # gpt-oss: a learned logit per head that takes probability mass
        sink = p["sinks"].astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        m = jnp.maximum(jnp.max(scores, -1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - m))
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bgqts,bsgd->btgqd", probs, cache_v.astype(jnp.float32))
    o = o.reshape(b, t, hq * hd).astype(x.dtype)
    return linear(o, p["wo"], p.get("bo")), cache_k, cache_v


def dense_mlp(p, x):
    return linear(jax.nn.silu(linear(x, p["w_gate"])) * linear(x, p["w_up"]), p["w_down"])


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


def _expert_act(cfg: Config, gate, up):
    if cfg.family == "gpt_oss":
        limit, alpha = cfg.swiglu_limit, 1.702
        gate = jnp.minimum(gate.astype(jnp.float32), limit)
        up = jnp.clip(up.astype(jnp.float32), -limit, limit)
        return ((up + 1) * gate * jax.nn.sigmoid(gate * alpha))
    return jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def _split_gate_up(p, y):
    if "e_gate_up" in p:  # gpt-oss: rows interleaved gate, up, gate, up, ...
        return y[..., 0::2], y[..., 1::2]
    return y


def moe_mlp(cfg: Config, p, x):
    """x [T, D] -> [T, D]: routed experts, weighted by the router."""
    t, d = x.shape
    k = cfg.experts_per_token
    idx, weights = route(cfg, p, x)
    fused = "e_gate_up" in p

    def bias(name, rows):  # per (token, slot) expert bias rows, or None
        return None if name not in p else p[name][rows].astype(jnp.float32)

    def experts(a, matmul, bias_rows):
        """The experts' SwiGLU MLP of a through matmul(a, expert weights), float32 out;
        bias_rows: each output row's expert (for the biases)."""
        if fused:
            gu = matmul(a, p["e_gate_up"]).astype(jnp.float32)
            if "e_gate_up_bias" in p:
                gu = gu + bias("e_gate_up_bias", bias_rows)
            gate, up = _split_gate_up(p, gu)
        else:
            gate, up = matmul(a, p["e_gate"]), matmul(a, p["e_up"])
        h = _expert_act(cfg, gate, up).astype(x.dtype)
        y = matmul(h, p["e_down"]).astype(jnp.float32)
        if "e_down_bias" in p:
            y = y + bias("e_down_bias", bias_rows)
        return y

    if t * k <= GATHER_MAX_PAIRS:  # decode: gather_qmm reads only the chosen experts
        y = experts(x, lambda a, w: expert_gather(a, w, idx), idx)  # [T, k, D]
    else:  # prefill: sort (token, slot) pairs by expert, one ragged matmul each
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
        ys = experts(x[order // k], lambda a, w: expert_ragged(a, w, sizes), flat[order])
        y = jnp.zeros((t * k, d), jnp.float32).at[order].set(ys).reshape(t, k, d)
    return jnp.einsum("tkd,tk->td", y, weights).astype(x.dtype)


def layer(cfg: Config, p, h, positions, cache_k, cache_v, window, rope_table):
    """One pre-norm block. h [B, T, D] is the residual stream."""
    b, t, d = h.shape
    x = jq.rms_norm(h, p["attn_norm"], eps=cfg.rms_eps)
    a, cache_k, cache_v = attention(cfg, p, x, positions, cache_k, cache_v, window, rope_table)
    x, h = jq.add_rms_norm(a, h, p["mlp_norm"], eps=cfg.rms_eps)
    if cfg.moe:
        m = moe_mlp(cfg, p, x.reshape(b * t, d)).reshape(b, t, d)
    else:
        m = dense_mlp(p, x)
    return h + m, cache_k, cache_v


# ---------------------------------------------------------------------------
# The model.


def init_cache(cfg: Config, batch: int, max_len: int, dtype=None):
    """KV cache: (k, v), each [L, B, max_len, Hkv, hd]."""
    dtype = dtype or jnp.dtype(cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def embed(params, tokens):
    e = params["embed"]
    if isinstance(e, QuantizedArray):  # MLX quantizes embeddings: gather rows, dequantize
        return jq.dequantize(e[tokens.reshape(-1)]).reshape(*tokens.shape, e.shape[-1])
    return e[tokens]


EXPERT_STACKS = ("e_gate_up", "e_gate", "e_up", "e_down")


def forward(cfg: Config, params, tokens, positions, cache, experts_by_layer: bool = False):
    """tokens [B, T] at positions [B, T] -> (logits [B, T, V] float32, cache).

    experts_by_layer: keep the quantized expert stacks out of the layer scan and
    index all layers' experts at once ([L*E, N, K], expert layer*E + e), so no
    step copies its layer's expert stack before the kernel (a custom call's
    operand is materialized: ~400 MB per layer for gpt-oss-20b in MXFP4).
    Single-device only: with experts split over a mesh axis, the flattened
    [L*E] axis would no longer be split in blocks."""
    inv_freq, factor = cfg.rope_inv_freq()
    rope_table = (jnp.asarray(inv_freq, jnp.float32), factor)
    h = embed(params, tokens).astype(jnp.dtype(cfg.dtype))
    windows = jnp.asarray(cfg.windows())
    cache_k, cache_v = cache

    layers = params["layers"]
    stacks = {}
    if experts_by_layer and cfg.moe:
        stacks = {k: _flatten_layers(v) for k, v in layers.items()
                  if k in EXPERT_STACKS and isinstance(v, QuantizedArray)}
        layers = {k: v for k, v in layers.items() if k not in stacks}

    def step(carry, xs):
        h, ck, cv = carry
        p, window, i = xs
        p = dict(p, **{k: ExpertsOfLayer(v, i, cfg.num_experts) for k, v in stacks.items()})
        # The cache stays in the carry (updated in place); the layer's slice is read.
        k_l, v_l = ck[i], cv[i]
        h, k_l, v_l = layer(cfg, p, h, positions, k_l, v_l, window, rope_table)
        ck = lax.dynamic_update_index_in_dim(ck, k_l, i, 0)
        cv = lax.dynamic_update_index_in_dim(cv, v_l, i, 0)
        return (h, ck, cv), None

    (h, cache_k, cache_v), _ = lax.scan(step, (h, cache_k, cache_v),
                                        (layers, windows, jnp.arange(cfg.num_layers)))
    h = jq.rms_norm(h, params["final_norm"], eps=cfg.rms_eps)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    logits = linear(h, head).astype(jnp.float32)
    return logits, (cache_k, cache_v)


def prefill(cfg: Config, params, prompt, max_len: int, experts_by_layer: bool = False):
    """prompt [B, S] -> (logits [B, S, V], cache, next token [B])."""
    b, s = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, cache = forward(cfg, params, prompt, positions, init_cache(cfg, b, max_len),
                            experts_by_layer)
    return logits, cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)


def decode(cfg: Config, params, cache, token, start, steps: int,
           experts_by_layer: bool = False):
    """Greedy decoding of `steps` tokens in one loop from token [B] at position
    `start`: -> (tokens [B, steps], last logits [B, V], cache)."""
    b = token.shape[0]

    def step(carry, i):
        token, cache, _ = carry
        pos = jnp.full((b, 1), start + i, jnp.int32)
        logits, cache = forward(cfg, params, token[:, None], pos, cache, experts_by_layer)
        nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        return (nxt, cache, logits[:, -1]), nxt

    logits0 = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    (_, cache, logits), tokens = lax.scan(step, (token, cache, logits0), jnp.arange(steps))
    return tokens.T, logits, cache


def generate(cfg: Config, params, prompt, steps: int, experts_by_layer: bool = False):
    """Greedy generation: prompt [B, S] -> [B, steps] new tokens (jit this whole)."""
    _, cache, token = prefill(cfg, params, prompt, prompt.shape[1] + steps, experts_by_layer)
    tokens, _, _ = decode(cfg, params, cache, token, prompt.shape[1], steps - 1,
                          experts_by_layer)
    return jnp.concatenate([token[:, None], tokens], axis=1)


# ---------------------------------------------------------------------------
# Parameters.


def init_params(cfg: Config, key, dtype=None):
    """Random parameters (normal, 1/sqrt(fan_in) scaled), float, in the layout above."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    L, D, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    keys = iter(jax.random.split(key, 32))

    def w(*shape, fan_in=None):
        # drawn in `dtype` itself: no float32 copy of a 20B-parameter model
        fan_in = fan_in or shape[-1]
        return jax.random.normal(next(keys), shape, dtype) * jnp.asarray(fan_in ** -0.5, dtype)

    layers = {"attn_norm": jnp.ones((L, D), dtype), "mlp_norm": jnp.ones((L, D), dtype),
              "wq": w(L, hq * hd, D), "wk": w(L, hkv * hd, D), "wv": w(L, hkv * hd, D),
              "wo": w(L, D, hq * hd)}
    if cfg.attention_bias:
        for name, n in (("bq", hq * hd), ("bk", hkv * hd), ("bv", hkv * hd), ("bo", D)):
            layers[name] = w(L, n, fan_in=16)
    if cfg.qk_norm:
        layers["q_norm"] = jnp.ones((L, hd), dtype)
        layers["k_norm"] = jnp.ones((L, hd), dtype)
    if cfg.moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        layers["router"] = w(L, E, D)
        layers["e_down"] = w(L, E, D, I)
        if cfg.family == "gpt_oss":
            layers["sinks"] = w(L, hq, fan_in=1)
            layers["router_bias"] = w(L, E, fan_in=16)
            layers["e_gate_up"] = w(L, E, 2 * I, D)
            layers["e_gate_up_bias"] = w(L, E, 2 * I, fan_in=16)
            layers["e_down_bias"] = w(L, E, D, fan_in=16)
        else:
            layers["e_gate"] = w(L, E, I, D)
            layers["e_up"] = w(L, E, I, D)
    else:
        I = cfg.intermediate_size
        layers.update(w_gate=w(L, I, D), w_up=w(L, I, D), w_down=w(L, D, I))
    params = {"embed": w(cfg.vocab_size, D, fan_in=1), "layers": layers,
              "final_norm": jnp.ones((D,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = w(cfg.vocab_size, D)
    return params


# Matrices that `quantize_params` quantizes (routers and norms stay float).
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "e_gate_up", "e_gate",
            "e_up", "e_down")

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


def quantize_params(params, mode: str, *, lm_head: bool = True):
    """Quantize every float weight matrix (and lm_head) to `mode` (a MODES name or
    a dict of jq.quantize arguments); QuantizedArrays already there stay as they are
    (gpt-oss's MXFP4 experts). Stacked [L, ...] weights quantize per matrix."""
    kw = quantize_args(mode)
    out = dict(params)
    layers = dict(params["layers"])
    for name in MATRICES:
        w = layers.get(name)
        if w is not None and not isinstance(w, QuantizedArray):
            layers[name] = quantize_matrix(w, kw)
    out["layers"] = layers
    if lm_head and "lm_head" in params and not isinstance(params["lm_head"], QuantizedArray):
        out["lm_head"] = quantize_matrix(params["lm_head"], kw)
    return out


def quantize_matrix(w, kw):
    """jq.quantize; a stack [L, ...] layer by layer, so every leaf (an NVFP4 global
    scale too) has the layer axis that lax.scan slices."""
    quantize = _jitted_quantize(tuple(sorted(kw.items())))
    if w.ndim == 2:
        return quantize(w)
    parts = [quantize(w[i]) for i in range(w.shape[0])]
    return jax.tree_util.tree_map(lambda *c: jnp.stack(c), *parts)


@functools.lru_cache(maxsize=None)
def _jitted_quantize(kw):
    return jax.jit(functools.partial(jq.quantize, **dict(kw)))


def weight_bytes(params) -> int:
    """Bytes of all parameters (packed data, scales, biases of quantized ones)."""
    return sum(int(np.prod(np.shape(a))) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(params))
