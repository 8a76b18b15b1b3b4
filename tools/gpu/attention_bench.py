"""Decode attention on a GPU: jq.decode_attention's reference (XLA), the Pallas
flash-decoding kernel and cuDNN (jax.nn.dot_product_attention(implementation="cudnn"),
where it applies: no sinks, no window, one query per sequence) timed in one process
on the same inputs, against the bound of reading the visible keys and values once
at the copy bandwidth measured in the same run (docs/measuring.md's rules: calls
issued back to back, one sync per sample, enough distinct caches to defeat the L2).

Cases: Llama-3-8B (Hq 32, Hkv 8, hd 128) and gpt-oss-20b (Hq 64, Hkv 8, hd 64, sinks;
window 128 on half the layers, so both window 128 and 0), batch 1 and 8, caches of
256 / 2048 / 8192 positions, one new token at position fill * S - 1 (default: the
cache is full). The reference reads all S positions whatever the position; the kernel
reads the visible ones only (fill < 1 and windows show the difference).

  python tools/gpu/attention_bench.py                  # the table (about 2 min on an H100)
  python tools/gpu/attention_bench.py --fill 0.5       # a half-full cache
  python tools/gpu/attention_bench.py --sweep --cases llama3-8b:1:8192,gpt-oss-20b:1:8192
                                                        # + one-at-a-time config variants
  python tools/gpu/attention_bench.py --variants "block_s=256;min_split_keys=64" --lengths 256
                                                        # + the variants named
  python tools/gpu/attention_bench.py --stacked --lengths 2048
                                                        # + a layer scan: layer= vs cache[i]
  python tools/gpu/attention_bench.py --smoke          # tiny shapes, CPU (interpret mode)

Writes the table to stdout and, with $OUT set, to $OUT/attention_bench.md. The
"auto" rule (jaxquant/pallas/configs.py: AUTO_ATTENTION) and the block table
(ATTENTION_CONFIGS) are what these numbers set.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxquant.bench import harness  # noqa: E402

# name -> (Hq, Hkv, hd, sinks, windows)
MODELS = {"llama3-8b": (32, 8, 128, False, (0,)),
          "gpt-oss-20b": (64, 8, 64, True, (128, 0))}
BATCHES = (1, 8)
LENGTHS = (256, 2048, 8192)
SMOKE = {"tiny": (8, 2, 64, True, (16, 0))}
L2_BYTES = 50 << 20            # H100's L2; inputs per sample are at least twice this
MAX_COPY_BYTES = 8 << 30       # memory for the distinct caches of one case
# --sweep: each variant changes one field of the platform's AttentionConfig.
SWEEP = (dict(block_s=32), dict(block_s=128), dict(num_warps=8), dict(num_warps=2),
         dict(num_stages=1), dict(num_stages=3), dict(target_programs=132),
         dict(target_programs=528), dict(min_split_keys=128), dict(min_split_keys=1024),
         dict(max_splits=16))


def _on_gpu():
    return harness.platform() in ("gpu", "cuda", "rocm")


def _lowering_platform():
    """"cuda" or "rocm": the Pallas kernels' platform on this GPU."""
    import jax
    version = getattr(jax.devices()[0].client, "platform_version", "")
    return "rocm" if "rocm" in version.lower() else "cuda"


def _parse_variants(text):
    """--variants "block_s=256;min_split_keys=64,block_s=32" -> [{...}, ...] (ints)."""
    return [{k.strip(): int(v) for k, v in (f.split("=") for f in part.split(","))}
            for part in text.split(";") if part.strip()]


def _impls(sinks, window, t, sweep):
    """[(label, f(q, k, v, positions, *, window, sinks))] that can run here."""
    import jaxquant as jq
    from jaxquant.pallas import configs

    out = [("reference", functools.partial(jq.decode_attention, backend="reference"))]
    if not _on_gpu():
        return out + [("pallas (interpret)", functools.partial(
            _pallas_config, cfg=None, platform="cuda", interpret=True))]
    out.append(("pallas", functools.partial(jq.decode_attention, backend="pallas")))
    platform = _lowering_platform()
    base = configs.ATTENTION_CONFIGS[platform]
    for variant in sweep:
        label = "pallas " + ",".join(f"{k}={v}" for k, v in variant.items())
        out.append((label, functools.partial(_pallas_config, cfg=base.replace(**variant),
                                             platform=platform)))
    if platform == "cuda" and not sinks and window == 0 and t == 1:
        out.append(("cudnn", _cudnn))
    return out


def _pallas_config(q, k, v, positions, *, window, sinks, cfg, platform, interpret=False):
    from jaxquant.pallas import attention as pa
    return pa.decode_attention(q, k, v, positions, window=window, sinks=sinks, config=cfg,
                               platform=platform, interpret=interpret)


def _cudnn(q, k, v, positions, *, window, sinks):
    """One query per sequence at positions[:, 0]: keys [0, pos] are its sequence."""
    import jax
    del window, sinks
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=positions[:, 0] + 1,
                                        implementation="cudnn")


def _chain(f, qs, ks, vs, positions, window, sinks):
    return tuple(f(q, k, v, positions, window=window, sinks=sinks)
                 for q, k, v in zip(qs, ks, vs))


