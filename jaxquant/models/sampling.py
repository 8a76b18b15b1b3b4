"""Token generation: sampling (temperature, top-k, top-p, min-p), stop tokens and
prompts of different lengths in one batch (docs/models.md, "Generation").

`generate` is greedy by default and then computes exactly what prefill + decode
compute. Sampling follows Hugging Face's order of logits processors: the logits
are divided by the temperature, then top-k, top-p and min-p each remove tokens
from what the previous filter kept (`filter_logits`), and the next token is drawn
from the softmax of what remains.

Prompts of different lengths are right-padded into one [B, S] array with their
`lengths`: the prefill runs every row over all S positions (causal attention: a
row's padding, after its tokens, never reaches them), each row's first new token
comes from the logits at its own last position, and decoding then runs each row
at its own position (the forward of one row vmapped over the batch, so each row
writes its own cache slot). Cache slots a row's padding filled lie past its
position until decoding overwrites them, so attention never reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.models.config import Config
from jaxquant.models.decoder import decode, forward, prefill


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits.

    temperature: 0 is greedy (argmax; the other fields must keep their defaults);
    > 0 divides the logits before the filters. top_k: keep the k largest logits (ties
    with the k-th kept too); 0 keeps all. top_p: keep the smallest set of the most
    likely tokens whose probability reaches top_p (a token is kept when the tokens
    ranked before it hold less than top_p); 1 keeps all. min_p: keep tokens whose
    probability is at least min_p times the most likely one's; 0 keeps all.

    Static under jax.jit (a hashable pytree with no leaves): a `generate` jitted
    with a Sampling argument compiles once per distinct Sampling."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        def real(name, value, ok, meaning):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a real number ({meaning}); got {value!r}")
            if not (math.isfinite(value) and ok(value)):
                raise ValueError(f"{name} must be {meaning}; got {value!r}")
            object.__setattr__(self, name, float(value))

        real("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0: greedy)")
        real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1] (1: off)")
        real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1] (0: off)")
        if isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k,
                                                                       numbers.Integral):
            raise TypeError(f"top_k must be an integer (0: off); got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off); got {self.top_k}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.greedy and (self.top_k, self.top_p, self.min_p) != (0, 1.0, 0.0):
            raise ValueError("temperature=0 is greedy: top_k, top_p and min_p have no effect "
                             "there; pass a temperature > 0 to sample")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


jax.tree_util.register_static(Sampling)
GREEDY = Sampling()


def filter_logits(logits, sampling: Sampling):
    """logits [..., V] -> float32 logits divided by the temperature, -inf where
    top-k, top-p or min-p (in that order, each on what the previous kept) removes
    the token. At least the most likely token always stays."""
    if sampling.greedy:
        raise ValueError("filter_logits needs a temperature > 0 (greedy keeps the argmax)")
    x = jnp.asarray(logits).astype(jnp.float32) / jnp.float32(sampling.temperature)
    v = x.shape[-1]
    neg = jnp.float32(-jnp.inf)
    if 0 < sampling.top_k < v:
        kth = lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, neg, x)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1, stable=True)
        ranked = jnp.take_along_axis(x, order, -1)
        p = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass of the tokens ranked before each
        before = before.at[..., 0].set(0.0)
        keep_ranked = before < jnp.float32(sampling.top_p)
        keep = jnp.put_along_axis(jnp.zeros_like(keep_ranked), order, keep_ranked, -1,
                                  inplace=False)
        x = jnp.where(keep, x, neg)
    if sampling.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  exp(x_i - x_max) >= min_p (the softmax's sum cancels)
        rel = jnp.exp(x - jnp.max(x, -1, keepdims=True))
        x = jnp.where(rel >= jnp.float32(sampling.min_p), x, neg)
    return x


def sample(key, logits, sampling: Sampling = GREEDY):
    """The next token per row of logits [B, V] -> int32 [B]: the argmax when greedy
    (key unused, may be None), else a draw from softmax(filter_logits(...)) with key."""
    if sampling.greedy:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling), axis=-1).astype(
        jnp.int32)


def _check_stop_tokens(cfg: Config, stop_tokens):
    """stop_tokens -> int32 [n] (None: no stop). Concrete ids are checked against the
    vocabulary; traced ones (jit without static_argnames) pass as they are, and an
    id outside it never matches."""
    if stop_tokens is None:
        return None
    if isinstance(stop_tokens, (numbers.Integral, np.integer)) and not isinstance(
            stop_tokens, (bool, np.bool_)):
        stop_tokens = (stop_tokens,)
    if isinstance(stop_tokens, (list, tuple)) and not any(
            isinstance(t, jax.core.Tracer) for t in stop_tokens):
        for t in stop_tokens:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (numbers.Integral,
                                                                     np.integer)):
                raise TypeError(f"stop_tokens must be token ids (ints); got {t!r}")
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"stop_tokens: {int(t)} is not a token id in [0, "
                                 f"{cfg.vocab_size})")
    ids = jnp.asarray(stop_tokens)
    if ids.ndim > 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"stop_tokens must be token ids (ints, or a 1-D integer array); got "
                        f"{ids.dtype}{list(ids.shape)}")
    return ids.reshape(-1).astype(jnp.int32)


def _check_lengths(lengths, b: int, s: int):
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be integers; got {lengths.dtype}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B] = ({b},); got shape {lengths.shape}")
    if not isinstance(lengths, jax.core.Tracer):
        values = np.asarray(lengths)
        if values.size and (values.min() < 1 or values.max() > s):
            raise ValueError(f"lengths must be in [1, S={s}] (each prompt's own tokens); got "
                             f"{values.tolist()}")
    return lengths.astype(jnp.int32)


def _step_rows(cfg: Config, params, cache, token, positions, experts_by_layer, mesh):
    """One decode step with each row at its own position: token, positions [B] ->
    (logits [B, V], cache). One row's forward, vmapped over the batch, so each row
    writes its own cache slot."""
    def one(tok, pos, k, v):  # k, v: one row's [L, S, Hkv, hd]
        logits, (k, v) = forward(cfg, params, tok[None, None], pos[None, None],
                                 (k[:, None], v[:, None]), experts_by_layer, mesh)
        return logits[0, -1], k[:, 0], v[:, 0]

    logits, k, v = jax.vmap(one, in_axes=(0, 0, 1, 1), out_axes=(0, 1, 1))(
        token, positions, *cache)
    return logits, (k, v)


def _step(cfg: Config, params, cache, token, positions, per_row: bool, experts_by_layer,
          mesh):
    """One decode step of token [B] at positions [B] -> (logits [B, V], cache): each row
    at its own position (_step_rows) where per_row, else the batch in lockstep."""
    if per_row:
        return _step_rows(cfg, params, cache, token, positions, experts_by_layer, mesh)
    logits, cache = forward(cfg, params, token[:, None], positions[:, None], cache,
                            experts_by_layer, mesh)
    return logits[:, -1], cache


def _prompt_rows(prompt, lengths):
    """-> (prompt, lengths [B] int32, per_row): with lengths, checked, and the padding's
    ids set to 0 (they only need to be valid: an invalid id's NaN would reach the cache,
    and 0 * NaN in attention is NaN even where masked); without, every row's S."""
    b, s = prompt.shape
    if lengths is None:
        return prompt, jnp.full((b,), s, jnp.int32), False
    lengths = _check_lengths(lengths, b, s)
    return jnp.where(jnp.arange(s) < lengths[:, None], prompt, 0), lengths, True


