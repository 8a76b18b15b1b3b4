"""The fused decode ops (jaxquant/ops/fused.py) on CPU: rms_norm_qmm, qmm_swiglu,
rms_norm_qmm_swiglu, qmm_add and gather_qmm_swiglu against the float64 oracle and against
the composition of the unfused ops, every mode of the activation, float32/bfloat16, edge
values, bad inputs, jit/vmap/scan/grad, and the fallback to the unfused ops on a backend
without a fused kernel.

The GPU tests (marked `gpu`; skipped with the reason without an NVIDIA GPU and the CUDA
library with the fused GEMV; tools/gpu/check_decode.sh runs them): the fused decode GEMVs
(gpu_src/cuda/gemv_mma.h, FUSE) on the cuda_mma layout: rms_norm_qmm's norm prologue,
qmm_swiglu's epilogue, both (rms_norm_qmm_swiglu) and qmm_add's addend against the unfused
ffi ops (to rounding; qmm_add bit for bit) and the float64 oracle, every mode x
float32/float16/bfloat16 x M in {1, 2, 8, 16}; gather_qmm_swiglu's on gather
slots (bad ids, dedupe, a bias row per expert); the cases the kernel does not take (I not a
multiple of 16, more than 16 rows, x too large to stage) run the unfused kernels; the
handler's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxquant as jq
import jaxquant.ffi as jf
from tests.common import DTYPES as ALL_DTYPES
from tests.common import EPS, deq64, quantize_for, rand, rms64
from tests.common import GPU_NATIVE_MODES as ALL_MODES
from tests.test_ops import nrand, oracle_quantized

MODES = [("affine", 4), ("affine", 3), ("mxfp4", 4), ("nvfp4", 4), ("mxfp8_e4m3", 8)]
DTYPES = [jnp.float32, jnp.bfloat16]
GPT_OSS = dict(activation="gpt_oss", limit=7.0, alpha=1.702)


@pytest.fixture(autouse=True)
def _reference_backend(request):
    """The ops' definition: the reference (the fallback test names its backend); the GPU
    tests keep the automatic choice, whose kernels they check."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with jq.backend("reference"):
        yield


def f64(a):
    return np.asarray(a, np.float64)


def matmul_bound(x64, w64, dtype):
    """Elementwise bound of y = x @ w.T as qmm computes it (w and x rounded to x's dtype
    at worst, float32 accumulation over K, the output rounded once)."""
    eps = EPS[jnp.dtype(dtype)]
    want = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    return want, (2 * eps + x64.shape[-1] * 2.0**-24) * mag + eps * np.abs(want)


def swiglu64(gate, up, activation, limit=None, alpha=1.702):
    """float64 act(gate, up) (docs/ops.md's composition) and |d act / d gate|,
    |d act / d up| bounds for the error propagation."""
    sig = lambda v: 1 / (1 + np.exp(-v))
    if activation == "silu":
        s = sig(gate)
        return gate * s * up, (1.1 * np.abs(up), np.abs(gate * s))
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    s = sig(alpha * gate)
    return ((up + 1) * gate * s,
            (np.abs(up + 1) * (1 + alpha * np.abs(gate)), np.abs(gate * s)))


def assert_swiglu_close(out, x, qw, bias, dtype, activation, limit=None, alpha=1.702, w64=None):
    y, b = matmul_bound(f64(x), deq64(qw) if w64 is None else w64, dtype)
    assert_swiglu_of(out, y, b, bias, dtype, activation, limit, alpha)


def assert_swiglu_of(out, y, b, bias, dtype, activation, limit=None, alpha=1.702):
    """out against act(y + bias) for the float64 product y, within b of it elementwise."""
    if bias is not None:
        y = y + f64(bias)
    i = y.shape[-1] // 2
    want, (dg, du) = swiglu64(y[..., :i], y[..., i:], activation, limit, alpha)
    eps = EPS[jnp.dtype(dtype)]
    bound = dg * b[..., :i] + du * b[..., i:] + 2 * eps * np.abs(want) + 1e-30
    got = f64(out)
    assert got.shape == want.shape and out.dtype == dtype
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


# ---------------------------------------------------------------------------
# rms_norm_qmm


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_qmm_matches_oracle(mode, bits, dtype):
    n, k = 48, 128
    qw = oracle_quantized(nrand(0, (n, k)), mode, bits)
    x = jnp.asarray(nrand(1, (2, 3, k), scale=3.0), dtype)
    w = jnp.asarray(nrand(2, (k,)), dtype)
    y = jax.jit(lambda x, w, q: jq.rms_norm_qmm(x, w, q, eps=1e-5, weight_offset=0.5))(x, w, qw)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    h64 = rms64(x, w, eps=1e-5, off=0.5)
    want, bound = matmul_bound(h64, deq64(qw), dtype)
    # the normalized x is rounded to x's dtype before the product: one more eps of |h|
    bound = bound + EPS[jnp.dtype(dtype)] * (np.abs(h64) @ np.abs(deq64(qw)).T)
    assert np.all(np.abs(f64(y) - want) <= bound)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 40), groups=st.integers(1, 3),
       weighted=st.booleans(), offset=st.sampled_from([0.0, 1.0]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rms_norm_qmm_equals_unfused(rows, n, groups, weighted, offset, dtype, seed):
    k = 32 * groups
    qw = oracle_quantized(nrand(seed, (n, k)), "mxfp4")
    x = jnp.asarray(nrand(seed + 1, (rows, k), scale=np.exp(seed % 5 - 2)), dtype)
    w = jnp.asarray(nrand(seed + 2, (k,)), dtype) if weighted else None
    fused = jq.rms_norm_qmm(x, w, qw, eps=1e-6, weight_offset=offset)
    unfused = jq.qmm(jq.rms_norm(x, w, eps=1e-6, weight_offset=offset), qw)
    np.testing.assert_array_equal(f64(fused), f64(unfused))


def test_rms_norm_qmm_edge_values():
    k = 64
    qw = oracle_quantized(nrand(0, (16, k)), "affine", 4)
    w = jnp.asarray(nrand(1, (k,)))
    x = np.stack([np.zeros(k), np.full(k, 1e30), np.full(k, 1e-30),
                  np.where(np.arange(k) == 3, np.nan, 1.0), np.full(k, np.inf)]).astype(np.float32)
    fused = jq.rms_norm_qmm(x, w, qw)
    unfused = jq.qmm(jq.rms_norm(x, w), qw)
    np.testing.assert_array_equal(f64(fused), f64(unfused))
    assert np.all(f64(fused)[0] == 0)  # a zero row: rsqrt(eps) * 0
    assert np.all(np.isnan(f64(fused)[3])) and np.all(np.isfinite(f64(fused)[:3]))


def test_rms_norm_qmm_prepacked_weight():
    # a kernel layout everywhere: the reference unpacks it first
    qw = oracle_quantized(nrand(0, (32, 128)), "mxfp4")
    x, w = nrand(1, (2, 128)), nrand(2, (128,))
    packed = jq.prepack(qw, "cuda_mma")
    np.testing.assert_array_equal(jq.rms_norm_qmm(x, w, packed), jq.rms_norm_qmm(x, w, qw))


# ---------------------------------------------------------------------------
# qmm_swiglu


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [dict(activation="silu"), GPT_OSS,
                                 dict(activation="gpt_oss", limit=None, alpha=1.0)],
                         ids=["silu", "gpt_oss", "gpt_oss_unclamped"])
def test_qmm_swiglu_matches_oracle(mode, bits, dtype, act):
    i, k = 24, 128
    qw = oracle_quantized(nrand(0, (2 * i, k), scale=0.5), mode, bits)
    x = jnp.asarray(nrand(1, (2, 3, k)), dtype)
    bias = jnp.asarray(nrand(2, (2 * i,)), dtype)
    y = jax.jit(lambda x, q, b: jq.qmm_swiglu(x, q, bias=b, **act))(x, qw, bias)
    assert y.shape == (2, 3, i)
    assert_swiglu_close(y, x, qw, bias, dtype, act["activation"], act.get("limit"),
                        act.get("alpha", 1.702))


