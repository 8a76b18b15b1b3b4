"""python -m jaxquant [demo]: a decoder on jaxquant, bf16 against each quantized mode.

For each mode: prefill a batch of prompts, then greedy-decode N tokens in one
jitted loop; print the weight bytes, prefill and decode tokens/s, and the
largest difference of the prefill logits from bf16's. Random weights at a small
config by default (seconds on a laptop CPU); `--config gpt-oss-20b` for that
model's dimensions, `--checkpoint DIR` for a real Hugging Face / MLX checkpoint,
`--mesh TPxEP` to shard it over the local devices (tensor x expert parallel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PRESETS = {
    # the smoke test's (tests/test_main.py)
    "tiny": dict(family="gpt_oss", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, num_experts=4, experts_per_token=2,
                 moe_intermediate_size=64, attention_bias=True, layer_windows=(8, 0),
                 sliding_window=8),
    # a gpt-oss-style MoE small enough for a laptop CPU
    "small": dict(family="gpt_oss", vocab_size=4096, hidden_size=256, num_layers=4,
                  num_heads=8, num_kv_heads=2, head_dim=32, num_experts=8,
                  experts_per_token=2, moe_intermediate_size=256, attention_bias=True,
                  layer_windows=(128, 0, 128, 0), sliding_window=128),
    "small-dense": dict(family="llama", vocab_size=4096, hidden_size=256, num_layers=4,
                        num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768),
    # openai/gpt-oss-20b's dimensions (config.json), random weights
    "gpt-oss-20b": dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24,
                        num_heads=64, num_kv_heads=8, head_dim=64, num_experts=32,
                        experts_per_token=4, moe_intermediate_size=2880, attention_bias=True,
                        rms_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                        layer_windows=(128, 0) * 12),
}
DEFAULT_MODES = ("bf16", "affine4", "affine8", "mxfp4", "nvfp4")


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, width: int = 30, stream=None):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()

    def step(self, what: str):
        self.done += 1
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {what:28s} "
                          f"{time.perf_counter() - self.t0:6.1f}s")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def parse_mesh(text: str | None):
    if text is None:
        return None
    try:
        tp, ep = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh wants TPxEP, e.g. 2x1 or 2x4; got {text!r}") from None
    return tp, ep


def _block(tree):
    import jax
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf.block_until_ready()
    return tree


def run_mode(cfg, params, prompt, steps, mesh, progress):
    """Prefill + decode for one parameter set: a dict of timings and results."""
    import jax

    from jaxquant import models
    from jaxquant.models import parallel

    if mesh is not None:
        params = parallel.shard_params(cfg, params, mesh)
    b, s = prompt.shape
    max_len = s + steps
    # one device: the experts of all layers indexed at once (no per-layer copy)
    by_layer = mesh is None
    prefill = jax.jit(models.prefill, static_argnums=(0, 3, 4))
    decode = jax.jit(models.decode, static_argnums=(0, 5, 6), donate_argnums=(2,))
    _block(prefill(cfg, params, prompt, max_len, by_layer))
    progress.step("prefill compiled")
    t0 = time.perf_counter()
    logits, cache, token = _block(prefill(cfg, params, prompt, max_len, by_layer))
    t_prefill = time.perf_counter() - t0
    progress.step("prefill")
    if mesh is not None:
        cache = parallel.shard_cache(cfg, cache, mesh)
    # warm-up on a copy of the cache (decode donates it)
    _block(decode(cfg, params, jax.tree_util.tree_map(lambda c: c.copy(), cache), token, s,
                  steps - 1, by_layer))
    progress.step("decode compiled")
    t0 = time.perf_counter()
    tokens, _, _ = _block(decode(cfg, params, cache, token, s, steps - 1, by_layer))
    t_decode = time.perf_counter() - t0
    progress.step("decode")
    return {"logits": logits, "tokens": jax.numpy.concatenate([token[:, None], tokens], 1),
            "prefill_tps": b * s / t_prefill, "decode_tps": b * (steps - 1) / t_decode,
            "weight_bytes": models.weight_bytes(params)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxquant [demo]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(PRESETS),
                    help="random-weight model dimensions (default: small)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--checkpoint", help="a Hugging Face / MLX checkpoint directory")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated; bf16 first is the reference (default: "
                         f"{','.join(DEFAULT_MODES)})")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    ap.add_argument("--prompt", help="prompt text (with --checkpoint and a tokenizer.json)")
    ap.add_argument("--mesh", nargs="?", const="auto",
                    help="shard over local devices: TPxEP (e.g. 2x1); bare --mesh: all "
                         "devices on tp (dense) or ep (MoE)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxquant as jq
    from jaxquant import models
    from jaxquant.models import checkpoint, parallel
    from jaxquant.models.decoder import MODES

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m != "bf16" and m not in MODES:
            ap.error(f"--modes: {m!r} is not known; choose from bf16, {', '.join(MODES)}")
    if args.tokens < 2 or args.prompt_len < 1 or args.batch < 1:
        ap.error("--tokens must be >= 2, --prompt-len and --batch >= 1")

    devices = jax.devices()
    print(f"jaxquant {jq.__version__}, jax {jax.__version__}: {len(devices)} x "
          f"{devices[0].platform}:{devices[0].device_kind}; backends {jq.available_backends()}")
    tokenizer = None
    if args.checkpoint:
        t0 = time.perf_counter()
        cfg, base = checkpoint.load(args.checkpoint, dtype=args.dtype)
        print(f"loaded {args.checkpoint} ({cfg.family}, {cfg.num_layers} layers) in "
              f"{time.perf_counter() - t0:.1f}s")
        tokenizer = _tokenizer(args.checkpoint)
    else:
        kw = dict(PRESETS[args.config], dtype=args.dtype)
        if args.layers:
            kw["num_layers"] = args.layers
            if kw.get("layer_windows"):
                kw["layer_windows"] = tuple(kw["layer_windows"][i % 2] for i in
                                            range(args.layers))
        cfg = models.Config(**kw)
        base = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
    mesh = None
    if args.mesh:
        tp, ep = parse_mesh(args.mesh) if args.mesh != "auto" else (
            (1, len(devices)) if cfg.moe else (len(devices), 1))
        mesh = parallel.make_mesh(tp, ep)
    print(f"model: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{'%d experts (top %d), ' % (cfg.num_experts, cfg.experts_per_token) if cfg.moe else ''}"
          f"vocab {cfg.vocab_size}; batch {args.batch} x prompt {args.prompt_len}, "
          f"{args.tokens} new tokens" + (f"; mesh tp={mesh.shape['tp']} x ep={mesh.shape['ep']}"
                                         if mesh else ""))
    if tokenizer is not None and args.prompt:
        if not hasattr(tokenizer, "encode"):
            ap.error("--prompt needs a tokenizer that encodes text; a GGUF file's vocabulary "
                     "only decodes (drop --prompt: the prompt is then random token ids)")
        ids = tokenizer.encode(args.prompt).ids
        prompt = jnp.asarray([ids] * args.batch, jnp.int32)
    else:
        prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 0,
                                    cfg.vocab_size, jnp.int32)

    progress = Progress(total=5 * len(modes))
    rows, ref = [], None
    for mode in modes:
        try:
            if mode == "bf16":  # the float reference: imported quantized weights dequantized
                params = jax.tree_util.tree_map(
                    lambda a: jq.dequantize(a, jnp.dtype(cfg.dtype))
                    if isinstance(a, jq.QuantizedArray) else a, base,
                    is_leaf=lambda a: isinstance(a, jq.QuantizedArray))
            else:
                params = _block(models.quantize_params(base, mode))
            progress.step(f"{mode}: weights ready")
            r = run_mode(cfg, params, prompt, args.tokens, mesh, progress)
            del params
        except Exception as e:  # noqa: BLE001 - one failing mode must not hide the others
            progress.close()
            print(f"{mode}: FAILED: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
            rows.append((mode, None))
            progress = Progress(total=5 * len(modes))
            progress.done = 5 * (modes.index(mode) + 1)
            continue
        if ref is None and mode == "bf16":
            ref = r
        rows.append((mode, r))
        # each mode's numbers as soon as they exist (a run cut short keeps them)
        print(f"done {mode}: {_bytes(r['weight_bytes'])}, prefill {r['prefill_tps']:.1f} tok/s, "
              f"decode {r['decode_tps']:.1f} tok/s", flush=True)
    progress.close()

    print(f"\n{'mode':9s} {'weights':>10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
          f"{'max |dlogit| vs bf16':>21s} {'same tokens':>11s}")
    for mode, r in rows:
        if r is None:
            print(f"{mode:9s} FAILED")
            continue
        if ref is not None and r is not ref:
            d = float(jnp.max(jnp.abs(r["logits"] - ref["logits"])))
            scale = float(jnp.max(jnp.abs(ref["logits"])))
            diff = f"{d:9.4f} ({d / scale:6.2%})"
            same = f"{int(np.sum(np.asarray(r['tokens']) == np.asarray(ref['tokens'])))}/" \
                   f"{r['tokens'].size}"
        else:
            diff, same = "-", "-"
        print(f"{mode:9s} {_bytes(r['weight_bytes']):>10s} {r['prefill_tps']:14.1f} "
              f"{r['decode_tps']:13.1f} {diff:>21s} {same:>11s}")
    if tokenizer is not None:
        for mode, r in rows:
            if r is not None:
                print(f"{mode}: {tokenizer.decode(np.asarray(r['tokens'][0]).tolist())!r}")
    return 0 if all(r is not None for _, r in rows) else 1


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _tokenizer(path):
    """A .gguf file's own vocabulary (decoding only), or tokenizer.json through the
    optional `tokenizers` package, else None."""
    if os.fspath(path).endswith(".gguf"):
        from jaxquant.models import gguf_checkpoint
        try:
            return gguf_checkpoint.tokenizer(path)
        except ValueError:  # a tokenizer model it cannot decode: ids only
            return None
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(file)


if __name__ == "__main__":
    sys.exit(main())
