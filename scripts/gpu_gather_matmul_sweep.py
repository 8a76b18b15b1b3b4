"""Block sizes of gather_matmul's Pallas kernel (float expert GEMV) on a GPU: each
FloatGemvConfig variant timed at gpt-oss-20b dims (E=32, top-4; gate_up N=5760 and down
N=2880, K=2880, bf16) for T=1 and T=8, as % of the copy bandwidth measured in the same
run, next to XLA's gather + einsum and the default config (configs.FLOAT_GEMV_CONFIGS).
Calls are issued back to back over 8 routings that touch different experts (the L2 holds
none of them), one sync per sample (docs/measuring.md). Bytes: the distinct experts'
weights + x + y.

  python scripts/gpu_gather_matmul_sweep.py          # 2-4 min on an H100 (mostly compiles)
  python scripts/gpu_gather_matmul_sweep.py --smoke  # tiny shapes, CPU (interpret mode)

Writes the table to stdout and, with $OUT set, to $OUT/gather_matmul_sweep.md. The best
row per shape is what FLOAT_GEMV_CONFIGS["cuda"] should hold.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.bench import harness, moe as bench_moe
from jaxquant.pallas import configs, moe

# (name, E, top_k, K, N)
SHAPES = [("gptoss-gateup", 32, 4, 2880, 5760), ("gptoss-down", 32, 4, 2880, 2880)]
SMOKE = [("smoke", 8, 2, 200, 96)]


def variants(platform):
    base = configs.FLOAT_GEMV_CONFIGS[platform]
    yield "default", None
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8)):
        yield f"bn={bn} bk={bk} w={warps}", base.replace(block_n=bn, block_k=bk,
                                                         num_warps=warps, min_programs=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default="1,8")
    args = ap.parse_args()
    cpu = harness.on_cpu()
    bw = harness.copy_bandwidth()
    lines = [f"# {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s", "",
             "| shape | T | impl | µs | %copy |", "|---|---|---|---:|---:|"]
    print("\n".join(lines), flush=True)
    for name, e, top_k, k, n in (SMOKE if args.smoke else SHAPES):
        w = (0.05 * jax.random.normal(jax.random.key(0), (e, n, k), jnp.float32)).astype(
            jnp.bfloat16)
        for t in map(int, args.tokens.split(",")):
            x = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
            idxs = bench_moe._routings(jax.random.key(100 + t), t, top_k, e, 8)
            distinct = np.mean([len(np.unique(np.asarray(i))) for i in idxs])
            nbytes = distinct * n * k * 2 + (t * k + t * top_k * n) * 2
            want = jax.jit(lambda x, w, i: jnp.einsum(
                "tk,tjnk->tjn", x, w[i], preferred_element_type=jnp.float32).astype(x.dtype))
            cases = [("xla gather+einsum", want)]
            for label, cfg in itertools.islice(variants("interpret" if cpu else "cuda"),
                                               2 if args.smoke else None):
                cases.append((f"pallas {label}", functools.partial(
                    moe.gather_matmul, interpret=cpu, config=cfg)))
            ref = np.asarray(want(x, w, idxs[0]), np.float32)
            for label, f in cases:
                many = jax.jit(lambda x, w, idxs, f=f: tuple(f(x, w, i) for i in idxs))
                try:
                    got = np.asarray(many(x, w, idxs)[0], np.float32)
                    err = np.abs(got - ref).max() / np.abs(ref).max()
                    assert err < 2e-2, f"error {err:.1e}"
                    sec = harness.timeit(many, (x, w, idxs), len(idxs), 3 if cpu else 10,
                                         inner=2 if cpu else 10)
                    row = (f"| {name} | {t} | {label} | {sec * 1e6:.1f} | "
                           f"{100 * nbytes / sec / bw:.0f}% |")
                except Exception as ex:  # noqa: BLE001 - a variant that fails is reported
                    row = f"| {name} | {t} | {label} | failed: {type(ex).__name__} | |"
                print(row, flush=True)
                lines.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gather_matmul_sweep.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
