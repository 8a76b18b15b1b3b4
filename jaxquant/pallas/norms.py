"""Pallas (Triton lowering) kernels for rms_norm, add_rms_norm and gated_rms_norm.

Entry points: `lower_rms_norm`, `lower_add_rms_norm`, `lower_gated_rms_norm` and
`supports`, registered by `jaxquant.pallas`; `rms_norm`, `add_rms_norm`,
`gated_rms_norm` for direct use. Block configs: `jaxquant.pallas.configs`.

Semantics are the reference's (jaxquant/ops/norms.py, docs/ops.md): statistics
and arithmetic in float32, in the reference's order of operations; outputs in
x's dtype (rms_norm), residual's (add_rms_norm: h and y) or gate's
(gated_rms_norm). float64 anywhere -> `supports` says no and the reference runs.

Layout. x is viewed as [R, S] (R = rows, the product of the leading axes; S the
last axis) or, for gated_rms_norm with group_size, as [R, G, S] (G groups of
S = group_size): each (row, group) is normalized on its own, so groups are just
more independent rows that share the weight's [G, S] view. One program owns a
[br, (bg,) bs] tile; BlockSpecs hand it the [br, (bg,) W] block of its rows
(W = S rounded up to a power of two, as Triton requires), loads and stores are
masked to the real rows/groups/columns (masked lanes read as 0, which adds
nothing to the sum of squares).

Two shapes of kernel, chosen by configs.NORM_CONFIGS (data, per platform):
  one pass   S <= max_block: bs = W, the whole row stays in registers between
             the reduction and the scaling: each input is read once, each
             output written once (add_rms_norm: x and residual read once, y
             and h written once). Narrow rows (per-head norms of 64..256) are
             batched br rows (and bg groups) per program up to `tile` elements,
             so a program still moves a useful amount of data.
  two pass   S > max_block: one row per program, a loop over `chunk`-wide
             column steps accumulates the sum of squares elementwise (one
             reduction at the end), a second loop re-reads the row (from L2 for
             all but huge rows), scales and stores. add_rms_norm stores h in the
             first loop and recomputes it (bit-identical) in the second rather
             than reading back its own stores.

Dispatch: registered for cuda and rocm at dispatch.PRIORITY["pallas"], above the ffi
backend's -1 there, so automatic choice takes these kernels on GPUs from
configs.AUTO_NORM_MIN_ELEMENTS (backend="ffi" still selects ffi); float64 or
other dtypes fall back to the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxquant.pallas.common import X_DTYPES, cdiv, iota, pow2_ceil, pow2_floor
from jaxquant.pallas.configs import NORM_CONFIGS, NormConfig

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static tiling of one call: rows R x groups G x width S (G = 1: ungrouped)."""
    rows: int
    groups: int
    width: int
    br: int          # rows per program
    bg: int          # groups per program
    bs: int          # columns per load (the whole padded row in one pass)
    block_w: int     # BlockSpec width: S rounded up to a power of two
    two_pass: bool
    num_warps: int
    num_stages: int

    @property
    def grid(self):
        r = cdiv(self.rows, self.br)
        return (r,) if self.groups == 1 else (r, cdiv(self.groups, self.bg))


