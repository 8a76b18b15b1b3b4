"""Variants of the decode step timed in turns in one process (each compiled once, then
run round after round, so that the GPU's drift between processes does not enter the
comparison), their first outputs compared with the first variant's.

  AB=residuals CONFIG=llama3-8b LAYERS=32 MODES=affine4,mxfp4 python tools/gpu/decode_step_ab.py
      a dense layer's residual adds in its products (decoder.fuses_residuals: jq.qmm_add,
      jq.rms_norm_qmm_swiglu; the default where they apply) against add_rms_norm and the
      layer's add as kernels of their own (benchmarks/h200/decode.json
      `decode_step.fused_residuals.*`; docs/decode.md, "What the step's structure costs")
  AB=qkv_norm CONFIG=llama3-8b LAYERS=32 MODES=affine4,mxfp4 python tools/gpu/decode_step_ab.py
      the attention's norm in the q/k/v product (jq.rms_norm_qmm's kernel, backend="ffi")
      against the default: the norm apart (XLA's fusions), then the plain GEMV
      (benchmarks/h200/decode.json `decode_step.qkv_norm.*`)
  AB=mlp_norm CONFIG=llama3-8b LAYERS=32 MODES=affine4 python tools/gpu/decode_step_ab.py
      with the residuals in the products, the MLP's norm before the SwiGLU product on each
      backend: the default (XLA's fusions), the CUDA kernel and Pallas
  AB=norm CONFIG=llama3-8b LAYERS=32 MODES=affine4 python tools/gpu/decode_step_ab.py
      the MLP's add_rms_norm on each backend: the default (XLA's fusions of the reference
      at one row on a GPU), the CUDA kernel (backend="ffi") and Pallas
      (benchmarks/h100/decode.json `decode_step.add_rms_norm_backend.*`)
"""
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant import demo, models
from jaxquant.models import decoder

AB = os.environ.get("AB", "residuals")
CONFIG = os.environ.get("CONFIG", "llama3-8b")
LAYERS = int(os.environ.get("LAYERS", "32"))
MODES = os.environ.get("MODES", "affine4,mxfp4").split(",")
PROMPT, TOKENS, ROUNDS = 128, 64, 5


def residual_variants():
    automatic = decoder.fuses_residuals  # read by decoder.layer while a variant traces

    def use(rule):
        decoder.fuses_residuals = rule
    return {"unfused": lambda: use(lambda cfg, p: False), "fused": lambda: use(automatic)}


def backend_variants(op, backends):
    """jq.<op> with each (name, backend) forced (None: the automatic choice); the models
    call jq.<op> while a variant traces."""
    automatic = getattr(jq, op)

    def use(backend):
        setattr(jq, op, automatic if backend is None else
                lambda *a, **kw: automatic(*a, **dict(kw, backend=backend)))
    return {name: (lambda b=b: use(b)) for name, b in backends}


def norm_variants():
    return backend_variants("add_rms_norm", (("default", None), ("ffi", "ffi"),
                                             ("pallas", "pallas")))


def qkv_norm_variants():  # layers.norm_linear calls jq.rms_norm_qmm
    return backend_variants("rms_norm_qmm", (("fused", "ffi"), ("apart", None)))


def mlp_norm_variants():
    automatic = jq.rms_norm_qmm_swiglu  # layers.norm_swiglu_linear calls it

    def use(backend):
        def apart(x, norm_weight, qw, *, eps, activation, limit=None, **kw):
            h = jq.rms_norm(x, norm_weight, eps=eps, backend=backend)
            return jq.qmm_swiglu(h, qw, activation=activation, limit=limit)
        jq.rms_norm_qmm_swiglu = automatic if backend == "default" else apart
    return {b: (lambda b=b: use(b)) for b in ("default", "ffi", "pallas")}


variants = {"residuals": residual_variants, "norm": norm_variants,
            "qkv_norm": qkv_norm_variants, "mlp_norm": mlp_norm_variants}[AB]()
cfg = demo.preset(CONFIG, "bfloat16", LAYERS)
base = jax.block_until_ready(jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0)))
prompt = jax.random.randint(jax.random.key(1), (1, PROMPT), 0, cfg.vocab_size, jnp.int32)
for mode in MODES:
    params = base if mode == "bf16" else jax.block_until_ready(models.quantize_params(base, mode))
    _, cache, token = jax.block_until_ready(jax.jit(
        lambda p, x: models.prefill(cfg, p, x, PROMPT + TOKENS))(params, prompt))
    compiled = {}
    for name, setup in variants.items():
        setup()
        compiled[name] = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, PROMPT, TOKENS),
                                 donate_argnums=1).lower(params, cache, token).compile()
    next(iter(variants.values()))()  # the first variant's setting back
    times, first = {k: [] for k in compiled}, {}
    for r in range(ROUNDS + 1):  # round 0 warms up
        for name, f in compiled.items():
            c = jax.block_until_ready(jax.tree_util.tree_map(lambda a: a.copy(), cache))
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(params, c, token))
            if r:
                times[name].append(time.perf_counter() - t0)
            else:
                first[name] = np.asarray(jax.tree_util.tree_leaves(out)[0])
    ref = next(iter(first))
    for name, ts in times.items():
        same = np.array_equal(first[name], first[ref])
        print(f"{CONFIG} L={LAYERS} {mode} {AB} {name:8s} {TOKENS / min(ts):8.1f} tok/s "
              f"(best of {ROUNDS}) {TOKENS / statistics.median(ts):8.1f} (median); first "
              f"output equal to {ref}'s: {same}")
