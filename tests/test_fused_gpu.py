"""The fused decode GEMVs (gpu_src/cuda/gemv_mma.h, FUSE) on an NVIDIA GPU, on the cuda_mma
layout: rms_norm_qmm's norm prologue and qmm_swiglu's epilogue against the unfused ffi
ops (to rounding) and the float64 oracle, every mode x float32/float16/bfloat16 x
M in {1, 2, 8, 16}; gather_qmm_swiglu's on gather slots (bad ids, dedupe, a bias row
per expert); the cases the kernel does not take (I not a multiple of 16, more
than 16 rows, x too large to stage) run the unfused kernels; the handler's checks.
Skipped without a CUDA GPU and library (tools/gpu/check_decode.sh runs it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.ffi as jf
from tests.common import DTYPES, EPS, MODES, deq64, quantize_for, rand, rms64
from tests.test_fused import swiglu64


def _fused_kernel():
    try:
        from jaxquant.ffi import mma
        lib = jf.libraries().get("cuda")
        return (jax.default_backend() in ("gpu", "cuda") and "cuda" in jf.loaded_platforms()
                and hasattr(lib.handle, "jq_gpu_gemv_mma_fused"), mma)
    except Exception:  # noqa: BLE001
        return False, None


_HAVE, mma = _fused_kernel()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _HAVE, reason="needs an NVIDIA GPU and the CUDA library "
                                                   "with the fused GEMV (jq_gpu_gemv_mma_fused)")]

MS = (1, 2, 8, 16)
ACTS = [dict(activation="silu"), dict(activation="gpt_oss", limit=7.0, alpha=1.702)]


def _packed(mode, bits, shape, key=0, scale=2.0):
    w = rand(key, shape, jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32, scale=scale)
    qw = quantize_for(mode, bits, w)
    return qw, jq.prepack(qw, layout="cuda_mma")


def _targets(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def f64(a):
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("mode,bits", MODES)
def test_rms_norm_qmm_kernel(mode, bits):
    # N = 48: three tiles; K = 192: three chunks
    qw, packed = _packed(mode, bits, (48, 192), key=bits)
    w64 = deq64(qw)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, 192), dt, scale=3.0) for dt in DTYPES for m in MS}
    ws = {jnp.dtype(dt).name: rand(99, (192,), dt) for dt in DTYPES}
    norm = lambda x, w, q: jq.rms_norm_qmm(x, w, q, eps=1e-5, weight_offset=0.5, backend="ffi")
    assert "jaxquant_gemv_mma_fused" in _targets(norm, xs["bfloat16", 1], ws["bfloat16"], packed)
    fused = jax.jit(lambda xs, ws, q: {k: norm(x, ws[k[0]], q) for k, x in xs.items()})(
        xs, ws, packed)
    unfused = jax.jit(lambda xs, ws, q: {
        k: jq.qmm(jq.rms_norm(x, ws[k[0]], eps=1e-5, weight_offset=0.5), q, backend="ffi")
        for k, x in xs.items()})(xs, ws, packed)
    for (name, m), y in fused.items():
        eps = EPS[jnp.dtype(name)]
        x = xs[name, m]
        assert y.dtype == jnp.dtype(name) and y.shape == (m, 48)
        h64 = rms64(x, ws[name], eps=1e-5, off=0.5)
        mag = np.abs(h64) @ np.abs(w64).T
        # against the unfused kernels: the normalized x may round the other way (one
        # ulp of h; float32 x meets the MMA as two bf16 terms, ~2^-17 of each element:
        # the GEMV's K x 2^-24 term), then the output's rounding
        gemv = (2 * eps + 192 * 2.0**-24) * mag
        bound = gemv + 2 * eps * np.abs(f64(unfused[name, m])) + 1e-30
        assert np.all(np.abs(f64(y) - f64(unfused[name, m])) <= bound), (name, m)
        # against the float64 oracle: h rounded to x's dtype, the GEMV's bound
        want = h64 @ w64.T
        bound = eps * mag + gemv + eps * np.abs(want) + 1e-30
        assert np.all(np.abs(f64(y) - want) <= bound), (name, m)


@pytest.mark.parametrize("mode,bits", MODES)
def test_qmm_swiglu_kernel(mode, bits):
    # I = 32: two gate tiles and two up tiles; every dtype, M, activation, with and
    # without a bias, in one program per side
    i, k = 32, 192
    qw, packed = _packed(mode, bits, (2 * i, k), key=bits + 1, scale=0.5)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, k), dt) for dt in DTYPES for m in MS}
    bias = {jnp.dtype(dt).name: rand(77, (2 * i,), dt) for dt in DTYPES}
    cases = [(key, a, with_bias) for key in xs for a in range(len(ACTS))
             for with_bias in (False, True)]

    def run(one):
        return jax.jit(lambda xs, bs, q: {
            c: one(xs[c[0]], q, bs[c[0][0]] if c[2] else None, ACTS[c[1]]) for c in cases})(
                xs, bias, packed)
    fused_one = lambda x, q, b, act: jq.qmm_swiglu(x, q, bias=b, backend="ffi", **act)
    assert "jaxquant_gemv_mma_fused" in _targets(
        lambda x, q: fused_one(x, q, None, ACTS[0]), xs["bfloat16", 1], packed)
    fused, unfused = run(fused_one), run(_unfused_swiglu)
    for c in cases:
        (name, m), a, with_bias = c
        y, eps = fused[c], EPS[jnp.dtype(name)]
        assert y.dtype == jnp.dtype(name) and y.shape == (m, i)
        # the halves are the unfused GEMV's outputs bit for bit; the activation's exp
        # (a few float32 ulps: 2^-20) and the output's rounding may differ (float16's
        # smallest subnormal, 2^-24, absolute)
        np.testing.assert_allclose(f64(y), f64(unfused[c]), rtol=max(4 * eps, 2.0**-20),
                                   atol=2.0**-24,
                                   err_msg=f"{name} M={m} {ACTS[a]} bias={with_bias}")


def _unfused_swiglu(x, q, bias, act):
    """The composition on the unfused ffi GEMV, its epilogue in jnp (float32)."""
    y = jq.qmm(x, q, backend="ffi").astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    gate, up = jnp.split(y, 2, axis=-1)
    if act["activation"] == "silu":
        return (jax.nn.silu(gate) * up).astype(x.dtype)
    gate, up = jnp.minimum(gate, act["limit"]), jnp.clip(up, -act["limit"], act["limit"])
    return ((up + 1) * gate * jax.nn.sigmoid(gate * act["alpha"])).astype(x.dtype)


# gather_qmm_swiglu's slots: one token's four experts with a repeat and an id past E
# (a NaN row); three tokens sharing experts (dedupe: segments of up to 8 rows); 16
# tokens of one expert (a 16-row segment, the two-n-tile kernel)
GATHER_IDS = {"t1": np.array([[3, 0, 3, 7]], np.int32),
              "t3": np.array([[1, 4], [4, 1], [1, -2]], np.int32),
              "t16": np.full((16, 1), 2, np.int32)}


def _unfused_gather_swiglu(x, q, idx, bias, act):
    """The composition on the unfused ffi gather GEMV, its epilogue in jnp (float32)."""
    y = jq.gather_qmm(x, q, idx, backend="ffi").astype(jnp.float32)
    if bias is not None:
        y = y + bias[jnp.clip(idx, 0, bias.shape[0] - 1)].astype(jnp.float32)
    gate, up = jnp.split(y, 2, axis=-1)
    if act["activation"] == "silu":
        return (jax.nn.silu(gate) * up).astype(x.dtype)
    gate, up = jnp.minimum(gate, act["limit"]), jnp.clip(up, -act["limit"], act["limit"])
    return ((up + 1) * gate * jax.nn.sigmoid(gate * act["alpha"])).astype(x.dtype)


@pytest.mark.parametrize("mode,bits", MODES)
def test_gather_qmm_swiglu_kernel(mode, bits):
    # E = 5 experts of I = 32 (two gate and two up tiles), K = 192; every dtype, slot
    # set, activation, x per token or per slot, with and without a bias [E, 2I]
    e, i, k = 5, 32, 192
    qw, packed = _packed(mode, bits, (e, 2 * i, k), key=bits + 2, scale=0.5)
    names = [jnp.dtype(dt).name for dt in DTYPES]
    xs = {(n, ids, per_slot): rand(len(ids) + 3 * per_slot,
                                   GATHER_IDS[ids].shape + (k,) if per_slot
                                   else (GATHER_IDS[ids].shape[0], k), jnp.dtype(n))
          for n in names for ids in GATHER_IDS for per_slot in (False, True)}
    bias = {n: rand(78, (e, 2 * i), jnp.dtype(n)) for n in names}
    cases = [(key, a, with_bias) for key in xs for a in range(len(ACTS))
             for with_bias in (False, True)]

    def run(one):
        return jax.jit(lambda xs, bs, q: {
            c: one(xs[c[0]], q, GATHER_IDS[c[0][1]], bs[c[0][0]] if c[2] else None, ACTS[c[1]])
            for c in cases})(xs, bias, packed)
    fused_one = lambda x, q, idx, b, act: jq.gather_qmm_swiglu(x, q, idx, bias=b, backend="ffi",
                                                               **act)
    assert "jaxquant_gemv_mma_fused" in _targets(
        lambda x, q: fused_one(x, q, GATHER_IDS["t1"], None, ACTS[1]), xs["bfloat16", "t1", False],
        packed)
    fused, unfused = run(fused_one), run(_unfused_gather_swiglu)
    w64 = deq64(qw)
    for c in cases:
        (name, ids, per_slot), a, with_bias = c
        idx = GATHER_IDS[ids]
        y, eps = fused[c], EPS[jnp.dtype(name)]
        assert y.dtype == jnp.dtype(name) and y.shape == idx.shape + (i,)
        bad = (idx < 0) | (idx >= e)
        assert np.all(np.isnan(f64(y)[bad])), c
        # as qmm_swiglu's: the halves are the unfused GEMV's bit for bit, the
        # activation's exp and the output's rounding may differ
        np.testing.assert_allclose(f64(y), f64(unfused[c]), rtol=max(4 * eps, 2.0**-20),
                                   atol=2.0**-24, err_msg=str(c))
        if name != "float16" and a == 1:  # the float64 oracle (gpt_oss clamps), valid slots
            x = xs[c[0]]
            for t, j in zip(*np.nonzero(~bad)):
                want, bound = _swiglu_oracle((x[t, j] if per_slot else x[t])[None],
                                             w64[idx[t, j]], name,
                                             bias[name][idx[t, j]] if with_bias else None)
                assert np.all(np.abs(f64(y[t, j]) - want[0]) <= bound[0]), (c, t, j)


def _swiglu_oracle(x, w64, dt, bias=None):
    """The float64 act(gate, up) of x [M, K] and w64 [2I, K] (gpt_oss, limit 7) and the
    bound a GEMV's output meets: its product's (rounded to dt) through the activation."""
    eps, x64 = EPS[jnp.dtype(dt)], f64(x)
    g = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    b = (2 * eps + x64.shape[-1] * 2.0**-24) * mag + eps * np.abs(g)  # the GEMV's output
    if bias is not None:
        g = g + f64(bias)
    i = w64.shape[0] // 2
    want, (dg, du) = swiglu64(g[..., :i], g[..., i:], "gpt_oss", 7.0)
    return want, dg * b[..., :i] + du * b[..., i:] + 2 * eps * np.abs(want) + 1e-30


def test_qmm_swiglu_affine4_eight_warps():
    # K = 4096 (64 chunks): warps_for gives 4, the affine 4-bit SwiGLU variant takes 8
    # (swiglu_warps): its halves are summed in another float32 order than the unfused
    # GEMV's; both within the GEMV's bound of the float64 oracle
    i, k = 48, 4096
    qw, packed = _packed("affine", 4, (2 * i, k), key=21, scale=0.5)
    w64 = deq64(qw)
    for dt in DTYPES:
        for m in (1, 4):
            x = rand(30 + m, (m, k), dt)
            y = jq.qmm_swiglu(x, packed, activation="gpt_oss", limit=7.0, backend="ffi")
            z = _unfused_swiglu(x, packed, None, ACTS[1])
            want, bound = _swiglu_oracle(x, w64, dt)
            assert np.all(np.abs(f64(y) - want) <= bound), (dt, m)
            assert np.all(np.abs(f64(z) - want) <= bound), (dt, m)


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("nvfp4", 4)])
def test_qmm_swiglu_oracle_many_tiles(mode, bits):
    # I = 16 * 300: 300 blocks, each a gate tile and the up tile 300 tiles further
    i, k = 16 * 300, 256
    qw, packed = _packed(mode, bits, (2 * i, k), key=3, scale=0.5)
    w64 = deq64(qw)
    for dt in DTYPES:
        for m in (1, 16):
            x = rand(m + 5, (m, k), dt)
            y = jq.qmm_swiglu(x, packed, activation="gpt_oss", limit=7.0, backend="ffi")
            want, bound = _swiglu_oracle(x, w64, dt)
            assert np.all(np.abs(f64(y) - want) <= bound), (dt, m)


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("mxfp8_e4m3", 8)])
def test_rms_norm_qmm_long_k(mode, bits):
    # K = 4096: four warps of 16 chunks; x (8 KiB at M = 1 in bf16) staged and normalized
    qw, packed = _packed(mode, bits, (37, 4096), key=11)
    w = rand(12, (4096,), jnp.bfloat16)
    for dt in DTYPES:
        for m in (1, 4):
            x = rand(7 + m, (m, 4096), dt)
            y = jq.rms_norm_qmm(x, w.astype(dt), packed, backend="ffi")
            z = jq.qmm(jq.rms_norm(x, w.astype(dt)), packed)
            eps = EPS[jnp.dtype(dt)]
            mag = np.abs(rms64(x, w)) @ np.abs(deq64(qw)).T
            bound = (2 * eps + 4096 * 2.0**-24) * mag + 2 * eps * np.abs(f64(z))
            assert np.all(np.abs(f64(y) - f64(z)) <= bound), (dt, m)


def test_cases_the_kernel_does_not_take_run_unfused():
    k = 192
    _, packed = _packed("mxfp4", 4, (48, k), key=1)  # I = 24: not whole tiles
    x = rand(1, (2, k), jnp.bfloat16)
    text = _targets(lambda x, q: jq.qmm_swiglu(x, q, backend="ffi"), x, packed)
    assert "jaxquant_gemv_mma_fused" not in text and "jaxquant_qmv_mma" in text
    np.testing.assert_allclose(f64(jq.qmm_swiglu(x, packed, backend="ffi")),
                               f64(_unfused_swiglu(x, packed, None, dict(activation="silu"))),
                               rtol=2**-7)
    x17 = rand(2, (17, k), jnp.bfloat16)  # more than 16 rows
    assert "jaxquant_gemv_mma_fused" not in _targets(
        lambda x, q: jq.rms_norm_qmm(x, None, q, backend="ffi"), x17, packed)
    # the fallback is the unfused ops on the backend asked for: the GPU norm kernel
    # (whose rounding may differ from XLA's reference norm by an ulp), then the GEMV
    np.testing.assert_array_equal(f64(jq.rms_norm_qmm(x17, None, packed, backend="ffi")),
                                  f64(jq.qmm(jq.rms_norm(x17, backend="ffi"), packed,
                                             backend="ffi")))
    _, big = _packed("affine", 4, (32, 8192), key=2)  # 16 x 32 KiB of float32 x: not staged
    xb = rand(3, (16, 8192), jnp.float32)
    assert "jaxquant_gemv_mma_fused" not in _targets(
        lambda x, q: jq.rms_norm_qmm(x, None, q, backend="ffi"), xb, big)
    np.testing.assert_array_equal(f64(jq.rms_norm_qmm(xb, None, big, backend="ffi")),
                                  f64(jq.qmm(jq.rms_norm(xb, backend="ffi"), big,
                                             backend="ffi")))


def test_automatic_choice_takes_the_fused_kernel_where_it_is_faster():
    """configs.FUSED_MAX_ROWS: the fused kernel up to its rows of x, the unfused ops above;
    gather_qmm_swiglu's only when asked for."""
    from jaxquant.ffi import configs

    _, packed = _packed("mxfp4", 4, (64, 192), key=4)
    w = rand(5, (192,), jnp.bfloat16)
    ops = {"rms_norm_qmm": lambda x, q: jq.rms_norm_qmm(x, w, q),
           "qmm_swiglu": lambda x, q: jq.qmm_swiglu(x, q)}
    for op, f in ops.items():
        most = configs.FUSED_MAX_ROWS[op]
        for m, fused in ((1, True), (most, True), (most + 1, False)):
            text = _targets(f, rand(4, (m, 192), jnp.bfloat16), packed)
            assert ("jaxquant_gemv_mma_fused" in text) == fused, (op, m)
            # the unfused ops still run the tensor-core GEMV, not a fallback
            assert fused or "jaxquant_qmv_mma" in text, (op, m)
    # gather_qmm_swiglu: opt-in (configs.py): the gather GEMV, then XLA's epilogue
    _, experts = _packed("mxfp4", 4, (3, 64, 192), key=5)
    idx = jnp.array([[0, 2]], jnp.int32)
    for backend, fused in ((None, False), ("ffi", True)):
        text = _targets(lambda x, q: jq.gather_qmm_swiglu(x, q, idx, backend=backend),
                        rand(4, (1, 192), jnp.bfloat16), experts)
        assert ("jaxquant_gemv_mma_fused" in text) == fused and "jaxquant_qmv_mma" in text


