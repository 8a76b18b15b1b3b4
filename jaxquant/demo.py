"""python -m jaxquant [demo]: a decoder on jaxquant, the float model against each
quantized mode.

For each mode: prefill a batch of prompts, then greedy-decode N tokens in one
jitted loop; print the weight bytes, prefill and decode tokens/s, the kernels
(backend) and weight layout the mode ran, and how far its prefill logits and
next-token distributions are from the float run's (bf16, or float32 with
--dtype float32). Random weights at a small config by default (seconds on a
laptop CPU): their quantization error says little about a trained model's, so
`--checkpoint DIR` (a Hugging Face / MLX checkpoint) gives the real picture.
`--config gpt-oss-20b` for that model's dimensions, `--mesh TPxEP` to shard it
over the local devices (tensor x expert parallel).
"""

from __future__ import annotations

import argparse
import os
import re
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
    # a dense Llama-style block small enough for tests (bench model's peer check)
    "tiny-dense": dict(family="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=128),
    "small-dense": dict(family="llama", vocab_size=4096, hidden_size=256, num_layers=4,
                        num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768),
    # openai/gpt-oss-20b's dimensions (config.json), random weights
    "gpt-oss-20b": dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=24,
                        num_heads=64, num_kv_heads=8, head_dim=64, num_experts=32,
                        experts_per_token=4, moe_intermediate_size=2880, attention_bias=True,
                        rms_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                        layer_windows=(128, 0) * 12),
    # meta-llama/Meta-Llama-3-8B's dimensions (config.json), random weights
    "llama3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      rms_eps=1e-5, rope_theta=500000.0),
    # meta-llama/Llama-3.2-1B's dimensions (config.json), random weights: a model larger
    # than a CPU's caches (bench model on a CPU)
    "llama3.2-1b": dict(family="llama", vocab_size=128256, hidden_size=2048, num_layers=16,
                        num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192,
                        rms_eps=1e-5, rope_theta=500000.0, tie_embeddings=True),
    # meta-llama/Meta-Llama-3-70B's dimensions (config.json), random weights: bf16 does not
    # fit one GPU; `bench model --init sharded` draws it quantized and placed (issue 30)
    "llama3-70b": dict(family="llama", vocab_size=128256, hidden_size=8192, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
                       rms_eps=1e-5, rope_theta=500000.0),
    # openai/gpt-oss-120b's dimensions (config.json), random weights (as llama3-70b)
    "gpt-oss-120b": dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, num_layers=36,
                         num_heads=64, num_kv_heads=8, head_dim=64, num_experts=128,
                         experts_per_token=4, moe_intermediate_size=2880, attention_bias=True,
                         rms_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                         layer_windows=(128, 0) * 18),
}
DEFAULT_MODES = ("bf16", "affine4", "affine8", "mxfp4", "nvfp4")


class Progress:
    """A one-line progress bar on stderr (no dependency). `close()` ends the bar's line
    (if one is open) before anything else is printed, so output never glues onto it.
    Where stdout or the stream is not a terminal (a file, a pipe, `| tee`), each step
    is a plain line instead: `\r` would leave one long line in the file."""

    def __init__(self, total: int, width: int = 30, stream=None):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.open = False
        self.bar = _is_terminal(self.stream) and _is_terminal(sys.stdout)

    def step(self, what: str):
        self.done += 1
        if not self.bar:
            self.stream.write(f"[{self.done}/{self.total}] {what} "
                              f"({time.perf_counter() - self.t0:.1f}s)\n")
            self.stream.flush()
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {what:28s} "
                          f"{time.perf_counter() - self.t0:6.1f}s")
        self.stream.flush()
        self.open = True

    def close(self):
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
        self.open = False


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def preset(name: str, dtype: str = "bfloat16", layers: int | None = None):
    """The models.Config of PRESETS[name]; `layers` overrides the depth (the sliding
    window keeps alternating)."""
    from jaxquant import models

    kw = dict(PRESETS[name], dtype=dtype)
    if layers:
        kw["num_layers"] = layers
        if kw.get("layer_windows"):
            kw["layer_windows"] = tuple(kw["layer_windows"][i % 2] for i in range(layers))
    return models.Config(**kw)


def parse_mesh(text: str | None):
    if text is None:
        return None
    try:
        tp, ep = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh wants TPxEP, e.g. 2x1 or 2x4; got {text!r}") from None
    return tp, ep


