"""Δlogits row by row (docs/measuring.md): a batch of random prompts through the float
and the quantized model, each row against the float run and against the same prompt
alone, to tell a model's sensitivity to some prompts from a batch effect.

  CONFIG=llama3-8b LAYERS=32 MODE=affine4 python tools/gpu/logit_rows.py
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import demo, models

CONFIG = os.environ.get("CONFIG", "llama3-8b")
LAYERS = int(os.environ.get("LAYERS", "32"))
MODE = os.environ.get("MODE", "affine4")
BATCH, PROMPT = 8, 128

cfg = demo.preset(CONFIG, "bfloat16", LAYERS)
base = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
quantized = models.quantize_params(base, MODE)
prompt = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, cfg.vocab_size, jnp.int32)
last_logits = jax.jit(lambda p, t: models.prefill(cfg, p, t, PROMPT + 8)[0][:, -1])


def logits(params, tokens):
    return np.asarray(last_logits(params, tokens), np.float64)


ref, got = logits(base, prompt), logits(quantized, prompt)
scale = np.abs(ref).max()
print(f"{CONFIG} {LAYERS} layers {MODE}: Δlogits of the batch "
      f"{np.abs(got - ref).max() / scale:.1%}")
for i in range(BATCH):
    q_alone, f_alone = logits(quantized, prompt[i:i + 1])[0], logits(base, prompt[i:i + 1])[0]
    print(f"  row {i}: against float {np.abs(got[i] - ref[i]).max() / scale:6.1%}; alone "
          f"against in the batch: {MODE} {np.abs(q_alone - got[i]).max() / scale:.2%}, "
          f"float {np.abs(f_alone - ref[i]).max() / scale:.2%}")
