"""Decode on NVIDIA: the tensor-core GEMV on the cuda_mma layout (docs/decode.md).

  python -m jaxquant bench decode [--only qmm,peers,moe,step,fused] [--modes ...] [--ms 1,8,16]

- qmm: M = 1 (every mode), 8 and 16 at (K, N) = (4096, 14336) and (14336, 4096):
  the ffi kernel on `jq.prepack`ed weights, the pallas kernel on canonical ones,
  `jq.qmm` (automatic choice) on canonical weights and on what `jq.quantize`
  returns by default, bf16 dense (XLA/cuBLAS), each as % of the copy bandwidth
  measured in the run, and per (M, mode) the default's time against the best.
- peers: torch's bf16 F.linear and torch._weight_int4pack_mm (int4, group 64)
  on the same GPU in the same process, where torch is importable.
- moe: gather_qmm decode layers (gpt-oss-20b, Qwen3-30B-A3B; T = 1 and 8), %
  of the copy bandwidth over the bytes of the distinct experts picked: prepacked,
  canonical, and the automatic choice on `jq.quantize`'s default output.
- fused: the fused decode GEMVs against their unfused ops (and the plain qmm), back to
  back at Llama-3-8B dims: rms_norm_qmm (norm + QKV, 4096 -> 6144) against rms_norm then
  qmm, qmm_swiglu (gate + up, 4096 -> 2 x 14336, silu) against qmm then the
  activation in XLA, rms_norm_qmm_swiglu (the two) against rms_norm then qmm_swiglu,
  qmm_add (down, 14336 -> 4096, plus the residual) against qmm then the add; M = 1 and
  8, affine4 and mxfp4, % of the copy bandwidth.
- step: a decode step of 8 layers (rms_norm -> gate, up, down qmm -> residual,
  M = 1, synced per step as a generation loop is), unrolled and as a lax.scan
  over the stacked layers, against bf16 dense.

Method as `python -m jaxquant bench qmm` (docs/measuring.md): every timed
call does `copies` products on distinct weights (more bytes than L2), median of
samples. Needs a CUDA GPU with the CUDA library (the kernel and the layout).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant.bench import harness
from jaxquant.bench.harness import timeit
from jaxquant.formats import PRESETS

MODES = {name: PRESETS[name] for name in (
    "affine4", "mxfp4", "affine2", "affine3", "affine5", "affine6", "affine8", "mxfp6_e2m3",
    "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4", "fp4")}
SHAPES = ((4096, 14336), (14336, 4096))  # (K, N); --shapes replaces them
MOE_LAYERS = {"gpt-oss-20b": (32, 4, 2880, 5760), "Qwen3-30B-A3B": (128, 8, 2048, 1536)}


def time_jax(fn, args, per_call):
    return timeit(fn, args, per_call, iters=7, inner=10)


def quantize_mode(mode, w, layout="canonical"):
    """jq.quantize of `mode`: canonical unless told (the rows name their layout);
    layout=None is jq.quantize's default, the op-level fast path's input."""
    return jq.quantize(w, **MODES[mode], layout=layout)


DEFAULT_IMPL = "auto (jq.quantize default)"


def default_vs_best(results, runs, key, *head, rounds=3):
    """The row comparing the DEFAULT_IMPL result under `key` (a results key prefix)
    with the fastest quantized implementation there, or None. Where another is
    fastest, the two are timed again in turns (`runs` holds each one's timing
    arguments) and their least times compared: timed once each, a minute
    apart, the same kernel on the same layout differed by up to 10% on an H100."""
    timed = {k[-1]: us for k, us in results.items() if k[:-1] == key}
    if DEFAULT_IMPL not in timed:
        return None
    best = min(timed, key=timed.get)
    best_us, default_us = timed[best], timed[DEFAULT_IMPL]
    if best != DEFAULT_IMPL:
        turns = {best: [], DEFAULT_IMPL: []}
        for _ in range(rounds):
            for impl in turns:
                turns[impl].append(time_jax(*runs[key + (impl,)]) * 1e6)
        best_us, default_us = min(turns[best]), min(turns[DEFAULT_IMPL])
    return (*head, f"{default_us / best_us:.2f}x", best, f"{best_us:.1f}", f"{default_us:.1f}")


def print_header(out, *cols):
    """A table's header (a blank line before it ends the table above: --json-out
    records each table's rows, jaxquant/bench/harness.py TableRecorder)."""
    out("")
    print_row(out, *cols)
    out("|" + "---|" * len(cols))