def kernels_used(lowered_text: str) -> str:
    """Which backend's kernels a lowered program calls, from its custom calls: jaxquant's
    FFI targets (ffi, or metal), Pallas' Triton calls; none: the jnp reference."""
    targets = set(re.findall(r"custom_call @([\w$.]+)", lowered_text))
    ffi = sorted(t for t in targets if t.startswith("jaxquant"))
    found = []
    if any("metal" in t for t in ffi):
        found.append("metal")
    if any("metal" not in t for t in ffi):
        found.append("ffi")
    if any("triton" in t for t in targets):
        found.append("pallas")
    return ", ".join(found) if found else "reference (jnp)"


def next_token_errors(logits, ref_logits):
    """(relative error of the logits, mean KL(ref || mode) of the next-token distributions
    in nats, top-1 agreement) over every prefill position, in float64."""
    import numpy as np
    a = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    b = np.asarray(ref_logits, np.float64).reshape(-1, logits.shape[-1])
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    log_p = b - b.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = a - a.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)))
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    return float(rel), kl, top1


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
    # the layer loop and experts_by_layer are chosen automatically (docs/models.md)
    prefill = jax.jit(models.prefill, static_argnums=(0, 3))
    decode = jax.jit(models.decode, static_argnums=(0, 5), donate_argnums=(2,))
    lowered = prefill.lower(cfg, params, prompt, max_len).as_text()
    _block(prefill(cfg, params, prompt, max_len))
    progress.step("prefill compiled")
    t0 = time.perf_counter()
    logits, cache, token = _block(prefill(cfg, params, prompt, max_len))
    t_prefill = time.perf_counter() - t0
    progress.step("prefill")
    if mesh is not None:
        cache = parallel.shard_cache(cfg, cache, mesh)
    # warm-up on a copy of the cache (decode donates it)
    lowered += decode.lower(cfg, params, cache, token, s, steps - 1).as_text()
    _block(decode(cfg, params, jax.tree_util.tree_map(lambda c: c.copy(), cache), token, s,
                  steps - 1))
    progress.step("decode compiled")
    t0 = time.perf_counter()
    tokens, _, _ = _block(decode(cfg, params, cache, token, s, steps - 1))
    t_decode = time.perf_counter() - t0
    progress.step("decode")
    return {"logits": logits, "tokens": jax.numpy.concatenate([token[:, None], tokens], 1),
            "prefill_tps": b * s / t_prefill, "decode_tps": b * (steps - 1) / t_decode,
            "weight_bytes": models.weight_bytes(params), "backend": kernels_used(lowered),
            "layout": _layouts(params)}


def _layouts(params) -> str:
    """The quantized weights' layouts ("canonical", or a kernel layout such as cuda_mma)."""
    import jax

    import jaxquant as jq
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda a: isinstance(a, jq.QuantizedArray))
    found = sorted({a.layout for a in leaves if isinstance(a, jq.QuantizedArray)})
    return ", ".join(found) if found else "float weights"


