// The decode GEMV on NVIDIA tensor cores (CUDA only, sm_80+): qmm with
// M <= 16 rows per weight matrix and gather_qmm, on the `cuda_mma` kernel
// layout that `jq.prepack` makes (jaxquant/layouts/cuda_mma.py; the layout is
// described exactly in docs/decode.md).
//
// y[n, m] = sum_k w[n, k] x[m, k] is one mma.sync.m16n8k16 per 16 weight rows
// x 16 k: the weight is the A operand (16 rows of N), x the B operand (M
// padded to 8 or 16 columns), float32 accumulation. M = 1 costs what M = 8
// does; the weight bytes, read once, are the whole cost.
//
// One warp owns one 16-row tile and every W-th chunk of 64 k of it (W warps
// per block split K; their partial sums meet in shared memory). In the layout
// a lane's part of a chunk (32 codes: rows g and g+8, 16 k) is one `bits`-word
// unit at (chunk * 32 + lane) * bits, copied to shared memory with 16-byte
// cp.async (4 and 8 bits) kStages - 1 chunks ahead of its use, so the bytes in
// flight cost no registers. Codes become bf16x2 / half2 A registers without
// int->float conversions:
//   affine 4-bit: (w >> 4j) & 0x000f000f | magic (128 + c in bf16, 1024 + c in
//     half); bf16 folds the 128 into the bias (y = s*sum((128+c)x) + (b-128s)*sum(x)),
//     half and float32 x subtract it exactly (HSUB2);
//   E2M1 (mxfp4, nvfp4, fp4): magnitude and sign bits moved into place with
//     shifts/LOP3, one HMUL2 by 2^126 (bf16) / 2^14 (half) rebases the exponent;
//   affine 2/3/5/6-bit, MX 6-bit floats: the register's two codes first put 16 bits
//     apart (code_pair), then as above (affine exact, no fold);
//   FP8 (sm_89+): cvt.rn.f16x2.e4m3x2 / e5m2x2 per register (to bf16 via float32);
//   affine 8-bit: the codec's exact float decode and one F2FP pack per pair.
// The kernel is issue-bound (ncu: issue slots busy, few memory stalls): instructions
// per weight byte decide its speed. Scales are applied once per group (per chunk for
// group 128) to the MMA's group sum: exactly, as a power of two, for E8M0; E4M3
// (nvfp4, sm_89+) converted a pair of rows at a time. sum(x) per group (affine)
// is one more MMA with an all-ones A. float32 x is split into bf16 hi + lo
// (two MMAs: ~2^-17 relative error per element instead of float32's 2^-24).
//
// Fused variants (FUSE, for jq.rms_norm_qmm and jq.qmm_swiglu; jaxquant/ops/fused.py):
//   kFuseNorm: the block's rows of x are staged in shared memory (always), then
//     rms-normalized in place (each block recomputes the rows' sums of squares; x is
//     tiny at decode) and rounded to x's dtype, as the unfused rms_norm hands them
//     to the GEMV;
//   kFuseSwiglu: N = 2I, a block owns gate tile j and up tile j + I/16 (the
//     two-tiles-per-block mode with the tiles I rows apart) and writes
//     act(gate, up) for its 16 of the I outputs: each half rounded to x's dtype
//     (the unfused qmm's output), + bias in float32, then the activation. With
//     indices (jq.gather_qmm_swiglu) each slot's expert and its bias row; an
//     invalid id gives a NaN row, as gather_qmm's.
// A tile's float ops are those of the plain GEMV, so the fused outputs match the
// unfused ops' to the rounding of the norm's statistics and of the activation; the
// SwiGLU variant at affine 4-bit may split K over more warps (swiglu_warps), which
// sums each half in another float32 order.
//
// gather_qmm: slot s uses expert indices[s] (on the device). With `dedupe`,
// the slots that pick the same expert are one segment of up to 8*NT rows
// whose weights are read once: the block of the segment's first slot
// computes it, the others return at once. An id outside [0, E) gives a NaN
// row and no weight read.
#pragma once

#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <initializer_list>
#include <type_traits>

#include "gpu_common.h"

#if defined(JQ_PLATFORM_CUDA)
#include <cuda_bf16.h>

namespace jq {
namespace gpu {
namespace mma {

constexpr int kChunkK = 64;      // k per chunk (4 MMA k-steps)
constexpr int kTileRows = 16;    // weight rows per MMA tile
constexpr int kMaxWarps = 8;
// x staged in shared memory up to this many bytes per block (M = 1 up to K = 16 Ki
// in bf16); more would cost blocks per SM.
constexpr int kMaxXSharedBytes = 36 * 1024;
// The fused norm needs x staged: up to this many bytes (M = 11 at K = 4096 in bf16;
// two such blocks still fit an H100 SM's shared memory).
constexpr int kMaxNormXSharedBytes = 96 * 1024;

enum Fuse : int { kFuseNone = 0, kFuseNorm = 1, kFuseSwiglu = 2 };
enum SwigluActivation : int { kActSilu = 0, kActGptOss = 1 };

struct Problem {
  QmvProblem q;
  int64_t tiles;     // ceil(N / 16)
  int64_t full_tiles;  // N / 16: tiles in the MMA layout; a last partial one is canonical
  int64_t chunks;    // K / 64
  int dedupe;        // gather: slots that share an expert form one segment
  int x_stride;      // > 0: the block stages its rows of x in shared memory, this many
                     // bytes apart (K * x bytes + 16, against bank conflicts); 0: from L1/L2
  int x_rows;        // rows of x staged (x_stride > 0)
  // The fused steps. The norm prologue (kFuseNorm always, kFuseSwiglu where `normalize`
  // is set): x's rows rms-normalized as the block stages them, with eps, the weight
  // offset and the weight norm_w [K] (nullptr: none). The SwiGLU's epilogue
  // (kFuseSwiglu): bias [N], or [E, N] with bias_stride = N (a row per expert), or
  // nullptr; the activation (SwigluActivation), its clamp limit (gpt_oss; inf: none)
  // and alpha. The plain GEMV's (kFuseNone) addend: y = x W^T + addend, addend [S, M, N]
  // in y's dtype (the product rounded to it first, as qmm(x, w) + addend rounds), or
  // nullptr.
  bool normalize = false;
  const void* norm_w = nullptr;
  int32_t norm_dt = kOther;
  float eps = 0.0f, offset = 0.0f;
  const void* bias = nullptr;
  int32_t bias_dt = kOther;
  int64_t bias_stride = 0;
  int activation = kActSilu;
  float limit = 0.0f, alpha = 0.0f;
  const void* addend = nullptr;
};

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool F16>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (F16) mma_f16(c, a, b0, b1);
  else mma_bf16(c, a, b0, b1);
}

__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  // fma with -0: bf16x2 arithmetic keeps subnormals (there is no .ftz for bf16)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ uint32_t hmul2_f16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t hsub2_f16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// (a & b) | c as one LOP3 (ptxas left it as two when written in C++).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <int SHIFT>
__device__ __forceinline__ uint32_t shl(uint32_t x) {
  if constexpr (SHIFT >= 0) return x << SHIFT;
  else return x >> (-SHIFT);
}

// The magic number left in affine codes by the fast 4-bit decode (0: none).
// bf16 x: 128 + c, the 128 folded into the bias (y = s*sum((128+c)x) + (b-128s)*sum(x);
// costs ~4 of float32's 24 bits, far below bf16's 8). float32 and half x: subtracted
// exactly in the A registers instead (the fold would cost 4 or 10 bits of the sum).
template <class C, int XDT>
struct AffineMagic {
  static constexpr float value = 0.0f;
};
template <>
struct AffineMagic<Codec<kAffine, 4>, kBF16> {
  static constexpr float value = 128.0f;
};

__device__ __forceinline__ uint32_t hsub2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  // a * 1 - b (fma: sm_80 has no bf16x2 sub)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(0x3f803f80u), "r"(b ^ 0x80008000u));
  return d;
}

// The hardware's FP8 conversions (sm_89+; exact: every E4M3 / E5M2 value, NaN and
// infinity included, is a half). `pair`: two codes, the first in the low byte.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define JQ_HAS_FP8_CVT 1
template <int EL>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t pair) {
  uint32_t h;
  const unsigned short b = (unsigned short)pair;
  if constexpr (EL == kE4M3) asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(b));
  else asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(h) : "h"(b));
  return h;
}
__device__ __forceinline__ float2 f16x2_to_float2(uint32_t h) {
  float lo, hi;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi) : "r"(h));
  return make_float2(lo, hi);
}
#else
#define JQ_HAS_FP8_CVT 0
#endif

// LEN <= 32 bits of the unit's bit stream from bit POS, in the low bits (the bits above
// LEN are the stream's next ones, not zero). POS and LEN are compile-time constants: a
// shift, or one funnel shift where the field straddles two words.
template <int POS, int LEN>
__device__ __forceinline__ uint32_t unit_bits(const uint32_t* w) {
  constexpr int word = POS / 32, sh = POS % 32;
  if constexpr (sh == 0) return w[word];
  else if constexpr (sh + LEN <= 32) return w[word] >> sh;
  else return __funnelshift_r(w[word], w[word + 1], sh);
}

// Codes S*8 + J (bits 0..BITS-1) and S*8 + 4 + J (bits 16..16+BITS-1) of the lane's
// unit, BITS <= 7: the A register's two codes where the 4-bit layout keeps them, so the
// same magic-number decode applies (the bits around them are not zero: the caller
// masks). BITS <= 4: the four low codes and the four high codes of the k-step are one
// field each, put 16 bits apart once for the step's four registers (the compiler
// shares it); wider codes, one field per code.
template <int BITS, int S, int J>
__device__ __forceinline__ uint32_t code_pair(const uint32_t* w) {
  constexpr int lo = (S * 8 + J) * BITS, hi = (S * 8 + 4 + J) * BITS;
  if constexpr (4 * BITS <= 16) {
    constexpr int group = S * 8 * BITS, span = 4 * BITS;
    const uint32_t v = (unit_bits<group, span>(w) & ((1u << span) - 1u)) |
                       (unit_bits<group + span, span>(w) << 16);
    return shl<-BITS * J>(v);
  } else {
    return (unit_bits<lo, BITS>(w) & ((1u << BITS) - 1u)) | (unit_bits<hi, BITS>(w) << 16);
  }
}

