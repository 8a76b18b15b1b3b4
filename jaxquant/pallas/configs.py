"""Block configurations of the Pallas qmm kernels: data, per platform and shape class.

This is the one place where kernel choice (GEMV vs GEMM) and block sizes live
(docs/backends.md). `select` maps (platform, transpose, M, N, K, format) to a
`KernelConfig`; everything it reads is in the tables below.

Shape classes (M = rows of x after flattening the leading axes):
  "gemv"   M <= PALLAS_GEMV_MAX_M: CUDA-core kernel, one weight pass, f32 FMA.
  "skinny" PALLAS_GEMV_MAX_M < M <= 64: tensor-core kernel with a 16..64-row M tile.
  "gemm"   M > 64: tensor-core kernel with large tiles.

Units: `block_n` rows of the weight (transpose=True) per program; `k_words`
packed words of K per row per loop step (rounded to whole groups);
transpose=False: `block_k` rows of K per step and `n_words` packed words of N
per program. `split_k` > 1 splits the K loop over programs (partial sums in
float32, added by XLA).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    kernel: str                 # "gemv" | "gemm"
    block_m: int = 16
    block_n: int = 64
    k_words: int = 16
    block_k: int = 32
    n_words: int = 16
    split_k: int = 1
    x_join: bool = True         # gemv, transpose=True: contract joined slot planes with x's
                                # natural tile (else: one strided x load per slot)
    permute_x: bool = False     # gemm, transpose=True: permute x by one XLA transpose
    swap_ab: bool = False       # gemm, transpose=True: compute y^T = W x^T (W as the A operand)
    interleave: bool = False    # gemm: dequantize a whole tile into K (N) order, one dot per
                                # step (2/4/8-bit formats; others keep one dot per slot)
    num_warps: int = 4
    num_stages: int = 2

    def replace(self, **kw) -> "KernelConfig":
        return dataclasses.replace(self, **kw)


# The most rows of x the Pallas GEMV kernel (jaxquant/pallas/gemv.py) takes: the "gemv"
# shape class above; past it the tensor-core GEMM.
PALLAS_GEMV_MAX_M = {"cuda": 4, "rocm": 4, "interpret": 4}

# GEMV (transpose=True): at least this many programs, so that every SM streams
# weights (132 SMs on an H100/H200, 304 CUs on an MI300X); below it block_n
# shrinks (tile words kept) and then the K loop is split.
MIN_PROGRAMS = {"cuda": 4 * 132, "rocm": 2 * 304, "interpret": 1}
MIN_BLOCK_N = 8

# (transpose, shape class) -> config, tuned on an H100 (benchmarks/h100/qmm.json `qmm.pallas.*`).
_CUDA: dict[tuple[bool, str], KernelConfig] = {
    (True, "gemv"): KernelConfig("gemv", block_n=32, k_words=32, num_warps=4, num_stages=3),
    (True, "skinny"): KernelConfig("gemm", block_m=16, block_n=64, k_words=32, swap_ab=True,
                                   num_warps=4, num_stages=3),
    (True, "gemm"): KernelConfig("gemm", block_m=256, block_n=128, k_words=16, interleave=True,
                                 num_warps=8, num_stages=2),
    (False, "gemv"): KernelConfig("gemv", block_k=16, n_words=32, num_warps=4, num_stages=3),
    (False, "skinny"): KernelConfig("gemm", block_m=16, block_k=64, n_words=16, num_warps=4,
                                    num_stages=3),
    (False, "gemm"): KernelConfig("gemm", block_m=128, block_k=64, n_words=16, interleave=True,
                                  num_warps=8, num_stages=2),
}
# ROCm: CUDA's tiles with Triton's AMD guidance: one stage (the AMD backend pipelines
# through registers) and 128-row GEMM tiles for x @ W.T.
_ROCM = {key: cfg.replace(num_stages=1) for key, cfg in _CUDA.items()}
_ROCM[(True, "gemm")] = _ROCM[(True, "gemm")].replace(block_m=128)
# interpret mode (CPU tests): small tiles so that masking is exercised.
_INTERPRET = {
    (True, "gemv"): KernelConfig("gemv", block_n=16, k_words=16),
    (True, "skinny"): KernelConfig("gemm", block_m=16, block_n=16, k_words=16, swap_ab=True),
    (True, "gemm"): KernelConfig("gemm", block_m=32, block_n=16, k_words=16, interleave=True),
    (False, "gemv"): KernelConfig("gemv", block_k=16, n_words=16),
    (False, "skinny"): KernelConfig("gemm", block_m=16, block_k=16, n_words=16),
    (False, "gemm"): KernelConfig("gemm", block_m=32, block_k=16, n_words=16, interleave=True),
}
_INTERPRET = {key: cfg.replace(num_warps=4, num_stages=1) for key, cfg in _INTERPRET.items()}

# (platform, transpose, shape class) -> config.
TABLE: dict[tuple[str, bool, str], KernelConfig] = {
    (platform, *key): cfg
    for platform, table in (("cuda", _CUDA), ("rocm", _ROCM), ("interpret", _INTERPRET))
    for key, cfg in table.items()}


def shape_class(platform: str, m: int) -> str:
    if m <= PALLAS_GEMV_MAX_M[platform]:
        return "gemv"
    return "skinny" if m <= 64 else "gemm"


def _spread_gemv(cfg: KernelConfig, min_programs: int, n: int, k_words: int) -> KernelConfig:
    tile = cfg.block_n * cfg.k_words
    bn = cfg.block_n
    while bn > MIN_BLOCK_N and -(-n // bn) < min_programs:
        bn //= 2
    kw = max(1, tile // bn)
    split = 1
    while -(-n // bn) * split < min_programs and k_words >= 4 * kw * split:
        split *= 2
    return cfg.replace(block_n=bn, k_words=kw, split_k=max(split, cfg.split_k))


# float32 activations double the staged x tiles: the large-tile class then uses
# one dot per slot (no whole-tile interleave) and two stages, within the 227 KiB
# of shared memory of a Hopper SM (and the compilers' limits elsewhere).
F32_GEMM = dict(interleave=False, permute_x=True, block_m=64, block_n=128, k_words=16,
                num_stages=2)


def select(platform: str, transpose: bool, m: int, n: int, k: int, bits: int,
           group_size: int, x_dtype=None) -> KernelConfig:
    """The kernel and block sizes for one call (all arguments static)."""
    cls = shape_class(platform, m)
    cfg = TABLE[(platform, bool(transpose), cls)]
    if cls == "gemm" and x_dtype is not None and str(x_dtype) == "float32":
        cfg = cfg.replace(**F32_GEMM)
    if cfg.kernel == "gemv" and transpose:
        cfg = _spread_gemv(cfg, MIN_PROGRAMS[platform], n, k * bits // 32)
    if cfg.kernel == "gemm" and cls == "skinny":
        # The M tile: the smallest power of two >= M, at least 16 (tensor-core minimum).
        bm = 16
        while bm < m:
            bm *= 2
        cfg = cfg.replace(block_m=bm)
    return cfg


# ---------------------------------------------------------------------------
# gather_matmul (float expert weights, decode): block configurations of the float
# expert GEMV (jaxquant.pallas.gemv.gather_gemv_float).


@dataclasses.dataclass(frozen=True)
class FloatGemvConfig:
    block_n: int = 32        # weight rows per program; power of two
    block_k: int = 256       # elements of K per loop step (one [block_n, block_k] tile
                             # load: 16-byte loads along K); power of two
    min_programs: int = 1    # shrink block_n (down to FLOAT_GEMV_MIN_BLOCK_N) until the
                             # grid has this many programs, so every SM streams weights
    num_warps: int = 4
    num_stages: int = 1      # the K loop prefetches the next tile into registers itself

    def replace(self, **kw) -> "FloatGemvConfig":
        return dataclasses.replace(self, **kw)


# cuda: the best or within 6% of the best of a block sweep at gpt-oss-20b's bf16 experts
# (benchmarks/h100/moe.json `gather_matmul.*`: 69-87% of the copy bandwidth, faster than
# block_n=32 with min_programs=528 at every shape).
# Wider blocks with block_k=512 spill (up to 40x slower). rocm: not tuned (a [32, 256]
# bf16 tile, 2 programs per MI300X CU).
# interpret (CPU tests): small blocks, so that test shapes go through several row
# blocks and K steps with masked tails.
FLOAT_GEMV_CONFIGS: dict[str, FloatGemvConfig] = {
    "cuda": FloatGemvConfig(block_n=8, block_k=256, min_programs=1),
    "rocm": FloatGemvConfig(block_n=32, block_k=256, min_programs=2 * 304),
    "interpret": FloatGemvConfig(block_n=16, block_k=32, min_programs=1),
}


# The smallest block_n a config may hold (the kernel's N-block grid axis is bounded).
FLOAT_GEMV_MIN_BLOCK_N = 8

# A float matrix at decode goes through the Pallas float GEMV (jq.gather_matmul with the
# matrix as its one expert) on a GPU where XLA's dot was measured slower inside the
# models' decode step: N >= 5120 with K < 8192 (q/k/v, gate+up). XLA stays where it was
# as fast or faster: the o projections (N <= 4096), K >= 8192 (Llama's down), the router
# (N = 32) and the heads (N >= 128k, XLA at 96-99% of copy). benchmarks/h100/decode.json
# `float_gemv.*` (per matrix, in the model, whole model). One row only: the GEMV gives
# every row its own slot, and a slot reads the whole matrix, so M rows read it M times
# where XLA's dot reads it once (Llama-3-8B bf16 at batch 8 on an H200: gate+up 246 µs
# a call through the GEMV, 31% of the step's bound; benchmarks/h200/model.json).
FLOAT_GEMV_OVER_XLA = dict(max_rows=1, min_n=5120, max_n=32768, max_k=8192)


# ---------------------------------------------------------------------------
# ragged_matmul (float expert weights, prefill): block configurations of the float
# ragged GEMM (jaxquant.pallas.gemm.ragged_gemm_float), by the mean rows per expert.


@dataclasses.dataclass(frozen=True)
class FloatGemmConfig:
    block_m: int = 64        # rows of x per work item (the schedule's tile); power of two >= 16
    block_n: int = 128       # weight rows per program; power of two >= 16
    block_k: int = 64        # elements of K per loop step; power of two >= 16
    num_warps: int = 4
    num_stages: int = 3      # Triton's software pipeline over the K loop

    def replace(self, **kw) -> "FloatGemmConfig":
        return dataclasses.replace(self, **kw)


# (most mean rows per expert, config), first match. cuda: an H100 sweep over gpt-oss-20b's
# bf16 experts (E = 32, K = 2880; block_m 64/128 x block_n 128/256 x 4/8 warps x 3/4
# stages; benchmarks/h100/moe.json `ragged_matmul.*`): 64 rows per expert best at 64 x
# 128, 4 warps, 3 stages (the rest within 6-10%); 128 rows per expert best at 128 x 128
# (4 or 8 warps within 2%).
# 32-row tiles below 32 rows per expert: not measured (half of a 64-row tile would be
# padding there). rocm: the cuda table (not tuned); interpret (CPU tests): small blocks,
# so test shapes go through several tiles, N blocks and K steps with masked tails.
RAGGED_FLOAT_CONFIGS: dict[str, tuple[tuple[float, FloatGemmConfig], ...]] = {
    "cuda": ((32, FloatGemmConfig(block_m=32, block_n=128, block_k=64, num_warps=4)),
             (96, FloatGemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4)),
             (math.inf, FloatGemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8))),
    "interpret": ((math.inf, FloatGemmConfig(block_m=16, block_n=16, block_k=16,
                                             num_warps=1, num_stages=1)),),
}
RAGGED_FLOAT_CONFIGS["rocm"] = RAGGED_FLOAT_CONFIGS["cuda"]


def select_ragged_float(platform: str, rows: int, num_experts: int) -> FloatGemmConfig:
    """The float ragged GEMM's blocks for `rows` rows of x over `num_experts` experts."""
    mean = rows / max(1, num_experts)
    return next(cfg for most, cfg in RAGGED_FLOAT_CONFIGS[platform] if mean <= most)