def test_qmm_swiglu_clamps():
    # gpt-oss: gate clamped above only, up on both sides (values far past the limit)
    k = 64
    qw = oracle_quantized(nrand(0, (32, k), scale=4.0), "mxfp8_e4m3")
    x = nrand(1, (4, k), scale=4.0)
    y = jq.qmm_swiglu(x, qw, **GPT_OSS)
    assert_swiglu_close(y, x, qw, None, jnp.float32, "gpt_oss", 7.0)
    g = f64(jq.qmm(x, qw))
    assert np.abs(g).max() > 20  # the clamp is exercised


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), i=st.integers(1, 24), groups=st.integers(1, 3),
       act=st.sampled_from(["silu", "gpt_oss"]), with_bias=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_qmm_swiglu_equals_unfused(rows, i, groups, act, with_bias, dtype, seed):
    k = 64 * groups
    qw = oracle_quantized(nrand(seed, (2 * i, k)), "affine", 4)
    x = jnp.asarray(nrand(seed + 1, (rows, k), scale=np.exp(seed % 5 - 2)), dtype)
    bias = jnp.asarray(nrand(seed + 2, (2 * i,)), dtype) if with_bias else None
    limit = 5.0 if act == "gpt_oss" else None
    fused = jq.qmm_swiglu(x, qw, activation=act, limit=limit, bias=bias)
    y = jq.qmm(x, qw).astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    gate, up = y[:, :i], y[:, i:]
    if act == "silu":
        want = jax.nn.silu(gate) * up
    else:  # the decoder's activation (jaxquant/models/layers.py's swiglu)
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        want = (up + 1) * gate * jax.nn.sigmoid(gate * 1.702)
    np.testing.assert_array_equal(f64(fused), f64(want.astype(dtype)))


def test_qmm_swiglu_edge_values():
    k = 64
    qw = oracle_quantized(nrand(0, (8, k)), "mxfp4")
    x = np.stack([np.zeros(k), np.where(np.arange(k) == 5, np.nan, 1.0),
                  np.full(k, 1e30)]).astype(np.float32)
    for act in (dict(activation="silu"), GPT_OSS):
        y = f64(jq.qmm_swiglu(x, qw, **act))
        assert np.all(y[0] == 0) and np.all(np.isnan(y[1]))
    # huge products: gpt_oss clamps up (and gate from above; a huge negative gate meets
    # sigmoid's 0), so its outputs stay finite where silu's overflow
    assert np.all(np.isfinite(f64(jq.qmm_swiglu(x[2:], qw, **GPT_OSS))))
    assert not np.all(np.isfinite(f64(jq.qmm_swiglu(x[2:], qw))))


def test_qmm_swiglu_float64():
    with jax.enable_x64(True):
        qw = oracle_quantized(nrand(0, (16, 64)), "affine", 4)
        x = jnp.asarray(nrand(1, (2, 64)), jnp.float64)
        y = jq.qmm_swiglu(x, qw, bias=jnp.ones((16,), jnp.float64))
        assert y.dtype == jnp.float64
        z = jq.rms_norm_qmm(x, None, qw)
        assert z.dtype == jnp.float64
        np.testing.assert_allclose(f64(z), rms64(x) @ deq64(qw).T, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# gather_qmm_swiglu


def assert_gather_swiglu_close(out, x, qw, indices, bias, dtype, activation, limit=None,
                               alpha=1.702):
    """Slot by slot against the float64 oracle: expert indices[t, j]'s product and bias
    row; NaN rows for ids outside [0, E)."""
    w64, ids = deq64(qw), np.asarray(indices)
    assert out.shape == (*ids.shape, qw.shape[1] // 2) and out.dtype == dtype
    for t, j in np.ndindex(*ids.shape):
        e = ids[t, j]
        xr = (x[t] if x.ndim == 2 else x[t, j])[None]
        if not 0 <= e < qw.shape[0]:
            assert np.all(np.isnan(f64(out[t, j]))), (t, j)
            continue
        assert_swiglu_close(out[t, j][None], xr, None, None if bias is None else bias[e],
                            dtype, activation, limit, alpha, w64=w64[e])


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [dict(activation="silu"), GPT_OSS], ids=["silu", "gpt_oss"])
def test_gather_qmm_swiglu_matches_oracle(mode, bits, dtype, act):
    e, i, k = 4, 24, 128
    qw = oracle_quantized(nrand(0, (e, 2 * i, k), scale=0.5), mode, bits)
    idx = np.array([[3, 0, 3], [1, 2, 0]], np.int32)  # a repeated expert
    bias = jnp.asarray(nrand(2, (e, 2 * i)), dtype)
    f = jax.jit(lambda x, q, ix, b: jq.gather_qmm_swiglu(x, q, ix, bias=b, **act))
    for x in (nrand(1, (2, k)), nrand(3, (2, 3, k))):  # x per token, or per slot
        x = jnp.asarray(x, dtype)
        assert_gather_swiglu_close(f(x, qw, idx, bias), x, qw, idx, bias, dtype,
                                   act["activation"], act.get("limit"))


@settings(max_examples=10, deadline=None)
@given(t=st.integers(1, 4), slots=st.integers(1, 4), e=st.integers(1, 6),
       i=st.integers(1, 24), groups=st.integers(1, 3), act=st.sampled_from(["silu", "gpt_oss"]),
       with_bias=st.booleans(), per_slot_x=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_gather_qmm_swiglu_equals_unfused(t, slots, e, i, groups, act, with_bias, per_slot_x,
                                          dtype, seed):
    k = 64 * groups
    qw = oracle_quantized(nrand(seed, (e, 2 * i, k)), "mxfp4")
    rng = np.random.default_rng(seed)
    idx = rng.integers(-1, e + 1, (t, slots)).astype(np.int32)  # some outside [0, E)
    x = jnp.asarray(nrand(seed + 1, (t, slots, k) if per_slot_x else (t, k),
                          scale=np.exp(seed % 5 - 2)), dtype)
    bias = jnp.asarray(nrand(seed + 2, (e, 2 * i)), dtype) if with_bias else None
    limit = 5.0 if act == "gpt_oss" else None
    fused = jq.gather_qmm_swiglu(x, qw, idx, activation=act, limit=limit, bias=bias)
    # the decoder's unfused steps (jaxquant/models/moe.py's experts_mlp)
    y = jq.gather_qmm(x, qw, idx).astype(jnp.float32)
    if bias is not None:
        y = y + bias[np.clip(idx, 0, e - 1)].astype(jnp.float32)
    gate, up = y[..., :i], y[..., i:]
    if act == "silu":
        want = jax.nn.silu(gate) * up
    else:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        want = (up + 1) * gate * jax.nn.sigmoid(gate * 1.702)
    np.testing.assert_array_equal(f64(fused), f64(want.astype(dtype)))
    bad = (idx < 0) | (idx >= e)
    assert np.all(np.isnan(f64(fused)[bad])) and not np.any(np.isnan(f64(fused)[~bad]))


def test_gather_qmm_swiglu_bias_row_per_expert():
    # each slot adds its own expert's bias row: zero weights leave act(bias) alone
    e, i, k = 3, 16, 64
    qw = oracle_quantized(np.zeros((e, 2 * i, k), np.float32), "affine", 4)
    bias = nrand(0, (e, 2 * i))
    idx = np.array([[2, 0, 1, 2]], np.int32)
    y = f64(jq.gather_qmm_swiglu(nrand(1, (1, k)), qw, idx, bias=bias))
    b = f64(bias)
    for j, ex in enumerate(idx[0]):
        g, u = b[ex, :i], b[ex, i:]
        np.testing.assert_allclose(y[0, j], g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)


def test_gather_qmm_swiglu_float64_and_transforms():
    with jax.enable_x64(True):
        qw = oracle_quantized(nrand(0, (3, 32, 64)), "affine", 4)
        x = jnp.asarray(nrand(1, (2, 64)), jnp.float64)
        y = jq.gather_qmm_swiglu(x, qw, np.array([[0, 2], [1, 1]]), bias=np.ones((3, 32)))
        assert y.dtype == jnp.float64 and y.shape == (2, 2, 16)
    qw = oracle_quantized(nrand(0, (3, 64, 64)), "mxfp4")
    x, idx, b = nrand(1, (4, 2, 64)), np.array([[0, 2], [1, 1]], np.int32), nrand(2, (3, 64))
    glu = lambda x: jq.gather_qmm_swiglu(x, qw, idx, bias=b, **GPT_OSS)
    # vmap over a batch of tokens folds into the primitive's token axis
    np.testing.assert_array_equal(jax.vmap(glu)(x), jnp.stack([glu(xi) for xi in x]))
    names = [q.primitive.name for q in jax.make_jaxpr(jax.vmap(glu))(x).eqns]
    assert names.count("jaxquant_gather_qmm_swiglu") == 1, names
    # grad to x and bias through the reference equals the unfused ops' grad
    def unfused(x, b):
        y = jq.gather_qmm(x, qw, idx) + b[idx]
        g, u = jnp.minimum(y[..., :32], 7.0), jnp.clip(y[..., 32:], -7.0, 7.0)
        return jnp.sum((u + 1) * g * jax.nn.sigmoid(1.702 * g))
    fused = lambda x, b: jnp.sum(jq.gather_qmm_swiglu(x, qw, idx, bias=b, **GPT_OSS))
    for a, c in zip(jax.grad(fused, (0, 1))(x[0], b), jax.grad(unfused, (0, 1))(x[0], b)):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# rms_norm_qmm_swiglu and qmm_add


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [dict(activation="silu"), GPT_OSS], ids=["silu", "gpt_oss"])
def test_rms_norm_qmm_swiglu_matches_oracle(mode, bits, dtype, act):
    i, k = 24, 128
    qw = oracle_quantized(nrand(0, (2 * i, k), scale=0.5), mode, bits)
    x = jnp.asarray(nrand(1, (2, 3, k), scale=3.0), dtype)
    w = jnp.asarray(nrand(2, (k,)), dtype)
    bias = jnp.asarray(nrand(3, (2 * i,)), dtype)
    y = jax.jit(lambda x, w, q, b: jq.rms_norm_qmm_swiglu(x, w, q, eps=1e-5, weight_offset=0.5,
                                                          bias=b, **act))(x, w, qw, bias)
    assert y.shape == (2, 3, i) and y.dtype == dtype
    h64, w64 = rms64(x, w, eps=1e-5, off=0.5), deq64(qw)
    prod, b = matmul_bound(h64, w64, dtype)
    # the normalized x is rounded to x's dtype before the product: one more eps of |h|
    b = b + EPS[jnp.dtype(dtype)] * (np.abs(h64) @ np.abs(w64).T)
    assert_swiglu_of(y, prod, b, bias, dtype, act["activation"], act.get("limit"))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), i=st.integers(1, 24), groups=st.integers(1, 3),
       act=st.sampled_from(["silu", "gpt_oss"]), weighted=st.booleans(), with_bias=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rms_norm_qmm_swiglu_equals_unfused(rows, i, groups, act, weighted, with_bias, dtype,
                                            seed):
    k = 64 * groups
    qw = oracle_quantized(nrand(seed, (2 * i, k)), "affine", 4)
    x = jnp.asarray(nrand(seed + 1, (rows, k), scale=np.exp(seed % 5 - 2)), dtype)
    w = jnp.asarray(nrand(seed + 2, (k,)), dtype) if weighted else None
    bias = jnp.asarray(nrand(seed + 3, (2 * i,)), dtype) if with_bias else None
    kw = dict(activation=act, limit=5.0 if act == "gpt_oss" else None, bias=bias)
    fused = jq.rms_norm_qmm_swiglu(x, w, qw, eps=1e-6, weight_offset=1.0, **kw)
    unfused = jq.qmm_swiglu(jq.rms_norm(x, w, eps=1e-6, weight_offset=1.0), qw, **kw)
    np.testing.assert_array_equal(f64(fused), f64(unfused))


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qmm_add_matches_oracle(mode, bits, dtype):
    n, k = 48, 128
    qw = oracle_quantized(nrand(0, (n, k)), mode, bits)
    x = jnp.asarray(nrand(1, (2, 3, k)), dtype)
    r = jnp.asarray(nrand(2, (2, 3, n), scale=4.0), dtype)
    y = jax.jit(jq.qmm_add)(x, qw, r)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    prod, bound = matmul_bound(f64(x), deq64(qw), dtype)
    want = prod + f64(r)
    # the product rounded to x's dtype (in `bound`), then the sum rounded once more
    bound = bound + EPS[jnp.dtype(dtype)] * (np.abs(prod) + np.abs(want)) + 1e-30
    assert np.all(np.abs(f64(y) - want) <= bound)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 40), groups=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_qmm_add_equals_unfused(rows, n, groups, dtype, seed):
    k = 32 * groups
    qw = oracle_quantized(nrand(seed, (n, k)), "mxfp4")
    x = jnp.asarray(nrand(seed + 1, (rows, k), scale=np.exp(seed % 5 - 2)), dtype)
    r = jnp.asarray(nrand(seed + 2, (rows, n), scale=np.exp(seed % 3)), dtype)
    np.testing.assert_array_equal(f64(jq.qmm_add(x, qw, r)), f64(jq.qmm(x, qw) + r))


