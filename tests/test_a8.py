"""quantize_rows and qmm_a8 (8-bit activations, docs/a8.md) against a float64 numpy
oracle written from the docs' rules: codes and scales bit for bit (on a GPU an int8
code at a rounding tie may be one off), products within the accumulation bound, random shapes, edge values (zero rows, Inf and
NaN rows, huge and tiny magnitudes), the MX-FP4 exactness boundary, bad arguments,
jit and vmap. The GPU's GEMMs (cuBLASLt IMMA / FP8) are timed by `bench prefill`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from tests import oracle
from tests.common import EPS

CODE_TYPES = ["int8", "float8_e4m3fn"]
X_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TINY = 2.0**-126


def _pow2_exponent(amax):
    """The smallest e with amax <= 448 * 2**e, clipped to [-126, 127] (float64, exact)."""
    if amax == 0:
        return -126
    e = math.frexp(amax / 448)[1]  # amax / 448 < 2**e, maybe not the smallest e
    while amax <= 448 * 2.0 ** (e - 1):
        e -= 1
    while amax > 448 * 2.0**e:
        e += 1
    return min(max(e, -126), 127)


def oracle_rows(a, code_type):
    """(codes as float64 values, float64 scales, ties) of every row of float array a.
    ties marks the int8 codes whose quotient lies within 2 float32 ulps of a half: a
    GPU's reciprocal of the scale is not correctly rounded (docs/a8.md), so there such a
    code may differ by one."""
    a32 = np.asarray(a, np.float32).reshape(-1, np.shape(a)[-1])
    codes = np.zeros(a32.shape, np.float64)
    ties = np.zeros(a32.shape, bool)
    scales = np.full(a32.shape[0], np.nan)
    for i, row in enumerate(a32):
        if not np.all(np.isfinite(row)):
            continue  # zero codes, NaN scale
        amax = float(np.max(np.abs(row), initial=0.0))
        if code_type == "int8":  # float32 arithmetic, one rounding per operation
            s = max(np.float32(amax) * np.float32(1 / 127), np.float32(TINY))
            inv = np.float32(1) / np.float32(s)
            codes[i] = np.clip(np.rint(row * inv), -127, 127)
            q = row.astype(np.float64) / np.float64(s)
            ties[i] = np.abs(np.abs(q - np.floor(q)) - 0.5) <= 2.0**-22 * np.maximum(np.abs(q), 1)
        else:
            s = 2.0 ** _pow2_exponent(amax)
            codes[i] = oracle.decode_element(oracle.encode_element(row.astype(np.float64) / s,
                                                                   "e4m3"), "e4m3")
        scales[i] = s
    shape = np.shape(a)
    return codes.reshape(shape), scales.reshape(shape[:-1]), ties.reshape(shape)


def assert_codes_equal(got, codes, ties):
    """Bit for bit on the CPU; elsewhere a code at a tie may be one off."""
    got = np.asarray(got, np.float64)
    if jax.default_backend() != "cpu":
        got = np.where(ties & (np.abs(got - codes) <= 1), codes, got)
    np.testing.assert_array_equal(got, codes)


def oracle_qmm_a8(x, w, code_type, out_dtype, precision=None):
    """(float64 y before the output rounding, bound on |y_op - y|) of qmm_a8(x,
    quantize_rows(w)): the sum's rounding (int8: exact int32 sums; FP8: float32 on the
    CPU; on a GPU the tensor cores' fast accumulation, bounded by 2**-10 of the sum of
    |products| with the default precision and 2**-14 with HIGHEST), the scales' product
    and its product with the sum in float32, one rounding of the output, and a code one
    off at a tie (GPU) on either side."""
    qx, sx, ties = oracle_rows(x, code_type)
    codes, scales, w_ties = oracle_rows(w, code_type)
    acc = qx @ codes.T  # exact in float64 (integers; e4m3 products)
    y = acc * sx[..., None] * scales
    mag = (np.abs(qx) @ np.abs(codes).T) * sx[..., None] * scales
    acc_err = 0.0
    if code_type != "int8":
        acc_err = x.shape[-1] * 2.0**-24
        if jax.default_backend() != "cpu":
            acc_err = max(acc_err, 2.0**-14 if precision == jax.lax.Precision.HIGHEST
                          else 2.0**-10)
    at_ties = (ties @ np.abs(codes).T + (np.abs(qx) + 1) @ w_ties.T) * sx[..., None] * scales
    bound = acc_err * mag + (2 * EPS[jnp.dtype(out_dtype)] + 2.0**-22) * np.abs(y) + at_ties
    return y, bound + 1e-30


def _check_close(y, want, bound):
    """y within bound of want; NaN where want is NaN; +-Inf where |want| is past y's
    dtype's largest finite value by more than the bound (either where it is within)."""
    got = np.asarray(y, np.float64)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    top = float(jnp.finfo(y.dtype).max)
    over = np.abs(want) - bound > top
    np.testing.assert_array_equal(got[over], np.sign(want[over]) * np.inf)
    either = ~over & (np.abs(want) + bound > top) & np.isinf(got)
    err = np.where(nan | over | either, 0, np.abs(got - want))
    bound = np.where(nan, np.inf, bound)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (worst, got[worst], want[worst], bound[worst])


