// The fused dequantize-GEMV (qmm with few rows, batched qmm, gather_qmm).
//
// One warp computes R consecutive weight rows of one slot for MT rows of x.
// Lane l takes the units (32 elements) l, l + W, l + 2W, ... of the row:
// their words arrive with 16-byte loads (U units of all R rows in flight
// before any is used); each unit's partial dot product is taken in float32
// (32 FMAs in element order) and its group's scale applied once (exactly,
// for the power-of-two E8M0 scales; affine adds bias * sum(x)); the lanes'
// sums meet in a butterfly of shuffles. The float ops of one output element
// depend only on K, the format and the warp size, never on M, R, the slot
// or the block, so gather_qmm == qmm (M = 1) bit for bit, and each row of a
// multi-row qmm equals its own M = 1 call.
//
// Slot s reads expert indices[s] (on the device; outside [0, E): a NaN row,
// nothing of the weights read) or s, and x row s / x_div.
#pragma once

#include <utility>

#include "gpu_common.h"

namespace jq {
namespace gpu {

template <class C>
__device__ __forceinline__ void apply_scale(float& acc, float q, float xsum, uint32_t sraw,
                                            uint32_t braw, int32_t sdt, float gsv) {
  if constexpr (C::kFmt == kAffine && C::kBits == 4) {
    // q = sum (1 + code/16) * x (see element<>): scale*code + bias = 16*scale*v + (bias - 16*scale)
    const float s16 = 16.0f * raw_to_float(sraw, sdt);
    acc = fmaf(q, s16, acc);
    acc = fmaf(raw_to_float(braw, sdt) - s16, xsum, acc);
  } else if constexpr (C::kFmt == kAffine) {
    acc = fmaf(q, raw_to_float(sraw, sdt), acc);
    acc = fmaf(raw_to_float(braw, sdt), xsum, acc);
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

// Element E of a unit as a float: the codec's (include/jq/codec.h: a code
// that does not straddle two words is decoded in place, e.g. E2M1 in three
// integer ops and a multiply), except for 4-bit affine, where the element is
// v = 1 + code/16 (see apply_scale).
template <class C, int E>
__device__ __forceinline__ float element(const uint32_t* w) {
  if constexpr (C::kFmt == kAffine && C::kBits == 4) {
    // v = 1 + code/16, exact: the code goes to the top mantissa bits of 1.0f (a shift and
    // one LOP3; no integer-to-float conversion, no subtraction); apply_scale undoes the 1.
    constexpr int i = E % 8;
    const uint32_t x = w[E / 8];
    const uint32_t placed = i <= 4 ? x << (19 - 4 * i) : x >> (4 * i - 19);
    return bits_to_f32((placed & 0x00780000u) | 0x3f800000u);
  } else {
    return C::template unit_element<E>(w);
  }
}

// q + sum_{e in [OFF, OFF+16)} element<E>(w) * xf[e], in element order; the
// element index is a compile-time constant, so the word and shift (and any
// straddle) of each code are resolved by the compiler.
template <class C, int OFF, int... E>
__device__ __forceinline__ float dot16(const uint32_t* w, const float* xf, float q,
                                       std::integer_sequence<int, E...>) {
  // two independent chains (even / odd elements), summed at the end: more
  // instruction-level parallelism, same order for every call
  float a = q, b = 0.0f;
  ((E % 2 == 0 ? (a = fmaf(element<C, OFF + E>(w), xf[OFF + E], a))
               : (b = fmaf(element<C, OFF + E>(w), xf[OFF + E], b))), ...);
  return a + b;
}

template <class C, int MT, int R, int U>
__global__ void __launch_bounds__(256) qmv_kernel(QmvProblem p, int64_t m_tiles) {
  constexpr int W = JQ_WARP;
  constexpr int BITS = C::kBits;
  const int lane = (int)(threadIdx.x % W);
  const int warps = (int)(blockDim.x / W);
  const int64_t warp0 = (int64_t)blockIdx.x * warps + threadIdx.x / W;
  const int64_t units = p.K / 32;
  const int64_t row_groups = (p.N + R - 1) / R;
  const bool g16 = p.group == 16;
  int gshift = 0;  // group sizes are powers of two (16..128)
  while ((1 << gshift) < p.group) ++gshift;
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  const int esz = p.x_dt == kF32 ? 4 : 2;
  const int ssz = dtype_bytes(p.scale_dt);

  for (int64_t s = blockIdx.y; s < p.S; s += gridDim.y) {
    const int64_t e = p.indices ? (int64_t)p.indices[s] : s;
    const bool valid = e >= 0 && e < p.E;
    const uint32_t* wexp = p.data + (valid ? e : 0) * p.N * p.words;
    const int64_t goff = (valid ? e : 0) * p.N * p.groups;
    const char* sexp = static_cast<const char*>(p.scales) + goff * ssz;
    const char* bexp = p.biases ? static_cast<const char*>(p.biases) + goff * ssz : nullptr;
    const char* xslot = static_cast<const char*>(p.x) + (s / p.x_div) * p.M * p.K * esz;
    for (int64_t mt = blockIdx.z; mt < m_tiles; mt += gridDim.z) {
      const int64_t m0 = mt * MT;
      const int mcount = (int)(p.M - m0 < MT ? p.M - m0 : MT);
      for (int64_t rg = warp0; rg < row_groups; rg += (int64_t)gridDim.x * warps) {
        const int64_t n0 = rg * R;
        float acc[MT][R];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
        int64_t rows[R];
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = n0 + r < p.N ? n0 + r : p.N - 1;

        if (valid) {
          for (int64_t u0 = lane; u0 < units; u0 += (int64_t)W * U) {
            // all loads of U units x R rows first
            uint32_t w[U][R][BITS];
            uint32_t sraw[U][R][2], braw[U][R][2];
#pragma unroll
            for (int j = 0; j < U; ++j) {
              const int64_t u = u0 + (int64_t)j * W;
              const bool in = u < units;
#pragma unroll
              for (int r = 0; r < R; ++r) {
                if (in) {
                  load_unit<BITS>(wexp + rows[r] * p.words + u * BITS, w[j][r]);
#pragma unroll
                  for (int h = 0; h < 2; ++h) {
                    sraw[j][r][h] = braw[j][r][h] = 0u;
                    if (h == 1 && !g16) break;  // one group per unit
                    const int64_t gi = rows[r] * p.groups + ((u * 32 + h * 16) >> gshift);
                    sraw[j][r][h] = load_raw(sexp, gi, p.scale_dt);
                    if constexpr (C::kFmt == kAffine) braw[j][r][h] = load_raw(bexp, gi, p.scale_dt);
                  }
                } else {
#pragma unroll
                  for (int i = 0; i < BITS; ++i) w[j][r][i] = 0u;
#pragma unroll
                  for (int h = 0; h < 2; ++h) sraw[j][r][h] = braw[j][r][h] = 0u;
                }
              }
            }
#pragma unroll
            for (int j = 0; j < U; ++j) {
              const int64_t u = u0 + (int64_t)j * W;
              if (u >= units) break;
              float xf[32];
              float xs0 = 0.0f, xs1 = 0.0f;
              if constexpr (MT == 1) {
                load_x32(xslot, m0 * p.K + u * 32, p.x_dt, xf);
                if constexpr (C::kFmt == kAffine) {
#pragma unroll
                  for (int i = 0; i < 16; ++i) xs0 += xf[i];
#pragma unroll
                  for (int i = 16; i < 32; ++i) xs1 += xf[i];
                }
              }
#pragma unroll
              for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                  if constexpr (MT > 1) {
                    if (m >= mcount) break;
                    load_x32(xslot, (m0 + m) * p.K + u * 32, p.x_dt, xf);
                    if constexpr (C::kFmt == kAffine) {
                      xs0 = 0.0f;
                      xs1 = 0.0f;
#pragma unroll
                      for (int i = 0; i < 16; ++i) xs0 += xf[i];
#pragma unroll
                      for (int i = 16; i < 32; ++i) xs1 += xf[i];
                    }
                  }
                  constexpr auto seq = std::make_integer_sequence<int, 16>{};
                  if (g16) {
                    const float q0 = dot16<C, 0>(w[j][r], xf, 0.0f, seq);
                    const float q1 = dot16<C, 16>(w[j][r], xf, 0.0f, seq);
                    apply_scale<C>(acc[m][r], q0, xs0, sraw[j][r][0], braw[j][r][0], p.scale_dt, gsv);
                    apply_scale<C>(acc[m][r], q1, xs1, sraw[j][r][1], braw[j][r][1], p.scale_dt, gsv);
                  } else {
                    float q = dot16<C, 0>(w[j][r], xf, 0.0f, seq);
                    q = dot16<C, 16>(w[j][r], xf, q, seq);  // one chain over all 32
                    apply_scale<C>(acc[m][r], q, xs0 + xs1, sraw[j][r][0], braw[j][r][0],
                                   p.scale_dt, gsv);
                  }
                }
              }
            }
          }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0 && m < mcount && n0 + r < p.N)
              store_out(p.y, (s * p.M + m0 + m) * p.N + n0 + r, p.x_dt, valid ? v : quiet_nan());
          }
        }
      }
    }
  }
}