def test_qmm_add_edge_values():
    k, n = 64, 16
    qw = oracle_quantized(nrand(0, (n, k)), "affine", 4)
    x = np.stack([np.zeros(k), np.ones(k), np.ones(k), np.full(k, 1e30)]).astype(np.float32)
    r = np.stack([nrand(1, (n,)), np.full(n, np.nan), np.full(n, np.inf),
                  np.full(n, -3e38)]).astype(np.float32)
    y = f64(jq.qmm_add(x, qw, r))
    np.testing.assert_array_equal(y[0], f64(r[0]))  # a zero row: the addend itself
    assert np.all(np.isnan(y[1])) and np.all(y[2] == np.inf)
    np.testing.assert_array_equal(y, f64(jq.qmm(x, qw) + r))  # overflow as the two ops'


def test_fused_float64():
    with jax.enable_x64(True):
        qw = oracle_quantized(nrand(0, (16, 64)), "affine", 4)
        x = jnp.asarray(nrand(1, (2, 64)), jnp.float64)
        w = jnp.asarray(nrand(2, (64,)), jnp.float64)
        r = jnp.asarray(nrand(3, (2, 16)), jnp.float64)
        y = jq.qmm_add(x, qw, r)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(f64(y), f64(x) @ deq64(qw).T + f64(r), rtol=1e-12)
        z = jq.rms_norm_qmm_swiglu(x, w, qw)
        assert z.dtype == jnp.float64
        h = rms64(x, w, eps=1e-6, off=0.0) @ deq64(qw).T
        want, _ = swiglu64(h[:, :8], h[:, 8:], "silu")
        np.testing.assert_allclose(f64(z), want, rtol=1e-12, atol=1e-300)


def test_new_fused_ops_bad_inputs():
    qw = oracle_quantized(nrand(0, (6, 64)), "mxfp4")
    x, w, r = nrand(1, (2, 64)), nrand(2, (64,)), nrand(3, (2, 6))
    with pytest.raises(ValueError, match=r"addend must have the product's shape \(2, 6\)"):
        jq.qmm_add(x, qw, r[:, :3])
    with pytest.raises(ValueError, match="addend must have .* x's dtype float32; got bfloat16"):
        jq.qmm_add(x, qw, r.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="addend"):
        jq.qmm_add(x, qw, np.ones((2, 6), np.int32))
    with pytest.raises(ValueError, match="x's last axis must be K=64"):
        jq.qmm_add(x[:, :32], qw, r)
    with pytest.raises(TypeError, match="qw"):
        jq.qmm_add(x, np.ones((6, 64), np.float32), r)
    with pytest.raises(ValueError, match="qw must have 2 dimensions"):
        jq.qmm_add(x, oracle_quantized(nrand(0, (2, 6, 64)), "mxfp4"), r)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        jq.rms_norm_qmm_swiglu(x, w[:32], qw)
    with pytest.raises(ValueError, match="even number of rows"):
        jq.rms_norm_qmm_swiglu(x, w, oracle_quantized(nrand(0, (5, 64)), "mxfp4"))
    with pytest.raises(ValueError, match="activation='gelu' is not known"):
        jq.rms_norm_qmm_swiglu(x, w, qw, activation="gelu")
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        jq.rms_norm_qmm_swiglu(x, w, qw, bias=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="eps"):
        jq.rms_norm_qmm_swiglu(x, w, qw, eps=-1.0)
    with pytest.raises(TypeError, match="eps of jq.rms_norm_qmm_swiglu is a static argument"):
        jax.jit(lambda e: jq.rms_norm_qmm_swiglu(x, w, qw, eps=e))(1e-6)
    with pytest.raises(TypeError, match="x must be"):
        jq.rms_norm_qmm_swiglu(np.ones((2, 64), np.int32), w, qw)


