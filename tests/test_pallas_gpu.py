"""Pallas qmm kernels on a real GPU (CUDA or ROCm) with realistic shapes.

Skipped (with the reason) where JAX sees no GPU. Each case draws fresh random
weights and activations, poisons nothing (the kernels write every output or
the test fails on non-finite values), and compares with the float64 product of
`dequantize_reference` on the host.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.pallas.qmm import qmm
from jaxquant.quantize import dequantize_reference
from tests.common import skip_module_without_gpu

skip_module_without_gpu("the Pallas qmm GPU tests "
                        "(tests/test_pallas_qmm.py runs the kernels in interpret mode)")

pytestmark = pytest.mark.gpu

FORMATS = [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 4, 64), ("affine", 4, 128),
    ("affine", 5, 32), ("affine", 6, 64), ("affine", 8, 64),
    ("mxfp4", 4, 32), ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32),
    ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
    ("affine", 2, 16), ("affine", 8, 16),
]
# M per kernel class under the CUDA/ROCm block tables: gemv (M <= 4), skinny
# tensor-core tiles (M <= 64), large tiles.
MS = {"gemv": 3, "skinny": 16, "gemm": 300}
TOL = {jnp.float32: 2e-3, jnp.float16: 4e-3, jnp.bfloat16: 1.5e-2}
_dequant = jax.jit(lambda qw: dequantize_reference(qw, jnp.float32))


def _fid(f):
    return "-".join(map(str, f))


def _case(fmt, m, n, k, transpose, dtype, seed):
    mode, bits, group = fmt
    key = jax.random.PRNGKey(seed)
    kw, kx = jax.random.split(key)
    w = jax.random.normal(kw, (n, k) if transpose else (k, n), jnp.float32)
    # canonical: the layout the Pallas kernels read (a GPU's default is cuda_mma)
    qw = jq.quantize(w.astype(dtype), mode=mode, bits=bits, group_size=group,
                     layout="canonical")
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    return x, qw


def _check(y, x, qw, transpose, tol):
    wd = np.asarray(_dequant(qw), np.float64)
    ref = np.asarray(x, np.float64) @ (wd.T if transpose else wd)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < tol, err


@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("fmt", FORMATS, ids=_fid)
def test_bf16_transpose_true(fmt, path):
    # N not a multiple of any block; K = 2880 (gpt-oss hidden size) is not a
    # multiple of the K tiles.
    k = 2880 if 2880 % fmt[2] == 0 else 2944
    x, qw = _case(fmt, MS[path], 1000, k, True, jnp.bfloat16, seed=len(path))
    _check(jax.jit(qmm)(x, qw), x, qw, True, TOL[jnp.bfloat16])


@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("fmt", FORMATS, ids=_fid)
def test_bf16_transpose_false(fmt, path):
    x, qw = _case(fmt, MS[path], 1024 + 3 * fmt[2], 1000, False, jnp.bfloat16, seed=2)
    f = jax.jit(lambda x, qw: qmm(x, qw, transpose=False))
    _check(f(x, qw), x, qw, False, TOL[jnp.bfloat16])


@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("nvfp4", 4, 16),
                                 ("mxfp8_e4m3", 8, 32)], ids=_fid)
def test_other_dtypes(fmt, dtype, path):
    x, qw = _case(fmt, MS[path], 2000, 4096, True, dtype, seed=3)
    _check(jax.jit(qmm)(x, qw), x, qw, True, TOL[dtype])


@pytest.mark.parametrize("path", sorted(MS))
def test_float32_highest_is_ieee(path):
    x, qw = _case(("mxfp4", 4, 32), MS[path], 512, 4096, True, jnp.float32, seed=4)
    f = jax.jit(lambda x, qw: qmm(x, qw, precision="highest"))
    _check(f(x, qw), x, qw, True, 2e-5)


@pytest.mark.parametrize("m", [1, 8, 16, 512])
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32)], ids=_fid)
def test_benchmark_shapes(fmt, m):
    x, qw = _case(fmt, m, 14336, 4096, True, jnp.bfloat16, seed=m)
    _check(jax.jit(qmm)(x, qw), x, qw, True, TOL[jnp.bfloat16])


def test_through_the_primitive():
    import jaxquant.pallas  # noqa: F401 - registers the backend

    x, qw = _case(("affine", 4, 64), 8, 4096, 4096, True, jnp.bfloat16, seed=9)
    y = jax.jit(lambda x, qw: jq.qmm(x, qw, backend="pallas"))(x, qw)
    _check(y, x, qw, True, TOL[jnp.bfloat16])


@pytest.mark.parametrize("path", sorted(MS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32)], ids=_fid)
def test_transpose_false_other_dtypes(fmt, dtype, path):
    x, qw = _case(fmt, MS[path], 1024 + 3 * fmt[2], 1000, False, dtype, seed=5)
    f = jax.jit(lambda x, qw: qmm(x, qw, transpose=False))
    _check(f(x, qw), x, qw, False, TOL[dtype])
