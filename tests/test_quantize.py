"""jq.quantize / jq.dequantize against the float64 numpy oracle (bit for bit),
round-trip error bounds derived from the formats, hand-worked MLX affine cases,
MX / NVFP4 / FP4 edge cases, and QuantizedArray as a pytree."""

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax

import jaxquant as jq
from tests import oracle

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
DTYPE_IDS = ["f32", "f16", "bf16"]
MX_MODES = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8", "mxfp8_e5m2"]
RULES = ["floor", "rceil", "round"]

# (mode, bits, group_size, scale_rule); None means "the format's default".
CONFIGS = (
    [("affine", b, g, None) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
    + [(m, None, None, r) for m in MX_MODES for r in RULES]
    + [("nvfp4", None, None, None)]
    + [("fp4", None, g, None) for g in (16, 32, 64)]
    + [("iq4nl", None, None, None)]
)


def cfg_id(c):
    mode, bits, g, rule = c
    return "-".join(str(x) for x in (mode, bits, g, rule) if x is not None)


def resolved(mode, bits, g):
    element, allowed_bits, _, default_group, _ = oracle.MODES[oracle.canonical_mode(mode)]
    if bits is None:
        bits = 4 if 4 in allowed_bits else allowed_bits[0]
    return bits, g or default_group


@functools.lru_cache(maxsize=None)
def quantize_fn(mode, bits, g, rule):
    """One jitted quantize per static configuration."""
    return jax.jit(functools.partial(jq.quantize, mode=mode, bits=bits, group_size=g,
                                     scale_rule=rule))


DEQ = jax.jit(jq.dequantize)
# Every example compiles: report the first failing example instead of shrinking it.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
F32_SUBNORMAL_SLACK = 2.0 ** -126  # XLA on CPU flushes float32 subnormal results


def arr(a):
    return None if a is None else np.asarray(a)


def bitview(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def scale_is_nan_marker(mode, scales):
    """Blocks whose stored scale makes the whole block NaN (element codes unspecified)."""
    kind = oracle.MODES[oracle.canonical_mode(mode)][4]
    if kind == "e8m0":
        return np.asarray(scales) == 255
    if kind == "e4m3":
        return np.isnan(oracle.decode_e4m3(scales))
    return np.zeros(np.shape(scales), bool)


# ---------------------------------------------------------------------------
# Checks shared by the tests.


def assert_quantize_matches_oracle(qw, w, mode, bits, g, rule):
    w = np.asarray(w)
    bits, g = resolved(mode, bits, g)
    o = oracle.quantize(w, mode, bits, g, rule)
    canon = oracle.canonical_mode(mode)
    *lead, n, k = w.shape
    # metadata and storage conventions
    assert isinstance(qw, jq.QuantizedArray)
    assert qw.mode == canon and qw.bits == bits and qw.group_size == g
    assert qw.dtype == w.dtype and qw.shape == w.shape
    assert qw.data.dtype == jnp.uint32 and qw.data.shape == (*lead, n, k * bits // 32)
    assert qw.scales.shape == (*lead, n, k // g)
    assert qw.scales.dtype == o["scales"].dtype, (qw.scales.dtype, o["scales"].dtype)
    # scales, biases, global scale: bit for bit
    np.testing.assert_array_equal(bitview(qw.scales), bitview(o["scales"]), err_msg="scales")
    if o["biases"] is None:
        assert qw.biases is None
    else:
        assert qw.biases.dtype == w.dtype and qw.biases.shape == qw.scales.shape
        np.testing.assert_array_equal(bitview(qw.biases), bitview(o["biases"]), err_msg="biases")
    if o["global_scale"] is None:
        assert qw.global_scale is None
    else:
        gs = np.asarray(qw.global_scale)
        assert gs.dtype == np.float32 and gs.size == 1
        assert bitview(gs.reshape(())) == bitview(o["global_scale"]), (gs, o["global_scale"])
    # element codes, block by block, except blocks the scale marks NaN
    skip = scale_is_nan_marker(mode, o["scales"])
    got = oracle.unpack_bits(np.asarray(qw.data), bits).reshape(*lead, n, k // g, g)
    want = oracle.unpack_bits(o["data"], bits).reshape(*lead, n, k // g, g)
    bad = np.any(got != want, axis=-1) & ~skip
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"codes differ in block {i}: w={w.reshape(*lead, n, k // g, g)[i].tolist()}\n"
            f"got {got[i].tolist()}\nwant {want[i].tolist()}")
    if not skip.any():
        np.testing.assert_array_equal(np.asarray(qw.data), o["data"], err_msg="data words")
    return o


def oracle_dequantize(qw):
    return oracle.dequantize(qw.mode, qw.bits, qw.group_size, arr(qw.data), arr(qw.scales),
                             arr(qw.biases), arr(qw.global_scale))


def dequant_tolerance(qw, ref, got, dtype):
    """One rounding of the output dtype, plus the float32 steps the contract names."""
    dtype = np.dtype(dtype)
    mag = np.maximum(np.abs(ref), np.abs(got.astype(np.float64)))
    mag = np.where(np.isfinite(mag), mag, 0)
    tol = np.zeros_like(ref)
    if dtype != np.float32:
        tol = tol + 0.5 * oracle.ulp(mag, dtype)
    if dtype.name in ("float32", "bfloat16"):
        tol = tol + F32_SUBNORMAL_SLACK
    if qw.mode == "affine":  # float32: one rounding of scale*q, one of the sum
        *lead, n, k = qw.shape
        g = qw.group_size
        q = oracle.unpack_bits(np.asarray(qw.data), qw.bits).astype(np.float64)
        sq = np.abs(np.repeat(np.asarray(qw.scales).astype(np.float64), g, axis=-1) * q)
        tol = tol + 0.5 * oracle.ulp(sq, np.float32) + 0.5 * oracle.ulp(mag, np.float32)
        if dtype != np.float32:  # double rounding
            tol = tol + 0.5 * oracle.ulp(mag, dtype)
    if qw.mode in ("fp4", "iq4nl"):  # element (2 or 7 significant bits) * scale: one float32 rounding
        tol = tol + 0.5 * oracle.ulp(mag, np.float32)
    if qw.mode == "nvfp4":  # float32 product with the global scale, then the cast
        tol = tol + 0.5 * oracle.ulp(mag, np.float32)
        if dtype != np.float32:
            tol = tol + 0.5 * oracle.ulp(mag, dtype)
    return tol


DEQ_TO = jax.jit(jq.dequantize, static_argnums=1)


def assert_dequantize_matches_oracle(qw, dtype=None, got=None):
    """jq.dequantize(qw, dtype) (or `got`, computed by the caller) vs the oracle."""
    dtype = np.dtype(qw.dtype if dtype is None else dtype)
    if got is None:
        got = DEQ(qw) if dtype == qw.dtype else DEQ_TO(qw, dtype)
    assert got.dtype == dtype and got.shape == qw.shape
    got = np.asarray(got)
    ref = oracle_dequantize(qw)
    g64 = got.astype(np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(g64), nan_ref, err_msg="NaN positions")
    tol = dequant_tolerance(qw, ref, got, dtype)
    err = np.where(nan_ref, 0, np.abs(g64 - ref))
    if not np.all(err <= tol):
        i = np.unravel_index(np.argmax(err - tol), err.shape)
        raise AssertionError(f"dequantize off at {i}: got {g64[i]!r}, oracle {ref[i]!r}, tol {tol[i]!r}")
    # exact zeros keep their sign (e.g. -0 elements)
    zero = (ref == 0) & (g64 == 0)
    if qw.mode != "affine":
        np.testing.assert_array_equal(np.signbit(g64[zero]), np.signbit(ref[zero]), err_msg="sign of 0")
    return got


def _spacing(a, element):
    """Spacing of the element grid in the binade of |a| (a > 0)."""
    ebits, mbits, bias, _ = oracle.ELEMENT_SPECS[element]
    safe = np.where(a > 0, a, 1.0)
    e = np.maximum(np.frexp(safe)[1] - 1, 1 - bias)
    return np.ldexp(1.0, e - mbits)


def assert_round_trip(w, qw, deq):
    """|w - dequantize(quantize(w))| within the bound the format gives."""
    w64 = np.asarray(w).astype(np.float64)
    deq = np.asarray(deq).astype(np.float64)
    dtype = np.asarray(w).dtype
    mode, g = qw.mode, qw.group_size
    *lead, n, k = w64.shape
    G = k // g
    wg = w64.reshape(*lead, n, G, g)
    dg = deq.reshape(*lead, n, G, g)
    err = np.abs(wg - dg)
    out = 0.5 * oracle.ulp(dg, dtype) + (F32_SUBNORMAL_SLACK if dtype.name != "float16" else 0)
    scales = np.asarray(qw.scales)
    if mode == "affine":
        nb = (1 << qw.bits) - 1
        s = np.asarray(qw.scales).astype(np.float64)[..., None]
        b = np.asarray(qw.biases).astype(np.float64)[..., None]
        q = oracle.unpack_bits(np.asarray(qw.data), qw.bits).reshape(*lead, n, G, g)
        s_orig = np.maximum((wg.max(-1) - wg.min(-1)) / nb, 1e-7)[..., None]
        store = nb * 0.5 * oracle.ulp(s, dtype) + 0.5 * oracle.ulp(b, dtype)
        f32 = 2 * oracle.ulp(np.abs(wg) + np.abs(b), np.float32) + nb * np.abs(s) * 2.0 ** -22
        # every element: within the (unadjusted) step s; MLX's edge snapping can
        # clip the far end of the range by up to s * n/(n+1)
        bound = s_orig * (1 + 2.0 ** -20) + store + f32 + out
        assert np.all(err <= bound), np.max(err - bound)
        # interior elements: within half a stored step
        interior = (q > 0) & (q < nb)
        bound_i = 0.5 * np.abs(s) + 0.25 * oracle.ulp(s, dtype) + store + f32 + out
        assert np.all(err[interior] <= np.broadcast_to(bound_i, err.shape)[interior]), \
            np.max((err - bound_i)[interior])
        return
    element = oracle.MODES[mode][0]
    if element in oracle.CODEBOOKS:
        # the nearest codebook value to x = w / scale (float32): within its distance
        # to the table, which past the ends is the distance to the end
        table = oracle.element_table(element)
        div = scales.astype(np.float32).astype(np.float64)[..., None]
        with np.errstate(all="ignore"):
            x = wg / div
        near = np.min(np.abs(x[..., None] - table), axis=-1) + oracle.ulp(x, np.float32)
        bound = near * np.abs(div) + out + 0.5 * oracle.ulp(dg, np.float32)
        zero_div = np.broadcast_to(div == 0, err.shape)
        assert np.all(dg[zero_div] == 0)
        ok = np.where(zero_div, True, err <= bound)
        assert ok.all(), (wg[~ok][:4], dg[~ok][:4], bound[~ok][:4])
        # the group's element of largest magnitude is the value -127 * scale
        peak = np.take_along_axis(wg, np.argmax(np.abs(wg), -1)[..., None], -1)
        assert np.all(np.abs(peak - table[0] * div) <= np.abs(peak) * 2.0 ** -7
                      + F32_SUBNORMAL_SLACK)
        return
    maxv = oracle.max_finite(element)
    if mode.startswith("mx"):
        e = scales.astype(np.int64)[..., None] - 127
        div = np.ldexp(1.0, e)
    elif mode == "nvfp4":
        gs = np.float32(np.asarray(qw.global_scale))
        div = (oracle.decode_e4m3(scales).astype(np.float32) * gs).astype(np.float64)[..., None]
    else:  # fp4
        div = scales.astype(np.float32).astype(np.float64)[..., None]
    with np.errstate(all="ignore"):
        x = np.abs(wg) / div
    elem = np.where(x <= maxv, 0.5 * _spacing(x, element), x - maxv)
    if not mode.startswith("mx"):  # x is computed in float32 before the element rounding
        elem = elem + oracle.ulp(x, np.float32)
    bound = elem * div + out
    if mode == "nvfp4":
        bound = bound + 0.5 * oracle.ulp(dg, np.float32)
    zero_div = np.broadcast_to(div == 0, err.shape)
    assert np.all(dg[zero_div] == 0)
    ok = np.where(zero_div, True, err <= bound)
    if not ok.all():
        i = tuple(np.argwhere(~ok)[0])
        raise AssertionError(f"round trip at {i}: w={wg[i]!r} deq={dg[i]!r} bound={bound[i]!r}")
    if mode.startswith("mx"):
        # whatever the rule, amax / 2**e stays below 2 * max_elem (floor: < 2**(emax+1);
        # round: <= sqrt(2) * max_elem; rceil: <= max_elem)
        amax = np.abs(wg).max(-1)
        assert np.all(amax <= np.ldexp(2.0 * maxv, e[..., 0]))


# ---------------------------------------------------------------------------
# The grid: every mode x dtype x scale rule, bit for bit.


def random_weights(rng, shape, dtype, log10_scale, zero_frac):
    w = rng.standard_normal(shape) * 10.0 ** log10_scale
    if zero_frac:
        z = rng.random(shape) < zero_frac
        w = np.where(z, np.where(rng.random(shape) < 0.5, -0.0, 0.0), w)
    return w.astype(dtype)


def shape_for(cfg):
    """A fixed shape per configuration (one compile each); varied across configs."""
    mode, bits, g, rule = cfg
    _, g = resolved(mode, bits, g)
    h = zlib.crc32(cfg_id(cfg).encode())
    lead = [(), (2,), (1, 2)][h % 3]
    return (*lead, 1 + (h >> 2) % 4, g * (1 + (h >> 4) % 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@settings(max_examples=8, deadline=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), log10_scale=st.floats(-2.5, 2.5),
       zero_frac=st.sampled_from([0.0, 0.0, 0.25]))
def test_quantize_matches_oracle(cfg, dtype, seed, log10_scale, zero_frac):
    mode, bits, g, rule = cfg
    w = random_weights(np.random.default_rng(seed), shape_for(cfg), dtype, log10_scale, zero_frac)
    qw = quantize_fn(mode, bits, g, rule)(w)
    assert_quantize_matches_oracle(qw, w, mode, bits, g, rule)
    deq = assert_dequantize_matches_oracle(qw)
    assert_round_trip(w, qw, deq)


@settings(max_examples=25, deadline=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), dtype=st.sampled_from(DTYPES),
       lead=st.lists(st.integers(1, 3), max_size=2), n=st.integers(1, 5),
       kgroups=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1),
       log10_scale=st.floats(-3, 3))
def test_quantize_random_shapes(cfg, dtype, lead, n, kgroups, seed, log10_scale):
    mode, bits, g, rule = cfg
    _, gg = resolved(mode, bits, g)
    w = random_weights(np.random.default_rng(seed), (*lead, n, kgroups * gg), dtype,
                       log10_scale, 0.0)
    qw = quantize_fn(mode, bits, g, rule)(w)
    assert_quantize_matches_oracle(qw, w, mode, bits, g, rule)
    deq = assert_dequantize_matches_oracle(qw)
    assert_round_trip(w, qw, deq)


PAD_ROWS = 128


def quant(w, mode, bits=None, g=None, rule=None):
    """Quantize 2-D w [r, K] under jit through the function compiled for
    [PAD_ROWS, K] (zero rows appended, then dropped: every rule here works per
    row, and zeros do not change NVFP4's tensor amax), so edge tests share
    compiles. Returns the QuantizedArray of the r rows (numpy children) and
    jq.dequantize of those rows."""
    w = np.asarray(w)
    r, k = w.shape
    assert r <= PAD_ROWS
    full = np.zeros((PAD_ROWS, k), w.dtype)
    full[:r] = w
    qw = quantize_fn(mode, bits, g, rule)(full)
    deq = np.asarray(DEQ(qw))[:r]
    qw = jax.tree_util.tree_map(lambda c: np.asarray(c)[:r] if np.ndim(c) else np.asarray(c), qw)
    return qw, deq


def check_edge(w, mode, bits=None, g=None, rule=None):
    """quant() plus the oracle comparisons; returns (qw, deq, codes)."""
    qw, deq = quant(w, mode, bits, g, rule)
    assert_quantize_matches_oracle(qw, w, mode, bits, g, rule)
    assert_dequantize_matches_oracle(qw, got=deq)
    codes = oracle.unpack_bits(np.asarray(qw.data), qw.bits)
    return qw, deq, codes


@pytest.mark.parametrize("mode", ["affine", "mxfp6_e3m2", "nvfp4", "fp4", "iq4nl"])
def test_dequantize_to_other_dtypes(mode):
    rng = np.random.default_rng(7)
    w = random_weights(rng, (3, 128), np.dtype(ml_dtypes.bfloat16), 0.5, 0.0)
    qw = quantize_fn(mode, None, None, None)(w)
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        assert_dequantize_matches_oracle(qw, dt)


def test_defaults():
    w = jax.ShapeDtypeStruct((2, 128), jnp.float32)
    qw = jax.eval_shape(jq.quantize, w)
    assert (qw.mode, qw.bits, qw.group_size) == ("affine", 4, 64)
    assert qw.biases is not None and qw.scales.dtype == jnp.float32
    for mode, bits, g in [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
                          ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32), ("mxfp8", 8, 32),
                          ("mxfp8_e5m2", 8, 32)]:
        qw = jax.eval_shape(functools.partial(jq.quantize, mode=mode), w)
        assert (qw.bits, qw.group_size) == (bits, g), mode
    assert jax.eval_shape(functools.partial(jq.quantize, mode="mxfp8"), w).mode == "mxfp8_e4m3"
    # the default MX rule is "floor": amax 7 in e2m1 -> e = floor(log2 7) - 2 = 0 (saturating)
    w = np.zeros((PAD_ROWS, 32), np.float32)
    w[0, 0] = 7.0
    assert np.asarray(quantize_fn("mxfp4", None, None, None)(w).scales)[0].tolist() == [127]


# ---------------------------------------------------------------------------
# MLX affine, worked by hand.


def _affine_group(values, bits=2, dtype=np.float32):
    w = np.zeros((1, 32), dtype)
    w[0, :len(values)] = values
    qw, deq, codes = check_edge(w, "affine", bits, 32)
    return qw, np.asarray(qw.scales)[0, 0], np.asarray(qw.biases)[0, 0], codes[0], deq[0]


def test_affine_hand_max_dominates_negative_scale():
    # min -1, max 2, n = 3: s = 3/3 = 1; |min| < |max| -> edge = max = 2, scale = -1;
    # q0 = rint(2 / -1) = -2 != 0 -> scale = 2 / -2 = -1, bias = 2; q = rint((w - 2) / -1)
    w = [2.0, -1.0, 0.0, 0.5, 1.5, 1.0]
    qw, scale, bias, codes, deq = _affine_group(w)
    assert scale == -1.0 and bias == 2.0
    # 2 -> 0, -1 -> 3, 0 -> 2, 0.5 -> rint(1.5) = 2, 1.5 -> rint(0.5) = 0, 1 -> 1; padding 0 -> 2
    assert codes[:6].tolist() == [0, 3, 2, 2, 0, 1]
    assert codes[6:].tolist() == [2] * 26
    assert deq[:6].tolist() == [2.0, -1.0, 0.0, 0.0, 2.0, 1.0]


def test_affine_hand_min_dominates():
    # min -3, max 1, n = 3: s = 4/3 (float32 1.3333334); |min| > |max| -> edge = min = -3,
    # scale = +s; q0 = rint(-3 / 1.3333334) = rint(-2.2499998) = -2 -> scale = -3 / -2 = 1.5,
    # bias = -3; q = rint((w + 3) / 1.5)
    w = [-3.0, 1.0, 0.0, -1.5, -2.25, 0.75]
    qw, scale, bias, codes, deq = _affine_group(w)
    assert scale == 1.5 and bias == -3.0
    # -3 -> 0; 1 -> rint(2.67) = 3; 0 -> 2; -1.5 -> 1; -2.25 -> rint(0.5) = 0; 0.75 -> rint(2.5) = 2
    assert codes[:6].tolist() == [0, 3, 2, 1, 0, 2]
    assert deq[:6].tolist() == [-3.0, 1.5, 0.0, -1.5, -3.0, 0.0]


def test_affine_hand_all_negative_and_all_positive():
    # all negative: min -4, max -1, n = 3: s = 1; edge = min = -4, scale = 1, q0 = -4,
    # scale = -4 / -4 = 1, bias = -4; q = w + 4
    w = np.array([[-1.0, -2.0, -3.0, -4.0] * 8, [1.0, 2.0, 3.0, 4.0] * 8], np.float32)
    qw, deq, codes = check_edge(w, "affine", 2, 32)
    # all positive: edge = max = 4, scale = -1, q0 = -4, scale = 4 / -4 = -1, bias = 4; q = 4 - w
    assert np.asarray(qw.scales).tolist() == [[1.0], [-1.0]]
    assert np.asarray(qw.biases).tolist() == [[-4.0], [4.0]]
    assert codes[:, :4].tolist() == [[3, 2, 1, 0], [3, 2, 1, 0]]
    np.testing.assert_array_equal(deq, w)


def test_affine_hand_q0_zero():
    # all zero: min = max = 0, s = max(0, 1e-7) = 1e-7; |0| > |0| is false -> edge = max = 0,
    # scale = -1e-7; q0 = rint(0 / -1e-7) = 0 -> bias = 0, scale stays -1e-7; q = 0.
    # {2e-8, 3e-8, -1e-8}: s = 1e-7 (clamped), edge = max = 3e-8, q0 = rint(-0.3) = 0: same.
    for w in ([0.0], [2e-8, 3e-8, -1e-8]):
        qw, scale, bias, codes, deq = _affine_group(w, bits=4)
        assert scale == np.float32(-1e-7) and bias == 0.0
        assert codes.tolist() == [0] * 32
        assert np.all(deq == 0)


def test_affine_hand_constant_group():
    # all -2: min = max = -2, s = 1e-7; edge = max = -2, scale = -1e-7;
    # q0 = rint(-2 / -1e-7) = 2e7 -> scale = -2 / 2e7 = -1e-7 (float32), bias = -2; q = 0
    w = np.full((2, 64), -2.0, np.float32)
    qw, deq, codes = check_edge(w, "affine", 4, 64)
    assert np.asarray(qw.scales).tolist() == [[np.float32(-1e-7)]] * 2
    assert np.asarray(qw.biases).tolist() == [[-2.0]] * 2
    assert np.all(codes == 0)
    np.testing.assert_array_equal(deq, w)
    # constant 5 in bfloat16: bias 5, scale -1e-7 rounded to bfloat16
    w = np.full((1, 32), 5.0, ml_dtypes.bfloat16)
    qw, deq, codes = check_edge(w, "affine", 8, 32)
    assert np.asarray(qw.biases)[0, 0] == 5.0
    assert np.asarray(qw.scales)[0, 0] == np.float32(-1e-7).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(deq.astype(np.float32), 5.0)


def test_affine_hand_tie_is_exact_division():
    # min -480, max 480, n = 15: s = 960 / 15 = 64; |min| > |max| is false -> edge = max = 480,
    # scale = -64; q0 = rint(480 / -64) = rint(-7.5) = -8 -> scale = 480 / -8 = -60, bias = 480.
    # w = 330: (330 - 480) / -60 = 2.5 exactly -> rint -> 2 (ties to even). MLX divides, so
    # the quotient is exact; a multiplication by a rounded reciprocal of -60 gives 2.5000002 -> 3.
    w = np.zeros((2, 32), np.float32)
    w[:, :4] = [-480.0, 480.0, 330.0, 390.0]
    for dtype in (np.float32, ml_dtypes.bfloat16):
        qw, deq = quant(w.astype(dtype), "affine", 4, 32)
        assert np.asarray(qw.scales)[0, 0] == -60.0 and np.asarray(qw.biases)[0, 0] == 480.0
        codes = oracle.unpack_bits(np.asarray(qw.data), 4)
        # -480 -> 16 -> clip 15; 480 -> 0; 330 -> rint(2.5) = 2; 390 -> rint(1.5) = 2
        assert codes[0, :4].tolist() == [15, 0, 2, 2], (dtype, codes[0, :4])


def test_affine_mixed_groups_and_signed_zero():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 128)).astype(np.float32)
    w[0, :64] = -0.0
    w[1, 64:] = 0.0
    w[2, :64] = -np.abs(w[2, :64])
    qw, deq, _ = check_edge(w, "affine", 3, 64)
    assert np.all(deq[0, :64] == 0) and np.all(deq[1, 64:] == 0)
    assert_round_trip(w, qw, deq)


# ---------------------------------------------------------------------------
# MX edge cases.


def test_mx_hand_block():
    # amax 6 -> e = floor(log2 6) - 2 = 0 -> code 127. Elements RNE, ties to even codes:
    # 5 (between 4 and 6) -> 4; 2.5 -> 2; 0.75 -> 1; 0.25 -> 0; -0 and -0.1 -> -0
    w = np.zeros((1, 32), np.float32)
    w[0, :8] = [6.0, 5.0, 2.5, 0.75, 0.25, -5.0, -0.0, -0.1]
    qw, deq, codes = check_edge(w, "mxfp4")
    assert np.asarray(qw.scales).tolist() == [[127]]
    assert codes[0, :8].tolist() == [0b0111, 0b0110, 0b0100, 0b0010, 0, 0b1110, 0b1000, 0b1000]
    assert deq[0, :8].tolist() == [6.0, 4.0, 2.0, 1.0, 0.0, -4.0, -0.0, -0.0]
    assert np.signbit(deq[0, 6]) and np.signbit(deq[0, 7]) and not np.signbit(deq[0, 4])


def test_mx_saturation():
    # amax 7: floor keeps e = floor(log2 7) - 2 = 0 and saturates 7 -> 6;
    # rceil takes e = 1 (7 <= 6 * 2): 7 / 2 = 3.5 is a tie between 3 and 4 -> 4 (even code) -> 8
    w = np.zeros((1, 32), np.float32)
    w[0, :2] = [7.0, -7.0]
    qw, deq, _ = check_edge(w, "mxfp4", rule="floor")
    assert np.asarray(qw.scales).tolist() == [[127]] and deq[0, :2].tolist() == [6.0, -6.0]
    qw, deq, _ = check_edge(w, "mxfp4", rule="rceil")
    assert np.asarray(qw.scales).tolist() == [[128]] and deq[0, :2].tolist() == [8.0, -8.0]
    # e4m3: amax 500 -> e = floor(log2 500) - 8 = 0, 500 saturates to 448
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 500.0
    qw, deq, _ = check_edge(w, "mxfp8_e4m3")
    assert np.asarray(qw.scales).tolist() == [[127]] and deq[0, 0] == 448.0
    # e5m2 has Inf codes, but quantize saturates: 65000 -> e = 15 - 15 = 0 -> 57344
    w[0, 0] = 65000.0
    qw, deq, codes = check_edge(w, "mxfp8_e5m2")
    assert np.asarray(qw.scales).tolist() == [[127]] and deq[0, 0] == 57344.0
    assert codes[0, 0] == 0x7B


def test_mx_all_zero_and_negative_zero_blocks():
    w = np.zeros((2, 96), np.float32)
    w[1, 32:64] = -0.0
    w[1, 64] = -1e-30  # rounds to -0 in every format and rule next to an amax of 1
    w[1, 65] = 1.0
    for mode in MX_MODES:
        for rule in RULES:
            qw, deq, _ = check_edge(w, mode, rule=rule)
            s = np.asarray(qw.scales)
            assert s[0].tolist() == [0, 0, 0] and s[1, :2].tolist() == [0, 0], (mode, rule)
            assert np.all(deq[:, :64] == 0)
            assert not np.any(np.signbit(deq[0])) and np.all(np.signbit(deq[1, 32:64]))
            assert deq[1, 64] == 0 and np.signbit(deq[1, 64]) and deq[1, 65] > 0


@pytest.mark.parametrize("mode", MX_MODES)
def test_mx_nonfinite_poisons_only_its_block(mode):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((3, 96)).astype(np.float32)
    w[0, 5] = np.nan
    w[1, 40] = np.inf
    w[2, 95] = -np.inf
    for rule in RULES:
        qw, deq, _ = check_edge(w, mode, rule=rule)
        s = np.asarray(qw.scales)
        assert s[0, 0] == s[1, 1] == s[2, 2] == 255
        assert np.sum(s == 255) == 3
        nan = np.zeros((3, 96), bool)
        nan[0, :32] = nan[1, 32:64] = nan[2, 64:] = True
        np.testing.assert_array_equal(np.isnan(deq), nan)


def _mx_array(codes, scales, mode="mxfp4", dtype=np.float32):
    bits = {"mxfp4": 4, "mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "mxfp8_e4m3": 8, "mxfp8_e5m2": 8}[mode]
    data = oracle.pack_bits(np.asarray(codes), bits)
    return jq.QuantizedArray(jnp.asarray(data), jnp.asarray(np.asarray(scales, np.uint8)),
                             mode=mode, bits=bits, group_size=32, dtype=dtype)


def test_e8m0_code_zero_dequantizes_exactly():
    # e2m1 codes 7 (6), 6 (4), 5 (3), 4 (2), 0xF (-6): times 2**-127 these are float32 normals
    codes = np.zeros((2, 32), np.int64)
    codes[0, :5] = [7, 6, 5, 4, 0xF]
    codes[1, :5] = [2, 0, 0xA, 1, 0]
    qw = _mx_array(codes, [[0], [254]])
    deq = np.asarray(DEQ(qw))
    assert deq[0, :5].tolist() == [6 * 2.0 ** -127, 4 * 2.0 ** -127, 3 * 2.0 ** -127,
                                   2 * 2.0 ** -127, -6 * 2.0 ** -127]
    assert deq[0, 0] != 0
    # largest code 254: 2**127 * (1, 0, -1, 0.5)
    assert deq[1, :4].tolist() == [2.0 ** 127, 0.0, -(2.0 ** 127), 2.0 ** 126]
    assert_dequantize_matches_oracle(qw, got=deq)
    # and quantize produces code 0: amax = 6 * 2**-127 = 1.5 * 2**-125 -> floor: e = -125 - 2
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = np.float32(6 * 2.0 ** -127)
    w[0, 1] = np.float32(-3 * 2.0 ** -127)
    qw, deq, codes = check_edge(w, "mxfp4", rule="floor")
    assert np.asarray(qw.scales).tolist() == [[0]]
    assert codes[0, :2].tolist() == [7, 0b1101]
    np.testing.assert_array_equal(deq, w)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_mx_subnormal_inputs(dtype):
    """Blocks at the bottom of the E8M0 range hold float32 (and bfloat16) subnormals:
    quantize(dequantize(q)) must give q back. Scale code 0 (2**-127) with e2m1 elements
    6, -4, 0.5, -1.5, 1: values 6 * 2**-127 (normal) and 2**-128, -1.5 * 2**-127,
    2**-127 (subnormals; exact in float32 and bfloat16). floor: amax = 1.5 * 2**-125 ->
    e = -125 - 2 = -127, and every w / 2**-127 is back on the e2m1 grid."""
    codes = np.zeros((1, 32), np.int64)
    codes[0, :5] = [7, 0b1110, 1, 0b1011, 2]
    qw = _mx_array(codes, [[0]], dtype=dtype)
    w = np.asarray(DEQ(qw))
    want = np.array([6, -4, 0.5, -1.5, 1]) * 2.0 ** -127
    assert w[0, :5].astype(np.float64).tolist() == want.tolist()
    q2, _ = quant(w, "mxfp4", rule="floor")
    assert np.asarray(q2.scales).tolist() == [[0]]
    assert oracle.unpack_bits(np.asarray(q2.data), 4)[0, :5].tolist() == codes[0, :5].tolist()


def test_e8m0_code_ff_is_all_nan():
    codes = np.zeros((2, 64), np.int64)
    codes[:, ::3] = 7
    for mode, dt in [("mxfp4", np.float32), ("mxfp4", ml_dtypes.bfloat16), ("mxfp8_e4m3", np.float16)]:
        qw = _mx_array(codes, [[255, 127], [3, 255]], mode, dt)
        deq = np.asarray(DEQ(qw)).astype(np.float64)
        assert np.all(np.isnan(deq[0, :32])) and np.all(np.isnan(deq[1, 32:]))
        assert not np.any(np.isnan(deq[0, 32:])) and not np.any(np.isnan(deq[1, :32]))


def test_mx_rceil_near_smallest_scale():
    # mxfp4, amax = 2**-125 (a float32 normal). rceil: the smallest e with
    # 2**-125 <= 6 * 2**e is e = -127 (6 * 2**-127 = 1.5 * 2**-125): code 0, element 4 (code 6).
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = np.float32(2.0 ** -125)
    qw, deq = quant(w, "mxfp4", rule="rceil")
    assert np.asarray(qw.scales).tolist() == [[0]]
    assert oracle.unpack_bits(np.asarray(qw.data), 4)[0, 0] == 6


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8_e4m3"])
def test_mx_round_rule_tiny_amax(mode):
    # "round": e = round(log2(amax / max_elem)). For amax = 2**-126 (the smallest float32
    # normal), 2**-125 and 3 * 2**-126: log2(amax / 6) is about -128.6, -127.6, -127.0 and
    # log2(amax / 448) below -133; all clamp to -127: code 0. (The float32 quotient is a
    # subnormal; flushing it to zero must not produce another scale.)
    w = np.zeros((3, 32), np.float32)
    w[:, 0] = np.array([2.0 ** -126, 2.0 ** -125, 3 * 2.0 ** -126], np.float32)
    qw, deq = quant(w, mode, rule="round")
    assert np.asarray(qw.scales).tolist() == [[0], [0], [0]], np.asarray(qw.scales)
    assert_quantize_matches_oracle(qw, w, mode, None, None, "round")


@pytest.mark.parametrize("mode", MX_MODES)
def test_mx_scale_rules_near_boundaries(mode):
    """amax at, just below and just above powers of two, sqrt(2) * 2**k and max_elem * 2**k."""
    element = oracle.MODES[oracle.canonical_mode(mode)][0]
    maxv = oracle.max_finite(element)
    bases = np.array([1.0, 2.0 ** 0.5, maxv, 2.0 ** oracle.emax_elem(element),
                      2.0 ** (oracle.emax_elem(element) + 1), 3.0, 0.1])
    vals = np.concatenate([bases * 2.0 ** k for k in (-20, -3, 0, 5)]).astype(np.float32)
    vals = np.concatenate([vals, np.nextafter(vals, np.float32(np.inf)),
                           np.nextafter(vals, np.float32(0))])
    assert vals.size <= PAD_ROWS
    rng = np.random.default_rng(5)
    w = (rng.uniform(-1, 1, (vals.size, 32)) * vals[:, None]).astype(np.float32)
    w[np.arange(vals.size), rng.integers(0, 32, vals.size)] = vals
    amax = np.abs(w).max(-1).astype(np.float64)
    for rule in RULES:
        qw, deq, _ = check_edge(w, mode, rule=rule)
        assert_round_trip(w, qw, deq)
        e = np.asarray(qw.scales).astype(np.int64)[:, 0] - 127
        if rule == "rceil":  # no element saturates
            assert np.all(amax <= maxv * np.ldexp(1.0, e))
        if rule == "floor":  # OCP: the top element binade holds amax
            assert np.all(np.ldexp(1.0, e + oracle.emax_elem(element)) <= amax)
            assert np.all(amax < np.ldexp(1.0, e + oracle.emax_elem(element) + 1))


# ---------------------------------------------------------------------------
# NVFP4 and FP4.


KV = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def test_iq4nl_hand():
    """Worked groups of 32: the peak lands on -127 (scale = peak / -127, its sign the
    peak's opposite); ties go to the larger value (7 between 1 and 13 -> 13; -115.5
    between -127 and -104 -> -104); past the ends saturates (+127 -> 113); an all-zero
    group has scale 0 and decodes to 0; among equal magnitudes the first is the peak."""
    f32 = np.float32
    rows = np.zeros((4, 32), f32)
    rows[0, :6] = [-127, 7, -115.5, 127, 0, 113]          # scale 1
    rows[1, :3] = [2, -2, 1]                               # scale -2/127
    rows[3, :4] = [-0.5, 0.5, 0.25, -0.25]                 # first peak -0.5: scale 0.5/127
    w = np.concatenate([rows, rows[::-1]], axis=1)         # K = 64: two groups a row
    qw, deq, codes = check_edge(w, "iq4nl")
    codes = codes.reshape(4, 2, 32)
    scales = np.asarray(qw.scales, np.float32)
    assert scales[0, 0] == 1 and scales[1, 0] == f32(2) / f32(-127) and scales[2, 0] == 0
    assert codes[0, 0, :6].tolist() == [0, 9, 1, 15, 8, 15]
    np.testing.assert_array_equal(deq[0, :6], [-127, 13, -104, 113, 1, 113])
    assert codes[1, 0, :3].tolist() == [0, 15, 3]          # 1 / (-2/127) = -63.5 -> -65
    np.testing.assert_array_equal(deq[1, :3], np.array([-127, 113, -65], f32) * scales[1, 0])
    assert (deq[2, :32] == 0).all()
    assert scales[3, 0] == f32(-0.5) / f32(-127)
    assert deq[3, 0] == -0.5 and deq[3, 1] == f32(113) * scales[3, 0]
    # every code reachable, the extremes included, and the values are the codebook's
    w = (np.arange(32, dtype=f32) - 16)[None] * f32(127 / 16)
    qw, deq, codes = check_edge(w, "iq4nl")
    assert {0, 15} <= set(codes.ravel().tolist())
    np.testing.assert_array_equal(np.unique(deq / np.asarray(qw.scales, f32)[:, :1]),
                                  np.unique(np.array(KV, f32)[np.unique(codes)]))


def test_iq4nl_extremes_and_nonfinite():
    """float16 extremes (a large peak; a subnormal peak: a scale that rounds to 0 in
    float16, every value 0) and NaN / Inf groups (scale NaN). (A peak of 65504 gets the
    scale 516 = float16(65504/127), and -127 * 516 overflows float16: as fp4's 6 * amax/6,
    the float16 output of such a group is Inf, its float32 output finite.)"""
    w = np.zeros((3, 64), np.float16)
    w[0, 0], w[0, 1] = 60000, -60000
    w[1, :32] = np.float16(6e-8)
    w[2, 0], w[2, 33] = np.nan, np.inf
    qw, deq, _ = check_edge(w, "iq4nl")
    scales = np.asarray(qw.scales)
    assert scales.dtype == np.float16 and scales[0, 0] == np.float16(np.float32(60000) / -127)
    assert deq[0, 0] == np.float16(-127 * np.float32(scales[0, 0]))
    assert scales[1, 0] == 0 and (deq[1] == 0).all()
    assert np.isnan(scales[2]).all() and np.isnan(deq[2]).all()


def test_nvfp4_hand():
    # amax(tensor) = 2688 = 6 * 448 -> encode = 1, global_scale = 1.
    w = np.zeros((2, 32), np.float32)
    w[0, :4] = [2688.0, -1.0, 0.5, 3.0]    # block 0: amax 2688 -> e4m3(448) = 0x7E
    w[0, 16:20] = [6.0, -4.0, 1.5, -0.0]   # block 1: amax 6 -> e4m3(1) = 0x38
    w[1, :2] = [0.75, 0.25]                # block 2: amax 0.75 -> 0.125 = 2**(4-7): 0x20
    qw, deq, _ = check_edge(w, "nvfp4")
    assert np.asarray(qw.global_scale) == 1.0
    assert np.asarray(qw.scales).tolist() == [[0x7E, 0x38], [0x20, 0x00]]
    # block 0: 2688 / 448 = 6; -1 / 448 -> -0; 0.5 / 448 -> 0; 3 / 448 -> 0
    assert deq[0, :4].tolist() == [2688.0, -0.0, 0.0, 0.0] and np.signbit(deq[0, 1])
    assert deq[0, 16:20].tolist() == [6.0, -4.0, 1.5, -0.0]
    # block 2: 0.75 / 0.125 = 6, 0.25 / 0.125 = 2; block 3 is all zero (scale 0)
    assert deq[1, :2].tolist() == [0.75, 0.25]
    assert np.all(deq[1, 16:] == 0)


def test_nvfp4_global_scale_and_nonfinite():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 64)).astype(np.float32) * 3
    w[1, 20] = np.nan
    w[2, 0] = np.inf
    qw, deq, _ = check_edge(w, "nvfp4")
    # amax over the finite values only; global_scale = 1 / (2688 / amax) in float32
    amax = np.float32(np.max(np.abs(w[np.isfinite(w)])))
    assert np.asarray(qw.global_scale) == np.float32(1) / (np.float32(2688) / amax)
    s = np.asarray(qw.scales)
    assert np.isnan(oracle.decode_e4m3(s[1, 1])) and np.isnan(oracle.decode_e4m3(s[2, 0]))
    nan = np.zeros(w.shape, bool)
    nan[1, 16:32] = nan[2, 0:16] = True
    np.testing.assert_array_equal(np.isnan(deq), nan)