// The four A registers of k-step S from the lane's unit `w` (BITS words):
// register j holds codes S*8 + j (low half) and S*8 + 4 + j (high half).
template <class C, bool F16, bool FOLD, int S, int J>
__device__ __forceinline__ uint32_t a_reg(const uint32_t* w) {
  constexpr int BITS = C::kBits;
  if constexpr (C::kFmt == kAffine && BITS == 4) {
    const uint32_t v = and_or(shl<-4 * J>(w[S]), 0x000f000fu, F16 ? 0x64006400u : 0x43004300u);
    if constexpr (F16) return hsub2_f16(v, 0x64006400u);  // exact: c
    if constexpr (!FOLD) return hsub2_bf16(v, 0x43004300u);
    return v;
  } else if constexpr (BITS == 4 && C::kFmt != kAffine) {  // E2M1
    const uint32_t x = w[S];
    if constexpr (F16) {
      const uint32_t v = (shl<9 - 4 * J>(x) & 0x0e000e00u) | (shl<12 - 4 * J>(x) & 0x80008000u);
      return hmul2_f16(v, 0x74007400u);  // 2^14
    } else {
      const uint32_t v = (shl<6 - 4 * J>(x) & 0x01c001c0u) | (shl<12 - 4 * J>(x) & 0x80008000u);
      return hmul2_bf16(v, 0x7e807e80u);  // 2^126
    }
  } else if constexpr (C::kFmt == kAffine && BITS <= 6) {
    // other affine widths: the 4-bit decode on the pair of codes, exact (c itself,
    // no fold: the same values as the codec's decode, so the same bits)
    constexpr uint32_t mask = ((1u << BITS) - 1u) * 0x00010001u;
    const uint32_t v = and_or(code_pair<BITS, S, J>(w), mask, F16 ? 0x64006400u : 0x43004300u);
    return F16 ? hsub2_f16(v, 0x64006400u) : hsub2_bf16(v, 0x43004300u);
  } else if constexpr (BITS == 6 && (C::kElement == kE2M3 || C::kElement == kE3M2)) {
    // MX 6-bit floats as E2M1 above: magnitude bits under the half's exponent LSBs,
    // sign to bit 15, one multiply by a power of two rebases the exponent (exact:
    // no special values; subnormals land on subnormals)
    const uint32_t v = code_pair<6, S, J>(w);
    constexpr bool E2M3 = C::kElement == kE2M3;
    if constexpr (F16) {
      const uint32_t m = E2M3 ? (shl<7>(v) & 0x0f800f80u) : (shl<8>(v) & 0x1f001f00u);
      return hmul2_f16(m | (shl<10>(v) & 0x80008000u), E2M3 ? 0x74007400u : 0x6c006c00u);
    } else {
      const uint32_t m = E2M3 ? (shl<4>(v) & 0x01f001f0u) : (shl<5>(v) & 0x03e003e0u);
      return hmul2_bf16(m | (shl<10>(v) & 0x80008000u), E2M3 ? 0x7e807e80u : 0x7d807d80u);
    }
#if JQ_HAS_FP8_CVT
  } else if constexpr (BITS == 8 && (C::kElement == kE4M3 || C::kElement == kE5M2)) {
    // codes S*8 + J and S*8 + 4 + J are byte J of words 2S and 2S + 1: one byte
    // permute, one conversion to half2 (x in half: the register), to bfloat16 through
    // float32 (exact: 3 instructions, against ~20 for two element decodes)
    const uint32_t pair = __byte_perm(w[2 * S], w[2 * S + 1], J | ((J + 4) << 4));
    const uint32_t h = fp8x2_to_f16x2<C::kElement>(pair);
    if constexpr (F16) return h;
    const float2 f = f16x2_to_float2(h);
    return pack_bf16x2(f.x, f.y);
#endif
  } else {
    const float lo = C::decode(unit_code<BITS, S * 8 + J>(w));
    const float hi = C::decode(unit_code<BITS, S * 8 + 4 + J>(w));
    return F16 ? pack_f16x2(lo, hi) : pack_bf16x2(lo, hi);
  }
}

template <class C, bool F16, bool FOLD, int S>
__device__ __forceinline__ void a_regs(const uint32_t* w, uint32_t* a) {
  a[0] = a_reg<C, F16, FOLD, S, 0>(w);
  a[1] = a_reg<C, F16, FOLD, S, 1>(w);
  a[2] = a_reg<C, F16, FOLD, S, 2>(w);
  a[3] = a_reg<C, F16, FOLD, S, 3>(w);
}

// The A registers of a whole chunk (4 k-steps) from the lane's unit.
template <class C, bool F16, bool FOLD>
__device__ __forceinline__ void chunk_a_regs(const uint32_t* w, uint32_t (&a)[4][4]) {
  a_regs<C, F16, FOLD, 0>(w, a[0]);
  a_regs<C, F16, FOLD, 1>(w, a[1]);
  a_regs<C, F16, FOLD, 2>(w, a[2]);
  a_regs<C, F16, FOLD, 3>(w, a[3]);
}

// The lane's unit of a chunk of the partial last tile, which stays canonical
// (rows of N that do not fill a tile): the same codes gathered from the rows'
// bit streams, bounds-checked.
template <int BITS>
__device__ __forceinline__ void tail_unit(const uint32_t* rows, int64_t words, int valid_rows,
                                          int64_t chunk, int lane, uint32_t* w) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < BITS; ++i) w[i] = 0u;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int s = i >> 3, h = (i >> 2) & 1, j = i & 3;
    const int r = g + 8 * (j & 1);
    const int e = (j >> 1) * 2 + h;
    const int64_t k = chunk * kChunkK + 16 * s + 4 * t + e;
    const uint32_t c = r < valid_rows ? stream_code(rows + r * words, k, BITS) : 0u;
    const int start = i * BITS, word = start >> 5, shift = start & 31;
    w[word] |= c << shift;
    if (shift + BITS > 32) w[word + 1] |= c >> (32 - shift);
  }
}

// Raw scale (or bias) codes of rows g and g + 8 for one group: the layout puts
// them side by side.
__device__ __forceinline__ void load_scale_pair(const void* base, int64_t pair, int32_t dt,
                                                uint32_t* raw) {
  raw[0] = load_raw(base, 2 * pair, dt);
  raw[1] = load_raw(base, 2 * pair + 1, dt);
}

// acc += scale * q (+ bias' * xs) for one row, the scale kinds of apply_scale in gemv_impl.h.
template <class C>
__device__ __forceinline__ void scale_into(float& acc, float q, float xs, uint32_t sraw,
                                           uint32_t braw, int32_t sdt, float gsv, float magic) {
  if constexpr (C::kFmt == kAffine) {
    const float s = raw_to_float(sraw, sdt);
    acc = fmaf(q, s, acc);
    acc = fmaf(fmaf(-magic, s, raw_to_float(braw, sdt)), xs, acc);
  } else if constexpr (C::kScale == kScaleE8M0) {
    // 2^(sraw - 127) as float bits, branch-free: sraw << 23 for codes 1..254; code 0
    // is 2^-127, the float32 subnormal 0x00400000 (the max); code 255 is NaN (a
    // mantissa bit from (255 + 1) >> 8). fmaf rounds q * 2^n + acc once (no FTZ).
    acc = fmaf(q, bits_to_f32(max((sraw << 23) | ((sraw + 1u) >> 8), 0x00400000u)), acc);
  } else if constexpr (C::kScale == kScaleE4M3) {
    acc = fmaf(q, scale_e4m3((uint8_t)sraw) * gsv, acc);
  } else {
    acc = fmaf(q, raw_to_float(sraw, sdt), acc);
  }
}

// B registers (x) of one k-step for column m of the lane: k = k0 .. k0 + 3 at `src`,
// through a generic pointer (x staged in shared memory, or global).
template <int XDT>
__device__ __forceinline__ void load_b(const char* src, uint32_t* b) {
  if constexpr (XDT == kF32) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    const uint32_t h0 = pack_bf16x2(v.x, v.y), h1 = pack_bf16x2(v.z, v.w);
    b[0] = h0;
    b[1] = h1;
    b[2] = pack_bf16x2(v.x - bits_to_f32(h0 << 16), v.y - bits_to_f32(h0 & 0xffff0000u));
    b[3] = pack_bf16x2(v.z - bits_to_f32(h1 << 16), v.w - bits_to_f32(h1 & 0xffff0000u));
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    b[0] = v.x;
    b[1] = v.y;
  }
}

// Where a warp's loads of one tile come from (32-bit offsets, set once per tile).
struct TileCursor {
  const uint32_t* w;     // the lane's unit of chunk 0 (tail: the tile's first canonical row)
  const char* x[2];      // the lane's x column (n8 tile 0 / 1) at k = 4t (row 0 for the
                         // columns past the segment's rows: computed, never stored)
  const char* s;         // scales of the lane's pair of rows (tail: of the tile's first row)
  const char* b;         // biases, likewise
  int valid_rows;        // rows of the tile inside N
};

// Tile `tile` of expert e: a full tile's cursor points at the lane's unit and its
// pair of rows' scales (the layout); the partial last one (TAIL) at its first
// canonical row.
template <bool TAIL>
__device__ __forceinline__ TileCursor tile_cursor(const QmvProblem& p, int64_t e, int64_t tile,
                                                  int bits, int ssz, int lane) {
  TileCursor cur;
  cur.x[0] = cur.x[1] = nullptr;
  const int64_t row0 = e * p.N + tile * kTileRows;  // the tile's first row in [E * N]
  cur.valid_rows = (int)(p.N - tile * kTileRows);
  const int64_t s0 = TAIL ? row0 * p.groups : row0 * p.groups + 2 * (lane >> 2);
  cur.w = p.data + row0 * p.words + (TAIL ? 0 : lane * bits);
  cur.s = static_cast<const char*>(p.scales) + s0 * ssz;
  cur.b = p.biases ? static_cast<const char*>(p.biases) + s0 * ssz : nullptr;
  return cur;
}

// A scale code of at most 16 bits (uint8 E8M0/E4M3 codes, half, bfloat16).
__device__ __forceinline__ uint32_t load_raw16(const void* base, int64_t i, int32_t dt) {
  return dt == kU8 ? (uint32_t)JQ_LDG(static_cast<const uint8_t*>(base) + i)
                   : (uint32_t)JQ_LDG(static_cast<const uint16_t*>(base) + i);
}

// A chunk's scales (and biases) in shared memory: [scale, bias][bytes] (scales_to_shared).
template <int P>
struct ScaleStage {
  static constexpr int bytes = 64 * P;  // 16 rows x P groups x at most 4 bytes
};

