"""Pallas qmm kernels in interpret mode on the CPU (small shapes), against
`dequantize_reference` + a float64 matmul: every mode x activation dtype x
kernel path (GEMV, GEMM) for transpose=True, every mode x path for
transpose=False, shapes that are not multiples of the block sizes.

The GPU tests (marked `gpu`, skipped with the reason where JAX sees no GPU; CUDA or ROCm)
at realistic shapes: each case draws fresh random weights and activations, poisons
nothing (the kernels write every output or the test fails on non-finite values), and
compares with the float64 product of `dequantize_reference` on the host."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.pallas import codecs, configs
from jaxquant.pallas.qmm import qmm, supports
from jaxquant.quantize import dequantize_reference
from tests.common import skip_without_gpu

# XLA:CPU compiles the interpreted kernels; its LLVM optimizations cost more
# than they save on these small problems.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}

# (mode, bits, group_size): every row of docs/formats.md, some group sizes twice.
FORMATS = [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 4, 64), ("affine", 5, 32),
    ("affine", 6, 64), ("affine", 8, 128), ("affine", 2, 16), ("affine", 8, 16),
    ("mxfp4", 4, 32), ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32),
    ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
    ("iq4nl", 4, 32),
]
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
# M per path under the interpret block table: GEMV for M <= 4, GEMM above.
PATHS = {"gemv": 1, "gemm": 20}

# Relative Frobenius error vs the float64 product of the exact dequantized
# weight: float32 is exact arithmetic in interpret mode; f16/bf16 are rounded
# at the output (and, on the GEMM path, at the dot inputs).
TOL = {jnp.float32: 2e-5, jnp.float16: 3e-3, jnp.bfloat16: 1.5e-2}


def _id(p):
    return "-".join(str(v) for v in p) if isinstance(p, tuple) else getattr(p, "__name__", str(p))


def _run(x, qw, **kw):
    f = jax.jit(functools.partial(qmm, interpret=True, **kw))
    return f.trace(x, qw).lower().compile(compiler_options=_FAST_COMPILE)(x, qw)


def _pack(codes, bits):
    """numpy: codes [R, C] -> uint32 words, docs/formats.md's little-endian bit stream."""
    r, c = codes.shape
    stream = (codes[:, :, None] >> np.arange(bits)) & 1          # [R, C, bits]
    words = stream.reshape(r, c * bits // 32, 32).astype(np.uint64)
    return (words << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def _random_qw(mode, bits, group, rows, cols, dtype, rng):
    """A random QuantizedArray built directly from codes and scales (every finite
    element code appears; scales in a range that keeps values O(1))."""
    fmt = jq.formats.FORMATS[mode]
    codes = rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint32)
    if fmt.element is not None:
        finite = np.isfinite(jq.formats.element_values(fmt.element))
        codes = np.where(finite[codes], codes, 0).astype(np.uint32)
    n_groups = cols // group
    biases = global_scale = None
    if fmt.scale == "e8m0":
        emax = jq.formats.ELEMENTS[fmt.element].emax   # keep |values| <= ~8
        scales = rng.integers(124 - emax, 131 - emax, (rows, n_groups)).astype(np.uint8)
    elif fmt.scale == "e4m3":
        scales = rng.integers(0x30, 0x48, (rows, n_groups)).astype(np.uint8)  # 2**-1 .. 2**2
        global_scale = jnp.float32(0.375)
    else:
        scales = jnp.asarray(rng.uniform(0.02, 0.2, (rows, n_groups)), dtype)
        if fmt.has_biases:
            biases = jnp.asarray(rng.normal(0, 0.5, (rows, n_groups)), dtype)
    return jq.QuantizedArray(jnp.asarray(_pack(codes, bits)), jnp.asarray(scales), biases,
                             global_scale, mode=mode, bits=bits, group_size=group, dtype=dtype)


_dequant = jax.jit(lambda qw: dequantize_reference(qw, jnp.float32))


def _case(mode, bits, group, dtype, m, transpose, seed, n_out=40, k_in=None):
    rng = np.random.default_rng(seed)
    # K = 320 (or 3 groups of 128): group counts that leave masked tails in the
    # interpret tiles; N = 40: not a multiple of 16.
    k = k_in or (320 if 320 % group == 0 else 3 * group)
    n = n_out
    qw = _random_qw(mode, bits, group, *((n, k) if transpose else (k, n)), dtype, rng)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return x, qw


def _check(y, x, qw, transpose, dtype):
    wd = np.asarray(_dequant(qw), np.float64)
    ref = np.asarray(x, np.float64) @ (wd.T if transpose else wd)
    assert y.dtype == x.dtype
    assert y.shape == ref.shape
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", FORMATS, ids=_id)
def test_transpose_true(fmt, dtype, path):
    mode, bits, group = fmt
    x, qw = _case(mode, bits, group, dtype, PATHS[path], True, seed=zlib.crc32(repr((fmt, path, dtype.__name__)).encode()))
    assert configs.select("interpret", True, x.shape[0], 40, x.shape[1], bits,
                          group).kernel == path
    _check(_run(x, qw, transpose=True), x, qw, True, dtype)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("fmt", FORMATS, ids=_id)
def test_transpose_false(fmt, path):
    mode, bits, group = fmt
    dtype = DTYPES[(FORMATS.index(fmt) + len(path)) % 3]
    # qw logical [K, N], groups along N: N = 320 (or 3 groups; masked group tails), K = 40.
    x, qw = _case(mode, bits, group, dtype, PATHS[path], False, seed=7,
                  n_out=320 if 320 % group == 0 else 3 * group, k_in=40)
    _check(_run(x, qw, transpose=False), x, qw, False, dtype)


def test_gemv_several_rows_split_k_and_leading_axes():
    x, qw = _case("affine", 4, 64, jnp.float32, 2, True, seed=3)
    x3 = x.reshape(2, 1, -1)
    cfg = configs.TABLE[("interpret", True, "gemv")].replace(split_k=3)
    y = _run(x3, qw, transpose=True, config=cfg)
    assert y.shape == (2, 1, 40)
    _check(y.reshape(2, 40), x, qw, True, jnp.float32)


def test_nvfp4_without_global_scale_and_fp4_groups():
    for mode, group in (("nvfp4", 16), ("fp4", 16), ("fp4", 64)):
        x, qw = _case(mode, 4, group, jnp.float32, 1, True, seed=5)
        if mode == "nvfp4":
            assert qw.global_scale is not None
            qw = jq.QuantizedArray(qw.data, qw.scales, None, None, mode="nvfp4", bits=4,
                                   group_size=16, dtype=qw.dtype)
        _check(_run(x, qw, transpose=True), x, qw, True, jnp.float32)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_nan_scale_poisons_its_rows(path):
    x, qw = _case("mxfp4", 4, 32, jnp.float32, PATHS[path], True, seed=11)
    scales = np.array(qw.scales)
    scales[5, 1] = 255
    qw = jq.QuantizedArray(qw.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=qw.dtype)
    y = np.asarray(_run(x, qw, transpose=True))
    assert np.all(np.isnan(y[:, 5]))
    assert np.all(np.isfinite(np.delete(y, 5, axis=1)))


def test_float_decoders_both_variants_exact():
    """The GPU decoder (float32 subnormal times a power of two) and the
    interpret-mode decoder (integer rebias + select) give the same bits as
    formats.decode_element for every code (checked in numpy, which does not
    flush subnormals)."""
    for name, elem in jq.formats.ELEMENTS.items():
        codes = np.arange(1 << elem.bits, dtype=np.uint32)
        top = codes << np.uint32(32 - elem.bits)
        want = jq.formats.element_values(name)
        got_select = np.asarray(jax.jit(
            functools.partial(codecs.decode_float_top, element=name, hw_subnormals=False))(top))
        np.testing.assert_array_equal(got_select, want)
        # hw variant, replayed in numpy float32 (IEEE subnormals)
        bits = (top.view(np.int32) >> (8 - elem.ebits)).view(np.uint32)
        mag = ((1 << (elem.ebits + elem.mbits)) - 1) << (23 - elem.mbits)
        bits = bits & np.uint32(0x80000000 | mag)
        hw = bits.view(np.float32) * np.float32(2.0 ** (127 - elem.bias))
        finite = np.isfinite(want)
        np.testing.assert_array_equal(hw[finite], want[finite])


def test_supports():
    _, qw = _case("affine", 4, 64, jnp.float32, 1, True, seed=0)
    x = jax.ShapeDtypeStruct
    assert supports(x((3, 320), jnp.bfloat16), qw, transpose=True, platform="cuda")
    assert supports(x((320,), jnp.float32), qw, transpose=True)
    assert not supports(x((3, 320), jnp.float64), qw, transpose=True)
    assert not supports(x((3, 40), jnp.float32), qw, transpose=True)
    assert supports(x((3, 40), jnp.float32), qw, transpose=False)
    assert not supports(x((3, 320), jnp.int8), qw, transpose=True)


def test_rejects_bad_input():
    x, qw = _case("affine", 4, 64, jnp.float32, 1, True, seed=0)
    with pytest.raises(ValueError, match="K="):
        qmm(x[:, :64], qw, interpret=True)
    with pytest.raises(TypeError):
        qmm(x.astype(jnp.int32), qw, interpret=True)


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("mxfp6_e3m2", 6, 32)],
                         ids=_id)
