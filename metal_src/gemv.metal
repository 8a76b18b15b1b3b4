// Fused dequantize-GEMV over stacked experts, for gather_qmm (one slot per routed token
// and expert, the expert id read on the GPU) and qmm with at most 8 rows of x per weight
// matrix. Formats: affine int4, mxfp4 (E8M0 scales), fp4 (scale-only, float scales).
//
// From the MetalTile expert GEMV (seed): one simdgroup of 32 lanes per output row, lanes
// striding along K, the expert id loaded once per row and turned into a row offset, a
// simd_sum at the end. Changed: each lane loads 16 bytes (a uint4: 32 codes, which lie in
// one group for every group size >= 32) instead of 4, the pack's group factors are
// applied once per 8 codes (affine: s * sum(q x) + b * sum(x)), a threadgroup holds
// kRows rows (4 simdgroups), each weight row is read once for all M <= 8 rows of x, and
// an id outside [0, experts) writes a NaN row without reading W (the seed assumed valid ids).
//
// Grid: (ceil(n / kRows), slots, 1) threadgroups of 32 * kRows threads.
#include "jq_metal.h"

namespace jq {

constant constexpr uint kQmvRows = 4;      // output rows (simdgroups) per threadgroup
constant constexpr uint kQmvMaxM = 8;      // rows of x per slot

// Codes of one uint32 pack as floats: the affine integer, or the E2M1 value.
template <uint F>
METAL_FUNC void decode_pack(uint pack, thread float* q) {
  for (uint j = 0; j < 8; ++j) {
    uint code = (pack >> (4u * j)) & 15u;
    q[j] = (F == kAffine4) ? float(code) : e2m1(code);
  }
}

template <typename T, uint F>
kernel void qmv(device const uint* w [[buffer(0)]],
                device const uchar* scales_raw [[buffer(1)]],
                device const T* biases [[buffer(2)]],
                device const T* x [[buffer(3)]],
                device const int* ids [[buffer(4)]],
                device T* out [[buffer(5)]],
                constant QmmParams& p [[buffer(6)]],
                JQ_THREAD_IDS) {
  const uint row = tgid.x * kQmvRows + simd;
  const uint slot = tgid.y;
  if (row >= p.n) return;  // the whole simdgroup leaves together
  device T* y = out + ulong(slot) * p.m * p.n + row;
  const int e = p.has_ids != 0u ? ids[slot] : int(slot);
  if (e < 0 || uint(e) >= p.experts) {
    for (uint mi = lane; mi < p.m; mi += 32u) y[ulong(mi) * p.n] = T(nan_f32());
    return;
  }
  const ulong w_row = ulong(uint(e)) * p.n + row;
  device const uint4* wp = (device const uint4*)(w + w_row * (p.k / 8u));
  const ulong s_row = w_row * (p.k / p.group_size);
  device const T* xs = x + ulong(slot / p.slots_per_x) * p.m * p.k;

  float acc[kQmvMaxM];
  for (uint mi = 0; mi < kQmvMaxM; ++mi) acc[mi] = 0.0f;
  const uint chunks = p.k / 32u;
  for (uint c = lane; c < chunks; c += 32u) {
    const uint4 packs = wp[c];
    float q[32];
    for (uint i = 0; i < 4; ++i) decode_pack<F>(packs[i], q + 8u * i);
    float scale[4], bias[4];
    int exp2 = 0;
    bool nan_block = false;
    if (F == kMxfp4) {
      const uint eb = scales_raw[s_row + c];  // group 32: one scale per chunk
      nan_block = eb == 255u;
      exp2 = e8m0_exponent(eb);
    } else {
      device const T* sc = (device const T*)scales_raw;
      for (uint i = 0; i < 4; ++i) {
        const ulong g = s_row + (32u * c + 8u * i) / p.group_size;
        scale[i] = float(sc[g]);
        bias[i] = F == kAffine4 ? float(biases[g]) : 0.0f;
      }
    }
    for (uint mi = 0; mi < p.m; ++mi) {
      device const vec<T, 4>* xv = (device const vec<T, 4>*)(xs + ulong(mi) * p.k + 32u * c);
      float part = 0.0f;
      for (uint i = 0; i < 4; ++i) {
        const vec<T, 4> xa = xv[2u * i], xb = xv[2u * i + 1u];
        const float xf[8] = {float(xa[0]), float(xa[1]), float(xa[2]), float(xa[3]),
                             float(xb[0]), float(xb[1]), float(xb[2]), float(xb[3])};
        float qx = 0.0f, sx = 0.0f;
        for (uint j = 0; j < 8; ++j) {
          qx = fma(q[8u * i + j], xf[j], qx);
          sx += xf[j];
        }
        if (F == kMxfp4) {
          part += qx;
        } else if (F == kAffine4) {
          part += scale[i] * qx + bias[i] * sx;
        } else {
          part += scale[i] * qx;
        }
      }
      // E8M0: the power of two is applied once per group, exactly unless the product
      // leaves float32's range; 255 makes the block NaN.
      acc[mi] += F == kMxfp4 ? (nan_block ? nan_f32() : ldexp(part, exp2)) : part;
    }
  }
  for (uint mi = 0; mi < p.m; ++mi) {  // uniform trip count: every lane reaches simd_sum
    const float total = simd_sum(acc[mi]);
    if (lane == 0u) y[ulong(mi) * p.n] = T(total);
  }
}

#define JQ_QMV(T, tname, F, fname) JQ_KERNEL("jq_qmv_" fname "_" tname, qmv<T, F>)
#define JQ_QMV_ALL(F, fname)           \
  JQ_QMV(float, "float32", F, fname)   \
  JQ_QMV(half, "float16", F, fname)    \
  JQ_QMV(bfloat, "bfloat16", F, fname)
JQ_QMV_ALL(kAffine4, "affine4")
JQ_QMV_ALL(kMxfp4, "mxfp4")
JQ_QMV_ALL(kFp4, "fp4")

}  // namespace jq
