"""The decoder's configuration, and how Hugging Face config.json files map onto it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
#: The families whose MLPs are experts (num_experts > 0); the others are dense.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
MLP_ACTIVATIONS = ("silu", "gpt_oss")  # silu(gate) * up; gpt-oss's clamped (up + 1) * glu
# softmax over all experts, then top-k; or top-k of the logits, then softmax over those k
MOE_ROUTERS = ("softmax_topk", "topk_softmax")

# What a family's blocks do differently, beyond the sizes: the value a Config field left
# None takes. The model code reads the fields, never the family name, so a new family
# that only recombines these needs a row here (docs/architecture.md, "Adding a model family").
_LLAMA_BLOCKS = dict(mlp_activation="silu", moe_router="softmax_topk", attention_sinks=False,
                     moe_bias=False)
FAMILY_TRAITS = {
    "llama": _LLAMA_BLOCKS, "qwen3": _LLAMA_BLOCKS, "qwen3_moe": _LLAMA_BLOCKS,
    # Mixtral's router (transformers' MixtralTopKRouter): softmax over every expert, top-k,
    # the k renormalized: Qwen3-MoE's with norm_topk_prob, which from_hf sets
    "mixtral": _LLAMA_BLOCKS,
    "gpt_oss": dict(mlp_activation="gpt_oss", moe_router="topk_softmax", attention_sinks=True,
                    moe_bias=True),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of a decoder-only transformer. Hashable (a static jit argument).

    family: "llama" (also Mistral/Qwen2-style dense), "qwen3" (dense, q/k norms),
    "qwen3_moe" (q/k norms, softmax-then-top-k router, SwiGLU experts), "mixtral"
    (Llama attention, Mistral's sliding window on every layer where set, Qwen3-MoE's
    router with the top k renormalized, SwiGLU experts) or "gpt_oss"
    (attention biases and sinks, alternating sliding window, top-k-then-softmax
    router with bias, clamped SwiGLU experts with biases, gate/up interleaved).
    mlp_activation, moe_router, attention_sinks (a learned per-head sink logit) and
    moe_bias (router and expert biases): None takes the family's (FAMILY_TRAITS).
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
    mlp_activation: str | None = None   # MLP_ACTIVATIONS
    moe_router: str | None = None       # MOE_ROUTERS
    attention_sinks: bool | None = None
    moe_bias: bool | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not known; expected one of {FAMILIES}")
        for name, value in FAMILY_TRAITS[self.family].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: set once, before any use
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} is not known; expected one "
                             f"of {MLP_ACTIVATIONS}")
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"moe_router={self.moe_router!r} is not known; expected one of "
                             f"{MOE_ROUTERS}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not (math.isfinite(self.rms_eps) and self.rms_eps >= 0):
            raise ValueError(f"rms_eps must be finite and >= 0; got {self.rms_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be finite and > 0; got {self.rope_theta}")
        for key, value in self.rope_scaling:
            if key in ROPE_POSITIVE and not (isinstance(value, (int, float))
                                             and not isinstance(value, bool)
                                             and math.isfinite(value) and value > 0):
                raise ValueError(f"rope_scaling {key}={value!r} must be a finite number > 0")
        rs = dict(self.rope_scaling)
        kind = rs.get("rope_type", rs.get("type", "default"))
        need = {"default": (), "linear": ("factor",), "yarn": (
            "factor", "original_max_position_embeddings"), "llama3": (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        if kind not in need or not isinstance(rs.get("truncate", True), bool):
            raise ValueError(f"rope_scaling {rs!r:.200}: the type must be one of {sorted(need)} "
                             f"and truncate a bool")
        missing = [k for k in need[kind] if k not in rs]
        if missing:
            raise ValueError(f"rope_scaling of type {kind!r} needs {missing}")
        if kind == "llama3" and rs["low_freq_factor"] == rs["high_freq_factor"]:
            raise ValueError("rope_scaling low_freq_factor and high_freq_factor must differ")
        if not all(math.isfinite(v) and v > 0 for v in self.rope_freq_factors):
            raise ValueError("rope_freq_factors must all be finite and > 0")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers={self.num_layers} is more than {MAX_LAYERS}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} must be 'bfloat16', 'float16' or 'float32' "
                             f"(activations and float weights)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.moe != (self.family in MOE_FAMILIES):
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


# config.json keys that do not change what the decoder computes at inference: metadata,
# training, generation and tokenizer settings (PretrainedConfig's common attributes, in
# transformers 4.x's full dicts and 5.x's), plus keys starting with "_".
HARMLESS_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "model_type",
    "attention_dropout", "initializer_range", "use_cache", "pretraining_tp",
    "max_position_embeddings", "initial_context_length", "router_aux_loss_coef",
    "output_router_logits", "router_jitter_noise", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "prefix",
    "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type",
    "finetuning_task", "task_specific_params", "pruned_heads", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "max_window_layers"})
# RoPE keys rope_inv_freq reads (4.x rope_scaling, 5.x rope_parameters), and the types.
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                       "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                       "beta_slow", "attention_factor", "truncate"})
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: The rope parameters that must be finite numbers > 0 (the others: the type and truncate).
ROPE_POSITIVE = frozenset({"factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings", "beta_fast", "beta_slow",
                           "attention_factor", "rope_theta"})
#: The most layers a config may declare (the deepest released decoders have under 200); a
#: bound so a hostile count is refused before anything per layer is built.
MAX_LAYERS = 4096
#: The largest size (hidden, vocabulary, heads, intermediate, ...) a config may declare.
MAX_SIZE = 1 << 31
# transformers' defaults where a config.json leaves a key out.
ROPE_THETA = {"gpt_oss": 150000.0, "mixtral": 1000000.0}
RMS_EPS = {"gpt_oss": 1e-5, "mixtral": 1e-5}
GPT_OSS_SWIGLU_ALPHA = 1.702  # the decoder's (docs/models.md)


class _Fields:
    """A config.json dict that remembers which keys were read, so what is left over can
    be refused by name (a key the loader does not understand is never defaulted)."""

    def __init__(self, cfg: dict):
        self.cfg, self.read = cfg, set()

    def __contains__(self, key):
        return key in self.cfg

    def __getitem__(self, key):
        if self.cfg.get(key) is None:
            raise ValueError(f"config.json has no {key!r} (model_type "
                             f"{self.cfg.get('model_type')!r} needs it)")
        self.read.add(key)
        return self.cfg[key]

    def get(self, key, default=None):
        self.read.add(key)
        value = self.cfg.get(key)
        return default if value is None else value

    def int(self, key, default=None, lo=1, hi=MAX_SIZE):
        """An int in [lo, hi] (key required when default is None)."""
        value = self[key] if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"config.json {key}={value!r:.80} must be an int in [{lo}, {hi}]")
        return value

    def number(self, key, default, positive=True):
        """A finite number (> 0 if positive, else >= 0), as float."""
        value = self.get(key, default)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0 or (positive and value == 0)):
            raise ValueError(f"config.json {key}={value!r:.80} must be a finite number "
                             f"{'> 0' if positive else '>= 0'}")
        return float(value)

    def bool(self, key, default):
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"config.json {key}={value!r:.80} must be true or false (JSON "
                             f"booleans, not strings or numbers)")
        return value

    def dict(self, key):
        value = self.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"config.json {key} must be an object; got {value!r:.80}")
        return value

    def expect(self, key, allowed, why):
        """Refuse a value of `key` the decoder does not implement (absent / null is fine)."""
        value = self.get(key)
        if value is not None and value not in allowed:
            raise ValueError(f"config.json {key}={value!r} is not supported ({why})")

    def leftover(self):
        return sorted(k for k in self.cfg if k not in self.read and k not in HARMLESS_KEYS
                      and not k.startswith("_"))


def _rope(f: _Fields, family: str):
    """(theta, sorted scaling pairs) from 5.x `rope_parameters` or 4.x `rope_theta` +
    `rope_scaling` (both spellings may appear; they must agree)."""
    params = dict(f.dict("rope_scaling"))
    for key, value in f.dict("rope_parameters").items():
        if key in params and params[key] != value:
            raise ValueError(f"config.json rope_parameters.{key}={value!r} contradicts "
                             f"rope_scaling.{key}={params[key]!r}")
        params[key] = value
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ValueError(f"config.json rope parameters {unknown} are not supported (known: "
                         f"{sorted(ROPE_KEYS)})")
    for key, value in params.items():
        if key in ROPE_POSITIVE and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or not math.isfinite(value) or value <= 0):
            raise ValueError(f"config.json rope parameter {key}={value!r:.80} must be a finite "
                             f"number > 0")
    theta = params.pop("rope_theta", None)
    top = None if f.get("rope_theta") is None else f.number("rope_theta", None)
    if theta is not None and top is not None and float(theta) != float(top):
        raise ValueError(f"config.json rope_theta={top!r} contradicts "
                         f"rope_parameters.rope_theta={theta!r}")
    theta = theta if theta is not None else top
    if theta is None:
        theta = ROPE_THETA.get(family, 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type={kind!r} is not supported (one of "
                         f"{ROPE_TYPES})")
    if kind == "default":
        params = {}
    return float(theta), tuple(sorted(params.items()))


def _windows(f: _Fields, mt: str, layers: int) -> tuple[int, tuple]:
    """(sliding window, per-layer windows): `layer_types` where given (5.x writes it for
    Qwen and gpt-oss), Mistral's and Mixtral's window on every layer, gpt-oss alternating
    by default."""
    window = f.int("sliding_window", 0, lo=0)
    types = f.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise ValueError(f"config.json layer_types must be a list; got {types!r:.80}")
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        f.expect("use_sliding_window", (False,), "Qwen's sliding-window layers")
        if not types:
            return 0, ()
    if mt == "gpt_oss" and not types:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types:
        bad = sorted({str(t) for t in types} - {"sliding_attention", "full_attention"})
        if bad or len(types) != layers:
            raise ValueError(f"config.json layer_types must be {layers} entries of "
                             f"'sliding_attention' / 'full_attention'; got {types}")
        if "sliding_attention" in types and not window:
            raise ValueError("config.json layer_types has sliding_attention layers but no "
                             "sliding_window")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
        return (window if any(windows) else 0), (windows if any(windows) else ())
    if mt in ("mistral", "mixtral") and window:
        return window, (window,) * layers
    return 0, ()


def _quantization(f: _Fields):
    """`quantization` (mlx-lm's; the checkpoint loader reads it) and `quantization_config`:
    gpt-oss's MXFP4 (read from the tensors), GPTQ, AWQ and compressed-tensors
    (docs/checkpoints.md) or mlx-lm's copy of `quantization`."""
    mlx = f.get("quantization")
    qc = f.get("quantization_config")
    for key, value in (("quantization", mlx), ("quantization_config", qc)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json {key} must be an object; got {value!r:.80}")
    methods = ("mxfp4", "gptq", "awq", "compressed-tensors")
    if qc is not None and qc.get("quant_method") not in methods and qc != mlx:
        raise ValueError(f"config.json quantization_config={qc!r} is not supported (the "
                         f"loader reads float, MLX-quantized, gpt-oss MXFP4, GPTQ, AWQ and "
                         f"compressed-tensors checkpoints)")


def _experts(f: _Fields, count: str, per_token: str) -> dict:
    """num_experts and experts_per_token from config.json's keys `count` and `per_token`,
    a bad value refused naming the key."""
    experts = f.int(count)
    k = f.int(per_token)
    if k > experts:
        raise ValueError(f"config.json {per_token}={k} is more than {count}={experts} (each "
                         f"token picks that many distinct experts)")
    return dict(num_experts=experts, experts_per_token=k)


def from_hf(cfg: dict, dtype: str = "bfloat16") -> Config:
    """A Config from a Hugging Face config.json dict (model_type llama, mistral,
    qwen2, qwen3, qwen3_moe, mixtral, gpt_oss), as transformers 4.x or 5.x writes it.

    Every key must be one the decoder implements or one that does not change inference
    (HARMLESS_KEYS); anything else raises ValueError naming the key, rather than being
    defaulted silently."""
    f = _Fields(cfg)
    mt = f.get("model_type", "llama")
    if not isinstance(mt, str):
        raise ValueError(f"config.json model_type={mt!r:.80} must be a string")
    family = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3",
              "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss"}.get(mt)
    if family is None:
        raise ValueError(f"model_type={mt!r} is not supported; expected llama, mistral, qwen2, "
                         f"qwen3, qwen3_moe, mixtral or gpt_oss")
    f.expect("hidden_act", ("silu",), "the MLPs are SwiGLU")
    f.expect("mlp_bias", (False,), "the dense MLP has no biases")
    f.expect("partial_rotary_factor", (1, 1.0), "RoPE rotates the whole head")
    f.expect("attn_logit_softcapping", (), "no attention soft-capping")
    f.expect("final_logit_softcapping", (), "no logit soft-capping")
    _quantization(f)
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    layers = f.int("num_hidden_layers", hi=MAX_LAYERS)
    if f.get("head_dim") is None and hidden % heads:
        raise ValueError(f"config.json num_attention_heads={heads} does not divide "
                         f"hidden_size={hidden} (and there is no head_dim)")
    theta, scaling = _rope(f, family)
    window, windows = _windows(f, mt, layers)
    kw = dict(family=family, vocab_size=f.int("vocab_size"), hidden_size=hidden,
              num_layers=layers, num_heads=heads,
              num_kv_heads=f.int("num_key_value_heads", heads),
              head_dim=f.int("head_dim", hidden // heads),
              intermediate_size=f.int("intermediate_size", 0, lo=0),
              rms_eps=f.number("rms_norm_eps", RMS_EPS.get(family, 1e-6), positive=False),
              rope_theta=theta, rope_scaling=scaling,
              tie_embeddings=f.bool("tie_word_embeddings", False),
              attention_bias=f.bool("attention_bias", mt in ("qwen2", "gpt_oss")),
              qk_norm=family in ("qwen3", "qwen3_moe"), layer_windows=windows, dtype=dtype)
    if family == "qwen3_moe":
        if f.get("mlp_only_layers") or f.get("decoder_sparse_step", 1) not in (1, 1.0):
            raise ValueError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step"
                             " != 1) is not supported")
        spellings = {f.int(key) for key in ("num_local_experts", "num_experts")
                     if f.get(key) is not None}
        if len(spellings) != 1:  # 5.x writes num_local_experts, 4.x num_experts
            raise ValueError(f"config.json needs one number of experts (num_local_experts or "
                             f"num_experts); got {sorted(spellings)}")
        key = "num_local_experts" if f.get("num_local_experts") is not None else "num_experts"
        kw.update(_experts(f, key, "num_experts_per_tok"),
                  moe_intermediate_size=f.int("moe_intermediate_size"),
                  norm_topk_prob=f.bool("norm_topk_prob", False))
    if family == "mixtral":  # intermediate_size is the experts' (there is no dense MLP)
        kw.update(_experts(f, "num_local_experts", "num_experts_per_tok"),
                  moe_intermediate_size=f.int("intermediate_size"), norm_topk_prob=True)
    if family == "gpt_oss":
        f.expect("swiglu_alpha", (GPT_OSS_SWIGLU_ALPHA,), "the experts' SwiGLU uses 1.702")
        per_token = ("num_experts_per_tok" if f.get("num_experts_per_tok") is not None
                     else "experts_per_token")
        kw.update(_experts(f, "num_local_experts", per_token),
                  moe_intermediate_size=f.int("intermediate_size"), sliding_window=window,
                  swiglu_limit=f.number("swiglu_limit", 7.0))
    unknown = f.leftover()
    if unknown:
        raise ValueError(f"config.json has keys the loader does not implement: {unknown} "
                         f"(model_type {mt!r}); refusing rather than ignoring them. If one "
                         f"does not change inference, remove it from config.json")
    return Config(**kw)