def test_large_m_tiles(fmt, transpose):
    """M > 64: the large-tile GEMM class (whole tiles dequantized and interleaved
    into K order, one dot per step; 6-bit falls back to one dot per slot)."""
    mode, bits, group = fmt
    assert configs.shape_class("interpret", 70) == "gemm"
    x, qw = _case(mode, bits, group, jnp.bfloat16, 70, transpose, seed=13,
                  **({} if transpose else dict(n_out=320, k_in=40)))
    _check(_run(x, qw, transpose=transpose), x, qw, transpose, jnp.bfloat16)


def test_gemv_spreads_small_n_over_programs():
    cfg = configs.select("cuda", True, 1, 4096, 14336, 4, 64)
    assert cfg.kernel == "gemv" and cfg.block_n * cfg.k_words >= 1024
    assert -(-4096 // cfg.block_n) * cfg.split_k >= configs.MIN_PROGRAMS["cuda"]


# ---------------------------------------------------------------------------
# On a GPU: the compiled kernels at realistic shapes.

needs_gpu = skip_without_gpu("the Pallas qmm GPU tests (the tests above run the kernels "
                             "in interpret mode)")

GPU_FORMATS = [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 4, 64), ("affine", 4, 128),
    ("affine", 5, 32), ("affine", 6, 64), ("affine", 8, 64),
    ("mxfp4", 4, 32), ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32),
    ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
    ("affine", 2, 16), ("affine", 8, 16), ("iq4nl", 4, 32),
]
# M per kernel class under the CUDA/ROCm block tables: gemv (M <= 4), skinny
# tensor-core tiles (M <= 64), large tiles.
MS = {"gemv": 3, "skinny": 16, "gemm": 300}
GPU_TOL = {jnp.float32: 2e-3, jnp.float16: 4e-3, jnp.bfloat16: 1.5e-2}


