"""Benchmarks: `python -m jaxquant bench {qmm,norm,moe} [options]`.

qmm: the kernels (pallas on GPUs; ffi where its library is built for the
platform) vs the jnp reference (jax.jit of x @ dequantize_reference(qw).T) vs
the bf16 dense x @ w.T, in one process, on the same inputs (DESIGN.md §7):
  * every timed call does one product per weight copy, over >= 8 distinct
    copies (rotating through more bytes than the L2 holds; all products distinct,
    so XLA cannot merge any); `inner` calls are issued back to back and synced
    once, so host dispatch overlaps device work; time per product = median over
    samples of (sample time / inner / copies);
  * a device-to-device copy (read + write of a large buffer) is timed in the same
    run; "%copy" is (bytes the op must move: weight + scales (+ biases) + x + y)
    / time, over the copy's (bytes read + written) / time.
Absolute numbers are only meaningful with the GPU name, which is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

DEFAULT_SHAPES = ((1, 4096, 14336), (8, 4096, 14336), (16, 4096, 14336), (1, 2880, 5760),
                  (512, 4096, 14336), (4096, 4096, 14336), (1, 14336, 4096))
DEFAULT_MODES = ("affine4", "mxfp4")
MODES = {
    "affine4": dict(mode="affine", bits=4, group_size=64),
    "affine8": dict(mode="affine", bits=8, group_size=64),
    "affine3": dict(mode="affine", bits=3, group_size=64),
    "mxfp4": dict(mode="mxfp4"),
    "mxfp6_e2m3": dict(mode="mxfp6_e2m3"),
    "mxfp6_e3m2": dict(mode="mxfp6_e3m2"),
    "mxfp8_e4m3": dict(mode="mxfp8_e4m3"),
    "mxfp8_e5m2": dict(mode="mxfp8_e5m2"),
    "nvfp4": dict(mode="nvfp4"),
    "fp4": dict(mode="fp4"),
}


def _parse_shapes(text):
    out = []
    for item in text.split(";"):
        item = item.strip().strip("()")
        if item:
            out.append(tuple(int(v) for v in item.split(",")))
    return tuple(out)


def _parse_variant(text):
    """'gemv:block_n=32,k_words=32,num_warps=4' -> (name, dict)."""
    from jaxquant.pallas import configs

    kernel, _, rest = text.partition(":")
    kw = {}
    for part in filter(None, rest.split(",")):
        key, _, val = part.partition("=")
        kw[key.strip()] = int(val)
    return text, configs.KernelConfig(kernel.strip(), **kw)


def _timeit(fn, args, n_products, iters, inner):
    """Median seconds per product. fn(*args) does n_products distinct products (no
    two alike, so XLA cannot merge them); each sample times `inner` calls issued
    back to back (host dispatch overlaps the device work) and one final sync."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) / n_products


def copy_bandwidth(nbytes=None, iters=10):
    """Bytes/s of a device-to-device copy (read + write of `nbytes`, default 2 GiB
    on accelerators, 256 MiB on the CPU), one XLA elementwise kernel per call."""
    import jax
    import jax.numpy as jnp

    if nbytes is None:
        nbytes = (256 << 20) if jax.devices()[0].platform == "cpu" else (2 << 30)

    a = jnp.arange(nbytes // 4, dtype=jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(1))
    sec = _timeit(f, (a,), 1, iters, inner=5)
    del a
    return 2 * nbytes / sec


def _variant_fits(cfg, m):
    """Variants are timed only at the M they are meant for: GEMV configs for
    M <= 16, small-M-tile GEMM configs for M <= 64, large tiles for M > 64."""
    if cfg.kernel == "gemv":
        return m <= 16
    return (cfg.block_m < 64) == (m <= 64)


@dataclasses.dataclass
class Row:
    shape: tuple
    mode: str
    impl: str
    us: float
    nbytes: int
    err: float | None = None


def bench_qmm(shapes=DEFAULT_SHAPES, modes=DEFAULT_MODES, dtype="bfloat16", copies=8,
              target_ms=20.0, iters=15, variants=(), check=True, seed=0, out=print,
              interpret=False):
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.pallas.qmm import qmm as pallas_qmm
    from jaxquant.quantize import dequantize_reference

    dev = jax.devices()[0]
    out(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}")
    use_ffi = "ffi" in jq.available_backends()
    if not use_ffi:
        out(f"# ffi: {jq.dispatch.unavailable_reason('ffi')}")
    bw = copy_bandwidth()
    out(f"# copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    dt = jnp.dtype(dtype)
    rows = []
    key = jax.random.PRNGKey(seed)
    for (m, k, n) in shapes:
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), dt)
        ws = [jax.random.normal(jax.random.fold_in(kw, i), (n, k), dt) * 0.05
              for i in range(copies)]
        dense_bytes = n * k * dt.itemsize + (m * k + m * n) * dt.itemsize
        # One timed call = one product per weight copy (all distinct); enough calls
        # back to back for ~target_ms of device work per sample.
        est_us = max(dense_bytes / bw * 1e6, 2 * m * n * k / 500e12 * 1e6, 5.0)
        inner = int(max(2, min(200, target_ms * 1e3 / (est_us * copies))))
        n_products = copies

        def many(f):
            return jax.jit(lambda x, ws: tuple(f(x, w) for w in ws))

        dense = many(lambda x, w: x @ w.T)
        t_dense = _timeit(dense, (x, ws), n_products, iters, inner)
        rows.append(Row((m, k, n), "-", "bf16 dense", t_dense * 1e6, dense_bytes))
        for mode in modes:
            qws = [jq.quantize(w, **MODES[mode]) for w in ws]
            jax.block_until_ready(qws)
            qbytes = qws[0].nbytes + (m * k + m * n) * dt.itemsize
            ref = many(lambda x, qw: x @ dequantize_reference(qw, dt).T)
            t_ref = _timeit(ref, (x, qws), n_products, iters, inner)
            rows.append(Row((m, k, n), mode, "jnp reference", t_ref * 1e6, qbytes))
            impls = []
            if dev.platform != "cpu" or interpret:
                impls += [(name, functools.partial(pallas_qmm, config=cfg, interpret=interpret))
                          for name, cfg in [("pallas", None)] + list(variants)
                          if cfg is None or _variant_fits(cfg, m)]
            if use_ffi:
                impls.append(("ffi", functools.partial(jq.qmm, backend="ffi")))
            if "metal" in jq.available_backends():  # macOS: the Apple GPU through the bridge
                impls.append(("metal", functools.partial(jq.qmm, backend="metal")))
            for name, kernel in impls:
                fn = many(kernel)
                err = None
                try:
                    t = _timeit(fn, (x, qws), n_products, iters, inner)
                except Exception as e:  # noqa: BLE001 - report and go on
                    out(f"# {name} failed at {(m, k, n)} {mode}: {type(e).__name__}: "
                        f"{str(e)[:300]}")
                    continue
                if check:
                    y = jax.jit(kernel)(x, qws[0])
                    yr = (x.astype(jnp.float32)
                          @ dequantize_reference(qws[0], jnp.float32).T)
                    err = float(jnp.linalg.norm(y.astype(jnp.float32) - yr)
                                / jnp.linalg.norm(yr))
                rows.append(Row((m, k, n), mode, name, t * 1e6, qbytes, err))
            del qws
        del ws
        _print_block(rows, (m, k, n), bw, out)
    return rows, bw