def main(argv=None) -> int:
    from jaxquant.bench import Parser  # errors on one line, with a pointer to --help
    ap = Parser(prog="python -m jaxquant [demo]", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", choices=sorted(PRESETS),
                    help="random-weight model dimensions (default: small)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--checkpoint", help="a Hugging Face / MLX checkpoint directory")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated; bf16 (the float model, in --dtype) is the "
                         f"reference the others are measured against (default: "
                         f"{','.join(DEFAULT_MODES)})")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="random prompt tokens (default 64; not with --prompt)")
    ap.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    ap.add_argument("--prompt", help="prompt text (needs --checkpoint with a tokenizer.json "
                                     "and the `tokenizers` package: the `text` extra)")
    ap.add_argument("--mesh", nargs="?", const="auto",
                    help="shard over local devices: TPxEP (e.g. 2x1); bare --mesh: all "
                         "devices on tp (dense) or ep (MoE)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="activations and float weights (default bfloat16)")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from jaxquant.models.params import MODES
    for m in modes:
        if m != "bf16" and m not in MODES:
            ap.error(f"--modes: {m!r} is not known; choose from bf16, {', '.join(MODES)}")
    if args.tokens < 2 or args.prompt_len < 1 or args.batch < 1:
        ap.error("--tokens must be >= 2, --prompt-len and --batch >= 1")
    gguf_file = args.checkpoint and args.checkpoint.endswith(".gguf")
    if gguf_file and not os.path.isfile(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint!r}: no such GGUF file")
    if (args.checkpoint and not gguf_file
            and not os.path.isfile(os.path.join(args.checkpoint, "config.json"))):
        ap.error(f"--checkpoint {args.checkpoint!r} is not a checkpoint directory (no "
                 f"config.json there); give the folder holding config.json and *.safetensors, "
                 f"or a .gguf file")
    if args.prompt is not None and not args.checkpoint:
        ap.error("--prompt needs --checkpoint DIR (random weights have no tokenizer); "
                 "without it the prompt is --prompt-len random tokens")
    tokenizer = load_tokenizer(args.checkpoint) if args.checkpoint else None
    if args.prompt is not None and tokenizer is not None and not hasattr(tokenizer, "encode"):
        ap.error("--prompt needs a tokenizer that encodes text; a GGUF file's vocabulary "
                 "only decodes (drop --prompt: the prompt is then random token ids)")
    if args.prompt is not None and tokenizer is None:
        ap.error(f"--prompt needs {os.path.join(args.checkpoint, 'tokenizer.json')} and the "
                 f"`tokenizers` package ({TOKENIZERS_INSTALL})")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxquant as jq
    from jaxquant import models
    from jaxquant.models import checkpoint, parallel

    devices = jax.devices()
    mesh_shape = None
    if args.mesh and args.mesh != "auto":
        mesh_shape = parse_mesh(args.mesh)
        if mesh_shape[0] * mesh_shape[1] > len(devices):
            ap.error(f"--mesh {args.mesh} needs {mesh_shape[0] * mesh_shape[1]} devices; "
                     f"{len(devices)} here (on a CPU, XLA_FLAGS="
                     f"--xla_force_host_platform_device_count=N makes N)")
    print(f"jaxquant {jq.__version__}, jax {jax.__version__}: {len(devices)} x "
          f"{devices[0].platform}:{devices[0].device_kind}; backends {jq.available_backends()}")
    if args.checkpoint:
        t0 = time.perf_counter()
        cfg, base = checkpoint.load(args.checkpoint, dtype=args.dtype)
        print(f"weights: checkpoint {args.checkpoint} ({cfg.family}, {cfg.num_layers} layers), "
              f"loaded in {time.perf_counter() - t0:.1f}s")
    else:
        cfg = preset(args.config, args.dtype, args.layers)
        base = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
        print(f"weights: random ({args.config} preset, models.init_params, seed 0). Random "
              f"weights show the kernels' speed, not a trained model's quantization error: "
              f"run --checkpoint DIR for the real picture")
    mesh = None
    if args.mesh:
        tp, ep = mesh_shape or ((1, len(devices)) if cfg.moe else (len(devices), 1))
        mesh = parallel.make_mesh(tp, ep)
    ref_name = {"bfloat16": "bf16", "float32": "float32"}[args.dtype]
    print(f"model: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{'%d experts (top %d), ' % (cfg.num_experts, cfg.experts_per_token) if cfg.moe else ''}"
          f"vocab {cfg.vocab_size}; batch {args.batch} x prompt {args.prompt_len}, "
          f"{args.tokens} new tokens" + (f"; mesh tp={mesh.shape['tp']} x ep={mesh.shape['ep']}"
                                         if mesh else ""))
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt).ids
        prompt = jnp.asarray([ids] * args.batch, jnp.int32)
    else:
        prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_len), 0,
                                    cfg.vocab_size, jnp.int32)

    progress = Progress(total=5 * len(modes))
    rows, ref = [], None
    for mode in modes:
        name = ref_name if mode == "bf16" else mode
        try:
            if mode == "bf16":  # the float reference: imported quantized weights dequantized
                params = jax.tree_util.tree_map(
                    lambda a: jq.dequantize(a, jnp.dtype(cfg.dtype))
                    if isinstance(a, jq.QuantizedArray) else a, base,
                    is_leaf=lambda a: isinstance(a, jq.QuantizedArray))
            else:
                params = _block(models.quantize_params(base, mode))
            progress.step(f"{name}: weights ready")
            r = run_mode(cfg, params, prompt, args.tokens, mesh, progress)
            del params
        except Exception as e:  # noqa: BLE001 - one failing mode must not hide the others
            progress.close()
            print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
            rows.append((name, None))
            progress.done = 5 * (modes.index(mode) + 1)
            continue
        if ref is None and mode == "bf16":
            ref = r
        rows.append((name, r))
        # each mode's numbers as soon as they exist (a run cut short keeps them)
        progress.close()
        print(f"done {name}: {_bytes(r['weight_bytes'])}, prefill {r['prefill_tps']:.1f} "
              f"tok/s, decode {r['decode_tps']:.1f} tok/s; kernels: {r['backend']}; "
              f"weights: {r['layout']}", flush=True)
    progress.close()

    print(f"\n{'mode':9s} {'weights':>10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
          f"{'logit rel.err':>13s} {'KL nats':>9s} {'top-1':>7s} {'same tokens':>11s}  kernels")
    for name, r in rows:
        if r is None:
            print(f"{name:9s} FAILED")
            continue
        if ref is not None and r is not ref:
            rel, kl, top1 = next_token_errors(r["logits"], ref["logits"])
            errs = f"{rel:13.2%} {kl:9.2e} {top1:7.1%}"
            same = f"{int(np.sum(np.asarray(r['tokens']) == np.asarray(ref['tokens'])))}/" \
                   f"{r['tokens'].size}"
        else:
            errs, same = f"{'-':>13s} {'-':>9s} {'-':>7s}", "-"
        print(f"{name:9s} {_bytes(r['weight_bytes']):>10s} {r['prefill_tps']:14.1f} "
              f"{r['decode_tps']:13.1f} {errs} {same:>11s}  {r['backend']} ({r['layout']})")
    print(f"""
weights: bytes of all weights (quantized ones with their scales). tok/s: prompt tokens
per second in prefill, new tokens per second in decode (batch {args.batch}; after a warm-up
call that compiles). Measured against the {ref_name} run ({ref_name} row), over every
prompt position's next-token prediction: logit rel.err = |logits - {ref_name}'s| /
|{ref_name}'s|; KL nats = mean KL({ref_name} || mode) of the next-token distributions;
top-1 = how often the most likely next token is {ref_name}'s; same tokens = greedy decoded
tokens equal to {ref_name}'s, position by position. kernels: the backend whose kernels the
compiled prefill and decode call (reference (jnp): XLA-compiled jnp, no custom kernel),
and the quantized weights' layout: canonical is the exchange layout every backend reads
(docs/formats.md); a kernel layout (jq.prepack, e.g. cuda_mma) is a permutation of the
same bits that one GPU kernel reads fastest, chosen where that kernel runs.""")
    if devices[0].platform == "cpu":
        print("Noise: on a CPU shared with other work, decode tok/s varies 1.5-2x from run "
              "to run; compare the rows of one run, and rerun before reading a gap under 2x.")
        for line in _slow_rows_on_cpu(rows):
            print(line)
    if ref is not None and not args.checkpoint:
        print("(random weights: a trained model's errors differ; --checkpoint DIR measures "
              "them)")
    if tokenizer is not None:
        for name, r in rows:
            if r is not None:
                print(f"{name}: {tokenizer.decode(np.asarray(r['tokens'][0]).tolist())!r}")
    return 0 if all(r is not None for _, r in rows) else 1


