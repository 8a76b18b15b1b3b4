// Dequantize: [..., N, K] codes -> values in T, one thread per uint32 pack (8 codes).
// mxfp4 is exact, float32 subnormals included (E2M1 x 2^(e-127) built from bits, so no
// subnormal arithmetic is involved; E8M0 255 makes the whole block of 32 NaN); affine
// int4 is fma(q, scale, bias) in float32 and fp4 is e2m1 * scale in float32, as the
// reference computes them.
//
// Grid: ceil(rows * k / 8 / threads) threadgroups of `threads` (256) threads.
#include "jq_metal.h"

namespace jq {

template <typename T, uint F>
kernel void dequantize(device const uint* w [[buffer(0)]],
                       device const uchar* scales_raw [[buffer(1)]],
                       device const T* biases [[buffer(2)]],
                       device T* out [[buffer(3)]],
                       constant DequantParams& p [[buffer(4)]],
                       JQ_THREAD_IDS) {
  const ulong pack = ulong(tgid.x) * threads + tid;
  const uint packs_per_row = p.k / 8u;
  if (pack >= ulong(p.rows) * packs_per_row) return;
  const ulong row = pack / packs_per_row;
  const uint k0 = uint(pack % packs_per_row) * 8u;
  const ulong g = row * (p.k / p.group_size) + k0 / p.group_size;
  float v[8];
  dequant_pack<T, F>(w[pack], scales_raw, biases, g, v);
  device T* y = out + pack * 8u;
  for (uint j = 0; j < 8; ++j) y[j] = T(v[j]);
}

#define JQ_DEQ(T, tname, F, fname) JQ_KERNEL("jq_dequantize_" fname "_" tname, dequantize<T, F>)
#define JQ_DEQ_ALL(F, fname)           \
  JQ_DEQ(float, "float32", F, fname)   \
  JQ_DEQ(half, "float16", F, fname)    \
  JQ_DEQ(bfloat, "bfloat16", F, fname)
JQ_DEQ_ALL(kAffine4, "affine4")
JQ_DEQ_ALL(kMxfp4, "mxfp4")
JQ_DEQ_ALL(kFp4, "fp4")

}  // namespace jq
