"""Benchmark of the norm ops: `main(argv)` (for `python -m jaxquant bench norm`).

For each rows x width shape and each op (rms_norm, add_rms_norm, gated_rms_norm)
it times, in one process, on the same inputs (DESIGN.md §7):
  pallas     the Pallas Triton kernel (jaxquant.pallas.norms; n/a without a
             CUDA/ROCm GPU unless --interpret),
  ffi        the ffi backend's kernel (jq.<op>(..., backend="ffi"); n/a where the
             ffi backend has no kernel for this platform),
  reference  the jnp reference under jax.jit (XLA's fused kernel).
Every timed call runs the op once per input copy, over `copies` distinct copies
(at least 8, more for small shapes, up to ~2x a large L2 cache's worth of
bytes), so inputs come from memory rather than L2; calls are issued back to back
and synced once per sample; time per op = median over samples / calls / copies
(jaxquant.bench._timeit). A device copy (read + write) is timed in the same run:
%copy = (bytes the op must move: row inputs + weight read, outputs written) /
time, over the copy's bytes / time. Absolute times only mean something next to
the device name, which is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

DEFAULT_SHAPES = ((1, 4096), (64, 4096), (4096, 4096), (4096, 5376), (32768, 128))
OPS = ("rms_norm", "add_rms_norm", "gated_rms_norm")
IMPLS = ("pallas", "ffi", "reference")
L2_BYTES = 2 * 50 * 2**20      # twice an H100's L2 (MI300X: 4 MiB L2 + 256 MiB infinity cache)
MAX_COPIES = 32                 # bounds the compile time of the small shapes' chains


@dataclasses.dataclass
class Row:
    shape: tuple
    op: str
    impl: str
    us: float | None
    nbytes: int
    err: float | None = None
    note: str = ""


def _parse_shapes(text):
    out = []
    for item in text.split(";"):
        item = item.strip().strip("()")
        if item:
            out.append(tuple(int(v) for v in item.replace("x", ",").split(",")))
    return tuple(out)


def _fns(op, gated_kw, interpret):
    """impl -> f(rows_args..., w) for one op (pallas: the kernel itself)."""
    import jaxquant as jq
    from jaxquant.pallas import norms as pn

    if op == "rms_norm":
        return {"pallas": lambda x, w: pn.rms_norm(x, w, interpret=interpret),
                "ffi": lambda x, w: jq.rms_norm(x, w, backend="ffi"),
                "reference": lambda x, w: jq.rms_norm(x, w, backend="reference")}
    if op == "add_rms_norm":
        return {"pallas": lambda x, r, w: pn.add_rms_norm(x, r, w, interpret=interpret),
                "ffi": lambda x, r, w: jq.add_rms_norm(x, r, w, backend="ffi"),
                "reference": lambda x, r, w: jq.add_rms_norm(x, r, w, backend="reference")}
    return {"pallas": lambda x, g, w: pn.gated_rms_norm(x, g, w, interpret=interpret,
                                                         **gated_kw),
            "ffi": lambda x, g, w: jq.gated_rms_norm(x, g, w, backend="ffi", **gated_kw),
            "reference": lambda x, g, w: jq.gated_rms_norm(x, g, w, backend="reference",
                                                           **gated_kw)}


def _why_not(impl, interpret):
    """None if `impl` can run here, else why not."""
    from jaxquant import dispatch

    if impl == "pallas":
        if interpret:
            return None
        from jaxquant.pallas import unavailable_reason
        return unavailable_reason()
    if impl == "ffi":
        try:
            import jaxquant.ffi  # noqa: F401 - registers the backend
        except Exception as e:  # noqa: BLE001
            return f"jaxquant.ffi does not import ({type(e).__name__}: {e})"
        return dispatch.unavailable_reason("ffi")
    return None


def _chain(f, args, w):
    """f(*a, w) for every copy a, each one ordered after the previous through an
    optimization barrier (which aliases, moves no bytes): XLA can neither merge
    the copies' reductions into one horizontal fusion nor drop any."""
    from jax import lax

    outs, prev = [], None
    for a in args:
        if prev is not None:
            a, _ = lax.optimization_barrier((a, prev))
        prev = f(*a, w)
        outs.append(prev)
    return tuple(outs)


