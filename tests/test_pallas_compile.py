"""ROCm (and CUDA) compile checks of the Pallas qmm kernels, on a CPU-only machine.

Each kernel is lowered with `lowering_platforms=("rocm",)` (resp. "cuda"); the
Triton module is taken from the `__gpu$xla.gpu.triton` custom call, printed as
text with jaxlib's MLIR context and compiled with the pip `triton` package for
gfx90a / gfx942 / gfx950 / gfx1100 (resp. sm_90, sm_80); a code object must
come out. Needs `pip install triton` (see tests/pallas_compile.py).
"""

import os
import re

import jax
import jax.numpy as jnp
import pytest

import jaxquant as jq
from jaxquant.pallas.qmm import qmm
from tests import pallas_compile as cc

triton = pytest.importorskip(
    "triton", reason="the ROCm/CUDA compile checks need the pip `triton` package "
                     "(pip install triton)")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
pytestmark = pytest.mark.toolchain

ALL_FORMATS = [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 4, 64), ("affine", 5, 32),
    ("affine", 6, 64), ("affine", 8, 128),
    ("mxfp4", 4, 32), ("mxfp6_e2m3", 6, 32), ("mxfp6_e3m2", 6, 32),
    ("mxfp8_e4m3", 8, 32), ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16), ("fp4", 4, 32),
    ("iq4nl", 4, 32),
]
# kernel kind -> (M, transpose)
KINDS = {"gemv_t": (1, True), "skinny_t": (16, True), "gemm_t": (256, True),
         "gemv_n": (1, False), "gemm_n": (256, False)}
ROCM = [t for t in cc.ROCM_TARGETS]
CUDA = [cc.CUDA_TARGETS[0]]


def _kernels(fmt, kind, platform, dtype=jnp.bfloat16):
    mode, bits, group = fmt
    m, transpose = KINDS[kind]
    n, k = 1000, 2048                       # N not a multiple of any block
    shape = (n, k) if transpose else (k, n - n % group)
    qw = jax.eval_shape(
        lambda w: jq.quantize(w, mode=mode, bits=bits, group_size=group),
        jax.ShapeDtypeStruct(shape, dtype))
    x = jax.ShapeDtypeStruct((m, k), dtype)
    kernels = cc.triton_kernels(
        lambda x, qw: qmm(x, qw, transpose=transpose, platform=platform), x, qw,
        platform=platform)
    assert len(kernels) == 1, kernels
    return kernels


_compile_all = cc.compile_all


def _fid(f):
    return "-".join(map(str, f))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_fid)
def test_rocm_gemv_every_format(fmt):
    _compile_all(_kernels(fmt, "gemv_t", "rocm"), [("hip", "gfx942", 64)])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("mxfp6_e3m2", 6, 32),
                                 ("mxfp8_e5m2", 8, 32), ("nvfp4", 4, 16)], ids=_fid)
def test_rocm_every_kernel_every_target(fmt, kind):
    _compile_all(_kernels(fmt, kind, "rocm"), ROCM)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: d.__name__)
def test_rocm_activation_dtypes(dtype, kind):
    _compile_all(_kernels(("affine", 4, 64), kind, "rocm", dtype), ROCM)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fmt", [("affine", 4, 64), ("mxfp4", 4, 32), ("affine", 3, 64),
                                 ("iq4nl", 4, 32)], ids=_fid)
def test_cuda_every_kernel(fmt, kind):
    _compile_all(_kernels(fmt, kind, "cuda"), CUDA)


def test_text_route_module_is_triton():
    (kernel,) = _kernels(("mxfp4", 4, 32), "gemv_t", "rocm")
    text = kernel.text()
    assert "tt.func" in text and "tt.load" in text


# --- gather_qmm (routed MoE decode): the expert-indexed GEMV -----------------------


