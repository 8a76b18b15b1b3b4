"""Wrong but well-typed arguments (docs/ops.md, "Wrong arguments"): the cases that used
to pass silently now raise, naming the argument, or give NaN rather than another
row's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models

W = jax.random.normal(jax.random.key(0), (4, 64, 128), jnp.float32)
QE = jq.quantize(W, mode="mxfp4")
X = jnp.ones((3, 128))


@pytest.mark.parametrize("transpose", ["yes", "no", 2, None, 1.0])
def test_transpose_must_be_a_bool(transpose):
    with pytest.raises(TypeError, match="transpose of jq.qmm must be a bool"):
        jq.qmm(X, QE[0], transpose=transpose)
    with pytest.raises(TypeError, match="transpose"):
        jq.gather_qmm(X, QE, jnp.zeros((3, 2), jnp.int32), transpose=transpose)
    with pytest.raises(TypeError, match="transpose"):
        jq.ragged_qmm(X, QE, jnp.array([1, 1, 1, 0]), transpose=transpose)


def test_transpose_accepts_bools_and_0_1():
    want = jq.qmm(X, QE[0])
    for t in (True, np.bool_(True), 1):
        np.testing.assert_array_equal(jq.qmm(X, QE[0], transpose=t), want)
    assert jq.qmm(jnp.ones((3, 64)), QE[0], transpose=0).shape == (3, 128)


@pytest.mark.parametrize("name", ["eps", "weight_offset"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_norm_scalars_must_be_finite(name, value):
    for f in (lambda **kw: jq.rms_norm(X, jnp.ones(128), **kw),
              lambda **kw: jq.add_rms_norm(X, X, jnp.ones(128), **kw),
              lambda **kw: jq.gated_rms_norm(X, X, jnp.ones(128), **kw)):
        with pytest.raises(ValueError, match=f"{name} must be finite"):
            f(**{name: value})


def test_quantized_array_index_out_of_bounds():
    for i in (4, -5, np.int64(7)):
        with pytest.raises(IndexError, match="out of bounds for axis 0 with size 4"):
            QE[i]
    np.testing.assert_array_equal(QE[-1].data, QE[3].data)   # negative indices as numpy
    with pytest.raises(IndexError, match="axis 1 with size 4"):
        jq.quantize(W[None], mode="mxfp4")[0, 4]


@pytest.mark.parametrize("field,value,match", [
    ("head_dim", 63, "even"), ("vocab_size", 0, "vocab_size"), ("num_layers", 0, "num_layers"),
    ("num_kv_heads", 0, "num_kv_heads"), ("dtype", "int8", "dtype"),
    ("rms_eps", -1.0, "rms_eps"), ("rms_eps", float("nan"), "rms_eps")])
def test_config_refuses_impossible_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        models.Config(**{field: value})


@pytest.fixture(scope="module")
def small():
    cfg = models.Config(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, intermediate_size=32, dtype="float32")
    return cfg, models.init_params(cfg, jax.random.key(0))


def test_token_ids_outside_the_vocabulary_give_nan_logits(small):
    cfg, params = small
    good = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
    want = models.prefill(cfg, params, good, 4)[0]
    for bad_id in (32, -1, 1000):
        logits = np.asarray(models.prefill(cfg, params, good.at[0, 2].set(bad_id), 4)[0])
        assert np.isnan(logits[0, 2]).all()              # never another token's row
        np.testing.assert_allclose(logits[1], want[1], rtol=1e-6, atol=1e-6)
    # quantized embeddings (MLX checkpoints) too
    q = dict(params, embed=jq.quantize(params["embed"], mode="affine", bits=8, group_size=32))
    logits = np.asarray(models.prefill(cfg, q, good.at[1, 0].set(32), 4)[0])
    assert np.isnan(logits[1, 0]).all() and np.isfinite(logits[0]).all()


def test_cache_and_step_counts_are_checked(small):
    cfg, params = small
    prompt = jnp.ones((1, 6), jnp.int32)
    with pytest.raises(ValueError, match="max_len=4 must be >= the prompt's length 6"):
        models.prefill(cfg, params, prompt, 4)
    with pytest.raises(ValueError, match="must fit the cache's max_len=4"):
        models.decode(cfg, params, models.init_cache(cfg, 1, 4), jnp.ones(1, jnp.int32), 3, 2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        models.generate(cfg, params, prompt, 0)
    tokens, _, _ = models.decode(cfg, params, models.init_cache(cfg, 1, 4),
                                 jnp.ones(1, jnp.int32), 2, 2)   # exactly fits
    assert tokens.shape == (1, 2)


def test_decode_attention_and_fused_ops_wrong_scalars():
    q, caches = jnp.ones((1, 1, 4, 16)), jnp.ones((2, 1, 8, 2, 16))
    pos = jnp.array([[3]])
    with pytest.raises(ValueError, match="layer=5 is past the caches' 2 layers"):
        jq.decode_attention(q, caches, caches, pos, layer=5)
    np.testing.assert_array_equal(jq.decode_attention(q, caches, caches, pos, layer=1),
                                  jq.decode_attention(q, caches[1], caches[1], pos))
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            jq.decode_attention(q, caches[0], caches[0], pos, scale=scale)
    # a position before every key sees nothing: NaN, not a made-up average
    assert np.isnan(np.asarray(jq.decode_attention(q, caches[0], caches[0],
                                                   jnp.array([[-1]])))).all()
    qw = jq.quantize(W[0], mode="mxfp4")
    with pytest.raises(ValueError, match="alpha must be finite"):
        jq.qmm_swiglu(X, qw, alpha=float("nan"))
    with pytest.raises(ValueError, match="limit must be finite"):
        jq.gather_qmm_swiglu(X, jq.quantize(W[:1], mode="mxfp4"), np.zeros((3, 1), np.int32),
                             activation="gpt_oss", limit=float("inf"))
    with pytest.raises(ValueError, match="eps must be finite"):
        jq.rms_norm_qmm(X, None, qw, eps=float("nan"))
