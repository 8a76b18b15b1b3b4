// dequantize on the GPU: one thread per unit (32 elements) of a row; the
// values are computed exactly like jaxquant.quantize.dequantize_reference
// (include/jq/codec.h: dequant_value) and stored with 16-byte stores.
#include "gpu_common.h"

namespace jq {
namespace gpu {

template <class C>
__global__ void __launch_bounds__(256) dequant_kernel(DequantProblem p) {
  const int64_t upr = p.k / 32;
  const int64_t total = p.rows * upr;
  int gshift = 0;
  while ((1 << gshift) < p.group) ++gshift;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = t / upr, u = t % upr;
    uint32_t w[C::kBits];
    load_unit<C::kBits>(p.data + row * p.words + u * C::kBits, w);
    const float gsv = p.global_scale ? p.global_scale[p.gs_count > 1 ? row / p.n / p.gs_div : 0]
                                     : 1.0f;
    // the scales of the unit's (at most two) groups
    float s[2] = {1.0f, 1.0f}, b[2] = {0.0f, 0.0f};
    uint32_t sc[2] = {0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t gi = row * p.groups + ((u * 32 + h * 16) >> gshift);
      if constexpr (C::kScale == kScaleFloat) {
        s[h] = raw_to_float(load_raw(p.scales, gi, p.scale_dt), p.scale_dt);
        if constexpr (C::kFmt == kAffine) b[h] = raw_to_float(load_raw(p.biases, gi, p.scale_dt), p.scale_dt);
      } else {
        sc[h] = static_cast<const uint8_t*>(p.scales)[gi];
      }
    }
    float v[32];
#define JQ_DQ(E) v[E] = dequant_value<C>(unit_code<C::kBits, E>(w), s[E / 16], b[E / 16], sc[E / 16], gsv);
    JQ_DQ(0) JQ_DQ(1) JQ_DQ(2) JQ_DQ(3) JQ_DQ(4) JQ_DQ(5) JQ_DQ(6) JQ_DQ(7)
    JQ_DQ(8) JQ_DQ(9) JQ_DQ(10) JQ_DQ(11) JQ_DQ(12) JQ_DQ(13) JQ_DQ(14) JQ_DQ(15)
    JQ_DQ(16) JQ_DQ(17) JQ_DQ(18) JQ_DQ(19) JQ_DQ(20) JQ_DQ(21) JQ_DQ(22) JQ_DQ(23)
    JQ_DQ(24) JQ_DQ(25) JQ_DQ(26) JQ_DQ(27) JQ_DQ(28) JQ_DQ(29) JQ_DQ(30) JQ_DQ(31)
#undef JQ_DQ
    const int64_t off = row * p.k + u * 32;
    if (p.out_dt == kF32) {
      float4* o = reinterpret_cast<float4*>(static_cast<float*>(p.out) + off);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    } else {
      uint32_t h[16];
      if (p.out_dt == kBF16) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
          h[i] = (uint32_t)f32_to_bf16(v[2 * i]) | ((uint32_t)f32_to_bf16(v[2 * i + 1]) << 16);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i)
          h[i] = (uint32_t)jq_f2h(v[2 * i]) | ((uint32_t)jq_f2h(v[2 * i + 1]) << 16);
      }
      uint4* o = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.out) + off);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
    }
  }
}

template <class C>
static hipError_t launch(const DequantProblem& p, hipStream_t stream) {
  const int64_t total = p.rows * (p.k / 32);
  const int threads = 256;
  int64_t blocks = (total + threads - 1) / threads;
  const int64_t cap = (int64_t)jq_device_sm_count() * 32;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  dequant_kernel<C><<<dim3((unsigned)blocks), dim3(threads), 0, stream>>>(p);
  return hipGetLastError();
}

hipError_t launch_dequant(const DequantProblem& p, hipStream_t stream) {
  hipError_t err = hipErrorInvalidValue;
  dispatch_format(p.fmt, p.bits, [&](auto codec) { err = launch<decltype(codec)>(p, stream); });
  return err;
}

}  // namespace gpu
}  // namespace jq
