"""The cdna4 layout (jaxquant/layouts/cdna4.py): the permutations against the
index formulas of docs/cdna4.md written out here independently, bijectivity,
exact inverses, prepack/unpack_layout round trips of mxfp4 QuantizedArrays,
every op accepting the layout, and the errors for sizes it does not take."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.layouts import cdna4
from tests.common import rand


def b_offset(e, n, kb, N, KB):
    """docs/cdna4.md: n = n_lane + 16*n_blk, kb = byte + 16*k_lane + 64*k0."""
    n_lane, n_blk = n % 16, n // 16
    byte, k_lane, k0 = kb % 16, (kb // 16) % 4, kb // 64
    return (e * N * KB + 16 * n_lane + 1024 * (KB // 64) * n_blk + byte + 256 * k_lane
            + 1024 * k0)


def scale_offset(e, mn, ks, MNp, KS):
    """docs/cdna4.md: mn = mn_lane + 16*mn_pack + 32*mn_blk, ks = k_lane + 4*k_pack + 8*k0."""
    mn_lane, mn_pack, mn_blk = mn % 16, (mn // 16) % 2, mn // 32
    k_lane, k_pack, k0 = ks % 4, (ks // 4) % 2, ks // 8
    return (e * MNp * KS + 4 * mn_lane + mn_pack + 256 * (KS // 8) * mn_blk + 64 * k_lane
            + 2 * k_pack + 256 * k0)


B_SIZES = [(1, 16, 64), (2, 48, 128), (3, 32, 192), (1, 80, 320)]
S_SIZES = [(1, 1, 8), (2, 16, 8), (1, 32, 16), (3, 45, 24), (2, 64, 8), (1, 100, 32)]


@pytest.mark.parametrize("E,N,KB", B_SIZES)
def test_b_formula_is_a_bijection_and_the_permutation_follows_it(E, N, KB):
    e, n, kb = np.meshgrid(np.arange(E), np.arange(N), np.arange(KB), indexing="ij")
    off = b_offset(e, n, kb, N, KB)
    assert np.array_equal(np.sort(off.ravel()), np.arange(E * N * KB))
    data = np.random.default_rng(N + KB).integers(0, 256, (E, N, KB), dtype=np.uint8)
    got = np.asarray(cdna4.preshuffle_b(jnp.asarray(data))).ravel()
    want = np.empty(E * N * KB, np.uint8)
    want[off.ravel()] = data.ravel()
    np.testing.assert_array_equal(got, want)
    # the module's own spec function says the same
    assert np.array_equal(cdna4.b_offset(e, n, kb, N, KB), off)
    np.testing.assert_array_equal(np.asarray(cdna4.unshuffle_b(got.reshape(E, N, KB))), data)


@pytest.mark.parametrize("E,MN,KS", S_SIZES)
def test_scale_formula_is_a_bijection_and_the_permutation_follows_it(E, MN, KS):
    mnp = -(-MN // 32) * 32
    e, mn, ks = np.meshgrid(np.arange(E), np.arange(mnp), np.arange(KS), indexing="ij")
    off = scale_offset(e, mn, ks, mnp, KS)
    assert np.array_equal(np.sort(off.ravel()), np.arange(E * mnp * KS))
    s = np.random.default_rng(MN).integers(1, 256, (E, MN, KS), dtype=np.uint8)
    got = np.asarray(cdna4.preshuffle_scales(jnp.asarray(s)))
    assert got.shape == (E, mnp, KS)
    padded = np.zeros((E, mnp, KS), np.uint8)
    padded[:, :MN] = s
    want = np.empty(E * mnp * KS, np.uint8)
    want[off.ravel()] = padded.ravel()
    np.testing.assert_array_equal(got.ravel(), want)
    assert np.count_nonzero(got) == s.size  # the padding is zero bytes
    assert np.array_equal(cdna4.scale_offset(e, mn, ks, MN, KS), off)
    np.testing.assert_array_equal(np.asarray(cdna4.unshuffle_scales(got, MN)), s)


def test_one_tile_is_contiguous_per_lane():
    """The first 1024 bytes are one 16x64-byte tile: lane l = n_lane + 16*k_lane finds
    row n_lane's bytes 16*k_lane .. 16*k_lane+15 at 16*l (one dwordx4 per lane)."""
    n, kb = np.meshgrid(np.arange(16), np.arange(128), indexing="ij")
    data = ((n * 7 + kb) % 256).astype(np.uint8)
    flat = np.asarray(cdna4.preshuffle_b(jnp.asarray(data))).ravel()
    for lane in range(64):
        n_lane, k_lane = lane % 16, lane // 16
        np.testing.assert_array_equal(flat[16 * lane:16 * lane + 16],
                                      data[n_lane, 16 * k_lane:16 * k_lane + 16])
        np.testing.assert_array_equal(flat[1024 + 16 * lane:1024 + 16 * lane + 16],
                                      data[n_lane, 64 + 16 * k_lane:64 + 16 * k_lane + 16])