template <class C>
static hipError_t launch_qmv_codec(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  const int warp = jq_device_warp_size();
  const int threads = c.threads;
  const int warps = threads / warp;
  const int mt = c.mt;
  const int64_t m_tiles = (p.M + mt - 1) / mt;
  const int64_t row_groups = (p.N + c.r - 1) / c.r;
  int64_t bx = (row_groups + warps - 1) / warps;
  if (bx > (int64_t)1 << 30) bx = (int64_t)1 << 30;
  const int64_t by = p.S < 65535 ? p.S : 65535;
  const int64_t bz = m_tiles < 65535 ? m_tiles : 65535;
  dim3 grid((unsigned)bx, (unsigned)by, (unsigned)bz), block((unsigned)threads);
#define JQ_QMV(MT_, R_, U_) \
  qmv_kernel<C, MT_, R_, U_><<<grid, block, 0, stream>>>(p, m_tiles)
  if (mt == 1) {
#if !defined(JQ_QMV_DEFAULT_CONFIGS_ONLY)  // compile checks build the defaults only
    if (c.r == 2) JQ_QMV(1, 2, 2);
    else if (c.r == 1) JQ_QMV(1, 1, 4);
    else
#endif
      JQ_QMV(1, 4, 1);
  } else {
    JQ_QMV(8, 1, 2);
  }
#undef JQ_QMV
  return hipGetLastError();
}

// The GEMV for p's format, among the formats in FORMATS (a mask of format ids:
// gemv_affine.hip and gemv_float.hip each build their share, in parallel).
template <uint32_t FORMATS>
static hipError_t launch_qmv_of(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  hipError_t err = hipErrorInvalidValue;
  dispatch_format<FORMATS>(p.fmt, p.bits, [&](auto codec) {
    err = launch_qmv_codec<decltype(codec)>(p, c, stream);
  });
  return err;
}

}  // namespace gpu
}  // namespace jq
