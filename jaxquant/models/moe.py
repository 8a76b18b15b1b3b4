"""The decoder's mixture-of-experts math: the router and the experts' SwiGLU MLP.

MoE layers use `gather_qmm` (float experts: `gather_matmul`) when few tokens run
(decode: each token reads its k experts' weights in place) and `ragged_qmm`
(float experts: `ragged_matmul`) otherwise (prefill: tokens sorted by expert,
one grouped matmul per projection)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import jaxquant as jq
from jaxquant.ffi.configs import GATHER_MAX_PAIRS
from jaxquant.models.config import Config
from jaxquant.models.layers import linear, swiglu
from jaxquant.quantized_array import QuantizedArray


class ExpertsOfLayer(NamedTuple):
    """Layer `layer`'s experts inside a stack of all layers' experts flattened to
    [L*E, N, K] (see `forward`'s experts_by_layer): expert e is row layer*E + e."""
    stack: QuantizedArray | jax.Array
    layer: jax.Array
    num_experts: int


def flatten_layers(qw):
    """[L, E, N, K] -> [L*E, N, K]: a reshape (of a QuantizedArray's children; no copy)."""
    if not isinstance(qw, QuantizedArray):
        return qw.reshape(-1, *qw.shape[2:])
    return qw.flatten_leading(2)


def in_stack(w, rows):
    """(w, rows), or for an ExpertsOfLayer its whole stack and the rows moved to its
    layer's experts."""
    if isinstance(w, ExpertsOfLayer):
        return w.stack, rows + w.layer * w.num_experts
    return w, rows


def expert_gather(x, w, idx):
    """x [T, K] or [T, k, K], w [E, N, K], idx [T, k] -> [T, k, N] (decode): the chosen
    experts read in place (gather_qmm, or gather_matmul for float w; `w[idx]` in XLA
    would copy them first)."""
    w, idx = in_stack(w, idx)
    if isinstance(w, QuantizedArray):
        return jq.gather_qmm(x, w, idx)
    return jq.gather_matmul(x, w, idx)


def expert_gather_swiglu(cfg: Config, x, w_gate_up, idx, bias):
    """x [T, K], w_gate_up [E, 2I, K] (quantized), idx [T, k], bias [E, 2I] or None
    -> [T, k, I] in x's dtype (decode): jq.gather_qmm_swiglu, the chosen experts'
    gate+up projection with its activation (its fused kernel is opt-in, so by default
    the gather GEMV and XLA's epilogue: docs/fused.md)."""
    if bias is not None:  # flattened with the weights under experts_by_layer
        bias, _ = in_stack(bias, idx)
    w_gate_up, idx = in_stack(w_gate_up, idx)
    kind = cfg.mlp_activation
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


def expert_order(flat, num_experts: int, by: str | None = None):
    """The pairs' order by expert, stable, its inverse and the experts' pair counts:
    (order, back, sizes), order = argsort(flat, stable=True), back[order[i]] = i, sizes
    [num_experts] int32 (the ragged products' group sizes). flat: int [P] expert ids in
    [0, num_experts] (num_experts: another device's pair, counted in no group). by:
    "sort" (argsort), "count" (a counting sort: a pair's place is the pairs of lower
    experts plus those of its own expert before it, a cumulative sum over the one-hot
    ids) or None, the platform's: argsort on the CPU, whose cumulative sum is the slower
    (617 against 376 µs at 2048 pairs), the counting sort elsewhere (an H200: 7.8 against
    19.0 µs at 2048 pairs, gpt-oss's 512 tokens; 23.5 against 44.7 at 131072;
    docs/prefill.md)."""
    if by is None:
        return lax.platform_dependent(flat, cpu=lambda f: expert_order(f, num_experts, "sort"),
                                      default=lambda f: expert_order(f, num_experts, "count"))
    if by not in ("sort", "count"):
        raise ValueError(f"by must be 'sort', 'count' or None; got {by!r}")
    inverse = lambda perm: jnp.zeros_like(perm).at[perm].set(
        jnp.arange(perm.shape[0], dtype=perm.dtype), unique_indices=True)
    if by == "sort":
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        return order, inverse(order), sizes
    onehot = flat[:, None] == jnp.arange(num_experts + 1, dtype=flat.dtype)
    upto = jnp.cumsum(onehot, axis=0, dtype=jnp.int32)  # [P, E + 1]: pairs so far per expert
    counts = upto[-1]
    below = jnp.cumsum(counts) - counts  # pairs of lower experts
    back = below[flat] + jnp.take_along_axis(upto, flat[:, None], 1)[:, 0] - 1
    return inverse(back), back, counts[:num_experts]


def route(cfg: Config, p, x):
    """Top-k experts and their weights per token: (idx [T, k] int32, weights [T, k] f32)."""
    logits = linear(x.astype(jnp.float32), p["router"].astype(jnp.float32),
                    p.get("router_bias"))
    k = cfg.experts_per_token
    if cfg.moe_router == "topk_softmax":  # top-k of the logits, softmax over those k
        top, idx = lax.top_k(logits, k)
        return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)  # softmax_topk: softmax, then top-k
    top, idx = lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, -1, keepdims=True)
    return idx.astype(jnp.int32), top


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
        bias, rows = in_stack(p[name + "_bias"], bias_rows)
        return y + bias[rows].astype(jnp.float32)

    def experts(a, matmul, bias_rows):
        """The experts' SwiGLU MLP of a through matmul(a, expert weights), float32 out;
        bias_rows: each output row's expert (for the biases)."""
        if "e_gate_up" in p:
            gate, up = jnp.split(product(a, matmul, "e_gate_up", bias_rows), 2, axis=-1)
        else:
            gate, up = (product(a, matmul, n, bias_rows) for n in ("e_gate", "e_up"))
        h = swiglu(gate, up, cfg.mlp_activation, cfg.swiglu_limit).astype(x.dtype)
        return product(h, matmul, "e_down", bias_rows)

    if t * k <= GATHER_MAX_PAIRS:  # decode: read only the chosen experts, in place
        local = jnp.where(mine, idx, 0)
        gather = lambda a, w: expert_gather(a, w, local)
        w_gate_up = p.get("e_gate_up")
        if isinstance(in_stack(w_gate_up, local)[0], QuantizedArray):
            h = expert_gather_swiglu(cfg, x, w_gate_up, local, p.get("e_gate_up_bias"))
            y = product(h, gather, "e_down", local)  # [T, k, D]
        else:
            y = experts(x, gather, local)
    else:  # prefill: sort (token, slot) pairs by expert, one ragged matmul each;
        # other devices' pairs sort last, past every group
        flat = jnp.where(mine, idx, num_experts).reshape(-1).astype(jnp.int32)
        order, back, sizes = expert_order(flat, num_experts)
        ys = experts(x[order // k], lambda a, w: expert_ragged(a, w, sizes),
                     jnp.minimum(flat[order], num_experts - 1))
        # back in (token, slot) order by a gather with the inverse permutation, which XLA
        # fuses into the weighted sum below (and the residual's add). Scattering the rows
        # into zeros instead cost a buffer of zeros and a scatter kernel a layer
        # (gpt-oss-20b, 512 tokens, H200: 23 against 8 µs a layer)
        y = ys[back].reshape(t, k, d)
    y = jnp.where(mine[..., None], y, 0.0)
    return jnp.einsum("tkd,tk->td", y, weights)
