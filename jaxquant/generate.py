"""python -m jaxquant generate: text in, text out.

Loads a checkpoint directory (Hugging Face / MLX / GPTQ / AWQ /
compressed-tensors, models.checkpoint.load; `--mode` quantizes float matrices on
load), encodes the prompt with the checkpoint's tokenizer.json (the `tokenizers`
package), in the checkpoint's chat template where tokenizer_config.json has one
(rendered by `jinja2`; --no-chat-template uses the prompt as it is), and streams
the generated text to stdout until an end token of the checkpoint
(generation_config.json / config.json eos_token_id) or --max-tokens. Greedy
unless --temperature > 0 (then --top-k / --top-p / --min-p filter and --seed
seeds the draws: models.Sampling). The prefill time and the decode rate (tok/s)
go to stderr at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _stream_text(tokenizer, ids, shown: str, final: bool) -> str:
    """The text of ids not yet shown: the decoded text past `shown`, held back while
    it ends in an incomplete UTF-8 character (a byte-level token split one)."""
    text = tokenizer.decode(ids)
    if not final and text.endswith("\ufffd"):
        return ""
    return text[len(shown):] if text.startswith(shown) else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxquant generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a checkpoint directory with config.json and tokenizer.json")
    ap.add_argument("--prompt", required=True, help="the prompt text (the user's message "
                    "where the checkpoint has a chat template)")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="generate at most this many tokens (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy; > 0: sample")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="keep tokens at least this fraction of the top one's probability")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    ap.add_argument("--mode", default=None,
                    help="quantize the float matrices on load (e.g. affine4; default: as stored)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-chat-template", action="store_true",
                    help="encode the prompt as it is, even where the checkpoint has a template")
    args = ap.parse_args(argv)

    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1; got {args.max_tokens}")
    if not os.path.isdir(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint!r} is not a directory")

    import jax
    import jax.numpy as jnp

    from jaxquant import models
    from jaxquant.models import text

    if args.mode is not None and args.mode not in models.MODES:
        ap.error(f"unknown --mode {args.mode!r}; choose from {sorted(models.MODES)}")
    try:
        sampling = models.Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    try:
        tokenizer = text.tokenizer(args.checkpoint)
        template = None if args.no_chat_template else text.chat_template(args.checkpoint)
        prompt = args.prompt
        if template is not None:
            prompt = text.render_chat(args.checkpoint, template,
                                      [{"role": "user", "content": args.prompt}])
        stops = text.stop_tokens(args.checkpoint)
    except (ImportError, ValueError) as e:
        print(f"python -m jaxquant generate: error: {e}", file=sys.stderr)
        return 2
    # a rendered template carries its own special tokens (bos included)
    ids = tokenizer.encode(prompt, add_special_tokens=template is None).ids
    if not ids:
        ap.error("the prompt encodes to no tokens")

    cfg, params = models.checkpoint.load(args.checkpoint, args.mode, dtype=args.dtype)
    bad = [t for t in stops if t >= cfg.vocab_size]
    if bad:
        print(f"python -m jaxquant generate: error: the checkpoint's end tokens {bad} are past "
              f"its vocabulary ({cfg.vocab_size})", file=sys.stderr)
        return 2
    key = jax.random.key(args.seed)
    out, shown = [], ""
    t0 = time.perf_counter()
    blocks = models.stream(cfg, params, jnp.asarray([ids], jnp.int32), args.max_tokens,
                           sampling=sampling, key=key, stop_tokens=stops or None)
    for n, block in enumerate(blocks):
        if n == 0:  # the first token: the prefill, with both programs' compilation
            t1 = time.perf_counter()
            prefill_s = t1 - t0
        new = [int(t) for t in block[0]]
        out += new[:next((j for j, t in enumerate(new) if t in stops), None)]
        piece = _stream_text(tokenizer, out, shown, final=False)
        shown += piece
        print(piece, end="", flush=True)
    decode_s = time.perf_counter() - t1
    print(_stream_text(tokenizer, out, shown, final=True), flush=True)
    ended = "end token" if len(out) < args.max_tokens else f"--max-tokens {args.max_tokens}"
    rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else float("nan")
    print(f"[{len(ids)} prompt tokens, prefill {prefill_s:.2f} s (with compilation); "
          f"{len(out)} tokens until {ended}, {rate:.1f} tok/s decode]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
