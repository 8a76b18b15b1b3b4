"""The gfx950 kernel (gpu_src/rocm/cdna4_qmm.hip) without an AMD GPU:

- address walk: include/jq/cdna4_layout.h, compiled for the CPU with the
  walker tests/cdna4_walk.cc, sends every (tile, K step, lane, register byte)
  to the byte the Python layout put there (the consumer agrees with the
  producer) and reads each byte exactly once;
- emulation: the kernel's loop on the CPU with the same header and an emulated
  scaled MFMA (the instruction's operand semantics, written out in the walker)
  against the float64 oracle: the numerics of the design (x split into E4M3
  terms, E8M0 scales through op_sel, NaN scales);
- the x split (jaxquant/ffi/cdna4.py) exact where docs/cdna4.md says;
- the gfx950 compile (toolchain): the scaled MFMA is in the assembly, with all
  four weight-scale bytes, and the code object is gfx950's.
What none of this proves: the instruction's behaviour on silicon (its operand
layout is AMD's documented one, not measured here) and the speed.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.ffi import cdna4 as ffi_cdna4
from jaxquant.ffi import configs as ffi_configs
from jaxquant.layouts import cdna4
from tests.common import assert_matmul_close, deq64, rand

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/clang++) for tests/cdna4_walk.cc")
    exe = tmp_path_factory.mktemp("cdna4") / "cdna4_walk"
    p = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-I", str(ROOT / "include"),
                        str(ROOT / "tests" / "cdna4_walk.cc"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return exe


def _planes_through(fn, index, *args):
    """Apply a uint8 permutation to a uint32 index array, one byte plane at a time."""
    out = 0
    for shift in (0, 8, 16, 24):
        plane = jnp.asarray(((index >> shift) & 0xFF).astype(np.uint8))
        out = out | (np.asarray(fn(plane, *args)).astype(np.uint32) << shift)
    return out


@pytest.mark.parametrize("N,K", [(16, 256), (32, 512), (48, 768), (112, 1024), (64, 2048)])
def test_address_walk_lands_on_the_layouts_bytes(walker, tmp_path, N, K):
    kb, ks = K // 2, K // 32
    bsrc = _planes_through(cdna4.preshuffle_b, np.arange(1, N * kb + 1, dtype=np.uint32)
                           .reshape(N, kb))
    ssrc = _planes_through(cdna4.preshuffle_scales, np.arange(1, N * ks + 1, dtype=np.uint32)
                           .reshape(N, ks))
    (tmp_path / "b").write_bytes(bsrc.astype("<u4").tobytes())
    (tmp_path / "s").write_bytes(ssrc.astype("<u4").tobytes())
    p = subprocess.run([str(walker), "walk", str(N), str(K), "3", str(tmp_path / "b"),
                        str(tmp_path / "s")], capture_output=True, text=True)
    assert p.returncode == 0 and "0 failures" in p.stdout, p.stdout + p.stderr


def test_the_walk_catches_a_wrong_layout(walker, tmp_path):
    """The walk fails against a layout with two lanes' bytes swapped (it can fail)."""
    N, K = 16, 256
    kb, ks = K // 2, K // 32
    bsrc = _planes_through(cdna4.preshuffle_b, np.arange(1, N * kb + 1, dtype=np.uint32)
                           .reshape(N, kb)).ravel()
    bsrc[[16, 32]] = bsrc[[32, 16]]
    ssrc = _planes_through(cdna4.preshuffle_scales, np.arange(1, N * ks + 1, dtype=np.uint32)
                           .reshape(N, ks))
    (tmp_path / "b").write_bytes(bsrc.astype("<u4").tobytes())
    (tmp_path / "s").write_bytes(ssrc.astype("<u4").tobytes())
    p = subprocess.run([str(walker), "walk", str(N), str(K), "2", str(tmp_path / "b"),
                        str(tmp_path / "s")], capture_output=True, text=True)
    assert p.returncode == 1 and "FAIL weight" in p.stderr, p.stdout + p.stderr


