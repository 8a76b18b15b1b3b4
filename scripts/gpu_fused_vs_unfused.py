"""The fused decode GEMVs (rms_norm_qmm, qmm_swiglu) against the unfused ops, in one
process on a GPU (benchmarks/RESULTS.md, "Ninth session"):

  python scripts/gpu_fused_vs_unfused.py kernels      # JAX level, Llama-3-8B shapes, M = 1, 4
  python scripts/gpu_fused_vs_unfused.py model [llama3-8b|gpt-oss-20b] [affine4,mxfp4]

kernels: one call = one product per weight copy (8 copies), unfused (the automatic
choice with the fused kernels off), the plain qmm alone, and fused (backend="ffi").
model: decode tok/s of the whole model, batch 1, with the automatic choice's fused
kernels off and on, alternating (configs.FUSED_MAX_ROWS decides "on" by default)."""
import dataclasses
import sys

import jax
import jax.numpy as jnp

import jaxquant as jq
import jaxquant.ffi  # noqa: F401 - registers the CUDA kernels
from jaxquant import demo, dispatch, models
from jaxquant.bench import decode as bd
from jaxquant.bench import model as bm
from jaxquant.bench.harness import copy_bandwidth

FUSED_OPS = ("rms_norm_qmm", "qmm_swiglu")


def kernels(bw, copies=8):
    for op, (k, n) in {"rms_norm_qmm": (4096, 6144), "qmm_swiglu": (4096, 2 * 14336)}.items():
        ws = [(0.05 * jax.random.normal(jax.random.key(7 * i + 1), (n, k), jnp.float32)
               ).astype(jnp.bfloat16) for i in range(copies)]
        nw = 1 + 0.1 * jax.random.normal(jax.random.key(5), (k,), jnp.bfloat16)
        if op == "rms_norm_qmm":
            impls = {"unfused": lambda x, q: jq.qmm(jq.rms_norm(x, nw), q),
                     "fused": lambda x, q: jq.rms_norm_qmm(x, nw, q, backend="ffi")}
        else:
            def unfused(x, q):
                g, u = jnp.split(jq.qmm(x, q).astype(jnp.float32), 2, axis=-1)
                return (jax.nn.silu(g) * u).astype(x.dtype)
            impls = {"unfused": unfused,
                     "fused": lambda x, q: jq.qmm_swiglu(x, q, backend="ffi")}
        impls["qmm alone"] = lambda x, q: jq.qmm(x, q)
        with_off(True)
        for mode in ("affine4", "mxfp4"):
            packed = [jq.prepack(bd._quantize(mode, w), layout="cuda_mma") for w in ws]
            nbytes = bd._nbytes(packed[0])
            for m in (1, 4):
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                for impl, f in impls.items():
                    us = bd._timeit(bd._many(f), (x, packed), copies) * 1e6
                    print(f"{op} M={m} {k}->{n} {mode:8s} {impl:10s} {us:7.1f} us "
                          f"{100 * nbytes / (us * 1e-6) / bw:4.0f}% of copy", flush=True)
            del packed
        with_off(False)


_REGISTERED = {}


def with_off(off: bool):
    """The automatic choice with the ffi fused kernels never taken (off) or as registered."""
    for op in FUSED_OPS:
        ks = _REGISTERED.setdefault(op, list(dispatch._KERNELS.get(op, [])))
        dispatch._KERNELS[op] = [
            dataclasses.replace(k, auto=lambda *a, platform, **p: False)
            if off and k.backend == "ffi" else k for k in ks]


def model(bw, name, modes):
    cfg = demo.preset(name, "bfloat16", None)
    base = bm._block(jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0)))
    prompt = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size, jnp.int32)
    for mode in modes:
        params = bm._block(models.quantize_params(base, mode))
        nbytes = bm.step_bytes(cfg, params, 1)
        for _ in range(2):
            for off in (True, False):
                with_off(off)
                tps = bm.decode_run(cfg, params, prompt, 64, {}, 3)["decode_tps"]
                print(f"{name} {mode} fused kernels {'off' if off else 'auto'}: {tps:.1f} tok/s "
                      f"{100 * tps * nbytes / bw:.0f}% of bound", flush=True)
        del params
    with_off(False)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "kernels"
    bw = copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {bw / 1e9:.0f} GB/s")
    if what == "kernels":
        kernels(bw)
    else:
        model(bw, sys.argv[2] if len(sys.argv) > 2 else "llama3-8b",
              (sys.argv[3] if len(sys.argv) > 3 else "affine4,mxfp4").split(","))
