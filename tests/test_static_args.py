"""Static arguments passed as traced values: the error names the argument and says
how to make it static (jax.jit's static_argnames), never a bare tracer error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

W = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
X = np.ones((2, 64), np.float32)
QW = jq.quantize(W, "mxfp4")
QE = jq.quantize(W[None], "mxfp4")
IDX = jnp.zeros((2, 1), jnp.int32)

CASES = {
    # (call, the argument the error must name, the function)
    "qmm-transpose": (lambda: jax.jit(jq.qmm)(X, QW, False), "transpose", "qmm"),
    "gather_qmm-transpose": (lambda: jax.jit(lambda x, t: jq.gather_qmm(x, QE, IDX, t))(X, True),
                             "transpose", "gather_qmm"),
    "ragged_qmm-transpose": (lambda: jax.jit(lambda x, t: jq.ragged_qmm(
        x, QE, jnp.array([2], jnp.int32), t))(X, True), "transpose", "ragged_qmm"),
    "quantize-bits": (lambda: jax.jit(lambda w, b: jq.quantize(w, "affine", b))(W, 4), "bits",
                      "quantize"),
    "quantize-group_size": (lambda: jax.jit(lambda w, g: jq.quantize(w, group_size=g))(W, 32),
                            "group_size", "quantize"),
    "rms_norm-eps": (lambda: jax.jit(jq.rms_norm)(X, None, 1e-6), "eps", "rms_norm"),
    "add_rms_norm-weight_offset": (lambda: jax.jit(
        lambda x, o: jq.add_rms_norm(x, x, None, weight_offset=o))(X, 1.0), "weight_offset",
        "add_rms_norm"),
    "gated_rms_norm-group_size": (lambda: jax.jit(
        lambda x, g: jq.gated_rms_norm(x, x, None, group_size=g))(X, 32), "group_size",
        "gated_rms_norm"),
    "gated_rms_norm-norm_before_gate": (lambda: jax.jit(
        lambda x, b: jq.gated_rms_norm(x, x, None, norm_before_gate=b))(X, True),
        "norm_before_gate", "gated_rms_norm"),
    "rms_norm_qmm-weight_offset": (lambda: jax.jit(
        lambda x, o: jq.rms_norm_qmm(x, None, QW, weight_offset=o))(X, 1.0), "weight_offset",
        "rms_norm_qmm"),
    "qmm_swiglu-alpha": (lambda: jax.jit(
        lambda x, a: jq.qmm_swiglu(x, QW, activation="gpt_oss", alpha=a))(X, 1.7), "alpha",
        "qmm_swiglu"),
    "gather_qmm_swiglu-limit": (lambda: jax.jit(
        lambda x, lim: jq.gather_qmm_swiglu(x, QE, IDX, activation="gpt_oss", limit=lim))(X, 7.0),
        "limit", "gather_qmm_swiglu"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_traced_static_argument_names_it_and_static_argnames(case):
    call, name, fn = CASES[case]
    with pytest.raises(TypeError) as e:
        call()
    msg = str(e.value)
    assert f"{name} of jq.{fn} is a static argument" in msg, msg
    assert f"static_argnames=({name!r},)" in msg and f"functools.partial(jq.{fn}" in msg, msg


def test_string_argument_is_refused_by_jax_naming_it():
    """A string never reaches jaxquant under jit: JAX refuses it first. Its message
    names the argument and static_argnames, which is what a user needs."""
    with pytest.raises(TypeError, match=r"(?s)path mode.*static_argnames"):
        jax.jit(jq.quantize)(W, "mxfp4")


def test_the_idioms_the_errors_suggest_work():
    y = jax.jit(jq.qmm, static_argnames="transpose")(X, QW, transpose=False)
    np.testing.assert_array_equal(y, jq.qmm(X, QW, False))
    qw = jax.jit(jq.quantize, static_argnames=("mode", "bits", "group_size"))(
        W, mode="affine", bits=4, group_size=32)
    assert (qw.mode, qw.bits, qw.group_size) == ("affine", 4, 32)
    q2 = jax.jit(functools.partial(jq.quantize, mode="mxfp4"))(W)
    np.testing.assert_array_equal(q2.data, QW.data)
