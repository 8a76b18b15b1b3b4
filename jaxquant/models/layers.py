"""The decoder's layer math on float or quantized weights: `linear` (y = x @ W.T for
a float array, a QuantizedArray, a RowQuantizedArray or a PermutedMatrix, so one
code path runs bf16 and every quantized mode), the normalized and gated
projections, rotary embedding, attention and the dense SwiGLU MLP."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxquant as jq
from jaxquant.models.config import MLP_ACTIVATIONS, Config
from jaxquant.pallas import configs
from jaxquant.quantized_array import QuantizedArray


class PermutedMatrix(NamedTuple):
    """A matrix stored with its input channels in the order `perm` (GPTQ act-order:
    jq.io.from_gptq): ``x @ W.T == x[..., perm] @ matrix.T``."""
    matrix: QuantizedArray
    perm: jax.Array


def on_several_devices(a) -> bool:
    """Whether a (an array, or a tracer under jit) lives on a mesh of several devices."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        return mesh.size > 1
    sharding = getattr(a, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def any_on_several_devices(tree) -> bool:
    """Whether any array of a pytree (a QuantizedArray's, a layer's) lives on a mesh of
    several devices."""
    return any(on_several_devices(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def float_gemv_applies(x, w) -> bool:
    """Whether linear(x, w) on a float w [N, K] takes the Pallas float GEMV (the float GEMV's
    shapes in jaxquant/pallas/configs.py, FLOAT_GEMV_OVER_XLA).
    One device only: the GEMV was measured on one GPU; over a mesh, XLA partitions its
    own dot."""
    rows = int(np.prod(x.shape[:-1]))
    n, k = w.shape
    route = configs.FLOAT_GEMV_OVER_XLA
    return (jax.default_backend() == "gpu" and 0 < rows <= route["max_rows"]
            and route["min_n"] <= n <= route["max_n"] and k <= route["max_k"]
            and not on_several_devices(w))


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
        y = float_linear(x, w.astype(x.dtype)).astype(x.dtype)
    return y if bias is None else y + bias.astype(y.dtype)


def float_linear(x, w):
    """x [..., K] . w [N, K] -> [..., N] in float32, as XLA's fast contraction: the
    einsum's (x's K against w's K, no transpose of w; `x @ w.T` takes XLA:CPU's slow
    path, 323 vs 14 ms CPU time at M = 1, 4096 -> 14336, float32). On the CPU a single
    bfloat16 row goes in as two: XLA:CPU's bfloat16 matrix-vector product is ~13x its
    two-row product (160 vs 12 ms), which costs the same as one (docs/backends.md)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows == 1 and x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        x2 = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
        y = jnp.einsum("mk,nk->mn", x2, w, preferred_element_type=jnp.float32)[:1]
        return y.reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)


def adds_in_the_product(w, bias=None) -> bool:
    """Whether linear_add of w (and bias) is one jq.qmm_add: w quantized, no bias, on
    one device."""
    return isinstance(w, QuantizedArray) and bias is None and not any_on_several_devices(w)


def linear_add(x, w, addend, bias=None):
    """addend + linear(x, w) (+ bias), in addend's dtype: a projection into the residual
    stream. jq.qmm_add on a quantized w without a bias on one device (one kernel where
    one exists: the product then follows the product before it, with no add between;
    docs/decode.md, "What the step's structure costs"); the two ops elsewhere, the same
    values: qmm_add rounds the product to x's dtype before the add, as linear does."""
    if adds_in_the_product(w, bias) and x.dtype == addend.dtype:
        return jq.qmm_add(x, w, addend)
    return addend + linear(x, w, bias)


def norm_linear(x, norm_weight, w, eps, bias=None):
    """linear(rms_norm(x, norm_weight), w) (+ bias): a projection of the normalized
    residual stream: jq.rms_norm_qmm on a quantized w (one kernel where one exists,
    the two ops elsewhere)."""
    if isinstance(w, QuantizedArray):
        y = jq.rms_norm_qmm(x, norm_weight, w, eps=eps)
        return y if bias is None else y + bias.astype(y.dtype)
    return linear(jq.rms_norm(x, norm_weight, eps=eps), w, bias)


SWIGLU_KINDS = MLP_ACTIVATIONS


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


def norm_swiglu_linear(x, norm_weight, w_gate_up, eps, kind="silu", limit=7.0):
    """swiglu_linear(rms_norm(x, norm_weight), w_gate_up): a pre-norm MLP's gate and up
    projections of the residual stream x. jq.rms_norm_qmm_swiglu on a quantized w_gate_up
    (one kernel where one exists), the two ops elsewhere."""
    if isinstance(w_gate_up, QuantizedArray):
        if kind not in SWIGLU_KINDS:
            raise ValueError(f"kind={kind!r} is not known; expected one of {SWIGLU_KINDS}")
        return jq.rms_norm_qmm_swiglu(x, norm_weight, w_gate_up, eps=eps, activation=kind,
                                      limit=limit if kind == "gpt_oss" else None)
    return swiglu_linear(jq.rms_norm(x, norm_weight, eps=eps), w_gate_up, kind=kind,
                         limit=limit)


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


# The prompt's attention where a fused (flash) kernel serves it: jax.nn.dot_product_attention's
# implementation per platform. On an H100 XLA's own attention of a 2048-token Llama-3-70B
# prompt (float32 scores, transposes, softmax reductions) was about a third of the
# prefill (docs/models.md, "Fast by default"); the CPU keeps the reference.
PROMPT_ATTENTION = {"gpu": "cudnn"}


def static_window(cfg: Config, window) -> int | None:
    """The layer's attention window as a Python int (0: none), or None where it is traced
    and differs between layers (the stacked layers' scan): the fused kernels take it
    static."""
    if isinstance(window, (int, np.integer)):
        return int(window)
    windows = set(cfg.windows().tolist())
    return windows.pop() if len(windows) == 1 else None


def prompt_attention_applies(cfg: Config, p, q, window=0) -> str | None:
    """The dot_product_attention implementation for a prompt's causal attention, or None
    (the cache-reading op serves it): a float16/bfloat16 model, more than one query, a
    window known at trace time (static_window), on a platform with an entry in
    PROMPT_ATTENTION, on one device (cuDNN's partitioning refuses q, k and v split
    differently, as tensor parallel splits kv heads fewer than its devices; measured on
    one GPU). Attention sinks (gpt-oss) take the kernel's logsumexp
    (prompt_attention)."""
    impl = PROMPT_ATTENTION.get(jax.default_backend())
    if impl is None or q.shape[1] < 2 or q.dtype not in (jnp.bfloat16, jnp.float16):
        return None
    if static_window(cfg, window) is None:
        return None
    if any_on_several_devices(p.get("wo")):
        return None
    return impl


def local_window(window) -> tuple[int, int] | None:
    """jax.nn.dot_product_attention's local_window_size for a window of `window` keys up
    to the query's own (0: all): the keys 0 .. window - 1 before it."""
    return (window - 1, 0) if window else None


def attention_with_logsumexp(q, k, v, impl, window):
    """dot_product_attention's output and the logsumexp of each query's scaled scores
    [B, T, Hq] in float32. jax.nn's cuDNN path rounds the logsumexp to the output's dtype
    (bf16: up to 2% off the sinks' share below), so cuDNN's is taken from the function
    jax.nn calls, where this jax has it; elsewhere jax.nn's."""
    if impl == "cudnn":
        try:
            from jax._src.cudnn import fused_attention_stablehlo as cudnn
            o, lse = cudnn.dot_product_attention(
                q, k, v, scale=q.shape[-1] ** -0.5, mask_type=cudnn.MaskType.CAUSAL,
                sliding_window_length=window or None, return_residual=True)
            return o, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)  # cuDNN's is [B, Hq, T]
        except (ImportError, AttributeError, TypeError):
            pass
    o, lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                          local_window_size=local_window(window),
                                          return_residual=True)
    return o, lse.astype(jnp.float32)


def prompt_attention(q, k, v, impl, window, sinks=None):
    """Causal attention of a prompt's T queries q [B, T, Hq, hd] over its own keys and
    values k, v [B, T, Hkv, hd], each query seeing the `window` keys up to its own (0:
    all), with gpt-oss's sinks [Hq] or None: jq.decode_attention's definition, on the
    fused kernel `impl`. A sink is a logit in the softmax's denominator only, so the
    attention with it is the attention without it times S / (S + e^sink) =
    sigmoid(lse - sink), S = e^lse the scores' sum, which the kernel returns."""
    if sinks is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                            local_window_size=local_window(window))
    o, lse = attention_with_logsumexp(q, k, v, impl, window)
    keep = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))
    return (o.astype(jnp.float32) * keep[..., None]).astype(q.dtype)


