"""jaxquant.models: the decoder's pieces against plain definitions, and checkpoint
loading from tiny directories written in the exact Hugging Face / MLX on-disk
layout (tensor names and shapes written out here by hand, not by the loader's
own tables).

The GPU tests (marked `gpu`; skipped with the reason without an NVIDIA GPU and jaxquant's
CUDA library): what the defaults give there (per-layer buffers, the cuda_mma layout) runs
the model to the tokens of the stacked, canonical form; jq.prepack of a stacked expert
weight stays within its memory bound."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models
from jaxquant.models import checkpoint, layers, moe
from jaxquant.models.config import MOE_FAMILIES
from jaxquant.models.decoder import moe_mlp
from jaxquant.quantized_array import QuantizedArray
from tests.common import cuda_library

pytest.importorskip("safetensors")

BF16 = ml_dtypes.bfloat16


def tiny(family, **kw):
    moe = family in MOE_FAMILIES
    base = dict(family=family, vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, intermediate_size=128,
                num_experts=4 if moe else 0, experts_per_token=2 if moe else 0,
                moe_intermediate_size=64 if moe else 0, qk_norm=family.startswith("qwen3"),
                attention_bias=family == "gpt_oss",
                layer_windows=(3, 0) if family == "gpt_oss" else ())
    base.update(kw)
    return models.Config(**base)


# ---------------------------------------------------------------------------
# The decoder.


def _prefill_both_ways(cfg, params, prompt, monkeypatch, impl):
    """prefill's logits and cache with the prompt attention the reference op's and `impl`'s
    (layers.PROMPT_ATTENTION for this platform)."""
    # a new function each run: jit's cache does not know PROMPT_ATTENTION
    run = lambda: jax.jit(lambda p, t: models.prefill(cfg, p, t, 24))(params, prompt)
    calls, fused = [], jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **k: calls.append(k["implementation"]) or fused(*a, **k))
    monkeypatch.setattr(layers, "PROMPT_ATTENTION", {})
    want = run()
    assert calls == []
    monkeypatch.setattr(layers, "PROMPT_ATTENTION", {jax.default_backend(): impl})
    got = run()
    assert calls and set(calls) == {impl}, calls   # the layers' prompt attention
    return want, got


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_prompt_attention_equals_the_cache_reading_op(family, monkeypatch):
    """prefill's causal attention over the prompt alone (jax.nn.dot_product_attention, the
    fused kernel's definition; "xla" here, cuDNN on GPUs: tests/test_prefill_gpu.py) gives
    the logits, cache and next token of decode_attention over the cache; gpt-oss's
    sinks through the kernel's logsumexp and its window of 3 keys in every other layer
    (per-layer buffers: each layer's window a Python int)."""
    cfg = tiny(family, dtype="bfloat16")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "affine4",
                                    per_layer=family == "gpt_oss")
    prompt = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    (want, cache_w, tok_w), (got, cache_g, tok_g) = _prefill_both_ways(
        cfg, params, prompt, monkeypatch, "xla")
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05 * scale)
    for a, b in zip(cache_g, cache_w):   # [L, B, S, Hkv, hd]: the first layer's the same
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a, b, atol=0.05 * np.abs(b).max())
    assert (np.asarray(tok_g) == np.asarray(tok_w)).mean() >= 0.5


def test_prompt_attention_applies_where_its_definition_holds(monkeypatch):
    monkeypatch.setattr(layers, "PROMPT_ATTENTION", {jax.default_backend(): "xla"})
    q = jnp.zeros((1, 4, 4, 16), jnp.bfloat16)
    assert layers.prompt_attention_applies(tiny("llama", dtype="bfloat16"), {}, q) == "xla"
    assert layers.prompt_attention_applies(tiny("llama"), {}, q.astype(jnp.float32)) is None
    assert layers.prompt_attention_applies(tiny("llama"), {}, q[:, :1]) is None  # one token
    # sinks (the kernel's logsumexp) and windows known at trace time
    assert layers.prompt_attention_applies(tiny("gpt_oss"), {"sinks": 0}, q, 3) == "xla"
    windows = tiny("llama", layer_windows=(3, 0))
    assert layers.prompt_attention_applies(windows, {}, q, 0) == "xla"
    assert layers.prompt_attention_applies(windows, {}, q, jnp.int32(3)) is None  # a scan's
    same = tiny("llama", layer_windows=(3, 3))  # one window in every layer: static anyway
    assert layers.prompt_attention_applies(same, {}, q, jnp.int32(3)) == "xla"
    assert layers.static_window(same, jnp.int32(3)) == 3
    wo = jnp.zeros((64, 64), jnp.bfloat16)
    assert layers.prompt_attention_applies(tiny("llama", dtype="bfloat16"), {"wo": wo}, q) == "xla"
    monkeypatch.setattr(layers, "on_several_devices", lambda a: True)   # a mesh's weights
    assert layers.prompt_attention_applies(tiny("llama", dtype="bfloat16"), {"wo": wo}, q) is None
    monkeypatch.setattr(layers, "PROMPT_ATTENTION", {})
    assert layers.prompt_attention_applies(tiny("llama"), {}, q) is None


@pytest.mark.parametrize("family,mode", [("llama", "affine4"), ("gpt_oss", "mxfp4")])
def test_decode_matches_full_forward(family, mode):
    """Decoding token by token through the KV cache gives the logits that one
    forward pass over the whole sequence gives (the MoE: gather_qmm in decode,
    ragged_qmm in the full pass; gpt-oss: the sliding window of 3 is crossed)."""
    cfg = tiny(family, dtype="float32")
    params = models.init_params(cfg, jax.random.key(0))
    if mode:
        params = models.quantize_params(params, mode)
    prompt = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    prefill = jax.jit(models.prefill, static_argnums=(0, 3))
    _, cache, tok = prefill(cfg, params, prompt, 24)
    toks, last, _ = jax.jit(models.decode, static_argnums=(0, 5))(cfg, params, cache, tok, 20, 3)
    seq = jnp.concatenate([prompt, tok[:, None], toks[:, :2]], axis=1)
    full, _, _ = prefill(cfg, params, seq, 24)
    np.testing.assert_allclose(last, full[:, -1], rtol=1e-4, atol=1e-4)
    if family == "llama":  # generate: the same tokens from one jitted loop
        gen = jax.jit(models.generate, static_argnums=(0, 3))(cfg, params, prompt, 4)
        np.testing.assert_array_equal(gen, jnp.concatenate([tok[:, None], toks], 1))


@pytest.mark.parametrize("mode", ["nvfp4", "affine4"])
def test_experts_by_layer_changes_nothing(mode):
    """Indexing all layers' experts at once ([L*E, N, K], no per-layer copy) gives
    the logits of the per-layer scan, through ragged_qmm (prefill) and gather_qmm
    (decode); an NVFP4 global scale per layer is spread over its experts."""
    cfg = tiny("gpt_oss", dtype="float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(4)), mode)
    prompt = jax.random.randint(jax.random.key(5), (2, 20), 0, cfg.vocab_size)
    prefill = jax.jit(models.prefill, static_argnums=(0, 3, 4))
    decode = jax.jit(models.decode, static_argnums=(0, 5, 6))
    (la, ca, ta), (lb, cb, tb) = (prefill(cfg, params, prompt, 24, f) for f in (False, True))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)  # another kernel split of K
    (_, da, _), (_, db, _) = (decode(cfg, params, c, t, 20, 2, f)
                              for c, t, f in ((ca, ta, False), (cb, tb, True)))
    np.testing.assert_allclose(da, db, rtol=1e-5, atol=1e-5)