def test_new_fused_ops_transforms():
    qw = oracle_quantized(nrand(0, (32, 64)), "affine", 4)
    x, w, r = nrand(1, (4, 3, 64)), nrand(2, (64,)), nrand(3, (4, 3, 32))
    glu = lambda x: jq.rms_norm_qmm_swiglu(x, w, qw, **GPT_OSS)
    np.testing.assert_array_equal(jax.vmap(glu)(x), glu(x))
    names = [e.primitive.name for e in jax.make_jaxpr(jax.vmap(glu))(x).eqns]
    assert len([n for n in names if n.startswith("jaxquant_")]) == 1, names
    # qmm_add: x and the addend batched, or either alone (the other broadcast)
    np.testing.assert_array_equal(jax.vmap(lambda x, r: jq.qmm_add(x, qw, r))(x, r),
                                  jq.qmm_add(x, qw, r))
    np.testing.assert_array_equal(jax.vmap(lambda r: jq.qmm_add(x[0], qw, r))(r),
                                  jq.qmm_add(jnp.broadcast_to(x[0], (4, 3, 64)), qw, r))
    np.testing.assert_array_equal(jax.vmap(lambda x: jq.qmm_add(x, qw, r[:, 0]), in_axes=1,
                                           out_axes=1)(x),
                                  jq.qmm_add(x, qw, jnp.broadcast_to(r[:, :1], (4, 3, 32))))
    names = [e.primitive.name for e in jax.make_jaxpr(jax.vmap(
        lambda x, r: jq.qmm_add(x, qw, r)))(x, r).eqns]
    assert len([n for n in names if n.startswith("jaxquant_")]) == 1, names
    # grad through the reference equals the unfused ops'
    gate_up = oracle_quantized(nrand(8, (64, 64)), "affine", 4)
    down = oracle_quantized(nrand(7, (16, 32)), "mxfp4")
    x2, r2, b = nrand(4, (3, 64)), nrand(5, (3, 16)), nrand(6, (64,))
    fused = lambda x, w, r, b: jnp.sum(jq.qmm_add(jq.rms_norm_qmm_swiglu(x, w, gate_up, bias=b),
                                                  down, r))

    def unfused(x, w, r, b):
        h = jq.qmm_swiglu(jq.rms_norm(x, w), gate_up, bias=b)
        return jnp.sum(jq.qmm(h, down) + r)
    g1 = jax.grad(fused, argnums=(0, 1, 2, 3))(x2, w, r2, b)
    g2 = jax.grad(unfused, argnums=(0, 1, 2, 3))(x2, w, r2, b)
    for a, c in zip(g1, g2):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Bad inputs: ValueError / TypeError naming the argument.


def test_bad_inputs():
    qw = oracle_quantized(nrand(0, (6, 64)), "mxfp4")
    odd = oracle_quantized(nrand(0, (5, 64)), "mxfp4")
    x, w = nrand(1, (2, 64)), nrand(2, (64,))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        jq.rms_norm_qmm(x, w[:32], qw)
    with pytest.raises(TypeError, match="norm_weight"):
        jq.rms_norm_qmm(x, np.arange(64), qw)
    with pytest.raises(TypeError, match="qw"):
        jq.rms_norm_qmm(x, w, np.ones((6, 64), np.float32))
    with pytest.raises(ValueError, match="x's last axis must be K=64"):
        jq.rms_norm_qmm(x[:, :32], w[:32], qw)
    with pytest.raises(ValueError, match="qw must have 2 dimensions"):
        jq.rms_norm_qmm(x, w, oracle_quantized(nrand(0, (2, 6, 64)), "mxfp4"))
    with pytest.raises(ValueError, match="eps"):
        jq.rms_norm_qmm(x, w, qw, eps=-1.0)
    with pytest.raises(TypeError, match="weight_offset"):
        jq.rms_norm_qmm(x, w, qw, weight_offset="1")
    with pytest.raises(TypeError, match="eps of jq.rms_norm_qmm is a static argument"):
        jax.jit(lambda e: jq.rms_norm_qmm(x, w, qw, eps=e))(1e-6)
    with pytest.raises(TypeError, match="x must be"):
        jq.rms_norm_qmm(np.ones((2, 64), np.int32), w, qw)
    with pytest.raises(ValueError, match="even number of rows"):
        jq.qmm_swiglu(x, odd)
    with pytest.raises(ValueError, match="activation='gelu' is not known"):
        jq.qmm_swiglu(x, qw, activation="gelu")
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        jq.qmm_swiglu(x, qw, bias=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="bias"):
        jq.qmm_swiglu(x, qw, bias=np.ones(6, np.int32))
    with pytest.raises(ValueError, match="limit"):
        jq.qmm_swiglu(x, qw, limit=7.0)  # silu takes no limit
    with pytest.raises(ValueError, match="limit must be > 0"):
        jq.qmm_swiglu(x, qw, activation="gpt_oss", limit=-1.0)
    with pytest.raises(TypeError, match="alpha"):
        jq.qmm_swiglu(x, qw, activation="gpt_oss", alpha="1.7")
    with pytest.raises(TypeError, match="limit of jq.qmm_swiglu is a static argument"):
        jax.jit(lambda lim: jq.qmm_swiglu(x, qw, activation="gpt_oss", limit=lim))(7.0)
    with pytest.raises(ValueError, match="x's last axis must be K=64"):
        jq.qmm_swiglu(x[:, :32], qw)
    with pytest.raises(TypeError, match="qw"):
        jq.qmm_swiglu(x, None)


def test_gather_qmm_swiglu_bad_inputs():
    qw = oracle_quantized(nrand(0, (3, 6, 64)), "mxfp4")
    x, idx = nrand(1, (2, 64)), np.array([[0, 1], [2, 0]], np.int32)
    with pytest.raises(ValueError, match=r"bias must have shape \(3, 6\)"):
        jq.gather_qmm_swiglu(x, qw, idx, bias=np.ones(6, np.float32))
    with pytest.raises(TypeError, match="bias"):
        jq.gather_qmm_swiglu(x, qw, idx, bias=np.ones((3, 6), np.int32))
    with pytest.raises(TypeError, match="indices must be an integer array"):
        jq.gather_qmm_swiglu(x, qw, idx.astype(np.float32))
    with pytest.raises(ValueError, match=r"indices must be \[T, k\]"):
        jq.gather_qmm_swiglu(x, qw, idx[0])
    with pytest.raises(ValueError, match="x must be"):
        jq.gather_qmm_swiglu(x[:1], qw, idx)
    with pytest.raises(ValueError, match="qw must have 3 dimensions"):
        jq.gather_qmm_swiglu(x, qw[0], idx)
    with pytest.raises(TypeError, match="QuantizedArray"):
        jq.gather_qmm_swiglu(x, np.ones((3, 6, 64), np.float32), idx)
    with pytest.raises(ValueError, match="even number of rows"):
        jq.gather_qmm_swiglu(x, oracle_quantized(nrand(0, (3, 5, 64)), "mxfp4"), idx)
    with pytest.raises(ValueError, match="activation='relu' is not known"):
        jq.gather_qmm_swiglu(x, qw, idx, activation="relu")
    with pytest.raises(ValueError, match="limit"):
        jq.gather_qmm_swiglu(x, qw, idx, limit=7.0)
    with pytest.raises(TypeError, match="alpha of jq.gather_qmm_swiglu is a static argument"):
        jax.jit(lambda a: jq.gather_qmm_swiglu(x, qw, idx, alpha=a))(1.0)


# ---------------------------------------------------------------------------
# Transformations.


