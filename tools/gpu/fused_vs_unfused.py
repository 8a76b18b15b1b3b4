"""The fused decode GEMVs (rms_norm_qmm, qmm_swiglu) against the unfused ops, in one
process on a GPU (benchmarks/h100/decode.json `fused.*`):

  python tools/gpu/fused_vs_unfused.py kernels      # JAX level, Llama-3-8B shapes, M = 1, 4
  python tools/gpu/fused_vs_unfused.py model [llama3-8b|gpt-oss-20b] [affine4,mxfp4]

kernels: `bench decode --only fused` at M = 1 and 4: one call = one product per weight
copy (8 copies), unfused ops, fused (backend="ffi") and the plain qmm alone.
model: decode tok/s of the whole model, batch 1, with the automatic choice's fused
kernels off and on, alternating (configs.FUSED_MAX_ROWS decides "on" by default)."""
import dataclasses
import sys

import jax
import jax.numpy as jnp

import jaxquant.ffi  # noqa: F401 - registers the CUDA kernels
from jaxquant import demo, dispatch, models
from jaxquant.bench import decode as bd
from jaxquant.bench import model as bm
from jaxquant.bench.harness import copy_bandwidth

FUSED_OPS = ("rms_norm_qmm", "qmm_swiglu")


def kernels(bw):
    """bench decode's fused part (jaxquant/bench/decode.py) at 1 and 4 rows of x."""
    bd.bench_fused(bw, print, ms=(1, 4))


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
