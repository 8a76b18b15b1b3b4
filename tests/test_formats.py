"""jaxquant.formats (codecs and packing) against the numpy oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxquant import formats
from tests import oracle
from tests.common import scaled_normals

ELEMENTS = ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"]
BITS = [2, 3, 4, 5, 6, 8]


@functools.lru_cache(maxsize=None)
def _jitted(fn, arg):
    """fn(value, arg) jitted once per (fn, arg): element name or bit width."""
    return jax.jit(lambda v: fn(v, arg))


def _decode(name):
    return _jitted(formats.decode_element, name)


def _encode(name):
    return _jitted(formats.encode_element, name)


def _pack(bits):
    return _jitted(formats.pack_bits, bits)


def _unpack(bits):
    return _jitted(formats.unpack_bits, bits)


def assert_same_values(got, ref, ctx=None):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    ok = (np.isnan(got) & np.isnan(ref)) | ((got == ref) & (np.signbit(got) == np.signbit(ref)))
    assert ok.all(), (ctx, np.nonzero(~ok), got[~ok][:8], ref[~ok][:8])


# ---------------------------------------------------------------------------
# The table.


def test_element_table_parameters():
    for name in ELEMENTS:
        f = formats.ELEMENTS[name]
        ebits, mbits, bias, special = oracle.ELEMENT_SPECS[name]
        assert (f.ebits, f.mbits, f.bias, f.special) == (ebits, mbits, bias, special)
        assert f.bits == oracle.element_bits(name)
        assert f.max_value == oracle.max_finite(name)
        assert f.emax == oracle.emax_elem(name)


def test_format_table_matches_design():
    for mode, (element, bits, groups, default_group, scale) in oracle.MODES.items():
        fmt = formats.FORMATS[mode]
        assert fmt.element == element
        assert tuple(fmt.bits) == bits
        assert set(fmt.group_sizes) == set(groups)
        assert fmt.default_group_size == default_group
        assert fmt.scale == scale
        assert fmt.has_biases == (mode == "affine")
        assert fmt.has_global_scale == (mode == "nvfp4")
        assert set(fmt.scale_rules) == (set(oracle.MX_RULES) if scale == "e8m0" else set())
    assert formats.get_format("mxfp8") is formats.FORMATS["mxfp8_e4m3"]
    assert formats.resolve("affine") [1:] == (4, 64)
    assert formats.resolve("mxfp4")[1:] == (4, 32)
    assert formats.resolve("nvfp4")[1:] == (4, 16)
    assert formats.resolve("fp4")[1:] == (4, 32)
    assert formats.resolve("mxfp6_e3m2")[1:] == (6, 32)
    assert formats.resolve("mxfp8")[1:] == (8, 32)


# ---------------------------------------------------------------------------
# Element decode / encode.


@pytest.mark.parametrize("name", ELEMENTS)
def test_decode_every_code(name):
    n = 1 << oracle.element_bits(name)
    for dt in (np.uint32, np.uint8):
        codes = np.arange(n).astype(dt)
        got = _decode(name)(codes)
        assert got.dtype == jnp.float32
        assert_same_values(got, oracle.element_table(name), (name, dt))


@pytest.mark.parametrize("name", ELEMENTS)
def test_element_values(name):
    assert_same_values(formats.element_values(name), oracle.element_table(name), name)


def _check_encode(name, x32):
    x32 = np.asarray(x32, np.float32)
    got = np.asarray(_encode(name)(x32))
    assert got.dtype == np.uint32
    ref = oracle.encode_element(x32.astype(np.float64), name)
    nan = np.isnan(x32)
    if oracle.nan_code(name) is not None:
        # NaN must encode as a NaN (which NaN code is free)
        assert np.all(np.isnan(oracle.element_table(name)[got[nan]])), got[nan]
    bad = (got != ref) & ~nan
    assert not bad.any(), list(zip(x32[bad][:10], got[bad][:10], ref[bad][:10]))


def _edges(name):
    t = oracle.element_table(name)
    pos = np.unique(t[np.isfinite(t) & (t >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2  # ties
    mx = pos[-1]
    v = np.concatenate([pos, mids, [mx * 1.25, mx * 2, 3.0e38, np.inf, pos[1] / 2, pos[1] / 4]])
    v = v.astype(np.float32)
    v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    v = np.concatenate([v, -v, np.array([np.nan, -np.nan, 0.0, -0.0, np.float32(np.finfo(np.float32).max)],
                                        np.float32)])
    return v.astype(np.float32)


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_edges(name):
    _check_encode(name, _edges(name))


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_signed_zero_ties_saturation(name):
    bits = oracle.element_bits(name)
    sign = 1 << (bits - 1)
    t = oracle.element_table(name)
    mx = oracle.max_finite(name)
    max_code = int(np.nonzero(t == mx)[0][0])
    x = np.array([0.0, -0.0, np.inf, -np.inf, mx * 4, -mx * 4, t[1] / 2, -t[1] / 2], np.float32)
    got = np.asarray(_encode(name)(x)).tolist()
    # t[1]/2 is the tie between 0 and the smallest subnormal: even code 0
    assert got == [0, sign, max_code, max_code | sign, max_code, max_code | sign, 0, sign]


@pytest.mark.parametrize("name", ELEMENTS)
@settings(max_examples=25, deadline=None)
@given(x=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_encode_random_floats(name, x):
    x = np.array(x, np.float32)
    # pad to one length: one compile per element format
    _check_encode(name, np.concatenate([x, np.zeros(64 - x.size, np.float32)]))


@pytest.mark.parametrize("name", ELEMENTS)
@settings(max_examples=15, deadline=None)
@given(x=scaled_normals(256, 20))
def test_encode_random_normal(name, x):
    _check_encode(name, x)


@pytest.mark.parametrize("name", ELEMENTS)
def test_round_to_element(name):
    x = _edges(name)
    x = x[~np.isnan(x)]
    got = np.asarray(jax.jit(lambda v: formats.round_to_element(v, name))(x))
    ref = oracle.element_table(name)[oracle.encode_element(x.astype(np.float64), name)]
    assert_same_values(got, ref, name)


# ---------------------------------------------------------------------------
# Scale codecs.


def test_decode_e8m0_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(formats.decode_e8m0)(codes))
    assert got.dtype == np.float32
    ref = oracle.decode_e8m0(codes)
    assert_same_values(got, ref)
    # 0x00 is 2**-127: a float32 subnormal, stored exactly (bit pattern 0x00400000 = 2**22 * 2**-149), not zero
    assert got[0] == np.float32(2.0 ** -127) and got[0] != 0
    assert got[0:1].view(np.uint32)[0] == 0x00400000
    assert np.isnan(got[255])
    assert got[127] == 1.0 and got[254] == np.float32(2.0 ** 127)


def test_decode_e8m0_eager():
    got = np.asarray(formats.decode_e8m0(np.array([0, 1, 255], np.uint8)))
    assert got[0] == np.float32(2.0 ** -127) and got[1] == np.float32(2.0 ** -126)
    assert np.isnan(got[2])


def test_e4m3_codecs():
    codes = np.arange(256, dtype=np.uint8)
    assert_same_values(jax.jit(formats.decode_e4m3)(codes), oracle.decode_e4m3(codes))
    x = _edges("e4m3")
    x = x[~np.isnan(x)]
    got = np.asarray(jax.jit(formats.encode_e4m3)(x))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, oracle.encode_element(x.astype(np.float64), "e4m3"))


def test_exp2i_exact():
    e = np.arange(-149, 128)
    got = np.asarray(jax.jit(formats.exp2i)(e))
    np.testing.assert_array_equal(got.astype(np.float64), np.ldexp(1.0, e))


# ---------------------------------------------------------------------------
# Packing.


@pytest.mark.parametrize("bits", BITS)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1),
       lead=st.lists(st.integers(1, 3), max_size=3),
       kblocks=st.integers(1, 4))
def test_pack_unpack_vs_oracle(bits, seed, lead, kblocks):
    rng = np.random.default_rng(seed)
    k = 32 * kblocks
    codes = rng.integers(0, 1 << bits, size=(*lead, k)).astype(np.uint32)
    words = np.asarray(_pack(bits)(codes))
    assert words.dtype == np.uint32 and words.shape == (*lead, k * bits // 32)
    np.testing.assert_array_equal(words, oracle.pack_bits(codes, bits))
    back = np.asarray(_unpack(bits)(oracle.pack_bits(codes, bits)))
    assert back.shape == codes.shape
    np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("bits", BITS)
def test_pack_extremes(bits):
    # all ones, alternating, single set element at every position
    k = 64
    ones = np.full((1, k), (1 << bits) - 1, np.uint32)
    np.testing.assert_array_equal(np.asarray(_pack(bits)(ones)), oracle.pack_bits(ones, bits))
    assert np.all(np.asarray(_pack(bits)(ones)) == 0xFFFFFFFF)
    eye = (np.eye(k, dtype=np.uint32) * ((1 << bits) - 1))
    np.testing.assert_array_equal(np.asarray(_pack(bits)(eye)), oracle.pack_bits(eye, bits))
    np.testing.assert_array_equal(np.asarray(_unpack(bits)(oracle.pack_bits(eye, bits))), eye)


@pytest.mark.parametrize("bits", BITS)
def test_pack_accepts_narrow_code_dtypes(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(3, 32)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(_pack(bits)(codes)), oracle.pack_bits(codes, bits))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("words", [1, 2, 3, 5])
def test_pack_unpack_short_streams(bits, words):
    """Where elements do not straddle words, any whole number of words is a stream
    (e.g. 16 four-bit elements: one nvfp4 / fp4 group of 16)."""
    rng = np.random.default_rng(bits * 10 + words)
    k = words * 32 // bits
    codes = rng.integers(0, 1 << bits, size=(2, 3, k)).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(_pack(bits)(codes)), oracle.pack_bits(codes, bits))
    np.testing.assert_array_equal(np.asarray(_unpack(bits)(oracle.pack_bits(codes, bits))), codes)


def test_pack_unpack_reject_bad_input():
    with pytest.raises(TypeError, match="data"):
        formats.unpack_bits(np.zeros((2, 4), np.int32), 4)
    # 3-bit elements straddle words: a stream is a multiple of 3 words (32 elements)
    with pytest.raises(ValueError, match="multiple of"):
        formats.unpack_bits(np.zeros((2, 4), np.uint32), 3)
    with pytest.raises(ValueError, match="multiple of"):
        formats.pack_bits(np.zeros((2, 20), np.uint32), 4)
    with pytest.raises(ValueError, match="multiple of"):
        formats.pack_bits(np.zeros((2, 16), np.uint32), 6)
