"""jq.decode_attention: the reference against a float64 numpy oracle written from the
op's definition (docs/ops.md), argument checks, and the op under jit, vmap, scan, grad
and x64. The Pallas kernel: tests/test_pallas_attention.py (interpret mode, and its tests
marked `gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def attention64(q, k, v, positions, window=0, sinks=None, scale=None):
    """float64, one (batch, query, head) at a time, from the definition: key s is
    visible iff s <= pos and (window == 0 or pos - s < window); sinks join the
    softmax's denominator only; no visible key: NaN without sinks, 0 with them."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, hq, hd = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scale = hd ** -0.5 if scale is None else scale
    out = np.zeros((b, t, hq, hd))
    for bi in range(b):
        for ti in range(t):
            pos = int(positions[bi, ti])
            keys = [j for j in range(s) if j <= pos and (window == 0 or pos - j < window)]
            for h in range(hq):
                kv = h // (hq // hkv)
                logits = np.array([q[bi, ti, h] @ k[bi, j, kv] * scale for j in keys])
                sink = None if sinks is None else float(np.asarray(sinks, np.float64)[h])
                if not keys:
                    out[bi, ti, h] = np.nan if sink is None else 0.0
                    continue
                top = logits.max() if sink is None else max(logits.max(), sink)
                e = np.exp(logits - top)
                den = e.sum() + (0.0 if sink is None else np.exp(sink - top))
                out[bi, ti, h] = (e / den) @ v[bi, keys, kv]
    return out


def _inputs(seed, b, t, hq, hkv, s, hd, dtype, start, sinks=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, hq, hd)).astype(np.float32)).astype(dtype)
    k = jnp.asarray(rng.normal(size=(b, s, hkv, hd)).astype(np.float32)).astype(dtype)
    v = jnp.asarray(rng.normal(size=(b, s, hkv, hd)).astype(np.float32)).astype(dtype)
    pos = jnp.asarray(start + np.arange(t)[None, :] + rng.integers(0, 4, (b, 1)), jnp.int32)
    sk = jnp.asarray(rng.normal(size=(hq,)).astype(np.float32)) if sinks else None
    return q, k, v, pos, sk


# (b, t, hq, hkv, s, hd, start position, window, sinks, dtype)
CASES = [
    (1, 1, 4, 2, 20, 16, 10, 0, False, F32),
    (2, 1, 8, 2, 33, 32, 30, 5, True, F32),          # window, sinks, last key position
    (3, 4, 4, 4, 17, 8, 3, 0, True, BF16),            # multi-head (G = 1), T > 1
    (2, 3, 6, 1, 25, 16, 12, 100, False, F16),        # multi-query (Hkv = 1), window > S
    (1, 2, 4, 2, 12, 16, 20, 3, False, F32),          # positions past S: every key visible
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])) +
                         f"-{'sinks' if c[8] else 'nosinks'}-{jnp.dtype(c[9]).name}")
def test_reference_against_oracle(case):
    b, t, hq, hkv, s, hd, start, window, sinks, dtype = case
    q, k, v, pos, sk = _inputs(0, b, t, hq, hkv, s, hd, dtype, start, sinks)
    got = jax.jit(functools.partial(jq.decode_attention, window=window))(q, k, v, pos, sinks=sk)
    assert got.dtype == jnp.dtype(dtype) and got.shape == q.shape
    want = attention64(q, k, v, np.asarray(pos), window, sk)
    tol = 1e-5 if dtype == F32 else float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def test_scale_and_traced_window():
    q, k, v, pos, sk = _inputs(1, 2, 2, 4, 2, 24, 16, F32, 15, sinks=True)
    f = jax.jit(lambda w, q: jq.decode_attention(q, k, v, pos, sinks=sk, window=w, scale=0.3))
    for w in (0, 1, 4):
        want = attention64(q, k, v, np.asarray(pos), w, sk, scale=0.3)
        np.testing.assert_allclose(f(jnp.int32(w), q), want, rtol=1e-5, atol=1e-5)


def test_no_visible_key_nan_without_sinks_zero_with():
    q, k, v, _, sk = _inputs(2, 1, 2, 4, 2, 8, 16, F32, 0, sinks=True)
    pos = jnp.asarray([[-1, 3]], jnp.int32)     # the first query sees nothing
    y = jq.decode_attention(q, k, v, pos)
    assert np.all(np.isnan(y[0, 0])) and np.all(np.isfinite(y[0, 1]))
    y = jq.decode_attention(q, k, v, pos, sinks=sk)
    assert np.all(y[0, 0] == 0)
    np.testing.assert_allclose(y, attention64(q, k, v, np.asarray(pos), 0, sk), atol=1e-6)


