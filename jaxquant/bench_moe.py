"""MoE benchmark: `main(argv)` (for `python -m jaxquant bench moe [options]`).

Routed-expert products of gpt-oss-20b-like and Qwen3-30B-A3B-like layers:
  decode (T = 1, 8 tokens, top-k experts each): gather_qmm
    pallas      jaxquant.pallas.moe.gather_qmm (the expert-indexed GEMV)
    ffi         jq.gather_qmm(backend="ffi"), where the ffi backend runs here
    jnp ref     the reference: gather the experts' packed weights, dequantize, einsum
    bf16 dense  bf16 weights: w[idx] gathered, then one einsum
    bf16 ragged sort (token, slot) pairs by expert, then lax.ragged_dot on bf16 weights
  prefill (T = 4096 tokens, T*top_k rows sorted by expert): ragged_qmm
    pallas      jaxquant.pallas.moe.ragged_qmm (qmm's GEMM over a device-side tile schedule)
    ffi / jnp ref  dequantize every expert + lax.ragged_dot
    bf16 ragged lax.ragged_dot on bf16 weights

Timing follows jaxquant/bench.py (DESIGN.md §7): each timed call does one product
per routing, over `--copies` distinct routings drawn so that successive products
touch different experts (the selected experts of one decode step can fit in the L2;
the rotation defeats it); time per product = median over samples. "%copy" is the
bytes the product must move over the device-to-device copy bandwidth measured in
the same run, counting only the distinct experts a routing selects (packed words +
scales (+ biases) for quantized impls, bf16 words for the bf16 ones) plus x and y.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from jaxquant.bench import MODES, _timeit, copy_bandwidth

# name -> (E, top_k, K, N)
LAYERS = {
    "gptoss20b": (32, 4, 2880, 5760),
    "qwen3_30b_a3b_down": (128, 8, 2048, 768),
    "qwen3_30b_a3b_gateup": (128, 8, 2048, 1536),
}
QUICK_LAYERS = {"tiny": (8, 2, 256, 384), "tiny_wide": (16, 4, 128, 512)}
DECODE_T = (1, 8)
PREFILL_T = 4096
QUICK_DECODE_T = (1, 3)
QUICK_PREFILL_T = 64


@dataclasses.dataclass
class Row:
    layer: str
    t: int
    mode: str
    impl: str
    us: float
    nbytes: float
    flops: float = 0.0
    err: float | None = None


def _routings(key, t, top_k, e, copies):
    """`copies` [T, top_k] int32 routings; routing c draws its experts from a window of a
    random permutation that moves by T*top_k per copy (consecutive products touch
    different experts where E allows), top_k distinct experts per token."""
    import jax
    import jax.numpy as jnp

    perm = jax.random.permutation(key, e)
    out = []
    for c in range(copies):
        pool = jnp.roll(perm, -c * t * top_k)[:max(top_k, min(e, t * top_k))]
        u = jax.random.uniform(jax.random.fold_in(key, c), (t, pool.shape[0]))
        out.append(pool[jnp.argsort(u, axis=1)[:, :top_k]].astype(jnp.int32))
    return out


CHECK_ROWS = 512  # prefill rows checked against float64 (all of them take tens of GB)


def _exact_prefix(x_sorted, qw, group_sizes, rows):
    """float64 product of the first `rows` expert-sorted rows with their experts'
    dequantized weights, one expert at a time on the host."""
    import jax.numpy as jnp
    import numpy as np

    from jaxquant.quantize import dequantize_reference

    starts = np.concatenate([[0], np.cumsum(np.asarray(group_sizes))])
    rows = min(rows, int(starts[-1]))
    x64 = np.asarray(x_sorted[:rows].astype(jnp.float32), np.float64)
    want = np.zeros((rows, qw.shape[1]))
    for e in range(len(starts) - 1):
        lo, hi = int(starts[e]), min(int(starts[e + 1]), rows)
        if lo >= rows:
            break
        if hi > lo:
            w64 = np.asarray(dequantize_reference(qw[e], jnp.float32), np.float64)
            want[lo:hi] = x64[lo:hi] @ w64.T
    return want


def _sorted_by_expert(x, idx, e):
    """Decode pairs as a ragged problem: x rows [T*k, K] sorted by expert, group sizes."""
    import jax.numpy as jnp

    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // idx.shape[1]]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    return rows, sizes


def _expert_bytes(qw):
    return qw.nbytes / qw.shape[0]


def bench_moe(layers=None, modes=("mxfp4",), decode_t=DECODE_T, prefill_t=PREFILL_T,
              dtype="bfloat16", copies=8, iters=10, target_ms=10.0, interpret=False,
              check=True, seed=0, out=print):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxquant as jq
    from jaxquant import dispatch
    from jaxquant.pallas import moe
    from jaxquant.quantize import dequantize_reference

    layers = LAYERS if layers is None else layers
    dev = jax.devices()[0]
    out(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}")
    bw = copy_bandwidth(nbytes=(2 << 30) if dev.platform != "cpu" else (64 << 20))
    out(f"# copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    ffi_ok = dispatch.unavailable_reason("ffi") is None
    if not ffi_ok:
        out(f"# ffi: {dispatch.unavailable_reason('ffi')}")
    dt = jnp.dtype(dtype)
    rows = []
    key = jax.random.PRNGKey(seed)

    def timed(fn, args, nbytes, layer, t, mode, impl, want=None):
        """Time fn; `want` (float64, the first routing's exact product) gives rel.err
        from the same compiled function's first output (no second compile)."""
        n_products = len(args[-1])                  # one product per routing
        est_us = max(nbytes / bw * 1e6, 5.0)
        inner = int(max(2, min(100, target_ms * 1e3 / (est_us * n_products))))
        err = None
        try:
            first = jax.block_until_ready(fn(*args))[0]
            if want is not None:  # (prefill: the first rows only)
                y = np.asarray(first[:want.shape[0]].astype(jnp.float32), np.float64)
                err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
            sec = _timeit(fn, args, n_products, iters, inner)
        except Exception as e:  # noqa: BLE001 - report and go on
            out(f"# {impl} failed at {layer} T={t} {mode}: {type(e).__name__}: {str(e)[:300]}")
            return
        rows.append(Row(layer, t, mode, impl, sec * 1e6, nbytes, flops, err))

    def many(f):
        return jax.jit(lambda x, w, idxs: tuple(f(x, w, i) for i in idxs))

    for name, (e, top_k, k, n) in layers.items():
        key, kw, kx, kr = jax.random.split(key, 4)
        w = (jax.random.normal(kw, (e, n, k), jnp.float32) * 0.05).astype(dt)
        wt = jnp.swapaxes(w, 1, 2)                          # [E, K, N] for ragged_dot
        qws = {m: jq.quantize(w, **MODES[m]) for m in modes}
        jax.block_until_ready((wt, qws))
        for t in tuple(decode_t) + ((prefill_t,) if prefill_t else ()):
            prefill = t == prefill_t
            x = jax.random.normal(jax.random.fold_in(kx, t), (t, k), dt)
            nc = 2 if prefill else copies
            idxs = _routings(jax.random.fold_in(kr, t), t, top_k, e, nc)
            distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in idxs]))
            # x read once per token (decode) or once per sorted row (prefill), y per slot.
            io_bytes = ((t * top_k if prefill else t) * k + t * top_k * n) * dt.itemsize
            flops = 2.0 * t * top_k * n * k
            out(f"# {name}: E={e} top_k={top_k} K={k} N={n} T={t} "
                f"({'prefill' if prefill else 'decode'}): {distinct:.1f} distinct experts "
                f"per product")
            if prefill:
                # Rows sorted by expert (T*top_k of them), group sizes on the device.
                sorted_in = [_sorted_by_expert(x, i, e) for i in idxs]
                xs = [s[0] for s in sorted_in]
                sizes = [s[1] for s in sorted_in]
                rag = jax.jit(lambda xs, w, sizes: tuple(
                    jax.lax.ragged_dot(a, w, g, preferred_element_type=jnp.float32)
                    .astype(dt) for a, g in zip(xs, sizes)))
                timed(rag, (xs, wt, sizes), e * n * k * dt.itemsize + io_bytes, name, t, "-",
                      "bf16 ragged_dot")
                for m, qw in qws.items():
                    qb = _expert_bytes(qw) * e + io_bytes
                    want = None
                    if check:
                        want = _exact_prefix(xs[0], qw, sizes[0], CHECK_ROWS)
                    impls = [("jnp ref", functools.partial(jq.ragged_qmm, backend="reference")),
                             ("pallas", functools.partial(moe.ragged_qmm, interpret=interpret))]
                    if ffi_ok:
                        impls.append(("ffi", functools.partial(jq.ragged_qmm, backend="ffi")))
                    for impl, rq in impls:
                        f = jax.jit(lambda xs, qw, sizes, rq=rq: tuple(
                            rq(a, qw, g) for a, g in zip(xs, sizes)))
                        timed(f, (xs, qw, sizes), qb, name, t, m, impl, want)
                    del want
                _print_block(rows, name, t, bw, out)
                continue
            # --- decode ---
            wbytes = distinct * n * k * dt.itemsize + io_bytes
            dense = many(lambda x, w, i: jnp.einsum(
                "tk,tjnk->tjn", x, w[i], preferred_element_type=jnp.float32).astype(dt))
            timed(dense, (x, w, idxs), wbytes, name, t, "-", "bf16 dense gather")

            def ragged(x, wt, i):
                a, g = _sorted_by_expert(x, i, e)
                return jax.lax.ragged_dot(a, wt, g, preferred_element_type=jnp.float32).astype(dt)
            timed(many(ragged), (x, wt, idxs), wbytes, name, t, "-", "bf16 ragged_dot")
            for m, qw in qws.items():
                qb = distinct * _expert_bytes(qw) + io_bytes
                want = None
                if check:
                    want = np.einsum("tk,tjnk->tjn", np.asarray(x, np.float64), np.asarray(
                        dequantize_reference(qw[idxs[0]], jnp.float32), np.float64))
                impls = [("jnp ref", lambda x, qw, i: jq.gather_qmm(x, qw, i,
                                                                    backend="reference")),
                         ("pallas", lambda x, qw, i: moe.gather_qmm(x, qw, i,
                                                                    interpret=interpret))]
                if ffi_ok:
                    impls.append(("ffi", lambda x, qw, i: jq.gather_qmm(x, qw, i, backend="ffi")))
                for impl, f in impls:
                    timed(many(f), (x, qw, idxs), qb, name, t, m, impl, want)
            _print_block(rows, name, t, bw, out)
        del w, wt, qws
    return rows, bw