# CI's full matrix (tests/conftest.py): ten to fifteen seconds of CPU per dtype; the
# README's run covers gather_matmul in test_gather_matmul.py and the float-expert decode
# in test_decode_matches_full_forward
@pytest.mark.full
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_experts_decode_logits_unchanged_by_gather_matmul(dtype, monkeypatch):
    """gpt-oss with float (unquantized) experts decodes through jq.gather_matmul (no XLA
    gather of the chosen experts' weights): the decode logits of the gather + einsum it
    replaced, stacked (experts_by_layer on and off) and per-layer."""
    from jaxquant.models import moe

    traced = []

    def gather_einsum(x, w, idx):  # expert_gather's float path before gather_matmul
        traced.append(x.shape)
        ws = w[idx].astype(x.dtype)
        eq = "tk,tsnk->tsn" if x.ndim == 2 else "tsk,tsnk->tsn"
        return jnp.einsum(eq, x, ws, preferred_element_type=jnp.float32).astype(x.dtype)

    cfg = tiny("gpt_oss", dtype=dtype)
    stacked = models.init_params(cfg, jax.random.key(14), per_layer=False)
    prompt = jax.random.randint(jax.random.key(15), (2, 9), 0, cfg.vocab_size)

    def decode_logits(params, experts_by_layer=None):
        jax.clear_caches()  # expert_gather is read when the step is traced
        _, cache, tok = jax.jit(models.prefill, static_argnums=(0, 3, 4))(
            cfg, params, prompt, 16, experts_by_layer)
        _, last, _ = jax.jit(models.decode, static_argnums=(0, 5, 6))(
            cfg, params, cache, tok, 9, 3, experts_by_layer)
        return np.asarray(last, np.float64)

    per_layer = models.unstack_layers(stacked)
    got = [decode_logits(stacked, True), decode_logits(stacked, False),
           decode_logits(per_layer)]
    assert not traced
    monkeypatch.setattr(moe, "expert_gather", gather_einsum)
    want_stacked, want_per_layer = decode_logits(stacked, False), decode_logits(per_layer)
    assert traced  # the swap acts: the steps were traced with the replaced expert_gather
    # float32: another summation order of the same products; bfloat16: bit for bit here
    tol = 1e-5 if dtype == "float32" else 0.0
    for g, want in zip(got, [want_stacked, want_stacked, want_per_layer]):
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's compiled prefill")
def test_cpu_prefill_runs_the_gemm_without_dequantized_weights():
    """The compiled prefill (jit, lax.scan over the layers) on the CPU: every quantized
    projection of the prompt's rows is the ffi's blocked GEMM, and no dequantized weight
    ([N, K] float, or the stack's [L, N, K]) is built (no dequantize, no convert of a
    weight's shape)."""
    import re

    from jaxquant.ffi import configs
    cfg = tiny("llama", dtype="bfloat16", vocab_size=96)  # no weight shares the embedding's
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "mxfp4")
    prompt = jnp.zeros((1, configs.FFI_GEMV_MAX_M["cpu"] + 8), jnp.int32)
    hlo = jax.jit(lambda p, t: models.prefill(cfg, p, t, 32)).lower(params, prompt).compile(
        ).as_text()
    assert "jaxquant_gemm" in hlo and "jaxquant_dequantize" not in hlo
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {(2 * i, d), (d, i), ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, d),
              (d, cfg.num_heads * hd)}
    for n, k in shapes:
        assert not re.search(rf"(?:f32|bf16)\[(?:{cfg.num_layers},)?{n},{k}\]", hlo), (n, k)