def test_nvfp4_all_zero():
    w = np.zeros((2, 32), np.float32)
    qw, deq, _ = check_edge(w, "nvfp4")
    assert np.asarray(qw.global_scale) == 1.0
    assert np.all(np.asarray(qw.scales) == 0) and np.all(np.asarray(qw.data) == 0)
    assert np.all(deq == 0)


def test_fp4_scale_is_a_float32_division():
    # scale = amax / 6 in float32: 5 / 6 = 0.8333... -> float32 0.833333313465 (the nearer
    # neighbour; 0.833333373070 is 4e-8 away). 5 * float32(1/6) would give the latter.
    w = np.zeros((1, 32), np.float32)
    w[0, :3] = [5.0, -2.5, 1.25]
    qw, deq = quant(w, "fp4", g=32)
    assert np.asarray(qw.scales)[0, 0] == np.float32(0.833333313465118408203125)
    codes = oracle.unpack_bits(np.asarray(qw.data), 4)[0]
    # 5 / s = 6.0000001 -> 6 (code 7); -2.5 / s -> -3 (0b1101); 1.25 / s = 1.5 -> code 3
    assert codes[:3].tolist() == [7, 0b1101, 3]


def test_fp4_hand_and_zero_groups():
    w = np.zeros((2, 32), np.float32)
    w[0, :4] = [6.0, -3.0, 0.75, 0.25]  # scale 1: 0.75 -> tie 0.5 / 1 -> 1 (even code 2); 0.25 -> 0
    w[1, :] = -0.0
    qw, deq, codes = check_edge(w, "fp4", g=16)
    assert np.asarray(qw.scales).tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert codes[0, :4].tolist() == [7, 0b1101, 2, 0]
    # a zero scale gives zero elements ("0 where the scale is 0"; the sign of -0 is not specified)
    assert np.all((codes[1] == 0) | (codes[1] == 8))
    assert deq[0, :4].tolist() == [6.0, -3.0, 1.0, 0.0]
    assert np.all(deq[1] == 0)


