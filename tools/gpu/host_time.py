"""Where a call's wall time goes outside its kernels, on a GPU:

  python tools/gpu/host_time.py prefill|decode [gpt-oss-20b] [layers|all] [bf16] [512] [dir]

prefill: one compiled `models.prefill` of a prompt of N tokens (and, in turns with it, the
same with `logits_at` the last position, as `generate` runs it); decode: `models.decode`
of N greedy steps in one call (its `lax.scan`) after a 128-token prompt, the cache
donated. Times the call three ways in one process (each call blocked, as `bench model`
times it; back to back; the time until the call returns), then traces three blocked
calls and, per call, sets the host's events (XLA's thunks, the runtime, the launches of
the command buffers) against the device's kernels: when the first kernel starts after
the call, how long the kernels span, when the call's result is ready after the last
kernel, where the device idles. XLA_FLAGS apply as usual (e.g. which ops the command
buffers take)."""
import collections
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxquant import demo, models
from jaxquant.bench import profile


def timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv):
    what = argv[0] if argv else "prefill"
    if what not in ("prefill", "decode"):
        raise SystemExit(f"the first argument is prefill or decode; got {what!r}")
    argv = argv[1:]
    config = argv[0] if argv else "gpt-oss-20b"
    num_layers = int(argv[1]) if len(argv) > 1 and argv[1] != "all" else None
    mode = argv[2] if len(argv) > 2 else "bf16"
    n = int(argv[3]) if len(argv) > 3 else (512 if what == "prefill" else 16)
    trace_dir = argv[4] if len(argv) > 4 else f"/tmp/{what}_trace"
    cfg = models.Config(**demo.PRESETS[config])
    if num_layers:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    base = jax.block_until_ready(
        jax.jit(models.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), jnp.bfloat16))
    params = base if mode == "bf16" else jax.block_until_ready(models.quantize_params(base, mode))
    if what == "prefill":
        prompt = jax.random.randint(jax.random.key(2), (1, n), 0, cfg.vocab_size, jnp.int32)
        compiled = jax.jit(lambda p, t: models.prefill(cfg, p, t, n)).lower(
            params, prompt).compile()
        call = lambda: compiled(params, prompt)
        shape, tokens = f"prompt {n}", n
    else:
        prompt = jax.random.randint(jax.random.key(2), (1, 128), 0, cfg.vocab_size, jnp.int32)
        _, cache, token = models.prefill(cfg, params, prompt, 128 + n)
        compiled = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, 128, n),
                           donate_argnums=1).lower(params, cache, token).compile()
        state = {"cache": cache}

        def call():  # each call decodes from where the last left its cache: the same work
            tokens, _, state["cache"] = compiled(params, state["cache"], token)
            return tokens
        shape, tokens = f"{n} decode steps in one call after a 128-token prompt", n
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; "
          f"{config} {cfg.num_layers} layers {mode}, {shape}; "
          f"{len(jax.tree_util.tree_leaves(params))} parameter arrays; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    jax.block_until_ready(call())
    blocked = timed(lambda: jax.block_until_ready(call()), 9)
    returns, rest = [], []
    for _ in range(9):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        returns.append(t1 - t0)
        rest.append(time.perf_counter() - t1)
    t0 = time.perf_counter()
    outs = [call() for _ in range(10)]
    jax.block_until_ready(outs)
    b2b = (time.perf_counter() - t0) / 10
    del outs
    med = lambda v: 1e3 * statistics.median(v)
    if what == "prefill":  # the head at the last position only, as generate runs it
        last = jnp.full((1,), n - 1, jnp.int32)
        tail = jax.jit(lambda p, t: models.prefill(cfg, p, t, n, logits_at=last)).lower(
            params, prompt).compile()
        jax.block_until_ready(tail(params, prompt))
        rounds = [timed(lambda: jax.block_until_ready(f()), 5)
                  for _ in range(2) for f in (call, lambda: tail(params, prompt))]
        every, only = rounds[0] + rounds[2], rounds[1] + rounds[3]
        print(f"logits at every position {med(every):.2f} ms, at the last only (logits_at) "
              f"{med(only):.2f} ms, in turns")
    print(f"blocked {med(blocked):.2f} ms ({tokens / statistics.median(blocked):.1f} tok/s); "
          f"call returns after {med(returns):.2f} ms, result ready {med(rest):.2f} ms later; "
          f"back to back {1e3 * b2b:.2f} ms ({tokens / b2b:.1f} tok/s)")

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(3):
            with jax.profiler.TraceAnnotation(f"traced_call_{i}"):
                jax.block_until_ready(call())
    events = profile.trace_events(profile.trace_file(trace_dir))
    procs, threads = profile.trace_names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels, _ = profile.device_events_of(events)
    host_pids = {pid for pid, name in procs.items() if not name.startswith("/device:")}
    calls = sorted((e for e in spans if e["name"].startswith("traced_call_")),
                   key=lambda e: e["ts"])
    for c in calls:
        t0, t1 = c["ts"], c["ts"] + c["dur"]
        ks = [k for k in kernels if t0 <= k.ts <= t1]
        first, last = (ks[0].ts, max(k.ts + k.dur for k in ks)) if ks else (t0, t0)
        busy, end = 0.0, t0
        for k in ks:
            s, e = max(k.ts, end), k.ts + k.dur
            if e > s:
                busy += e - s
            end = max(end, e)
        print(f"\n{c['name']}: {c['dur'] / 1e3:.2f} ms; {len(ks)} kernels; first kernel "
              f"{(first - t0) / 1e3:.2f} ms after the call, span {(last - first) / 1e3:.2f} ms "
              f"(busy {busy / 1e3:.2f}), result {(t1 - last) / 1e3:.2f} ms after the last")
        # the host's events inside the call, by thread and name: total and count
        by = collections.defaultdict(lambda: [0.0, 0])
        for e in spans:
            if e["pid"] in host_pids and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1 and e is not c:
                key = (threads.get((e["pid"], e["tid"]), str(e["tid"]))[:28], e["name"][:90])
                by[key][0] += e["dur"]
                by[key][1] += 1
        for (th, name), (dur, cnt) in sorted(by.items(), key=lambda kv: -kv[1][0])[:40]:
            print(f"  {dur / 1e3:8.3f} ms {cnt:5d}x  [{th}] {name}")
        if c is calls[-1]:  # the call's kernels by name and the code that emitted them
            index = profile.hlo_index(compiled.as_text())
            kinds = collections.defaultdict(lambda: [0.0, 0])
            for k in ks:
                op = index.get(k.hlo_op)
                where = f"{op.opcode} {op.function}" if op else ""
                key = (profile.classify(k.name, k.hlo_op, op), k.name.split(".")[0][:60],
                       where[:50])
                kinds[key][0] += k.dur
                kinds[key][1] += 1
            print("  kernels (class, name, HLO op and Python function): µs, count")
            for (cls, name, where), (dur, cnt) in sorted(kinds.items(),
                                                         key=lambda kv: -kv[1][0])[:60]:
                print(f"  {dur:9.1f} µs {cnt:5d}x  {cls:10s} {name:60s} {where}")
        # device idle stretches longer than 50 us inside the span: where the host was
        gaps = [(a.ts + a.dur, b.ts) for a, b in zip(ks, ks[1:]) if b.ts - (a.ts + a.dur) > 50]
        for g0, g1 in gaps[:12]:
            print(f"  device idle {(g1 - g0) / 1e3:.3f} ms at +{(g0 - t0) / 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
