"""GGUF import (jq.io.from_gguf*, models.checkpoint.load of a .gguf) against the
`gguf` package itself (written against gguf 0.19.0, llama.cpp's gguf-py):

- tensors: blocks made by gguf.quants.quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  MXFP4), or random bytes with finite scale fields for the types gguf can only
  dequantize (the K-quants, IQ4_NL, IQ4_XS; non-finite and extreme fields apart); jq.dequantize of the import equals
  gguf.quants.dequantize number for number (ggml's d*0 with d < 0 is -0,
  jaxquant's +0: compared as numbers, and the bits of every nonzero value);
- files: tiny models written with gguf.GGUFWriter from random weights quantized
  with gguf.quants, in llama.cpp's conventions (convert_hf_to_gguf's Q/K `permute`
  for llama, gpt-oss's gate/up split); loaded, they decode the same greedy tokens
  as the float model built from gguf's own dequantization of the same bytes.
"""

import importlib.metadata

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models
from jaxquant.models import checkpoint, gguf_checkpoint
from jaxquant.quantized_array import QuantizedArray
from tests.test_models import tiny as models_tiny

gguf = pytest.importorskip("gguf", reason="the GGUF tests compare against the 'gguf' package "
                                          "(pip install gguf)")
from gguf import quants as gq  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

GGUF_VERSION = importlib.metadata.version("gguf")  # tested with 0.19.0
RNG = np.random.default_rng(29)
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]  # gguf.quants.quantize writes these
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]              # gguf only dequantizes these
IQ4 = ["IQ4_NL", "IQ4_XS"]                                        # and these (codebook: iq4nl)


