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
// unit at (chunk * 32 + lane) * bits: 16-byte loads for 4 and 8 bits, U
// chunks in flight before any is used. Codes become bf16x2 / half2 A
// registers without int->float conversions:
//   affine 4-bit: (w >> 4j) & 0x000f000f | magic (128 + c in bf16, 1024 + c in
//     half); the magic is folded into the bias: y = s*sum((M+c)x) + (b - M*s)*sum(x);
//   E2M1 (mxfp4, nvfp4, fp4): magnitude and sign bits moved into place with
//     shifts/LOP3, one HMUL2 by 2^126 (bf16) / 2^14 (half) rebases the exponent;
//   other formats: the codec's exact float decode and one F2FP pack per pair.
// Scales are applied once per group (per chunk for group 128) to the MMA's
// group sum: exactly, as a power of two, for E8M0. sum(x) per group (affine)
// is one more MMA with an all-ones A. float32 x is split into bf16 hi + lo
// (two MMAs: ~2^-17 relative error per element instead of float32's 2^-24).
//
// gather_qmm: slot s uses expert indices[s] (on the device). With `dedupe`,
// the slots that pick the same expert are one segment of up to 8*NT rows
// whose weights are read once: the block of the segment's first slot
// computes it, the others return at once. An id outside [0, E) gives a NaN
// row and no weight read.
#pragma once

#include "gpu_common.h"

#if defined(JQ_PLATFORM_CUDA)
#include <cuda_bf16.h>

