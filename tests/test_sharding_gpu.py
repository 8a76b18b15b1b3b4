"""Tensor and expert parallel on two real GPUs in the GPU's default kernel layout
(cuda_mma on NVIDIA with jaxquant's CUDA library): the sharded model decodes the
logits of one device, its compiled decode step all-gathers no weight (packed
uint32 data or uint8 scales), and two processes of one GPU each (NCCL,
jax.distributed) decode the tokens of one process with both GPUs
(tests/multiprocess_cases.py). The same cases run on CPU fake devices in CI
(tests/test_sharding.py, tests/test_multiprocess.py). Skips with fewer than two
GPUs. Run: pytest -q tests/test_sharding_gpu.py (or tools/gpu/scaleout.sh)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxquant import models
from jaxquant.models import parallel
from jaxquant.quantized_array import QuantizedArray


def _gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs on one host")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DENSE = models.Config(family="llama", vocab_size=512, hidden_size=512, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1024,
                      dtype="bfloat16")
MOE = models.Config(family="gpt_oss", vocab_size=512, hidden_size=512, num_layers=2,
                    num_heads=8, num_kv_heads=4, head_dim=64, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=512, attention_bias=True,
                    layer_windows=(8, 0), dtype="bfloat16")


def _weight_gathers(text):
    return [g for g in re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
            if g.startswith(("u32", "u8", "(u32", "(u8"))]


@pytest.mark.parametrize("cfg,mode,tp,ep", [(DENSE, "affine4", 2, 1),
                                            (DENSE, "mxfp4", 2, 1),
                                            (MOE, "mxfp4", 1, 2), (MOE, "mxfp4", 2, 1)],
                         ids=["dense-affine4-2x1", "dense-mxfp4-2x1", "moe-1x2", "moe-2x1"])
def test_sharded_default_layout_decodes_like_one_gpu(cfg, mode, tp, ep):
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), mode)
    layouts = {w.layout for w in jax.tree_util.tree_leaves(
        params, is_leaf=lambda a: isinstance(a, QuantizedArray)) if isinstance(w, QuantizedArray)}
    mesh = parallel.make_mesh(tp, ep)
    prompt = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    pre = jax.jit(lambda p, t, m: models.prefill(cfg, p, t, 16, mesh=m), static_argnums=2)
    # decode the one-device tokens on both (bf16 partial sums round in another order,
    # so a near tie could flip a free-running greedy token): compare the logits
    dec = jax.jit(lambda p, c, t, m: models.forward(cfg, p, t, pos, c, mesh=m)[0],
                  static_argnums=3)
    logits, cache, tok = pre(params, prompt, None)
    steps = jnp.concatenate([tok[:, None], prompt[:, :5]], axis=1)  # 6 fixed tokens
    pos = jnp.broadcast_to(jnp.arange(8, 14, dtype=jnp.int32), steps.shape)
    want = dec(params, cache, steps, None)
    sharded = parallel.shard_params(cfg, params, mesh)
    logits_g, cache_g, _ = pre(sharded, prompt, mesh)
    cache_g = parallel.shard_cache(cfg, cache_g, mesh)
    compiled = dec.lower(sharded, cache_g, steps, mesh).compile()
    got = compiled(sharded, cache_g, steps)
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    for a, b in ((logits_g, logits), (got, want)):
        d = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        assert d <= 3e-2 * scale, (layouts, d, scale)
    assert _weight_gathers(compiled.as_text()) == [], layouts


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return str(s.getsockname()[1])


def _run(nproc, devices):
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_cases", str(i),
                               str(nproc), port, "gpu"], cwd=ROOT, text=True,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=devices[i]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(nproc)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def test_two_processes_one_gpu_each_decode_like_one_process():
    (one,) = _run(1, ["0,1"])
    two = _run(2, ["0", "1"])
    assert one["devices"] == 2 and all(o["devices"] == 2 and o["process_count"] == 2
                                       for o in two)
    for case in (k for k in one if k.endswith("/sharded")):
        assert two[0][case]["tokens"] == two[1][case]["tokens"] == one[case]["tokens"], case
        assert one[case]["tokens"] == one[case.replace("/sharded", "/unsharded")]["tokens"], case
