"""Prefill on NVIDIA: the tensor-core GEMM on the cuda_mma layout (docs/decode.md,
"Prefill").

  python -m jaxquant bench prefill [--only qmm,ragged] [--modes affine4,mxfp4]

- qmm: M = 64, 512, 4096 at (K, N) = (4096, 14336) (--shapes): the ffi GEMM on
  `jq.prepack`ed weights, `auto` on prepacked weights (the GEMM up to
  configs.MMA_GEMM_MAX_M rows, then the layout's dequantize + cuBLAS) and on
  canonical ones (XLA's dequantize fusion + cuBLAS), the reference on prepacked
  weights, bf16 dense (cuBLAS) and, where torch is importable, torch's bf16
  F.linear, and the opt-in 8-bit activations (`jq.qmm_a8`, int8 and FP8 rows made by
  `jq.quantize_rows` from the mode's weight; docs/a8.md), with TFLOP/s and the ratio
  to bf16 dense.
- ragged: ragged_qmm on gpt-oss-20b's expert stack (E = 32, 2880 -> 5760) with T =
  4, 32, 512, 4096 rows spread evenly over the experts (T < E: one row each for
  the first T): the ffi kernel (prepacked), `auto` on canonical weights, bf16
  lax.ragged_dot, and the dense bf16 GEMM of equal FLOPs (x[T, K] @ w[K, N]);
  "copy time" is the used experts' bytes at the copy bandwidth of the run.

Method as the other scenarios: every timed call does `copies` products on
distinct weights, median of samples (docs/measuring.md).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant.bench.decode import (many_products, print_header, print_row, quantize_mode, start,
                                   time_jax, time_torch)
from jaxquant.ffi import configs
from jaxquant.ops.a8 import CODE_TYPES

QMM_SHAPES = ((64, 4096, 14336), (512, 4096, 14336), (4096, 4096, 14336))  # (M, K, N)
RAGGED_TS = (4, 32, 512, 4096)
RAGGED_LAYER = (32, 2880, 5760)  # gpt-oss-20b: E, K, N


def _rel_err(y, want):
    y = y.astype(jnp.float32)
    return float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))


def bench_qmm(bw, out, modes, copies, shapes=QMM_SHAPES):
    from jaxquant.quantize import dequantize_reference

    print_header(out, "qmm: M, K, N", "mode", "impl", "us", "TFLOP/s", "vs bf16 dense", "rel.err")
    res = {}
    weights = {}
    for m, k, n in shapes:
        if (k, n) not in weights:  # quantized once per weight shape
            weights.clear()
            ws = [(0.05 * jax.random.normal(jax.random.key(i), (n, k), jnp.float32)
                   ).astype(jnp.bfloat16) for i in range(copies)]
            qws = {mode: [quantize_mode(mode, w) for w in ws] for mode in modes}
            prep = jax.jit(jq.prepack, static_argnames="layout")
            packed = {mode: [prep(q, layout="cuda_mma") for q in qs] for mode, qs in qws.items()}
            weights[k, n] = ws, qws, packed
        ws, qws, packed = weights[k, n]
        case = f"{m}, {k}, {n}"
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        tflops = lambda us: f"{2 * m * n * k / (us * 1e-6) / 1e12:.0f}"
        dense = time_jax(many_products(lambda x, w: x @ w.T), (x, ws), copies) * 1e6
        res[(m, "bf16 dense")] = dense
        print_row(out, case, "-", "bf16 dense", f"{dense:.1f}", tflops(dense), "1.00x", "")
        torch_us = _torch_linear(x, ws, copies)
        if torch_us is not None:
            print_row(out, case, "-", "torch bf16 F.linear", f"{torch_us:.1f}", tflops(torch_us),
                  f"{dense / torch_us:.2f}x", "")
        for mode in modes:
            want = x.astype(jnp.float32) @ dequantize_reference(qws[mode][0], jnp.float32).T

            def row(impl, f, weights):
                """Time f over the copies' weights and print its line (a failure too)."""
                try:
                    us = time_jax(many_products(f), (x, weights), copies) * 1e6
                except Exception as e:  # noqa: BLE001
                    print_row(out, case, mode, impl, f"failed: {e}"[:160])
                    return
                res[(m, mode, impl)] = us
                print_row(out, case, mode, impl, f"{us:.1f}", tflops(us), f"{dense / us:.2f}x",
                      f"{_rel_err(jax.jit(f)(x, weights[0]), want):.1e}")

            for impl, q, backend in (("ffi mma gemm (prepacked)", packed[mode], "ffi"),
                                     ("auto (prepacked)", packed[mode], None),
                                     ("auto (canonical)", qws[mode], None),
                                     ("reference (prepacked)", packed[mode], "reference")):
                row(impl, lambda x, q, b=backend: jq.qmm(x, q, backend=b), q)
            for code_type in CODE_TYPES:  # the opt-in 8-bit activations (docs/a8.md)
                row(f"qmm_a8 {code_type} (opt-in; weight rows from {mode})", jq.qmm_a8,
                    [jq.quantize_rows(q, code_type) for q in qws[mode]])
    return res


def _torch_linear(x, ws, copies):
    """torch's F.linear on the same arrays (µs), where torch has CUDA and x is on a GPU."""
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None
    if not torch.cuda.is_available() or x.devices().pop().platform != "gpu":
        return None
    tx = torch.from_dlpack(x)
    tws = [torch.from_dlpack(w) for w in ws]
    return time_torch(lambda: [torch.nn.functional.linear(tx, w) for w in tws], copies) * 1e6


