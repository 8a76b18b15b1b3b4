// The Hopper prefill GEMM (qmm_wgmma.h) for every format and 16-bit x. Built for
// sm_90a alone (wgmma is an sm_90a feature; CMakeLists.txt gives this file its own
// architecture list), so the handler checks the device before it launches.
// Compiled once per launcher and rows of x per block (JQ_WGMMA_PART = 1..12: affine
// bf16, float bf16, affine f16, float f16, each for BN = 64, 128, 256; part 1 also
// holds wgmma_usable, the tensor maps and the launchers that pick the BN), as the GEMV
// files are per JQ_MMA_PART: the whole file was the build's longest compile (139 s on
// the 2-core machine under load), and one part per launcher took 125 s of the 16-core
// machine's 148 s build once BN = 64 came. Part 13 is ragged_matmul's GEMM on float
// experts. Without JQ_WGMMA_PART it defines all.
#include <stdlib.h>
#include <string.h>

#include <cudaTypedefs.h>

#include "qmm_wgmma.h"
#if !defined(JQ_WGMMA_PART) || JQ_WGMMA_PART == 13
#include "ragged_matmul_wgmma.h"
#endif

#if defined(JQ_PLATFORM_CUDA)
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(JQ_NO_WGMMA)
#error "qmm_wgmma.hip is built for sm_90a only"
#endif

