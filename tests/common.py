"""Helpers shared by the op tests of every backend: the modes and dtypes swept,
random inputs, and the elementwise error bound of a matmul against the float64
oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import jaxquant as jq
from jaxquant import formats
from tests import oracle

MODES = [("affine", 2), ("affine", 3), ("affine", 4), ("affine", 5), ("affine", 6),
         ("affine", 8), ("mxfp4", 4), ("mxfp6_e2m3", 6), ("mxfp6_e3m2", 6), ("mxfp8_e4m3", 8),
         ("mxfp8_e5m2", 8), ("nvfp4", 4), ("fp4", 4), ("iq4nl", 4)]
# The modes the GPU libraries' kernels and the cuda_mma layout decode: all but the
# codebook ones, which the ffi backend refuses on a GPU and the layout refuses everywhere
# (tests/test_ffi.py and tests/test_decode_layout.py check the refusals; the Pallas
# kernels serve them on a GPU, the CPU library on the CPU).
GPU_NATIVE_MODES = [(m, b) for m, b in MODES
                    if formats.FORMATS[m].element not in formats.CODEBOOKS]
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
EPS = {jnp.dtype(jnp.float32): 2.0**-24, jnp.dtype(jnp.float16): 2.0**-11,
       jnp.dtype(jnp.bfloat16): 2.0**-8}


# The x86-64 CPU flags each ISA's CPU kernels need (cpu_src/cpu_ffi.cc, select_kernels).
CPU_ISA_FLAGS = {"avx512": ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx2",
                            "fma", "f16c"], "avx2": ["avx2", "fma", "f16c"], "baseline": []}


def cpu_flags() -> list[str]:
    """This CPU's flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def gpus():
    """The CUDA/ROCm devices JAX sees."""
    try:
        return [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm")]
    except RuntimeError:
        return []


def skip_module_without_gpu(what: str):
    """Skip the calling test module, saying why, where JAX sees no GPU."""
    if not gpus():
        pytest.skip(f"no CUDA/ROCm GPU visible to JAX: {what}", allow_module_level=True)


def cuda_library() -> bool:
    """Whether JAX's default backend is an NVIDIA GPU and jaxquant's CUDA library is loaded
    (the tests of the native CUDA kernels need both)."""
    try:
        import jaxquant.ffi as jf
        return jax.default_backend() in ("gpu", "cuda") and "cuda" in jf.loaded_platforms()
    except Exception:  # noqa: BLE001 - no GPU, no library
        return False


def skip_without_gpu(what: str):
    """A skip mark for the GPU tests of a module that also holds CPU tests: each test
    marked `@pytest.mark.gpu` and with this mark skips, saying why, where JAX sees no GPU
    (the module's CPU tests still run)."""
    return pytest.mark.skipif(not gpus(), reason=f"no CUDA/ROCm GPU visible to JAX: {what}")


def rand(key, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def quantize_for(mode, bits, w, group_size=None):
    """jq.quantize in the canonical layout on every device: the kernels these tests
    check read it (jq.quantize's default on a GPU is the kernel layout, which would
    send an explicitly named canonical-layout backend to the reference); tests of a
    kernel layout prepack the result."""
    return jq.quantize(w, mode=mode, bits=bits if mode == "affine" else None,
                       group_size=group_size, layout="canonical")


def deq64(qw):
    """The oracle's float64 values of a QuantizedArray."""
    arr = lambda a: None if a is None else np.asarray(a)
    return oracle.dequantize(qw.mode, qw.bits, qw.group_size, arr(qw.data), arr(qw.scales),
                             arr(qw.biases), arr(qw.global_scale))


@functools.cache
def xla_rounds_affine_once() -> bool:
    """Whether XLA in this process compiles the reference's affine dequantize, float32
    `q * scale + bias`, with one rounding (an FMA, as XLA:CPU and XLA:GPU do at their
    default optimization levels and as jaxquant's kernels always do). The test suite
    compiles XLA:CPU without LLVM optimization (tests/conftest.py), which rounds twice:
    there the reference, which is XLA's arithmetic, differs from the kernels by one
    rounding of the product, and the tests that pin the kernels to the reference bit
    for bit pin them to the float64 oracle's one rounding instead."""
    qw = jq.quantize(rand(0, (16, 256)), mode="affine", bits=4, group_size=32)
    got = np.asarray(jq.dequantize(qw, jnp.float32, backend="reference"))
    return bool(np.array_equal(got, deq64(qw).astype(np.float32)))


def assert_matmul_close(y, x, w64, dtype, transpose=True):
    """y (any dtype) vs float64 x @ w.T (x @ w for transpose=False), bounded per
    element: the weights rounded to x's dtype at worst, float32 accumulation
    over K, one rounding of the output."""
    x64 = np.asarray(x, np.float64)
    w64 = w64 if transpose else np.swapaxes(w64, -1, -2)
    want = x64 @ np.swapaxes(w64, -1, -2)
    mag = np.abs(x64) @ np.swapaxes(np.abs(w64), -1, -2)
    eps = EPS[jnp.dtype(dtype)]
    k = x64.shape[-1]
    bound = (2 * eps + k * 2.0**-24) * mag + eps * np.abs(want) + 1e-30
    got = np.asarray(y, np.float64)
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), np.nanmax(np.abs(got - want) / bound)


def rms64(x, w=None, eps=1e-6, off=0.0, group=None):
    """The float64 RMSNorm of docs/ops.md (per group of `group` along the last axis)."""
    x = np.asarray(x, np.float64)
    xs = x.reshape(*x.shape[:-1], -1, group) if group else x
    y = (xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps)).reshape(x.shape)
    return y if w is None else y * (np.asarray(w, np.float64) + off)


def act64(g, name):
    g = np.asarray(g, np.float64)
    s = 1 / (1 + np.exp(-g))
    return g * s if name == "silu" else s


def scaled_normals(n, max_log2):
    """A hypothesis strategy: n float32 standard normals (from a drawn seed) times 2**s,
    s drawn from [-max_log2, max_log2]."""
    return st.builds(
        lambda seed, s: (np.random.default_rng(seed).standard_normal(n) * 2.0 ** s).astype(
            np.float32),
        st.integers(0, 2 ** 32 - 1), st.floats(-max_log2, max_log2))
