"""Bad input to quantize / dequantize / QuantizedArray (docs/ops.md): rejected at
trace time with ValueError / TypeError whose message names the argument (and,
where there is one, the offending value)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

W = np.ones((4, 64), np.float32)
QA = jq.QuantizedArray


def quantize_jit(w, **kw):
    return jax.jit(lambda w: jq.quantize(w, **kw))(w)


# ---------------------------------------------------------------------------
# quantize: w


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.complex64, bool])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_w_dtype(dtype, jit):
    w = np.ones((4, 64), dtype)
    with pytest.raises(TypeError, match=r"\bw\b.*" + np.dtype(dtype).name):
        (quantize_jit if jit else jq.quantize)(w, mode="mxfp4")


@pytest.mark.parametrize("w", ["abc", None, object()])
def test_quantize_w_not_numeric(w):
    with pytest.raises(TypeError, match=r"\bw\b"):
        jq.quantize(w)


@pytest.mark.parametrize("shape", [(64,), (), (32,)])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_w_ndim(shape, jit):
    w = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match=r"\bw\b.*(2 dim|\[\.\.\., N, K\])"):
        (quantize_jit if jit else jq.quantize)(w, mode="mxfp4")


@pytest.mark.parametrize("mode,group,k", [("affine", 64, 96), ("affine", 128, 192), ("mxfp4", 32, 48),
                                          ("nvfp4", 16, 24), ("fp4", 64, 96), ("mxfp6_e3m2", 32, 40),
                                          ("iq4nl", 32, 48)])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_k_not_multiple_of_group(mode, group, k, jit):
    w = np.ones((3, k), np.float32)
    with pytest.raises(ValueError, match=rf"(?s)(K={k}|{k}).*group_size={group}"):
        (quantize_jit if jit else jq.quantize)(w, mode=mode, group_size=group)


# ---------------------------------------------------------------------------
# quantize: mode, bits, group_size, scale_rule


@pytest.mark.parametrize("mode", ["int4", "MXFP4", "mxfp6", "", "nvfp8"])
def test_quantize_unknown_mode(mode):
    with pytest.raises(ValueError, match=rf"mode={mode!r}"):
        jq.quantize(W, mode=mode)


@pytest.mark.parametrize("mode", [None, 4, ("mxfp4",)])
def test_quantize_mode_not_a_string(mode):
    with pytest.raises((TypeError, ValueError), match=r"\bmode\b"):
        jq.quantize(W, mode=mode)


@pytest.mark.parametrize("mode,bits", [("affine", 7), ("affine", 1), ("affine", 16), ("affine", 0),
                                       ("mxfp4", 8), ("mxfp6_e2m3", 4), ("mxfp8", 4),
                                       ("mxfp8_e5m2", 6), ("nvfp4", 8), ("fp4", 2), ("iq4nl", 8)])
def test_quantize_bits_not_allowed(mode, bits):
    with pytest.raises(ValueError, match=rf"bits={bits}\b.*mode="):
        jq.quantize(W, mode=mode, bits=bits)


@pytest.mark.parametrize("bits", [True, 4.0, "4", [4]])
def test_quantize_bits_wrong_type(bits):
    with pytest.raises((TypeError, ValueError), match=r"\bbits\b"):
        jq.quantize(W, mode="affine", bits=bits)


@pytest.mark.parametrize("mode,group", [("affine", 8), ("affine", 256), ("affine", 0), ("affine", -64),
                                        ("mxfp4", 64), ("mxfp4", 16), ("nvfp4", 32),
                                        ("fp4", 128), ("fp4", 8), ("mxfp8_e5m2", 64),
                                        ("iq4nl", 16), ("iq4nl", 64)])
def test_quantize_group_size_not_allowed(mode, group):
    w = np.ones((2, 256), np.float32)
    with pytest.raises(ValueError, match=rf"group_size={group}\b.*mode="):
        jq.quantize(w, mode=mode, group_size=group)


@pytest.mark.parametrize("group", [64.0, "64", True])
def test_quantize_group_size_wrong_type(group):
    with pytest.raises((TypeError, ValueError), match=r"group_size"):
        jq.quantize(W, mode="affine", group_size=group)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp6_e2m3", "mxfp8", "mxfp8_e5m2"])
@pytest.mark.parametrize("rule", ["ceil", "FLOOR", "nearest", ""])
def test_quantize_unknown_scale_rule(mode, rule):
    with pytest.raises(ValueError, match=rf"scale_rule={rule!r}"):
        jq.quantize(W, mode=mode, scale_rule=rule)


@pytest.mark.parametrize("mode", ["affine", "nvfp4", "fp4", "iq4nl"])
@pytest.mark.parametrize("rule", ["floor", "rceil", "round"])
def test_quantize_scale_rule_for_non_mx_mode(mode, rule):
    with pytest.raises(ValueError, match=rf"scale_rule={rule!r}.*mode={mode!r}"):
        jq.quantize(W, mode=mode, scale_rule=rule)


def test_quantize_checks_happen_at_trace_time():
    """The checks fire while tracing: no compile, no device work."""
    spec = jax.ShapeDtypeStruct((4, 48), jnp.float32)
    with pytest.raises(ValueError, match="group_size"):
        jax.eval_shape(lambda w: jq.quantize(w, mode="mxfp4"), spec)
    spec = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    with pytest.raises(TypeError, match=r"\bw\b"):
        jax.eval_shape(lambda w: jq.quantize(w, mode="mxfp4"), spec)


# ---------------------------------------------------------------------------
# dequantize


def _good(mode="affine"):
    return jq.quantize(W, mode=mode)


@pytest.mark.parametrize("dtype", [jnp.int32, np.uint8, np.complex64, bool])
def test_dequantize_dtype_not_float(dtype):
    with pytest.raises(TypeError, match=r"\bdtype\b.*" + np.dtype(dtype).name):
        jq.dequantize(_good(), dtype)


def test_dequantize_dtype_not_a_dtype():
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        jq.dequantize(_good(), "bogus")


@pytest.mark.parametrize("qw", [np.ones((4, 64), np.float32), None, (1, 2), "qw"])
def test_dequantize_not_a_quantized_array(qw):
    with pytest.raises(TypeError, match=r"\bqw\b"):
        jq.dequantize(qw)


def test_dequantize_under_jit_rejects_bad_dtype():
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        jax.jit(lambda q: jq.dequantize(q, jnp.int32))(_good("mxfp4"))


# ---------------------------------------------------------------------------
# QuantizedArray


D = np.zeros((4, 8), np.uint32)      # mxfp4 / fp4 / affine-4, K = 64
S8 = np.zeros((4, 2), np.uint8)
SF = np.zeros((4, 2), np.float32)
D16 = np.zeros((4, 8), np.uint32)    # nvfp4, K = 64, 4 groups of 16
S16 = np.zeros((4, 4), np.uint8)


def mx(**kw):
    args = dict(data=D, scales=S8, mode="mxfp4", bits=4, group_size=32, dtype=np.float32)
    args.update(kw)
    data, scales = args.pop("data"), args.pop("scales")
    return QA(data, scales, args.pop("biases", None), args.pop("global_scale", None), **args)


def test_valid_arrays_are_accepted():
    """The baseline of the tests below is valid, so their errors come from the one change."""
    assert mx().shape == (4, 64)
    assert QA(D, SF, SF, mode="affine", bits=4, group_size=32, dtype=np.float32).shape == (4, 64)
    assert QA(D, SF, mode="fp4", bits=4, group_size=32, dtype=np.float32).shape == (4, 64)
    assert QA(D, SF, mode="iq4nl", bits=4, group_size=32, dtype=np.float32).shape == (4, 64)
    assert QA(D16, S16, None, np.float32(0.5), mode="nvfp4", bits=4, group_size=16,
              dtype=np.float32).shape == (4, 64)
    assert QA(D16, S16, mode="nvfp4", bits=4, group_size=16, dtype=np.float32).shape == (4, 64)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32, np.uint64])
def test_qa_data_dtype(dtype):
    with pytest.raises(TypeError, match=r"\bdata\b.*uint32"):
        mx(data=D.astype(dtype))


def test_qa_data_not_an_array():
    with pytest.raises(TypeError, match=r"\bdata\b"):
        mx(data=D.tolist())


@pytest.mark.parametrize("mode,scales", [("mxfp4", SF), ("mxfp4", S8.astype(np.int8)),
                                         ("mxfp4", S8.astype(np.uint16)),
                                         ("fp4", S8), ("fp4", S8.astype(np.int32)),
                                         ("iq4nl", S8), ("iq4nl", S8.astype(np.int16))])
def test_qa_scales_dtype(mode, scales):
    with pytest.raises(TypeError, match=r"\bscales\b"):
        mx(mode=mode, scales=scales)


def test_qa_scales_dtype_affine_and_nvfp4():
    with pytest.raises(TypeError, match=r"\bscales\b"):
        QA(D, S8, S8, mode="affine", bits=4, group_size=32, dtype=np.float32)
    with pytest.raises(TypeError, match=r"\bscales\b"):
        QA(D16, S16.astype(np.float32), mode="nvfp4", bits=4, group_size=16, dtype=np.float32)


def test_qa_scales_not_an_array():
    with pytest.raises(TypeError, match=r"\bscales\b"):
        mx(scales=S8.tolist())


@pytest.mark.parametrize("scales", [S8[:, :1], S8[:3], np.zeros((4, 3), np.uint8), S8[None]])
def test_qa_scales_shape(scales):
    with pytest.raises(ValueError, match=r"\bscales\b"):
        mx(scales=scales)


def test_qa_data_shape_for_bits():
    # the same scales with 6-bit elements need 12 words per row, not 8
    with pytest.raises(ValueError, match=r"\bscales\b|\bdata\b"):
        mx(mode="mxfp6_e2m3", bits=6)


def test_qa_affine_biases():
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        QA(D, SF, mode="affine", bits=4, group_size=32, dtype=np.float32)
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        QA(D, SF, SF[:, :1], mode="affine", bits=4, group_size=32, dtype=np.float32)
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        QA(D, SF, SF.astype(np.float16), mode="affine", bits=4, group_size=32, dtype=np.float32)


@pytest.mark.parametrize("mode", ["mxfp4", "fp4", "iq4nl"])
def test_qa_biases_for_a_mode_without_them(mode):
    scales = S8 if mode == "mxfp4" else SF
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        mx(mode=mode, scales=scales, biases=scales)


def test_qa_global_scale_for_a_mode_without_it():
    with pytest.raises(ValueError, match=r"global_scale"):
        mx(global_scale=np.float32(1))
    with pytest.raises(ValueError, match=r"global_scale"):
        QA(D, SF, SF, np.float32(1), mode="affine", bits=4, group_size=32, dtype=np.float32)


def test_qa_global_scale_shape():
    with pytest.raises(ValueError, match=r"global_scale"):
        QA(D16, S16, None, np.ones(3, np.float32), mode="nvfp4", bits=4, group_size=16,
           dtype=np.float32)


@pytest.mark.parametrize("gs", ["abc", np.int32(1), np.array([1], np.int64).reshape(()),
                                np.complex64(1)])
def test_qa_global_scale_not_float(gs):
    """global_scale is a float32 multiplier (docs/formats.md)."""
    with pytest.raises((TypeError, ValueError), match=r"global_scale"):
        QA(D16, S16, None, gs, mode="nvfp4", bits=4, group_size=16, dtype=np.float32)


@pytest.mark.parametrize("kw,name", [(dict(mode="int4"), "mode"), (dict(bits=8), "bits"),
                                     (dict(group_size=16), "group_size")])
def test_qa_mode_bits_group(kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        mx(**kw)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.complex64])
def test_qa_logical_dtype_not_float(dtype):
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        mx(dtype=dtype)


def test_qa_logical_shape_needs_n_and_k():
    """A QuantizedArray is [..., N, K]: 1-D children are refused, either when built
    or by the ops, with an error naming the argument (not an unpacking error)."""
    try:
        qw = mx(data=D[0], scales=S8[0])
    except (TypeError, ValueError) as e:
        assert any(n in str(e) for n in ("data", "scales", "shape")), e
        return
    with pytest.raises(ValueError, match=r"\bqw\b"):
        jq.dequantize(qw)


def test_qa_rank0():
    with pytest.raises(ValueError, match=r"\bdata\b|\bscales\b"):
        mx(data=np.uint32(0), scales=np.uint8(0))


# ---------------------------------------------------------------------------
# One shape rule for every backend: a QuantizedArray rebuilt without its constructor
# (tree_unflatten) is checked again by each op, so the reference cannot broadcast what a
# kernel refuses.

def _backends():
    return [b for b in ("reference", "ffi", "pallas") if b in jq.available_backends()]


def _unflatten_with_biases(qw, biases):
    leaves, tree = jax.tree_util.tree_flatten(qw)
    leaves[2] = biases
    return jax.tree_util.tree_unflatten(tree, leaves)


@pytest.mark.parametrize("backend", _backends())
def test_ops_refuse_broadcastable_biases(backend):
    w = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    qw = jq.quantize(w, mode="affine", bits=4, group_size=32)
    bad = _unflatten_with_biases(qw, qw.biases[:, :1])                  # [N, 1] of [N, 4]
    x = jnp.ones((2, 128), jnp.float32)
    calls = [lambda: jq.qmm(x, bad, backend=backend),
             lambda: jq.dequantize(bad, backend=backend),
             lambda: jq.qmm_swiglu(x, bad, backend=backend),
             lambda: jq.rms_norm_qmm(x, None, bad, backend=backend),
             lambda: jax.jit(lambda x: jq.qmm(x, bad, backend=backend))(x)]
    for call in calls:
        with pytest.raises(ValueError, match=r"\bbiases\b"):
            call()
    experts = jq.quantize(np.stack([w, w]), mode="affine", bits=4, group_size=32)
    bad3 = _unflatten_with_biases(experts, experts.biases[:, :, :1])
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        jq.gather_qmm(x, bad3, jnp.zeros((2, 1), jnp.int32), backend=backend)
    with pytest.raises(ValueError, match=r"\bbiases\b"):
        jq.ragged_qmm(x, bad3, jnp.array([1, 1]), backend=backend)


# ---------------------------------------------------------------------------
# Expert ids of any integer type: never cut to jax's 32-bit integers (docs/ops.md).

def _experts():
    w = np.random.default_rng(1).standard_normal((3, 16, 64)).astype(np.float32)
    return jq.quantize(w, mode="affine", bits=4, group_size=32), jnp.asarray(w)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype,wide", [(np.int64, 2**32), (np.int64, 2**32 + 2),
                                        (np.int64, -2**32 + 1), (np.uint64, 2**63 + 1),
                                        (np.uint64, 2**32 + 1)])
def test_gather_wide_index_is_a_nan_row(backend, dtype, wide):
    qw, w = _experts()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 64)), jnp.float32)
    idx = np.array([[wide, 1], [2, wide]], dtype)
    for y in (jq.gather_qmm(x, qw, idx, backend=backend),
              jq.gather_matmul(x, w, idx)):
        y = np.asarray(y)
        assert np.isnan(y[0, 0]).all() and np.isnan(y[1, 1]).all()   # not expert wide % 2**32
        assert np.isfinite(y[0, 1]).all() and np.isfinite(y[1, 0]).all()
    ok = jq.gather_qmm(x, qw, np.array([[0, 1], [2, 0]], dtype), backend=backend)
    np.testing.assert_array_equal(np.asarray(ok)[0, 1],
                                  np.asarray(jq.gather_qmm(x, qw, idx, backend=backend))[0, 1])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("sizes,dtype,match", [
    ([2**32, 0, 1], np.int64, "sum to at most"),          # 1 after a cut to int32
    ([2**32 + 1, 0, 0], np.int64, "sum to at most"),
    ([-2**32 + 1, 1, 1], np.int64, ">= 0"),               # +1 after a cut
    ([2**64 - 1, 0, 0], np.uint64, "sum to at most"),
    ([2**31, 2**31, 1], np.uint32, "sum to at most")])    # sums past int32 too
def test_ragged_wide_group_sizes_refused(backend, sizes, dtype, match):
    qw, w = _experts()
    x = jnp.ones((2, 64), jnp.float32)
    gs = np.array(sizes, dtype)
    with pytest.raises(ValueError, match=r"group_sizes.*" + match):
        jq.ragged_qmm(x, qw, gs, backend=backend)
    with pytest.raises(ValueError, match=r"group_sizes.*" + match):
        jq.ragged_matmul(x, w, gs)
    y = jq.ragged_qmm(x, qw, np.array([1, 0, 1], dtype), backend=backend)
    assert y.shape == (2, 16) and np.isfinite(np.asarray(y)).all()
