"""The Metal backend's kernels (metal_src/*.metal) off macOS.

- syntax: every .metal file through clang with the MSL shim header (tests/metal_shim/);
- numerics: the same sources compiled as C++ against the MSL-on-CPU shim (threadgroups as
  real threads with real barriers, simdgroup operations through shared slots), dispatched
  with the bridge's own plans (metal_src/dispatch_plan.h), against the float64 oracle and
  the reference, with the other backends' tolerances;
- the shim itself: kernels that would deadlock or race on a GPU fail here.

The GPU tests (marked `gpu`): on macOS with the backend built, the same ops on an Apple GPU
through the bridge (.github/workflows/macos.yml runs them); elsewhere they skip, saying
why.
"""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from tests.common import EPS, act64, assert_matmul_close, deq64, rms64
from tests.common import rand as common_rand
from tests.metal_shim import shim

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FORMATS = [("affine", 4, 32), ("affine", 4, 64), ("affine", 4, 128), ("mxfp4", None, 32),
           ("fp4", None, 16), ("fp4", None, 32), ("fp4", None, 64)]


def _np(a, dtype=None):
    return np.asarray(a) if dtype is None else np.asarray(a).astype(dtype)


def rand(seed, shape, scale=1.0):
    """Standard normal float32 from numpy (jax.random would compile once per shape)."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _quantize(mode, bits, group, shape, key, dtype=np.float32):
    """A QuantizedArray of random codes and scales (scales in `dtype`: the kernels read
    float scales in x's dtype), built in numpy: no XLA compilation per shape."""
    rng = np.random.default_rng(key)
    *lead, n, k = shape
    data = rng.integers(0, 2**32, (*lead, n, k // 8), dtype=np.uint32)
    gshape = (*lead, n, k // group)
    biases = None
    if mode == "mxfp4":
        scales = rng.integers(122, 131, gshape).astype(np.uint8)
    else:
        scales = rng.uniform(0.05, 0.5, gshape).astype(dtype)
        if mode == "affine":
            biases = rng.uniform(-1.0, 0.0, gshape).astype(dtype)
    return jq.QuantizedArray(jnp.asarray(data), jnp.asarray(scales),
                             None if biases is None else jnp.asarray(biases), None, mode=mode,
                             bits=4, group_size=group, dtype=dtype)


@pytest.fixture(scope="session")
def metal(tmp_path_factory):
    if shim.cxx() is None:
        pytest.skip("no C++ compiler for the MSL-on-CPU shim")
    # the root shared by this pytest run's xdist workers: the library is built once
    return shim.MetalOnCpu(shim.build_cached(tmp_path_factory.getbasetemp().parent))


# ---------------------------------------------------------------------------
# Syntax


CLANG = shutil.which("clang++-19") or shutil.which("clang++")


def _clang_syntax(src, strict):
    """clang -fsyntax-only on an MSL source: `strict` with the address-space shim
    (tests/metal_shim/strict/: device/constant/threadgroup are clang address spaces, so
    mixing them is an error as in MSL; ext_vector types), else the CPU shim it runs on."""
    includes = ([f"-I{shim.SHIM / 'strict'}"] if strict else []) + [f"-I{shim.SHIM}",
                                                                    f"-I{shim.METAL_SRC}"]
    return subprocess.run([CLANG, "-fsyntax-only", "-x", "c++", "-std=c++20", "-Wall", "-Wextra",
                           "-Werror", "-Wno-unknown-attributes", "-Wno-unused-parameter",
                           *includes, str(src)], capture_output=True, text=True)


@pytest.mark.toolchain
@pytest.mark.parametrize("strict", [True, False], ids=["address_spaces", "cpu_shim"])
@pytest.mark.parametrize("src", shim.sources(), ids=lambda p: p.name)
def test_metal_source_syntax(src, strict):
    if CLANG is None:
        pytest.skip("clang++ not found (the MSL syntax check needs it)")
    r = _clang_syntax(src, strict)
    assert r.returncode == 0, r.stderr


@pytest.mark.toolchain
def test_syntax_check_rejects_mixed_address_spaces(tmp_path):
    if CLANG is None:
        pytest.skip("clang++ not found (the MSL syntax check needs it)")
    src = tmp_path / "bad.metal"
    src.write_text('''#include "jq_metal.h"
template <typename T>
kernel void bad(device const T* x [[buffer(0)]], device T* out [[buffer(1)]],
                constant uint& n [[buffer(2)]], JQ_THREAD_IDS) {
  threadgroup float s[32];
  device float* q = s;
  out[tid] = x[tid] + q[0];
}
JQ_KERNEL("bad", bad<float>)
''')
    r = _clang_syntax(src, strict=True)
    assert r.returncode != 0 and "address_space(3)" in r.stderr, r.stderr
    assert _clang_syntax(src, strict=False).returncode == 0  # the CPU shim cannot tell


@pytest.mark.full  # compiles every instantiation (~12 s); CI's full matrix
def test_every_kernel_is_instantiated(metal):
    names = set(metal.kernels())
    for fmt in ("affine4", "mxfp4", "fp4"):
        for dt in ("float32", "float16", "bfloat16"):
            for op in ("qmv", "qmm", "qmm_nax", "dequantize"):
                assert f"jq_{op}_{fmt}_{dt}" in names
    for a in ("float32", "float16", "bfloat16"):
        for kind in ("row4", "head", "wide"):
            assert f"jq_rms_norm_{kind}_{a}" in names
        for b in ("float32", "float16", "bfloat16"):
            assert f"jq_add_rms_norm_{a}_{b}" in names and f"jq_gated_rms_norm_{a}_{b}" in names


# ---------------------------------------------------------------------------
# Quantized matmuls


@pytest.mark.parametrize("mode,bits,group", FORMATS)
def test_qmv_matches_oracle(metal, mode, bits, group):
    """The GEMV (qmm with M <= 8): every format and dtype, M = 1, 3, 8, a row count that
    leaves a threadgroup part empty, K longer than 32 lanes x 32 codes (lanes loop)."""
    for i, (dtype, m, n, k) in enumerate([(np.float32, 1, 5, 1152), (np.float16, 3, 9, 256),
                                          (ml_dtypes.bfloat16, 8, 4, 128)]):
        qw = _quantize(mode, bits, group, (2, n, k), 10 + i, dtype)
        x = _np(rand(20 + i, (2, m, k)), dtype)
        y = metal.qmv(x, qw)
        assert y.dtype == dtype and y.shape == (2, m, n)
        w64 = deq64(qw)
        for e in range(2):
            assert_matmul_close(y[e], x[e], w64[e], jnp.dtype(dtype))


@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 64), ("mxfp4", None, 32),
                                             ("fp4", None, 32)])
def test_expert_gemv_reads_ids_and_nans_bad_ones(metal, mode, bits, group):
    """gather_qmm's slots: the expert id comes from the ids buffer; ids outside [0, E)
    (negative, E, huge) give NaN rows; slots share x (top-k = 3 per token)."""
    e, n, k, tokens, top = 4, 6, 128, 2, 3
    qw = _quantize(mode, bits, group, (e, n, k), 30)
    x = _np(rand(31, (tokens, 1, k)))
    ids = np.array([2, -1, 0, 3, 4, 2**31 - 1], np.int32)
    y = metal.qmv(x, qw, ids)
    assert y.shape == (tokens * top, 1, n)
    w64 = deq64(qw)
    for s, i in enumerate(ids):
        if 0 <= i < e:
            assert_matmul_close(y[s], x[s // top], w64[i], jnp.float32)
        else:
            assert np.isnan(y[s]).all(), s
    # the same expert through the GEMV without ids gives the same bits (one inner routine)
    direct = metal.qmv(x[:1], qw)
    np.testing.assert_array_equal(y[0], direct[2])


def test_mxfp4_gemv_e8m0_edges(metal):
    """E8M0 in the GEMV: 255 in any block makes the row NaN; 254 (2^127) and 0 (2^-127,
    subnormal) are applied exactly, once per block of 32."""
    n, k = 4, 128
    rng = np.random.default_rng(200)
    data = jnp.asarray(rng.integers(0, 2**32, (1, n, k // 8), dtype=np.uint32))
    scales = np.array([[0, 0, 0, 0], [127, 255, 127, 127], [254, 254, 254, 254],
                       [1, 127, 200, 60]], np.uint8)[None]
    qw = jq.QuantizedArray(data, jnp.asarray(scales), None, None, mode="mxfp4", bits=4,
                           group_size=32, dtype=jnp.float32)
    x = rand(201, (1, 1, k), scale=1e-3)  # keeps 2^127 * (x . w) inside float32
    y = metal.qmv(x, qw)[0, 0]
    assert np.isnan(y[1]) and not np.isnan(y[[0, 2, 3]]).any()
    w64 = deq64(qw)[0]
    want = x[0, 0].astype(np.float64) @ w64.T
    np.testing.assert_allclose(y[2], want[2], rtol=1e-5)
    np.testing.assert_allclose(y[3], want[3], rtol=1e-5)
    assert y[0] != 0 and abs(y[0] - want[0]) <= 2.0**-149 * 4  # subnormal, not flushed


@pytest.mark.parametrize("nax", [False, True], ids=["simdgroup_matrix", "nax"])
@pytest.mark.parametrize("mode,bits,group", [("fp4", None, 32), ("fp4", None, 16),
                                             ("affine", 4, 64), ("mxfp4", None, 32)])
def test_qmm_gemm_matches_oracle(metal, nax, mode, bits, group):
    """The GEMM for M > 8: 32 x 32 tiles with masked edges (M, N not multiples of 32),
    batched weights, every dtype."""
    for i, (dtype, b, m, n, k) in enumerate([(np.float32, 1, 9, 40, 64),
                                             (ml_dtypes.bfloat16, 2, 33, 7, 128),
                                             (np.float16, 1, 40, 33, 64)]):
        qw = _quantize(mode, bits, group, (b, n, k), 40 + i, dtype)
        x = _np(rand(50 + i, (b, m, k)), dtype)
        y, (kernel, grid, threads) = metal.qmm(x, qw, nax=nax)
        assert threads == 128 and grid == (-(-n // 32), -(-m // 32), b)
        assert ("nax" in kernel) == nax
        w64 = deq64(qw)
        for j in range(b):
            assert_matmul_close(y[j], x[j], w64[j], jnp.dtype(dtype))


def test_qmm_paths_agree_with_reference_qmm(metal):
    """GEMV and GEMM against jq.qmm(backend='reference') on one problem."""
    qw = _quantize("fp4", None, 32, (24, 256), 60)
    for m in (4, 12):
        x = _np(rand(61 + m, (m, 256)))
        want = np.asarray(jq.qmm(x, qw, backend="reference"))
        qw3 = jax.tree.map(lambda a: a[None], qw)  # a batch of one weight matrix
        got = metal.qmv(x[None], qw3)[0] if m <= 8 else metal.qmm(x[None], qw3)[0][0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Dequantize


def test_mxfp4_dequantize_is_exact_with_e8m0_edges(metal):
    """E8M0 2^(e-127): e = 0 is the subnormal 2^-127 (exact, not flushed), e = 254 the
    largest, e = 255 a NaN block; every E2M1 code; bit for bit the reference in float32."""
    n, k = 6, 64
    codes = np.arange(n * k, dtype=np.uint32) % 16
    data = np.zeros((n, k // 8), np.uint32)
    for j in range(8):
        data |= codes.reshape(n, k // 8, 8)[..., j] << (4 * j)
    scales = np.array([[0, 1], [126, 127], [128, 254], [255, 3], [150, 255], [100, 140]],
                      np.uint8)
    qw = jq.QuantizedArray(jnp.asarray(data), jnp.asarray(scales), None, None, mode="mxfp4",
                           bits=4, group_size=32, dtype=jnp.float32)
    want = np.asarray(jq.dequantize(qw, backend="reference"))
    got = metal.dequantize(qw, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)],
                                  want.view(np.uint32)[~np.isnan(want)])
    assert (np.isnan(got) == np.isnan(want)).all()
    assert np.isnan(got[3, :32]).all() and np.isnan(got[4, 32:]).all()
    tiny = got[0, :32][codes[:32] % 8 != 0]
    assert (np.abs(tiny) > 0).all()  # subnormal results kept
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in float32, as in the kernel
        np.testing.assert_array_equal(got, deq64(qw).astype(np.float32))
    for dtype in (np.float16, ml_dtypes.bfloat16):
        low = metal.dequantize(qw, dtype)
        np.testing.assert_array_equal(low.astype(np.float32),
                                      np.asarray(jq.dequantize(qw, dtype=dtype,
                                                               backend="reference"),
                                                 np.float32))


@pytest.mark.parametrize("mode,bits,group", FORMATS)
def test_dequantize_matches_oracle(metal, mode, bits, group):
    """float32: one rounding of the exact value (affine is one fma, fp4 one product), so
    equal to the oracle rounded; float16/bfloat16 round that float32 once more."""
    for dtype in DTYPES:
        qw = _quantize(mode, bits, group, (3, 5, 128), 70, dtype)
        got = metal.dequantize(qw, dtype)
        want = deq64(qw)
        assert got.dtype == dtype and got.shape == (3, 5, 128)
        if dtype == np.float32:
            np.testing.assert_array_equal(got, want.astype(np.float32))
        else:
            np.testing.assert_array_equal(got, want.astype(np.float32).astype(dtype))


# ---------------------------------------------------------------------------
# Norms


@pytest.mark.parametrize("n,kernel", [(64, "head"), (128, "head"), (256, "head"),
                                      (384, "row4"), (4096, "row4"), (100, "wide"),
                                      (4224, "wide"), (8, "wide")])
def test_rms_norm_geometries(metal, n, kernel):
    for i, dtype in enumerate(DTYPES):
        rows = 9 if kernel == "head" else (1 if n > 1024 else 2)  # 9: a partly empty threadgroup
        x = _np(rand(80 + i, (rows, n), scale=2.0), dtype)
        w = _np(rand(90 + i, (n,)), dtype)
        eps = EPS[jnp.dtype(dtype)]
        tol = dict(rtol=4 * eps + 1e-6, atol=4 * eps + 1e-6)
        cases = [((w,), rms64(x, w)), ((None, 1e-3), rms64(x, eps=1e-3)),
                 ((w, 1e-6, 1.0), rms64(x, w, off=1.0))]
        # 1024-thread groups cost ~1024 OS threads per dispatch: the weight variants once
        for args, want in cases if n <= 1024 else cases[i:i + 1]:
            y, name = metal.rms_norm(x, *args)
            assert name == f"jq_rms_norm_{kernel}_{shim.DTYPE_NAMES[np.dtype(dtype)]}"
            np.testing.assert_allclose(y.astype(np.float64), want, err_msg=name, **tol)


def test_add_rms_norm(metal):
    """h = (x + residual) rounded once to residual's dtype (as the reference: checked
    against it for one pair, against that rule for the rest); y = rms_norm(h)."""
    n = 320
    for i, (xdt, rdt) in enumerate([(a, b) for a in DTYPES for b in DTYPES]):
        x, r = _np(rand(100 + i, (3, n)), xdt), _np(rand(110 + i, (3, n)), rdt)
        w = _np(rand(120 + i, (n,)), rdt)
        y, h = metal.add_rms_norm(x, r, w, off=0.5)
        assert y.dtype == rdt and h.dtype == rdt
        want_h = (x.astype(np.float32) + r.astype(np.float32)).astype(rdt)
        if xdt == rdt == ml_dtypes.bfloat16:
            want_h = np.asarray(jq.add_rms_norm(x, r, w, backend="reference")[1])
        np.testing.assert_array_equal(h.astype(np.float32), want_h.astype(np.float32))
        eps = EPS[jnp.dtype(rdt)]
        np.testing.assert_allclose(y.astype(np.float64), rms64(h, w, off=0.5),
                                   rtol=4 * eps + 1e-6, atol=4 * eps + 1e-6)
    y, _ = metal.add_rms_norm(x, r)  # no weight
    np.testing.assert_allclose(y.astype(np.float64), rms64(h), rtol=4 * eps + 1e-6,
                               atol=4 * eps + 1e-6)


@pytest.mark.parametrize("gdt", DTYPES)
def test_gated_rms_norm(metal, gdt):
    n = 256
    x, gate = _np(rand(130, (3, n))), _np(rand(131, (3, n)), gdt)
    w = _np(rand(132, (n,)), gdt)
    eps = EPS[jnp.dtype(gdt)]
    for activation in ("silu", "sigmoid"):
        for before in (True, False):
            for group in (None, 64):
                y = metal.gated_rms_norm(x, gate, w, activation=activation,
                                         norm_before_gate=before, group_size=group)
                g = act64(gate, activation)
                want = (rms64(x, w, group=group) * g if before
                        else rms64(np.asarray(x, np.float64) * g, w, group=group))
                assert y.dtype == gdt
                np.testing.assert_allclose(y.astype(np.float64), want, rtol=8 * eps + 1e-5,
                                           atol=8 * eps + 1e-5,
                                           err_msg=str((activation, before, group)))
    # x in float16 and bfloat16, no weight (weight_offset unused without a weight)
    for xdt in (np.float16, ml_dtypes.bfloat16):
        xl = _np(x, xdt)
        y = metal.gated_rms_norm(xl, gate, None, off=3.0, group_size=128)
        np.testing.assert_allclose(y.astype(np.float64),
                                   rms64(xl, group=128) * act64(gate, "silu"),
                                   rtol=8 * eps + 1e-5, atol=8 * eps + 1e-5)


# ---------------------------------------------------------------------------
# The shim fails what a GPU would get wrong


def _faulty(metal, kernel, threads=64, groups=1, flag=0, timeout_s=1.0):
    out = shim._aligned(np.zeros(groups * threads, np.float32))
    metal.dispatch(kernel, [out, np.array([flag], np.uint32)], (groups, 1, 1), threads,
                   timeout_s=timeout_s)
    return out


def test_shim_fails_a_barrier_not_every_thread_reaches(metal):
    with pytest.raises(shim.ShimError, match="only 32 of 64 threads arrived"):
        _faulty(metal, "faulty_divergent_barrier")


def test_shim_fails_a_simd_op_not_every_lane_reaches(metal):
    with pytest.raises(shim.ShimError, match="simdgroup operation: only 16 of 32"):
        _faulty(metal, "faulty_divergent_simd_sum")


def test_shim_race_without_barrier_is_visible(metal):
    """With the barrier, the reduction is exact in every threadgroup. Without it, some
    thread reads a slot before its simdgroup wrote it in at least one of many runs."""
    good = _faulty(metal, "faulty_racy_sum", threads=256, groups=8, flag=1)
    assert (good == 256).all()
    bad = [_faulty(metal, "faulty_racy_sum", threads=256, groups=8, flag=0) for _ in range(5)]
    assert any((b != 256).any() for b in bad)


def test_shim_rejects_wrong_buffer_count_and_partial_simdgroups(metal):
    out = shim._aligned(np.zeros(64, np.float32))
    with pytest.raises(shim.ShimError, match="takes 2 buffers"):
        metal.dispatch("faulty_racy_sum", [out], (1, 1, 1), 64)
    with pytest.raises(shim.ShimError, match="multiple of 32"):
        metal.dispatch("faulty_racy_sum", [out, np.zeros(1, np.uint32)], (1, 1, 1), 48)


# ---------------------------------------------------------------------------
# The bridge and the Python side, off macOS


@pytest.mark.toolchain
def test_bridge_type_checks():
    """metal_ffi.mm through clang as Objective-C++: its XLA FFI half against the real XLA
    headers, its Metal calls against declarations transcribed from Apple's documentation
    (tests/metal_shim/objc/). Only a Mac compiles and links it for real (macos.yml)."""
    if CLANG is None:
        pytest.skip("clang++ not found")
    r = subprocess.run([CLANG, "-fsyntax-only", "-x", "objective-c++", "-fobjc-arc", "-fblocks",
                        "-fobjc-runtime=macosx-14.0", "-std=c++17", "-Wall", "-Werror",
                        f"-I{shim.SHIM / 'objc'}", f"-I{shim.METAL_SRC}", "-isystem",
                        jax.ffi.include_dir(), str(shim.METAL_SRC / "metal_ffi.mm")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_metal_is_not_listed_off_macos():
    from jaxquant import dispatch
    assert "metal" not in jq.available_backends()
    assert "macOS only" in dispatch.not_built_backends()["metal"]
    with pytest.raises(RuntimeError, match="backend='metal' cannot run here: not built"):
        jq.rms_norm(jnp.ones((2, 8)), backend="metal")


def test_metal_applies_takes_what_the_kernels_serve():
    """What the lowering sends to the bridge (the rest goes to the reference)."""
    from jaxquant.metal import kernels
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    x = sd((3, 64), jnp.bfloat16)
    ok = _quantize("affine", 4, 64, (8, 64), 1, ml_dtypes.bfloat16)
    three_bit = jq.QuantizedArray(jnp.zeros((8, 6), jnp.uint32), ok.scales, ok.biases, None,
                                  mode="affine", bits=3, group_size=64, dtype=jnp.bfloat16)
    f32_scales = _quantize("fp4", None, 32, (8, 64), 1)
    mx = _quantize("mxfp4", None, 32, (8, 64), 1)
    nv = jq.QuantizedArray(mx.data, jnp.zeros((8, 4), jnp.uint8), None, jnp.float32(1.0),
                           mode="nvfp4", bits=4, group_size=16, dtype=jnp.float32)
    qmm = lambda qw, transpose=True: kernels.qmm_applies(x, qw, transpose=transpose, precision=None)
    assert qmm(ok) and qmm(mx)
    assert not qmm(ok, transpose=False)  # x @ W: the reference
    assert not qmm(three_bit) and not qmm(nv)
    assert not qmm(f32_scales)  # float scales must be in x's dtype
    assert kernels.dequantize_applies(mx, dtype=jnp.float16)
    assert not kernels.dequantize_applies(mx, dtype=jnp.float64)
    w = sd((64,), jnp.float32)
    assert kernels.rms_norm_applies(sd((3, 64), jnp.float32), w, eps=1e-6, weight_offset=0.0)
    assert not kernels.rms_norm_applies(x, w, eps=1e-6, weight_offset=0.0)  # weight dtype != x's
    assert kernels.gated_rms_norm_applies(sd((3, 64), jnp.float32), x, None, eps=1e-6,
                                       weight_offset=0.0, activation="silu",
                                       norm_before_gate=True, group_size=None)


# ---------------------------------------------------------------------------
# jq ops with backend="metal" end to end, the bridge's handlers (metal_src/handlers.h)
# running the kernels on the shim: everything but metal_ffi.mm's Metal calls


_TARGETS_REGISTERED = []


@pytest.fixture
def metal_backend(metal):
    """backend="metal" served by the shim for one test (dispatch's state restored after,
    so no other test in this process sees a metal backend off macOS)."""
    if sys.platform == "darwin":
        pytest.skip("macOS has the real backend (this module's gpu tests)")
    from jaxquant import dispatch
    from jaxquant.metal import kernels, loader
    if not _TARGETS_REGISTERED:  # FFI targets can be registered once per process
        for target, symbol in loader.TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(metal.lib, symbol)),
                                        platform="cpu")
        _TARGETS_REGISTERED.append(True)
    not_built = dispatch._NOT_BUILT.pop("metal", None)
    dispatch.register_backend("metal", lambda: None)
    kernels.register_kernels()
    try:
        yield
    finally:
        for kernels in dispatch._KERNELS.values():
            kernels[:] = [k for k in kernels if k.backend != "metal"]
        dispatch._AVAILABILITY.pop("metal", None)
        if not_built is not None:
            dispatch._NOT_BUILT["metal"] = not_built


def _on_metal(f, *args, **kw):
    return jax.jit(lambda *a: f(*a, **kw, backend="metal"))(*args)


@pytest.mark.parametrize("mode,group", [("affine", 64), ("mxfp4", 32), ("fp4", 16)])
def test_jq_qmm_on_metal(metal_backend, mode, group):
    for dtype, m in [(np.float32, 1), (ml_dtypes.bfloat16, 8), (np.float16, 9),
                     (np.float32, 37)]:
        qw = _quantize(mode, None, group, (2, 24, 96 if group != 64 else 128), 140 + m, dtype)
        x = _np(rand(150 + m, (2, m, qw.shape[-1])), dtype)
        text = jax.jit(lambda x: jq.qmm(x, qw, backend="metal")).lower(x).as_text()
        assert ("jaxquant_metal_qmv" if m <= 8 else "jaxquant_metal_qmm") in text
        y = np.asarray(_on_metal(jq.qmm, x, qw))
        w64 = deq64(qw)
        for b in range(2):
            assert_matmul_close(y[b], x[b], w64[b], jnp.dtype(dtype))


def test_jq_gather_qmm_on_metal(metal_backend):
    """Expert ids read on the GPU; ids outside [0, E) give NaN rows; every slot equals
    qmm on its expert bit for bit (docs/ops.md's gather_qmm invariant: one inner routine)."""
    qw = _quantize("mxfp4", None, 32, (4, 16, 64), 160)
    x = _np(rand(161, (3, 64)))
    idx = jnp.array([[0, 3], [-1, 2], [4, 1]], jnp.int32)
    y = np.asarray(_on_metal(jq.gather_qmm, x, qw, idx))
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            if 0 <= e < 4:
                np.testing.assert_array_equal(y[t, j], np.asarray(_on_metal(jq.qmm, x[t], qw[e])))
            else:
                assert np.isnan(y[t, j]).all()
    x3 = _np(rand(162, (3, 2, 64)))  # one x per slot
    y3 = np.asarray(_on_metal(jq.gather_qmm, x3, qw, idx))
    assert_matmul_close(y3[2, 1], x3[2, 1], deq64(qw)[1], jnp.float32)
    assert np.isnan(y3[2, 0]).all()


def test_jq_dequantize_and_norms_on_metal(metal_backend):
    qw = _quantize("fp4", None, 32, (2, 8, 64), 170, ml_dtypes.bfloat16)
    got = np.asarray(_on_metal(jq.dequantize, qw, dtype=jnp.bfloat16))
    np.testing.assert_array_equal(got, np.asarray(jq.dequantize(qw, dtype=jnp.bfloat16,
                                                                backend="reference")))
    x, w = _np(rand(171, (2, 3, 128))), _np(rand(172, (128,)))
    np.testing.assert_allclose(np.asarray(_on_metal(jq.rms_norm, x, w)), rms64(x, w),
                               rtol=1e-5, atol=1e-6)
    y = jax.jit(jax.vmap(lambda x: jq.rms_norm(x, w, backend="metal")))(x)
    np.testing.assert_allclose(np.asarray(y), rms64(x, w), rtol=1e-5, atol=1e-6)
    r = _np(rand(173, (2, 3, 128)), ml_dtypes.bfloat16)
    _, h = _on_metal(jq.add_rms_norm, x, r)
    np.testing.assert_array_equal(np.asarray(h), (x + r.astype(np.float32)).astype(r.dtype))
    g = _np(rand(174, (2, 3, 128)))
    y = _on_metal(jq.gated_rms_norm, x, g, w, activation="sigmoid", group_size=32)
    np.testing.assert_allclose(np.asarray(y), rms64(x, w, group=32) * act64(g, "sigmoid"),
                               rtol=1e-5, atol=1e-5)


def test_metal_serves_the_rest_on_the_reference(metal_backend):
    """backend="metal" on what the kernels do not take (x @ W, 8-bit, ragged_qmm): the
    reference's result, no error."""
    qw8 = jq.quantize(jnp.asarray(rand(180, (16, 64))), mode="affine", bits=8)
    x = _np(rand(181, (2, 64)))
    np.testing.assert_array_equal(np.asarray(_on_metal(jq.qmm, x, qw8)),
                                  np.asarray(jq.qmm(x, qw8, backend="reference")))
    qw = _quantize("fp4", None, 32, (2, 16, 64), 182)
    xr = _np(rand(183, (5, 64)))
    sizes = jnp.array([2, 3], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(_on_metal(jq.ragged_qmm, xr, qw, sizes)),
        np.asarray(jq.ragged_qmm(xr, qw, sizes, backend="reference")))


def test_the_bridge_refuses_bad_calls(metal_backend):
    """Calls the lowering never makes, straight through the FFI targets: an error naming
    the problem, nothing read or written."""
    from jaxquant.metal import kernels
    qw = _quantize("fp4", None, 32, (1, 32, 128), 190)
    x = _np(rand(191, (1, 2, 128)))
    attrs = dict(fmt=np.int64(2), group_size=np.int64(32))
    call = lambda name, out, *ops, **kw: jax.ffi.ffi_call(name, out)(*ops, **kw)
    cases = [
        ("the output must be x's dtype", lambda: call(
            "jaxquant_metal_qmm", jax.ShapeDtypeStruct((1, 2, 31), jnp.float32), x, qw.data,
            qw.scales, kernels._biases(qw), **attrs)),
        ("group_size 48", lambda: call(
            "jaxquant_metal_dequantize", jax.ShapeDtypeStruct((1, 32, 128), jnp.float32),
            qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(2), group_size=np.int64(48))),
        ("fmt must be", lambda: call(
            "jaxquant_metal_dequantize", jax.ShapeDtypeStruct((1, 32, 128), jnp.float32),
            qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(7), group_size=np.int64(32))),
        ("ids must be int32", lambda: call(
            "jaxquant_metal_qmv", jax.ShapeDtypeStruct((2, 2, 32), jnp.float32), x, qw.data,
            qw.scales, kernels._biases(qw), jnp.zeros((2,), jnp.float32), **attrs)),
        ("1 to 8 rows", lambda: call(
            "jaxquant_metal_qmv", jax.ShapeDtypeStruct((1, 9, 32), jnp.float32),
            _np(rand(192, (1, 9, 128))), qw.data, qw.scales, kernels._biases(qw),
            jnp.zeros((0,), jnp.int32), **attrs)),
        ("scales must have data's rank and dtype", lambda: call(
            "jaxquant_metal_qmm", jax.ShapeDtypeStruct((1, 2, 32), jnp.float32), x, qw.data,
            qw.scales.astype(jnp.float16), kernels._biases(qw), **attrs)),
        ("weight must be", lambda: call(
            "jaxquant_metal_rms_norm", jax.ShapeDtypeStruct((2, 64), jnp.float32),
            jnp.ones((2, 64)), jnp.ones((63,)), eps=np.float32(1e-6),
            weight_offset=np.float32(0))),
        ("group_size must divide", lambda: call(
            "jaxquant_metal_gated_rms_norm", jax.ShapeDtypeStruct((2, 64), jnp.float32),
            jnp.ones((2, 64)), jnp.ones((2, 64)), jnp.zeros((0,)), eps=np.float32(1e-6),
            weight_offset=np.float32(0), activation=np.int64(0), norm_before_gate=np.int64(1),
            group_size=np.int64(48))),
    ]
    for match, f in cases:
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(f())


def _header_enum(path, name):
    """{enumerator: value} of `enum name : type { kA = 0, ... }` in a metal_src header."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[1] / path).read_text()
    body = re.search(rf"enum\s+{name}\s*:\s*\w+\s*\{{([^}}]*)\}}", text).group(1)
    return {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def test_format_ids_match_the_kernels_header():
    """metal.kernels.FORMAT_IDS is a copy of jq_metal.h's Format enum (the kernels switch on
    these numbers): the same names, in kCamelCase, with the same values; and
    configs.METAL_GEMV_MAX_M is dispatch_plan.h's kGemvMaxM."""
    import re
    from jaxquant.metal import configs, kernels
    header = _header_enum("metal_src/jq_metal.h", "Format")
    assert header, "no Format enum in metal_src/jq_metal.h"
    assert {"k" + name.capitalize(): i for name, i in kernels.FORMAT_IDS.items()} == header
    import pathlib
    plan = (pathlib.Path(__file__).resolve().parents[1] / "metal_src/dispatch_plan.h").read_text()
    assert int(re.search(r"kGemvMaxM\s*=\s*(\d+)", plan).group(1)) == configs.METAL_GEMV_MAX_M


# ---------------------------------------------------------------------------
# On an Apple GPU, through the bridge (macOS with the backend built).

METAL_HERE = "metal" in jq.available_backends()
needs_gpu = pytest.mark.skipif(
    not METAL_HERE,
    reason="" if METAL_HERE else
    f"the metal backend cannot run here: {dispatch.unavailable_reason('metal')}")
GPU_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
GPU_MODES = [("affine", 4, 64), ("mxfp4", None, 32), ("fp4", None, 32), ("fp4", None, 16)]


def on_apple_gpu(f, *args, **kw):
    return jax.jit(lambda *a: f(*a, **kw, backend="metal"))(*args)


@pytest.mark.gpu
@needs_gpu
def test_lowers_to_the_metal_targets():
    qw = jq.quantize(common_rand(0, (64, 128)), mode="mxfp4")
    text = jax.jit(lambda x: jq.qmm(x, qw, backend="metal")).lower(
        common_rand(1, (2, 128))).as_text()
    assert "jaxquant_metal_qmv" in text


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode,bits,group", GPU_MODES)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_qmm_gemv_and_gemm(mode, bits, group, dtype):
    w = common_rand(2, (2, 96, 256)).astype(dtype)  # scales in x's dtype: the kernels' case
    qw = jq.quantize(w, mode=mode, bits=bits, group_size=group)
    for m in (1, 8, 9, 70):  # the GEMV up to 8 rows, the GEMM above (edges masked)
        x = common_rand(3 + m, (2, m, 256)).astype(dtype)
        y = on_apple_gpu(jq.qmm, x, qw)
        assert y.dtype == dtype and y.shape == (2, m, 96)
        w64 = deq64(qw)
        for b in range(2):
            assert_matmul_close(y[b], x[b], w64[b], jnp.dtype(dtype))


@pytest.mark.gpu
@needs_gpu
def test_gather_qmm_bad_ids_give_nan_rows():
    qw = jq.quantize(common_rand(4, (4, 32, 128)), mode="affine", bits=4)
    x = common_rand(5, (3, 128))
    idx = jnp.array([[0, 3], [-1, 2], [4, 1]], jnp.int32)
    y = np.asarray(on_apple_gpu(jq.gather_qmm, x, qw, idx))
    w64 = deq64(qw)
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            if 0 <= e < 4:
                assert_matmul_close(y[t, j], x[t], w64[e], jnp.float32)
                np.testing.assert_array_equal(y[t, j],
                                              np.asarray(on_apple_gpu(jq.qmm, x[t], qw[e])))
            else:
                assert np.isnan(y[t, j]).all()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mxfp4_dequantize_exact(dtype):
    qw = jq.quantize(common_rand(6, (64, 256), scale=1e-37), mode="mxfp4")  # E8M0 near 2^-127
    got = np.asarray(on_apple_gpu(jq.dequantize, qw, dtype=dtype))
    want = np.asarray(jq.dequantize(qw, dtype=dtype, backend="reference"))
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [64, 128, 256, 384, 4096, 100, 5000])
def test_rms_norm_widths(n):
    for dtype in GPU_DTYPES:
        x, w = common_rand(7, (5, n), scale=2.0).astype(dtype), common_rand(8, (n,)).astype(dtype)
        eps = EPS[jnp.dtype(dtype)]
        y = on_apple_gpu(jq.rms_norm, x, w)
        np.testing.assert_allclose(np.asarray(y, np.float64), rms64(x, w),
                                   rtol=4 * eps + 1e-6, atol=4 * eps + 1e-6)


@pytest.mark.gpu
@needs_gpu
def test_add_and_gated_rms_norm():
    x = common_rand(9, (4, 320), dtype=jnp.float32)
    r = common_rand(10, (4, 320), dtype=jnp.bfloat16)
    w = common_rand(11, (320,), dtype=jnp.bfloat16)
    y, h = on_apple_gpu(jq.add_rms_norm, x, r, w)
    _, hr = jq.add_rms_norm(x, r, w, backend="reference")
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hr, np.float32))
    eps = EPS[jnp.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(np.asarray(y, np.float64), rms64(h, w), rtol=4 * eps + 1e-6,
                               atol=4 * eps + 1e-6)
    gate = common_rand(12, (4, 320), dtype=jnp.bfloat16)
    for activation in ("silu", "sigmoid"):
        for before in (True, False):
            for group in (None, 64):
                y = on_apple_gpu(jq.gated_rms_norm, x, gate, w, activation=activation,
                          norm_before_gate=before, group_size=group)
                g = act64(gate, activation)
                want = (rms64(x, w, group=group) * g if before
                        else rms64(np.asarray(x, np.float64) * g, w, group=group))
                np.testing.assert_allclose(np.asarray(y, np.float64), want,
                                           rtol=8 * eps + 1e-5, atol=8 * eps + 1e-5)


@pytest.mark.gpu
@needs_gpu
def test_page_aligned_and_staged_buffers_agree():
    """Sizes that are and are not multiples of the page: the zero-copy and the staged path."""
    for rows in (4, 3):  # 4 x 4096 float32 = 64 KiB (a page multiple); 3 x 4096 is not
        x = common_rand(13, (rows, 4096))
        np.testing.assert_allclose(np.asarray(on_apple_gpu(jq.rms_norm, x)), rms64(x), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.gpu
@needs_gpu
def test_the_bridge_refuses_bad_calls_gpu():
    """Shapes the lowering never sends, straight through the FFI: an error, no crash."""
    from jaxquant.metal import kernels
    qw = jq.quantize(common_rand(14, (1, 32, 128)), mode="fp4")
    bad_out = jax.ShapeDtypeStruct((1, 2, 31), jnp.float32)  # N should be 32
    with pytest.raises(Exception, match="the output must be x's dtype"):
        jax.ffi.ffi_call("jaxquant_metal_qmm", bad_out)(
            common_rand(15, (1, 2, 128)), qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(2),
            group_size=np.int64(32)).block_until_ready()
    with pytest.raises(Exception, match="group_size 48"):
        jax.ffi.ffi_call("jaxquant_metal_dequantize",
                         jax.ShapeDtypeStruct((1, 32, 128), jnp.float32))(
            qw.data, qw.scales, kernels._biases(qw), fmt=np.int64(2),
            group_size=np.int64(48)).block_until_ready()


@pytest.mark.gpu
@needs_gpu
def test_bfloat16_inputs_with_ml_dtypes():
    x = np.asarray(common_rand(17, (2, 128))).astype(ml_dtypes.bfloat16)
    y = on_apple_gpu(jq.rms_norm, x)
    assert y.dtype == jnp.bfloat16
