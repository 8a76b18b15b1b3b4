"""jq.quantize's default layout (docs/layouts.md, "Where the default layout comes
from"): the default device's kernel layout, so that jq.qmm on what jq.quantize
returns runs the fastest kernel there, and every consumer of a QuantizedArray
taking that layout as it takes the canonical one.

A kernel layout is data, so it is built and checked on a CPU: `kernel_default`
makes the cuda_mma layout the CPU's default, the rule an NVIDIA GPU with the
CUDA library follows (jaxquant/ffi registers it there), and each consumer is
run on the result against the same weight quantized canonically: exporters give
the same bytes, dequantize the same values, every op the same product on the
reference and ffi backends. The GPU half (the layout there, the kernel it
runs) is tests/test_decode_gpu.py's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import layouts
from jaxquant.layouts import cuda_mma
from tests.common import assert_matmul_close, deq64, rand

MMA = cuda_mma.NAME


@pytest.fixture
def kernel_default(monkeypatch):
    """cuda_mma as the default layout on this (CPU) platform. The choice is made
    when jq.quantize runs (at trace time under jit), so the tests below call it
    outside any jit cached from before the fixture."""
    layout = layouts.LAYOUTS[MMA]
    platform = layouts.default_platform()
    monkeypatch.setitem(layouts.LAYOUTS, MMA,
                        dataclasses.replace(layout, platforms=layout.platforms + (platform,)))


def _pair(mode, shape, key=0, dtype=jnp.float32, **kw):
    """(canonical, default) quantizations of one weight; N = 40 in the tests: two
    16-row tiles of the layout and 8 rows after them."""
    w = rand(key, shape, dtype)
    return (jq.quantize(w, mode=mode, layout="canonical", **kw),
            jq.quantize(w, mode=mode, **kw))


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------
# The rule


def test_default_is_canonical_where_no_kernel_reads_another():
    """Without the fixture (this CPU): jq.quantize is canonical, as jq.prepack's
    default is here, and bit for bit what layout="canonical" gives."""
    assert layouts.default_layout(jq.quantize(rand(0, (16, 64))), "cpu") == "canonical"
    canonical, default = _pair("affine", (40, 128), bits=4, group_size=64)
    assert default.layout == canonical.layout == "canonical"
    _leaves_equal(default, canonical)


@pytest.mark.parametrize("mode,kw", [("affine", dict(bits=4, group_size=64)),
                                     ("affine", dict(bits=3, group_size=32)),
                                     ("mxfp4", {}), ("nvfp4", {}), ("mxfp6_e2m3", {})])
def test_quantize_returns_the_default_devices_layout(kernel_default, mode, kw):
    canonical, default = _pair(mode, (2, 40, 128), **kw)
    assert canonical.layout == "canonical" and default.layout == MMA
    assert default.shape == canonical.shape and default.dtype == canonical.dtype
    assert not np.array_equal(np.asarray(default.data), np.asarray(canonical.data))
    _leaves_equal(jq.unpack_layout(default), canonical)  # the same bits, permuted
    _leaves_equal(default, jq.prepack(canonical))         # what jq.prepack gives
    # jq.prepack of a weight already in the layout is that weight, named or not
    assert jq.prepack(default) is default and jq.prepack(default, MMA) is default
    _leaves_equal(jq.prepack(default, "canonical"), canonical)


def test_layout_argument(kernel_default):
    w = rand(1, (16, 96))  # K = 96: not a multiple of the layout's 64-wide chunks
    assert jq.quantize(w, mode="mxfp4").layout == "canonical"  # the default falls back
    with pytest.raises(ValueError, match="multiple of 64"):
        jq.quantize(w, mode="mxfp4", layout=MMA)  # a named layout does not
    with pytest.raises(ValueError, match="layout='nope' is not known"):
        jq.quantize(w, mode="mxfp4", layout="nope")
    with pytest.raises(TypeError, match="layout must be a layout name or None"):
        jq.quantize(w, mode="mxfp4", layout=3)
    with pytest.raises(TypeError, match="layout of jq.quantize is a static argument"):
        jax.jit(lambda w, l: jq.quantize(w, layout=l))(w, jnp.int32(0))


def test_layout_is_static_through_jit_and_vmap(kernel_default):
    w = rand(2, (3, 40, 64))
    jitted = jax.jit(jq.quantize, static_argnames=("mode", "layout"))
    packed = jitted(w, mode="mxfp4")
    assert packed.layout == MMA
    _leaves_equal(packed, jq.quantize(w, mode="mxfp4"))
    _leaves_equal(jitted(w, mode="mxfp4", layout="canonical"),
                  jq.quantize(w, mode="mxfp4", layout="canonical"))
    mapped = jax.vmap(lambda m: jq.quantize(m, mode="nvfp4"))(w)  # a global scale per matrix
    assert mapped.layout == MMA and np.shape(mapped.global_scale) == (3,)
    _leaves_equal(jq.unpack_layout(mapped),
                  jax.vmap(lambda m: jq.quantize(m, mode="nvfp4", layout="canonical"))(w))


def test_leading_axis_indexing(kernel_default):
    canonical, default = _pair("affine", (3, 40, 64), bits=4, group_size=64)
    _leaves_equal(default[1], jq.prepack(canonical[1]))
    _leaves_equal(default[1:], jq.prepack(canonical[1:]))
    with pytest.raises(IndexError, match="jq.unpack_layout it first"):
        default[0, :16]


# ---------------------------------------------------------------------------
# Values and ops


@pytest.mark.parametrize("mode,kw", [("affine", dict(bits=4, group_size=64)),
                                     pytest.param("mxfp4", {}, marks=pytest.mark.full),
                                     pytest.param("nvfp4", {}, marks=pytest.mark.full)])
@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_dequantize_and_every_op(kernel_default, mode, kw, backend):
    if backend not in jq.available_backends():
        pytest.skip(f"backend {backend!r} is not built here")
    e, n, k, t = 3, 40, 128, 5
    canonical, default = _pair(mode, (e, n, k), key=3, **kw)
    assert default.layout == MMA
    x = rand(4, (t, k))
    b = dict(backend=backend)
    ref = dict(backend="reference")
    same = lambda got, want: np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # the values: the oracle's to a few float32 roundings (affine's q * scale + bias
    # may round twice, relative to its terms, not to their sum), and (reference) bit
    # for bit those of the canonical weight
    want = deq64(canonical)
    for dtype, rtol in ((jnp.float32, 2.0**-22), (jnp.bfloat16, 2.0**-8)):
        got = jq.dequantize(default, dtype, **b)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol,
                                   atol=2.0**-21 * np.max(np.abs(want)))
        if backend == "reference":
            same(got, jq.dequantize(canonical, dtype, **ref))
    # the products against the float64 oracle, and (reference) bit for bit with canonical
    y = jq.qmm(x, default[0], **b)
    assert_matmul_close(y, x, deq64(canonical[0]), jnp.float32)
    idx = jnp.asarray([[0, 2], [1, 1], [2, 0], [1, 0], [0, 0]])
    yg = jq.gather_qmm(x, default, idx, **b)
    xs = np.broadcast_to(np.asarray(x)[:, None, None, :], (t, 2, 1, k))
    assert_matmul_close(yg[:, :, None, :], xs, deq64(canonical)[np.asarray(idx)], jnp.float32)
    sizes = jnp.asarray([2, 0, 3])
    yr = jq.ragged_qmm(x, default, sizes, **b)
    rows = np.repeat(np.arange(e), np.asarray(sizes))
    assert_matmul_close(yr[:, None, :], x[:, None, :], deq64(canonical)[rows], jnp.float32)
    if backend == "reference":
        same(y, jq.qmm(x, canonical[0], **ref))
        same(yg, jq.gather_qmm(x, canonical, idx, **ref))
        same(yr, jq.ragged_qmm(x, canonical, sizes, **ref))
    # the fused decode ops
    nw = 1 + 0.1 * rand(5, (k,))
    for got, want in (
            (jq.rms_norm_qmm(x, nw, default[0], **b), jq.rms_norm_qmm(x, nw, canonical[0], **ref)),
            (jq.qmm_swiglu(x, default[0], **b), jq.qmm_swiglu(x, canonical[0], **ref)),
            (jq.gather_qmm_swiglu(x, default, idx, **b),
             jq.gather_qmm_swiglu(x, canonical, idx, **ref))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-5 * float(np.max(np.abs(np.asarray(want)))))
    # 8-bit rows of its values (jq.quantize_rows reads a QuantizedArray's values)
    _leaves_equal(jq.quantize_rows(default), jq.quantize_rows(canonical))


# ---------------------------------------------------------------------------
# Exporters: the canonical bytes from either layout


def _symmetric_affine4(n=40, k=128):
    """A 4-bit affine array of the form GPTQ, AWQ, compressed-tensors and GGUF Q4_0
    store: group 32, float16 power-of-two scales, biases -8 * scale (exact)."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    scales = (2.0 ** -rng.integers(2, 7, (n, k // 32))).astype(np.float16)
    return jq.QuantizedArray(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(-8 * scales),
                             mode="affine", bits=4, group_size=32, dtype=jnp.float16)