// Scales (and biases) of one chunk for the lane's rows g and g + 8: P group
// pieces. WIDE: float32 scales, two registers per pair of rows; else the pair's
// two codes share one register (row g low half, row g + 8 high half).
template <class C, int P, bool TAIL, int SDT>
struct ChunkScales {
  static constexpr bool WIDE = SDT == kF32;
  static constexpr int SW = WIDE ? 2 : 1;
  uint32_t r[P][2][SW];  // [group piece][scale, bias][row g, row g + 8 | packed]

  __device__ __forceinline__ void load(const QmvProblem& p, const TileCursor& cur, int c,
                                       int gshift, int g) {
#pragma unroll
    for (int pc = 0; pc < P; ++pc) {
      const int gi = ((c << 6) + pc * (64 / P)) >> gshift;
      uint32_t v[2][2] = {{0u, 0u}, {0u, 0u}};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int64_t i = gi * 16 + h;  // the layout: [tile, group, g, row half]
        bool in = true;
        if constexpr (TAIL) {  // canonical [N, G] rows
          i = (int64_t)(g + 8 * h) * p.groups + gi;
          in = g + 8 * h < cur.valid_rows;
        }
        if (in) {
          if constexpr (WIDE) {
            v[0][h] = JQ_LDG(reinterpret_cast<const uint32_t*>(cur.s) + i);
            if constexpr (C::kFmt == kAffine)
              v[1][h] = JQ_LDG(reinterpret_cast<const uint32_t*>(cur.b) + i);
          } else {
            v[0][h] = load_raw16(cur.s, i, SDT);
            if constexpr (C::kFmt == kAffine) v[1][h] = load_raw16(cur.b, i, SDT);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if constexpr (WIDE) {
          r[pc][k][0] = v[k][0];
          r[pc][k][1 % SW] = v[k][1];
        } else {
          r[pc][k][0] = v[k][0] | (v[k][1] << 16);
        }
      }
    }
  }

  // The chunk's scales (and biases) from a stage that scales_to_shared filled:
  // [scale, bias][ScaleStage bytes] (the biases `bias_off` bytes after the scales),
  // rows g and g + 8 side by side (one load).
  __device__ __forceinline__ void load_shared(const uint8_t* st, int g,
                                              int bias_off = ScaleStage<P>::bytes) {
    constexpr int ssz = dtype_bytes(SDT);
#pragma unroll
    for (int pc = 0; pc < P; ++pc)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && C::kFmt != kAffine) break;
        const uint8_t* pairp = st + k * bias_off + (pc * 16 + 2 * g) * ssz;
        if constexpr (SDT == kF32) {
          const uint2 v = *reinterpret_cast<const uint2*>(pairp);
          r[pc][k][0] = v.x;
          r[pc][k][1 % SW] = v.y;
        } else if constexpr (SDT == kU8) {
          const uint32_t v = *reinterpret_cast<const uint16_t*>(pairp);
          r[pc][k][0] = (v & 0xffu) | ((v & 0xff00u) << 8);
        } else {
          r[pc][k][0] = *reinterpret_cast<const uint32_t*>(pairp);
        }
      }
  }

  __device__ __forceinline__ uint32_t get(int pc, int k, int h) const {
    if constexpr (WIDE) return r[pc][k][h % SW];
    else return (r[pc][k][0] >> (16 * h)) & 0xffffu;
  }

  // E4M3 scales (nvfp4, uint8 codes) of rows g and g + 8 for piece pc, times the global
  // scale: scale_e4m3(code) * gsv per row; on sm_89+ one conversion of the pair to half2
  // (exact) instead of two software decodes.
  __device__ __forceinline__ float2 e4m3_pair(int pc, float gsv) const {
#if JQ_HAS_FP8_CVT
    const float2 f = f16x2_to_float2(fp8x2_to_f16x2<kE4M3>(__byte_perm(r[pc][0][0], 0u, 0x20)));
#else
    const float2 f = make_float2(scale_e4m3((uint8_t)get(pc, 0, 0)),
                                 scale_e4m3((uint8_t)get(pc, 0, 1)));
#endif
    return make_float2(f.x * gsv, f.y * gsv);
  }
};

// One chunk of TB tiles (the block's, same k): x (B) loads once for all of them,
// then per tile the decode of the lane's unit w[j] into A registers and the MMAs;
// per group piece sum(x) (affine: one MMA with an all-ones A) is shared by the
// tiles, and the scales go into acc[j]. A tile's float ops do not depend on TB.
template <class C, int XDT, int NT, int P, bool TAIL, int SDT, int TB>
__device__ __forceinline__ void compute_chunk(const TileCursor& cur, int c,
                                              const uint32_t (&w)[TB][C::kBits],
                                              const ChunkScales<C, P, TAIL, SDT> (&sc)[TB],
                                              float gsv, float (&acc)[TB][NT][4]) {
  constexpr bool F16 = XDT == kF16;
  constexpr int NB = XDT == kF32 ? 4 : 2;
  constexpr int ESZ = dtype_bytes(XDT);
  constexpr float MAGIC = AffineMagic<C, XDT>::value;
  constexpr bool FOLD = MAGIC != 0.0f;
  constexpr uint32_t ONES = F16 ? 0x3c003c00u : 0x3f803f80u;
  constexpr int SPP = 4 / P;  // k-steps per group piece (P groups per chunk)
  uint32_t b[4][NT][NB];
#pragma unroll
  for (int st = 0; st < 4; ++st)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // a generic load: x is staged in shared memory or read from L1/L2
      load_b<XDT>(cur.x[nt] + (c * kChunkK + 16 * st) * ESZ, b[st][nt]);
    }
  uint32_t a[TB][4][4];
#pragma unroll
  for (int j = 0; j < TB; ++j) chunk_a_regs<C, F16, FOLD>(w[j], a[j]);
#pragma unroll
  for (int pc = 0; pc < P; ++pc) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float xs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (C::kFmt == kAffine) {
#pragma unroll
        for (int st = pc * SPP; st < (pc + 1) * SPP; ++st) {
          const uint32_t ones[4] = {ONES, ONES, ONES, ONES};
          mma16816<F16>(xs, ones, b[st][nt][0], b[st][nt][1]);
          if constexpr (XDT == kF32) mma16816<F16>(xs, ones, b[st][nt][2], b[st][nt][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < TB; ++j) {
        float q[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int st = pc * SPP; st < (pc + 1) * SPP; ++st) {
          mma16816<F16>(q, a[j][st], b[st][nt][0], b[st][nt][1]);
          if constexpr (XDT == kF32) mma16816<F16>(q, a[j][st], b[st][nt][2], b[st][nt][3]);
        }
        if constexpr (C::kScale == kScaleE4M3 && SDT == kU8) {
          const float2 sv = sc[j].e4m3_pair(pc, gsv);  // the pair of rows at once
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc[j][nt][i] = fmaf(q[i], i >> 1 ? sv.y : sv.x, acc[j][nt][i]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            scale_into<C>(acc[j][nt][i], q[i], xs[i], sc[j].get(pc, 0, i >> 1),
                          sc[j].get(pc, 1, i >> 1), SDT, gsv, MAGIC);
        }
      }
    }
  }
}

__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, int bytes) {
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// Likewise, but `src_bytes` of them read (the rest zero-filled): 0 reads nothing,
// so a copy past the end needs no branch (src must still be a valid address).
__device__ __forceinline__ void cp_async_fill(uint32_t dst, const void* src, int bytes,
                                             uint32_t src_bytes) {
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
// A 4-byte cp_async_fill issued by the lanes where `guard` holds, as a predicated
// copy: no branch around it (the other lanes write nothing).
__device__ __forceinline__ void cp_async_fill4_if(uint32_t dst, const void* src,
                                                 uint32_t src_bytes, bool guard) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n"
      " @p cp.async.ca.shared.global [%0], [%1], 4, %2;\n}\n" ::"r"(dst),
      "l"(src), "r"(src_bytes), "r"((uint32_t)guard));
}
// Programmatic dependent launch (sm_90): wait for the kernel before this one to
// finish (its writes visible); let the next one start launching.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void grid_dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The stage after `stage` in a ring of S.
template <int S>
__device__ __forceinline__ int next_stage(int stage) {
  if constexpr ((S & (S - 1)) == 0) return (stage + 1) & (S - 1);
  else return stage + 1 == S ? 0 : stage + 1;
}

// The lane's unit of a chunk, global -> shared, with the widest copies its
// alignment allows (the unit is `BITS` words at a multiple of BITS words).
// `read` false: nothing read (zeros; the chunk past the warp's last, never used).
template <int BITS>
__device__ __forceinline__ void unit_to_shared(uint32_t dst, const uint32_t* src, bool read = true) {
  constexpr int kBytes = BITS % 4 == 0 ? 16 : (BITS % 2 == 0 ? 8 : 4);
#pragma unroll
  for (int i = 0; i < BITS * 4 / kBytes; ++i)
    cp_async_fill(dst + i * kBytes, src + i * kBytes / 4, kBytes, read ? kBytes : 0);
}

// Chunks in flight per warp: the lane's units (and the warp's scales) go global
// -> shared with cp.async (no registers held while in flight) kStages - 1 chunks
// ahead of the one used: DRAM latency under load is ~1000+ cycles, several
// chunks' work. Weights: each lane reads back only what it copied itself;
// scales: copied by a few lanes, read by all after a __syncwarp.
template <int BITS>
struct Stages {
  // more stages measured slower at 4 bits (tools/cuda/tune_mma_driver.hip: 6 and 8 lose
  // 0.5-3 us on an H100); fewer above 4 bits keep the blocks per SM
  static constexpr int value = BITS > 4 ? 3 : 4;
};

// The scales (and biases) of chunk c, [group piece][g][row half], to shared memory:
// 16 * P * ssz bytes each, 4 bytes per lane.
template <class C, int P, int SSZ>
__device__ __forceinline__ void scales_to_shared(uint32_t dst, const char* s_tile,
                                                 const char* b_tile, int c, int gshift, int lane,
                                                 bool read = true) {
  constexpr int kPieces = 16 * P * SSZ / 4;
  const int off = (((c << 6) >> gshift) * 16 * SSZ) + 4 * lane;
  const uint32_t n = read ? 4 : 0;
#pragma unroll
  for (int k = 0; k < (C::kFmt == kAffine ? 2 : 1); ++k) {
    const char* src = (k ? b_tile : s_tile) + off;
    const uint32_t d = dst + k * ScaleStage<P>::bytes + 4 * lane;
    if (lane < kPieces) cp_async_fill(d, src, 4, n);
    if constexpr (kPieces > 32)
      if (lane + 32 < kPieces) cp_async_fill(d + 128, src + 128, 4, n);
  }
}