def test_sinks_take_probability_mass():
    # A huge sink takes (almost) all of the mass: the output goes to 0; a very negative
    # one none of it: the output is plain softmax attention.
    q, k, v, pos, _ = _inputs(3, 1, 1, 2, 1, 10, 16, F32, 9)
    plain = jq.decode_attention(q, k, v, pos)
    low = jq.decode_attention(q, k, v, pos, sinks=jnp.full((2,), -1e4))
    high = jq.decode_attention(q, k, v, pos, sinks=jnp.full((2,), 1e4))
    np.testing.assert_allclose(low, plain, rtol=1e-6)
    assert float(jnp.max(jnp.abs(high))) == 0.0


def test_bf16_sinks_and_mixed_dtypes():
    # f32 queries over a bf16 cache (and bf16 sinks): float32 math, f32 output.
    q, k, v, pos, sk = _inputs(4, 2, 1, 4, 2, 20, 32, F32, 19, sinks=True)
    k, v, sk = k.astype(BF16), v.astype(BF16), sk.astype(BF16)
    y = jq.decode_attention(q, k, v, pos, sinks=sk, window=6)
    assert y.dtype == F32
    np.testing.assert_allclose(y, attention64(q, k, v, np.asarray(pos), 6, sk),
                               rtol=1e-5, atol=1e-5)


def test_matches_the_decoder_math_bit_for_bit():
    """The op's reference is the decoder's former attention math: the same program."""
    q, k, v, pos, sk = _inputs(5, 2, 3, 8, 2, 40, 16, BF16, 20, sinks=True)
    window = jnp.int32(7)

    def decoder_math(q, k, v, pos, window, sinks):
        b, t, hq, hd = q.shape
        hkv = k.shape[2]
        qg = q.reshape(b, t, hkv, hq // hkv, hd).astype(jnp.float32)
        scores = jnp.einsum("btgqd,bsgd->bgqts", qg, k.astype(jnp.float32)) * hd ** -0.5
        key_pos = jnp.arange(k.shape[1])
        qpos = pos[:, None, None, :, None]
        visible = (key_pos <= qpos) & ((window == 0) | (qpos - key_pos < window))
        scores = jnp.where(visible, scores, -jnp.inf)
        sink = sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        m = jnp.maximum(jnp.max(scores, -1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - m))
        o = jnp.einsum("bgqts,bsgd->btgqd", probs, v.astype(jnp.float32))
        return o.reshape(b, t, hq, hd).astype(q.dtype)

    want = jax.jit(decoder_math)(q, k, v, pos, window, sk)
    got = jax.jit(lambda *a: jq.decode_attention(*a[:4], window=a[4], sinks=a[5],
                                                 backend="reference"))(q, k, v, pos, window, sk)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------------------
# Transformations.


def test_vmap_shared_cache_and_batched_cache():
    q, k, v, pos, sk = _inputs(6, 2, 1, 4, 2, 12, 16, F32, 8, sinks=True)
    qs = jnp.stack([q, q * 0.5, -q])
    # cache shared: the vmapped queries become more query rows (no copy of the cache)
    y = jax.vmap(lambda q: jq.decode_attention(q, k, v, pos, sinks=sk))(qs)
    for i in range(3):
        np.testing.assert_allclose(y[i], jq.decode_attention(qs[i], k, v, pos, sinks=sk),
                                   rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.vmap(lambda q: jq.decode_attention(q, k, v, pos)))(qs))
    assert "jaxquant_decode_attention" in jaxpr and "[2,3,4,16]" in jaxpr.replace(" ", "")
    # caches batched with the queries and positions: the batch axis folds into B
    ks, vs = jnp.stack([k, k[::-1], -k]), jnp.stack([v, -v, v[::-1]])
    ps = jnp.stack([pos, pos - 3, pos + 1])
    y = jax.jit(jax.vmap(lambda q, k, v, p: jq.decode_attention(q, k, v, p, window=4)))(
        qs, ks, vs, ps)
    for i in range(3):
        np.testing.assert_allclose(y[i], jq.decode_attention(qs[i], ks[i], vs[i], ps[i],
                                                             window=4), rtol=1e-6, atol=1e-6)
    # per-element windows and sinks: vmap of the reference
    ws = jnp.asarray([0, 2, 5], jnp.int32)
    sks = jnp.stack([sk, -sk, sk * 2])
    y = jax.vmap(lambda w, s: jq.decode_attention(q, k, v, pos, sinks=s, window=w))(ws, sks)
    for i in range(3):
        np.testing.assert_allclose(y[i], attention64(q, k, v, np.asarray(pos), int(ws[i]),
                                                     sks[i]), rtol=1e-5, atol=1e-5)