def test_vmap_folds_into_the_primitive():
    qw = oracle_quantized(nrand(0, (32, 64)), "affine", 4)
    x, w = nrand(1, (4, 3, 64)), nrand(2, (64,))
    norm = lambda x: jq.rms_norm_qmm(x, w, qw)
    glu = lambda x: jq.qmm_swiglu(x, qw, **GPT_OSS)
    for fn in (norm, glu):
        np.testing.assert_array_equal(jax.vmap(fn)(x), fn(x))
        np.testing.assert_array_equal(jax.vmap(fn, in_axes=1, out_axes=1)(x), fn(x))
        names = [e.primitive.name for e in jax.make_jaxpr(jax.vmap(fn))(x).eqns]
        assert len([n for n in names if n.startswith("jaxquant_")]) == 1, names


def test_vmap_over_weights():
    # a batch of weights: vmap of the reference (off the kernels), same values
    stack = oracle_quantized(nrand(0, (3, 32, 64)), "mxfp4")
    x, w = nrand(1, (2, 64)), nrand(2, (3, 64))
    y = jax.vmap(lambda w, q: jq.rms_norm_qmm(x, w, q))(w, stack)
    s = jax.vmap(lambda q: jq.qmm_swiglu(x, q))(stack)
    for b in range(3):  # a batched dot: float32 sums in another order
        np.testing.assert_allclose(y[b], jq.rms_norm_qmm(x, w[b], stack[b]), rtol=1e-5)
        np.testing.assert_allclose(s[b], jq.qmm_swiglu(x, stack[b]), rtol=1e-5, atol=1e-6)


def test_scan_layer_loop():
    layers = oracle_quantized(nrand(0, (3, 2 * 64, 64), scale=0.2), "mxfp8_e4m3")
    norms = nrand(1, (3, 64))
    x = nrand(2, (2, 64))

    def fused(h, p):
        nw, q = p
        return jq.qmm_swiglu(jq.rms_norm(h, nw), q), None

    def body(h, p):  # norm fused into the product, activation fused after it
        nw, q = p
        y = jq.rms_norm_qmm(h, nw, q)
        return (jax.nn.silu(y[:, :64]) * y[:, 64:]), None

    got, _ = jax.jit(lambda x, p: jax.lax.scan(fused, x, p))(x, (norms, layers))
    want, _ = jax.jit(lambda x, p: jax.lax.scan(body, x, p))(x, (norms, layers))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_grad_matches_unfused():
    qw = oracle_quantized(nrand(0, (64, 64)), "affine", 4)
    qw2 = oracle_quantized(nrand(4, (32, 64)), "mxfp4")
    x, w, b = nrand(1, (3, 64)), nrand(2, (64,)), nrand(3, (32,))
    fused = lambda x, w, b: jnp.sum(jq.qmm_swiglu(jq.rms_norm_qmm(x, w, qw), qw2, bias=b))

    def unfused(x, w, b):
        y = jq.qmm(jq.qmm(jq.rms_norm(x, w), qw), qw2) + b
        return jnp.sum(jax.nn.silu(y[:, :16]) * y[:, 16:])
    g1 = jax.grad(fused, argnums=(0, 1, 2))(x, w, b)
    g2 = jax.grad(unfused, argnums=(0, 1, 2))(x, w, b)
    for a, c in zip(g1, g2):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Backends: with no fused kernel for the case, the unfused ops of that backend.


def test_fallback_is_the_unfused_ops_of_the_backend():
    if "ffi" not in jq.available_backends():
        pytest.skip("the ffi CPU library is not built here")
    qw = oracle_quantized(nrand(0, (32, 64)), "affine", 4)
    x, w = nrand(1, (2, 64)), nrand(2, (64,))
    r = nrand(3, (2, 32))
    for fn in (lambda b: jq.rms_norm_qmm(x, w, qw, backend=b),
               lambda b: jq.qmm_swiglu(x, qw, backend=b),
               lambda b: jq.rms_norm_qmm_swiglu(x, w, qw, backend=b),
               lambda b: jq.qmm_add(x, qw, r, backend=b)):
        text = jax.jit(lambda: fn("ffi")).lower().as_text()
        assert "jaxquant_qmv" in text  # the ffi GEMV, not the reference's dot
        want = np.asarray(fn("reference"))  # to rounding: a dot's, relative to its largest terms
        np.testing.assert_allclose(fn("ffi"), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    np.testing.assert_array_equal(jq.rms_norm_qmm(x, w, qw, backend="ffi"),
                                  jq.qmm(jq.rms_norm(x, w, backend="ffi"), qw, backend="ffi"))
    # the reference backend lowers the reference: no custom call
    text = jax.jit(lambda: jq.rms_norm_qmm(x, w, qw, backend="reference")).lower().as_text()
    assert "custom_call" not in text


def test_automatic_choice_of_the_fused_kernel_by_rows():
    """The fused GEMV's automatic choice (the CUDA kernel; this module's GPU tests lower
    it): up to configs.FUSED_MAX_ROWS rows of x, counted over every leading axis."""
    from jaxquant.ffi import configs

    assert configs.FUSED_MAX_ROWS == {"qmm_swiglu": 4, "qmm_add": 16}
    for op, most in configs.FUSED_MAX_ROWS.items():
        auto = configs.auto_fused(op)
        x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        assert auto(x(1, 64), None, platform="cuda")
        assert auto(x(1, most, 64), None, platform="cuda")
        assert not auto(x(most + 1, 64), None, platform="cuda")
        assert not auto(x(2, most, 64), None, platform="cuda")  # batch x rows
    with pytest.raises(KeyError):
        configs.auto_fused("qmm")


# ---------------------------------------------------------------------------
# On an NVIDIA GPU: the fused decode GEMVs (gpu_src/cuda/gemv_mma.h, FUSE) on the cuda_mma
# layout, at every mode it holds (tests/common.py's GPU_NATIVE_MODES as ALL_MODES, ALL_DTYPES).

def _fused_kernel():
    try:
        from jaxquant.ffi import mma
        lib = jf.libraries().get("cuda")
        return (jax.default_backend() in ("gpu", "cuda") and "cuda" in jf.loaded_platforms()
                and hasattr(lib.handle, "jq_gpu_gemv_mma_fused"), mma)
    except Exception:  # noqa: BLE001
        return False, None


_HAVE, mma = _fused_kernel()
needs_gpu = pytest.mark.skipif(not _HAVE, reason="needs an NVIDIA GPU and the CUDA library "
                                                  "with the fused GEMV (jq_gpu_gemv_mma_fused)")

MS = (1, 2, 8, 16)
ACTS = [dict(activation="silu"), dict(activation="gpt_oss", limit=7.0, alpha=1.702)]


def _packed(mode, bits, shape, key=0, scale=2.0):
    w = rand(key, shape, jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32, scale=scale)
    qw = quantize_for(mode, bits, w)
    return qw, jq.prepack(qw, layout="cuda_mma")


def _targets(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", ALL_MODES)
def test_rms_norm_qmm_kernel(mode, bits):
    # N = 48: three tiles; K = 192: three chunks
    qw, packed = _packed(mode, bits, (48, 192), key=bits)
    w64 = deq64(qw)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, 192), dt, scale=3.0)
          for dt in ALL_DTYPES for m in MS}
    ws = {jnp.dtype(dt).name: rand(99, (192,), dt) for dt in ALL_DTYPES}
    norm = lambda x, w, q: jq.rms_norm_qmm(x, w, q, eps=1e-5, weight_offset=0.5, backend="ffi")
    assert "jaxquant_gemv_mma_fused" in _targets(norm, xs["bfloat16", 1], ws["bfloat16"], packed)
    fused = jax.jit(lambda xs, ws, q: {k: norm(x, ws[k[0]], q) for k, x in xs.items()})(
        xs, ws, packed)
    unfused = jax.jit(lambda xs, ws, q: {
        k: jq.qmm(jq.rms_norm(x, ws[k[0]], eps=1e-5, weight_offset=0.5), q, backend="ffi")
        for k, x in xs.items()})(xs, ws, packed)
    for (name, m), y in fused.items():
        eps = EPS[jnp.dtype(name)]
        x = xs[name, m]
        assert y.dtype == jnp.dtype(name) and y.shape == (m, 48)
        h64 = rms64(x, ws[name], eps=1e-5, off=0.5)
        mag = np.abs(h64) @ np.abs(w64).T
        # against the unfused kernels: the normalized x may round the other way (one
        # ulp of h; float32 x meets the MMA as two bf16 terms, ~2^-17 of each element:
        # the GEMV's K x 2^-24 term), then the output's rounding
        gemv = (2 * eps + 192 * 2.0**-24) * mag
        bound = gemv + 2 * eps * np.abs(f64(unfused[name, m])) + 1e-30
        assert np.all(np.abs(f64(y) - f64(unfused[name, m])) <= bound), (name, m)
        # against the float64 oracle: h rounded to x's dtype, the GEMV's bound
        want = h64 @ w64.T
        bound = eps * mag + gemv + eps * np.abs(want) + 1e-30
        assert np.all(np.abs(f64(y) - want) <= bound), (name, m)