namespace jq {
namespace gpu {
namespace mma {

constexpr int kChunkK = 64;      // k per chunk (4 MMA k-steps)
constexpr int kTileRows = 16;    // weight rows per MMA tile
constexpr int kMaxWarps = 8;

struct Problem {
  QmvProblem q;
  int64_t tiles;     // ceil(N / 16)
  int64_t full_tiles;  // N / 16: tiles in the MMA layout; a last partial one is canonical
  int64_t chunks;    // K / 64
  int dedupe;        // gather: slots that share an expert form one segment
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

// The four A registers of k-step S from the lane's unit `w` (BITS words):
// register j holds codes S*8 + j (low half) and S*8 + 4 + j (high half).
template <class C, bool F16, bool FOLD, int S, int J>
__device__ __forceinline__ uint32_t a_reg(const uint32_t* w) {
  constexpr int BITS = C::kBits;
  if constexpr (C::kFmt == kAffine && BITS == 4) {
    const uint32_t v = (shl<-4 * J>(w[S]) & 0x000f000fu) | (F16 ? 0x64006400u : 0x43004300u);
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

// acc += scale * q (+ bias' * xs) for one row, the scale kinds of apply_scale in qmv_impl.h.
template <class C>
__device__ __forceinline__ void scale_into(float& acc, float q, float xs, uint32_t sraw,
                                           uint32_t braw, int32_t sdt, float gsv, float magic) {
  if constexpr (C::kFmt == kAffine) {
    const float s = raw_to_float(sraw, sdt);
    acc = fmaf(q, s, acc);
    acc = fmaf(fmaf(-magic, s, raw_to_float(braw, sdt)), xs, acc);
  } else if constexpr (C::kScale == kScaleE8M0) {
    if (sraw == 255u) {
      acc = quiet_nan();
    } else {
      const int32_t n = (int32_t)sraw - 127;
      if (n >= -126) {
        acc = fmaf(q, exp2i_normal(n), acc);
      } else {
        const int32_t half = n >> 1;
        acc = acc + q * exp2i_normal(half) * exp2i_normal(n - half);
      }
    }
  } else if constexpr (C::kScale == kScaleE4M3) {
    acc = fmaf(q, scale_e4m3((uint8_t)sraw) * gsv, acc);
  } else {
    acc = fmaf(q, raw_to_float(sraw, sdt), acc);
  }
}

// B registers (x) of one k-step for column m of the lane: k = k0 .. k0 + 3.
template <int XDT>
__device__ __forceinline__ void load_b(const void* xrow, int64_t k0, uint32_t* b) {
  if constexpr (XDT == kF32) {
    const float4 v = JQ_LDG(reinterpret_cast<const float4*>(static_cast<const float*>(xrow) + k0));
    // x = hi + lo, both bf16: the MMA sees ~16 significant bits of float32 x
    const uint32_t h0 = pack_bf16x2(v.x, v.y), h1 = pack_bf16x2(v.z, v.w);
    b[0] = h0;
    b[1] = h1;
    b[2] = pack_bf16x2(v.x - bits_to_f32(h0 << 16), v.y - bits_to_f32(h0 & 0xffff0000u));
    b[3] = pack_bf16x2(v.z - bits_to_f32(h1 << 16), v.w - bits_to_f32(h1 & 0xffff0000u));
  } else {
    const uint2 v = JQ_LDG(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(xrow) + k0));
    b[0] = v.x;
    b[1] = v.y;
  }
}

// The warp's share of one tile: acc[nt][i] (C fragment layout) over its chunks.
// TAIL: the partial last tile, read from its canonical rows (kept out of the
// hot loop's code).
template <class C, int XDT, int NT, int P, int U, bool TAIL>
__device__ __forceinline__ void accumulate_tile(const Problem& pr, int64_t e, int64_t tile,
                                                int mcount, const int64_t* xrow_s,
                                                float (&acc)[NT][4]) {
  constexpr int BITS = C::kBits;
  constexpr bool F16 = XDT == kF16;
  constexpr int NB = XDT == kF32 ? 4 : 2;
  constexpr float MAGIC = AffineMagic<C, XDT>::value;
  constexpr bool FOLD = MAGIC != 0.0f;
  constexpr uint32_t ONES = F16 ? 0x3c003c00u : 0x3f803f80u;
  const QmvProblem& p = pr.q;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int esz = XDT == kF32 ? 4 : 2;
  const char* xcol[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = g + 8 * nt;
    xcol[nt] = m < mcount ? static_cast<const char*>(p.x) + xrow_s[m] * p.K * esz : nullptr;
  }
  const uint32_t* wexp = p.data + e * p.N * p.words;
  const uint32_t* wtile = wexp + tile * kTileRows * p.words;
  const int valid_rows = (int)(p.N - tile * kTileRows);
  const int ssz = p.scale_dt == kU8 ? 1 : (p.scale_dt == kF32 ? 4 : 2);
  const char* sexp = static_cast<const char*>(p.scales) + e * p.N * p.groups * ssz;
  const char* bexp = p.biases ? static_cast<const char*>(p.biases) + e * p.N * p.groups * ssz
                              : nullptr;
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  constexpr int steps_per_piece = 4 / P;  // P groups per chunk (1 for group >= 64)

  for (int64_t c0 = warp; c0 < pr.chunks; c0 += (int64_t)warps * U) {
    uint32_t w[U][BITS];
    uint32_t b[U][4][NT][NB];
    uint32_t sc[U][P][2][2];  // [chunk][group piece][scale, bias][row g, row g + 8]
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + (int64_t)u * warps;
#pragma unroll
      for (int pc = 0; pc < P; ++pc)
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[u][pc][i >> 1][i & 1] = 0u;
      if (c < pr.chunks) {
#pragma unroll
        for (int pc = 0; pc < P; ++pc) {
          const int64_t gi = (c * kChunkK + pc * steps_per_piece * 16) / p.group;
          if constexpr (!TAIL) {
            const int64_t pair = (tile * p.groups + gi) * 8 + g;
            load_scale_pair(sexp, pair, p.scale_dt, sc[u][pc][0]);
            if constexpr (C::kFmt == kAffine) load_scale_pair(bexp, pair, p.scale_dt, sc[u][pc][1]);
          } else {
            const int64_t row0 = tile * kTileRows;  // canonical [N, G] rows
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = g + 8 * h;
              if (r < valid_rows) {
                sc[u][pc][0][h] = load_raw(sexp, (row0 + r) * p.groups + gi, p.scale_dt);
                if constexpr (C::kFmt == kAffine)
                  sc[u][pc][1][h] = load_raw(bexp, (row0 + r) * p.groups + gi, p.scale_dt);
              }
            }
          }
        }
        if constexpr (!TAIL) {
          load_unit<BITS>(wtile + (c * 32 + lane) * BITS, w[u]);
        } else {
          tail_unit<BITS>(wtile, p.words, valid_rows, c, lane, w[u]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < BITS; ++i) w[u][i] = 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + (int64_t)u * warps;
#pragma unroll
      for (int st = 0; st < 4; ++st)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (c < pr.chunks && xcol[nt] != nullptr) {
            load_b<XDT>(xcol[nt], c * kChunkK + 16 * st + 4 * t, b[u][st][nt]);
          } else {
#pragma unroll
            for (int i = 0; i < NB; ++i) b[u][st][nt][i] = 0u;
          }
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + (int64_t)u * warps;
      if (c >= pr.chunks) break;
      uint32_t a[4][4];
      a_regs<C, F16, FOLD, 0>(w[u], a[0]);
      a_regs<C, F16, FOLD, 1>(w[u], a[1]);
      a_regs<C, F16, FOLD, 2>(w[u], a[2]);
      a_regs<C, F16, FOLD, 3>(w[u], a[3]);
#pragma unroll
      for (int pc = 0; pc < P; ++pc) {
        const uint32_t* sraw = sc[u][pc][0];
        const uint32_t* braw = sc[u][pc][1];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float q[4] = {0.0f, 0.0f, 0.0f, 0.0f}, xs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int st = 0; st < 4; ++st) {
            if (st / steps_per_piece != pc) continue;
            mma16816<F16>(q, a[st], b[u][st][nt][0], b[u][st][nt][1]);
            if constexpr (XDT == kF32) mma16816<F16>(q, a[st], b[u][st][nt][2], b[u][st][nt][3]);
            if constexpr (C::kFmt == kAffine) {
              const uint32_t ones[4] = {ONES, ONES, ONES, ONES};
              mma16816<F16>(xs, ones, b[u][st][nt][0], b[u][st][nt][1]);
              if constexpr (XDT == kF32)
                mma16816<F16>(xs, ones, b[u][st][nt][2], b[u][st][nt][3]);
            }
          }
#pragma unroll
          for (int i = 0; i < 4; ++i)
            scale_into<C>(acc[nt][i], q[i], xs[i], sraw[i >> 1], braw[i >> 1], p.scale_dt, gsv,
                          MAGIC);
        }
      }
    }
  }
}

template <class C, int XDT, int NT, int P, int U>
__global__ void __launch_bounds__(256) qmv_mma_kernel(Problem pr) {
  constexpr int CAP = 8 * NT;  // rows of x per segment
  const QmvProblem& p = pr.q;

  __shared__ int64_t xrow_s[16], yrow_s[16];
  __shared__ int mcount_s;
  __shared__ float red[kMaxWarps][kTileRows][16];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t tile = blockIdx.x;
  const int64_t s = blockIdx.y;

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

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;

  if (valid) {
    if (tile < pr.full_tiles)
      accumulate_tile<C, XDT, NT, P, U, false>(pr, e, tile, mcount, xrow_s, acc);
    else
      accumulate_tile<C, XDT, NT, P, U, true>(pr, e, tile, mcount, xrow_s, acc);
  }

  // --- the warps' partial sums meet in shared memory ------------------------
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][g + 8 * (i >> 1)][8 * nt + 2 * t + (i & 1)] = acc[nt][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTileRows * mcount; idx += blockDim.x) {
    const int r = idx % kTileRows, m = idx / kTileRows;
    const int64_t n = tile * kTileRows + r;
    if (n >= p.N) continue;
    float v = 0.0f;
    for (int wi = 0; wi < warps; ++wi) v += red[wi][r][m];
    store_out(p.y, yrow_s[m] * p.N + n, p.x_dt, valid ? v : quiet_nan());
  }
}

// Warps per block (split K): a function of K only, so that one output
// element's float ops do not depend on M, the slot or N (gather_qmm == qmm
// bit for bit on this kernel too).
inline int warps_for(int64_t chunks) {
  if (chunks >= 128) return 8;
  if (chunks >= 16) return 4;
  return chunks >= 4 ? 2 : 1;
}

template <class C, int XDT, int NT, int P>
static hipError_t launch_p(const Problem& pr, hipStream_t stream) {
  constexpr int BITS = C::kBits;
  constexpr int U = (XDT == kF32 || NT == 2) ? 2 : (BITS <= 4 ? 4 : 2);
  const int warps = warps_for(pr.chunks);
  dim3 grid((unsigned)pr.tiles, (unsigned)pr.q.S, 1), block((unsigned)(32 * warps));
  qmv_mma_kernel<C, XDT, NT, P, U><<<grid, block, 0, stream>>>(pr);
  return hipGetLastError();
}

// Groups per chunk: only the group sizes each format allows are instantiated.
template <class C, int XDT, int NT>
static hipError_t launch_nt(const Problem& pr, hipStream_t stream) {
  const int g = pr.q.group;
  if constexpr (C::kFmt == kAffine) {
    return g == 32 ? launch_p<C, XDT, NT, 2>(pr, stream) : launch_p<C, XDT, NT, 1>(pr, stream);
  } else if constexpr (C::kFmt == kNvfp4) {
    return launch_p<C, XDT, NT, 4>(pr, stream);
  } else if constexpr (C::kFmt == kFp4) {
    return g == 16 ? launch_p<C, XDT, NT, 4>(pr, stream)
                   : g == 32 ? launch_p<C, XDT, NT, 2>(pr, stream)
                             : launch_p<C, XDT, NT, 1>(pr, stream);
  } else {
    return launch_p<C, XDT, NT, 2>(pr, stream);  // MX: group 32
  }
}

template <class C, int XDT>
static hipError_t launch_c(const Problem& pr, int nt, hipStream_t stream) {
  return nt == 1 ? launch_nt<C, XDT, 1>(pr, stream) : launch_nt<C, XDT, 2>(pr, stream);
}

// Every format for activations of dtype XDT (one translation unit per XDT).
template <int XDT>
static hipError_t launch_formats(const Problem& pr, int nt, hipStream_t stream) {
  const QmvProblem& p = pr.q;
  switch (p.fmt) {
    case kAffine:
      switch (p.bits) {
#if !defined(JQ_MMA_CHECK_ONLY)  // compile checks build the 4-bit kernels only
        case 2: return launch_c<Codec<kAffine, 2>, XDT>(pr, nt, stream);
        case 3: return launch_c<Codec<kAffine, 3>, XDT>(pr, nt, stream);
        case 5: return launch_c<Codec<kAffine, 5>, XDT>(pr, nt, stream);
        case 6: return launch_c<Codec<kAffine, 6>, XDT>(pr, nt, stream);
        case 8: return launch_c<Codec<kAffine, 8>, XDT>(pr, nt, stream);
#endif
        default: return launch_c<Codec<kAffine, 4>, XDT>(pr, nt, stream);
      }
#if !defined(JQ_MMA_CHECK_ONLY)
    case kMxfp6E2M3: return launch_c<Codec<kMxfp6E2M3, 6>, XDT>(pr, nt, stream);
    case kMxfp6E3M2: return launch_c<Codec<kMxfp6E3M2, 6>, XDT>(pr, nt, stream);
    case kMxfp8E4M3: return launch_c<Codec<kMxfp8E4M3, 8>, XDT>(pr, nt, stream);
    case kMxfp8E5M2: return launch_c<Codec<kMxfp8E5M2, 8>, XDT>(pr, nt, stream);
    case kNvfp4: return launch_c<Codec<kNvfp4, 4>, XDT>(pr, nt, stream);
    case kFp4: return launch_c<Codec<kFp4, 4>, XDT>(pr, nt, stream);
#endif
    default: return launch_c<Codec<kMxfp4, 4>, XDT>(pr, nt, stream);
  }
}

hipError_t launch_qmv_mma_bf16(const Problem& pr, int nt, hipStream_t stream);
hipError_t launch_qmv_mma_f16(const Problem& pr, int nt, hipStream_t stream);
hipError_t launch_qmv_mma_f32(const Problem& pr, int nt, hipStream_t stream);

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif  // JQ_PLATFORM_CUDA