__device__ __forceinline__ uint32_t smem_raw(const uint8_t* base, int i, int32_t dt) {
  if (dt == kU8) return base[i];
  if (dt == kF32) return reinterpret_cast<const uint32_t*>(base)[i];
  return reinterpret_cast<const uint16_t*>(base)[i];
}

// The block's dynamic shared memory, sized for its warps and tiles (a block of 4
// warps takes what it uses, not kMaxWarps' worth: more blocks fit on an SM):
// [x rows][weight stages: warps x S x TB x 32 lanes x BITS words][scale stages].
// The warps' partial sums (TB x warps x 16 x 16 floats) reuse the weight stages
// once every copy has landed: a warp's stages of a tile are S x 128 x BITS >= 1 KB.
struct SharedLayout {
  int stage_off, scale_off, bytes;
  template <class C, int P, int S, int TB = 1>
  __host__ __device__ static SharedLayout of(int x_rows, int x_stride, int warps) {
    SharedLayout l;
    l.stage_off = x_stride > 0 ? x_rows * x_stride : 0;  // x_stride is a multiple of 16
    l.scale_off = l.stage_off + warps * S * TB * 32 * C::kBits * 4;
    l.bytes = l.scale_off + warps * S * TB * 2 * ScaleStage<P>::bytes;
    return l;
  }
};
static_assert(Stages<2>::value * 32 * 2 * 4 >= kTileRows * 16 * 4,
              "a warp's weight stages hold its partial sums");

// The warp's share of the block's tiles tile0 + j * tstep, j < ntile <= TB (tstep 1:
// consecutive tiles; the SwiGLU's gate and up tiles are I / 16 apart):
// acc[j][nt][i] (C fragment layout) over its chunks warp, warp + W, ... TAIL: the
// partial last tile (TB = 1), read from its canonical rows.
// stage_x() (block-wide: it ends in __syncthreads) fills x_smem; with EARLY the
// first S - 1 chunks' copies are issued before it, so that DRAM works while x
// comes in from L2. The block's tiles share each x load (M > 8: x is read from
// L1/L2, and a tile's 16 rows are worth less than its M x K x bytes).
template <class C, int XDT, int NT, int P, bool TAIL, int SDT, int S, bool EARLY, int TB,
          class StageX>
__device__ __forceinline__ void accumulate_tiles(const Problem& pr, int64_t e, int64_t tile0,
                                                 int64_t tstep, int ntile, int mcount,
                                                 const int64_t* xrow_s,
                                                 uint32_t* stage_smem, uint8_t* scale_smem,
                                                 const char* x_smem, StageX&& stage_x,
                                                 float (&acc)[TB][NT][4]) {
  constexpr int BITS = C::kBits;
  constexpr int ESZ = dtype_bytes(XDT);
  using Scales = ChunkScales<C, P, TAIL, SDT>;
  const QmvProblem& p = pr.q;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  constexpr int ssz = dtype_bytes(SDT);
  // tiles past ntile (the block's last group of full tiles may be short) alias
  // tile0: their copies read nothing and their sums are never stored
  TileCursor cur[TB];
#pragma unroll
  for (int j = 0; j < TB; ++j)
    cur[j] = tile_cursor<TAIL>(p, e, j < ntile ? tile0 + j * tstep : tile0, BITS, ssz, lane);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = g + 8 * nt < mcount ? g + 8 * nt : 0;
    cur[0].x[nt] = x_smem ? x_smem + (int64_t)m * pr.x_stride + 4 * t * ESZ
                          : static_cast<const char*>(p.x) + (xrow_s[m] * p.K + 4 * t) * ESZ;
  }
  int gshift = 0;  // group sizes are powers of two
  while ((1 << gshift) < p.group) ++gshift;
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  const int chunks = (int)pr.chunks;
  // the warp's chunks: warp + i * warps, i < mine
  const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;

  if constexpr (TAIL || !EARLY) stage_x();
  if constexpr (TAIL) {
    static_assert(TB == 1, "the partial last tile is a block's only tile");
    for (int i = 0; i < mine; ++i) {
      const int c = warp + i * warps;
      uint32_t w[1][BITS];
      tail_unit<BITS>(cur[0].w, p.words, cur[0].valid_rows, c, lane, w[0]);
      Scales sc[1];
      sc[0].load(p, cur[0], c, gshift, g);
      compute_chunk<C, XDT, NT, P, TAIL, SDT, 1>(cur[0], c, w, sc, gsv, acc);
    }
  } else {
    // this lane's stage slots: [stage][tile][BITS words], private to the lane
    uint32_t* slots = stage_smem + ((warp * S * TB) * 32 + lane) * BITS;
    const uint32_t slots_s = (uint32_t)__cvta_generic_to_shared(slots);
    constexpr int kSlotStride = 32 * BITS;  // words between a lane's slots
    // the warp's scale stages: [stage][tile][scale, bias][ScaleStage bytes]
    constexpr int kSB = ScaleStage<P>::bytes;
    uint8_t* sstage = scale_smem + warp * S * TB * 2 * kSB;
    const uint32_t sstage_s = (uint32_t)__cvta_generic_to_shared(sstage);
    const char* s_tile[TB];
    const char* b_tile[TB];
#pragma unroll
    for (int j = 0; j < TB; ++j) {
      const int64_t row0 = e * p.N + (j < ntile ? tile0 + j * tstep : tile0) * kTileRows;
      s_tile[j] = static_cast<const char*>(p.scales) + row0 * p.groups * ssz;
      b_tile[j] = p.biases ? static_cast<const char*>(p.biases) + row0 * p.groups * ssz
                           : s_tile[j];
    }
    // scales through the pipeline when 4-byte copies can reach them (expert bases
    // of odd N x groups x bytes are not); else loaded one chunk ahead. The tiles
    // of a block are a multiple of 16 rows apart: they share tile0's alignment.
    const uintptr_t align =
        reinterpret_cast<uintptr_t>(s_tile[0]) | reinterpret_cast<uintptr_t>(b_tile[0]);
    // The issues below advance the scales' offset by a fixed step, which needs a warp's
    // chunks (warps x 64 k apart) to be whole groups apart: not so only with one warp
    // and groups of 128 (K < 256), which then takes the loop that loads scales itself.
    const uint32_t warp_k = (uint32_t)warps << 6;  // k between a warp's chunks
    const uint32_t step_s = (warp_k >> gshift) * (16u * ssz);
    const bool async_scales = (align & 3) == 0 && (warp_k >> gshift << gshift) == warp_k;
    // The lane's part of a chunk's scale copies, set once: a chunk's scales (and
    // biases) are kPieces 4-byte words each; where both fit a warp, lanes [0, kPieces)
    // copy the scales and the next kPieces lanes the biases: one predicated copy per
    // lane, no branch (scales_to_shared, two copies under a branch, otherwise).
    constexpr int kPieces = 16 * P * ssz / 4;
    constexpr bool kOneCopy = C::kFmt != kAffine ? kPieces <= 32 : 2 * kPieces <= 32;
    const bool bias_lane = C::kFmt == kAffine && lane >= kPieces;
    const bool scale_lane = lane < (C::kFmt == kAffine ? 2 : 1) * kPieces;
    const uint32_t lane_sdst = (bias_lane ? kSB : 0) + 4 * (lane % kPieces);
    const char* lane_ssrc[TB];
#pragma unroll
    for (int j = 0; j < TB; ++j)
      lane_ssrc[j] = (bias_lane ? b_tile[j] : s_tile[j]) + 4 * (lane % kPieces);
    // The warp's chunks are issued in order, S - 1 ahead of their use: the next one's
    // index among the warp's, chunk number, unit and scale byte offsets and stage
    // advance by a step per issue instead of being recomputed from the index (affine
    // 4-bit 108 -> 101 SASS instructions a chunk, MXFP4 160 -> 154; 3-5% less time
    // at Llama's shapes on an H200: docs/decode.md). Past the warp's last chunk, a
    // copy that reads nothing (of chunk 0, a valid address): no branch in the loop.
    // Offsets in unsigned 32-bit arithmetic.
    int iss_n = 0, iss_stage = 0;
    uint32_t iss_cc = (uint32_t)warp, iss_w = (uint32_t)warp * (128u * BITS);
    uint32_t iss_s = ((uint32_t)(warp << 6) >> gshift) * (16u * ssz);
    const uint32_t step_w = (uint32_t)warps * (128u * BITS);
    auto issue = [&](bool scales) {
      const bool read = iss_n < mine;
      const uint32_t wbyte = read ? iss_w : 0u, sbyte = read ? iss_s : 0u;
#pragma unroll
      for (int j = 0; j < TB; ++j) {
        const bool rj = read && j < ntile;
        const uint32_t slot = (uint32_t)(iss_stage * TB + j);
        unit_to_shared<BITS>(slots_s + slot * (kSlotStride * 4),
                             reinterpret_cast<const uint32_t*>(
                                 reinterpret_cast<const char*>(cur[j].w) + wbyte),
                             rj);
        if (scales) {
          if constexpr (kOneCopy) {
            cp_async_fill4_if(sstage_s + slot * (2 * kSB) + lane_sdst, lane_ssrc[j] + sbyte,
                              rj ? 4 : 0, scale_lane);
          } else {
            scales_to_shared<C, P, ssz>(sstage_s + slot * 2 * kSB, s_tile[j], b_tile[j],
                                        read ? iss_cc : 0u, gshift, lane, rj);
          }
        }
      }
      ++iss_n;
      iss_cc += (uint32_t)warps;
      iss_w += step_w;
      iss_s += step_s;
      iss_stage = next_stage<S>(iss_stage);
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      issue(async_scales);
      cp_async_commit();
    }
    if constexpr (EARLY) stage_x();
    // ASYNC: the scales come through the pipeline; else (unaligned) from global
    // memory one chunk ahead. Two loops, so that neither carries the other's code.
    auto loop = [&](auto async_tag) {
      constexpr bool ASYNC = decltype(async_tag)::value;
      Scales sc[TB];
      if (!ASYNC && mine > 0)
#pragma unroll
        for (int j = 0; j < TB; ++j) sc[j].load(p, cur[j], warp, gshift, g);
      int stage = 0;  // chunk i's (i % S)
      for (int i = 0; i < mine; ++i) {
        const int c = warp + i * warps;
        issue(ASYNC);  // chunk i + S - 1
        cp_async_commit();
        Scales sc_next[TB];
        if (!ASYNC) {
#pragma unroll
          for (int j = 0; j < TB; ++j) {
            sc_next[j] = sc[j];
            if (i + 1 < mine) sc_next[j].load(p, cur[j], c + warps, gshift, g);
          }
        }
        cp_async_wait<S - 1>();
        __syncwarp();
        uint32_t w[TB][BITS];
#pragma unroll
        for (int j = 0; j < TB; ++j) {
          const int slot = stage * TB + j;
          if constexpr (ASYNC) sc[j].load_shared(sstage + slot * 2 * kSB, g);
          load_unit<BITS, false>(slots + slot * kSlotStride, w[j]);
        }
        stage = next_stage<S>(stage);
        __syncwarp();  // every lane has read stage i % S before it is refilled
        compute_chunk<C, XDT, NT, P, TAIL, SDT, TB>(cur[0], c, w, sc, gsv, acc);
        if constexpr (!ASYNC)
#pragma unroll
          for (int j = 0; j < TB; ++j) sc[j] = sc_next[j];
      }
    };
    if (async_scales) loop(std::true_type{});
    else loop(std::false_type{});
    cp_async_wait<0>();
  }
}

