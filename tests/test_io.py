"""Importers / exporters of jaxquant.io against independent decoders.

Every format is decoded here a second time, from its own definition, with a
small float64 decoder written from docs/formats.md (and from ggml's and
transformers' code for their formats), and compared with jq.dequantize of the
imported QuantizedArray. Round trips are checked bit for bit both ways.
"""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import io
from jaxquant.quantized_array import QuantizedArray

RNG = np.random.default_rng(20240601)


# ---------------------------------------------------------------------------
# Independent decoders (float64), from the definitions.


def minifloat(codes, ebits, mbits, bias):
    """Value of 1+ebits+mbits-bit float codes without Inf/NaN (FP4/FP6 of OCP MX)."""
    c = np.asarray(codes).astype(np.int64)
    sign = (c >> (ebits + mbits)) & 1
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = (c & ((1 << mbits) - 1)).astype(np.float64)
    mag = np.where(e == 0, m / 2.0**mbits * 2.0 ** (1 - bias),
                   (1 + m / 2.0**mbits) * 2.0 ** (e.astype(np.float64) - bias))
    return np.where(sign == 1, -mag, mag)


ELEMENTS = {"mxfp4": (2, 1, 1), "mxfp6_e2m3": (2, 3, 1), "mxfp6_e3m2": (3, 2, 3)}


def e8m0(e):
    e = np.asarray(e)
    return np.where(e == 255, np.nan, 2.0 ** (e.astype(np.float64) - 127))


def to_f32(x64):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x64).astype(np.float32)