@pytest.mark.parametrize("code_type", CODE_TYPES)
@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_quantize_rows_matches_oracle(code_type, dtype, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 9, rng.integers(0, 2))) + (int(rng.integers(1, 70)),
                                                               int(rng.integers(1, 300)))
    a = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,)))
    a = jnp.asarray(a.astype(np.float32)).astype(dtype)
    r = jax.jit(jq.quantize_rows, static_argnums=1)(a, code_type)
    codes, scales, ties = oracle_rows(np.asarray(a, np.float32), code_type)
    assert r.codes.dtype == jnp.dtype(code_type) and r.scales.dtype == jnp.float32
    assert_codes_equal(r.codes, codes, ties)
    np.testing.assert_array_equal(np.asarray(r.scales, np.float64), scales)
    assert np.all(np.abs(np.asarray(r.codes, np.float64)) <= (127 if code_type == "int8" else 448))


@pytest.mark.parametrize("code_type", CODE_TYPES)
def test_scale_edges(code_type):
    """The scale rule at its edges: rows whose largest magnitude is 0, float32's smallest
    normal and a subnormal, powers of two, 448 * 2**k and 127 * 2**k exactly and one ulp
    above, float32's largest; int8 rows with exact rounding ties (x.5 codes)."""
    up = lambda v: np.nextafter(np.float32(v), np.float32(np.inf))
    amaxes = [0.0, 2.0**-126, 2.0**-140, 1.0, 2.0**-20, 2.0**40, float(np.finfo(np.float32).max)]
    for k in (-100, -3, 0, 5, 100):
        for cap in (448.0, 127.0):
            amaxes += [cap * 2.0**k, float(up(cap * 2.0**k))]
    rows = np.zeros((len(amaxes) + 1, 8), np.float32)
    rows[:-1, 0] = amaxes
    third = np.float32(amaxes) / 3
    rows[:-1, 1] = -np.where(third >= 2.0**-126, third, 0)  # no subnormals (docs/a8.md)
    rows[-1] = [127, 0.5, 1.5, 2.5, -0.5, -2.5, 63.5, 1]  # scale 1: ties at every .5
    r = jax.jit(jq.quantize_rows, static_argnums=1)(jnp.asarray(rows), code_type)
    codes, scales, ties = oracle_rows(rows, code_type)
    np.testing.assert_array_equal(np.asarray(r.scales, np.float64), scales)
    assert_codes_equal(r.codes, codes, ties)
    if code_type == "int8":
        assert codes[-1].tolist() == [127, 0, 2, 2, 0, -2, 64, 1]  # half to even


@pytest.mark.parametrize("precision", [None, jax.lax.Precision.HIGHEST], ids=["default", "highest"])
@pytest.mark.parametrize("code_type", CODE_TYPES)
@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_qmm_a8_matches_oracle(code_type, dtype, seed, precision):
    rng = np.random.default_rng(100 + seed)
    m, n, k = (int(v) for v in rng.integers(1, [40, 90, 400]))
    k = 50 if seed == 0 else k  # padded to 64 (XLA's GPU int8 dot got K = 50 wrong)
    lead = tuple(rng.integers(1, 4, rng.integers(0, 2)))
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    x = jnp.asarray(rng.standard_normal(lead + (m, k)).astype(np.float32) * 3).astype(dtype)
    y = jax.jit(jq.qmm_a8, static_argnums=2)(x, jq.quantize_rows(w, code_type), precision)
    assert y.dtype == dtype and y.shape == lead + (m, n)
    want, bound = oracle_qmm_a8(np.asarray(x, np.float32), w, code_type, dtype, precision)
    _check_close(y, want, bound)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("code_type", CODE_TYPES)
