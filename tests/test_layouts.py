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


def test_no_layout_named_keeps_canonical_where_no_kernel_reads_another():
    qw = _qw()
    assert jq.prepack(qw, layout="canonical") is qw
    assert layouts.default_layout(qw, platform="no_such_platform") == "canonical"
