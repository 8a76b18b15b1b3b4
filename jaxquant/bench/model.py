"""Whole models as users run them (docs/measuring.md): `jaxquant.models` at real
dimensions with random weights, bf16 and each quantized mode, against the
weight-read bound and a PyTorch peer built the way gpt-fast builds one.

  python -m jaxquant bench model [--configs llama3-8b,gpt-oss-20b] [--modes bf16,affine4,mxfp4]
      [--batch 1,8] [--peer torch|none] [--profile] [--mesh 2x1] [--xla-flags FLAGS ...]
      [--prefill-a8 int8,float8_e4m3fn]

Per config, mode and batch: a prompt is prefilled, then `--tokens` greedy
tokens are decoded in one jitted `models.decode` loop, timed after compilation
(median of --iters runs, each on a fresh copy of the prefilled cache); prefill
tok/s is `models.prefill` of one `--prefill`-token sequence (with --prefill-a8, also
with 8-bit activations: rows "prefill a8 <dtype>", docs/a8.md). The bound is the
weight bytes one decode step must read (every layer weight; experts scaled by
the share of them the batch picks, expected 1-(1-k/E)^B under uniform routing,
k/E at batch 1; the head; one embedding row per sequence; KV cache not
counted) at the copy bandwidth measured in this process (a streaming
read+write, calls back to back). On a CPU a copy measures caches, so the
bound's columns are left out there. "prefill % of GEMM" (accelerators) is the
prefill's weight-product FLOP/s (`matmul_flops_per_token`) against a dense bf16
8192^3 GEMM timed in this process; "prefill % of bound" its time at the longer of
that rate and its weight bytes at the copy bandwidth, over its time
(`prefill_of_bound`). "first token ms" is the same prompt's prefill as
`models.generate` runs it (the head at the last position only, `logits_at`), waited
for. "Δlogits" is max |logits - float logits| / max |float logits| at the prompt's
last position.

The peer (dense configs; `jaxquant/bench/torch_peer.py`): the same function on
the same weights in torch, a static KV cache, the decode step compiled with
torch.compile(mode="max-autotune") on CUDA (eager on the CPU), bf16 weights and
int4 group 64 through torch._weight_int4pack_mm (CUDA only). Its prefill runs
eagerly, as gpt-fast's does by default.

--init sharded draws each mode's weights straight into their quantized form on
each mesh (`parallel.init_params`, one layer at a time: no float copy of a 70B
model); the default draws one float copy and quantizes and places it.

--profile traces each config and mode's decode at the first batch size, and its
prefill, and prints where the time goes (`jaxquant/bench/profile.py`); on a mesh,
the first GPU's kernels, with the collectives as a class of their own. --mesh runs the
same on tensor x expert parallel meshes (`jaxquant.models.parallel`) with the
scaling against one device. --xla-flags re-runs the decode measurement in a
subprocess per variant with the flags appended to XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from jaxquant.bench import harness

GPU_CONFIGS, CPU_CONFIGS = ("llama3-8b", "gpt-oss-20b"), ("tiny-dense", "tiny")
FLOAT_MODES = {"bf16": "bfloat16", "float32": "float32"}
QUANT_DEFAULT = ("affine4", "mxfp4")
PEER_IMPL = "torch (gpt-fast style)"
DEFAULT_LAYOUT_IMPL = "jaxquant default layout"  # the one-device row beside a --layout


def _block(tree):
    import jax

    return jax.block_until_ready(tree)


def _device_bytes(tree) -> float:
    """The bytes of tree's arrays that the device holding the most of them holds (the
    whole array where it is replicated, its block where split)."""
    import jax

    per = {}
    for a in jax.tree_util.tree_leaves(tree):
        for shard in getattr(a, "addressable_shards", ()):
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return float(max(per.values(), default=0))


def step_bytes(cfg, params, batch: int, per_device: bool = False) -> float:
    """Weight bytes one decode step of `batch` sequences reads (see the module doc);
    per_device: those the busiest device of a mesh reads (its blocks)."""
    from jaxquant import models

    weigh = _device_bytes if per_device else models.weight_bytes
    share = 1.0
    if cfg.moe:
        share = 1.0 - (1.0 - cfg.experts_per_token / cfg.num_experts) ** batch
    total = 0.0
    for key, value in params.items():
        if key == "embed" and not cfg.tie_embeddings:
            total += weigh(value) / cfg.vocab_size * batch
        elif key == "layers":  # stacked [L, ...] or one dict per layer (separate buffers)
            for layer in (value if isinstance(value, (tuple, list)) else (value,)):
                for name, w in layer.items():
                    total += weigh(w) * (share if name.startswith("e_") else 1.0)
        else:
            total += weigh(value)
    return total


def matmul_flops_per_token(cfg) -> float:
    """FLOPs of one token's weight products in a prefill (2 per multiply-add: q/k/v, o,
    the MLP or the token's k experts and the router, the head); the attention's own
    products (2 x T x Hq x hd a token and layer, a few % at 512 tokens) are not counted,
    so the rate this gives is a lower bound."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d
    if cfg.moe:
        mlp = cfg.experts_per_token * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
    else:
        mlp = 3 * d * cfg.intermediate_size
    return 2.0 * (cfg.num_layers * (attn + mlp) + cfg.vocab_size * d)


