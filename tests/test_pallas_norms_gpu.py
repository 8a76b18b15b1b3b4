"""Pallas norm kernels on a real GPU (CUDA or ROCm) with realistic shapes.

Skipped (with the reason) where JAX sees no GPU. Each case compares the kernel
with the jnp reference on the same device (a few ulps of the output dtype) and
with the float64 numpy oracle on the host (tests/common.py's rms64/act64).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.common import skip_module_without_gpu

skip_module_without_gpu("the Pallas norm GPU tests "
                        "(tests/test_pallas_norms.py runs the kernels in interpret mode)")

import jaxquant as jq  # noqa: E402
import jaxquant.pallas  # noqa: E402,F401 - registers the backend
from jaxquant import dispatch  # noqa: E402
from jaxquant.ops.norms import (add_rms_norm_reference, gated_rms_norm_reference,  # noqa: E402
                                rms_norm_reference)
from jaxquant.pallas import configs  # noqa: E402
from jaxquant.pallas import norms as pn  # noqa: E402
from tests.common import act64, rms64  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (4096, 5376), (32768, 128), (1, 4096), (4, 20000)]
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
ORACLE_TOL = {jnp.dtype(F32): 4e-6, jnp.dtype(F16): 2.0**-9, jnp.dtype(BF16): 2.0**-6}
# Rows compared with the float64 oracle on the host (all of them for small shapes).
ORACLE_ROWS = 64


def _sid(s):
    return "x".join(map(str, s))


def _rand(key, shape, dtype, scale=1.0, loc=0.0):
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
        tol = ORACLE_TOL[jnp.dtype(y.dtype)]
        np.testing.assert_allclose(np.asarray(y[:ORACLE_ROWS], np.float64), want64,
                                   rtol=tol, atol=tol)


def _head(a):
    return np.asarray(a[:ORACLE_ROWS], np.float64)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_rms_norm(shape, dtype):
    x, w = _rand(0, shape, dtype, 2.0), _rand(1, shape[-1:], dtype, 0.1, 1.0)
    y = jax.jit(functools.partial(pn.rms_norm, eps=1e-6, weight_offset=0.0))(x, w)
    ref = jax.jit(functools.partial(rms_norm_reference, eps=1e-6, weight_offset=0.0))(x, w)
    _check(y, ref, rms64(_head(x), w))


@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F32, BF16)],
                         ids=lambda d: "-".join(jnp.dtype(t).name for t in d))
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
def test_add_rms_norm(shape, dtypes):
    xd, rd = dtypes
    x, r, w = _rand(2, shape, xd), _rand(3, shape, rd), _rand(4, shape[-1:], rd, 0.1, 1.0)
    y, h = jax.jit(functools.partial(pn.add_rms_norm, eps=1e-6, weight_offset=0.0))(x, r, w)
    yr, hr = jax.jit(functools.partial(add_rms_norm_reference, eps=1e-6,
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


@pytest.mark.parametrize("case", GATED, ids=lambda c: f"{_sid(c[0])}-g{c[1]}-"
                                                      f"{'nbg' if c[2] else 'gbn'}-{c[3]}")
def test_gated_rms_norm(case):
    shape, group_size, nbg, act = case
    # float32 x with bfloat16 gate and weight (docs/ops.md): output bf16.
    x, gate, w = _rand(5, shape, F32), _rand(6, shape, BF16, 2.0), _rand(7, shape[-1:], BF16)
    kw = dict(eps=1e-6, weight_offset=0.0, activation=act, norm_before_gate=nbg,
              group_size=group_size)
    y = jax.jit(functools.partial(pn.gated_rms_norm, **kw))(x, gate, w)
    ref = jax.jit(functools.partial(gated_rms_norm_reference, **kw))(x, gate, w)
    a, x64 = act64(_head(gate), act), _head(x)
    want = (rms64(x64, w, group=group_size) * a if nbg
            else rms64(x64 * a, w, group=group_size))
    _check(y, ref, want)


def test_auto_and_explicit_backend_use_the_kernels():
    platform = {"gpu": "cuda"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    shape = (configs.AUTO_NORM_MIN_ELEMENTS // 4096, 4096)  # the smallest `auto` takes
    x = jax.ShapeDtypeStruct(shape, BF16)
    impl = dispatch.select("rms_norm", None, platform, (x, None),
                           dict(eps=1e-6, weight_offset=0.0))
    assert getattr(impl, "func", None) is pn.lower_rms_norm
    x, r, w = _rand(8, shape, BF16), _rand(9, shape, BF16), _rand(10, (4096,), BF16)
    for backend in (None, "pallas"):
        y, h = jax.jit(functools.partial(jq.add_rms_norm, backend=backend))(x, r, w)
        yr, hr = jq.add_rms_norm(x, r, w, backend="reference")
        np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(hr, np.float64))
        _check(y, yr)
        g = jax.jit(functools.partial(jq.gated_rms_norm, group_size=512, backend=backend))(
            x, r, w)
        _check(g, jq.gated_rms_norm(x, r, w, group_size=512, backend="reference"))