def test_fp4_half_precision_scale_rounding():
    # float16: amax 1000 -> 1000 / 6 = 166.67 -> float16 166.625 (spacing 0.125);
    # 1000 / 166.625 = 6.0015 -> 6
    w = np.zeros((1, 32), np.float16)
    w[0, :2] = [1000.0, -500.0]
    qw, deq, codes = check_edge(w, "fp4", g=32)
    assert np.asarray(qw.scales)[0, 0] == np.float16(166.625)
    assert codes[0, :2].tolist() == [7, 0b1101]  # 6, -500 / 166.625 = -3.0008 -> -3
    # 6 * 166.625 = 999.75: a float16 tie (spacing 0.5) -> 1000 (even);
    # -3 * 166.625 = -499.875: a tie (spacing 0.25) -> -500 (even)
    assert deq[0, :2].tolist() == [1000.0, -500.0]
    # a scale that underflows float16 to zero: amax 1e-7 / 6 < 2**-25 -> 0, elements 0
    w[0, :2] = [np.float16(1e-7), -np.float16(1e-7)]
    qw, deq, codes = check_edge(w, "fp4", g=32)
    assert np.asarray(qw.scales)[0, 0] == 0 and np.all(deq == 0)


# ---------------------------------------------------------------------------
# QuantizedArray.