def _print_block(rows, shape, bw, out):
    block = [r for r in rows if r.shape == shape]
    dense = next(r for r in block if r.impl == "bf16 dense")
    m, k, n = shape
    out("")
    out("| M, K, N | mode | impl | µs | vs dense | vs ref | GB/s | %copy | TFLOP/s | rel.err |")
    out("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in block:
        ref = next((q for q in block if q.mode == r.mode and q.impl == "jnp reference"), None)
        vs_ref = f"{ref.us / r.us:.2f}x" if ref is not None and r.impl != "jnp reference" \
            and r.mode != "-" else ""
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        tf = 2 * m * n * k / (r.us * 1e-6) / 1e12
        err = "" if r.err is None else f"{r.err:.1e}"
        out(f"| {m}, {k}, {n} | {r.mode} | {r.impl} | {r.us:.1f} | {dense.us / r.us:.2f}x | "
            f"{vs_ref} | {gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {tf:.1f} | {err} |")


# Other benchmarks live in their own modules; each takes its own options.
SUBCOMMANDS = {"norm": "jaxquant.bench_norm", "moe": "jaxquant.bench_moe"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m jaxquant bench",
        epilog="also: 'norm' (rms_norm family) and 'moe' (gather_qmm / ragged_qmm); "
               "see 'python -m jaxquant bench norm --help'")
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("qmm", help="pallas / ffi qmm vs jnp reference vs bf16 dense")
    q.add_argument("--shapes", type=_parse_shapes, default=DEFAULT_SHAPES,
                   help="'M,K,N;M,K,N;...' (default: the issue's seven shapes)")
    q.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {sorted(MODES)}")
    q.add_argument("--dtype", default="bfloat16")
    q.add_argument("--copies", type=int, default=8, help="distinct weight copies (>= 8)")
    q.add_argument("--iters", type=int, default=15, help="timed calls (median)")
    q.add_argument("--target-ms", type=float, default=20.0, help="work per timed call")
    q.add_argument("--variant", action="append", default=[],
                   help="extra kernel config, e.g. 'gemv:block_n=32,k_words=32,num_warps=4'")
    q.add_argument("--no-check", action="store_true")
    q.add_argument("--interpret", action="store_true", help="(smoke test on the CPU)")
    args = parser.parse_args(argv)
    if args.what == "qmm":
        if args.copies < 8:
            parser.error("--copies must be >= 8 (to defeat the L2 cache)")
        modes = tuple(m for m in args.modes.split(",") if m)
        for mname in modes:
            if mname not in MODES:
                parser.error(f"unknown mode {mname!r}; expected one of {sorted(MODES)}")
        variants = [_parse_variant(v) for v in args.variant]
        bench_qmm(args.shapes, modes, args.dtype, args.copies, args.target_ms, args.iters,
                  variants, check=not args.no_check, interpret=args.interpret)
    return 0


if __name__ == "__main__":
    sys.exit(main())
