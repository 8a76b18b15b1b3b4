"""The ops (docs/ops.md) on the reference backend against the float64 oracle,
under jit, vmap, scan, grad and x64."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxquant as jq
from jaxquant import dispatch
from tests import oracle
from tests.common import (DTYPES, EPS, MODES, act64, assert_matmul_close, deq64, quantize_for,
                          rand, rms64)


def nrand(seed, shape, dtype=jnp.float32, scale=1.0):
    """Standard normal numpy values: unlike `rand`, and unlike slicing jax arrays
    eagerly, nothing is compiled for a new shape."""
    return (scale * np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


def oracle_quantized(w, mode, bits=None, group_size=None):
    """A QuantizedArray quantized by the numpy oracle (tests/oracle.py): the ops'
    inputs without compiling jq.quantize for yet another shape and mode
    (tests/test_quantize.py checks that both agree)."""
    w = np.asarray(w)
    mode, _, bits, group_size, _, _ = oracle._resolve(mode, bits, group_size, None)
    d = oracle.quantize(w, mode, bits, group_size)
    gs = None if d["global_scale"] is None else np.asarray(d["global_scale"], np.float32)
    return jq.QuantizedArray(d["data"], d["scales"], d["biases"], gs, mode=mode, bits=bits,
                             group_size=group_size, dtype=w.dtype)


@pytest.fixture(autouse=True)
def _reference_backend():
    """These tests define the ops: pin the reference (tests/test_ffi.py and
    tests/test_pallas_*.py test the kernels against the same oracle)."""
    with jq.backend("reference"):
        yield


# ---------------------------------------------------------------------------
# qmm


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [True, False])
def test_qmm_matches_oracle(mode, bits, dtype, transpose):
    n, k = 64, 128
    w = rand(0, (n, k) if transpose else (k, n), dtype)
    qw = quantize_for(mode, bits, w)
    x = rand(1, (2, 3, k), dtype)
    y = jax.jit(jq.qmm, static_argnums=2)(x, qw, transpose)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    assert_matmul_close(y, x, deq64(qw), dtype, transpose)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 40), groups=st.integers(1, 4),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_qmm_random_shapes(m, n, groups, mode, seed):
    mode, bits = mode
    k = groups * jq.formats.get_format(mode).default_group_size
    qw = quantize_for(mode, bits, rand(seed, (n, k), scale=np.exp((seed % 7) - 3)))
    x = rand(seed + 1, (m, k))
    assert_matmul_close(jq.qmm(x, qw), x, deq64(qw), jnp.float32)


def test_qmm_batched_weights():
    qw = jq.quantize(rand(0, (3, 32, 64)), mode="mxfp4")
    x = rand(1, (3, 5, 64))
    y = jq.qmm(x, qw)
    w64 = deq64(qw)
    for b in range(3):
        assert_matmul_close(y[b], x[b], w64[b], jnp.float32)


def test_qmm_vmap_over_x_weights_and_both():
    qws = jq.quantize(rand(0, (4, 32, 64)), mode="affine", bits=4, group_size=32)
    x = rand(1, (4, 2, 64))
    w64 = deq64(qws)
    y_x = jax.vmap(jq.qmm, in_axes=(0, None))(x, qws[1])
    y_w = jax.vmap(jq.qmm, in_axes=(None, 0))(x[0], qws)
    y_both = jax.jit(jax.vmap(jq.qmm))(x, qws)
    for b in range(4):
        assert_matmul_close(y_x[b], x[b], w64[1], jnp.float32)
        assert_matmul_close(y_w[b], x[0], w64[b], jnp.float32)
        assert_matmul_close(y_both[b], x[b], w64[b], jnp.float32)
    # The batch folds into the primitive: one qmm in the jaxpr, no reference loop.
    jaxpr = jax.make_jaxpr(jax.vmap(jq.qmm))(x, qws)
    assert [e.primitive.name for e in jaxpr.eqns].count("jaxquant_qmm") == 1


def test_qmm_vmap_batch_of_nvfp4_global_scales():
    ws = rand(0, (3, 16, 32))
    qws = jax.vmap(lambda w: jq.quantize(w, mode="nvfp4"))(ws)
    assert qws.global_scale.shape == (3,)
    x = rand(1, (2, 32))
    y = jax.vmap(jq.qmm, in_axes=(None, 0))(x, qws)
    for b in range(3):
        assert_matmul_close(y[b], x, deq64(qws[b]), jnp.float32)


def test_qmm_scan_layer_loop():
    layers = jq.quantize(rand(0, (4, 64, 64), scale=0.1), mode="mxfp8")
    x = rand(1, (2, 64))

    def body(h, qw):
        return jnp.tanh(jq.qmm(h, qw)), None

    out, _ = jax.jit(lambda x, l: jax.lax.scan(body, x, l))(x, layers)
    h = np.asarray(x, np.float64)
    w64 = deq64(layers)
    for i in range(4):
        h = np.tanh(h @ w64[i].T)
    np.testing.assert_allclose(out, h, rtol=1e-4, atol=1e-5)


def test_qmm_grad_in_x_and_lora():
    qw = jq.quantize(rand(0, (32, 64)), mode="affine")
    x = rand(1, (3, 64))
    w64 = deq64(qw)
    g = jax.jit(jax.grad(lambda x: jq.qmm(x, qw).sum()))(x)
    np.testing.assert_allclose(g, np.broadcast_to(w64.sum(0), (3, 64)), rtol=1e-5, atol=1e-5)
    # LoRA on a frozen quantized base: gradient reaches the adapters.
    a, b = rand(2, (64, 4), scale=0.1), rand(3, (4, 32), scale=0.1)

    def loss(ab, x):
        a, b = ab
        return jnp.sum(jnp.sin(jq.qmm(x, qw) + x @ a @ b))

    ga, gb = jax.grad(loss)((a, b), x)
    ct = np.cos(x.astype(np.float64) @ w64.T + np.asarray(x @ a @ b, np.float64))
    np.testing.assert_allclose(gb, (np.asarray(x @ a, np.float64)).T @ ct, rtol=1e-3, atol=1e-4)
    assert ga.shape == a.shape
    # transpose=False and second derivatives through the linear op.
    qw_t = jq.quantize(rand(4, (64, 32)), mode="mxfp4")
    g2 = jax.grad(lambda x: jnp.sum(jq.qmm(x, qw_t, transpose=False) ** 2))(x)
    y = x.astype(np.float64) @ deq64(qw_t)
    np.testing.assert_allclose(g2, 2 * y @ deq64(qw_t).T, rtol=1e-4, atol=1e-3)


def test_qmm_no_derivative_wrt_weights():
    w = rand(0, (16, 32))
    x = rand(1, (2, 32))
    qw = jq.quantize(w, mode="affine", group_size=32)
    with pytest.raises(ValueError, match="quantized weights"):
        jax.grad(lambda s: jq.qmm(x, jq.QuantizedArray(qw.data, s, qw.biases, mode="affine",
                                                       bits=4, group_size=32,
                                                       dtype=jnp.float32)).sum())(qw.scales)


def _affine_with(qw, scales=None, biases=None):
    """qw with its scales or biases replaced by (traced) arrays."""
    return jq.QuantizedArray(qw.data, qw.scales if scales is None else scales,
                             qw.biases if biases is None else biases, mode="affine", bits=qw.bits,
                             group_size=qw.group_size, dtype=qw.dtype)


def test_no_derivative_wrt_weights_of_gather_ragged_and_dequantize():
    qw = oracle_quantized(nrand(0, (4, 16, 32)), "affine", 4, 32)
    x = nrand(1, (3, 32))
    idx = np.array([[0, 1], [2, 3], [1, 1]])
    gs = np.array([1, 1, 1, 0])
    cases = {
        "gather_qmm": lambda s: jq.gather_qmm(x, _affine_with(qw, scales=s), idx).sum(),
        "ragged_qmm": lambda s: jq.ragged_qmm(x, _affine_with(qw, scales=s), gs).sum(),
        "dequantize": lambda s: jq.dequantize(_affine_with(qw, scales=s)).sum(),
    }
    for name, f in cases.items():
        with pytest.raises(ValueError, match=f"jaxquant.{name} has no derivative with respect "
                                             "to the quantized"):
            jax.grad(f)(qw.scales)
    with pytest.raises(ValueError, match="quantized"):  # biases are weights too
        jax.grad(lambda b: jq.dequantize(_affine_with(qw, biases=b)).sum())(qw.biases)


def test_qmm_x64():
    with jax.enable_x64(True):
        qw = jq.quantize(rand(0, (16, 64)).astype(jnp.float64), mode="affine", group_size=32)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)))
        y = jq.qmm(x, qw)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, np.asarray(x) @ deq64(qw).T, rtol=1e-12, atol=1e-12)


X64_MODES = [("mxfp6_e3m2", 6), ("fp4", 4), ("nvfp4", 4)]


def test_gather_ragged_dequantize_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((5, 64))
        idx = np.array([[0, 2], [1, 1], [2, 0], [1, 0], [2, 2]])
        gs = np.array([2, 0, 2])
        for mode, bits in X64_MODES:
            qw = quantize_for(mode, bits, rng.standard_normal((3, 16, 64)))
            assert qw.dtype == jnp.float64
            w64 = deq64(qw)
            d = jq.dequantize(qw)
            assert d.dtype == jnp.float64
            np.testing.assert_array_equal(d, w64)
            y = jax.jit(jq.gather_qmm)(x, qw, idx)
            assert y.dtype == jnp.float64
            want = np.einsum("tk,tjnk->tjn", x, w64[idx])
            np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
            y = jax.jit(jq.ragged_qmm)(x, qw, gs)
            assert y.dtype == jnp.float64
            want = np.concatenate([x[:2] @ w64[0].T, x[2:4] @ w64[2].T, np.zeros((1, 16))])
            np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_norms_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        x, r, g = (rng.standard_normal((3, 96)) for _ in range(3))
        w = rng.standard_normal(96)
        tol = dict(rtol=1e-13, atol=1e-13)
        y = jq.rms_norm(x, w, eps=1e-5, weight_offset=0.5)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, rms64(x, w, eps=1e-5, off=0.5), **tol)
        y, h = jq.add_rms_norm(x, r, w)
        assert y.dtype == h.dtype == jnp.float64
        h64 = x + r
        np.testing.assert_array_equal(h, h64)
        np.testing.assert_allclose(y, rms64(h64, w), **tol)
        for before, group in [(True, None), (False, 32)]:
            y = jq.gated_rms_norm(x, g, w, norm_before_gate=before, group_size=group)
            assert y.dtype == jnp.float64
            a = act64(g, "silu")
            want = (rms64(x, w, group=group) * a if before
                    else rms64(x * a, w, group=group))
            np.testing.assert_allclose(y, want, **tol)


@pytest.mark.skipif("ffi" not in jq.available_backends(),
                    reason="needs the ffi backend (its CPU library is not built)")
def test_backend_choice_retraces_jitted_functions():
    """The backend in force is part of jit's cache key: a function traced under
    one choice is traced again under another."""
    qw = jq.quantize(rand(0, (16, 64)), mode="mxfp4")
    x = rand(1, (1, 64))
    f = jax.jit(jq.qmm)
    assert "jaxquant_qmv" not in f.lower(x, qw).as_text()  # pinned to the reference
    with jq.backend("ffi"):
        assert "jaxquant_qmv" in f.lower(x, qw).as_text()
        np.testing.assert_allclose(f(x, qw), jq.qmm(x, qw, backend="reference"), rtol=2e-6,
                                   atol=1e-6)
    with jq.backend(None):  # automatic: on the CPU the ffi kernel wins
        assert "jaxquant_qmv" in f.lower(x, qw).as_text()


def test_qmm_honours_default_matmul_precision():
    qw = jq.quantize(rand(0, (16, 64)), mode="mxfp4")
    x = rand(1, (2, 64))
    with jax.default_matmul_precision("highest"):
        text = jax.jit(jq.qmm).lower(x, qw).as_text()
    assert "HIGHEST" in text
    assert "HIGHEST" not in jax.jit(jq.qmm).lower(x, qw).as_text()


def test_gather_and_ragged_qmm_honour_default_matmul_precision():
    qw = jq.quantize(rand(0, (4, 16, 32)), mode="mxfp4")
    x = rand(1, (3, 32))
    idx = jnp.array([[0, 1], [2, 3], [1, 1]])
    gs = jnp.array([1, 1, 1, 0])
    for f, args in [(jq.gather_qmm, (x, qw, idx)), (jq.ragged_qmm, (x, qw, gs))]:
        with jax.default_matmul_precision("highest"):
            text = jax.jit(f).lower(*args).as_text()
        assert "HIGHEST" in text, f.__name__
        assert "HIGHEST" not in jax.jit(f).lower(*args).as_text(), f.__name__


# ---------------------------------------------------------------------------
# gather_qmm


@pytest.mark.parametrize("mode,bits", MODES)
@pytest.mark.parametrize("per_slot_x", [False, True])
def test_gather_qmm_matches_oracle_and_qmm_bitwise(mode, bits, per_slot_x):
    e, n, k, t, slots = 5, 24, 64, 4, 3
    qw = quantize_for(mode, bits, rand(0, (e, n, k)))
    idx = jax.random.randint(jax.random.key(2), (t, slots), 0, e)
    x = rand(1, (t, slots, k) if per_slot_x else (t, k), jnp.bfloat16)
    y = jax.jit(jq.gather_qmm)(x, qw, idx)
    assert y.shape == (t, slots, n) and y.dtype == jnp.bfloat16
    w64 = deq64(qw)
    qmm = jax.jit(jq.qmm)
    for i in range(t):
        for j in range(slots):
            xi = x[i, j] if per_slot_x else x[i]
            assert_matmul_close(y[i, j], xi, w64[int(idx[i, j])], jnp.bfloat16)
            single = qmm(xi, qw[int(idx[i, j])])
            assert np.array_equal(np.asarray(single), np.asarray(y[i, j]))


def test_gather_qmm_bad_ids_give_nan_rows():
    e = 3
    qw = jq.quantize(rand(0, (e, 16, 32)), mode="mxfp4")
    idx = jnp.array([[0, -1], [3, 2], [2**31 - 1, -2**31]], jnp.int32)
    y = jax.jit(jq.gather_qmm)(rand(1, (3, 32)), qw, idx)
    bad = np.array([[False, True], [True, False], [True, True]])
    assert np.all(np.isnan(np.asarray(y))[bad])
    assert not np.any(np.isnan(np.asarray(y))[~bad])


def test_gather_qmm_vmap_and_grad():
    qw = jq.quantize(rand(0, (4, 16, 32)), mode="nvfp4")
    x = rand(1, (2, 3, 32))
    idx = jnp.array([[[0, 1], [2, 3], [1, 1]], [[3, 3], [0, 2], [2, 0]]])
    y = jax.vmap(jq.gather_qmm, in_axes=(0, None, 0))(x, qw, idx)
    for b in range(2):
        np.testing.assert_array_equal(y[b], jq.gather_qmm(x[b], qw, idx[b]))
    w64 = deq64(qw)
    g = jax.grad(lambda x: jq.gather_qmm(x, qw, idx[0]).sum())(x[0])
    want = np.stack([w64[np.asarray(idx[0, t])].sum(axis=(0, 1)) for t in range(3)])
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def assert_gather_close(y, x, w64, idx, dtype):
    """gather_qmm's y [T, k, N] against the float64 x [T, (k,) K] @ w64[idx].T, per element."""
    x64 = np.asarray(x, np.float64)
    idx = np.asarray(idx)
    xs = np.broadcast_to(x64[:, None] if x64.ndim == 2 else x64, idx.shape + x64.shape[-1:])
    assert_matmul_close(np.asarray(y, np.float64)[..., None, :], xs[..., None, :], w64[idx],
                        dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gather_qmm_float32_float16(dtype):
    """test_gather_qmm_matches_oracle_and_qmm_bitwise covers bfloat16 x every mode."""
    idx = np.array([[0, 2], [1, 1], [3, 0]])
    x = nrand(1, (3, 32), dtype)
    mode, bits = {jnp.float32: ("nvfp4", 4), jnp.float16: ("affine", 4)}[dtype]
    qw = oracle_quantized(nrand(0, (4, 16, 32), dtype), mode, bits,
                          group_size=32 if mode == "affine" else None)
    y = jq.gather_qmm(x, qw, idx)
    assert y.shape == (3, 2, 16) and y.dtype == dtype
    assert_gather_close(y, x, deq64(qw), idx, dtype)
    assert np.array_equal(np.asarray(jq.qmm(x[2], qw[3])), np.asarray(y)[2, 0])


def test_gather_qmm_vmap_over_weights_and_over_indices():
    qws = oracle_quantized(nrand(0, (2, 4, 16, 32)), "mxfp4")  # a batch of expert stacks
    x = nrand(1, (2, 3, 32))
    idx = np.array([[[0, 1], [2, 3], [1, 0]], [[2, 0], [0, 0], [3, 2]]])
    w64 = deq64(qws)
    q0, q1 = qws[0], qws[1]
    want = {  # in_axes -> the unbatched calls, one per batch element
        (None, 0, None): [jq.gather_qmm(x[0], q, idx[0]) for q in (q0, q1)],
        (0, 0, 0): [jq.gather_qmm(x[0], q0, idx[0]), jq.gather_qmm(x[1], q1, idx[1])],
        (None, None, 0): [jq.gather_qmm(x[0], q0, i) for i in (idx[0], idx[1])],
    }
    for in_axes, loop in want.items():
        args = [a if d == 0 else a[0] for a, d in zip((x, qws, idx), in_axes)]
        y = np.asarray(jax.jit(jax.vmap(jq.gather_qmm, in_axes=in_axes))(*args))
        assert y.shape == (2, 3, 2, 16)
        np.testing.assert_allclose(y, np.stack(loop), rtol=1e-6, atol=1e-6, err_msg=str(in_axes))
        for b in range(2):
            pick = lambda a, d: a[b if d == 0 else 0]
            assert_gather_close(y[b], pick(x, in_axes[0]), pick(w64, in_axes[1]),
                                pick(idx, in_axes[2]), jnp.float32)


# ---------------------------------------------------------------------------
# ragged_qmm


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("mxfp6_e3m2", 6),
                                       ("nvfp4", 4), ("fp4", 4), ("mxfp8_e5m2", 8)])