def test_float_experts_decode_reads_experts_in_place_on_gpus():
    """The gpt-oss decode step lowered for CUDA (on this CPU machine) with float experts:
    the expert products are the gather_matmul Triton kernel and no XLA gather produces
    an expert weight tile [.., N, K]."""
    import re

    cfg = tiny("gpt_oss", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.key(16), per_layer=True)
    cache = models.init_cache(cfg, 1, 16)
    step = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, 3, 1)[1])
    text = step.trace(params, cache, jnp.zeros((1,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("jq_gather_matmul") >= 2 * cfg.num_layers    # gate_up and down
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    weight_tiles = re.findall(rf'"stablehlo.gather".*-> tensor<[0-9x]*x(?:{2 * i}x{d}|{d}x{i})x',
                              text)
    assert not weight_tiles, weight_tiles


@pytest.mark.parametrize("family,mode", [("llama", None), ("llama", "affine4"),
                                         ("gpt_oss", "mxfp4"), ("qwen3_moe", "affine4")])
def test_fused_matrices_equal_the_separate_ones(family, mode):
    """wqkv / w_gate_up / e_gate_up (rows of the parts one after the other, gate rows
    first) quantize to the parts' own codes and scales, and the model gives the same
    logits with the fused or the separate matrices (to float32 rounding: XLA's CPU
    dot may block K differently for another N; bf16 checkpoints below match bit for
    bit)."""
    cfg = tiny(family, dtype="float32", attention_bias=True)
    fused = models.init_params(cfg, jax.random.key(6))
    separate = models.unfuse_params(cfg, fused)
    assert "wqkv" not in separate["layers"] and "wq" in separate["layers"]
    if mode:
        fused = models.quantize_params(fused, mode)
        separate = models.quantize_params(separate, mode, fuse=False)
        assert "wq" in separate["layers"]
        for key, parts in models.params.FUSED.items():
            if key not in fused["layers"]:
                continue
            for got, want in zip(models.unfuse_params(cfg, fused)["layers"].values(),
                                 separate["layers"].values()):
                for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                    np.testing.assert_array_equal(a, b)
    refused = models.fuse_params(models.unfuse_params(cfg, fused))
    assert jax.tree_util.tree_structure(refused) == jax.tree_util.tree_structure(fused)
    for a, b in zip(jax.tree_util.tree_leaves(refused), jax.tree_util.tree_leaves(fused)):
        np.testing.assert_array_equal(a, b)
    prompt = jax.random.randint(jax.random.key(7), (2, 6), 0, cfg.vocab_size)
    run = jax.jit(lambda p: models.prefill(cfg, p, prompt, 8)[0])
    np.testing.assert_allclose(run(fused), run(separate), rtol=1e-5, atol=1e-5)


def test_nvfp4_parts_with_their_own_global_scales_stay_separate():
    cfg = tiny("llama", dtype="float32")
    separate = models.quantize_params(
        models.unfuse_params(cfg, models.init_params(cfg, jax.random.key(8))), "nvfp4",
        fuse=False)
    assert set(models.fuse_params(separate)["layers"]) == set(separate["layers"])


@pytest.mark.parametrize("family,mode", [("llama", "affine4"),
                                         pytest.param("gpt_oss", "mxfp4", marks=pytest.mark.full),
                                         pytest.param("gpt_oss", None, marks=pytest.mark.full)])
def test_per_layer_buffers_equal_the_stacked_layers(family, mode):
    """Per-layer buffers (a Python loop over layers) and stacked layers (lax.scan):
    the same values from init_params and quantize_params in either form, and the
    same logits and tokens, prefill and decode."""
    cfg = tiny(family, dtype="float32")
    stacked = models.init_params(cfg, jax.random.key(9), per_layer=False)
    split = models.init_params(cfg, jax.random.key(9), per_layer=True)
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == cfg.num_layers
    if mode:
        q_split = models.quantize_params(stacked, mode, per_layer=True)  # straight from a stack
        stacked = models.quantize_params(stacked, mode, per_layer=False)
        split = models.quantize_params(split, mode, per_layer=True)
        assert isinstance(q_split["layers"], tuple)
        for a, b in zip(jax.tree_util.tree_leaves(q_split), jax.tree_util.tree_leaves(split)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(models.unstack_layers(stacked)),
                    jax.tree_util.tree_leaves(split)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(models.stack_layers(split)),
                    jax.tree_util.tree_leaves(stacked)):
        np.testing.assert_array_equal(a, b)
    prompt = jax.random.randint(jax.random.key(10), (1, 12), 0, cfg.vocab_size)
    gen = jax.jit(models.generate, static_argnums=(0, 3))
    logits = jax.jit(models.prefill, static_argnums=(0, 3))
    np.testing.assert_allclose(logits(cfg, split, prompt, 16)[0],
                               logits(cfg, stacked, prompt, 16)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gen(cfg, split, prompt, 3), gen(cfg, stacked, prompt, 3))
    with pytest.raises(ValueError, match="layers"):
        models.prefill(cfg, dict(split, layers=split["layers"][:1]), prompt, 16)


@pytest.mark.parametrize("family,mode", [("llama", "affine4"),
                                         pytest.param("gpt_oss", "mxfp4", marks=pytest.mark.full),
                                         pytest.param("llama", None, marks=pytest.mark.full)])
def test_a8_params_prefill(family, mode):
    """models.a8_params (docs/a8.md): the dense matrices become RowQuantizedArrays (the
    experts, router and embedding stay), stacked and per-layer alike, layer by layer
    equal to jq.quantize_rows of the matrix; the prefill's logits stay near the
    original params' and its cache decodes with the original params."""
    cfg = tiny(family, dtype="float32")
    params = models.init_params(cfg, jax.random.key(4), per_layer=False)
    if mode:
        params = models.quantize_params(params, mode, per_layer=False)
    prompt = jax.random.randint(jax.random.key(5), (1, 12), 0, cfg.vocab_size)
    prefill = jax.jit(models.prefill, static_argnums=(0, 3))
    want, _, _ = prefill(cfg, params, prompt, 16)
    for dtype, tol in (("int8", 0.03), ("float8_e4m3fn", 0.12)):
        a8 = models.a8_params(params, dtype)
        layers = a8["layers"]
        assert isinstance(a8["lm_head"], jq.RowQuantizedArray)
        for k, v in layers.items():
            dense = k in ("wqkv", "wo", "w_gate_up", "w_down")
            assert isinstance(v, jq.RowQuantizedArray) == dense, k
            if dense:
                # jitted as a8_params is (the affine dequantize's float32 s * q + b
                # contracts to one FMA under jit, not op by op)
                one = jax.jit(jq.quantize_rows, static_argnums=1)(params["layers"][k][1], dtype)
                np.testing.assert_array_equal(v.codes[1].astype(jnp.float32),
                                              one.codes.astype(jnp.float32))
                np.testing.assert_array_equal(v.scales[1], one.scales)
            else:
                assert v is params["layers"][k], k
        logits, cache, tok = prefill(cfg, a8, prompt, 16)
        # at the last position, as bench model's Δlogits (at another position of the
        # MoE model a routing choice flips under 8-bit q/k/v)
        err = float(jnp.max(jnp.abs(logits[:, -1] - want[:, -1])) / jnp.max(jnp.abs(want[:, -1])))
        assert 0 < err < tol, (dtype, err)
        split, _, _ = prefill(cfg, models.a8_params(models.unstack_layers(params), dtype),
                              prompt, 16)
        np.testing.assert_allclose(split, logits, rtol=1e-5, atol=1e-5)
        toks, _, _ = jax.jit(models.decode, static_argnums=(0, 5))(cfg, params, cache, tok,
                                                                   12, 3)
        assert toks.shape == (1, 3)


def test_defaults_follow_the_device():
    from jaxquant.models.decoder import resolve_experts_by_layer
    from jaxquant.models.params import default_per_layer
    assert default_per_layer() == (jax.default_backend() != "cpu")
    cfg = tiny("gpt_oss")
    params = models.init_params(cfg, jax.random.key(11))
    assert models.params.is_per_layer(params) == default_per_layer()
    layers = models.init_params(cfg, jax.random.key(11), per_layer=False)["layers"]
    assert resolve_experts_by_layer(cfg, layers, None)  # float experts: gather_matmul
    assert not resolve_experts_by_layer(cfg, layers, False)
    q = models.quantize_params(params, "mxfp4", per_layer=False)["layers"]
    assert resolve_experts_by_layer(cfg, q, None)  # quantized, stacked, one device
    assert not resolve_experts_by_layer(cfg, q, False)
    assert resolve_experts_by_layer(cfg, layers, True)
    split = models.quantize_params(params, "mxfp4", per_layer=True)["layers"]
    assert not resolve_experts_by_layer(cfg, split, True)  # each layer's experts its own
    # placed on several devices: tests/sharding_cases.py (model_gpt_oss) checks it is off


def test_norm_linear_and_swiglu_linear():
    from jaxquant.models.layers import norm_linear, swiglu_linear
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    w = (0.3 * rng.standard_normal((96, 64))).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * nw
    np.testing.assert_allclose(norm_linear(x, nw, w, 1e-5, bias), xn @ w.T + bias,
                               rtol=1e-4, atol=1e-4)
    qw = jq.quantize(w, mode="mxfp4")
    np.testing.assert_allclose(norm_linear(x, nw, qw, 1e-5),
                               xn @ np.asarray(jq.dequantize(qw), np.float64).T,
                               rtol=1e-4, atol=1e-4)
    gu = x.astype(np.float64) @ w.T * 4 + bias  # large enough to reach gpt-oss's clamp
    g, u = gu[:, :48], gu[:, 48:]
    silu = g / (1 + np.exp(-g)) * u
    gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    oss = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
    assert np.abs(g).max() > 7 and np.abs(u).max() > 7
    for kind, want in (("silu", silu), ("gpt_oss", oss)):
        got = swiglu_linear(x, 4 * w, bias, kind=kind)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="kind"):
        swiglu_linear(x, w, kind="gelu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_residuals_in_the_products_change_no_value(dtype, monkeypatch):
    """A quantized dense layer adds its residuals in its products (decoder.fuses_residuals:
    jq.qmm_add, jq.rms_norm_qmm_swiglu) with the same values as add_rms_norm, qmm_swiglu
    and the add apart: prefill and decode logits equal bit for bit; float weights, biased
    projections and MoE layers keep the ops apart."""
    from jaxquant.models import decoder
    cfg = tiny("llama", dtype=dtype)
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "affine4")
    prompt = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)

    def run():
        _, cache, tok = jax.jit(models.prefill, static_argnums=(0, 3))(cfg, params, prompt, 9)
        toks, last, _ = jax.jit(models.decode, static_argnums=(0, 5))(cfg, params, cache, tok,
                                                                       6, 3)
        return np.asarray(toks), np.asarray(last.astype(jnp.float32))

    jaxpr = str(jax.make_jaxpr(lambda p, t: models.forward(
        cfg, p, t, jnp.zeros_like(t), models.init_cache(cfg, 2, 4)))(params, prompt[:, :1]))
    assert "jaxquant_qmm_add" in jaxpr and "jaxquant_rms_norm_qmm_swiglu" in jaxpr
    assert "jaxquant_add_rms_norm" not in jaxpr
    fused = run()
    monkeypatch.setattr(decoder, "fuses_residuals", lambda cfg, p: False)
    unfused = run()
    np.testing.assert_array_equal(fused[0], unfused[0])
    np.testing.assert_array_equal(fused[1], unfused[1])
    layer = {k: v[0] for k, v in params["layers"].items()}
    monkeypatch.undo()
    assert decoder.fuses_residuals(cfg, layer)
    assert not decoder.fuses_residuals(cfg, dict(layer, bo=jnp.zeros(64)))
    assert not decoder.fuses_residuals(cfg, dict(layer, wo=jq.dequantize(layer["wo"])))
    assert not decoder.fuses_residuals(tiny("gpt_oss"), layer)


def test_quantize_params_layout():
    """Kernel-ready by default: the default device's layout (canonical on a CPU);
    a named layout prepacks every quantized matrix, the model's logits unchanged."""
    cfg = tiny("gpt_oss", dtype="float32")
    params = models.init_params(cfg, jax.random.key(13))
    canonical = models.quantize_params(params, "mxfp4", layout="canonical")
    default = models.quantize_params(params, "mxfp4")
    want_layout = jq.layouts.default_layout(canonical["layers"]["wqkv"])
    packed = models.quantize_params(params, "mxfp4", layout="cuda_mma")
    for p, layout in ((canonical, "canonical"), (default, want_layout), (packed, "cuda_mma")):
        quantized = [a for a in jax.tree_util.tree_leaves(
            p, is_leaf=lambda a: isinstance(a, QuantizedArray)) if isinstance(a, QuantizedArray)]
        assert len(quantized) == 5 and {a.layout for a in quantized} == {layout}
    assert isinstance(packed["lm_head"], QuantizedArray) and not isinstance(
        packed["embed"], QuantizedArray)
    back = models.prepack_params(packed, "canonical")
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(canonical)):
        np.testing.assert_array_equal(a, b)
    prompt = jax.random.randint(jax.random.key(14), (1, 6), 0, cfg.vocab_size)
    run = jax.jit(lambda p: models.prefill(cfg, p, prompt, 8)[0])
    np.testing.assert_allclose(run(packed), run(canonical), rtol=1e-5, atol=1e-5)


