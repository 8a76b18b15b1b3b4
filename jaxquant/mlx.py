"""MLX-compatible quantization API: ``jq.mlx`` (docs/formats.md, "MLX").

Functions here take MLX's signatures and return MLX's tuples, so code written
against ``mlx.core`` ports by changing the import::

    w_q, scales, biases = jq.mlx.quantize(w, group_size=64, bits=4)
    w_q, scales = jq.mlx.quantize(w, mode="mxfp4")
    w2 = jq.mlx.dequantize(w_q, scales, biases, group_size=64, bits=4)

The arrays are bit-compatible with MLX's: ``w_q`` is MLX's uint32 packing (a
little-endian bit stream along K, docs/formats.md), scales are MLX's (the input
dtype for affine, uint8 E8M0 for mxfp4/mxfp8, uint8 E4M3 for nvfp4), so arrays
move between MLX and JAX unchanged (``np.array(mlx_array)``; for bfloat16 MLX
arrays use ``np.array(a.view(mx.uint16)).view(ml_dtypes.bfloat16)``, which
`from_mlx` does for you when handed an ``mlx.core.array``).

Checked bit for bit against MLX 0.32.4 (CPU) in tests/test_mlx.py. What MLX
does, and therefore what these functions do:

- Defaults per mode (MLX's table): affine group 64 / 4 bits, mxfp4 32 / 4,
  mxfp8 32 / 8, nvfp4 16 / 4. ``"mxfp8"`` is E4M3 (jaxquant's
  ``"mxfp8_e4m3"``).
- affine: ``jq.quantize``'s rule (docs/formats.md), which is MLX's CPU rule.
- mxfp4 / mxfp8: the shared exponent is the smallest one with no saturation
  (``scale_rule="rceil"``; MLX 0.32 no longer uses ``round(log2(amax/max))``),
  and an all-zero block gets scale 2**0 (code 127; OCP's floor rule gives 0).
  For float16 / bfloat16 w that rule applies to ``amax / max`` rounded to w's
  dtype, as MLX divides (a float16 quotient can round down to a power of two,
  or to 0: then 2**0 too). E4M3 elements round to nearest, ties to even.
- E2M1 elements (mxfp4, nvfp4) round to nearest with ties toward zero
  (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3, 5 -> 4; ``jq.quantize`` rounds ties
  to even), and a value that rounds to zero is written as +0
  (code 0), never -0 (code 8). mxfp8 keeps the sign of zero (code 0x80).
- nvfp4 without ``global_scale``: block scale ``e4m3(amax / 6)``, elements
  ``e2m1(w / scale)``; there is no tensor scale (unlike ``jq.quantize``, which
  always computes one). With ``global_scale=g`` (MLX's convention: ``g`` is
  the tensor's absolute maximum, or any float32 > 0), block scale
  ``e4m3(amax / 6 * (2688 / g))`` and the dequantization multiplier is
  ``g / 2688`` (2688 = 6 * 448). The returned QuantizedArray stores that
  multiplier as its ``global_scale`` (jaxquant's convention, docs/formats.md).
  ``to_mlx`` turns a multiplier back into a g; a float32 multiplier that no
  g / 2688 gives (the quotients step over some: 9 of 600 random tensors'
  ``jq.quantize`` multipliers) becomes the nearest, and MLX's dequantize of it
  then differs from jaxquant's by up to one float32 ulp.

Dequantization is ``jq.dequantize`` (the op; docs/formats.md defines its values).
It equals MLX's bit for bit for mxfp4, mxfp8 and nvfp4 without a global scale
(every value is an exact product). Known, documented differences, each pinned
by a test against real MLX:

- affine: MLX's CPU path computes ``T(T(scale * q) + bias)`` in the scales'
  dtype ``T`` (two roundings: the product is stored before the sum); jaxquant
  computes ``scale * q + bias`` in float32 rounded once (a fused multiply-add)
  and casts to the output dtype. Measured against MLX 0.32.4 (random matrices,
  bits 2-8, groups 32-128, float32/float16/bfloat16): they differ by at most 1 ulp
  of max(|scale * q|, |output|) in ``T``, at about half the elements (47%; up to
  67% of a matrix). Where the bias dominates that is up to 64 ulps of the product
  alone, and where product and bias nearly cancel, many ulps of the small output
  (up to 127 in bfloat16, 512 in float16). At a group's zero point MLX
  gives exactly 0.0 where jaxquant gives the exact value of the stored scale
  and bias, a residual such as 6e-8. Kept on purpose: one rounding is the more
  accurate value, it is what MLX's own Metal kernel writes (``q * scale + bias``,
  contracted), and copying the CPU rule would take jq.mlx off the op and its
  kernels; in bfloat16 it also costs: 27.7 ms against 11.5 ms for a 4096x4096
  dequantize on a 2-core CPU (float32: no measurable difference).
- nvfp4 with a global scale: MLX computes ``e2m1 * (e4m3 * (g / 2688))``,
  jaxquant ``(e2m1 * e4m3) * (g / 2688)`` (within one float32 ulp). MLX's CPU
  path returns float32 whatever ``dtype`` is asked there (its float32 global
  scale promotes the product); jaxquant returns the asked dtype, as MLX does
  without a global scale.
- Inputs MLX mishandles are not copied: non-finite blocks (jaxquant: scale
  0xFF = NaN, per OCP), blocks whose absolute maximum is a float32 subnormal,
  E8M0 255 (MLX decodes it as +inf, jaxquant as NaN), and MLX's 1-bit affine
  mode (not a jaxquant format).
- nvfp4 with a global scale and float16/bfloat16 input: the block scales are
  MLX's, but MLX's half-precision element quotient is not reproduced: elements
  next to rounding ties land on the neighbouring code. Measured against MLX 0.32.4
  on 20 random 256x1024 matrices: bfloat16 0.22% of codes on average, up to
  0.49% of a matrix; float16 0.03%, up to 0.06%; float32 none.

Errors: where MLX raises ``ValueError`` (every error case of MLX's own
quantization tests), so does jq.mlx. A wrong dtype (integer ``w`` or scales,
an integer output ``dtype``, float indices) raises `DtypeError`, which is both
a ``ValueError`` (MLX) and a ``TypeError`` (jaxquant's own API). Not copied:
MLX's ``ValueError`` for a gradient with respect to MX scales (``jax.grad``
raises JAX's own ``TypeError`` for uint8 inputs before jq.mlx runs), and MLX's
leniency for integer ``x`` or for biases of another float dtype than the
scales (refused here).

Modes MLX lacks (``mxfp6_e2m3``, ``mxfp6_e3m2``, ``mxfp8_e5m2``, ``fp4``) are
accepted too, with jaxquant's own rules and defaults; they have no MLX twin.

Everything here is jittable and works on tracers; ``stream=`` is accepted for
signature compatibility and ignored (JAX places the computation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import dispatch, formats
from jaxquant import ops as jq_ops
from jaxquant.layouts import unpack_layout
from jaxquant.ops import dequantize as _jq_dequantize
from jaxquant.quantize import check_float_dtype, ldexp
from jaxquant.quantize import quantize as _jq_quantize
from jaxquant.quantized_array import CANONICAL, QuantizedArray

__all__ = ["MLX_MODES", "NVFP4_GLOBAL_SCALE_FACTOR", "DtypeError", "dequantize", "from_mlx",
           "gather_qmm", "quantize", "quantized_matmul", "to_mlx"]

#: The modes MLX itself implements (its names).
MLX_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")

#: MLX's nvfp4 ``global_scale`` g encodes with 2688 / g and decodes with g / 2688.
NVFP4_GLOBAL_SCALE_FACTOR = 6 * 448



class DtypeError(TypeError, ValueError):
    """An array or dtype argument of the wrong dtype (an integer ``w`` to quantize,
    integer scales, an integer output ``dtype``, float indices).

    MLX raises ``ValueError`` for these and jaxquant's own API ``TypeError``; this
    class is both, so ported code that catches MLX's ``ValueError`` keeps working.
    """


# ---------------------------------------------------------------------------
# Small helpers.


def _check_float(name: str, dtype):
    """check_float_dtype, raising DtypeError (MLX: ValueError) instead of TypeError."""
    try:
        return check_float_dtype(name, dtype)
    except TypeError as e:
        raise DtypeError(str(e)) from None


def _exact_div(x, d):
    """x / d correctly rounded, also under jit (d: a number or an array that
    broadcasts against x).

    XLA rewrites a division by a constant, or by a broadcast operand, into a
    multiplication by the reciprocal, which is not correctly rounded (x / 6,
    x / scale[..., None]). A divisor of x's own shape that XLA cannot prove
    constant keeps the true division.
    """
    x = jnp.asarray(x)
    zero = jnp.where(jnp.isfinite(x), x * 0, 0).astype(x.dtype)  # +-0, not foldable
    return x / (jnp.asarray(d, x.dtype) + zero)


def _as_array(x, name: str):
    """jax / numpy arrays as they are (tracers included); MLX arrays and
    sequences as numpy."""
    if x is None or isinstance(x, (jax.Array, np.ndarray)):
        return x
    if type(x).__module__.startswith("mlx"):
        return _mlx_to_numpy(x)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            return np.asarray(x)
        except Exception as e:  # pragma: no cover - numpy's own message is kept
            raise TypeError(f"{name} must be an array; got {type(x).__name__}") from e
    return x


def _mlx_to_numpy(a):
    """An ``mlx.core.array`` as numpy (bfloat16 through a uint16 view: numpy's
    buffer protocol does not know bfloat16)."""
    import ml_dtypes
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(a)


def _to_dtype(dtype, name="dtype"):
    """A jnp dtype from a numpy/jnp dtype, a name, or an ``mlx.core.Dtype``."""
    if dtype is None:
        return None
    if type(dtype).__module__.startswith("mlx"):
        dtype = str(dtype).rsplit(".", 1)[-1]
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}={dtype!r} is not a dtype") from e


# MLX's affine groups; jaxquant's affine also takes 16 (GGUF's Q6_K / Q2_K), which MLX
# refuses, so these functions refuse it as MLX does
MLX_AFFINE_GROUP_SIZES = (32, 64, 128)


def _resolve(mode, bits, group_size):
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str such as {list(MLX_MODES)}; got {mode!r}")
    fmt, bits, group_size = formats.resolve(mode, bits, group_size)
    if fmt.mode == "affine" and group_size not in MLX_AFFINE_GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported by MLX's affine "
                         f"quantization; expected one of {list(MLX_AFFINE_GROUP_SIZES)}")
    return fmt, bits, group_size


def _global_scale_from_mlx(g):
    """MLX's nvfp4 global_scale g -> jaxquant's float32 multiplier g / 2688
    (elementwise: a scalar, or one per leading index)."""
    if g is None:
        return None
    g = jnp.asarray(_as_array(g, "global_scale"), jnp.float32)
    return _exact_div(g, NVFP4_GLOBAL_SCALE_FACTOR)


def _global_scale_to_mlx(gs):
    """jaxquant's multiplier -> MLX's g, chosen so that MLX's g / 2688 gives
    back exactly `gs` (the one of gs * 2688 and its two neighbours that does;
    where none does, no g does and gs * 2688 is the nearest)."""
    gs = jnp.asarray(gs, jnp.float32)
    g = gs * np.float32(NVFP4_GLOBAL_SCALE_FACTOR)
    up = jnp.nextafter(g, jnp.float32(jnp.inf))
    down = jnp.nextafter(g, jnp.float32(-jnp.inf))
    back = lambda c: _exact_div(c, NVFP4_GLOBAL_SCALE_FACTOR) == gs
    return jnp.where(back(g), g, jnp.where(back(up), up, jnp.where(back(down), down, g)))


# ---------------------------------------------------------------------------
# from_mlx / to_mlx


def from_mlx(w_q, scales, biases=None, *, group_size, bits, mode, dtype=None,
             global_scale=None) -> QuantizedArray:
    """MLX's quantized arrays -> a QuantizedArray sharing their buffers.

    w_q: uint32 [..., N, K*bits/32] (MLX's packed weight); scales [..., N, K/group];
    biases (affine only) like scales. group_size / bits / mode: as given to
    ``mx.quantize`` (None = MLX's default for the mode). dtype: the logical dtype
    (default: the scales' dtype for affine, bfloat16 otherwise, as
    ``mx.dequantize``). global_scale: nvfp4 only, MLX's convention (see module doc).

    Arrays are kept as they are (numpy stays numpy, jax stays jax, tracers
    work); ``mlx.core.array`` inputs are converted to numpy.
    """
    return _from_mlx(w_q, scales, biases, group_size=group_size, bits=bits, mode=mode,
                     dtype=dtype, global_scale=global_scale, w_name="w_q")


def _from_mlx(w_q, scales, biases, *, group_size, bits, mode, dtype, global_scale, w_name):
    fmt, bits, group_size = _resolve(mode, bits, group_size)
    w = w_name
    w_q = _as_array(w_q, w)
    scales = _as_array(scales, "scales")
    biases = _as_array(biases, "biases")
    if w_q is None or not hasattr(w_q, "dtype"):
        raise TypeError(f"{w} must be an array; got {type(w_q).__name__}")
    if w_q.dtype != np.uint32:
        raise DtypeError(f"{w} must be uint32 (MLX's packed weight); got {w_q.dtype}")
    if w_q.ndim < 2:
        raise ValueError(f"{w} must have at least 2 dimensions [..., N, K*bits/32]; "
                         f"got shape {tuple(w_q.shape)}")
    if scales is None or not hasattr(scales, "dtype"):
        raise TypeError(f"scales must be an array; got {type(scales).__name__}")
    words = w_q.shape[-1]
    if (words * 32) % bits or ((words * 32) // bits) % group_size:
        raise ValueError(
            f"{w}'s last axis ({words} uint32 words = {words * 32} bits) does not hold a "
            f"whole number of groups of {group_size} {bits}-bit elements (mode={fmt.mode!r})")
    k = words * 32 // bits
    want = tuple(w_q.shape[:-1]) + (k // group_size,)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must have shape {want} for {w} of shape {tuple(w_q.shape)} "
                         f"(K={k}, group_size={group_size}, bits={bits}); got "
                         f"{tuple(scales.shape)}")
    if fmt.scale == "float":
        if not jnp.issubdtype(scales.dtype, jnp.floating):
            raise DtypeError(f"scales for mode={fmt.mode!r} must be a float dtype; got "
                            f"{scales.dtype}")
    elif scales.dtype != np.uint8:
        raise DtypeError(f"scales for mode={fmt.mode!r} must be uint8 ({fmt.scale.upper()} "
                        f"codes); got {scales.dtype}")
    if fmt.has_biases:
        if biases is None:
            raise ValueError(f"mode={fmt.mode!r} needs biases (mx.quantize returns "
                             f"(w_q, scales, biases)); got biases=None")
        if tuple(biases.shape) != want or biases.dtype != scales.dtype:
            raise ValueError(f"biases must match scales ({want}, {scales.dtype}); got "
                             f"{tuple(biases.shape)}, {biases.dtype}")
    elif biases is not None:
        raise ValueError(f"mode={mode!r} has no biases; got biases of shape "
                         f"{tuple(np.shape(biases))}")
    if global_scale is not None and not fmt.has_global_scale:
        raise ValueError(f"global_scale is only used by mode='nvfp4'; got mode={mode!r}")
    if dtype is None:
        dtype = scales.dtype if fmt.scale == "float" else jnp.bfloat16
    dtype = _check_float("dtype", _to_dtype(dtype))
    return QuantizedArray(w_q, scales, biases, _global_scale_from_mlx(global_scale),
                          mode=fmt.mode, bits=bits, group_size=group_size, dtype=dtype)


def to_mlx(qw: QuantizedArray) -> tuple:
    """A QuantizedArray -> the tuple ``mx.quantize`` returns.

    affine: ``(w_q, scales, biases)``; other modes: ``(w_q, scales)``. An nvfp4
    array with a global scale returns ``(w_q, scales, global_scale)``, the last
    in MLX's convention (pass it as ``mx.dequantize(..., global_scale=g)``).
    The arrays are qw's own (no copy) in the canonical layout (MLX's); a kernel
    layout (docs/layouts.md: what jq.quantize gives on a GPU) is unpacked first.
    """
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    qw = unpack_layout(qw)
    if qw.format.has_biases:
        return qw.data, qw.scales, qw.biases
    if qw.global_scale is not None:
        return qw.data, qw.scales, _global_scale_to_mlx(qw.global_scale)
    return qw.data, qw.scales


# ---------------------------------------------------------------------------
# quantize / dequantize


def quantize(w, group_size=None, bits=None, mode="affine", *, global_scale=None, stream=None):
    """``mx.quantize``: ``(w_q, scales, biases)`` for affine, ``(w_q, scales)`` otherwise.

    w: float array [..., N, K], groups along K. See the module docstring for the
    rules per mode and for ``global_scale`` (nvfp4 only, MLX's convention: one
    float32 scalar).
    """
    del stream
    fmt, bits, group_size = _resolve(mode, bits, group_size)
    if global_scale is not None:
        if not fmt.has_global_scale:
            raise ValueError(f"global_scale is only used by mode='nvfp4'; got mode={mode!r}")
        global_scale = _as_array(global_scale, "global_scale")
        if np.size(global_scale) != 1:
            raise ValueError(f"global_scale must be a float32 scalar; got shape "
                             f"{tuple(np.shape(global_scale))}")
        global_scale = jnp.asarray(global_scale, jnp.float32).reshape(())
    w = _as_array(w, "w")
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        w = np.asarray(w)
    _check_float("w", w.dtype)
    return _quantize_jit(w, global_scale, mode=fmt.mode, bits=bits, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("mode", "bits", "group_size"))
def _quantize_jit(w, global_scale, *, mode, bits, group_size):
    fmt = formats.FORMATS[mode]
    if mode in ("mxfp4", "mxfp8_e4m3", "nvfp4"):
        qw = _quantize_mlx(w, fmt, group_size, global_scale)
    elif fmt.scale == "e8m0":
        qw = _jq_quantize(w, mode, bits, group_size, scale_rule="rceil", layout=CANONICAL)
    else:
        qw = _jq_quantize(w, mode, bits, group_size, layout=CANONICAL)
    out = to_mlx(qw)
    return out[:2] if mode == "nvfp4" else out


def _encode_e2m1_mlx(x):
    """E2M1 codes as MLX writes them: round to nearest, ties toward zero
    (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3, 5 -> 4), saturate at 6, and a value
    that rounds to zero is +0 (code 0)."""
    codes = formats.encode_element(x, "e2m1")  # nearest, ties to even
    mag = codes & jnp.uint32(7)
    lower = jnp.where(mag > 0, mag - 1, 0)
    value = formats.decode_element(mag, "e2m1")
    midpoint = (value + formats.decode_element(lower, "e2m1")) * np.float32(0.5)
    mag = jnp.where((mag > 0) & (jnp.abs(x) == midpoint), lower, mag)
    return jnp.where(mag == 0, jnp.uint32(0), (codes & jnp.uint32(8)) | mag)


def _quantize_mlx(w, fmt, group_size, global_scale):
    """MLX's mxfp4 / mxfp8 / nvfp4 quantization (see the module docstring)."""
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        w = np.asarray(w)
    dtype = check_float_dtype("w", w.dtype)
    if w.ndim < 2:
        raise ValueError(f"w must have at least 2 dimensions [..., N, K]; got shape {w.shape}")
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"w's last axis (K={k}) must be a multiple of group_size={group_size}")
    wg = jnp.asarray(w).astype(jnp.float32).reshape(*w.shape[:-1], k // group_size, group_size)
    amax = jnp.max(jnp.abs(wg), axis=-1)
    multiplier = None
    if fmt.scale == "e8m0":
        if dtype == jnp.float32:
            scales = formats.encode_e8m0(amax, fmt.element, "rceil")
            zero = amax == 0
        else:
            # MLX divides amax by the element's largest value in w's dtype and takes
            # the smallest e with that quotient <= 2**e: in float16 the quotient can
            # round down to a power of two, or to 0 (then 2**0, as for an all-zero
            # block), where the exact rule (rceil) gives one more (measured against
            # MLX 0.32.4 on 20000 blocks next to each power of two: 917 mxfp8 and
            # 780 mxfp4 float16 scales differed from rceil, none from this).
            r = _exact_div(amax, formats.ELEMENTS[fmt.element].max_value)
            r = r.astype(dtype).astype(jnp.float32)
            fl, m = formats.log2_parts(jnp.where(r > 0, r, np.float32(1)))
            e = jnp.clip(fl + (m > 1).astype(jnp.int32), -127, 127)
            scales = jnp.where(jnp.isfinite(amax), e + 127, 255).astype(jnp.uint8)
            zero = r == 0
        scales = jnp.where(zero, jnp.uint8(127), scales)  # MLX: an all-zero block has 2**0
        x = ldexp(wg, -(scales.astype(jnp.int32) - 127)[..., None])
    else:
        target = _exact_div(amax, 6)
        if dtype != jnp.float32:  # MLX divides in w's dtype
            target = target.astype(dtype).astype(jnp.float32)
        if global_scale is not None:
            multiplier = _global_scale_from_mlx(global_scale)
            target = target * (np.float32(NVFP4_GLOBAL_SCALE_FACTOR) / global_scale)
        scales = formats.encode_e4m3(target)
        divisor = formats.decode_e4m3(scales)
        if multiplier is not None:
            divisor = divisor * multiplier
        divisor = divisor[..., None]
        x = jnp.where(divisor != 0, _exact_div(wg, jnp.where(divisor != 0, divisor, 1)), 0)
    if fmt.element == "e2m1":
        codes = _encode_e2m1_mlx(x)
    else:
        codes = formats.encode_element(x, fmt.element)  # E4M3: nearest, ties to even
    bits = fmt.bits[0]
    data = formats.pack_bits(codes.reshape(w.shape), bits)
    return QuantizedArray(data, scales, None, multiplier, mode=fmt.mode, bits=bits,
                          group_size=group_size, dtype=dtype)


def dequantize(w, scales, biases=None, group_size=None, bits=None, mode="affine",
               global_scale=None, dtype=None, *, stream=None, backend=None):
    """``mx.dequantize``: the [..., N, K] values of MLX's quantized arrays.

    dtype: the output dtype (numpy/jnp dtype, name, or ``mlx.core`` Dtype);
    default: the scales' dtype for affine, bfloat16 otherwise (as MLX).
    Computed by ``jq.dequantize`` (so a backend kernel serves it where one is
    available; ``backend=`` as for every jaxquant op). See the module docstring
    for the rounding differences with MLX's CPU path.
    """
    del stream
    fmt, bits, group_size = _resolve(mode, bits, group_size)
    args = [_as_array(a, n) for a, n in ((w, "w"), (scales, "scales"), (biases, "biases"),
                                         (global_scale, "global_scale"))]
    dtype = _to_dtype(dtype)
    if dtype is not None:
        dtype = _check_float("dtype", dtype)
    return _dequantize_jit(*args, group_size=group_size, bits=bits, mode=mode, dtype=dtype,
                           backend=dispatch.resolve_backend(backend))


@functools.partial(jax.jit, static_argnames=("group_size", "bits", "mode", "dtype", "backend"))
def _dequantize_jit(w, scales, biases, global_scale, *, group_size, bits, mode, dtype, backend):
    qw = _from_mlx(w, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=None,
                   global_scale=global_scale, w_name="w")
    return _jq_dequantize(qw, dtype=dtype, backend=backend)


# ---------------------------------------------------------------------------
# Quantized matmuls (quantized_matmul, gather_qmm) go below this line; they
# take MLX's signatures and are built on jq.qmm / jq.gather_qmm via from_mlx.


def _broadcast_quantized(qw: QuantizedArray, batch: tuple) -> QuantizedArray:
    """qw with its leading (batch) axes broadcast to `batch`."""
    grow = lambda a: None if a is None else jnp.broadcast_to(a, batch + a.shape[-2:])
    gs = qw.global_scale
    return qw.replace(data=grow(qw.data), scales=grow(qw.scales), biases=grow(qw.biases),
                      global_scale=gs if gs is None or jnp.ndim(gs) == 0 else jnp.broadcast_to(
                          gs, batch[:len(batch) - (qw.ndim - 2) + jnp.ndim(gs)]))


def quantized_matmul(x, w, scales, biases=None, transpose=True, group_size=None, bits=None,
                     mode="affine", *, global_scale=None, stream=None, backend=None):
    """``mx.quantized_matmul``: ``x @ dequantize(w).T`` (transpose) or ``x @ dequantize(w)``,
    on `jq.qmm`. Batch axes of x and w broadcast against each other, as in MLX."""
    del stream
    x = jnp.asarray(_as_array(x, "x"))
    _check_float("x", x.dtype)
    qw = from_mlx(w, scales, biases, group_size=group_size, bits=bits, mode=mode,
                  dtype=x.dtype, global_scale=global_scale)
    if qw.ndim == 2:
        return jq_ops.qmm(x, qw, transpose, backend=backend)
    if x.ndim < 2:
        raise ValueError(f"x must be [..., M, K] when w has batch axes; got shape {x.shape}")
    batch = jnp.broadcast_shapes(x.shape[:-2], qw.shape[:-2])
    x = jnp.broadcast_to(x, batch + x.shape[-2:])
    return jq_ops.qmm(x, _broadcast_quantized(qw, batch), transpose, backend=backend)


def gather_qmm(x, w, scales, biases=None, lhs_indices=None, rhs_indices=None, transpose=True,
               group_size=None, bits=None, mode="affine", global_scale=None, *,
               sorted_indices=False, stream=None, backend=None):
    """``mx.gather_qmm``: ``out[i] = x[lhs[i]] @ dequantize(w[rhs[i]]).T`` where the indices
    are flat indices into the batch axes of x [..., M, K] and w [..., N, K], broadcast
    together; out has shape ``broadcast(lhs, rhs).shape + (M, N)``. Runs on
    `jq.gather_qmm` with one row per (index, m); an out-of-range index gives NaN rows
    (MLX leaves that undefined)."""
    del stream, sorted_indices
    x = jnp.asarray(_as_array(x, "x"))
    _check_float("x", x.dtype)
    qw = from_mlx(w, scales, biases, group_size=group_size, bits=bits, mode=mode,
                  dtype=x.dtype, global_scale=global_scale)
    if x.ndim < 2 or qw.ndim < 2:
        raise ValueError(f"x and w must have at least 2 dimensions; got x {x.shape}, "
                         f"w {qw.shape}")
    m, k = x.shape[-2:]
    x_batch, w_batch = x.shape[:-2], qw.shape[:-2]
    default = lambda batch: jnp.arange(int(np.prod(batch)), dtype=jnp.int32).reshape(batch)
    lhs = default(x_batch) if lhs_indices is None else jnp.asarray(lhs_indices)
    rhs = default(w_batch) if rhs_indices is None else jnp.asarray(rhs_indices)
    for name, idx in (("lhs_indices", lhs), ("rhs_indices", rhs)):
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise DtypeError(f"{name} must be integer; got {idx.dtype}")
    out_batch = jnp.broadcast_shapes(lhs.shape, rhs.shape)
    lhs = jnp.broadcast_to(lhs, out_batch).reshape(-1)
    rhs = jnp.broadcast_to(rhs, out_batch).reshape(-1)
    qw_flat = qw.flatten_leading()  # a global scale per leading index: one per expert
    rows = jnp.take(x.reshape(-1, m, k), lhs, axis=0, mode="fill", fill_value=jnp.nan)
    y = jq_ops.gather_qmm(rows.reshape(-1, k), qw_flat, jnp.repeat(rhs, m)[:, None],
                          transpose, backend=backend)
    return y.reshape(out_batch + (m, y.shape[-1]))