def prefill_of_bound(row, gemm_flops: float, bw: float) -> float:
    """A prefill's time at its bound over its time. The bound is the longer of its weight
    products' FLOPs at the dense GEMM's rate and the weight bytes it reads at the copy
    bandwidth (`step_bytes` at the prompt's tokens: every expert, where a prompt of
    hundreds of tokens picks them all). A MoE's prefill of a few hundred tokens is bound
    by the bytes: gpt-oss-20b's 512 tokens read 40 GB of experts in bf16."""
    tokens, tps = row["prefill_tokens"], row["prefill_tps"]
    bound_s = max(tokens * row["prefill_flops"] / tps / gemm_flops, row["prefill_bytes"] / bw)
    return bound_s * tps / tokens


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _median_time(fn, iters, prepare=None):
    """Median seconds of fn(*prepare()) over `iters` runs after one warm-up run."""
    times = []
    for i in range(iters + 1):
        args = prepare() if prepare else ()
        t0 = time.perf_counter()
        fn(*args)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _logit_diff(logits, ref) -> float:
    import numpy as np

    a, r = np.asarray(logits, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))


# ---------------------------------------------------------------------------
# jaxquant.


def decode_run(cfg, params, prompt, tokens, kw, iters, mesh=None, profile_dir=None):
    """Prefill `prompt` [B, S], then time `tokens` greedy decode steps: dict with
    decode_tps, last-position prefill logits, and the profile Breakdown when asked."""
    import jax

    from jaxquant import models
    from jaxquant.models import parallel

    b, s = prompt.shape
    max_len = s + tokens
    kw = kw if mesh is None else dict(kw, mesh=mesh)

    def prefill_prompt(params, prompt):
        return models.prefill(cfg, params, prompt, max_len, **kw)

    def decode_steps(params, cache, token):
        return models.decode(cfg, params, cache, token, s, tokens, **kw)

    logits, cache, token = _block(jax.jit(prefill_prompt)(params, prompt))
    if mesh is not None:
        cache = parallel.shard_cache(cfg, cache, mesh)
    compiled = jax.jit(decode_steps, donate_argnums=1).lower(params, cache, token).compile()
    fresh = lambda: (params, _block(jax.tree_util.tree_map(lambda c: c.copy(), cache)), token)
    sec = _median_time(lambda *a: _block(compiled(*a)), iters, fresh)
    out = {"decode_tps": b * tokens / sec, "logits": logits[:, -1]}
    if profile_dir is not None:
        try:
            out["profile"] = profile_decode(cfg, compiled, fresh(), tokens, profile_dir)
        except Exception as e:  # noqa: BLE001 - the measurement stands without it
            out["profile"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def prefill_run(cfg, params, tokens, kw, iters, mesh=None, profile_dir=None):
    """Time the prefill of one `tokens`-token sequence: dict with prefill_tps, and the
    profile Breakdown of one prefill when asked."""
    import jax
    import jax.numpy as jnp

    from jaxquant import models

    prompt = jax.random.randint(jax.random.key(2), (1, tokens), 0, cfg.vocab_size, jnp.int32)
    kw = kw if mesh is None else dict(kw, mesh=mesh)
    f = jax.jit(lambda params, prompt: models.prefill(cfg, params, prompt, tokens, **kw))
    compiled = f.lower(params, prompt).compile()
    out = {"prefill_tps": tokens / _median_time(lambda: _block(compiled(params, prompt)), iters)}
    # what generate pays before its first token: the head at the last position only
    last = jnp.full((1,), tokens - 1, jnp.int32)
    first = jax.jit(lambda params, prompt: models.prefill(
        cfg, params, prompt, tokens, logits_at=last, **kw)[1:]).lower(params, prompt).compile()
    out["first_token_s"] = _median_time(lambda: _block(first(params, prompt)), iters)
    if profile_dir is not None:
        try:
            out["profile"] = profile_run(cfg, compiled, (params, prompt), 1, profile_dir)
        except Exception as e:  # noqa: BLE001 - the measurement stands without it
            out["profile"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def prefill_rates(cfg, p):
    """A row's prefill columns from prefill_run's result: tok/s, weight-product FLOP/s and
    the time to the first token."""
    return {"prefill_tps": p["prefill_tps"],
            "prefill_flops": p["prefill_tps"] * matmul_flops_per_token(cfg),
            "first_token_s": p["first_token_s"]}


def prefill_a8_rows(cfg, name, mode, params, prompt, ref_logits, args):
    """--prefill-a8: the prefill timed again with each 8-bit activation type
    (models.a8_params: the dense matrices as jq.RowQuantizedArrays, jq.qmm_a8; docs/a8.md),
    and its last-position logits on the decode prompt against the float run's."""
    import jax

    from jaxquant import models

    rows = []
    for dtype in args.prefill_a8:
        row = {"config": name, "impl": f"jaxquant, prefill a8 {dtype}", "mode": mode,
               "batch": 1}  # no decode: no weights read per step
        try:
            a8 = _block(models.a8_params(params, dtype))
            row.update(prefill_rates(cfg, prefill_run(cfg, a8, args.prefill, args.forward_kw,
                                                      args.iters)))
            if ref_logits is not None:
                logits, _, _ = jax.jit(lambda a8, t: models.prefill(
                    cfg, a8, t, t.shape[1], **args.forward_kw))(a8, prompt[:1])
                row["dlogits"] = _logit_diff(logits[:, -1], ref_logits[:1])
            del a8
        except Exception as e:  # noqa: BLE001
            row = _failed(name, row["impl"], mode, 1, e)
        rows.append(row)
    return rows


def profile_decode(cfg, compiled, args, steps, trace_dir):
    """Trace one run of the compiled decode loop and break it down (profile.py)."""
    return profile_run(cfg, compiled, args, steps, trace_dir)


def profile_run(cfg, compiled, args, steps, trace_dir):
    """Trace one run of a compiled program (`steps` decode steps, or one prefill) and
    break it down (profile.py)."""
    import re

    import jax

    from jaxquant.bench import profile

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        _block(compiled(*args))
    text = compiled.as_text()
    module = re.match(r"HloModule (\S+?),", text)
    events, kind = profile.device_events(profile.trace_file(trace_dir),
                                         module.group(1) if module else None)
    return profile.breakdown(events, profile.hlo_index(text), steps, cfg.num_layers, kind)


# ---------------------------------------------------------------------------
# The torch peer.


def peer_rows(args, cfg, base, prompts, ref, out):
    """Rows of the torch peer (bf16 weights, and int4 where a quantized mode runs)."""
    import numpy as np

    from jaxquant.bench import torch_peer

    why = torch_peer.unavailable(cfg)
    if why is not None:
        out(f"# {args.config_name}: torch peer not run: {why}")
        return []
    import torch

    device = "cuda" if args.platform != "cpu" else "cpu"
    variants = [m for m in args.modes if m in FLOAT_MODES][:1]
    if any(m not in FLOAT_MODES for m in args.modes):
        why_int4 = torch_peer.int4_unavailable(device)
        if why_int4 is None:
            variants.append("int4 g64")
        else:
            out(f"# {args.config_name}: torch int4 peer skipped: {why_int4}")
    compile_mode = None if args.peer_compile == "none" else args.peer_compile
    rows = []
    for variant in variants:
        harness.progress(f"{args.config_name} {PEER_IMPL} {variant}")
        try:
            peer = torch_peer.Peer(cfg, base, int4=variant == "int4 g64",
                                   compile_mode=compile_mode)
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append(_failed(args.config_name, PEER_IMPL, variant, 0, e))
            continue
        for b in args.peer_batch or args.batch[:1]:
            row = {"config": args.config_name, "impl": PEER_IMPL, "mode": variant, "batch": b,
                   "step_bytes": peer.step_bytes(b)}
            try:
                prompt = np.asarray(prompts[b] if b in prompts else prompts[args.batch[0]][:1]
                                    .repeat(b, 0))
                peer.setup(b, prompt.shape[1] + args.tokens)
                logits, token = peer.prefill(prompt)
                run = lambda: (peer.decode(token, prompt.shape[1], args.tokens), peer.sync())
                sec = _median_time(run, args.iters)
                row["decode_tps"] = b * args.tokens / sec
                if b in ref:
                    row["dlogits"] = _logit_diff(logits[:, -1].float().cpu().numpy(), ref[b])
                if b == (args.peer_batch or args.batch)[0] and args.prefill:
                    long = np.asarray(prompts["prefill"])
                    peer.setup(1, long.shape[1])
                    row["prefill_tps"] = long.shape[1] / _median_time(
                        lambda: (peer.prefill(long), peer.sync()), args.iters)
            except Exception as e:  # noqa: BLE001
                row = _failed(args.config_name, PEER_IMPL, variant, b, e)
            rows.append(_done(row))
        peer = None  # its weights and compiled step freed before the next variant's
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------
# One config.


def _done(row):
    """The row, its numbers also on stderr at once (a run cut short keeps them)."""
    if "failed" not in row:
        extra = "".join(f", {k} {row[k]:.4g}" for k in ("prefill_tps", "dlogits") if k in row)
        decode = f"decode {row['decode_tps']:.1f} tok/s" if "decode_tps" in row else "prefill"
        harness.progress(f"{row['config']} {row['impl']} {row['mode']} batch {row['batch']}: "
                         f"{decode}{extra}")
    return row


def _failed(config, impl, mode, batch, e):
    msg = str(e).splitlines()[0][:160] if str(e) else ""
    harness.progress(f"{config} {impl} {mode} batch {batch} failed: {type(e).__name__}: {msg}")
    return {"config": config, "impl": impl, "mode": mode, "batch": batch,
            "failed": f"{type(e).__name__}: {msg}"}


def _placed(cfg, params, mode, mesh, layout=None):
    """The weights of one mode on one mesh (None: one device): params placed, or,
    without params (--init sharded), drawn straight into their placed, quantized form
    (parallel.init_params: the same values)."""
    import jax
    import jax.numpy as jnp

    from jaxquant.models import parallel

    if params is not None:
        return params if mesh is None else parallel.shard_params(cfg, params, mesh)
    on = mesh if mesh is not None else parallel.make_mesh(1, 1)
    dtype = jnp.dtype(FLOAT_MODES.get(mode, cfg.dtype))
    return _block(parallel.init_params(cfg, jax.random.key(0), on,
                                       None if mode in FLOAT_MODES else mode, dtype=dtype,
                                       layout=layout))


def config_rows(args, name, out):
    """Every row of one config: jaxquant per mode and batch (and mesh), then the peer."""
    import jax
    import jax.numpy as jnp

    from jaxquant import demo, models
    from jaxquant.models import parallel

    cfg = demo.preset(name, args.dtype, args.layers)
    args.config_name = name
    # --init sharded: no host copy; each (mode, mesh) draws its own placed weights
    base = None if getattr(args, "init", "host") == "sharded" else _block(
        jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0)))
    prompts = {b: jax.random.randint(jax.random.key(1), (b, args.prompt), 0, cfg.vocab_size,
                                     jnp.int32) for b in args.batch}
    prompts["prefill"] = jax.random.randint(jax.random.key(2), (1, args.prefill or 1), 0,
                                            cfg.vocab_size, jnp.int32)
    layout = getattr(args, "layout", None)
    meshes = [(None, "jaxquant", layout)]
    if args.mesh and layout is not None:  # the best one-device run is the default layout's
        meshes.append((None, DEFAULT_LAYOUT_IMPL, None))
    meshes += [(parallel.make_mesh(tp, ep), f"jaxquant {tp}x{ep}", layout)
               for tp, ep in args.mesh if tp * ep <= jax.device_count()]
    for tp, ep in args.mesh:
        if tp * ep > jax.device_count():
            out(f"# mesh {tp}x{ep} not run: it needs {tp * ep} devices, {jax.device_count()} "
                f"here")
    rows, ref = [], {}
    for mode in args.modes:
        harness.progress(f"{name} {mode}: weights")
        try:
            if base is None:
                params = None
            elif mode in FLOAT_MODES:
                dt = jnp.dtype(FLOAT_MODES[mode])  # no copy where base has it already
                params = jax.tree_util.tree_map(
                    lambda a: a if a.dtype == dt else a.astype(dt), base)
            else:
                params = _block(models.quantize_params(base, mode,
                                                       layout=getattr(args, "layout", None)))
        except Exception as e:  # noqa: BLE001
            rows.append(_failed(name, "jaxquant", mode, 0, e))
            continue
        a8_rows = []
        for mesh, impl, mesh_layout in meshes:
            if mode in FLOAT_MODES and impl == DEFAULT_LAYOUT_IMPL:
                continue  # float weights have no layout
            try:
                placed = _placed(cfg, params if mesh_layout == layout or params is None else
                                 models.prepack_params(params, mesh_layout), mode, mesh,
                                 mesh_layout)
            except Exception as e:  # noqa: BLE001
                rows.append(_failed(name, impl, mode, 0, e))
                continue
            for b in args.batch:
                harness.progress(f"{name} {impl} {mode} batch {b}")
                row = {"config": name, "impl": impl, "mode": mode, "batch": b,
                       "step_bytes": step_bytes(cfg, placed, b)}
                if mesh is not None:
                    row["device_step_bytes"] = step_bytes(cfg, placed, b, per_device=True)
                profile_dir = None
                if args.profile and b == args.batch[0]:
                    profile_dir = os.path.join(args.profile_dir,
                                               f"{name}_{impl}_{mode}_b{b}")
                try:
                    r = decode_run(cfg, placed, prompts[b], args.tokens, args.forward_kw,
                                   args.iters, mesh, profile_dir)
                    row["decode_tps"] = r["decode_tps"]
                    if mode in FLOAT_MODES and mesh is None and impl == "jaxquant":
                        ref.setdefault(b, r["logits"])
                    elif b in ref:
                        row["dlogits"] = _logit_diff(r["logits"], ref[b])
                    if b == args.batch[0] and args.prefill:
                        p = prefill_run(cfg, placed, args.prefill, args.forward_kw, args.iters,
                                        mesh, profile_dir and profile_dir + "_prefill")
                        row.update(prefill_rates(cfg, p))
                        row["prefill_tokens"] = args.prefill
                        row["prefill_bytes"] = step_bytes(cfg, placed, args.prefill)
                    else:
                        p = {}
                    if b == args.batch[0] and args.prefill and mesh is None:
                        a8_rows += prefill_a8_rows(cfg, name, mode, placed, prompts[b], ref.get(b),
                                                   args)
                    for what, res, title in (
                            ("decode steps", r, f"{name} {impl} {mode} batch {b}"),
                            ("prefill", p,
                             f"{name} {impl} {mode} prefill {args.prefill} tokens")):
                        if isinstance(res.get("profile"), str):
                            out(f"# profile of {title} failed: {res['profile']}")
                        elif "profile" in res:
                            from jaxquant.bench import profile

                            profile.print_breakdown(res["profile"], out, title, what=what)
                except Exception as e:  # noqa: BLE001
                    row = _failed(name, impl, mode, b, e)
                rows.append(_done(row))
                rows += [_done(r) for r in a8_rows]
                a8_rows = []
            del placed
        del params
    if args.peer == "torch" and base is not None:
        rows += peer_rows(args, cfg, base, {k: v for k, v in prompts.items()}, ref, out)
    del base
    return rows


