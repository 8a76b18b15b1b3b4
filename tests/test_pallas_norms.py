"""Pallas rms_norm / add_rms_norm / gated_rms_norm in interpret mode on the CPU.

Against the float64 numpy oracle (tests/common.py's rms64/act64, written from docs/ops.md) and against the jnp reference (same float32 arithmetic: a few ulps of the
output dtype). The interpret block table (tiny `max_block`/`chunk`/`tile`) sends
small widths through every path: many rows per program (64..256), one pass with
masked tails (1, 7, 1000 -> padded), two passes over column steps (> 256), groups
batched per program and groups wider than a block; the CUDA table is run too
(one pass up to 16 Ki columns, 4096-wide steps above). Small row counts keep the
module fast (each case compiles one small XLA program).

The GPU tests (marked `gpu`, skipped with the reason where JAX sees no GPU; CUDA or ROCm)
run the kernels at realistic shapes: each case compares the kernel with the jnp reference
on the same device (a few ulps of the output dtype) and with the float64 numpy oracle on
the host.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from jaxquant.ops import norms as ops_norms
from jaxquant.ops.norms import (add_rms_norm_reference, gated_rms_norm_reference,
                                rms_norm_reference)
from jaxquant.pallas import configs
from jaxquant.pallas import norms as pn
from tests import oracle
from tests.common import act64, rms64, skip_without_gpu

# XLA:CPU compiles each interpreted kernel; its LLVM optimizations cost more
# than they save on these small problems.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
# Oracle tolerance, relative and absolute, per output dtype: 2 ulps for f16/bf16
# (the output rounding plus float32 noise); float32 allows for float32 sums of up
# to 20000 squares and the rsqrt.
ORACLE_TOL = {jnp.dtype(F32): 2e-6, jnp.dtype(F16): 2.0**-9, jnp.dtype(BF16): 2.0**-6}


def _jit(fn, *args, **kw):
    f = jax.jit(functools.partial(fn, **kw))
    return f.trace(*args).lower().compile(compiler_options=_FAST_COMPILE)(*args)


def _run(fn, *args, **kw):
    """The Pallas kernel, interpreted."""
    return _jit(fn, *args, interpret=True, **kw)


rms_norm_reference = functools.partial(_jit, rms_norm_reference)
add_rms_norm_reference = functools.partial(_jit, add_rms_norm_reference)
gated_rms_norm_reference = functools.partial(_jit, gated_rms_norm_reference)


def _rand(seed, shape, dtype, scale=1.0, loc=0.0):
    v = np.random.default_rng(seed).normal(loc, scale, shape)
    return jnp.asarray(v.astype(jnp.dtype(dtype)))     # numpy (ml_dtypes) cast: no XLA op


def _check_oracle(y, want, dtype):
    assert y.dtype == jnp.dtype(dtype), (y.dtype, dtype)
    tol = ORACLE_TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)


def _check_ref(y, ref):
    """Within a few ulps of the output dtype of the jnp reference: f16/bf16 differ
    by at most one rounding; float32 by the order of the float32 sums (XLA's
    reduction tree vs the kernel's per-lane then cross-lane sums)."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    ulps = 8 if ref.dtype == jnp.float32 else 2
    got, want = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    bound = ulps * oracle.ulp(want, np.dtype(ref.dtype))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def _finite(*a):
    return all(np.all(np.isfinite(np.asarray(v, np.float64))) for v in a)


WIDTHS = [1, 7, 64, 128, 256, 1000, 4096, 5376, 20000]
# Every width in float32 and bfloat16; float16 on a spread of them (same code path).
RMS_CASES = [(w, d) for w in WIDTHS for d in (F32, BF16)] + [(w, F16) for w in (1, 7, 256, 5376)]


def _rows(width):
    return 2 if width >= 4096 else 5


# ---------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("width,dtype", RMS_CASES,
                         ids=[f"{w}-{jnp.dtype(d).name}" for w, d in RMS_CASES])
def test_rms_norm(width, dtype):
    x = _rand(width, (_rows(width), width), dtype, scale=3.0)
    w = _rand(width + 1, (width,), dtype)
    y = _run(pn.rms_norm, x, w, eps=1e-5, weight_offset=0.25)
    assert _finite(y)
    _check_oracle(y, rms64(x, w, eps=1e-5, off=0.25), dtype)
    _check_ref(y, rms_norm_reference(x, w, eps=1e-5, weight_offset=0.25))