// 16 bytes of shared memory at a shared-window address. The fused norm reads and
// writes staged x with these: through a generic pointer the same accesses went down
// the L1TEX path, where they queued behind the weight stream's cp.async copies.
__device__ __forceinline__ uint4 lds16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts16(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
               :: "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// 16 bytes of x (8 16-bit or 4 float32 elements) as float32, and back, rounded to x's
// dtype as store_out rounds
template <int XDT>
__device__ __forceinline__ void unpack16(uint4 u, float (&f)[16 / dtype_bytes(XDT)]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (XDT == kF32) {
      f[i] = bits_to_f32(w[i]);
    } else {
      f[2 * i] = raw_to_float(w[i] & 0xffffu, XDT);
      f[2 * i + 1] = raw_to_float(w[i] >> 16, XDT);
    }
  }
}
template <int XDT>
__device__ __forceinline__ uint4 pack16(const float (&f)[16 / dtype_bytes(XDT)]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (XDT == kF32) {
      w[i] = f32_to_bits(f[i]);
    } else if constexpr (XDT == kBF16) {
      w[i] = (uint32_t)f32_to_bf16(f[2 * i]) | ((uint32_t)f32_to_bf16(f[2 * i + 1]) << 16);
    } else {
      w[i] = (uint32_t)jq_f2h(f[2 * i]) | ((uint32_t)jq_f2h(f[2 * i + 1]) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The norm weight's elements k .. k + V - 1 plus the offset, as float32: one vector
// load where the weight is 16-byte aligned (`vec`), else one element at a time.
template <int V>
__device__ __forceinline__ void norm_weights(const Problem& pr, int64_t k, bool vec,
                                             float (&w)[V]) {
  if (vec && pr.norm_dt == kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(pr.norm_w) + k);
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      const float4 f = __ldg(p + i);
      w[4 * i] = f.x, w[4 * i + 1] = f.y, w[4 * i + 2] = f.z, w[4 * i + 3] = f.w;
    }
  } else if (vec) {  // 16-bit: V x 2 bytes
    const uint16_t* p = static_cast<const uint16_t*>(pr.norm_w) + k;
    uint32_t h[V / 2];
    if constexpr (V == 8) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
      h[0] = u.x, h[1] = u.y, h[2] = u.z, h[3] = u.w;
    } else {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      h[0] = u.x, h[1] = u.y;
    }
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      w[2 * i] = raw_to_float(h[i] & 0xffffu, pr.norm_dt);
      w[2 * i + 1] = raw_to_float(h[i] >> 16, pr.norm_dt);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) w[i] = raw_to_float(load_raw(pr.norm_w, k + i, pr.norm_dt), pr.norm_dt);
  }
#pragma unroll
  for (int i = 0; i < V; ++i) w[i] += pr.offset;
}

// The norm's per-vector steps, shared by both staging paths so that they round alike:
// ss + the squares of a 16-byte vector of x (in element order), and the vector
// normalized, (x * r) * w, rounded to x's dtype.
template <int XDT>
__device__ __forceinline__ float add_squares16(uint4 u, float ss) {
  float f[16 / dtype_bytes(XDT)];
  unpack16<XDT>(u, f);
#pragma unroll
  for (float e : f) ss = fmaf(e, e, ss);
  return ss;
}
template <int XDT>
__device__ __forceinline__ uint4 normalized16(uint4 u, float r, bool weighted,
                                              const float (&w)[16 / dtype_bytes(XDT)]) {
  constexpr int V = 16 / dtype_bytes(XDT);
  float f[V];
  unpack16<XDT>(u, f);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    f[i] *= r;
    if (weighted) f[i] *= w[i];
  }
  return pack16<XDT>(f);
}

// The norm prologue: the block's `rows` staged rows of x, rms-normalized in place:
// r = rsqrt(sum(x^2) / K + eps) per row, then (x * r) * (w + offset) in float32 (x * r
// without a weight), rounded to x's dtype: the reference's float32 steps in its order.
// While the first weight copies are in flight. A thread takes 16-byte vectors of each
// row (M = 1 at K = 4096 in bf16: 4 per thread) with ld/st.shared, and loads the norm
// weight's vectors for kNormVecs of them at once, each applied to every row. Element
// by element through generic pointers (one load, its use, its store at a time) the
// norm had cost 16 µs of a 30.8 µs kernel at 4096 -> 6144, M = 1 (the plain GEMV:
// 14.1 µs; ncu, H100: stalls on L1TEX).
// `norm_s`: shared, kMaxWarps x 16 partial sums, then one scale per row.
constexpr int kNormVecs = 4;
template <int XDT>
__device__ __forceinline__ void normalize_staged_x(uint8_t* xs, const Problem& pr, int rows,
                                                   float* norm_s) {
  constexpr int V = 16 / dtype_bytes(XDT);  // elements per 16-byte vector
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t K = pr.q.K;
  const int vecs = (int)(K / V);  // K is a multiple of 64
  const uint32_t xs_s = (uint32_t)__cvta_generic_to_shared(xs);
  float* row_scale = norm_s + kMaxWarps * 16;
  for (int m = 0; m < rows; ++m) {
    const uint32_t row = xs_s + (uint32_t)(m * pr.x_stride);
    float ss = 0.0f;
#pragma unroll 4
    for (int v = threadIdx.x; v < vecs; v += blockDim.x)
      ss = add_squares16<XDT>(lds16(row + 16 * v), ss);
    ss = warp_sum(ss);
    if (lane == 0) norm_s[warp * 16 + m] = ss;
  }
  __syncthreads();
  if ((int)threadIdx.x < rows) {
    float ss = 0.0f;
    for (int w = 0; w < warps; ++w) ss += norm_s[w * 16 + threadIdx.x];
    row_scale[threadIdx.x] = rsqrtf(ss / (float)K + pr.eps);
  }
  __syncthreads();
  const bool weighted = pr.norm_w != nullptr;
  const bool vec = (reinterpret_cast<uintptr_t>(pr.norm_w) & 15) == 0;
  for (int v0 = threadIdx.x; v0 < vecs; v0 += kNormVecs * blockDim.x) {
    float wk[kNormVecs][V];
#pragma unroll
    for (int j = 0; j < kNormVecs; ++j) {
      const int v = v0 + j * blockDim.x;
      if (weighted && v < vecs) norm_weights<V>(pr, (int64_t)v * V, vec, wk[j]);
    }
    for (int m = 0; m < rows; ++m) {
      const uint32_t row = xs_s + (uint32_t)(m * pr.x_stride);
      const float r = row_scale[m];
#pragma unroll
      for (int j = 0; j < kNormVecs; ++j) {
        const int v = v0 + j * blockDim.x;
        if (v < vecs)
          sts16(row + 16 * v, normalized16<XDT>(lds16(row + 16 * v), r, weighted, wk[j]));
      }
    }
  }
}

// The norm prologue with one row of x and at most kNormVecs 16-byte vectors a thread (K <= 4096
// in 16-bit x with 4 warps, 8192 with 8): x and the norm weight go to registers together
// (one memory latency, not one per phase as in stage x / normalize_staged_x), the sum of
// squares and the normalized x from those registers, one store of it to shared memory.
// Every float operation is normalize_staged_x's, in its order: the same bits.
template <int XDT>
__device__ __forceinline__ void stage_normalized_row(uint8_t* xs, const Problem& pr,
                                                     const void* xrow, float* norm_s) {
  constexpr int V = 16 / dtype_bytes(XDT);  // elements per 16-byte vector
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t K = pr.q.K;
  const int vecs = (int)(K / V);
  const uint32_t xs_s = (uint32_t)__cvta_generic_to_shared(xs);
  const bool weighted = pr.norm_w != nullptr;
  const bool vec = (reinterpret_cast<uintptr_t>(pr.norm_w) & 15) == 0;
  uint4 xv[kNormVecs];
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) xv[j] = JQ_LDG(reinterpret_cast<const uint4*>(xrow) + v);
  }
  float wk[kNormVecs][V];
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (weighted && v < vecs) norm_weights<V>(pr, (int64_t)v * V, vec, wk[j]);
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j)
    if ((int)threadIdx.x + j * (int)blockDim.x < vecs) ss = add_squares16<XDT>(xv[j], ss);
  ss = warp_sum(ss);
  if (lane == 0) norm_s[warp * 16] = ss;
  __syncthreads();
  ss = 0.0f;
  for (int w = 0; w < warps; ++w) ss += norm_s[w * 16];
  const float r = rsqrtf(ss / (float)K + pr.eps);
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) sts16(xs_s + 16 * v, normalized16<XDT>(xv[j], r, weighted, wk[j]));
  }
  __syncthreads();
}

// v rounded to x's dtype (the unfused qmm's output), back as float.
__device__ __forceinline__ float round_to_dtype(float v, int32_t dt) {
  if (dt == kBF16) return bits_to_f32((uint32_t)f32_to_bf16(v) << 16);
  if (dt == kF16) return jq_h2f(jq_f2h(v));
  return v;
}

__device__ __forceinline__ float sigmoid_f32(float v) { return 1.0f / (1.0f + expf(-v)); }

