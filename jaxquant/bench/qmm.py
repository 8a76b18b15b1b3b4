"""qmm: the kernels (pallas on GPUs; ffi where its library is built for the
platform) vs the jnp reference (jax.jit of x @ dequantize_reference(qw).T) vs
the dense x @ w.T in the activation dtype, in one process, on the same inputs.

Every timed call does one product per weight copy (all distinct); "%copy" counts
the bytes the product must move: weight + scales (+ biases) + x + y. On a CPU
the case names the threads (those this process may run on: `taskset -c 0` for
one), the ffi row names the ISA of its kernels, XLA's einsum and numpy's float32
GEMV join the dense rows, and each row's %copy is against a host copy of the
same bytes on as many threads (harness.cpu_copy_bandwidth).
The implementations timed are `PEERS` (on the canonical layout, the one their
kernels read): adding one is one small function. Then the op a user calls,
`jq.qmm` with the automatic choice, on the canonical layout, on `jq.prepack`'s
layout for the device (where it is not the canonical one), and on what
`jq.quantize` returns by default; a line per mode compares the last with the
fastest quantized row (docs/layouts.md: the default must be the fast path).
On a CPU, `--peer llamacpp` adds llama.cpp's CPU GEMV (ggml_mul_mat, from the
llama-cpp-python package) per shape, on 1 and all threads, on weights of the same
bits where a ggml block format holds a jaxquant one (llamacpp_peer.py,
docs/measuring.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jaxquant.bench import harness

# (M, K, N). GPU: decode (M = 1, 8, 16), a gpt-oss-20b MoE expert, prefill-sized M,
# and the transposed layer shape. CPU: the same kinds of M at a size a laptop times
# in seconds.
GPU_SHAPES = ((1, 4096, 14336), (8, 4096, 14336), (16, 4096, 14336), (1, 2880, 5760),
              (512, 4096, 14336), (4096, 4096, 14336), (1, 14336, 4096))
CPU_SHAPES = ((1, 1024, 2048), (16, 1024, 2048), (256, 1024, 2048))
DEFAULT_MODES = ("affine4", "mxfp4")


@dataclasses.dataclass
class Options:
    """What a peer may read: the command line's choices."""
    interpret: bool = False
    variants: tuple = ()          # ((name, configs.KernelConfig), ...): extra pallas configs


@dataclasses.dataclass(frozen=True)
class Peer:
    """One implementation. make(m, opts) -> [(label, f)] with f(x, w) one product
    (w dense for dense peers, a QuantizedArray otherwise); [] where it cannot run."""
    name: str
    quantized: bool
    make: Callable


def _dense(m, opts):
    return [("dense", lambda x, w: x @ w.T)]


def _dense_einsum(m, opts):
    """On a CPU, XLA's other float GEMV: `x @ w.T` takes a slow path there (docs/backends.md)."""
    import jax.numpy as jnp
    if not harness.on_cpu():
        return []
    return [("dense einsum", lambda x, w: jnp.einsum("mk,nk->mn", x, w))]


def _reference(m, opts):
    from jaxquant.quantize import dequantize_reference
    return [("jnp reference", lambda x, qw: x @ dequantize_reference(qw, x.dtype).T)]


def _op_reference(m, opts):
    """The op's own reference (dequantize, then XLA's contraction in its fast form): what
    automatic choice weighs a kernel against."""
    import jaxquant as jq
    return [("jq reference", functools.partial(jq.qmm, backend="reference"))]


def _pallas(m, opts):
    from jaxquant.pallas.qmm import qmm as pallas_qmm
    label = harness.pallas_label(opts.interpret)
    if label is None:
        return []
    kw = dict(interpret=True) if harness.on_cpu() else {}
    out = [(label, functools.partial(pallas_qmm, **kw))]
    for name, cfg in opts.variants:
        if _variant_fits(cfg, m):
            out.append((f"{label} {name}", functools.partial(pallas_qmm, config=cfg, **kw)))
    return out


def _ffi(m, opts):
    import jaxquant as jq
    if "ffi" not in jq.available_backends():
        return []
    from jaxquant import ffi
    # on a CPU the label names the kernels' ISA (JAXQUANT_FFI_CPU_ISA caps it)
    label = f"ffi ({ffi.cpu_kernels_isa()})" if harness.on_cpu() else "ffi"
    return [(label, functools.partial(jq.qmm, backend="ffi"))]


def _metal(m, opts):
    import jaxquant as jq
    if "metal" not in jq.available_backends():  # macOS only: the Apple GPU through the bridge
        return []
    return [("metal", functools.partial(jq.qmm, backend="metal"))]


PEERS = [Peer("dense", False, _dense), Peer("einsum", False, _dense_einsum),
         Peer("reference", True, _reference),
         Peer("op_reference", True, _op_reference),
         Peer("pallas", True, _pallas), Peer("ffi", True, _ffi), Peer("metal", True, _metal)]


