"""ragged_matmul (routed-MoE prefill on float expert weights) on the CPU: the op (reference
backend) against the float64 oracle with random shapes (K and N not powers of two) and
group sizes (empty groups, one group of every row, rows past the groups), the traced
group-size rule and the concrete checks, argument errors naming the argument,
jit/vmap/grad; the Pallas kernel in interpret mode against the oracle and the reference,
over several tile sizes, and its registration.

The GPU tests (marked `gpu`, skipped with the reason where JAX sees no GPU), at gpt-oss-20b
and Qwen3-30B-A3B dimensions: the Pallas kernel, chosen automatically, against a float32
IEEE (precision HIGHEST) product per group and against the reference backend (XLA's
ragged_dot); rows past sum(group_sizes) are zero; empty groups, one group holding every
row, and a flattened [L*E] stack read in place (the decoder's experts_by_layer) give the
same rows as the layer's own experts; the compiled program runs the Triton kernel and
neither transposes nor copies the experts; gpt-oss tiny prefill logits on the GPU equal the
reference backend's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from jaxquant.pallas import configs, moe
from tests.common import assert_matmul_close, skip_without_gpu

DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _run(fn, *args):
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=_FAST_COMPILE)(*args)


def _case(seed, e, n, k, t, dtype, w_dtype=None, spare=0):
    """x [T + spare, K], w [E, N, K], group sizes routing T rows at random (some empty)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((e, n, k), np.float32).astype(w_dtype or dtype)
    x = rng.standard_normal((t + spare, k), np.float32).astype(dtype)
    sizes = np.bincount(rng.integers(0, e, t), minlength=e).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)


