"""The tensor-core prefill GEMM (gpu_src/cuda/qmm_gemm.h) on an NVIDIA GPU, on the
cuda_mma layout: qmm with M > 16 for every mode and 16-bit activation dtype
against the float64 oracle (N with a canonical tail, K of 1..many chunks,
batched weights), ragged_qmm's edge cases (empty groups, all rows in one group,
T not a multiple of the row block, rows past sum(group_sizes) zero, sizes past
T), its few-rows path through the decode GEMV, `auto` picking both, and ragged_matmul's
grouped GEMM on float experts (qmm_wgmma.h) with the same edge cases.
Skipped without a CUDA GPU and library (tools/gpu/check_prefill.sh runs it)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from jaxquant.ffi import configs
from tests.common import GPU_NATIVE_MODES, assert_matmul_close, cuda_library, deq64, rand
from tests.test_decode_gpu import _packed
from tests.test_pallas_attention import attention64, scores64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_library(),
                                 reason="needs an NVIDIA GPU and the CUDA library")]

X16 = (jnp.float16, jnp.bfloat16)


def _gemm_used(f, *args):
    return "jaxquant_qmm_gemm" in jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_qmm_every_mode_and_dtype(mode, bits):
    # N = 37: two tiles and a canonical tail of 5 rows; K = 192: 3 chunks, fewer than
    # the K-split warps of a narrow block; M = 17 .. 200: partial row blocks
    qw, packed = _packed(mode, bits, (37, 192), key=bits)
    w64 = deq64(qw)
    for dt in X16:
        for m in (17, 64, 200):
            x = rand(m, (m, 192), dt)
            y = jq.qmm(x, packed, backend="ffi")
            assert y.dtype == jnp.dtype(dt)
            assert_matmul_close(y, x, w64, jnp.dtype(dt))
    assert _gemm_used(lambda x, q: jq.qmm(x, q, backend="ffi"), x, packed)


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_qmm_every_mode_aligned_scales(mode, bits):
    # N = 136 (8 full tiles and a canonical tail of 8: two blocks of the Hopper kernel,
    # the second mostly past N), K = 256: every tile's scales 4-byte aligned, which the
    # wgmma kernel (gpu_src/cuda/qmm_wgmma.h) needs; on an H100 it runs this (N = 37 above
    # takes the mma.sync kernel), $JAXQUANT_GEMM_KERNEL=mma runs the other
    qw, packed = _packed(mode, bits, (136, 256), key=bits + 40)
    w64 = deq64(qw)
    for dt in X16:
        for m in (17, 64, 65, 130):
            x = rand(m + 1, (m, 256), dt)
            assert_matmul_close(jq.qmm(x, packed, backend="ffi"), x, w64, jnp.dtype(dt))


@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 32), ("affine", 4, 128),
                                             ("fp4", 4, 16), ("nvfp4", 4, 16)])
def test_qmm_long_k_wide_n_batched(mode, bits, group):
    # 2 matrices [2, 700, 2048]: 44 tiles (a tail of 12 rows), 32 chunks; the row
    # tiles per block follow the grid size, so several block widths run
    qw, packed = _packed(mode, bits, (2, 700, 2048), key=5, group_size=group)
    w64 = deq64(qw)
    for m in (33, 300):
        x = rand(m, (2, m, 2048), jnp.bfloat16)
        assert_matmul_close(jq.qmm(x, packed, backend="ffi"), x, w64, jnp.bfloat16)


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4)])
def test_qmm_rows_per_block_follow_the_grid(mode, bits):
    if os.environ.get("JAXQUANT_GEMM_KERNEL") == "mma":
        pytest.skip("about the wgmma kernel's row blocks; $JAXQUANT_GEMM_KERNEL=mma forces "
                    "the mma.sync kernel, whose bits differ between M = 512 and M = 64 here")
    # M = 512: the Hopper kernel takes 256 rows of x per block on a long grid (N = 16384:
    # 128 x 2 blocks) and 128 on a short one (the first 1024 rows of that weight: 8 x 2
    # blocks of 256 would leave most SMs idle; gpu_src/cuda/qmm_gemm.h, wgmma_rows_per_block);
    # and 64 from at most 64 rows; either way the oracle's product, and the same numbers
    # for the same rows (K = 512 is 8 chunks: too few for the K split at 64 rows, which
    # changes the order of a row's sums)
    qw, packed = _packed(mode, bits, (16384, 512), key=bits + 60)
    head = jq.prepack(qw[:1024], layout="cuda_mma")
    w64 = deq64(qw)
    x = rand(61, (512, 512), jnp.bfloat16)
    y = jq.qmm(x, packed, backend="ffi")
    y_head = jq.qmm(x, head, backend="ffi")
    assert_matmul_close(y, x, w64, jnp.bfloat16)
    assert_matmul_close(y_head, x, w64[:1024], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y_head), np.asarray(y[:, :1024]))
    for m in (64, 40):  # 64 rows per block (40: the block's last 24 rows past x's end)
        y_m = jq.qmm(x[:m], packed, backend="ffi")
        np.testing.assert_array_equal(np.asarray(y_m), np.asarray(y[:m]))


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("nvfp4", 4),
                                       ("mxfp8_e4m3", 8)])
def test_qmm_k_split_over_a_cluster(mode, bits):
    if os.environ.get("JAXQUANT_GEMM_KERNEL") == "mma":
        pytest.skip("about the wgmma kernel's K split; $JAXQUANT_GEMM_KERNEL=mma forces "
                    "the mma.sync kernel")
    # M <= 64 rows on a grid of at most one block per SM: each output tile's K is split
    # over a cluster of blocks (gpu_src/cuda/qmm_gemm.h, wgmma_ksplit). K = 4160: 65
    # chunks. N = 16 * 80 + 8: 11 blocks, four a tile on a GPU of 44 SMs or more (17,
    # 17, 17 and 14 chunks); N = 16 * 320 + 8: 41 blocks, two a tile on one of 41 to 163
    # SMs (an H100's or H200's 132: 33 and 32). The last block has a canonical tail and
    # warps past N (every tile's scales 4-byte aligned, as the wgmma kernel needs).
    # Block 0 adds the others' accumulators in one fixed order: a second run has the
    # same bits.
    k = 4160
    for n in (16 * 80 + 8, 16 * 320 + 8):
        qw, packed = _packed(mode, bits, (n, k), key=bits + n)
        w64 = deq64(qw)
        for dt in X16:
            for m in (17, 40, 64):
                x = rand(m + 81, (m, k), dt)
                y = jq.qmm(x, packed, backend="ffi")
                assert_matmul_close(y, x, w64, jnp.dtype(dt))
                np.testing.assert_array_equal(np.asarray(y),
                                              np.asarray(jq.qmm(x, packed, backend="ffi")))


def _ragged64(x, w64, sizes):
    """float64 oracle: row t uses the expert of its group; rows past the groups 0."""
    t = x.shape[0]
    owner = np.full(t, -1)
    start = 0
    for e, s in enumerate(np.maximum(np.asarray(sizes), 0)):
        owner[start:min(start + s, t)] = e
        start = min(start + s, t)
    want = np.zeros((t, w64.shape[1]))
    x64 = np.asarray(x, np.float64)
    for e in range(w64.shape[0]):
        rows = owner == e
        want[rows] = x64[rows] @ w64[e].T
    return want, owner


def _check_ragged(y, x, w64, sizes, dtype):
    want, owner = _ragged64(x, w64, sizes)
    y = np.asarray(y, np.float64)
    assert y.shape == want.shape
    np.testing.assert_array_equal(y[owner < 0], 0.0)
    for e in range(w64.shape[0]):
        rows = owner == e
        if rows.any():
            assert_matmul_close(y[rows], np.asarray(x, np.float64)[rows], w64[e], dtype)


RAGGED_CASES = {
    "even": [40, 40, 40, 40, 40],
    "empty groups": [0, 70, 0, 130, 0],
    "all in one": [0, 0, 200, 0, 0],
    "rows past the groups": [10, 0, 65, 3, 1],
    "sizes past T": [150, 100, 0, 30, 0],
    "negative size is empty": [100, -5, 50, 0, 50],
    "int32 extremes": [0, 2**31 - 1, -(2**31), 2**31 - 1, 5],
}
# Concrete sizes that are negative or sum past T are refused eagerly (ValueError); the
# cases run the traced rule (negative = 0, cut at T) under jit.
_ragged_ffi = jax.jit(lambda x, q, s: jq.ragged_qmm(x, q, s, backend="ffi"))


@pytest.mark.parametrize("case", RAGGED_CASES)
@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("nvfp4", 4),
                                       ("mxfp8_e4m3", 8), ("affine", 3)])
def test_ragged_gemm_edge_cases(case, mode, bits):
    qw, packed = _packed(mode, bits, (5, 40, 256), key=13)
    w64 = deq64(qw)
    sizes = jnp.asarray(RAGGED_CASES[case], jnp.int32)
    t = 264  # > RAGGED_GATHER_MAX_T: the GEMM; the last row block partial
    assert t > configs.RAGGED_GATHER_MAX_T
    for dt in X16:
        x = rand(t, (t, 256), dt)
        y = _ragged_ffi(x, packed, sizes)
        _check_ragged(y, x, w64, RAGGED_CASES[case], jnp.dtype(dt))
    assert _gemm_used(lambda x, q, s: jq.ragged_qmm(x, q, s, backend="ffi"), x, packed, sizes)


@pytest.mark.parametrize("dt", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_ragged_few_rows_through_the_gemv(dt):
    qw, packed = _packed("mxfp4", 4, (6, 40, 256), key=17)
    w64 = deq64(qw)
    for sizes in ([0, 3, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 2, 0, 0, 0], [4, 9, 0, 0, 0, 3],
                  [2, -3, 1, 0, 0, 0], [2**31 - 1, 2**31 - 1, 0, 0, 0, 0], [1, 2, 20, 0, 0, 0]):
        t = 4 if sum(np.maximum(sizes, 0)) <= 4 else 16
        x = rand(t, (t, 256), dt)
        y = _ragged_ffi(x, packed, jnp.asarray(sizes, jnp.int32))
        _check_ragged(y, x, w64, sizes, jnp.dtype(dt))
    # up to RAGGED_GATHER_MAX_T rows: groups longer than the 16 slots that share a read
    t = configs.RAGGED_GATHER_MAX_T
    for sizes in ([60, 0, 90, 40, 0, 10], [t, 0, 0, 0, 0, 0], [0, 37, 0, 0, 100, 200]):
        x = rand(t + 1, (t, 256), dt)
        y = _ragged_ffi(x, packed, jnp.asarray(sizes, jnp.int32))
        _check_ragged(y, x, w64, sizes, jnp.dtype(dt))


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_wgmma_producer_warp(mode, bits):
    # N a multiple of 16 (every tile full, 16-byte bases): the wgmma kernel's producer
    # (gpu_src/cuda/qmm_wgmma.h, WS; qmm_gemm.h, plan_gemm) makes the copies: a warp at
    # 64 and 128 rows of x per block, a warpgroup at 256. N = 272: 17 tiles, blocks of
    # 8, 8 and 1 (the last block's box reads the next matrix's tiles, or past the stack,
    # where its warps take zeros); K = 1088: 17 chunks, split over a cluster at 40 and 64
    # rows. ragged_qmm: empty groups and rows past the groups; [300, 0, 520] has 273 rows
    # an expert, so 256-row blocks, partial ones at each expert's end.
    # tools/gpu/check_decode.sh runs it again with $JAXQUANT_WGMMA_PRODUCER=0, each warp
    # making its own copies.
    qw, packed = _packed(mode, bits, (3, 272, 1088), key=bits + 90)
    w64 = deq64(qw)
    for dt in X16:
        for m in (40, 64, 130):
            x = rand(m + 7, (3, m, 1088), dt)
            assert_matmul_close(jq.qmm(x, packed, backend="ffi"), x, w64, jnp.dtype(dt))
        for sizes in ([0, 200, 70], [10, 0, 265], [300, 0, 520]):
            x = rand(sum(sizes), (sum(sizes) + 30, 1088), dt)
            y = _ragged_ffi(x, packed, jnp.asarray(sizes, jnp.int32))
            _check_ragged(y, x, w64, sizes, jnp.dtype(dt))


def test_ragged_matches_the_reference_on_gpt_oss_shape():
    # gpt-oss-20b's expert shape (K = 2880: 45 chunks, an odd count), T = 512
    qw, packed = _packed("mxfp4", 4, (8, 576, 2880), key=23)
    sizes = jnp.asarray([64, 0, 100, 200, 0, 48, 0, 100], jnp.int32)
    x = rand(24, (512, 2880), jnp.bfloat16)
    y = jq.ragged_qmm(x, packed, sizes, backend="ffi")
    _check_ragged(y, x, deq64(qw), np.asarray(sizes), jnp.bfloat16)


def test_auto_picks_the_gemm():
    qw, packed = _packed("affine", 4, (64, 128))
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    impl = dispatch.select("qmm", None, "cuda", (x, packed), dict(transpose=True, precision=None))
    assert impl is not None and getattr(impl, "func", impl).__module__ == "jaxquant.ffi.mma"
    _, experts = _packed("mxfp4", 4, (3, 64, 128))
    sizes = jax.ShapeDtypeStruct((3,), jnp.int32)
    impl = dispatch.select("ragged_qmm", None, "cuda", (x, experts, sizes),
                           dict(transpose=True, precision=None))
    assert impl is not None and getattr(impl, "func", impl).__module__ == "jaxquant.ffi.mma"
    assert _gemm_used(jq.qmm, jnp.ones((64, 128), jnp.bfloat16), packed)


_ragged_matmul_ffi = jax.jit(lambda x, w, s: jq.ragged_matmul(x, w, s, backend="ffi"))
needs_wgmma = pytest.mark.skipif(not configs.wgmma_usable(),
                                 reason="ragged_matmul's kernel needs compute capability 9.0")


def _float_experts(key, shape, dt):
    w = rand(key, shape, dt)
    return w, np.asarray(w, np.float64)


@needs_wgmma
@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_matmul_edge_cases(case):
    # float experts w [E, N, K] in x's dtype. N = 200: two 128-row weight boxes, the
    # second running into the next expert's rows (past the stack's end for the last);
    # K = 328: six chunks, the last of 8 k (zeros past K in both boxes). T = 264 rows,
    # the last 128-row item of a group partial.
    sizes = RAGGED_CASES[case]
    for dt in X16:
        w, w64 = _float_experts(3, (5, 200, 328), dt)
        x = rand(4, (264, 328), dt)
        y = _ragged_matmul_ffi(x, w, jnp.asarray(sizes, jnp.int32))
        _check_ragged(y, x, w64, sizes, jnp.dtype(dt))
    assert "jaxquant_ragged_matmul" in _ragged_matmul_ffi.lower(
        x, w, jnp.asarray(sizes, jnp.int32)).as_text()


@needs_wgmma
@pytest.mark.parametrize("t", [1, 7, 64, 100, 513, 2100])
def test_ragged_matmul_random_groups(t):
    # random group sizes summing to T or less, 16 experts: from one row to groups of
    # several 128-row items
    rng = np.random.default_rng(t)
    e = 16
    cuts = np.sort(rng.integers(0, t + 1, e - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [rng.integers(cuts[-1], t + 1)]]))
    for dt in X16:
        w, w64 = _float_experts(t + 5, (e, 96, 512), dt)
        x = rand(t + 6, (t, 512), dt)
        y = _ragged_matmul_ffi(x, w, jnp.asarray(sizes, jnp.int32))
        _check_ragged(y, x, w64, sizes, jnp.dtype(dt))


@needs_wgmma
def test_ragged_matmul_gpt_oss_shape_and_auto():
    # gpt-oss-20b's experts' width (K = 2880: 45 chunks), 8 of its 5760 rows' worth
    w, w64 = _float_experts(31, (8, 640, 2880), jnp.bfloat16)
    sizes = jnp.asarray([64, 0, 100, 200, 0, 48, 0, 100], jnp.int32)
    x = rand(32, (512, 2880), jnp.bfloat16)
    impl = dispatch.select("ragged_matmul", None, "cuda", (x, w, sizes),
                           dict(transpose=True, precision=None))
    assert impl is not None and getattr(impl, "func", impl).__module__ == "jaxquant.ffi.mma"
    y = jax.jit(jq.ragged_matmul)(x, w, sizes)
    _check_ragged(y, x, w64, np.asarray(sizes), jnp.bfloat16)


@needs_wgmma
def test_ragged_matmul_bad_operands_are_refused():
    from jaxquant.ffi.mma import ragged_matmul_call
    w = rand(1, (3, 64, 128), jnp.bfloat16)
    x = rand(2, (100, 128), jnp.bfloat16)
    sizes = jnp.asarray([30, 30, 40], jnp.int32)
    for args, match in (((x, w, jnp.ones((4,), jnp.int32)), "group_sizes"),
                        ((x, w.astype(jnp.float16), sizes), "w in x's dtype"),
                        ((x.astype(jnp.float32), w.astype(jnp.float32), sizes),
                         "float16 or bfloat16"),
                        ((x[:, :100], w[:, :, :100], sizes), "multiple of 8"),
                        ((x, w[:, :, :64], sizes), r"x \[T, K\] and w \[E, N, K\]")):
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(ragged_matmul_call(*args))
    # no experts: every row is past the groups
    y = ragged_matmul_call(x, w[:0], jnp.zeros((0,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)
    # the cases the kernel does not take go to the other kernels, not to it
    for xx, ww in ((x.astype(jnp.float32), w), (x[:, :100], w[:, :, :100])):
        impl = dispatch.select("ragged_matmul", "ffi", "cuda", (xx, ww, sizes),
                               dict(transpose=True, precision=None))
        assert impl is None or getattr(impl, "func", impl).__module__ != "jaxquant.ffi.mma"


def test_bad_group_sizes_are_refused():
    _, experts = _packed("mxfp4", 4, (3, 64, 128))
    x = rand(1, (100, 128), jnp.bfloat16)
    with pytest.raises(Exception, match="group_sizes"):
        from jaxquant.ffi.mma import qmm_gemm_call
        jax.block_until_ready(qmm_gemm_call(x[None], experts, jnp.ones((4,), jnp.int32)))
    with pytest.raises(Exception, match="float16 or bfloat16"):
        from jaxquant.ffi.mma import qmm_gemm_call
        jax.block_until_ready(qmm_gemm_call(x[None].astype(jnp.float32), experts,
                                            jnp.ones((3,), jnp.int32)))


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_dequantize_on_the_layout(mode, bits):
    # N = 37 (a canonical tail), K = 192: the values the GEMM multiplies, in x's dtype:
    # the codes times the scale (plus bias) rounded once to that dtype; the scale
    # itself is rounded to it first (exact for bfloat16 / E8M0 scales)
    qw, packed = _packed(mode, bits, (2, 37, 192), key=31)
    w64 = deq64(qw)
    for dt in X16:
        got = jq.dequantize(packed, dtype=dt, backend="ffi")
        assert got.dtype == jnp.dtype(dt) and got.shape == qw.shape
        eps = float(jnp.finfo(dt).eps)
        err = np.abs(np.asarray(got, np.float64) - w64)
        assert np.all(err <= 2 * eps * np.abs(w64) + eps * np.abs(w64).max()), err.max()
    hlo = jax.jit(lambda q: jq.dequantize(q, dtype=jnp.bfloat16)).lower(packed).as_text()
    assert "jaxquant_dequant_mma" in hlo


def test_auto_past_the_gemm_dequantizes_then_cublas():
    qw, packed = _packed("mxfp4", 4, (300, 256), key=37)
    m = configs.mma_gemm_max_m(packed) + 36
    x = rand(38, (m, 256), jnp.bfloat16)
    hlo = jax.jit(jq.qmm).lower(x, packed).as_text()
    assert "jaxquant_dequant_mma" in hlo and "jaxquant_qmm_gemm" not in hlo
    assert_matmul_close(jax.jit(jq.qmm)(x, packed), x, deq64(qw), jnp.bfloat16)
    # an explicit backend="ffi" gets the GEMM at any M
    assert _gemm_used(lambda x, q: jq.qmm(x, q, backend="ffi"), x, packed)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_prompt_attention_takes_cudnn_and_equals_the_op(family, monkeypatch):
    """models.prefill's prompt attention on the GPU: cuDNN's fused kernel
    (layers.PROMPT_ATTENTION), against decode_attention over the cache; gpt-oss with
    its sinks and a window of 64 keys in every other layer, routing each token to every
    expert: with 2 of the 4 its logits missed this bound, which we put down to routing
    (a top-k is discontinuous: a rounding's difference can move a token to another
    expert); the attention alone is checked against the op below."""
    from jaxquant import models
    from jaxquant.models import layers

    assert layers.PROMPT_ATTENTION.get("gpu") == "cudnn"
    extra = dict(num_experts=4, experts_per_token=4, moe_intermediate_size=128,
                 attention_bias=True, layer_windows=(64, 0)) if family == "gpt_oss" else {}
    cfg = models.Config(family=family, vocab_size=64, hidden_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256,
                        dtype="bfloat16", **extra)
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "affine4",
                                    per_layer=True)
    prompt = jax.random.randint(jax.random.key(1), (2, 200), 0, cfg.vocab_size)
    got = {}
    for name, table in (("op", {}), ("cudnn", {"gpu": "cudnn"})):
        monkeypatch.setattr(layers, "PROMPT_ATTENTION", table)
        run = jax.jit(lambda p, t: models.prefill(cfg, p, t, 256))
        got[name] = (run(params, prompt), run.lower(params, prompt).as_text())
    assert "cudnn" not in got["op"][1].lower() and "cudnn" in got["cudnn"][1].lower()
    (want, cache_w, _), (have, cache_h, _) = got["op"][0], got["cudnn"][0]
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), atol=0.05 * scale)
    np.testing.assert_array_equal(np.asarray(cache_h[0][0], np.float32),
                                  np.asarray(cache_w[0][0], np.float32))


@pytest.mark.parametrize("window", [0, 128])
def test_prompt_attention_sinks_on_cudnn_against_the_op(window):
    """The sinks' rule on cuDNN (layers.prompt_attention: the kernel's attention times
    sigmoid(logsumexp - sink)) against the float64 oracle of the op, with sinks from
    a small share of a row's mass to most of it, grouped heads and gpt-oss's head size;
    and the logsumexp it takes against the float64 oracle, to float32's rounding of
    the bf16 scores' sums (a logsumexp rounded to bfloat16 is up to 2^-9 of its size
    off)."""
    from jaxquant.models import layers

    b, t, hq, hkv, hd = 2, 300, 8, 2, 64
    kq, kk, kv, _ = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(kq, (b, t, hq, hd), jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, hkv, hd), jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, hkv, hd), jnp.bfloat16)
    sinks = jnp.linspace(-3.0, 8.0, hq, dtype=jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    run = jax.jit(layers.prompt_attention, static_argnums=(3, 4))
    assert "cudnn" in run.lower(q, k, v, "cudnn", window, sinks).as_text().lower()
    got = np.asarray(run(q, k, v, "cudnn", window, sinks), np.float64)
    want = attention64(q, k, v, positions, window, sinks, hd ** -0.5)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())

    _, lse = jax.jit(layers.attention_with_logsumexp, static_argnums=(3, 4))(
        q, k, v, "cudnn", window)
    assert lse.dtype == jnp.float32 and lse.shape == (b, t, hq)
    s = scores64(q, k, positions, window, hd ** -0.5).reshape(b, hq, t, t)
    m = s.max(-1, keepdims=True)
    want_lse = (m[..., 0] + np.log(np.exp(s - m).sum(-1))).transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=5e-4, atol=5e-4)
