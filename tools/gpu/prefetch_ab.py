"""A/B in one process (VARIANTS=name,name picks some): the decode step with L2 prefetches of the next weights issued
after the q/k/v product (they land while RoPE, the cache write and attention run), and
add_rms_norm on the CUDA norm kernel, against the default step."""
import os, sys, time, statistics
import jax, jax.numpy as jnp, numpy as np
import jaxquant as jq
from jaxquant import demo, models
from jaxquant.models import layers
from jaxquant.ffi import mma
from jaxquant.ffi.kernels import qw_operands

CONFIG = os.environ.get("CONFIG", "llama3-8b")
LAYERS = int(os.environ.get("LAYERS", "16"))
MODE = os.environ.get("MODE", "affine4")
TOKENS = 64
VAR = {}

def leaves(qw):
    d, s, b, gs = qw_operands(qw)
    return [a for a in (d, s, b) if a.size]

def nbytes(a):
    return a.size * a.dtype.itemsize

orig_qkv = layers.qkv_projection
def qkv(cfg, p, h):
    q, k, v = orig_qkv(cfg, p, h)
    ranges = []
    if VAR.get("wo"):
        ranges += [(a, 0, nbytes(a)) for a in leaves(p["wo"])]
    mb = VAR.get("gu_mb", 0)
    if mb:
        gu = leaves(p["w_gate_up"])
        tot = sum(nbytes(a) for a in gu)
        f = min(1.0, mb * 2**20 / tot)
        for a in gu:
            half = nbytes(a) // 2
            ranges += [(a, 0, int(f * half)), (a, half, half + int(f * half))]
    if ranges:
        shp = q.shape
        q = mma.l2_prefetch_call(q.reshape(-1), ranges).reshape(shp)
    return q, k, v
layers.qkv_projection = qkv

orig_arn = jq.add_rms_norm
def arn(*a, **k):
    if VAR.get("norm_ffi"):
        k = dict(k, backend="ffi")
    return orig_arn(*a, **k)
jq.add_rms_norm = arn

def block(t):
    return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, t)

cfg = demo.preset(CONFIG, "bfloat16", LAYERS)
base = block(jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0)))
params = block(models.quantize_params(base, MODE))
del base
lay = params["layers"]
print("layers form:", type(lay).__name__, (list(lay[0].keys()) if isinstance(lay, (tuple, list)) else list(lay.keys())), flush=True)
prompt = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size, jnp.int32)
max_len = 128 + TOKENS
logits, cache, token = block(jax.jit(lambda p, x: models.prefill(cfg, p, x, max_len))(params, prompt))

variants = {
    "default": {},
    "wo.bulk4k": {"wo": 1, "env": "4096,0,528"},
    "wo.line4k": {"wo": 1, "env": "4096,1,528"},
    "wo.line1k": {"wo": 1, "env": "1024,1,1056"},
    "wo.bulk32k": {"wo": 1, "env": "32768,0,1024"},
    "wo+gu16.bulk4k": {"wo": 1, "gu_mb": 16, "env": "4096,0,528"},
    "wo+gu16.line4k": {"wo": 1, "gu_mb": 16, "env": "4096,1,528"},
    "wo+gu32.bulk4k": {"wo": 1, "gu_mb": 32, "env": "4096,0,528"},
    "norm_ffi": {"norm_ffi": 1},
}
only = os.environ.get("VARIANTS")
if only:
    variants = {k: v for k, v in variants.items() if k in only.split(",")}
compiled, outs = {}, {}
for name, v in variants.items():
    VAR.clear(); VAR.update(v)
    t0 = time.time()
    try:
        compiled[name] = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, 128, TOKENS),
                                 donate_argnums=1).lower(params, cache, token).compile()
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:400], flush=True)
        continue
    print(f"compiled {name} in {time.time()-t0:.1f}s", flush=True)
VAR.clear()
fresh = lambda: jax.tree_util.tree_map(lambda c: c.copy(), cache)
times = {k: [] for k in compiled}
for r in range(6):
    for name, f in compiled.items():
        os.environ["JAXQUANT_PREFETCH"] = variants[name].get("env", "")
        c = block(fresh())
        t0 = time.perf_counter()
        out = block(f(params, c, token))
        dt = time.perf_counter() - t0
        if r:
            times[name].append(dt)
        if r == 1:
            outs[name] = np.asarray(out[0] if isinstance(out, tuple) else out)
ref = outs.get("default")
for name, ts in times.items():
    same = "" if ref is None else f" tokens == default: {bool(np.array_equal(outs[name], ref))}"
    print(f"{CONFIG} L={LAYERS} {MODE} {name:10s} {TOKENS/min(ts):8.1f} tok/s (best)  {TOKENS/statistics.median(ts):8.1f} (median){same}", flush=True)
