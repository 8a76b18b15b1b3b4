// Device helpers shared by the gpu_src/ kernels, and the launchers' declarations.
#pragma once

#include <stdint.h>

#include "jq_hip.h"  // first: the runtime's headers
#include "jq/codec.h"
#include "jq/problems.h"

namespace jq {
namespace gpu {

// Kernel choice for the fused GEMV (one place, as data): rows of x per
// tile (MT), weight rows per warp (R), threads per block.
struct QmvConfig {
  int mt, r, threads;
};
QmvConfig qmv_config(const QmvProblem& p);

hipError_t launch_dequant(const DequantProblem& p, hipStream_t stream);
hipError_t launch_qmv_affine(const QmvProblem& p, const QmvConfig& c, hipStream_t stream);
hipError_t launch_qmv_float(const QmvProblem& p, const QmvConfig& c, hipStream_t stream);
hipError_t launch_norm(const NormProblem& p, hipStream_t stream);

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = JQ_WARP / 2; o > 0; o >>= 1) v += jq_shfl_xor(v, o);
  return v;
}

// One load through the read-only path (global memory) or a plain one (shared memory).
template <bool GLOBAL, class T>
__device__ __forceinline__ T load_word(const T* p) {
  if constexpr (GLOBAL) return JQ_LDG(p);
  else return *p;
}

// The `BITS` words of one unit (32 elements) with the widest aligned loads, from
// global memory (GLOBAL) or shared memory.
template <int BITS, bool GLOBAL = true>
__device__ __forceinline__ void load_unit(const uint32_t* p, uint32_t* w) {
  if constexpr (BITS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) {
      const uint4 v = load_word<GLOBAL>(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (BITS % 2 == 0) {
#pragma unroll
    for (int i = 0; i < BITS / 2; ++i) {
      const uint2 v = load_word<GLOBAL>(reinterpret_cast<const uint2*>(p) + i);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) w[i] = load_word<GLOBAL>(p + i);
  }
}

// 32 consecutive activations (16-byte loads) as float32.
__device__ __forceinline__ void load_x32(const void* x, int64_t off, int32_t dt, float* xf) {
  if (dt == kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 v = JQ_LDG(p + i);
      xf[4 * i] = v.x;
      xf[4 * i + 1] = v.y;
      xf[4 * i + 2] = v.z;
      xf[4 * i + 3] = v.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + off);
    uint32_t h[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = JQ_LDG(p + i);
      h[4 * i] = v.x;
      h[4 * i + 1] = v.y;
      h[4 * i + 2] = v.z;
      h[4 * i + 3] = v.w;
    }
    if (dt == kBF16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        xf[2 * i] = bits_to_f32(h[i] << 16);
        xf[2 * i + 1] = bits_to_f32(h[i] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        xf[2 * i] = jq_h2f((uint16_t)(h[i] & 0xffffu));
        xf[2 * i + 1] = jq_h2f((uint16_t)(h[i] >> 16));
      }
    }
  }
}

__device__ __forceinline__ uint32_t load_raw(const void* p, int64_t i, int32_t dt) {
  switch (dt) {
    case kU8: return static_cast<const uint8_t*>(p)[i];
    case kF32: return f32_to_bits(static_cast<const float*>(p)[i]);
    default: return static_cast<const uint16_t*>(p)[i];
  }
}

__device__ __forceinline__ float raw_to_float(uint32_t raw, int32_t dt) {
  switch (dt) {
    case kF32: return bits_to_f32(raw);
    case kBF16: return bits_to_f32(raw << 16);
    default: return jq_h2f((uint16_t)raw);
  }
}

__device__ __forceinline__ void store_out(void* p, int64_t i, int32_t dt, float v) {
  switch (dt) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = jq_f2h(v); break;
  }
}

#endif  // device compiler

}  // namespace gpu
}  // namespace jq
