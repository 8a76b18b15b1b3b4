"""decode_attention: attention of a few new queries over a KV cache (docs/ops.md).

q [B, T, Hq, hd] attends to k_cache / v_cache [B, S, Hkv, hd] (grouped-query:
query head h reads kv head h // (Hq / Hkv)); key s is visible to the query at
positions[b, t] iff s <= pos and, for window > 0, pos - s < window. The cache
already holds this step's keys (the caller writes them first). gpt-oss sinks
(one logit per query head) enter the softmax's denominator only. Softmax and
both contractions in float32 (float64 for float64 inputs); the output has q's
dtype. A query with no visible key gives NaN without sinks, 0 with them.
With `layer`, the caches are every layer's, stacked [L, B, S, Hkv, hd], and the op
reads layer `layer` where it lies (a traced index follows lax.dynamic_index_in_dim:
negative counts from the end, then clamped into [0, L)): a layer loop passes the
whole stack and its index, no slice of it.

The reference is the decoder's attention as it was before it called this op;
kernels (jaxquant.pallas.attention) read the cache in place. `window` is an
operand (models scan over per-layer windows); `scale` is static.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.ops.common import (check_x, compute_dtype, default_precision,
                                 jvp_through_reference, to_front_or_broadcast)
from jaxquant.primitive import Op
from jaxquant.sharding import Dims, Factors
from jaxquant.static_args import require_static


def decode_attention_reference(q, k_cache, v_cache, positions, window, sinks, layer=None, *,
                               scale, precision):
    if layer is not None:
        k_cache = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
        v_cache = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    b, t, hq, hd = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    acc = compute_dtype(jnp.promote_types(q.dtype, k_cache.dtype))
    qg = q.reshape(b, t, hkv, hq // hkv, hd).astype(acc)
    scores = jnp.einsum("btgqd,bsgd->bgqts", qg, k_cache.astype(acc),
                        precision=precision) * scale
    key_pos = jnp.arange(s)
    qpos = positions[:, None, None, :, None]
    visible = key_pos <= qpos
    visible &= (window == 0) | (qpos - key_pos < window)
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is not None:  # gpt-oss: a learned logit per head that takes probability mass
        sink = sinks.astype(acc).reshape(1, hkv, hq // hkv, 1, 1)
        m = jnp.maximum(jnp.max(scores, -1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - m))
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bgqts,bsgd->btgqd", probs, v_cache.astype(acc), precision=precision)
    return o.reshape(b, t, hq, hd).astype(q.dtype)


# Sharding rules (jaxquant/sharding.py): which operand and result dimensions are
# the same logical axis, and which may split.


def attention_factors(q, k_cache, v_cache, positions, window, sinks, layer, **params):
    # Batch, query rows and kv heads split (q's heads are (kv head, group)); the
    # softmax's keys, the head dim and a stack's layers (one is read) do not.
    b, t, hq, hd = q.shape
    s, hkv = k_cache.shape[-3], k_cache.shape[-2]
    sizes = {"b": b, "t": t, "h": hkv, "g": hq // hkv, "s": s, "d": hd}
    if layer is not None:
        sizes["l"] = k_cache.shape[0]
    heads = Dims([("b",), ("t",), ("h", "g"), ("d",)])
    cache = Dims(([] if layer is None else [("l",)]) + [("b",), ("s",), ("h",), ("d",)])
    ops = [heads, cache, cache, Dims([("b",), ("t",)]), Dims([]),
           None if sinks is None else Dims([("h", "g")]), None if layer is None else Dims([])]
    return Factors(ops, [heads], sizes, replicated=("s", "d", "l"), priority=(1, 2))


decode_attention_op = Op("decode_attention", decode_attention_reference,
                         factors=attention_factors)


# ---------------------------------------------------------------------------
# Public function.


def _int_scalar(name, value, meaning):
    """value as an integer scalar array (traced ones pass through); concrete values < 0
    raise."""
    if isinstance(value, jax.core.Tracer) or hasattr(value, "dtype"):
        v = jnp.asarray(value)
        if v.shape != () or not jnp.issubdtype(v.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer scalar; got {v.dtype}{list(v.shape)}")
        if not isinstance(value, jax.core.Tracer) and int(v) < 0:
            raise ValueError(f"{name} must be >= 0 ({meaning}); got {int(v)}")
        return v
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer ({meaning}); got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 ({meaning}); got {value}")
    return jnp.asarray(value, jnp.int32)


def decode_attention(q, k_cache, v_cache, positions, *, sinks=None, window=0, scale=None,
                     layer=None, backend: str | None = None):
    """Attention of q [B, T, Hq, hd] over the cache k_cache / v_cache [B, S, Hkv, hd]
    (Hq a multiple of Hkv; query head h reads kv head h // (Hq // Hkv)) at query
    positions int [B, T]: key s is visible iff s <= pos and, for window > 0,
    pos - s < window. sinks [Hq] (gpt-oss): a logit per head in the softmax's
    denominator only. scale defaults to hd ** -0.5. Float32 softmax; -> [B, T, Hq, hd]
    in q's dtype.

    layer: the caches are all layers' [L, B, S, Hkv, hd] and layer (an int scalar;
    traced, it follows lax.dynamic_index_in_dim) picks one, read in place (no
    per-layer slice in a layer loop).
    window and layer may be traced (e.g. per-layer windows in a scan).
    Static (Python values, not traced under jax.jit): scale, backend."""
    q = check_x(q, "q")
    k_cache, v_cache = check_x(k_cache, "k_cache"), check_x(v_cache, "v_cache")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, hd]; got shape {q.shape}")
    b, t, hq, hd = q.shape
    lead = "" if layer is None else "L, "
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 4 + (layer is not None) or c.shape[-4] != b or c.shape[-1] != hd:
            raise ValueError(f"{name} must be [{lead}B={b}, S, Hkv, hd={hd}]; got shape "
                             f"{c.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}; got "
                         f"{v_cache.shape}")
    s, hkv = k_cache.shape[-3], k_cache.shape[-2]
    if s == 0:
        raise ValueError(f"k_cache must hold at least one position (S > 0); got {k_cache.shape}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads Hq={hq} must be a multiple of the cache's heads Hkv={hkv}")
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be an integer array; got {positions.dtype}")
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [B, T] = {(b, t)}; got shape {positions.shape}")
    if sinks is not None:
        sinks = check_x(sinks, "sinks")
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must be [Hq] = ({hq},); got shape {sinks.shape}")
    window = _int_scalar("window", window, "0: no window")
    if layer is not None:
        layer = _int_scalar("layer", layer, "an index into the caches' first axis")
        if not isinstance(layer, jax.core.Tracer) and int(layer) >= k_cache.shape[0]:
            # lax.dynamic_index_in_dim would clamp it to the last layer
            raise ValueError(f"layer={int(layer)} is past the caches' {k_cache.shape[0]} layers")
    require_static("scale", scale, "decode_attention")
    if scale is None:
        scale = hd ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real scalar (Python or NumPy, static); got {scale!r}")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return decode_attention_op.bind(q, k_cache, v_cache, positions, window, sinks, layer,
                                    backend=backend, scale=float(scale),
                                    precision=default_precision())


# ---------------------------------------------------------------------------
# Batching: the vmapped axis folds into the queries (a shared cache) or the batch.


def _attention_batch(args, dims, *, backend, scale, precision):
    q, k, v, positions, window, sinks, layer = args
    qd, kd, vd, pd, wd, sd, ld = dims
    if wd is not None or sd is not None or ld is not None or (
            layer is not None and (kd is not None or vd is not None)):
        return None  # per-element windows, sinks or layers, batched stacks: vmap of the reference
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q = to_front_or_broadcast(q, qd, n)
    positions = to_front_or_broadcast(positions, pd, n)
    bind = lambda *a: decode_attention_op.bind(*a, window, sinks, layer, backend=backend,
                                               scale=scale, precision=precision)
    if kd is None and vd is None:
        # One cache for all: the batch's queries are more query rows of it (no cache copy).
        qt = jnp.moveaxis(q, 0, 1)                         # [B, n, T, Hq, hd]
        bsz, t = qt.shape[0], qt.shape[2]
        out = bind(qt.reshape(bsz, n * t, *qt.shape[3:]), k, v,
                   jnp.moveaxis(positions, 0, 1).reshape(bsz, n * t))
        return jnp.moveaxis(out.reshape(bsz, n, t, *out.shape[2:]), 1, 0), 0
    k, v = to_front_or_broadcast(k, kd, n), to_front_or_broadcast(v, vd, n)
    fold = lambda a: a.reshape(-1, *a.shape[2:])
    out = bind(fold(q), fold(k), fold(v), fold(positions))
    return out.reshape(n, -1, *out.shape[1:]), 0


decode_attention_op.batch_rule = _attention_batch
jvp_through_reference(decode_attention_op)