def _variant_fits(cfg, m):
    """Variants are timed only at the M they are meant for: GEMV configs for
    M <= 16, small-M-tile GEMM configs for M <= 64, large tiles for M > 64."""
    if cfg.kernel == "gemv":
        return m <= 16
    return (cfg.block_m < 64) == (m <= 64)


def run(args, out=print):
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.quantize import dequantize_reference

    cpu = harness.on_cpu()
    if args.peer == "llamacpp":
        from jaxquant.bench import llamacpp_peer
        why = ("it is llama.cpp's CPU kernels, compared with jaxquant's on the CPU: run "
               "with JAX_PLATFORMS=cpu") if not cpu else llamacpp_peer.unavailable()
        if why:
            raise SystemExit(f"python -m jaxquant bench qmm: --peer llamacpp: {why}")
    bw = harness.start(out, args.interpret, cpu_copy_per_row=True)
    opts = Options(args.interpret, tuple(args.variant))
    dt = jnp.dtype(args.dtype)
    rows = []
    key = jax.random.PRNGKey(0)
    threads = harness.cpu_threads() if cpu else 0
    for (m, k, n) in args.shapes:
        # on a CPU the case names the threads: one run per thread count (taskset)
        case = f"{m}, {k}, {n}" + (f" ({threads} thread{'s' * (threads > 1)})" if cpu else "")
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), dt)
        ws = [jax.random.normal(jax.random.fold_in(kw, i), (n, k), dt) * 0.05
              for i in range(args.copies)]
        io = (m * k + m * n) * dt.itemsize
        flops = 2.0 * m * n * k
        block = []
        time = functools.partial(harness.run_case, block, n_products=args.copies, case=case,
                                 x=m, family=f"K={k}, N={n}", iters=args.iters,
                                 target_ms=args.target_ms, bw=bw, flops=flops, out=out)

        def many(f):
            return jax.jit(lambda x, ws: tuple(f(x, w) for w in ws))

        def copy_bw(nbytes):  # CPU: a copy of one timed call's bytes
            return harness.cpu_copy_bandwidth(args.copies * nbytes, threads) if cpu else None

        dense_bytes = n * k * dt.itemsize + io
        for peer in (p for p in PEERS if not p.quantized and p.name in args.peers):
            for label, f in peer.make(m, opts):
                time(many(f), (x, ws), nbytes=dense_bytes, mode="-", impl=label,
                     row_bw=copy_bw(dense_bytes))
        if cpu and "numpy" in args.peers:  # numpy's float32 GEMV (its BLAS), for scale
            import numpy as np
            xn = np.asarray(x, np.float32)
            wn = [np.asarray(w, np.float32) for w in ws]
            nb = n * k * 4 + (m * k + m * n) * 4
            time(lambda: [xn @ w.T for w in wn], (), nbytes=nb, mode="-",
                 impl="numpy float32", row_bw=copy_bw(nb))
            del wn
        for mode in args.modes:
            qws = [jq.quantize(w, **harness.MODES[mode], layout="canonical") for w in ws]
            jax.block_until_ready(qws)
            want = None
            if not args.no_check:
                want = x.astype(jnp.float32) @ dequantize_reference(qws[0], jnp.float32).T

            def check(ys, want=want):
                y = ys[0].astype(jnp.float32)
                return float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))

            qbytes = qws[0].nbytes + io
            for peer in (p for p in PEERS if p.quantized and p.name in args.peers):
                for label, f in peer.make(m, opts):
                    time(many(f), (x, qws), nbytes=qbytes, mode=mode, impl=label,
                         check=None if want is None else check, row_bw=copy_bw(qbytes))
            for label, weights in (_op_weights(ws, qws, mode) if "auto" in args.peers else ()):
                time(many(jq.qmm), (x, weights), nbytes=qbytes, mode=mode,
                     impl=label, check=None if want is None else check, row_bw=copy_bw(qbytes))
            del qws
        del ws
        harness.print_table(block, bw, out, base="dense einsum" if cpu else "dense",
                            ref="jnp reference", case_title="M, K, N")
        for mode in args.modes:
            out(default_vs_best(block, mode))
        rows += block
        if args.peer == "llamacpp":
            rows += _llamacpp(args, m, k, n, out)
    return rows, bw


