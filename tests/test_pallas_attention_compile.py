"""ROCm (and CUDA) compile checks of the Pallas decode-attention kernels on a CPU-only
machine, as tests/test_pallas_compile.py does for the others: lowered with
`lowering_platforms=("rocm",)` (resp. "cuda"), the Triton modules compiled with the
pip `triton` package for every ROCm target (resp. sm_90); a code object must come out.
"""

import os

import jax
import jax.numpy as jnp
import pytest

import jaxquant as jq
from jaxquant.pallas import attention as pa
from tests import pallas_compile as cc

triton = pytest.importorskip(
    "triton", reason="the ROCm/CUDA compile checks need the pip `triton` package "
                     "(pip install triton)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
pytestmark = pytest.mark.toolchain

S = jax.ShapeDtypeStruct
BF16, F32, F16 = jnp.bfloat16, jnp.float32, jnp.float16

# name -> (b, t, hq, hkv, s, hd, dtype, sinks): one split (a single kernel) or several
# (the attention kernel writing partials, then the combine kernel).
CASES = {
    "llama_b1_s8192_split": (1, 1, 32, 8, 8192, 128, BF16, False),
    "llama_b8_s256_onepass": (8, 1, 32, 8, 256, 128, BF16, False),
    "gptoss_sinks_split": (1, 1, 64, 8, 2048, 64, BF16, True),
    "gptoss_sinks_onepass_t4": (8, 4, 64, 8, 200, 64, BF16, True),
    "f32_odd_head_dim": (2, 2, 12, 4, 1000, 80, F32, True),
    "f16_mqa": (1, 1, 8, 1, 4096, 128, F16, False),
}


def _args(case):
    b, t, hq, hkv, s, hd, dt, sinks = CASES[case]
    return (S((b, t, hq, hd), dt), S((b, s, hkv, hd), dt), S((b, s, hkv, hd), dt),
            S((b, t), jnp.int32), S((), jnp.int32), S((hq,), F32) if sinks else None)


def _kernels(case, platform):
    b, t, hq, hkv, s, hd, _, _ = CASES[case]
    p = pa.plan(platform, b, t, hq, hkv, s, hd)
    fn = lambda q, k, v, pos, w, sk: pa.decode_attention(q, k, v, pos, window=w, sinks=sk,
                                                         platform=platform)
    kernels = cc.triton_kernels(fn, *_args(case), platform=platform)
    # jaxlib 0.10.2 lists every kernel; newer ones capture the first
    assert len(kernels) in ((1,) if p.splits == 1 else (1, 2)), (case, len(kernels))
    return kernels


def test_cases_cover_one_pass_and_splits():
    splits = {pa.plan(pl, *CASES[c][:6]).splits > 1 for c in CASES for pl in ("cuda", "rocm")}
    assert splits == {True, False}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rocm_decode_attention(case):
    cc.compile_all(_kernels(case, "rocm"), list(cc.ROCM_TARGETS))


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_decode_attention(case):
    cc.compile_all(_kernels(case, "cuda"), [cc.CUDA_TARGETS[0]])


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_stacked_cache_with_a_layer_index(platform):
    # every layer's cache [L, B, S, Hkv, hd] and a traced layer, through the op
    q, k, v, pos, w, sk = _args("gptoss_sinks_split")
    stack = S((24,) + k.shape, k.dtype)
    fn = lambda q, k, v, p, w, sk, i: jq.decode_attention(q, k, v, p, window=w, sinks=sk,
                                                          layer=i)
    kernels = cc.triton_kernels(fn, q, stack, stack, pos, w, sk, S((), jnp.int32),
                                platform=platform)
    targets = [("hip", "gfx942", 64)] if platform == "rocm" else [cc.CUDA_TARGETS[0]]
    cc.compile_all(kernels, targets)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_op_dispatches_to_pallas_on_gpus(platform):
    """jq.decode_attention under automatic choice lowers to the kernel on GPUs (a
    traced window, as in a model's layer scan)."""
    fn = lambda q, k, v, pos, w, sk: jq.decode_attention(q, k, v, pos, window=w, sinks=sk)
    kernels = cc.triton_kernels(fn, *_args("gptoss_sinks_split"), platform=platform)
    assert kernels and "tt.func" in kernels[0].text()
    assert not cc.triton_kernels(
        lambda *a: jq.decode_attention(*a[:4], window=a[4], backend="reference"),
        *_args("gptoss_sinks_split")[:5], platform=platform)