def _moe_naive(cfg, p, x):
    """Per token, per chosen expert, dense float64 matmuls."""
    x = np.asarray(x, np.float64)
    w = {k: (np.asarray(jq.dequantize(v, jnp.float32), np.float64)
             if isinstance(v, QuantizedArray) else np.asarray(v, np.float64))
         for k, v in p.items()}
    logits = x @ w["router"].T + w.get("router_bias", 0)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if cfg.family == "gpt_oss":
            idx = np.argsort(-logits[t], kind="stable")[:cfg.experts_per_token]
            wt = np.exp(logits[t, idx] - logits[t, idx].max())
            wt /= wt.sum()
        else:
            pr = np.exp(logits[t] - logits[t].max())
            pr /= pr.sum()
            idx = np.argsort(-pr, kind="stable")[:cfg.experts_per_token]
            wt = pr[idx] / pr[idx].sum()
        for e, c in zip(idx, wt):
            if "e_gate_up" in w:  # gate rows, then up rows
                gu = w["e_gate_up"][e] @ x[t]
                gu = gu + w["e_gate_up_bias"][e] if "e_gate_up_bias" in w else gu
                g, u = np.split(gu, 2)
            else:
                g, u = w["e_gate"][e] @ x[t], w["e_up"][e] @ x[t]
            if cfg.family == "gpt_oss":
                g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                h = (u + 1) * g / (1 + np.exp(-1.702 * g))
                y = w["e_down"][e] @ h + w["e_down_bias"][e]
            else:
                y = w["e_down"][e] @ (g / (1 + np.exp(-g)) * u)
            out[t] += c * y
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("tokens", [3, 40])  # 3: gather_qmm; 40 (80 pairs): ragged_qmm
def test_moe_against_naive(family, tokens):
    cfg = tiny(family, dtype="float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(2)), "mxfp4")
    p = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
    x = jax.random.normal(jax.random.key(3), (tokens, cfg.hidden_size), jnp.float32)
    got = jax.jit(lambda p, x: moe_mlp(cfg, p, x))(p, x)
    want = _moe_naive(cfg, p, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("by", ["sort", "count"])
def test_expert_order_is_the_stable_argsort(by):
    """Both orderings of the MoE prefill's pairs (the CPU's argsort, the GPUs' counting
    sort) against NumPy's stable argsort, the inverse and the group sizes; uneven, empty
    and all-in-one experts, other devices' pairs (id num_experts), one pair."""
    rng = np.random.default_rng(7)
    cases = [rng.integers(0, 9, 300), rng.integers(0, 33, 2048), np.full(50, 3),
             np.full(20, 8), np.array([2]), rng.choice([0, 8], 64), rng.integers(0, 2, 17)]
    for flat, e in zip(cases, [8, 32, 8, 8, 8, 8, 1]):
        order, back, sizes = moe.expert_order(jnp.asarray(flat, jnp.int32), e, by)
        want = np.argsort(flat, kind="stable")
        np.testing.assert_array_equal(order, want)
        np.testing.assert_array_equal(np.asarray(back)[want], np.arange(flat.size))
        np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=e + 1)[:e])
        assert sizes.dtype == jnp.int32
    with pytest.raises(ValueError, match="by"):
        moe.expert_order(jnp.zeros(4, jnp.int32), 2, "radix")