def select_float_gemv(platform: str, n: int, slots: int) -> FloatGemvConfig:
    """The float expert GEMV's blocks for N rows and `slots` (token, expert) pairs."""
    cfg = FLOAT_GEMV_CONFIGS[platform]
    bn = cfg.block_n
    while bn > FLOAT_GEMV_MIN_BLOCK_N and -(-n // bn) * slots < cfg.min_programs:
        bn //= 2
    return cfg.replace(block_n=bn)


# ---------------------------------------------------------------------------
# Norms: block configurations (jaxquant.pallas.norms).


@dataclasses.dataclass(frozen=True)
class NormConfig:
    max_block: int = 16384   # widest row (group) normalized in one pass; power of two
    chunk: int = 4096        # column step of the two-pass kernel; power of two
    tile: int = 4096         # elements per program that narrow rows are batched up to
    per_thread: int = 16     # elements per thread: num_warps = tile / (warp * per_thread)
    warp: int = 32           # lanes per warp (wavefront) used for that estimate
    max_warps: int = 16
    num_stages: int = 1      # software pipelining of the two-pass loops (CUDA only)

    def replace(self, **kw) -> "NormConfig":
        return dataclasses.replace(self, **kw)


# CUDA: 16 elements per thread keeps a 16 Ki-element row in registers with 16
# warps (32 f32 registers per input); 4096-element tiles (8 warps) are what the
# Triton layer-norm recipe uses to reach the copy bandwidth. ROCm: same tiles on
# 64-wide wavefronts (half the warps), one stage (the AMD backend pipelines
# through registers). interpret (CPU tests): tiny limits, so that small test
# widths go through the multi-row, grouped and two-pass paths.
NORM_CONFIGS: dict[str, NormConfig] = {
    "cuda": NormConfig(max_block=16384, chunk=4096, tile=4096, per_thread=16, warp=32,
                       max_warps=16, num_stages=2),
    "rocm": NormConfig(max_block=16384, chunk=4096, tile=4096, per_thread=16, warp=64,
                       max_warps=16, num_stages=1),
    "interpret": NormConfig(max_block=256, chunk=128, tile=512, per_thread=16, warp=32,
                            max_warps=4, num_stages=1),
}

# ---------------------------------------------------------------------------
# Decode attention: block configurations (jaxquant.pallas.attention).


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    block_s: int = 64            # keys (cache rows) per loop step; power of two >= 16
    max_rows: int = 64           # query rows per program (positions x heads of a kv head)
    target_programs: int = 264   # split the keys until (batch x kv heads x splits) reaches this
    min_split_keys: int = 256    # ... but give every split at least this many keys
    max_splits: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def replace(self, **kw) -> "AttentionConfig":
        return dataclasses.replace(self, **kw)


# CUDA's measured on an H100 (docs/attention.md: no variant faster at 192 keys, batch 1
# and 8; longer caches not settled; tools/gpu/attention_bench.py --variants): it aims at two
# programs per H100 SM, ROCm at one per MI300X CU with one stage (the AMD backend
# pipelines through registers). interpret (CPU tests): tiny blocks, so that small test
# caches go through many steps, several splits and several row tiles.
ATTENTION_CONFIGS: dict[str, AttentionConfig] = {
    "cuda": AttentionConfig(),
    "rocm": AttentionConfig(target_programs=304, num_stages=1),
    "interpret": AttentionConfig(block_s=16, max_rows=16, target_programs=8,
                                 min_split_keys=32, max_splits=4, num_stages=1),
}

# ---------------------------------------------------------------------------
# Automatic choice (dispatch's `auto`): where the kernels were measured to beat the
# reference; an explicit backend="pallas" still takes every case they support.


# qmm: the GEMV/skinny cases (M <= 16, x @ W.T), where the kernels beat the jnp
# reference 2-7x on an H100; at M >= 512 the tiled GEMM is slower than the
# reference (benchmarks/h100/qmm.json `qmm.pallas.*`), so `auto` leaves it to XLA. gather_qmm (2-10x)
# and ragged_qmm (prefill, 11-28x) win in every measured case: no rule.
AUTO_QMM_MAX_M = 16

# Norms: on an H100 the kernels beat XLA's fused reference from about a million
# elements (1.01-1.25x at 4096x4096, 4096x5376, 32768x128) and lose below (0.8-1.06x
# at 1x4096 and 64x4096, where launch cost dominates): benchmarks/h100/norm.json.
AUTO_NORM_MIN_ELEMENTS = 1 << 20


def auto_qmm(x, qw, *, transpose, platform, **params) -> bool:
    return transpose and math.prod(x.shape[:-1]) <= AUTO_QMM_MAX_M


def auto_norm(x, *operands, platform, **params) -> bool:
    return math.prod(x.shape) >= AUTO_NORM_MIN_ELEMENTS


# Decode attention: where automatic choice takes the kernel, per platform: at most
# `max_t` query positions per sequence (None: any) and caches of at least `min_s`
# positions. Every case the kernel takes until tools/gpu/attention_bench.py shows a
# case where the reference is faster (benchmarks/h100/decode.json `attention.decode.*`).
AUTO_ATTENTION = {"cuda": dict(max_t=None, min_s=0), "rocm": dict(max_t=None, min_s=0)}


def auto_decode_attention(q, k_cache, *operands, platform, **params) -> bool:
    rule = AUTO_ATTENTION.get(platform)
    if rule is None:
        return False
    max_t = rule["max_t"]
    return (max_t is None or q.shape[1] <= max_t) and k_cache.shape[-3] >= rule["min_s"]