# Why a mode's CPU decode is slow, for the note under the table.
CPU_SLOW_WHY = {
    "nvfp4": "the CPU kernel is not tuned for its two-level scales (an FP8 E4M3 scale per "
             "16 weights times a float32 one per matrix) as it is for mxfp4's and affine's; "
             "the GPU kernels are the tuned ones",
}


def _slow_rows_on_cpu(rows) -> list[str]:
    """A line for each quantized row whose decode is under a third of the quantized rows'
    median here: a gap past the noise, with the reason where one is known."""
    from jaxquant.models.params import MODES

    quantized = [(n, r["decode_tps"]) for n, r in rows if r is not None and n in MODES]
    if len(quantized) < 2:
        return []
    median = sorted(t for _, t in quantized)[len(quantized) // 2]
    return [f"{n}: decode {median / t:.0f}x slower than the other quantized modes' median "
            f"here: {CPU_SLOW_WHY.get(n, 'no CPU kernel tuned for this mode')}."
            for n, t in quantized if t < median / 3]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


# Where the optional `tokenizers` package comes from: pyproject.toml's `text` extra.
TOKENIZERS_INSTALL = 'pip install "jaxquant[text]" (in a checkout: pip install -e ".[text]")'


def load_tokenizer(path):
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
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 (the tokenizers package raises plain Exception)
        from jaxquant.io import CheckpointError
        raise CheckpointError(f"{file}: not a tokenizer the tokenizers package reads ({e})") \
            from None


if __name__ == "__main__":
    sys.exit(main())
