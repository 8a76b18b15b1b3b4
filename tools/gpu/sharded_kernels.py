"""Which kernels the partitioned program calls when jaxquant's ops are sharded
over the local GPUs (used by tools/gpu/check_model.sh): per case, the
custom-call targets and collectives in the compiled HLO, and the error
against one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq

n = len(jax.devices())
mesh = Mesh(np.array(jax.devices()), ("x",))
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))


def put_q(qw, spec):
    return jq.QuantizedArray(put(qw.data, spec), put(qw.scales, spec),
                             None if qw.biases is None else put(qw.biases, spec),
                             qw.global_scale, mode=qw.mode, bits=qw.bits,
                             group_size=qw.group_size, dtype=qw.dtype)


def report(name, fn, args, sharded):
    want = jax.jit(fn)(*args)
    got = jax.jit(fn)(*sharded)
    text = jax.jit(fn).lower(*sharded).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    coll = {c: len(re.findall(rf" {c}(?:-start)?\(", text))
            for c in ("all-gather", "all-reduce", "reduce-scatter")}
    want = want.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    print(f"{name:28s} rel. err {err:.2g}  collectives {coll}  kernels {targets}")


key = jax.random.key(0)
x = jax.random.normal(key, (4, 2880), jnp.bfloat16)
# affine with groups of 32: K=2880 has 45 groups of 64, which do not split in two
for mode, group in (("affine", 32), ("mxfp4", 32)):
    # canonical: the layout whose N and K split (a kernel layout splits on leading axes)
    qw = jq.quantize(jax.random.normal(key, (5760, 2880), jnp.bfloat16), mode=mode,
                     group_size=group, layout="canonical")
    report(f"qmm column {mode}", jq.qmm, (x, qw), (put(x, P()), put_q(qw, P("x"))))
    report(f"qmm row {mode}", jq.qmm, (x, qw), (put(x, P(None, "x")), put_q(qw, P(None, "x"))))
    qe = jq.quantize(jax.random.normal(key, (32, 5760, 2880), jnp.bfloat16), mode=mode,
                     group_size=group, layout="canonical")
    idx = jax.random.randint(key, (1, 4), 0, 32)
    report(f"gather_qmm experts {mode}", jq.gather_qmm, (x[:1], qe, idx),
           (put(x[:1], P()), put_q(qe, P("x")), put(idx, P())))
    xr = jax.random.normal(key, (256, 2880), jnp.bfloat16)
    sizes = jnp.full((32,), 8, jnp.int32)
    report(f"ragged_qmm experts {mode}", jq.ragged_qmm, (xr, qe, sizes),
           (put(xr, P()), put_q(qe, P("x")), put(sizes, P())))
