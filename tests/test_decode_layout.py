"""The cuda_mma kernel layout (jaxquant/layouts/cuda_mma.py): exact round
trips for every mode, and the position of every code and scale checked
against the formula the tensor-core kernel reads (gpu_src/cuda/gemv_mma.h,
docs/decode.md), independently of the jnp transposes that build it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import formats
from jaxquant.layouts import cuda_mma
from tests.common import GPU_NATIVE_MODES, quantize_for


def _qw(mode, bits, shape, key=0):
    w = jax.random.normal(jax.random.key(key), shape, jnp.float32)
    return quantize_for(mode, bits, w)


@pytest.mark.parametrize("mode,bits", GPU_NATIVE_MODES)
def test_round_trip_every_mode(mode, bits):
    qw = _qw(mode, bits, (2, 40, 128))  # N = 40: two tiles and a canonical tail of 8 rows
    packed = jax.jit(jq.prepack, static_argnames="layout")(qw, layout="cuda_mma")
    assert packed.layout == "cuda_mma" and packed.shape == qw.shape
    assert packed.data.shape == qw.data.shape and packed.scales.shape == qw.scales.shape
    assert not np.array_equal(np.asarray(packed.data), np.asarray(qw.data))
    back = jq.unpack_layout(packed)
    for a, b in zip(jax.tree_util.tree_leaves(qw), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_codebook_modes_stay_canonical():
    """The layout's kernels decode no codebook: prepack refuses iq4nl by name, and the
    default layout keeps it canonical (where the Pallas kernels read it)."""
    qw = _qw("iq4nl", 4, (16, 64))
    assert "codebook" in cuda_mma.unsupported(qw)
    with pytest.raises(ValueError, match="codebook"):
        jq.prepack(qw, layout="cuda_mma")


@pytest.mark.parametrize("mode,bits,n,k", [("affine", 4, 37, 192), ("affine", 3, 16, 64),
                                           ("mxfp4", 4, 32, 128), ("mxfp6_e2m3", 6, 21, 64),
                                           ("nvfp4", 4, 48, 64), ("affine", 8, 5, 64)])
def test_codes_and_scales_where_the_kernel_reads_them(mode, bits, n, k):
    qw = _qw(mode, bits, (n, k), key=n)
    packed = jq.prepack(qw, layout="cuda_mma")
    canon = np.asarray(formats.unpack_bits(qw.data, bits)).reshape(n, k)
    words = np.asarray(packed.data).reshape(-1)
    stream = np.asarray(formats.unpack_bits(jnp.asarray(words), bits))  # the matrix's codes
    n_full = n // 16 * 16
    chunks = k // 64
    tile, c, lane, i = np.meshgrid(np.arange(n // 16), np.arange(chunks), np.arange(32),
                                   np.arange(32), indexing="ij")
    g, q = lane // 4, lane % 4
    s, h, j = i // 8, (i // 4) % 2, i % 4
    row = 16 * tile + g + 8 * (j & 1)
    kk = 64 * c + 16 * s + 4 * q + 2 * (j >> 1) + h
    pos = ((tile * chunks + c) * 32 + lane) * 32 + i
    np.testing.assert_array_equal(stream[pos], canon[row, kk])
    # rows past the last whole tile stay canonical
    np.testing.assert_array_equal(stream[n_full * k:], canon[n_full:].reshape(-1))
    groups = k // qw.group_size
    sc, ps = np.asarray(qw.scales), np.asarray(packed.scales).reshape(-1)
    tile, gi, g, half = np.meshgrid(np.arange(n // 16), np.arange(groups), np.arange(8),
                                    np.arange(2), indexing="ij")
    pos = ((tile * groups + gi) * 8 + g) * 2 + half
    np.testing.assert_array_equal(ps[pos], sc[16 * tile + g + 8 * half, gi])
    np.testing.assert_array_equal(ps[n_full * groups:], sc[n_full:].reshape(-1))


def test_unsupported_and_default():
    qw = jq.quantize(jnp.ones((16, 96)), mode="affine", bits=4, group_size=32)
    assert "64" in cuda_mma.unsupported(qw)
    with pytest.raises(ValueError, match="multiple of 64"):
        jq.prepack(qw, layout="cuda_mma")
    # the default layout is canonical on platforms without the kernel
    from jaxquant import layouts
    assert layouts.default_layout(_qw("affine", 4, (16, 64)), platform="cpu") == "canonical"


def test_ops_take_the_layout_everywhere():
    qw = _qw("mxfp4", 4, (3, 24, 128))
    packed = jq.prepack(qw, layout="cuda_mma")
    x = jax.random.normal(jax.random.key(5), (2, 128), jnp.float32)
    idx = jnp.asarray([[0, 2], [1, -1]])
    ref = dict(backend="reference")
    np.testing.assert_array_equal(np.asarray(jq.gather_qmm(x, packed, idx, **ref)),
                                  np.asarray(jq.gather_qmm(x, qw, idx, **ref)))
    np.testing.assert_array_equal(np.asarray(jq.qmm(x, packed[1], **ref)),
                                  np.asarray(jq.qmm(x, qw[1], **ref)))
    # auto on a platform without the kernel: whatever runs, the same product
    np.testing.assert_allclose(np.asarray(jq.qmm(x, packed[1])), np.asarray(jq.qmm(x, qw[1])),
                               rtol=1e-5, atol=1e-5)
