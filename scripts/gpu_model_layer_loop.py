"""Decode tok/s of jaxquant.models by layer form on one GPU, against the bound.

For Llama-3-8B's and gpt-oss-20b's dimensions (random weights, batch 1, a
128-token context, greedy steps in one jitted loop timed after a compile run),
each mode (bf16, affine4 g64, mxfp4) in each variant:

  default          what a user gets: init_params / quantize_params with no
                   arguments (per-layer buffers on a GPU, the device's kernel
                   layout, experts_by_layer automatic)
  stacked          stacked [L, ...] weights in lax.scan (experts_by_layer
                   automatic: on for quantized experts)
  stacked-no-ebl   the same with experts_by_layer=False (MoE, quantized)
  canonical        per-layer buffers in the canonical layout (quantized; what
                   the kernel layout is worth)

The bound is the weight bytes one token reads (every matrix once, the experts
k/E of theirs, lm_head) at the copy bandwidth measured in this process
(jaxquant.bench.harness.copy_bandwidth, read + write bytes/s); "% bound" is
tok/s over that.

  python scripts/gpu_model_layer_loop.py | tee $OUT/model_layer_loop.txt
  python scripts/gpu_model_layer_loop.py --configs llama3-8b --modes affine4 --variants default,stacked

About 5-6 minutes on an H100 with every row (11 compiles of the decode loop);
each row prints as soon as it is measured.
"""

from __future__ import annotations

import argparse
import sys
import time

CONFIGS = ("llama3-8b", "gpt-oss-20b")  # jaxquant.demo's presets (any other one works too)
MODES = {"llama3-8b": ("bf16", "affine4", "mxfp4"), "gpt-oss-20b": ("bf16", "mxfp4")}
VARIANTS = ("default", "stacked", "stacked-no-ebl", "canonical")


def bytes_per_token(cfg, params) -> float:
    """Weight bytes one decoded token reads: every matrix and vector of the layers
    once, the experts' k/E, the head (the embedding's one row is left out)."""
    from jaxquant import models
    from jaxquant.models.decoder import is_per_layer

    layers = params["layers"]
    total = 0.0
    for p in (layers if is_per_layer(layers) else (layers,)):
        for key, value in p.items():
            share = cfg.experts_per_token / cfg.num_experts if key.startswith("e_") else 1.0
            total += share * models.weight_bytes(value)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return total + models.weight_bytes(head) + models.weight_bytes(params["final_norm"])


def decode_tps(cfg, params, context, steps, experts_by_layer=None) -> float:
    """Greedy decode tokens/s: `steps` tokens in one jitted loop from position
    `context`, timed on the second call (the first compiles)."""
    import jax
    import jax.numpy as jnp

    from jaxquant import models

    decode = jax.jit(models.decode, static_argnums=(0, 5, 6), donate_argnums=(2,))
    token = jnp.zeros((1,), jnp.int32)
    times = []
    for _ in range(2):
        cache = models.init_cache(cfg, 1, context + steps)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        jax.block_until_ready(decode(cfg, params, cache, token, context, steps,
                                     experts_by_layer))
        times.append(time.perf_counter() - t0)
    return steps / times[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--modes", default="", help="comma-separated (default: per config)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=32, help="decoded tokens timed (default 32)")
    ap.add_argument("--context", type=int, default=128, help="cache position (default 128)")
    ap.add_argument("--layers", type=int, help="override the layer count (faster compiles)")
    args = ap.parse_args(argv)

    import jax

    import jaxquant as jq
    from jaxquant import models
    from jaxquant.bench.harness import copy_bandwidth
    from jaxquant.demo import PRESETS

    bw = copy_bandwidth()
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}; jax {jax.__version__}; jaxquant backends "
          f"{jq.available_backends()}; copy bandwidth (read+write) {bw / 1e9:.0f} GB/s; "
          f"batch 1, context {args.context}, {args.steps} greedy steps timed", flush=True)
    print(f"{'config':12s} {'mode':8s} {'variant':17s} {'MB/token':>9s} {'tok/s':>8s} "
          f"{'bound':>8s} {'% bound':>8s}", flush=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        kw = dict(PRESETS[name])  # tiny: a CPU smoke run
        if args.layers:
            kw["num_layers"] = args.layers
            if kw.get("layer_windows"):
                kw["layer_windows"] = tuple(kw["layer_windows"][i % 2]
                                            for i in range(args.layers))
        cfg = models.Config(**kw)
        modes = ([m.strip() for m in args.modes.split(",") if m.strip()]
                 or MODES.get(name, ("bf16", "affine4", "mxfp4")))
        for per_layer in (True, False):  # one float copy resident at a time
            form = [v for v in variants if v.startswith("stacked") != per_layer]
            if not form:
                continue
            base = jax.jit(models.init_params, static_argnums=0,
                           static_argnames="per_layer")(cfg, jax.random.key(0),
                                                        per_layer=per_layer)
            for mode in modes:
                runs = []
                for variant in form:
                    quantized = mode != "bf16"
                    if variant == "canonical" and not quantized:
                        continue
                    if variant == "stacked-no-ebl" and not (cfg.moe and quantized):
                        continue
                    ebl = False if variant == "stacked-no-ebl" else None
                    layout = "canonical" if variant == "canonical" else None
                    runs.append((variant, ebl, layout))
                for variant, ebl, layout in runs:
                    try:
                        params = base if mode == "bf16" else jax.block_until_ready(
                            models.quantize_params(base, mode, layout=layout,
                                                   per_layer=per_layer))
                        nbytes = bytes_per_token(cfg, params)
                        tps = decode_tps(cfg, params, args.context, args.steps, ebl)
                        bound = bw / nbytes
                        print(f"{name:12s} {mode:8s} {variant:17s} {nbytes / 1e6:9.1f} "
                              f"{tps:8.1f} {bound:8.0f} {tps / bound:8.1%}", flush=True)
                    except Exception as e:  # noqa: BLE001 - report the row and go on
                        print(f"{name:12s} {mode:8s} {variant:17s} FAILED: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
                    finally:
                        params = None
            del base
    return 0


if __name__ == "__main__":
    sys.exit(main())