def test_handler_checks():
    k = 128
    _, packed = _packed("mxfp4", 4, (32, k))
    q3 = mma._flat_qw(packed)
    x = rand(0, (1, 2, k), jnp.bfloat16)
    call = lambda *a, **kw: jax.block_until_ready(mma.gemv_mma_fused_call(*a, **kw))
    with pytest.raises(Exception, match="norm weight must be"):
        call(x, q3, jnp.ones((k + 1,), jnp.float32), fuse=mma.FUSE_NORM)
    with pytest.raises(Exception, match="bias must be"):
        call(x, q3, jnp.ones((k,), jnp.float32), fuse=mma.FUSE_SWIGLU)
    with pytest.raises(Exception, match="fuse must be"):
        call(x, q3, None, fuse=3)
    _, odd = _packed("mxfp4", 4, (48, k))
    with pytest.raises(Exception, match="I a multiple of 16"):
        call(x, mma._flat_qw(odd), None, fuse=mma.FUSE_SWIGLU)
    _, big = _packed("affine", 4, (32, 8192))
    with pytest.raises(Exception, match="stages x in shared memory"):
        call(rand(0, (1, 16, 8192), jnp.float32), mma._flat_qw(big), None, fuse=mma.FUSE_NORM)
    # gather_qmm_swiglu: a bias row per expert; no indices with the norm
    _, experts = _packed("mxfp4", 4, (3, 32, k))
    ids, x1 = jnp.array([0, 2], jnp.int32), rand(0, (2, 1, k), jnp.bfloat16)
    with pytest.raises(Exception, match=r"bias must be .*\[3, 32\]"):
        call(x1, experts, jnp.ones((32,), jnp.float32), fuse=mma.FUSE_SWIGLU, indices=ids)
    with pytest.raises(Exception, match="takes no indices"):
        call(x1, experts, None, fuse=mma.FUSE_NORM, indices=ids)
    with pytest.raises(Exception, match="1 per gather slot"):
        call(rand(0, (2, 2, k), jnp.bfloat16), experts, None, fuse=mma.FUSE_SWIGLU, indices=ids)
