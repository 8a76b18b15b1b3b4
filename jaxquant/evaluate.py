"""python -m jaxquant eval: how much each quantization mode changes a model.

For a checkpoint (a Hugging Face / MLX directory with a tokenizer.json) and a
text (default: jaxquant/data/eval_text.txt, a short English prose text that
ships with the package), the float model and each requested mode read the text
in windows of `--context` tokens; per mode it prints

- perplexity of the text (exp of the mean next-token negative log-likelihood),
- KL(float || mode): the mean over positions of the Kullback-Leibler divergence
  of the mode's next-token distribution from the float model's, in nats,
- top-1 agreement: the fraction of positions where both pick the same next token,

so a user can choose a mode with numbers from their own model. `--a8 float8_e4m3fn,int8`
adds a row per row above and 8-bit activation type: the same weights with the dense
matrices in 8-bit rows and x quantized per token (`models.a8_params`, `jq.qmm_a8`:
docs/a8.md), named "<row>+x:fp8" / "<row>+x:int8", as a prefill would run them. The float row is
the checkpoint's own weights in `--dtype` (bfloat16 or float32); quantized modes
are made from them on load (`models.quantize_params`); matrices the checkpoint
already stores quantized (MLX, gpt-oss MXFP4 experts) stay as stored in every row.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")
A8_NAMES = {"float8_e4m3fn": "fp8", "int8": "int8"}  # --a8 types -> row name suffixes


def window_stats(ref_logits, logits, targets):
    """Sums over the positions of one batch of windows: (nll of the targets under
    `logits`, KL(ref || logits), top-1 agreements, positions). logits [B, S, V]
    float32; targets [B, S-1] the next tokens."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, -1)
    ref_logp = jax.nn.log_softmax(ref_logits, -1)
    nll = -jnp.take_along_axis(logp[:, :-1], targets[..., None], -1).sum()
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp))
    agree = jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1))
    return nll, kl, agree, logits.shape[0] * logits.shape[1]


def evaluate(cfg, variants: dict, tokens, *, context: int = 256, batch: int = 4):
    """variants: name -> params, the first the reference. tokens: 1-D ints.
    Returns name -> dict(perplexity, kl, top1, positions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxquant import models

    tokens = np.asarray(tokens, np.int32)
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens; got {context}")
    n = len(tokens) // context
    if n == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of "
                         f"context={context}; pass a longer text or a smaller --context")
    windows = tokens[:n * context].reshape(n, context)
    logits_of = jax.jit(lambda p, w: models.prefill(cfg, p, w, w.shape[1])[0])
    stats = jax.jit(window_stats)
    names = list(variants)
    sums = {k: np.zeros(4) for k in names}
    for i in range(0, n, batch):
        w = jnp.asarray(windows[i:i + batch])
        ref = logits_of(variants[names[0]], w)
        for name in names:
            lg = ref if name == names[0] else logits_of(variants[name], w)
            sums[name] += np.array([float(v) for v in stats(ref, lg, w[:, 1:])])
    out = {}
    for name, (nll, kl, agree, pos) in sums.items():
        predicted = n * (context - 1)
        out[name] = dict(perplexity=float(np.exp(nll / predicted)), kl=kl / pos,
                         top1=agree / pos, positions=int(pos))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxquant eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a Hugging Face / MLX checkpoint directory with a tokenizer.json")
    ap.add_argument("--text", default=DEFAULT_TEXT,
                    help="a UTF-8 text file (default: the text that ships with jaxquant)")
    ap.add_argument("--modes", default="affine4,affine8,mxfp4,nvfp4",
                    help="comma-separated modes (default: %(default)s)")
    ap.add_argument("--context", type=int, default=256, help="tokens per window (default 256)")
    ap.add_argument("--max-tokens", type=int, default=4096,
                    help="read at most this many tokens of the text (default 4096)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--a8", default="",
                    help="also each row with 8-bit activations of these types, comma-separated: "
                         f"{', '.join(A8_NAMES)} (docs/a8.md; default: none)")
    args = ap.parse_args(argv)

    from jaxquant.models import params as model_params

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in model_params.MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {sorted(model_params.MODES)}")
    a8 = [t for t in args.a8.split(",") if t]
    bad = [t for t in a8 if t not in A8_NAMES]
    if bad:
        ap.error(f"unknown --a8 type(s) {bad}; choose from {list(A8_NAMES)}")
    if not os.path.isdir(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint!r} is not a directory")
    if not os.path.isfile(args.text):
        ap.error(f"--text {args.text!r} is not a file")
    import importlib.util

    from jaxquant.demo import TOKENIZERS_INSTALL, load_tokenizer

    if not os.path.isfile(os.path.join(args.checkpoint, "tokenizer.json")):
        ap.error(f"no tokenizer.json in {args.checkpoint!r}: eval reads the text through the "
                 f"checkpoint's own tokenizer")
    if importlib.util.find_spec("tokenizers") is None:
        ap.error(f"eval needs the 'tokenizers' package to read {args.checkpoint!r}'s "
                 f"tokenizer.json: {TOKENIZERS_INSTALL}")
    tokenizer = load_tokenizer(args.checkpoint)

    import jaxquant.models.checkpoint as checkpoint

    with open(args.text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()).ids[:args.max_tokens]
    if len(ids) < max(args.context, 2):
        ap.error(f"the text has {len(ids)} tokens, fewer than one window of --context "
                 f"{args.context}; pass a longer --text or a smaller --context")
    cfg, params = checkpoint.load(args.checkpoint, mode=None, dtype=args.dtype)
    variants = {args.dtype: params}
    for m in modes:
        variants[m] = model_params.quantize_params(params, m)
    variants.update({f"{name}+x:{A8_NAMES[t]}": model_params.a8_params(p, t)
                     for name, p in list(variants.items()) for t in a8})
    print(f"{args.checkpoint}: {len(ids)} tokens of {os.path.basename(args.text)} in windows "
          f"of {args.context}; KL and top-1 agreement against the {args.dtype} row",
          file=sys.stderr)
    result = evaluate(cfg, variants, ids, context=args.context)
    width = max(10, *map(len, result))
    print(f"{'mode':<{width}} {'weights':>10} {'perplexity':>11} {'KL (nats)':>10} "
          f"{'top-1 agree':>12}")
    for name, r in result.items():
        size = model_params.weight_bytes(variants[name]) / 2**20
        print(f"{name:<{width}} {size:>8.1f}Mi {r['perplexity']:>11.3f} {r['kl']:>10.5f} "
              f"{100 * r['top1']:>11.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
