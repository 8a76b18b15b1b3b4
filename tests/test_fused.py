"""The fused decode ops (jaxquant/ops/fused.py) on CPU: rms_norm_qmm, qmm_swiglu and
gather_qmm_swiglu against the float64 oracle and against the composition of the unfused ops, every
mode of the activation, float32/bfloat16, edge values, bad inputs, jit/vmap/scan/grad,
and the fallback to the unfused ops on a backend without a fused kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxquant as jq
from tests.common import EPS, deq64, rms64
from tests.test_ops import nrand, oracle_quantized

MODES = [("affine", 4), ("affine", 3), ("mxfp4", 4), ("nvfp4", 4), ("mxfp8_e4m3", 8)]
DTYPES = [jnp.float32, jnp.bfloat16]
GPT_OSS = dict(activation="gpt_oss", limit=7.0, alpha=1.702)


@pytest.fixture(autouse=True)
def _reference_backend():
    """The ops' definition: the reference (the fallback test names its backend)."""
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
    for fn in (lambda b: jq.rms_norm_qmm(x, w, qw, backend=b),
               lambda b: jq.qmm_swiglu(x, qw, backend=b)):
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
    """The fused GEMV's automatic choice (the CUDA kernel; tests/test_fused_gpu.py lowers
    it): up to configs.FUSED_MAX_ROWS rows of x, counted over every leading axis."""
    from jaxquant.ffi import configs

    assert configs.FUSED_MAX_ROWS == {"rms_norm_qmm": 1, "qmm_swiglu": 4}
    for op, most in configs.FUSED_MAX_ROWS.items():
        auto = configs.auto_fused(op)
        x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        assert auto(x(1, 64), None, platform="cuda")
        assert auto(x(1, most, 64), None, platform="cuda")
        assert not auto(x(most + 1, 64), None, platform="cuda")
        assert not auto(x(2, most, 64), None, platform="cuda")  # batch x rows
    with pytest.raises(KeyError):
        configs.auto_fused("qmm")