def _swiglu_cases(mode, bits, i, k, *, key, aux, x_scale=1.0):
    """A SwiGLU kernel test's inputs: qw and its cuda_mma copy [2I, K], x per (dtype
    name, M), an operand of aux = (key, length) per dtype name, and the cases (x's key,
    the activation's index, with the operand or not)."""
    qw, packed = _packed(mode, bits, (2 * i, k), key=key, scale=0.5)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, k), dt, scale=x_scale)
          for dt in ALL_DTYPES for m in MS}
    auxs = {jnp.dtype(dt).name: rand(aux[0], (aux[1],), dt) for dt in ALL_DTYPES}
    cases = [(c, a, with_aux) for c in xs for a in range(len(ACTS)) for with_aux in (False, True)]
    return qw, packed, xs, auxs, cases


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", ALL_MODES)
def test_qmm_swiglu_kernel(mode, bits):
    # I = 32: two gate tiles and two up tiles; every dtype, M, activation, with and
    # without a bias, in one program per side
    i, k = 32, 192
    qw, packed, xs, bias, cases = _swiglu_cases(mode, bits, i, k, key=bits + 1,
                                                aux=(77, 2 * i))

    def run(one):
        return jax.jit(lambda xs, bs, q: {
            c: one(xs[c[0]], q, bs[c[0][0]] if c[2] else None, ACTS[c[1]]) for c in cases})(
                xs, bias, packed)
    fused_one = lambda x, q, b, act: jq.qmm_swiglu(x, q, bias=b, backend="ffi", **act)
    assert "jaxquant_gemv_mma_fused" in _targets(
        lambda x, q: fused_one(x, q, None, ACTS[0]), xs["bfloat16", 1], packed)
    fused, unfused = run(fused_one), run(_unfused_swiglu)
    for c in cases:
        (name, m), a, with_bias = c
        y, eps = fused[c], EPS[jnp.dtype(name)]
        assert y.dtype == jnp.dtype(name) and y.shape == (m, i)
        # the halves are the unfused GEMV's outputs bit for bit; the activation's exp
        # (a few float32 ulps: 2^-20) and the output's rounding may differ (float16's
        # smallest subnormal, 2^-24, absolute)
        np.testing.assert_allclose(f64(y), f64(unfused[c]), rtol=max(4 * eps, 2.0**-20),
                                   atol=2.0**-24,
                                   err_msg=f"{name} M={m} {ACTS[a]} bias={with_bias}")


def _unfused_swiglu(x, q, bias, act):
    """The composition on the unfused ffi GEMV, its epilogue in jnp (float32)."""
    y = jq.qmm(x, q, backend="ffi").astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    gate, up = jnp.split(y, 2, axis=-1)
    if act["activation"] == "silu":
        return (jax.nn.silu(gate) * up).astype(x.dtype)
    gate, up = jnp.minimum(gate, act["limit"]), jnp.clip(up, -act["limit"], act["limit"])
    return ((up + 1) * gate * jax.nn.sigmoid(gate * act["alpha"])).astype(x.dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", ALL_MODES)
def test_rms_norm_qmm_swiglu_kernel(mode, bits):
    # I = 32, K = 192; every dtype, M, activation, with and without a norm weight
    i, k = 32, 192
    qw, packed, xs, ws, cases = _swiglu_cases(mode, bits, i, k, key=bits + 2, aux=(99, k),
                                              x_scale=3.0)
    norm = dict(eps=1e-5, weight_offset=0.5)

    def run(one):
        return jax.jit(lambda xs, ws, q: {
            c: one(xs[c[0]], ws[c[0][0]] if c[2] else None, q, ACTS[c[1]]) for c in cases})(
                xs, ws, packed)
    fused_one = lambda x, w, q, act: jq.rms_norm_qmm_swiglu(x, w, q, backend="ffi", **norm, **act)
    unfused_one = lambda x, w, q, act: jq.qmm_swiglu(jq.rms_norm(x, w, **norm), q, backend="ffi",
                                                     **act)
    assert "jaxquant_gemv_mma_fused" in _targets(
        lambda x, w, q: fused_one(x, w, q, ACTS[0]), xs["bfloat16", 1], ws["bfloat16"], packed)
    fused, unfused = run(fused_one), run(unfused_one)
    for c in cases:
        (name, m), a, weighted = c
        y, z, eps = fused[c], unfused[c], EPS[jnp.dtype(name)]
        assert y.dtype == jnp.dtype(name) and y.shape == (m, i)
        # the normalized x may round the other way than the unfused norm's (an ulp of
        # h: rms_norm_qmm's kernel test), which moves gate and up by the GEMV's bound,
        # then the activation's float32 steps and the output's rounding
        h64 = rms64(xs[name, m], ws[name] if weighted else None, eps=1e-5, off=0.5)
        mag = np.abs(h64) @ np.abs(deq64(qw)).T
        gemv = (2 * eps + k * 2.0**-24) * mag
        gu = f64(jq.qmm(jq.rms_norm(xs[name, m], ws[name] if weighted else None, **norm),
                        packed))
        act = ACTS[a]
        _, (dg, du) = swiglu64(gu[:, :i], gu[:, i:], act["activation"], act.get("limit"),
                               act.get("alpha", 1.702))
        bound = ((dg + 1) * gemv[:, :i] + (du + 1) * gemv[:, i:]
                 + max(4 * eps, 2.0**-20) * np.abs(f64(z)) + 2.0**-24)
        assert np.all(np.abs(f64(y) - f64(z)) <= bound), (name, m, a, weighted)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", ALL_MODES)
def test_qmm_add_kernel(mode, bits):
    # N = 37: two full tiles and a partial one (the canonical tail); K = 192
    n, k = 37, 192
    qw, packed = _packed(mode, bits, (n, k), key=bits + 3)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, k), dt) for dt in ALL_DTYPES for m in MS}
    rs = {key: rand(50 + key[1], (key[1], n), jnp.dtype(key[0]), scale=8.0) for key in xs}
    add = lambda x, q, r: jq.qmm_add(x, q, r, backend="ffi")
    assert "jaxquant_gemv_mma_fused" in _targets(add, xs["bfloat16", 1], packed,
                                                 rs["bfloat16", 1])
    fused = jax.jit(lambda xs, rs, q: {c: add(xs[c], q, rs[c]) for c in xs})(xs, rs, packed)
    unfused = jax.jit(lambda xs, rs, q: {c: jq.qmm(xs[c], q, backend="ffi") + rs[c]
                                         for c in xs})(xs, rs, packed)
    for c, y in fused.items():
        assert y.dtype == jnp.dtype(c[0]) and y.shape == (c[1], n)
        # the GEMV's sum rounded to x's dtype, then the add rounded: the two ops' steps
        np.testing.assert_array_equal(f64(y), f64(unfused[c]), err_msg=str(c))
    # under jit with a scan: the addend of each step is the last step's output (a stack
    # of one nvfp4 global scale does not scan: its other modes')
    if mode == "nvfp4":
        return
    layers = jq.prepack(quantize_for(mode, bits, rand(9, (3, 64, 64), jnp.float32, scale=0.2)),
                        layout="cuda_mma")
    h = rand(10, (1, 64), jnp.bfloat16)
    step = lambda add_op: jax.jit(lambda h, ls: jax.lax.scan(
        lambda h, q: (add_op(h, q), None), h, ls)[0])
    np.testing.assert_array_equal(
        f64(step(lambda h, q: jq.qmm_add(h, q, h, backend="ffi"))(h, layers)),
        f64(step(lambda h, q: jq.qmm(h, q, backend="ffi") + h)(h, layers)))


