"""Cross-checks of the numpy oracle (tests/oracle.py) against ml_dtypes and
against hand-worked values, so that the oracle can be trusted as a reference."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import oracle
from tests.common import scaled_normals

ML = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}
ELEMENTS = sorted(ML)


def same_values(a, b):
    """Equal as values, NaN == NaN, and the sign of zero must agree."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    eq = (a == b) & (np.signbit(a) == np.signbit(b))
    return np.all(both_nan | eq)


@pytest.mark.parametrize("name", ELEMENTS)
def test_element_table_matches_ml_dtypes(name):
    bits = oracle.element_bits(name)
    codes = np.arange(1 << bits, dtype=np.uint8)
    ref = codes.view(ML[name]).astype(np.float64)
    got = oracle.element_table(name)
    assert got.shape == (1 << bits,)
    assert same_values(got, ref), np.nonzero(~((got == ref) | (np.isnan(got) & np.isnan(ref))))


def test_element_table_facts():
    """The numbers docs/formats.md states."""
    e2m1 = oracle.element_table("e2m1")
    assert list(e2m1[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(e2m1[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert oracle.max_finite("e2m3") == 7.5
    assert oracle.element_table("e2m3")[1] == 0.125
    assert oracle.max_finite("e3m2") == 28
    assert oracle.max_finite("e4m3") == 448
    assert oracle.max_finite("e5m2") == 57344
    for name in ("e2m1", "e2m3", "e3m2"):
        assert np.all(np.isfinite(oracle.element_table(name)))
    e4m3 = oracle.element_table("e4m3")
    assert np.isnan(e4m3[0x7F]) and np.isnan(e4m3[0xFF])
    assert np.sum(np.isnan(e4m3)) == 2 and not np.any(np.isinf(e4m3))
    e5m2 = oracle.element_table("e5m2")
    assert e5m2[0x7C] == np.inf and e5m2[0xFC] == -np.inf
    assert np.sum(np.isnan(e5m2)) == 6
    assert [oracle.emax_elem(n) for n in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2")] == [2, 2, 4, 8, 15]


def test_decode_e8m0_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    got = oracle.decode_e8m0(codes)
    assert same_values(got, ref)
    assert got[0] == 2.0 ** -127 and got[127] == 1.0 and got[254] == 2.0 ** 127
    assert np.isnan(got[255])


def test_decode_e4m3_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    assert same_values(oracle.decode_e4m3(codes), codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def _ml_encode(x32, name):
    return np.asarray(x32, np.float32).astype(ML[name]).view(np.uint8).astype(np.uint32)


def _edge_values(name):
    """Every element value, every midpoint, and their float32 neighbours."""
    t = oracle.element_table(name)
    pos = np.unique(t[np.isfinite(t) & (t >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    v = np.concatenate([pos, mids]).astype(np.float32)
    v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    v = np.concatenate([v, -v, [np.float32(0), np.float32(-0.0)]])
    return v.astype(np.float32)


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_matches_ml_dtypes_on_edges(name):
    x = _edge_values(name)
    inr = np.abs(x) <= oracle.max_finite(name)
    x = x[inr]
    got = oracle.encode_element(x.astype(np.float64), name)
    ref = _ml_encode(x, name)
    bad = got != ref
    assert not bad.any(), list(zip(x[bad], got[bad], ref[bad]))


@pytest.mark.parametrize("name", ELEMENTS)
@settings(max_examples=30, deadline=None)
@given(x=scaled_normals(500, 12))
def test_encode_matches_ml_dtypes_random(name, x):
    x = x[np.abs(x) <= oracle.max_finite(name)]
    got = oracle.encode_element(x.astype(np.float64), name)
    ref = _ml_encode(x, name)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_ties_go_to_even_code(name):
    t = oracle.element_table(name)
    pos = np.unique(t[np.isfinite(t) & (t >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    codes = oracle.encode_element(mids, name)
    assert np.all(codes % 2 == 0)
    # and each tie lands on one of its two neighbours
    vals = t[codes]
    assert np.all((vals == pos[1:]) | (vals == pos[:-1]))


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_saturates(name):
    mx = oracle.max_finite(name)
    bits = oracle.element_bits(name)
    sign = 1 << (bits - 1)
    max_code = int(np.nonzero(oracle.element_table(name) == mx)[0][0])
    big = np.array([mx, np.nextafter(mx, np.inf), mx * 1.5, mx * 2 ** 20, 1e300, np.inf])
    assert np.all(oracle.encode_element(big, name) == max_code)
    assert np.all(oracle.encode_element(-big, name) == max_code | sign)


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_signed_zero_and_nan(name):
    bits = oracle.element_bits(name)
    sign = 1 << (bits - 1)
    t = oracle.element_table(name)
    tiny = t[1] / 4  # rounds to zero
    assert list(oracle.encode_element([0.0, -0.0, tiny, -tiny], name)) == [0, sign, 0, sign]
    nan_code = oracle.encode_element([np.nan], name)[0]
    if oracle.nan_code(name) is None:
        assert nan_code == 0
    else:
        assert np.isnan(t[nan_code])


@pytest.mark.parametrize("name", ELEMENTS)
def test_encode_decode_round_trip_every_code(name):
    t = oracle.element_table(name)
    codes = np.nonzero(np.isfinite(t))[0]
    np.testing.assert_array_equal(oracle.encode_element(t[codes], name), codes)


# ---------------------------------------------------------------------------
# Bit stream.


def test_pack_bits_hand_examples():
    # 4-bit: element 0 in the low nibble of word 0
    w = oracle.pack_bits(np.arange(1, 9), 4)
    assert w.dtype == np.uint32 and list(w) == [0x87654321]
    # 8-bit: bytes in little-endian order
    w = oracle.pack_bits(np.array([0x11, 0x22, 0x33, 0x44]), 8)
    assert list(w) == [0x44332211]
    # 3-bit: element 10 occupies stream bits 30, 31, 32 (straddles words 0 and 1)
    c = np.zeros(32, np.int64)
    c[10] = 0b101
    w = oracle.pack_bits(c, 3)
    assert list(w) == [1 << 30, 1, 0]
    # 6-bit: element 5 occupies bits 30..35
    c = np.zeros(16, np.int64)
    c[5] = 0b111111
    w = oracle.pack_bits(c, 6)
    assert list(w) == [0b11 << 30, 0b1111, 0]
    # 5-bit: element 6 occupies bits 30..34 -> two low bits in word 0
    c = np.zeros(32, np.int64)
    c[6] = 0b10110
    w = oracle.pack_bits(c, 5)
    assert list(w[:2]) == [0b10 << 30, 0b101]
    # 2-bit
    assert list(oracle.pack_bits(np.array([3, 0, 1, 2] + [0] * 12), 2)) == [0b10010011]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), lead=st.lists(st.integers(1, 3), max_size=2),
       kblocks=st.integers(1, 3))
def test_pack_unpack_round_trip(bits, seed, lead, kblocks):
    rng = np.random.default_rng(seed)
    k = 32 * kblocks
    codes = rng.integers(0, 1 << bits, size=(*lead, k)).astype(np.uint32)
    words = oracle.pack_bits(codes, bits)
    assert words.dtype == np.uint32 and words.shape == (*lead, k * bits // 32)
    np.testing.assert_array_equal(oracle.unpack_bits(words, bits), codes)
    # The stream as one big little-endian integer per row.
    flat_c = codes.reshape(-1, k)
    flat_w = words.reshape(-1, k * bits // 32)
    for row_c, row_w in zip(flat_c[:3], flat_w[:3]):
        big = sum(int(x) << (32 * i) for i, x in enumerate(row_w))
        assert [(big >> (bits * j)) & ((1 << bits) - 1) for j in range(k)] == list(row_c)


# ---------------------------------------------------------------------------
# Quantize rules of the oracle itself, on hand-worked blocks.


def test_mx_rules_hand_examples():
    e = lambda a, el, r: int(oracle.mx_shared_exponent(np.float32(a), el, r))
    # e2m1 (max 6, emax 2)
    assert e(6.0, "e2m1", "floor") == 0 and e(6.0, "e2m1", "rceil") == 0 and e(6.0, "e2m1", "round") == 0
    assert e(7.0, "e2m1", "floor") == 0      # floor(log2 7) - 2 = 0, saturates 7 -> 6
    assert e(7.0, "e2m1", "rceil") == 1      # 7 <= 6 * 2
    assert e(7.0, "e2m1", "round") == 0      # log2(7/6) = 0.22
    assert e(4.0, "e2m1", "floor") == 0 and e(4.0, "e2m1", "rceil") == 0
    assert e(3.0, "e2m1", "floor") == -1 and e(3.0, "e2m1", "rceil") == -1
    assert e(3.5, "e2m1", "rceil") == 0      # 3.5 > 6 * 2**-1
    assert e(9.0, "e2m1", "round") == 1      # log2(1.5) = 0.58 -> 1
    assert e(8.0, "e2m1", "round") == 0      # log2(4/3) = 0.415 -> 0
    # e4m3 (max 448, emax 8): amax 1 -> floor(0) - 8 = -8
    assert e(1.0, "e4m3", "floor") == -8 and e(1.0, "e4m3", "rceil") == -8
    assert e(1.0, "e4m3", "round") == -9     # log2(1/448) = -8.81
    # clamping
    assert e(2.0 ** -130, "e2m1", "floor") == -127
    assert e(2.0 ** -130, "e2m1", "round") == -127
    assert e(0.0, "e5m2", "rceil") == -127


def test_oracle_mx_quantize_hand_example():
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [6.0, -3.0, 0.25, -0.0]
    q = oracle.quantize(w, "mxfp4")
    assert q["scales"].dtype == np.uint8 and q["scales"].tolist() == [[127]]
    codes = oracle.unpack_bits(q["data"], 4)[0]
    # 6 -> 0b0111, -3 -> 0b1101, 0.25 -> tie between 0 and 0.5 -> 0, -0 -> 0b1000
    assert codes[:4].tolist() == [7, 0b1101, 0, 8]
    assert codes[4:].tolist() == [0] * 28
    assert q["data"].tolist() == [[0x80D7, 0, 0, 0]]


def test_oracle_affine_hand_example():
    # group of 32: min -1, max 0.5, bits 2 (n = 3)
    w = np.full((1, 32), 0.0, np.float32)
    w[0, 0] = -1.0
    w[0, 1] = 0.5
    q = oracle.quantize(w, "affine", bits=2, group_size=32)
    # s = 1.5/3 = 0.5; |min| > |max|: edge = -1, scale = 0.5; q0 = rint(-2) = -2;
    # scale = -1 / -2 = 0.5, bias = -1; q = rint((w + 1) / 0.5): -1 -> 0, 0.5 -> 3, 0 -> 2
    assert q["scales"].tolist() == [[0.5]] and q["biases"].tolist() == [[-1.0]]
    codes = oracle.unpack_bits(q["data"], 2)[0]
    assert codes[:3].tolist() == [0, 3, 2]
    deq = oracle.dequantize("affine", 2, 32, q["data"], q["scales"], q["biases"])
    np.testing.assert_array_equal(deq, w.astype(np.float64))


def test_oracle_dequantize_e8m0_extremes():
    data = oracle.pack_bits(np.full((2, 32), 7), 4)  # element 6 everywhere
    scales = np.array([[0], [255]], np.uint8)
    deq = oracle.dequantize("mxfp4", 4, 32, data, scales)
    assert np.all(deq[0] == 6 * 2.0 ** -127)
    assert np.all(np.isnan(deq[1]))


def test_ulp_helper():
    assert oracle.ulp(1.0, np.float32) == 2.0 ** -23
    assert oracle.ulp(1.0, np.float16) == 2.0 ** -10
    assert oracle.ulp(1.0, ml_dtypes.bfloat16) == 2.0 ** -7
    assert oracle.ulp(0.0, np.float16) == 2.0 ** -24
    assert oracle.ulp(3.0, np.float32) == 2.0 ** -22
    assert math.isclose(oracle.ulp(1e-40, np.float32), 2.0 ** -149)
