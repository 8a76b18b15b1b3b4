"""models.checkpoint.load on GPTQ, AWQ and compressed-tensors checkpoints.

Tiny Llama checkpoints in the hubs' on-disk layout (config.json's
quantization_config; `*.qweight` / `.qzeros` / `.scales` / `.g_idx`, or
`*.weight_packed` / `.weight_scale` / `.weight_zero_point` / `.weight_shape` /
`.weight_global_scale`), every linear packed by the reference package itself
(auto-gptq, AutoAWQ, compressed-tensors). The loaded model keeps them quantized
and decodes the same greedy tokens as the float model whose weights are the
reference dequantizer's output.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models
from jaxquant.models import checkpoint
from jaxquant.models.layers import PermutedMatrix
from jaxquant.models.params import MATRICES
from jaxquant.quantized_array import QuantizedArray
from tests.test_io_hf import _ct_compress, _gptqmodel_dequant, _reference_module
from tests.test_models import LLAMA, _dense_mlps, _hf_common, _manual_common, _write

pytest.importorskip("safetensors")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
KEYS = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
        "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
        "mlp.down_proj": "w_down"}


def _float_checkpoint(seed):
    rng = np.random.default_rng(seed)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    return t


def _quantize_linears(t, pack):
    """Replace every decoder linear's `.weight` by pack(prefix, weight) tensors; returns
    (checkpoint tensors, the reference dequantized weights by name)."""
    out, ref = dict(t), {}
    for i in range(LLAMA["num_hidden_layers"]):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}"
            tensors, w = pack(prefix, np.asarray(out.pop(prefix + ".weight"), np.float32))
            out.update(tensors)
            ref[prefix + ".weight"] = np.asarray(w, np.float32)
    return out, ref


def _gptq_pack(prefix, w, act_order=True):
    """auto-gptq's own packing: act-order groups (desc_act), or contiguous ones."""
    torch = pytest.importorskip("torch")
    qlinear = _reference_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    n, k = w.shape
    g = 32
    if act_order:
        # act-order sorts K by the Hessian of the layer's input: one order for the
        # matrices that share an input (q/k/v, gate/up), so they fuse
        shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace(
            "up_proj", "gate_proj")
        rng = np.random.default_rng(sum(map(ord, shared)))
        g_idx = torch.from_numpy(rng.permutation(np.arange(k) // g).astype(np.int32))
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // g
    wt = torch.from_numpy(w)
    blocks = [wt[:, g_idx == j] for j in range(k // g)]       # the groups' columns
    lo = torch.stack([b.min(1).values.clamp(max=0) for b in blocks], 1)
    hi = torch.stack([b.max(1).values.clamp(min=0) for b in blocks], 1)
    scales = ((hi - lo) / 15).half().float()
    zeros = torch.round(-lo / scales).clamp(1, 15)             # v1 cannot hold a zero of 0
    layer = qlinear.QuantLinear(4, g, k, n, False)
    codes = torch.clamp(torch.round(wt / scales[:, g_idx.long()]) + zeros[:, g_idx.long()], 0, 15)
    lin = torch.nn.Linear(k, n, bias=False).half()
    lin.weight.data = ((codes - zeros[:, g_idx.long()]) * scales[:, g_idx.long()]).half()
    layer.pack(lin, scales, zeros, g_idx)
    deq = layer(torch.eye(k, dtype=torch.float16)).T.float().numpy()
    return {f"{prefix}.{p}": getattr(layer, p).numpy() for p in ("qweight", "qzeros", "scales",
                                                                 "g_idx")}, deq


def _random_gptq_pack(prefix, w, act_order=True):
    """No package: random GPTQ words (every field value, zero fields of 15 included), in
    act-order groups or contiguous ones, dequantized by gptqmodel's transcribed reading
    (tests/test_io_hf.py)."""
    n, k = w.shape
    rng = np.random.default_rng(sum(map(ord, prefix)))
    qweight = rng.integers(0, 2 ** 32, (k // 8, n), dtype=np.uint32).view(np.int32)
    qzeros = rng.integers(0, 2 ** 32, (k // 32, n // 8), dtype=np.uint32).view(np.int32)
    scales = (rng.random((k // 32, n)) * 0.02 + 1e-3).astype(np.float16)
    g_idx = np.arange(k) // 32
    g_idx = (rng.permutation(g_idx) if act_order else g_idx).astype(np.int32)
    deq = _gptqmodel_dequant(qweight, qzeros, scales, g_idx, 4, v1=True)
    return ({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
             f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx},
            deq.astype(np.float16).astype(np.float32))


def _awq_pack(prefix, w):
    torch = pytest.importorskip("torch")
    gemm = _reference_module("awq", "modules.linear.gemm")
    packing = _reference_module("awq", "utils.packing_utils")
    n, k = w.shape
    g = 32
    wt = torch.from_numpy(w).T.reshape(k // g, g, n)           # [G, g, N]
    lo, hi = wt.amin(1).clamp(max=0), wt.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    codes = torch.clamp(torch.round(wt / scales.float()[:, None]) + zeros[:, None], 0, 15)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = ((codes - zeros[:, None]) * scales.float()[:, None]).reshape(k, n).T
    layer = gemm.WQLinear_GEMM.from_linear(lin, 4, g, scales=scales, zeros=zeros)
    deq = packing.dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, g)
    return {f"{prefix}.{p}": getattr(layer, p).numpy() for p in ("qweight", "qzeros",
                                                                 "scales")}, deq.T.float().numpy()


CT_SCHEMES = {
    "pack-quantized": dict(num_bits=4, type="int", symmetric=False, strategy="group",
                           group_size=32),
    "nvfp4-pack-quantized": dict(num_bits=4, type="float", symmetric=True,
                                 strategy="tensor_group", group_size=16),
}


def _ct_pack(fmt):
    def pack(prefix, w):
        torch = pytest.importorskip("torch")
        tensors, _, deq = _ct_compress(torch.from_numpy(w).to(torch.bfloat16), CT_SCHEMES[fmt],
                                       fmt)
        return {prefix + name[1:]: v for name, v in tensors.items()}, deq.astype(np.float32)
    return pack


def _tokens(cfg, params):
    prompt = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    run = jax.jit(lambda p: models.generate(cfg, p, prompt, 6))
    logits = jax.jit(lambda p: models.prefill(cfg, p, prompt, 8)[0])
    return np.asarray(run(params)), np.asarray(logits(params))


QUANT_CONFIGS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
              "sym": False, "checkpoint_format": "gptq"}, _gptq_pack),
    "gptq-random-words": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                           "desc_act": True, "sym": False}, _random_gptq_pack),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
             "version": "gemm"}, _awq_pack),
    **{fmt: ({"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}},
             _ct_pack(fmt)) for fmt, args in CT_SCHEMES.items()},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(QUANT_CONFIGS))
def test_quantized_checkpoint_decodes_like_its_float_model(tmp_path, kind):
    quant_config, pack = QUANT_CONFIGS[kind]
    t, ref = _quantize_linears(_float_checkpoint(7), pack)
    _write(tmp_path, dict(LLAMA, quantization_config=quant_config), t)
    cfg, params = checkpoint.load(tmp_path, mode="mxfp4", dtype="float32")  # mode: float only
    layers = params["layers"]
    matrices = {k: v for k, v in layers.items() if k in MATRICES}
    assert set(matrices) >= {"wo", "w_down"} and len(matrices) >= 4
    for key, w in matrices.items():
        inner = w.matrix if isinstance(w, PermutedMatrix) else w
        assert isinstance(inner, QuantizedArray), key
        assert isinstance(w, PermutedMatrix) == kind.startswith("gptq"), key
    if kind != "gptq-random-words":  # one permutation (or none) per input: fused
        assert "wqkv" in matrices and "w_gate_up" in matrices
    assert isinstance(params["lm_head"], QuantizedArray)           # float, quantized by mode
    assert params["lm_head"].mode == "mxfp4"

    float_params = _manual_common({**t, **ref}, 2)
    for name, key in KEYS.items():
        float_params["layers"][key] = jnp.stack(
            [jnp.asarray(ref[f"model.layers.{i}.{name}.weight"]) for i in range(2)])
    float_params = {k: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), v)
                    for k, v in float_params.items()}
    float_params["lm_head"] = params["lm_head"]
    want_tokens, want_logits = _tokens(cfg, float_params)
    got_tokens, got_logits = _tokens(cfg, params)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # the only difference: float16 / bfloat16 rounding of the reference's weights
    np.testing.assert_allclose(got_logits, want_logits, rtol=0,
                               atol=2e-2 * float(np.abs(want_logits).max()))


def test_unsupported_configs_are_refused(tmp_path):
    t, _ = _quantize_linears(_float_checkpoint(8), _awq_pack)
    bad = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    _write(tmp_path, dict(LLAMA, quantization_config=bad), t)
    with pytest.raises(ValueError, match="GEMM"):
        checkpoint.load(tmp_path)


def test_bf16_model_keeps_float16_gptq_scales(tmp_path):
    """dtype is the activation dtype; the imported scales keep their own dtype."""
    t, _ = _quantize_linears(_float_checkpoint(9), _gptq_pack)
    _write(tmp_path, dict(LLAMA, quantization_config=QUANT_CONFIGS["gptq"][0]), t)
    cfg, params = checkpoint.load(tmp_path)
    wqkv = params["layers"]["wqkv"]
    assert wqkv.matrix.dtype == jnp.bfloat16 and wqkv.matrix.scales.dtype in (jnp.float16,
                                                                              jnp.float32)
    assert wqkv.perm.shape == (2, 64) and wqkv.matrix.shape == (2, 128, 64)
    tokens, logits = _tokens(cfg, params)
    assert tokens.shape == (2, 6) and np.all(np.isfinite(logits))




# ---------------------------------------------------------------------------
# Quantized experts of MoE checkpoints: Qwen3-MoE's (mlp.experts.{e}.{gate,up,down}_proj)
# and Mixtral's (block_sparse_moe.experts.{e}.{w1,w3,w2}).


MOE_QUANT = {
    "gptq-random-words": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                           "desc_act": False, "sym": False},
                          functools.partial(_random_gptq_pack, act_order=False)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
              "sym": False, "checkpoint_format": "gptq"},
             functools.partial(_gptq_pack, act_order=False)),
    "awq": QUANT_CONFIGS["awq"],
    "pack-quantized": QUANT_CONFIGS["pack-quantized"],
    "nvfp4-pack-quantized": QUANT_CONFIGS["nvfp4-pack-quantized"],
}
EXPERT_KEYS = {"gate_proj": "e_gate", "up_proj": "e_up", "down_proj": "e_down"}
# layout: (its expert block's module, expert module -> decoder key, q/k norms)
MOE_LAYOUTS = {"qwen3_moe": ("mlp", EXPERT_KEYS, True),
               "mixtral": ("block_sparse_moe", {"w1": "e_gate", "w3": "e_up", "w2": "e_down"},
                           False)}


