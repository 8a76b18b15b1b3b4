// The one portability header of gpu_src/: kernels are written with HIP
// spellings; nvcc (CUDA) and clang/hipcc (ROCm) compile the same files.
//
//   JQ_WARP            warp/wavefront size in device code: 32 on NVIDIA and
//                      RDNA (gfx10+, wave32), 64 on CDNA/GCN (gfx9: gfx90a,
//                      gfx942, gfx950). Host code asks the device instead
//                      (jq_device_warp_size()).
//   jq_shfl_xor        a warp-wide butterfly shuffle
//   jq_h2f / jq_f2h    float16 <-> float32 with the hardware converts
//   hipStream_t, hipError_t, hipGetLastError, ... on CUDA map to cuda*.
//
// Define JQ_HIP_NOGPULIB when compiling for ROCm with -nogpulib (no ROCm
// device libraries: CI's compile checks with Debian's clang + HIP 5.2
// headers): this header then supplies the few __ockl_* / fence helpers
// those headers call, from clang builtins.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) && !defined(__HIP__)
// ------------------------------------------------------------------ CUDA (nvcc)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define JQ_PLATFORM_CUDA 1
typedef cudaStream_t hipStream_t;
typedef cudaError_t hipError_t;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipGetLastError cudaGetLastError
#define hipGetErrorString cudaGetErrorString
#define hipGetDevice cudaGetDevice
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define hipDeviceAttributeWarpSize cudaDevAttrWarpSize
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipMemcpy cudaMemcpy
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipDeviceSynchronize cudaDeviceSynchronize
#define JQ_WARP 32
template <class T>
__device__ __forceinline__ T jq_shfl_xor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
__device__ __forceinline__ float jq_h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t jq_f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float jq_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float jq_exp(float x) { return __expf(x); }
#define JQ_LDG(p) __ldg(p)

#else
// ------------------------------------------------------------------ ROCm (clang -x hip, hipcc)
#include <hip/hip_runtime.h>
#define JQ_PLATFORM_ROCM 1
#if defined(__HIP_DEVICE_COMPILE__)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define JQ_WARP __AMDGCN_WAVEFRONT_SIZE
#elif defined(__GFX9__)
#define JQ_WARP 64
#else
#define JQ_WARP 32
#endif
#else
#define JQ_WARP 64  // host pass: kernels are parsed, not generated; host code asks the device
#endif
template <class T>
__device__ __forceinline__ T jq_shfl_xor(T v, int lane_mask) {
  return __shfl_xor(v, lane_mask, JQ_WARP);
}
__device__ __forceinline__ float jq_h2f(uint16_t h) {
  return (float)__builtin_bit_cast(_Float16, h);
}
__device__ __forceinline__ uint16_t jq_f2h(float f) {
  return __builtin_bit_cast(uint16_t, (_Float16)f);
}
#if defined(JQ_HIP_NOGPULIB)
__device__ __forceinline__ float jq_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }
__device__ __forceinline__ float jq_exp(float x) {
  return __builtin_amdgcn_exp2f(x * 1.4426950408889634f);
}
#else
__device__ __forceinline__ float jq_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float jq_exp(float x) { return __expf(x); }
#endif
#define JQ_LDG(p) (*(p))

#if defined(JQ_HIP_NOGPULIB) && defined(__HIP_DEVICE_COMPILE__)
// What hip.amdgcn.bc / ockl would provide; only the calls HIP 5.2's headers make.
extern "C" __device__ __attribute__((const)) size_t __ockl_get_local_id(uint32_t d) {
  return d == 0 ? __builtin_amdgcn_workitem_id_x()
                : d == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z();
}
extern "C" __device__ __attribute__((const)) size_t __ockl_get_group_id(uint32_t d) {
  return d == 0 ? __builtin_amdgcn_workgroup_id_x()
                : d == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z();
}
extern "C" __device__ __attribute__((const)) size_t __ockl_get_local_size(uint32_t d) {
  // hsa_kernel_dispatch_packet_t: workgroup_size_{x,y,z} are u16 at byte offsets 4, 6, 8.
  const uint16_t* p = (const uint16_t*)__builtin_amdgcn_dispatch_ptr();
  return p[2 + d];
}
extern "C" __device__ __attribute__((const)) size_t __ockl_get_num_groups(uint32_t d) {
  // grid_size_{x,y,z} are u32 at byte offsets 12, 16, 20 (in work-items).
  const uint16_t* p16 = (const uint16_t*)__builtin_amdgcn_dispatch_ptr();
  const uint32_t* p32 = (const uint32_t*)__builtin_amdgcn_dispatch_ptr();
  const uint32_t wg = p16[2 + d];
  return (p32[3 + d] + wg - 1) / wg;
}
extern "C" __device__ void __atomic_work_item_fence(__cl_mem_fence_flags flags,
                                                    __memory_order order, __memory_scope scope) {
  (void)flags;
  (void)scope;
  if (order == __ATOMIC_ACQUIRE)
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
  else if (order == __ATOMIC_RELEASE)
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  else
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
}
#endif  // JQ_HIP_NOGPULIB
#endif  // CUDA / ROCm

// Host: the warp size of the current device (cached per device).
int jq_device_warp_size();
int jq_device_sm_count();

// Launch `expr` (a hipError_t) and turn a failure into an ffi::Error.
#define JQ_LAUNCH_CHECK(expr, what)                                                   \
  do {                                                                                \
    hipError_t jq_err = (expr);                                                       \
    if (jq_err == hipSuccess) jq_err = hipGetLastError();                             \
    if (jq_err != hipSuccess)                                                         \
      return ::xla::ffi::Error::Internal(std::string("jaxquant ffi: launching ") +    \
                                         (what) + " failed: " +                        \
                                         hipGetErrorString(jq_err));                  \
  } while (0)

#if defined(JQ_PLATFORM_ROCM) && defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX9__)
static_assert(JQ_WARP == 64, "CDNA/GCN (gfx9) runs wave64");
#elif defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__)
static_assert(JQ_WARP == 32, "RDNA (gfx10+) runs wave32 by default");
#endif
#endif
