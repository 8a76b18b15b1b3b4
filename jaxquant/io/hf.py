"""Importers (and exporters) for the quantized checkpoints of the model hubs:
GPTQ, AWQ and compressed-tensors. Public through `jaxquant.io` (docs/checkpoints.md).

Every conversion is exact: ``jq.dequantize`` of the result, in the dtype the
reference dequantizer produces, is bit for bit what that dequantizer gives
(tests/test_io_hf.py compares against AutoGPTQ, AutoAWQ and compressed-tensors
themselves). Work is numpy on the host, vectorized; the results' children are
numpy arrays (``jax.device_put`` moves them).

Integer formats (GPTQ, AWQ, compressed-tensors int) dequantize as
``scale * (q - zero)`` with q and zero unsigned integers. They become jaxquant's
``affine`` mode (``scale * q + bias``) with ``bias = -scale * zero``. With a
float16 / bfloat16 scale that product is not always representable in the
scale's dtype, but it always is in float32 (11 + 8 significant bits), and so is
``scale * q + bias = scale * (q - zero)``, computed in float32 and rounded once to
the output dtype exactly as the references round their single product. So the
affine scales and biases are stored in the checkpoint's scale dtype where every
bias is exact in it (symmetric quantization: zero = 2**(bits-1)), else in
float32.

Group sizes: a group of the source that is a multiple of 32 becomes affine
groups of the largest of 128, 64, 32 that divides it, each repeating its scale
and bias (per-channel quantization is one group of K).
"""

from __future__ import annotations

import functools
import re

try:  # re's own parser: re._parser from Python 3.11, sre_parse before
    from re import _parser as _re_parser
except ImportError:  # pragma: no cover (Python 3.10)
    import sre_parse as _re_parser

import ml_dtypes
import numpy as np

from jaxquant import formats
from jaxquant.io._common import canonical, host_array
from jaxquant.quantize import check_float_dtype
from jaxquant.quantized_array import QuantizedArray

__all__ = ["from_awq", "from_compressed_tensors", "from_gptq", "to_awq", "to_compressed_tensors",
           "to_gptq"]

_AFFINE_GROUPS = (128, 64, 32)
#: AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_BITS = (2, 3, 4, 8)


# ---------------------------------------------------------------------------
# Bit streams (numpy): element k of a row at bits [k*bits, (k+1)*bits).