def _moe_float(seed, layout="qwen3_moe"):
    """(config.json, tensors) of a tiny float MoE checkpoint in `layout`'s names."""
    from tests.test_models import MIXTRAL, QWEN3_MOE, _rand

    block, names, qk_norm = MOE_LAYOUTS[layout]
    config = QWEN3_MOE if layout == "qwen3_moe" else MIXTRAL
    rng = np.random.default_rng(seed)
    t = _hf_common(rng, config, qk_norm=qk_norm)
    for li in range(2):
        pre = f"model.layers.{li}.{block}."
        t[pre + "gate.weight"] = _rand(rng, 4, 64)
        for e in range(4):
            for name in names:
                t[pre + f"experts.{e}.{name}.weight"] = _rand(rng, 64, 64)
    return config, t


# Mixtral's names through the same importers: one format covers them by default
MOE_CASES = [("qwen3_moe", kind) for kind in MOE_QUANT] + [
    pytest.param("mixtral", kind, marks=() if kind == "pack-quantized" else pytest.mark.full)
    for kind in MOE_QUANT]


@pytest.mark.slow
@pytest.mark.parametrize("layout,kind", MOE_CASES)
def test_quantized_moe_checkpoint_decodes_like_its_float_model(tmp_path, layout, kind):
    """Every expert of a tiny Qwen3-MoE or Mixtral checkpoint packed by the reference
    package (or random GPTQ words): the experts load as one quantized stack [E, N, K]
    per layer, their values the package's dequantization, and the model decodes the
    greedy tokens of the float model built from those values."""
    quant_config, pack = MOE_QUANT[kind]
    block, names, _ = MOE_LAYOUTS[layout]
    config, t = _moe_float(13, layout)
    out, ref = dict(t), {}
    for li in range(2):
        for e in range(4):
            for name in names:
                prefix = f"model.layers.{li}.{block}.experts.{e}.{name}"
                tensors, w = pack(prefix, np.asarray(out.pop(prefix + ".weight"), np.float32))
                out.update(tensors)
                ref[prefix] = np.asarray(w, np.float32)
    _write(tmp_path, dict(config, quantization_config=quant_config), out)
    cfg, params = checkpoint.load(tmp_path, dtype="float32", per_layer=False, fuse=False)
    assert cfg.family == layout
    lay = params["layers"]
    floats = dict(_manual_common(t, 2))
    fl = dict(floats["layers"])
    fl["router"] = jnp.stack([jnp.asarray(t[f"model.layers.{li}.{block}.gate.weight"])
                              for li in range(2)])
    for name, key in names.items():
        w = lay[key]
        assert isinstance(w, QuantizedArray) and w.shape == (2, 4, 64, 64), (key, type(w))
        want = np.stack([np.stack([ref[f"model.layers.{li}.{block}.experts.{e}.{name}"]
                                   for e in range(4)]) for li in range(2)])
        got = np.asarray(jq.dequantize(w, dtype=jnp.float32))
        # the references return their weights in float16 / bfloat16: equal once rounded so
        assert any(np.array_equal(got.astype(dt).astype(np.float32), want)
                   for dt in (np.float32, np.float16, ml_dtypes.bfloat16)), key
        fl[key] = jnp.asarray(want)
    floats["layers"] = fl
    floats = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), floats)
    want_tokens, want_logits = _tokens(cfg, floats)
    got_tokens, got_logits = _tokens(cfg, params)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # the only difference: float16 / bfloat16 rounding of the reference's weights
    np.testing.assert_allclose(got_logits, want_logits, rtol=0,
                               atol=2e-2 * float(np.abs(want_logits).max()))
    # with default arguments: gate and up fused into one quantized stack, the same tokens
    _, fused = checkpoint.load(tmp_path, dtype="float32")
    layers = fused["layers"]
    e_gate_up = (layers[0] if isinstance(layers, tuple) else layers)["e_gate_up"]
    assert isinstance(e_gate_up, QuantizedArray)
    np.testing.assert_array_equal(_tokens(cfg, fused)[0], want_tokens)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_quantized_moe_experts_refused_by_name(tmp_path, layout):
    """Act-order experts (a permutation per expert) and a mix of quantized and float
    experts: a ValueError naming the module, never a silently wrong model."""
    config, t = _moe_float(14, layout)
    block, names, _ = MOE_LAYOUTS[layout]
    down = next(n for n, key in names.items() if key == "e_down")
    out = dict(t)
    prefix = f"model.layers.0.{block}.experts.1.{down}"
    tensors, _ = _random_gptq_pack(prefix, np.asarray(out.pop(prefix + ".weight"), np.float32))
    out.update(tensors)
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    _write(tmp_path, dict(config, quantization_config=cfg), out)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.{block}\.experts.*some experts "
                                         rf"are quantized"):
        checkpoint.load(tmp_path, dtype="float32")
    for e in (0, 2, 3):
        p = f"model.layers.0.{block}.experts.{e}.{down}"
        tensors, _ = _random_gptq_pack(p, np.asarray(out.pop(p + ".weight"), np.float32))
        out.update(tensors)
    _write(tmp_path / "all", dict(config, quantization_config=cfg), out)
    with pytest.raises(ValueError, match="act-order experts"):
        checkpoint.load(tmp_path / "all", dtype="float32")