def test_scan_over_layers_with_per_layer_windows():
    # the decoder's use: caches and windows stacked per layer, scanned
    q, k, v, pos, _ = _inputs(7, 1, 1, 4, 2, 16, 16, F32, 15)
    ks, vs = jnp.stack([k, -k]), jnp.stack([v, v * 2])
    windows = jnp.asarray([4, 0], jnp.int32)

    def step(c, xs):
        k, v, w = xs
        return c, jq.decode_attention(q, k, v, pos, window=w)

    _, ys = jax.jit(lambda: jax.lax.scan(step, 0, (ks, vs, windows)))()
    for i, w in enumerate((4, 0)):
        np.testing.assert_allclose(ys[i], attention64(q, ks[i], vs[i], np.asarray(pos), w),
                                   rtol=1e-5, atol=1e-5)


def _reordered_f32_tolerance(q, k, v, positions):
    """How far two float32 evaluations of the attention may differ per output element
    when they sum in different orders (window 0, no sinks). A vmapped call is a batched
    dot and a direct call is not: XLA:CPU splits their reductions (hd for the scores, S
    for the output) differently, and how depends on the vector width (8 lanes with AVX2,
    16 with AVX-512), so the two agree bit for bit on one machine and not on another.
    Reordering a float32 sum of n terms moves it by up to n * 2^-24 * (the sum of the
    terms' magnitudes): a score by hd * u * scale * sum_d |q_d k_d|, which exp turns into
    that relative error of each probability; the output by S * u * sum_s p_s |v_s| plus
    the probabilities' error times the same sum. The bound is against the terms' size,
    not the element's: an output element that is a cancellation (0.01 out of terms near
    1) differs by a fraction of the terms' ulp, which rtol alone calls a 2e-6 error."""
    u = 2.0 ** -24
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, _, hq, hd = q64.shape
    s, hkv = k64.shape[1], k64.shape[2]
    kq = np.repeat(np.abs(k64), hq // hkv, axis=2)           # [B, S, Hq, hd]
    score_terms = np.einsum("bthd,bshd->bths", np.abs(q64), kq).max() * hd ** -0.5
    terms = attention64(q, k, np.abs(np.asarray(v, np.float64)), np.asarray(positions))
    return 2 * u * (2 * (hd + 2) * score_terms + s + 4) * terms


def _assert_within(got, want, tolerance):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= tolerance), f"error / tolerance up to {np.max(err / tolerance):.3g}"


def test_layer_of_a_stacked_cache():
    # the caches of every layer stacked [L, B, S, Hkv, hd], one read by index, in a scan
    # over the layers (the stack is not sliced); a traced index follows
    # lax.dynamic_index_in_dim (negative from the end, clamped)
    q, k, v, pos, sk = _inputs(11, 2, 1, 4, 2, 12, 16, F32, 9, sinks=True)
    ks, vs = jnp.stack([k, -k, k * 2]), jnp.stack([v, v * 3, -v])
    windows = jnp.asarray([0, 3, 5], jnp.int32)

    def step(c, xs):
        layer, w = xs
        return c, jq.decode_attention(q, ks, vs, pos, sinks=sk, window=w, layer=layer)

    _, ys = jax.jit(lambda: jax.lax.scan(step, 0, (jnp.arange(3), windows)))()
    for i in range(3):
        np.testing.assert_allclose(ys[i], attention64(q, ks[i], vs[i], np.asarray(pos),
                                                      int(windows[i]), sk), rtol=1e-5, atol=1e-5)
    at = jax.jit(lambda i: jq.decode_attention(q, ks, vs, pos, layer=i))
    np.testing.assert_array_equal(at(jnp.int32(-1)), at(jnp.int32(2)))
    np.testing.assert_array_equal(at(jnp.int32(7)), at(jnp.int32(2)))
    # vmap over queries keeps one stack (the queries become rows); over layers: the reference
    qs = jnp.stack([q, -q])
    y = jax.vmap(lambda q: jq.decode_attention(q, ks, vs, pos, layer=1))(qs)
    _assert_within(y[1], jq.decode_attention(-q, ks[1], vs[1], pos),
                   _reordered_f32_tolerance(-q, ks[1], vs[1], pos))
    y = jax.vmap(lambda i: jq.decode_attention(q, ks, vs, pos, layer=i))(jnp.arange(3))
    _assert_within(y[2], jq.decode_attention(q, ks[2], vs[2], pos),
                   _reordered_f32_tolerance(q, ks[2], vs[2], pos))
    with pytest.raises(ValueError, match=r"k_cache must be \[L, B=2"):
        jq.decode_attention(q, k, v, pos, layer=0)
    with pytest.raises(ValueError, match="layer must be >= 0"):
        jq.decode_attention(q, ks, vs, pos, layer=-1)
    with pytest.raises(TypeError, match="layer must be an integer"):
        jq.decode_attention(q, ks, vs, pos, layer=1.0)