def _gather_kernels(fmt, platform, transpose=True, per_slot=False, dtype=jnp.bfloat16,
                    via_dispatch=False):
    import jaxquant.pallas  # noqa: F401 - registers the Pallas lowerings
    from jaxquant.pallas import moe

    mode, bits, group = fmt
    e, n, k, t, slots = 8, 1000, 2048, 2, 4          # N not a multiple of any block
    shape = (e, n, k) if transpose else (e, k, n - n % group)
    qw = jax.eval_shape(lambda w: jq.quantize(w, mode=mode, bits=bits, group_size=group),
                        jax.ShapeDtypeStruct(shape, dtype))
    x = jax.ShapeDtypeStruct((t, slots, k) if per_slot else (t, k), dtype)
    idx = jax.ShapeDtypeStruct((t, slots), jnp.int32)
    if via_dispatch:
        fn = lambda x, qw, idx: jq.gather_qmm(x, qw, idx, transpose=transpose)
    else:
        fn = lambda x, qw, idx: moe.gather_qmm(x, qw, idx, transpose=transpose,
                                               platform=platform)
    kernels = cc.triton_kernels(fn, x, qw, idx, platform=platform)
    assert len(kernels) == 1, kernels
    assert kernels[0].name in ("kernel",) or "gather_qmm" in kernels[0].name, kernels[0].name
    return kernels


def test_rocm_gather_through_dispatch_every_target():
    # jq.gather_qmm under automatic choice lowers to the Pallas kernel on ROCm.
    _compile_all(_gather_kernels(("mxfp4", 4, 32), "rocm", via_dispatch=True), ROCM)


@pytest.mark.parametrize("case", [(("affine", 4, 64), True, True), (("mxfp6_e3m2", 6, 32), True,
                                                                     False),
                                  (("nvfp4", 4, 16), False, False)],
                         ids=lambda c: f"{_fid(c[0])}-{'t' if c[1] else 'n'}")
def test_rocm_gather_formats(case):
    fmt, transpose, per_slot = case
    _compile_all(_gather_kernels(fmt, "rocm", transpose, per_slot), [("hip", "gfx942", 64),
                                                                      ("hip", "gfx1100", 32)])


@pytest.mark.parametrize("case", [(("affine", 8, 128), True, True, "gfx942"),
                                  (("mxfp6_e2m3", 6, 32), True, False, "gfx950"),
                                  (("mxfp8_e5m2", 8, 32), False, True, "gfx942"),
                                  (("fp4", 4, 32), True, False, "gfx1100")],
                         ids=lambda c: f"{_fid(c[0])}-{'t' if c[1] else 'n'}-{c[3]}")
def test_rocm_gather_more_formats(case):
    fmt, transpose, per_slot, arch = case
    target = next(t for t in ROCM if t[1] == arch)
    _compile_all(_gather_kernels(fmt, "rocm", transpose, per_slot), [target])


@pytest.mark.parametrize("fmt", [("mxfp4", 4, 32), ("affine", 4, 64), ("mxfp8_e4m3", 8, 32)],
                         ids=_fid)
def test_cuda_gather_sm90(fmt):
    _compile_all(_gather_kernels(fmt, "cuda", per_slot=fmt[0] == "affine"), CUDA)


# --- gather_matmul (routed MoE decode on float experts): the float expert GEMV --------


def _gather_matmul_kernels(platform, dtype, per_slot=False):
    import jaxquant.pallas  # noqa: F401 - registers the Pallas lowerings

    e, n, k, t, slots = 32, 2880, 2880, 2, 4          # gpt-oss-20b's down projection
    sd = jax.ShapeDtypeStruct
    x = sd((t, slots, k) if per_slot else (t, k), dtype)
    kernels = cc.triton_kernels(jq.gather_matmul, x, sd((e, n, k), dtype),
                                sd((t, slots), jnp.int32), platform=platform)
    assert [kk.name for kk in kernels] == [f"jq_gather_matmul_{jnp.dtype(dtype).name}"]
    return kernels


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_rocm_gather_matmul_every_target(dtype):
    _compile_all(_gather_matmul_kernels("rocm", dtype, per_slot=dtype == jnp.float32), ROCM)


def test_cuda_gather_matmul_sm90_streams_16_byte_loads():
    # K = 2880 is not a power of two (a masked tail), yet the weight tile loads stay
    # 16 bytes wide: the kernel's bandwidth rests on it.
    (kernel,) = _gather_matmul_kernels("cuda", jnp.bfloat16)
    compiled = cc.compile_kernel(kernel, *CUDA[0])
    assert len(cc.code_object(compiled)) > 0
    assert "ld.global.v4.b32" in compiled.asm["ptx"]


# --- ragged_matmul (routed MoE prefill on float experts): the float ragged GEMM -------