@pytest.mark.slow
def test_transformers_mixtral_with_compressed_tensors_experts(tmp_path):
    """A tiny Mixtral saved by transformers' save_pretrained, its experts packed by
    compressed-tensors (int4, group 32): loaded as quantized expert stacks, it decodes
    the greedy tokens transformers gives for the same checkpoint with every expert
    replaced by compressed-tensors' dequantization (read back by from_pretrained)."""
    import json

    from safetensors.numpy import load_file, save_file

    torch = pytest.importorskip("torch", reason="torch (CPU) is needed to run transformers")
    transformers = pytest.importorskip("transformers", reason="compares against transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "float")
    (file,) = (tmp_path / "float").glob("*.safetensors")
    tensors = load_file(file)
    experts = sorted(n for n in tensors if ".block_sparse_moe.experts." in n)
    assert len(experts) == 2 * 4 * 3  # layers x experts x {w1, w2, w3}
    packed, dequantized = dict(tensors), dict(tensors)
    for name in experts:
        prefix = name[:-len(".weight")]
        parts, w = _ct_pack("pack-quantized")(prefix, packed.pop(name))
        packed.update(parts)
        dequantized[name] = w
    hf = json.loads((tmp_path / "float" / "config.json").read_text())
    for sub, weights, extra in (
            ("quantized", packed, dict(quantization_config=QUANT_CONFIGS["pack-quantized"][0])),
            ("reference", dequantized, {})):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(dict(hf, **extra)))
        save_file(weights, tmp_path / sub / "model.safetensors")

    prompt = np.arange(12).reshape(2, 6) % 64
    reference = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "reference", dtype=torch.float32).eval()
    with torch.no_grad():
        want_logits = reference(torch.tensor(prompt)).logits.numpy()
        ids = torch.tensor(prompt)
        for _ in range(6):
            step = reference(ids, use_cache=False).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, step[:, None]], 1)
    cfg, params = checkpoint.load(tmp_path / "quantized", dtype="float32")
    assert cfg.family == "mixtral" and cfg.num_experts == 4
    layers = params["layers"]
    layer0 = layers[0] if isinstance(layers, tuple) else jax.tree_util.tree_map(
        lambda a: a[0], layers)
    e_down = layer0["e_down"]
    assert isinstance(e_down, QuantizedArray) and e_down.bits == 4
    # the package's dequantization, bit for bit once rounded to its bfloat16 output
    got = np.asarray(jq.dequantize(e_down, dtype=jnp.float32)).astype(ml_dtypes.bfloat16)
    want = np.stack([dequantized[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"]
                     for e in range(4)]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got, want)
    tokens = jnp.asarray(prompt, jnp.int32)
    with jax.default_matmul_precision("highest"):
        got_logits = np.asarray(models.prefill(cfg, params, tokens, 16)[0])
        got_tokens = np.asarray(models.generate(cfg, params, tokens, 6))
    np.testing.assert_array_equal(got_tokens, ids[:, 6:].numpy())
    # the only difference: the reference's experts are compressed-tensors' bfloat16
    # output (the products rounded), the loaded ones scale * (q - zero) in float32
    assert np.linalg.norm(got_logits - want_logits) / np.linalg.norm(want_logits) < 4e-3