def _exports():
    mx4 = jq.quantize(rand(8, (2, 40, 128)), mode="mxfp4", layout="canonical")
    mx6 = jq.quantize(rand(9, (40, 128)), mode="mxfp6_e2m3", layout="canonical")
    aff = jq.quantize(rand(10, (40, 128)), mode="affine", bits=4, group_size=64,
                      layout="canonical")
    sym = _symmetric_affine4()
    io = jq.io
    return [
        ("to_mlx_tensors affine", lambda q: io.to_mlx_tensors(q, "w"), aff),
        ("to_mlx_tensors mxfp4", lambda q: io.to_mlx_tensors(q, "w"), mx4),
        ("to_gpt_oss", io.to_gpt_oss, mx4),
        ("to_ggml_mxfp4", io.to_ggml_mxfp4, mx4),
        ("to_mx_blocks mxfp4", io.to_mx_blocks, mx4),
        ("to_mx_blocks mxfp6", io.to_mx_blocks, mx6),
        ("to_gptq", io.to_gptq, sym),
        ("to_gptq act order", lambda q: io.to_gptq(q, np.random.default_rng(0).permutation(128)),
         sym),
        ("to_awq", io.to_awq, sym),
        ("to_compressed_tensors affine", lambda q: io.to_compressed_tensors(q, "w"), sym),
        ("to_compressed_tensors mxfp4", lambda q: io.to_compressed_tensors(q[0], "w"), mx4),
        ("to_gguf_tensor Q4_0", lambda q: io.to_gguf_tensor(q, "Q4_0"), sym),
        ("to_gguf_tensor Q4_1", lambda q: io.to_gguf_tensor(q, "Q4_1"), sym),
        ("to_gguf_tensor MXFP4", lambda q: io.to_gguf_tensor(q, "MXFP4"), mx4),
        ("jq.mlx.to_mlx", jq.mlx.to_mlx, aff),
    ]