@pytest.mark.parametrize("width", [7, 1000])
def test_rms_norm_no_weight(width):
    # weight None: weight_offset is ignored (the reference's rule).
    x = _rand(1, (3, 4, width), BF16)          # leading axes fold into rows
    y = _run(pn.rms_norm, x, None, eps=1e-3, weight_offset=1.0)
    assert y.shape == x.shape
    _check_oracle(y, rms64(x, eps=1e-3), BF16)
    _check_ref(y, rms_norm_reference(x, None, eps=1e-3, weight_offset=1.0))


@pytest.mark.parametrize("width", [1000, 5376, 20000])
def test_rms_norm_cuda_table(width):
    """The CUDA blocks (one pass up to 16384 columns, two above) in interpret mode."""
    x, w = _rand(2, (2, width), BF16), _rand(3, (width,), F32)   # f32 weight, bf16 x
    y = _run(pn.rms_norm, x, w, eps=1e-6, weight_offset=0.0, config=configs.NORM_CONFIGS["cuda"])
    _check_oracle(y, rms64(x, w), BF16)
    _check_ref(y, rms_norm_reference(x, w, eps=1e-6, weight_offset=0.0))


def test_rms_norm_large_values_and_zeros():
    # Rows of zeros give 0 (rsqrt(eps) * 0), large values do not overflow float32 sums.
    x = jnp.asarray(np.concatenate([np.zeros((1, 300), np.float16),
                                    np.asarray(_rand(4, (2, 300), F16, scale=2000.0))]))
    y = _run(pn.rms_norm, x, None, eps=1e-6, weight_offset=0.0)
    assert np.all(np.asarray(y[0], np.float64) == 0)
    _check_oracle(y, rms64(x), F16)


# ---------------------------------------------------------------------------
# add_rms_norm


@pytest.mark.parametrize("width", [7, 128, 1000])
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F32, BF16), (F32, F32), (F16, F16),
                                    (BF16, F32)], ids=lambda d: "-".join(jnp.dtype(t).name
                                                                         for t in d))
def test_add_rms_norm(dtypes, width):
    xd, rd = dtypes
    x, r, w = _rand(0, (5, width), xd), _rand(1, (5, width), rd), _rand(2, (width,), rd, 0.2, 1.0)
    y, h = _run(pn.add_rms_norm, x, r, w, eps=1e-6, weight_offset=0.0)
    yr, hr = add_rms_norm_reference(x, r, w, eps=1e-6, weight_offset=0.0)
    assert h.dtype == rd and y.dtype == rd
    np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(hr, np.float64))
    _check_oracle(y, rms64(hr, w), rd)
    _check_ref(y, yr)


def test_add_rms_norm_no_weight_offset():
    x, r = _rand(0, (3, 2, 96), BF16), _rand(1, (3, 2, 96), BF16)
    w = _rand(2, (96,), BF16, 0.1)
    y, h = _run(pn.add_rms_norm, x, r, w, eps=1e-6, weight_offset=1.0)
    yr, hr = add_rms_norm_reference(x, r, w, eps=1e-6, weight_offset=1.0)
    np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(hr, np.float64))
    _check_ref(y, yr)
    y, h = _run(pn.add_rms_norm, x, r, None, eps=1e-6, weight_offset=1.0)
    _check_ref(y, add_rms_norm_reference(x, r, None, eps=1e-6, weight_offset=1.0)[0])


# ---------------------------------------------------------------------------
# gated_rms_norm


def _gated_case(x, gate, w, *, activation, norm_before_gate, group_size, eps=1e-6, off=0.0,
                config=None):
    kw = dict(eps=eps, weight_offset=off, activation=activation,
              norm_before_gate=norm_before_gate, group_size=group_size)
    y = _run(pn.gated_rms_norm, x, gate, w, config=config, **kw)
    a = act64(gate, activation)
    x64 = np.asarray(x, np.float64)
    if norm_before_gate:
        want = rms64(x64, w, eps=eps, off=off, group=group_size) * a
    else:
        want = rms64(x64 * a, w, eps=eps, off=off, group=group_size)
    _check_oracle(y, want, gate.dtype)
    _check_ref(y, gated_rms_norm_reference(x, gate, w, **kw))


