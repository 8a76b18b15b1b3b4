"""MoE: routed-expert products of gpt-oss-20b-like and Qwen3-30B-A3B-like layers.
  decode (T tokens, top-k experts each): gather_qmm
    pallas      jaxquant.pallas.moe.gather_qmm (the expert-indexed GEMV)
    ffi         jq.gather_qmm(backend="ffi"), where the ffi backend runs here
    jnp ref     the reference: gather the experts' packed weights, dequantize, einsum
    ffi fused swiglu / ffi + XLA swiglu  (gate+up layers, SWIGLU_LAYERS) the product with
                its per-expert bias and activation: jq.gather_qmm_swiglu (one kernel on
                the cuda_mma layout) against the ffi gather_qmm, then XLA's epilogue
    dense gather  dense weights: w[idx] gathered, then one einsum (XLA copies the chosen
                  experts' weights before the dot)
    dense pallas  jq.gather_matmul on dense weights: the Pallas float expert GEMV, reading
                  the chosen experts' rows in place (what models use for float experts)
    dense ragged  sort (token, slot) pairs by expert, then lax.ragged_dot on dense weights
    dense gemv 1  one dense [T, K] x [N, K]^T product of one expert's size (cuBLAS on a
                  GPU): the bandwidth a single matrix reaches, for scale
  prefill (T tokens, T*top_k rows sorted by expert): ragged_qmm
    pallas      jaxquant.pallas.moe.ragged_qmm (qmm's GEMM over a device-side tile schedule)
    ffi / jnp ref  dequantize every expert + lax.ragged_dot
    dense ragged  lax.ragged_dot on dense weights
    dense pallas  jq.ragged_matmul's Pallas kernel on dense weights: the float GEMM over
                  the same schedule, reading the experts in place (what models use for
                  float experts)
    dense ffi   jq.ragged_matmul(backend="ffi") on dense weights, where it has a kernel
                (the grouped GEMM on float experts, compute capability 9.0)
    dense gemm  one dense [T*top_k, K] x [N, K]^T product (cuBLAS on a GPU): the same
                FLOPs as the routed product, for scale
Each timed call does one product per routing, over `--copies` distinct routings
drawn so that successive products touch different experts (the rotation defeats
the cache). "%copy" counts only the distinct experts a routing selects (packed
words + scales (+ biases), or dense words) plus x and y.
"""

from __future__ import annotations

import functools

from jaxquant.bench import harness

