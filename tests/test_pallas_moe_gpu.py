"""Pallas gather_qmm (routed MoE decode) on a real GPU with realistic shapes.

Skipped (with the reason) where JAX sees no GPU. Checks: the float64 product of
the selected experts' `dequantize_reference`, docs/ops.md's invariant
gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]]) bit for bit on the
pallas backend, NaN rows for ids -1 and E, the backward pass (transpose=False
kernel) and a jitted top-k MoE layer against the reference backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.pallas import moe
from jaxquant.quantize import dequantize_reference
from tests.common import skip_module_without_gpu

skip_module_without_gpu("the Pallas MoE GPU tests "
                        "(tests/test_pallas_moe.py runs the kernels in interpret mode)")

pytestmark = pytest.mark.gpu

TOL = {jnp.float32: 2e-3, jnp.float16: 4e-3, jnp.bfloat16: 1.5e-2}
# (name, E, top_k, K, N, T, mode kwargs, dtype)
CASES = [
    ("gptoss-decode1", 32, 4, 2880, 5760, 1, dict(mode="mxfp4"), jnp.bfloat16),
    ("gptoss-decode8", 32, 4, 2880, 5760, 8, dict(mode="mxfp4"), jnp.bfloat16),
    ("qwen3-gateup", 128, 8, 2048, 1536, 8, dict(mode="affine", bits=4, group_size=64),
     jnp.bfloat16),
    ("qwen3-down", 128, 8, 768, 2048, 4, dict(mode="nvfp4"), jnp.float16),
    ("mxfp6-f32", 16, 2, 1024, 1000, 3, dict(mode="mxfp6_e3m2"), jnp.float32),
]


def _case(e, top_k, k, n, t, qkw, dtype, seed=0, per_slot=False):
    kw, kx, ki = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(kw, (e, n, k), jnp.float32).astype(dtype)
    qw = jq.quantize(w, **qkw, layout="canonical")  # the Pallas kernels' layout
    x = jax.random.normal(kx, (t, top_k, k) if per_slot else (t, k), jnp.float32).astype(dtype)
    idx = jax.random.randint(ki, (t, top_k), 0, e, jnp.int32)
    return x, qw, idx


@jax.jit
def _exact(x, qw, idx):
    """float32 product with IEEE float32 dots (precision HIGHEST) of the selected experts'
    dequantize_reference: within ~1e-6 of the float64 product, far below the tolerances."""
    flat = idx.reshape(-1)
    w = dequantize_reference(qw[flat], jnp.float32)                     # [T*k, N, K]
    xs = x.astype(jnp.float32)
    xs = xs.reshape(flat.shape[0], -1) if x.ndim == 3 else jnp.repeat(xs, idx.shape[1], 0)
    y = jnp.einsum("sk,snk->sn", xs, w, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*idx.shape, -1)


def _oracle(x, qw, idx):
    return np.asarray(_exact(x, qw, idx), np.float64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_gather_vs_oracle_and_qmm_bitwise(case):
    name, e, top_k, k, n, t, qkw, dtype = case
    per_slot = name.endswith("down")
    x, qw, idx = _case(e, top_k, k, n, t, qkw, dtype, per_slot=per_slot)
    y = jax.jit(lambda x, qw, i: jq.gather_qmm(x, qw, i, backend="pallas"))(x, qw, idx)
    assert y.dtype == x.dtype and y.shape == (t, top_k, n)
    want = _oracle(x, qw, idx)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
    # docs/ops.md: bit for bit the pallas qmm of the selected expert.
    ids = np.asarray(idx)
    one = jax.jit(lambda xv, q: jq.qmm(xv, q, backend="pallas"))
    for ti in range(t):
        for j in range(top_k):
            xv = x[ti, j] if per_slot else x[ti]
            np.testing.assert_array_equal(np.asarray(y[ti, j]),
                                          np.asarray(one(xv, qw[int(ids[ti, j])])))


def test_bad_ids_are_nan_rows():
    x, qw, _ = _case(32, 4, 2880, 5760, 2, dict(mode="mxfp4"), jnp.bfloat16)
    idx = jnp.asarray([[-1, 3, 32, 31], [0, 2**31 - 1, -2**31, 5]], jnp.int32)
    y = np.asarray(jax.jit(lambda x, qw, i: moe.gather_qmm(x, qw, i))(x, qw, idx)
                   .astype(jnp.float32))
    bad = ~((np.asarray(idx) >= 0) & (np.asarray(idx) < 32))
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


def test_grad_vmap_and_transpose_false():
    x, qw, idx = _case(32, 4, 2048, 768, 4, dict(mode="mxfp4"), jnp.float32)
    f = lambda b: lambda x: jq.gather_qmm(x, qw, idx, backend=b).sum()
    g = jax.jit(jax.grad(f("pallas")))(x)
    g_ref = jax.jit(jax.grad(f("reference")))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=2e-3, atol=2e-3)
    xs = jnp.stack([x, -x])
    y = jax.jit(jax.vmap(lambda x: jq.gather_qmm(x, qw, idx, backend="pallas")))(xs)
    y0 = jax.jit(lambda x: jq.gather_qmm(x, qw, idx, backend="pallas"))(x)
    np.testing.assert_array_equal(np.asarray(y[0]), np.asarray(y0))


def test_moe_layer_pallas_vs_reference():
    e, d, f, t, top_k = 32, 2880, 5760, 8, 4
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    router = jax.random.normal(ks[0], (d, e), jnp.float32).astype(jnp.bfloat16) * 0.02
    canonical = dict(mode="mxfp4", layout="canonical")  # the Pallas kernels' layout
    qg, qu = (jq.quantize(jax.random.normal(k, (e, f, d), jnp.bfloat16) * 0.02, **canonical)
              for k in ks[1:3])
    qd = jq.quantize(jax.random.normal(ks[3], (e, d, f), jnp.bfloat16) * 0.02, **canonical)
    x = jax.random.normal(ks[4], (t, d), jnp.bfloat16)

    def layer(x, router, qg, qu, qd, backend):
        w, idx = jax.lax.top_k((x @ router).astype(jnp.float32), top_k)
        w = jax.nn.softmax(w, axis=-1).astype(x.dtype)
        a = (jax.nn.silu(jq.gather_qmm(x, qg, idx, backend=backend))
             * jq.gather_qmm(x, qu, idx, backend=backend))
        return jnp.einsum("tk,tkn->tn", w, jq.gather_qmm(a, qd, idx, backend=backend))

    run = jax.jit(layer, static_argnums=5)
    y = np.asarray(run(x, router, qg, qu, qd, "pallas").astype(jnp.float32))
    r = np.asarray(run(x, router, qg, qu, qd, "reference").astype(jnp.float32))
    assert np.linalg.norm(y - r) / np.linalg.norm(r) < 2e-2


# ---------------------------------------------------------------------------
# ragged_qmm (prefill): rows sorted by expert, group sizes on the device.

RAGGED = [("gptoss-prefill", 32, 2880, 5760, 4096, dict(mode="mxfp4"), jnp.bfloat16),  # big tiles
          ("qwen3-prefill", 128, 2048, 768, 4096, dict(mode="affine", bits=4, group_size=64),
           jnp.bfloat16),
          ("nvfp4-f32", 8, 1024, 1000, 300, dict(mode="nvfp4"), jnp.float32)]


@jax.jit
def _ragged_exact(x, qw, sizes):
    w = jnp.swapaxes(dequantize_reference(qw, jnp.float32), 1, 2)
    return jax.lax.ragged_dot(x.astype(jnp.float32), w, sizes,
                              precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("case", RAGGED, ids=lambda c: c[0])
def test_ragged_vs_exact(case):
    name, e, k, n, rows, qkw, dtype = case
    kw, kx, ks = jax.random.split(jax.random.PRNGKey(2), 3)
    qw = jq.quantize(jax.random.normal(kw, (e, n, k), jnp.float32).astype(dtype), **qkw,
                     layout="canonical")
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)
    # Uneven groups, some empty, the last rows in no group (they must come out zero).
    p = jax.random.dirichlet(ks, jnp.full((e,), 0.3))
    sizes = np.floor(np.asarray(p) * (rows - 37)).astype(np.int32)
    sizes[1] = 0
    sizes = jnp.asarray(sizes)
    y = jax.jit(lambda x, qw, g: jq.ragged_qmm(x, qw, g, backend="pallas"))(x, qw, sizes)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    want = np.asarray(_ragged_exact(x, qw, sizes), np.float64)
    total = int(np.sum(np.asarray(sizes)))
    assert np.all(got[total:] == 0) and np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
