"""The model on JAX's multi-controller runtime, for tests/test_multiprocess.py.

python -m tests.multiprocess_cases PROCESS_ID NUM_PROCESSES PORT
starts one process of NUM_PROCESSES (each with 4 / NUM_PROCESSES CPU devices, so
the global mesh always has 4), joins them with jax.distributed.initialize over
JAX's CPU collectives (gloo), shards a tiny dense and a tiny MoE model over a
tp=2 x ep=2 mesh spanning the processes, greedy-decodes, and prints one JSON line:
per case, the tokens and the last logits (gathered to every process). With
NUM_PROCESSES=1 the same mesh lives in one process, and "unsharded" cases run
on one device for reference."""

import os
import sys

PID, NPROC, PORT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={4 // NPROC}")

import json  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if NPROC > 1:
    jax.distributed.initialize(f"localhost:{PORT}", num_processes=NPROC, process_id=PID)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxquant import models  # noqa: E402
from jaxquant.demo import PRESETS  # noqa: E402
from jaxquant.models import parallel  # noqa: E402

CONFIGS = {"dense": dict(PRESETS["small-dense"], num_layers=2, vocab_size=512),
           "moe": PRESETS["tiny"]}
CASES = (("dense", "float32"), ("moe", "mxfp4"))  # float and quantized; dense and experts
STEPS = 6


def run(cfg, params, mesh):
    if mesh is not None:
        params = parallel.shard_params(cfg, params, mesh)
    prompt = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7) % cfg.vocab_size
    # mesh=: the MoE runs expert parallel (parallel.expert_parallel_moe) across processes
    logits, cache, token = jax.jit(models.prefill, static_argnums=(0, 3),
                                   static_argnames="mesh")(cfg, params, prompt, 8 + STEPS,
                                                           mesh=mesh)
    if mesh is not None:
        cache = parallel.shard_cache(cfg, cache, mesh)
    tokens, last, _ = jax.jit(models.decode, static_argnums=(0, 5), static_argnames="mesh")(
        cfg, params, cache, token, 8, STEPS, mesh=mesh)
    gather = (lambda a: multihost_utils.process_allgather(a, tiled=True)) if NPROC > 1 else (
        lambda a: a)
    return {"tokens": np.asarray(gather(tokens)).tolist(),
            "logits": np.asarray(gather(last), np.float64).round(5).tolist()}


def main():
    out = {"process_count": jax.process_count(), "devices": jax.device_count()}
    mesh = parallel.make_mesh(2, 2)
    for name, mode in CASES:
        cfg = models.Config(**CONFIGS[name], dtype="float32")
        p = models.init_params(cfg, jax.random.key(0))
        p = p if mode == "float32" else models.quantize_params(p, mode)
        out[f"{name}/{mode}/sharded"] = run(cfg, p, mesh)
        if NPROC == 1:
            out[f"{name}/{mode}/unsharded"] = run(cfg, p, None)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
