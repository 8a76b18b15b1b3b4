"""jaxquant.mlx: MLX's signatures and MLX's bits.

The first part checks handcrafted expectations and runs everywhere. The second
compares with real MLX bit for bit; it needs the ``mlx`` package, which has
CPU wheels for Linux x86_64 / aarch64 (and macOS):

    pip install "mlx[cpu]==0.32.4"

and is skipped where ``mlx`` cannot be imported.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.mlx as jqm
from jaxquant.layouts import cuda_mma
from jaxquant.quantized_array import QuantizedArray
from tests.common import xla_rounds_affine_once

RNG = np.random.default_rng(7)
F32 = np.float32
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def unpack(w_q, bits):
    """Independent unpacking: a row's words are one little-endian bit stream,
    element j = bits [j*bits, (j+1)*bits), least significant bit first."""
    w_q = np.asarray(w_q)
    stream = np.unpackbits(w_q.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    fields = stream.reshape(*w_q.shape[:-1], -1, bits).astype(np.int64)
    return fields @ (1 << np.arange(bits))


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def e4m3_code(x):
    """ml_dtypes' float8_e4m3fn rounding (nearest, ties to even) as uint8 codes."""
    return np.asarray(x, F32).astype(E4M3).view(np.uint8)


def block_rows(values, k=32):
    """Rows of k elements: each row starts with `values`, then zeros."""
    w = np.zeros((len(values), k), F32)
    for i, v in enumerate(values):
        w[i, :len(v)] = v
    return w


# ---------------------------------------------------------------------------
# Signatures, tuples, defaults.


@pytest.mark.parametrize("mode,group,bits,n_out,scale_dtype", [
    ("affine", 64, 4, 3, np.float32), ("mxfp4", 32, 4, 2, np.uint8),
    ("mxfp8", 32, 8, 2, np.uint8), ("nvfp4", 16, 4, 2, np.uint8)])