namespace jq {
namespace gpu {
namespace mma {

#if defined(JQ_WGMMA_PART)
#define JQ_WGMMA_BUILDS(part) (JQ_WGMMA_PART == (part))
#else
#define JQ_WGMMA_BUILDS(part) 1
#endif

#if defined(JQ_NO_WGMMA)  // nvcc < 12: no sm_90a
#if JQ_WGMMA_BUILDS(1)
bool wgmma_usable() { return false; }
hipError_t launch_qmm_wgmma_affine_bf16(const GemmProblem&, hipStream_t) { return hipErrorInvalidValue; }
hipError_t launch_qmm_wgmma_float_bf16(const GemmProblem&, hipStream_t) { return hipErrorInvalidValue; }
hipError_t launch_qmm_wgmma_affine_f16(const GemmProblem&, hipStream_t) { return hipErrorInvalidValue; }
hipError_t launch_qmm_wgmma_float_f16(const GemmProblem&, hipStream_t) { return hipErrorInvalidValue; }
hipError_t launch_ragged_matmul_wgmma(const GemmProblem&, hipStream_t) { return hipErrorInvalidValue; }
#endif
#else
#if JQ_WGMMA_BUILDS(1)
bool wgmma_usable() {
  static const bool usable = [] {
    const char* env = getenv("JAXQUANT_GEMM_KERNEL");
    if (env != nullptr && strcmp(env, "mma") == 0) return false;
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return false;
    return major == 9 && minor == 0;
  }();
  return usable;
}

// the driver's tensor-map encoder, through the runtime (no link to libcuda)
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return (PFN_cuTensorMapEncodeTiled_v12000) nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major [rows, K] matrix of 16-bit floats as boxes of box_rows x 64 k,
// 128-byte swizzled (the wgmma operands' shared-memory layout)
static bool matrix16_map(const void* base, int64_t K, int64_t rows, int box_rows, bool f16,
                         CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
  const cuuint32_t box[2] = {(cuuint32_t)kChunkK, (cuuint32_t)box_rows};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool x_tensor_map(const GemmProblem& pr, int bn, bool f16, CUtensorMap* map) {
  return matrix16_map(pr.q.x, pr.q.K, pr.q.Sx * pr.q.M, bn, f16, map);
}

bool float_weight_map(const GemmProblem& pr, bool f16, CUtensorMap* map) {
  return matrix16_map(pr.q.data, pr.q.K, pr.q.E * pr.q.N, kWgRows, f16, map);
}

bool wgmma_piece_maps(const GemmProblem& pr, int bits, int scale_bytes, CUtensorMap* w,
                      CUtensorMap* s, CUtensorMap* b) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const QmvProblem& q = pr.q;
  const int64_t experts = q.E > 0 ? q.E : 1;
  const cuuint64_t tiles = (cuuint64_t)(experts * q.N / kTileRows);
  auto map = [&](CUtensorMap* m, const void* base, CUtensorMapDataType dt, int64_t elem_bytes,
                 int64_t row_bytes, int box_bytes) {
    const cuuint64_t dims[2] = {(cuuint64_t)(row_bytes / elem_bytes), tiles};
    const cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t box[2] = {(cuuint32_t)(box_bytes / elem_bytes), (cuuint32_t)kWgWarps};
    const cuuint32_t elem[2] = {1, 1};
    return encode(m, dt, 2, const_cast<void*>(base), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  const int ssz = dtype_bytes(q.scale_dt);
  const int64_t scale_row = q.groups * kTileRows * ssz;
  return map(w, q.data, CU_TENSOR_MAP_DATA_TYPE_UINT32, 4, kTileRows * q.words * 4, 128 * bits) &&
         map(s, q.scales, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, scale_row, scale_bytes) &&
         map(b, q.biases ? q.biases : q.scales, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, scale_row,
             scale_bytes);
}
#endif

// launch_qmm_wgmma_<family>_<dtype>_bn<BN>: one launcher's kernels for one BN (part
// 3 * launcher + BN's index + 1); launch_qmm_wgmma_<family>_<dtype> picks by pr.block_m.
#define JQ_WG_LAUNCH_BN(FAMILY, DT, BN) \
  hipError_t launch_qmm_wgmma_##FAMILY##_##DT##_bn##BN(const GemmProblem& pr, hipStream_t stream)
#define JQ_WG_LAUNCHER(FAMILY, DT)                                               \
  JQ_WG_LAUNCH_BN(FAMILY, DT, 64);                                               \
  JQ_WG_LAUNCH_BN(FAMILY, DT, 128);                                              \
  JQ_WG_LAUNCH_BN(FAMILY, DT, 256);                                              \
  hipError_t launch_qmm_wgmma_##FAMILY##_##DT(const GemmProblem& pr, hipStream_t stream) { \
    return pr.block_m == 64    ? launch_qmm_wgmma_##FAMILY##_##DT##_bn64(pr, stream)  \
           : pr.block_m == 256 ? launch_qmm_wgmma_##FAMILY##_##DT##_bn256(pr, stream) \
                               : launch_qmm_wgmma_##FAMILY##_##DT##_bn128(pr, stream); \
  }
#define JQ_WG_PART(FAMILY, DT, XDT, FORMATS, BN)                      \
  JQ_WG_LAUNCH_BN(FAMILY, DT, BN) {                                   \
    return launch_formats<WgmmaLaunch<BN>, XDT, FORMATS>(pr, 1, stream); \
  }

#if JQ_WGMMA_BUILDS(1)
JQ_WG_LAUNCHER(affine, bf16)
JQ_WG_LAUNCHER(float, bf16)
JQ_WG_LAUNCHER(affine, f16)
JQ_WG_LAUNCHER(float, f16)
JQ_WG_PART(affine, bf16, kBF16, kAffineFormats, 64)
#endif
#if JQ_WGMMA_BUILDS(2)
JQ_WG_PART(affine, bf16, kBF16, kAffineFormats, 128)
#endif
#if JQ_WGMMA_BUILDS(3)
JQ_WG_PART(affine, bf16, kBF16, kAffineFormats, 256)
#endif
#if JQ_WGMMA_BUILDS(4)
JQ_WG_PART(float, bf16, kBF16, kFloatFormats, 64)
#endif
#if JQ_WGMMA_BUILDS(5)
JQ_WG_PART(float, bf16, kBF16, kFloatFormats, 128)
#endif
#if JQ_WGMMA_BUILDS(6)
JQ_WG_PART(float, bf16, kBF16, kFloatFormats, 256)
#endif
#if JQ_WGMMA_BUILDS(7)
JQ_WG_PART(affine, f16, kF16, kAffineFormats, 64)
#endif
#if JQ_WGMMA_BUILDS(8)
JQ_WG_PART(affine, f16, kF16, kAffineFormats, 128)
#endif
#if JQ_WGMMA_BUILDS(9)
JQ_WG_PART(affine, f16, kF16, kAffineFormats, 256)
#endif
#if JQ_WGMMA_BUILDS(10)
JQ_WG_PART(float, f16, kF16, kFloatFormats, 64)
#endif
#if JQ_WGMMA_BUILDS(11)
JQ_WG_PART(float, f16, kF16, kFloatFormats, 128)
#endif
#if JQ_WGMMA_BUILDS(12)
JQ_WG_PART(float, f16, kF16, kFloatFormats, 256)
#endif
#if JQ_WGMMA_BUILDS(13)
hipError_t launch_ragged_matmul_wgmma(const GemmProblem& pr, hipStream_t stream) {
  return pr.q.x_dt == kF16 ? launch_ragged_matmul_bn<kF16, 128>(pr, stream)
                           : launch_ragged_matmul_bn<kBF16, 128>(pr, stream);
}
#endif
#undef JQ_WG_PART
#undef JQ_WG_LAUNCHER
#undef JQ_WG_LAUNCH_BN
#endif  // JQ_NO_WGMMA

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