def _fid(f):
    return "-".join(map(str, f))


def _gpu_case(fmt, m, n, k, transpose, dtype, seed):
    mode, bits, group = fmt
    key = jax.random.PRNGKey(seed)
    kw, kx = jax.random.split(key)
    w = jax.random.normal(kw, (n, k) if transpose else (k, n), jnp.float32)
    # canonical: the layout the Pallas kernels read (a GPU's default is cuda_mma)
    qw = jq.quantize(w.astype(dtype), mode=mode, bits=bits, group_size=group,
                     layout="canonical")
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    return x, qw


def _gpu_check(y, x, qw, transpose, tol):
    wd = np.asarray(_dequant(qw), np.float64)
    ref = np.asarray(x, np.float64) @ (wd.T if transpose else wd)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < tol, err


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("fmt", GPU_FORMATS, ids=_fid)
def test_bf16_transpose_true(fmt, path):
    # N not a multiple of any block; K = 2880 (gpt-oss hidden size) is not a
    # multiple of the K tiles.
    k = 2880 if 2880 % fmt[2] == 0 else 2944
    x, qw = _gpu_case(fmt, MS[path], 1000, k, True, jnp.bfloat16, seed=len(path))
    _gpu_check(jax.jit(qmm)(x, qw), x, qw, True, GPU_TOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("fmt", GPU_FORMATS, ids=_fid)
def test_bf16_transpose_false(fmt, path):
    x, qw = _gpu_case(fmt, MS[path], 1024 + 3 * fmt[2], 1000, False, jnp.bfloat16, seed=2)
    f = jax.jit(lambda x, qw: qmm(x, qw, transpose=False))
    _gpu_check(f(x, qw), x, qw, False, GPU_TOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("nvfp4", 4, 16),
                                 ("mxfp8_e4m3", 8, 32)], ids=_fid)
def test_other_dtypes(fmt, dtype, path):
    x, qw = _gpu_case(fmt, MS[path], 2000, 4096, True, dtype, seed=3)
    _gpu_check(jax.jit(qmm)(x, qw), x, qw, True, GPU_TOL[dtype])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", sorted(MS))
def test_float32_highest_is_ieee(path):
    x, qw = _gpu_case(("mxfp4", 4, 32), MS[path], 512, 4096, True, jnp.float32, seed=4)
    f = jax.jit(lambda x, qw: qmm(x, qw, precision="highest"))
    _gpu_check(f(x, qw), x, qw, True, 2e-5)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 8, 16, 512])
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32)], ids=_fid)
def test_benchmark_shapes(fmt, m):
    x, qw = _gpu_case(fmt, m, 14336, 4096, True, jnp.bfloat16, seed=m)
    _gpu_check(jax.jit(qmm)(x, qw), x, qw, True, GPU_TOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
def test_through_the_primitive():
    import jaxquant.pallas  # noqa: F401 - registers the backend

    x, qw = _gpu_case(("affine", 4, 64), 8, 4096, 4096, True, jnp.bfloat16, seed=9)
    y = jax.jit(lambda x, qw: jq.qmm(x, qw, backend="pallas"))(x, qw)
    _gpu_check(y, x, qw, True, GPU_TOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32)], ids=_fid)
def test_transpose_false_other_dtypes(fmt, dtype, path):
    x, qw = _gpu_case(fmt, MS[path], 1024 + 3 * fmt[2], 1000, False, dtype, seed=5)
    f = jax.jit(lambda x, qw: qmm(x, qw, transpose=False))
    _gpu_check(f(x, qw), x, qw, False, GPU_TOL[dtype])
