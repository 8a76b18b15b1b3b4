"""Imported GPTQ / AWQ / compressed-tensors arrays through the GPU kernels: the
affine arrays carry float32 (asymmetric) or float16 (symmetric) scales and
biases whatever x's dtype, the exact NVFP4 import is fp4 with float32 scales in
groups of 16 — scale dtypes that jq.quantize never makes. qmm by the automatic
choice, by Pallas and by the cuda_mma FFI kernels against the float64 oracle.
Skipped without a CUDA GPU (the arrays are random words: no torch needed)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.io import hf as io_hf
from tests.common import assert_matmul_close, deq64, rand
from tests.test_decode_gpu import _cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU and the CUDA library")]

RNG = np.random.default_rng(2929)
N, K = 96, 512


def _gptq(bits, sym):
    qweight = RNG.integers(0, 2 ** 32, (K * bits // 32, N), dtype=np.uint32).view(np.int32)
    if sym:  # every stored zero 2**(bits-1) - 1: true zero 2**(bits-1), float16 scales kept
        qzeros = io_hf.pack_stream(np.full((K // 128, N), 2 ** (bits - 1) - 1), bits)
    else:
        qzeros = RNG.integers(0, 2 ** 32, (K // 128, N * bits // 32), dtype=np.uint32)
    scales = (RNG.random((K // 128, N)) * 0.02 + 1e-3).astype(np.float16)
    qw, _ = jq.io.from_gptq(qweight, qzeros.view(np.int32), scales, bits=bits)
    assert qw.scales.dtype == (np.float16 if sym else np.float32)
    return qw


def _awq():
    qweight = RNG.integers(0, 2 ** 32, (K, N // 8), dtype=np.uint32).view(np.int32)
    qzeros = RNG.integers(0, 2 ** 32, (K // 64, N // 8), dtype=np.uint32).view(np.int32)
    scales = (RNG.random((K // 64, N)) * 0.02 + 1e-3).astype(np.float16)
    return jq.io.from_awq(qweight, qzeros, scales)


def _nvfp4_exact():
    packed = RNG.integers(0, 256, (N, K // 2), dtype=np.uint8)
    scale = RNG.integers(0x08, 0x70, (N, K // 16), dtype=np.uint8)   # finite E4M3 codes
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale,
               "m.weight_global_scale": np.array([3.7], np.float32)}
    config = {"format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                           "strategy": "tensor_group", "group_size": 16}}}}
    qw = jq.io.from_compressed_tensors(tensors, "m", config)
    assert (qw.mode, qw.group_size, qw.scales.dtype) == ("fp4", 16, np.float32)
    return qw


CASES = {**{f"gptq{b}": (lambda b=b: _gptq(b, False)) for b in (2, 3, 4, 8)},
         "gptq4_sym": lambda: _gptq(4, True), "awq": _awq, "nvfp4_exact": _nvfp4_exact}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [None, "pallas", "ffi_cuda_mma"])
def test_imported_arrays_on_the_gpu_kernels(case, backend):
    qw = CASES[case]()
    w64 = deq64(qw)
    weights = jq.prepack(qw, layout="cuda_mma") if backend == "ffi_cuda_mma" else qw
    for dt in (jnp.float16, jnp.bfloat16):
        for m in (1, 8, 64):
            x = rand(m, (m, K), dt)
            y = jq.qmm(x, weights, backend="ffi" if backend == "ffi_cuda_mma" else backend)
            assert y.dtype == jnp.dtype(dt)
            assert_matmul_close(y, x, w64, jnp.dtype(dt))
