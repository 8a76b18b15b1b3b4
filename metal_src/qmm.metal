// Quantized GEMM y[b] = x[b] @ dequantize(W[b]).T for qmm with more than 8 rows of x
// (the GEMV, gemv.metal, takes the rest): fp4 (scale-only), affine int4, mxfp4.
//
// Geometry of the MetalTile fp4 qmm (seed), on simdgroup matrices instead of the MPP
// tensor ops (qmm_nax.metal has those): 128 threads = 4 simdgroups in a 2 x 2 grid, a
// 32 x 32 output tile per threadgroup (BM = BN = BK = 32), each simdgroup a 16 x 16
// sub-tile (2 x 2 simdgroup_float8x8 accumulators). Per K-block every thread stages 8
// elements of an x row and dequantizes one uint32 pack (8 codes) of a W row into
// threadgroup memory (row stride 36 = 32 + 4 skew against bank conflicts). Changed:
// staging is float32 for every dtype (the seed staged bf16 through half, which clips
// |x| > 65504); the edges of M and N are masked, so any M and N work (the seed required
// multiples of 32); every format of dequant_pack, any group size that divides 32-blocks
// into whole packs.
//
// Grid: (ceil(n / 32), ceil(m / 32), batch) threadgroups of 128 threads.
#include "jq_metal.h"

namespace jq {

constant constexpr uint kTile = 32;
constant constexpr uint kStride = 36;

template <typename T, uint F>
kernel void qmm(device const uint* w [[buffer(0)]],
                device const uchar* scales_raw [[buffer(1)]],
                device const T* biases [[buffer(2)]],
                device const T* x [[buffer(3)]],
                device T* out [[buffer(4)]],
                constant QmmParams& p [[buffer(5)]],
                JQ_THREAD_IDS) {
  threadgroup float xs[kTile * kStride];
  threadgroup float ws[kTile * kStride];
  threadgroup float os[4 * 16 * 16];
  const uint n0 = tgid.x * kTile, m0 = tgid.y * kTile, b = tgid.z;
  const uint sm = simd / 2u, sn = simd & 1u;
  const uint r = tid / 4u, quad = tid & 3u;  // the row this thread stages, its 8-column quarter
  const bool x_ok = m0 + r < p.m, w_ok = n0 + r < p.n;
  const ulong x_row = (ulong(b) * p.m + m0 + r) * p.k;
  const ulong w_row = ulong(b) * p.n + n0 + r;
  device const uint* wp = w + w_row * (p.k / 8u);
  const ulong s_row = w_row * (p.k / p.group_size);

  simdgroup_float8x8 acc[2][2];
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint kb = 0; kb < p.k; kb += kTile) {
    const uint k0 = kb + quad * 8u;
    float v[8];
    if (w_ok) {
      dequant_pack<T, F>(wp[k0 / 8u], scales_raw, biases, s_row + k0 / p.group_size, v);
    } else {
      for (uint j = 0; j < 8; ++j) v[j] = 0.0f;
    }
    for (uint j = 0; j < 8; ++j) {
      xs[r * kStride + quad * 8u + j] = x_ok ? float(x[x_row + k0 + j]) : 0.0f;
      ws[r * kStride + quad * 8u + j] = v[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < kTile; kk += 8u) {
      simdgroup_float8x8 a[2], bt[2];
      for (uint i = 0; i < 2; ++i) simdgroup_load(a[i], xs, kStride, ulong2(ulong(kk), ulong(sm * 16u + 8u * i)));
      for (uint j = 0; j < 2; ++j) simdgroup_load(bt[j], ws, kStride, ulong2(ulong(kk), ulong(sn * 16u + 8u * j)), true);
      for (uint i = 0; i < 2; ++i)
        for (uint j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], bt[j], acc[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // xs/ws are rewritten next block
  }
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) simdgroup_store(acc[i][j], os + simd * 256u, 16, ulong2(ulong(8u * j), ulong(8u * i)));
  simdgroup_barrier(mem_flags::mem_threadgroup);  // each simdgroup reads back only its own tile
  const uint o_row = lane / 2u, o_col = (lane & 1u) * 8u;
  const uint m = m0 + sm * 16u + o_row;
  for (uint j = 0; j < 8; ++j) {
    const uint n = n0 + sn * 16u + o_col + j;
    if (m < p.m && n < p.n) out[(ulong(b) * p.m + m) * p.n + n] = T(os[simd * 256u + o_row * 16u + o_col + j]);
  }
}

#define JQ_QMM(T, tname, F, fname) JQ_KERNEL("jq_qmm_" fname "_" tname, qmm<T, F>)
#define JQ_QMM_ALL(F, fname)           \
  JQ_QMM(float, "float32", F, fname)   \
  JQ_QMM(half, "float16", F, fname)    \
  JQ_QMM(bfloat, "bfloat16", F, fname)
JQ_QMM_ALL(kAffine4, "affine4")
JQ_QMM_ALL(kMxfp4, "mxfp4")
JQ_QMM_ALL(kFp4, "fp4")

}  // namespace jq
