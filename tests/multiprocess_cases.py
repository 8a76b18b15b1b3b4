"""The model on JAX's multi-controller runtime, for tests/test_multiprocess.py.

python -m tests.multiprocess_cases PROCESS_ID NUM_PROCESSES PORT [gpu]
starts one process of NUM_PROCESSES (each with 4 / NUM_PROCESSES CPU devices, so
the global mesh always has 4), joins them with jax.distributed.initialize over
JAX's CPU collectives (gloo), shards a tiny dense and a tiny MoE model over a
tp=2 x ep=2 mesh spanning the processes, greedy-decodes, and prints one JSON line:
per case, the tokens and the last logits (gathered to every process). With
NUM_PROCESSES=1 the same mesh lives in one process, and "unsharded" cases run
on one device for reference. The affine4 case is in the CUDA GPUs' default
kernel layout (cuda_mma, forced: the layout is data), its row-parallel
matrices in the split layout.

With `gpu` (scripts/gpu_two_process.sh): the process's visible GPUs (one each
with CUDA_VISIBLE_DEVICES, or both in one process), NCCL, and a 2 x 1 mesh
over the two GPUs; the affine4 case in the default layout of the GPU."""

import os
import sys

PID, NPROC, PORT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
GPU = sys.argv[4:] == ["gpu"]
if not GPU:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={4 // NPROC}")

import json  # noqa: E402

import jax  # noqa: E402

if not GPU:
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
# float and quantized; dense and experts; a kernel layout (None: the device's default)
CASES = (("dense", "float32", None), ("moe", "mxfp4", None),
         ("dense", "affine4", None if GPU else "cuda_mma"))
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
    mesh = parallel.make_mesh(2, 1) if GPU else parallel.make_mesh(2, 2)
    for name, mode, layout in CASES:
        cfg = models.Config(**CONFIGS[name], dtype="float32")
        p = models.init_params(cfg, jax.random.key(0))
        p = p if mode == "float32" else models.quantize_params(p, mode, layout=layout)
        if name == "dense" and mode != "float32":
            out["layouts"] = sorted({w.layout for w in jax.tree_util.tree_leaves(
                parallel.shard_params(cfg, p, mesh)["layers"],
                is_leaf=lambda a: hasattr(a, "layout")) if hasattr(w, "layout")})
        out[f"{name}/{mode}/sharded"] = run(cfg, p, mesh)
        if NPROC == 1:
            out[f"{name}/{mode}/unsharded"] = run(cfg, p, None)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
