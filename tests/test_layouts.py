"""The kernel-layout registry (jaxquant/layouts): prepack / unpack_layout round
trips, and every op accepting a non-canonical layout (through the reference,
which unpacks). Uses a test-only layout (rows of each matrix reversed, scales
padded by one row) so the mechanism is tested apart from any kernel's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import layouts
from tests.common import rand


def _pack(qw):
    pad = lambda a: None if a is None else jnp.concatenate(
        [a[..., ::-1, :], jnp.zeros_like(a[..., :1, :])], axis=-2)
    return qw.data[..., ::-1, :], pad(qw.scales), pad(qw.biases)


def _unpack(qw):
    cut = lambda a: None if a is None else a[..., :-1, :][..., ::-1, :]
    return qw.data[..., ::-1, :], cut(qw.scales), cut(qw.biases)


@pytest.fixture(scope="module", autouse=True)
def reversed_rows():
    layouts.register(layouts.Layout(
        "test_reversed_rows", _pack, _unpack,
        lambda qw: None if qw.shape[-2] % 2 == 0 else "N must be even"))
    yield
    del layouts.LAYOUTS["test_reversed_rows"]


def _qw(shape=(2, 8, 64), mode="affine"):
    w = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    return jq.quantize(w, mode=mode)


@pytest.mark.parametrize("mode", ["affine", "mxfp4", "nvfp4"])
def test_round_trip_bit_exact(mode):
    qw = _qw(mode=mode)
    packed = jax.jit(jq.prepack, static_argnames="layout")(qw, layout="test_reversed_rows")
    assert packed.layout == "test_reversed_rows" and packed.shape == qw.shape
    back = jq.unpack_layout(packed)
    assert back.layout == "canonical"
    for a, b in zip(jax.tree_util.tree_leaves(qw), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # indexing a leading axis of a prepacked stack is the prepacked matrix
    np.testing.assert_array_equal(np.asarray(jq.unpack_layout(packed[1]).data),
                                  np.asarray(qw[1].data))


def test_ops_accept_a_kernel_layout():
    qw = _qw()
    packed = jq.prepack(qw, layout="test_reversed_rows")
    x = jax.random.normal(jax.random.key(1), (3, 64), jnp.float32)
    ref = dict(backend="reference")  # auto may pick a kernel for the canonical layout
    np.testing.assert_array_equal(np.asarray(jq.dequantize(packed)),
                                  np.asarray(jq.dequantize(qw, **ref)))
    np.testing.assert_array_equal(np.asarray(jq.qmm(x, packed[0])),
                                  np.asarray(jq.qmm(x, qw[0], **ref)))
    idx = jnp.array([[1, 0]])
    np.testing.assert_array_equal(np.asarray(jq.gather_qmm(x[:1], packed, idx)),
                                  np.asarray(jq.gather_qmm(x[:1], qw, idx, **ref)))


def test_errors():
    qw = _qw()
    with pytest.raises(ValueError, match="layout='nope' is not known"):
        jq.prepack(qw, layout="nope")
    with pytest.raises(ValueError, match="N must be even"):
        jq.prepack(_qw((7, 64)), layout="test_reversed_rows")
    with pytest.raises(TypeError, match="qw must be a jaxquant.QuantizedArray"):
        jq.prepack(np.zeros((4, 4)))
    with pytest.raises(IndexError, match="jq.unpack_layout it first"):
        jq.prepack(qw, layout="test_reversed_rows")[0, 1:3]


def test_cuda_mma_refuses_affine_group16():
    """The cuda_mma kernels take affine groups of 32 and more: a group-16 array (GGUF
    Q6_K / Q2_K) stays canonical, where the GEMV decodes it."""
    from jaxquant.layouts import cuda_mma

    qw = jq.quantize(rand(3, (32, 128)), mode="affine", bits=6, group_size=16)
    assert "group_size=16" in cuda_mma.unsupported(qw)
    assert cuda_mma.unsupported(jq.quantize(rand(3, (32, 128)), mode="affine", bits=6,
                                            group_size=32)) is None
    assert layouts.default_layout(qw, platform="cuda") == "canonical"


def test_no_layout_named_keeps_canonical_where_no_kernel_reads_another():
    qw = _qw()
    assert jq.prepack(qw, layout="canonical") is qw
    assert layouts.default_layout(qw, platform="no_such_platform") == "canonical"


# ---------------------------------------------------------------------------
# Bounded memory: jq.prepack converts a stack piece by piece.

UNFUSED = {"xla_disable_hlo_passes": "fusion"}  # the worst case: every intermediate stored


def _temp_and_out(fn, *args):
    m = jax.jit(fn).lower(*args).compile(compiler_options=UNFUSED).memory_analysis()
    return m.temp_size_in_bytes, m.output_size_in_bytes


@pytest.mark.parametrize("shape", [(2, 4, 512, 256), (2048, 256)])
@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_prepack_in_bounded_memory(shape, mode):
    """A stacked [L, E, N, K] weight (and one tall matrix) prepacks with at most a
    quarter of its bytes in temporaries, the result itself 1x; converting it all at
    once (the layout's pack on the whole array) needs many times that."""
    qw = _qw(shape, mode)
    own = sum(a.nbytes for a in jax.tree_util.tree_leaves(qw))
    temp, out = _temp_and_out(lambda q: jq.prepack(q, layout="cuda_mma"), qw)
    assert temp <= 0.25 * own and out <= 1.001 * own, (temp / own, out / own)
    whole, _ = _temp_and_out(layouts.get("cuda_mma").pack, qw)
    assert whole > 4 * own  # what the pieces avoid (so the bound above can fail)
    temp, _ = _temp_and_out(jq.unpack_layout, jq.prepack(qw, layout="cuda_mma"))
    assert temp <= 0.25 * own, temp / own


@pytest.mark.parametrize("layout,mode,shape", [
    ("cuda_mma", "affine", (3, 2, 200, 128)),     # N % 16 != 0: canonical tail rows
    ("cuda_mma", "mxfp4", (1, 1000, 64)),         # one tall matrix: blocks of rows + a tail
    ("cuda_mma", "nvfp4", (5, 48, 64)),
    ("cuda_mma", "mxfp4", (1024, 64)),            # blocks cover every row: no tail
    ("cdna4", "mxfp4", (2, 3, 336, 256)),         # scales padded to 32 rows after the tail
    ("cdna4", "mxfp4", (64, 512)),                # no tail
    ("test_reversed_rows", "affine", (6, 8, 64)),  # no row blocks: whole matrices
])
def test_pieces_equal_the_whole(layout, mode, shape):
    """Piece by piece is bit for bit the layout's pack (and unpack) of the whole."""
    qw = _qw(shape, mode)
    target = layouts.get(layout)
    packed = jq.prepack(qw, layout=layout)
    for got, want in zip((packed.data, packed.scales, packed.biases), target.pack(qw)):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    back = jq.unpack_layout(packed)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(qw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("layout", ["cdna4", "cuda_mma"])
@pytest.mark.parametrize("shape", [(64, 512), (2, 64, 512), (48, 512)])
def test_prepack_when_row_blocks_cover_every_row(layout, shape):
    """Converted in row blocks (one matrix is over the piece budget) whose count divides N:
    no empty tail piece is converted (cdna4's pack cannot take 0 rows)."""
    qw = jq.quantize(jax.random.normal(jax.random.key(0), shape), mode="mxfp4")
    packed = jq.prepack(qw, layout=layout)
    assert packed.layout == layout
    np.testing.assert_array_equal(np.asarray(jq.unpack_layout(packed).data), np.asarray(qw.data))
    np.testing.assert_array_equal(np.asarray(jq.unpack_layout(packed).scales),
                                  np.asarray(qw.scales))