def test_moe_prefill_with_the_counting_sort(monkeypatch):
    """The MoE prefill on the GPUs' ordering (a counting sort), run here on the CPU."""
    count = functools.partial(moe.expert_order, by="count")
    monkeypatch.setattr(moe, "expert_order", count)
    cfg = tiny("gpt_oss", dtype="float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(2)), "mxfp4")
    p = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
    x = jax.random.normal(jax.random.key(3), (40, cfg.hidden_size), jnp.float32)
    got = jax.jit(lambda p, x: moe_mlp(cfg, p, x))(p, x)
    want = _moe_naive(cfg, p, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_config_errors():
    with pytest.raises(ValueError, match="family"):
        models.Config(family="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        models.Config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_experts"):
        models.Config(family="qwen3_moe")
    with pytest.raises(ValueError, match="model_type"):
        models.from_hf({"model_type": "bert"})
    with pytest.raises(ValueError, match="rope_scaling"):
        tiny("llama", rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0))).rope_inv_freq()


def test_rope_scaling_matches_transformers_formulas():
    # llama3 (Llama 3.1's numbers): high frequencies kept, low ones divided by factor
    cfg = tiny("llama", head_dim=128, rope_theta=500000.0, rope_scaling=tuple(sorted(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.items())))
    inv, att = cfg.rope_inv_freq()
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    assert att == 1.0 and inv[0] == base[0] and np.isclose(inv[-1], base[-1] / 8)
    # yarn (gpt-oss's numbers): attention factor 0.1 ln(32) + 1
    cfg = tiny("gpt_oss", head_dim=64, rope_theta=150000.0, rope_scaling=tuple(sorted(
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "original_max_position_embeddings": 4096, "truncate": False}.items())))
    inv, att = cfg.rope_inv_freq()
    base = 1.0 / 150000.0 ** (np.arange(0, 64, 2) / 64)
    assert np.isclose(att, 0.1 * np.log(32) + 1)
    assert np.isclose(inv[0], base[0]) and np.isclose(inv[-1], base[-1] / 32)


# ---------------------------------------------------------------------------
# Checkpoints.


def _write(path, config, tensors, shards=2):
    """config.json + the tensors split over `shards` safetensors files."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        jq.io.save_safetensors(path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", part)


def _rand(rng, *shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(BF16)


def _dense_mlps(rng, t):
    """LLAMA's two layers' SwiGLU MLP weights (hidden 64, intermediate 128) into t."""
    for i in range(2):
        pre = f"model.layers.{i}.mlp."
        t[pre + "gate_proj.weight"] = _rand(rng, 128, 64)
        t[pre + "up_proj.weight"] = _rand(rng, 128, 64)
        t[pre + "down_proj.weight"] = _rand(rng, 64, 128)


def _hf_common(rng, cfg_hf, attn_bias=False, qk_norm=False):
    d, v = cfg_hf["hidden_size"], cfg_hf["vocab_size"]
    hq, hkv, hd = (cfg_hf["num_attention_heads"], cfg_hf["num_key_value_heads"],
                   cfg_hf["head_dim"])
    t = {"model.embed_tokens.weight": _rand(rng, v, d, scale=1.0),
         "model.norm.weight": (1 + _rand(rng, d)).astype(BF16),
         "lm_head.weight": _rand(rng, v, d)}
    for i in range(cfg_hf["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = (1 + _rand(rng, d)).astype(BF16)
        t[pre + "post_attention_layernorm.weight"] = (1 + _rand(rng, d)).astype(BF16)
        for name, n in (("q_proj", hq * hd), ("k_proj", hkv * hd), ("v_proj", hkv * hd)):
            t[pre + f"self_attn.{name}.weight"] = _rand(rng, n, d)
            if attn_bias:
                t[pre + f"self_attn.{name}.bias"] = _rand(rng, n)
        t[pre + "self_attn.o_proj.weight"] = _rand(rng, d, hq * hd)
        if attn_bias:
            t[pre + "self_attn.o_proj.bias"] = _rand(rng, d)
        if qk_norm:
            t[pre + "self_attn.q_norm.weight"] = (1 + _rand(rng, hd)).astype(BF16)
            t[pre + "self_attn.k_norm.weight"] = (1 + _rand(rng, hd)).astype(BF16)
    return t


LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False}


def _stack(tensors, fmt, n):
    return jnp.stack([jnp.asarray(tensors[fmt.format(i)]) for i in range(n)])


def _manual_common(t, n):
    """The decoder's parameter dict, from HF names written out by hand."""
    lay = {"attn_norm": _stack(t, "model.layers.{}.input_layernorm.weight", n),
           "mlp_norm": _stack(t, "model.layers.{}.post_attention_layernorm.weight", n)}
    for key, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        lay[key] = _stack(t, f"model.layers.{{}}.self_attn.{name}.weight", n)
        if f"model.layers.0.self_attn.{name}.bias" in t:
            lay["b" + key[1]] = _stack(t, f"model.layers.{{}}.self_attn.{name}.bias", n)
    if "model.layers.0.self_attn.q_norm.weight" in t:
        lay["q_norm"] = _stack(t, "model.layers.{}.self_attn.q_norm.weight", n)
        lay["k_norm"] = _stack(t, "model.layers.{}.self_attn.k_norm.weight", n)
    return {"embed": jnp.asarray(t["model.embed_tokens.weight"]),
            "final_norm": jnp.asarray(t["model.norm.weight"]),
            "lm_head": jnp.asarray(t["lm_head.weight"]), "layers": lay}


def _logits(cfg, params):
    prompt = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size
    return jax.jit(lambda p: models.prefill(cfg, p, prompt, 8)[0])(params)


def test_llama_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    _write(tmp_path, LLAMA, t)
    cfg, params = checkpoint.load(tmp_path)
    assert cfg.family == "llama" and cfg.num_layers == 2 and cfg.rms_eps == 1e-5
    manual = _manual_common(t, 2)
    for key, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        manual["layers"][key] = _stack(t, f"model.layers.{{}}.mlp.{name}.weight", 2)
    want = _logits(cfg, manual)  # the separate q/k/v and gate/up run as they are
    fused = manual["layers"]  # on load: q, k, v rows one after the other; gate, then up
    np.testing.assert_array_equal(params["layers"]["wqkv"], jnp.concatenate(
        [fused["wq"], fused["wk"], fused["wv"]], axis=1))
    np.testing.assert_array_equal(params["layers"]["w_gate_up"], jnp.concatenate(
        [fused["w_gate"], fused["w_up"]], axis=1))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        models.fuse_params(manual))
    np.testing.assert_array_equal(_logits(cfg, params), want)
    cfg, separate = checkpoint.load(tmp_path, fuse=False)
    np.testing.assert_array_equal(_logits(cfg, separate), want)

    # quantized on load: each layer's matrix exactly as jq.quantize makes it, the
    # fused q/k/v's rows the three matrices' own codes and scales
    cfg, q = checkpoint.load(tmp_path, mode="affine4")
    wqkv = q["layers"]["wqkv"]
    assert isinstance(wqkv, QuantizedArray) and (wqkv.mode, wqkv.bits, wqkv.group_size) == (
        "affine", 4, 64)
    for name, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)),
                       ("v_proj", slice(96, 128))):
        one = jq.quantize(jnp.asarray(t[f"model.layers.1.self_attn.{name}.weight"]),
                          mode="affine", bits=4, group_size=64)
        for c in ("data", "scales", "biases"):
            np.testing.assert_array_equal(getattr(wqkv, c)[1][rows], getattr(one, c))
    assert isinstance(q["lm_head"], QuantizedArray)
    assert not isinstance(q["embed"], QuantizedArray)
    assert models.weight_bytes(q) < models.weight_bytes(params) / 2
    got = _logits(cfg, q)
    assert float(jnp.max(jnp.abs(got - want))) < 0.25 * float(jnp.max(jnp.abs(want)))

    with pytest.raises(ValueError, match="mode"):
        checkpoint.load(tmp_path, mode="int3")


GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 64, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 3, "rms_norm_eps": 1e-5,
           "rope_theta": 150000.0, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "layer_types": ["sliding_attention", "full_attention"],
           "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                            "truncate": False},
           "quantization_config": {"quant_method": "mxfp4"}}


def _gpt_oss_tensors(rng):
    t = _hf_common(rng, GPT_OSS, attn_bias=True)
    e, d, i = 4, 64, 64
    for li in range(2):
        pre = f"model.layers.{li}."
        t[pre + "self_attn.sinks"] = _rand(rng, 4, scale=1.0)
        t[pre + "mlp.router.weight"] = _rand(rng, e, d)
        t[pre + "mlp.router.bias"] = _rand(rng, e)
        x = pre + "mlp.experts."
        t[x + "gate_up_proj_blocks"] = rng.integers(0, 256, (e, 2 * i, d // 32, 16), np.uint8)
        t[x + "gate_up_proj_scales"] = rng.integers(118, 124, (e, 2 * i, d // 32), np.uint8)
        t[x + "gate_up_proj_bias"] = _rand(rng, e, 2 * i)
        t[x + "down_proj_blocks"] = rng.integers(0, 256, (e, d, i // 32, 16), np.uint8)
        t[x + "down_proj_scales"] = rng.integers(118, 124, (e, d, i // 32), np.uint8)
        t[x + "down_proj_bias"] = _rand(rng, e, d)
    return t


@pytest.mark.parametrize("mode", [None, "affine4"])
def test_gpt_oss_checkpoint_keeps_mxfp4_experts(tmp_path, mode):
    rng = np.random.default_rng(1)
    t = _gpt_oss_tensors(rng)
    _write(tmp_path, GPT_OSS, t)
    cfg, params = checkpoint.load(tmp_path, mode=mode)
    assert cfg.family == "gpt_oss" and cfg.layer_windows == (3, 0) and cfg.num_experts == 4
    lay = params["layers"]
    # gate_up's rows interleaved gate, up, ... in the checkpoint: gate rows first on load
    halves = np.concatenate([np.arange(0, 128, 2), np.arange(1, 128, 2)])
    for key, name, rows in (("e_gate_up", "gate_up_proj", halves),
                            ("e_down", "down_proj", np.arange(64))):
        qw = lay[key]
        assert qw.mode == "mxfp4"  # never requantized, whatever `mode` asks of the rest
        for li in range(2):
            blocks, scales = jq.io.to_gpt_oss(qw[li])
            x = f"model.layers.{li}.mlp.experts.{name}"
            np.testing.assert_array_equal(blocks, t[x + "_blocks"][:, rows])
            np.testing.assert_array_equal(scales, t[x + "_scales"][:, rows])
    np.testing.assert_array_equal(
        lay["e_gate_up_bias"][1], t["model.layers.1.mlp.experts.gate_up_proj_bias"][:, halves])
    assert isinstance(lay["wqkv"], QuantizedArray) == (mode is not None)
    if mode is None:
        manual = _manual_common(t, 2)
        ml = manual["layers"]
        ml["sinks"] = _stack(t, "model.layers.{}.self_attn.sinks", 2)
        ml["router"] = _stack(t, "model.layers.{}.mlp.router.weight", 2)
        ml["router_bias"] = _stack(t, "model.layers.{}.mlp.router.bias", 2)
        ml["e_gate_up_bias"] = _stack(t, "model.layers.{}.mlp.experts.gate_up_proj_bias",
                                      2)[..., halves]
        ml["e_down_bias"] = _stack(t, "model.layers.{}.mlp.experts.down_proj_bias", 2)
        for key, name, rows in (("e_gate_up", "gate_up_proj", halves),
                                ("e_down", "down_proj", np.arange(64))):
            parts = [jq.io.from_gpt_oss(
                t[f"model.layers.{li}.mlp.experts.{name}_blocks"][:, rows],
                t[f"model.layers.{li}.mlp.experts.{name}_scales"][:, rows]) for li in range(2)]
            ml[key] = jax.tree_util.tree_map(lambda *c: jnp.stack(c), *parts)
        np.testing.assert_array_equal(_logits(cfg, params), _logits(cfg, manual))


QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 64,
             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}


def test_qwen3_moe_checkpoint(tmp_path):
    rng = np.random.default_rng(2)
    t = _hf_common(rng, QWEN3_MOE, qk_norm=True)
    for li in range(2):
        pre = f"model.layers.{li}.mlp."
        t[pre + "gate.weight"] = _rand(rng, 4, 64)
        for e in range(4):
            t[pre + f"experts.{e}.gate_proj.weight"] = _rand(rng, 64, 64)
            t[pre + f"experts.{e}.up_proj.weight"] = _rand(rng, 64, 64)
            t[pre + f"experts.{e}.down_proj.weight"] = _rand(rng, 64, 64)
    _write(tmp_path, QWEN3_MOE, t, shards=3)
    cfg, params = checkpoint.load(tmp_path)
    manual = _manual_common(t, 2)
    ml = manual["layers"]
    ml["router"] = _stack(t, "model.layers.{}.mlp.gate.weight", 2)
    for key, name in (("e_gate", "gate_proj"), ("e_up", "up_proj"), ("e_down", "down_proj")):
        ml[key] = jnp.stack([jnp.stack([jnp.asarray(
            t[f"model.layers.{li}.mlp.experts.{e}.{name}.weight"]) for e in range(4)])
            for li in range(2)])
    np.testing.assert_array_equal(_logits(cfg, params), _logits(cfg, manual))
    cfg, q = checkpoint.load(tmp_path, mode="mxfp4")
    assert q["layers"]["e_down"].mode == "mxfp4" and q["layers"]["e_down"].shape == (
        2, 4, 64, 64)


MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 64, "num_local_experts": 4,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
           "sliding_window": None, "tie_word_embeddings": False}
MIXTRAL_EXPERTS = {"e_gate": ("w1", "gate_proj"), "e_up": ("w3", "up_proj"),
                   "e_down": ("w2", "down_proj")}


def _mixtral_tensors(rng):
    """A tiny float Mixtral checkpoint's tensors (MIXTRAL's config)."""
    t = _hf_common(rng, MIXTRAL)
    for li in range(2):
        pre = f"model.layers.{li}.block_sparse_moe."
        t[pre + "gate.weight"] = _rand(rng, 4, 64)
        for e in range(4):
            for name, _ in MIXTRAL_EXPERTS.values():
                t[pre + f"experts.{e}.{name}.weight"] = _rand(rng, 64, 64)
    return t


@pytest.mark.parametrize("stacked", [False, True])
def test_mixtral_checkpoint(tmp_path, stacked):
    """Mixtral's names: block_sparse_moe.gate (the router) and experts.{e}.{w1, w3, w2}
    (gate, up, down), or mlx-lm's stacked block_sparse_moe.switch_mlp.{gate,up,down}_proj,
    4-bit here, with the router quantized too (8 bits, a per-module override, as mlx-lm
    writes Qwen3-MoE's; it loads dequantized): the same logits as the parameters
    written out by hand."""
    rng = np.random.default_rng(5)
    t = _hf_common(rng, MIXTRAL)
    manual = _manual_common(t, 2)
    ml = manual["layers"]
    stacks, routers = {key: [] for key in MIXTRAL_EXPERTS}, []
    for li in range(2):
        pre = f"model.layers.{li}.block_sparse_moe."
        t[pre + "gate.weight"] = _rand(rng, 4, 64)
        if stacked:
            qr = jq.quantize(jnp.asarray(t.pop(pre + "gate.weight"), jnp.float32),
                             mode="affine", bits=8, group_size=32)
            t.update(jq.io.to_mlx_tensors(qr, pre + "gate"))
            routers.append(jq.dequantize(qr, dtype=jnp.float32))
        else:
            routers.append(jnp.asarray(t[pre + "gate.weight"]))
        for key, (name, switch) in MIXTRAL_EXPERTS.items():
            w = np.stack([_rand(rng, 64, 64) for _ in range(4)])
            if stacked:
                qw = jq.quantize(jnp.asarray(w, jnp.float32), mode="affine", bits=4,
                                 group_size=32)
                t.update(jq.io.to_mlx_tensors(qw, pre + "switch_mlp." + switch))
                stacks[key].append(qw)
            else:
                t.update({pre + f"experts.{e}.{name}.weight": w[e] for e in range(4)})
                stacks[key].append(jnp.asarray(w))
    ml["router"] = jnp.stack(routers)
    for key, parts in stacks.items():
        ml[key] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *parts)
    mlx = {"group_size": 32, "bits": 4, **{
        f"model.layers.{li}.block_sparse_moe.gate": {"group_size": 32, "bits": 8}
        for li in range(2)}}
    config = dict(MIXTRAL, quantization=mlx) if stacked else MIXTRAL
    _write(tmp_path, config, t)
    cfg, params = checkpoint.load(tmp_path, fuse=False, per_layer=False)
    assert cfg.family == "mixtral" and cfg.moe_intermediate_size == 64
    assert isinstance(params["layers"]["e_down"], QuantizedArray) == stacked
    np.testing.assert_array_equal(_logits(cfg, params), _logits(cfg, manual))


def test_mlx_checkpoint(tmp_path):
    """An mlx-lm 4-bit checkpoint: every linear and the embedding quantized
    (`.weight` uint32, `.scales`, `.biases`), lm_head overridden to 8 bits."""
    rng = np.random.default_rng(3)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    special = "lm_head"
    quantized, mlx = {}, {}
    for name in list(t):
        prefix = name[:-len(".weight")]
        if name.endswith(".weight") and t[name].ndim == 2:
            bits = 8 if prefix == special else 4
            qw = jq.quantize(jnp.asarray(t[name]), mode="affine", bits=bits, group_size=64)
            quantized[prefix] = qw
            mlx.update(jq.io.to_mlx_tensors(qw, prefix))
        else:
            mlx[name] = t[name]
    config = dict(LLAMA, quantization={"group_size": 64, "bits": 4,
                                       special: {"group_size": 64, "bits": 8}})
    _write(tmp_path, config, mlx)
    cfg, params = checkpoint.load(tmp_path, mode="mxfp4")  # mode leaves MLX weights alone
    assert isinstance(params["embed"], QuantizedArray)
    for prefix, key, li, rows in (("model.layers.0.self_attn.q_proj", "wqkv", 0, slice(0, 64)),
                                  ("model.layers.1.mlp.up_proj", "w_gate_up", 1,
                                   slice(128, 256))):
        got, want = params["layers"][key][li], quantized[prefix]  # fused on load
        assert (got.mode, got.bits) == (want.mode, want.bits)
        for c in ("data", "scales", "biases"):
            np.testing.assert_array_equal(getattr(got, c)[rows], getattr(want, c))
    assert params["lm_head"].bits == 8
    np.testing.assert_array_equal(params["lm_head"].data, quantized["lm_head"].data)
    logits = _logits(cfg, params)
    assert logits.shape == (2, 6, 64) and bool(jnp.all(jnp.isfinite(logits)))

    # one layer's matrix at other bits than the same matrix elsewhere cannot stack
    odd = "model.layers.1.mlp.down_proj"
    bad = dict(config["quantization"], **{odd: {"group_size": 64, "bits": 8}})
    mlx.update(jq.io.to_mlx_tensors(jq.quantize(jnp.asarray(t[odd + ".weight"]), mode="affine",
                                                bits=8, group_size=64), odd))
    _write(tmp_path / "mixed", dict(config, quantization=bad), mlx)
    with pytest.raises(ValueError, match="w_down"):  # stacked: one format per matrix
        checkpoint.load(tmp_path / "mixed", per_layer=False)
    cfg, mixed = checkpoint.load(tmp_path / "mixed", per_layer=True)  # per layer: any
    assert [lay["w_down"].bits for lay in mixed["layers"]] == [4, 8]
    logits = _logits(cfg, mixed)
    assert logits.shape == (2, 6, 64) and bool(jnp.all(jnp.isfinite(logits)))
    # default arguments on any device: the mixed model loads per layer by itself
    _, default = checkpoint.load(tmp_path / "mixed")
    assert models.params.is_per_layer(default)
    assert [lay["w_down"].bits for lay in default["layers"]] == [4, 8]
    np.testing.assert_array_equal(_logits(cfg, default), logits)
    assert models.params.mixed_formats(default["layers"]) == {
        "w_down": ["('affine', 4, 64, 'canonical')", "('affine', 8, 64, 'canonical')"]}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_float_gemv_is_linears_product_and_its_rule(dtype, monkeypatch):
    """layers.float_gemv (a float matrix as gather_matmul's one expert) computes
    linear's einsum (same float32 sums, one rounding), for x [B, 1, K] and [K]; the rule
    takes decode rows of mid-sized matrices on a GPU only."""
    from jaxquant.models import layers

    w = jax.random.normal(jax.random.key(0), (300, 72), jnp.float32).astype(dtype)  # any shape
    for shape in [(3, 1, 72), (72,), (2, 2, 72)]:
        x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
        want = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
        got = jax.jit(layers.float_gemv)(x, w)
        assert got.shape == shape[:-1] + (300,) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(dtype),
                                   np.float32), rtol=float(jnp.finfo(dtype).eps), atol=1e-5)
    x1 = jnp.ones((1, 1, 4096), dtype)
    assert not layers.float_gemv_applies(x1, jnp.ones((6144, 4096)))       # the CPU: never
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert layers.float_gemv_applies(x1, jnp.ones((6144, 4096)))           # q/k/v
    assert layers.float_gemv_applies(jnp.ones((1, 2880)), jnp.ones((5120, 2880)))
    # a batch: XLA's dot, which reads the matrix once for every row
    assert not layers.float_gemv_applies(jnp.ones((2, 1, 2880)), jnp.ones((5120, 2880)))
    assert not layers.float_gemv_applies(jnp.ones((8, 1, 2880)), jnp.ones((5120, 2880)))
    assert not layers.float_gemv_applies(jnp.ones((1, 14336)), jnp.ones((4096, 14336)))
    assert not layers.float_gemv_applies(jnp.ones((1, 2880)), jnp.ones((32, 2880)))
    assert not layers.float_gemv_applies(jnp.ones((1, 4096)), jnp.ones((2880, 4096)))  # o
    assert not layers.float_gemv_applies(jnp.ones((1, 2880)), jnp.ones((201088, 16)))


def test_family_traits_are_fields_a_config_may_set():
    """A Config field left None takes its family's trait; one set explicitly wins, and the
    decoder follows it (sinks drawn and used for a dense llama; gpt-oss's router and
    activation on a qwen3_moe)."""
    from jaxquant.models.config import FAMILY_TRAITS

    for family in FAMILY_TRAITS:
        cfg = tiny(family)
        assert {k: getattr(cfg, k) for k in FAMILY_TRAITS[family]} == FAMILY_TRAITS[family]
    assert tiny("gpt_oss") == tiny("gpt_oss", mlp_activation="gpt_oss", moe_bias=True)
    with pytest.raises(ValueError, match="mlp_activation"):
        tiny("llama", mlp_activation="gelu")
    with pytest.raises(ValueError, match="moe_router"):
        tiny("qwen3_moe", moe_router="sigmoid")
    cfg = tiny("llama", attention_sinks=True)
    params = models.init_params(cfg, jax.random.key(3), per_layer=False)
    assert params["layers"]["sinks"].shape == (cfg.num_layers, cfg.num_heads)
    prompt = jnp.arange(6, dtype=jnp.int32)[None] % cfg.vocab_size
    logits, _, _ = models.prefill(cfg, params, prompt, 8)
    no_sinks = dict(params, layers={k: v for k, v in params["layers"].items() if k != "sinks"})
    logits0, _, _ = models.prefill(cfg, no_sinks, prompt, 8)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    assert not np.allclose(np.asarray(logits, np.float32), np.asarray(logits0, np.float32))
    moe = tiny("qwen3_moe", moe_router="topk_softmax", mlp_activation="gpt_oss")
    p = models.init_params(moe, jax.random.key(4), per_layer=False)
    x = jax.random.normal(jax.random.key(5), (3, moe.hidden_size), jnp.float32)
    layer0 = jax.tree_util.tree_map(lambda a: a[0], p["layers"])
    from jaxquant.models.moe import route
    idx, w = route(moe, layer0, x)
    logits_r = x @ layer0["router"].astype(jnp.float32).T
    top, want_idx = jax.lax.top_k(logits_r, moe.experts_per_token)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(w), np.asarray(jax.nn.softmax(top, -1)), rtol=1e-5)


@pytest.mark.parametrize("dtype,shape", [(jnp.bfloat16, (1, 1, 96)), (jnp.bfloat16, (1, 96)),
                                         (jnp.bfloat16, (3, 96)), (jnp.float32, (1, 96))])
def test_float_linear_is_the_einsum(dtype, shape):
    """float_linear (one bfloat16 row padded to two on the CPU) gives the product's
    values and shape: each output row against the float64 product of the same inputs."""
    from jaxquant.models.layers import float_linear
    x = jax.random.normal(jax.random.key(0), shape, dtype)
    w = jax.random.normal(jax.random.key(1), (40, 96), dtype)
    y = jax.jit(float_linear)(x, w)
    assert y.shape == shape[:-1] + (40,) and y.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# On an NVIDIA GPU with jaxquant's CUDA library: the defaults there.

needs_gpu = pytest.mark.skipif(not cuda_library(),
                               reason="needs an NVIDIA GPU and the CUDA library")

CFG = models.Config(family="gpt_oss", vocab_size=512, hidden_size=256, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=256, attention_bias=True,
                    layer_windows=(4, 0, 4), sliding_window=4)
DENSE = models.Config(family="llama", vocab_size=512, hidden_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cfg,mode", [(DENSE, "affine4"), (CFG, "mxfp4"), (DENSE, "bf16")])
def test_defaults_on_cuda(cfg, mode, monkeypatch):
    params = models.init_params(cfg, jax.random.key(0))
    assert isinstance(params["layers"], tuple)  # per-layer buffers on a GPU
    if mode != "bf16":
        fast = models.quantize_params(params, mode)
        quantized = [a for a in jax.tree_util.tree_leaves(
            fast, is_leaf=lambda a: isinstance(a, QuantizedArray)) if isinstance(a, QuantizedArray)]
        assert quantized and {a.layout for a in quantized} == {"cuda_mma"}
        slow = models.quantize_params(models.stack_layers(params), mode, layout="canonical",
                                      per_layer=False)
    else:
        fast, slow = params, models.stack_layers(params)
    prompt = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
    gen = jax.jit(models.generate, static_argnums=(0, 3))
    logits = jax.jit(lambda p: models.prefill(cfg, p, prompt, 24)[0])
    want = logits(slow)
    np.testing.assert_allclose(logits(fast), want, rtol=0.05,
                               atol=0.05 * float(jnp.max(jnp.abs(want))))
    # The greedy tokens with the prompt's attention the op's on both sides: the fast side's
    # cuDNN kernel (checked above, and against the op in tests/test_prefill_gpu.py) moves
    # this random model's flat logits by ~1%, which changed 4 of the 8 tokens (a flipped
    # token changes the ones after it); the tokens check the products and the decode loop
    monkeypatch.setattr(layers, "PROMPT_ATTENTION", {})
    agree = np.mean(np.asarray(gen(cfg, fast, prompt, 8)) == np.asarray(gen(cfg, slow, prompt, 8)))
    assert agree >= 0.75, agree  # bf16 activations: another kernel may flip a late token


@pytest.mark.gpu
@needs_gpu
def test_prepack_of_a_stacked_expert_weight_in_bounded_memory():
    w = jax.random.normal(jax.random.key(2), (4, 8, 1024, 1024), jnp.bfloat16)
    qw = jq.quantize(w, mode="mxfp4", layout="canonical")  # what prepack converts
    del w
    own = sum(a.nbytes for a in jax.tree_util.tree_leaves(qw))
    m = jax.jit(lambda q: jq.prepack(q, layout="cuda_mma")).lower(qw).compile().memory_analysis()
    assert m.temp_size_in_bytes <= 0.25 * own, m.temp_size_in_bytes / own
    assert m.output_size_in_bytes <= 1.001 * own