def _print_block(rows, layer, t, bw, out):
    block = [r for r in rows if r.layer == layer and r.t == t]
    if not block:
        return
    base = next((r for r in block if r.impl == "bf16 ragged_dot"), None)
    out("")
    out("| layer | T | mode | impl | µs | vs bf16 ragged | vs ref | GB/s | %copy | TFLOP/s "
        "| rel.err |")
    out("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in block:
        ref = next((q for q in block if q.mode == r.mode and q.impl == "jnp ref"), None)
        vs_ref = (f"{ref.us / r.us:.2f}x" if ref is not None and r.impl != "jnp ref"
                  and r.mode != "-" else "")
        vs_base = f"{base.us / r.us:.2f}x" if base is not None else ""
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        err = "" if r.err is None else f"{r.err:.1e}"
        out(f"| {r.layer} | {r.t} | {r.mode} | {r.impl} | {r.us:.1f} | {vs_base} | {vs_ref} | "
            f"{gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {r.flops / (r.us * 1e-6) / 1e12:.2f} | "
            f"{err} |")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m jaxquant bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(LAYERS),
                   help=f"comma-separated, from {sorted(LAYERS)}")
    p.add_argument("--modes", default="mxfp4", help=f"comma-separated, from {sorted(MODES)}")
    p.add_argument("--decode-t", default=None, help="token counts for decode, e.g. '1,8'")
    p.add_argument("--prefill-t", type=int, default=None, help=f"prefill tokens ({PREFILL_T})")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--copies", type=int, default=8, help="distinct routings per timed call")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--target-ms", type=float, default=10.0)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--interpret", action="store_true", help="pallas in interpret mode")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, pallas in interpret mode, few iterations (CPU smoke test)")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; expected one of {sorted(MODES)}")
    if args.quick:
        layers, decode_t, prefill_t = QUICK_LAYERS, QUICK_DECODE_T, QUICK_PREFILL_T
        copies, iters, interpret = min(args.copies, 2), min(args.iters, 3), True
        target_ms = 1.0
    else:
        names = [s for s in args.layers.split(",") if s]
        for s in names:
            if s not in LAYERS:
                p.error(f"unknown layer {s!r}; expected one of {sorted(LAYERS)}")
        layers = {s: LAYERS[s] for s in names}
        decode_t, prefill_t = DECODE_T, PREFILL_T
        copies, iters, interpret, target_ms = args.copies, args.iters, args.interpret, \
            args.target_ms
    if args.decode_t is not None:
        decode_t = tuple(int(v) for v in args.decode_t.split(",") if v)
    if args.prefill_t is not None:
        prefill_t = args.prefill_t
    if args.no_prefill:
        prefill_t = 0
    bench_moe(layers, modes, decode_t, prefill_t, args.dtype, copies, iters, target_ms,
              interpret, check=not args.no_check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