def _qws():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4, 64)).astype(np.float32)
    return [jq.quantize(w, mode="affine", bits=4, group_size=32),
            jq.quantize(w.astype(ml_dtypes.bfloat16), mode="mxfp4"),
            jq.quantize(w, mode="nvfp4"),
            jq.quantize(w.astype(np.float16), mode="fp4", group_size=16)], w


def assert_same_qw(a, b):
    assert type(a) is jq.QuantizedArray and type(b) is jq.QuantizedArray
    assert (a.mode, a.bits, a.group_size, a.dtype, a.layout, a.shape) == \
        (b.mode, b.bits, b.group_size, b.dtype, b.layout, b.shape)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(bitview(x), bitview(y))
    assert (a.biases is None) == (b.biases is None)
    assert (a.global_scale is None) == (b.global_scale is None)


def test_pytree_flatten_unflatten_jit_device_put():
    qws, _ = _qws()
    for qw in qws:
        leaves, treedef = jax.tree_util.tree_flatten(qw)
        assert len(leaves) == 2 + (qw.biases is not None) + (qw.global_scale is not None)
        assert_same_qw(jax.tree_util.tree_unflatten(treedef, leaves), qw)
        assert_same_qw(jax.jit(lambda q: q)(qw), qw)
        assert_same_qw(jax.device_put(qw), qw)
        assert_same_qw(jax.device_put(qw, jax.devices()[0]), qw)
        moved = jax.device_put(qw)
        assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(moved))
        np.testing.assert_array_equal(np.asarray(DEQ(moved)), np.asarray(DEQ(qw)))
        # a QuantizedArray passes through jit as an argument and a result
        out = jax.jit(lambda q, x: (q, jq.dequantize(q) * x))(qw, 2.0)
        assert_same_qw(out[0], qw)