def test_2d_and_jit():
    data = jnp.asarray(np.arange(32 * 128, dtype=np.uint32).astype(np.uint8).reshape(32, 128))
    f = jax.jit(cdna4.preshuffle_b)
    np.testing.assert_array_equal(np.asarray(f(data)), np.asarray(cdna4.preshuffle_b(data[None])[0]))
    np.testing.assert_array_equal(np.asarray(jax.jit(cdna4.unshuffle_b)(f(data))), np.asarray(data))
    s = jnp.asarray(np.arange(20 * 16, dtype=np.uint32).astype(np.uint8).reshape(20, 16))
    p = jax.jit(cdna4.preshuffle_scales)(s)
    assert p.shape == (32, 16)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(cdna4.unshuffle_scales, static_argnums=1)(p, 20)), np.asarray(s))


def test_bad_sizes_and_types():
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K_BYTES % 64 == 0.*N=8"):
        cdna4.preshuffle_b(jnp.zeros((8, 64), jnp.uint8))
    with pytest.raises(ValueError, match=r"K_BYTES=96"):
        cdna4.unshuffle_b(jnp.zeros((1, 16, 96), jnp.uint8))
    with pytest.raises(ValueError, match=r"K_S % 8 == 0.*K_S=12"):
        cdna4.preshuffle_scales(jnp.zeros((32, 12), jnp.uint8))
    with pytest.raises(TypeError, match="data must be a uint8 array"):
        cdna4.preshuffle_b(jnp.zeros((16, 64), jnp.uint32))
    with pytest.raises(TypeError, match="scales must be a uint8 array"):
        cdna4.preshuffle_scales(np.zeros((16, 8), np.float32))
    with pytest.raises(ValueError, match="2-D without E or 3-D"):
        cdna4.preshuffle_b(jnp.zeros((1, 1, 16, 64), jnp.uint8))
    with pytest.raises(ValueError, match="not the cdna4 padding of mn=40"):
        cdna4.unshuffle_scales(jnp.zeros((32, 8), jnp.uint8), 40)


# ---------------------------------------------------------------------------
# As a Layout of QuantizedArrays.


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("shape", [(16, 256), (48, 512), (2, 32, 256), (3, 80, 768),
                                   (2, 2, 16, 256)])