@pytest.mark.parametrize("transpose", [True, False])
def test_ragged_qmm_matches_oracle(mode, bits, transpose):
    e, n, k, t = 4, 64, 64, 11
    shape = (e, n, k) if transpose else (e, k, n)
    qw = quantize_for(mode, bits, rand(0, shape))
    gs = jnp.array([3, 0, 5, 1], jnp.int32)  # 9 rows used, 2 left over
    x = rand(1, (t, k))
    y = jax.jit(jq.ragged_qmm, static_argnums=3)(x, qw, gs, transpose)
    w64 = deq64(qw)
    start = 0
    for g, size in enumerate(np.asarray(gs)):
        assert_matmul_close(y[start:start + size], x[start:start + size], w64[g], jnp.float32,
                            transpose)
        start += size
    assert np.all(np.asarray(y[start:]) == 0)
    gx = jax.grad(lambda x: jq.ragged_qmm(x, qw, gs, transpose).sum())(x)
    assert np.all(np.asarray(gx[start:]) == 0)
    np.testing.assert_allclose(gx[0], (w64[0] if transpose else w64[0].T).sum(0),
                               rtol=1e-5, atol=1e-5)


def test_ragged_qmm_vmap_over_x():
    qw = jq.quantize(rand(0, (2, 8, 32)), mode="mxfp4")
    gs = jnp.array([2, 3])
    x = rand(1, (3, 6, 32))
    y = jax.vmap(jq.ragged_qmm, in_axes=(0, None, None))(x, qw, gs)
    for b in range(3):
        np.testing.assert_allclose(y[b], jq.ragged_qmm(x[b], qw, gs), rtol=1e-6, atol=1e-6)
    gss = jnp.array([[2, 3], [1, 1], [0, 6]])
    y = jax.vmap(jq.ragged_qmm, in_axes=(0, None, 0))(x, qw, gss)
    for b in range(3):
        np.testing.assert_allclose(y[b], jq.ragged_qmm(x[b], qw, gss[b]), rtol=1e-6, atol=1e-6)