@pytest.mark.parametrize("group_size", [None, 64])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm(activation, norm_before_gate, group_size):
    # float32 x with bfloat16 gate and weight (docs/ops.md): output bf16.
    x = _rand(0, (5, 256), F32)
    gate, w = _rand(1, (5, 256), BF16, 2.0), _rand(2, (256,), BF16)
    _gated_case(x, gate, w, activation=activation, norm_before_gate=norm_before_gate,
                group_size=group_size)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_groups_wider_than_a_block(norm_before_gate):
    # group 640 > the interpret max_block (256): two passes per (row, group).
    x, gate = _rand(3, (3, 1280), BF16), _rand(4, (3, 1280), BF16)
    w = _rand(5, (1280,), BF16)
    _gated_case(x, gate, w, activation="silu", norm_before_gate=norm_before_gate,
                group_size=640, off=0.5)


@pytest.mark.parametrize("width,group_size", [(1000, None), (5376, 128), (96, 1), (7, 7)])
def test_gated_shapes(width, group_size):
    # weight None, f16 everywhere; odd widths, group == width, groups of one element.
    x, gate = _rand(6, (3, width), F16), _rand(7, (3, width), F16)
    _gated_case(x, gate, None, activation="sigmoid", norm_before_gate=False,
                group_size=group_size, eps=1e-5)


def test_gated_cuda_table_grouped():
    # CUDA table: 64 groups of 128 (32 per program) and f32 gate output.
    x, gate = _rand(8, (2, 8192), BF16), _rand(9, (2, 8192), F32)
    w = _rand(10, (8192,), BF16)
    _gated_case(x, gate, w, activation="silu", norm_before_gate=True, group_size=128,
                config=configs.NORM_CONFIGS["cuda"])


# ---------------------------------------------------------------------------
# Plans, supports, registration (no kernels run).


def test_plans():
    cuda = functools.partial(pn.plan, "cuda")
    p = cuda(32768, 1, 128)                    # per-head rows: batched per program
    assert (p.br, p.bs, p.two_pass) == (32, 128, False) and p.grid == (1024,)
    p = cuda(4096, 1, 5376)                    # one pass, block 8192, masked tail
    assert (p.br, p.bs, p.block_w, p.two_pass) == (1, 8192, 8192, False)
    p = cuda(3, 1, 20000)                      # two passes, 4096-wide steps
    assert (p.br, p.bs, p.block_w, p.two_pass) == (1, 4096, 32768, True)
    p = cuda(2, 64, 128)                       # groups batched per program
    assert (p.br, p.bg, p.bs) == (1, 32, 128) and p.grid == (2, 2)
    for platform in ("cuda", "rocm", "interpret"):
        for rows, groups, width in [(1, 1, 1), (7, 3, 5), (1, 1, 1 << 20), (1 << 20, 1, 64)]:
            p = pn.plan(platform, rows, groups, width)
            for v in (p.br, p.bg, p.bs, p.block_w, p.num_warps):
                assert v & (v - 1) == 0                      # Triton: powers of two
            assert 1 <= p.num_warps <= configs.NORM_CONFIGS[platform].max_warps
            assert p.br * p.grid[0] >= rows and p.block_w >= width


def test_supports():
    sd = jax.ShapeDtypeStruct
    assert pn.supports(sd((4, 64), F32), sd((4, 64), BF16), None, eps=1e-6, platform="cuda")
    assert not pn.supports(sd((4, 64), jnp.float64), None)     # float64 -> reference
    assert not pn.supports(sd((4, 64), F32), sd((64,), jnp.float64))
    assert not pn.supports(sd((0, 64), F32))
    assert not pn.supports(sd((4, 0), F32))
    assert not pn.supports(sd((4, 64), F32), group_size=48)
    assert pn.supports(sd((4, 64), F32), group_size=32)
    with pytest.raises(TypeError):
        pn.rms_norm(jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError):
        pn.add_rms_norm(jnp.zeros((2, 3)), jnp.zeros((3, 3)))
    with pytest.raises(ValueError):
        pn.gated_rms_norm(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2,)))