def test_prepack_round_trip_is_bit_exact(shape):
    w = rand(sum(shape), shape, scale=4.0)
    w = w.at[..., 0, :32].set(0.0)  # a zero block (scale byte 0 where the rule gives it)
    qw = jq.quantize(w, mode="mxfp4")
    packed = jax.jit(jq.prepack, static_argnames="layout")(qw, layout="cdna4")
    assert packed.layout == "cdna4" and packed.shape == qw.shape
    assert packed.data.shape == qw.data.shape and packed.data.dtype == jnp.uint32
    n = shape[-2]
    assert packed.scales.shape == qw.scales.shape[:-2] + (-(-n // 32) * 32, qw.scales.shape[-1])
    _leaves_equal(jq.unpack_layout(packed), qw)
    if len(shape) > 2:  # indexing an expert of the stack is that expert prepacked
        _leaves_equal(packed[1], jq.prepack(qw[1], layout="cdna4"))
    # the data bytes are exactly preshuffle_b of the canonical bytes
    bytes_of = lambda d: np.asarray(jax.lax.bitcast_convert_type(d, jnp.uint8)).reshape(
        -1, n, d.shape[-1] * 4)
    np.testing.assert_array_equal(bytes_of(packed.data),
                                  np.asarray(cdna4.preshuffle_b(bytes_of(qw.data))))


def test_ops_accept_the_cdna4_layout():
    w = rand(3, (2, 32, 256))
    qw = jq.quantize(w, mode="mxfp4")
    packed = jq.prepack(qw, layout="cdna4")
    x = rand(4, (3, 256))
    ref = dict(backend="reference")
    np.testing.assert_array_equal(np.asarray(jq.dequantize(packed)),
                                  np.asarray(jq.dequantize(qw, **ref)))
    np.testing.assert_array_equal(np.asarray(jq.qmm(x, packed[1])),
                                  np.asarray(jq.qmm(x, qw[1], **ref)))
    np.testing.assert_array_equal(np.asarray(jq.qmm(rand(5, (2, 3, 256)), packed)),
                                  np.asarray(jq.qmm(rand(5, (2, 3, 256)), qw, **ref)))
    idx = jnp.array([[1, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(jq.gather_qmm(x[:2], packed, idx)),
                                  np.asarray(jq.gather_qmm(x[:2], qw, idx, **ref)))
    gs = jnp.array([2, 1])
    np.testing.assert_array_equal(np.asarray(jq.ragged_qmm(x, packed, gs)),
                                  np.asarray(jq.ragged_qmm(x, qw, gs, **ref)))


@pytest.mark.parametrize("mode,shape,match", [
    ("affine", (16, 256), "mxfp4 only"),
    ("mxfp8", (16, 256), "mxfp4 only"),
    ("mxfp4", (24, 256), r"N % 16 == 0 and K % 256 == 0.*N=24"),
    ("mxfp4", (16, 128), r"K=128"),
    ("mxfp4", (16, 2880), r"K=2880"),
])
def test_prepack_refuses_what_the_layout_does_not_take(mode, shape, match):
    qw = jq.quantize(rand(0, shape), mode=mode)
    with pytest.raises(ValueError, match=match):
        jq.prepack(qw, layout="cdna4")


def test_registered_but_default_nowhere():
    assert jq.layouts.cdna4 is cdna4 and jq.layouts.LAYOUTS["cdna4"].platforms == ()
    qw = jq.quantize(rand(0, (32, 256)), mode="mxfp4")
    for platform in ("rocm", "cuda", "cpu"):  # (cuda may default to cuda_mma: docs/decode.md)
        assert jq.layouts.default_layout(qw, platform=platform) != "cdna4"


def test_edge_values_survive():
    """Every E2M1 code and the E8M0 extremes (0, 254, NaN 255) through the layout."""
    codes = np.array(list(itertools.product(range(16), repeat=2)), np.uint8)
    data_bytes = (codes[:, 0] | (codes[:, 1] << 4)).astype(np.uint8)
    data_bytes = np.resize(data_bytes, (16, 128))
    data = jax.lax.bitcast_convert_type(jnp.asarray(data_bytes).reshape(16, 32, 4), jnp.uint32)
    scales = np.resize(np.array([0, 1, 127, 254, 255], np.uint8), (16, 8))
    qw = jq.QuantizedArray(data, jnp.asarray(scales), mode="mxfp4", bits=4, group_size=32,
                           dtype=jnp.float32)
    packed = jq.prepack(qw, layout="cdna4")
    _leaves_equal(jq.unpack_layout(packed), qw)
    np.testing.assert_array_equal(np.asarray(jq.dequantize(packed)),
                                  np.asarray(jq.dequantize(qw, backend="reference")))