def deq(qw, dtype=jnp.float32):
    return np.asarray(jq.dequantize(qw, dtype=dtype))


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_values_equal(a, b):
    """Equal as numbers (ggml's table has no -0: its code 8 decodes to +0)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(a, b, equal_nan=True)


def assert_same_qw(a: QuantizedArray, b: QuantizedArray):
    assert (a.mode, a.bits, a.group_size, a.shape) == (b.mode, b.bits, b.group_size, b.shape)
    for x, y in ((a.data, b.data), (a.scales, b.scales), (a.biases, b.biases)):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert_bits_equal(x, y)


_jit_quantize = jax.jit(jq.quantize, static_argnames=("mode", "bits", "group_size"))


def quantized(shape, mode, dtype=np.float32, **kw):
    """jq.quantize of normal data (jitted: one compile instead of many eager ops)."""
    w = RNG.standard_normal(shape).astype(dtype)
    return _jit_quantize(w, mode=mode, **kw)


def random_qw(mode, shape, bits=None, group_size=None):
    """A QuantizedArray with random bits in every field (exporters must move any bits)."""
    fmt, bits, group_size = jq.formats.resolve(mode, bits, group_size)
    *lead, k = shape
    data = RNG.integers(0, 2**32, (*lead, k * bits // 32), dtype=np.uint32)
    sshape = (*lead, k // group_size)
    if fmt.scale == "float":
        scales = RNG.standard_normal(sshape).astype(np.float32)
        biases = RNG.standard_normal(sshape).astype(np.float32) if fmt.has_biases else None
    else:
        scales, biases = RNG.integers(0, 256, sshape, dtype=np.uint8), None
    gs = np.float32(0.5) if fmt.has_global_scale else None
    return QuantizedArray(data, scales, biases, gs, mode=mode, bits=bits, group_size=group_size,
                          dtype=jnp.float32)


def scale_bytes(shape, lo=2, hi=255):
    """E8M0 bytes in [lo, hi]; the default range keeps every value a normal float32
    (scale >= 2**-125) and includes 255 (NaN)."""
    s = RNG.integers(lo, hi + 1, shape, dtype=np.uint8)
    s.reshape(-1)[:3] = [lo, 127, hi][: s.size]
    return s


def gpt_oss_reference(blocks, scales):
    """transformers' convert_moe_packed_tensors, before its final transpose:
    low nibble -> element 2j, high nibble -> 2j+1, ldexp by scale - 127."""
    lut = minifloat(np.arange(16), 2, 1, 1)
    out = np.empty(blocks.shape[:-1] + (32,))
    out[..., 0::2] = lut[blocks & 0x0F]
    out[..., 1::2] = lut[blocks >> 4]
    out = out * e8m0(scales)[..., None]
    return to_f32(out.reshape(*blocks.shape[:-2], -1))


def test_gpt_oss_decodes_like_transformers():
    # [E, N, G, 16] as gate_up_proj_blocks: E=2 experts, N=3 rows, K = 4*32.
    blocks = RNG.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
    scales = scale_bytes((2, 3, 4))
    qw = io.from_gpt_oss(blocks, scales)
    assert qw.mode == "mxfp4" and qw.shape == (2, 3, 128) and qw.dtype == jnp.bfloat16
    assert_bits_equal(deq(qw), gpt_oss_reference(blocks, scales))
    # the default logical dtype is bfloat16, as transformers' decode
    assert deq(qw, None).dtype == jnp.bfloat16


def test_gpt_oss_import_is_a_view():
    blocks = RNG.integers(0, 256, (5, 2, 16), dtype=np.uint8)
    qw = io.from_gpt_oss(blocks, scale_bytes((5, 2)))
    assert qw.data.dtype == np.uint32 and qw.data.shape == (5, 8)
    assert np.shares_memory(qw.data, blocks)


def test_gpt_oss_round_trips_bits():
    blocks = RNG.integers(0, 256, (3, 7, 5, 16), dtype=np.uint8)
    scales = RNG.integers(0, 256, (3, 7, 5), dtype=np.uint8)
    b2, s2 = io.to_gpt_oss(io.from_gpt_oss(blocks, scales))
    assert_bits_equal(b2, blocks)
    assert_bits_equal(s2, scales)


def test_gpt_oss_export_import_of_quantized():
    qw = quantized((2, 8, 96), "mxfp4")
    blocks, scales = io.to_gpt_oss(qw)
    assert blocks.shape == (2, 8, 3, 16) and scales.shape == (2, 8, 3)
    assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
    assert_same_qw(io.from_gpt_oss(blocks, scales), qw)
    # and transformers' decode of the exported blocks gives jq.dequantize's values
    assert_bits_equal(gpt_oss_reference(blocks, scales), deq(qw))


def test_gpt_oss_subnormal_scales_are_exact():
    blocks = RNG.integers(0, 256, (4, 2, 16), dtype=np.uint8)
    scales = np.array([[0, 1]] * 4, np.uint8)
    assert_bits_equal(deq(io.from_gpt_oss(blocks, scales)), gpt_oss_reference(blocks, scales))


# ---------------------------------------------------------------------------
# ggml block_mxfp4

KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def ggml_e8m0_to_fp32_half(e):
    """ggml-impl.h's GGML_E8M0_TO_FP32_HALF, bit for bit."""
    e = np.asarray(e).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def ggml_dequantize_row_mxfp4(raw):
    """ggml-quants.c's dequantize_row_mxfp4 over rows of 17-byte blocks (float32
    arithmetic, as ggml): y[j] = kvalues[qs[j] & 15] * d, y[j+16] = kvalues[qs[j] >> 4] * d."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    d = ggml_e8m0_to_fp32_half(blocks[..., 0])[..., None]
    qs = blocks[..., 1:]
    with np.errstate(over="ignore"):
        y = np.concatenate([KVALUES_MXFP4[qs & 0x0F].astype(np.float32) * d,
                            KVALUES_MXFP4[qs >> 4].astype(np.float32) * d], axis=-1)
    return y.reshape(*raw.shape[:-1], -1)


def ggml_rows(shape_rows, nblocks, scale_hi=254):
    blocks = RNG.integers(0, 256, (*shape_rows, nblocks, 17), dtype=np.uint8)
    blocks[..., 0] = scale_bytes((*shape_rows, nblocks), hi=scale_hi)
    return blocks.reshape(*shape_rows, nblocks * 17)


def test_ggml_scale_convention_is_ocp_e8m0():
    # ggml's half-scale times its doubled table is e2m1 * 2**(e - 127): the byte is OCP E8M0.
    e = np.arange(2, 255)
    for code in range(16):
        with np.errstate(over="ignore"):
            ggml = KVALUES_MXFP4[code].astype(np.float32) * ggml_e8m0_to_fp32_half(e)
        ocp = to_f32(minifloat(code, 2, 1, 1) * e8m0(e))
        assert_values_equal(ggml, ocp)


def test_ggml_decodes_like_ggml():
    raw = ggml_rows((2, 3), 4)
    qw = io.from_ggml_mxfp4(raw, 128)
    assert qw.shape == (2, 3, 128) and qw.mode == "mxfp4"
    assert_bits_equal(np.asarray(qw.scales), raw.reshape(2, 3, 4, 17)[..., 0])
    assert_values_equal(deq(qw), ggml_dequantize_row_mxfp4(raw))


def test_ggml_flat_bytes_are_rows_of_k():
    raw = ggml_rows((6,), 2)
    qw = io.from_ggml_mxfp4(raw.reshape(-1), 64)
    assert qw.shape == (6, 64)
    assert_values_equal(deq(qw), ggml_dequantize_row_mxfp4(raw))


def test_ggml_scale_255_is_nan_not_ggml_finite():
    raw = ggml_rows((1,), 2)
    raw[0, 0] = 255
    raw[0, 1:17] = 0x21  # codes 1 and 2: nonzero in ggml's decode
    got = deq(io.from_ggml_mxfp4(raw, 64))
    assert np.isnan(got[0, :32]).all()
    assert not np.isnan(ggml_dequantize_row_mxfp4(raw)[0, :32]).any()  # ggml: scale 2**128
    assert_values_equal(got[0, 32:], ggml_dequantize_row_mxfp4(raw)[0, 32:])


def test_ggml_round_trips_bits():
    raw = RNG.integers(0, 256, (2, 5, 3 * 17), dtype=np.uint8)
    assert_bits_equal(io.to_ggml_mxfp4(io.from_ggml_mxfp4(raw, 96)), raw)
    rq = random_qw("mxfp4", (4, 160))
    out = io.to_ggml_mxfp4(rq)
    assert out.shape == (4, 5 * 17) and out.dtype == np.uint8
    assert_same_qw(io.from_ggml_mxfp4(out, 160), rq)
    qw = quantized((4, 160), "mxfp4")
    out = io.to_ggml_mxfp4(qw)
    assert_same_qw(io.from_ggml_mxfp4(out, 160), qw)
    assert_values_equal(ggml_dequantize_row_mxfp4(out), deq(qw))


# ---------------------------------------------------------------------------
# 17-byte MXFP4 / 25-byte MXFP6 blocks


def mx_blocks_reference(raw, mode):
    """Decode scale-first blocks element by element from the byte-level spec:
    MXFP4 high nibble = even element; MXFP6 a big-endian (MSB-first) bit stream."""
    nbytes = io.MX_BLOCK_BYTES[mode]
    blocks = raw.reshape(-1, nbytes)
    ebits, mbits, bias = ELEMENTS[mode]
    codes = np.empty((blocks.shape[0], 32), np.int64)
    for i, blk in enumerate(blocks):
        if mode == "mxfp4":
            for j in range(32):
                byte = int(blk[1 + j // 2])
                codes[i, j] = byte >> 4 if j % 2 == 0 else byte & 0x0F
        else:
            stream = int.from_bytes(bytes(blk[1:]), "big")  # 192 bits, E0 at the top
            for j in range(32):
                codes[i, j] = (stream >> (192 - 6 * (j + 1))) & 0x3F
    vals = minifloat(codes, ebits, mbits, bias) * e8m0(blocks[:, 0])[:, None]
    return to_f32(vals.reshape(*raw.shape[:-1], -1))


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"])
def test_mx_blocks_decode_by_spec(mode):
    nb, B = 3, io.MX_BLOCK_BYTES[mode]
    raw = RNG.integers(0, 256, (2, 4, nb, B), dtype=np.uint8)
    raw[..., 0] = scale_bytes((2, 4, nb), lo=5)  # E3M2's 0.0625 * 2**-122 is normal
    raw = raw.reshape(2, 4, nb * B)
    qw = io.from_mx_blocks(raw, mode)
    assert qw.mode == mode and qw.shape == (2, 4, 96)
    assert_bits_equal(deq(qw), mx_blocks_reference(raw, mode))


def test_mxfp6_bit_order_example():
    # E0 = 0b101010, E1 = 0b000011, E2 = 0b110000, E3 = 0b011111, the rest 0:
    # byte0 = [E0 5..0][E1 5..4] = 101010 00, byte1 = [E1 3..0][E2 5..2] = 0011 1100,
    # byte2 = [E2 1..0][E3 5..0] = 00 011111.
    raw = np.zeros((1, 25), np.uint8)
    raw[0, 0] = 127
    raw[0, 1:4] = [0b10101000, 0b00111100, 0b00011111]
    got = deq(io.from_mx_blocks(raw, "mxfp6_e2m3"))[0, :5]
    want = to_f32(minifloat([0b101010, 0b000011, 0b110000, 0b011111, 0], 2, 3, 1))
    assert_bits_equal(got, want)
    assert got.tolist() == [-1.25, 0.375, -2.0, 7.5, 0.0]


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"])
def test_mx_blocks_round_trip_bits(mode):
    B = io.MX_BLOCK_BYTES[mode]
    raw = RNG.integers(0, 256, (3, 2, 4 * B), dtype=np.uint8)
    assert_bits_equal(io.to_mx_blocks(io.from_mx_blocks(raw, mode)), raw)
    # flat bytes with k
    q_flat = io.from_mx_blocks(raw.reshape(-1), mode, k=128)
    assert q_flat.shape == (6, 128)
    assert_bits_equal(np.asarray(q_flat.data), np.asarray(io.from_mx_blocks(raw, mode).data)
                      .reshape(6, -1))
    qw = quantized((2, 3, 64), mode)
    out = io.to_mx_blocks(qw)
    assert out.shape == (2, 3, 2 * B)
    assert_same_qw(io.from_mx_blocks(out, mode), qw)
    assert_bits_equal(mx_blocks_reference(out, mode), deq(qw))
    rq = random_qw(mode, (5, 96))
    assert_same_qw(io.from_mx_blocks(io.to_mx_blocks(rq), mode), rq)


def test_formats_agree_with_each_other():
    # One mxfp4 array through all three byte formats: each a permutation of the others.
    qw = random_qw("mxfp4", (3, 64))
    blocks, scales = io.to_gpt_oss(qw)
    mx = io.to_mx_blocks(qw).reshape(3, 2, 17)
    gg = io.to_ggml_mxfp4(qw).reshape(3, 2, 17)
    assert_bits_equal(mx[..., 0], scales)
    assert_bits_equal(gg[..., 0], scales)
    swapped = ((blocks << 4) | (blocks >> 4)).astype(np.uint8)  # gpt-oss: low = even
    assert_bits_equal(mx[..., 1:], swapped)
    even, odd = blocks & 0x0F, blocks >> 4
    codes = np.stack([even, odd], -1).reshape(3, 2, 32)
    assert_bits_equal(gg[..., 1:], (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8))


# ---------------------------------------------------------------------------
# MLX tensors


def mlx_affine_reference(weight, scales, biases, bits, group_size):
    """Element k of a row is bits [k*bits, (k+1)*bits) of the row's words read as
    one little-endian integer; value = scale * q + bias in float32. Returns the
    two float32 roundings of that: once (a fused multiply-add, what XLA compiles)
    and twice (product, then sum)."""
    rows = weight.reshape(-1, weight.shape[-1])
    k = weight.shape[-1] * 32 // bits
    q = np.empty((rows.shape[0], k), np.int64)
    for r, row in enumerate(rows):
        stream = int.from_bytes(row.astype("<u4").tobytes(), "little")
        for j in range(k):
            q[r, j] = (stream >> (j * bits)) & ((1 << bits) - 1)
    s = np.repeat(scales.reshape(rows.shape[0], -1).astype(np.float64), group_size, -1)
    b = np.repeat(biases.reshape(rows.shape[0], -1).astype(np.float64), group_size, -1)
    once = (s * q + b).astype(np.float32)
    twice = (s * q).astype(np.float32) + b.astype(np.float32)
    return once.reshape(*weight.shape[:-1], k), twice.reshape(*weight.shape[:-1], k)


def assert_one_of(got, candidates):
    """got equals, element by element and bit for bit, one of the candidates."""
    got = np.asarray(got)
    ok = np.zeros(got.shape, bool)
    for c in candidates:
        assert c.dtype == got.dtype and c.shape == got.shape
        ok |= got.view(np.uint8).reshape(*got.shape, -1).__eq__(
            c.view(np.uint8).reshape(*c.shape, -1)).all(-1)
    assert ok.all(), f"{(~ok).sum()} of {ok.size} elements match none of the candidates"


def mlx_tensors(prefix, n, k, bits, group_size, dtype):
    return {
        f"{prefix}.weight": RNG.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32),
        f"{prefix}.scales": (RNG.standard_normal((n, k // group_size)) * 0.1).astype(dtype),
        f"{prefix}.biases": RNG.standard_normal((n, k // group_size)).astype(dtype),
        "other.weight": np.zeros(3, np.float32),
    }


@pytest.mark.parametrize("bits,group_size,dtype", [
    (4, 64, np.float32), (3, 32, ml_dtypes.bfloat16), (6, 128, np.float16), (2, 32, np.float32),
    (5, 64, np.float32), (8, 32, ml_dtypes.bfloat16)])
def test_mlx_tensors_decode_by_spec(bits, group_size, dtype):
    t = mlx_tensors("model.layers.0.mlp.up_proj", 3, 256, bits, group_size, dtype)
    qw = io.from_mlx_tensors(t, "model.layers.0.mlp.up_proj", bits=bits, group_size=group_size)
    assert qw.shape == (3, 256) and qw.dtype == jnp.dtype(dtype)
    p = "model.layers.0.mlp.up_proj"
    want = mlx_affine_reference(t[p + ".weight"], t[p + ".scales"], t[p + ".biases"], bits,
                                group_size)
    assert_one_of(deq(qw), want)


def test_mlx_tensors_round_trip():
    t = mlx_tensors("l", 4, 128, 4, 64, ml_dtypes.bfloat16)
    qw = io.from_mlx_tensors(t, "l", bits=4, group_size=64)
    out = io.to_mlx_tensors(qw, "l")
    assert sorted(out) == ["l.biases", "l.scales", "l.weight"]
    for key, v in out.items():
        assert_bits_equal(v, t[key])
    for mode, mlx_mode in [("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8"), ("affine", "affine")]:
        q = random_qw(mode, (2, 3, 64), group_size=32)
        out = io.to_mlx_tensors(q, "experts")
        assert sorted(out) == sorted(["experts.scales", "experts.weight"] + (
            ["experts.biases"] if mode == "affine" else []))
        back = io.from_mlx_tensors(out, "experts", bits=q.bits, group_size=32, mode=mlx_mode)
        assert_same_qw(back, q)


def test_safetensors_round_trip(tmp_path):
    pytest.importorskip("safetensors")
    qw = quantized((8, 128), "affine", ml_dtypes.bfloat16, bits=4, group_size=64)
    gq = random_qw("mxfp4", (2, 4, 64))
    blocks, scales = io.to_gpt_oss(gq)
    tensors = dict(io.to_mlx_tensors(qw, "m.q_proj"))
    tensors["m.experts.gate_up_proj_blocks"] = blocks
    tensors["m.experts.gate_up_proj_scales"] = scales
    path = tmp_path / "w.safetensors"
    io.save_safetensors(path, tensors)
    loaded = io.load_safetensors(path)
    assert sorted(loaded) == sorted(tensors)
    for key in tensors:
        assert_bits_equal(loaded[key], tensors[key])
    assert loaded["m.q_proj.scales"].dtype == ml_dtypes.bfloat16
    assert_same_qw(io.from_mlx_tensors(loaded, "m.q_proj", bits=4, group_size=64), qw)
    assert_same_qw(io.from_gpt_oss(loaded["m.experts.gate_up_proj_blocks"],
                                   loaded["m.experts.gate_up_proj_scales"]), gq)
    assert_bits_equal(deq(io.from_mlx_tensors(loaded, "m.q_proj", bits=4, group_size=64)),
                      deq(qw))


def test_safetensors_missing_package_says_how_to_install(monkeypatch, tmp_path):
    """Writing needs the package; reading is jaxquant's own bounded reader, without it."""
    a = {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    io.save_safetensors(tmp_path / "x.safetensors", a)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError, match=r"pip install safetensors.*jaxquant\[safetensors\]"):
        io.save_safetensors(tmp_path / "y.safetensors", {})
    np.testing.assert_array_equal(io.load_safetensors(tmp_path / "x.safetensors")["a"], a["a"])


