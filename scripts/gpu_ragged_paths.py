"""ragged_qmm's paths at small T on a GPU, same process (benchmarks/RESULTS.md, "Fifth
session"): gpt-oss-20b's experts (E = 32, top-4; gate_up 2880 -> 5760 and down 2880 ->
2880), mxfp4, T = 4..64 tokens (16..256 rows sorted by expert, 8 routings per call):
the cuda_mma GEMM (forced: RAGGED_GATHER_MAX_T = 0), the cuda_mma GEMV path (every row
a gather slot, configs.ragged_gather_dedupe rows per block) and the Pallas GEMM on the
canonical layout. µs per product and % of the used experts' bytes at copy speed.

  python scripts/gpu_ragged_paths.py      # about 1 minute on an H100
"""
import functools
import jax, jax.numpy as jnp, numpy as np
import jaxquant as jq
from jaxquant.bench import harness, moe as bm
from jaxquant.ffi import configs
from jaxquant.pallas import moe as pmoe

bw = harness.copy_bandwidth()
print(f"copy bw {bw/1e9:.0f} GB/s")
for name, (e, top_k, k, n) in (("gateup", (32, 4, 2880, 5760)), ("down", (32, 4, 2880, 2880))):
    w = (0.05 * jax.random.normal(jax.random.key(0), (e, n, k), jnp.float32)).astype(jnp.bfloat16)
    qc = jq.quantize(w, mode="mxfp4")
    qm = jq.prepack(qc, "cuda_mma")
    for t in (4, 8, 16, 32, 64):
        x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
        idxs = bm._routings(jax.random.key(100 + t), t, top_k, e, 8)
        srt = [bm._sorted_by_expert(x, i, e) for i in idxs]
        xs, sizes = [s[0] for s in srt], [s[1] for s in srt]
        distinct = np.mean([len(np.unique(np.asarray(i))) for i in idxs])
        nbytes = distinct * qc.nbytes / e + (t * top_k * (k + n)) * 2
        res = {}
        for label, qw, maxt, f in (
                ("ffi GEMM", qm, 0, functools.partial(jq.ragged_qmm, backend="ffi")),
                ("ffi gather GEMV", qm, 10**6, functools.partial(jq.ragged_qmm, backend="ffi")),
                ("pallas canonical", qc, 0, functools.partial(pmoe.ragged_qmm))):
            configs.RAGGED_GATHER_MAX_T = maxt
            g = jax.jit(lambda xs, qw, sizes, f=f: tuple(f(a, qw, s) for a, s in zip(xs, sizes)))
            try:
                ys = g(xs, qw, sizes)
                res[label] = np.asarray(ys[0], np.float32)
                sec = harness.timeit(g, (xs, qw, sizes), len(xs), 10, 10)
                print(f"{name} T={t} rows={t*top_k} {label}: {sec*1e6:.1f} us, {100*nbytes/sec/bw:.0f}% (distinct {distinct:.1f})", flush=True)
            except Exception as ex:
                print(f"{name} T={t} {label}: failed {type(ex).__name__}: {str(ex)[:200]}", flush=True)
        a = list(res.values())
        if len(a) > 1:
            print("  max rel diff", max(float(np.abs(b - a[0]).max() / np.abs(a[0]).max()) for b in a[1:]))