def test_vmap():
    qws, _ = _qws()
    for qw in qws:
        full = np.asarray(DEQ(qw))
        treedef = jax.tree_util.tree_structure(qw)
        n_leaves = treedef.num_leaves
        axes = [0, 0] + [0] * (qw.biases is not None) + [None] * (qw.global_scale is not None)
        assert len(axes) == n_leaves
        in_axes = jax.tree_util.tree_unflatten(treedef, axes)
        got = jax.vmap(jq.dequantize, in_axes=(in_axes,))(qw)
        np.testing.assert_array_equal(bitview(got), bitview(full))
        # inside vmap the logical shape is the per-expert one
        shapes = []
        jax.vmap(lambda q: shapes.append(q.shape) or jnp.zeros(()), in_axes=(in_axes,))(qw)
        assert shapes == [(4, 64)]
        # vmapping out a QuantizedArray
        back = jax.vmap(lambda q: q, in_axes=(in_axes,), out_axes=in_axes)(qw)
        assert_same_qw(back, qw)
    # plain in_axes=0 works when every child has the leading axis
    qw = qws[0]
    np.testing.assert_array_equal(np.asarray(jax.vmap(jq.dequantize)(qw)), np.asarray(DEQ(qw)))


def test_vmap_of_quantize():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((3, 4, 64)) * np.array([0.01, 1.0, 100.0])[:, None, None]).astype(np.float32)
    for mode, kw in [("mxfp4", {}), ("affine", dict(bits=3, group_size=32)), ("nvfp4", {})]:
        qv = jax.vmap(lambda x: jq.quantize(x, mode=mode, **kw))(w)
        assert qv.shape == w.shape
        if mode == "nvfp4":  # one global scale per expert (each vmapped call sees its own amax)
            assert np.shape(qv.global_scale) == (3,)
        for e in range(3):
            assert_quantize_matches_oracle(qv[e], w[e], mode, kw.get("bits"), kw.get("group_size"), None)
        assert_dequantize_matches_oracle(qv)


