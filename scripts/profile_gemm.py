"""One qmm through the ffi GEMM on prepacked weights, for a profiler (ncu -k
regex:qmm_wgmma). python scripts/profile_gemm.py M [K N] [mode]"""
import sys

import jax
import jax.numpy as jnp

import jaxquant as jq

m = int(sys.argv[1])
k, n = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4096, 14336)
mode = sys.argv[4] if len(sys.argv) > 4 else "affine"
w = (0.05 * jax.random.normal(jax.random.key(0), (n, k), jnp.float32)).astype(jnp.bfloat16)
qw = jq.prepack(jq.quantize(w, mode=mode), layout="cuda_mma")
x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
f = jax.jit(lambda x, q: jq.qmm(x, q, backend="ffi"))
for _ in range(3):
    jax.block_until_ready(f(x, qw))
