"""models.from_hf on config.json as transformers 4.x and 5.x write it: the same Config
from both spellings (5.x: `rope_parameters` {rope_theta, rope_type, ...}, Qwen3-MoE's
`num_local_experts`; 4.x: `rope_theta` + `rope_scaling`, `num_experts`), keys the
loader does not implement refused by name, and (where transformers and torch are
installed) tiny random transformers models saved by `save_pretrained` in both
spellings giving transformers' logits to 1e-6 relative in float32 and its greedy
tokens."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import models
from jaxquant.models import checkpoint

# config.json as transformers 5.24's save_pretrained wrote it for tiny random models
# (Llama with llama3 RoPE scaling, Qwen3, Qwen3-MoE, Mixtral with a sliding window, gpt-oss
# with YaRN).
_DIMS = {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "attention_dropout": 0.0,
         "hidden_act": "silu", "initializer_range": 0.02, "pad_token_id": None,
         "dtype": "float32", "tie_word_embeddings": False, "transformers_version": "5.24.0",
         "use_cache": True}
HF5 = {
    "llama": dict(_DIMS, architectures=["LlamaForCausalLM"], model_type="llama",
                  attention_bias=False, bos_token_id=1, eos_token_id=2, intermediate_size=128,
                  max_position_embeddings=2048, mlp_bias=False, pretraining_tp=1,
                  rms_norm_eps=1e-06, rope_parameters={
                      "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 16, "rope_theta": 500000.0,
                      "rope_type": "llama3"}),
    "qwen3": dict(_DIMS, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  attention_bias=False, bos_token_id=None, eos_token_id=None,
                  intermediate_size=128, layer_types=["full_attention", "full_attention"],
                  max_position_embeddings=32768, max_window_layers=28, rms_norm_eps=1e-06,
                  rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                  sliding_window=None, use_sliding_window=False),
    "qwen3_moe": dict(_DIMS, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      attention_bias=False, bos_token_id=None, decoder_sparse_step=1,
                      eos_token_id=None, intermediate_size=128, max_position_embeddings=32768,
                      mlp_only_layers=[], moe_intermediate_size=64, norm_topk_prob=True,
                      num_experts_per_tok=2, num_local_experts=4, output_router_logits=False,
                      rms_norm_eps=1e-06, router_aux_loss_coef=0.001, sliding_window=None,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                      use_sliding_window=False),
    # Mixtral: intermediate_size is the experts'; a window of 4 on every layer (the tests'
    # 12 positions cross it; released Mixtrals have none)
    "mixtral": dict(_DIMS, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    bos_token_id=1, eos_token_id=2, intermediate_size=32,
                    max_position_embeddings=131072, num_experts_per_tok=2,
                    num_local_experts=4, output_router_logits=False, rms_norm_eps=1e-05,
                    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                    router_aux_loss_coef=0.001, router_jitter_noise=0.0, sliding_window=4),
    "gpt_oss": dict(_DIMS, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    attention_bias=True, bos_token_id=None, eos_token_id=None,
                    intermediate_size=64, layer_types=["sliding_attention", "full_attention"],
                    max_position_embeddings=131072, num_experts_per_tok=2,
                    num_local_experts=4, output_router_logits=False, rms_norm_eps=1e-05,
                    rope_parameters={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                     "original_max_position_embeddings": 4096,
                                     "rope_theta": 150000.0, "rope_type": "yarn",
                                     "truncate": False},
                    router_aux_loss_coef=0.001, sliding_window=3, swiglu_alpha=1.702,
                    swiglu_limit=7.0),
}
# What each should load as (written out, not derived from the loader).
WANT = {
    "llama": dict(family="llama", rope_theta=500000.0, rope_scaling=(
        ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 16), ("rope_type", "llama3")), rms_eps=1e-6),
    "qwen3": dict(family="qwen3", rope_theta=1000000.0, rope_scaling=(), qk_norm=True),
    "qwen3_moe": dict(family="qwen3_moe", rope_theta=10000.0, rope_scaling=(), num_experts=4,
                      experts_per_token=2, moe_intermediate_size=64, norm_topk_prob=True),
    "mixtral": dict(family="mixtral", rope_theta=1000000.0, rope_scaling=(), num_experts=4,
                    experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True,
                    layer_windows=(4, 4), rms_eps=1e-5, qk_norm=False,
                    moe_router="softmax_topk", mlp_activation="silu"),
    "gpt_oss": dict(family="gpt_oss", rope_theta=150000.0, rope_scaling=(
        ("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
        ("original_max_position_embeddings", 4096), ("rope_type", "yarn"), ("truncate", False)),
        num_experts=4, experts_per_token=2, layer_windows=(3, 0), rms_eps=1e-5,
        attention_bias=True),
}


def to_4x(cfg5):
    """The 4.x spelling of a 5.x config.json: top-level rope_theta and rope_scaling (None
    for default RoPE), Qwen3-MoE's num_experts."""
    cfg = copy.deepcopy(cfg5)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.57.1"
    return cfg


