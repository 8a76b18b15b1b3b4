"""Benchmark of the ffi backend's fused dequantize-GEMV (DESIGN.md §7).

  python -m jaxquant.ffi.bench [--shapes 4096x14336] [--modes affine4,mxfp4] [--m 1]

For each (K, N) shape and mode it times, in one process, on the same inputs:
the ffi kernel (jq.qmm, backend="ffi"), the jnp reference (backend="reference")
and the bf16 dense product x @ w.T; plus a device copy of the same number of
bytes, to express the kernel's traffic as a fraction of the copy bandwidth
measured in the same run. Every timed executable walks `copies` (>= 8)
distinct weight copies so the weights come from memory, not from the L2
cache, and the time of one call is taken as the difference between
executables doing 3 and 1 passes over the copies, divided by the extra calls
(which removes the dispatch overhead of an executable).

`run(shapes, modes, ...) -> rows` returns one dict per (shape, mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import jaxquant.ffi  # noqa: F401  (registers the backend)

DEFAULT_SHAPES = [(4096, 14336)]
DEFAULT_MODES = ["affine4", "mxfp4"]


def parse_mode(name: str):
    """'affine4' -> ('affine', 4, 64); 'mxfp4' -> ('mxfp4', None, None); 'affine4g128' too."""
    group = None
    if "g" in name and name.split("g")[-1].isdigit() and name.startswith("affine"):
        name, group = name.rsplit("g", 1)
        group = int(group)
    if name.startswith("affine"):
        return "affine", int(name[len("affine"):] or 4), group or 64
    return name, None, group


def _median_time(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _per_call(make, args, copies, reps=15):
    """Seconds per call of one op: (t(3 passes) - t(1 pass)) / (2 * copies)."""
    t1 = _median_time(make(1), *args, reps=reps)
    t3 = _median_time(make(3), *args, reps=reps)
    return max(t3 - t1, 1e-9) / (2 * copies)


def _passes(op, copies):
    """make(passes): one executable calling op(xs[p], ws[p][i]) for every pass p and copy
    i: distinct x and weights per call, so XLA can neither drop a duplicate call nor share
    a subexpression (the reference's dequantize) between passes."""
    def make(passes):
        f = jax.jit(lambda xs, ws: [op(xs[p], ws[p][i]) for p in range(passes)
                                    for i in range(copies)])
        return f
    return make


def _time_op(op, x, ws, copies, reps=7):
    """ws: 3 lists of `copies` distinct weights (one list per pass)."""
    if jax.default_backend() == "cpu":
        # CPU: XLA may run independent calls of one executable concurrently, so
        # time single calls (dispatch is small against milliseconds), rotating copies.
        f = jax.jit(op)
        jax.block_until_ready(f(x, ws[0][0]))
        ts = []
        for r in range(max(reps, 3)):
            for w in ws[0]:
                t = time.perf_counter()
                jax.block_until_ready(f(x, w))
                ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    xs = [x * (1 + p / 64) for p in range(3)]
    return _per_call(_passes(op, copies), (xs, ws), copies, reps=reps)


def copy_bandwidth(nbytes: int, copies: int) -> float:
    """Bytes/s of a device copy (read + write counted) over `copies` buffers of nbytes."""
    n = max(nbytes // 4, 1024)
    if jax.default_backend() == "cpu":
        bufs = [jnp.full((n,), i, jnp.uint32) for i in range(copies)]
        f = jax.jit(lambda b: b ^ jnp.uint32(1))
        jax.block_until_ready(f(bufs[0]))
        ts = []
        for _ in range(3):
            for b in bufs:
                t = time.perf_counter()
                jax.block_until_ready(f(b))
                ts.append(time.perf_counter() - t)
        return 2 * 4 * n / statistics.median(ts)

    # distinct buffers per pass: XLA would fuse b ^ 1, b ^ 2, ... into one read of b
    bufs = [[jnp.full((n,), 3 * p + i, jnp.uint32) for i in range(copies)] for p in range(3)]

    def make(passes):
        f = jax.jit(lambda bufs: [b ^ jnp.uint32(1) for p in range(passes) for b in bufs[p]])
        return lambda bufs: f(bufs)
    t = _per_call(make, (bufs,), copies)
    return 2 * 4 * n / t


def run(shapes=DEFAULT_SHAPES, modes=DEFAULT_MODES, m: int = 1, dtype=jnp.bfloat16,
        copies: int = 8, with_reference: bool = True, with_dense: bool = True,
        qmv_configs=None):
    """Time ffi qmm vs the jnp reference vs bf16 dense. One dict per (shape, mode[, config])."""
    copies = max(int(copies), 8)
    rows = []
    platform = jax.default_backend()
    device = str(jax.devices()[0].device_kind)
    for (k, n) in shapes:
        key = jax.random.key(0)
        x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(dtype)
        dense_s = None
        if with_dense:
            ws = [[jax.random.normal(jax.random.fold_in(key, 100 + 50 * p + i), (n, k), dtype)
                   for i in range(copies)] for p in range(3 if platform != "cpu" else 1)]
            dense_s = _time_op(lambda x, w: x @ w.T, x, ws, copies)
            del ws
        bw = None
        for name in modes:
            mode, bits, group = parse_mode(name)
            qws = [[jq.quantize(jax.random.normal(jax.random.fold_in(key, 200 + 50 * p + i),
                                                  (n, k), jnp.float32).astype(dtype),
                                mode=mode, bits=bits, group_size=group) for i in range(copies)]
                   for p in range(3 if platform != "cpu" else 1)]
            jax.block_until_ready(qws)
            nbytes = qws[0][0].nbytes + x.size * x.dtype.itemsize + m * n * x.dtype.itemsize
            if bw is None:
                bw = copy_bandwidth(nbytes, copies)
            ref_s = None
            if with_reference:
                ref_s = _time_op(lambda x, w: jq.qmm(x, w, backend="reference"), x, qws, copies,
                                 reps=3)
            for cfg in (qmv_configs or [None]):
                old = os.environ.get("JAXQUANT_FFI_GPU_QMV")
                if cfg is not None:
                    os.environ["JAXQUANT_FFI_GPU_QMV"] = cfg
                try:
                    ker_s = _time_op(lambda x, w: jq.qmm(x, w, backend="ffi"), x, qws, copies)
                finally:
                    if cfg is not None:
                        if old is None:
                            os.environ.pop("JAXQUANT_FFI_GPU_QMV", None)
                        else:
                            os.environ["JAXQUANT_FFI_GPU_QMV"] = old
                rows.append(dict(
                    platform=platform, device=device, k=k, n=n, m=m, mode=name,
                    dtype=jnp.dtype(dtype).name, config=cfg, copies=copies,
                    kernel_us=ker_s * 1e6, ref_us=None if ref_s is None else ref_s * 1e6,
                    dense_us=None if dense_s is None else dense_s * 1e6,
                    bytes=nbytes, kernel_GBs=nbytes / ker_s / 1e9, copy_GBs=bw / 1e9,
                    pct_copy_bw=100 * (nbytes / ker_s) / bw,
                    ref_over_kernel=None if ref_s is None else ref_s / ker_s,
                    dense_over_kernel=None if dense_s is None else dense_s / ker_s))
            del qws
    return rows


def format_table(rows) -> str:
    head = (f"{'device':<22} {'K':>6} {'N':>6} {'M':>3} {'mode':<12} {'cfg':<7} {'ffi us':>9} "
            f"{'ref us':>10} {'bf16 us':>9} {'ref/ffi':>8} {'bf16/ffi':>8} {'GB/s':>7} "
            f"{'copy GB/s':>9} {'%copy':>6}")
    lines = [head, "-" * len(head)]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    for r in rows:
        lines.append(
            f"{r['device'][:22]:<22} {r['k']:>6} {r['n']:>6} {r['m']:>3} {r['mode']:<12} "
            f"{str(r['config'] or '-'):<7} {r['kernel_us']:>9.1f} {f(r['ref_us'], '10.1f'):>10} "
            f"{f(r['dense_us'], '9.1f'):>9} {f(r['ref_over_kernel'], '8.2f'):>8} "
            f"{f(r['dense_over_kernel'], '8.2f'):>8} {r['kernel_GBs']:>7.1f} "
            f"{r['copy_GBs']:>9.1f} {r['pct_copy_bw']:>6.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="ffi fused GEMV vs jnp reference vs bf16 dense")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in DEFAULT_SHAPES),
                    help="KxN,KxN,...")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--qmv-configs", default=None,
                    help="GPU only: 'R,THREADS;...' rows per warp and block size to sweep")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    rows = run(shapes, [m for m in args.modes.split(",") if m], m=args.m,
               dtype=jnp.dtype(args.dtype), copies=args.copies,
               with_reference=not args.no_reference, with_dense=not args.no_dense,
               qmv_configs=args.qmv_configs.split(";") if args.qmv_configs else None)
    print(format_table(rows))
    if args.json:
        import json  # noqa: PLC0415
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
