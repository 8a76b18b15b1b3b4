"""The decode GEMV through JAX, back to back: one jitted call runs 64 distinct M = 1
products (8 weights x 8 rows of x, so XLA merges none), as a step's products follow
each other (with programmatic dependent launch between them), timed over 10 calls;
the median and best of 5 samples, µs per product. For an A/B of two builds of the
CUDA library, run it once per build in turns (JAXQUANT_FFI_LIB_DIR) on one machine:
ratios between processes hold to a few per cent here, where a model's tok/s moves by
up to 10%. Numbers: benchmarks/h100/decode.json `gemv.jax.splits_ab.*`; docs/decode.md.

  JAXQUANT_FFI_LIB_DIR=build/lib python tools/gpu/gemv_jax_ab.py TAG [MODES] [K,N;K,N]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant.bench import harness
from jaxquant.formats import PRESETS

tag = sys.argv[1]
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["affine4", "mxfp4"]
shapes = ([tuple(int(v) for v in s.split(",")) for s in sys.argv[3].split(";")]
          if len(sys.argv) > 3 else [(4096, 4096), (2880, 5120), (4096, 6144), (4096, 14336)])
for mode in modes:
    for k, n in shapes:
        ws = [jq.quantize(jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16),
                          **PRESETS[mode])
              for i in range(8)]
        xs = [jax.random.normal(jax.random.key(100 + r), (1, k), jnp.bfloat16) for r in range(8)]
        f = jax.jit(lambda xs, ws: [jq.qmm(x, w) for x in xs for w in ws])
        per_call = harness.timed_samples(f, (xs, ws), iters=5, inner=10)
        samples = [t / (len(xs) * len(ws)) * 1e6 for t in per_call]
        print(f"| {tag} | {mode} | {k} -> {n} | {np.median(samples):.2f} us | best {min(samples):.2f} |",
              flush=True)
