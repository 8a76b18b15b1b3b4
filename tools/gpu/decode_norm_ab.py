"""The decode step with the MLP's add_rms_norm on each backend, timed in turns in one
process: the default (automatic choice: XLA's fusions of the reference at one row on a
GPU), the CUDA kernel (backend="ffi") and Pallas. Numbers:
benchmarks/h100/decode.json `decode_step.add_rms_norm_backend.*`; docs/decode.md.

  CONFIG=llama3-8b LAYERS=32 MODE=affine4 python tools/gpu/decode_norm_ab.py
"""
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant import demo, models

CONFIG = os.environ.get("CONFIG", "llama3-8b")
LAYERS = int(os.environ.get("LAYERS", "32"))
MODE = os.environ.get("MODE", "affine4")
PROMPT, TOKENS, ROUNDS = 128, 64, 5

backend = None  # read while each variant traces
automatic = jq.add_rms_norm


def add_rms_norm(*args, **kw):
    return automatic(*args, **(kw if backend is None else dict(kw, backend=backend)))


jq.add_rms_norm = add_rms_norm  # models call jq.add_rms_norm

cfg = demo.preset(CONFIG, "bfloat16", LAYERS)
params = jax.block_until_ready(jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0)))
if MODE != "bf16":
    params = jax.block_until_ready(models.quantize_params(params, MODE))
prompt = jax.random.randint(jax.random.key(1), (1, PROMPT), 0, cfg.vocab_size, jnp.int32)
_, cache, token = jax.block_until_ready(jax.jit(
    lambda p, x: models.prefill(cfg, p, x, PROMPT + TOKENS))(params, prompt))

compiled = {}
for name in ("default", "ffi", "pallas"):
    backend = None if name == "default" else name
    compiled[name] = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, PROMPT, TOKENS),
                             donate_argnums=1).lower(params, cache, token).compile()
backend = None

times, first = {k: [] for k in compiled}, {}
for r in range(ROUNDS + 1):  # round 0 warms up
    for name, f in compiled.items():
        c = jax.block_until_ready(jax.tree_util.tree_map(lambda a: a.copy(), cache))
        t0 = time.perf_counter()
        out = jax.block_until_ready(f(params, c, token))
        if r:
            times[name].append(time.perf_counter() - t0)
        else:
            first[name] = np.asarray(jax.tree_util.tree_leaves(out)[0])
for name, ts in times.items():
    same = np.array_equal(first[name], first["default"])
    print(f"{CONFIG} L={LAYERS} {MODE} add_rms_norm {name:8s} {TOKENS / min(ts):8.1f} tok/s "
          f"(best of {ROUNDS}) {TOKENS / statistics.median(ts):8.1f} (median); first output "
          f"equal to the default's: {same}")