def test_defaults_and_tuples_follow_mlx(mode, group, bits, n_out, scale_dtype):
    w = RNG.standard_normal((2, 3, 128)).astype(F32)
    out = jqm.quantize(w, mode=mode)
    assert len(out) == n_out
    w_q, scales = out[:2]
    assert w_q.dtype == np.uint32 and w_q.shape == (2, 3, 128 * bits // 32)
    assert scales.dtype == scale_dtype and scales.shape == (2, 3, 128 // group)
    if n_out == 3:
        assert out[2].shape == scales.shape and out[2].dtype == scales.dtype
    y = jqm.dequantize(*out, mode=mode)
    assert y.shape == w.shape
    assert y.dtype == (jnp.float32 if mode == "affine" else jnp.bfloat16)  # MLX's default
    assert jqm.dequantize(*out, mode=mode, dtype="float16").dtype == jnp.float16


@pytest.mark.parametrize("bits,group_size,dtype", [(4, 64, F32), (3, 32, BF16), (6, 128, F32)])
def test_affine_is_jq_quantize(bits, group_size, dtype):
    w = RNG.standard_normal((4, 256)).astype(dtype)
    w_q, scales, biases = jqm.quantize(w, group_size, bits)
    qw = jq.quantize(w, "affine", bits, group_size)
    assert_bits_equal(w_q, qw.data)
    assert_bits_equal(scales, qw.scales)
    assert_bits_equal(biases, qw.biases)
    y = jqm.dequantize(w_q, scales, biases, group_size, bits)
    assert_bits_equal(y, jq.dequantize(qw))
    # value = scale * q + bias in float32 from the independently unpacked codes,
    # rounded once (fused multiply-add) or twice (product, then sum)
    q = unpack(w_q, bits).reshape(4, -1, group_size).astype(np.float64)
    s64 = np.asarray(scales, np.float64)[..., None]
    b64 = np.asarray(biases, np.float64)[..., None]
    once = (q * s64 + b64).astype(F32).reshape(4, 256)
    twice = ((q * s64).astype(F32) + b64.astype(F32)).reshape(4, 256)
    got = np.asarray(jqm.dequantize(w_q, scales, biases, group_size, bits, dtype=F32))
    assert ((got.view(np.uint32) == once.view(np.uint32))
            | (got.view(np.uint32) == twice.view(np.uint32))).all()


def test_mxfp4_rounds_ties_toward_zero_and_writes_plus_zero():
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, -0.2, -0.0, -0.25, 0.2, 5.5]
    w_q, scales = jqm.quantize(block_rows([ties]), mode="mxfp4")
    assert int(np.asarray(scales)[0, 0]) == 127  # amax 6 = 6 * 2**0
    vals = E2M1[unpack(w_q, 4)[0, :len(ties)]]
    assert vals.tolist() == [6, 0, .5, 1, 1.5, 2, 3, 4, -.5, -3, 0, 0, 0, 0, 6]
    assert not np.signbit(vals[10:13]).any()  # -0.2, -0.0, -0.25 -> code 0, not 8


def test_mxfp4_shared_exponent_is_rceil():
    # amax = 6 * 2**k -> exponent k; a hair above -> k + 1 (no element saturates).
    k = np.array([-20, -1, 0, 3, 40])
    exact = 6.0 * 2.0**k
    above = np.nextafter(exact.astype(F32), F32(np.inf))
    w = block_rows([[a] for a in np.concatenate([exact, above])])
    _, scales = jqm.quantize(w, mode="mxfp4")
    assert np.asarray(scales)[:, 0].tolist() == list(127 + k) + list(128 + k)
    _, scales8 = jqm.quantize(block_rows([[448.0], [449.0], [-448.0 * 2**-30]]), mode="mxfp8")
    assert np.asarray(scales8)[:, 0].tolist() == [127, 128, 97]
    # an all-zero block: MLX writes 2**0 (127) where OCP's rule would give 2**-127 (0)
    for mode in ("mxfp4", "mxfp8"):
        w_q, s0 = jqm.quantize(np.zeros((2, 64), F32), mode=mode)
        assert (np.asarray(s0) == 127).all() and (np.asarray(w_q) == 0).all()


def test_mxfp8_keeps_negative_zero_and_rounds_to_even():
    w = block_rows([[448.0, -1e-30, -0.0, 1.0625, 1.1875, 0.0]])
    w_q, _ = jqm.quantize(w, mode="mxfp8")
    codes = unpack(w_q, 8)[0, :6]
    assert codes.tolist() == [0x7E, 0x80, 0x80, int(e4m3_code(1.0)), int(e4m3_code(1.25)), 0]


def test_nvfp4_without_global_scale():
    rows = [[6.0, 1.0, -3.0], [4.5, 0.75, 2.26], [0.0, -0.0], [1e-3, -4e-4], [1e6, 3.0]]
    w = block_rows(rows, k=32)  # the second group of 16 in each row is all zeros
    w_q, scales = jqm.quantize(w, mode="nvfp4")
    assert np.asarray(scales).shape == (5, 2) and (np.asarray(scales)[:, 1] == 0).all()
    target = np.abs(w[:, :16]).max(-1) / F32(6)
    want = np.where(target > 448, np.uint8(0x7E), e4m3_code(np.minimum(target, 448)))
    assert_bits_equal(np.asarray(scales)[:, 0], want)  # 1e6 / 6 saturates at 448 (0x7E)
    s = np.asarray(scales)[:, :1].view(E4M3).astype(F32)
    x = np.where(s != 0, w[:, :16] / np.where(s != 0, s, 1), 0)
    codes = unpack(w_q, 4)
    assert_bits_equal(codes[:, :16], mlx_e2m1(x))
    assert (codes[:, 16:] == 0).all()
    assert E2M1[codes[1, :3]].tolist() == [6.0, 1.0, 3.0]  # 0.75/0.75 = 1, 2.26/.75 -> 3
    assert (codes[2] == 0).all() and (codes[3] == 0).all()  # zero scale -> +0 codes


def mlx_e2m1(x):
    """E2M1 codes of x, nearest with ties toward zero, zero always +0 (test's own
    implementation, by comparison with the value table)."""
    x = np.asarray(x, np.float64)
    mags = E2M1[:8]
    d = np.abs(np.abs(x)[..., None] - mags)
    code = np.argmin(d, axis=-1)  # first minimum: the smaller magnitude on a tie
    code = np.where(np.abs(x) >= 6, 7, code)
    return np.where((x < 0) & (code > 0), code + 8, code)


def test_nvfp4_scale_division_is_correctly_rounded_under_jit():
    # amax / 6 on and next to e4m3 rounding midpoints. XLA turns a division by a
    # constant into a multiplication by f32(1/6), which is off by an ulp now and
    # then, and an ulp next to a midpoint decides the e4m3 code.
    mids = np.array([(1 + (2 * m + 1) / 16) * 2.0**e for e in range(-6, 8) for m in range(8)])
    amax = [(6 * mids).astype(F32)]
    for direction in (np.inf, 0):
        a = amax[0]
        for _ in range(3):
            a = np.nextafter(a, F32(direction))
            amax.append(a)
    amax = np.concatenate(amax)
    w = np.zeros((len(amax), 32), F32)
    w[:, 0] = amax
    want = e4m3_code(amax / F32(6))  # numpy divides correctly rounded
    assert (want != e4m3_code((amax * F32(1 / 6)).astype(F32))).any()  # the trap is armed
    for fn in (jqm.quantize, jax.jit(jqm.quantize, static_argnames="mode")):
        _, scales = fn(w, mode="nvfp4")
        assert_bits_equal(np.asarray(scales)[:, 0], want)
    n = len(mids)  # exact midpoints in bfloat16 input: ties to even after MLX's bf16 division
    _, scales = jqm.quantize(w[:n].astype(BF16), mode="nvfp4")
    assert_bits_equal(np.asarray(scales)[:, 0], e4m3_code(mids))


def test_nvfp4_with_global_scale_uses_mlx_convention():
    w = (RNG.standard_normal((4, 64)) * 3).astype(F32)
    g = F32(np.abs(w).max())
    w_q, scales = jqm.quantize(w, mode="nvfp4", global_scale=g)
    amax = np.abs(w).reshape(4, 4, 16).max(-1)
    assert_bits_equal(scales, e4m3_code(amax / F32(6) * (F32(2688) / g)))
    dec = g / F32(2688)
    y = np.asarray(jqm.dequantize(w_q, scales, mode="nvfp4", global_scale=g, dtype=F32))
    s = np.asarray(scales).view(E4M3).astype(F32)
    want = (E2M1[unpack(w_q, 4)].astype(F32).reshape(4, 4, 16) * s[..., None]) * dec
    assert_bits_equal(y, want.reshape(4, 64))
    # the QuantizedArray stores g / 2688; to_mlx gives a g MLX maps to the same multiplier
    qw = jqm.from_mlx(w_q, scales, mode="nvfp4", group_size=16, bits=4, global_scale=g)
    assert np.asarray(qw.global_scale) == dec
    assert len(jqm.to_mlx(qw)) == 3 and np.asarray(jqm.to_mlx(qw)[2]) / F32(2688) == dec


def test_global_scale_round_trip_preserves_the_multiplier():
    gs = np.concatenate([RNG.uniform(1e-3, 1e4, 200), [1.0, 2688.0, 448.0 * 6 * 3]]).astype(F32)
    for g in gs:
        mult = np.asarray(jqm._global_scale_from_mlx(g))
        assert mult == g / F32(2688)  # numpy's division is correctly rounded
        g2 = np.asarray(jqm._global_scale_to_mlx(mult))
        assert g2 / F32(2688) == mult


def test_global_scale_per_expert():
    w_q, scales = jqm.quantize(RNG.standard_normal((2, 4, 32)).astype(F32), mode="nvfp4")
    g = np.array([3.0, 1e3], F32)
    qw = jqm.from_mlx(w_q, scales, mode="nvfp4", group_size=16, bits=4, global_scale=g)
    assert_bits_equal(qw.global_scale, g / F32(2688))
    # to_mlx gives a g' that MLX maps to the same multiplier (not always g itself)
    assert_bits_equal(np.asarray(jqm.to_mlx(qw)[2]) / F32(2688), g / F32(2688))
    y = np.asarray(jqm.dequantize(w_q, scales, mode="nvfp4", global_scale=g, dtype=F32))
    for e in range(2):
        ye = jqm.dequantize(w_q[e], scales[e], mode="nvfp4", global_scale=g[e], dtype=F32)
        assert_bits_equal(y[e], ye)
    with pytest.raises(ValueError, match="global_scale must be"):
        jqm.from_mlx(w_q, scales, mode="nvfp4", group_size=16, bits=4, global_scale=g[:1].repeat(3))


def test_from_mlx_to_mlx_share_arrays():
    w_q, scales, biases = jqm.quantize(RNG.standard_normal((3, 64)).astype(F32), 32, 4)
    qw = jqm.from_mlx(w_q, scales, biases, group_size=32, bits=4, mode="affine")
    assert qw.shape == (3, 64) and qw.dtype == jnp.float32
    out = jqm.to_mlx(qw)
    assert out[0] is w_q and out[1] is scales and out[2] is biases
    w4, s4 = jqm.quantize(RNG.standard_normal((2, 5, 64)).astype(F32), mode="mxfp4")
    n4 = (np.asarray(w4), np.asarray(s4))  # numpy stays numpy
    q4 = jqm.from_mlx(*n4, group_size=None, bits=None, mode="mxfp4")
    assert q4.mode == "mxfp4" and q4.dtype == jnp.bfloat16 and q4.data is n4[0]
    assert len(jqm.to_mlx(q4)) == 2 and jqm.to_mlx(q4)[1] is n4[1]
    q8 = jqm.from_mlx(*jqm.quantize(np.ones((2, 32), F32), mode="mxfp8"), group_size=32,
                      bits=8, mode="mxfp8")
    assert q8.mode == "mxfp8_e4m3"


def test_dequantize_under_jit_and_vmap():
    w_q, scales, biases = jqm.quantize(RNG.standard_normal((2, 4, 256)).astype(F32), 64, 4)
    eager = jqm.dequantize(w_q, scales, biases, 64, 4)
    jitted = jax.jit(lambda a, b, c: jqm.dequantize(a, b, c, 64, 4))(w_q, scales, biases)
    mapped = jax.vmap(lambda a, b, c: jqm.dequantize(a, b, c, 64, 4))(w_q, scales, biases)
    assert_bits_equal(jitted, eager)
    assert_bits_equal(mapped, eager)
    w = RNG.standard_normal((4, 256)).astype(F32)
    a = jqm.quantize(w, mode="nvfp4", global_scale=F32(3.0))
    b = jax.jit(lambda x, g: jqm.quantize(x, mode="nvfp4", global_scale=g))(w, F32(3.0))
    for x, y in zip(a, b):
        assert_bits_equal(x, y)


_jit_quantize = jax.jit(jq.quantize, static_argnames=("mode", "bits", "group_size", "scale_rule"))


def test_jaxquant_only_modes_are_accepted():
    w = RNG.standard_normal((2, 64)).astype(F32)
    for mode in ("mxfp6_e2m3", "fp4"):
        out = jqm.quantize(w, mode=mode)
        qw = _jit_quantize(w, mode=mode, **({"scale_rule": "rceil"} if mode != "fp4" else {}))
        assert_bits_equal(out[0], qw.data)
        assert_bits_equal(jqm.dequantize(*out, mode=mode, dtype=F32),
                          jq.dequantize(qw, dtype=F32))


BAD = [
    (lambda: jqm.dequantize(np.zeros((2, 8), np.int32), np.zeros((2, 1), F32),
                            np.zeros((2, 1), F32)), jqm.DtypeError, "w must be uint32"),
    (lambda: jqm.dequantize(np.zeros(8, np.uint32), np.zeros(1, F32), np.zeros(1, F32)),
     ValueError, "w must have at least 2 dimensions"),
    (lambda: jqm.dequantize(np.zeros((2, 8), np.uint32), np.zeros((2, 2), F32),
                            np.zeros((2, 2), F32)), ValueError, "scales must have shape"),
    (lambda: jqm.dequantize(np.zeros((2, 8), np.uint32), np.zeros((2, 1), F32)), ValueError,
     "biases=None"),
    (lambda: jqm.dequantize(np.zeros((2, 8), np.uint32), np.zeros((2, 1), F32),
                            np.zeros((2, 1), np.float16)), ValueError, "biases must match"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8),
                            np.zeros((2, 1), np.uint8), mode="mxfp4"), ValueError, "no biases"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), F32), mode="mxfp4"),
     jqm.DtypeError, "scales for mode='mxfp4' must be uint8"),
    (lambda: jqm.dequantize(np.zeros((2, 8), np.uint32), np.zeros((2, 1), np.uint8),
                            np.zeros((2, 1), np.uint8)), jqm.DtypeError, "float dtype"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8), bits=3,
                            mode="mxfp4"), ValueError, "bits=3"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8),
                            group_size=64, mode="mxfp4"), ValueError, "group_size=64"),
    (lambda: jqm.dequantize(np.zeros((2, 3), np.uint32), np.zeros((2, 1), F32),
                            np.zeros((2, 1), F32), 32, 4), ValueError, "whole number of groups"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8),
                            mode="mxfp4", global_scale=1.0), ValueError, "global_scale"),
    (lambda: jqm.dequantize(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8),
                            mode="mxfp4", dtype=np.int32), jqm.DtypeError, "dtype"),
    (lambda: jqm.quantize(np.ones((2, 64), F32), mode="int4"), ValueError, "mode='int4'"),
    (lambda: jqm.quantize(np.ones((2, 64), F32), mode=4), TypeError, "mode must be a str"),
    (lambda: jqm.quantize(np.ones((2, 64), F32), bits=1), ValueError, "bits=1"),
    (lambda: jqm.quantize(np.ones((2, 48), F32), mode="mxfp4"), ValueError, "group_size=32"),
    (lambda: jqm.quantize(np.ones((2, 48), F32), mode="nvfp4", group_size=16, bits=4,
                          global_scale=np.ones(2, F32)), ValueError, "global_scale must be"),
    (lambda: jqm.quantize(np.ones(64, F32), mode="nvfp4"), ValueError, "at least 2 dimensions"),
    (lambda: jqm.quantize(np.ones((2, 64), np.int32), mode="mxfp4"), jqm.DtypeError, "w must be"),
    (lambda: jqm.quantize(np.ones((2, 64), F32), mode="mxfp8", global_scale=1.0), ValueError,
     "global_scale"),
    (lambda: jqm.to_mlx(np.zeros((2, 4), np.uint32)), TypeError, "QuantizedArray"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match.replace("(", r"\(").replace("[", r"\[")):
        call()