def test_scan_over_experts():
    qws, _ = _qws()
    for qw in qws[:2] + qws[3:]:  # children all carry the expert axis
        full = np.asarray(jax.jit(jq.dequantize, static_argnums=1)(qw, jnp.float32))

        def step(c, q):
            d = jq.dequantize(q, dtype=jnp.float32)
            return c + d.sum(), d

        tot, ys = jax.jit(lambda q: lax.scan(step, jnp.float32(0), q))(qw)
        np.testing.assert_array_equal(np.asarray(ys), full)
    # nvfp4: the scalar global scale stays outside the scan
    qw = qws[2]
    full = np.asarray(DEQ(qw))
    gs = qw.global_scale

    def step2(c, xs):
        data, scales = xs
        q = jq.QuantizedArray(data, scales, None, gs, mode="nvfp4", bits=4, group_size=16,
                              dtype=qw.dtype)
        return c, jq.dequantize(q)

    _, ys = lax.scan(step2, 0, (qw.data, qw.scales))
    np.testing.assert_array_equal(np.asarray(ys), full)


def test_indexing_leading_axes():
    qws, _ = _qws()
    for qw in qws:
        full = np.asarray(DEQ(qw))
        kids = [arr(c) for c in (qw.data, qw.scales, qw.biases)]
        cases = [1, -1, slice(1, 3), np.array([2, 0, 2]), jnp.array([1, 0]),
                 (slice(None), slice(1, 3)), (np.array([0, 2]), slice(1, 3)), (2, slice(None, None, 2))]
        for idx in cases:
            want = full[idx]
            sub = qw[idx]
            assert isinstance(sub, jq.QuantizedArray)
            assert sub.shape == want.shape, (idx, sub.shape, want.shape)
            assert (sub.mode, sub.bits, sub.group_size, sub.dtype, sub.layout) == \
                (qw.mode, qw.bits, qw.group_size, qw.dtype, qw.layout)
            np_idx = tuple(np.asarray(i) if isinstance(i, jax.Array) else i
                           for i in (idx if isinstance(idx, tuple) else (idx,)))
            for got_c, c in zip((sub.data, sub.scales, sub.biases), kids):
                if c is None:
                    assert got_c is None
                else:
                    np.testing.assert_array_equal(bitview(got_c), bitview(c[np_idx]))
            if qw.global_scale is None:
                assert sub.global_scale is None
            else:
                assert np.asarray(sub.global_scale) == np.asarray(qw.global_scale)
        # dequantize of a slice equals the slice of dequantize (one compile per array)
        np.testing.assert_array_equal(bitview(DEQ(qw[1])), bitview(full[1]))
        # traced index under jit
        got = jax.jit(lambda q, i: jq.dequantize(q[i]))(qw, jnp.int32(2))
        np.testing.assert_array_equal(bitview(got), bitview(full[2]))