@pytest.mark.parametrize("name", sorted(HF5))
def test_both_spellings_give_the_same_config(name):
    cfg5, cfg4 = models.from_hf(HF5[name]), models.from_hf(to_4x(HF5[name]))
    assert cfg5 == cfg4
    for key, value in WANT[name].items():
        assert getattr(cfg5, key) == value, (key, getattr(cfg5, key), value)
    assert "rope_parameters" not in to_4x(HF5[name]) and "rope_theta" not in HF5[name]


def _with(name, **changes):
    cfg = copy.deepcopy(HF5[name])
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("name,changes,match", [
    ("llama", {"some_new_field": 3}, "some_new_field"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}},
     "rope_type"),
    ("llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "mscale": 2.0}},
     "mscale"),
    ("llama", {"rope_theta": 20000.0}, "rope_theta"),             # contradicts rope_parameters
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ("qwen3_moe", {"num_experts": 8}, "num_local_experts or num_experts"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
    ("mixtral", {"num_local_experts": "4"}, "num_local_experts"),
    ("mixtral", {"num_local_experts": None}, "num_local_experts"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than "
                                           "num_local_experts=4"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("mixtral", {"num_experts": 4}, "num_experts"),   # not a key Mixtral's config writes
    ("mixtral", {"sliding_window": -1}, "sliding_window"),
    ("gpt_oss", {"swiglu_alpha": 1.5}, "swiglu_alpha"),
    ("gpt_oss", {"num_local_experts": None}, "num_local_experts"),
])
def test_keys_the_loader_does_not_implement_are_refused(name, changes, match):
    with pytest.raises(ValueError, match=match):
        models.from_hf(_with(name, **changes))


def test_harmless_and_agreeing_keys_are_accepted():
    cfg = _with("llama", rope_theta=500000.0, _commit_hash="abc", use_cache=False,
                max_length=20, tokenizer_class="LlamaTokenizer")
    assert models.from_hf(cfg) == models.from_hf(HF5["llama"])
    both = _with("qwen3_moe", num_experts=4)          # both spellings, the same number
    assert models.from_hf(both).num_experts == 4
    # transformers' own default where a key is left out: Qwen3-MoE's norm_topk_prob is False
    cfg = _with("qwen3_moe")
    del cfg["norm_topk_prob"]
    assert models.from_hf(cfg).norm_topk_prob is False


# ---------------------------------------------------------------------------
# Against transformers itself (tiny random models, float32).

_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="torch (CPU) is needed to run transformers")
    transformers = pytest.importorskip("transformers", reason="compares against transformers")
    out = {}
    for name, (config_name, model_name) in _CLASSES.items():
        torch.manual_seed(0)
        hf = {k: v for k, v in HF5[name].items()
              if k not in ("architectures", "dtype", "transformers_version", "model_type")}
        config = getattr(transformers, config_name)(**hf)
        model = getattr(transformers, model_name)(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        dirs = {}
        for spelling in ("5.x", "4.x"):
            d = tmp_path_factory.mktemp(f"{name}-{spelling}")
            model.save_pretrained(d)
            if spelling == "4.x":
                written = json.loads((d / "config.json").read_text())
                (d / "config.json").write_text(json.dumps(to_4x(written)))
            dirs[spelling] = d
        out[name] = (torch, model, dirs)
    return out


@pytest.mark.parametrize("spelling", ["5.x", "4.x"])
@pytest.mark.parametrize("name", sorted(_CLASSES))
def test_matches_transformers(hf_models, name, spelling):
    torch, model, dirs = hf_models[name]
    written = json.loads((dirs[spelling] / "config.json").read_text())
    assert ("rope_parameters" in written) == (spelling == "5.x")
    prompt = np.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        want = model(torch.tensor(prompt)).logits.numpy()
        # greedy by full forwards: transformers' cached generate() with gpt-oss's sliding
        # window shorter than the prompt disagrees with its own full forward (5.24)
        ids = torch.tensor(prompt)
        for _ in range(6):
            step = model(ids, use_cache=False).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, step[:, None]], 1)
        want_tokens = ids[:, 6:].numpy()
    cfg, params = checkpoint.load(dirs[spelling], dtype="float32")
    tokens = jnp.asarray(prompt, jnp.int32)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(models.prefill(cfg, params, tokens, 16)[0])
        got_tokens = np.asarray(models.generate(cfg, params, tokens, 6))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6
    np.testing.assert_array_equal(got_tokens, want_tokens)
