"""What the Pallas kernels share: small index/mask helpers, the weight operands and
their decoded tiles (`Tile`), the slot loops, and the pallas_call cache (`call`).

Everything here runs inside kernel bodies or their wrappers; nothing knows which
op or kernel family it serves. The codecs themselves are `jaxquant.pallas.codecs`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxquant.pallas import codecs
from jaxquant.quantized_array import QuantizedArray

INTERLEAVE_K = 128   # elements of K (N for transpose=False) per interleaved GEMM step

X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------
# Small helpers.


def cdiv(a, b):
    return -(-a // b)


def pow2_floor(v: int) -> int:
    v = max(1, int(v))
    return 1 << (v.bit_length() - 1)


def pow2_ceil(v: int) -> int:
    v = max(1, int(v))
    return 1 << (v - 1).bit_length()


def pow2_block(size: int, extent: int) -> int:
    """A power-of-two block of at most `size` (at least 1), no larger than `extent`
    rounded up to a power of two (a block never spans more than the padded extent)."""
    return min(pow2_floor(size), pow2_ceil(extent))


def split_loop(n_blocks: int, split_k: int) -> tuple[int, int]:
    """A loop over `n_blocks` blocks split across programs: (split, steps per program),
    `split_k` clamped to [1, n_blocks]."""
    split = max(1, min(split_k, n_blocks))
    return split, cdiv(n_blocks, split)


def iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def index(v):
    """A static integer index as a 0-d int32 array (interpret mode's load/store
    discharge takes arrays or slices, not Python ints)."""
    return jnp.asarray(v, jnp.int32)


def load(ref, mask, other=0):
    return plgpu.load(ref, mask=mask, other=other)


def bcast(mask, shape):
    return jnp.broadcast_to(mask, shape)


def dot_precision(precision, x_dtype):
    """lax precision pair for the in-kernel dot: IEEE float32 for 'highest'."""
    if jnp.dtype(x_dtype) != jnp.float32:
        return None
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, (tuple, list)):
        precision = precision[0]
    name = getattr(precision, "name", precision)
    if isinstance(name, str) and name.lower() in ("highest", "float32", "f32_f32_f32"):
        return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    return (lax.Precision.DEFAULT, lax.Precision.DEFAULT)


# ---------------------------------------------------------------------------
# Operands shared by the kernels.


def weight_operands(qw: QuantizedArray, geo: codecs.Geometry):
    """[rows, groups, cpg(, wpb)] view of the words, scales, and the optional
    biases / global scale, as (arrays, flags)."""
    groups = qw.scales.shape[-1]
    rows = qw.scales.size // max(groups, 1)      # leading (expert) axes fold into rows
    shape = (rows, groups, geo.cpg) if geo.wpb == 1 else (rows, groups, geo.cpg, geo.wpb)
    ops = [qw.data.reshape(shape), qw.scales.reshape(rows, groups)]
    has_bias = qw.biases is not None
    if has_bias:
        ops.append(qw.biases.reshape(rows, groups))
    has_gs = qw.global_scale is not None
    if has_gs:
        ops.append(jnp.asarray(qw.global_scale, jnp.float32).reshape(-1))  # 1 or one per expert
    return ops, has_bias, has_gs


class Tile:
    """One tile of packed words ([rows, groups, cpg] per word of a block), decoded slot by slot.

    Formats whose blocks are one word (2/4/8 bits) load the tile once and decode
    every slot with static shifts (the kernels unroll over slots). Formats whose
    elements straddle words (3/5/6 bits, 32-element blocks of `bits` words) are
    the shared slow path: the kernels loop over the 32 slots and each slot loads
    the (strided) word plane(s) holding it, decoding with dynamic shifts.
    """

    def __init__(self, w_ref, idx, mask, geo, fmt, hw, planes=None):
        self.w_ref, self.idx, self.mask, self.geo, self.fmt, self.hw = (
            w_ref, idx, mask, geo, fmt, hw)
        if planes is None and geo.wpb == 1:
            planes = [load(w_ref.at[idx], mask)]
        self.planes = planes

    def slot(self, t):
        geo = self.geo
        if self.planes is not None:
            return codecs.decode_slot(self.planes, geo, t, self.fmt, self.hw)
        word, nxt = codecs.slot_word_dynamic(t, geo)
        lo = load(self.w_ref.at[self.idx + (word,)], self.mask)
        hi = load(self.w_ref.at[self.idx + (nxt,)], self.mask)
        return codecs.decode_code(codecs.slot_code_dynamic(lo, hi, t, geo), geo, self.fmt,
                                  self.hw)


def static_slots(geo) -> bool:
    return geo.wpb == 1


def over_slots(geo, body, init):
    """carry = body(t, carry) for every slot t: unrolled (static t, starting from
    None) for one-word blocks, else a loop (traced t) from `init`."""
    if static_slots(geo):
        carry = None
        for t in range(geo.epb):
            carry = body(t, carry)
        return carry
    return lax.fori_loop(0, geo.epb, body, init)


def for_slots(geo, run):
    """run(slots) for every slot: once with all of them (one-word blocks: static slots,
    unrolled) or once per slot in a loop (straddling formats, the shared slow path:
    traced t, one pass per slot)."""
    if static_slots(geo):
        run(list(range(geo.epb)))
        return

    def one(t, carry):
        run([t])
        return carry
    lax.fori_loop(0, geo.epb, one, 0)


def add_or_first(a, b):
    return b if a is None else a + b


def unpack_refs(refs, has_xs, has_bias, has_gs):
    it = iter(refs)
    x_ref = next(it)
    xs_ref = next(it) if has_xs else None
    w_ref = next(it)
    s_ref = next(it)
    b_ref = next(it) if has_bias else None
    gs_ref = next(it) if has_gs else None
    o_ref = next(it)
    return x_ref, xs_ref, w_ref, s_ref, b_ref, gs_ref, o_ref


def call(kernel, grid, out_shape, operands, config, interpret, name):
    fn = pallas_fn(kernel.func, tuple(sorted(kernel.keywords.items())), grid, out_shape,
                    config.num_warps, config.num_stages, interpret, name)
    return fn(*operands)


@functools.lru_cache(maxsize=512)
def pallas_fn(kernel_fn, kernel_kw, grid, out_shape, num_warps, num_stages, interpret, name):
    """One jitted pallas_call per distinct kernel: repeated calls (the layers of a
    model, the weight copies of a benchmark) trace to the same jaxpr, which JAX
    lowers (and, on newer jaxlibs, Triton-compiles) once per module."""
    call = pl.pallas_call(
        functools.partial(kernel_fn, **dict(kernel_kw)),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )
    return jax.jit(call)


def finish_split(out, split, dtype):
    # Left to right, elementwise: the same float ops for every output shape (a qmm
    # row and a gather_qmm slot add their split-K partial sums identically).
    if split > 1:
        out = functools.reduce(lambda a, b: a + b, [out[i] for i in range(split)])
    return out.astype(dtype)

def interleave(ws):
    """Slot planes ws[t] [..., C] -> [..., C, epb]: element t of each block innermost."""
    def build(ts, level):
        if len(ts) == 1:
            return ws[ts[0]]
        even = [t for t in ts if not (t >> level) & 1]
        odd = [t for t in ts if (t >> level) & 1]
        return jnp.stack([build(even, level + 1), build(odd, level + 1)], axis=-1)

    out = build(list(range(len(ws))), 0)
    return out.reshape(*ws[0].shape, len(ws))


def dequant(v, mul, add, cdt):
    w = v * mul[:, :, None]
    if add is not None:
        w = w + add[:, :, None]
    return w.astype(cdt)


# ---------------------------------------------------------------------------
# JAX's Pallas-Triton deprecation warning.

# JAX 0.11 deprecated the Pallas Triton backend and warns (DeprecationWarning, this
# text) each time a Triton pallas_call is lowered. Triton is the only Pallas path on
# ROCm (Mosaic GPU does not run there) and the one jaxquant's kernels use on CUDA, so
# the warning says nothing a jaxquant user can act on. jaxquant ignores this one
# message while the dispatcher lowers jaxquant's own kernels (`quiet_lowering`,
# registered with jaxquant.dispatch); every other warning, and the same one from
# anyone else's pallas_call, passes.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_lowering():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION,
                                category=DeprecationWarning)
        yield
