"""The tensor-core decode GEMV's edge cases in one small process, for
compute-sanitizer (tools/gpu/check_decode.sh): a canonical tail tile (N % 16),
M = 1 / 9 / 16, float32 and half x, gather_qmm with repeated experts and ids
outside [0, E) (NaN rows, no weight read). Prints ALL OK when the results
match the reference."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq


def main():
    ok = True
    for mode, bits in (("affine", 4), ("mxfp4", 4), ("affine", 3), ("mxfp8_e5m2", 8),
                       ("nvfp4", 4)):
        w = jax.random.normal(jax.random.key(bits), (5, 37, 128), jnp.float32)
        qw = jq.quantize(w, mode=mode, bits=bits if mode == "affine" else None)
        packed = jq.prepack(qw, layout="cuda_mma")
        for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
            for m in (1, 9, 16):
                x = jax.random.normal(jax.random.key(m), (m, 128), dt)
                y = jq.qmm(x, packed[2], backend="ffi").astype(jnp.float32)
                r = jq.qmm(x, qw[2], backend="reference").astype(jnp.float32)
                err = float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r))
                if not err < 2e-2:
                    print("qmm mismatch", mode, bits, jnp.dtype(dt).name, m, err, flush=True)
                ok &= err < 2e-2
            idx = jnp.asarray([[0, 4, -1], [4, 5, 0], [0, 2, 1], [1, 4, 99]], jnp.int32)
            x = jax.random.normal(jax.random.key(3), (4, 128), dt)
            y = np.asarray(jq.gather_qmm(x, packed, idx, backend="ffi").astype(jnp.float32))
            r = np.asarray(jq.gather_qmm(x, qw, idx, backend="reference").astype(jnp.float32))
            bad = (np.asarray(idx) < 0) | (np.asarray(idx) >= 5)
            ok &= bool(np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad])))
            good = bool(np.allclose(y[~bad], r[~bad], rtol=3e-2, atol=3e-2 * np.abs(r[~bad]).max()))
            if not good:
                print("gather mismatch", mode, bits, jnp.dtype(dt).name, flush=True)
            ok &= good
        print(mode, bits, "ok" if ok else "MISMATCH", flush=True)
    print("ALL OK" if ok else "FAILED")


if __name__ == "__main__":
    main()