# gather_qmm_swiglu's slots: one token's four experts with a repeat and an id past E
# (a NaN row); three tokens sharing experts (dedupe: segments of up to 8 rows); 16
# tokens of one expert (a 16-row segment, the two-n-tile kernel)
GATHER_IDS = {"t1": np.array([[3, 0, 3, 7]], np.int32),
              "t3": np.array([[1, 4], [4, 1], [1, -2]], np.int32),
              "t16": np.full((16, 1), 2, np.int32)}


def _unfused_gather_swiglu(x, q, idx, bias, act):
    """The composition on the unfused ffi gather GEMV, its epilogue in jnp (float32)."""
    y = jq.gather_qmm(x, q, idx, backend="ffi").astype(jnp.float32)
    if bias is not None:
        y = y + bias[jnp.clip(idx, 0, bias.shape[0] - 1)].astype(jnp.float32)
    gate, up = jnp.split(y, 2, axis=-1)
    if act["activation"] == "silu":
        return (jax.nn.silu(gate) * up).astype(x.dtype)
    gate, up = jnp.minimum(gate, act["limit"]), jnp.clip(up, -act["limit"], act["limit"])
    return ((up + 1) * gate * jax.nn.sigmoid(gate * act["alpha"])).astype(x.dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", ALL_MODES)
def test_gather_qmm_swiglu_kernel(mode, bits):
    # E = 5 experts of I = 32 (two gate and two up tiles), K = 192; every dtype, slot
    # set, activation, x per token or per slot, with and without a bias [E, 2I]
    e, i, k = 5, 32, 192
    qw, packed = _packed(mode, bits, (e, 2 * i, k), key=bits + 2, scale=0.5)
    names = [jnp.dtype(dt).name for dt in ALL_DTYPES]
    xs = {(n, ids, per_slot): rand(len(ids) + 3 * per_slot,
                                   GATHER_IDS[ids].shape + (k,) if per_slot
                                   else (GATHER_IDS[ids].shape[0], k), jnp.dtype(n))
          for n in names for ids in GATHER_IDS for per_slot in (False, True)}
    bias = {n: rand(78, (e, 2 * i), jnp.dtype(n)) for n in names}
    cases = [(key, a, with_bias) for key in xs for a in range(len(ACTS))
             for with_bias in (False, True)]

    def run(one):
        return jax.jit(lambda xs, bs, q: {
            c: one(xs[c[0]], q, GATHER_IDS[c[0][1]], bs[c[0][0]] if c[2] else None, ACTS[c[1]])
            for c in cases})(xs, bias, packed)
    fused_one = lambda x, q, idx, b, act: jq.gather_qmm_swiglu(x, q, idx, bias=b, backend="ffi",
                                                               **act)
    assert "jaxquant_gemv_mma_fused" in _targets(
        lambda x, q: fused_one(x, q, GATHER_IDS["t1"], None, ACTS[1]), xs["bfloat16", "t1", False],
        packed)
    fused, unfused = run(fused_one), run(_unfused_gather_swiglu)
    w64 = deq64(qw)
    for c in cases:
        (name, ids, per_slot), a, with_bias = c
        idx = GATHER_IDS[ids]
        y, eps = fused[c], EPS[jnp.dtype(name)]
        assert y.dtype == jnp.dtype(name) and y.shape == idx.shape + (i,)
        bad = (idx < 0) | (idx >= e)
        assert np.all(np.isnan(f64(y)[bad])), c
        # as qmm_swiglu's: the halves are the unfused GEMV's bit for bit, the
        # activation's exp and the output's rounding may differ
        np.testing.assert_allclose(f64(y), f64(unfused[c]), rtol=max(4 * eps, 2.0**-20),
                                   atol=2.0**-24, err_msg=str(c))
        if name != "float16" and a == 1:  # the float64 oracle (gpt_oss clamps), valid slots
            x = xs[c[0]]
            for t, j in zip(*np.nonzero(~bad)):
                want, bound = _swiglu_oracle((x[t, j] if per_slot else x[t])[None],
                                             w64[idx[t, j]], name,
                                             bias[name][idx[t, j]] if with_bias else None)
                assert np.all(np.abs(f64(y[t, j]) - want[0]) <= bound[0]), (c, t, j)


def _swiglu_oracle(x, w64, dt, bias=None):
    """The float64 act(gate, up) of x [M, K] and w64 [2I, K] (gpt_oss, limit 7) and the
    bound a GEMV's output meets: its product's (rounded to dt) through the activation."""
    eps, x64 = EPS[jnp.dtype(dt)], f64(x)
    g = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    b = (2 * eps + x64.shape[-1] * 2.0**-24) * mag + eps * np.abs(g)  # the GEMV's output
    if bias is not None:
        g = g + f64(bias)
    i = w64.shape[0] // 2
    want, (dg, du) = swiglu64(g[..., :i], g[..., i:], "gpt_oss", 7.0)
    return want, dg * b[..., :i] + du * b[..., i:] + 2 * eps * np.abs(want) + 1e-30


@pytest.mark.gpu
@needs_gpu
def test_qmm_swiglu_affine4_eight_warps():
    # K = 4096 (64 chunks): warps_for gives 4, the affine 4-bit SwiGLU variant takes 8
    # (swiglu_warps): its halves are summed in another float32 order than the unfused
    # GEMV's; both within the GEMV's bound of the float64 oracle
    i, k = 48, 4096
    qw, packed = _packed("affine", 4, (2 * i, k), key=21, scale=0.5)
    w64 = deq64(qw)
    for dt in ALL_DTYPES:
        for m in (1, 4):
            x = rand(30 + m, (m, k), dt)
            y = jq.qmm_swiglu(x, packed, activation="gpt_oss", limit=7.0, backend="ffi")
            z = _unfused_swiglu(x, packed, None, ACTS[1])
            want, bound = _swiglu_oracle(x, w64, dt)
            assert np.all(np.abs(f64(y) - want) <= bound), (dt, m)
            assert np.all(np.abs(f64(z) - want) <= bound), (dt, m)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("nvfp4", 4)])
def test_qmm_swiglu_oracle_many_tiles(mode, bits):
    # I = 16 * 300: 300 blocks, each a gate tile and the up tile 300 tiles further
    i, k = 16 * 300, 256
    qw, packed = _packed(mode, bits, (2 * i, k), key=3, scale=0.5)
    w64 = deq64(qw)
    for dt in ALL_DTYPES:
        for m in (1, 16):
            x = rand(m + 5, (m, k), dt)
            y = jq.qmm_swiglu(x, packed, activation="gpt_oss", limit=7.0, backend="ffi")
            want, bound = _swiglu_oracle(x, w64, dt)
            assert np.all(np.abs(f64(y) - want) <= bound), (dt, m)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("mxfp8_e4m3", 8)])
def test_rms_norm_qmm_long_k(mode, bits):
    # K = 4096: four warps of 16 chunks; x (8 KiB at M = 1 in bf16) staged and normalized
    qw, packed = _packed(mode, bits, (37, 4096), key=11)
    w = rand(12, (4096,), jnp.bfloat16)
    for dt in ALL_DTYPES:
        for m in (1, 4):
            x = rand(7 + m, (m, 4096), dt)
            y = jq.rms_norm_qmm(x, w.astype(dt), packed, backend="ffi")
            z = jq.qmm(jq.rms_norm(x, w.astype(dt)), packed)
            eps = EPS[jnp.dtype(dt)]
            mag = np.abs(rms64(x, w)) @ np.abs(deq64(qw)).T
            bound = (2 * eps + 4096 * 2.0**-24) * mag + 2 * eps * np.abs(f64(z))
            assert np.all(np.abs(f64(y) - f64(z)) <= bound), (dt, m)