def print_row(out, *cols):
    out("| " + " | ".join(str(c) for c in cols) + " |")


def many_products(f):
    """One call = one product per weight copy (all distinct, one launch each)."""
    return jax.jit(lambda x, ws: tuple(f(x, w) for w in ws))


def bench_qmm(bw, out, modes, copies=8, ms=(1, 8, 16)):
    from jaxquant.quantize import dequantize_reference

    print_header(out, "qmm: M, K, N", "mode", "impl", "us", "%copy", "vs M=1", "rel.err")
    results, runs, versus = {}, {}, []
    for k, n in SHAPES:
        ws = [(0.05 * jax.random.normal(jax.random.key(100 * k + i), (n, k), jnp.float32)
               ).astype(jnp.bfloat16) for i in range(copies)]
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            us = time_jax(many_products(lambda x, w: x @ w.T), (x, ws), copies) * 1e6
            results[(m, k, n, "-", "bf16 dense")] = us
            print_row(out, f"{m}, {k}, {n}", "-", "bf16 dense", f"{us:.1f}",
                  f"{100 * n * k * 2 / (us * 1e-6) / bw:.0f}%", "", "")
        main = ("affine4", "mxfp4")
        for mode in modes if (k, n) == SHAPES[0] else [md for md in modes if md in main]:
            qws = [quantize_mode(mode, w) for w in ws]
            prep = jax.jit(jq.prepack, static_argnames="layout")
            packed = [prep(q, layout="cuda_mma") for q in qws]
            default = [quantize_mode(mode, w, layout=None) for w in ws]
            nbytes = qws[0].nbytes
            for m in ms if mode in main else (1,):
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                impls = [("ffi mma (prepacked)", packed, "ffi")]
                if mode in main:
                    impls.append(("pallas (canonical)", qws, "pallas"))
                impls += [("auto (canonical)", qws, None), (DEFAULT_IMPL, default, None)]
                for impl, q, backend in impls:
                    f = lambda x, q, b=backend: jq.qmm(x, q, backend=b)
                    products = many_products(f)
                    try:
                        us = time_jax(products, (x, q), copies) * 1e6
                    except Exception as e:  # noqa: BLE001
                        print_row(out, f"{m}, {k}, {n}", mode, impl, f"failed: {e}"[:160])
                        continue
                    y = jax.jit(f)(x, q[0]).astype(jnp.float32)
                    yr = x.astype(jnp.float32) @ dequantize_reference(qws[0], jnp.float32).T
                    err = float(jnp.linalg.norm(y - yr) / jnp.linalg.norm(yr))
                    results[(m, k, n, mode, impl)] = us
                    runs[(m, k, n, mode, impl)] = (products, (x, q), copies)
                    base = results.get((1, k, n, mode, impl))
                    print_row(out, f"{m}, {k}, {n}", mode, impl, f"{us:.1f}",
                          f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                          f"{us / base:.2f}x" if base and m > 1 else "", f"{err:.1e}")
                row = default_vs_best(results, runs, (m, k, n, mode), f"{m}, {k}, {n}", mode,
                                      default[0].layout)
                if row is not None:
                    versus.append(row)
            del qws, packed, default
        del ws
    # the op-level default (jq.qmm on jq.quantize's output) against the fastest variant
    print_header(out, "qmm default vs best: M, K, N", "mode", "default layout",
                 "default / best", "best", "best us", "default us")
    for row in versus:
        print_row(out, *row)
    return results