def test_registered_for_gpus_above_ffi():
    import jaxquant.pallas  # noqa: F401 - registers the backend

    for name in ("rms_norm", "add_rms_norm", "gated_rms_norm"):
        ks = [k for k in dispatch._KERNELS.get(name, ()) if k.backend == "pallas"]
        assert sorted(p for k in ks for p in k.platforms) == ["cuda", "rocm"], name
        assert all(k.priority == dispatch.PRIORITY["pallas"] == 0 for k in ks)
        ffi = [k for k in dispatch._KERNELS.get(name, ()) if k.backend == "ffi"
               and set(k.platforms) & {"cuda", "rocm"}]
        assert all(k.priority < dispatch.PRIORITY["pallas"] for k in ffi)
    x = jax.ShapeDtypeStruct((4096, 4096), F32)       # applies reads shape and dtype only
    x64 = jax.ShapeDtypeStruct((4096, 4096), jnp.float64)
    small = jax.ShapeDtypeStruct((64, 4096), F32)     # below AUTO_NORM_MIN_ELEMENTS
    rp = dict(eps=1e-6, weight_offset=0.0)
    select = functools.partial(dispatch.select, platform="cuda")
    assert select("rms_norm", None, args=(x, None), params=rp).func is pn.lower_rms_norm
    impl = select("rms_norm", None, args=(x64, None), params=rp)
    assert getattr(impl, "func", None) is not pn.lower_rms_norm
    assert select("rms_norm", None, args=(small, None), params=rp) is None  # auto: XLA
    assert select("rms_norm", "pallas", args=(small, None), params=rp).func is pn.lower_rms_norm
    gp = dict(eps=1e-6, weight_offset=0.0, activation="silu", norm_before_gate=True,
              group_size=None)
    assert select("gated_rms_norm", None, args=(x, x, None), params=gp).func is pn.lower_gated_rms_norm