def test_edge_rows(code_type, dtype):
    """Zero, huge, tiny, Inf and NaN rows of x and of w: NaN exactly where a non-finite
    row meets, every other product as the oracle says; a row near float32's largest
    against a small weight row stays finite (the scales multiply first)."""
    rng = np.random.default_rng(7)
    k = 96
    x = rng.standard_normal((8, k)).astype(np.float32)
    x[0] = 0
    x[7] = 1e38
    x[1] *= 1e18
    x[2] *= 1e-30
    x[3, 5] = np.inf
    x[4, 9] = np.nan
    x[5, :] = 0
    x[5, 3] = -2.0**-100
    w = rng.standard_normal((6, k)).astype(np.float32)
    w[0] = 0
    w[1] *= 1e-25
    w[2, 1] = -np.inf
    w[3] *= 1e18
    w[4] *= 1e-8
    wq = jq.quantize_rows(jnp.asarray(w), code_type)
    codes, scales, ties = oracle_rows(w, code_type)
    assert_codes_equal(wq.codes, codes, ties)
    np.testing.assert_array_equal(np.asarray(wq.scales, np.float64), scales)
    x = np.asarray(jnp.asarray(x).astype(dtype), np.float32)  # x's values in its dtype
    y = jax.jit(jq.qmm_a8)(jnp.asarray(x).astype(dtype), wq)
    want, bound = oracle_qmm_a8(x, w, code_type, dtype)
    assert np.isnan(want[3]).all() and np.isnan(want[:, 2]).all() and np.isfinite(want[0, 0])
    assert np.isfinite(want[7, 4]) and abs(want[7, 4]) > 1e28
    _check_close(y, want, bound)
    y = np.asarray(y, np.float32)
    assert (y[0, [0, 1, 3, 4, 5]] == 0).all() and (y[[0, 1, 2, 5, 6], 0] == 0).all()