def time_torch(fn, per_call, iters=7, inner=10):
    """timeit's method for a torch callable (CUDA synchronized once per sample)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) / per_call


def bench_torch_peers(bw, out, copies=8):
    try:
        import torch

        from jaxquant.bench import torch_peer
    except Exception as e:  # noqa: BLE001
        out(f"torch peers: torch not importable: {e}")
        return {}
    res = {}
    dev = "cuda"
    print_header(out, "torch peers: M, K, N", "impl", "us", "%copy")
    for k, n in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        ws = [0.05 * torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g)
              for _ in range(copies)]

        us = time_torch(lambda: [torch.nn.functional.linear(x, w) for w in ws], copies) * 1e6
        res[(k, n, "torch bf16 linear")] = us
        print_row(out, f"1, {k}, {n}", "torch bf16 F.linear", f"{us:.1f}",
              f"{100 * n * k * 2 / (us * 1e-6) / bw:.0f}%")
        try:
            # int4 group 64, asymmetric (the same kind as affine4 g64)
            packs = [torch_peer.int4pack(w, 64) for w in ws]
            us = time_torch(lambda: [torch._weight_int4pack_mm(x, p, 64, sz) for p, sz in packs],
                            copies) * 1e6
            nbytes = n * k // 2 + n * (k // 64) * 4
            res[(k, n, "torch int4pack")] = us
            print_row(out, f"1, {k}, {n}", "torch._weight_int4pack_mm g64", f"{us:.1f}",
                  f"{100 * nbytes / (us * 1e-6) / bw:.0f}%")
        except Exception as e:  # noqa: BLE001
            print_row(out, f"1, {k}, {n}", "torch._weight_int4pack_mm failed:", repr(e)[:200])
        del ws
        torch.cuda.empty_cache()
    return res


def bench_moe(bw, out, copies=8):
    print_header(out, "moe: layer", "T", "impl", "us", "distinct experts", "%copy (distinct)")
    res, runs, versus = {}, {}, []
    for name, (e, topk, k, n) in MOE_LAYERS.items():
        w = (0.05 * jax.random.normal(jax.random.key(e), (e, n, k), jnp.float32)).astype(
            jnp.bfloat16)
        qw = quantize_mode("mxfp4", w)
        default = quantize_mode("mxfp4", w, layout=None)
        del w
        packed = jax.jit(jq.prepack, static_argnames="layout")(qw, layout="cuda_mma")
        per_expert = qw.nbytes / e
        for t in (1, 8):
            rng = np.random.default_rng(t)
            idx = np.stack([np.stack([rng.choice(e, topk, replace=False) for _ in range(t)])
                            for _ in range(copies)]).astype(np.int32)  # [copies, T, k]
            distinct = np.mean([len(np.unique(i)) for i in idx])
            x = jax.random.normal(jax.random.key(t), (copies, t, k), jnp.bfloat16)
            for impl, q, backend in (("ffi mma (prepacked)", packed, "ffi"),
                                     ("pallas (canonical)", qw, "pallas"),
                                     ("auto (canonical)", qw, None),
                                     (DEFAULT_IMPL, default, None)):
                f = jax.jit(lambda x, q, idx, b=backend: tuple(
                    jq.gather_qmm(x[c], q, idx[c], backend=b) for c in range(copies)))
                try:
                    us = time_jax(f, (x, q, jnp.asarray(idx)), copies) * 1e6
                except Exception as ex:  # noqa: BLE001
                    print_row(out, name, t, impl, f"failed: {ex}"[:160])
                    continue
                res[(name, t, impl)] = us
                runs[(name, t, impl)] = (f, (x, q, jnp.asarray(idx)), copies)
                print_row(out, name, t, impl, f"{us:.1f}", f"{distinct:.1f}",
                      f"{100 * distinct * per_expert / (us * 1e-6) / bw:.0f}%")
            row = default_vs_best(res, runs, (name, t), name, t, default.layout)
            if row is not None:
                versus.append(row)
        del qw, packed, default
    print_header(out, "moe default vs best: layer", "T", "default layout", "default / best",
                 "best", "best us", "default us")
    for row in versus:
        print_row(out, *row)
    return res


# (K, N): Llama-3-8B's q/k/v, gate and up, and down projection (qmm_add: the residual)
FUSED_SHAPES = {"rms_norm_qmm": (4096, 6144), "qmm_swiglu": (4096, 2 * 14336),
                "rms_norm_qmm_swiglu": (4096, 2 * 14336), "qmm_add": (14336, 4096)}


def fused_variants(op, nw, r):
    """op's fused kernel (backend="ffi": at every M, where the automatic choice takes it
    up to configs.FUSED_MAX_ROWS rows, or never), the automatic choice, and the unfused ops:
    (x, q) -> y each. nw: the norm weight [K]; r(m): the addend [m, N]."""
    def swiglu(y):
        g, u = jnp.split(y.astype(jnp.float32), 2, axis=-1)
        return (jax.nn.silu(g) * u).astype(y.dtype)
    return {
        "rms_norm_qmm": (lambda x, q: jq.rms_norm_qmm(x, nw, q, backend="ffi"),
                         lambda x, q: jq.rms_norm_qmm(x, nw, q),
                         lambda x, q: jq.qmm(jq.rms_norm(x, nw), q)),
        "qmm_swiglu": (lambda x, q: jq.qmm_swiglu(x, q, backend="ffi"),
                       lambda x, q: jq.qmm_swiglu(x, q),
                       lambda x, q: swiglu(jq.qmm(x, q))),
        "rms_norm_qmm_swiglu": (lambda x, q: jq.rms_norm_qmm_swiglu(x, nw, q, backend="ffi"),
                                lambda x, q: jq.rms_norm_qmm_swiglu(x, nw, q),
                                lambda x, q: jq.qmm_swiglu(jq.rms_norm(x, nw), q)),
        "qmm_add": (lambda x, q: jq.qmm_add(x, q, r(x.shape[0]), backend="ffi"),
                    lambda x, q: jq.qmm_add(x, q, r(x.shape[0])),
                    lambda x, q: jq.qmm(x, q) + r(x.shape[0])),
    }[op]


def bench_fused(bw, out, modes=("affine4", "mxfp4"), copies=8, ms=(1, 8)):
    print_header(out, "fused: op, M, K, N", "mode", "impl", "us", "%copy", "unfused / fused")
    res = {}
    for op, (k, n) in FUSED_SHAPES.items():
        ws = [(0.05 * jax.random.normal(jax.random.key(7 * i + 1), (n, k), jnp.float32)
               ).astype(jnp.bfloat16) for i in range(copies)]
        nw = 1 + 0.1 * jax.random.normal(jax.random.key(5), (k,), jnp.bfloat16)
        r = lambda m: jax.random.normal(jax.random.key(6), (m, n), jnp.bfloat16)
        fused, auto, unfused = fused_variants(op, nw, r)
        for mode in modes:
            packed = [jq.prepack(quantize_mode(mode, w), layout="cuda_mma") for w in ws]
            default = [quantize_mode(mode, w, layout=None) for w in ws]
            nbytes = packed[0].nbytes
            for m in ms:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                # qmm alone: the plain GEMV on the same weight, what the fusion adds to;
                # the op with the automatic choice on jq.quantize's default output
                for impl, f, q in (("unfused", unfused, packed), ("fused", fused, packed),
                                   ("qmm alone", lambda x, q: jq.qmm(x, q), packed),
                                   (f"fused, {DEFAULT_IMPL}", auto, default)):
                    us = time_jax(many_products(f), (x, q), copies) * 1e6
                    res[(op, m, mode, impl)] = us
                    ratio = (res[(op, m, mode, "unfused")] / us if impl.startswith("fused")
                             else None)
                    print_row(out, f"{op}, {m}, {k}, {n}", mode, impl, f"{us:.1f}",
                          f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                          f"{ratio:.2f}x" if ratio else "")
            del packed, default
        del ws
    return res


def bench_step(bw, out, modes=("affine4", "mxfp4"), layers=8, d=4096, f=14336):
    print_header(out, "decode step (8 layers, M=1, synced per step): weights", "loop", "us/step",
                 "vs bf16 dense")
    key = jax.random.key(99)
    ks = jax.random.split(key, 3)
    dense = {nm: (0.02 * jax.random.normal(kk, (layers,) + shp, jnp.float32)).astype(jnp.bfloat16)
             for nm, kk, shp in zip(("gate", "up", "down"), ks, ((f, d), (f, d), (d, f)))}
    norm_w = jnp.ones((layers, d), jnp.bfloat16)
    x0 = jax.random.normal(jax.random.key(1), (1, d), jnp.bfloat16)

    def layer(x, w, nw, mm):
        h = jq.rms_norm(x, nw)
        if "gate_up" in w:  # one product over the concatenated weights, then a split
            g, u = jnp.split(mm(h, w["gate_up"]), 2, axis=-1)
        else:
            g, u = mm(h, w["gate"]), mm(h, w["up"])
        a = jax.nn.silu(g) * u
        return x + mm(a.astype(x.dtype), w["down"])

    def unrolled(mm):
        def step(x, ws, nws):
            for i in range(layers):
                x = layer(x, jax.tree_util.tree_map(lambda a: a[i], ws), nws[i], mm)
            return x
        return jax.jit(step)

    def scanned(mm):
        def step(x, ws, nws):
            return jax.lax.scan(lambda x, wn: (layer(x, wn[0], wn[1], mm), None), x,
                                (ws, nws))[0]
        return jax.jit(step)

    def per_step(fn, *args, iters=7, inner=20):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(inner):
                jax.block_until_ready(fn(*args))  # synced per step
            times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times) * 1e6

    # gate and up as one [2f, d] weight per layer (quantized whole: its rows are the
    # same groups as the two halves', so the products equal the separate ones)
    fused = {"gate_up": jnp.concatenate([dense["gate"], dense["up"]], axis=1),
             "down": dense["down"]}
    dense_mm = lambda h, w: h @ w.T
    res = {}
    for label, ws in (("bf16 dense", dense), ("bf16 dense, gate+up fused", fused)):
        for loop, make in (("unrolled", unrolled), ("lax.scan", scanned)):
            res[(label, loop)] = per_step(make(dense_mm), x0, ws, norm_w)
            print_row(out, label, loop, f"{res[label, loop]:.0f}",
                  f"{res['bf16 dense', loop] / res[label, loop]:.2f}x")
    for mode in modes:
        for wlabel, wd in (("", dense), (", gate+up fused", fused)):
            qws = {nm: quantize_mode(mode, w) for nm, w in wd.items()}
            packed = {nm: jq.prepack(q, layout="cuda_mma") for nm, q in qws.items()}
            default = {nm: quantize_mode(mode, w, layout=None) for nm, w in wd.items()}
            runs = [("prepacked (ffi mma)", packed)] + (
                [("canonical (auto)", qws), (DEFAULT_IMPL, default)] if not wlabel else [])
            for label, ws in runs:
                for loop, make in (("unrolled", unrolled), ("lax.scan", scanned)):
                    us = per_step(make(lambda h, q: jq.qmm(h, q)), x0, ws, norm_w)
                    res[(mode, label + wlabel, loop)] = us
                    print_row(out, f"{mode} {label}{wlabel}", loop, f"{us:.0f}",
                          f"{res['bf16 dense', loop] / us:.2f}x")
            del qws, packed, default
    return res


def add_arguments(parser, cpu):
    parser.add_argument("--only", default="qmm,peers,moe,fused,step",
                        help="parts to run: qmm, peers (torch), moe, fused, step "
                             "(default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="qmm modes at (4096, 14336) (affine4 and mxfp4 at both shapes)")
    parser.add_argument("--ms", default="1,8,16", help="rows of x for the qmm part")
    parser.add_argument("--shapes", default="4096,14336;14336,4096",
                        help="qmm (K, N) shapes, 'K,N;K,N'; all modes at the first, affine4 "
                             "and mxfp4 at every one (default: %(default)s)")
    harness.common_options(parser, copies=8, iters=7, target_ms=20.0)


def start(out):
    """The device and copy-bandwidth lines every NVIDIA scenario starts with; bytes/s."""
    dev = jax.devices()[0]
    out(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    bw = harness.copy_bandwidth()  # looked up per call: tests replace it on the CPU
    out(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    return bw


def run(args, out):
    bw = start(out)
    parts = args.only.split(",")
    global SHAPES
    SHAPES = tuple(tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";"))
    if "qmm" in parts:
        bench_qmm(bw, out, args.modes.split(","), copies=args.copies,
                  ms=tuple(int(m) for m in args.ms.split(",")))
    if "peers" in parts:
        bench_torch_peers(bw, out, copies=args.copies)
    if "moe" in parts:
        bench_moe(bw, out, copies=args.copies)
    if "fused" in parts:
        bench_fused(bw, out, copies=args.copies)
    if "step" in parts:
        bench_step(bw, out)
    return [], bw


SCENARIO = {"help": "decode on NVIDIA: the tensor-core GEMV (prepacked), torch peers, "
                    "MoE layers, an 8-layer decode step unrolled and in lax.scan",
            "add_arguments": add_arguments, "run": run, "xlabel": "M"}