def test_integer_index_on_n_axis():
    """qw[e, n] drops the N axis: either refuse it (IndexError) or give a
    QuantizedArray that dequantizes to w[e, n]; never one that breaks the ops."""
    qws, _ = _qws()
    for qw in qws:
        full = np.asarray(DEQ(qw))
        try:
            sub = qw[1, 2]
        except IndexError:
            continue
        np.testing.assert_array_equal(bitview(DEQ(sub)), bitview(full[1, 2]))


def test_indexing_rejects_k_and_ellipsis():
    qws, _ = _qws()
    for qw in qws:
        for bad in [(0, 0, 0), (slice(None), slice(None), 0), Ellipsis, (Ellipsis, 0),
                    (0, Ellipsis), None, (None, 0)]:
            with pytest.raises(IndexError):
                qw[bad]


@pytest.mark.parametrize("convert", [np.asarray, np.array, jnp.asarray, jnp.array, list, iter,
                                     lambda qw: [row for row in qw], lambda qw: jnp.stack([qw]),
                                     lambda qw: jax.jit(jnp.asarray)(qw)],
                         ids=["np.asarray", "np.array", "jnp.asarray", "jnp.array", "list",
                              "iter", "for", "jnp.stack", "jit-asarray"])
def test_quantized_array_is_not_an_array(convert):
    """np.asarray once gave array([], float64) and jnp.asarray shape (0,) although
    len(qw) was 256: every conversion must point at jq.dequantize instead."""
    qw = jq.quantize(np.ones((4, 256, 64), np.float32), "mxfp4")
    assert len(qw) == 4
    with pytest.raises(TypeError, match=r"jq\.dequantize"):
        convert(qw)


