"""8-bit activations for prefill (opt-in): `quantize_rows` and `qmm_a8` (docs/a8.md).

y = qmm_a8(x, w) quantizes every row of x to w's 8-bit code type with its own scale
(per token, computed on the fly), multiplies the codes in XLA's integer / FP8 dot
(cuBLASLt's IMMA / FP8 GEMM on a Hopper GPU, at about twice the bf16 rate) and
scales the product by the row's and the output channel's scale.

These are compositions of XLA ops, not primitives: the kernel is XLA's own GEMM, and a
primitive would only hide the dot from the GEMM rewriter that picks it. jit, vmap and
sharding see plain XLA ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant import formats
from jaxquant.quantize import check_float_dtype, dequantize_reference
from jaxquant.quantized_array import QuantizedArray


@dataclasses.dataclass(frozen=True)
class CodeType:
    """An 8-bit code type of quantize_rows. `rule` says how a row's scale is chosen:
    "amax": scale = max|row| * float32(1 / max_code) (the SmoothQuant / per-token int8
    rule, max|row| / max_code up to that rounding);
    "pow2": scale = the smallest power of two with max|row| <= max_code * scale, so
    dividing by it is exact and only the code's own rounding is left (docs/a8.md: an
    MX-FP4 row converts exactly while its block exponents span at most 14 binades)."""

    dtype: np.dtype
    max_code: float
    rule: str
    accumulator: np.dtype


CODE_TYPES: dict[str, CodeType] = {
    "int8": CodeType(jnp.dtype(jnp.int8), 127.0, "amax", jnp.dtype(jnp.int32)),
    "float8_e4m3fn": CodeType(jnp.dtype(jnp.float8_e4m3fn), 448.0, "pow2",
                              jnp.dtype(jnp.float32)),
}

# The largest K whose int8 products cannot overflow the int32 accumulator (128**2 * K: a
# RowQuantizedArray made by hand may hold -128).
MAX_INT8_K = (2**31 - 1) // 128**2
_TINY = float(np.finfo(np.float32).tiny)  # 2**-126: no scale is ever subnormal


def code_type(dtype, what="dtype") -> CodeType:
    try:
        name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in CODE_TYPES:
        raise ValueError(f"{what} must be one of {sorted(CODE_TYPES)}; got {dtype!r}")
    return CODE_TYPES[name]


@jax.tree_util.register_pytree_node_class
class RowQuantizedArray:
    """codes [..., N, K] (int8 or float8_e4m3fn) and float32 scales [..., N]: row n's
    value is codes[n] * scales[n]. A weight for `qmm_a8` (from `quantize_rows`)."""

    __slots__ = ("codes", "scales")

    def __init__(self, codes, scales):
        self.codes, self.scales = codes, scales

    def tree_flatten(self):
        return (self.codes, self.scales), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self):
        return tuple(self.codes.shape)

    @property
    def ndim(self):
        return len(self.codes.shape)

    def dequantize(self, dtype=jnp.float32):
        return (self.codes.astype(jnp.float32) * self.scales[..., None]).astype(dtype)

    def __repr__(self):
        return f"RowQuantizedArray(shape={self.shape}, codes={self.codes.dtype})"


def _row_scales(amax, ct: CodeType):
    """float32 scales [...] of rows whose largest magnitude is amax (finite, >= 0)."""
    if ct.rule == "amax":
        return jnp.maximum(amax * np.float32(1 / ct.max_code), _TINY)
    # pow2: the smallest e with amax <= max_code * 2**e, from amax's exponent and mantissa
    # bits (no log2: XLA's CPU log2 is not exact at powers of two). With amax = 1.m *
    # 2**exp and max_code = 1.c * 2**(cap_exp - 1) (448 = 1.75 * 2**8): e = exp + 1 -
    # cap_exp when 1.m <= 1.c, one more when its mantissa bits are larger. float32's
    # largest amax gives e = 120: no upper clip is needed.
    bits = lax.bitcast_convert_type(amax, jnp.uint32)
    exp = (bits >> 23).astype(jnp.int32) - 127
    cap_mant, cap_exp = np.frexp(ct.max_code)  # max_code = cap_mant * 2**cap_exp
    cap_bits = int(round((cap_mant * 2 - 1) * 2**23))  # the mantissa bits of 1.c
    e = exp + 1 - int(cap_exp) + ((bits & 0x7FFFFF) > cap_bits).astype(jnp.int32)
    return formats.exp2i(jnp.maximum(e, -126))


def quantize_rows(a, dtype="float8_e4m3fn") -> RowQuantizedArray:
    """Quantize every row (the last axis) of `a` [..., K] to 8-bit codes with one float32
    scale per row. `a`: a float array, or a QuantizedArray (its values, in float32, by
    jq.dequantize's definition). dtype: "float8_e4m3fn" (power-of-two scales, codes
    rounded to nearest even) or "int8" (scale max|row| * float32(1/127), codes
    round(row * float32(1 / scale)), half to even, clipped to +-127). An all-zero row
    gets scale 2**-126 and zero codes; a row holding Inf or NaN gets zero codes and a
    NaN scale, so every product with it is NaN. Rules and limits: docs/a8.md."""
    ct = code_type(dtype)
    if isinstance(a, QuantizedArray):
        a = dequantize_reference(a, jnp.float32)
    elif isinstance(a, RowQuantizedArray):
        raise TypeError("a is already a RowQuantizedArray")
    else:
        a = jnp.asarray(a)
        check_float_dtype("a", a.dtype)
        if a.ndim < 1:
            raise ValueError(f"a must have at least one dimension; got shape {a.shape}")
    return _rows(a.astype(jnp.float32), ct)


def _rows(a, ct: CodeType) -> RowQuantizedArray:
    """quantize_rows of float32 a, its arguments checked."""
    finite = jnp.all(jnp.isfinite(a), axis=-1, keepdims=True)
    amax = jnp.max(jnp.where(finite, jnp.abs(a), 0.0), axis=-1, keepdims=True,
                   initial=0.0)
    scales = _row_scales(amax, ct)
    if ct.rule == "amax":
        # Products with float32 reciprocals, written out (1/127 above, 1/scale here): XLA
        # turns a division by a constant or a broadcast into such a product in some
        # compiles and not others, and the two differ at rounding ties. A GPU's float32
        # reciprocal is not correctly rounded: there a code at a tie may be one off.
        scaled = jnp.where(finite, a * (1 / scales), 0.0)
        codes = jnp.clip(jnp.round(scaled), -ct.max_code, ct.max_code).astype(ct.dtype)
    else:
        codes = jnp.where(finite, a / scales, 0.0).astype(ct.dtype)  # pow2: exact division
    scales = jnp.where(finite, scales, jnp.nan)[..., 0]
    return RowQuantizedArray(codes, scales)


def _check(x, w):
    if not isinstance(w, RowQuantizedArray):
        hint = (" (jq.quantize_rows(qw) makes one from a QuantizedArray)"
                if isinstance(w, QuantizedArray) else "")
        raise TypeError(f"w must be a jaxquant RowQuantizedArray from jq.quantize_rows; "
                        f"got {type(w).__name__}{hint}")
    ct = code_type(getattr(w.codes, "dtype", None), "w.codes's dtype")
    if getattr(w.scales, "dtype", None) != jnp.float32:
        raise TypeError(f"w.scales must be a float32 array; got "
                        f"{getattr(w.scales, 'dtype', type(w.scales).__name__)}")
    if w.ndim != 2 or w.scales.shape != w.shape[:1]:
        raise ValueError(f"w must be 2-D codes [N, K] with scales [N]; got codes "
                         f"{w.shape} and scales {tuple(w.scales.shape)}")
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    check_float_dtype("x", x.dtype)
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x must be [..., K] with K = {w.shape[1]} (w's columns); got "
                         f"shape {tuple(x.shape)}")
    if ct.rule == "amax" and w.shape[1] > MAX_INT8_K:
        raise ValueError(f"x's K = {w.shape[1]} > {MAX_INT8_K}: int8 products could "
                         "overflow the int32 accumulator")
    return x, ct


# K padded with zero codes to a multiple of this before the GEMM: cuBLASLt's int8 and FP8
# GEMMs take K % 16 == 0, and XLA's GPU int8 dot returned twice the product at K = 50
# (jax 0.11.2, H100, M > 1; K = 16, 64, 217, 278, 4096 were right). Real models' K are
# multiples of 16 already: no copy there.
K_MULTIPLE = 16


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def qmm_a8(x, w: RowQuantizedArray, precision=None):
    """x [..., K] @ w.T with x quantized per row (token) to w's code type, in x's dtype:

        y = out(float32(qx @ w.codes.T) * (sx[..., None] * w.scales))

    where (qx, sx) = quantize_rows(x, w's code type), the product accumulates exactly in
    int32 (int8) or in float32 (float8_e4m3fn: products exact, the sum in the GEMM's
    order), the two scales multiply first (so only a result beyond float32's range
    overflows), and out() rounds once to x's dtype. precision: the dot's
    (lax.Precision): on a Hopper GPU the default lets cuBLAS's FP8 GEMM accumulate in the
    tensor cores' fast mode and lax.Precision.HIGHEST adds into float32 every few
    k-blocks (docs/a8.md has the errors and the cost). Not differentiable."""
    x, ct = _check(x, w)
    qx = _rows(x.astype(jnp.float32), ct)
    scales = qx.scales[..., None] * w.scales
    codes, x_codes = w.codes, qx.codes
    pad = -x.shape[-1] % K_MULTIPLE
    if pad:
        codes = jnp.pad(codes, ((0, 0), (0, pad)))
        x_codes = jnp.pad(x_codes, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if ct.rule == "pow2" and x.dtype == jnp.bfloat16:
        # quantize_rows's power-of-two scales commute with rounding, so the GEMM may round
        # its float32 sum to bfloat16 itself: the same value (docs/a8.md), and no float32
        # [M, N] pass (cuBLAS's FP8 GEMM into float32 took 79 us at M = 64 against 37
        # into bf16). A RowQuantizedArray made by hand with other scales rounds twice.
        acc = lax.dot_general(x_codes, codes, dims, precision,
                              preferred_element_type=jnp.bfloat16)
        return acc * scales.astype(jnp.bfloat16)
    acc = lax.dot_general(x_codes, codes, dims, precision, preferred_element_type=ct.accumulator)
    return (acc.astype(jnp.float32) * scales).astype(x.dtype)


@qmm_a8.defjvp
def _qmm_a8_jvp(precision, primals, tangents):
    raise TypeError("jq.qmm_a8 is not differentiable: rounding x to 8-bit codes has no "
                    "useful derivative (use jq.qmm for training)")
