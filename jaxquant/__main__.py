"""python -m jaxquant [demo | report | generate | eval | bench ...]

demo (default): a decoder on jaxquant, prefill + decode for bf16 and each
quantized mode: tokens/s, weight bytes, logit difference from bf16
(`python -m jaxquant demo --help`: --checkpoint, --mesh, --config, ...).
report: the JAX devices and jaxquant backends here, and each format's
quantize -> dequantize error on a standard normal matrix.
generate --checkpoint DIR --prompt TEXT: text in, text out (the checkpoint's
tokenizer and chat template, streamed; `python -m jaxquant generate --help`).
eval --checkpoint DIR: perplexity, KL divergence and top-1 agreement of each
quantized mode against the float model on a text (`python -m jaxquant eval --help`).
bench ...: the benchmarks (`python -m jaxquant bench --help`).
"""

from __future__ import annotations

import sys
import time


def backends() -> None:
    """The first lines of `report`: the JAX devices, and which jaxquant backends and
    native libraries are built and available here (and why not). CI prints them."""
    import jax

    import jaxquant as jq
    from jaxquant import dispatch

    print(f"jaxquant {jq.__version__}, jax {jax.__version__}, devices: "
          f"{', '.join(sorted({d.platform + ':' + d.device_kind for d in jax.devices()}))}")
    not_built = dispatch.not_built_backends()
    for name in dispatch.BACKENDS:
        if name in not_built:
            continue
        why = dispatch.unavailable_reason(name)
        print(f"  backend {name:9s} {'available' if why is None else 'unavailable: ' + why}")
        if name == "ffi":  # which native libraries this install has, or why not (the build's words)
            from jaxquant import ffi
            for platform, lib in ffi.libraries().items():
                print(f"    library {platform:4s} "
                      f"{'loaded from ' + str(lib.path) if lib.handle is not None else lib.error}")
    for name, why in not_built.items():  # apart: not part of this build at all
        print(f"  (not built on this platform: {name}: {why})")


def report(n: int = 1024, k: int = 4096) -> None:
    """python -m jaxquant report: the JAX devices, which jaxquant backends are built and
    available here (and why not), and per format (mode, bits, group size) the bits per
    weight and the quantize -> dequantize error on a standard normal [1024, 4096] float32
    matrix: relative error |w - deq(q(w))| / |w|, the largest absolute error, and the
    round trip's time in ms (jitted, after a warm-up). Takes no arguments."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxquant as jq

    backends()
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32)
    print(f"\nround trip on a standard normal [{n}, {k}] float32 matrix "
          f"(rel. error = |w - deq(q(w))| / |w|):")
    print(f"{'mode':12s} {'bits':>4s} {'group':>5s} {'bits/weight':>11s} {'rel. error':>10s} "
          f"{'max abs err':>11s} {'ms':>7s}")
    roundtrip = jax.jit(lambda w, mode, bits, group: jq.dequantize(
        jq.quantize(w, mode=mode, bits=bits, group_size=group)), static_argnums=(1, 2, 3))
    for fmt in jq.FORMATS.values():
        for bits in fmt.bits:
            groups = fmt.group_sizes if fmt.mode in ("affine", "fp4") else fmt.group_sizes[:1]
            for group in groups:
                roundtrip(w, fmt.mode, bits, group).block_until_ready()
                t0 = time.perf_counter()
                d = roundtrip(w, fmt.mode, bits, group).block_until_ready()
                ms = 1e3 * (time.perf_counter() - t0)
                qw = jq.quantize(w[:1], mode=fmt.mode, bits=bits, group_size=group)
                bpw = 8 * (qw.nbytes - (4 if qw.global_scale is not None else 0)) / k
                err = np.linalg.norm(np.asarray(d - w)) / np.linalg.norm(np.asarray(w))
                print(f"{fmt.mode:12s} {bits:4d} {group:5d} {bpw:11.3f} {err:10.5f} "
                      f"{float(jnp.max(jnp.abs(d - w))):11.5f} {ms:7.1f}")


def main(argv: list[str]) -> int:
    """Runs a command; a checkpoint it cannot load (jq.io.CheckpointError: malformed,
    inconsistent or out-of-bounds files, docs/checkpoints.md) is one line on stderr,
    `error: <file>: <what>`, and exit status 1. Other exceptions keep their traceback."""
    try:
        return _command(argv)
    except ValueError as e:
        from jaxquant.io import CheckpointError
        if not isinstance(e, CheckpointError):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def _command(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] == "bench":
        from jaxquant import bench
        return bench.main(argv[1:]) or 0
    if argv and argv[0] == "eval":
        from jaxquant import evaluate
        return evaluate.main(argv[1:])
    if argv and argv[0] == "generate":
        from jaxquant import generate
        return generate.main(argv[1:])
    if argv and argv[0] == "report":
        if argv[1:] in (["-h"], ["--help"]):
            print(report.__doc__)
            return 0
        if argv[1:]:
            print(f"python -m jaxquant report: error: it takes no arguments; got "
                  f"{' '.join(argv[1:])} (see python -m jaxquant report --help)", file=sys.stderr)
            return 2
        report()
        return 0
    from jaxquant import demo
    if argv and argv[0] == "demo":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"unknown command {argv[0]!r}\n{__doc__}", file=sys.stderr)
        return 2
    return demo.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