@contextlib.contextmanager
def _gather_max_t(value):
    """configs.RAGGED_GATHER_MAX_T = value (None: unchanged) while products are
    compiled (the kernel is chosen when a primitive is lowered)."""
    saved = configs.RAGGED_GATHER_MAX_T
    configs.RAGGED_GATHER_MAX_T = saved if value is None else value
    try:
        yield
    finally:
        configs.RAGGED_GATHER_MAX_T = saved


def _even_sizes(t, e):
    """T rows over E experts: T // E each and one more for the first T % E."""
    return np.array([t // e + (i < t % e) for i in range(e)], np.int32)


def bench_ragged(bw, out, modes, copies):
    from jaxquant.quantize import dequantize_reference

    e, k, n = RAGGED_LAYER
    print_header(out, "ragged_qmm: E, K, N", "T", "mode", "impl", "us", "TFLOP/s",
                 "vs dense equal FLOPs", "x copy time (used experts)", "rel.err")
    w = (0.05 * jax.random.normal(jax.random.key(7), (e, n, k), jnp.float32)).astype(jnp.bfloat16)
    wt = jnp.swapaxes(w, 1, 2)  # [E, K, N] for ragged_dot
    w_dense = [jnp.swapaxes(w[i], 0, 1) for i in range(copies)]  # equal-FLOPs peer [K, N]
    res = {}
    for t in RAGGED_TS:
        case = f"{e}, {k}, {n}"
        sizes = jnp.asarray(_even_sizes(t, e))
        used = int((np.asarray(sizes) > 0).sum())
        xs = [jax.random.normal(jax.random.key(1000 * t + c), (t, k), jnp.bfloat16)
              for c in range(copies)]
        tflops = lambda us: f"{2 * t * n * k / (us * 1e-6) / 1e12:.1f}"
        dense = time_jax(jax.jit(lambda xs, ws: tuple(x @ wd for x, wd in zip(xs, ws))),
                        (xs, w_dense), copies) * 1e6
        res[(t, "dense")] = dense
        print_row(out, case, t, "-", "bf16 dense GEMM, equal FLOPs", f"{dense:.1f}", tflops(dense),
              "1.00x", "", "")
        rd = jax.jit(lambda xs, wt, g: tuple(jax.lax.ragged_dot(x, wt, g) for x in xs))
        us = time_jax(rd, (xs, wt, sizes), copies) * 1e6
        print_row(out, case, t, "-", "bf16 lax.ragged_dot", f"{us:.1f}", tflops(us),
              f"{dense / us:.2f}x", "", "")
        for mode in modes:
            qw = quantize_mode(mode, w)
            packed = jax.jit(jq.prepack, static_argnames="layout")(qw, layout="cuda_mma")
            copy_us = used * qw.nbytes / e / bw * 1e6
            want = jax.lax.ragged_dot(xs[0].astype(jnp.float32),
                                      jnp.swapaxes(dequantize_reference(qw, jnp.float32), 1, 2),
                                      sizes)
            impls = [("ffi mma (prepacked)", packed, "ffi", None),
                     ("auto (canonical)", qw, None, None)]
            if t <= configs.RAGGED_GATHER_MAX_T:  # the choice's other side, for the record
                impls.insert(1, ("ffi mma gemm (prepacked, forced)", packed, "ffi", 0))
            for impl, q, backend, gather_max in impls:
                f = lambda x, q, g, b=backend: jq.ragged_qmm(x, q, g, backend=b)
                many = jax.jit(lambda xs, q, g, f=f: tuple(f(x, q, g) for x in xs))
                try:
                    with _gather_max_t(gather_max):
                        us = time_jax(many, (xs, q, sizes), copies) * 1e6
                        err = _rel_err(jax.jit(f)(xs[0], q, sizes), want)
                except Exception as ex:  # noqa: BLE001
                    print_row(out, case, t, mode, impl, f"failed: {ex}"[:160])
                    continue
                res[(t, mode, impl)] = us
                print_row(out, case, t, mode, impl, f"{us:.1f}", tflops(us), f"{dense / us:.2f}x",
                      f"{us / copy_us:.2f}x ({used} experts, {copy_us:.0f} us)", f"{err:.1e}")
            del qw, packed
    return res


def add_arguments(parser, cpu):
    from jaxquant.bench import harness

    parser.add_argument("--only", default="qmm,ragged",
                        help="parts to run: qmm, ragged (default: %(default)s)")
    parser.add_argument("--modes", default="affine4,mxfp4",
                        help="quantization modes (default: %(default)s)")
    parser.add_argument(
        "--shapes", type=harness.int_tuples(3, "M,K,N"), default=QMM_SHAPES,
        help="qmm products, 'M,K,N;M,K,N': x is [M, K], the weight [N, K] (default: %s)"
             % "; ".join(",".join(map(str, s)) for s in QMM_SHAPES))
    harness.common_options(parser, copies=8, iters=7, target_ms=20.0)


def run(args, out):
    bw = start(out)
    modes = args.modes.split(",")
    parts = args.only.split(",")
    if "qmm" in parts:
        bench_qmm(bw, out, modes, args.copies, args.shapes)
    if "ragged" in parts:
        bench_ragged(bw, out, modes, args.copies)
    return [], bw


SCENARIO = {"help": "prefill on NVIDIA: the tensor-core GEMM (prepacked) for qmm and "
                    "ragged_qmm vs bf16 dense, ragged_dot and torch",
            "add_arguments": add_arguments, "run": run, "xlabel": "M"}