# ---------------------------------------------------------------------------
# Bad inputs: ValueError / TypeError naming the argument.

U8 = np.uint8


def _mxfp4_qw():
    return random_qw("mxfp4", (2, 64))


BAD = [
    (lambda: io.from_gpt_oss(np.zeros((2, 3, 16), np.int8), np.zeros((2, 3), U8)), TypeError,
     "blocks must be uint8"),
    (lambda: io.from_gpt_oss([[1]], np.zeros((2, 3), U8)), TypeError, "blocks must be an array"),
    (lambda: io.from_gpt_oss(np.zeros((3, 16), U8), np.zeros((3,), U8)), ValueError, "blocks"),
    (lambda: io.from_gpt_oss(np.zeros((2, 3, 15), U8), np.zeros((2, 3), U8)), ValueError,
     "blocks must have shape"),
    (lambda: io.from_gpt_oss(np.zeros((2, 3, 16), U8), np.zeros((2, 4), U8)), ValueError,
     "scales must have shape"),
    (lambda: io.from_gpt_oss(np.zeros((2, 3, 16), U8), np.zeros((2, 3), np.float32)), TypeError,
     "scales must be uint8"),
    (lambda: io.from_gpt_oss(np.zeros((2, 3, 16), U8), np.zeros((2, 3), U8), dtype=jnp.int32),
     TypeError, "dtype"),
    (lambda: io.from_ggml_mxfp4(np.zeros((2, 17), np.float32), 32), TypeError,
     "raw must be uint8"),
    (lambda: io.from_ggml_mxfp4(np.zeros((2, 17), U8), 33), ValueError, "k=33"),
    (lambda: io.from_ggml_mxfp4(np.zeros((2, 17), U8), 0), ValueError, "k=0"),
    (lambda: io.from_ggml_mxfp4(np.zeros((2, 17), U8), 64), ValueError, "raw's last axis"),
    (lambda: io.from_ggml_mxfp4(np.zeros(50, U8), 64), ValueError, "raw has 50 bytes"),
    (lambda: io.from_mx_blocks(np.zeros((2, 17), U8), "mxfp8"), ValueError, "mode='mxfp8'"),
    (lambda: io.from_mx_blocks(np.zeros((2, 17), U8), "bogus"), ValueError, "mode='bogus'"),
    (lambda: io.from_mx_blocks(np.zeros((2, 26), U8), "mxfp6_e2m3"), ValueError,
     "raw's last axis"),
    (lambda: io.from_mx_blocks(np.zeros(25, U8), "mxfp6_e3m2"), ValueError, "raw must have"),
    (lambda: io.to_gpt_oss(random_qw("affine", (2, 64))), ValueError,
     "qw.mode='affine'"),
    (lambda: io.to_gpt_oss(np.zeros((2, 8), np.uint32)), TypeError, "qw must be a QuantizedArray"),
    (lambda: io.to_ggml_mxfp4(random_qw("mxfp8_e4m3", (2, 64))),
     ValueError, "qw.mode='mxfp8_e4m3'"),
    (lambda: io.to_mx_blocks(random_qw("nvfp4", (2, 64))),
     ValueError, "qw.mode='nvfp4'"),
    (lambda: io.to_mlx_tensors(random_qw("nvfp4", (2, 64)), "p"),
     ValueError, "global_scale"),
    (lambda: io.to_mlx_tensors(_mxfp4_qw(), 3), TypeError, "prefix must be a str"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.uint32)}, "p", bits=4,
                                 group_size=64), ValueError, "p.scales"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.uint32),
                                  "p.scales": np.zeros((2, 1), np.float32)}, "p", bits=4,
                                 group_size=64), ValueError, "p.biases"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.uint32),
                                  "p.scales": np.zeros((2, 2), U8),
                                  "p.biases": np.zeros((2, 2), U8)}, "p", bits=4,
                                 group_size=32, mode="mxfp4"), ValueError, "p.biases"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.int32),
                                  "p.scales": np.zeros((2, 1), np.float32),
                                  "p.biases": np.zeros((2, 1), np.float32)}, "p", bits=4,
                                 group_size=64), TypeError, "uint32"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.uint32),
                                  "p.scales": np.zeros((2, 2), np.float32),
                                  "p.biases": np.zeros((2, 2), np.float32)}, "p", bits=4,
                                 group_size=64), ValueError, "scales must have shape"),
    (lambda: io.from_mlx_tensors({"p.weight": np.zeros((2, 8), np.uint32)}, "p", bits=7,
                                 group_size=64), ValueError, "bits=7"),
    (lambda: io.from_mlx_tensors([], "p", bits=4, group_size=64), TypeError, "tensors must be"),
    (lambda: io.load_safetensors(123), TypeError, "path"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match.replace("[", r"\[").replace("(", r"\(")):
        call()


def test_unknown_layout_is_refused():
    """A kernel layout is unpacked to the canonical bytes (tests/test_default_layout.py);
    a layout no module registered cannot be, and is named."""
    qw = _mxfp4_qw()
    other = QuantizedArray(qw.data, qw.scales, mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32, layout="some_kernel_layout")
    for fn in (io.to_gpt_oss, io.to_ggml_mxfp4, io.to_mx_blocks):
        with pytest.raises(ValueError, match="layout='some_kernel_layout' is not known"):
            fn(other)
