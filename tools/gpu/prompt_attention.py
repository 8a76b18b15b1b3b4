"""The prompt's attention in models.prefill: the fused kernel (cuDNN through
jax.nn.dot_product_attention, layers.PROMPT_ATTENTION) against the cache-reading op
(jq.decode_attention), alternating in one process on a GPU (docs/models.md, "Fast by
default"):

  python tools/gpu/prompt_attention.py [llama3-8b] [layers] [bf16,affine4] [512,2048]

Prints prefill tok/s of each, their ratio and the largest logit difference."""
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from jaxquant import demo, models
from jaxquant.bench.harness import timeit
from jaxquant.models import layers


def main(argv):
    config = argv[0] if argv else "llama3-8b"
    num_layers = int(argv[1]) if len(argv) > 1 else 8
    modes = (argv[2] if len(argv) > 2 else "bf16,affine4").split(",")
    lengths = [int(n) for n in (argv[3] if len(argv) > 3 else "512,2048").split(",")]
    cfg = dataclasses.replace(models.Config(**demo.PRESETS[config]), num_layers=num_layers)
    fused = dict(layers.PROMPT_ATTENTION)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {config} dims, {num_layers} layers; fused: {fused}")
    print("| mode | prompt | op tok/s | fused tok/s | fused / op | max |Δlogits| / max |logits| |")
    print("|---|---:|---:|---:|---:|---:|")
    base = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    for mode in modes:
        params = base if mode == "bf16" else models.quantize_params(base, mode)
        for n in lengths:
            prompt = jax.random.randint(jax.random.key(1), (1, n), 0, cfg.vocab_size)
            out = {}
            for name, table in (("op", {}), ("fused", fused)):
                layers.PROMPT_ATTENTION = table
                run = jax.jit(lambda p, t: models.prefill(cfg, p, t, n)[0])
                sec = timeit(run, (params, prompt), 1, 5, 3)
                out[name] = (n / sec, run(params, prompt))
            layers.PROMPT_ATTENTION = fused
            (op, lo), (fu, lf) = out["op"], out["fused"]
            err = float(jnp.abs(lf - lo).max() / jnp.abs(lo).max())
            print(f"| {mode} | {n} | {op:.0f} | {fu:.0f} | {fu / op:.2f}x | {err:.2e} |")
        del params


if __name__ == "__main__":
    main(sys.argv[1:])
