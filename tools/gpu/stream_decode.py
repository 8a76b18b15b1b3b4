"""Decode as a caller's loop sees it: one jitted call per token against `models.stream`'s
blocks and `models.decode`'s single loop, in one process (docs/models.md, "Generation"):

  python tools/gpu/stream_decode.py [gpt-oss-20b] [bf16,mxfp4] [64] [8,16,32]

Per mode: greedy decode tok/s of `tokens` tokens after a 128-token prompt (compiled and
run once before the clock), each way:
  per-token call  a jitted forward + argmax per token, the token read back each step
                  (cache not donated), as a Python decode loop is written;
  stream N        models.stream(..., block=N): blocks of N steps, cache donated, the
                  next block dispatched before this one's tokens are read;
  one loop        models.decode's lax.scan of all the tokens in one call (bench model's).
The tokens of each way are compared with the one loop's."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import demo, models


def main(argv):
    config = argv[0] if argv else "gpt-oss-20b"
    modes = (argv[1] if len(argv) > 1 else "bf16,mxfp4").split(",")
    tokens = int(argv[2]) if len(argv) > 2 else 64
    blocks = [int(b) for b in (argv[3] if len(argv) > 3 else "8,16,32").split(",")]
    cfg = models.Config(**demo.PRESETS[config])
    prompt_len = 128
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {config}, batch 1, prompt {prompt_len}, "
          f"{tokens} greedy tokens")
    print("| mode | way | decode tok/s | vs one loop | tokens equal |")
    print("|---|---|---:|---:|---|")
    base = jax.block_until_ready(
        jax.jit(models.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), jnp.bfloat16))
    prompt = jax.random.randint(jax.random.key(1), (1, prompt_len), 0, cfg.vocab_size, jnp.int32)
    max_len = prompt_len + tokens
    for mode in modes:
        params = base if mode == "bf16" else jax.block_until_ready(
            models.quantize_params(base, mode))
        first = jax.jit(lambda p, t: models.prefill(cfg, p, t, max_len))
        _, cache0, tok0 = jax.block_until_ready(first(params, prompt))

        # one loop: models.decode over all the tokens (bench model's form)
        loop = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, prompt_len, tokens - 1)[0])
        jax.block_until_ready(loop(params, cache0, tok0))
        t0 = time.perf_counter()
        want = np.asarray(loop(params, cache0, tok0))
        rates = {"one loop": ((tokens - 1) / (time.perf_counter() - t0), want)}

        # a jitted call per token, its token read back every step
        @jax.jit
        def step(p, cache, token, pos):
            logits, cache = models.forward(cfg, p, token[:, None], pos, cache)
            return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

        def per_token():
            cache, token, got = cache0, tok0, []
            for i in range(tokens - 1):
                token, cache = step(params, cache, token,
                                    jnp.full((1, 1), prompt_len + i, jnp.int32))
                got.append(int(token[0]))
            return np.asarray([got])

        per_token()
        t0 = time.perf_counter()
        got = per_token()
        rates["per-token call"] = ((tokens - 1) / (time.perf_counter() - t0), got)

        for b in blocks:
            def run():
                it = models.stream(cfg, params, prompt, tokens, block=b)
                next(it)  # the prefill's token
                t0 = time.perf_counter()
                rest = np.concatenate(list(it), 1)
                return (tokens - 1) / (time.perf_counter() - t0), rest
            run()
            rates[f"stream {b}"] = run()
        ref = rates["one loop"][0]
        for way, (rate, got) in rates.items():
            print(f"| {mode} | {way} | {rate:.1f} | {rate / ref:.2f}x | "
                  f"{np.array_equal(got, want)} |")
        params = None  # the next mode's weights without these


if __name__ == "__main__":
    main(sys.argv[1:])