# Traced group sizes outside the contract: a negative size counts as 0, the groups are
# cut at T rows (int32 max twice: a cumulative sum that must not wrap).
RAGGED_RULE = [[5, -1, 4, 2], [-3, 20, 0, 1], [3, 4, 6, 5], [0, 0, 0, 0], [11, 0, 0, 0],
               [2**31 - 1, 2**31 - 1, 0, 0], [0, -(2**31), 7, 9]]


def _ragged_rule_want(x, w64, sizes):
    """float64 rows of the rule, and which rows are past every group (zero)."""
    t = x.shape[0]
    ends = np.minimum(np.cumsum(np.clip(np.asarray(sizes, np.int64), 0, None)), t)
    owner = np.searchsorted(ends, np.arange(t), side="right")
    live = np.arange(t) < ends[-1]
    w_rows = w64[np.minimum(owner, len(sizes) - 1)]                   # [T, N, K]
    want = np.einsum("tk,tnk->tn", np.asarray(x, np.float64), w_rows)
    return np.where(live[:, None], want, 0.0), live


def _ragged_backends():
    from jaxquant.pallas import moe
    runs = {"reference": lambda x, q, g: jq.ragged_qmm(x, q, g, backend="reference"),
            "pallas-interpret": lambda x, q, g: moe.ragged_qmm(x, q, g, interpret=True)}
    if "ffi" in jq.available_backends():
        runs["ffi"] = lambda x, q, g: jq.ragged_qmm(x, q, g, backend="ffi")
    return runs