def _oracle(x, w, sizes, transpose=True):
    """float64 per-group x @ w[e].T (w rounded to x's dtype first, as the op defines);
    rows past the groups zero. Also returns which rows are live."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(jnp.asarray(w).astype(x.dtype), np.float64)
    w64 = w64 if transpose else np.swapaxes(w64, 1, 2)
    t = x64.shape[0]
    ends = np.minimum(np.cumsum(np.clip(np.asarray(sizes, np.int64), 0, None)), t)
    owner = np.minimum(np.searchsorted(ends, np.arange(t), side="right"), len(ends) - 1)
    live = np.arange(t) < ends[-1]
    return w64[owner], live


def _check_oracle(y, x, w, sizes, transpose=True):
    w_rows, live = _oracle(x, w, sizes, transpose)
    got = np.asarray(y, np.float64)
    assert np.all(got[~live] == 0), "rows past sum(group_sizes) must be zero"
    assert_matmul_close(got[live][:, None, :], np.asarray(x, np.float64)[live][:, None, :],
                        w_rows[live], x.dtype)


# Random shapes (seeded): E, N, K, T, spare rows past the groups.
SHAPES = [(5, 40, 90, 37, 3), (1, 7, 33, 9, 0), (9, 24, 300, 50, 1), (4, 1, 17, 6, 2),
          (16, 65, 128, 4, 0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(shape, dtype):
    i = SHAPES.index(shape)
    e, n, k, t, spare = shape
    x, w, sizes = _case(i, e, n, k, t, dtype, spare=spare)
    y = jax.jit(jq.ragged_matmul)(x, w, sizes)
    assert y.shape == (t + spare, n) and y.dtype == dtype
    _check_oracle(y, x, w, sizes)


def test_float32_weights_with_bfloat16_x_and_transpose_false():
    x, w, sizes = _case(7, 3, 48, 80, 20, jnp.bfloat16, w_dtype=np.float32, spare=2)
    _check_oracle(jax.jit(jq.ragged_matmul)(x, w, sizes), x, w, sizes)
    wt = jnp.swapaxes(w, 1, 2)                                  # [E, K, N]
    y = jax.jit(functools.partial(jq.ragged_matmul, transpose=False))(x, wt, sizes)
    _check_oracle(y, x, wt, sizes, transpose=False)


# Traced group sizes outside the contract: a negative size counts as 0, the groups are
# cut at T rows (as ragged_qmm's, tests/test_ops.py).
RAGGED_RULE = [[5, -1, 4, 2], [-3, 20, 0, 1], [3, 4, 6, 5], [0, 0, 0, 0], [11, 0, 0, 0],
               [2**31 - 1, 2**31 - 1, 0, 0], [0, -(2**31), 7, 9]]


@pytest.mark.parametrize("sizes", RAGGED_RULE, ids=str)
def test_traced_group_sizes_rule_reference_and_pallas(sizes):
    x, w, _ = _case(3, 4, 32, 64, 11, jnp.float32)
    w_rows, live = _oracle(x, w, sizes)
    want = np.where(live[:, None], np.einsum("tk,tnk->tn", np.asarray(x, np.float64), w_rows), 0)
    gs = jnp.asarray(sizes, jnp.int32)
    runs = {"reference": lambda *a: jq.ragged_matmul(*a, backend="reference"),
            "pallas-interpret": functools.partial(moe.ragged_matmul, interpret=True)}
    for name, run in runs.items():
        y = np.asarray(jax.jit(run)(x, w, gs), np.float64)
        assert np.all(y[~live] == 0), name
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_concrete_group_sizes_are_checked():
    x, w, _ = _case(0, 4, 32, 64, 11, jnp.float32)
    for bad in ([5, -1, 4, 2], np.array([0, 0, -1, 0]), jnp.array([3, 4, 6, 5])):
        with pytest.raises(ValueError, match="group_sizes"):
            jq.ragged_matmul(x, w, bad)
    with pytest.raises(ValueError, match=r"group_sizes must sum to at most T=11"):
        jq.ragged_matmul(x, w, [2**31 - 1, 2**31 - 1, 0, 0])
    assert jq.ragged_matmul(x, w, [11, 0, 0, 0]).shape == (11, 32)


def test_bad_arguments_name_the_argument():
    x, w, sizes = _case(0, 4, 32, 64, 11, jnp.float32)
    with pytest.raises(TypeError, match="quantized experts go through jq.ragged_qmm"):
        jq.ragged_matmul(x, jq.quantize(w, mode="mxfp4"), sizes)
    with pytest.raises(TypeError, match="w"):
        jq.ragged_matmul(x, w.astype(jnp.int32), sizes)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        jq.ragged_matmul(x, w[0], sizes)
    with pytest.raises(TypeError, match="x"):
        jq.ragged_matmul(x.astype(jnp.int8), w, sizes)
    with pytest.raises(TypeError, match="group_sizes must be an integer array"):
        jq.ragged_matmul(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"group_sizes must be \[E\] = \(4,\)"):
        jq.ragged_matmul(x, w, sizes[:3])
    with pytest.raises(ValueError, match=r"x must be \[T, K=64\]"):
        jq.ragged_matmul(x[:, :16], w, sizes)
    with pytest.raises(ValueError, match=r"x must be \[T, K=64\]"):
        jq.ragged_matmul(x[None], w, sizes)
    with pytest.raises(TypeError, match="transpose"):
        jq.ragged_matmul(x, w, sizes, transpose="yes")


def test_vmap_over_x_and_sizes_and_grad():
    x, w, sizes = _case(2, 3, 24, 40, 10, jnp.float32)
    xb = jnp.stack([x, 2 * x, -x])
    yb = jax.jit(jax.vmap(jq.ragged_matmul, in_axes=(0, None, None)))(xb, w, sizes)
    for b in range(3):
        np.testing.assert_array_equal(yb[b], jq.ragged_matmul(xb[b], w, sizes))
    sb = jnp.stack([sizes, jnp.asarray([10, 0, 0], jnp.int32)])
    ys = jax.vmap(jq.ragged_matmul, in_axes=(None, None, 0))(x, w, sb)
    np.testing.assert_array_equal(ys[1], jq.ragged_matmul(x, w, sb[1]))
    # the float weights differentiate too: d/dw of sum(y) is each group's column sums of x
    gx, gw = jax.grad(lambda x, w: jq.ragged_matmul(x, w, sizes).sum(), argnums=(0, 1))(x, w)
    ends = np.cumsum(np.asarray(sizes))
    starts = ends - np.asarray(sizes)
    for e in range(3):
        want = np.broadcast_to(np.asarray(x)[starts[e]:ends[e]].sum(0), (24, 40))
        np.testing.assert_allclose(gw[e], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx[:ends[-1]], np.asarray(w).sum(1)[np.repeat(
        np.arange(3), np.asarray(sizes))], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block_m", [16, 32])
def test_pallas_interpret_vs_oracle_and_reference(dtype, block_m):
    """The kernel over several tiles, N blocks and K steps with masked tails (K, N not
    multiples of the blocks), tiles straddling groups, empty groups, spare rows."""
    x, w, _ = _case(5, 6, 40, 90, 0, dtype, spare=70)
    sizes = jnp.asarray([0, 1, 33, 0, 17, 16], jnp.int32)       # 67 rows of 70
    cfg = configs.FloatGemmConfig(block_m=block_m, block_n=16, block_k=32, num_warps=1,
                                  num_stages=1)
    y = _run(functools.partial(moe.ragged_matmul, interpret=True, config=cfg), x, w, sizes)
    _check_oracle(y, x, w, sizes)
    ref = np.asarray(jq.ragged_matmul(x, w, sizes, backend="reference"), np.float64)
    w_rows, live = _oracle(x, w, sizes)
    mag = np.einsum("tk,tnk->tn", np.abs(np.asarray(x, np.float64)), np.abs(w_rows))
    bound = 2 * 90 * 2.0**-24 * mag + 2 * float(jnp.finfo(dtype).eps) * np.abs(ref)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound + 1e-30)


def test_pallas_supports_and_registration():
    sd = jax.ShapeDtypeStruct
    x, w, gs = sd((8, 64), jnp.bfloat16), sd((4, 40, 64), jnp.bfloat16), sd((4,), jnp.int32)
    assert moe.supports_ragged_matmul(x, w, gs, transpose=True)
    assert moe.supports_ragged_matmul(sd((8, 64), jnp.float32), w, gs, transpose=True)
    assert not moe.supports_ragged_matmul(x, w, gs, transpose=False)
    assert not moe.supports_ragged_matmul(sd((8, 64), jnp.float64), w, gs, transpose=True)
    assert not moe.supports_ragged_matmul(x, w, sd((3,), jnp.int32), transpose=True)
    assert not moe.supports_ragged_matmul(sd((8, 32), jnp.bfloat16), w, gs, transpose=True)
    assert not moe.supports_ragged_matmul(sd((0, 64), jnp.bfloat16), w, gs, transpose=True)
    with pytest.raises(ValueError, match="no kernel"):
        moe.ragged_matmul(jnp.ones((2, 64)), jnp.ones((4, 40, 64)), jnp.zeros((3,), int),
                          interpret=True)
    kernels = [k for k in dispatch._KERNELS.get("ragged_matmul", ()) if k.backend == "pallas"]
    assert kernels, "the Pallas ragged_matmul is not registered"


def test_tile_rows_follow_the_mean_rows_per_expert():
    pick = lambda rows, e: configs.select_ragged_float("cuda", rows, e).block_m
    assert pick(128, 32) <= pick(2048, 32) <= pick(8192, 32)
    assert all(c.block_m >= 16 and c.block_n >= 16 and c.block_k >= 16
               for table in configs.RAGGED_FLOAT_CONFIGS.values() for _, c in table)


# ---------------------------------------------------------------------------
# On a GPU: the Pallas kernel at the models' dimensions.

needs_gpu = skip_without_gpu("the ragged_matmul GPU tests (the tests above run the kernel "
                             "in interpret mode)")

# (name, E, N, K, rows, dtype): rows = tokens x top-k, routed at random
GPU_CASES = [
    ("gptoss-gateup-2048", 32, 5760, 2880, 2048, jnp.bfloat16),
    ("gptoss-down-2048", 32, 2880, 2880, 2048, jnp.bfloat16),
    ("gptoss-gateup-100", 32, 5760, 2880, 100, jnp.float16),
    ("gptoss-down-8192", 32, 2880, 2880, 8192, jnp.bfloat16),
    ("qwen3-gateup", 128, 1536, 2048, 1024, jnp.bfloat16),
    ("f32-odd", 7, 1000, 1000, 333, jnp.float32),
]


def _gpu_case(e, n, k, rows, dtype, seed=0, spare=0):
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


GPU_TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["pallas", None], ids=["pallas", "auto"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_kernel_vs_exact_and_reference(case, backend):
    """The Pallas kernel, and the automatic choice (on a Hopper GPU with the CUDA library
    the grouped GEMM of ragged_matmul_wgmma.h for 16-bit x, else Pallas). float32 x at
    precision "highest" (IEEE); at the default precision it is tf32 on the tensor cores,
    like XLA's dot (test_float32_default_precision_is_tf32)."""
    _, e, n, k, rows, dtype = case
    x, w, sizes = _gpu_case(e, n, k, rows, dtype, spare=5)
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
        f = jax.jit(functools.partial(jq.ragged_matmul, backend=backend))
        text = f.lower(x, w, sizes).as_text()
        kernels = ("__gpu$xla.gpu.triton",) if backend == "pallas" else (
            "__gpu$xla.gpu.triton", "jaxquant_ragged_matmul")
        assert any(kernel in text for kernel in kernels), f"not a kernel of {kernels}"
        y = np.asarray(f(x, w, sizes), np.float64)
        ref = np.asarray(jax.jit(lambda *a: jq.ragged_matmul(*a, backend="reference"))(
            x, w, sizes), np.float64)
    want = _exact(x, w, sizes)
    assert np.all(y[rows:] == 0), "rows past sum(group_sizes) must be zero"
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < GPU_TOL[dtype]
    assert np.linalg.norm(y - ref) / np.linalg.norm(want) < GPU_TOL[dtype]


