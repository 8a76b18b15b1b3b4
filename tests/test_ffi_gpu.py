"""The ffi backend on an NVIDIA (or AMD) GPU: the gpu_src/ kernels against the
float64 oracle and the reference, the gather_qmm == qmm invariant bit for bit,
NaN rows, the norms, and the handlers' validation. Skipped without a GPU or
without the GPU library (tools/gpu/check_ffi.sh runs it, also under
compute-sanitizer)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.ffi as jf
from tests.common import (DTYPES, EPS, MODES, act64, assert_matmul_close, deq64, quantize_for,
                          rand, rms64)
from tests.test_ffi import GATHER_IDX, check_sweep_products, sweep_calls


def _gpu_platform():
    try:
        backend = jax.default_backend()
    except Exception:  # noqa: BLE001
        return None
    return {"gpu": "cuda"}.get(backend, backend) if backend in ("gpu", "cuda", "rocm") else None


PLATFORM = _gpu_platform()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(PLATFORM is None, reason="needs a GPU (JAX's default backend is not gpu)"),
    pytest.mark.skipif(PLATFORM is not None and jf.unavailable_reason(PLATFORM) is not None,
                       reason=f"the GPU ffi library is not usable: {jf.unavailable_reason(PLATFORM)}"
                       if PLATFORM else ""),
]

f32 = lambda a: np.asarray(a, np.float32)
QUICK = os.environ.get("JQ_GPU_TEST_QUICK") == "1"  # (compute-sanitizer runs: fewer cases)


@pytest.mark.parametrize("mode,bits", MODES[:1] + MODES[6:8] if QUICK else MODES)
def test_gpu_mode_sweep(mode, bits):
    e, n, k, t = 4, 40, 256, 3
    w = rand(0, (e, n, k), jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32, scale=3.0)
    qw = quantize_for(mode, bits, w)
    xs = {jnp.dtype(dt).name: rand(1, (t, k), dt) for dt in DTYPES}
    xl = {name: rand(2, (20, k), x.dtype) for name, x in xs.items()}
    idx = jnp.asarray(GATHER_IDX)

    def large(x, q):  # M > FFI_GEMV_MAX_M: ffi dequantize + XLA's dot (IEEE float32 when highest)
        with jax.default_matmul_precision("highest"):
            return jq.qmm(x, q, backend="ffi")

    def run(qw, xs, xl, idx):
        return {name: dict(sweep_calls(qw, x, idx), large=large(xl[name], qw[2]))
                for name, x in xs.items()}

    out = jax.jit(run)(qw, xs, xl, idx)
    w64 = deq64(qw)
    for name, o in out.items():
        dtype = jnp.dtype(name)
        x = xs[name]
        eps = EPS[dtype]
        d, r = f32(o["deq"]), f32(o["deq_ref"])
        sub = (np.abs(r) < 2.0**-126) & (r != 0)
        np.testing.assert_array_equal(d[~sub], r[~sub], err_msg=name)
        np.testing.assert_allclose(np.asarray(o["deq"], np.float64)[~sub], w64[~sub],
                                   rtol=2 * eps, atol=1e-30, err_msg=name)
        assert_matmul_close(o["large"], xl[name], w64[2], dtype)
        check_sweep_products(o, x, w64, name)


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4)])
def test_gpu_benchmark_shape_and_configs(mode, bits):
    """The benchmark's shape (K=4096, N=14336, M=1); every rows-per-warp config gives the
    same bits (the accumulation order does not depend on it)."""
    k, n = (4096, 14336) if not QUICK else (1024, 2048)
    qw = quantize_for(mode, bits, rand(3, (n, k), jnp.bfloat16))
    x = rand(4, (k,), jnp.bfloat16)
    f = jax.jit(lambda x, q: jq.qmm(x, q, backend="ffi"))
    outs = []
    for cfg in ["4,256", "2,256", "1,256", "4,128"]:
        os.environ["JAXQUANT_FFI_GPU_QMV"] = cfg
        try:
            outs.append(f32(f(x, qw)))
        finally:
            del os.environ["JAXQUANT_FFI_GPU_QMV"]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    assert_matmul_close(outs[0], x, deq64(qw), jnp.bfloat16)


def test_gpu_batched_qmm_group16_and_nan_block():
    qw = quantize_for("fp4", 4, rand(5, (3, 32, 96)), group_size=16)
    x = rand(6, (3, 5, 96))
    assert_matmul_close(jax.jit(lambda x: jq.qmm(x, qw, backend="ffi"))(x), x, deq64(qw),
                        jnp.float32)
    qm = quantize_for("mxfp4", 4, rand(7, (16, 64)))
    scales = np.asarray(qm.scales).copy()
    scales[3, 1] = 255
    qm = jq.QuantizedArray(qm.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    y = f32(jax.jit(lambda x: jq.qmm(x, qm, backend="ffi"))(rand(8, (2, 64))))
    assert np.all(np.isnan(y[:, 3])) and not np.any(np.isnan(np.delete(y, 3, axis=1)))


@pytest.mark.parametrize("d", [7, 64, 128, 256, 5376])
def test_gpu_norms(d):
    x = rand(9, (6, d), jnp.bfloat16, scale=2.0)
    r = rand(10, (6, d), jnp.float32)
    w = rand(11, (d,), jnp.bfloat16)
    gate = rand(12, (6, d), jnp.bfloat16)
    group = 64 if d % 64 == 0 else None

    def run(x, r, w, gate):
        return (jq.rms_norm(x, w, backend="ffi"), jq.add_rms_norm(x, r, w, backend="ffi"),
                jq.add_rms_norm(x, r, w, backend="reference")[1],
                jq.gated_rms_norm(x, gate, w, group_size=group, backend="ffi"),
                jq.gated_rms_norm(x, gate, w, activation="sigmoid", norm_before_gate=False,
                                  backend="ffi"))
    y, (ya, h), h_ref, yg, yg2 = jax.jit(run)(x, r, w, gate)
    tol = dict(rtol=2**-6, atol=2**-6)
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w), **tol)
    np.testing.assert_array_equal(f32(h), f32(h_ref))
    np.testing.assert_allclose(np.asarray(ya, np.float64), rms64(h, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(yg, np.float64),
                               rms64(x, w, group=group) * act64(gate, "silu"), **tol)
    np.testing.assert_allclose(np.asarray(yg2, np.float64),
                               rms64(np.asarray(x, np.float64) * act64(gate, "sigmoid"), w), **tol)


def test_gpu_handler_errors():
    SDS = jax.ShapeDtypeStruct
    call = lambda target, out, *a, **k: jax.block_until_ready(jax.jit(lambda *a: jax.ffi.ffi_call(
        target, out, vmap_method="sequential")(*a, **k))(*a))
    d = jnp.zeros((4, 16), jnp.uint32)
    s = jnp.ones((4, 2), jnp.float32)
    e0 = jnp.zeros((0,), jnp.float32)
    attrs = dict(fmt=np.int64(0), bits=np.int64(4), group_size=np.int64(64))
    with pytest.raises(jax.errors.JaxRuntimeError, match="biases must match"):
        call("jaxquant_dequantize", SDS((4, 128), jnp.float32), d, s, e0, e0, **attrs)
    with pytest.raises(jax.errors.JaxRuntimeError, match="K=128"):
        call("jaxquant_qmv", SDS((1, 1, 4), jnp.float32), jnp.ones((1, 1, 64)), d[None], s[None],
             s[None], e0, jnp.zeros((0,), jnp.int32), **attrs)
    with pytest.raises(jax.errors.JaxRuntimeError, match="eps must be >= 0"):
        call("jaxquant_rms_norm", SDS((3, 8), jnp.float32), jnp.ones((3, 8)), e0,
             eps=np.float32(-1), weight_offset=np.float32(0))