def _max_rel_err(y, ref):
    import jax.numpy as jnp

    y, ref = (jnp.asarray(a, jnp.float32) for a in (y, ref))
    return float(jnp.max(jnp.abs(y - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def bench_norm(shapes=DEFAULT_SHAPES, ops=OPS, dtype="bfloat16", min_copies=8, iters=10,
               target_ms=10.0, interpret=False, gated_kw=None, copy_mb=None, seed=0,
               out=print):
    import jax
    import jax.numpy as jnp

    from jaxquant.bench import _timeit, copy_bandwidth

    gated_kw = dict(gated_kw or {})
    dev = jax.devices()[0]
    out(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}")
    on_cpu = dev.platform == "cpu"
    if copy_mb is None:
        copy_mb = 256 if on_cpu else 1024
    bw = copy_bandwidth(nbytes=copy_mb << 20, iters=5 if on_cpu else 10)
    out(f"# copy bandwidth (read+write of {copy_mb} MiB): {bw / 1e9:.0f} GB/s")
    why = {impl: _why_not(impl, interpret) for impl in IMPLS}
    for impl, reason in why.items():
        if reason is not None:
            out(f"# {impl}: n/a ({reason})")
    dt = jnp.dtype(dtype)
    rows = []
    key = jax.random.PRNGKey(seed)
    for shape in shapes:
        r, d = shape
        for op in ops:
            key, kw_ = jax.random.split(key)
            n_row_args = 1 if op == "rms_norm" else 2
            row_bytes = r * d * dt.itemsize
            out_count = 2 if op == "add_rms_norm" else 1
            nbytes = (n_row_args + out_count) * row_bytes + d * dt.itemsize
            copies = int(max(min_copies, min(MAX_COPIES, -(-L2_BYTES // nbytes))))
            args = [tuple(jax.random.normal(jax.random.fold_in(key, 2 * c + a), shape,
                                            jnp.float32).astype(dt)
                          for a in range(n_row_args)) for c in range(copies)]
            w = (1.0 + 0.1 * jax.random.normal(kw_, (d,), jnp.float32)).astype(dt)
            jax.block_until_ready(args)
            # ~target_ms of device work per sample, at ~the copy bandwidth.
            est_us = max(nbytes / bw * 1e6, 3.0)
            inner = int(max(2, min(100, target_ms * 1e3 / (est_us * copies))))
            fns = _fns(op, gated_kw, interpret)
            ref_out = None
            for impl in ("reference", "pallas", "ffi"):
                if why[impl] is not None:
                    rows.append(Row(shape, op, impl, None, nbytes, note="n/a"))
                    continue
                many = jax.jit(functools.partial(_chain, fns[impl]))
                try:
                    t = _timeit(many, (args, w), copies, iters, inner)
                    y = many(args, w)[0]                 # copy 0's result, no new compile
                except Exception as e:  # noqa: BLE001 - report and go on
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    out(f"# {impl} {op} {shape} failed: {msg}")
                    rows.append(Row(shape, op, impl, None, nbytes, note="failed"))
                    continue
                y = y if op != "add_rms_norm" else y[0]
                if impl == "reference":
                    ref_out, err = y, None
                else:
                    err = _max_rel_err(y, ref_out) if ref_out is not None else None
                rows.append(Row(shape, op, impl, t * 1e6, nbytes, err))
            del args
        _print_block(rows, shape, bw, out)
    return rows, bw


def _print_block(rows, shape, bw, out):
    block = [r for r in rows if r.shape == shape]
    out("")
    out("| rows x width | op | impl | µs | vs ref | GB/s | %copy | max|Δ|/max|ref| |")
    out("|---|---|---|---:|---:|---:|---:|---:|")
    for r in block:
        label = f"{shape[0]} x {shape[1]}"
        if r.us is None:
            out(f"| {label} | {r.op} | {r.impl} | {r.note} | | | | |")
            continue
        ref = next((q for q in block if q.op == r.op and q.impl == "reference"), None)
        vs = f"{ref.us / r.us:.2f}x" if ref is not None and ref.us and r.impl != "reference" \
            else ""
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        err = "" if r.err is None else f"{r.err:.1e}"
        out(f"| {label} | {r.op} | {r.impl} | {r.us:.1f} | {vs} | {gbs:.0f} | "
            f"{100 * gbs * 1e9 / bw:.0f}% | {err} |")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m jaxquant bench norm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=_parse_shapes, default=DEFAULT_SHAPES,
                        help="'R,D;R,D;...' rows x width (default: 1x4096, 64x4096, "
                             "4096x4096, 4096x5376, 32768x128)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {OPS}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--copies", type=int, default=8,
                        help="minimum distinct input copies (>= 8; small shapes get more)")
    parser.add_argument("--iters", type=int, default=10, help="timed samples (median)")
    parser.add_argument("--target-ms", type=float, default=10.0, help="work per sample")
    parser.add_argument("--activation", default="silu", choices=("silu", "sigmoid"))
    parser.add_argument("--gate-after-norm", action="store_true",
                        help="gated_rms_norm with norm_before_gate=False")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--copy-mb", type=int, default=None,
                        help="size of the bandwidth-reference copy (default 1024; CPU 256)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas kernels in interpret mode (CPU smoke test)")
    args = parser.parse_args(argv)
    ops = tuple(o for o in args.ops.split(",") if o)
    for o in ops:
        if o not in OPS:
            parser.error(f"unknown op {o!r}; expected some of {OPS}")
    if args.copies < 8:
        parser.error("--copies must be >= 8 (to defeat the L2 cache)")
    for s in args.shapes:
        if len(s) != 2 or min(s) < 1:
            parser.error(f"shapes are rows,width; got {s}")
    gated_kw = dict(activation=args.activation, norm_before_gate=not args.gate_after_norm,
                    group_size=args.group_size)
    bench_norm(args.shapes, ops, args.dtype, args.copies, args.iters, args.target_ms,
               args.interpret, gated_kw, args.copy_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