def _check_generation(cfg: Config, prompt, steps, sampling, key, stop_tokens):
    """generate's and stream's arguments checked: -> (sampling, stop ids [n] (none: [-1],
    which no token is), prompt, key (none: a key never drawn from, greedy))."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"steps must be an int; got {steps!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    sampling = GREEDY if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a models.Sampling or None; got {sampling!r}")
    if not sampling.greedy and key is None:
        raise ValueError("key: sampling (temperature > 0) needs a jax.random key")
    stops = _check_stop_tokens(cfg, stop_tokens)
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2:
        raise ValueError(f"prompt must be [B, S] token ids; got shape {prompt.shape}")
    stop_ids = jnp.full((1,), -1, jnp.int32) if stops is None else stops
    return sampling, stop_ids, prompt, jax.random.key(0) if key is None else key


def _next_token(logits, token, done, i, key, sampling, stop_ids):
    """Step i's tokens from its logits [B, V] (drawn with fold_in(key, i)); a row that
    has stopped repeats its stop token. -> (tokens [B], done [B])."""
    nxt = sample(jax.random.fold_in(key, i), logits, sampling)
    nxt = jnp.where(done, token, nxt)
    return nxt, done | jnp.isin(nxt, stop_ids)


def generate(cfg: Config, params, prompt, steps: int, experts_by_layer=None, mesh=None, *,
             lengths=None, sampling: Sampling | None = None, key=None, stop_tokens=None):
    """prompt [B, S] -> [B, steps] new tokens (jit this whole; mesh: forward's).

    lengths [B] (optional): each row's prompt length (right-padded: row b's tokens
    are prompt[b, :lengths[b]], the rest is ignored); each row then decodes as its
    own single-prompt run would. sampling: a `Sampling` (None: greedy); key: a
    jax.random key, needed when sampling (step i draws with fold_in(key, i)).
    stop_tokens: token ids (e.g. the checkpoint's eos_token_id,
    models.checkpoint.stop_tokens); a row that produced one repeats it for its
    remaining steps, and the loop ends once every row has stopped.

    Greedy with neither lengths nor stop_tokens is prefill + decode exactly."""
    sampling, stop_ids, prompt, key = _check_generation(cfg, prompt, steps, sampling, key,
                                                        stop_tokens)
    b, s = prompt.shape
    if lengths is None and sampling.greedy and stop_tokens is None:
        _, cache, token = prefill(cfg, params, prompt, s + steps, experts_by_layer, mesh,
                                  logits_at=jnp.full((b,), s - 1, jnp.int32))
        tokens, _, _ = decode(cfg, params, cache, token, s, steps - 1, experts_by_layer, mesh)
        return jnp.concatenate([token[:, None], tokens], axis=1)

    prompt, lengths, per_row = _prompt_rows(prompt, lengths)
    logits, cache, _ = prefill(cfg, params, prompt, s + steps, experts_by_layer, mesh,
                               logits_at=lengths - 1)
    token = sample(jax.random.fold_in(key, 0), logits[:, 0], sampling)
    done = jnp.isin(token, stop_ids)
    out = jnp.zeros((b, steps), jnp.int32).at[:, 0].set(token)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, token, cache, done, out = carry
        # `token` (the previous step's) sits at lengths + i - 1
        logits, cache = _step(cfg, params, cache, token, lengths + i - 1, per_row,
                              experts_by_layer, mesh)
        nxt, done = _next_token(logits, token, done, i, key, sampling, stop_ids)
        return i + 1, nxt, cache, done, lax.dynamic_update_index_in_dim(out, nxt, i, 1)

    i, token, _, _, out = lax.while_loop(cond, body, (jnp.int32(1), token, tuple(cache), done,
                                                      out))
    return jnp.where(jnp.arange(steps) < i, out, token[:, None])


# stream's two programs, compiled once per config, shape and static argument: the prefill
# with the first draw, and a block of `n` decode steps.
@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("sampling",
                                                                    "experts_by_layer", "mesh"))
def _stream_prefill(cfg, params, prompt, lengths, key, max_len, *, sampling, experts_by_layer,
                    mesh):
    logits, cache, _ = prefill(cfg, params, prompt, max_len, experts_by_layer, mesh,
                               logits_at=lengths - 1)
    return sample(jax.random.fold_in(key, 0), logits[:, 0], sampling), tuple(cache)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=("n", "per_row", "sampling", "experts_by_layer", "mesh"))
def _stream_block(cfg, params, cache, token, done, first, lengths, key, stop_ids, *, n,
                  per_row, sampling, experts_by_layer, mesh):
    """Decode steps first .. first + n - 1 (step i writes the token of step i - 1 at
    lengths + i - 1). Positions past the cache (the last block's steps past `steps`) are
    clamped to its last slot: those steps' tokens are dropped, and nothing reads the
    cache after them."""
    max_len = cache[0].shape[2]

    def step(carry, i):
        token, cache, done = carry
        pos = jnp.minimum(lengths + i - 1, max_len - 1)
        logits, cache = _step(cfg, params, cache, token, pos, per_row, experts_by_layer, mesh)
        nxt, done = _next_token(logits, token, done, i, key, sampling, stop_ids)
        return (nxt, cache, done), nxt

    (token, cache, done), tokens = lax.scan(step, (token, cache, done), first + jnp.arange(n))
    return tokens.T, token, cache, done


def stream(cfg: Config, params, prompt, steps: int, experts_by_layer=None, mesh=None, *,
           lengths=None, sampling: Sampling | None = None, key=None, stop_tokens=None,
           block: int = 16):
    """`generate`'s tokens as they are decoded: yields int32 NumPy arrays [B, n] (the
    first [B, 1], then up to `block` tokens each) whose concatenation is `generate(cfg,
    params, prompt, steps, lengths=..., sampling=..., key=..., stop_tokens=...)` up to
    the step at which every row has stopped (that step's tokens included), or all
    `steps`.

    The prefill and each block of `block` decode steps are one call each of a program
    compiled once (per config, shape and sampling), the cache donated from one block to
    the next, and each block is dispatched before the previous block's tokens are read
    back: the host's work per call (argument handling, XLA's set-up of the program's
    kernels, the launch: milliseconds for a model of hundreds of kernels) is paid once
    per block and runs while the device decodes, where a jitted call per token would
    pay it every token (docs/models.md, "Generation"). Past the last stop or `steps`,
    at most one block more is computed and dropped."""
    sampling, stop_ids, prompt, key = _check_generation(cfg, prompt, steps, sampling, key,
                                                        stop_tokens)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive int; got {block!r}")
    s = prompt.shape[1]
    prompt, lengths, per_row = _prompt_rows(prompt, lengths)
    stop_set = np.asarray(stop_ids)
    static = dict(sampling=sampling, experts_by_layer=experts_by_layer, mesh=mesh)
    token, cache = _stream_prefill(cfg, params, prompt, lengths, key, s + steps, **static)
    done = jnp.isin(token, stop_ids)

    def launch(first, token, cache, done):
        if first >= steps:
            return None
        return _stream_block(cfg, params, cache, token, done, jnp.int32(first), lengths, key,
                             stop_ids, n=int(min(block, steps - 1)), per_row=per_row, **static)

    pending = launch(1, token, cache, done)
    del cache  # donated to the block
    out = np.asarray(token)[:, None]
    stopped = np.isin(out[:, 0], stop_set)
    yield out
    first = 1
    while pending is not None and not stopped.all():
        tokens, token, cache, done = pending
        pending = launch(first + tokens.shape[1], token, cache, done)
        del cache
        tokens = np.asarray(tokens)[:, :steps - first]
        # the first step after which every row has stopped ends the stream
        hit = np.logical_or.accumulate(np.isin(tokens, stop_set), axis=1) | stopped[:, None]
        ended = np.flatnonzero(hit.all(axis=0))
        if ended.size:
            tokens = tokens[:, :ended[0] + 1]
        stopped = hit[:, tokens.shape[1] - 1]
        first += tokens.shape[1]
        yield tokens
