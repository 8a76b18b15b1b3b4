"""Device memory of models.quantize_params on one GPU: gpt-oss-20b's dimensions in bf16,
resident (random weights, about 42 GB), quantized to a mode (mxfp4 by default). Prints,
from jax.devices()[0].memory_stats(), the bytes in use before, the peak while
quantizing, and the bytes in use after (the bf16 model plus the quantized one), with
the input's and output's own sizes; the bound is input + output + one layer's
temporaries (docs/models.md, "Memory while quantizing").

  python tools/gpu/quantize_memory.py | tee $OUT/quantize_memory.txt
  python tools/gpu/quantize_memory.py --stacked            # stacked [L, ...] in and out
  python tools/gpu/quantize_memory.py --mem-fraction 0.6   # force the out-of-memory path

With --mem-fraction small enough that the output does not fit, quantize_params runs
out of memory part way; the script then prints the bytes still in use after the error,
which should be the bf16 model's (nothing of the partial output held).

Each line is `key value` (bytes as GiB): peak_gib, after_gib, input_gib, output_gib,
over_gib (peak minus input minus output: one layer's temporaries at most).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt-oss-20b", help="a jaxquant.demo preset")
    ap.add_argument("--mode", default="mxfp4", help="a models.MODES name (default mxfp4)")
    ap.add_argument("--stacked", action="store_true",
                    help="stacked [L, ...] layers in and out (default: per-layer buffers, "
                         "the GPU default)")
    ap.add_argument("--mem-fraction", type=float,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION for this process (default: jax's)")
    args = ap.parse_args(argv)
    # the allocator's settings are read when jax starts: set them before importing it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.mem_fraction is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)

    import jax
    import jax.numpy as jnp

    from jaxquant import demo, models

    gib = lambda b: f"{b / 2**30:.2f}"
    dev = jax.devices()[0]

    def stats():
        s = dev.memory_stats() or {}
        return s.get("bytes_in_use", 0), s.get("peak_bytes_in_use", 0), s.get("bytes_limit", 0)

    print("device", dev.device_kind, "jax", jax.__version__, "date",
          time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    cfg = models.Config(**demo.PRESETS[args.config])
    params = models.init_params(cfg, jax.random.key(0), jnp.bfloat16,
                                per_layer=not args.stacked)
    jax.block_until_ready(params)
    before, peak0, limit = stats()
    print("config", args.config, "mode", args.mode, "layers",
          "stacked" if args.stacked else "per-layer")
    print("limit_gib", gib(limit))
    print("input_gib", gib(models.device_bytes(params)))
    print("before_gib", gib(before), "(peak so far", gib(peak0) + ")")
    try:
        out = models.quantize_params(params, args.mode, per_layer=not args.stacked)
        jax.block_until_ready(out)
    except Exception as e:  # out of memory: what is still held afterwards
        first = str(e).strip().splitlines()[0][:200]
        used, peak, _ = stats()
        print("error", type(e).__name__, first)
        print("peak_gib", gib(peak))
        print("after_error_gib", gib(used), "input_gib", gib(models.device_bytes(params)),
              "held_beyond_input_gib", gib(used - models.device_bytes(params)))
        return 1
    used, peak, _ = stats()
    inp, outb = models.device_bytes(params), models.device_bytes(out, params)
    print("peak_gib", gib(peak))
    print("after_gib", gib(used))
    print("output_gib", gib(outb))
    print("over_gib", gib(peak - inp - outb),
          "(one layer's temporaries: the bound's allowance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