@pytest.mark.gpu
@needs_gpu
def test_cases_the_kernel_does_not_take_run_unfused():
    k = 192
    _, packed = _packed("mxfp4", 4, (48, k), key=1)  # I = 24: not whole tiles
    x = rand(1, (2, k), jnp.bfloat16)
    text = _targets(lambda x, q: jq.qmm_swiglu(x, q, backend="ffi"), x, packed)
    assert "jaxquant_gemv_mma_fused" not in text and "jaxquant_qmv_mma" in text
    np.testing.assert_allclose(f64(jq.qmm_swiglu(x, packed, backend="ffi")),
                               f64(_unfused_swiglu(x, packed, None, dict(activation="silu"))),
                               rtol=2**-7)
    x17 = rand(2, (17, k), jnp.bfloat16)  # more than 16 rows
    assert "jaxquant_gemv_mma_fused" not in _targets(
        lambda x, q: jq.rms_norm_qmm(x, None, q, backend="ffi"), x17, packed)
    # the fallback is the unfused ops on the backend asked for: the GPU norm kernel
    # (whose rounding may differ from XLA's reference norm by an ulp), then the GEMV
    np.testing.assert_array_equal(f64(jq.rms_norm_qmm(x17, None, packed, backend="ffi")),
                                  f64(jq.qmm(jq.rms_norm(x17, backend="ffi"), packed,
                                             backend="ffi")))
    _, big = _packed("affine", 4, (32, 8192), key=2)  # 16 x 32 KiB of float32 x: not staged
    xb = rand(3, (16, 8192), jnp.float32)
    assert "jaxquant_gemv_mma_fused" not in _targets(
        lambda x, q: jq.rms_norm_qmm(x, None, q, backend="ffi"), xb, big)
    np.testing.assert_array_equal(f64(jq.rms_norm_qmm(xb, None, big, backend="ffi")),
                                  f64(jq.qmm(jq.rms_norm(xb, backend="ffi"), big,
                                             backend="ffi")))


@pytest.mark.gpu
@needs_gpu
def test_automatic_choice_takes_the_fused_kernel_where_it_is_faster():
    """configs.FUSED_MAX_ROWS: the fused kernel up to its rows of x, the unfused ops above;
    rms_norm_qmm's, rms_norm_qmm_swiglu's and gather_qmm_swiglu's only when asked for."""
    from jaxquant.ffi import configs

    _, packed = _packed("mxfp4", 4, (64, 192), key=4)
    w = rand(5, (192,), jnp.bfloat16)
    ops = {"qmm_swiglu": lambda x, q: jq.qmm_swiglu(x, q),
           "qmm_add": lambda x, q: jq.qmm_add(x, q, jnp.zeros((x.shape[0], 64), x.dtype))}
    for op, f in ops.items():
        most = configs.FUSED_MAX_ROWS[op]
        for m, fused in ((1, True), (most, True), (most + 1, False)):
            text = _targets(f, rand(4, (m, 192), jnp.bfloat16), packed)
            assert ("jaxquant_gemv_mma_fused" in text) == fused, (op, m)
            # the unfused ops still run the tensor-core kernels, not a fallback (qmm_add's
            # qmm past 16 rows: the prefill GEMM)
            unfused = "jaxquant_qmm_gemm" if op == "qmm_add" else "jaxquant_qmv_mma"
            assert fused or unfused in text, (op, m)
    # rms_norm_qmm: opt-in (configs.py): the norm, then the plain GEMV
    norm = lambda backend: (lambda x, q: jq.rms_norm_qmm(x, w, q, backend=backend))
    text = _targets(norm(None), rand(4, (1, 192), jnp.bfloat16), packed)
    assert "jaxquant_gemv_mma_fused" not in text and "jaxquant_qmv_mma" in text, text[-2000:]
    assert "fuse = 1" in _targets(norm("ffi"), rand(4, (1, 192), jnp.bfloat16), packed)
    # rms_norm_qmm_swiglu: opt-in (configs.py): the norm, then qmm_swiglu's fused kernel
    nglu = lambda backend: (lambda x, q: jq.rms_norm_qmm_swiglu(x, w, q, backend=backend))
    text = _targets(nglu(None), rand(4, (1, 192), jnp.bfloat16), packed)
    assert "jaxquant_gemv_mma_fused" in text and "fuse = 2" in text, text[-2000:]
    assert "fuse = 3" in _targets(nglu("ffi"), rand(4, (1, 192), jnp.bfloat16), packed)
    # gather_qmm_swiglu: opt-in (configs.py): the gather GEMV, then XLA's epilogue
    _, experts = _packed("mxfp4", 4, (3, 64, 192), key=5)
    idx = jnp.array([[0, 2]], jnp.int32)
    for backend, fused in ((None, False), ("ffi", True)):
        text = _targets(lambda x, q: jq.gather_qmm_swiglu(x, q, idx, backend=backend),
                        rand(4, (1, 192), jnp.bfloat16), experts)
        assert ("jaxquant_gemv_mma_fused" in text) == fused, backend
        assert fused or "jaxquant_qmv_mma" in text, backend


@pytest.mark.gpu
@needs_gpu
def test_handler_checks():
    k = 128
    _, packed = _packed("mxfp4", 4, (32, k))
    q3 = packed.flatten_leading()
    x = rand(0, (1, 2, k), jnp.bfloat16)
    call = lambda *a, **kw: jax.block_until_ready(mma.gemv_mma_fused_call(*a, **kw))
    with pytest.raises(Exception, match="norm weight must be"):
        call(x, q3, jnp.ones((k + 1,), jnp.float32), fuse=mma.FUSE_NORM)
    with pytest.raises(Exception, match="bias must be"):
        call(x, q3, jnp.ones((k,), jnp.float32), fuse=mma.FUSE_SWIGLU)
    with pytest.raises(Exception, match="fuse must be"):
        call(x, q3, None, fuse=5)
    with pytest.raises(Exception, match="addend must have the output's shape"):
        call(x, q3, jnp.ones((1, 2, 16), jnp.bfloat16), fuse=mma.FUSE_ADD)
    with pytest.raises(Exception, match="addend must have .* x's dtype"):
        call(x, q3, jnp.ones((1, 2, 32), jnp.float32), fuse=mma.FUSE_ADD)
    with pytest.raises(Exception, match="norm weight must be"):
        call(x, q3, jnp.ones((k + 1,), jnp.float32), fuse=mma.FUSE_NORM_SWIGLU)
    _, odd = _packed("mxfp4", 4, (48, k))
    with pytest.raises(Exception, match="I a multiple of 16"):
        call(x, odd.flatten_leading(), None, fuse=mma.FUSE_SWIGLU)
    _, big = _packed("affine", 4, (32, 8192))
    with pytest.raises(Exception, match="stages x in shared memory"):
        call(rand(0, (1, 16, 8192), jnp.float32), big.flatten_leading(), None, fuse=mma.FUSE_NORM)
    with pytest.raises(Exception, match="rms_norm_qmm_swiglu's kernel stages x"):  # 36 KiB
        call(rand(0, (1, 2, 8192), jnp.float32), big.flatten_leading(), None,
             fuse=mma.FUSE_NORM_SWIGLU)
    # gather_qmm_swiglu: a bias row per expert; no indices with the norm
    _, experts = _packed("mxfp4", 4, (3, 32, k))
    ids, x1 = jnp.array([0, 2], jnp.int32), rand(0, (2, 1, k), jnp.bfloat16)
    with pytest.raises(Exception, match=r"bias must be .*\[3, 32\]"):
        call(x1, experts, jnp.ones((32,), jnp.float32), fuse=mma.FUSE_SWIGLU, indices=ids)
    for fuse in (mma.FUSE_NORM, mma.FUSE_NORM_SWIGLU, mma.FUSE_ADD):
        with pytest.raises(Exception, match=r"only qmm_swiglu's kernel \(fuse 2\) takes indices"):
            call(x1, experts, None if fuse != mma.FUSE_ADD else jnp.ones((2, 1, 32), jnp.bfloat16),
                 fuse=fuse, indices=ids)
    with pytest.raises(Exception, match="1 per gather slot"):
        call(rand(0, (2, 2, k), jnp.bfloat16), experts, None, fuse=mma.FUSE_SWIGLU, indices=ids)