def test_grad_through_the_reference():
    q, k, v, pos, sk = _inputs(8, 1, 1, 2, 1, 6, 8, F32, 5, sinks=True)
    loss = lambda q, k, v, s: jnp.sum(jq.decode_attention(q, k, v, pos, sinks=s) ** 2)
    ref = lambda q, k, v, s: jnp.sum(jq.ops.attention.decode_attention_reference(
        q, k, v, pos, jnp.int32(0), s, scale=8 ** -0.5, precision=None) ** 2)
    for got, want in zip(jax.grad(loss, (0, 1, 2, 3))(q, k, v, sk),
                         jax.grad(ref, (0, 1, 2, 3))(q, k, v, sk)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_x64():
    with jax.enable_x64(True):
        q, k, v, pos, sk = _inputs(9, 1, 2, 2, 1, 9, 8, jnp.float64, 7, sinks=True)
        y = jq.decode_attention(q, k, v, pos.astype(jnp.int64), sinks=sk.astype(jnp.float64),
                                window=3)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, attention64(q, k, v, np.asarray(pos), 3, sk), rtol=1e-12)


def test_a_scoped_backend_without_the_op_leaves_it_to_the_reference():
    # a model run under `with jq.backend("ffi")` keeps working: the ffi backend has no
    # decode_attention, so the op runs its reference; named on the call, it is an error
    if "ffi" not in jq.available_backends():
        pytest.skip("the ffi backend is not built here")
    q, k, v, pos, _ = _inputs(12, 1, 1, 4, 2, 8, 16, F32, 5)
    want = jq.decode_attention(q, k, v, pos, backend="reference")
    with jq.backend("ffi"):
        got = jax.jit(lambda *a: jq.decode_attention(*a))(q, k, v, pos)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(RuntimeError, match="has no kernel for decode_attention"):
        jax.jit(lambda *a: jq.decode_attention(*a, backend="ffi"))(q, k, v, pos)


# ---------------------------------------------------------------------------
# Bad input: errors name the argument.


def test_bad_input():
    q, k, v, pos, sk = _inputs(10, 1, 1, 4, 2, 8, 16, F32, 5, sinks=True)
    att = jq.decode_attention
    with pytest.raises(ValueError, match="q must be"):
        att(q[0], k, v, pos)
    with pytest.raises(ValueError, match="k_cache must be"):
        att(q, k[..., :8], v, pos)
    with pytest.raises(ValueError, match="v_cache must have"):
        att(q, k, v[:, :4], pos)
    with pytest.raises(ValueError, match="multiple of the cache's heads"):
        att(q[:, :, :3], k, v, pos)
    with pytest.raises(ValueError, match="S > 0"):
        att(q, k[:, :0], v[:, :0], pos)
    with pytest.raises(TypeError, match="positions must be an integer"):
        att(q, k, v, pos.astype(F32))
    with pytest.raises(ValueError, match="positions must be"):
        att(q, k, v, pos[0])
    with pytest.raises(ValueError, match="sinks must be"):
        att(q, k, v, pos, sinks=sk[:2])
    with pytest.raises(TypeError, match="sinks must be"):
        att(q, k, v, pos, sinks=sk.astype(jnp.int32))
    with pytest.raises(TypeError, match="k_cache must be"):
        att(q, k.astype(jnp.int8), v, pos)
    with pytest.raises(ValueError, match="window must be >= 0"):
        att(q, k, v, pos, window=-1)
    with pytest.raises(TypeError, match="window must be an integer"):
        att(q, k, v, pos, window=2.5)
    with pytest.raises(TypeError, match="window must be an integer"):
        att(q, k, v, pos, window=jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="scale must be a real"):
        att(q, k, v, pos, scale="big")
    with pytest.raises(TypeError, match="scale of jq.decode_attention is a static"):
        jax.jit(lambda s: att(q, k, v, pos, scale=s))(1.0)