def _llamacpp(args, m, k, n, out):
    """The llama.cpp peer's table at one shape (jaxquant/bench/llamacpp_peer.py)."""
    from jaxquant.bench import llamacpp_peer

    modes = [md for md in args.modes if md in llamacpp_peer.PAIRS]
    if not modes or k % llamacpp_peer.QK:
        out(f"# llama.cpp peer: nothing to compare at K={k} among --modes "
            f"{','.join(args.modes)} (it pairs {', '.join(llamacpp_peer.PAIRS)}; K a "
            f"multiple of {llamacpp_peer.QK})")
        return []
    rows = llamacpp_peer.compare(m, k, n, modes, copies=args.copies, iters=args.iters,
                                 target_ms=args.target_ms, out=out)
    llamacpp_peer.print_table(rows, out)
    out(llamacpp_peer.NOTE)
    return rows


DEFAULT_IMPL = "jq.qmm auto, jq.quantize default"


def _op_weights(ws, canonical, mode):
    """[(label, weights)] for `jq.qmm` with the automatic choice: the canonical
    weights, jq.prepack's layout for the device (where it differs), and what
    jq.quantize returns without a layout named."""
    import jaxquant as jq

    out = [("jq.qmm auto, canonical", canonical)]
    packed = [jq.prepack(q) for q in canonical]
    if packed[0].layout != "canonical":
        out.append((f"jq.qmm auto, prepacked ({packed[0].layout})", packed))
    default = [jq.quantize(w, **harness.MODES[mode]) for w in ws]
    out.append((f"{DEFAULT_IMPL} ({default[0].layout})", default))
    return out


def default_vs_best(rows, mode) -> str:
    """One line: jq.qmm on jq.quantize's default output against the fastest
    quantized implementation of `mode` among `rows` (one case)."""
    timed = [r for r in rows if r.mode == mode and r.us]
    default = next((r for r in timed if r.impl.startswith(DEFAULT_IMPL)), None)
    if default is None or not timed:
        return f"# {mode}: jq.quantize default not timed"
    best = min(timed, key=lambda r: r.us)
    return (f"# {default.case} {mode}: jq.quantize default {default.us:.1f} µs = "
            f"{best.us / default.us:.2f}x the best ({best.impl}, {best.us:.1f} µs)")


def _variant(text):
    """'gemv:block_n=32,k_words=32,num_warps=4' -> (text, KernelConfig)."""
    import argparse

    from jaxquant.pallas import configs

    kernel, _, rest = text.partition(":")
    try:
        kw = {key.strip(): int(val) for key, _, val in
              (part.partition("=") for part in rest.split(",") if part)}
        return text, configs.KernelConfig(kernel.strip(), **kw)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"bad kernel config {text!r}: {e}") from None


def add_arguments(parser, cpu: bool):
    parser.add_argument(
        "--shapes", type=harness.int_tuples(3, "M,K,N"), default=CPU_SHAPES if cpu else GPU_SHAPES,
        help="products to time, 'M,K,N;M,K,N;...': x is [M, K], the weight [N, K] "
             "(default here: %s)" % "; ".join(",".join(map(str, s)) for s in
                                             (CPU_SHAPES if cpu else GPU_SHAPES)))
    parser.add_argument("--modes", type=harness.names(tuple(harness.MODES), "mode"),
                        default=DEFAULT_MODES,
                        help="quantization formats, comma-separated, from "
                             f"{', '.join(harness.MODES)} (default: {','.join(DEFAULT_MODES)})")
    every = tuple(p.name for p in PEERS) + ("numpy", "auto")
    # op_reference only when named: the jnp reference row already times the reference's
    # dequantize, and a default row more is every run's time
    default = tuple(p for p in every if p != "op_reference")
    parser.add_argument("--peers", type=harness.names(every, "peer"), default=default,
                        help="implementations to time, comma-separated: dense (x @ w.T), einsum "
                             "(CPU), reference (x @ dequantized w.T), op_reference (jq.qmm's reference "
                             "backend), pallas, ffi, metal, numpy (CPU), auto (jq.qmm's "
                             "own choice on each layout) (default: all but op_reference)")
    parser.add_argument("--peer", choices=("llamacpp", "none"), default="none",
                        help="also compare jq.qmm with llama.cpp's CPU GEMV (ggml_mul_mat, "
                             "from the llama-cpp-python package) per shape, on 1 and all "
                             "threads: affine4 g32 with Q4_1 (same bits) and Q4_0, affine8 "
                             "g32 with Q8_0, mxfp4 with MXFP4 and iq4nl with IQ4_NL (same "
                             "bits) (CPU only; default: none)")
    parser.add_argument("--variant", action="append", type=_variant, default=[],
                        help="also time the Pallas kernel with this block config, e.g. "
                             "'gemv:block_n=32,k_words=32,num_warps=4' (repeatable)")
    harness.common_options(parser, copies=8, iters=3 if cpu else 15,
                           target_ms=2.0 if cpu else 20.0)


SCENARIO = dict(help="quantized matmul (jq.qmm): kernels vs jnp reference vs dense",
                add_arguments=add_arguments, run=run, xlabel="M (rows of x)")
