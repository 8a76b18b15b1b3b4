"""ragged_matmul (routed-MoE prefill on float experts) on a real GPU at gpt-oss-20b and
Qwen3-30B-A3B dimensions.

Skipped (with the reason) where JAX sees no GPU. Checks: the Pallas kernel, chosen
automatically, against a float32 IEEE (precision HIGHEST) product per group and against
the reference backend (XLA's ragged_dot); rows past sum(group_sizes) are zero; empty
groups, one group holding every row, and a flattened [L*E] stack read in place (the
decoder's experts_by_layer) give the same rows as the layer's own experts; the compiled
program runs the Triton kernel and neither transposes nor copies the experts; gpt-oss
tiny prefill logits on the GPU equal the reference backend's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.pallas import configs, moe
from tests.common import skip_module_without_gpu

skip_module_without_gpu("the ragged_matmul GPU tests "
                        "(tests/test_ragged_matmul.py runs the kernel in interpret mode)")

pytestmark = pytest.mark.gpu

# (name, E, N, K, rows, dtype): rows = tokens x top-k, routed at random
CASES = [
    ("gptoss-gateup-2048", 32, 5760, 2880, 2048, jnp.bfloat16),
    ("gptoss-down-2048", 32, 2880, 2880, 2048, jnp.bfloat16),
    ("gptoss-gateup-100", 32, 5760, 2880, 100, jnp.float16),
    ("gptoss-down-8192", 32, 2880, 2880, 8192, jnp.bfloat16),
    ("qwen3-gateup", 128, 1536, 2048, 1024, jnp.bfloat16),
    ("f32-odd", 7, 1000, 1000, 333, jnp.float32),
]


def _case(e, n, k, rows, dtype, seed=0, spare=0):
    kw, kx, ki = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = (0.05 * jax.random.normal(kw, (e, n, k), jnp.float32)).astype(dtype)
    x = jax.random.normal(kx, (rows + spare, k), jnp.float32).astype(dtype)
    ids = jax.random.randint(ki, (rows,), 0, e, jnp.int32)
    return x, w, jnp.bincount(ids, length=e).astype(jnp.int32)


def _exact(x, w, group_sizes):
    """float32 IEEE (precision HIGHEST) per-group products, rows past the groups zero."""
    x, w, sizes = np.asarray(x, np.float32), np.asarray(w, np.float32), np.asarray(group_sizes)
    out, row = np.zeros((x.shape[0], w.shape[1]), np.float64), 0
    for e, size in enumerate(sizes):
        out[row:row + size] = x[row:row + size].astype(np.float64) @ w[e].T.astype(np.float64)
        row += size
    return out


TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_kernel_vs_exact_and_reference(case):
    """float32 x at precision "highest" (IEEE); at the default precision it is tf32 on
    the tensor cores, like XLA's dot (test_float32_default_precision_is_tf32)."""
    _, e, n, k, rows, dtype = case
    x, w, sizes = _case(e, n, k, rows, dtype, spare=5)
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
        f = jax.jit(jq.ragged_matmul)
        assert "__gpu$xla.gpu.triton" in f.lower(x, w, sizes).as_text(), "not the Pallas kernel"
        y = np.asarray(f(x, w, sizes), np.float64)
        ref = np.asarray(jax.jit(lambda *a: jq.ragged_matmul(*a, backend="reference"))(
            x, w, sizes), np.float64)
    want = _exact(x, w, sizes)
    assert np.all(y[rows:] == 0), "rows past sum(group_sizes) must be zero"
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < TOL[dtype]
    assert np.linalg.norm(y - ref) / np.linalg.norm(want) < TOL[dtype]


def test_float32_default_precision_is_tf32():
    """At the default precision float32 rows multiply in tf32 (10-bit mantissas), as
    XLA's own dot does on this GPU: within tf32's error, not IEEE's."""
    x, w, sizes = _case(7, 1000, 1000, 333, jnp.float32)
    y = np.asarray(jax.jit(jq.ragged_matmul)(x, w, sizes), np.float64)
    want = _exact(x, w, sizes)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("block_m", [32, 64, 128])
def test_uneven_groups_every_tile_size(block_m):
    """Empty groups, a group of one row, one group of most rows, groups straddling tiles:
    the same rows whatever the tile (each row is one expert's K-sum in float32)."""
    x, w, _ = _case(9, 384, 640, 0, jnp.bfloat16, spare=700)
    sizes = jnp.asarray([0, 1, 500, 0, 17, 0, 63, 64, 0], jnp.int32)
    cfg = configs.FloatGemmConfig(block_m=block_m, block_n=128, block_k=64)
    y = np.asarray(jax.jit(lambda *a: moe.ragged_matmul(*a, config=cfg))(x, w, sizes),
                   np.float64)
    want = _exact(x, w, sizes)
    assert np.all(y[645:] == 0)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < TOL[jnp.bfloat16]
    ref = np.asarray(jax.jit(moe.ragged_matmul)(x, w, sizes), np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=np.abs(want).max() * 2e-2)


def test_flattened_stack_in_place_equals_the_layer():
    """Layer 2 of a [4*E, N, K] stack through group sizes that are zero for every other
    layer's experts: the same rows as the layer's own [E, N, K], bit for bit."""
    x, w, sizes = _case(32, 576, 640, 256, jnp.bfloat16)
    stack = jnp.concatenate([w * 0.5, -w, w, w * 2.0])          # layer 2 is w itself
    full = jnp.zeros(4 * 32, jnp.int32).at[64:96].set(sizes)
    y_stack = jax.jit(jq.ragged_matmul)(x, stack, full)
    y_layer = jax.jit(jq.ragged_matmul)(x, w, sizes)
    cfg = configs.select_ragged_float("cuda", 256, 32)
    y_same_tiles = jax.jit(lambda *a: moe.ragged_matmul(*a, config=cfg))(x, stack, full)
    np.testing.assert_array_equal(np.asarray(y_same_tiles), np.asarray(y_layer))
    want = _exact(x, w, sizes)
    assert np.linalg.norm(np.asarray(y_stack, np.float64) - want) / np.linalg.norm(want) < 1e-2


def test_compiled_program_copies_no_expert_weights():
    x, w, sizes = _case(32, 5760, 2880, 2048, jnp.bfloat16)
    hlo = jax.jit(jq.ragged_matmul).lower(x, w, sizes).compile().as_text()
    assert "transpose(" not in hlo, "an XLA transpose of the experts left in the program"
    assert "f32[32,5760,2880]" not in hlo and "bf16[32,2880,5760]" not in hlo


def test_gpt_oss_prefill_logits_vs_reference_backend():
    from jaxquant import models
    from tests.test_models import tiny

    cfg = tiny("gpt_oss", dtype="bfloat16")
    params = models.init_params(cfg, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)

    def run(backend):
        with jq.backend(backend):
            logits, _, _ = jax.jit(models.prefill, static_argnums=(0, 3))(cfg, params,
                                                                         prompt, 48)
        return np.asarray(logits, np.float64)

    got, want = run(None), run("reference")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
