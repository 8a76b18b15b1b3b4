"""The CDNA4 (gfx950) MXFP4 preshuffle: B bytes and E8M0 scales arranged so that
one wave's scaled-MFMA operands are contiguous loads (docs/cdna4.md).

B (the packed E2M1 weight, viewed as bytes [E, N, K_BYTES], K_BYTES = K/2): the
byte (e, n, kb) with n = n_lane + 16*n_blk and kb = byte + 16*k_lane + 64*k0
(n_lane, byte < 16; k_lane < 4) goes to offset

    e*N*K_BYTES + n_blk*(K_BYTES/64)*1024 + k0*1024 + k_lane*256 + n_lane*16 + byte.

Each 16-row x 64-byte tile (16 weight rows x 128 K elements: one operand of a
v_mfma_scale_f32_16x16x128_f8f6f4) becomes 1024 contiguous bytes in which lane
l = n_lane + 16*k_lane of a wave finds its 16 bytes (32 E2M1 values) at 16*l:
one buffer_load_dwordx4 per lane, the wave's loads coalesced. Tiles follow each
other along K, then along N. Needs N % 16 == 0 and K_BYTES % 64 == 0.

Scales (E8M0 bytes [E, MN, K_S], K_S = K/32): MN is padded with zero bytes up
to MNp, a multiple of 32; the scale (e, mn, ks) with mn = mn_lane + 16*mn_pack
+ 32*mn_blk and ks = k_lane + 4*k_pack + 8*k0 (mn_lane < 16; k_lane < 4;
mn_pack, k_pack < 2) goes to offset

    e*MNp*K_S + mn_blk*(K_S/8)*256 + k0*256 + k_lane*64 + mn_lane*4 + k_pack*2 + mn_pack.

Each 32-row x 8-scale block is 256 contiguous bytes; lane l = mn_lane +
16*k_lane reads one dword at 4*l holding the scales of its rows mn_lane and
mn_lane + 16 (two 16-row MFMA tiles) for K steps 2*k0 and 2*k0 + 1; the MFMA's
op_sel picks the byte. Needs K_S % 8 == 0.

Both formulas are bijections for those sizes (tests/test_cdna4_layout.py walks
every index), and the inverses here are exact. As a `jaxquant.layouts` Layout
("cdna4"): mxfp4 only, N % 16 == 0 and K % 256 == 0 (K_BYTES % 64 and K_S % 8);
`data` keeps its canonical uint32 shape [..., N, K/8] with its bytes permuted,
`scales` become uint8 [..., MNp, K/32]. Not the default on any platform: ROCm
is wider than gfx950, and only gfx950 has a kernel that reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.layouts import Layout, register

NAME = "cdna4"
MN_LANES = 16      # rows of one MFMA operand tile (n_lane, mn_lane)
K_LANES = 4        # lane groups along K (k_lane)
LANE_BYTES = 16    # bytes of B one lane loads per K step: 32 E2M1 values
TILE_K_BYTES = K_LANES * LANE_BYTES  # 64 bytes = 128 K elements: one MFMA K step
TILE_BYTES = MN_LANES * TILE_K_BYTES  # 1024
SCALE_MN_BLOCK = 32  # rows per scale block (2 MFMA tiles): the MN padding
SCALE_K_BLOCK = 8    # scales per row per scale block (2 MFMA K steps)
SCALE_BLOCK_BYTES = SCALE_MN_BLOCK * SCALE_K_BLOCK  # 256

__all__ = ["NAME", "padded_mn", "preshuffle_b", "preshuffle_scales", "unshuffle_b",
           "unshuffle_scales", "b_offset", "scale_offset"]


def padded_mn(mn: int) -> int:
    """MN rounded up to a multiple of 32 (the scale layout's row padding)."""
    return -(-int(mn) // SCALE_MN_BLOCK) * SCALE_MN_BLOCK


# ---------------------------------------------------------------------------
# The formulas, as plain integer functions (the specification the tests check
# the permutations and the kernel's address header against).


def b_offset(e, n, kb, n_rows, k_bytes):
    """Offset of canonical byte (e, n, kb) in the preshuffled B buffer."""
    n_lane, n_blk = n % MN_LANES, n // MN_LANES
    byte, k_lane, k0 = kb % LANE_BYTES, (kb // LANE_BYTES) % K_LANES, kb // TILE_K_BYTES
    return (e * n_rows * k_bytes + LANE_BYTES * n_lane + TILE_BYTES * (k_bytes // TILE_K_BYTES)
            * n_blk + byte + 256 * k_lane + TILE_BYTES * k0)


def scale_offset(e, mn, ks, mn_rows, k_scales):
    """Offset of canonical scale (e, mn, ks) in the preshuffled scale buffer
    (whose rows are padded to padded_mn(mn_rows))."""
    mn_lane, mn_pack, mn_blk = mn % 16, (mn // 16) % 2, mn // 32
    k_lane, k_pack, k0 = ks % 4, (ks // 4) % 2, ks // 8
    return (e * padded_mn(mn_rows) * k_scales + 4 * mn_lane + mn_pack
            + SCALE_BLOCK_BYTES * (k_scales // SCALE_K_BLOCK) * mn_blk + 64 * k_lane
            + 2 * k_pack + SCALE_BLOCK_BYTES * k0)


# ---------------------------------------------------------------------------
# The permutations (jnp, jittable; 2-D [N, K_BYTES] or 3-D [E, N, K_BYTES]).


def _as_3d(name, a, what):
    shape = tuple(np.shape(a))
    dtype = getattr(a, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.uint8:
        raise TypeError(f"{name} must be a uint8 array {what}; got "
                        f"{dtype if dtype is not None else type(a).__name__}")
    if len(shape) not in (2, 3):
        raise ValueError(f"{name} must be {what} (2-D without E or 3-D); got shape {shape}")
    a = jnp.asarray(a)
    return (a[None], True) if a.ndim == 2 else (a, False)


def _check_b(name, shape):
    _, n, kb = shape
    if n % MN_LANES or kb % TILE_K_BYTES:
        raise ValueError(f"{name}: the cdna4 B layout needs N % {MN_LANES} == 0 and K_BYTES % "
                         f"{TILE_K_BYTES} == 0 (K % 128 == 0); got N={n}, K_BYTES={kb} "
                         f"(shape {shape})")


def preshuffle_b(data):
    """uint8 [E, N, K_BYTES] (or [N, K_BYTES]) -> the same shape, bytes in the
    CDNA4 5-D order (module docstring)."""
    a, squeeze = _as_3d("data", data, "[E, N, K_BYTES]")
    _check_b("data", a.shape)
    e, n, kb = a.shape
    # [e, n_blk, n_lane, k0, k_lane, byte] -> [e, n_blk, k0, k_lane, n_lane, byte]
    t = a.reshape(e, n // MN_LANES, MN_LANES, kb // TILE_K_BYTES, K_LANES, LANE_BYTES)
    out = t.transpose(0, 1, 3, 4, 2, 5).reshape(e, n, kb)
    return out[0] if squeeze else out


def unshuffle_b(data):
    """The exact inverse of preshuffle_b."""
    a, squeeze = _as_3d("data", data, "[E, N, K_BYTES]")
    _check_b("data", a.shape)
    e, n, kb = a.shape
    t = a.reshape(e, n // MN_LANES, kb // TILE_K_BYTES, K_LANES, MN_LANES, LANE_BYTES)
    out = t.transpose(0, 1, 4, 2, 3, 5).reshape(e, n, kb)
    return out[0] if squeeze else out


def _check_scales(name, shape):
    if shape[2] % SCALE_K_BLOCK:
        raise ValueError(f"{name}: the cdna4 scale layout needs K_S % {SCALE_K_BLOCK} == 0 "
                         f"(K % 256 == 0); got K_S={shape[2]} (shape {shape})")


def preshuffle_scales(scales):
    """E8M0 uint8 [E, MN, K_S] (or [MN, K_S]) -> [E, MNp, K_S], MNp = MN rounded
    up to 32 with zero rows, in the CDNA4 4-D order (module docstring)."""
    a, squeeze = _as_3d("scales", scales, "[E, MN, K_S]")
    _check_scales("scales", a.shape)
    e, mn, ks = a.shape
    mnp = padded_mn(mn)
    if mnp != mn:
        a = jnp.pad(a, ((0, 0), (0, mnp - mn), (0, 0)))
    # [e, mn_blk, mn_pack, mn_lane, k0, k_pack, k_lane]
    #   -> [e, mn_blk, k0, k_lane, mn_lane, k_pack, mn_pack]
    t = a.reshape(e, mnp // 32, 2, 16, ks // SCALE_K_BLOCK, 2, K_LANES)
    out = t.transpose(0, 1, 4, 6, 3, 5, 2).reshape(e, mnp, ks)
    return out[0] if squeeze else out


def unshuffle_scales(scales, mn: int):
    """The exact inverse of preshuffle_scales: [E, MNp, K_S] -> [E, mn, K_S]
    (the padding rows dropped; `mn` is the unpadded row count)."""
    a, squeeze = _as_3d("scales", scales, "[E, MNp, K_S]")
    _check_scales("scales", a.shape)
    e, mnp, ks = a.shape
    mn = int(mn)
    if mn < 0 or padded_mn(mn) != mnp:
        raise ValueError(f"scales: {mnp} rows is not the cdna4 padding of mn={mn} "
                         f"(expected {padded_mn(mn)})")
    t = a.reshape(e, mnp // 32, ks // SCALE_K_BLOCK, K_LANES, 16, 2, 2)
    out = t.transpose(0, 1, 6, 4, 2, 5, 3).reshape(e, mnp, ks)[:, :mn]
    return out[0] if squeeze else out


# ---------------------------------------------------------------------------
# The registered Layout: a QuantizedArray's uint32 data and uint8 scales.


def _data_bytes(data):
    """uint32 [..., N, K/8] -> uint8 [E, N, K/2] (little-endian: byte 0 holds
    elements 0 and 1) and the leading shape."""
    lead, (n, w) = data.shape[:-2], data.shape[-2:]
    b = jax.lax.bitcast_convert_type(data, jnp.uint8)  # [..., N, K/8, 4]
    return b.reshape(-1, n, w * 4), lead


def _data_words(b, lead):
    e, n, kb = b.shape
    return jax.lax.bitcast_convert_type(b.reshape(e, n, kb // 4, 4), jnp.uint32).reshape(
        *lead, n, kb // 4)


def _unsupported(qw):
    if qw.mode != "mxfp4":
        return f"the cdna4 layout holds mxfp4 only; got mode={qw.mode!r}"
    n, k = qw.shape[-2:]
    if n % MN_LANES or k % (SCALE_K_BLOCK * qw.group_size):
        return (f"the cdna4 layout needs N % {MN_LANES} == 0 and K % 256 == 0 (16-row MFMA "
                f"tiles, 8 scales per 32-row scale block); got N={n}, K={k}")
    return None


def _pack(qw):
    b, lead = _data_bytes(qw.data)
    data = _data_words(preshuffle_b(b), lead)
    s = qw.scales
    scales = preshuffle_scales(s.reshape(-1, *s.shape[-2:]))
    return data, scales.reshape(*lead, *scales.shape[-2:]), None


def _unpack(qw):
    b, lead = _data_bytes(qw.data)
    data = _data_words(unshuffle_b(b), lead)
    s = qw.scales
    scales = unshuffle_scales(s.reshape(-1, *s.shape[-2:]), qw.data.shape[-2])
    return data, scales.reshape(*lead, *scales.shape[-2:]), None


LAYOUT = register(Layout(
    NAME, _pack, _unpack, _unsupported, platforms=(), row_block=SCALE_MN_BLOCK,
    doc="CDNA4 (gfx950) MXFP4 preshuffle: 16x64-byte B tiles and 32x8 scale blocks "
        "contiguous per wave (docs/cdna4.md)"))