@pytest.mark.parametrize("name,export,canonical", _exports(), ids=[e[0] for e in _exports()])
def test_exporters_write_the_canonical_bytes(name, export, canonical):
    packed = jq.prepack(canonical, MMA)
    assert packed.layout == MMA
    assert not np.array_equal(np.asarray(packed.data), np.asarray(canonical.data))
    _leaves_equal(export(packed), export(canonical))


def test_safetensors_file_is_the_canonical_one(kernel_default, tmp_path):
    canonical, default = _pair("mxfp4", (40, 128), key=11)
    for name, qw in (("canonical", canonical), ("default", default)):
        jq.io.save_safetensors(tmp_path / f"{name}.safetensors", jq.io.to_mlx_tensors(qw, "w"))
    assert ((tmp_path / "canonical.safetensors").read_bytes()
            == (tmp_path / "default.safetensors").read_bytes())
    back = jq.io.from_mlx_tensors(jq.io.load_safetensors(tmp_path / "default.safetensors"), "w",
                                  bits=4, group_size=32, mode="mxfp4", dtype=jnp.float32)
    _leaves_equal(back, canonical)


def test_mlx_functions_stay_canonical(kernel_default):
    """jq.mlx speaks MLX's arrays: its quantize gives them whatever the default
    layout, and its matmuls take them."""
    w = rand(12, (40, 128))
    canonical = jq.quantize(w, mode="affine", bits=4, group_size=64, layout="canonical")
    _leaves_equal(jq.mlx.quantize(w, group_size=64, bits=4), jq.mlx.to_mlx(canonical))
    x = rand(13, (3, 128))
    got = jq.mlx.quantized_matmul(x, *jq.mlx.to_mlx(jq.quantize(w, mode="affine", bits=4,
                                                                 group_size=64)),
                                  group_size=64, bits=4, backend="reference")
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(jq.qmm(x, canonical, backend="reference")))


# ---------------------------------------------------------------------------
# Other producers and consumers


def test_models_quantize_straight_into_their_layout(kernel_default):
    from jaxquant import models

    cfg = models.Config(family="llama", vocab_size=64, hidden_size=128, intermediate_size=192,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, dtype="float32")
    params = models.init_params(cfg, jax.random.key(0))
    layouts_of = lambda p: {a.layout for a in jax.tree_util.tree_leaves(
        p, is_leaf=lambda a: isinstance(a, jq.QuantizedArray)) if isinstance(a, jq.QuantizedArray)}
    fast = models.quantize_params(params, "mxfp4", per_layer=True)
    assert layouts_of(fast) == {MMA}
    slow = models.quantize_params(params, "mxfp4", per_layer=True, layout="canonical")
    assert layouts_of(slow) == {"canonical"}
    for a, b in zip(jax.tree_util.tree_leaves(models.prepack_params(fast, "canonical")),
                    jax.tree_util.tree_leaves(slow)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_places_canonically_then_prepacks(kernel_default):
    nnx = pytest.importorskip("flax.nnx")
    import jaxquant.nnx as jqnnx

    model = nnx.Linear(128, 48, rngs=nnx.Rngs(0))
    holder = nnx.Sequential(model)
    x = rand(14, (3, 128))
    jqnnx.quantize(holder, "mxfp4")
    qw = holder.layers[0].qweight.get_value()
    assert qw.layout == MMA
    y = holder(x)
    canonical = jq.unpack_layout(qw)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jq.qmm(x, canonical)) + np.asarray(
        holder.layers[0].bias.get_value()), rtol=1e-5, atol=1e-5)
    other = nnx.Sequential(nnx.Linear(128, 48, rngs=nnx.Rngs(0)))
    jqnnx.quantize(other, "mxfp4", prepack=False)
    _leaves_equal(other.layers[0].qweight.get_value(), canonical)


def test_device_put_to_the_host_keeps_the_layout(kernel_default):
    default = jq.quantize(rand(15, (40, 64)), mode="mxfp4")
    host = jax.device_put(default, jax.devices("cpu")[0])
    assert host.layout == MMA
    _leaves_equal(host, default)
    np.testing.assert_array_equal(np.asarray(jq.dequantize(host)),
                                  np.asarray(jq.dequantize(jq.unpack_layout(default))))
