"""The Hopper wgmma GEMM at few rows per block, on a GPU (benchmarks/RESULTS.md, "Eighth
session"): qmm with M = 17..128 on Llama-3-8B's shapes (bf16 dense `x @ w.T` beside it,
µs and the ratio), and ragged_qmm through the GEMM at every T (RAGGED_GATHER_MAX_T = 0)
on gpt-oss-20b's experts (E = 32, top-4, mxfp4; T = 64..1024 tokens). Run once per
rows-per-block choice, e.g. the default and $JAXQUANT_WGMMA_BN=128, and compare.

  python scripts/gpu_wgmma_rows_sweep.py TAG      # about 1 minute on an H100
"""
import sys
import jax, jax.numpy as jnp
import jaxquant as jq
from jaxquant.bench.decode import _many, _quantize, _timeit
from jaxquant.bench import harness, moe as bm
from jaxquant.ffi import configs

tag = sys.argv[1]
prep = jax.jit(jq.prepack, static_argnames="layout")
SHAPES = {"up14336": (4096, 14336), "qkv": (4096, 6144), "o": (4096, 4096),
          "down": (14336, 4096)}
for name, (k, n) in SHAPES.items():
    cp = 4
    ws = [(0.05 * jax.random.normal(jax.random.key(i), (n, k), jnp.float32)).astype(jnp.bfloat16)
          for i in range(cp)]
    qs = {mode: [prep(_quantize(mode, w), layout="cuda_mma") for w in ws] for mode in ("affine4", "mxfp4")}
    for m in (17, 32, 64, 96, 128):
        x = jax.random.normal(jax.random.key(7), (m, k), jnp.bfloat16)
        dense = _timeit(_many(lambda x, w: x @ w.T), (x, ws), cp) * 1e6
        row = f"{tag} | {name} {k}->{n} M={m} | bf16 {dense:.1f}"
        for mode, q in qs.items():
            us = _timeit(_many(lambda x, q: jq.qmm(x, q, backend="ffi")), (x, q), cp) * 1e6
            row += f" | {mode} {us:.1f} ({dense / us:.2f}x)"
        print(row, flush=True)
    del ws, qs

configs.RAGGED_GATHER_MAX_T = 0  # the GEMM at every T
for name, (e, top_k, k, n) in (("gateup", (32, 4, 2880, 5760)), ("down", (32, 4, 2880, 2880))):
    w = (0.05 * jax.random.normal(jax.random.key(0), (e, n, k), jnp.float32)).astype(jnp.bfloat16)
    qm = prep(jq.quantize(w, mode="mxfp4"), layout="cuda_mma")
    for t in (64, 128, 256, 512, 1024):
        x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
        idxs = bm._routings(jax.random.key(100 + t), t, top_k, e, 4)
        srt = [bm._sorted_by_expert(x, i, e) for i in idxs]
        xs, sizes = [s[0] for s in srt], [s[1] for s in srt]
        g = jax.jit(lambda xs, qw, sizes: tuple(jq.ragged_qmm(a, qw, s, backend="ffi")
                                                for a, s in zip(xs, sizes)))
        sec = harness.timeit(g, (xs, qm, sizes), len(xs), 10, 10)
        flops = 2 * t * top_k * k * n
        print(f"{tag} | ragged {name} T={t} rows={t*top_k} | mxfp4 {sec*1e6:.1f} us "
              f"{flops/sec/1e12:.0f} TFLOP/s", flush=True)
