// Shared MSL helpers of the Metal kernels: element codecs (docs/formats.md:
// E2M1, E8M0, affine), the parameter blocks the bridge (metal_ffi.mm) fills, and the
// threadgroup reduction. Also compiled as C++ by the CPU shim (tests/metal_shim/), so:
// no threadgroup pointers outside kernel bodies except through template parameters.
#pragma once
#include <metal_stdlib>
using namespace metal;

#include "jq_params.h"

// The thread ids every kernel takes, last and in this order (the CPU shim's launcher
// relies on the order).
#define JQ_THREAD_IDS                                                                   \
  uint3 tgid [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]], uint simd [[simdgroup_index_in_threadgroup]], \
      uint threads [[threads_per_threadgroup]]

// JQ_KERNEL("host_name", kernel<T, ...>): instantiate a kernel template under the name the
// bridge looks up. Metal spells that with attributes standard C++ does not allow on an
// explicit instantiation, so off Metal the macro instantiates plainly and registers the
// kernel with the CPU shim's launcher under the same name.
#define JQ_CAT_(a, b) a##b
#define JQ_CAT(a, b) JQ_CAT_(a, b)
#ifdef __METAL_VERSION__
#define JQ_KERNEL(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
#else
#define JQ_KERNEL(name, ...)                       \
  template decltype(__VA_ARGS__) __VA_ARGS__;      \
  static ::jq_shim::Registrar JQ_CAT(jq_registrar_, __COUNTER__)(name, &__VA_ARGS__);
#endif

namespace jq {

using QmmParams = JqQmmParams;
using DequantParams = JqDequantParams;
using NormParams = JqNormParams;

// ---- Element codecs ------------------------------------------------------------------

// E2M1 code (sign bit 3) times 2^exp2, built from bits: exact whenever the result is a
// float32 (normal or subnormal), so no GPU flush of subnormal arithmetic can touch it.
// Magnitudes: code 1 = 0.5 (subnormal), codes 2..7 = (1 + mant/2) * 2^(exp - 1).
METAL_FUNC float e2m1_scaled(uint code, int exp2) {
  uint sign = (code & 8u) << 28;
  uint mag = code & 7u;
  if (mag == 0u) {
    return as_type<float>(sign);
  }
  uint e = mag >> 1;
  uint mant = (e == 0u) ? 0u : (mag & 1u);
  int t = (e == 0u ? -1 : int(e) - 1) + exp2;  // value = (1 + mant/2) * 2^t
  uint bits;
  if (t > 127) {
    bits = 0x7f800000u;  // beyond float32 (6 * 2^127): infinity, as the reference's product
  } else if (t >= -126) {
    bits = uint(t + 127) << 23 | mant << 22;
  } else if (t >= -149) {
    bits = (2u + mant) << uint(t + 148);  // subnormal: (2 + mant) * 2^(t - 1) in units of 2^-149
  } else {
    bits = 0u;  // below float32's range (E2M1 * E8M0 never gets here: t >= -128)
  }
  return as_type<float>(sign | bits);
}

// E2M1 magnitude table (value of codes 0..15), for the matmul inner loops.
METAL_FUNC float e2m1(uint code) {
  return e2m1_scaled(code, 0);
}

// E8M0 scale byte as a power-of-two exponent; 255 is NaN (handled by the callers).
METAL_FUNC int e8m0_exponent(uint e) {
  return int(e) - 127;
}

// 2^(e - 127) as a float32, exactly (e = 0 is the subnormal 2^-127), NaN for e = 255.
METAL_FUNC float e8m0_value(uint e) {
  if (e == 255u) return as_type<float>(0x7fc00000u);
  if (e == 0u) return as_type<float>(0x00400000u);
  return as_type<float>(e << 23);
}

METAL_FUNC float nan_f32() {
  return as_type<float>(0x7fc00000u);
}

// ---- Formats of the quantized matmuls ------------------------------------------------
// Each decodes one uint32 pack (8 consecutive 4-bit codes of a row) given the pack's
// scale (and bias); `dot8` returns sum_i value_i * xs[i] with the group factors applied
// once per pack.

enum Format : uint { kAffine4 = 0, kMxfp4 = 1, kFp4 = 2 };

// The 8 values of pack `bits` (row scale index g) in float32, as dequantize computes them.
template <typename T, uint F>
METAL_FUNC void dequant_pack(uint bits, device const uchar* scales_raw, device const T* biases,
                             ulong g, thread float* v) {
  if (F == kMxfp4) {
    const uint e = scales_raw[g];
    for (uint j = 0; j < 8; ++j) {
      v[j] = e == 255u ? nan_f32() : e2m1_scaled((bits >> (4u * j)) & 15u, e8m0_exponent(e));
    }
  } else {
    const float s = float(((device const T*)scales_raw)[g]);
    const float b = F == kAffine4 ? float(biases[g]) : 0.0f;
    for (uint j = 0; j < 8; ++j) {
      const uint code = (bits >> (4u * j)) & 15u;
      v[j] = F == kAffine4 ? fma(float(code), s, b) : e2m1(code) * s;
    }
  }
}

// ---- Reductions ----------------------------------------------------------------------

// Sum of v over the threadgroup (n_simd simdgroups of 32 lanes): simd_sum per
// simdgroup, one slot per simdgroup in `scratch` (threadgroup float[>= n_simd]), then
// every thread adds the slots in the same order. Every thread of the threadgroup must
// call it (it has barriers). The trailing barrier lets the caller reuse `scratch`.
template <typename Scratch>
METAL_FUNC float threadgroup_sum(float v, Scratch scratch, uint lane, uint simd, uint n_simd) {
  float s = simd_sum(v);
  if (lane == 0u) scratch[simd] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < n_simd; ++i) total += scratch[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

}  // namespace jq