def _ragged_matmul_kernels(platform, dtype, rows=2048):
    import jaxquant.pallas  # noqa: F401 - registers the Pallas lowerings

    e, n, k = 32, 2880, 2880                          # gpt-oss-20b's down projection
    sd = jax.ShapeDtypeStruct
    kernels = cc.triton_kernels(jq.ragged_matmul, sd((rows, k), dtype), sd((e, n, k), dtype),
                                sd((e,), jnp.int32), platform=platform)
    assert [kk.name for kk in kernels] == [f"jq_ragged_matmul_{jnp.dtype(dtype).name}"]
    return kernels


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_rocm_ragged_matmul_every_target(dtype):
    _compile_all(_ragged_matmul_kernels("rocm", dtype), ROCM)


@pytest.mark.parametrize("rows", [256, 4096])
def test_cuda_ragged_matmul_sm90(rows):
    # both tile classes of RAGGED_FLOAT_CONFIGS (32- and 128-row work items)
    _compile_all(_ragged_matmul_kernels("cuda", jnp.bfloat16, rows), CUDA)


# ---------------------------------------------------------------------------
# Norm kernels (jaxquant/pallas/norms.py): one representative case per kernel
# shape (one pass with a masked tail, two passes over column steps, many narrow
# rows per program, batched groups with mixed dtypes).

def _norm_cases(platform):
    from jaxquant.pallas import norms as pn

    S = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    return {
        "rms_onepass_5376": (lambda x, w: pn.rms_norm(x, w, platform=platform),
                             (S((4096, 5376), bf), S((5376,), bf))),
        "rms_twopass_20000": (lambda x, w: pn.rms_norm(x, w, platform=platform),
                              (S((3, 20000), f32), S((20000,), bf))),
        "add_heads_128": (lambda x, r, w: pn.add_rms_norm(x, r, w, platform=platform),
                          (S((32768, 128), bf), S((32768, 128), bf), S((128,), bf))),
        "gated_groups": (lambda x, g, w: pn.gated_rms_norm(
            x, g, w, group_size=128, norm_before_gate=False, activation="sigmoid",
            platform=platform), (S((64, 4096), f32), S((64, 4096), bf), S((4096,), bf))),
        # gated_rms_norm's other combinations: silu with the norm before the gate (no
        # groups), sigmoid with the gate before the norm on a masked-tail row, and silu
        # before the gate over many narrow groups per program.
        "gated_silu_before": (lambda x, g, w: pn.gated_rms_norm(
            x, g, w, norm_before_gate=True, activation="silu", platform=platform),
            (S((64, 4096), f32), S((64, 4096), bf), S((4096,), bf))),
        "gated_sigmoid_after_5376": (lambda x, g, w: pn.gated_rms_norm(
            x, g, w, norm_before_gate=False, activation="sigmoid", platform=platform),
            (S((16, 5376), bf), S((16, 5376), bf), S((5376,), bf))),
        "gated_silu_before_groups_64": (lambda x, g, w: pn.gated_rms_norm(
            x, g, w, group_size=64, norm_before_gate=True, activation="silu",
            platform=platform), (S((32, 2048), f32), S((32, 2048), bf), S((2048,), f32))),
    }


NORM_CASES = sorted(_norm_cases("rocm"))
NORM_ROCM = list(cc.ROCM_TARGETS)      # gfx90a, gfx942, gfx950 (pip triton >= 3.9), gfx1100


@pytest.mark.parametrize("case", NORM_CASES)
def test_rocm_norm_kernels(case):
    fn, args = _norm_cases("rocm")[case]
    kernels = cc.triton_kernels(fn, *args, platform="rocm")
    assert len(kernels) == 1, kernels
    _compile_all(kernels, NORM_ROCM)


@pytest.mark.parametrize("case", NORM_CASES)
def test_cuda_norm_kernels(case):
    fn, args = _norm_cases("cuda")[case]
    kernels = cc.triton_kernels(fn, *args, platform="cuda")
    assert len(kernels) == 1, kernels
    _compile_all(kernels, CUDA)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_norm_ops_dispatch_to_pallas_on_gpus(platform):
    """`auto` lowers jq.rms_norm / add_rms_norm / gated_rms_norm to the Pallas kernels on
    GPUs from a million elements; smaller ones stay with XLA (configs.AUTO_NORM_MIN_ELEMENTS)."""
    big = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    for fn in (lambda x: jq.rms_norm(x, x[0]), lambda x: jq.add_rms_norm(x, x, x[0]),
               lambda x: jq.gated_rms_norm(x, x, x[0], group_size=256)):
        (kernel,) = cc.triton_kernels(fn, big, platform=platform)
        assert "tt.func" in kernel.text()
    small = jax.ShapeDtypeStruct((8, 1000), jnp.bfloat16)
    assert not cc.triton_kernels(lambda x: jq.rms_norm(x, x[0]), small, platform=platform)