# name -> (E, top_k, K, N)
GPU_LAYERS = {
    "gptoss20b": (32, 4, 2880, 5760),
    "gptoss20b_down": (32, 4, 2880, 2880),
    "qwen3_30b_a3b_down": (128, 8, 2048, 768),
    "qwen3_30b_a3b_gateup": (128, 8, 2048, 1536),
}
CPU_LAYERS = {"small": (8, 2, 512, 1024), "small_wide": (16, 4, 256, 1024)}
# gate+up layers (N = 2I): their decode also times gather_qmm_swiglu, with this activation
SWIGLU_LAYERS = {"gptoss20b": "gpt_oss", "qwen3_30b_a3b_gateup": "silu", "small": "silu"}
LAYERS = {**GPU_LAYERS, **CPU_LAYERS}
GPU_DECODE_T, GPU_PREFILL_T = (1, 8), 4096
CPU_DECODE_T, CPU_PREFILL_T = (1, 8), 64
CHECK_ROWS = 512  # prefill rows checked against float64 (all of them take tens of GB)


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
    return x[order // idx.shape[1]], jnp.bincount(flat, length=e).astype(jnp.int32)


def _rel_err(want):
    import jax.numpy as jnp
    import numpy as np

    def check(ys):
        y = np.asarray(ys[0][:want.shape[0]].astype(jnp.float32), np.float64)
        return float(np.linalg.norm(y - want) / np.linalg.norm(want))
    return check


def _dense_err(x, w, idx):
    """check(outputs) -> relative error of the first routing's [T, k, N] against a float32
    IEEE product (precision HIGHEST) of the selected experts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    want = np.asarray(jax.jit(lambda x, w, i: jnp.einsum(
        "tk,tjnk->tjn", x.astype(jnp.float32), w[i].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST))(x, w, idx), np.float64)

    def check(ys):
        y = np.asarray(ys[0].astype(jnp.float32), np.float64)
        return float(np.linalg.norm(y - want) / np.linalg.norm(want))
    return check


def _quantized_impls(op, interpret):
    """[(label, f)] for gather_qmm (decode) or ragged_qmm (prefill): the peers here."""
    import jaxquant as jq
    from jaxquant.pallas import moe

    jq_op = getattr(jq, op)
    out = [("jnp ref", functools.partial(jq_op, backend="reference"))]
    label = harness.pallas_label(interpret)
    if label is not None:
        out.append((label, functools.partial(getattr(moe, op),
                                             interpret=harness.on_cpu())))
    if "ffi" in jq.available_backends():
        out.append(("ffi", functools.partial(jq_op, backend="ffi")))
    return out


def _time_swiglu(time, many, x, qw, idxs, activation, nbytes, mode):
    """A gate+up layer's product with its activation and per-expert bias:
    jq.gather_qmm_swiglu on the ffi backend (one fused kernel where it runs) against
    the ffi gather_qmm followed by the bias and activation in XLA (what it replaces)."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.ops.common import default_precision
    from jaxquant.ops.fused import gather_qmm_swiglu_unfused

    e, n = qw.shape[0], qw.shape[1]
    bias = (jax.random.normal(jax.random.key(1), (e, n), jnp.float32) * 0.1).astype(x.dtype)
    act = dict(activation=activation, limit=7.0 if activation == "gpt_oss" else None,
               alpha=1.702)
    # the op's own composition: the ffi gather_qmm, then its epilogue in XLA
    unfused = lambda x, qw, i: gather_qmm_swiglu_unfused(
        x, qw, i, bias, backend="ffi", precision=default_precision(), **act)
    fused = functools.partial(jq.gather_qmm_swiglu, bias=bias, backend="ffi", **act)
    time(many(unfused), (x, qw, idxs), nbytes=nbytes, mode=mode, impl="ffi + XLA swiglu")
    time(many(fused), (x, qw, idxs), nbytes=nbytes, mode=mode, impl="ffi fused swiglu")


def run(args, out=print):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxquant as jq
    from jaxquant import dispatch
    from jaxquant.pallas import moe

    bw = harness.start(out, args.interpret)
    dt = jnp.dtype(args.dtype)
    rows = []
    key = jax.random.PRNGKey(0)
    prefill_t = 0 if args.no_prefill else args.prefill_t
    for name in args.layers:
        e, top_k, k, n = LAYERS[name]
        key, kw, kx, kr = jax.random.split(key, 4)
        w = (jax.random.normal(kw, (e, n, k), jnp.float32) * 0.05).astype(dt)
        wt = jnp.swapaxes(w, 1, 2)                          # [E, K, N] for ragged_dot
        # canonical: the layout the kernels timed here read (bench decode's moe part
        # times the default layout's)
        qws = {m: jq.quantize(w, **harness.MODES[m], layout="canonical") for m in args.modes}
        jax.block_until_ready((wt, qws))
        for t in tuple(args.decode_t) + ((prefill_t,) if prefill_t else ()):
            prefill = t == prefill_t
            x = jax.random.normal(jax.random.fold_in(kx, t), (t, k), dt)
            idxs = _routings(jax.random.fold_in(kr, t), t, top_k, e,
                             2 if prefill else args.copies)
            distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in idxs]))
            # x read once per token (decode) or once per sorted row (prefill), y per slot.
            io = ((t * top_k if prefill else t) * k + t * top_k * n) * dt.itemsize
            case = f"{name} T={t}"
            block = []
            time = functools.partial(harness.run_case, block, n_products=len(idxs), case=case,
                                     x=t, family=f"{name} {'prefill' if prefill else 'decode'}",
                                     iters=args.iters, target_ms=args.target_ms, bw=bw,
                                     flops=2.0 * t * top_k * n * k, out=out)
            out(f"# {name}: E={e} top_k={top_k} K={k} N={n} T={t} "
                f"({'prefill' if prefill else 'decode'}): {distinct:.1f} distinct experts "
                f"per product")
            if prefill:
                sorted_in = [_sorted_by_expert(x, i, e) for i in idxs]
                xs, sizes = [s[0] for s in sorted_in], [s[1] for s in sorted_in]
                rag = jax.jit(lambda xs, w, sizes: tuple(
                    jax.lax.ragged_dot(a, w, g, preferred_element_type=jnp.float32)
                    .astype(dt) for a, g in zip(xs, sizes)))
                time(rag, (xs, wt, sizes), nbytes=e * n * k * dt.itemsize + io, mode="-",
                     impl="dense ragged")
                label = harness.pallas_label(args.interpret)
                if label is not None:
                    rm = functools.partial(moe.ragged_matmul, interpret=harness.on_cpu())
                    f = jax.jit(lambda xs, w, sizes: tuple(rm(a, w, g)
                                                           for a, g in zip(xs, sizes)))
                    time(f, (xs, w, sizes), nbytes=e * n * k * dt.itemsize + io, mode="-",
                         impl=f"dense {label}")
                if dispatch.select("ragged_matmul", "ffi", "cuda", (xs[0], w, sizes[0]),
                                   dict(transpose=True, precision=None),
                                   required=False) is not None:
                    f = jax.jit(lambda xs, w, sizes: tuple(
                        jq.ragged_matmul(a, w, g, backend="ffi") for a, g in zip(xs, sizes)))
                    time(f, (xs, w, sizes), nbytes=e * n * k * dt.itemsize + io, mode="-",
                         impl="dense ffi")
                mats = [w[c % e] + jnp.zeros((), dt) for c in range(len(idxs))]
                time(jax.jit(lambda xs, mats: tuple(
                    jnp.einsum("tk,nk->tn", a, m, preferred_element_type=jnp.float32).astype(dt)
                    for a, m in zip(xs, mats))), (xs, mats),
                    nbytes=n * k * dt.itemsize + io, mode="-", impl="dense gemm")
                del mats
                for m, qw in qws.items():
                    check = None if args.no_check else _rel_err(
                        _exact_prefix(xs[0], qw, sizes[0], CHECK_ROWS))
                    for impl, rq in _quantized_impls("ragged_qmm", args.interpret):
                        f = jax.jit(lambda xs, qw, sizes, rq=rq: tuple(
                            rq(a, qw, g) for a, g in zip(xs, sizes)))
                        time(f, (xs, qw, sizes), nbytes=qw.nbytes + io, mode=m, impl=impl,
                             check=check)
            else:
                def many(f):
                    return jax.jit(lambda x, w, idxs: tuple(f(x, w, i) for i in idxs))

                def ragged(x, wt, i):
                    a, g = _sorted_by_expert(x, i, e)
                    return jax.lax.ragged_dot(a, wt, g,
                                              preferred_element_type=jnp.float32).astype(dt)

                dense_bytes = distinct * n * k * dt.itemsize + io
                dense_check = None if args.no_check else _dense_err(x, w, idxs[0])
                time(many(lambda x, w, i: jnp.einsum(
                    "tk,tjnk->tjn", x, w[i], preferred_element_type=jnp.float32).astype(dt)),
                    (x, w, idxs), nbytes=dense_bytes, mode="-", impl="dense gather",
                    check=dense_check)
                label = harness.pallas_label(args.interpret)
                if label is not None:
                    gm = functools.partial(moe.gather_matmul, interpret=harness.on_cpu())
                    time(many(gm), (x, w, idxs), nbytes=dense_bytes, mode="-",
                         impl=f"dense {label}", check=dense_check)
                # one expert's matrix per product, a different one each (distinct buffers)
                mats = [w[c % e] + jnp.zeros((), dt) for c in range(len(idxs))]
                time(jax.jit(lambda x, mats: tuple(
                    jnp.einsum("tk,nk->tn", x, m, preferred_element_type=jnp.float32).astype(dt)
                    for m in mats)), (x, mats), nbytes=n * k * dt.itemsize + t * (k + n) *
                    dt.itemsize, mode="-", impl="dense gemv 1", flops=2.0 * t * n * k)
                del mats
                time(many(ragged), (x, wt, idxs), nbytes=dense_bytes, mode="-",
                     impl="dense ragged")
                for m, qw in qws.items():
                    check = None if args.no_check else _rel_err(np.einsum(
                        "tk,tjnk->tjn", np.asarray(x, np.float64),
                        np.asarray(jq.dequantize(qw[idxs[0]], jnp.float32), np.float64)))
                    for impl, f in _quantized_impls("gather_qmm", args.interpret):
                        time(many(f), (x, qw, idxs), nbytes=distinct * qw.nbytes / e + io,
                             mode=m, impl=impl, check=check)
                    if name in SWIGLU_LAYERS and "ffi" in jq.available_backends():
                        _time_swiglu(time, many, x, qw, idxs, SWIGLU_LAYERS[name],
                                     distinct * qw.nbytes / e + io, m)
            harness.print_table(block, bw, out, base="dense ragged", ref="jnp ref",
                                case_title="layer, T")
            rows += block
        del w, wt, qws
    return rows, bw