def unpack_stream(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint32 words [..., W] -> uint8/uint16 codes [..., count] (little-endian stream)."""
    words = np.ascontiguousarray(words.astype("<u4", copy=False))
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], -1)[..., :count].astype(np.uint8)
    stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    stream = stream[..., :count * bits].reshape(*words.shape[:-1], count, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(-1, dtype=np.uint8)


def pack_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [..., K] -> uint32 words [..., ceil(K*bits/32)], the inverse of unpack_stream."""
    codes = np.asarray(codes)
    k = codes.shape[-1]
    words = -(-k * bits // 32)
    if 32 % bits == 0:
        per = 32 // bits
        padded = np.zeros((*codes.shape[:-1], words * per), np.uint32)
        padded[..., :k] = codes
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        return (padded.reshape(*codes.shape[:-1], words, per) << shifts).sum(-1, dtype=np.uint32)
    bit_planes = (codes[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.zeros((*codes.shape[:-1], words * 32), np.uint8)
    stream[..., :k * bits] = bit_planes.reshape(*codes.shape[:-1], k * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


# ---------------------------------------------------------------------------
# Shared checks and the affine construction.


def _int_words(x, name: str) -> np.ndarray:
    """int32 / uint32 packed words -> uint32 (a view)."""
    x = host_array(x, name)
    if x.dtype not in (np.int32, np.uint32):
        raise TypeError(f"{name} must be int32 (packed words); got {x.dtype}")
    return x.view(np.uint32)


def _float_scales(x, name: str) -> np.ndarray:
    x = host_array(x, name)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a float array; got {x.dtype}")
    return x


def _packed_triplet(qweight, qzeros, scales):
    """GPTQ's / AWQ's (qweight, qzeros, scales), checked: uint32 views and float scales, 2-D."""
    qweight = _int_words(qweight, "qweight")
    qzeros = _int_words(qzeros, "qzeros")
    scales = _float_scales(scales, "scales")
    if qweight.ndim != 2 or qzeros.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"qweight, qzeros and scales must be 2-D; got {qweight.shape}, "
                         f"{qzeros.shape}, {scales.shape}")
    return qweight, qzeros, scales


def _check_bits(bits, allowed, fn: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in allowed:
        raise ValueError(f"{fn}: bits={bits!r} is not supported; expected one of {list(allowed)}")
    return int(bits)


def _affine_group(group: int, k: int) -> int:
    """The affine group size that tiles a source group of `group` elements."""
    if k % 32 or k <= 0:
        raise ValueError(f"K={k} (input features) must be a positive multiple of 32")
    for g in _AFFINE_GROUPS:
        if group % g == 0:
            return g
    raise ValueError(f"a quantization group of {group} elements is not a multiple of 32; no "
                     f"affine group size ({list(_AFFINE_GROUPS)}) tiles it exactly")


def _repeat_groups(a: np.ndarray, k: int, group: int) -> np.ndarray:
    """[..., N, G] per source group -> [..., N, K/group] per affine group."""
    reps = k // group // a.shape[-1]
    return a if reps == 1 else np.repeat(a, reps, axis=-1)


def _logical(dtype, fallback):
    return check_float_dtype("dtype", fallback if dtype is None else dtype)


def affine_from_zeros(codes_data: np.ndarray, scales: np.ndarray, zeros: np.ndarray, *,
                      bits: int, group: int, dtype) -> QuantizedArray:
    """value = scale * (q - zero) -> affine QuantizedArray, exactly (see the module doc).

    codes_data: uint32 [N, K*bits/32] (jaxquant's packing); scales float and zeros
    integer, both [N, G] with G = K / group.
    """
    n, w = codes_data.shape
    k = w * 32 // bits
    g = _affine_group(group, k)
    s32 = scales.astype(np.float32)
    bias32 = -(s32 * zeros.astype(np.float32))        # exact: <= 19 significant bits
    keep = scales.dtype
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = bias32.astype(keep)
    exact = np.array_equal(narrow.astype(np.float32), bias32, equal_nan=True)
    s, b = (scales, narrow) if exact else (s32, bias32)
    s, b = (np.ascontiguousarray(_repeat_groups(a, k, g)) for a in (s, b))
    return QuantizedArray(np.ascontiguousarray(codes_data), s, b, mode="affine", bits=bits,
                          group_size=g, dtype=dtype)


def affine_zeros(qw: QuantizedArray, fn: str) -> tuple[np.ndarray, np.ndarray]:
    """(scales float32 [N, G], integer zeros [N, G]) with bias == -scale * zero exactly;
    ValueError if qw's biases are not of that form (e.g. MLX-rule affine arrays).
    qw must be canonical (the exporters unpack a kernel layout first)."""
    if not isinstance(qw, QuantizedArray):
        raise TypeError(f"qw must be a QuantizedArray; got {type(qw).__name__}")
    if qw.mode != "affine" or qw.ndim != 2:
        raise ValueError(f"{fn} exports a 2-D affine QuantizedArray; "
                         f"got mode={qw.mode!r}, shape={qw.shape}")
    s = np.asarray(qw.scales).astype(np.float64)
    b = np.asarray(qw.biases).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s != 0, -b / s, 0.0)
    ok = (np.isfinite(z) & (z == np.round(z)) & (z >= 0) & (z < 2 ** qw.bits)
          & ((s != 0) | (b == 0)))
    if not ok.all():
        bad = tuple(int(i[0]) for i in np.nonzero(~ok))
        raise ValueError(f"{fn}: qw's bias is not -scale * zero with an integer zero in "
                         f"[0, {2 ** qw.bits - 1}] (first at group {bad}: scale {s[bad]}, bias "
                         f"{b[bad]}); only arrays of that form (e.g. imported ones) export")
    return s.astype(np.float32), z.astype(np.int64)


def _to_float16(s: np.ndarray, fn: str) -> np.ndarray:
    h = s.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), s, equal_nan=True):
        raise ValueError(f"{fn}: qw's scales are not all float16 values, which the format "
                         f"stores; exporting would round them")
    return h


# ---------------------------------------------------------------------------
# GPTQ


def _ones(bits: int) -> int:
    return sum(1 << s for s in range(0, 32, bits))


def _gptq_v1_zeros(qzeros: np.ndarray, bits: int, n: int) -> np.ndarray:
    """gptq (v1) packed zeros -> true zeros [G, N], as gptqmodel converts v1 to v2:
    2/4/8 bits: one add of 0x..0101 per int32 word (a carry crosses fields within
    the word: gptqmodel's v2 -> v1 subtraction borrows where a zero is 0, and the
    add undoes it exactly); 3 bits, whose fields straddle words: each field + 1
    modulo 8. For every stored field below 2**bits - 1 (all that auto-gptq's
    packer writes) this is auto-gptq's field + 1."""
    if bits == 3:
        return (unpack_stream(qzeros, bits, n) + 1) & 7
    words = ((qzeros.astype(np.int64) + _ones(bits)) & 0xFFFFFFFF).astype(np.uint32)
    return unpack_stream(words, bits, n)


def _gptq_v1_words(zeros: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of _gptq_v1_zeros: true zeros [G, N] -> gptq (v1) packed words."""
    if bits == 3:
        return pack_stream((zeros - 1) & 7, bits)
    words = pack_stream(zeros, bits).astype(np.int64)
    return ((words - _ones(bits)) & 0xFFFFFFFF).astype(np.uint32)


def from_gptq(qweight, qzeros, scales, g_idx=None, *, bits, checkpoint_format="gptq",
              dtype=None):
    """GPTQ (auto-gptq / gptqmodel) -> ``(qw, perm)``.

    qweight int32 [K*bits/32, N] (K packed along axis 0, element k at stream bits
    [k*bits, (k+1)*bits) of each column: the 3-bit packing straddles words the same
    way), qzeros int32 [G, N*bits/32] (packed along N), scales float [G, N], g_idx
    int [K] (the group of each input channel; None: k // (K/G)).
    checkpoint_format: "gptq" stores zero - 1 (auto-gptq, gptqmodel's default), read
    as gptqmodel reads it; "gptq_v2" stores zero.

    qw: affine QuantizedArray [N, K]; dtype is its logical dtype (default the
    scales' dtype). perm: None when every group is contiguous in K; else int32
    [K] (act-order / desc_act), and the weight is stored with its input channels
    in the order perm: ``x @ W.T == jq.qmm(x[..., perm], qw)`` and
    ``W == jq.dequantize(qw)[:, argsort(perm)]``.
    """
    bits = _check_bits(bits, GPTQ_BITS, "from_gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; expected 'gptq' or "
                         f"'gptq_v2'")
    qweight, qzeros, scales = _packed_triplet(qweight, qzeros, scales)
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != n or qzeros.shape != (groups, -(-n * bits // 32)):
        raise ValueError(f"for qweight {qweight.shape} (K={k}, N={n}) and {bits} bits, scales "
                         f"must be [G, {n}] and qzeros [G, {-(-n * bits // 32)}]; got scales "
                         f"{scales.shape}, qzeros {qzeros.shape}")
    if groups == 0 or k == 0 or k % groups:
        raise ValueError(f"K={k} is not a whole number of the {groups} groups of scales "
                         f"(both must be positive)")
    group = k // groups
    zeros = (_gptq_v1_zeros(qzeros, bits, n) if checkpoint_format == "gptq"
             else unpack_stream(qzeros, bits, n))
    data = np.ascontiguousarray(qweight.T)            # K's stream per row n
    perm = act_order_perm(g_idx, k, groups, "g_idx")
    if perm is not None:
        data = pack_stream(unpack_stream(data, bits, k)[:, perm], bits)
    qw = affine_from_zeros(data, scales.T, zeros.T, bits=bits, group=group,
                           dtype=_logical(dtype, scales.dtype))
    return qw, perm


def act_order_perm(g_idx, k: int, groups: int, name: str):
    """A group index per input channel (GPTQ's g_idx, compressed-tensors'
    weight_g_idx) -> None where the groups are contiguous in K (k // group), else the
    int32 permutation that sorts the channels by group (stable): the codes in that
    order have contiguous groups. ValueError unless each group has exactly K/groups
    channels."""
    if g_idx is None:
        return None
    g_idx = host_array(g_idx, name)
    group = k // groups
    if g_idx.shape != (k,) or g_idx.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of shape ({k},); got "
                         f"{g_idx.shape} {g_idx.dtype}")
    if np.array_equal(g_idx, np.arange(k) // group):
        return None
    lo, hi = int(g_idx.min()), int(g_idx.max())
    if lo < 0 or hi >= groups:  # before bincount, which allocates max + 1 counters
        raise ValueError(f"{name} must hold group numbers in [0, {groups}); got values "
                         f"from {lo} to {hi}")
    counts = np.bincount(g_idx.astype(np.int64), minlength=groups)
    if np.any(counts != group):
        raise ValueError(f"{name} must put exactly {group} input channels in each of the "
                         f"{groups} groups; got counts {counts.tolist()[:8]}...")
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def to_gptq(qw: QuantizedArray, perm=None, *, checkpoint_format="gptq"):
    """Inverse of from_gptq: ``(qweight int32, qzeros int32, scales float16, g_idx int32)``.

    qw's biases must be ``-scale * zero`` with integer zeros (as imported) and its
    scales float16 values. The groups are qw's (a source group wider than 128
    comes back as several groups with equal scales: the same values).
    """
    qw = canonical(qw)
    s, z = affine_zeros(qw, "to_gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; expected 'gptq' or "
                         f"'gptq_v2'")
    bits = _check_bits(qw.bits, GPTQ_BITS, "to_gptq")
    n, k = qw.shape
    data = np.asarray(qw.data)
    g_idx = (np.arange(k) // qw.group_size).astype(np.int32)
    if perm is not None:
        perm = host_array(perm, "perm")
        if perm.shape != (k,) or not np.array_equal(np.sort(perm), np.arange(k)):
            raise ValueError(f"perm must be a permutation of range({k})")
        g_idx[perm] = np.arange(k) // qw.group_size
        data = pack_stream(unpack_stream(data, bits, k)[:, np.argsort(perm)], bits)
    qzeros = _gptq_v1_words(z.T, bits) if checkpoint_format == "gptq" else pack_stream(z.T, bits)
    return (np.ascontiguousarray(data.T).view(np.int32), qzeros.view(np.int32),
            _to_float16(s, "to_gptq").T.copy(), g_idx)


# ---------------------------------------------------------------------------
# AWQ (AutoAWQ GEMM)


def from_awq(qweight, qzeros, scales, *, bits=4, dtype=None) -> QuantizedArray:
    """AutoAWQ GEMM (``version: gemm``) -> affine QuantizedArray [N, K].

    qweight int32 [K, N/8] and qzeros int32 [G, N/8] are packed along N: nibble
    i of word j holds column 8j + AWQ_ORDER[i]; scales float16 [G, N]; the zero
    is stored as is. dtype: the logical dtype (default the scales').
    """
    bits = _check_bits(bits, (4,), "from_awq")
    qweight, qzeros, scales = _packed_triplet(qweight, qzeros, scales)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if scales.shape[1] != n or qzeros.shape != (groups, n // 8) or not groups or k % groups:
        raise ValueError(f"for qweight {qweight.shape} (K={k}, N={n}), scales must be [G, {n}] "
                         f"and qzeros [G, {n // 8}] with G dividing K; got scales "
                         f"{scales.shape}, qzeros {qzeros.shape}")
    order = np.argsort(AWQ_ORDER)                     # column c of 8 sits at nibble order[c]

    def columns(words):                               # [R, N/8] -> [R, N] in column order
        nib = unpack_stream(words, 4, words.shape[-1] * 8).reshape(*words.shape, 8)
        return nib[..., order].reshape(words.shape[0], -1)

    data = pack_stream(columns(qweight).T, 4)
    return affine_from_zeros(data, scales.T, columns(qzeros).T, bits=4, group=k // groups,
                             dtype=_logical(dtype, scales.dtype))


def to_awq(qw: QuantizedArray):
    """Inverse of from_awq: ``(qweight int32 [K, N/8], qzeros int32 [G, N/8], scales float16
    [G, N])``; qw must be 4-bit affine with ``bias = -scale * zero`` (as imported)."""
    qw = canonical(qw)
    s, z = affine_zeros(qw, "to_awq")
    _check_bits(qw.bits, (4,), "to_awq")
    n, k = qw.shape
    if n % 8:
        raise ValueError(f"to_awq packs N along int32 words: N={n} must be a multiple of 8")

    def words(cols):                                  # [R, N] -> [R, N/8] in AWQ order
        r = cols.shape[0]
        return pack_stream(cols.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)].reshape(r, n), 4)

    codes = unpack_stream(np.asarray(qw.data), 4, k)  # [N, K]
    return (words(codes.T).view(np.int32), words(z.T).view(np.int32),
            _to_float16(s, "to_awq").T.copy())


# ---------------------------------------------------------------------------
# compressed-tensors


#: Bounds on compressed-tensors' "re:" patterns and the module names they are matched
#: against (real ones: under 200 characters, one or two repeats): with at most
#: MAX_REPEATS repeats, none inside another, a match backtracks through at most about
#: MAX_NAME ** MAX_REPEATS states (0.02 s).
MAX_PATTERN, MAX_NAME, MAX_REPEATS = 1000, 256, 3
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def _pattern_nodes(tree, inside=False):
    """(op name, inside a repeat, is a repeat) for every node of a parsed pattern."""
    for op, arg in tree:
        name = str(op)
        rep = name in _REPEATS and arg[1] != 1
        yield name, inside, rep
        for a in (arg if isinstance(arg, (list, tuple)) else (arg,)):
            for sub in (a if isinstance(a, (list, tuple)) else (a,)):
                if hasattr(sub, "data"):
                    yield from _pattern_nodes(sub, inside or rep)


@functools.lru_cache(maxsize=256)
def checked_pattern(pattern: str):
    """A compressed-tensors "re:" target or ignore pattern, compiled, if it matches in
    bounded time (docs/checkpoints.md, "Validation"): at most MAX_PATTERN characters and
    MAX_REPEATS repeats, and no repeat or alternation inside a repeat ("(a+)*",
    "(.*.*)*", "(a|b)*": backtracking over them grows exponentially with the name's
    length). ValueError otherwise."""
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"the pattern 're:{pattern[:40]}...' is longer than {MAX_PATTERN} "
                         f"characters")
    try:
        nodes = list(_pattern_nodes(_re_parser.parse(pattern)))
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"the pattern 're:{pattern[:80]}' is not a regular expression ({e})") \
            from None
    if any(inside and (rep or name == "BRANCH") for name, inside, rep in nodes):
        raise ValueError(f"the pattern 're:{pattern[:80]}' has a repeat or alternation inside a "
                         f"repeat, which can take exponential time to match; write it without "
                         f"(e.g. '(.*)*' as '.*', '(a|b)*' as '[ab]*')")
    if sum(rep for _, _, rep in nodes) > MAX_REPEATS:
        raise ValueError(f"the pattern 're:{pattern[:80]}' has more than {MAX_REPEATS} repeats")
    return compiled


def _matches(target, prefix: str) -> bool:
    if not isinstance(target, str):
        raise ValueError(f"compressed-tensors targets and ignore entries must be strings; got "
                         f"{target!r:.80}")
    if target.startswith("re:"):
        if len(prefix) > MAX_NAME:
            raise ValueError(f"module name {prefix[:40]!r}... is longer than {MAX_NAME} "
                             f"characters")
        return checked_pattern(target[3:]).match(prefix) is not None
    return target == prefix or target == "Linear"


def compressed_tensors_scheme(quant_config: dict, prefix: str):
    """(format, weights args) of the config group whose targets match module
    `prefix` (a Linear), or None when none does or `ignore` lists it."""
    if not isinstance(quant_config, dict) or "config_groups" not in quant_config:
        raise ValueError("quant_config must be a compressed-tensors quantization_config dict "
                         "(with 'config_groups')")
    ignore, groups = quant_config.get("ignore") or [], quant_config["config_groups"]
    if not isinstance(ignore, list) or not isinstance(groups, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("targets", []), list)
            for g in groups.values()):
        raise ValueError("quant_config's 'ignore' must be a list and 'config_groups' an object "
                         "of objects whose 'targets' are lists")
    if any(_matches(t, prefix) and t != "Linear" for t in ignore):
        return None
    for group in groups.values():
        if any(_matches(t, prefix) for t in group.get("targets", ())):
            fmt = group.get("format") or quant_config.get("format")
            weights = group.get("weights") or {}
            if not isinstance(weights, dict):
                raise ValueError(f"quant_config's config group 'weights' must be an object; got "
                                 f"{weights!r:.80}")
            return fmt, weights
    return None


def from_compressed_tensors(tensors: dict, prefix: str, quant_config: dict, *, dtype=None,
                            exact: bool = True) -> QuantizedArray:
    """The weight of module `prefix` of a compressed-tensors checkpoint -> QuantizedArray.

    tensors: name -> array (``{prefix}.weight_packed`` / ``.weight`` and
    ``.weight_scale``, ``.weight_zero_point``, ``.weight_global_scale``).
    quant_config: config.json's ``quantization_config``.
    Formats: ``pack-quantized`` int 2/4/8 bits and ``int-quantized`` int8 (group,
    channel or tensor strategy, symmetric or not) -> affine; ``mxfp4-pack-quantized``,
    ``mxfp6-pack-quantized`` (E2M3), ``mxfp8-quantized`` -> the MX mode, a byte copy;
    ``nvfp4-pack-quantized`` -> ``fp4`` with group 16 and float32 scales
    ``e4m3_scale / global_scale`` (the reference divides each block scale by the
    global scale in float32, a value nvfp4's ``e4m3 * global`` product cannot always
    reproduce); with exact=False -> ``nvfp4`` with ``global_scale = 1 / global``
    (a float32 rounding per element away from the reference, a quarter of the scale
    bytes). ``float-quantized`` (FP8 with float per-tensor/channel scales) is refused:
    no mode holds E4M3 codes with a free float scale (mxfp8's scales are powers of 2).
    ``weight_g_idx`` (group act-order: input channel k in group weight_g_idx[k]) is
    refused here unless its groups are contiguous: `from_compressed_tensors_act_order`
    returns the weight with its permutation.
    """
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> array; got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    scheme = compressed_tensors_scheme(quant_config, prefix)
    if scheme is None:
        raise ValueError(f"module {prefix!r} is not quantized by quant_config (no config group "
                         f"targets it, or it is ignored)")
    fmt, args = scheme
    g_idx_name = f"{prefix}.weight_g_idx"
    if g_idx_name in tensors:
        qw = from_compressed_tensors({t: v for t, v in tensors.items() if t != g_idx_name},
                                     prefix, quant_config, dtype=dtype, exact=exact)
        groups = qw.shape[-1] // qw.group_size
        if act_order_perm(tensors[g_idx_name], qw.shape[-1], groups, g_idx_name) is not None:
            raise ValueError(f"{g_idx_name}: group act-order (input channels of a group are "
                             f"not contiguous in K); jq.io.from_compressed_tensors_act_order "
                             f"reads it with its permutation (models.checkpoint.load does)")
        return qw

    def get(part, required=True):
        name = f"{prefix}.{part}"
        if name not in tensors:
            if required:
                near = sorted(t for t in tensors if t.startswith(prefix))
                raise ValueError(f"tensors has no {name} (format {fmt!r}); keys starting with "
                                 f"the prefix: {near}")
            return None
        return host_array(tensors[name], f"tensors[{name!r}]")

    if fmt in ("pack-quantized", "int-quantized", "naive-quantized"):
        if args.get("type", "int") != "int":
            raise ValueError(f"{prefix}: format {fmt!r} with weights type {args.get('type')!r}"
                             f" is not supported (int only)")
        return _ct_int(fmt, args, get, dtype)
    if fmt == "nvfp4-pack-quantized":
        return _ct_nvfp4(get, dtype, exact)
    if fmt in ("mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized"):
        return _ct_mx(fmt, get, dtype)
    if fmt == "float-quantized":
        raise ValueError(f"{prefix}: compressed-tensors 'float-quantized' (FP8 E4M3 with a float "
                         f"scale per tensor or channel) maps onto no jaxquant mode exactly: "
                         f"mxfp8's scales are powers of two per 32 elements")
    raise ValueError(f"{prefix}: compressed-tensors format {fmt!r} is not supported")


def from_compressed_tensors_act_order(tensors: dict, prefix: str, quant_config: dict, *,
                                      dtype=None, exact: bool = True):
    """`from_compressed_tensors` for a module that may carry ``weight_g_idx`` (group
    act-order: input channel k uses the scale and zero point of group
    weight_g_idx[k]) -> (qw, perm) as `from_gptq` returns them: perm None where the
    groups are contiguous, else int32 [K] with the codes stored in that order, so
    ``x @ W.T == jq.qmm(x[..., perm], qw)`` and ``W == jq.dequantize(qw)[:, argsort(perm)]``."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of name -> array; got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    g_idx_name = f"{prefix}.weight_g_idx"
    g_idx = tensors.get(g_idx_name)
    qw = from_compressed_tensors({t: v for t, v in tensors.items() if t != g_idx_name}, prefix,
                                 quant_config, dtype=dtype, exact=exact)
    k = qw.shape[-1]
    perm = act_order_perm(g_idx, k, k // qw.group_size, g_idx_name)
    if perm is None:
        return qw, None
    if qw.mode != "affine":
        raise ValueError(f"{g_idx_name}: group act-order with mode {qw.mode!r}; only the int "
                         f"formats (affine) carry it")
    codes = unpack_stream(np.asarray(qw.data), qw.bits, k)[:, perm]
    return QuantizedArray(pack_stream(codes, qw.bits), qw.scales, qw.biases, mode="affine",
                          bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype), perm


def _ct_int(fmt, args, get, dtype) -> QuantizedArray:
    bits = args.get("num_bits", 8)
    strategy = args.get("strategy", "tensor")
    scale = _float_scales(get("weight_scale"), "weight_scale")
    if fmt == "pack-quantized":
        _check_bits(bits, (2, 4, 8), "from_compressed_tensors (pack-quantized)")
        packed = _int_words(get("weight_packed"), "weight_packed")
        shape = get("weight_shape", required=False)
        n, k = (int(shape[0]), int(shape[1])) if shape is not None else (
            packed.shape[0], packed.shape[1] * 32 // bits)
        if packed.shape != (n, -(-k * bits // 32)):
            raise ValueError(f"weight_packed {packed.shape} does not hold [{n}, {k}] at {bits} "
                             f"bits")
        data = np.ascontiguousarray(packed)           # stream of q + 2**(bits-1) along K
    else:
        _check_bits(bits, (8,), f"from_compressed_tensors ({fmt})")
        w = host_array(get("weight"), "weight")
        if w.dtype != np.int8 or w.ndim != 2:
            raise TypeError(f"{fmt} weight must be 2-D int8; got {w.shape} {w.dtype}")
        n, k = w.shape
        data = (w.view(np.uint8) ^ 0x80).view("<u4").astype(np.uint32)  # q + 128
    scale = scale.reshape(scale.shape[0] if scale.ndim == 2 else 1, -1)  # tensor: [1] or []
    scale = np.broadcast_to(scale, (n, scale.shape[1]))
    groups = scale.shape[-1]
    if strategy == "group":
        group = args.get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
            raise ValueError(f"weights group_size={group!r} must be a positive int for the "
                             f"group strategy")
        if groups * group != k:
            raise ValueError(f"weight_scale has {groups} groups of {group} for K={k}")
    elif groups == 1:
        group = k
    else:
        raise ValueError(f"strategy {strategy!r} with weight_scale {scale.shape} is not "
                         f"supported (group, channel or tensor)")
    offset = 1 << (bits - 1)
    zp = get("weight_zero_point", required=False)
    if args.get("symmetric", True) or zp is None:
        zeros = np.full((n, groups), offset, np.int64)
    elif zp.dtype == np.int32 and fmt == "pack-quantized":   # packed along N (axis 0)
        zeros = unpack_stream(zp.view(np.uint32).T, bits, n).T.astype(np.int64)
    else:                                              # int8 [N, G] (tensor: [1]), signed
        zp = zp.reshape(zp.shape[0] if zp.ndim == 2 else 1, -1).astype(np.int64) + offset
        zeros = np.broadcast_to(zp, (n, groups))
    return affine_from_zeros(data, np.ascontiguousarray(scale), zeros, bits=bits, group=group,
                             dtype=_logical(dtype, scale.dtype))


def _u8(x, name):
    x = np.asarray(x)
    if x.dtype.itemsize != 1:
        raise TypeError(f"{name} must be one byte per element (uint8 / float8); got {x.dtype}")
    return np.ascontiguousarray(x).view(np.uint8)


def _ct_nvfp4(get, dtype, exact) -> QuantizedArray:
    packed = _u8(get("weight_packed"), "weight_packed")     # [N, K/2], element 2j low nibble
    codes8 = _u8(get("weight_scale"), "weight_scale")       # E4M3 [N, K/16]
    gscale = np.asarray(get("weight_global_scale"), np.float32).reshape(-1)
    if gscale.size != 1:
        raise ValueError(f"weight_global_scale must hold one value; got {gscale.shape}")
    data = packed.view("<u4").astype(np.uint32)
    if not exact:
        return QuantizedArray(data, codes8, global_scale=np.float32(1) / gscale[0], mode="nvfp4",
                              bits=4, group_size=16, dtype=_logical(dtype, np.float32))
    e4m3 = np.asarray(formats.decode_e4m3(codes8), np.float32)
    scales = (e4m3 / gscale[0]).astype(np.float32)          # IEEE float32 division, as torch
    return QuantizedArray(data, scales, mode="fp4", bits=4, group_size=16,
                          dtype=_logical(dtype, np.float32))


_CT_MX = {"mxfp4-pack-quantized": ("mxfp4", "weight_packed"),
          "mxfp6-pack-quantized": ("mxfp6_e2m3", "weight_packed"),
          "mxfp8-quantized": ("mxfp8_e4m3", "weight")}


def _ct_mx(fmt, get, dtype) -> QuantizedArray:
    mode, part = _CT_MX[fmt]
    payload = _u8(get(part), part)
    scales = _u8(get("weight_scale"), "weight_scale")
    return QuantizedArray(payload.view("<u4").astype(np.uint32), scales, mode=mode,
                          bits=formats.FORMATS[mode].bits[0], group_size=32,
                          dtype=_logical(dtype, np.float32))


_MX_CT = {mode: (fmt, part) for fmt, (mode, part) in _CT_MX.items()}


def to_compressed_tensors(qw: QuantizedArray, prefix: str) -> tuple[dict, dict]:
    """Inverse of from_compressed_tensors where the format holds qw exactly:
    ``(tensors, config_group)``, tensors named ``{prefix}.weight_packed`` ... and
    config_group the ``{"format", "weights"}`` entry of ``config_groups``.

    affine 2/4/8-bit with ``bias = -scale * zero`` (integer zeros, as imported) ->
    ``pack-quantized`` int, group strategy, symmetric where every zero is
    2**(bits-1); scales in qw's logical dtype where they are exact in it, else
    float32. mxfp4 / mxfp6_e2m3 / mxfp8_e4m3 -> the MX formats (a byte copy).
    Other modes raise ValueError (fp4's float32 scales are not e4m3 / global for
    a known global scale).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    qw = canonical(qw)
    if qw.mode in _MX_CT:
        fmt, part = _MX_CT[qw.mode]
        payload = np.ascontiguousarray(np.asarray(qw.data), "<u4").view(np.uint8)
        if part == "weight":
            payload = payload.view(ml_dtypes.float8_e4m3fn)
        args = {"num_bits": qw.bits, "type": "float", "symmetric": True, "strategy": "group",
                "group_size": 32, "scale_dtype": "torch.uint8"}
        return ({f"{prefix}.{part}": payload, f"{prefix}.weight_scale": np.asarray(qw.scales)},
                {"format": fmt, "weights": args})
    s, z = affine_zeros(qw, "to_compressed_tensors")
    bits = _check_bits(qw.bits, (2, 4, 8), "to_compressed_tensors")
    n, k = qw.shape
    offset = 1 << (bits - 1)
    symmetric = bool(np.all(z == offset))
    logical = np.dtype(qw.dtype)
    scale = s.astype(logical) if np.array_equal(s.astype(logical).astype(np.float32), s) else s
    tensors = {f"{prefix}.weight_packed": np.asarray(qw.data).view(np.int32),
               f"{prefix}.weight_scale": scale,
               f"{prefix}.weight_shape": np.array([n, k], np.int64)}
    if not symmetric:
        tensors[f"{prefix}.weight_zero_point"] = pack_stream(z.T, bits).T.copy().view(np.int32)
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
            "group_size": qw.group_size}
    return tensors, {"format": "pack-quantized", "weights": args}