def _layer_scan(backend, sliced, qs, ks, vs, positions, window, sinks):
    """A layer loop as models run one: lax.scan over the layers of stacked caches
    [L, B, S, Hkv, hd], each step attending to its layer: by index (`layer=`, the stack
    read in place) or by slicing the stack (`ks[i]`, an operand the kernel gets copied)."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq

    def step(carry, xs):
        q, i = xs
        if sliced:
            o = jq.decode_attention(q, ks[i], vs[i], positions, window=window, sinks=sinks,
                                    backend=backend)
        else:
            o = jq.decode_attention(q, ks, vs, positions, window=window, sinks=sinks, layer=i,
                                    backend=backend)
        return carry, o

    return jax.lax.scan(step, 0, (qs, jnp.arange(qs.shape[0])))[1]


def run(args, out=print):
    import jax
    import jax.numpy as jnp

    bw = harness.start(out, interpret=not _on_gpu())
    dt = jnp.dtype(args.dtype)
    models = SMOKE if args.smoke else MODELS
    cases = [(m, b, s) for m in models for b in args.batches for s in args.lengths]
    if args.cases:
        wanted = {tuple(c.split(":")) for c in args.cases.split(",")}
        cases = [c for c in cases if (c[0], str(c[1]), str(c[2])) in wanted]
    sweep = _parse_variants(args.variants) if args.variants else SWEEP if args.sweep else ()
    rows = []
    key = jax.random.key(0)
    for name, b, s in cases:
        hq, hkv, hd, with_sinks, windows = models[name]
        full = 2 * b * s * hkv * hd * dt.itemsize
        copies = max(2, min(args.max_copies, math.ceil(2 * L2_BYTES / full),
                            MAX_COPY_BYTES // full))
        ks_ = jax.random.split(jax.random.fold_in(key, s * 16 + b), 3 * copies + 1)
        normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dt)
        qs = [normal(ks_[3 * c], (b, args.t, hq, hd)) for c in range(copies)]
        kc = [normal(ks_[3 * c + 1], (b, s, hkv, hd)) for c in range(copies)]
        vc = [normal(ks_[3 * c + 2], (b, s, hkv, hd)) for c in range(copies)]
        sinks = jax.random.normal(ks_[-1], (hq,), jnp.float32) if with_sinks else None
        last = max(args.t, int(round(args.fill * s))) - 1
        positions = jnp.broadcast_to(jnp.arange(last - args.t + 1, last + 1, dtype=jnp.int32),
                                     (b, args.t))
        jax.block_until_ready((qs, kc, vc))
        for window in windows:
            visible = min(last + 1, window) if window else last + 1
            nbytes = (2 * b * visible * hkv * hd + 2 * b * args.t * hq * hd) * dt.itemsize
            case = f"{name} B={b} S={s} w={window}"
            out(f"# {case}: pos {last}, {visible} of {s} keys visible; {copies} caches of "
                f"{full / 2**20:.1f} MiB; bound (visible K+V at copy bandwidth): "
                f"{nbytes / bw * 1e6:.2f} µs")
            block, ref = [], {}

            def check(ys, ref=ref):
                y = jnp.asarray(ys[0], jnp.float32)
                if "y" not in ref:          # the reference runs first
                    ref["y"] = y
                    return None
                return float(jnp.max(jnp.abs(y - ref["y"])) / jnp.max(jnp.abs(ref["y"])))

            timed = [(label, jax.jit(functools.partial(_chain, f)), (qs, kc, vc))
                     for label, f in _impls(with_sinks, window, args.t, sweep)]
            if args.stacked:
                stacked = (jnp.stack(qs), jnp.stack(kc), jnp.stack(vc))
                for backend in ("reference", "pallas") if _on_gpu() else ("reference",):
                    for sliced in (False, True):
                        label = f"{backend}, scan, {'stack[i]' if sliced else 'layer=i'}"
                        timed.append((label, jax.jit(functools.partial(
                            _layer_scan, backend, sliced)), stacked))
            for label, fn, data in timed:
                harness.run_case(block, fn, (*data, positions, jnp.int32(window), sinks),
                                 n_products=copies, nbytes=nbytes, case=case, x=s,
                                 family=f"{name} B={b}", mode=f"w{window}", impl=label,
                                 iters=args.iters, target_ms=args.target_ms, bw=bw,
                                 check=check, out=out)
            harness.print_table(block, bw, out, base=None, ref="reference",
                                case_title="case", flops=False)
            rows += block
        del qs, kc, vc
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=harness.ints, default=BATCHES)
    p.add_argument("--lengths", type=harness.ints, default=LENGTHS)
    p.add_argument("--t", type=int, default=1, help="new tokens per sequence (default 1)")
    p.add_argument("--fill", type=float, default=1.0,
                   help="the last query sits at fill * S - 1 (default 1: a full cache)")
    p.add_argument("--cases", default="",
                   help="only these, 'model:B:S,...' (e.g. llama3-8b:1:8192)")
    p.add_argument("--stacked", action="store_true",
                   help="also time a layer scan over stacked caches: layer= (read in place) "
                        "vs slicing the stack per layer")
    p.add_argument("--sweep", action="store_true",
                   help="also time the Pallas kernel with one config field changed at a time")
    p.add_argument("--variants", default="",
                   help="instead of --sweep's: config variants to time, e.g. "
                        "'block_s=256;min_split_keys=64,block_s=32'")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes (CPU: the kernel in interpret mode; checks, not speed)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--target-ms", type=float, default=10.0)
    p.add_argument("--max-copies", type=int, default=16)
    args = p.parse_args(argv)
    if not 0 < args.fill <= 1 or args.t < 1:
        p.error("--fill must be in (0, 1] and --t >= 1")
    if args.smoke:
        args.batches, args.lengths = tuple(min(b, 2) for b in args.batches), (40, 100)
        args.iters, args.target_ms = 2, 1.0
    lines = []

    def out(line):
        print(line, flush=True)
        lines.append(line)

    run(args, out)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "attention_bench.md")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"# written to {path}")


if __name__ == "__main__":
    main()