@pytest.mark.gpu
@needs_gpu
def test_float32_default_precision_is_tf32():
    """At the default precision float32 rows multiply in tf32 (10-bit mantissas), as
    XLA's own dot does on this GPU: within tf32's error, not IEEE's."""
    x, w, sizes = _gpu_case(7, 1000, 1000, 333, jnp.float32)
    y = np.asarray(jax.jit(jq.ragged_matmul)(x, w, sizes), np.float64)
    want = _exact(x, w, sizes)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_m", [32, 64, 128])
def test_uneven_groups_every_tile_size(block_m):
    """Empty groups, a group of one row, one group of most rows, groups straddling tiles:
    the same rows whatever the tile (each row is one expert's K-sum in float32)."""
    x, w, _ = _gpu_case(9, 384, 640, 0, jnp.bfloat16, spare=700)
    sizes = jnp.asarray([0, 1, 500, 0, 17, 0, 63, 64, 0], jnp.int32)
    cfg = configs.FloatGemmConfig(block_m=block_m, block_n=128, block_k=64)
    y = np.asarray(jax.jit(lambda *a: moe.ragged_matmul(*a, config=cfg))(x, w, sizes),
                   np.float64)
    want = _exact(x, w, sizes)
    assert np.all(y[645:] == 0)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < GPU_TOL[jnp.bfloat16]
    ref = np.asarray(jax.jit(moe.ragged_matmul)(x, w, sizes), np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=np.abs(want).max() * 2e-2)


