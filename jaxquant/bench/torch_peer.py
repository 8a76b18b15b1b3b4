"""The PyTorch peer of `python -m jaxquant bench model`: a dense Llama-style
decoder built the way gpt-fast (pytorch-labs/gpt-fast, model.py and
generate.py) builds one, computing the same function as
`jaxquant.models` for the same weights.

As gpt-fast: fused wqkv, a static KV cache [B, Hkv, S, hd] updated in place
with index_put, a causal mask row per position, F.scaled_dot_product_attention
with the KV heads repeated (GQA), the decode step compiled whole
(`torch.compile(mode="max-autotune", fullgraph=True)`, coordinate-descent
tuning on) and a Python loop of greedy steps; int4 weights (group 64,
asymmetric min/max, every linear layer and the head) through
`torch._weight_int4pack_mm` on `torch.ops.aten._convert_weight_to_int4pack`
data. As jaxquant (so the two agree): RoPE on the two halves of a head
(Hugging Face's convention; gpt-fast's own checkpoints are permuted for its
interleaved one), norms in float32 with the weight applied before the cast
back, logits in float32.

The weights are views of the JAX arrays (DLPack, no copy) but for wqkv, which
is concatenated as in gpt-fast.
"""

from __future__ import annotations

import numpy as np

INT4_GROUP = 64