@pytest.mark.parametrize("sizes", RAGGED_RULE, ids=str)
def test_ragged_qmm_traced_group_sizes_rule_on_every_backend(sizes):
    e, n, k, t = 4, 32, 64, 11
    qw = jq.quantize(rand(0, (e, n, k)), mode="mxfp4")
    x = rand(1, (t, k))
    want, live = _ragged_rule_want(x, deq64(qw), sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    for name, run in _ragged_backends().items():
        y = np.asarray(jax.jit(run)(x, qw, gs), np.float64)
        assert np.all(y[~live] == 0), name
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=name)
    # vmap over the sizes (the batching rule maps the primitive per size vector)
    ys = jax.jit(jax.vmap(jq.ragged_qmm, in_axes=(None, None, 0)))(x, qw, jnp.stack([gs, gs]))
    np.testing.assert_allclose(np.asarray(ys[1], np.float64), want, rtol=1e-5, atol=1e-5)


def test_ragged_qmm_concrete_group_sizes_are_checked():
    qw = jq.quantize(rand(0, (4, 32, 64)), mode="mxfp4")
    x = rand(1, (11, 64))
    for bad in ([5, -1, 4, 2], np.array([0, 0, -1, 0]), jnp.array([3, 4, 6, 5])):
        with pytest.raises(ValueError, match="group_sizes"):
            jq.ragged_qmm(x, qw, bad)
    with pytest.raises(ValueError, match=r"group_sizes must sum to at most T=11"):
        jq.ragged_qmm(x, qw, [2**31 - 1, 2**31 - 1, 0, 0])  # no int32 wrap in the check
    y = jq.ragged_qmm(x, qw, [11, 0, 0, 0])   # sum == T is fine
    assert y.shape == (11, 32)


RAGGED_MORE = [("affine", 2, jnp.float32), ("affine", 3, jnp.float32), ("affine", 5, jnp.float32),
               ("affine", 6, jnp.float32), ("affine", 8, jnp.float32),
               ("mxfp6_e2m3", 6, jnp.float32), ("mxfp8_e4m3", 8, jnp.float32),
               ("affine", 4, jnp.bfloat16), ("mxfp4", 4, jnp.bfloat16)]


def test_ragged_qmm_more_modes_and_bfloat16():
    """The modes and dtype test_ragged_qmm_matches_oracle leaves out, all inside one jit."""
    w, x = nrand(0, (3, 16, 64)), nrand(1, (6, 64))
    gs = np.array([2, 0, 3], np.int32)
    qws = [oracle_quantized(w.astype(dt), m, b, 32) for m, b, dt in RAGGED_MORE]
    xs = [x.astype(dt) for _, _, dt in RAGGED_MORE]
    ys = jax.jit(lambda xs, qws: [jq.ragged_qmm(x, q, gs) for x, q in zip(xs, qws)])(xs, qws)
    for (mode, bits, dtype), qw, x, y in zip(RAGGED_MORE, qws, xs, ys):
        assert (qw.mode, qw.bits) == (mode, bits) and y.shape == (6, 16) and y.dtype == dtype
        y, w64 = np.asarray(y), deq64(qw)
        assert_matmul_close(y[:2], x[:2], w64[0], dtype)
        assert_matmul_close(y[2:5], x[2:5], w64[2], dtype)
        assert np.all(y[5:].astype(np.float32) == 0)


