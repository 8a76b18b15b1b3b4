"""gather_matmul (routed-MoE decode on float experts) on a real GPU at gpt-oss-20b and
Qwen3-30B-A3B dimensions.

Skipped (with the reason) where JAX sees no GPU. Checks: the Pallas kernel, chosen
automatically, against a float32 IEEE (precision HIGHEST) product of the selected
experts, and against the reference backend (XLA's gather + dot); NaN rows for ids -1 and
E; the compiled program runs the Triton kernel and gathers no expert weights; gpt-oss
tiny decode logits on the GPU equal the reference backend's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from tests.common import skip_module_without_gpu

skip_module_without_gpu("the gather_matmul GPU tests "
                        "(tests/test_gather_matmul.py runs the kernel in interpret mode)")

pytestmark = pytest.mark.gpu

# (name, E, top_k, N, K, T, dtype, x per slot)
CASES = [
    ("gptoss-gateup-T1", 32, 4, 5760, 2880, 1, jnp.bfloat16, False),
    ("gptoss-gateup-T8", 32, 4, 5760, 2880, 8, jnp.bfloat16, False),
    ("gptoss-down-T1", 32, 4, 2880, 2880, 1, jnp.bfloat16, True),
    ("gptoss-down-T8", 32, 4, 2880, 2880, 8, jnp.float16, True),
    ("qwen3-gateup", 128, 8, 1536, 2048, 4, jnp.bfloat16, False),
    ("qwen3-down", 128, 8, 2048, 768, 4, jnp.bfloat16, True),
    ("f32-odd", 16, 2, 1000, 1000, 3, jnp.float32, False),
]


def _case(e, top_k, n, k, t, dtype, per_slot, seed=0):
    kw, kx, ki = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = (0.05 * jax.random.normal(kw, (e, n, k), jnp.float32)).astype(dtype)
    x = jax.random.normal(kx, (t, top_k, k) if per_slot else (t, k), jnp.float32).astype(dtype)
    idx = jax.random.randint(ki, (t, top_k), 0, e, jnp.int32)
    return x, w, idx


@jax.jit
def _exact(x, w, idx):
    """float32 IEEE product (precision HIGHEST) of the selected experts: within ~1e-6
    of the float64 product, far below the tolerances."""
    xs = x.astype(jnp.float32)
    xs = xs if x.ndim == 3 else jnp.broadcast_to(xs[:, None], idx.shape + xs.shape[-1:])
    return jnp.einsum("tjk,tjnk->tjn", xs, w[idx].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_kernel_vs_exact_and_reference(case):
    _, e, top_k, n, k, t, dtype, per_slot = case
    x, w, idx = _case(e, top_k, n, k, t, dtype, per_slot)
    f = jax.jit(jq.gather_matmul)
    assert "__gpu$xla.gpu.triton" in f.lower(x, w, idx).as_text(), "not the Pallas kernel"
    y = np.asarray(f(x, w, idx), np.float64)
    want = np.asarray(_exact(x, w, idx), np.float64)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < TOL[dtype]
    ref = np.asarray(jax.jit(lambda *a: jq.gather_matmul(*a, backend="reference"))(x, w, idx),
                     np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(want) < TOL[dtype]


def test_bad_ids_are_nan_rows():
    x, w, _ = _case(32, 4, 2880, 2880, 2, jnp.bfloat16, False)
    idx = jnp.asarray([[-1, 3, 32, 0], [5, 2**31 - 1, 31, -2**31]], jnp.int32)
    y = np.asarray(jax.jit(jq.gather_matmul)(x, w, idx), np.float32)
    bad = np.asarray([[1, 0, 1, 0], [0, 1, 0, 1]], bool)
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


def test_compiled_program_gathers_no_expert_weights():
    x, w, idx = _case(32, 4, 5760, 2880, 1, jnp.bfloat16, False)
    hlo = jax.jit(jq.gather_matmul).lower(x, w, idx).compile().as_text()
    assert "gather(" not in hlo.replace("all-gather(", ""), "an XLA gather left in the program"


def test_gpt_oss_decode_logits_vs_reference_backend():
    from jaxquant import models
    from tests.test_models import tiny

    cfg = tiny("gpt_oss", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)

    def run(backend):
        with jq.backend(backend):
            _, cache, tok = jax.jit(models.prefill, static_argnums=(0, 3))(cfg, params,
                                                                         prompt, 16)
            _, last, _ = jax.jit(models.decode, static_argnums=(0, 5))(cfg, params, cache,
                                                                       tok, 9, 3)
        return np.asarray(last, np.float64)

    got, want = run(None), run("reference")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("shape", [(5120, 2880), (6144, 4096)], ids=lambda s: f"{s[1]}to{s[0]}")
def test_decoder_linear_at_decode_takes_the_float_gemv(shape):
    """models.layers.linear on a float matrix at one row per sequence (decode) runs the
    Pallas float GEMV (pallas.configs.FLOAT_GEMV_OVER_XLA) and gives the float32 product, bias added."""
    from jaxquant.models import layers

    n, k = shape
    w = (0.05 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 1, k), jnp.float32).astype(jnp.bfloat16)
    bias = jnp.linspace(-1, 1, n, dtype=jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(layers.linear)
    assert layers.float_gemv_applies(x, w)
    assert "__gpu$xla.gpu.triton" in f.lower(x, w, bias).as_text(), "not the Pallas kernel"
    y = np.asarray(f(x, w, bias), np.float64)
    want = np.asarray(jnp.einsum("btk,nk->btn", x.astype(jnp.float32), w.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST), np.float64)
    want = want + np.asarray(bias, np.float64)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
