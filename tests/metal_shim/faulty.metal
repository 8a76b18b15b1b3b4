// Kernels that are wrong on a GPU, to show that the shim fails them (tests/test_metal.py).
#include "jq_metal.h"

namespace jq_faulty {

// threadgroup_barrier inside a branch only the first simdgroup takes: a GPU hangs or
// misbehaves; the shim reports the barrier not every thread reached.
template <typename T>
kernel void divergent_barrier(device T* out [[buffer(0)]], constant uint& unused [[buffer(1)]],
                              JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  if (simd == 0u) {
    scratch[lane] = float(lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// simd_sum reached by half of the lanes of a simdgroup.
template <typename T>
kernel void divergent_simd_sum(device T* out [[buffer(0)]], constant uint& unused [[buffer(1)]],
                               JQ_THREAD_IDS) {
  float v = 1.0f;
  if (lane < 16u) v = simd_sum(v);
  out[tid] = v;
}

// A threadgroup reduction whose slot reads lack the barrier after the writes: the sum
// depends on thread timing (a race); with the barrier it is always `threads`.
template <typename T>
kernel void racy_sum(device T* out [[buffer(0)]], constant uint& with_barrier [[buffer(1)]],
                     JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  const float s = simd_sum(1.0f);
  if (lane == 0u) scratch[simd] = s;
  if (with_barrier != 0u) threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < threads / 32u; ++i) total += scratch[i];
  if (with_barrier != 0u) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0u) scratch[simd] = 0.0f;  // reset for the next threadgroup
  out[tgid.x * threads + tid] = total;
}

JQ_KERNEL("faulty_divergent_barrier", divergent_barrier<float>)
JQ_KERNEL("faulty_divergent_simd_sum", divergent_simd_sum<float>)
JQ_KERNEL("faulty_racy_sum", racy_sum<float>)

}  // namespace jq_faulty