def _emulate(walker, tmp_path, x3, packed):
    """The kernel's loop on the CPU: float32 y [B, M, N] before the output rounding."""
    b, m, k = x3.shape
    n = packed.shape[-2]
    xq, xs = ffi_cdna4.split_x(x3, ffi_cdna4.TERMS[jnp.dtype(x3.dtype)])
    files = {}
    for name, arr in (("xq", xq), ("xs", xs), ("w", packed.data), ("ws", packed.scales)):
        files[name] = tmp_path / name
        files[name].write_bytes(np.ascontiguousarray(np.asarray(arr)).tobytes())
    y = tmp_path / "y"
    p = subprocess.run([str(walker), "emulate", str(b), str(m), str(n), str(k),
                        str(xq.shape[1]), *(str(files[f]) for f in ("xq", "xs", "w", "ws")),
                        str(y)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return np.frombuffer(y.read_bytes(), np.float32).reshape(b, m, n)


@pytest.mark.parametrize("dtype,B,M,N,K", [
    (jnp.bfloat16, 1, 1, 48, 512),
    (jnp.bfloat16, 2, 5, 32, 256),
    (jnp.float16, 1, 17, 16, 768),
    (jnp.float16, 2, 3, 80, 256),
    (jnp.bfloat16, 1, 2, 16, 2048),  # 8 waves split K
    (jnp.float16, 1, 1, 32, 1024),   # 4 waves
])
def test_emulated_kernel_matches_the_oracle(walker, tmp_path, dtype, B, M, N, K):
    w = rand(B + N, (B, N, K), scale=2.0)
    qw = jq.quantize(w, mode="mxfp4")
    packed = jq.prepack(qw, layout="cdna4")
    # x with a wide range across blocks (the split's scales), some exact zeros
    x = rand(M + K, (B, M, K), jnp.float32) * jnp.exp2(
        jax.random.randint(jax.random.key(7), (B, M, K // 32, 1), -10, 10)).repeat(32, -1).reshape(
        B, M, K)
    x = x.at[..., :32].set(0.0).astype(dtype)
    y = _emulate(walker, tmp_path, x, packed)
    w64 = deq64(qw)
    x64 = np.asarray(x, np.float64)
    want = np.einsum("bmk,bnk->bmn", x64, w64)
    mag = np.einsum("bmk,bnk->bmn", np.abs(x64), np.abs(w64))
    # float32 accumulation over K, and the split's 2^-17-of-the-block-amax per element
    amax = np.abs(x64).reshape(B, M, K // 32, 32).max(-1).repeat(32, -1)
    split = np.einsum("bmk,bnk->bmn", amax, np.abs(w64)) * 2.0**-17
    bound = K * 2.0**-24 * mag + split + 1e-30
    assert np.all(np.abs(y - want) <= bound), np.max(np.abs(y - want) / bound)
    # and, rounded to x's dtype as the kernel stores it, within the suite's matmul bound
    assert_matmul_close(jnp.asarray(y).astype(dtype), x, w64, dtype)


def test_emulated_kernel_nan_scale_makes_a_nan_column(walker, tmp_path):
    qw = jq.quantize(rand(1, (1, 48, 512)), mode="mxfp4")
    scales = qw.scales.at[0, 37, 9].set(255)  # row 37: in the second tile of pair 1
    qw = jq.QuantizedArray(qw.data, scales, mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    y = _emulate(walker, tmp_path, rand(2, (1, 3, 512), jnp.bfloat16),
                 jq.prepack(qw, layout="cdna4"))
    assert np.all(np.isnan(y[0, :, 37]))
    assert not np.any(np.isnan(np.delete(y, 37, axis=2)))


@pytest.mark.parametrize("dtype,terms,exact_within", [(jnp.bfloat16, 2, 2.0**-9),
                                                      (jnp.float16, 3, 2.0**-5)])
def test_split_x_is_exact_where_documented(dtype, terms, exact_within):
    x = (rand(0, (2, 7, 1024)) * jnp.exp2(jax.random.randint(
        jax.random.key(1), (2, 7, 1024), -14, 14).astype(jnp.float32))).astype(dtype)
    x = x.at[0, 0, :32].set(0.0).at[1, 2, 64:96].set(jnp.finfo(dtype).max)
    xq, xs = ffi_cdna4.split_x(x, terms)
    assert xq.shape == (2, terms, 16, 1024) and xq.dtype == jnp.uint8
    assert xs.shape == (2, 16, 32) and xs.dtype == jnp.uint8
    back = np.asarray(ffi_cdna4.join_x(xq, xs, 7), np.float64)
    xf = np.asarray(x, np.float64)
    amax = np.abs(xf).reshape(2, 7, 32, 32).max(-1, keepdims=True).repeat(32, -1).reshape(xf.shape)
    near = np.abs(xf) >= exact_within * amax
    np.testing.assert_array_equal(back[near], xf[near])
    assert np.all(np.abs(back - xf) <= 2.0**-17 * amax)
    assert np.all(np.asarray(xq)[:, :, 7:] == 0)  # the M padding rows are zeros
    # every term is a finite E4M3 (no 0x7F/0xFF NaN codes), every scale a finite E8M0
    assert not np.any((np.asarray(xq) & 0x7F) == 0x7F) and np.all(np.asarray(xs) < 255)


def test_applies_only_to_the_cdna4_layout_on_gfx950(monkeypatch):
    qw = jq.quantize(rand(0, (32, 256)), mode="mxfp4")
    x = jax.ShapeDtypeStruct((1, 256), jnp.bfloat16)
    packed = jq.prepack(qw, layout="cdna4")
    kw = dict(platform="rocm", transpose=True, precision=None)
    monkeypatch.setattr(ffi_cdna4, "_is_gfx950", lambda: True)
    assert ffi_cdna4.qmm_applies(x, packed, **kw)
    assert ffi_cdna4.qmm_applies(jax.ShapeDtypeStruct((1, 256), jnp.float16), packed, **kw)
    assert not ffi_cdna4.qmm_applies(x, qw, **kw)  # canonical: the other kernels
    assert not ffi_cdna4.qmm_applies(jax.ShapeDtypeStruct((1, 256), jnp.float32), packed, **kw)
    assert not ffi_cdna4.qmm_applies(x, packed, platform="rocm", transpose=False, precision=None)
    monkeypatch.setattr(ffi_cdna4, "_is_gfx950", lambda: False)
    assert not ffi_cdna4.qmm_applies(x, packed, **kw)  # another GPU: the reference


@pytest.mark.slow
@pytest.mark.toolchain
def test_gfx950_compile_has_the_scaled_mfma():
    sys.path.insert(0, str(ROOT / "tools" / "toolchain"))
    import cdna4_compile_check as ccc  # noqa: PLC0415
    clang, why = ccc.find_toolchain()
    if clang is None:
        pytest.skip(why)
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "toolchain" / "cdna4_compile_check.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    if p.returncode == 3:
        pytest.skip(summary["skipped"])
    assert p.returncode == 0, p.stdout + p.stderr
    # 6 kernels (1-3 terms x bf16/f16 out), each 2 tiles x 2 K steps x terms MFMAs per K pair
    assert len(summary["kernels"]) == 6, summary
    assert summary["mfma_scale_count"] == 4 * (1 + 2 + 3) * 2, summary
    assert summary["weight_scale_bytes"] == [0, 1, 2, 3], summary
    assert summary["x_scale_bytes"] == [0], summary
    assert "unexpected_formats" not in summary, summary
    assert summary["code_object_is_gfx950"], summary


def _lower_for_rocm(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",)).as_text()


def test_rocm_lowering_calls_the_kernel_for_cdna4_weights(monkeypatch):
    """The wiring without a GPU: registered as jaxquant.ffi does when the ROCm library
    loads, on a (pretended) gfx950 qmm lowers to the kernel's custom call behind the
    non-finite fallback; other dtypes, layouts and transpose=False do not."""
    from jaxquant import dispatch  # noqa: PLC0415
    monkeypatch.setattr(ffi_cdna4, "_is_gfx950", lambda: True)
    kernels = dispatch._KERNELS.setdefault("qmm", [])
    before = len(kernels)
    ffi_cdna4.register()
    try:
        qw = jq.quantize(rand(0, (2, 48, 512)), mode="mxfp4")
        packed = jq.prepack(qw, layout="cdna4")
        S = jax.ShapeDtypeStruct
        hlo = _lower_for_rocm(lambda x, w: jq.qmm(x, w), S((2, 3, 512), jnp.bfloat16), packed)
        assert hlo.count("@jaxquant_cdna4_qmm") == 1 and "stablehlo.case" in hlo, hlo[:2000]
        assert "jaxquant_cdna4_qmm" in _lower_for_rocm(lambda x, w: jq.qmm(x, w[1]),
                                                       S((1, 512), jnp.float16), packed)
        # automatic choice: up to configs.CDNA4_AUTO_MAX_M rows; backend="ffi" takes any M
        big = S((ffi_configs.CDNA4_AUTO_MAX_M + 1, 512), jnp.bfloat16)
        assert "jaxquant_cdna4_qmm" not in _lower_for_rocm(lambda x, w: jq.qmm(x, w), big,
                                                           packed[0])
        with jq.backend("ffi"):
            monkeypatch.setitem(dispatch._AVAILABILITY, "ffi", lambda: None)
            assert "jaxquant_cdna4_qmm" in _lower_for_rocm(lambda x, w: jq.qmm(x, w), big,
                                                           packed[0])
        for x, w, t in ((S((3, 512), jnp.float32), packed[0], True),
                        (S((3, 512), jnp.bfloat16), qw[0], True),
                        (S((3, 48), jnp.bfloat16), packed[0], False)):
            hlo = _lower_for_rocm(lambda x, w, t=t: jq.qmm(x, w, transpose=t), x, w)
            assert "jaxquant_cdna4_qmm" not in hlo
    finally:
        del kernels[before:]