// kFuseSwiglu: output n of act(gate, up) from the two halves' float32 sums, in the
// reference's steps: each half rounded to x's dtype, + bias (float32), then
// silu(gate) * up, or gpt-oss's gate = min(gate, limit), up = clip(up, -limit,
// limit), (up + 1) * gate * sigmoid(gate * alpha). The comparisons keep NaN as
// jnp.minimum / jnp.clip do.
// e: the matrix's expert (the bias row, with bias_stride).
__device__ __forceinline__ float swiglu_out(const Problem& pr, float gate, float up, int64_t e,
                                            int64_t n, int64_t half) {
  gate = round_to_dtype(gate, pr.q.x_dt);
  up = round_to_dtype(up, pr.q.x_dt);
  if (pr.bias != nullptr) {
    const int64_t b = e * pr.bias_stride + n;
    gate += raw_to_float(load_raw(pr.bias, b, pr.bias_dt), pr.bias_dt);
    up += raw_to_float(load_raw(pr.bias, b + half, pr.bias_dt), pr.bias_dt);
  }
  if (pr.activation == kActGptOss) {
    gate = gate > pr.limit ? pr.limit : gate;
    up = up > pr.limit ? pr.limit : (up < -pr.limit ? -pr.limit : up);
    return (up + 1.0f) * gate * sigmoid_f32(gate * pr.alpha);
  }
  return gate * sigmoid_f32(gate) * up;
}

// TB: full tiles per block (1 or 2: see tiles_per_block). Blocks
// 0 .. ceil(full_tiles / TB) - 1 take TB consecutive full tiles each (the last
// maybe fewer), the block after them the partial last tile, if any. FUSE
// (kFuseNone compiles to the plain GEMV, with Problem::addend its epilogue): kFuseNorm
// (x always staged) or kFuseSwiglu (TB = 2, N = 2I with I % 16 == 0: block b owns tiles
// b and b + I / 16; with Problem::normalize the norm prologue too, x staged, M <= 8).
template <class C, int XDT, int NT, int P, int SDT, int S = Stages<C::kBits>::value,
          bool EARLY = true, int PF = S - 1, int TB = 1, int FUSE = kFuseNone>
__global__ void __launch_bounds__(256, 2) qmv_mma_kernel(Problem pr) {
  constexpr int CAP = 8 * NT;  // rows of x per segment
  constexpr bool SWIGLU = FUSE == kFuseSwiglu;
  static_assert(!SWIGLU || TB == 2, "the SwiGLU's block owns a gate and an up tile");
  // the variants with the norm prologue, and whether this launch runs it (a runtime
  // choice in the SwiGLU's: one kernel for qmm_swiglu and rms_norm_qmm_swiglu). Not in
  // the SwiGLU's two-n-tile kernels (M > 8): at 5, 6 and 2 bits with 32-row groups the
  // norm's registers made them spill, and launch_s refuses them the norm.
  constexpr bool CAN_NORM = FUSE == kFuseNorm || (SWIGLU && NT == 1);
  const bool norm = FUSE == kFuseNorm || (CAN_NORM && pr.normalize);
  const QmvProblem& p = pr.q;

  __shared__ int64_t xrow_s[16], yrow_s[16];
  __shared__ int mcount_s;
  // the norm prologue: the rows' partial sums of squares per warp, then their scales
  __shared__ float norm_s[CAN_NORM ? (kMaxWarps + 1) * 16 : 1];
  // Dynamic shared memory, sized by the launch for the block's warps (SharedLayout):
  // x rows | weight stages | scale stages; the warps' partial sums reuse the stages.
  extern __shared__ __align__(16) uint8_t smem_dyn[];
  const SharedLayout lay =
      SharedLayout::of<C, P, S, TB>(pr.x_rows, pr.x_stride, blockDim.x >> 5);
  uint32_t* stage_smem = reinterpret_cast<uint32_t*>(smem_dyn + lay.stage_off);
  uint8_t* scale_smem = smem_dyn + lay.scale_off;
  // the partial sums: [tile j * warps + warp][row][column]
  float(*red)[kTileRows][16] = reinterpret_cast<float(*)[kTileRows][16]>(smem_dyn + lay.stage_off);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // the block's tiles: tile0 + j * tstep, j < ntile
  const int64_t tstep = SWIGLU ? pr.full_tiles / 2 : 1;
  const int64_t full_blocks = SWIGLU ? tstep : (pr.full_tiles + TB - 1) / TB;
  const bool tail = !SWIGLU && (int64_t)blockIdx.x >= full_blocks;  // the partial last tile
  const int64_t tile0 = tail ? pr.full_tiles : (int64_t)blockIdx.x * (SWIGLU ? 1 : TB);
  const int ntile = tail ? 1 : SWIGLU ? 2 : (int)min((int64_t)TB, pr.full_tiles - tile0);
  const int64_t s = blockIdx.y;
  // Launched as a programmatic dependent (launch_s: sm_90), the block may start
  // while the kernel before it still runs. Every input may be that kernel's output,
  // so nothing is read before grid_dependency_wait() returns (a no-op in an ordinary
  // launch). What may happen before: the warp's first PF chunks of a qmm
  // weight tile are prefetched into L2. A prefetch is only a hint and L2 is where
  // every SM's writes meet, so a line the kernel before writes later is read as
  // written.
  if constexpr (PF > 0) {
    if (p.indices == nullptr && !tail) {  // gather: the expert is an input
      const int mine = (int)((pr.chunks - warp + warps - 1) / warps);
      for (int j = 0; j < ntile; ++j) {
        const uint32_t* unit =
            p.data + (s * p.N + (tile0 + j * tstep) * kTileRows) * p.words + lane * C::kBits;
        for (int i = 0; i < PF && i < mine; ++i)
          prefetch_l2(unit + (int64_t)(warp + i * warps) * (32 * C::kBits));
      }
    }
  }
  if constexpr (CAN_NORM) {  // the norm weight, which every block reads first
    if (norm && pr.norm_w != nullptr) {
      const int64_t bytes = p.K * (pr.norm_dt == kF32 ? 4 : 2);
      for (int64_t o = 128 * (int64_t)threadIdx.x; o < bytes; o += 128 * (int64_t)blockDim.x)
        prefetch_l2(static_cast<const char*>(pr.norm_w) + o);
    }
  }
  grid_dependency_wait();
  // --- the segment: expert and rows of x / y -------------------------------
  int64_t e = s;
  if (p.indices != nullptr) e = p.indices[s];
  const bool valid = e >= 0 && e < p.E;
  if (warp == 0) {
    int count = 0;
    if (p.indices == nullptr) {
      count = (int)p.M;
      if (lane < count) {
        xrow_s[lane] = (s / p.x_div) * p.M + lane;
        yrow_s[lane] = s * p.M + lane;
      }
    } else if (!valid || !pr.dedupe) {
      count = 1;
      if (lane == 0) {
        xrow_s[0] = s / p.x_div;
        yrow_s[0] = s;
      }
    } else {
      // occurrences of e before s: a block leads when their number is a multiple of CAP
      int before = 0;
      for (int64_t b0 = 0; b0 < s; b0 += 32) {
        const int64_t j = b0 + lane;
        const bool hit = j < s && p.indices[j] == e;
        before += __popc(__ballot_sync(0xffffffffu, hit));
      }
      if (before % CAP == 0) {
        for (int64_t b0 = s; b0 < p.S && count < CAP; b0 += 32) {
          const int64_t j = b0 + lane;
          const bool hit = j < p.S && p.indices[j] == e;
          const uint32_t mask = __ballot_sync(0xffffffffu, hit);
          const int pos = count + __popc(mask & ((1u << lane) - 1u));
          if (hit && pos < CAP) {
            xrow_s[pos] = j / p.x_div;
            yrow_s[pos] = j;
          }
          count += __popc(mask);
        }
        count = count < CAP ? count : CAP;
      }
    }
    if (lane == 0) mcount_s = count;
  }
  __syncthreads();
  const int mcount = mcount_s;
  if (mcount == 0) return;  // another block computes this slot

  float acc[TB][NT][4];
#pragma unroll
  for (int j = 0; j < TB; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][nt][i] = 0.0f;

  // the segment's rows of x, once per block (every warp reads all of K)
  const char* x_smem = pr.x_stride > 0 ? reinterpret_cast<const char*>(smem_dyn) : nullptr;
  auto stage_x = [&]() {
    if (x_smem == nullptr) return;
    const int esz = p.x_dt == kF32 ? 4 : 2;
    if constexpr (CAN_NORM) {
      if (norm && mcount == 1 && p.K * esz <= 16 * kNormVecs * (int64_t)blockDim.x) {
        stage_normalized_row<XDT>(smem_dyn, pr,
                                  static_cast<const char*>(p.x) + xrow_s[0] * p.K * esz, norm_s);
        return;
      }
    }
    const int row_vecs = (int)(p.K * esz / 16);
    for (int i = threadIdx.x; i < mcount * row_vecs; i += blockDim.x) {
      const int m = i / row_vecs, v = i - m * row_vecs;
      const uint4 val = JQ_LDG(reinterpret_cast<const uint4*>(
                                   static_cast<const char*>(p.x) + xrow_s[m] * p.K * esz) + v);
      *reinterpret_cast<uint4*>(smem_dyn + (int64_t)m * pr.x_stride + 16 * v) = val;
    }
    if constexpr (CAN_NORM) {
      if (norm) {
        __syncthreads();
        normalize_staged_x<XDT>(smem_dyn, pr, mcount, norm_s);
      }
    }
    __syncthreads();
  };
  if (valid) {
    if (!tail) {
      accumulate_tiles<C, XDT, NT, P, false, SDT, S, EARLY, TB>(pr, e, tile0, tstep, ntile,
                                                                mcount, xrow_s, stage_smem,
                                                                scale_smem, x_smem, stage_x, acc);
    } else if constexpr (!SWIGLU) {
      float (&acc1)[1][NT][4] = *reinterpret_cast<float(*)[1][NT][4]>(&acc[0]);
      accumulate_tiles<C, XDT, NT, P, true, SDT, S, EARLY, 1>(
          pr, e, tile0, 1, 1, mcount, xrow_s, stage_smem, scale_smem, x_smem, stage_x, acc1);
    }
  }

  // the next GEMV's blocks may start on the SM slots this grid leaves free (they wait
  // for its end in grid_dependency_wait; letting them start at the top measured slower)
  grid_dependents_may_launch();
  // --- the warps' partial sums meet in shared memory (over the stages) ------
  __syncthreads();
#pragma unroll
  for (int j = 0; j < TB; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        red[j * warps + warp][g + 8 * (i >> 1)][8 * nt + 2 * t + (i & 1)] = acc[j][nt][i];
  __syncthreads();
  if constexpr (SWIGLU) {
    // gate row n (tile0) and up row n + I (tile0 + I / 16), summed over the warps in
    // the plain GEMV's order; output n of I
    const int64_t half = p.N / 2;
    for (int idx = threadIdx.x; idx < kTileRows * mcount; idx += blockDim.x) {
      const int r = idx % kTileRows, m = idx / kTileRows;
      const int64_t n = tile0 * kTileRows + r;
      float gate = 0.0f, up = 0.0f;
      for (int wi = 0; wi < warps; ++wi) {
        gate += red[wi][r][m];
        up += red[warps + wi][r][m];
      }
      store_out(p.y, yrow_s[m] * half + n, p.x_dt,
                valid ? swiglu_out(pr, gate, up, e, n, half) : quiet_nan());
    }
  } else {
    for (int idx = threadIdx.x; idx < ntile * kTileRows * mcount; idx += blockDim.x) {
      const int r = idx % kTileRows, m = (idx / kTileRows) % mcount,
                j = idx / (kTileRows * mcount);
      const int64_t n = (tile0 + j) * kTileRows + r;
      if (n >= p.N) continue;
      float v = 0.0f;
      for (int wi = 0; wi < warps; ++wi) v += red[j * warps + wi][r][m];
      const int64_t at = yrow_s[m] * p.N + n;
      if (pr.addend != nullptr)  // qmm(x, w) + addend: the product rounded first, as there
        v = round_to_dtype(v, p.x_dt) + raw_to_float(load_raw(pr.addend, at, p.x_dt), p.x_dt);
      store_out(p.y, at, p.x_dt, valid ? v : quiet_nan());
    }
  }
}

// $NAME when it is one of `allowed` (a value benchmark sweeps force), else 0.
inline int env_choice(const char* name, std::initializer_list<int> allowed) {
  const char* env = getenv(name);
  const int v = env ? atoi(env) : 0;
  for (int a : allowed)
    if (v == a) return v;
  return 0;
}

// The current device's SM count (gpu_ffi.hip caches it per device).
inline int sm_count() { return jq_device_sm_count(); }

// cudaFuncSetAttribute changes a kernel on the CURRENT device only: a process that
// launches it on several GPUs (tensor / expert parallel: one XLA thread per device) must
// raise the shared-memory limit on each, or the launch fails on every device but the
// first, and that device's peers then wait forever in their next collective. `done`
// (a static of the caller's template instance: one per kernel) holds a bit per device.
template <class Kernel>
inline bool raise_shared_limit(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  const uint64_t bit = uint64_t(1) << dev;
  if (done.load(std::memory_order_acquire) & bit) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
      cudaSuccess)
    return false;
  done.fetch_or(bit, std::memory_order_acq_rel);
  return true;
}