def test_ragged_qmm_vmap_over_weights():
    qws = oracle_quantized(nrand(0, (2, 4, 16, 32)), "mxfp4")
    gs = np.array([2, 0, 3, 0])
    x = nrand(1, (6, 32))
    y = np.asarray(jax.jit(jax.vmap(jq.ragged_qmm, in_axes=(None, 0, None)))(x, qws, gs))
    w64 = deq64(qws)
    qs = [qws[b] for b in range(2)]
    np.testing.assert_allclose(y, np.stack([jq.ragged_qmm(x, q, gs) for q in qs]), rtol=1e-6,
                               atol=1e-6)
    assert_matmul_close(y[:, :2], x[:2], w64[:, 0], jnp.float32)
    assert_matmul_close(y[:, 2:5], x[2:5], w64[:, 2], jnp.float32)
    assert np.all(y[:, 5:] == 0)
    # weights and x both batched
    xs = nrand(2, (2, 6, 32))
    y = jax.vmap(jq.ragged_qmm, in_axes=(0, 0, None))(xs, qws, gs)
    loop = np.stack([jq.ragged_qmm(xs[b], qs[b], gs) for b in range(2)])
    np.testing.assert_allclose(y, loop, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# norms (float64 numpy oracle written here from docs/ops.md)


@pytest.mark.parametrize("width", [1, 7, 64, 128, 256, 1000, 5376])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(width, dtype):
    x = rand(0, (3, width), dtype, scale=3.0)
    w = rand(1, (width,), dtype)
    tol = dict(rtol=4 * EPS[jnp.dtype(dtype)], atol=4 * EPS[jnp.dtype(dtype)])
    y = jax.jit(jq.rms_norm)(x, w)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w), **tol)
    y = jq.rms_norm(x, None, eps=1e-3, weight_offset=1.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, eps=1e-3), **tol)
    y = jq.rms_norm(x, w, weight_offset=1.0)
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w, off=1.0), **tol)


@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                    (jnp.float32, jnp.float32)])
def test_add_rms_norm(dtypes):
    xd, rd = dtypes
    x, r, w = rand(0, (4, 96), xd), rand(1, (4, 96), rd), rand(2, (96,), rd)
    y, h = jax.jit(jq.add_rms_norm)(x, r, w)
    assert h.dtype == rd and y.dtype == rd
    h64 = np.asarray((x + r).astype(rd), np.float64)
    np.testing.assert_array_equal(np.asarray(h, np.float64), h64)
    eps = EPS[jnp.dtype(rd)]
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(h64, w), rtol=4 * eps,
                               atol=4 * eps)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 64])
def test_gated_rms_norm(activation, norm_before_gate, group_size):
    x = rand(0, (5, 256), jnp.float32)  # float32 x with bf16 gate/weight (docs/ops.md)
    gate, w = rand(1, (5, 256), jnp.bfloat16), rand(2, (256,), jnp.bfloat16)
    y = jax.jit(jq.gated_rms_norm, static_argnames=("activation", "norm_before_gate",
                                                    "group_size"))(
        x, gate, w, activation=activation, norm_before_gate=norm_before_gate,
        group_size=group_size)
    assert y.dtype == jnp.bfloat16
    a = act64(gate, activation)
    if norm_before_gate:
        want = rms64(x, w, group=group_size) * a
    else:
        want = rms64(np.asarray(x, np.float64) * a, w, group=group_size)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-7, atol=2**-7)


def test_norms_vmap_and_grad():
    x, r, w = rand(0, (3, 4, 32)), rand(1, (3, 4, 32)), rand(2, (32,))
    y = jax.vmap(jq.rms_norm, in_axes=(0, None))(x, w)
    np.testing.assert_allclose(y, jq.rms_norm(x, w), rtol=1e-6)
    ws = rand(3, (3, 32))
    y = jax.vmap(jq.rms_norm)(x, ws)  # batched weight: vmap of the reference
    for b in range(3):
        np.testing.assert_allclose(y[b], jq.rms_norm(x[b], ws[b]), rtol=1e-6)
    yh = jax.vmap(jq.add_rms_norm, in_axes=(0, None, None))(x, r[0], w)
    np.testing.assert_allclose(yh[1], x + r[0], rtol=1e-6)

    def ref(x, w):
        xf = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        return jnp.sum(jnp.sin(xf * w))

    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(jq.rms_norm(x, w))), argnums=(0, 1))(x, w)
    gr = jax.grad(ref, argnums=(0, 1))(x, w)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    gg = jax.grad(lambda x: jnp.sum(jq.gated_rms_norm(x, r, w, norm_before_gate=False)))(x)
    assert gg.shape == x.shape and np.all(np.isfinite(gg))


def _rms_ref(h, w, eps, off, group=None):
    """Plain float32 jnp RMSNorm (docs/ops.md), the gradients' reference."""
    hs = h.reshape(*h.shape[:-1], -1, group) if group else h
    y = (hs / jnp.sqrt(jnp.mean(hs * hs, -1, keepdims=True) + eps)).reshape(h.shape)
    return y * (w + off)