def int4pack(w, group: int = INT4_GROUP, inner_k_tiles: int = 8):
    """w [N, K] (float, CUDA) -> (packed weight, scales_and_zeros [K/group, N, 2] bf16) for
    torch._weight_int4pack_mm: asymmetric min/max quantization per group of K, as
    gpt-fast's group_quantize_tensor (dequantized (q - 8) * scale + zero)."""
    import torch

    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    sz = torch.stack([scale.reshape(n, k // group), zero.reshape(n, k // group)], -1)
    sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
    q_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(q_u8, inner_k_tiles), sz


def int4_unavailable(device: str) -> str | None:
    """Why the int4 peer cannot run on `device`, or None."""
    import torch

    if device != "cuda":
        return ("torch._weight_int4pack_mm on _convert_weight_to_int4pack data is the CUDA "
                "kernel gpt-fast uses (the CPU has other ops and layouts)")
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm"
    return None


def unavailable(cfg) -> str | None:
    """Why the peer cannot be built for `cfg`, or None."""
    if cfg.family != "llama" or cfg.attention_bias or cfg.qk_norm or cfg.tie_embeddings:
        return (f"the torch peer is a dense Llama decoder; {cfg.family} (MoE, biases, q/k "
                f"norms or tied embeddings) is not built")
    if cfg.layer_windows or dict(cfg.rope_scaling).get("rope_type", "default") not in (
            "default", "llama3", "linear"):
        return "the torch peer has no sliding window or YaRN"
    return None


def _modules():
    """The nn.Module classes (torch imported only when a peer is built)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Linear(nn.Module):
        """y = x @ w.T: w [N, K] float, or int4-packed (`int4pack`)."""

        def __init__(self, w, group=None):
            super().__init__()
            self.out_features, self.group = w.shape[0], group
            if group is None:
                self.register_buffer("weight", w, persistent=False)
            else:
                packed, sz = int4pack(w, group)
                self.register_buffer("weight", packed, persistent=False)
                self.register_buffer("scales_and_zeros", sz, persistent=False)

        def forward(self, x):
            if self.group is None:
                return F.linear(x, self.weight)
            lead = x.shape[:-1]
            y = torch.ops.aten._weight_int4pack_mm(
                x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.weight, self.group,
                self.scales_and_zeros)
            return y.reshape(*lead, self.out_features).to(x.dtype)

    class RMSNorm(nn.Module):
        def __init__(self, w, eps):
            super().__init__()
            self.eps = eps
            self.register_buffer("weight", w, persistent=False)

        def forward(self, x):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)

    class KVCache(nn.Module):
        def __init__(self, batch, heads, max_len, head_dim, dtype, device):
            super().__init__()
            shape = (batch, heads, max_len, head_dim)
            self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

        def update(self, input_pos, k, v):
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
            return self.k_cache, self.v_cache

    def rope(x, cos, sin):  # x [B, T, H, hd]; cos, sin [T, hd/2]
        xf = x.float()
        a, b = xf.chunk(2, dim=-1)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, cfg, wq, wk, wv, wo, group):
            super().__init__()
            self.hq, self.hkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            self.wqkv = Linear(torch.cat([wq, wk, wv]), group)
            self.wo = Linear(wo, group)
            self.kv_cache = None

        def forward(self, x, cos, sin, mask, input_pos):
            b, t, _ = x.shape
            q_size, kv_size = self.hq * self.hd, self.hkv * self.hd
            q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
            q = rope(q.view(b, t, self.hq, self.hd), cos, sin)
            k = rope(k.view(b, t, self.hkv, self.hd), cos, sin)
            v = v.view(b, t, self.hkv, self.hd)
            q, k, v = (a.transpose(1, 2) for a in (q, k, v))
            k, v = self.kv_cache.update(input_pos, k, v)
            k = k.repeat_interleave(self.hq // self.hkv, dim=1)
            v = v.repeat_interleave(self.hq // self.hkv, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
            return self.wo(y.transpose(1, 2).contiguous().view(b, t, q_size))

    class Block(nn.Module):
        def __init__(self, cfg, p, group):
            super().__init__()
            self.attention = Attention(cfg, p["wq"], p["wk"], p["wv"], p["wo"], group)
            self.w1, self.w3 = Linear(p["w_gate"], group), Linear(p["w_up"], group)
            self.w2 = Linear(p["w_down"], group)
            self.attention_norm = RMSNorm(p["attn_norm"], cfg.rms_eps)
            self.ffn_norm = RMSNorm(p["mlp_norm"], cfg.rms_eps)

        def forward(self, h, cos, sin, mask, input_pos):
            h = h + self.attention(self.attention_norm(h), cos, sin, mask, input_pos)
            x = self.ffn_norm(h)
            return h + self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Transformer(nn.Module):
        def __init__(self, cfg, p, group):
            super().__init__()
            self.cfg = cfg
            self.register_buffer("tok_embeddings", p["embed"], persistent=False)
            self.layers = nn.ModuleList(
                Block(cfg, {k: v[i] for k, v in p["layers"].items()}, group)
                for i in range(cfg.num_layers))
            self.norm = RMSNorm(p["final_norm"], cfg.rms_eps)
            self.output = Linear(p["lm_head"], group)
            inv_freq, factor = cfg.rope_inv_freq()
            self.register_buffer("inv_freq", torch.tensor(np.asarray(inv_freq, np.float32),
                                                          device=p["embed"].device))
            self.attention_factor = factor

        def setup_caches(self, batch, max_len):
            dev, dt = self.tok_embeddings.device, self.tok_embeddings.dtype
            cfg = self.cfg
            for block in self.layers:
                block.attention.kv_cache = KVCache(batch, cfg.num_kv_heads, max_len,
                                                   cfg.head_dim, dt, dev)
            self.causal_mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool,
                                                     device=dev))

        def forward(self, idx, input_pos):
            mask = self.causal_mask[None, None, input_pos]
            angles = input_pos[:, None].float() * self.inv_freq
            cos = torch.cos(angles) * self.attention_factor
            sin = torch.sin(angles) * self.attention_factor
            h = self.tok_embeddings[idx]
            for block in self.layers:
                h = block(h, cos, sin, mask, input_pos)
            return self.output(self.norm(h)).float()

    return Transformer


class Peer:
    """A gpt-fast-style decoder on `params` (jaxquant.models' dense Llama layout).
    `setup(batch, max_len)` sizes the KV cache; `prefill(prompt)` -> (logits [B, S, V]
    float32, next token [B, 1]); `decode(token, start, steps)` -> tokens [B, steps]
    (greedy, one compiled step per token)."""

    def __init__(self, cfg, params, *, int4: bool = False, compile_mode: str | None = None):
        import torch

        why = unavailable(cfg)
        if why is not None:
            raise ValueError(why)
        p = _to_torch(params)
        self.device = p["embed"].device.type
        self.model = _modules()(cfg, p, INT4_GROUP if int4 else None)
        self.row_bytes = p["embed"][0].numel() * p["embed"].element_size()
        step = self._decode_one_token
        if compile_mode is not None:
            import torch._inductor.config as inductor

            inductor.coordinate_descent_tuning = True  # as gpt-fast's generate.py
            step = torch.compile(step, mode=compile_mode, fullgraph=True)
        self.step = step

    def setup(self, batch: int, max_len: int):
        self.model.setup_caches(batch, max_len)

    def step_bytes(self, batch: int) -> int:
        """Weight bytes a decode step reads: every weight, one embedding row a sequence."""
        weights = sum(b.numel() * b.element_size() for name, b in self.model.named_buffers()
                      if name.endswith(("weight", "scales_and_zeros")))
        return weights + batch * self.row_bytes

    def _decode_one_token(self, token, input_pos):
        import torch

        logits = self.model(token, input_pos)
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int32)

    def prefill(self, prompt):
        import torch

        with torch.no_grad():
            prompt = torch.as_tensor(np.array(prompt), device=self.device).long()
            pos = torch.arange(prompt.shape[1], device=self.device)
            logits = self.model(prompt, pos)
            return logits, torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int32)

    def decode(self, token, start: int, steps: int):
        import torch

        out = []
        with torch.no_grad():
            input_pos = torch.tensor([start], device=self.device)
            for _ in range(steps):
                token = self.step(token.long(), input_pos).clone()
                input_pos += 1
                out.append(token)
        return torch.cat(out, dim=1)

    def sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


def _to_torch(tree):
    """The JAX arrays of a params dict as torch tensors on the same device (DLPack views)."""
    import torch

    if isinstance(tree, dict):
        return {k: _to_torch(v) for k, v in tree.items()}
    return torch.from_dlpack(tree)