def _mxfp4_row(spans):
    """One mxfp4 weight row per span: block 0 at scale 2**0 holding 6.0, the other blocks
    at scale 2**-span holding every E2M1 magnitude."""
    k = 64
    w = np.zeros((len(spans), k), np.float32)
    mags = np.array([0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    for i, span in enumerate(spans):
        w[i, :32] = 6.0
        w[i, 32:32 + 14] = np.concatenate([mags, -mags]) * 2.0**-span
    return w


def test_mxfp4_rows_convert_exactly_within_14_binades():
    """docs/a8.md: an MX-FP4 row converts to E4M3 codes exactly while its blocks' scales
    stay within 2**-14 of the largest; at 15 binades the smallest values round."""
    w = _mxfp4_row([0, 7, 14, 15])
    qw = jq.quantize(jnp.asarray(w), "mxfp4")
    exact = jq.dequantize(qw, jnp.float32)
    np.testing.assert_array_equal(np.asarray(exact), w)  # the rows are mxfp4 values
    got = np.asarray(jq.quantize_rows(qw).dequantize())
    np.testing.assert_array_equal(got[:3], w[:3])
    assert (got[3] != w[3]).any()
    rng = np.random.default_rng(3)
    qw = jq.quantize(jnp.asarray(rng.standard_normal((64, 256)).astype(np.float32)), "mxfp4")
    np.testing.assert_array_equal(np.asarray(jq.quantize_rows(qw).dequantize()),
                                  np.asarray(jq.dequantize(qw, jnp.float32)))


def test_bfloat16_output_path_rounds_once():
    """x in bfloat16 with E4M3 codes lets the GEMM round to bfloat16 (power-of-two
    scales): on the CPU bit for bit the float32 path rounded to bfloat16."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((33, 200)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((17, 200)).astype(np.float32)).astype(jnp.bfloat16)
    wq = jq.quantize_rows(w)
    y16 = np.asarray(jq.qmm_a8(x, wq), np.float64)
    y32 = np.asarray(jq.qmm_a8(x.astype(jnp.float32), wq).astype(jnp.bfloat16), np.float64)
    if jax.default_backend() == "cpu":  # the same float32 sum: the same bits
        np.testing.assert_array_equal(y16, y32)
        return
    # two GEMMs, each with its fast accumulation: one bfloat16 ulp and both sums' errors
    qx, sx, _ = oracle_rows(np.asarray(x, np.float32), "float8_e4m3fn")
    codes = np.abs(np.asarray(wq.codes, np.float64))
    bound = np.abs(y32) * 2.0**-7
    bound += 2 * 2.0**-10 * (np.abs(qx) @ codes.T) * sx[:, None] * np.asarray(wq.scales)
    assert np.all(np.abs(y16 - y32) <= bound)


def test_vmap_and_stacked_weights():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((3, 40, 64)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((3, 5, 64)).astype(np.float32))
    for code_type in CODE_TYPES:
        wq = jax.vmap(lambda w: jq.quantize_rows(w, code_type))(w)
        y = jax.jit(jax.vmap(jq.qmm_a8))(x, wq)
        for e in range(3):
            one = jq.qmm_a8(x[e], jq.quantize_rows(w[e], code_type))
            np.testing.assert_array_equal(np.asarray(y[e]), np.asarray(one))


def test_bad_arguments():
    w = jnp.ones((8, 16), jnp.float32)
    wq = jq.quantize_rows(w, "int8")
    x = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(ValueError, match="dtype"):
        jq.quantize_rows(w, "int4")
    with pytest.raises(ValueError, match="dtype"):
        jq.quantize_rows(w, jnp.float8_e5m2)
    with pytest.raises(TypeError, match="a must"):
        jq.quantize_rows(jnp.ones((8, 16), jnp.int32))
    with pytest.raises(ValueError, match="a must"):
        jq.quantize_rows(jnp.float32(1.0))
    with pytest.raises(TypeError, match="already"):
        jq.quantize_rows(wq)
    with pytest.raises(TypeError, match="w must .*quantize_rows\\(qw\\)"):
        jq.qmm_a8(x, jq.quantize(jnp.ones((8, 32)), "mxfp4"))
    with pytest.raises(TypeError, match="w must"):
        jq.qmm_a8(x, w)
    with pytest.raises(TypeError, match="x must"):
        jq.qmm_a8(jnp.ones((2, 16), jnp.int32), wq)
    with pytest.raises(ValueError, match="x must .*K = 16"):
        jq.qmm_a8(jnp.ones((2, 15)), wq)
    with pytest.raises(ValueError, match="w must be 2-D"):
        jq.qmm_a8(x, jq.quantize_rows(jnp.ones((2, 8, 16)), "int8"))
    with pytest.raises(ValueError, match="int32 accumulator"):
        big = jq.RowQuantizedArray(jnp.zeros((1, 140000), jnp.int8), jnp.ones((1,)))
        jq.qmm_a8(jnp.zeros((1, 140000)), big)
    with pytest.raises(TypeError, match="w.scales must be a float32"):
        jq.qmm_a8(x, jq.RowQuantizedArray(wq.codes, wq.scales.astype(jnp.int32)))
    with pytest.raises(TypeError, match="w.scales must be a float32"):
        jq.qmm_a8(x, jq.RowQuantizedArray(wq.codes, [1.0] * 8))
    with pytest.raises(ValueError, match="w.codes's dtype"):
        jq.qmm_a8(x, jq.RowQuantizedArray(wq.codes.astype(jnp.int16), wq.scales))
    with pytest.raises(ValueError, match="int32 accumulator"):  # -128 codes are possible
        big = jq.RowQuantizedArray(jnp.zeros((1, 131072), jnp.int8), jnp.ones((1,)))
        jq.qmm_a8(jnp.zeros((1, 131072)), big)
    # empty x and K = 0: empty and zero products, no error
    assert jq.qmm_a8(jnp.zeros((0, 16)), wq).shape == (0, 8)
    empty_k = jq.quantize_rows(jnp.zeros((8, 0)), "int8")
    np.testing.assert_array_equal(jq.qmm_a8(jnp.zeros((2, 0)), empty_k), np.zeros((2, 8)))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda x: jq.qmm_a8(x, wq).sum())(x)