def test_through_the_primitive_on_cpu_is_unchanged():
    # The pallas kernels register for cuda/rocm only: on the CPU the ops keep
    # their reference/ffi lowering (no interpret-mode kernel sneaks in).
    import jaxquant.pallas  # noqa: F401

    x = _rand(0, (3, 64), F32)
    np.testing.assert_allclose(jq.rms_norm(x), rms64(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# On a GPU: the compiled kernels at realistic shapes, against the jnp reference compiled
# for the same device (ops_norms: the module's own, not the CPU-compiled wrappers above).

needs_gpu = skip_without_gpu("the Pallas norm GPU tests (the tests above run the kernels "
                             "in interpret mode)")

SHAPES = [(4096, 4096), (4096, 5376), (32768, 128), (1, 4096), (4, 20000)]
GPU_ORACLE_TOL = {jnp.dtype(F32): 4e-6, jnp.dtype(F16): 2.0**-9, jnp.dtype(BF16): 2.0**-6}
# Rows compared with the float64 oracle on the host (all of them for small shapes).
ORACLE_ROWS = 64


def _sid(s):
    return "x".join(map(str, s))


def _gpu_rand(key, shape, dtype, scale=1.0, loc=0.0):
    v = loc + scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)
    return v.astype(dtype)


def _check(y, ref, want64=None):
    """y vs the reference on the device, elementwise within `ulps` units of the
    output dtype's precision times |ref| (float32 allows for the order of the sums
    and the GPUs' approximate rsqrt/division), and, on the first rows, vs the
    float64 oracle on the host."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    ulps = 16 if ref.dtype == jnp.float32 else 2
    got, exp = y.astype(jnp.float32), ref.astype(jnp.float32)
    bound = ulps * float(jnp.finfo(ref.dtype).eps) * jnp.abs(exp) + 1e-30
    n_bad = int(jnp.sum(~(jnp.abs(got - exp) <= bound)))       # NaN counts as bad
    worst = float(jnp.max(jnp.abs(got - exp) / bound))
    assert n_bad == 0, (n_bad, worst)
    if want64 is not None:
        tol = GPU_ORACLE_TOL[jnp.dtype(y.dtype)]
        np.testing.assert_allclose(np.asarray(y[:ORACLE_ROWS], np.float64), want64,
                                   rtol=tol, atol=tol)


def _head(a):
    return np.asarray(a[:ORACLE_ROWS], np.float64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_rms_norm_gpu(shape, dtype):
    x, w = _gpu_rand(0, shape, dtype, 2.0), _gpu_rand(1, shape[-1:], dtype, 0.1, 1.0)
    y = jax.jit(functools.partial(pn.rms_norm, eps=1e-6, weight_offset=0.0))(x, w)
    ref = jax.jit(functools.partial(ops_norms.rms_norm_reference, eps=1e-6,
                                    weight_offset=0.0))(x, w)
    _check(y, ref, rms64(_head(x), w))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F32, BF16)],
                         ids=lambda d: "-".join(jnp.dtype(t).name for t in d))
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_add_rms_norm_gpu(shape, dtypes):
    xd, rd = dtypes
    x, r = _gpu_rand(2, shape, xd), _gpu_rand(3, shape, rd)
    w = _gpu_rand(4, shape[-1:], rd, 0.1, 1.0)
    y, h = jax.jit(functools.partial(pn.add_rms_norm, eps=1e-6, weight_offset=0.0))(x, r, w)
    yr, hr = jax.jit(functools.partial(ops_norms.add_rms_norm_reference, eps=1e-6,
                                       weight_offset=0.0))(x, r, w)
    np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(hr, np.float64))
    _check(y, yr, rms64(_head(hr), w))


GATED = [  # (shape, group_size, norm_before_gate, activation)
    ((4096, 4096), None, True, "silu"),
    ((4096, 4096), 512, False, "silu"),
    ((4096, 5376), None, False, "sigmoid"),
    ((32768, 128), None, True, "silu"),
    ((1, 4096), 128, True, "sigmoid"),
    ((4, 20000), None, False, "silu"),
    ((4, 40000), 20000, True, "silu"),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GATED, ids=lambda c: f"{_sid(c[0])}-g{c[1]}-"
                                                      f"{'nbg' if c[2] else 'gbn'}-{c[3]}")
def test_gated_rms_norm_gpu(case):
    shape, group_size, nbg, act = case
    # float32 x with bfloat16 gate and weight (docs/ops.md): output bf16.
    x, gate = _gpu_rand(5, shape, F32), _gpu_rand(6, shape, BF16, 2.0)
    w = _gpu_rand(7, shape[-1:], BF16)
    kw = dict(eps=1e-6, weight_offset=0.0, activation=act, norm_before_gate=nbg,
              group_size=group_size)
    y = jax.jit(functools.partial(pn.gated_rms_norm, **kw))(x, gate, w)
    ref = jax.jit(functools.partial(ops_norms.gated_rms_norm_reference, **kw))(x, gate, w)
    a, x64 = act64(_head(gate), act), _head(x)
    want = (rms64(x64, w, group=group_size) * a if nbg
            else rms64(x64 * a, w, group=group_size))
    _check(y, ref, want)


@pytest.mark.gpu
@needs_gpu
def test_auto_and_explicit_backend_use_the_kernels():
    platform = {"gpu": "cuda"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    shape = (configs.AUTO_NORM_MIN_ELEMENTS // 4096, 4096)  # the smallest `auto` takes
    x = jax.ShapeDtypeStruct(shape, BF16)
    impl = dispatch.select("rms_norm", None, platform, (x, None),
                           dict(eps=1e-6, weight_offset=0.0))
    assert getattr(impl, "func", None) is pn.lower_rms_norm
    x, r, w = _gpu_rand(8, shape, BF16), _gpu_rand(9, shape, BF16), _gpu_rand(10, (4096,), BF16)
    for backend in (None, "pallas"):
        y, h = jax.jit(functools.partial(jq.add_rms_norm, backend=backend))(x, r, w)
        yr, hr = jq.add_rms_norm(x, r, w, backend="reference")
        np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(hr, np.float64))
        _check(y, yr)
        g = jax.jit(functools.partial(jq.gated_rms_norm, group_size=512, backend=backend))(
            x, r, w)
        _check(g, jq.gated_rms_norm(x, r, w, group_size=512, backend="reference"))
