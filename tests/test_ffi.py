"""The ffi backend on the CPU: every op x mode x dtype against the float64
oracle (tests/oracle.py) and the reference, the shared codec header against
jaxquant.formats, the gather_qmm == qmm invariant bit for bit, and every
validation error of the handlers (called directly through jax.ffi.ffi_call).

The GPU tests (marked `gpu`; skipped with the reason without a GPU or without the GPU
library; tools/gpu/check_ffi.sh runs them, also under compute-sanitizer): the gpu_src/
kernels on an NVIDIA (or AMD) GPU against the float64 oracle and the reference, the
gather_qmm == qmm invariant bit for bit, NaN rows, the norms, and the handlers'
validation."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.ffi as jf
from jaxquant import dispatch, formats
from jaxquant.ffi import configs, kernels, loader
from tests import oracle
from tests.common import (CPU_ISA_FLAGS, DTYPES, EPS, GPU_NATIVE_MODES, MODES, act64,
                          assert_matmul_close, cpu_flags, deq64, quantize_for, rand, rms64,
                          xla_rounds_affine_once)

CPU_LIB = jf.libraries()["cpu"]


@contextlib.contextmanager
def enable_x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


_JITS = {}


def _jitted(fn, backend, kw):
    key = (fn, backend, tuple(sorted(kw.items(), key=lambda i: i[0])))
    if key not in _JITS:
        _JITS[key] = jax.jit(lambda *a: fn(*a, backend=backend, **kw))
    return _JITS[key]


def ffi(fn, *a, **k):
    return _jitted(fn, "ffi", k)(*a)


def ref(fn, *a, **k):
    return _jitted(fn, "reference", k)(*a)


def test_cpu_library_loaded():
    assert CPU_LIB.handle is not None, CPU_LIB.error
    assert dispatch.unavailable_reason("ffi") is None
    assert "ffi" in jq.available_backends()
    assert CPU_LIB.handle.jq_cpu_threads() >= 1


def test_missing_library_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "_search_dirs", lambda: [tmp_path])
    lib = loader.load("cuda")
    assert lib.handle is None and "libjaxquant_cuda.so was not built" in lib.error
    assert str(tmp_path) in lib.error and "nvcc" in lib.error
    (tmp_path / "libjaxquant_rocm.so").write_bytes(b"not a library")
    lib = loader.load("rocm")
    assert lib.handle is None and "failed to load" in lib.error
    assert "no library for platform" in jf.unavailable_reason("tpu")


def test_missing_library_quotes_the_build(monkeypatch, tmp_path):
    """A GPU library the build left out: the error says why, as CMakeLists.txt wrote it."""
    monkeypatch.setattr(loader, "_search_dirs", lambda: [tmp_path])
    (tmp_path / "native_build.txt").write_text(
        "cuda: not built: nvcc found but no NVIDIA GPU visible (JAXQUANT_ENABLE_CUDA=AUTO)\n"
        "rocm: building for gfx942 (JAXQUANT_ENABLE_ROCM=AUTO)\n")
    lib = loader.load("cuda")
    assert lib.handle is None and "no NVIDIA GPU visible (JAXQUANT_ENABLE_CUDA=AUTO)" in lib.error
    assert "not built (nvcc found" in lib.error
    # a platform the build did build, but whose library is missing here: the generic reason
    assert "no HIP compiler" in loader.load("rocm").error


# ---------------------------------------------------------------------------
# The shared codec header == jaxquant.formats


def test_codec_table_matches_formats():
    import ctypes
    h = CPU_LIB.handle
    names = ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"]
    codebooks = ["iq4nl"]  # element ids after the minifloats
    specials = {"none": 0, "fn": 1, "ieee": 2}
    out = (ctypes.c_int32 * 6)()
    for i, name in enumerate(names):
        assert h.jq_element_spec(i, out) == 0
        e = formats.ELEMENTS[name]
        assert list(out[:4]) == [e.ebits, e.mbits, e.bias, specials[e.special]], name
        vals = (ctypes.c_float * 256)()
        n = h.jq_decode_element_all(i, vals)
        assert n == 1 << e.bits
        got = np.array(vals[:n], np.float32)
        np.testing.assert_array_equal(got, formats.element_values(name))
        np.testing.assert_array_equal(got.astype(np.float64), oracle.element_table(name))
    for i, name in enumerate(codebooks, start=len(names)):
        assert h.jq_element_spec(i, out) == -1  # no minifloat fields
        vals = (ctypes.c_float * 256)()
        assert h.jq_decode_element_all(i, vals) == len(formats.CODEBOOKS[name]) == 16
        got = np.array(vals[:16], np.float32)
        np.testing.assert_array_equal(got, formats.element_values(name))
        np.testing.assert_array_equal(got.astype(np.float64), oracle.element_table(name))
    assert h.jq_decode_element_all(len(names) + len(codebooks), vals) == -1
    scale_kinds = {"float": 0, "e8m0": 1, "e4m3": 2}
    assert set(kernels.FORMAT_IDS) == set(formats.FORMATS)
    for mode, fid in kernels.FORMAT_IDS.items():
        f = formats.FORMATS[mode]
        assert h.jq_format_spec(fid, out) == 0
        element = -1 if f.element is None else (names + codebooks).index(f.element)
        bits_mask = sum(1 << b for b in f.bits)
        group_mask = sum(1 << int(np.log2(g)) for g in f.group_sizes)
        assert list(out) == [element, bits_mask, group_mask, scale_kinds[f.scale],
                             int(f.has_biases), int(f.has_global_scale)], mode
    assert h.jq_format_spec(len(kernels.FORMAT_IDS), out) == -1


def test_library_describes_itself():
    """FORMAT_IDS and the registered targets come from the library (jq_format_name,
    jq_ffi_targets), in the order of codec.h's format list; a library that numbers
    the formats differently from another loaded one is refused, naming both."""
    assert CPU_LIB.format_ids == kernels.FORMAT_IDS == {m: i for i, m in enumerate(formats.FORMATS)}
    assert CPU_LIB.targets == ("dequantize", "qmv", "rms_norm", "add_rms_norm", "gated_rms_norm",
                               "gemm")
    import ctypes
    renumbered = {m: len(kernels.FORMAT_IDS) - 1 - i for m, i in kernels.FORMAT_IDS.items()}
    lib = loader.Library("cpu", CPU_LIB.path, ctypes.CDLL(str(CPU_LIB.path)),
                          format_ids=renumbered)
    assert jf._refuse_if_renumbered(lib) and lib.handle is None
    assert "numbers the formats" in lib.error and "rebuild" in lib.error


def test_gpu_decoders_on_host(tmp_path):
    """codec.h's GPU decoders (E2M1 and every other element decoded in place in its
    packed word) equal the exact ones bit for bit, for every (format, bits) of the
    table: tests/native/codec_check.cc, built with the host compiler."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = str(tmp_path / "codec_check")
    subprocess.run([cxx, "-std=c++17", "-O1", "-Iinclude", "-DJQ_GPU_DECODE=1",
                    "tests/native/codec_check.cc", "-o", exe], check=True, cwd=root)
    p = subprocess.run([exe], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "14 (format, bits) checked, 0 failing" in p.stdout


@pytest.mark.parametrize("dt,mlt", [(2, ml_dtypes.bfloat16), (1, np.float16)])
def test_codec_rounding(dt, mlt):
    import ctypes
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(4000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 4000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 6e-8,
                  3e-8, 2.98e-8, 5.96e-8, 1e38, 3.4e38, 1.1754944e-38], np.float32)]
    ).astype(np.float32)
    out = np.zeros(x.shape, np.uint16)
    CPU_LIB.handle.jq_round_f32(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size),
                                ctypes.c_int(dt), out.ctypes.data_as(ctypes.c_void_p))
    with np.errstate(over="ignore"):
        want = x.astype(mlt)
    got = out.view(mlt)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


# ---------------------------------------------------------------------------
# Every mode x dtype: dequantize, qmm (fused GEMV) and gather_qmm in one jit per
# mode (compiles dominate this suite's time on a 2-core machine).

GATHER_IDX = np.array([[0, 3], [2, -1], [4, 1]], np.int32)  # -1 and 4: NaN rows


_SWEEP_QW = {}


def sweep_calls(qw, x, idx):
    """The ffi calls of a mode sweep for one activation x [t, K] on weights qw [E, N, K]
    (traced inside one jit): dequantize (ffi and reference), qmm with qw[1] (all rows and
    each row alone), gather_qmm with `idx` (GATHER_IDX) and each slot's qmm."""
    e, t = qw.shape[0], x.shape[0]
    return dict(
        deq=jq.dequantize(qw, x.dtype, backend="ffi"),
        deq_ref=jq.dequantize(qw, x.dtype, backend="reference"),
        qmm=jq.qmm(x, qw[1], backend="ffi"),
        rows=[jq.qmm(x[i], qw[1], backend="ffi") for i in range(t)],
        gather=jq.gather_qmm(x, qw, idx, backend="ffi"),
        per_slot=[[jq.qmm(x[i], qw[int(j)], backend="ffi") if 0 <= j < e else None
                   for j in GATHER_IDX[i]] for i in range(t)])