# ---------------------------------------------------------------------------
# XLA_FLAGS variants (subprocesses).


def _child_argv(args):
    argv = ["--configs", ",".join(args.configs), "--modes", ",".join(args.modes),
            "--batch", ",".join(map(str, args.batch)), "--prompt", str(args.prompt),
            "--tokens", str(args.tokens), "--prefill", "0", "--peer", "none",
            "--iters", str(args.iters), "--dtype", args.dtype, "--json",
            "--init", getattr(args, "init", "host")]
    if getattr(args, "layout", None):
        argv += ["--layout", args.layout]
    if args.layers:
        argv += ["--layers", str(args.layers)]
    if args.forward_kw:
        argv += ["--forward-kw", ",".join(f"{k}={v!r}" for k, v in args.forward_kw.items())]
    return argv


def variant_rows(args, flags, out):
    """The decode rows of a subprocess run with `flags` appended to XLA_FLAGS."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    harness.progress(f"XLA_FLAGS variant: {env['XLA_FLAGS']}")
    p = subprocess.run([sys.executable, "-m", "jaxquant", "bench", "model", *_child_argv(args)],
                       env=env, capture_output=True, text=True)
    rows = [json.loads(line[len("#json "):]) for line in p.stdout.splitlines()
            if line.startswith("#json ")]
    if p.returncode or not rows:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        out(f"# XLA_FLAGS variant {flags!r} failed (exit {p.returncode}): {tail}")
    for r in rows:
        r["variant"] = flags
    return rows


# ---------------------------------------------------------------------------
# Tables.


def _cell(row, key, fmt):
    return fmt.format(row[key]) if row.get(key) is not None else ""


def print_rows(rows, bw, out, meshes, gemm_flops=None):
    """The table (bw: the copy's bytes/s, or a function of the bytes read); gemm_flops (FLOP/s of a dense bf16 GEMM in this process, or None) adds
    each prefill's weight-product FLOP/s as a share of it."""
    cols = ["config", "impl", "mode", "batch", "decode tok/s", "% of bound", "bound tok/s",
            "vs float"]
    cols += ["prefill tok/s"] + (["prefill % of GEMM", "prefill % of bound"] if gemm_flops
                                 else [])
    cols += ["prefill vs float", "first token ms", "weights read/step", "Δlogits"]
    cols += ["vs 1 device", "vs best 1 device", "prefill vs best 1 device"] if meshes else []
    out("")
    out("| " + " | ".join(cols) + " |")
    out("|" + "|".join("---" if i < 3 else "---:" for i in range(len(cols))) + "|")
    single = {(r["config"], r["mode"], r["batch"]): r.get("decode_tps") for r in rows
              if r["impl"] == "jaxquant"}
    one_device = [r for r in rows if r["impl"] in ("jaxquant", DEFAULT_LAYOUT_IMPL)]
    # the float mode's one-device run of the config and batch: what quantizing buys
    floats = {(r["config"], r["batch"]): r for r in rows
              if r["impl"] == "jaxquant" and r["mode"] in FLOAT_MODES and "failed" not in r}

    def vs_float(r, key):
        f = floats.get((r["config"], r["batch"]))
        if f is None or f is r or not r.get(key) or not f.get(key) or \
                r["impl"] == PEER_IMPL:
            return ""
        return f"{r[key] / f[key]:.2f}x"

    def best(r, key):
        """The best one-device `key` of r's config and batch (any mode: a float mesh row
        against the best quantized one-device run too, as a user would choose)."""
        got = [o[key] for o in one_device if o["config"] == r["config"]
               and o["batch"] == r["batch"] and o.get(key)]
        return max(got, default=None)
    for r in rows:
        if "failed" in r:
            out("| " + " | ".join([r["config"], r["impl"], r["mode"], str(r["batch"]),
                                   "failed: " + r["failed"]] + [""] * (len(cols) - 5)) + " |")
            continue
        # on a mesh, the bound of the weights the busiest device reads (its blocks)
        read = r.get("device_step_bytes", r.get("step_bytes"))
        rate = bw(read) if callable(bw) and read else bw
        bound = r["batch"] * rate / read if rate and read else None
        cells = [r["config"], r["impl"], r["mode"], str(r["batch"]),
                 _cell(r, "decode_tps", "{:.1f}")]
        none = bound is None or "decode_tps" not in r
        cells += ["" if none else f"{100 * r['decode_tps'] / bound:.0f}%",
                  "" if none else f"{bound:.0f}", vs_float(r, "decode_tps")]
        cells.append(_cell(r, "prefill_tps", "{:.0f}"))
        if gemm_flops:
            cells.append(f"{100 * r['prefill_flops'] / gemm_flops:.0f}%"
                         if "prefill_flops" in r else "")
            cells.append(f"{100 * prefill_of_bound(r, gemm_flops, bw):.0f}%"
                         if "prefill_bytes" in r and not callable(bw) else "")
        cells += [vs_float(r, "prefill_tps"),
                  "" if "first_token_s" not in r else f"{1e3 * r['first_token_s']:.2f}",
                  _fmt_bytes(r["step_bytes"]) if "step_bytes" in r else "",
                  _cell(r, "dlogits", "{:.2%}")]
        if meshes:
            one = single.get((r["config"], r["mode"], r["batch"]))
            on_mesh = r["impl"] not in ("jaxquant", DEFAULT_LAYOUT_IMPL, PEER_IMPL)
            cells.append(f"{r['decode_tps'] / one:.2f}x" if one and "decode_tps" in r
                         and on_mesh else "")
            for key in ("decode_tps", "prefill_tps"):
                top = best(r, key) if on_mesh and r.get(key) else None
                cells.append(f"{r[key] / top:.2f}x" if top else "")
        out("| " + " | ".join(cells) + " |")


def print_variants(variants, rows, bw, out):
    base = {(r["config"], r["mode"], r["batch"]): r.get("decode_tps") for r in rows
            if r["impl"] == "jaxquant"}
    cols = ["config", "mode", "batch", "XLA_FLAGS", "decode tok/s", "% of bound",
            "vs this process"]
    out("")
    out(f"# decode by XLA_FLAGS variant (subprocesses; this process: "
        f"{os.environ.get('XLA_FLAGS') or 'none'})")
    out("| " + " | ".join(cols) + " |")
    out("|" + "|".join("---" if i < 4 else "---:" for i in range(len(cols))) + "|")
    for r in variants:
        cells = [r["config"], r["mode"], str(r["batch"]), f"`{r['variant']}`"]
        if "failed" in r:
            out("| " + " | ".join(cells + ["failed: " + r["failed"]]
                                  + [""] * (len(cols) - 5)) + " |")
            continue
        cells.append(f"{r['decode_tps']:.1f}")
        rate = bw(r["step_bytes"]) if callable(bw) else bw
        cells.append(f"{100 * r['decode_tps'] * r['step_bytes'] / (r['batch'] * rate):.0f}%")
        one = base.get((r["config"], r["mode"], r["batch"]))
        cells.append(f"{r['decode_tps'] / one:.2f}x" if one else "")
        out("| " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------
# The scenario.


def _mesh_list(text):
    out = []
    for item in text.split(","):
        try:
            tp, ep = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not TPxEP (e.g. 2x1)") from None
        if tp < 1 or ep < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: TP and EP must be >= 1")
        out.append((tp, ep))
    return tuple(out)


def _forward_kw(text):
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def add_arguments(parser, cpu):
    from jaxquant import demo
    from jaxquant.models import MODES
    from jaxquant.ops.a8 import CODE_TYPES

    configs = CPU_CONFIGS if cpu else GPU_CONFIGS
    g = parser.add_argument_group("what runs")
    g.add_argument("--configs", type=harness.names(tuple(demo.PRESETS), "config"),
                   default=configs,
                   help=f"model dimensions (random weights), from {', '.join(demo.PRESETS)} "
                        f"(default here: {','.join(configs)})")
    g.add_argument("--layers", type=int, default=None,
                   help="override every config's layer count (for a quicker run)")
    modes = tuple(FLOAT_MODES) + tuple(MODES)
    g.add_argument("--modes", type=harness.names(modes, "mode"), default=None,
                   help=f"weights: {', '.join(FLOAT_MODES)} (unquantized) or a quantized mode "
                        f"({', '.join(MODES)}) (default: the --dtype float mode, "
                        f"{', '.join(QUANT_DEFAULT)})")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="activations (models.Config.dtype) (default: %(default)s)")
    g.add_argument("--batch", type=harness.ints, default=(1, 8),
                   help="sequences decoded together, comma-separated (default: 1,8)")
    g.add_argument("--prompt", type=int, default=16 if cpu else 128,
                   help="prompt tokens before decode (default here: %(default)s)")
    g.add_argument("--tokens", type=int, default=8 if cpu else 64,
                   help="greedy tokens decoded in the timed loop (default here: %(default)s)")
    g.add_argument("--prefill", type=int, default=32 if cpu else 512,
                   help="tokens of the timed prefill (batch 1); 0 skips it (default here: "
                        "%(default)s)")
    g.add_argument("--prefill-a8", type=harness.names(tuple(CODE_TYPES), "dtype"),
                   default=(),
                   help="also time each mode's prefill with 8-bit activations of these types "
                        "(models.a8_params, jq.qmm_a8: docs/a8.md), int8,float8_e4m3fn "
                        "(default: none)")
    g.add_argument("--iters", type=int, default=2 if cpu else 3,
                   help="timed runs per measurement, after a warm-up run; the median is "
                        "reported (default here: %(default)s)")
    g.add_argument("--forward-kw", type=_forward_kw, default={},
                   help="extra keyword arguments of models.prefill/decode, KEY=VALUE,... "
                        "(Python literals, e.g. experts_by_layer=True)")
    g = parser.add_argument_group("peer, profile, mesh, XLA flags")
    g.add_argument("--peer", choices=("torch", "none"),
                   default="torch" if not cpu and _torch_cuda() else "none",
                   help="the torch (gpt-fast style) peer of dense configs (default: torch where "
                        "torch with CUDA is importable, else none)")
    g.add_argument("--peer-batch", type=harness.ints, default=(),
                   help="the peer's batch sizes (default: the first of --batch; each one is "
                        "a torch.compile with autotuning)")
    g.add_argument("--peer-compile", choices=("max-autotune", "default", "none"),
                   default="none" if cpu else "max-autotune",
                   help="torch.compile mode of the peer's decode step; none: eager (default "
                        "here: %(default)s)")
    g.add_argument("--profile", action="store_true",
                   help="trace each config and mode's decode at the first batch size (and its "
                        "prefill) and print a breakdown per decode step (per prefill): kernels "
                        "per layer, time per class, gaps, copies")
    g.add_argument("--profile-dir", default=None,
                   help="where the traces go (default: a temporary directory)")
    g.add_argument("--layout", default=None,
                   help="the quantized weights' kernel layout (jq.prepack; default: the "
                        "device's fastest). With --mesh, a one-device row in the default "
                        "layout is run too: 'vs best 1 device' divides by the best one-device "
                        "run (docs/sharding.md)")
    g.add_argument("--init", choices=("host", "sharded"), default="host",
                   help="host: one float copy of the weights, quantized and placed per mode and "
                        "mesh; sharded: each mode and mesh draws its weights straight into "
                        "their quantized, placed form (parallel.init_params: models larger "
                        "than one device's memory in float, e.g. llama3-70b, gpt-oss-120b; "
                        "no peer)")
    g.add_argument("--mesh", type=_mesh_list, default=(),
                   help="also run on these tensor x expert parallel meshes, TPxEP,... (e.g. "
                        "2x1,1x2), with the scaling against one device: 'vs 1 device' (the "
                        "same mode and layout), 'vs best 1 device' and 'prefill vs best 1 "
                        "device' (the best one-device run of the config and batch, any mode, "
                        "the default layout among them); a mesh row's %% of bound is of the "
                        "weights the busiest device reads")
    g.add_argument("--xla-flags", action="append", default=[], metavar="FLAGS",
                   help="re-run the decode in a subprocess with FLAGS appended to XLA_FLAGS "
                        "(repeatable: one row per variant; write it with '=', e.g. "
                        "--xla-flags=--xla_gpu_enable_command_buffer=)")
    g.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    harness.json_out_option(g)
    # what the other scenarios' shared options would set (bench.main checks them)
    parser.set_defaults(copies=8, target_ms=1.0, plot=None, interpret=False)


def run(args, out=print):
    import jax

    cpu = harness.on_cpu()
    args.platform = harness.platform()
    float_mode = "bf16" if args.dtype == "bfloat16" else "float32"
    # the float mode first: the others' Δlogits are against it
    args.modes = sorted(args.modes or (float_mode,) + QUANT_DEFAULT,
                        key=lambda m: m not in FLOAT_MODES)
    args.profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="jaxquant_profile_")
    if not args.batch or min(args.batch) < 1 or args.prompt < 1 or args.tokens < 1 or \
            args.prefill < 0 or args.iters < 1:
        raise SystemExit("bench model: --batch, --prompt, --tokens and --iters must be >= 1, "
                         "--prefill >= 0")
    dev = jax.devices()[0]
    out(f"# device: {jax.device_count()} x {dev.device_kind} ({dev.platform}); jax "
        f"{jax.__version__}; forward options {args.forward_kw or 'none (the defaults)'}")
    variants = [r for flags in args.xla_flags for r in variant_rows(args, flags, out)]
    bw = None
    if cpu:
        # a copy of each row's step bytes on every thread: a step larger than the
        # last-level cache is held against memory, a smaller one against the cache
        bw = harness.cpu_copy_bandwidth
        llc = harness.last_level_cache_bytes()
        out(f"# CPU: bound = a host copy of the row's weight bytes per step (at most "
            f"{harness.CPU_COPY_MAX_BYTES >> 20} MiB) on {harness.cpu_threads()} threads, "
            f"read+write; last-level cache {_fmt_bytes(llc) if llc else 'unknown'} (a step "
            f"that fits it is held against the cache)")
        if set(args.configs) <= set(CPU_CONFIGS):
            out(f"# CPU: tiny configs ({', '.join(args.configs)}: seconds, not a real "
                f"model's size; --configs llama3.2-1b is larger than most caches) and " +
                ("no torch peer (--peer torch adds it)" if args.peer != "torch"
                 else "the torch peer on the CPU"))
    else:
        bw = harness.copy_bandwidth()
        out(f"# copy bandwidth (read+write, back to back): {bw / 1e9:.0f} GB/s; bound = that "
            f"/ weights read per step x batch")
    gemm_flops = None
    if not cpu and args.prefill:
        gemm_flops = harness.dense_matmul_flops()
        out(f"# dense bf16 GEMM (8192^3, XLA's dot) here: {gemm_flops / 1e12:.0f} TFLOP/s; "
            f"prefill % of GEMM = the prefill's weight-product FLOP/s (attention's own not "
            f"counted) / that; prefill % of bound = its time at the longer of that rate and "
            f"its weight bytes at the copy bandwidth / its time")
    if args.peer == "torch":
        import torch

        out(f"# peer: torch {torch.__version__}, compile {args.peer_compile}")
    rows = []
    for name in args.configs:
        rows += config_rows(args, name, out)
    if args.json:
        for r in rows:
            out("#json " + json.dumps(r))
    print_rows(rows, bw, out, args.mesh, gemm_flops)
    if variants:
        print_variants(variants, rows, bw, out)
    return [], None if callable(bw) else bw


SCENARIO = {"help": "whole models (llama3-8b, gpt-oss-20b dims): decode and prefill tok/s, %% "
                    "of the weight-read bound, a torch (gpt-fast style) peer, profile, mesh",
            "add_arguments": add_arguments, "run": run, "xlabel": "batch",
            # the torch peer and the XLA_FLAGS subprocesses share the GPU with this process
            # (JAX allocates as it goes), and gpt-oss-20b's bf16 weights (42 GB) stay
            # resident beside a quantized copy and, with --mesh, a shard
            "env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}}
