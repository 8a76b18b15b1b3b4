"""The metal backend on an Apple GPU, through the bridge (macOS with the backend built;
.github/workflows/macos.yml runs it). Off macOS these tests skip; tests/test_metal.py
runs the same kernels on the MSL-on-CPU shim there."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from tests.common import EPS, act64, assert_matmul_close, deq64, rand, rms64

if "metal" not in jq.available_backends():
    pytest.skip(f"the metal backend cannot run here: {dispatch.unavailable_reason('metal')}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
MODES = [("affine", 4, 64), ("mxfp4", None, 32), ("fp4", None, 32), ("fp4", None, 16)]


def metal(f, *args, **kw):
    return jax.jit(lambda *a: f(*a, **kw, backend="metal"))(*args)


def test_lowers_to_the_metal_targets():
    qw = jq.quantize(rand(0, (64, 128)), mode="mxfp4")
    text = jax.jit(lambda x: jq.qmm(x, qw, backend="metal")).lower(rand(1, (2, 128))).as_text()
    assert "jaxquant_metal_qmv" in text


@pytest.mark.parametrize("mode,bits,group", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_qmm_gemv_and_gemm(mode, bits, group, dtype):
    w = rand(2, (2, 96, 256)).astype(dtype)  # scales in x's dtype: the kernels' case
    qw = jq.quantize(w, mode=mode, bits=bits, group_size=group)
    for m in (1, 8, 9, 70):  # the GEMV up to 8 rows, the GEMM above (edges masked)
        x = rand(3 + m, (2, m, 256)).astype(dtype)
        y = metal(jq.qmm, x, qw)
        assert y.dtype == dtype and y.shape == (2, m, 96)
        w64 = deq64(qw)
        for b in range(2):
            assert_matmul_close(y[b], x[b], w64[b], jnp.dtype(dtype))


def test_gather_qmm_bad_ids_give_nan_rows():
    qw = jq.quantize(rand(4, (4, 32, 128)), mode="affine", bits=4)
    x = rand(5, (3, 128))
    idx = jnp.array([[0, 3], [-1, 2], [4, 1]], jnp.int32)
    y = np.asarray(metal(jq.gather_qmm, x, qw, idx))
    w64 = deq64(qw)
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            if 0 <= e < 4:
                assert_matmul_close(y[t, j], x[t], w64[e], jnp.float32)
                np.testing.assert_array_equal(y[t, j], np.asarray(metal(jq.qmm, x[t], qw[e])))
            else:
                assert np.isnan(y[t, j]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mxfp4_dequantize_exact(dtype):
    qw = jq.quantize(rand(6, (64, 256), scale=1e-37), mode="mxfp4")  # E8M0 near 2^-127
    got = np.asarray(metal(jq.dequantize, qw, dtype=dtype))
    want = np.asarray(jq.dequantize(qw, dtype=dtype, backend="reference"))
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("n", [64, 128, 256, 384, 4096, 100, 5000])
def test_rms_norm_widths(n):
    for dtype in DTYPES:
        x, w = rand(7, (5, n), scale=2.0).astype(dtype), rand(8, (n,)).astype(dtype)
        eps = EPS[jnp.dtype(dtype)]
        y = metal(jq.rms_norm, x, w)
        np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w),
                                   rtol=4 * eps + 1e-6, atol=4 * eps + 1e-6)


def test_add_and_gated_rms_norm():
    x, r = rand(9, (4, 320), dtype=jnp.float32), rand(10, (4, 320), dtype=jnp.bfloat16)
    w = rand(11, (320,), dtype=jnp.bfloat16)
    y, h = metal(jq.add_rms_norm, x, r, w)
    _, hr = jq.add_rms_norm(x, r, w, backend="reference")
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hr, np.float32))
    eps = EPS[jnp.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(h, w), rtol=4 * eps + 1e-6,
                               atol=4 * eps + 1e-6)
    gate = rand(12, (4, 320), dtype=jnp.bfloat16)
    for activation in ("silu", "sigmoid"):
        for before in (True, False):
            for group in (None, 64):
                y = metal(jq.gated_rms_norm, x, gate, w, activation=activation,
                          norm_before_gate=before, group_size=group)
                g = act64(gate, activation)
                want = (rms64(x, w, group=group) * g if before
                        else rms64(np.asarray(x, np.float64) * g, w, group=group))
                np.testing.assert_allclose(np.asarray(y, np.float64), want,
                                           rtol=8 * eps + 1e-5, atol=8 * eps + 1e-5)


def test_page_aligned_and_staged_buffers_agree():
    """Sizes that are and are not multiples of the page: the zero-copy and the staged path."""
    for rows in (4, 3):  # 4 x 4096 float32 = 64 KiB (a page multiple); 3 x 4096 is not
        x = rand(13, (rows, 4096))
        np.testing.assert_allclose(np.asarray(metal(jq.rms_norm, x)), rms64(x), rtol=1e-5,
                                   atol=1e-6)


def test_the_bridge_refuses_bad_calls():
    """Shapes the lowering never sends, straight through the FFI: an error, no crash."""
    from jaxquant.metal import kernels
    qw = jq.quantize(rand(14, (1, 32, 128)), mode="fp4")
    bad_out = jax.ShapeDtypeStruct((1, 2, 31), jnp.float32)  # N should be 32
    with pytest.raises(Exception, match="the output must be x's dtype"):
        jax.ffi.ffi_call("jaxquant_metal_qmm", bad_out)(
            rand(15, (1, 2, 128)), qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(2),
            group_size=np.int64(32)).block_until_ready()
    with pytest.raises(Exception, match="group_size 48"):
        jax.ffi.ffi_call("jaxquant_metal_dequantize",
                         jax.ShapeDtypeStruct((1, 32, 128), jnp.float32))(
            qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(2),
            group_size=np.int64(48)).block_until_ready()


def test_bfloat16_inputs_with_ml_dtypes():
    x = np.asarray(rand(17, (2, 128))).astype(ml_dtypes.bfloat16)
    y = metal(jq.rms_norm, x)
    assert y.dtype == jnp.bfloat16
