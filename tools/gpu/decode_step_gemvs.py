"""The decode step's GEMVs by their place in a layer, from a trace of the jitted decode
loop: each product's median kernel time, the idle time before it and the kernel it
follows. One process; `$JAXQUANT_*` knobs (docs/decode.md) apply to the whole run.

  CONFIG=llama3-8b MODES=affine4,mxfp4 python tools/gpu/decode_step_gemvs.py

A dense Llama layer's products run in the order q/k/v (with the attention norm),
o (+ the residual), gate/up (SwiGLU), down (+ the residual); the head follows the last
layer (benchmarks/h200/decode.json `decode_step.gemvs.*`).
"""
import collections
import os
import statistics

import jax
import jax.numpy as jnp

from jaxquant import demo, models
from jaxquant.bench import model as bench_model
from jaxquant.bench import profile

CONFIG = os.environ.get("CONFIG", "llama3-8b")
MODES = os.environ.get("MODES", "affine4,mxfp4").split(",")
STEPS = 64
DENSE_PLACES = ["q/k/v", "o", "gate/up", "down"]

cfg = demo.preset(CONFIG, "bfloat16", None)
base = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
prompt = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size, jnp.int32)
for mode in MODES:
    params = models.quantize_params(base, mode)
    trace_dir = f"/tmp/decode_step_gemvs_{mode}"
    run = bench_model.decode_run(cfg, params, prompt, STEPS, {}, 3, None, trace_dir)
    events, _ = profile.device_events(profile.trace_file(trace_dir))
    gemvs = [i for i, e in enumerate(events) if profile.classify(e.name, e.hlo_op, None) == "qmm"]
    if not gemvs:
        raise SystemExit("no GEMV kernel in the trace: this tool reads a GPU's kernels")
    per_step = len(gemvs) // STEPS
    per_layer = (per_step - 1) // cfg.num_layers
    places = DENSE_PLACES if per_layer == 4 and not cfg.moe else [f"#{p}" for p in range(per_layer)]
    times, gaps, after = (collections.defaultdict(list), collections.defaultdict(list),
                          collections.defaultdict(collections.Counter))
    for j, i in enumerate(gemvs[per_step:], start=per_step):  # the first step: warm-up
        p = j % per_step
        place = "head" if p == per_step - 1 else places[p % per_layer]
        times[place].append(events[i].dur)
        gaps[place].append(events[i].ts - events[i - 1].ts - events[i - 1].dur)
        after[place][events[i - 1].name[:40]] += 1
    print(f"{CONFIG} {mode}: {run['decode_tps']:.1f} tok/s, {per_step} GEMVs a step")
    for place in places + ["head"]:
        print(f"  {place:8s} {statistics.median(times[place]):7.2f} µs, idle before "
              f"{statistics.median(gaps[place]):5.2f} µs, after {after[place].most_common(1)[0][0]}")
