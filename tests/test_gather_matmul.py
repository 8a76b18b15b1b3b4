"""gather_matmul (routed-MoE decode on float expert weights) on the CPU: the op (reference
backend) against the float64 oracle and against the XLA gather + einsum it replaces, with
random shapes (K and N not powers of two), NaN rows for bad indices, argument errors naming
the argument, jit/vmap/grad; the Pallas kernel in interpret mode against the reference
(tight bound), its bad-id rows read in bounds, its block choice and its registration.

The GPU tests (marked `gpu`, skipped with the reason where JAX sees no GPU), at gpt-oss-20b
and Qwen3-30B-A3B dimensions: the Pallas kernel, chosen automatically, against a float32
IEEE (precision HIGHEST) product of the selected experts, and against the reference backend
(XLA's gather + dot); NaN rows for ids -1 and E; the compiled program runs the Triton kernel
and gathers no expert weights; gpt-oss tiny decode logits on the GPU equal the reference
backend's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.pallas import configs, moe
from tests.common import assert_matmul_close, skip_without_gpu

DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _run(fn, *args):
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=_FAST_COMPILE)(*args)


def _case(seed, e, n, k, t, slots, dtype, per_slot=False, w_dtype=None, bad=False):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((e, n, k), np.float32).astype(w_dtype or dtype)
    x = rng.standard_normal((t, slots, k) if per_slot else (t, k), np.float32).astype(dtype)
    idx = rng.integers(-1 if bad else 0, e + 1 if bad else e, (t, slots)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx)


def _xla_gather_einsum(x, w, idx):
    """What models.moe.expert_gather did before gather_matmul: gather, then einsum."""
    ws = w[idx].astype(x.dtype)
    eq = "tk,tsnk->tsn" if x.ndim == 2 else "tsk,tsnk->tsn"
    return jnp.einsum(eq, x, ws, preferred_element_type=jnp.float32).astype(x.dtype)


def _check_oracle(y, x, w, idx):
    """y [T, k, N] against float64 x @ w[idx].T per element (w rounded to x's dtype first,
    as the op defines), NaN exactly on the rows of ids outside [0, E)."""
    idx = np.asarray(idx)
    valid = (idx >= 0) & (idx < w.shape[0])
    got = np.asarray(y, np.float64)
    assert np.all(np.isnan(got[~valid])) and np.all(np.isfinite(got[valid]))
    w64 = np.asarray(w.astype(x.dtype), np.float64)[np.where(valid, idx, 0)]   # [T, k, N, K]
    x64 = np.asarray(x, np.float64)
    xs = np.broadcast_to(x64[:, None] if x64.ndim == 2 else x64, idx.shape + x64.shape[-1:])
    assert_matmul_close(got[valid][:, None, :], xs[valid][:, None, :], w64[valid], x.dtype)


def _assert_same_sums(y, other, x, w, idx):
    """y and `other` are the same products summed in other float32 orders: per element
    within float32's error bound over K of the magnitudes (|x| @ |w|.T), plus one
    rounding to x's dtype; NaN in the same places."""
    got, want = np.asarray(y, np.float64), np.asarray(other, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    idx = np.clip(np.asarray(idx), 0, w.shape[0] - 1)
    x64, w64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))[idx]
    mag = np.einsum("tk,tsnk->tsn" if x.ndim == 2 else "tsk,tsnk->tsn", x64, w64)
    bound = 2 * x.shape[-1] * 2.0**-24 * mag + float(jnp.finfo(x.dtype).eps) * np.abs(want)
    ok = np.isnan(want) | (np.abs(got - want) <= bound)
    assert np.all(ok), np.nanmax(np.abs(got - want) / bound)