def check_sweep_products(o, x, w64, name):
    """sweep_calls' products: qmm against the oracle, each row == the M=1 call bit for bit;
    gather_qmm slot (i, j) == qmm(x[i], qw[idx[i, j]]) bit for bit, NaN rows for bad ids."""
    dtype, (t, n), e = jnp.dtype(name), o["qmm"].shape, w64.shape[0]
    f32 = lambda a: np.asarray(a, np.float32)
    assert o["qmm"].dtype == dtype and o["gather"].shape == (t, 2, n)
    assert_matmul_close(o["qmm"], x, w64[1], dtype)
    for i in range(t):
        np.testing.assert_array_equal(f32(o["rows"][i]), f32(o["qmm"][i]), err_msg=name)
        for j, ej in enumerate(GATHER_IDX[i]):
            got = f32(o["gather"][i, j])
            if 0 <= ej < e:
                np.testing.assert_array_equal(got, f32(o["per_slot"][i][j]), err_msg=name)
                assert_matmul_close(o["gather"][i, j], x[i], w64[ej], dtype)
            else:
                assert np.all(np.isnan(got)), name


def _sweep_qw(mode, bits):
    """The [4, 24, 128] weights of a mode (quantizing op by op costs more than the ffi
    calls: quantized once for the tests that share them)."""
    if (mode, bits) not in _SWEEP_QW:
        w = rand(0, (4, 24, 128), jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32,
                 scale=3.0)
        _SWEEP_QW[mode, bits] = quantize_for(mode, bits, w)
    return _SWEEP_QW[mode, bits]


@pytest.mark.parametrize("mode,bits", MODES)
def test_mode_sweep(mode, bits):
    k, t = 128, 3
    qw = _sweep_qw(mode, bits)
    xs = {jnp.dtype(dt).name: rand(1, (t, k), dt) for dt in DTYPES}
    idx = jnp.asarray(GATHER_IDX)

    run = lambda qw, xs, idx: {name: sweep_calls(qw, x, idx) for name, x in xs.items()}
    out = jax.jit(run)(qw, xs, idx)
    w64 = deq64(qw)
    f32 = lambda a: np.asarray(a, np.float32)
    for name, o in out.items():
        dtype = jnp.dtype(name)
        x = xs[name]
        eps = EPS[dtype]
        # dequantize: bit for bit the reference, and the oracle's values rounded once
        assert o["deq"].dtype == dtype and o["deq"].shape == qw.shape
        np.testing.assert_array_equal(f32(o["deq"]), f32(o["deq_ref"]), err_msg=name)
        np.testing.assert_allclose(np.asarray(o["deq"], np.float64), w64, rtol=2 * eps,
                                   atol=1e-30, err_msg=name)
        check_sweep_products(o, x, w64, name)


# ---------------------------------------------------------------------------
# dequantize


def test_codebook_modes_only_on_the_cpu():
    """The CPU library decodes codebooks (test_mode_sweep); the GPU libraries build their
    float kernels for minifloats only (codec.h kFloatFormats), so the ffi backend's
    `supports` refuses iq4nl for cuda and rocm, where the Pallas kernels take it."""
    qw = quantize_for("iq4nl", 4, rand(4, (24, 128)))
    x = rand(5, (3, 128))
    assert kernels.supports_dequantize(qw, dtype=jnp.float32, platform="cpu")
    assert kernels.supports_matmul(x, qw, platform="cpu", transpose=True)
    for platform in ("cuda", "rocm"):
        assert not kernels.supports_dequantize(qw, dtype=jnp.float32, platform=platform)
        assert not kernels.supports_matmul(x, qw, platform=platform, transpose=True)
    fp4 = quantize_for("fp4", 4, rand(4, (24, 128)))
    assert kernels.supports_matmul(x, fp4, platform="cuda", transpose=True)


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_dequantize_fp4_groups(group_size):
    qw = quantize_for("fp4", 4, rand(1, (5, 128)), group_size=group_size)
    np.testing.assert_array_equal(ffi(jq.dequantize, qw), ref(jq.dequantize, qw))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_affine_group16(bits):
    """Affine in 16-element groups (GGUF's Q6_K / Q2_K sub-blocks): the native
    dequantize one float32 rounding of the oracle's value (as for every group size),
    the GEMV (few rows) and the dequantize + dot path (many rows) against the float64
    product."""
    qw = quantize_for("affine", bits, rand(bits, (40, 160)), group_size=16)
    np.testing.assert_array_equal(ffi(jq.dequantize, qw), deq64(qw).astype(np.float32))
    for m in (1, 3, 40):
        x = rand(m, (m, 160))
        assert_matmul_close(ffi(jq.qmm, x, qw), x, deq64(qw), jnp.float32)
    qs = quantize_for("affine", bits, rand(bits + 1, (3, 24, 64)), group_size=16)
    x = rand(5, (2, 64))
    idx = jnp.array([[2, 0], [1, 1]], jnp.int32)
    want = ref(jq.gather_qmm, x, qs, idx)
    np.testing.assert_allclose(ffi(jq.gather_qmm, x, qs, idx), want, rtol=1e-5, atol=1e-5)


def test_dequantize_e8m0_extremes():
    qw = quantize_for("mxfp4", 4, rand(2, (4, 128)))
    scales = np.asarray(qw.scales).copy()
    scales[0, 0], scales[0, 1], scales[1, 2], scales[2, 3] = 255, 0, 254, 1
    qw = jq.QuantizedArray(qw.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    y = np.asarray(ffi(jq.dequantize, qw))
    r = np.asarray(ref(jq.dequantize, qw))
    # Bit for bit, float32 subnormal results included (scale codes 0 and 1: 2**-127, 2**-126)
    np.testing.assert_array_equal(y.view(np.uint32), r.view(np.uint32))
    assert np.all(np.isnan(y[0, :32]))
    w64 = deq64(qw)
    finite = np.isfinite(w64)
    assert np.any((np.abs(w64) < 2.0**-126) & (w64 != 0))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y[finite], w64[finite].astype(np.float32))


def test_dequantize_nvfp4_without_global_scale():
    qw = quantize_for("nvfp4", 4, rand(3, (8, 64)))
    qw = jq.QuantizedArray(qw.data, qw.scales, mode="nvfp4", bits=4, group_size=16,
                           dtype=jnp.float32)
    np.testing.assert_array_equal(ffi(jq.dequantize, qw), ref(jq.dequantize, qw))


def test_dequantize_vmap_of_the_call():
    qws = [quantize_for("nvfp4", 4, rand(i, (6, 64), scale=i + 1.0)) for i in range(3)]
    stack = lambda f: jnp.stack([f(q) for q in qws])
    data, scales, gs = stack(lambda q: q.data), stack(lambda q: q.scales), stack(
        lambda q: q.global_scale)
    def one(d, s, g):
        q = jq.QuantizedArray(d, s, None, g, mode="nvfp4", bits=4, group_size=16,
                              dtype=jnp.float32)
        return jf.dequantize_call(q, jnp.float32)
    y = jax.jit(jax.vmap(one))(data, scales, gs)
    for i, q in enumerate(qws):
        np.testing.assert_array_equal(y[i], ref(jq.dequantize, q))


# ---------------------------------------------------------------------------
# qmm


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("mxfp6_e3m2", 6),
                                       ("nvfp4", 4), ("affine", 5)])
@pytest.mark.parametrize("transpose", [True, False])
def test_qmm_large_m_and_transpose(mode, bits, transpose):
    n, k = 64, 128
    m = jf.configs.FFI_GEMV_MAX_M["cpu"] + 3
    qws = {jnp.dtype(dt).name: quantize_for(mode, bits, rand(2, (n, k) if transpose else (k, n), dt))
           for dt in DTYPES}
    xs = {jnp.dtype(dt).name: rand(3, (m, k), dt) for dt in DTYPES}
    f = lambda backend: jax.jit(lambda qws, xs: {
        d: jq.qmm(xs[d], qws[d], transpose=transpose, backend=backend) for d in xs})
    y, r = f("ffi")(qws, xs), f("reference")(qws, xs)
    for d in xs:
        assert y[d].dtype == jnp.dtype(d)
        assert_matmul_close(y[d], xs[d], deq64(qws[d]), jnp.dtype(d), transpose)
        # x @ W is ffi dequantize + the reference's dot: bit for bit the reference, where
        # XLA rounds the reference's affine q * scale + bias once as the kernel does
        # (x @ W.T is the blocked GEMM: test_gemm_mode_sweep)
        if not transpose and (mode != "affine" or xla_rounds_affine_once()):
            np.testing.assert_array_equal(np.asarray(y[d], np.float32), np.asarray(r[d], np.float32))


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp8_e5m2", 8), ("fp4", 4)])
def test_qmm_batched_weights(mode, bits):
    qw = quantize_for(mode, bits, rand(4, (3, 32, 64)))
    x = rand(5, (3, 2, 64))
    y = ffi(jq.qmm, x, qw)
    assert_matmul_close(y, x, deq64(qw), jnp.float32)
    for b in range(3):
        np.testing.assert_array_equal(y[b], ffi(jq.qmm, x[b], qw[b]))