// Launch the GEMV as a programmatic dependent (sm_90+): its blocks start while the
// kernel before it in the stream drains, and wait in grid_dependency_wait() before
// reading anything. Measured on an H100 (tools/cuda/tune_mma_driver.hip, back to back):
// 1.6 us less per call at every size, 33 MB 18.4 -> 16.8 us. $JAXQUANT_PDL=0 turns it off.
inline bool programmatic_launch() {
  static const bool on = [] {
    const char* env = getenv("JAXQUANT_PDL");
    if (env != nullptr && env[0] == '0') return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return on;
}

// Warps per block (split K): a function of K only, so that one output
// element's float ops do not depend on M, the slot or N (gather_qmm == qmm
// bit for bit on this kernel too).
// $JAXQUANT_MMA_WARPS (1, 2, 4 or 8) overrides it for benchmark sweeps.
inline int forced_warps() {
  static const int forced = env_choice("JAXQUANT_MMA_WARPS", {1, 2, 4, 8});
  return forced;
}
inline int warps_for(int64_t chunks) {
  if (const int forced = forced_warps()) return forced;
  if (chunks >= 128) return 8;
  if (chunks >= 16) return 4;
  return chunks >= 4 ? 2 : 1;
}

// The SwiGLU variant's warps. Its block owns a gate and an up tile; at 4-bit affine
// codes 4 warps measured slow there and 8 faster (H100, tools/cuda/ab_mma_driver.hip,
// 4096 -> 2 x 14336: M = 1 32.7 us at 4 warps, 28.2 at 8, 31.0 at 2; M = 2 37.6 / 33.2;
// M = 4 39.8 / 38.1), while MXFP4 went the other way (29.1 at 4, 34.9 at 8), so only
// affine 4-bit takes 8 where warps_for gives 4. $JAXQUANT_MMA_WARPS (every kernel) and
// $JAXQUANT_MMA_SWIGLU_WARPS (this variant) override it.
template <class C>
inline int swiglu_warps(int64_t chunks) {
  static const int forced = env_choice("JAXQUANT_MMA_SWIGLU_WARPS", {1, 2, 4, 8});
  if (forced) return forced;
  const int w = warps_for(chunks);
  constexpr bool affine4 = C::kFmt == kAffine && C::kBits == 4;
  return affine4 && w == 4 && !forced_warps() ? 8 : w;
}

// Full tiles per block. A block's tiles share each x load, affine's sum(x) MMA and the
// chunk loop's waits; with the grid halved the bytes in flight per warp double. A
// tile's float ops do not depend on it. $JAXQUANT_MMA_TILES (1 or 2) overrides it.
// - M > 8: x (M x K, read through L1/L2 when it does not fit kMaxXSharedBytes)
//   outweighs a tile's weights (16 x K codes): two tiles where half the tiles still
//   give every SM two blocks.
// - M = 1 (qmm), 4-bit codes (launch_s): two tiles where the grid stays 8 blocks
//   of two per SM deep (a language model's head). Per tile and chunk the loop then
//   issues fewer instructions (affine4 101 -> 81; SASS, sm_90); the
//   head (4096 -> 128256) took 114 -> 104 us for affine4 and 129 -> 112 for mxfp4,
//   gpt-oss-20b's (2880 -> 201088, mxfp4) 153 -> 128 (H100,
//   tools/cuda/ab_mma_driver.hip); at 3-7 blocks per SM (4096 -> 14336 / 28672) the
//   halved grid lost 0-8%.
// - M = 2..8 keep one: measured both ways (M = 4: affine4 26.6 -> 22.8 us, mxfp4
//   24.4 -> 26.0; M = 2 19.4 -> 19.9).
inline int tiles_per_block(const QmvProblem& q, int nt, int64_t full_tiles) {
  static const int forced = env_choice("JAXQUANT_MMA_TILES", {1, 2});
  if (forced) return forced;
  const int64_t pairs = (full_tiles / 2) * q.S;
  if (nt == 2) return pairs >= 2 * (int64_t)sm_count() ? 2 : 1;
  return q.M == 1 && q.indices == nullptr && pairs >= 8 * (int64_t)sm_count() ? 2 : 1;
}

// The most bytes of x a block of the FUSE variant stages.
template <int FUSE>
constexpr int max_x_shared_bytes() {
  return FUSE == kFuseNorm ? kMaxNormXSharedBytes : kMaxXSharedBytes;
}

// The covering set of the CUDA compile check (tests/test_ffi_toolchain.py on machines
// without a GPU, as in CI; never a library build): -DJQ_MMA_COVERING_SET builds every
// codec in one variant of each kernel (one n-tile count, groups per chunk, scale dtype,
// tiles per block, wgmma tile) and affine 4-bit, whose float scales and biases take
// every branch, in all of them; with bfloat16 x every codec, with float16 or float32
// x affine 4-bit and MXFP4 alone (x's dtype enters a kernel through x's loads and
// conversions, apart from the codec's decode), and float16 x in one variant but both
// scale dtypes (the other variants branch on 16-bit against float32 x, never on
// float16 against bfloat16; 16-bit scales are x's own dtype, a conversion of their own).
// Each codec's code, each variant's and each x dtype's then compiles at least once,
// at about a quarter of the check's time (docs/building.md, "CI's time"); every
// build of the library compiles the whole matrix.
#if defined(JQ_MMA_COVERING_SET)
template <class C>
constexpr bool kAffine4 = C::kFmt == kAffine && C::kBits == 4;
template <class C, int XDT>
constexpr bool kEveryVariant = kAffine4<C> && XDT != kF16;
template <class C>
constexpr bool kEveryScaleDtype = kAffine4<C>;
template <class C, int XDT>
constexpr bool kBuiltForX = XDT == kBF16 || kAffine4<C> || C::kFmt == kMxfp4;
#else
template <class C, int XDT>
constexpr bool kEveryVariant = true;
template <class C>
constexpr bool kEveryScaleDtype = true;
template <class C, int XDT>
constexpr bool kBuiltForX = true;
#endif

template <class C, int XDT, int NT, int P, int SDT, int TB, int FUSE = kFuseNone>
static hipError_t launch_tb(const Problem& prx, int warps, hipStream_t stream) {
  constexpr int S = Stages<C::kBits>::value;
  auto kernel = qmv_mma_kernel<C, XDT, NT, P, SDT, S, true, S - 1, TB, FUSE>;
  const SharedLayout lay = SharedLayout::of<C, P, S, TB>(prx.x_rows, prx.x_stride, warps);
  constexpr int kMost = max_x_shared_bytes<FUSE>() +
                        kMaxWarps * S * TB * (32 * C::kBits * 4 + 2 * ScaleStage<P>::bytes);
  static std::atomic<uint64_t> raised{0};
  if (!raise_shared_limit(kernel, kMost, raised)) return hipErrorInvalidValue;
  const int64_t blocks = FUSE == kFuseSwiglu
                             ? prx.full_tiles / 2
                             : (prx.full_tiles + TB - 1) / TB + (prx.tiles - prx.full_tiles);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks, (unsigned)prx.q.S, 1);
  cfg.blockDim = dim3((unsigned)(32 * warps));
  cfg.dynamicSmemBytes = lay.bytes;
  cfg.stream = stream;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl;
  cfg.numAttrs = programmatic_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, prx);
}