def attention(cfg: Config, p, h, positions, cache, layer_index, window, rope_table,
              from_start: bool = False, add_residual: bool = False):
    """Self-attention of the residual stream h [B, T, D] at positions [B, T]. cache:
    (k, v), each [L, B, S, Hkv, hd] for all layers, updated in place at
    (layer_index, positions). Returns (out [B, T, D], cache); with add_residual, out is
    h + the attention's output (linear_add: the output projection adds it).

    from_start: positions are arange(T) in every row and the cache holds nothing before
    them (models.prefill), so the attention is causal over these T tokens alone: a fused
    kernel takes it where prompt_attention_applies."""
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
    impl = prompt_attention_applies(cfg, p, q, window) if from_start else None
    if impl is not None:
        o = prompt_attention(q, k.astype(q.dtype), v.astype(q.dtype), impl,
                             static_window(cfg, window), p.get("sinks"))
    else:
        # the op reads layer `layer_index` of the stacked caches in place (no slice copy)
        o = jq.decode_attention(q, cache_k, cache_v, positions, sinks=p.get("sinks"),
                                window=window, layer=layer_index)
    o = o.reshape(b, t, hq * hd)
    if add_residual:
        return linear_add(o, p["wo"], h, p.get("bo")), (cache_k, cache_v)
    return linear(o, p["wo"], p.get("bo")), (cache_k, cache_v)


def dense_mlp(cfg: Config, p, x):
    if "w_gate_up" in p:
        h = swiglu_linear(x, p["w_gate_up"], kind=cfg.mlp_activation, limit=cfg.swiglu_limit)
    else:
        h = swiglu(linear(x, p["w_gate"]), linear(x, p["w_up"]), cfg.mlp_activation,
                   cfg.swiglu_limit).astype(x.dtype)
    return linear(h, p["w_down"])


def residual_mlp(cfg: Config, p, h):
    """h + dense_mlp(rms_norm(h, mlp_norm)) with the norm in the gate and up projection
    (norm_swiglu_linear) and the residual in the down projection (linear_add): the same
    values as the norm, dense_mlp and the add apart."""
    g = norm_swiglu_linear(h, p["mlp_norm"], p["w_gate_up"], cfg.rms_eps, cfg.mlp_activation,
                           cfg.swiglu_limit)
    return linear_add(g, p["w_down"], h)