# --- ragged_qmm (routed MoE prefill): qmm's GEMM over a device-computed schedule -----


def _ragged_kernels(fmt, platform, t, dtype=jnp.bfloat16):
    from jaxquant.pallas import moe

    mode, bits, group = fmt
    e, n, k = 8, 1000, 2048
    qw = jax.eval_shape(lambda w: jq.quantize(w, mode=mode, bits=bits, group_size=group),
                        jax.ShapeDtypeStruct((e, n, k), dtype))
    x = jax.ShapeDtypeStruct((t, k), dtype)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    kernels = cc.triton_kernels(lambda x, qw, g: moe.ragged_qmm(x, qw, g, platform=platform),
                                x, qw, sizes, platform=platform)
    assert len(kernels) == 1, kernels
    assert kernels[0].name in ("kernel",) or "ragged_qmm" in kernels[0].name, kernels[0].name
    return kernels


@pytest.mark.parametrize("t", [256, 4096], ids=["skinny", "gemm"])
def test_rocm_ragged(t):
    _compile_all(_ragged_kernels(("mxfp4", 4, 32), "rocm", t), [("hip", "gfx942", 64),
                                                                 ("hip", "gfx1100", 32)])


@pytest.mark.parametrize("case", [(("affine", 4, 64), 4096, "gfx942"),
                                  (("nvfp4", 4, 16), 256, "gfx950")],
                         ids=lambda c: f"{_fid(c[0])}-T{c[1]}-{c[2]}")
def test_rocm_ragged_formats(case):
    # ragged_qmm beyond mxfp4: affine (scales and biases) and nvfp4 (E4M3 scales and
    # a global scale per expert), one tile class and one target each.
    fmt, t, arch = case
    target = next(x for x in ROCM if x[1] == arch)
    _compile_all(_ragged_kernels(fmt, "rocm", t), [target])


@pytest.mark.parametrize("fmt", [("mxfp4", 4, 32), ("affine", 4, 64)], ids=_fid)
def test_cuda_ragged_sm90(fmt):
    _compile_all(_ragged_kernels(fmt, "cuda", 4096), CUDA)


# ---------------------------------------------------------------------------
# JAX's Pallas-Triton DeprecationWarning (jax >= 0.11 warns at every lowering of a
# Triton pallas_call): jaxquant's own lowering does not pass it on to users.


def test_lowering_a_jaxquant_kernel_emits_no_triton_deprecation(monkeypatch):
    import warnings

    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import core as triton_core
    from jax._src.pallas.triton import pallas_call_registration as triton_lowering

    from jaxquant.pallas.common import TRITON_DEPRECATION

    # Where the installed JAX does not warn yet, warn as jax 0.11 does, from its
    # Triton lowering rule, so that the test sees what users of newer JAX would.
    real = triton_lowering.pallas_call_lowering

    def warning_lowering(*args, **kwargs):
        warnings.warn("The Pallas Triton backend is deprecated and will be removed in a "
                      "future JAX version.", DeprecationWarning, stacklevel=2)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_lowering, "pallas_call_lowering", warning_lowering)
    rules = getattr(pallas_core, "_backend_lowering_rules", {})   # where jax looks it up
    if triton_core.CompilerParams in rules:
        monkeypatch.setitem(rules, triton_core.CompilerParams, (warning_lowering, "gpu"))
    qw = jax.eval_shape(lambda w: jq.quantize(w, mode="mxfp4"),
                        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((2, 512), jnp.bfloat16)          # M <= 16: `auto` takes pallas

    def lower(fn, x):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernels = cc.triton_kernels(fn, x, qw, platform="cuda")
        return kernels, [w for w in caught if issubclass(w.category, DeprecationWarning)
                         and re.match(TRITON_DEPRECATION, str(w.message))]

    kernels, warned = lower(lambda x, qw: jq.qmm(x, qw), x)   # through jaxquant's dispatch
    assert kernels and not warned
    # A pallas_call lowered outside jaxquant's dispatch keeps the warning (the filter is
    # that narrow); another M, as JAX caches the lowering of the kernel above.
    x3 = jax.ShapeDtypeStruct((3, 512), jnp.bfloat16)
    kernels, warned = lower(lambda x, qw: qmm(x, qw, platform="cuda"), x3)
    assert kernels and warned