def test_to_mlx_unpacks_kernel_layouts():
    qw = jq.quantize(jnp.linspace(-1, 1, 16 * 64).reshape(16, 64), mode="mxfp4",
                     layout="canonical")
    packed = jq.prepack(qw, layout=cuda_mma.NAME)
    assert not np.array_equal(np.asarray(packed.data), np.asarray(qw.data))
    for got, want in zip(jqm.to_mlx(packed), jqm.to_mlx(qw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    unknown = QuantizedArray(np.zeros((2, 4), np.uint32), np.zeros((2, 1), np.uint8),
                             mode="mxfp4", bits=4, group_size=32, dtype=jnp.float32,
                             layout="tiles")
    with pytest.raises(ValueError, match="layout='tiles' is not known"):
        jqm.to_mlx(unknown)


# ---------------------------------------------------------------------------
# Against real MLX.

try:
    import mlx.core as mx
except ImportError:  # pragma: no cover - depends on the environment
    mx = None

needs_mlx = pytest.mark.skipif(
    mx is None, reason='needs MLX: pip install "mlx[cpu]==0.32.4" (CPU wheels for Linux and macOS)')


def to_mx(a):
    a = np.asarray(a)
    if a.dtype == BF16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def from_mx(a):
    return jqm._mlx_to_numpy(a)


MX_DTYPES = {"float32": F32, "float16": np.float16, "bfloat16": BF16}


def mlx_test_weights(dtype, mode):
    """Random rows over a wide range, plus rows that hit ties and exponent edges."""
    w = RNG.standard_normal((2, 24, 256)) * np.exp(RNG.uniform(-6, 6, (2, 24, 1)))
    special = np.zeros((2, 8, 256))
    gsz = 16 if mode == "nvfp4" else 32
    if mode == "mxfp8":  # E4M3 ties, signed zeros, saturation edge
        ties = np.array([448.0, 1.0625, 1.1875, -1.0625, -0.0, -1e-30, 248.0, 0.5])
    else:  # E2M1 ties (amax 6: the scale is 1 in every mode), signed zeros
        ties = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, -0.2, -0.0,
                         -0.25, 0.2, -1.75, 1.0])
    for b in range(256 // gsz):
        special[0, b % 8, b * gsz:b * gsz + len(ties[:gsz])] = ties[:gsz] * 2.0 ** (b - 4)
    special[1, :, ::gsz] = 6.0 * 2.0 ** np.arange(-3, 5)[:, None]
    special[1, :4, 1::gsz] = np.nextafter(F32(6.0), F32(7))
    return np.concatenate([w, special], axis=1).astype(dtype)


# Every error case of MLX 0.32.4's python/tests/test_quantized.py (test_mode_error_cases,
# test_mxfp4/mxfp8/nvfp4_quantize_dequantize, test_throw), plus the same checks on the
# other entry points. MLX raises ValueError for all of them; jq.mlx raises ValueError or
# jqm.DtypeError (a ValueError and a TypeError). Each case is a function of the module
# (mlx.core or jaxquant.mlx) and of a converter from numpy to that module's arrays.
_EW = RNG.standard_normal((256, 256)).astype(F32)
_EX = RNG.standard_normal((1, 256)).astype(F32)
_EWQ, _ES, _EB = (np.asarray(a) for a in jqm.quantize(_EW, 32, 4))
_FP = {m: tuple(np.asarray(a) for a in jqm.quantize(_EW.astype(BF16), mode=m))
       for m in ("mxfp4", "mxfp8", "nvfp4")}
_I32 = lambda a: np.zeros(np.shape(a), np.int32)
_int32 = lambda L: np.int32 if L is jqm else mx.int32
MLX_ERROR_CASES = {
    "quantize-mode-xyz": lambda L, c: L.quantize(c(_EW), mode="xyz"),
    "dequantize-mode-xyz": lambda L, c: L.dequantize(c(_EWQ), c(_ES), c(_EB), bits=4,
                                                     group_size=32, mode="xyz"),
    "qmm-mode-xyz": lambda L, c: L.quantized_matmul(c(_EX), c(_EWQ), c(_ES), c(_EB), bits=4,
                                                    group_size=32, mode="xyz"),
    "gather-mode-xyz": lambda L, c: L.gather_qmm(c(_EX), c(_EWQ), c(_ES), c(_EB),
                                                 rhs_indices=c(np.array(0)), bits=4,
                                                 group_size=32, mode="xyz"),
    # jaxquant's affine takes group 16 (GGUF's Q6_K / Q2_K); MLX's does not
    "quantize-affine-group16": lambda L, c: L.quantize(c(_EW), group_size=16, bits=4),
    "quantize-int32": lambda L, c: L.quantize(c(np.zeros((128, 128), np.int32))),
    "quantize-int32-mxfp4": lambda L, c: L.quantize(c(np.zeros((128, 128), np.int32)),
                                                    mode="mxfp4"),
    "dequantize-no-biases": lambda L, c: L.dequantize(c(_EWQ), c(_ES), None, bits=4,
                                                      group_size=32),
    "qmm-no-biases": lambda L, c: L.quantized_matmul(c(_EX), c(_EWQ), c(_ES), None, bits=4,
                                                     group_size=32),
    "gather-no-biases": lambda L, c: L.gather_qmm(c(_EX), c(_EWQ), c(_ES), None,
                                                  rhs_indices=c(np.array(0)), bits=4,
                                                  group_size=32),
    "dequantize-int-scales": lambda L, c: L.dequantize(c(_EWQ), c(_I32(_ES)), c(_I32(_EB)),
                                                       bits=4, group_size=32),
    "qmm-int-x-and-scales": lambda L, c: L.quantized_matmul(
        c(np.zeros(256, np.int32)), c(_EWQ), c(_I32(_ES)), c(_I32(_EB)), bits=4, group_size=32),
    "qmm-int-scales": lambda L, c: L.quantized_matmul(c(_EX), c(_EWQ), c(_I32(_ES)),
                                                      c(_I32(_EB)), bits=4, group_size=32),
    "gather-int-x-and-scales": lambda L, c: L.gather_qmm(
        c(np.zeros(256, np.int32)), c(_EWQ), c(_I32(_ES)), c(_I32(_EB)),
        rhs_indices=c(np.array(0)), bits=4, group_size=32),
    "gather-float-indices": lambda L, c: L.gather_qmm(c(_EX), c(_EWQ[None]), c(_ES[None]),
                                                      c(_EB[None]), rhs_indices=c(np.zeros(1, F32)),
                                                      bits=4, group_size=32),
    "dequantize-int-w": lambda L, c: L.dequantize(c(_EWQ.astype(np.int32)), c(_ES), c(_EB),
                                                  bits=4, group_size=32),
    "dequantize-int-dtype": lambda L, c: L.dequantize(c(_EWQ), c(_ES), c(_EB), bits=4,
                                                      group_size=32, dtype=_int32(L)),
    "qmm-w-transposed": lambda L, c: L.quantized_matmul(c(_EX), c(_EWQ.T), c(_ES), c(_EB),
                                                        bits=4, group_size=32),
    "qmm-transpose-false": lambda L, c: L.quantized_matmul(
        c(RNG.standard_normal((1, 64)).astype(F32)), c(_EWQ[:, :8]), c(_ES[:, :2]),
        c(_EB[:, :2]), False, bits=4, group_size=32),
    "qmm-scales-transposed": lambda L, c: L.quantized_matmul(c(_EX), c(_EWQ), c(_ES.T),
                                                             c(_EB.T), bits=4, group_size=32),
    "quantize-1d": lambda L, c: L.quantize(c(_EW[0])),
    "quantize-bits-7": lambda L, c: L.quantize(c(_EW), bits=7),
    "mxfp8-global-scale": lambda L, c: L.quantize(c(_EW), mode="mxfp8",
                                                  global_scale=c(np.float32(1))),
}
for _m, _bits, _gs in (("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)):
    MLX_ERROR_CASES.update({
        f"{_m}-quantize-bits-3": lambda L, c, m=_m: L.quantize(c(_EW.astype(BF16)), bits=3,
                                                               mode=m),
        f"{_m}-quantize-group-64": lambda L, c, m=_m: L.quantize(c(_EW.astype(BF16)),
                                                                 group_size=64, mode=m),
        f"{_m}-dequantize-bits": lambda L, c, m=_m, b=_bits: L.dequantize(
            *map(c, _FP[m]), bits=12 - b, mode=m),
        f"{_m}-dequantize-group": lambda L, c, m=_m, g=_gs: L.dequantize(
            *map(c, _FP[m]), group_size=48 - g, mode=m),
        f"{_m}-dequantize-int-dtype": lambda L, c, m=_m: L.dequantize(*map(c, _FP[m]), mode=m,
                                                                      dtype=_int32(L)),
        f"{_m}-dequantize-float-scales": lambda L, c, m=_m: L.dequantize(
            c(_FP[m][0]), c(_FP[m][1].astype(F32)), mode=m),
        f"{_m}-dequantize-biases": lambda L, c, m=_m: L.dequantize(
            c(_FP[m][0]), c(_FP[m][1]), c(_FP[m][1]), mode=m),
    })


@pytest.mark.parametrize("case", list(MLX_ERROR_CASES))
def test_errors_raise_mlx_exception_classes(case):
    call = MLX_ERROR_CASES[case]
    if mx is not None:  # MLX itself: the class this test expects is MLX's
        with pytest.raises(Exception) as theirs:
            call(mx, to_mx)
        assert type(theirs.value) is ValueError, theirs.value
    inputs = [lambda a: a] + ([to_mx] if mx is not None else [])  # numpy and MLX arrays
    for convert in inputs:
        with pytest.raises(ValueError) as ours:
            call(jqm, convert)
        if isinstance(ours.value, TypeError):  # jaxquant's own API says TypeError here
            assert isinstance(ours.value, jqm.DtypeError), ours.value


MLX_CASES = [("affine", {"group_size": 64, "bits": 4}), ("affine", {"group_size": 32, "bits": 3}),
             ("affine", {"group_size": 128, "bits": 6}), ("mxfp4", {}), ("mxfp8", {}),
             ("nvfp4", {}), ("nvfp4", {"global_scale": True})]


@needs_mlx
@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("mode,kw", MLX_CASES, ids=[f"{m}-{'-'.join(map(str, k.values()))}"
                                                   for m, k in MLX_CASES])
def test_quantize_matches_mlx(dtype, mode, kw):
    w = mlx_test_weights(MX_DTYPES[dtype], mode)
    kw = dict(kw)
    g = None
    if kw.pop("global_scale", False):
        g = F32(np.abs(w.astype(F32)).max())
    ours = jqm.quantize(w, mode=mode, global_scale=g, **kw)
    theirs = mx.quantize(to_mx(w), mode=mode, **kw,
                         **({"global_scale": mx.array(g)} if g is not None else {}))
    assert len(ours) == len(theirs)
    if g is not None and dtype != "float32":
        # Documented: MLX's half-precision nvfp4 path with a global scale computes the
        # element quotient in a way we do not reproduce; scales are identical, and
        # elements differ only next to rounding ties (jaxquant/mlx.py: measured up to
        # 0.49% of codes in bfloat16, 0.06% in float16).
        assert_bits_equal(ours[1], from_mx(theirs[1]))
        same = unpack(ours[0], 4) == unpack(from_mx(theirs[0]), 4)
        assert same.mean() > 0.99
        return
    for a, b in zip(ours, theirs):
        assert_bits_equal(a, from_mx(b))


@needs_mlx
@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_mx_scale_next_to_powers_of_two_matches_mlx(dtype, mode):
    """Blocks whose largest magnitude lies within 2% of max_value * 2**e, e from -30 to
    7: MLX divides by max_value in w's dtype (float16: the quotient can round to a power
    of two, be subnormal or round to 0), jq.mlx the same."""
    rng = np.random.default_rng(11)
    maxv = 448.0 if mode == "mxfp8" else 6.0
    n = 4000
    amax = maxv * 2.0 ** rng.integers(-30, 8, n) * (1 + rng.uniform(-0.02, 0.02, n))
    w = rng.uniform(-1, 1, (n, 32)) * amax[:, None]
    w[:, 0] = amax
    w = w.astype(MX_DTYPES[dtype])
    w = w[np.abs(w.astype(F32)).max(1) < np.inf]  # non-finite blocks differ on purpose
    for a, b in zip(jqm.quantize(w, mode=mode), mx.quantize(to_mx(w), mode=mode)):
        assert_bits_equal(a, from_mx(b))


@needs_mlx
@pytest.mark.parametrize("dtype", list(MX_DTYPES))
@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4", "affine"])
def test_dequantize_matches_mlx(dtype, mode):
    w = mlx_test_weights(MX_DTYPES[dtype], mode)
    arrays = mx.quantize(to_mx(w), mode=mode)
    for out in ("float32", None):
        mdt = None if out is None else getattr(mx, out)
        theirs = from_mx(mx.dequantize(*arrays, mode=mode, dtype=mdt))
        ours = np.asarray(jqm.dequantize(*[from_mx(a) for a in arrays], mode=mode, dtype=mdt))
        assert ours.dtype == theirs.dtype
        if mode == "affine":
            # Documented: MLX's CPU path computes T(T(scale * q) + bias) in the scales'
            # dtype T (two roundings); jq.mlx is jq.dequantize: scale * q + bias in
            # float32 rounded once (a fused multiply-add), then cast to the output dtype.
            q = unpack(arrays[0], 4).reshape(2, 32, 4, 64).astype(np.float64)
            s, b = (from_mx(a).astype(np.float64)[..., None] for a in arrays[1:])
            t = MX_DTYPES[dtype]
            mlx_rule = ((q * s).astype(t).astype(np.float64) + b).astype(t)
            assert_bits_equal(theirs, mlx_rule.astype(theirs.dtype).reshape(theirs.shape))
            once = (q * s + b).astype(F32).astype(ours.dtype).reshape(ours.shape)
            assert_bits_equal(ours, once)
            if out is None:  # the docstring's bound: 1 ulp of max(|scale * q|, |output|) in T
                product = (q * s).astype(t).astype(np.float64).reshape(theirs.shape)
                big = np.maximum(np.abs(product), np.abs(theirs.astype(np.float64))).astype(t)
                d = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
                assert (d <= np.spacing(big).astype(np.float64)).all()
        else:
            assert_bits_equal(ours, theirs)


@needs_mlx
@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_affine_dequantize_rounds_once_where_mlx_rounds_twice(backend):
    """The decision (jaxquant/mlx.py's docstring): jq.mlx keeps jq.dequantize's one
    rounding of scale * q + bias rather than copying MLX's CPU path, which rounds the
    product to the scales' dtype first. In float32 they differ by at most half an ulp
    of the product plus one of the output (at about half the elements; other dtypes:
    test_dequantize_matches_mlx). At a group's zero point MLX's
    product rounds to exactly -bias, so MLX gives 0.0 where jq.mlx gives the exact
    value of the stored scale and bias, a residual such as 6e-8."""
    if backend not in jq.available_backends():
        pytest.skip(f"backend {backend!r} is not available here")
    w = RNG.standard_normal((64, 256)).astype(F32)
    w_q, scales, biases = (np.asarray(a) for a in jqm.quantize(w, 64, 4))
    theirs = from_mx(mx.dequantize(*map(to_mx, (w_q, scales, biases)), 64, 4))
    ours = np.asarray(jqm.dequantize(w_q, scales, biases, 64, 4, backend=backend))
    q = unpack(w_q, 4).reshape(64, 4, 64).astype(np.float64)
    s, b = scales[..., None].astype(np.float64), biases[..., None].astype(np.float64)
    product = (q * s).astype(F32)  # exact in float64, rounded once to float32
    assert_bits_equal(theirs, (product + biases[..., None]).reshape(64, 256))  # two roundings
    if backend == "reference" and not xla_rounds_affine_once():
        # the reference is XLA's arithmetic: compiled without LLVM optimization (the test
        # suite's XLA:CPU, tests/conftest.py) it rounds twice, like MLX's CPU path
        assert_bits_equal(ours, theirs)
        return
    assert_bits_equal(ours, (q * s + b).astype(F32).reshape(64, 256))  # one rounding
    half_ulp = (np.spacing(np.abs(product)) / 2).reshape(64, 256)
    assert (np.abs(ours.astype(np.float64) - theirs) <= half_ulp + np.spacing(np.abs(theirs))).all()
    differ = ours != theirs
    assert 0.2 < differ.mean() < 0.8, differ.mean()
    zero_point = (theirs == 0) & (ours != 0)
    assert zero_point.any()
    assert (np.abs(ours[zero_point]) <= half_ulp[zero_point]).all()


@needs_mlx
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nvfp4_global_scale_dequantize_returns_the_asked_dtype(dtype):
    """MLX 0.32's CPU nvfp4 dequantize with a global scale returns float32 whatever
    dtype is asked (it multiplies by g / 2688 as a float32 array, which promotes);
    jq.mlx returns the asked dtype, as MLX does without a global scale. The values
    are the float32 result rounded once to that dtype. If MLX fixes this, the first
    assertion fails: then compare bits here instead."""
    w = RNG.standard_normal((16, 64)).astype(F32)
    g = np.float32(np.abs(w).max())
    w_q, scales = mx.quantize(to_mx(w), mode="nvfp4", global_scale=mx.array(g))
    asked = getattr(mx, dtype)
    theirs = mx.dequantize(w_q, scales, mode="nvfp4", global_scale=mx.array(g), dtype=asked)
    assert theirs.dtype == mx.float32  # MLX's quirk
    assert mx.dequantize(w_q, scales, mode="nvfp4", dtype=asked).dtype == asked  # no g: asked
    args = (from_mx(w_q), from_mx(scales))
    ours = np.asarray(jqm.dequantize(*args, mode="nvfp4", global_scale=g, dtype=dtype))
    ours32 = np.asarray(jqm.dequantize(*args, mode="nvfp4", global_scale=g, dtype=F32))
    assert ours.dtype == MX_DTYPES[dtype]
    assert_bits_equal(ours, ours32.astype(ours.dtype))
    # float32 values within an ulp of MLX's (e2m1 * (e4m3 * m) vs (e2m1 * e4m3) * m)
    np.testing.assert_allclose(ours32, from_mx(theirs), rtol=2**-23, atol=0)


@needs_mlx
@pytest.mark.parametrize("mode,jq_mode", [("mxfp4", "mxfp4"), ("mxfp8", "mxfp8_e4m3"),
                                          ("affine", "affine")])
def test_mlx_reads_jaxquant_arrays(mode, jq_mode):
    w = RNG.standard_normal((3, 16, 128)).astype(F32)
    qw = jq.quantize(w, mode=jq_mode)  # jaxquant's own rules (floor scales, ties to even)
    theirs = from_mx(mx.dequantize(*[to_mx(a) for a in jqm.to_mlx(qw)], mode=mode,
                                   dtype=mx.float32))
    ours = np.asarray(jq.dequantize(qw, dtype=F32))
    if mode == "affine":  # MLX rounds the product first (see test_dequantize_matches_mlx)
        q = unpack(qw.data, 4).reshape(3, 16, 2, 64).astype(F32)
        s, b = (np.asarray(a)[..., None] for a in (qw.scales, qw.biases))
        assert_bits_equal(theirs, (q * s + b).reshape(theirs.shape))  # numpy: two roundings
        assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    else:
        assert_bits_equal(ours, theirs)


@needs_mlx
def test_mlx_reads_jaxquant_nvfp4_with_global_scale():
    w = RNG.standard_normal((16, 64)).astype(F32)
    qw = jq.quantize(w, mode="nvfp4")  # always has a global scale
    w_q, scales, g = jqm.to_mlx(qw)
    theirs = from_mx(mx.dequantize(to_mx(w_q), to_mx(scales), mode="nvfp4",
                                   global_scale=mx.array(np.asarray(g)), dtype=mx.float32))
    ours = np.asarray(jq.dequantize(qw, dtype=F32))
    # MLX: e2m1 * (e4m3 * m); jaxquant: (e2m1 * e4m3) * m, m the same float32 multiplier.
    m = np.asarray(qw.global_scale, F32)
    s = np.asarray(scales).view(E4M3).astype(F32)
    e = E2M1[unpack(w_q, 4)].astype(F32).reshape(16, 4, 16)
    # MLX multiplies by g / 2688 of the g it is given. Not every float32 multiplier m
    # is such a quotient (g / 2688 steps over some: 9 of 600 random draws here), so
    # to_mlx gives the g whose quotient is m where one exists, else the nearest.
    mlx_m = F32(np.asarray(g, F32) / F32(2688))
    assert abs(mlx_m - m) <= np.spacing(m)
    assert_bits_equal(theirs, (e * (s * mlx_m)[..., None]).reshape(16, 64))
    assert_bits_equal(ours, ((e * s[..., None]) * m).reshape(16, 64))


@needs_mlx
@pytest.mark.parametrize("seed", [264, 400, 1])  # multipliers MLX's g / 2688 can / cannot give
def test_nvfp4_global_scale_export_is_exact_where_mlx_can_express_it(seed):
    w = np.random.default_rng(seed).standard_normal((16, 64)).astype(F32)
    qw = jq.quantize(w, mode="nvfp4")
    m = np.asarray(qw.global_scale, F32)
    g = np.asarray(jqm.to_mlx(qw)[2], F32)
    # every g within 64 float32 steps of m * 2688: is any quotient exactly m?
    near = np.nextafter(F32(m * F32(2688)), F32(np.inf)) - F32(m * F32(2688))
    cands = F32(m * F32(2688)) + near * np.arange(-64, 65, dtype=F32)
    expressible = np.any(cands / F32(2688) == m)
    assert (F32(g / F32(2688)) == m) == expressible


@needs_mlx
def test_mlx_safetensors_interop(tmp_path):
    pytest.importorskip("safetensors")
    from jaxquant import io

    w = mx.array(RNG.standard_normal((32, 128)).astype(F32)).astype(mx.bfloat16)
    w_q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    mx.save_safetensors(str(tmp_path / "mlx.safetensors"),
                        {"q_proj.weight": w_q, "q_proj.scales": scales, "q_proj.biases": biases})
    qw = io.from_mlx_tensors(io.load_safetensors(tmp_path / "mlx.safetensors"), "q_proj",
                             bits=4, group_size=64)
    assert qw.dtype == jnp.bfloat16
    for ours, theirs in zip((qw.data, qw.scales, qw.biases), (w_q, scales, biases)):
        assert_bits_equal(ours, from_mx(theirs))
    # MLX rounds scale * q and then the sum to bfloat16 (see above), each within half a
    # bfloat16 ulp, 2^-8 relative: near a group's zero point the sum is far below the
    # product (a fixed tolerance failed there for some draws)
    theirs = from_mx(mx.dequantize(w_q, scales, biases, 64, 4, dtype=mx.float32))
    q = unpack(np.asarray(qw.data), 4).reshape(32, 2, 64).astype(np.float64)
    product = np.abs(q * np.asarray(qw.scales, np.float64)[..., None]).reshape(32, 128)
    ours = np.asarray(jq.dequantize(qw, dtype=F32), np.float64)
    assert (np.abs(ours - theirs) <= 2.0**-8 * (product + np.abs(theirs))
            + 2.0**-23 * np.abs(ours)).all()
    # and back: MLX loads what jaxquant saves
    q4 = jq.quantize(RNG.standard_normal((8, 64)).astype(F32), mode="mxfp4")
    io.save_safetensors(tmp_path / "jq.safetensors", io.to_mlx_tensors(q4, "e"))
    loaded = mx.load(str(tmp_path / "jq.safetensors"))
    theirs = mx.dequantize(loaded["e.weight"], loaded["e.scales"], mode="mxfp4",
                           dtype=mx.float32)
    assert_bits_equal(np.asarray(jq.dequantize(q4, dtype=F32)), from_mx(theirs))


# ---------------------------------------------------------------------------
# quantized_matmul / gather_qmm: on jq.qmm / jq.gather_qmm, against float64 and MLX.


def _deq64(w_q, scales, biases, mode):
    qw = jqm.from_mlx(w_q, scales, biases, group_size=None, bits=None, mode=mode,
                      dtype=jnp.float32)
    return np.asarray(jq.dequantize(qw), np.float64)


@pytest.mark.parametrize("mode", ["affine", "mxfp4", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("transpose", [True, False])
def test_quantized_matmul_and_gather_qmm(mode, transpose):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 64, 64)).astype(np.float32)
    q = jqm.quantize(w, mode=mode)
    biases = q[2] if mode == "affine" else None
    w64 = _deq64(q[0], q[1], biases, mode)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    w64t = w64 if transpose else np.swapaxes(w64, -1, -2)
    # 2-D weight, and a batch of weights broadcast against x's batch axes.
    y = jqm.quantized_matmul(x, q[0][1], q[1][1], None if biases is None else biases[1],
                             transpose=transpose, mode=mode)
    np.testing.assert_allclose(y, x @ w64t[1].T, rtol=1e-5, atol=1e-4)
    yb = jqm.quantized_matmul(x[:1, None], q[0], q[1], biases, transpose=transpose, mode=mode)
    assert yb.shape == (1, 3, 5, 64)
    np.testing.assert_allclose(yb[0], x[0] @ np.swapaxes(w64t, -1, -2), rtol=1e-5, atol=1e-4)
    lhs, rhs = np.array([[0, 1], [1, 0]]), np.array([[2, 0], [1, 5]])  # 5 is out of range
    g = jqm.gather_qmm(x, q[0], q[1], biases, lhs_indices=lhs, rhs_indices=rhs,
                       transpose=transpose, mode=mode)
    assert g.shape == (2, 2, 5, 64)
    for i in range(2):
        for j in range(2):
            if rhs[i, j] >= 3:
                assert np.all(np.isnan(g[i, j]))
            else:
                np.testing.assert_allclose(g[i, j], x[lhs[i, j]] @ w64t[rhs[i, j]].T,
                                           rtol=1e-5, atol=1e-4)
    if mx is None:
        return
    ma = lambda a: None if a is None else mx.array(a)
    ym = mx.quantized_matmul(ma(x), ma(q[0][1]), ma(q[1][1]),
                             None if biases is None else ma(biases[1]), transpose=transpose,
                             mode=mode)
    np.testing.assert_allclose(y, np.array(ym), rtol=1e-5, atol=1e-4)
    ok = rhs < 3
    gm = mx.gather_qmm(ma(x), ma(q[0]), ma(q[1]), ma(biases), lhs_indices=ma(lhs[ok]),
                       rhs_indices=ma(rhs[ok]), transpose=transpose, mode=mode)
    np.testing.assert_allclose(np.asarray(g)[ok], np.array(gm), rtol=1e-5, atol=1e-4)


@needs_mlx
def test_mlx_tensors_round_trip_nvfp4():
    """nvfp4 through the MLX safetensors importer/exporter (tests/test_io.py's
    round trip covers affine, mxfp4 and mxfp8): MLX 0.32's own nvfp4 arrays."""
    from jaxquant import io

    w = RNG.standard_normal((2, 8, 64)).astype(F32)
    w_q, scales = mx.quantize(to_mx(w), mode="nvfp4")  # MLX's layers: no global scale
    tensors = {"experts.weight": from_mx(w_q), "experts.scales": from_mx(scales)}
    qw = io.from_mlx_tensors(tensors, "experts", bits=4, group_size=16, mode="nvfp4")
    assert (qw.mode, qw.bits, qw.group_size, qw.shape) == ("nvfp4", 4, 16, (2, 8, 64))
    out = io.to_mlx_tensors(qw, "experts")
    assert sorted(out) == ["experts.scales", "experts.weight"]
    for key, v in out.items():
        assert_bits_equal(v, tensors[key])
    theirs = from_mx(mx.dequantize(w_q, scales, mode="nvfp4", dtype=mx.float32))
    assert_bits_equal(np.asarray(jq.dequantize(qw, dtype=F32)), theirs)
    # jaxquant's own nvfp4 carries a global scale, which MLX's layers cannot store.
    with pytest.raises(ValueError, match="global_scale"):
        io.to_mlx_tensors(jq.quantize(w, mode="nvfp4"), "experts")