def plan(platform: str, rows: int, groups: int, width: int,
         config: NormConfig | None = None) -> Plan:
    cfg = config or NORM_CONFIGS[platform]
    block_w = pow2_ceil(width)
    two_pass = block_w > cfg.max_block
    if two_pass:
        bs, bg, br = min(cfg.chunk, block_w), 1, 1
    else:
        bs = block_w
        bg = 1 if groups == 1 else min(pow2_floor(cfg.tile // bs), pow2_ceil(groups))
        br = min(pow2_floor(cfg.tile // (bs * bg)), pow2_ceil(rows))
    elems = br * bg * bs
    warps = min(cfg.max_warps, pow2_floor(elems // (cfg.warp * cfg.per_thread)))
    return Plan(rows, groups, width, br, bg, bs, block_w, two_pass, warps, cfg.num_stages)


# ---------------------------------------------------------------------------
# Which cases the kernels take.


def supports(x, *operands, group_size=None, **params) -> bool:
    """Whether the kernels take these arguments: x and the op's other array operands
    (None: absent) as anything with a shape and dtype (e.g. ShapedArrays), the op's
    params as keywords (only group_size matters). float64 (and anything but
    f32/f16/bf16) -> no."""
    try:
        if any(a is not None and jnp.dtype(a.dtype) not in X_DTYPES for a in (x, *operands)):
            return False
        if len(x.shape) < 1 or math.prod(x.shape) == 0:
            return False
        if group_size is not None and (group_size <= 0 or x.shape[-1] % group_size):
            return False
    except Exception:  # noqa: BLE001 - "no" is the answer to anything malformed
        return False
    return True


def _dt(a):
    return None if a is None else a.dtype


# ---------------------------------------------------------------------------
# The kernel (one body for the three ops).


def _act(g, activation):
    # 1 / (1 + exp(-g)): what XLA expands jax.nn.sigmoid (logistic) to.
    s = 1.0 / (1.0 + jnp.exp(-g))
    return g * s if activation == "silu" else s


def _norm_kernel(*refs, op, p: Plan, has_w, eps, offset, activation, norm_before_gate):
    n_in = (1 if op == "rms" else 2) + has_w
    x_ref = refs[0]
    b_ref = refs[1] if op != "rms" else None        # residual (add) or gate (gated)
    w_ref = refs[n_in - 1] if has_w else None
    y_ref = refs[n_in]
    h_ref = refs[n_in + 1] if op == "add" else None
    grouped = p.groups > 1
    tile = (p.br, p.bg, p.bs) if grouped else (p.br, p.bs)

    # Rows (and groups) of this program that exist: the grid over-covers.
    lead_ok = pl.program_id(0) * p.br + iota(p.br) < p.rows
    w_lead_ok = None
    if grouped:
        g_ok = pl.program_id(1) * p.bg + iota(p.bg) < p.groups
        lead_ok = lead_ok[:, None] & g_ok[None, :]
        w_lead_ok = g_ok

    def at(c0):
        """Indexers and masks of the column step starting at c0."""
        cols = pl.ds(c0, p.bs)
        c_ok = c0 + iota(p.bs) < p.width
        xi = (slice(None),) * (len(tile) - 1) + (cols,)
        m = jnp.broadcast_to(lead_ok[..., None] & c_ok, tile)
        wi = (slice(None), cols) if grouped else (cols,)
        wm = jnp.broadcast_to(w_lead_ok[:, None] & c_ok[None, :], (p.bg, p.bs)) \
            if grouped else c_ok
        return xi, m, wi, wm

    def load(ref, idx, mask):
        return plgpu.load(ref.at[idx], mask=mask, other=0).astype(_F32)

    def values(c0, store_h):
        """(v, g, at(c0)): v the float32 values to normalize, g the activated gate."""
        xi, m, wi, wm = at(c0)
        x = load(x_ref, xi, m)
        g = None
        if op == "add":
            # h = (x + residual) in residual's dtype; adding in float32 then rounding
            # once is what XLA does for any mix of f32/f16/bf16 operands.
            h = (x + load(b_ref, xi, m)).astype(h_ref.dtype)
            if store_h:
                plgpu.store(h_ref.at[xi], h, mask=m)
            v = h.astype(_F32)
        elif op == "gated":
            g = _act(load(b_ref, xi, m), activation)
            v = x if norm_before_gate else x * g
        else:
            v = x
        return v, g, (xi, m, wi, wm)

    def finish(v, inv, g, where):
        xi, m, wi, wm = where
        y = v * inv                                  # the reference's order of products
        if has_w:
            y = y * (load(w_ref, wi, wm) + offset)   # [(bg,) bs] broadcasts over rows
        if op == "gated" and norm_before_gate:
            y = y * g
        plgpu.store(y_ref.at[xi], y.astype(y_ref.dtype), mask=m)

    def inv_rms(sum_sq):
        return lax.rsqrt(sum_sq / float(p.width) + eps)

    if not p.two_pass:
        v, g, where = values(0, True)
        finish(v, inv_rms(jnp.sum(v * v, axis=-1, keepdims=True)), g, where)
        return

    n_steps = cdiv(p.width, p.bs)

    def start(i):
        return pl.multiple_of(i * p.bs, p.bs)

    def pass1(i, acc):
        v, _, _ = values(start(i), True)
        return acc + v * v                           # elementwise: one reduction at the end

    acc = lax.fori_loop(0, n_steps, pass1, jnp.zeros(tile, _F32))
    inv = inv_rms(jnp.sum(acc, axis=-1, keepdims=True))

    def pass2(i, carry):
        v, g, where = values(start(i), False)
        finish(v, inv, g, where)
        return carry

    lax.fori_loop(0, n_steps, pass2, 0)


@functools.lru_cache(maxsize=256)
def _pallas_fn(op, p: Plan, dtypes, out_dtypes, has_w, eps, offset, activation,
               norm_before_gate, interpret):
    """One jitted pallas_call per distinct static configuration (the layers of a
    model reuse it; JAX lowers it once per module)."""
    grouped = p.groups > 1
    if grouped:
        shape = (p.rows, p.groups, p.width)
        row_spec = pl.BlockSpec((p.br, p.bg, p.block_w), lambda i, j: (i, j, 0))
        w_spec = pl.BlockSpec((p.bg, p.block_w), lambda i, j: (j, 0))
    else:
        shape = (p.rows, p.width)
        row_spec = pl.BlockSpec((p.br, p.block_w), lambda i: (i, 0))
        w_spec = pl.BlockSpec((p.block_w,), lambda i: (0,))
    n_rows_in = 1 if op == "rms" else 2
    in_specs = [row_spec] * n_rows_in + ([w_spec] if has_w else [])
    out_shape = tuple(jax.ShapeDtypeStruct(shape, d) for d in out_dtypes)
    kernel = functools.partial(_norm_kernel, op=op, p=p, has_w=has_w, eps=eps, offset=offset,
                               activation=activation, norm_before_gate=norm_before_gate)
    call = pl.pallas_call(
        kernel,
        grid=p.grid,
        in_specs=in_specs,
        out_specs=tuple(row_spec for _ in out_dtypes),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        name=f"jq_{op}_norm",
    )
    return jax.jit(call)


def _run(op, rows_in, weight, out_dtypes, *, eps, weight_offset, platform, interpret, config,
         group_size=None, activation="silu", norm_before_gate=True):
    x = rows_in[0]
    s_full = x.shape[-1]
    r = math.prod(x.shape[:-1])
    groups = 1 if group_size is None or group_size == s_full else s_full // group_size
    width = s_full // groups
    platform = "interpret" if interpret else platform
    p = plan(platform, r, groups, width, config)
    view = (r, groups, width) if groups > 1 else (r, width)
    args = [a.reshape(view) for a in rows_in]
    if weight is not None:
        args.append(weight.reshape(view[1:]))
    fn = _pallas_fn(op, p, tuple(a.dtype for a in args), tuple(out_dtypes), weight is not None,
                    float(eps), float(weight_offset), activation, bool(norm_before_gate),
                    bool(interpret))
    return [o.reshape(x.shape) for o in fn(*args)]


def _check(name, x, rows, weight, group_size=None):
    """Static argument checks of the direct entry points (the ops check theirs)."""
    if not supports(x, *rows, weight, group_size=group_size):
        raise TypeError(f"the pallas {name} takes float32/float16/bfloat16 operands, x with "
                        f"at least one non-empty axis and a group_size dividing the last axis; "
                        f"got x {x.shape} {x.dtype}, others "
                        f"{[str(_dt(a)) for a in (*rows, weight)]}, group_size={group_size}")
    if any(a.shape != x.shape for a in rows):
        raise ValueError(f"{name}: operands must have x's shape {x.shape}; got "
                         f"{[a.shape for a in rows]}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"{name}: weight must have shape {x.shape[-1:]}; got {weight.shape}")


# ---------------------------------------------------------------------------
# Entry points. lower_*: what the dispatcher runs (the reference's signature plus
# platform; cases `supports` accepted, no argument checks). The others: the same
# for direct use (defaults as the ops', checks, plus interpret and config).


def lower_rms_norm(x, weight, *, eps, weight_offset, platform, interpret=False, config=None):
    """x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset), in x.dtype."""
    (y,) = _run("rms", [x], weight, [x.dtype], eps=eps, weight_offset=weight_offset,
                interpret=interpret, platform=platform, config=config)
    return y


def lower_add_rms_norm(x, residual, weight, *, eps, weight_offset, platform, interpret=False,
                       config=None):
    """(rms_norm(h, weight), h) with h = (x + residual) in residual.dtype."""
    y, h = _run("add", [x, residual], weight, [residual.dtype, residual.dtype], eps=eps,
                weight_offset=weight_offset, interpret=interpret, platform=platform,
                config=config)
    return y, h


def lower_gated_rms_norm(x, gate, weight, *, eps, weight_offset, activation, norm_before_gate,
                         group_size, platform, interpret=False, config=None):
    """norm_before_gate: rms_norm(x, weight) * act(gate); else rms_norm(x * act(gate), weight);
    per group of `group_size` columns when given. Output in gate.dtype."""
    (y,) = _run("gated", [x, gate], weight, [gate.dtype], eps=eps, weight_offset=weight_offset,
                group_size=group_size, activation=activation,
                norm_before_gate=norm_before_gate, interpret=interpret, platform=platform,
                config=config)
    return y


def rms_norm(x, weight=None, *, eps=1e-6, weight_offset=0.0, platform="cuda", interpret=False,
             config=None):
    _check("rms_norm", x, (), weight)
    return lower_rms_norm(x, weight, eps=eps, weight_offset=weight_offset, platform=platform,
                          interpret=interpret, config=config)


def add_rms_norm(x, residual, weight=None, *, eps=1e-6, weight_offset=0.0, platform="cuda",
                 interpret=False, config=None):
    _check("add_rms_norm", x, (residual,), weight)
    return lower_add_rms_norm(x, residual, weight, eps=eps, weight_offset=weight_offset,
                              platform=platform, interpret=interpret, config=config)


def gated_rms_norm(x, gate, weight=None, *, eps=1e-6, weight_offset=0.0, activation="silu",
                   norm_before_gate=True, group_size=None, platform="cuda", interpret=False,
                   config=None):
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"activation={activation!r}; expected 'silu' or 'sigmoid'")
    _check("gated_rms_norm", x, (gate,), weight, group_size)
    return lower_gated_rms_norm(x, gate, weight, eps=eps, weight_offset=weight_offset,
                                activation=activation, norm_before_gate=norm_before_gate,
                                group_size=group_size, platform=platform, interpret=interpret,
                                config=config)


rms_norm.__doc__ = lower_rms_norm.__doc__
add_rms_norm.__doc__ = lower_add_rms_norm.__doc__
gated_rms_norm.__doc__ = lower_gated_rms_norm.__doc__