def test_add_rms_norm_grad_matches_jnp():
    x, r, w = nrand(0, (3, 4, 64)), nrand(1, (3, 4, 64)), nrand(2, (64,))
    cy, ch = nrand(3, (3, 4, 64)), nrand(4, (3, 4, 64))  # cotangents for y and h

    def loss(fn):
        def f(x, r, w):
            y, h = fn(x, r, w)
            return jnp.sum(jnp.sin(y) * cy) + jnp.sum(h * h * ch)
        return f

    def ref(x, r, w):
        h = x + r
        return _rms_ref(h, w, 1e-5, 1.0), h

    ours = lambda x, r, w: jq.add_rms_norm(x, r, w, eps=1e-5, weight_offset=1.0)
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, r, w)
    gr = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(x, r, w)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gated_rms_norm_grad_matches_jnp():
    x, gate, w = nrand(0, (5, 64)), nrand(1, (5, 64)), nrand(2, (64,))
    ct = nrand(3, (5, 64))
    for activation, norm_before_gate, group_size in [("silu", True, None),
                                                     ("sigmoid", False, 16)]:
        act = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}[activation]

        def ref(x, gate, w):
            a = act(gate)
            if norm_before_gate:
                return _rms_ref(x, w, 1e-6, 0.0, group_size) * a
            return _rms_ref(x * a, w, 1e-6, 0.0, group_size)

        ours = lambda x, gate, w: jq.gated_rms_norm(x, gate, w, activation=activation,
                                                    norm_before_gate=norm_before_gate,
                                                    group_size=group_size)
        grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.tanh(fn(*a)) * ct),
                                           argnums=(0, 1, 2)))
        for a, b in zip(grad(ours)(x, gate, w), grad(ref)(x, gate, w)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gated_rms_norm_vmap():
    x, gate, w = nrand(0, (3, 4, 32)), nrand(1, (3, 4, 32)), nrand(2, (3, 32))
    kw = dict(norm_before_gate=False, group_size=16)
    f = lambda x, g, w: jq.gated_rms_norm(x, g, w, **kw)
    y = np.asarray(jax.vmap(f, in_axes=(0, 0, None))(x, gate, w[0]))  # folds into the rows
    y_w = np.asarray(jax.vmap(f)(x, gate, w))  # batched weight: vmap of the reference
    for b in range(3):
        np.testing.assert_allclose(y[b], f(x[b], gate[b], w[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y_w[b], f(x[b], gate[b], w[b]), rtol=1e-6, atol=1e-6)
    a = act64(gate, "silu")
    np.testing.assert_allclose(y, rms64(x * a, w[0], group=16), rtol=1e-5, atol=1e-5)


def test_scan_layer_loop_with_gather_qmm_and_norm():
    """A decoder-like layer loop under lax.scan: norm, routed experts (a stack of
    expert weights per layer), residual; against the unrolled loop and float64."""
    layers, e, d, t = 3, 4, 32, 3
    qws = oracle_quantized(nrand(0, (layers, e, d, d), scale=0.2), "mxfp4")
    norm_w = 1 + nrand(1, (layers, d), scale=0.1)
    idx = np.random.default_rng(2).integers(0, e, (layers, t, 2)).astype(np.int32)
    x = nrand(3, (t, d))

    def layer(h, qw, nw, ix):
        y = jq.rms_norm(h, nw)
        return h + jnp.tanh(jq.gather_qmm(y, qw, ix)).sum(axis=1)

    scanned, _ = jax.jit(lambda x, xs: jax.lax.scan(
        lambda h, l: (layer(h, *l), None), x, xs))(x, (qws, norm_w, idx))

    @jax.jit
    def unrolled(h, qws, norm_w, idx):
        for i in range(layers):
            h = layer(h, qws[i], norm_w[i], idx[i])
        return h

    np.testing.assert_allclose(scanned, unrolled(x, qws, norm_w, idx), rtol=1e-5, atol=1e-5)
    h64, w64 = np.asarray(x, np.float64), deq64(qws)
    for i in range(layers):
        y = rms64(h64, norm_w[i])
        h64 = h64 + np.tanh(np.einsum("tk,tjnk->tjn", y, w64[i][idx[i]])).sum(1)
    np.testing.assert_allclose(scanned, h64, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# Every public op is exactly one jaxquant primitive.


def test_one_primitive_per_op():
    qw = jq.quantize(rand(0, (4, 16, 32)), mode="mxfp4")
    x = rand(1, (3, 32))
    idx = jnp.zeros((3, 2), jnp.int32)
    cases = {
        "dequantize": (jq.dequantize, (qw,)),
        "qmm": (jq.qmm, (x, qw[0])),
        "gather_qmm": (jq.gather_qmm, (x, qw, idx)),
        "ragged_qmm": (jq.ragged_qmm, (x, qw, jnp.array([1, 1, 1, 0]))),
        "rms_norm": (jq.rms_norm, (x, x[0])),
        "add_rms_norm": (jq.add_rms_norm, (x, x, x[0])),
        "gated_rms_norm": (jq.gated_rms_norm, (x, x, x[0])),
    }
    for name, (fn, args) in cases.items():
        eqns = jax.make_jaxpr(fn)(*args).eqns
        names = [e.primitive.name for e in eqns]
        assert names == [f"jaxquant_{name}"], (name, names)


# ---------------------------------------------------------------------------
# Bad inputs.


def test_op_bad_inputs():
    qw = jq.quantize(rand(0, (4, 16, 32)), mode="mxfp4")
    x = rand(1, (3, 32))
    with pytest.raises(TypeError, match="qw"):
        jq.qmm(x, np.ones((16, 32)))
    with pytest.raises(TypeError, match="x"):
        jq.qmm(x.astype(jnp.int32), qw[0])
    with pytest.raises(ValueError, match="K=32"):
        jq.qmm(rand(1, (3, 31)), qw[0])
    with pytest.raises(ValueError, match="x must be"):
        jq.qmm(x, qw)  # batched qw needs [*B, M, K]
    with pytest.raises(ValueError, match="qw"):
        jq.gather_qmm(x, qw[0], jnp.zeros((3, 2), jnp.int32))
    with pytest.raises(TypeError, match="indices"):
        jq.gather_qmm(x, qw, jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="indices"):
        jq.gather_qmm(x, qw, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="x must be"):
        jq.gather_qmm(x, qw, jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        jq.ragged_qmm(x, qw, jnp.array([1, 2]))
    with pytest.raises(TypeError, match="group_sizes"):
        jq.ragged_qmm(x, qw, jnp.array([1.0, 2, 0, 0]))
    with pytest.raises(ValueError, match="weight"):
        jq.rms_norm(x, jnp.ones(31))
    with pytest.raises(ValueError, match="residual"):
        jq.add_rms_norm(x, x[:2])
    with pytest.raises(ValueError, match="activation"):
        jq.gated_rms_norm(x, x, activation="relu")
    with pytest.raises(ValueError, match="group_size"):
        jq.gated_rms_norm(x, x, group_size=5)
    with pytest.raises(ValueError, match="eps"):
        jq.rms_norm(x, eps=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        jq.dequantize(qw, dtype=jnp.int8)


def test_op_bad_inputs_more():
    qw = oracle_quantized(nrand(0, (4, 16, 32)), "mxfp4")
    x = nrand(1, (3, 32))
    gs = np.array([1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"x must be \[T, K=32\]"):
        jq.ragged_qmm(x[None], qw, gs)  # rank 3
    with pytest.raises(ValueError, match=r"x must be \[T, K=32\]"):
        jq.ragged_qmm(x[:, :16], qw, gs)  # wrong K
    with pytest.raises(ValueError, match="K=16"):  # transpose=False: qw is [K, N] = [16, 32]
        jq.qmm(x, qw[0], transpose=False)
    for bad in ("1e-6", None, jnp.float32(1e-6), np.bool_(True)):
        with pytest.raises(TypeError, match="eps"):
            jq.rms_norm(x, eps=bad)
    # NumPy real scalars are static values like Python floats
    np.testing.assert_array_equal(jq.rms_norm(x, eps=np.float32(1e-3), weight_offset=np.int64(1)),
                                  jq.rms_norm(x, eps=float(np.float32(1e-3)), weight_offset=1.0))
    with pytest.raises(TypeError, match="weight_offset"):
        jq.add_rms_norm(x, x, x[0], weight_offset="1")
    with pytest.raises(TypeError, match="eps"):
        jq.gated_rms_norm(x, x, eps=True)
    with pytest.raises(TypeError, match="weight_offset"):
        jq.gated_rms_norm(x, x, weight_offset=jnp.ones(()))
    for gate in (x[:, :16], x[0], x[None]):
        with pytest.raises(ValueError, match="gate must have x's shape"):
            jq.gated_rms_norm(x, gate)
    with pytest.raises(TypeError, match="gate"):
        jq.gated_rms_norm(x, x.astype(np.int32))
    with pytest.raises(TypeError, match="weight"):
        jq.rms_norm(x, np.ones(32, np.int32))
    with pytest.raises(TypeError, match="weight"):
        jq.gated_rms_norm(x, x, np.ones(32, np.int8))
    with pytest.raises(TypeError, match="residual"):
        jq.add_rms_norm(x, x.astype(np.int32))


# ---------------------------------------------------------------------------
# Backend dispatch: argument, context, $JAXQUANT_BACKEND, unavailable and unknown names.


def _bound_backend(fn, *args):
    """The backend the op's primitive was bound with (None: automatic). A fresh
    function each time: make_jaxpr caches traces, and the environment variable
    (read when the op is traced) is not part of the cache key."""
    (eqn,) = jax.make_jaxpr(lambda *a: fn(*a))(*args).eqns
    return eqn.params["backend"]


def test_backend_env_var(monkeypatch):
    qw = oracle_quantized(nrand(0, (16, 32)), "mxfp4")
    x = nrand(1, (3, 32))
    qmm = lambda x: jq.qmm(x, qw)
    with jq.backend(None):  # lift the module's reference pin: the variable decides
        monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
        assert _bound_backend(qmm, x) is None
        monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
        assert _bound_backend(qmm, x) == "reference"
        assert _bound_backend(lambda x: jq.rms_norm(x), x) == "reference"
        monkeypatch.setenv("JAXQUANT_BACKEND", "auto")
        assert _bound_backend(qmm, x) is None
        if "metal" not in jq.available_backends():  # off macOS: not part of the build
            monkeypatch.setenv("JAXQUANT_BACKEND", "metal")
            with pytest.raises(RuntimeError, match="backend='metal' cannot run here: "
                                                   "(not built: .*macOS only|.*metal)"):
                jq.qmm(x, qw)
            with pytest.raises(RuntimeError, match="'metal'"):
                jq.rms_norm(x)
        # The argument and the context manager take precedence over the variable.
        assert _bound_backend(lambda x: jq.qmm(x, qw, backend="reference"), x) == "reference"
        with jq.backend("reference"):
            assert _bound_backend(qmm, x) == "reference"
        monkeypatch.setenv("JAXQUANT_BACKEND", "bogus")
        with pytest.raises(ValueError, match="'bogus' is not known"):
            jq.qmm(x, qw)
        for name, missing in [("pallas", "GPU"), ("ffi", "libjaxquant_cpu")]:
            monkeypatch.setenv("JAXQUANT_BACKEND", name)
            if name in jq.available_backends():
                assert _bound_backend(qmm, x) == name
            else:
                with pytest.raises(RuntimeError, match=f"backend='{name}' cannot run here: "
                                                       f".*{missing}"):
                    jq.qmm(x, qw)


def test_unknown_and_unavailable_backend_names():
    qw = oracle_quantized(nrand(0, (16, 32)), "mxfp4")
    x = nrand(1, (3, 32))
    with pytest.raises(ValueError, match="'cuda' is not known"):
        jq.qmm(x, qw, backend="cuda")
    with pytest.raises(ValueError, match="'triton' is not known"):
        with jq.backend("triton"):
            pass
    avail = jq.available_backends()
    assert avail[0] == "reference"
    if sys.platform != "darwin":  # the Metal backend is part of macOS builds only
        with pytest.raises(RuntimeError, match="backend='metal' cannot run here: not built: "
                                               ".*macOS only"):
            jq.rms_norm(x, backend="metal")
        assert "metal" not in avail
    for name in dispatch.BACKENDS:
        why = dispatch.unavailable_reason(name)
        assert (why is None) == (name in avail)
        if why is not None:
            with pytest.raises(RuntimeError, match=f"backend={name!r} cannot run here"):
                jq.dequantize(qw, backend=name)


# ---------------------------------------------------------------------------
# Composition: a decoder MLP block and a routed MoE block, end to end under jit.


def test_decoder_mlp_block():
    d, f = 128, 256
    wg, wu, wd = rand(0, (f, d), scale=0.1), rand(1, (f, d), scale=0.1), rand(2, (d, f), scale=0.1)
    qg, qu = jq.quantize(wg, mode="affine"), jq.quantize(wu, mode="affine")
    qd = jq.quantize(wd, mode="affine")
    norm_w = 1 + rand(3, (d,), scale=0.1)
    x, res = rand(4, (2, 5, d)), rand(5, (2, 5, d))

    @jax.jit
    def block(x, res):
        y, h = jq.add_rms_norm(x, res, norm_w)
        a = jax.nn.silu(jq.qmm(y, qg)) * jq.qmm(y, qu)
        return h + jq.qmm(a, qd)

    out = block(x, res)
    h = np.asarray(x, np.float64) + np.asarray(res, np.float64)
    y = rms64(h, norm_w)
    g, u = y @ deq64(qg).T, y @ deq64(qu).T
    want = h + (g / (1 + np.exp(-g)) * u) @ deq64(qd).T
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    # ...and the quantization error against the float weights stays at the format's level.
    gd, ud = y @ np.asarray(wg, np.float64).T, y @ np.asarray(wu, np.float64).T
    dense = h + (gd / (1 + np.exp(-gd)) * ud) @ np.asarray(wd, np.float64).T
    rel = np.linalg.norm(np.asarray(out) - dense) / np.linalg.norm(dense - h)
    assert rel < 0.2, rel


def moe_block(x, router, q_gate, q_up, q_down, top_k):
    logits = x @ router
    weights, idx = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(weights, axis=-1)
    a = jax.nn.silu(jq.gather_qmm(x, q_gate, idx)) * jq.gather_qmm(x, q_up, idx)
    y = jq.gather_qmm(a, q_down, idx)  # per-slot x
    return jnp.einsum("tk,tkn->tn", weights, y)


def test_moe_block():
    e, d, f, t, top_k = 8, 64, 96, 6, 2
    router = rand(0, (d, e))
    qs = [jq.quantize(rand(i + 1, shape, scale=0.1), mode="mxfp4")
          for i, shape in enumerate([(e, f, d), (e, f, d), (e, d, f)])]
    x = rand(9, (t, d))
    out = jax.jit(moe_block, static_argnums=5)(x, router, *qs, top_k)
    x64 = np.asarray(x, np.float64)
    logits = np.asarray(x @ router, np.float64)
    wg, wu, wd = (deq64(q) for q in qs)
    want = np.zeros((t, d))
    for i in range(t):
        top = np.argsort(-logits[i])[:top_k]
        p = np.exp(logits[i, top] - logits[i, top].max())
        p /= p.sum()
        for j, ex in enumerate(top):
            g, u = wg[ex] @ x64[i], wu[ex] @ x64[i]
            want[i] += p[j] * (wd[ex] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    hlo = jax.jit(moe_block, static_argnums=5).lower(x, router, *qs, top_k).as_text()
    # One device program: no host callbacks, sends or receives.
    for word in ("callback", "stablehlo.send", "stablehlo.recv"):
        assert word not in hlo


def mx_rounding_bound(w, element, block=32):
    """Per-element bound on |w - dequantize(quantize(w))| for an MX format with the
    OCP floor scale rule (docs/formats.md): scale = 2**(floor(log2 amax) - emax_elem);
    an element rounds to the nearest grid value (at most half the gap it falls in)
    or saturates to the largest (error = excess over it)."""
    w64 = np.asarray(w, np.float64)
    wb = w64.reshape(*w64.shape[:-1], -1, block)
    amax = np.abs(wb).max(-1, keepdims=True)
    scale = np.ldexp(1.0, oracle.mx_shared_exponent(amax, element, "floor"))
    table = oracle.element_table(element)
    grid = np.unique(np.abs(table[np.isfinite(table)]))
    u = np.abs(wb) / scale
    i = np.clip(np.searchsorted(grid, u, side="right") - 1, 0, len(grid) - 2)
    err = np.where(u >= grid[-1], u - grid[-1], (grid[i + 1] - grid[i]) / 2) * scale
    return err.reshape(w64.shape)


def test_moe_block_against_dense_float_weights():
    """The jitted MoE block on mxfp4 weights vs the float64 block on the original
    float weights. Each weight's error is bounded by the format (checked exactly);
    those bounds propagate through the block as a root-sum-square `sigma` (errors of
    distinct weights independent; silu is 1.1-Lipschitz): every output within
    4 sigma, the whole within 1 sigma in norm (a bound b on a weight's error
    bounds its standard deviation by b/sqrt(3), so the expected norm is ~0.6 sigma)."""
    e, d, f, t, top_k = 8, 64, 96, 6, 2  # the weights of test_moe_block
    router = rand(0, (d, e))
    ws = [rand(i + 1, shape, scale=0.1) for i, shape in enumerate([(e, f, d), (e, f, d),
                                                                  (e, d, f)])]
    qs = [jq.quantize(w, mode="mxfp4") for w in ws]
    x = rand(9, (t, d))
    out = np.asarray(jax.jit(moe_block, static_argnums=5)(x, router, *qs, top_k), np.float64)
    w64 = [np.asarray(w, np.float64) for w in ws]
    b = [mx_rounding_bound(w, "e2m1") for w in ws]
    for w, q, bound in zip(w64, qs, b):
        assert np.all(np.abs(deq64(q) - w) <= bound)
    x64 = np.asarray(x, np.float64)
    logits = np.asarray(x @ router, np.float64)  # the routing is not quantized
    dense, var = np.zeros((t, d)), np.zeros((t, d))
    for i in range(t):
        top = np.argsort(-logits[i])[:top_k]
        p = np.exp(logits[i, top] - logits[i, top].max())
        p /= p.sum()
        for j, ex in enumerate(top):
            g, u = w64[0][ex] @ x64[i], w64[1][ex] @ x64[i]
            s = g / (1 + np.exp(-g))
            dense[i] += p[j] * (w64[2][ex] @ (s * u))
            vg, vu = b[0][ex] ** 2 @ x64[i] ** 2, b[1][ex] ** 2 @ x64[i] ** 2
            va = 1.1 ** 2 * vg * (u ** 2 + vu) + s ** 2 * vu
            var[i] += p[j] ** 2 * (b[2][ex] ** 2 @ (s * u) ** 2 + w64[2][ex] ** 2 @ va)
    sigma = np.sqrt(var)
    err = np.abs(out - dense)
    assert np.all(err <= 4 * sigma), np.max(err / sigma)
    assert np.linalg.norm(err) <= np.linalg.norm(sigma), np.linalg.norm(err) / np.linalg.norm(
        sigma)
    # sigma is far below the outputs: a wrong block would not pass.
    assert np.linalg.norm(sigma) < 0.6 * np.linalg.norm(dense)
