"""The tensor-core decode GEMV (gpu_src/cuda/gemv_mma.h) on an NVIDIA GPU, on the
cuda_mma layout: every mode and activation dtype against the float64 oracle
(M = 1..16, N with a canonical tail, K at group granularity), gather_qmm with
repeated experts (read once), bad ids (NaN rows), gather == qmm bit for bit,
`auto` picking it, and a lax.scan over stacked prepacked layers. Skipped
without a CUDA GPU and library (tools/gpu/check_decode.sh runs it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import dispatch
from tests.common import (DTYPES, GPU_NATIVE_MODES, MODES, assert_matmul_close, cuda_library, deq64,
                          quantize_for, rand)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_library(),
                                 reason="needs an NVIDIA GPU and the CUDA library")]


def _packed(mode, bits, shape, key=0, group_size=None):
    w = rand(key, shape, jnp.bfloat16 if mode in ("affine", "fp4") else jnp.float32, scale=2.0)
    qw = quantize_for(mode, bits, w, group_size)
    return qw, jq.prepack(qw, layout="cuda_mma")


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_qmm_every_mode_dtype_and_m(mode, bits):
    # N = 37: two tiles and a canonical tail of 5 rows; K = 192: 3 chunks (odd)
    qw, packed = _packed(mode, bits, (37, 192), key=bits)
    w64 = deq64(qw)
    ms = (1, 2, 7, 8, 9, 16)
    xs = {(jnp.dtype(dt).name, m): rand(m, (m, 192), dt) for dt in DTYPES for m in ms}
    out = jax.jit(lambda xs, q: {key: jq.qmm(x, q, backend="ffi") for key, x in xs.items()})(
        xs, packed)
    for (name, m), y in out.items():
        assert y.dtype == jnp.dtype(name)
        assert_matmul_close(y, xs[name, m], w64, jnp.dtype(name))
        # each row is its own M = 1 product, bit for bit
        if m in (8, 16):
            one = jq.qmm(xs[name, m][3:4], packed, backend="ffi")
            np.testing.assert_array_equal(np.asarray(y[3:4], np.float32), np.asarray(one, np.float32))


@pytest.mark.parametrize("mode,bits", [m for m in MODES if m[0] in
                                       ("affine", "mxfp4", "mxfp8_e4m3", "nvfp4")])
def test_long_k_few_tiles(mode, bits):
    # N = 37 (3 tiles) with K = 4096 (64 chunks, 4 warps of 16 chunks, x staged in
    # shared memory for M = 1, from L1/L2 for M = 9 in float32): partial sums of every
    # warp meet over the weight stages
    qw, packed = _packed(mode, bits, (37, 4096), key=11)
    w64 = deq64(qw)
    for dt in DTYPES:
        x = rand(7, (9, 4096), dt)
        y = jq.qmm(x, packed, backend="ffi")
        assert_matmul_close(y, x, w64, jnp.dtype(dt))
        one = jq.qmm(x[3:4], packed, backend="ffi")
        np.testing.assert_array_equal(np.asarray(y[3:4], np.float32), np.asarray(one, np.float32))


@pytest.mark.parametrize("mode,bits", [m for m in MODES if m[0] in
                                       ("affine", "mxfp4", "nvfp4", "mxfp6_e3m2")])
def test_two_tiles_per_block(mode, bits):
    # M > 8 on N = 16 * 529 + 5 rows: enough tiles that a block takes two of them
    # (tiles_per_block in gpu_src/cuda/gemv_mma.h), an odd count of full tiles (the last
    # block has one) and a canonical tail; each row still equals its M = 1 product
    qw, packed = _packed(mode, bits, (16 * 529 + 5, 256), key=5)
    w64 = deq64(qw)
    for dt in DTYPES:
        x = rand(9, (16, 256), dt)
        for m in (9, 16):
            y = jq.qmm(x[:m], packed, backend="ffi")
            assert_matmul_close(y, x[:m], w64, jnp.dtype(dt))
            one = jq.qmm(x[m - 1:m], packed, backend="ffi")
            np.testing.assert_array_equal(np.asarray(y[m - 1:m], np.float32),
                                          np.asarray(one, np.float32))


def test_one_row_two_tiles_deep_grid_and_rows_through_l1():
    # N = 16 * 2401 + 5: 2401 full tiles, a grid deep enough that M = 1 takes two tiles
    # per block (tiles_per_block: 8 blocks of two per SM up to 150 SMs), an odd count
    # (the last block has one) and a canonical tail; M = 2 and 4 read x through L1 with
    # one tile per block. Each of their rows equals the M = 1 product bit for bit.
    for mode in ("affine", "mxfp4"):
        qw, packed = _packed(mode, 4, (16 * 2401 + 5, 128), key=13)
        w64 = deq64(qw)
        x = rand(3, (4, 128), jnp.bfloat16)
        one = jq.qmm(x[:1], packed, backend="ffi")
        assert_matmul_close(one, x[:1], w64, jnp.bfloat16)
        for m in (2, 4):
            y = jq.qmm(x[:m], packed, backend="ffi")
            assert_matmul_close(y, x[:m], w64, jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(y[:1], np.float32),
                                          np.asarray(one, np.float32))


def test_gather_two_tiles_per_block():
    # 32 slots over 3 experts: segments of up to 16 slots (two MMA column tiles),
    # N = 16 * 45 + 3: 32 x 22 blocks of two tiles, the last full tile alone, a tail
    e, n, k, t, topk = 3, 16 * 45 + 3, 128, 16, 2
    qw, packed = _packed("mxfp4", 4, (e, n, k), key=9)
    w64 = deq64(qw)
    idx = np.random.default_rng(3).integers(0, e, size=(t, topk))
    idx[4, 1] = -1
    x = rand(4, (t, k), jnp.bfloat16)
    y = np.asarray(jq.gather_qmm(x, packed, jnp.asarray(idx, jnp.int32), backend="ffi"),
                   np.float32)
    for i in range(t):
        for j in range(topk):
            ex = int(idx[i, j])
            if ex < 0:
                assert np.all(np.isnan(y[i, j]))
                continue
            assert_matmul_close(y[i, j], x[i], w64[ex], jnp.bfloat16)
            one = jq.qmm(x[i:i + 1], packed[ex], backend="ffi")
            np.testing.assert_array_equal(y[i, j], np.asarray(one, np.float32)[0])


@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 32), ("affine", 4, 128),
                                             ("affine", 8, 128), ("fp4", 4, 16), ("fp4", 4, 64)])
def test_group_sizes(mode, bits, group):
    qw, packed = _packed(mode, bits, (48, 256), key=group, group_size=group)
    x = rand(3, (3, 256), jnp.bfloat16)
    assert_matmul_close(jq.qmm(x, packed, backend="ffi"), x, deq64(qw), jnp.bfloat16)


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_affine_group16_stays_canonical_and_decodes(bits):
    """Affine group 16 (GGUF Q6_K / Q2_K): the cuda_mma layout refuses it (its kernels
    take groups >= 32), so prepack keeps it canonical, where the CUDA GEMV and the
    automatic choice decode it against the float64 product."""
    qw = quantize_for("affine", bits, rand(bits, (48, 256), jnp.bfloat16, scale=2.0), 16)
    assert jq.prepack(qw).layout == "canonical"
    with pytest.raises(ValueError, match="group_size=16"):
        jq.prepack(qw, layout="cuda_mma")
    for m in (1, 3, 40):
        x = rand(m, (m, 256), jnp.bfloat16)
        assert_matmul_close(jq.qmm(x, qw, backend="ffi"), x, deq64(qw), jnp.bfloat16)
        assert_matmul_close(jax.jit(jq.qmm)(x, qw), x, deq64(qw), jnp.bfloat16)


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("mxfp8_e4m3", 8)])
def test_gather_dedupe_bad_ids_and_bitwise_qmm(mode, bits):
    e, n, k = 6, 40, 128
    qw, packed = _packed(mode, bits, (e, n, k), key=7)
    w64 = deq64(qw)
    for t, topk in ((1, 4), (5, 3), (12, 2)):
        rng = np.random.default_rng(t)
        idx = rng.integers(0, 3, size=(t, topk))  # few experts: many repeats
        idx[0, -1] = -1
        if t > 1:
            idx[1, 0] = e  # out of range
            idx[2, :] = 1  # one token picks expert 1 twice
        x = rand(t, (t, k), jnp.bfloat16)
        y = np.asarray(jq.gather_qmm(x, packed, jnp.asarray(idx, jnp.int32), backend="ffi"),
                       np.float32)
        assert y.shape == (t, topk, n)
        for i in range(t):
            for j in range(topk):
                ex = int(idx[i, j])
                if not 0 <= ex < e:
                    assert np.all(np.isnan(y[i, j])), (i, j)
                    continue
                assert_matmul_close(y[i, j], x[i:i + 1][0], w64[ex], jnp.bfloat16)
                one = jq.qmm(x[i:i + 1], packed[ex], backend="ffi")
                np.testing.assert_array_equal(y[i, j], np.asarray(one, np.float32)[0])


def test_gather_per_slot_x_and_f32():
    e, n, k, t, topk = 4, 24, 192, 3, 2
    qw, packed = _packed("nvfp4", 4, (e, n, k), key=11)
    idx = jnp.asarray([[0, 3], [3, 1], [0, 0]], jnp.int32)
    x = rand(12, (t, topk, k), jnp.float32)
    y = jq.gather_qmm(x, packed, idx, backend="ffi")
    w64 = deq64(qw)
    for i in range(t):
        for j in range(topk):
            assert_matmul_close(y[i, j], x[i, j], w64[int(idx[i, j])], jnp.float32)


def test_auto_picks_it_and_prepack_defaults_to_it():
    qw, packed = _packed("affine", 4, (64, 128))
    assert jq.prepack(qw).layout == "cuda_mma"
    x = jax.ShapeDtypeStruct((1, 128), jnp.bfloat16)
    impl = dispatch.select("qmm", None, "cuda", (x, packed), dict(transpose=True, precision=None))
    assert impl is not None and getattr(impl, "func", impl).__module__ == "jaxquant.ffi.mma"
    idx = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    _, experts = _packed("mxfp4", 4, (3, 64, 128))
    impl = dispatch.select("gather_qmm", None, "cuda", (x, experts, idx),
                           dict(transpose=True, precision=None))
    assert impl is not None and getattr(impl, "func", impl).__module__ == "jaxquant.ffi.mma"
    hlo = jax.jit(lambda x, q: jq.qmm(x, q)).lower(jnp.ones((1, 128), jnp.bfloat16),
                                                   packed).as_text()
    assert "jaxquant_qmv_mma" in hlo


def test_scan_over_stacked_layers_matches_unrolled():
    layers, d = 4, 256
    qw, packed = _packed("mxfp4", 4, (layers, d, d), key=21)
    x0 = rand(22, (1, d), jnp.bfloat16)

    def body(x, q):
        y = jq.qmm(x, q)
        return (y / (1 + jnp.abs(y).max())).astype(x.dtype), None

    scanned = jax.jit(lambda x, q: jax.lax.scan(body, x, q)[0])(x0, packed)
    x = x0
    for i in range(layers):
        x = body(x, packed[i])[0]
    np.testing.assert_array_equal(np.asarray(scanned, np.float32), np.asarray(x, np.float32))
    hlo = jax.jit(lambda x, q: jax.lax.scan(body, x, q)[0]).lower(x0, packed).as_text()
    assert "jaxquant_qmv_mma" in hlo


def test_bad_calls_raise():
    from jaxquant.ffi import mma
    _, packed = _packed("affine", 4, (1, 32, 128))
    with pytest.raises(Exception, match="M <= 16"):
        jax.block_until_ready(mma.qmv_mma_call(jnp.ones((1, 17, 128), jnp.bfloat16), packed))


@pytest.mark.parametrize("mode,bits", [("affine", 4), ("mxfp4", 4), ("nvfp4", 4)])
def test_quantize_returns_the_layout_and_qmm_runs_its_kernel(mode, bits):
    """The op-level default (docs/layouts.md): jq.quantize on CUDA gives cuda_mma,
    jq.prepack of it is itself, and jq.qmm / gather_qmm with the automatic choice on
    it run the tensor-core kernel: bit for bit the prepacked canonical weight's
    product with backend="ffi", and the oracle's to rounding."""
    w = rand(21, (3, 40, 256), jnp.bfloat16)
    kw = dict(mode=mode, bits=bits if mode == "affine" else None)
    default = jq.quantize(w, **kw)
    canonical = jq.quantize(w, **kw, layout="canonical")
    assert default.layout == "cuda_mma" and canonical.layout == "canonical"
    assert jq.prepack(default) is default
    for a, b in zip(jax.tree_util.tree_leaves(jq.unpack_layout(default)),
                    jax.tree_util.tree_leaves(canonical)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    chosen = dispatch.select("qmm", None, "cuda", (rand(0, (8, 256), jnp.bfloat16), default[0]),
                             dict(transpose=True, precision=None))
    assert chosen is not None and chosen.backend == "ffi"
    for m in (1, 8, 16):
        x = rand(m, (m, 256), jnp.bfloat16)
        y = jax.jit(jq.qmm)(x, default[1])
        np.testing.assert_array_equal(
            np.asarray(y, np.float32),
            np.asarray(jq.qmm(x, jq.prepack(canonical[1], layout="cuda_mma"), backend="ffi"),
                       np.float32))
        assert_matmul_close(y, x, deq64(canonical[1]), jnp.bfloat16)
    x = rand(3, (4, 256), jnp.bfloat16)
    idx = jnp.asarray([[0, 2], [1, 1], [2, 0], [0, 0]])
    yg = jax.jit(jq.gather_qmm)(x, default, idx)
    xs = np.broadcast_to(np.asarray(x, np.float32)[:, None, None, :], (4, 2, 1, 256))
    assert_matmul_close(yg[:, :, None, :], xs, deq64(canonical)[np.asarray(idx)], jnp.bfloat16)