def assert_same_numbers(got, ref):
    """Equal as numbers (NaN = NaN), and bit for bit wherever nonzero."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype == np.float32
    assert np.array_equal(got, ref, equal_nan=True), np.nanmax(np.abs(got - ref))
    nz = ref != 0
    assert np.array_equal(got[nz].view(np.uint32), ref[nz].view(np.uint32))


def values(x):
    if isinstance(x, QuantizedArray):
        return np.asarray(jq.dequantize(x, dtype=jnp.float32))
    return np.asarray(x, np.float32)


def weights(shape, scale=0.1):
    w = (RNG.standard_normal(shape) * scale).astype(np.float32)
    flat = w.reshape(-1, 32)
    flat[0] = 0                       # an all-zero block
    flat[1] = 0.25                    # a constant block
    flat[2] *= 3e4                    # large values
    flat[3] *= 1e-6                   # tiny: float16 subnormal d
    return w


def k_quant_bytes(name, rows, k):
    """Random blocks of a K-quant with finite d/dmin fields (small, subnormals included)."""
    _, nbytes = GGML_QUANT_SIZES[T[name]]
    raw = RNG.integers(0, 256, (rows, k // 256, nbytes), dtype=np.uint8)
    d = (RNG.standard_normal((rows, k // 256, 2)) * 1e-3).astype(np.float16)
    d[0, 0] = np.float16(6e-8)  # a float16 subnormal
    d = d.view(np.uint8).reshape(rows, k // 256, 4)
    where = {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}.get(name, 0)  # fp16 d (and dmin)
    width = 2 if name in ("Q3_K", "Q6_K") else 4
    raw[..., where:where + width] = d[..., :width]
    return raw.reshape(rows, -1)


def iq4_bytes(name, rows, k):
    """Random blocks of IQ4_NL / IQ4_XS with finite d fields (float16 subnormals included):
    every other byte (codes, IQ4_XS's 6-bit sub-block scales) is any value."""
    _, nbytes = GGML_QUANT_SIZES[T[name]]
    raw = RNG.integers(0, 256, (rows, k // GGML_QUANT_SIZES[T[name]][0], nbytes), dtype=np.uint8)
    d = (RNG.standard_normal(raw.shape[:-1]) * 1e-2).astype(np.float16)
    d.flat[0] = np.float16(6e-8)  # a float16 subnormal
    raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def quantized_bytes(name, rows, k):
    return (iq4_bytes if name in IQ4 else k_quant_bytes)(name, rows, k)


# ---------------------------------------------------------------------------
# Tensors.


def test_type_table_matches_gguf():
    for name, (number, block, nbytes) in jq.io.gguf.GGML_TYPES.items():
        assert T[name].value == number
        assert GGML_QUANT_SIZES[T[name]] == (block, nbytes), name


@pytest.mark.parametrize("name", QUANTIZABLE)
@pytest.mark.parametrize("shape", [(6, 256), (3, 5, 96)])
def test_quantized_by_gguf_dequantize_like_gguf(name, shape):
    w = weights(shape)
    raw = gq.quantize(w, T[name])
    qw = jq.io.from_gguf_tensor(raw, name, shape, dtype=jnp.float32)
    assert qw.shape == shape and qw.mode == ("mxfp4" if name == "MXFP4" else "affine")
    assert_same_numbers(values(qw), gq.dequantize(raw, T[name]))
    by_number = jq.io.from_gguf_tensor(raw.reshape(-1), T[name].value, shape)
    assert_same_numbers(values(by_number), values(qw))
    np.testing.assert_array_equal(jq.io.to_gguf_tensor(qw, name), raw)  # the inverse, bit for bit


@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize("shape", [(5, 512), (2, 3, 256)])
def test_k_quants_dequantize_like_gguf(name, shape):
    rows = int(np.prod(shape[:-1]))
    raw = k_quant_bytes(name, rows, shape[-1]).reshape(*shape[:-1], -1)
    got = jq.io.from_gguf_tensor(raw, name, shape, dtype=jnp.float32)
    ref = gq.dequantize(raw, T[name])
    if name in ("Q2_K", "Q6_K"):  # 16-element sub-blocks: affine group 16, float32 terms
        assert (got.mode, got.bits, got.group_size) == ("affine", 2 if name == "Q2_K" else 6, 16)
        assert got.scales.dtype == got.biases.dtype == np.float32
    elif name == "Q3_K":  # q in [-4, 3]: E2M1 values, 16-element groups
        assert (got.mode, got.group_size, got.scales.dtype) == ("fp4", 16, np.float32)
    else:
        assert (got.mode, got.bits, got.group_size) == ("affine", int(name[1]), 32)
        assert got.scales.dtype == got.biases.dtype == np.float32
    assert_same_numbers(values(got), ref)


@pytest.mark.parametrize("name", IQ4)
@pytest.mark.parametrize("shape", [(5, 512), (2, 3, 256)])
def test_iq4_dequantize_like_gguf(name, shape):
    rows = int(np.prod(shape[:-1]))
    raw = iq4_bytes(name, rows, shape[-1]).reshape(*shape[:-1], -1)
    got = jq.io.from_gguf_tensor(raw, name, shape, dtype=jnp.float32)
    assert (got.mode, got.bits, got.group_size, got.biases) == ("iq4nl", 4, 32, None)
    assert got.scales.dtype == (np.float16 if name == "IQ4_NL" else np.float32)
    assert_same_numbers(values(got), gq.dequantize(raw, T[name]))
    by_number = jq.io.from_gguf_tensor(raw.reshape(-1), T[name].value, shape)
    assert_same_numbers(values(by_number), values(got))
    if name == "IQ4_NL":   # the inverse, bit for bit
        np.testing.assert_array_equal(jq.io.to_gguf_tensor(got, name), raw)


def test_iq4_nl_export_of_quantized_weights():
    """jq.quantize's iq4nl of float16 weights (float16 scales) is IQ4_NL's blocks, and of
    float32 weights too where every scale is a float16 number; others are refused."""
    w = weights((4, 96))
    for dt in (jnp.float16, jnp.float32):
        qw = jq.quantize(jnp.asarray(w, dt), mode="iq4nl", layout="canonical")
        if dt == jnp.float32 and not np.array_equal(
                np.asarray(qw.scales).astype(np.float16).astype(np.float32), qw.scales):
            with pytest.raises(ValueError, match="float16"):
                jq.io.to_gguf_tensor(qw, "IQ4_NL")
            continue
        raw = jq.io.to_gguf_tensor(qw, "IQ4_NL")
        assert raw.shape == (4, 3 * 18) and raw.dtype == np.uint8
        assert_same_numbers(gq.dequantize(raw, T.IQ4_NL), values(qw))


def _iq4_block_fields(name, raw):
    """(d float64 [blocks], ls [blocks, G] or None, codes [blocks, G, 32]) read byte by byte
    from ggml-common.h's block_iq4_nl / block_iq4_xs, independently of the importer."""
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[T[name]][1])
    d = np.array([np.frombuffer(b[0:2].tobytes(), "<f2")[0] for b in blocks], np.float64)
    if name == "IQ4_NL":
        qs, ls = blocks[:, None, 2:18], None
    else:
        qs = blocks[:, 8:136].reshape(-1, 8, 16)
        ls = np.zeros((len(blocks), 8), np.int64)
        for n, b in enumerate(blocks):
            high = int(b[2]) | int(b[3]) << 8
            for i in range(8):
                ls[n, i] = ((int(b[4 + i // 2]) >> (4 * (i % 2))) & 15) | ((high >> 2 * i) & 3) << 4
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return d, ls, codes


@pytest.mark.parametrize("name", IQ4)
def test_iq4_codes_and_scales_from_the_block_layout(name):
    """The importer's codes and scales against a byte-by-byte reading of the blocks: code
    j of a 32-group in the low nibble of byte j (j < 16) or the high nibble of byte j-16;
    IQ4_XS's scale d * (ls - 32) with its 6-bit ls, exact (a float32 product of at most
    16 significant bits)."""
    raw = iq4_bytes(name, 3, 512)
    qw = jq.io.from_gguf_tensor(raw, name, (3, 512))
    d, ls, codes = _iq4_block_fields(name, raw)
    got_codes = jq.io.gguf.unpack_codes(np.asarray(qw.data), 4).reshape(codes.shape)
    np.testing.assert_array_equal(got_codes, codes)
    want = d[:, None] if ls is None else d[:, None] * (ls - 32)
    np.testing.assert_array_equal(np.asarray(qw.scales, np.float64).reshape(want.shape), want)


@pytest.mark.parametrize("name", IQ4)
def test_iq4_edge_blocks_like_gguf(name):
    """Extreme codes (0: -127, 15: 113) and IQ4_XS's extreme sub-block scales (ls 0 and
    63: -32d and 31d), d = +-0, a float16 subnormal, the largest float16, Inf and NaN:
    gguf's numbers, non-finite ones included (no codebook value is 0, so d = Inf gives
    +-Inf, and IQ4_XS's ls = 32 with d = Inf NaN, as in ggml)."""
    _, nbytes = GGML_QUANT_SIZES[T[name]]
    ds = [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, np.inf, -np.inf, np.nan, 1.0]
    raw = RNG.integers(0, 256, (len(ds), nbytes), dtype=np.uint8)
    raw[:, 0:2] = np.array(ds, np.float16)[:, None].view(np.uint8)
    first = 18 if name == "IQ4_NL" else 136
    raw[0::2, first - 16:first] = 0x00   # codes 0 (-127) in the last 32 elements
    raw[1::2, first - 16:first] = 0xFF   # codes 15 (113)
    if name == "IQ4_XS":                # ls: 0, 63, 32 in sub-blocks 0, 1, 2
        raw[:, 2:4] = np.array([0b00_11_00 << 4 | 0b10_11_00], "<u2")[:, None].view(np.uint8)[0]
        raw[:, 4] = 0xF0
        raw[:, 5] = (raw[:, 5] & 0xF0) | 0x00
    k = GGML_QUANT_SIZES[T[name]][0]
    got = values(jq.io.from_gguf_tensor(raw, name, (len(ds), k), dtype=jnp.float32))
    with np.errstate(invalid="ignore"):
        ref = gq.dequantize(raw, T[name])
    assert np.isinf(ref).any() and np.isnan(ref).any()
    assert_same_numbers(got, ref)
    if name == "IQ4_XS":
        d, ls, _ = _iq4_block_fields(name, raw)
        assert (ls[:, 0] == 0).all() and (ls[:, 1] == 63).all() and (ls[:, 2] == 32).all()


def test_q4_k_affine_terms_are_exact_products():
    """Q4_K's scale is float32(d) * sc and its bias -(dmin * m), both exact in float32."""
    raw = k_quant_bytes("Q4_K", 4, 256)
    qw = jq.io.from_gguf_tensor(raw, "Q4_K", (4, 256))
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float64)
    sc, _ = gq.Q4_K.get_scale_min(raw[:, 4:16].copy())
    np.testing.assert_array_equal(np.asarray(qw.scales, np.float64), d * sc.astype(np.float64))


def test_scales_widen_to_float32_only_when_float16_overflows():
    w = weights((4, 64))
    raw = gq.quantize(w, T.Q8_0)
    assert jq.io.from_gguf_tensor(raw, "Q8_0", (4, 64)).scales.dtype == np.float16
    big = raw.copy()
    big[0, 0:2] = np.array([np.float16(1000.0)]).view(np.uint8)  # -128 * 1000 > float16 max
    qw = jq.io.from_gguf_tensor(big, "Q8_0", (4, 64), dtype=jnp.float32)
    assert qw.scales.dtype == qw.biases.dtype == np.float32
    assert_same_numbers(values(qw), gq.dequantize(big, T.Q8_0))
    np.testing.assert_array_equal(jq.io.to_gguf_tensor(qw, "Q8_0"), big)


def test_non_finite_d_makes_the_block_nan():
    raw = gq.quantize(weights((2, 64)), T.Q4_0)
    raw[0, 0:2] = np.array([np.float16(np.inf)]).view(np.uint8)
    got = values(jq.io.from_gguf_tensor(raw, "Q4_0", (2, 64), dtype=jnp.float32))
    assert np.isnan(got[0, :32]).all() and np.isfinite(got[0, 32:]).all()
    assert_same_numbers(got[1], gq.dequantize(raw, T.Q4_0)[1])


@pytest.mark.parametrize("name,dtype", [("F32", np.float32), ("F16", np.float16),
                                        ("BF16", ml_dtypes.bfloat16)])
def test_float_tensors_load_as_float(name, dtype):
    w = weights((3, 64)).astype(dtype)
    got = jq.io.from_gguf_tensor(w.view(np.uint8), name, (3, 64))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("call,exc,match", [
    *[(lambda r, t=t: jq.io.from_gguf_tensor(r, t, (1, 256)), ValueError, f"'{t}' has no")
      for t in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0",
                "TQ2_0")],
    (lambda r: jq.io.from_gguf_tensor(r[:, :18 * 7], "IQ4_NL", (1, 256)), ValueError, "raw has"),
    (lambda r: jq.io.from_gguf_tensor(r[:, :18 * 8], "IQ4_NL", (1, 288)), ValueError, "raw has"),
    (lambda r: jq.io.from_gguf_tensor(r[:, :136], "IQ4_XS", (2, 256)), ValueError, "raw has"),
    (lambda r: jq.io.from_gguf_tensor(r, "IQ4_XS", (1, 128)), ValueError, "256-element"),
    (lambda r: jq.io.from_gguf_tensor(r[:, :136], "IQ4_XS", (256,)), ValueError, "shape"),
    (lambda r: jq.io.from_gguf_tensor(r.view(np.int8)[:, :136], "IQ4_XS", (1, 256)), TypeError,
     "uint8"),
    (lambda r: jq.io.from_gguf_tensor(r, "Q9_9", (1, 256)), ValueError, "Q9_9"),
    (lambda r: jq.io.from_gguf_tensor(r, 99, (1, 256)), ValueError, "99"),
    (lambda r: jq.io.from_gguf_tensor(r, 2.0, (1, 256)), TypeError, "ggml_type"),
    (lambda r: jq.io.from_gguf_tensor(r, "Q4_0", (1, 100)), ValueError, "shape"),
    (lambda r: jq.io.from_gguf_tensor(r, "Q4_0", (2, 256)), ValueError, "raw has"),
    (lambda r: jq.io.from_gguf_tensor(r.astype(np.int8), "Q4_0", (1, 256)), TypeError, "uint8"),
    (lambda r: jq.io.from_gguf_tensor([1, 2], "Q4_0", (1, 256)), TypeError, "raw"),
    (lambda r: jq.io.to_gguf_tensor(jq.quantize(jnp.asarray(weights((2, 64))), mode="affine",
                                                bits=4, group_size=32), "Q4_1"),
     ValueError, "float16"),
    (lambda r: jq.io.to_gguf_tensor(jq.io.from_gguf_tensor(r, "Q4_0", (1, 256)), "Q8_0"),
     ValueError, "bits=8"),
    (lambda r: jq.io.to_gguf_tensor(jq.io.from_gguf_tensor(r, "Q4_0", (1, 256)), "Q4_K"),
     ValueError, "Q4_K"),
    (lambda r: jq.io.to_gguf_tensor(jq.io.from_gguf_tensor(r, "Q4_0", (1, 256)), "IQ4_NL"),
     ValueError, "iq4nl"),
])
def test_bad_inputs(call, exc, match):
    raw = gq.quantize(weights((1, 256)), T.Q4_0)
    with pytest.raises(exc, match=match):
        call(raw)


def test_to_gguf_refuses_an_asymmetric_array_as_q4_0():
    qw = jq.quantize(jnp.asarray(weights((2, 64)), jnp.float16), mode="affine", bits=4,
                     group_size=32)
    with pytest.raises(ValueError, match="biases = -8"):
        jq.io.to_gguf_tensor(qw, "Q4_0")


# ---------------------------------------------------------------------------
# Files.


def permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


class Writer:
    """A GGUF file of one model, written with gguf.GGUFWriter; remembers what gguf
    dequantizes each tensor to (the reference's weights)."""

    def __init__(self, path, arch):
        self.w = gguf.GGUFWriter(str(path), arch)
        self.path = path
        self.ref = {}

    def add(self, name, w, qtype="F32"):
        w = np.asarray(w, np.float32)
        if qtype in ("F32", "F16"):
            data = w.astype(np.float16 if qtype == "F16" else np.float32)
            self.w.add_tensor(name, data)
            self.ref[name] = data.astype(np.float32)
            return
        if qtype in QUANTIZABLE:
            raw = gq.quantize(w, T[qtype])
        else:  # K-quants, IQ4: random blocks of w's shape
            raw = quantized_bytes(qtype, int(np.prod(w.shape[:-1])), w.shape[-1])
            raw = raw.reshape(*w.shape[:-1], -1)
        self.w.add_tensor(name, raw, raw_dtype=T[qtype])
        self.ref[name] = gq.dequantize(raw, T[qtype])

    def close(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def tiny(family, **kw):
    """test_models' tiny Config, in float32, with non-default rope base and epsilon (so
    the metadata's are checked) and gpt-oss's sliding window written out."""
    base = dict(vocab_size=96, intermediate_size=96, rope_theta=5000.0, rms_eps=1e-5,
                dtype="float32", sliding_window=3 if family == "gpt_oss" else 0)
    return models_tiny(family, **dict(base, **kw))


def llama3_rope_factors(cfg, factor=8.0, low=1.0, high=4.0, old=64):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_freqs.weight)."""
    base, dim = cfg.rope_theta, cfg.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            rope_factors.append(1)
        elif wavelen > low_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def write_model(path, arch, cfg, qtypes, tokenizer="gpt2"):
    """Random float weights in HF's conventions -> a GGUF in llama.cpp's; returns the
    float params that gguf's dequantization of the file gives, in HF's conventions."""
    params = jax.tree_util.tree_map(np.asarray, models.unfuse_params(
        cfg, models.init_params(cfg, jax.random.key(3), per_layer=False)))
    lay = params["layers"]
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):  # norms off 1: they matter
        if name in lay:
            lay[name] = lay[name] + RNG.standard_normal(lay[name].shape).astype(np.float32) * 0.1
    wr = Writer(path, arch)
    w = wr.w
    w.add_block_count(cfg.num_layers)
    w.add_context_length(128)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
    if cfg.moe and arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    # llama.cpp's Mixtral (llama with experts): the experts' size is feed_forward_length
    w.add_feed_forward_length(cfg.intermediate_size)
    if cfg.family == "gpt_oss":
        w.add_sliding_window(cfg.sliding_window)
    rs = dict(cfg.rope_scaling)
    if rs:  # as convert_hf_to_gguf writes HF's rope_scaling (yarn)
        w.add_rope_scaling_type(gguf.RopeScalingType(rs["rope_type"]))
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        tokens = ["<|bos|>", "Hello", "\u0120world", "\u00e2\u0122\u013b"]  # ’ byte-level
    else:
        tokens = ["<s>", "\u2581Hello", "\u2581world", "<0x41>"]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (cfg.vocab_size - 1))
    w.add_bos_token_id(0)

    q = qtypes.get
    wr.add("token_embd.weight", params["embed"], q("embed", "Q8_0"))
    wr.add("output_norm.weight", params["final_norm"])
    if cfg.rope_freq_factors:
        wr.add("rope_freqs.weight", np.asarray(cfg.rope_freq_factors, np.float32))
    if not cfg.tie_embeddings:
        wr.add("output.weight", params["lm_head"], q("lm_head", "Q8_0"))
    llama = arch == "llama"
    for i in range(cfg.num_layers):
        pre = f"blk.{i}."
        L = {k: v[i] for k, v in lay.items()}
        qt = lambda key: (q(key, "Q4_0")[i] if isinstance(q(key), list)  # noqa: E731
                          else q(key, "Q4_0"))
        wr.add(pre + "attn_norm.weight", L["attn_norm"])
        wr.add(pre + ("post_attention_norm.weight" if cfg.family == "gpt_oss"
                      else "ffn_norm.weight"), L["mlp_norm"])
        wq, wk = L["wq"], L["wk"]
        if llama:
            wq, wk = permute(wq, cfg.num_heads, cfg.num_heads), permute(wk, cfg.num_heads,
                                                                        cfg.num_kv_heads)
        for key, name, m in (("wq", "attn_q", wq), ("wk", "attn_k", wk), ("wv", "attn_v", L["wv"]),
                             ("wo", "attn_output", L["wo"])):
            wr.add(pre + name + ".weight", m, qt(key))
        for key, name in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v"), ("bo", "attn_output")):
            if key in L:
                wr.add(pre + name + ".bias", L[key])
        if cfg.qk_norm:
            wr.add(pre + "attn_q_norm.weight", L["q_norm"])
            wr.add(pre + "attn_k_norm.weight", L["k_norm"])
        if cfg.family == "gpt_oss":
            wr.add(pre + "attn_sinks.weight", L["sinks"])
            wr.add(pre + "ffn_gate_inp.weight", L["router"])
            wr.add(pre + "ffn_gate_inp.bias", L["router_bias"])
            wr.add(pre + "ffn_gate_exps.weight", L["e_gate"], "MXFP4")
            wr.add(pre + "ffn_up_exps.weight", L["e_up"], "MXFP4")
            wr.add(pre + "ffn_gate_exps.bias", L["e_gate_bias"])
            wr.add(pre + "ffn_up_exps.bias", L["e_up_bias"])
            wr.add(pre + "ffn_down_exps.weight", L["e_down"], "MXFP4")
            wr.add(pre + "ffn_down_exps.bias", L["e_down_bias"])
        elif cfg.moe:  # qwen3moe's and llama.cpp's Mixtral's stacked experts
            wr.add(pre + "ffn_gate_inp.weight", L["router"])
            for key, name in (("e_gate", "ffn_gate_exps"), ("e_up", "ffn_up_exps"),
                              ("e_down", "ffn_down_exps")):
                wr.add(pre + name + ".weight", L[key], qt(key))
        else:
            for key, name in (("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down")):
                wr.add(pre + name + ".weight", L[key], qt(key))
    wr.close()

    # The reference: gguf's dequantization of every tensor, back in HF's conventions.
    r = wr.ref
    inverse = lambda n, nkv, a: a[np.argsort(permute(np.arange(a.shape[0]), n, nkv))]  # noqa: E731
    ref = {"embed": r["token_embd.weight"], "final_norm": r["output_norm.weight"]}
    if not cfg.tie_embeddings:
        ref["lm_head"] = r["output.weight"]
    names = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
             "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias",
             "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
             "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
             "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
             "router": "ffn_gate_inp.weight", "router_bias": "ffn_gate_inp.bias",
             "sinks": "attn_sinks.weight", "e_gate": "ffn_gate_exps.weight",
             "e_up": "ffn_up_exps.weight", "e_down": "ffn_down_exps.weight",
             "e_down_bias": "ffn_down_exps.bias", "e_gate_bias": "ffn_gate_exps.bias",
             "e_up_bias": "ffn_up_exps.bias",
             "mlp_norm": "post_attention_norm.weight" if cfg.family == "gpt_oss"
             else "ffn_norm.weight"}
    layers = {}
    for key in lay:
        per = []
        for i in range(cfg.num_layers):
            pre = f"blk.{i}."
            a = r[pre + names[key]]
            if llama and key == "wq":
                a = inverse(cfg.num_heads, cfg.num_heads, a)
            if llama and key == "wk":
                a = inverse(cfg.num_heads, cfg.num_kv_heads, a)
            per.append(a)
        layers[key] = np.stack(per)
    ref["layers"] = layers
    return jax.tree_util.tree_map(jnp.asarray, ref)


def greedy(cfg, params, steps=6):
    prompt = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)
    gen = jax.jit(models.generate, static_argnums=(0, 3))
    logits, _, _ = jax.jit(models.prefill, static_argnums=(0, 3))(cfg, params, prompt, 8)
    return np.asarray(gen(cfg, params, prompt, steps)), np.asarray(logits)


CASES = {
    "llama": ("llama", tiny("llama"), {}),
    "llama_tied": ("llama", tiny("llama", tie_embeddings=True),
                   {"wq": "Q5_0", "wk": "Q5_1", "wv": "Q4_1", "w_down": ["Q8_0", "Q4_0"]}),
    "qwen2": ("qwen2", tiny("llama", attention_bias=True), {"embed": "Q4_0", "lm_head": "F16"}),
    "qwen3": ("qwen3", tiny("qwen3"), {"wo": "Q8_0"}),
    "llama3_rope": ("llama", tiny("llama", rope_freq_factors=tuple(
        float(v) for v in llama3_rope_factors(tiny("llama")))), {}),
    "qwen3moe": ("qwen3moe", tiny("qwen3_moe"), {"e_down": "Q8_0"}),
    # Mixtral as convert_hf_to_gguf writes it: general.architecture llama, llama.expert_count
    "mixtral": ("llama", tiny("mixtral", intermediate_size=64), {"e_up": "Q4_1",
                                                                 "e_down": "Q8_0"}),
    "gpt-oss": ("gpt-oss", tiny("gpt_oss", rope_scaling=tuple(sorted(dict(
        rope_type="yarn", factor=32.0, original_max_position_embeddings=64,
        truncate=False).items()))), {}),
    "llama_k_quants": ("llama", tiny("llama", hidden_size=256, head_dim=64, intermediate_size=512),
                       {"wq": "Q4_K", "wk": "Q5_K", "wv": "Q6_K", "wo": "Q3_K", "w_gate": "Q5_K",
                        "w_up": "Q2_K", "w_down": ["Q4_K", "Q6_K"], "embed": "Q6_K",
                        "lm_head": "Q4_K"}),
    "llama_iq4": ("llama", tiny("llama", hidden_size=256, head_dim=64, intermediate_size=512),
                  {"wq": "IQ4_NL", "wk": "IQ4_XS", "wv": "IQ4_XS", "wo": "IQ4_NL",
                   "w_gate": "IQ4_XS", "w_up": "IQ4_NL", "w_down": ["IQ4_XS", "IQ4_NL"],
                   "embed": "IQ4_NL", "lm_head": "IQ4_XS"}),
}


# llama_iq4 (~10 s on a CPU) repeats llama_k_quants' path with other codes: the full matrix
# runs it; the IQ4 tensors' exactness is checked in the default run above
@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c == "llama_iq4"
                                  else c for c in CASES])
def test_gguf_file_decodes_like_its_float_model(tmp_path, case):
    arch, cfg, qtypes = CASES[case]
    path = tmp_path / "model.gguf"
    ref = write_model(path, arch, cfg, qtypes)
    got_cfg, params = checkpoint.load(str(path), dtype="float32", fuse=False, per_layer=False)
    assert got_cfg == cfg
    lay = params["layers"]
    for key in ("wq", "wk", "wo"):
        assert isinstance(lay[key], QuantizedArray)  # stayed quantized
    if cfg.family == "gpt_oss":
        assert lay["e_gate"].mode == "mxfp4" and lay["e_gate"].shape == (2, 4, 64, 64)
    if case == "llama_k_quants":  # a Q4_K_M-style mix: no float matrix but the norms
        assert lay["wo"].mode == "fp4"
        assert (lay["wv"].bits, lay["wv"].group_size) == (6, 16)       # Q6_K
        assert (lay["w_up"].bits, lay["w_up"].group_size) == (2, 16)   # Q2_K
        # Q4_K and Q6_K layers of w_down: widened to 6 bits, Q4_K's groups split in two
        assert (lay["w_down"].mode, lay["w_down"].bits, lay["w_down"].group_size) == (
            "affine", 6, 16)
        floats = [k for k, a in lay.items() if not isinstance(a, QuantizedArray)]
        assert sorted(floats) == ["attn_norm", "mlp_norm"], floats
        assert isinstance(params["embed"], QuantizedArray)
        assert isinstance(params["lm_head"], QuantizedArray)
    if case == "llama_iq4":  # every matrix in the codebook format, none float
        floats = [k for k, a in lay.items() if not isinstance(a, QuantizedArray)]
        assert sorted(floats) == ["attn_norm", "mlp_norm"], floats
        assert {a.mode for k, a in lay.items() if k not in floats} == {"iq4nl"}
        assert params["embed"].mode == params["lm_head"].mode == "iq4nl"
    if case == "llama_tied":  # Q8_0 and Q4_0 layers of w_down: widened to 8 bits, exact
        assert (lay["w_down"].bits, lay["w_down"].scales.dtype) == (8, jnp.float32)
    # the imported weights are gguf's dequantization, number for number
    for key, a in lay.items():
        np.testing.assert_array_equal(values(a) if not isinstance(a, QuantizedArray)
                                      else np.asarray(jq.dequantize(a, dtype=jnp.float32)),
                                      np.asarray(ref["layers"][key]), err_msg=key)
    np.testing.assert_array_equal(values(params["embed"]), np.asarray(ref["embed"]))
    toks, logits = greedy(cfg, params)
    ref_toks, ref_logits = greedy(cfg, ref)
    # and as checkpoint.load gives it by default: fused (gate rows then up rows), the
    # same function
    _, fused = checkpoint.load(str(path), dtype="float32")
    np.testing.assert_array_equal(greedy(cfg, fused)[0], ref_toks)
    np.testing.assert_array_equal(toks, ref_toks)
    # float32 sums in another order (qmm vs einsum): relative to the logits' scale
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4,
                               atol=1e-4 * float(np.abs(ref_logits).max()))


def test_llama_permutation_is_undone(tmp_path):
    """Against a model without the permutation round trip, llama's rope would differ:
    the loader's rows are HF's rows (checked on the float tensors)."""
    cfg = tiny("llama")
    path = tmp_path / "m.gguf"
    write_model(path, "llama", cfg, {"wq": "F32", "wk": "F32"})
    _, params = checkpoint.load(str(path), dtype="float32", fuse=False, per_layer=False)
    hf = jax.tree_util.tree_map(np.asarray, models.unfuse_params(
        cfg, models.init_params(cfg, jax.random.key(3), per_layer=False)))
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"]), hf["layers"]["wq"])
    np.testing.assert_array_equal(np.asarray(params["layers"]["wk"]), hf["layers"]["wk"])


def test_rope_freqs_give_llama3_frequencies():
    """ggml's freq_factors from convert_hf_to_gguf equal HF's llama3 rope scaling."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    hf = tiny("llama", rope_scaling=tuple(sorted(scaling.items())))
    factors = tuple(float(v) for v in llama3_rope_factors(hf))
    assert len(set(factors)) > 2  # the three regimes are all present
    gg = tiny("llama", rope_freq_factors=factors)
    np.testing.assert_allclose(gg.rope_inv_freq()[0], hf.rope_inv_freq()[0], rtol=1e-6)
    with pytest.raises(ValueError, match="rope_freq_factors"):
        tiny("llama", rope_freq_factors=(1.0,))


def test_mode_quantizes_only_float_matrices(tmp_path):
    cfg = tiny("llama")
    path = tmp_path / "m.gguf"
    write_model(path, "llama", cfg, {"wv": "F16"})
    _, params = checkpoint.load(str(path), mode="mxfp4", dtype="float32", fuse=False)
    assert params["layers"]["wv"].mode == "mxfp4"
    assert params["layers"]["wq"].mode == "affine"  # Q4_0 as stored


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_tokenizer_decodes(tmp_path, model):
    cfg = tiny("llama")
    path = tmp_path / "m.gguf"
    write_model(path, "llama", cfg, {}, tokenizer=model)
    tok = gguf_checkpoint.tokenizer(str(path))
    assert tok.bos_id == 0 and len(tok.tokens) == cfg.vocab_size
    want = "Hello world\u2019" if model == "gpt2" else " Hello worldA"
    assert tok.decode([0, 1, 2, 3]) == want


def test_per_expert_mixtral_tensors_are_refused(tmp_path):
    """llama with llama.expert_count but one tensor per expert (blk.N.ffn_gate.E, an
    older llama.cpp layout): refused by name, never read as a dense llama."""
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_expert_count(2)
    w.add_expert_used_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for e in range(2):
        w.add_tensor(f"blk.0.ffn_gate.{e}.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        checkpoint.load(str(path))


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon"):
        checkpoint.load(str(path))


# ---------------------------------------------------------------------------
# The kernels on imported arrays (float16 and float32 scales and biases).


def imported(name, shape):
    if name in QUANTIZABLE:
        raw = gq.quantize(weights(shape), T[name])
    else:
        raw = quantized_bytes(name, shape[0], shape[1])
    return jq.io.from_gguf_tensor(raw, name, shape, dtype=jnp.bfloat16)


def _gpu():
    return jax.default_backend() in ("gpu", "cuda", "rocm")


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "MXFP4", "Q3_K", "Q4_K", "Q5_K",
                                  "IQ4_NL", "IQ4_XS"])
def test_every_backend_here_runs_imported_arrays(name):
    """jq.qmm on each available backend (the ffi kernels on the CPU, the Pallas and
    native GPU kernels on a GPU), canonical and prepacked, against the float64 product
    of gguf's dequantization."""
    from tests.common import assert_matmul_close
    qw = imported(name, (40, 512))
    w64 = np.asarray(jq.dequantize(qw, dtype=jnp.float32), np.float64)
    x = jax.random.normal(jax.random.key(2), (3, 512), jnp.bfloat16)
    for backend in [b for b in jq.available_backends() if b != "metal"]:
        dev = jax.tree_util.tree_map(jnp.asarray, qw)
        for w in (dev, jq.prepack(dev)):
            assert_matmul_close(jq.qmm(x, w, backend=backend), x, w64, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "MXFP4", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL",
                                  "IQ4_XS"])
@pytest.mark.parametrize("m", [1, 16, 128])
def test_gpu_kernels_on_imported_arrays(name, m):
    """Decode (M = 1, 16) and prefill (M = 128) shapes on the default (auto) kernels."""
    from tests.common import assert_matmul_close
    qw = jax.tree_util.tree_map(jnp.asarray, imported(name, (256, 1024)))
    w64 = np.asarray(jq.dequantize(qw, dtype=jnp.float32), np.float64)
    x = jax.random.normal(jax.random.key(m), (m, 1024), jnp.bfloat16)
    assert_matmul_close(jax.jit(jq.qmm)(x, jq.prepack(qw)), x, w64, jnp.bfloat16)
    assert_matmul_close(jax.jit(jq.qmm)(x, qw), x, w64, jnp.bfloat16)