@pytest.mark.gpu
@needs_gpu
def test_flattened_stack_in_place_equals_the_layer():
    """Layer 2 of a [4*E, N, K] stack through group sizes that are zero for every other
    layer's experts: the same rows as the layer's own [E, N, K], bit for bit."""
    x, w, sizes = _gpu_case(32, 576, 640, 256, jnp.bfloat16)
    stack = jnp.concatenate([w * 0.5, -w, w, w * 2.0])          # layer 2 is w itself
    full = jnp.zeros(4 * 32, jnp.int32).at[64:96].set(sizes)
    y_stack = jax.jit(jq.ragged_matmul)(x, stack, full)
    y_layer = jax.jit(jq.ragged_matmul)(x, w, sizes)
    cfg = configs.select_ragged_float("cuda", 256, 32)
    y_same_tiles = jax.jit(lambda *a: moe.ragged_matmul(*a, config=cfg))(x, stack, full)
    np.testing.assert_array_equal(np.asarray(y_same_tiles), np.asarray(y_layer))
    want = _exact(x, w, sizes)
    assert np.linalg.norm(np.asarray(y_stack, np.float64) - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_compiled_program_copies_no_expert_weights():
    x, w, sizes = _gpu_case(32, 5760, 2880, 2048, jnp.bfloat16)
    hlo = jax.jit(jq.ragged_matmul).lower(x, w, sizes).compile().as_text()
    assert "transpose(" not in hlo, "an XLA transpose of the experts left in the program"
    assert "f32[32,5760,2880]" not in hlo and "bf16[32,2880,5760]" not in hlo


@pytest.mark.gpu
@needs_gpu
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
