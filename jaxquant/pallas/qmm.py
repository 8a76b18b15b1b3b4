"""Pallas (Triton lowering) qmm: y = x @ dequantize(qw).T (or x @ W).

The front of the kernel families: `lower_qmm` is what the dispatcher runs (the
arguments as jq.qmm validated them, a case `supports` accepted, the platform it
lowers for); `qmm` is the same for direct use, with its own argument checks.
The kernels: `jaxquant.pallas.gemv` (M <= configs.PALLAS_GEMV_MAX_M) and `jaxquant.pallas.gemm`;
which one and its block sizes: `jaxquant.pallas.configs.select`. None writes the
dequantized weight to memory; all accumulate in float32.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxquant.pallas import codecs, configs
from jaxquant.pallas.common import X_DTYPES, dot_precision
from jaxquant.pallas.gemm import gemm_n, gemm_t
from jaxquant.pallas.gemv import gemv_n, gemv_t
from jaxquant.quantized_array import CANONICAL, QuantizedArray


def supports(x, qw, *, transpose=True, **params) -> bool:
    """Whether `qmm` has a kernel for these arguments (x: anything with a shape and
    dtype, e.g. a ShapedArray; the op's params, `platform` included, are ignored)."""
    try:
        if jnp.dtype(x.dtype) not in X_DTYPES:
            return False
        if qw.layout != CANONICAL:
            return False
        if len(qw.shape) != 2 or len(x.shape) < 1:
            return False
        k = qw.shape[1] if transpose else qw.shape[0]
        if x.shape[-1] != k:
            return False
        codecs.geometry(qw.bits, qw.group_size)
        if qw.data.dtype != jnp.uint32:
            return False
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False
    return True


def lower_qmm(x, qw: QuantizedArray, *, transpose: bool, precision, platform: str,
              interpret: bool = False, config: configs.KernelConfig | None = None):
    """The kernel for a case `supports` accepted (no argument checks). `platform`
    ("cuda" | "rocm") picks the block-config table; interpret=True runs the kernels
    in interpret mode with the "interpret" table; `config` overrides the table."""
    k, n = qw.shape[::-1] if transpose else qw.shape
    lead = x.shape[:-1]
    m = math.prod(lead)
    if m == 0 or n == 0 or k == 0:
        return jnp.zeros((*lead, n), x.dtype)
    platform = "interpret" if interpret else platform
    if config is None:
        config = configs.select(platform, transpose, m, n, k, qw.bits, qw.group_size, x.dtype)
    if transpose:
        fn = gemv_t if config.kernel == "gemv" else gemm_t
    else:
        fn = gemv_n if config.kernel == "gemv" else gemm_n
    y = fn(x.reshape(m, k), qw, config, interpret=interpret, hw=not interpret,
           precision=dot_precision(precision, x.dtype))
    return y.reshape(*lead, n)


def qmm(x, qw: QuantizedArray, *, transpose: bool = True, precision=None,
        platform: str = "cuda", interpret: bool = False,
        config: configs.KernelConfig | None = None):
    """y = x @ dequantize(qw).T (transpose=True; qw logical [N, K]) or
    y = x @ dequantize(qw) (transpose=False; qw logical [K, N], groups along N).

    x: [..., K] float32/float16/bfloat16 -> [..., N] in x.dtype, float32
    accumulation. Direct use (the ops go through `lower_qmm`); see `lower_qmm` for
    platform, interpret and config.
    """
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    x = jnp.asarray(x)
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16 for the pallas qmm; got {x.dtype}")
    if qw.layout != CANONICAL:
        raise ValueError(f"the pallas qmm takes the canonical layout; got layout={qw.layout!r}")
    if len(qw.shape) != 2:
        raise ValueError(f"qw must be 2-D for qmm; got shape {qw.shape}")
    k = qw.shape[1] if transpose else qw.shape[0]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x's last axis must be K={k} (qw shape {qw.shape}, "
                         f"transpose={transpose}); got x shape {x.shape}")
    return lower_qmm(x, qw, transpose=transpose, precision=precision, platform=platform,
                     interpret=interpret, config=config)