def _abstract(shape, dtype, **kw):
    return jax.eval_shape(functools.partial(jq.quantize, **kw), jax.ShapeDtypeStruct(shape, dtype))


def test_shape_dtype_nbytes_by_hand():
    # data [2,3,16] uint32 = 384 B; scales and biases [2,3,2] float16 = 24 B each
    qw = _abstract((2, 3, 128), jnp.float16, mode="affine", bits=4, group_size=64)
    assert qw.shape == (2, 3, 128) and qw.dtype == np.float16 and qw.ndim == 3
    assert qw.size == 768 and len(qw) == 2
    assert qw.data.shape == (2, 3, 16) and qw.scales.shape == qw.biases.shape == (2, 3, 2)
    assert qw.nbytes == 384 + 24 + 24
    qw = _abstract((1, 64), jnp.float32, mode="affine", bits=3, group_size=32)
    assert qw.data.shape == (1, 6) and qw.nbytes == 24 + 8 + 8  # 64*3/32 = 6 words
    qw = _abstract((4, 64), jnp.float32, mode="mxfp4")
    assert qw.shape == (4, 64) and qw.dtype == np.float32 and qw.scales.dtype == np.uint8
    assert qw.nbytes == 4 * 8 * 4 + 4 * 2  # data [4,8] words + uint8 scales [4,2]
    qw = _abstract((2, 32), jnp.bfloat16, mode="nvfp4")
    assert qw.dtype == jnp.bfloat16 and qw.global_scale.shape == ()
    assert qw.nbytes == 2 * 4 * 4 + 2 * 2 + 4  # data, e4m3 scales, float32 global scale
    qw = _abstract((5, 96), jnp.float32, mode="mxfp6_e3m2")
    assert qw.data.shape == (5, 18) and qw.nbytes == 5 * 18 * 4 + 5 * 3
    qw = _abstract((5, 64), jnp.float32, mode="mxfp8_e5m2")
    assert qw.data.shape == (5, 16) and qw.nbytes == 5 * 16 * 4 + 5 * 2
    qw = _abstract((3, 7, 64), jnp.bfloat16, mode="fp4", group_size=16)
    assert qw.data.shape == (3, 7, 8) and qw.scales.dtype == jnp.bfloat16
    assert qw.nbytes == 3 * 7 * 8 * 4 + 3 * 7 * 4 * 2
    # concrete arrays agree with the abstract ones
    real = jq.quantize(np.zeros((4, 64), np.float32), mode="mxfp4")
    assert real.nbytes == 136 and real.shape == (4, 64) and real.dtype == np.float32


# ---------------------------------------------------------------------------
# The non-finite rule (docs/formats.md), every mode and every shape: a group
# holding NaN or +-Inf dequantizes to NaN in every element, other groups are
# unaffected. XLA's vectorized CPU min/max drop NaNs depending on the shape, so
# affine once lost a NaN at [0, 0] of a (64, 64) matrix but not of (16, 64).

NONFINITE_MODES = ["affine", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
                   "nvfp4", "fp4", "iq4nl"]


@pytest.mark.parametrize("mode", NONFINITE_MODES)
@pytest.mark.parametrize("shape", [(16, 64), (64, 64), (64, 256), (2, 3, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_nonfinite_group_is_nan_and_only_it(mode, shape):
    g = resolved(mode, None, None)[1]
    rng = np.random.default_rng(zlib.crc32(f"{mode}{shape}".encode()))
    clean = rng.standard_normal(shape).astype(np.float32)
    groups = clean.reshape(-1, shape[-1] // g, g)
    rows = groups.shape[0]
    # (row, group, position in group, value): first, middle and last element of a
    # group, NaN / +Inf / -Inf, in the first, a middle and the last row and group.
    poison = []
    for i, (pos, value) in enumerate(
            [(p, v) for p in (0, g // 2, g - 1) for v in (np.nan, np.inf, -np.inf)]):
        row = [0, rows // 2, rows - 1][i % 3]
        poison.append((row, [0, groups.shape[1] // 2, groups.shape[1] - 1][i // 3], pos, value))
    poison = list({(r, c): (r, c, p, v) for r, c, p, v in poison}.values())  # one per group
    dirty = groups.copy()
    for r, c, p, v in poison:
        groups[r, c, p] = 0.0  # same finite values (NVFP4's tensor amax) as the dirty copy
        dirty[r, c, p] = v
    for dtype in ([np.float32, ml_dtypes.bfloat16] if mode in ("affine", "fp4", "iq4nl")
                  else [np.float32]):
        ref = np.asarray(jq.dequantize(jq.quantize(groups.reshape(shape).astype(dtype), mode),
                                       dtype=jnp.float32)).reshape(groups.shape)
        got = np.asarray(jq.dequantize(jq.quantize(dirty.reshape(shape).astype(dtype), mode),
                                       dtype=jnp.float32)).reshape(groups.shape)
        expect_nan = np.zeros(groups.shape[:2], bool)
        for r, c, _, _ in poison:
            expect_nan[r, c] = True
        missing = np.argwhere(~np.isnan(got) & expect_nan[..., None])
        assert not missing.size, (dtype, missing)
        np.testing.assert_array_equal(got[~expect_nan], ref[~expect_nan])


def test_replace_and_flatten_leading_keep_every_field():
    """QuantizedArray.replace rebuilds (validated) with the named fields changed;
    flatten_leading ([*B, N, K] -> [prod(B), N, K]) keeps the format, the layout and a
    global scale given per leading index (broadcast over B with the rest), so the flat
    array dequantizes to the stack's values."""
    w = jax.random.normal(jax.random.key(7), (2, 3, 16, 64), jnp.float32)
    per_matrix = jax.vmap(jax.vmap(lambda m: jq.quantize(m, mode="nvfp4", layout="canonical")))(w)
    per_stack = jq.quantize(w[0], mode="nvfp4", layout="canonical")
    partial = per_matrix.replace(global_scale=per_matrix.global_scale[:, 0])  # one per B0
    for qw, lead_gs in ((per_matrix, (2, 3)), (partial, (2,))):
        assert qw.global_scale.shape == lead_gs
        flat = qw.flatten_leading()
        assert flat.shape == (6, 16, 64) and flat.global_scale.shape == (6,)
        assert (flat.mode, flat.bits, flat.group_size, flat.dtype, flat.layout) == (
            qw.mode, qw.bits, qw.group_size, qw.dtype, qw.layout)
        np.testing.assert_array_equal(np.asarray(jq.dequantize(flat)),
                                      np.asarray(jq.dequantize(qw)).reshape(6, 16, 64))
    one = per_matrix.flatten_leading(1)  # B = (2,): the shape stays, the scales' too
    assert one.shape == (2, 3, 16, 64) and one.global_scale.shape == (2, 3)
    assert per_stack.flatten_leading().global_scale.shape == jnp.shape(per_stack.global_scale)
    two_d = per_stack[0].flatten_leading()
    assert two_d.shape == (1, 16, 64)
    packed = jq.prepack(jq.quantize(w[0], mode="affine", bits=4, group_size=64,
                                    layout="canonical"), "cuda_mma")
    assert packed.flatten_leading().layout == "cuda_mma"
    np.testing.assert_array_equal(np.asarray(jq.dequantize(packed.flatten_leading())),
                                  np.asarray(jq.dequantize(packed)))
    assert per_stack.replace(layout="canonical") is not per_stack
    with pytest.raises(TypeError, match="unknown field"):
        per_stack.replace(shape=(1, 2))
    with pytest.raises(ValueError):
        per_stack.replace(bits=3)
    with pytest.raises(ValueError, match="n="):
        per_stack.flatten_leading(2)
