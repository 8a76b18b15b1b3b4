"""The decoder's configuration, and how Hugging Face config.json files map onto it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of a decoder-only transformer. Hashable (a static jit argument).

    family: "llama" (also Mistral/Qwen2-style dense), "qwen3" (dense, q/k norms),
    "qwen3_moe" (q/k norms, softmax-then-top-k router, SwiGLU experts) or "gpt_oss"
    (attention biases and sinks, alternating sliding window, top-k-then-softmax
    router with bias, clamped SwiGLU experts with biases, gate/up interleaved).
    """

    family: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512      # dense MLP
    num_experts: int = 0              # 0: dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()          # sorted (key, value) pairs of HF's rope_scaling
    rope_freq_factors: tuple = ()     # per frequency divisors (a GGUF's rope_freqs tensor)
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    norm_topk_prob: bool = True       # qwen3_moe
    sliding_window: int = 0           # gpt_oss: every other layer (layer_types)
    layer_windows: tuple = ()         # per layer: 0 full attention, else window
    swiglu_limit: float = 7.0         # gpt_oss
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not known; expected one of {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.moe != (self.family in ("qwen3_moe", "gpt_oss")):
            raise ValueError(f"family={self.family!r} needs num_experts "
                             f"{'> 0' if not self.moe else '= 0'}; got {self.num_experts}")
        if self.moe and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                             f"expected head_dim/2 = {self.head_dim // 2}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def windows(self) -> np.ndarray:
        """Per layer: the attention window (0: full)."""
        if self.layer_windows:
            return np.asarray(self.layer_windows, np.int32)
        return np.zeros(self.num_layers, np.int32)

    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """RoPE inverse frequencies [head_dim/2] and the attention factor that scales
        cos/sin (1 but for YaRN): default, "llama3" and "yarn" scaling, as in
        Hugging Face transformers; rope_freq_factors divide the frequencies (ggml's
        freq_factors, how GGUF files carry Llama 3's scaling)."""
        dim, base = self.head_dim, self.rope_theta
        inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.rope_freq_factors:
            inv = inv / np.asarray(self.rope_freq_factors, np.float64)
        rs = dict(self.rope_scaling)
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind in ("default", None):
            return inv, 1.0
        factor = float(rs["factor"])
        if kind == "linear":
            return inv / factor, 1.0
        if kind == "llama3":
            low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old = float(rs["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - low) / (high - low)
            scaled = np.where(wavelen > old / low, inv / factor, inv)
            mid = (wavelen <= old / low) & (wavelen >= old / high)
            return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled), 1.0
        if kind == "yarn":
            old = float(rs["original_max_position_embeddings"])
            beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))
            attention = rs.get("attention_factor")
            if attention is None:
                attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

            def correction_dim(rotations):
                return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
            if rs.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
            extrapolate = 1 - ramp
            inv = inv / factor * (1 - extrapolate) + inv * extrapolate
            return inv, float(attention)
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, "
                         f"llama3, yarn)")


def from_hf(cfg: dict, dtype: str = "bfloat16") -> Config:
    """A Config from a Hugging Face config.json dict (model_type llama, mistral,
    qwen2, qwen3, qwen3_moe, gpt_oss)."""
    mt = cfg.get("model_type", "llama")
    family = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3",
              "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss"}.get(mt)
    if family is None:
        raise ValueError(f"model_type={mt!r} is not supported; expected llama, mistral, qwen2, "
                         f"qwen3, qwen3_moe or gpt_oss")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    kw = dict(family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden,
              num_layers=layers, num_heads=heads,
              num_kv_heads=cfg.get("num_key_value_heads", heads),
              head_dim=cfg.get("head_dim") or hidden // heads,
              intermediate_size=cfg.get("intermediate_size", 0),
              rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
              rope_theta=float(cfg.get("rope_theta", 10000.0)),
              rope_scaling=tuple(sorted((cfg.get("rope_scaling") or {}).items())),
              tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
              attention_bias=bool(cfg.get("attention_bias", mt in ("qwen2", "gpt_oss"))),
              qk_norm=family in ("qwen3", "qwen3_moe"), dtype=dtype)
    if family == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step"
                             " != 1) is not supported")
        kw.update(num_experts=cfg["num_experts"], experts_per_token=cfg["num_experts_per_tok"],
                  moe_intermediate_size=cfg["moe_intermediate_size"],
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    if family == "gpt_oss":
        window = int(cfg.get("sliding_window") or 0)
        types = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        kw.update(num_experts=cfg["num_local_experts"],
                  experts_per_token=cfg.get("num_experts_per_tok", cfg.get("experts_per_token")),
                  moe_intermediate_size=cfg["intermediate_size"], sliding_window=window,
                  layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                  swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if mt == "mistral" and cfg.get("sliding_window"):
        kw.update(layer_windows=(int(cfg["sliding_window"]),) * layers)
    return Config(**kw)