// FUSE: kFuseNorm stages x always (the handler checked that it fits
// kMaxNormXSharedBytes) and keeps one tile per block (x then comes from shared
// memory, not L1/L2: nothing for a second tile to share); kFuseSwiglu takes two.
template <class C, int XDT, int NT, int P, int SDT, int FUSE = kFuseNone>
static hipError_t launch_s(const Problem& pr, hipStream_t stream) {
  const int warps = FUSE == kFuseSwiglu ? swiglu_warps<C>(pr.chunks) : warps_for(pr.chunks);
  constexpr int esz = dtype_bytes(XDT);
  Problem prx = pr;
  prx.x_rows = pr.q.indices != nullptr ? (pr.dedupe ? 8 * NT : 1) : (int)pr.q.M;
  prx.x_stride = (int)(pr.q.K * esz + 16);
  // The plain GEMV stages x in shared memory for one row; more rows come through L1,
  // which every block on the SM shares, where staged copies are one per block (M x K x
  // 2 bytes against a tile's 16 x K / 2 of 4-bit weights). H100, 4096 -> 14336 affine4:
  // M = 2 19.3 -> 17.0 us, M = 3 22.7 -> 17.2, M = 4 26.7 -> 17.5 (mxfp4 24.8 -> 17.4)
  // through L1 (4096 -> 4096 at M = 4: 11.1 -> 11.4); one row at K = 14336 (28 KiB)
  // stays faster staged (19.4 against 20.5). The fused variants keep staging (the norm
  // needs it; the SwiGLU's two tiles share one copy: 37.3 staged against 39.7 through
  // L1 at M = 2). Past max_x_shared_bytes staging would cost blocks per SM.
  const bool stage = FUSE != kFuseNone || prx.x_rows == 1;
  if (!stage || (int64_t)prx.x_rows * prx.x_stride > max_x_shared_bytes<FUSE>())
    prx.x_stride = 0;  // x from L1/L2
  if constexpr (FUSE == kFuseNorm) {
    if (prx.x_stride == 0) return hipErrorInvalidValue;
    return launch_tb<C, XDT, NT, P, SDT, 1, FUSE>(prx, warps, stream);
  } else if constexpr (FUSE == kFuseSwiglu) {
    // the norm: one n-tile (CAN_NORM), x staged
    if (prx.normalize && (NT != 1 || prx.x_stride == 0)) return hipErrorInvalidValue;
    return launch_tb<C, XDT, NT, P, SDT, 2, FUSE>(prx, warps, stream);
  } else {
    // two tiles' registers fit the 128 of __launch_bounds__ without spills up to 6
    // bits, with 16-bit x and 8/16-bit scales (ptxas -v, sm_90); 8-bit weights
    // weigh twice as much against x anyway. With 8 columns (M <= 8) only at 4 bits,
    // for a model's head at M = 1 (tiles_per_block): built at every width up to 6 bits
    // the library's build took 266 s on the H100 machine, 160-225 s without them.
    constexpr bool kTwoTiles = NT == 2 ? C::kBits <= 6 : C::kBits == 4;
    if constexpr (kTwoTiles && SDT != kF32 && XDT != kF32 && kEveryVariant<C, XDT>) {
      if (tiles_per_block(pr.q, NT, pr.full_tiles) == 2)
        return launch_tb<C, XDT, NT, P, SDT, 2>(prx, warps, stream);
    }
    return launch_tb<C, XDT, NT, P, SDT, 1>(prx, warps, stream);
  }
}

// The decode GEMV's launch policy for the format switches below (the prefill
// GEMM has its own: qmm_gemm.h); FUSE picks a fused variant.
template <int FUSE>
struct FusedGemvLaunch {
  template <class C, int XDT, int NT, int P, int SDT>
  static hipError_t run(const Problem& pr, hipStream_t stream) {
    return launch_s<C, XDT, NT, P, SDT, FUSE>(pr, stream);
  }
};
using GemvLaunch = FusedGemvLaunch<kFuseNone>;

// The launch of the kernels on this layout, shared by them: launch_formats picks the
// codec C (jq::dispatch_format), then L::run<C, XDT, NT, P, SDT>(pr, stream) with x's
// dtype, n-tiles NT, groups per chunk P (only the group sizes each format allows)
// and the scales' dtype SDT: uint8 codes, or for float-scale formats float32 or x's
// own 16-bit dtype, nothing else. jaxquant/ffi/mma.py converts other scales to
// float32 (exact) before the call, and the handlers refuse a call with others
// (gemv_mma.hip, check_scale_dtype). Serving every pair (bf16 scales with f16 x,
// 16-bit scales with f32 x) built a third more affine kernels, a sixth of the build.
template <class L, class C, int XDT, int NT, int P, class Pr>
static hipError_t launch_p(const Pr& pr, hipStream_t stream) {
  if constexpr (C::kScale != kScaleFloat) {
    return L::template run<C, XDT, NT, P, kU8>(pr, stream);
  } else {
    if (pr.q.scale_dt == kF32) return L::template run<C, XDT, NT, P, kF32>(pr, stream);
    if constexpr (XDT != kF32 && kEveryScaleDtype<C>) {
      if (pr.q.scale_dt == XDT) return L::template run<C, XDT, NT, P, XDT>(pr, stream);
    }
    return hipErrorInvalidValue;
  }
}

template <class L, class C, int XDT, int NT, class Pr>
static hipError_t launch_nt(const Pr& pr, hipStream_t stream) {
  const int g = pr.q.group;
  if constexpr (!kEveryVariant<C, XDT> && (C::kFmt == kAffine || C::kFmt == kFp4)) {
    return launch_p<L, C, XDT, NT, 1>(pr, stream);  // the compile check's covering set
  } else if constexpr (C::kFmt == kAffine) {
    return g == 32 ? launch_p<L, C, XDT, NT, 2>(pr, stream) : launch_p<L, C, XDT, NT, 1>(pr, stream);
  } else if constexpr (C::kFmt == kNvfp4) {
    return launch_p<L, C, XDT, NT, 4>(pr, stream);
  } else if constexpr (C::kFmt == kFp4) {
    return g == 16 ? launch_p<L, C, XDT, NT, 4>(pr, stream)
                   : g == 32 ? launch_p<L, C, XDT, NT, 2>(pr, stream)
                             : launch_p<L, C, XDT, NT, 1>(pr, stream);
  } else {
    return launch_p<L, C, XDT, NT, 2>(pr, stream);  // MX: group 32
  }
}

template <class L, class C, int XDT, class Pr>
static hipError_t launch_c(const Pr& pr, int nt, hipStream_t stream) {
  if constexpr (!kEveryVariant<C, XDT>) {
    return launch_nt<L, C, XDT, 1>(pr, stream);  // the compile check's covering set
  } else {
    return nt == 1 ? launch_nt<L, C, XDT, 1>(pr, stream) : launch_nt<L, C, XDT, 2>(pr, stream);
  }
}

// The one switch on formats (jq::dispatch_format) over the formats in FORMATS: the
// affine and the small-float families build in separate translation units
// (qmv_mma_<family>_<dtype>.hip, so nvcc builds them in parallel).
template <class L, int XDT, uint32_t FORMATS, class Pr>
static hipError_t launch_formats(const Pr& pr, int nt, hipStream_t stream) {
  hipError_t err = hipErrorInvalidValue;  // (a pair no format allows: checked before)
  dispatch_format<FORMATS>(pr.q.fmt, pr.q.bits, [&](auto codec) {
    if constexpr (kBuiltForX<decltype(codec), XDT>) err = launch_c<L, decltype(codec), XDT>(pr, nt, stream);
  });
  return err;
}

// One kernel a translation unit where CMake builds the library: CMakeLists.txt compiles
// each qmv_mma_<family>_<dtype>.hip once per launcher it defines (JQ_MMA_PART =
// JQ_MMA_GEMV, JQ_MMA_GEMM or JQ_MMA_DEQUANT) and each gemv_mma_fused_<family>_<dtype>.hip
// once per variant (JQ_MMA_NORM, JQ_MMA_SWIGLU), so the longest compile, which bounds a
// parallel build, is one kernel's (docs/building.md has the times). Without JQ_MMA_PART
// a file defines all of them (the compile checks, a hand build).
#define JQ_MMA_GEMV 1
#define JQ_MMA_GEMM 2
#define JQ_MMA_DEQUANT 3
#define JQ_MMA_NORM 4
#define JQ_MMA_SWIGLU 5
#if defined(JQ_MMA_PART)
#define JQ_MMA_BUILDS(part) (JQ_MMA_PART == (part))
#else
#define JQ_MMA_BUILDS(part) 1
#endif

#define JQ_MMA_DECLARE(DT)                                                                   \
  hipError_t launch_gemv_mma_affine_##DT(const Problem& pr, int nt, hipStream_t stream);      \
  hipError_t launch_gemv_mma_float_##DT(const Problem& pr, int nt, hipStream_t stream);       \
  inline hipError_t launch_qmv_mma_##DT(const Problem& pr, int nt, hipStream_t stream) {      \
    return pr.q.fmt == kAffine ? launch_gemv_mma_affine_##DT(pr, nt, stream)                   \
                               : launch_gemv_mma_float_##DT(pr, nt, stream);                  \
  }                                                                                           \
  hipError_t launch_qmv_mma_norm_affine_##DT(const Problem& pr, int nt, hipStream_t stream);  \
  hipError_t launch_qmv_mma_norm_float_##DT(const Problem& pr, int nt, hipStream_t stream);   \
  hipError_t launch_qmv_mma_swiglu_affine_##DT(const Problem& pr, int nt, hipStream_t stream);\
  hipError_t launch_qmv_mma_swiglu_float_##DT(const Problem& pr, int nt, hipStream_t stream); \
  inline hipError_t launch_gemv_mma_fused_##DT(const Problem& pr, int nt, int fuse,            \
                                              hipStream_t stream) {                           \
    const bool affine = pr.q.fmt == kAffine;                                                  \
    if (fuse == kFuseNorm)                                                                    \
      return affine ? launch_qmv_mma_norm_affine_##DT(pr, nt, stream)                         \
                    : launch_qmv_mma_norm_float_##DT(pr, nt, stream);                         \
    return affine ? launch_qmv_mma_swiglu_affine_##DT(pr, nt, stream)                         \
                  : launch_qmv_mma_swiglu_float_##DT(pr, nt, stream);                         \
  }
JQ_MMA_DECLARE(bf16)
JQ_MMA_DECLARE(f16)
JQ_MMA_DECLARE(f32)
#undef JQ_MMA_DECLARE

// A fused launcher (gemv_mma_fused_<family>_<dtype>.hip defines the norm and the SwiGLU
// one of its family and x dtype; CMake compiles the file once for each, JQ_MMA_NORM and
// JQ_MMA_SWIGLU).
#define JQ_MMA_FUSED_LAUNCHER(KIND, FUSE, FAMILY, DT, XDT, FORMATS)                          \
  hipError_t launch_qmv_mma_##KIND##_##FAMILY##_##DT(const Problem& pr, int nt,             \
                                                    hipStream_t stream) {                    \
    return launch_formats<FusedGemvLaunch<FUSE>, XDT, FORMATS>(pr, nt, stream);              \
  }


}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif  // JQ_PLATFORM_CUDA