def add_arguments(parser, cpu: bool):
    layers = CPU_LAYERS if cpu else GPU_LAYERS
    parser.add_argument(
        "--layers", type=harness.names(tuple(LAYERS), "layer"), default=tuple(layers),
        help="expert layers (E experts, top-k, K -> N): "
             + "; ".join(f"{n} ({e}, top-{t}, {k} -> {nn})" for n, (e, t, k, nn) in LAYERS.items())
             + f" (default here: {','.join(layers)})")
    parser.add_argument("--modes", type=harness.names(tuple(harness.MODES), "mode"),
                        default=("mxfp4",),
                        help=f"quantization formats, comma-separated, from "
                             f"{', '.join(harness.MODES)} (default: mxfp4)")
    decode_t, prefill_t = (CPU_DECODE_T, CPU_PREFILL_T) if cpu else (GPU_DECODE_T, GPU_PREFILL_T)
    parser.add_argument("--decode-t", type=harness.ints, default=decode_t,
                        help="tokens per decode step (gather_qmm), comma-separated; '' for none "
                             f"(default here: {','.join(map(str, decode_t))})")
    parser.add_argument("--prefill-t", type=int, default=prefill_t,
                        help=f"tokens of the prefill product (ragged_qmm) (default here: "
                             f"{prefill_t})")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill product")
    harness.common_options(parser, copies=8, iters=3 if cpu else 10,
                           target_ms=2.0 if cpu else 10.0)


SCENARIO = dict(help="routed MoE: gather_qmm (decode) and ragged_qmm (prefill) vs dense",
                add_arguments=add_arguments, run=run, xlabel="T (tokens)")
