"""A decoder-only transformer in plain JAX on jaxquant's ops: the block, the
forward pass, prefill and greedy decoding (generation: sampling.py). The layer math is in
layers.py, the mixture of experts in moe.py, the parameters (their keys, init,
fusing, stacking, quantization) in params.py, the placement on a mesh in
parallel.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxquant as jq
from jaxquant.models import parallel
from jaxquant.models.config import Config
from jaxquant.models.layers import (adds_in_the_product, any_on_several_devices, attention,
                                    dense_mlp, linear, residual_mlp)
from jaxquant.models.moe import ExpertsOfLayer, experts_mlp, flatten_layers, route
from jaxquant.models.params import EXPERT_BIASES, EXPERT_STACKS, is_per_layer
from jaxquant.quantized_array import QuantizedArray


def moe_mlp(cfg: Config, p, x, mesh=None):
    """x [T, D] -> [T, D]: routed experts, weighted by the router. On a `mesh` of
    several devices, expert parallel (parallel.expert_parallel_moe): each device
    runs its own experts and the partial sums are reduced (activations move, never
    the experts)."""
    idx, weights = route(cfg, p, x)
    if mesh is not None and mesh.size > 1:
        return parallel.expert_parallel_moe(cfg, p, x, idx, weights, mesh)
    return experts_mlp(cfg, p, x, idx, weights, cfg.num_experts).astype(x.dtype)


def fuses_residuals(cfg: Config, p) -> bool:
    """Whether a layer adds the residuals in its products (layers.linear_add,
    layers.residual_mlp) instead of in add_rms_norm and an add of their own: a dense
    layer whose output projection, gate and up, and down projection are quantized and
    unbiased, on one device. The values are the same either way; on a GPU the
    products then follow one another with no small kernel between (docs/decode.md,
    "What the step's structure costs")."""
    return (not cfg.moe and isinstance(p.get("w_gate_up"), QuantizedArray)
            and not any_on_several_devices(p["w_gate_up"])
            and adds_in_the_product(p.get("wo"), p.get("bo"))
            and adds_in_the_product(p.get("w_down")))


def layer(cfg: Config, p, h, positions, cache, layer_index, window, rope_table, mesh=None,
          from_start=False):
    """One pre-norm block. h [B, T, D] is the residual stream; cache (k, v) of all
    layers, this one's updated in place; mesh: moe_mlp's; from_start: attention's.
    Returns (h, cache)."""
    b, t, d = h.shape
    if fuses_residuals(cfg, p):
        h, cache = attention(cfg, p, h, positions, cache, layer_index, window, rope_table,
                             from_start, add_residual=True)
        return residual_mlp(cfg, p, h), cache
    a, cache = attention(cfg, p, h, positions, cache, layer_index, window, rope_table,
                         from_start)
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
    return bool(stacks) and not any_on_several_devices(stacks)


def forward(cfg: Config, params, tokens, positions, cache, experts_by_layer=None, mesh=None,
            from_start=False, logits_at=None):
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
    everything else is partitioned by jit from the weights' shardings either way.

    from_start: the caller promises positions[b] = arange(T) and an empty cache (a
    prompt from its first token: prefill passes it), so attention may run as causal
    attention over the T tokens alone (layers.prompt_attention_applies: a fused kernel
    on GPUs).

    logits_at: None, or an int array [B] of indices into T: the final norm and the head
    run at that one token of each row, and the logits are [B, 1, V]. A prompt's next
    token needs its last position's only, and the head over every position of a long
    prompt is a product as large as a layer's (gpt-oss-20b's 201088 x 2880)."""
    inv_freq, factor = cfg.rope_inv_freq()
    rope_table = (jnp.asarray(inv_freq, jnp.float32), factor)
    h = embed(params, tokens).astype(jnp.dtype(cfg.dtype))
    layers = params["layers"]
    cache = tuple(cache)
    if is_per_layer(layers):
        if len(layers) != cfg.num_layers:
            raise ValueError(f"params has {len(layers)} layers; the config {cfg.num_layers}")
        for i, (p, window) in enumerate(zip(layers, cfg.windows().tolist())):
            h, cache = layer(cfg, p, h, positions, cache, i, window, rope_table, mesh,
                             from_start)
    else:
        stacks = {}
        if resolve_experts_by_layer(cfg, layers, experts_by_layer, mesh):
            stacks = {k: flatten_layers(v) for k, v in layers.items()
                      if k in EXPERT_STACKS + EXPERT_BIASES}
            layers = {k: v for k, v in layers.items() if k not in stacks}

        def step(carry, xs):
            h, cache = carry
            p, window, i = xs
            p = dict(p, **{k: ExpertsOfLayer(v, i, cfg.num_experts) for k, v in stacks.items()})
            return layer(cfg, p, h, positions, cache, i, window, rope_table, mesh,
                         from_start), None

        (h, cache), _ = lax.scan(step, (h, cache), (layers, jnp.asarray(cfg.windows()),
                                                    jnp.arange(cfg.num_layers)))
    if logits_at is not None:
        h = jnp.take_along_axis(h, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
    h = jq.rms_norm(h, params["final_norm"], eps=cfg.rms_eps)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    logits = linear(h, head).astype(jnp.float32)
    return logits, cache


def prefill(cfg: Config, params, prompt, max_len: int, experts_by_layer=None, mesh=None, *,
            logits_at=None):
    """prompt [B, S] -> (logits [B, S, V], cache, next token [B]: the argmax at the last
    position); mesh: forward's. logits_at (forward's): an int array [B] of positions, the
    logits then [B, 1, V] at those only and the token their argmax."""
    b, s = prompt.shape
    if s > max_len:
        raise ValueError(f"max_len={max_len} must be >= the prompt's length {s} (the cache "
                         f"holds prompt and generated tokens)")
    if logits_at is not None and jnp.shape(logits_at) != (b,):
        raise ValueError(f"logits_at must be one position per row, shape ({b},); got "
                         f"{jnp.shape(logits_at)}")
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, cache = forward(cfg, params, prompt, positions, init_cache(cfg, b, max_len),
                            experts_by_layer, mesh, from_start=True, logits_at=logits_at)
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
