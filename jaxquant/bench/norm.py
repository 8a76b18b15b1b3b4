"""Norms: rms_norm, add_rms_norm, gated_rms_norm, timed in one process on the same
inputs as
  pallas     the Pallas Triton kernel (jaxquant.pallas.norms; GPUs, or interpret
             mode with --interpret),
  ffi        the ffi backend's kernel (jq.<op>(..., backend="ffi")), where built,
  reference  the jnp reference under jax.jit (XLA's fused kernel).
Copies of the inputs are chained through an optimization barrier (which moves no
bytes), so XLA can neither merge their reductions nor drop any. "%copy" counts
row inputs + weight read and outputs written.
"""

from __future__ import annotations

import functools

from jaxquant.bench import harness

GPU_SHAPES = ((1, 4096), (64, 4096), (4096, 4096), (4096, 5376), (32768, 128))
CPU_SHAPES = ((1, 1024), (64, 1024), (1024, 1024))
OPS = ("rms_norm", "add_rms_norm", "gated_rms_norm")
MAX_COPIES = 32                 # bounds the compile time of the small shapes' chains


def _cache_bytes():
    """Twice a large last-level cache: H100's 50 MiB L2; a CPU's tens of MiB."""
    return (2 * 32 << 20) if harness.on_cpu() else (2 * 50 << 20)


def _impls(op, gated_kw, interpret):
    """[(label, f(*row_args, w))] for one op: the peers that can run here."""
    import jaxquant as jq
    from jaxquant.pallas import norms as pn

    kw = gated_kw if op == "gated_rms_norm" else {}
    jq_op = getattr(jq, op)
    out = [("reference", lambda *a: jq_op(*a, backend="reference", **kw))]
    label = harness.pallas_label(interpret)
    if label is not None:
        pallas_kw = dict(interpret=True) if harness.on_cpu() else {}
        out.append((label, lambda *a: getattr(pn, op)(*a, **kw, **pallas_kw)))
    if "ffi" in jq.available_backends():
        out.append(("ffi", lambda *a: jq_op(*a, backend="ffi", **kw)))
    return out


def _chain(f, args, w):
    """f(*a, w) for every copy a, each one ordered after the previous through an
    optimization barrier (which aliases, moves no bytes)."""
    from jax import lax

    outs, prev = [], None
    for a in args:
        if prev is not None:
            a, _ = lax.optimization_barrier((a, prev))
        prev = f(*a, w)
        outs.append(prev)
    return tuple(outs)


def run(args, out=print):
    import jax
    import jax.numpy as jnp

    bw = harness.start(out, args.interpret)
    gated_kw = dict(activation=args.activation, norm_before_gate=not args.gate_after_norm,
                    group_size=args.group_size)
    dt = jnp.dtype(args.dtype)
    rows = []
    key = jax.random.PRNGKey(0)
    for shape in args.shapes:
        r, d = shape
        case = f"{r} x {d}"
        block = []
        for op in args.ops:
            key, kw_ = jax.random.split(key)
            n_row_args = 1 if op == "rms_norm" else 2
            n_out = 2 if op == "add_rms_norm" else 1
            nbytes = (n_row_args + n_out) * r * d * dt.itemsize + d * dt.itemsize
            copies = int(max(args.copies, min(MAX_COPIES, -(-_cache_bytes() // nbytes))))
            xs = [tuple(jax.random.normal(jax.random.fold_in(key, 2 * c + a), shape,
                                          jnp.float32).astype(dt) for a in range(n_row_args))
                  for c in range(copies)]
            w = (1.0 + 0.1 * jax.random.normal(kw_, (d,), jnp.float32)).astype(dt)
            jax.block_until_ready(xs)
            ref = {}

            def check(ys, ref=ref):
                y = ys[0][0] if isinstance(ys[0], (tuple, list)) else ys[0]
                y = jnp.asarray(y, jnp.float32)
                if "y" not in ref:          # the reference runs first
                    ref["y"] = y
                    return None
                return float(jnp.max(jnp.abs(y - ref["y"]))
                             / jnp.maximum(jnp.max(jnp.abs(ref["y"])), 1e-30))

            for label, f in _impls(op, gated_kw, args.interpret):
                harness.run_case(block, jax.jit(functools.partial(_chain, f)), (xs, w),
                                 n_products=copies, nbytes=nbytes, case=case, x=r,
                                 family=f"width {d}", mode=op, impl=label, iters=args.iters,
                                 target_ms=args.target_ms, bw=bw,
                                 check=None if args.no_check else check, out=out)
            del xs
        harness.print_table(block, bw, out, base=None, ref="reference",
                            case_title="rows x width", flops=False)
        rows += block
    return rows, bw


def add_arguments(parser, cpu: bool):
    shapes = CPU_SHAPES if cpu else GPU_SHAPES
    parser.add_argument(
        "--shapes", type=harness.int_tuples(2, "rows,width"), default=shapes,
        help="inputs to normalize, 'R,D;R,D;...': R rows of width D (default here: %s)"
             % "; ".join(f"{r},{d}" for r, d in shapes))
    parser.add_argument("--ops", type=harness.names(OPS, "op"), default=OPS,
                        help=f"which norms, comma-separated (default: {','.join(OPS)})")
    g = parser.add_argument_group("gated_rms_norm")
    g.add_argument("--activation", default="silu", choices=("silu", "sigmoid"),
                   help="the gate's activation (default: %(default)s)")
    g.add_argument("--gate-after-norm", action="store_true",
                   help="norm_before_gate=False: normalize x * act(gate)")
    g.add_argument("--group-size", type=int, default=None,
                   help="normalize within groups of this many columns")
    harness.common_options(parser, copies=8, iters=3 if cpu else 10,
                           target_ms=2.0 if cpu else 10.0)


SCENARIO = dict(help="rms_norm, add_rms_norm, gated_rms_norm: kernels vs XLA's fused reference",
                add_arguments=add_arguments, run=run, xlabel="rows")