# Random shapes (seeded): N and K not powers of two, one expert, one slot, one token.
SHAPES = [(5, 40, 90, 3, 2), (1, 7, 33, 1, 1), (9, 24, 300, 4, 3), (4, 1, 17, 2, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle_and_the_gather_einsum(shape, dtype):
    i = SHAPES.index(shape)
    x, w, idx = _case(i, *shape, dtype, per_slot=i % 2 == 1)
    y = jax.jit(jq.gather_matmul)(x, w, idx)
    assert y.shape == idx.shape + (shape[1],) and y.dtype == dtype
    _check_oracle(y, x, w, idx)
    _assert_same_sums(y, jax.jit(_xla_gather_einsum)(x, w, idx), x, w, idx)


def test_weights_in_another_dtype_are_cast_to_x_first():
    x, w, idx = _case(10, 3, 20, 48, 2, 2, jnp.bfloat16, w_dtype=np.float32)
    y = jax.jit(jq.gather_matmul)(x, w, idx)
    np.testing.assert_array_equal(y, jax.jit(jq.gather_matmul)(x, w.astype(jnp.bfloat16), idx))
    _check_oracle(y, x, w, idx)


def test_transpose_false():
    x, w, idx = _case(11, 4, 24, 40, 3, 2, jnp.float32)
    wt = jnp.swapaxes(w, 1, 2)                                   # [E, K, N]
    y = jax.jit(functools.partial(jq.gather_matmul, transpose=False))(x, wt, idx)
    _check_oracle(y, x, w, idx)


def test_bad_indices_give_nan_rows():
    e = 3
    x, w, _ = _case(12, e, 16, 32, 3, 2, jnp.float32)
    idx = jnp.array([[0, -1], [3, 2], [2**31 - 1, -2**31]], jnp.int32)
    y = jax.jit(jq.gather_matmul)(x, w, idx)
    _check_oracle(y, x, w, idx)
    # any integer dtype: a uint8 255 is a bad id, not expert 255 % E
    y8 = jax.jit(jq.gather_matmul)(x, w, jnp.array([[0, 255], [2, 1], [1, 0]], jnp.uint8))
    assert np.all(np.isnan(np.asarray(y8)[0, 1])) and np.all(np.isfinite(np.asarray(y8)[1:]))


def test_vmap_jit_and_grad():
    x, w, _ = _case(13, 4, 16, 32, 3, 2, jnp.float32)
    xb = jnp.stack([x, 2 * x])
    idx = jnp.array([[[0, 1], [2, 3], [1, 1]], [[3, 3], [0, 2], [2, 0]]])
    y = jax.jit(jax.vmap(jq.gather_matmul, in_axes=(0, None, 0)))(xb, w, idx)
    for b in range(2):
        np.testing.assert_array_equal(y[b], jq.gather_matmul(xb[b], w, idx[b]))
    # a batch of weights (off the kernels: vmap of the reference)
    wb = jnp.stack([w, -w])
    yw = jax.vmap(jq.gather_matmul, in_axes=(None, 0, None))(x, wb, idx[0])
    np.testing.assert_allclose(yw[1], jq.gather_matmul(x, -w, idx[0]), rtol=1e-5, atol=1e-5)
    # gradients with respect to x and w: those of the gather + einsum
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w, idx[0]) ** 2))
    got = jax.grad(loss(jq.gather_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(_xla_gather_einsum), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_argument():
    x, w, idx = _case(14, 4, 16, 32, 3, 2, jnp.float32)
    qw = jq.quantize(w, mode="mxfp4")
    with pytest.raises(TypeError, match="w must be a float array.*gather_qmm"):
        jq.gather_matmul(x, qw, idx)
    with pytest.raises(TypeError, match="qw must be a jaxquant.QuantizedArray.*gather_matmul"):
        jq.gather_qmm(x, w, idx)
    with pytest.raises(TypeError, match="w must be float"):
        jq.gather_matmul(x, w.astype(jnp.int32), idx)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        jq.gather_matmul(x, w[0], idx)
    with pytest.raises(TypeError, match="x must be float"):
        jq.gather_matmul(x.astype(jnp.int8), w, idx)
    with pytest.raises(TypeError, match="indices must be an integer array"):
        jq.gather_matmul(x, w, idx.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"indices must be \[T, k\]"):
        jq.gather_matmul(x, w, idx[0])
    with pytest.raises(ValueError, match="x must be"):
        jq.gather_matmul(x[:, :16], w, idx)
    with pytest.raises(ValueError, match="x must be"):
        jq.gather_matmul(x[:2], w, idx)
    with pytest.raises(TypeError, match="transpose"):
        jq.gather_matmul(x, w, idx, transpose="yes")


# ---------------------------------------------------------------------------
# The Pallas kernel, interpret mode (interpret configs: 16-row blocks, 32-element K steps,
# so the shapes below have masked row blocks and masked K tails).

KERNEL_SHAPES = [(5, 40, 90, 3, 2), (3, 33, 100, 2, 3), (32, 48, 2880 // 16, 1, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pallas_kernel_matches_reference(shape, dtype):
    i = KERNEL_SHAPES.index(shape)
    x, w, idx = _case(20 + i, *shape, dtype, per_slot=i == 1, bad=i == 0)
    y = _run(functools.partial(moe.gather_matmul, interpret=True), x, w, idx)
    assert y.shape == idx.shape + (shape[1],) and y.dtype == dtype
    _check_oracle(y, x, w, idx)
    _assert_same_sums(y, jax.jit(jq.gather_matmul)(x, w, idx), x, w, idx)


def test_pallas_bad_ids_read_expert_zero_in_bounds():
    """The kernel addresses expert e's rows as e*N + n in an [E*N, K] view: a bad id
    read unguarded would shift row blocks past row 0 (interpret mode clamps or pads an
    out-of-range window). Its raw rows must equal expert 0's, bit for bit."""
    x, w, _ = _case(30, 4, 40, 70, 3, 2, jnp.float32)
    idx = jnp.array([[-1, 2], [4, 0], [13, -2**31]], jnp.int32)
    y = np.asarray(_run(functools.partial(moe.gather_matmul, interpret=True), x, w, idx))
    _check_oracle(y, x, w, idx)
    cfg = configs.select_float_gemv("interpret", 40, 6)
    raw = _run(lambda x, w, ids: moe.gather_gemv_float(x, w, ids, cfg, interpret=True,
                                                        x_div=2), x, w, moe._slot_ids(idx, 4))
    zero = _run(lambda x, w, ids: moe.gather_gemv_float(x, w, ids, cfg, interpret=True,
                                                         x_div=2), x, w, jnp.zeros(6, jnp.int32))
    bad = ~((np.asarray(idx) >= 0) & (np.asarray(idx) < 4)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(raw)[bad], np.asarray(zero)[bad])


def test_pallas_other_blocks_and_any_config():
    x, w, idx = _case(31, 3, 50, 130, 2, 2, jnp.bfloat16)
    ref = jax.jit(jq.gather_matmul)(x, w, idx)
    for cfg in (configs.FloatGemvConfig(block_n=8, block_k=16),
                configs.FloatGemvConfig(block_n=64, block_k=256)):   # blocks past N and K
        y = _run(functools.partial(moe.gather_matmul, interpret=True, config=cfg), x, w, idx)
        _assert_same_sums(y, ref, x, w, idx)


def test_float_gemv_block_choice():
    pick = lambda n, slots: configs.select_float_gemv("rocm", n, slots).block_n
    base = configs.FLOAT_GEMV_CONFIGS["rocm"]        # 32 rows, >= 608 programs (MI300X)
    assert pick(5760, 4) == base.block_n           # gpt-oss gate_up, T=1: 720 programs
    assert pick(2880, 4) == base.block_n // 2      # down: halved until >= 2 per MI300X CU
    assert pick(100, 1) == configs.FLOAT_GEMV_MIN_BLOCK_N   # never below the minimum
    assert pick(2880, 32) == base.block_n          # T=8: enough programs already
    # cuda: the H100 sweep's block (8 rows) at every shape
    assert {configs.select_float_gemv("cuda", n, s).block_n
            for n, s in ((5760, 4), (2880, 4), (100, 1), (2880, 32))} == {8}


def test_supports_and_registration():
    sd = jax.ShapeDtypeStruct
    x, w, idx = sd((2, 64), jnp.bfloat16), sd((4, 40, 64), jnp.bfloat16), sd((2, 3), jnp.int32)
    assert moe.supports_gather_matmul(x, w, idx, transpose=True)
    assert moe.supports_gather_matmul(sd((2, 3, 64), jnp.float32), w, idx, transpose=True)
    assert not moe.supports_gather_matmul(x, w, idx, transpose=False)
    assert not moe.supports_gather_matmul(sd((2, 64), jnp.float64), w, idx, transpose=True)
    assert not moe.supports_gather_matmul(x, sd((40, 64), jnp.bfloat16), idx, transpose=True)
    assert not moe.supports_gather_matmul(sd((2, 32), jnp.bfloat16), w, idx, transpose=True)
    # slots run on the first grid axis (no 65535 limit); N blocks on the second
    assert moe.supports_gather_matmul(sd((70000, 64), jnp.bfloat16), w,
                                      sd((70000, 1), jnp.int32), transpose=True)
    assert not moe.supports_gather_matmul(x, sd((1, 65536 * 8, 64), jnp.bfloat16), idx,
                                          transpose=True)
    with pytest.raises(ValueError, match="no kernel"):
        moe.gather_matmul(jnp.ones((2, 64)), jnp.ones((4, 40, 64)), jnp.zeros((2, 3), int),
                          transpose=False)
    from jaxquant import dispatch
    kernels = [k for k in dispatch._KERNELS.get("gather_matmul", ()) if k.backend == "pallas"]
    assert sorted(p for k in kernels for p in k.platforms) == ["cuda", "rocm"]
    assert all(k.auto is None for k in kernels)    # automatic wherever it applies


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_gpu_lowering_runs_the_kernel_without_a_weight_gather(platform):
    """jq.gather_matmul lowered for a GPU (on this CPU machine): one Triton kernel, and no
    XLA gather of the experts' weights."""
    from tests import pallas_compile as cc
    sd = jax.ShapeDtypeStruct
    args = sd((1, 2880), jnp.bfloat16), sd((32, 5760, 2880), jnp.bfloat16), sd((1, 4), jnp.int32)
    text = jax.jit(jq.gather_matmul).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()
    assert "stablehlo.gather" not in text and "dot_general" not in text
    kernels = cc.triton_kernels(jq.gather_matmul, *args, platform=platform)
    assert [k.name for k in kernels] == ["jq_gather_matmul_bfloat16"]


# ---------------------------------------------------------------------------
# On a GPU: the Pallas kernel at the models' dimensions.

needs_gpu = skip_without_gpu("the gather_matmul GPU tests (the tests above run the kernel "
                             "in interpret mode)")

# (name, E, top_k, N, K, T, dtype, x per slot)
GPU_CASES = [
    ("gptoss-gateup-T1", 32, 4, 5760, 2880, 1, jnp.bfloat16, False),
    ("gptoss-gateup-T8", 32, 4, 5760, 2880, 8, jnp.bfloat16, False),
    ("gptoss-down-T1", 32, 4, 2880, 2880, 1, jnp.bfloat16, True),
    ("gptoss-down-T8", 32, 4, 2880, 2880, 8, jnp.float16, True),
    ("qwen3-gateup", 128, 8, 1536, 2048, 4, jnp.bfloat16, False),
    ("qwen3-down", 128, 8, 2048, 768, 4, jnp.bfloat16, True),
    ("f32-odd", 16, 2, 1000, 1000, 3, jnp.float32, False),
]


def _gpu_case(e, top_k, n, k, t, dtype, per_slot, seed=0):
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


GPU_TOL = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_kernel_vs_exact_and_reference(case):
    _, e, top_k, n, k, t, dtype, per_slot = case
    x, w, idx = _gpu_case(e, top_k, n, k, t, dtype, per_slot)
    f = jax.jit(jq.gather_matmul)
    assert "__gpu$xla.gpu.triton" in f.lower(x, w, idx).as_text(), "not the Pallas kernel"
    y = np.asarray(f(x, w, idx), np.float64)
    want = np.asarray(_exact(x, w, idx), np.float64)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < GPU_TOL[dtype]
    ref = np.asarray(jax.jit(lambda *a: jq.gather_matmul(*a, backend="reference"))(x, w, idx),
                     np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(want) < GPU_TOL[dtype]


@pytest.mark.gpu
@needs_gpu
def test_bad_ids_are_nan_rows():
    x, w, _ = _gpu_case(32, 4, 2880, 2880, 2, jnp.bfloat16, False)
    idx = jnp.asarray([[-1, 3, 32, 0], [5, 2**31 - 1, 31, -2**31]], jnp.int32)
    y = np.asarray(jax.jit(jq.gather_matmul)(x, w, idx), np.float32)
    bad = np.asarray([[1, 0, 1, 0], [0, 1, 0, 1]], bool)
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


@pytest.mark.gpu
@needs_gpu
def test_compiled_program_gathers_no_expert_weights():
    x, w, idx = _gpu_case(32, 4, 5760, 2880, 1, jnp.bfloat16, False)
    hlo = jax.jit(jq.gather_matmul).lower(x, w, idx).compile().as_text()
    assert "gather(" not in hlo.replace("all-gather(", ""), "an XLA gather left in the program"


@pytest.mark.gpu
@needs_gpu
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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(5120, 2880), (6144, 4096)], ids=lambda s: f"{s[1]}to{s[0]}")
def test_decoder_linear_at_decode_takes_the_float_gemv(shape):
    """models.layers.linear on a float matrix at one row (batch-1 decode) runs the Pallas
    float GEMV (pallas.configs.FLOAT_GEMV_OVER_XLA) and gives the float32 product, bias added;
    two rows take XLA's dot."""
    from jaxquant.models import layers

    n, k = shape
    w = (0.05 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, 1, k), jnp.float32).astype(jnp.bfloat16)
    assert not layers.float_gemv_applies(jnp.concatenate([x, x]), w)
    bias = jnp.linspace(-1, 1, n, dtype=jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(layers.linear)
    assert layers.float_gemv_applies(x, w)
    assert "__gpu$xla.gpu.triton" in f.lower(x, w, bias).as_text(), "not the Pallas kernel"
    y = np.asarray(f(x, w, bias), np.float64)
    want = np.asarray(jnp.einsum("btk,nk->btn", x.astype(jnp.float32), w.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST), np.float64)
    want = want + np.asarray(bias, np.float64)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