def test_qmm_group16_and_vmap():
    qw = quantize_for("fp4", 4, rand(6, (48, 96)), group_size=16)
    x = rand(7, (4, 2, 96))
    y = jax.jit(jax.vmap(lambda x: jq.qmm(x, qw, backend="ffi")))(x)
    assert_matmul_close(y, x, deq64(qw), jnp.float32)


def test_qmm_nan_block_and_grad():
    qw = quantize_for("mxfp4", 4, rand(8, (16, 64)))
    scales = np.asarray(qw.scales).copy()
    scales[3, 1] = 255
    qw = jq.QuantizedArray(qw.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    x = rand(9, (2, 64))
    y = np.asarray(ffi(jq.qmm, x, qw))
    assert np.all(np.isnan(y[:, 3])) and not np.any(np.isnan(np.delete(y, 3, axis=1)))
    qw_ok = quantize_for("affine", 4, rand(10, (16, 64)))
    g = jax.grad(lambda x: jq.qmm(x, qw_ok, backend="ffi").sum())(x)
    np.testing.assert_allclose(g, np.broadcast_to(deq64(qw_ok).sum(0), (2, 64)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qmm_affine_inf_in_x(m, dtype):
    """An Inf in x: each output is the definition's sum((q s + b) x), +-Inf where the
    weight is non-zero, NaN where it is 0 or the signs of two Infs meet; never a row
    turned NaN by the bias term's Inf - Inf (the fused form s sum(q x) + b sum(x))."""
    k, n = 128, 48
    qw = quantize_for("affine", 4, rand(14, (n, k), scale=2.0))
    x = np.array(rand(15, (m, k), dtype), np.float32)
    x[0, 5] = np.inf
    if m > 1:
        x[1, 70], x[1, 3] = -np.inf, np.nan   # NaN row
    if m > 2:
        x[2, 9], x[2, 100] = np.inf, -np.inf
    x = jnp.asarray(x, dtype)
    y = np.asarray(ffi(jq.qmm, x, qw), np.float64)
    w64 = deq64(qw)
    with np.errstate(invalid="ignore", over="ignore"):
        # the oracle's float64 values, as an explicit IEEE sum (BLAS may skip zeros)
        want = (np.asarray(x, np.float64)[:, None, :] * w64[None]).sum(-1)
    assert np.isinf(want[0]).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    inf = np.isinf(want)
    np.testing.assert_array_equal(y[inf], want[inf])
    fin = np.isfinite(want)
    assert np.isfinite(y[fin]).all()
    # the reference (XLA's dot) on the row with one Inf; with two it may give NaN where
    # the IEEE sum is +-Inf (its blocked product multiplies zero padding by the Infs)
    ry = np.asarray(ref(jq.qmm, x, qw), np.float64)[0]
    np.testing.assert_array_equal(np.isnan(y[0]), np.isnan(ry))
    np.testing.assert_array_equal(y[0][np.isinf(ry)], ry[np.isinf(ry)])
    # gather_qmm's slots take the same path: bit for bit qmm's rows
    idx = jnp.zeros((m, 1), jnp.int32)
    qw3 = jax.tree.map(lambda a: a[None], qw)
    g = np.asarray(ffi(jq.gather_qmm, x, qw3, idx), np.float64)[:, 0]
    np.testing.assert_array_equal(g, y)


_OOM_CODE = r"""
import resource, sys, jax, jax.numpy as jnp, numpy as np, jaxquant as jq
def statm(i):
    return int(open("/proc/self/statm").read().split()[i]) * 4096
def qw_of(k):   # built from zeros directly: quantize's temporaries would not fit
    z = lambda *s: np.zeros(s, np.uint16).view(jnp.bfloat16)
    return jq.QuantizedArray(np.zeros((64, k // 8), np.uint32), z(64, k // 64), z(64, k // 64),
                             mode="affine", bits=4, group_size=64, dtype=jnp.bfloat16)
call = jax.jit(lambda x, qw: jq.qmm(x, qw, backend="ffi"))
def ready(k):
    x, qw = jnp.ones((16, k), jnp.bfloat16), jax.device_put(qw_of(k))
    return x, qw, call.lower(x, qw).compile(), jax.block_until_ready((x, qw))
tiny, small = ready(1 << 12), ready(1 << 19)
np.asarray(tiny[2](*tiny[:2]))
before = statm(1)
np.asarray(small[2](*small[:2]))      # 32 MiB of scratch per thread (AVX-512: 64) while it runs
print("KEPT", statm(1) - before)
xb, qb, big, _ = ready(1 << 23)
limit = statm(0) + (1 << 28)   # no room for a thread's 512 MiB of scratch
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for _ in range(3):
    try:
        np.asarray(big(xb, qb))
        print("RAN 0")
    except Exception as e:   # XLA's error, not an abort
        print("ERROR", type(e).__name__, str(e).splitlines()[0])
print("AGAIN", float(np.asarray(small[2](*small[:2])).sum()))
"""


def test_qmv_scratch_out_of_memory_is_an_error():
    """Scratch (M * K floats per thread, twice that in the AVX-512 GEMV of 4-bit codes)
    past the address-space limit: a clean error from the call, on whichever thread the
    allocation failed (not std::bad_alloc's abort on a worker), the process still usable
    afterwards; and no scratch kept once a call that could allocate it returns."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXQUANT_FFI_THREADS="2")
    p = subprocess.run([sys.executable, "-c", _OOM_CODE], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line.split(" ", 1) for line in p.stdout.splitlines()]
    assert [k for k, _ in lines] == ["KEPT", "ERROR", "ERROR", "ERROR", "AGAIN"], p.stdout
    assert all("RESOURCE_EXHAUSTED" in v and "out of host memory" in v
               for k, v in lines if k == "ERROR"), p.stdout
    lines = dict(lines)
    assert int(lines["KEPT"]) < 32 << 20, p.stdout
    assert float(lines["AGAIN"]) == 0.0, p.stdout


@pytest.mark.parametrize("mode,bits", [("mxfp4", 4), ("nvfp4", 4), ("fp4", 4),
                                       ("mxfp6_e2m3", 6), ("mxfp6_e3m2", 6),
                                       ("mxfp8_e4m3", 8), ("mxfp8_e5m2", 8)])
def test_qmv_decodes_every_code(mode, bits):
    """Every element code (NaN, Inf, -0, subnormals) through the GEMV's vector decode
    (the LUT, F16C and gather paths), one code per column: x one-hot picks column k,
    so y is the decoded weight times its scale, exactly the oracle's float64 value."""
    fmt = formats.FORMATS[mode]
    group = 16 if mode == "nvfp4" else 32
    k = max(32, 1 << bits)
    codes = np.tile(np.arange(k) % (1 << bits), (4, 1))
    data = oracle.pack_bits(codes, bits)
    if fmt.scale == "e8m0":
        # (no float32-subnormal products: the GEMV flushes them, as XLA's CPU code does)
        scales = np.array([[127], [120], [131], [30]], np.uint8).repeat(k // group, 1)
    elif fmt.scale == "e4m3":
        scales = np.array([[0x38], [0x01], [0x6a], [0x7e]], np.uint8).repeat(k // group, 1)
    else:
        scales = np.array([[1.0], [0.375], [-4.0], [2.0 ** -20]], np.float32).repeat(k // group, 1)
    make = lambda data: jq.QuantizedArray(jnp.asarray(data), jnp.asarray(scales), mode=mode,
                                          bits=bits, group_size=group, dtype=jnp.float32)
    want = oracle.dequantize(mode, bits, group, data, scales)          # [4, k] float64
    # dequantize (the same vector decode, subnormals kept): every code, NaN and Inf too
    deq = np.asarray(ffi(jq.dequantize, make(data), dtype=jnp.float32))
    np.testing.assert_array_equal(deq, want.astype(np.float32), err_msg=mode)
    # the GEMV: a NaN or Inf weight times x's zeros is NaN for the whole sum, so those
    # codes become 0 here (their non-finite products: test_qmm_nan_block_and_grad)
    finite = np.isfinite(want).all(0)
    codes = np.where(finite, codes, 0)
    qw, want = make(oracle.pack_bits(codes, bits)), np.where(finite, want, 0.0)
    eye = jnp.eye(k, dtype=jnp.float32)
    qw3 = jax.tree.map(lambda a: a[None], qw)
    got = np.asarray(ffi(jq.gather_qmm, eye, qw3, jnp.zeros((k, 1), jnp.int32)))[:, 0].T
    np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=mode)
    for m in (1, 3):   # qmm's tiles: the same values
        y = np.asarray(ffi(jq.qmm, eye[:m], qw))
        np.testing.assert_array_equal(y, got[:, :m].T, err_msg=mode)


# The 16-lane GEMV (AVX-512 with VBMI; where the CPU has it, the default ISA here) on
# what its decode and scale handling special-case: an odd number of units, groups of
# 16 inside a 4-bit unit and across an 8-bit one, 1 to 5 rows of x (every tile
# height), E8M0 rows that take the 8-lane path; and every ISA through a subprocess.
WIDE_CASES = [("affine", 4, 16), ("affine", 4, 32), ("affine", 4, 128), ("affine", 8, 16),
              ("affine", 8, 64), ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("fp4", 4, 16),
              ("fp4", 4, 64), ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32),
              ("mxfp6_e2m3", 6, 32), ("iq4nl", 4, 32)]


def set_cpu_threads(n):
    """Caps the CPU library's threads from the next call on; returns the previous cap."""
    return CPU_LIB.handle.jq_cpu_set_threads(n)


@pytest.mark.parametrize("mode,bits,group", WIDE_CASES)
def test_qmv_group_and_tile_shapes(mode, bits, group):
    k = 7 * 32 if group <= 32 else 3 * 128
    qw = quantize_for(mode, bits, rand(31, (37, k), scale=2.0), group_size=group)
    w64 = deq64(qw)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = rand(32, (5, k), dtype)
        rows = [np.asarray(ffi(jq.qmm, x[i:i + 1], qw), np.float32)[0] for i in range(5)]
        for m in range(1, 6):
            y = ffi(jq.qmm, x[:m], qw)
            assert_matmul_close(y, x[:m], w64, dtype)
            for i in range(m):  # one row's bits do not depend on M
                np.testing.assert_array_equal(np.asarray(y, np.float32)[i], rows[i],
                                              err_msg=f"{mode} m={m} row {i}")


def test_qmv_e8m0_rows_of_scale_0_and_255():
    """Rows holding scale code 0 (2**-127, split in two factors) or 255 (NaN) take the
    8-lane path; the rows beside them stay on the 16-lane one."""
    qw = quantize_for("mxfp4", 4, rand(33, (6, 256)))
    scales = np.asarray(qw.scales).copy()
    scales[1, 2], scales[3, 0], scales[4, 5], scales[4, 6] = 0, 255, 0, 140
    qw = jq.QuantizedArray(qw.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    x = rand(34, (2, 256))
    y = np.asarray(ffi(jq.qmm, x, qw))
    w64 = deq64(qw)
    assert np.all(np.isnan(y[:, 3])) and not np.any(np.isnan(np.delete(y, 3, 1)))
    assert_matmul_close(np.delete(y, 3, 1), x, np.delete(w64, 3, 0), jnp.float32)


@pytest.mark.parametrize("n", [1, 3, 17, 257])
def test_qmv_threads_same_bits(n):
    """The split over threads (XLA's pool) gives the same bits as one thread: N below,
    at and above the threads, odd N, several slots (gather_qmm), M = 1 and 3."""
    if len(os.sched_getaffinity(0)) < 2:  # XLA's pool has a thread per core it may use
        pytest.skip("one core here: no split to compare")
    cases = [("mxfp4", 4, None), ("affine", 4, 32), ("mxfp8_e4m3", 8, None),
             ("mxfp6_e3m2", 6, None)]
    before = set_cpu_threads(1)
    try:
        for mode, bits, group in cases:
            qw = quantize_for(mode, bits, rand(35, (3, n, 96)), group_size=group)
            x = rand(36, (3, 96))
            idx = jnp.asarray([[0, 2], [1, 1], [2, 0]], jnp.int32)
            call = lambda: [np.asarray(a) for a in (ffi(jq.qmm, x, qw[1]), ffi(jq.qmm, x[:1], qw[2]),
                                                    ffi(jq.gather_qmm, x, qw, idx))]
            set_cpu_threads(1)
            one = call()
            for t in (2, 3, 8):
                set_cpu_threads(t)
                for a, b in zip(call(), one):
                    np.testing.assert_array_equal(a, b, err_msg=f"{mode} n={n} threads={t}")
            assert_matmul_close(one[0], x, deq64(qw)[1], jnp.float32)
    finally:
        set_cpu_threads(0)
    assert CPU_LIB.handle.jq_cpu_threads() == before


# ---------------------------------------------------------------------------
# The blocked GEMM (qmm with more rows of x than the GEMV takes; target jaxquant_gemm)

GEMM_M = (configs.FFI_GEMV_MAX_M["cpu"] + 1, 70)  # past the GEMV; a strip and a tail


def _gemm_qw(mode, bits, n=70, k=192, group=None, seed=60):
    # N = 70: a 64-row block and a tail of 6 (not a micro-tile of 6 rows either);
    # K = 192: a 128-wide panel and a tail of 64
    dt = jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32
    return quantize_for(mode, bits, rand(seed, (n, k), dt, scale=3.0), group_size=group)


@pytest.mark.parametrize("mode,bits", MODES)
def test_gemm_mode_sweep(mode, bits):
    """Every mode x dtype against the oracle at M past the GEMV (jq.qmm's automatic
    choice on the CPU), with M, N and K tails; a row's bits do not depend on M."""
    qw = _gemm_qw(mode, bits)
    xs = {jnp.dtype(dt).name: rand(61, (max(GEMM_M), qw.shape[1]), dt) for dt in DTYPES}
    run = jax.jit(lambda qw, xs: {d: [jq.qmm(x[:m], qw) for m in GEMM_M] for d, x in xs.items()})
    assert "jaxquant_gemm" in run.lower(qw, xs).as_text()
    out = run(qw, xs)
    w64 = deq64(qw)
    for d, ys in out.items():
        for m, y in zip(GEMM_M, ys):
            assert y.dtype == jnp.dtype(d) and y.shape == (m, qw.shape[0])
            assert_matmul_close(y, xs[d][:m], w64, jnp.dtype(d))
        small, large = (np.asarray(y, np.float32) for y in ys)
        np.testing.assert_array_equal(large[:GEMM_M[0]], small, err_msg=f"{mode} {d}")


def test_gemm_auto_choice_and_no_dequantized_weight():
    """Automatic choice on the CPU: the GEMV up to FFI_GEMV_MAX_M rows, the GEMM past it
    (neither materializes the weight: no dequantize, no float [N, K] in the program);
    x @ W (transpose=False) keeps the ffi dequantize + XLA's dot."""
    qw = _gemm_qw("mxfp4", 4, n=64, k=128)
    lower = lambda m, **kw: jax.jit(lambda x: jq.qmm(x, qw, **kw)).lower(
        rand(62, (m, 128))).as_text()
    text = lower(configs.FFI_GEMV_MAX_M["cpu"])
    assert "jaxquant_qmv" in text and "jaxquant_gemm" not in text
    text = lower(configs.FFI_GEMV_MAX_M["cpu"] + 1)
    assert "jaxquant_gemm" in text and "jaxquant_dequantize" not in text
    assert "tensor<64x128xf32>" not in text
    qwn = quantize_for("mxfp4", 4, rand(63, (128, 64)))
    text = jax.jit(lambda x: jq.qmm(x, qwn, transpose=False, backend="ffi")).lower(
        rand(64, (40, 128))).as_text()
    assert "jaxquant_dequantize" in text and "jaxquant_gemm" not in text


def test_gemm_edge_values():
    """NaN blocks (E8M0 255), E8M0 scale 0 (2**-127: a float32 subnormal weight, flushed
    as XLA's CPU code flushes it), Inf and NaN in x on affine weights, nvfp4 without a
    global scale, batched weights, expert ids out of range (NaN rows)."""
    m = GEMM_M[0]
    qw = _gemm_qw("mxfp4", 4, n=20, k=128)
    scales = np.asarray(qw.scales).copy()
    scales[3, 1], scales[5, 0] = 255, 0
    qw = jq.QuantizedArray(qw.data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    for dt in (jnp.float32, jnp.bfloat16):  # (bfloat16 x: the AMX tiles where the CPU has them)
        x = rand(65, (m, 128), dt)
        y = np.asarray(ffi(jq.qmm, x, qw), np.float32)
        assert np.all(np.isnan(y[:, 3])) and not np.any(np.isnan(np.delete(y, 3, axis=1)))
        assert_matmul_close(np.delete(y, 3, 1), x, np.delete(deq64(qw), 3, 0), dt)

    qa = _gemm_qw("affine", 4, n=20, k=128)
    for dt in (jnp.float32, jnp.bfloat16):
        xa = np.asarray(rand(66, (m, 128), dt), np.float32).copy()
        xa[2, 5], xa[4, 7], xa[6, 9] = np.inf, -np.inf, np.nan
        ya = np.asarray(ffi(jq.qmm, jnp.asarray(xa, dt), qa), np.float32)
        with np.errstate(invalid="ignore"):  # the definition: +-Inf, or NaN (Inf - Inf)
            want = np.asarray(xa, np.float64) @ deq64(qa).T
        finite, nan = np.isfinite(want), np.isnan(want)
        np.testing.assert_array_equal(np.isnan(ya), nan)
        np.testing.assert_array_equal(ya[~finite & ~nan], want[~finite & ~nan])
        assert_matmul_close(ya[[0, 1, 3, 5]], xa[[0, 1, 3, 5]], deq64(qa), dt)
    x = rand(65, (m, 128))

    qn = quantize_for("nvfp4", 4, rand(67, (20, 128)))
    qn = jq.QuantizedArray(qn.data, qn.scales, mode="nvfp4", bits=4, group_size=16,
                           dtype=jnp.float32)  # no global scale
    assert_matmul_close(ffi(jq.qmm, x, qn), x, deq64(qn), jnp.float32)

    qb = quantize_for("affine", 8, rand(68, (3, 20, 128)))
    xb = rand(69, (3, m, 128))
    yb = ffi(jq.qmm, xb, qb)
    assert_matmul_close(yb, xb, deq64(qb), jnp.float32)

    idx = jnp.asarray([2, -1, 3, 0], jnp.int32)
    yg = np.asarray(jax.jit(lambda x, q, i: kernels.gemm_call(x, q, i))(xb[:1], qb, idx))
    w64 = deq64(qb)
    for s, e in enumerate(np.asarray(idx)):
        if 0 <= e < 3:
            assert_matmul_close(yg[s], xb[0], w64[e], jnp.float32)
        else:
            assert np.all(np.isnan(yg[s]))


def test_gemm_threads_same_bits():
    """The GEMM's split over threads (XLA's pool) gives the one-thread bits."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here: no split to compare")
    qw = _gemm_qw("affine", 4, n=200, k=256)
    x = rand(70, (40, 256), jnp.bfloat16)
    before = set_cpu_threads(1)
    try:
        one = np.asarray(ffi(jq.qmm, x, qw), np.float32)
        for t in (2, 3):
            set_cpu_threads(t)
            np.testing.assert_array_equal(np.asarray(ffi(jq.qmm, x, qw), np.float32), one)
    finally:
        set_cpu_threads(0)
    assert CPU_LIB.handle.jq_cpu_threads() == before
    assert_matmul_close(one, x, deq64(qw), jnp.bfloat16)


ISA_NAMES = {"avx512": b"avx512f+bw+vl+dq+vbmi", "avx2": b"avx2+fma+f16c", "neon": b"neon",
             "baseline": b"baseline"}


def test_cpu_isa_is_the_best_or_the_capped_one():
    """The library runs the best ISA the CPU has, or the one JAXQUANT_FFI_CPU_ISA caps it to."""
    import ctypes
    h = CPU_LIB.handle
    h.jq_cpu_isa.restype = ctypes.c_char_p
    flags = set(cpu_flags())
    if not flags or not sys.platform.startswith("linux") or jax.devices()[0].platform != "cpu":
        pytest.skip("needs /proc/cpuinfo (Linux)")
    cap = os.environ.get("JAXQUANT_FFI_CPU_ISA")
    order = ["avx512", "avx2", "baseline"]
    order = order[order.index(cap):] if cap in order else order
    want = next(isa for isa in order if set(CPU_ISA_FLAGS[isa]) <= flags)
    if os.uname().machine in ("aarch64", "arm64"):  # NEON: every arm64 CPU has it
        want = "baseline" if cap == "baseline" else "neon"
    elif os.uname().machine != "x86_64":
        want = "baseline"
    assert h.jq_cpu_isa() == ISA_NAMES[want]


@pytest.mark.parametrize("isa", [pytest.param("avx2", marks=pytest.mark.full),
                                 pytest.param("baseline", marks=pytest.mark.full)])
def test_lower_isas_decode_every_code(isa):  # ~40 s of CPU each: CI's full matrix
    """The tests of the GEMV's decode, shapes and threads again with the kernels of a
    lower ISA (JAXQUANT_FFI_CPU_ISA in a subprocess: the choice is made once a process)."""
    if os.uname().machine != "x86_64" or not set(CPU_ISA_FLAGS[isa]) <= set(cpu_flags()):
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ, JAXQUANT_FFI_CPU_ISA=isa, JAX_PLATFORMS="cpu")
    sel = ("qmv_decodes_every_code or qmv_group_and_tile_shapes or qmv_e8m0_rows or "
           "qmv_threads_same_bits or cpu_isa_is_the_best or gemm_")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        __file__, "-k", sel], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout.splitlines()[-1], p.stdout[-500:]


def test_float64_falls_back_to_reference():
    with enable_x64():
        qw = quantize_for("affine", 4, rand(11, (16, 64)))
        x = rand(12, (2, 64)).astype(jnp.float64)
        np.testing.assert_array_equal(ffi(jq.qmm, x, qw), ref(jq.qmm, x, qw))
        np.testing.assert_array_equal(ffi(jq.dequantize, qw, dtype=jnp.float64),
                                      ref(jq.dequantize, qw, dtype=jnp.float64))
        x64 = rand(13, (3, 8)).astype(jnp.float64)
        np.testing.assert_array_equal(ffi(jq.rms_norm, x64), ref(jq.rms_norm, x64))


# ---------------------------------------------------------------------------
# gather_qmm and ragged_qmm


@pytest.mark.parametrize("transpose", [True, False])
def test_gather_qmm_per_slot_x_and_transpose(transpose):
    e, n, k = 3, 64, 64
    w = rand(22, (e, n, k) if transpose else (e, k, n))
    qw = quantize_for("affine", 4, w)
    x = rand(23, (5, 2, k))
    idx = jnp.array([[0, 1], [2, 2], [1, 0], [7, 0], [-3, 2]], jnp.int32)
    y = ffi(jq.gather_qmm, x, qw, idx, transpose=transpose)
    r = ref(jq.gather_qmm, x, qw, idx, transpose=transpose)
    np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5)
    for ti in range(5):
        for j in range(2):
            ei = int(idx[ti, j])
            if 0 <= ei < e:
                np.testing.assert_array_equal(
                    y[ti, j], ffi(jq.qmm, x[ti, j], qw[ei], transpose=transpose))
            else:
                assert np.all(np.isnan(y[ti, j]))


def test_gather_qmm_int64_indices_do_not_wrap():
    with enable_x64():
        qw = quantize_for("mxfp4", 4, rand(24, (2, 16, 64)))
        x = rand(25, (2, 64))
        idx = jnp.array([[1, 2**32 + 1], [0, -(2**32)]], jnp.int64)
        y = np.asarray(ffi(jq.gather_qmm, x, qw, idx))
        assert np.all(np.isnan(y[0, 1])) and np.all(np.isnan(y[1, 1]))
        assert not np.any(np.isnan(y[:, 0]))


def test_gather_qmm_vmap_and_grad():
    qw = quantize_for("nvfp4", 4, rand(26, (3, 16, 64)))
    x = rand(27, (2, 4, 64))
    idx = jnp.array([[[0, 2], [1, 1], [2, 0], [0, 0]], [[1, 2], [2, 2], [0, 1], [1, 0]]])
    y = jax.jit(jax.vmap(lambda x, i: jq.gather_qmm(x, qw, i, backend="ffi")))(x, idx)
    for b in range(2):
        np.testing.assert_array_equal(y[b], ffi(jq.gather_qmm, x[b], qw, idx[b]))
    g = jax.grad(lambda x: jq.gather_qmm(x, qw, idx[0], backend="ffi").sum())(x[0])
    want = deq64(qw)[np.asarray(idx[0])].sum(axis=(1, 2))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,bits", MODES)
def test_ragged_qmm(mode, bits):
    """Every mode, one activation dtype each (float32, float16, bfloat16 in turn) and
    transpose=True and False in turn (the sweep's [4, 24, 128] weights: N=24, K=128, or
    K=24, N=128): bit for bit the reference (the ffi dequantize + the same ragged_dot),
    each live row close to the oracle for its group's expert, rows past
    sum(group_sizes) zero."""
    qw = _sweep_qw(mode, bits)
    i = MODES.index((mode, bits))
    dt, tr = DTYPES[i % len(DTYPES)], i % 2 == 0
    sizes = [3, 0, 4, 1]                     # 8 live rows of 10
    t = 10
    gs = jnp.array(sizes, jnp.int32)
    xs = {(jnp.dtype(dt).name, tr): rand(29, (t, qw.shape[2] if tr else qw.shape[1]), dt)}
    out = jax.jit(lambda xs, qw, gs: {
        key: [jq.ragged_qmm(x, qw, gs, transpose=key[1], backend=b) for b in ("ffi", "reference")]
        for key, x in xs.items()})(xs, qw, gs)
    w64 = deq64(qw)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    live = len(owner)
    for (d, transpose), (y, r) in out.items():
        x = np.asarray(xs[d, transpose], np.float32)
        n = qw.shape[1] if transpose else qw.shape[2]
        assert y.dtype == jnp.dtype(d) and y.shape == (t, n), d
        y, r = np.asarray(y, np.float32), np.asarray(r, np.float32)
        np.testing.assert_array_equal(y, r, err_msg=f"{d} transpose={transpose}")
        assert np.all(y[live:] == 0), d
        for i in range(live):
            assert_matmul_close(y[i], x[i], w64[owner[i]], jnp.dtype(d), transpose)


# ---------------------------------------------------------------------------
# Norms


@pytest.mark.parametrize("d", [1, 7, 64, 128, 256, 5376])
def test_rms_norm(d):
    xs = {jnp.dtype(dt).name: rand(30, (3, 2, d), dt, scale=2.0) for dt in DTYPES}
    ws = {name: rand(31, (d,), x.dtype) for name, x in xs.items()}
    run = jax.jit(lambda xs, ws: {n: (jq.rms_norm(xs[n], ws[n], backend="ffi"),
                                      jq.rms_norm(xs[n], eps=1e-3, backend="ffi"),
                                      jq.rms_norm(xs[n], ws[n], weight_offset=1.0, backend="ffi"))
                                  for n in xs})
    out = run(xs, ws)
    for name, x in xs.items():
        eps = EPS[jnp.dtype(name)]
        tol = dict(rtol=4 * eps + 1e-6, atol=4 * eps + 1e-6)
        w = ws[name]
        for y, want in zip(out[name], [rms64(x, w), rms64(x, eps=1e-3), rms64(x, w, off=1.0)]):
            assert y.dtype == x.dtype and y.shape == x.shape
            np.testing.assert_allclose(np.asarray(y, np.float64), want, err_msg=name, **tol)


def test_add_rms_norm():
    d = 320
    cases = [(dt, xdt) for dt in DTYPES for xdt in (jnp.float32, jnp.bfloat16)]
    args = [(rand(32, (4, d), xdt), rand(33, (4, d), dt), rand(34, (d,), jnp.float32))
            for dt, xdt in cases]
    y = jax.jit(lambda args: [jq.add_rms_norm(*a, backend="ffi") for a in args])(args)
    r = jax.jit(lambda args: [jq.add_rms_norm(*a, backend="reference") for a in args])(args)
    for (dt, _), (x, res, w), (yi, hi), (_, hr) in zip(cases, args, y, r):
        assert yi.dtype == dt and hi.dtype == dt
        np.testing.assert_array_equal(np.asarray(hi, np.float32), np.asarray(hr, np.float32))
        eps = EPS[jnp.dtype(dt)]
        np.testing.assert_allclose(np.asarray(yi, np.float64), rms64(hi, w), rtol=4 * eps + 1e-6,
                                   atol=4 * eps + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype):
    d = 256
    x, gate, w = rand(35, (3, d), jnp.float32), rand(36, (3, d), dtype), rand(37, (d,), dtype)
    combos = [(a, b, g) for a in ("silu", "sigmoid") for b in (True, False) for g in (None, 64)]
    out = jax.jit(lambda x, gate, w: [
        jq.gated_rms_norm(x, gate, w, activation=a, norm_before_gate=b, group_size=g,
                          backend="ffi") for a, b, g in combos])(x, gate, w)
    eps = EPS[jnp.dtype(dtype)]
    for (activation, before, group), y in zip(combos, out):
        assert y.dtype == dtype
        g = act64(gate, activation)
        want = (rms64(x, w, group=group) * g if before
                else rms64(np.asarray(x, np.float64) * g, w, group=group))
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=8 * eps + 1e-5,
                                   atol=8 * eps + 1e-5, err_msg=str((activation, before, group)))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_norms_per_head_rows(d):
    x = rand(38, (5, 8, d), jnp.bfloat16)
    w = rand(39, (d,), jnp.bfloat16)
    y = ffi(jq.rms_norm, x, w)
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w), rtol=2**-6, atol=2**-6)


def test_norms_vmap_of_the_call_and_batched_weights():
    x, w = rand(40, (3, 4, 16)), rand(41, (3, 16))
    y = jax.jit(jax.vmap(lambda x, w: jf.rms_norm_call(x, w, 1e-6, 0.0)))(x, w)
    for b in range(3):
        np.testing.assert_allclose(y[b], rms64(x[b], w[b]), rtol=1e-5, atol=1e-6)
    y2 = jax.jit(jax.vmap(lambda x, w: jq.rms_norm(x, w, backend="ffi")))(x, w)
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-7)


def test_auto_prefers_ffi_on_cpu():
    qw = quantize_for("mxfp4", 4, rand(42, (16, 64)))
    x = rand(43, (64,))
    text = jax.jit(lambda x: jq.qmm(x, qw)).lower(x).as_text()
    assert "jaxquant_qmv" in text
    text = jax.jit(lambda x: jq.qmm(x, qw, backend="reference")).lower(x).as_text()
    assert "jaxquant_" not in text


def test_kernel_choice_table():
    """configs holds the choice for every platform: what auto takes (GPU: the GEMVs only;
    CPU: also dequantize and large norms), and every kernel is registered for the loaded
    platform with its priority and `platform` passed by the dispatcher."""
    sa = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)
    qw = jax.eval_shape(lambda w: quantize_for("mxfp4", 4, w), sa((64, 128)))
    for platform, max_m in configs.FFI_GEMV_MAX_M.items():
        assert configs.auto_qmm(sa((max_m, 128)), qw, transpose=True, precision=None,
                                platform=platform)
        gemm = configs.FFI_GEMM_MAX_M.get(platform, 0) > max_m  # the CPU's blocked GEMM
        assert configs.auto_qmm(sa((max_m + 1, 128)), qw, transpose=True, precision=None,
                                platform=platform) == gemm
        assert not configs.auto_qmm(sa((1, 64)), qw, transpose=False, precision=None,
                                    platform=platform)
        assert configs.auto_dequantize(qw, dtype=jnp.float32, platform=platform) == (
            platform == "cpu")
        big, small = sa((1 << 16,)), sa((8, 128))
        assert configs.auto_norm(big, None, eps=1e-6, weight_offset=0.0, platform=platform) == (
            platform == "cpu")
        assert not configs.auto_norm(small, None, eps=1e-6, weight_offset=0.0, platform=platform)
        assert not configs.never(sa((4, 128)), qw, sa((1,), jnp.int32), platform=platform)
    # The table's kernels, once per loaded platform. Besides them, only the kernels of a
    # kernel layout (jaxquant/ffi/mma.py on CUDA, cdna4.py on ROCm) register for ffi.
    table = {name: impl for name, impl, *_ in jf.KERNELS}
    ffi_kernels = {name: [k for k in ks if k.backend == "ffi"]
                   for name, ks in dispatch._KERNELS.items()}
    ffi_kernels = {name: ks for name, ks in ffi_kernels.items() if ks}
    assert set(table) <= set(ffi_kernels)
    for name, ks in ffi_kernels.items():
        from_table = [k for k in ks if k.impl is table.get(name)]
        if name in table:
            assert [k.platforms for k in from_table] == [(p,) for p in jf.loaded_platforms()], name
            assert all(k.priority == dispatch.PRIORITY["ffi"][k.platforms[0]] for k in from_table), name
        layout_kernels = [k for k in ks if k.impl is not table.get(name)]
        assert all(k.impl.__module__ in ("jaxquant.ffi.mma", "jaxquant.ffi.cdna4")
                   for k in layout_kernels), name


def test_baseline_isa_matches():
    """The kernels compiled for the baseline ISA give the same results."""
    code = r"""
import ctypes, jax, jax.numpy as jnp, numpy as np, jaxquant as jq, jaxquant.ffi as jf
h = jf.libraries()["cpu"].handle
h.jq_cpu_isa.restype = ctypes.c_char_p
assert h.jq_cpu_isa() == b"baseline", h.jq_cpu_isa()
out = {}
for mode, bits in [("affine", 4), ("affine", 6), ("mxfp4", 4), ("mxfp8_e5m2", 8), ("nvfp4", 4),
                   ("iq4nl", 4)]:
    qw = jq.quantize(jax.random.normal(jax.random.key(0), (24, 128)), mode=mode,
                     bits=bits if mode == "affine" else None)
    x = jax.random.normal(jax.random.key(1), (20, 128), jnp.bfloat16)  # 2 rows: GEMV; 20: GEMM
    out[f"{mode}-{bits}-"] = [np.asarray(jax.jit(lambda q: jq.dequantize(q, jnp.bfloat16, backend="ffi"))(qw), np.float32),
                             np.asarray(jax.jit(lambda x: jq.qmm(x[:2], qw, backend="ffi"))(x), np.float32),
                             np.asarray(jax.jit(lambda x: jq.qmm(x, qw, backend="ffi"))(x), np.float32)]
x = jax.random.normal(jax.random.key(2), (3, 200), jnp.float16)
out["rms-0-"] = [np.asarray(jax.jit(lambda x: jq.rms_norm(x, backend="ffi"))(x), np.float32)]
np.savez(OUT, **{k + str(i): a for k, v in out.items() for i, a in enumerate(v)})
"""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, JAXQUANT_FFI_CPU_ISA="baseline", JAX_PLATFORMS="cpu")
        path = os.path.join(d, "base.npz")
        subprocess.run([sys.executable, "-c", f"OUT = {path!r}\n" + code], check=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
        base = np.load(path)
        for key in base.files:
            mode, bits, i = key.split("-")
            bits, i = int(bits), int(i)
            if mode == "rms":
                x = jax.random.normal(jax.random.key(2), (3, 200), jnp.float16)
                np.testing.assert_allclose(base[key], rms64(x), rtol=4e-3, atol=4e-3)
                continue
            qw = jq.quantize(jax.random.normal(jax.random.key(0), (24, 128)), mode=mode,
                             bits=bits if mode == "affine" else None)
            if i == 0:  # dequantize: bit for bit in either ISA, and the reference's
                deq = jax.jit(lambda q: jq.dequantize(q, jnp.bfloat16, backend="ffi"))(qw)
                np.testing.assert_array_equal(base[key], np.asarray(deq, np.float32))
                if mode == "affine":  # one float32 rounding of the oracle's exact value
                    once = deq64(qw).astype(np.float32).astype(ml_dtypes.bfloat16)
                    np.testing.assert_array_equal(base[key], once.astype(np.float32))
                if mode != "affine" or xla_rounds_affine_once():
                    np.testing.assert_array_equal(base[key], np.asarray(
                        ref(jq.dequantize, qw, dtype=jnp.bfloat16), np.float32))
            else:
                x = jax.random.normal(jax.random.key(1), (20, 128), jnp.bfloat16)
                x = x[:2] if i == 1 else x
                assert_matmul_close(base[key], x, deq64(qw), jnp.bfloat16)


# ---------------------------------------------------------------------------
# The handlers' validation: every error path, called directly.


def _call(target, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs, vmap_method="sequential")(
        *a, **attrs))(*args)


def _fmt(fmt=0, bits=4, group_size=64):
    return dict(fmt=np.int64(fmt), bits=np.int64(bits), group_size=np.int64(group_size))


E0 = np.zeros((0,), np.float32)
SDS = jax.ShapeDtypeStruct


def _affine(n=4, k=128, dt=np.float32):
    return (np.zeros((n, k * 4 // 32), np.uint32), np.ones((n, k // 64), dt),
            np.zeros((n, k // 64), dt))


DEQ_BAD = {
    "fmt": (lambda d, s, b: (d, s, b, E0), SDS((4, 128), np.float32), _fmt(fmt=9), "fmt=9"),
    "fmt_negative": (lambda d, s, b: (d, s, b, E0), SDS((4, 128), np.float32), _fmt(fmt=-1),
                     "not a format id"),
    "bits": (lambda d, s, b: (d, s, b, E0), SDS((4, 128), np.float32), _fmt(bits=7), "bits=7"),
    "group": (lambda d, s, b: (d, s, b, E0), SDS((4, 128), np.float32), _fmt(group_size=48),
              "group_size=48"),
    "data_dtype": (lambda d, s, b: (d.astype(np.int32), s, b, E0), SDS((4, 128), np.float32),
                   _fmt(), "data must be uint32"),
    "data_rank0": (lambda d, s, b: (np.uint32(0), np.float32(1), np.float32(0), E0),
                   SDS((), np.float32), _fmt(), "rank >= 1"),
    "words": (lambda d, s, b: (d[:, :6], s, b, E0), SDS((4, 48), np.float32), _fmt(),
              "multiple of bits"),
    "scales_rank": (lambda d, s, b: (d, s[None], b, E0), SDS((4, 128), np.float32), _fmt(),
                    "scales must have data's rank"),
    "scales_lead": (lambda d, s, b: (d, s[:3], b[:3], E0), SDS((4, 128), np.float32), _fmt(),
                    "on all axes but the last"),
    "scales_last": (lambda d, s, b: (d, s[:, :1], b[:, :1], E0), SDS((4, 128), np.float32),
                    _fmt(), "K/group_size"),
    "scales_dtype_affine": (lambda d, s, b: (d, s.astype(np.uint8), b.astype(np.uint8), E0),
                            SDS((4, 128), np.float32), _fmt(), "scales must be float32"),
    "scales_dtype_mx": (lambda d, s, b: (d, np.ones((4, 4), np.float32), E0, E0),
                        SDS((4, 128), np.float32), _fmt(fmt=1, group_size=32),
                        "scales must be uint8"),
    "biases_missing": (lambda d, s, b: (d, s, E0, E0), SDS((4, 128), np.float32), _fmt(),
                       "biases must match scales"),
    "biases_shape": (lambda d, s, b: (d, s, np.zeros((4, 3), np.float32), E0),
                     SDS((4, 128), np.float32), _fmt(), "biases must match scales"),
    "biases_extra": (lambda d, s, b: (d, np.ones((4, 4), np.uint8), np.ones((4, 4), np.uint8), E0),
                     SDS((4, 128), np.float32), _fmt(fmt=1, group_size=32), "has no biases"),
    "gs_extra": (lambda d, s, b: (d, s, b, np.ones((1,), np.float32)), SDS((4, 128), np.float32),
                 _fmt(), "has no global_scale"),
    "gs_dtype": (lambda d, s, b: (d, np.ones((4, 8), np.uint8), E0, np.ones((1,), np.int32)),
                 SDS((4, 128), np.float32), _fmt(fmt=6, group_size=16),
                 "global_scale must be float32"),
    "gs_count": (lambda d, s, b: (d, np.ones((4, 8), np.uint8), E0, np.ones((3,), np.float32)),
                 SDS((4, 128), np.float32), _fmt(fmt=6, group_size=16), "global_scale must be"),
    "k_group": (lambda d, s, b: (d[:, :12], s, b, E0), SDS((4, 96), np.float32), _fmt(),
                r"K=96 must be a multiple of group_size=64"),
    "biases_dtype": (lambda d, s, b: (d, s, b.astype(np.float16), E0), SDS((4, 128), np.float32),
                     _fmt(), r"biases must match scales \(\(4, 2\), float32\)"),
    "out_dtype": (lambda d, s, b: (d, s, b, E0), SDS((4, 128), np.int32), _fmt(),
                  "output must be float32"),
    "out_shape": (lambda d, s, b: (d, s, b, E0), SDS((4, 127), np.float32), _fmt(),
                  "output must have shape"),
}


@pytest.mark.parametrize("case", sorted(DEQ_BAD))
def test_dequantize_handler_rejects(case):
    make, out, attrs, msg = DEQ_BAD[case]
    with pytest.raises(jax.errors.JaxRuntimeError, match=msg):
        _call("jaxquant_dequantize", out, *make(*_affine()), **attrs)


def _qmv_ok():
    d, s, b = _affine(n=8, k=128)
    return dict(x=np.ones((1, 2, 128), np.float32), d=d[None], s=s[None], b=b[None], gs=E0,
                idx=np.zeros((0,), np.int32), out=SDS((1, 2, 8), np.float32))


QMV_BAD = {
    "data_rank": (dict(d=np.zeros((8, 16), np.uint32), s=np.ones((8, 2), np.float32),
                       b=np.zeros((8, 2), np.float32)), "rank 3"),
    "x_dtype": (dict(x=np.ones((1, 2, 128), np.int32)), "x must be float32"),
    "x_rank": (dict(x=np.ones((2, 128), np.float32)), r"x must be \[Sx, M, K"),
    "x_k": (dict(x=np.ones((1, 2, 64), np.float32)), "K=128"),
    "y_dtype": (dict(out=SDS((1, 2, 8), np.float16)), "output must have x's dtype"),
    "y_shape": (dict(out=SDS((1, 2, 9), np.float32)), "output must be"),
    "slots": (dict(out=SDS((3, 2, 8), np.float32), idx=np.zeros((3,), np.int32),
                   x=np.ones((2, 2, 128), np.float32)), "must divide"),
    "indices_dtype": (dict(idx=np.zeros((1,), np.float32)), "indices must be int32"),
    "indices_shape": (dict(idx=np.zeros((2,), np.int32)), "indices must be int32"),
    "no_indices": (dict(out=SDS((2, 2, 8), np.float32), x=np.ones((2, 2, 128), np.float32)),
                   "must equal E"),
    "format": (dict(attrs=_fmt(bits=9)), "bits=9"),
    "scales_last": (dict(s=np.ones((1, 8, 3), np.float32)), "K/group_size"),
    "k_group": (dict(d=np.zeros((1, 8, 12), np.uint32), x=np.ones((1, 2, 96), np.float32)),
                r"K=96 must be a multiple of group_size=64"),
}


@pytest.mark.parametrize("target", ["jaxquant_qmv", "jaxquant_gemm"])  # one validation
@pytest.mark.parametrize("case", sorted(QMV_BAD))
def test_qmv_handler_rejects(case, target):
    change, msg = dict(QMV_BAD[case][0]), QMV_BAD[case][1]
    a = _qmv_ok()
    attrs = change.pop("attrs", _fmt())
    a.update(change)
    with pytest.raises(jax.errors.JaxRuntimeError, match=msg):
        _call(target, a["out"], a["x"], a["d"], a["s"], a["b"], a["gs"], a["idx"], **attrs)


@pytest.mark.parametrize("target", ["jaxquant_qmv", "jaxquant_gemm"])
def test_qmv_handler_ok_call(target):
    a = _qmv_ok()
    y = _call(target, a["out"], a["x"], a["d"], a["s"], a["b"], a["gs"], a["idx"], **_fmt())
    np.testing.assert_array_equal(y, np.zeros((1, 2, 8), np.float32))


X = np.ones((3, 16), np.float32)
NORM_ATTRS = dict(eps=np.float32(1e-6), weight_offset=np.float32(0))
NORM_BAD = {
    "x_dtype": ("jaxquant_rms_norm", SDS((3, 16), np.int32), (X.astype(np.int32), E0),
                NORM_ATTRS, "x must be float32"),
    "x_rank": ("jaxquant_rms_norm", SDS((), np.float32), (np.float32(1), E0), NORM_ATTRS,
               "rank >= 1"),
    "eps": ("jaxquant_rms_norm", SDS((3, 16), np.float32), (X, E0),
            dict(NORM_ATTRS, eps=np.float32(-1)), "eps must be >= 0"),
    "weight_shape": ("jaxquant_rms_norm", SDS((3, 16), np.float32), (X, np.ones((15,), np.float32)),
                     NORM_ATTRS, "weight must be"),
    "weight_lead": ("jaxquant_rms_norm", SDS((3, 16), np.float32),
                    (X, np.ones((2, 16), np.float32)), NORM_ATTRS, "weight must be"),
    "weight_dtype": ("jaxquant_rms_norm", SDS((3, 16), np.float32), (X, np.ones((16,), np.int32)),
                     NORM_ATTRS, "weight must be float32"),
    "out": ("jaxquant_rms_norm", SDS((3, 16), np.float16), (X, E0), NORM_ATTRS,
            "output must have"),
    "residual_shape": ("jaxquant_add_rms_norm", (SDS((3, 16), np.float32),) * 2,
                       (X, X[:2], E0), NORM_ATTRS, "residual must have x's shape"),
    "residual_dtype": ("jaxquant_add_rms_norm", (SDS((3, 16), np.float32),) * 2,
                       (X, X.astype(np.int32), E0), NORM_ATTRS, "residual must be float32"),
    "h_dtype": ("jaxquant_add_rms_norm", (SDS((3, 16), np.float32), SDS((3, 16), np.float16)),
                (X, X, E0), NORM_ATTRS, "h must have"),
    "gate_shape": ("jaxquant_gated_rms_norm", SDS((3, 16), np.float32), (X, X[:, :8], E0),
                   dict(NORM_ATTRS, activation=np.int64(0), norm_before_gate=np.int64(1),
                        group_size=np.int64(0)), "gate must have x's shape"),
    "activation": ("jaxquant_gated_rms_norm", SDS((3, 16), np.float32), (X, X, E0),
                   dict(NORM_ATTRS, activation=np.int64(5), norm_before_gate=np.int64(1),
                        group_size=np.int64(0)), "activation=5"),
    "group": ("jaxquant_gated_rms_norm", SDS((3, 16), np.float32), (X, X, E0),
              dict(NORM_ATTRS, activation=np.int64(0), norm_before_gate=np.int64(1),
                   group_size=np.int64(5)), "group_size=5"),
    "gate_dtype": ("jaxquant_gated_rms_norm", SDS((3, 16), np.float32),
                   (X, X.astype(np.int32), E0),
                   dict(NORM_ATTRS, activation=np.int64(0), norm_before_gate=np.int64(1),
                        group_size=np.int64(0)), "gate must be float32"),
    "add_out_dtype": ("jaxquant_add_rms_norm", (SDS((3, 16), np.float16), SDS((3, 16), np.float32)),
                      (X, X, E0), NORM_ATTRS, "output must have .* residual's"),
    "gated_out_dtype": ("jaxquant_gated_rms_norm", SDS((3, 16), np.float16), (X, X, E0),
                        dict(NORM_ATTRS, activation=np.int64(0), norm_before_gate=np.int64(1),
                             group_size=np.int64(0)), "gate's"),
}


@pytest.mark.parametrize("case", sorted(NORM_BAD))
def test_norm_handlers_reject(case):
    target, out, args, attrs, msg = NORM_BAD[case]
    with pytest.raises(jax.errors.JaxRuntimeError, match=msg):
        _call(target, out, *args, **attrs)


def test_zero_sized_calls():
    qw = quantize_for("affine", 4, rand(50, (0, 64)))
    assert ffi(jq.dequantize, qw).shape == (0, 64)
    x = rand(51, (2, 64))
    assert ffi(jq.qmm, x, qw).shape == (2, 0)
    assert ffi(jq.rms_norm, jnp.zeros((0, 8))).shape == (0, 8)


def test_gemm_rows_follow_the_kernel_the_device_runs(monkeypatch):
    # the wgmma GEMM (compute capability 9.0) beats dequantize + cuBLAS up to
    # MMA_GEMM_MAX_M_SM90 rows; it needs every tile's scales 4-byte aligned (else
    # the mma.sync GEMM runs, which wins up to MMA_GEMM_MAX_M only), like plan_gemm
    aligned = jq.quantize(jnp.ones((40, 256), jnp.bfloat16), mode="affine")      # 40 x 4 x 2 B
    odd = jq.quantize(jnp.ones((37, 192), jnp.bfloat16), mode="affine")          # 37 x 3 x 2 B
    mx = jq.quantize(jnp.ones((36, 128), jnp.bfloat16), mode="mxfp4")            # 36 x 4 x 1 B
    for cap, want in (("9.0", configs.MMA_GEMM_MAX_M_SM90), ("8.0", configs.MMA_GEMM_MAX_M),
                      (None, configs.MMA_GEMM_MAX_M)):
        monkeypatch.setattr(configs, "_cuda_capability", lambda cap=cap: cap)
        assert configs.mma_gemm_max_m(aligned) == want
        assert configs.mma_gemm_max_m(mx) == want
        assert configs.mma_gemm_max_m(odd) == configs.MMA_GEMM_MAX_M
    # $JAXQUANT_GEMM_KERNEL=mma runs the mma.sync GEMM on 9.0 too: its rows
    monkeypatch.setattr(configs, "_cuda_capability", lambda: "9.0")
    monkeypatch.setenv("JAXQUANT_GEMM_KERNEL", "mma")
    assert configs.mma_gemm_max_m(aligned) == configs.MMA_GEMM_MAX_M
    assert configs.MMA_GEMM_MAX_M_SM90 > configs.MMA_GEMM_MAX_M


# ---------------------------------------------------------------------------
# On an NVIDIA (or AMD) GPU: the gpu_src/ kernels.

def _gpu_platform():
    try:
        backend = jax.default_backend()
    except Exception:  # noqa: BLE001
        return None
    return {"gpu": "cuda"}.get(backend, backend) if backend in ("gpu", "cuda", "rocm") else None


PLATFORM = _gpu_platform()
# Why the GPU tests skip here, or None: no GPU, or the GPU ffi library not usable.
GPU_SKIP = ("needs a GPU (JAX's default backend is not gpu)" if PLATFORM is None else
            f"the GPU ffi library is not usable: {jf.unavailable_reason(PLATFORM)}"
            if jf.unavailable_reason(PLATFORM) is not None else None)
needs_gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")

f32 = lambda a: np.asarray(a, np.float32)
QUICK = os.environ.get("JQ_GPU_TEST_QUICK") == "1"  # (compute-sanitizer runs: fewer cases)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits", MODES[:1] + MODES[6:8] if QUICK else GPU_NATIVE_MODES)
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


@pytest.mark.gpu
@needs_gpu
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


@pytest.mark.gpu
@needs_gpu
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


@pytest.mark.gpu
@needs_gpu
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


@pytest.mark.gpu
@needs_gpu
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
